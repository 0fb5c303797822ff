//! Identifying parameters: what a run computes, pinned per period (`job_params`).
//!
//! A job declares, for each key, the parameters that decide what its runs compute
//! ([`super::Job::params`]; for the fine settlement, the month's fine rule). A run of a period is
//! only meaningful under one set of them: two shards of one month settled under two rules are two
//! different settlements mixed in one table. So the first claim of a period — (job name, business
//! date), whichever shard or shard count claims first — pins its parameters here, in the claim's
//! transaction, and every later claim of the period compares its own with the pinned ones in its
//! transaction: a claim whose parameters differ claims nothing ([`super::ClaimOutcome::Conflict`]).
//!
//! The pinned parameters change only through [`repin`] (a correction), which waits for in-flight
//! claims of the period (they hold the pin's row `FOR SHARE` until they commit) and records the
//! old value. Parameters are JSON objects compared by their identity ([`same_identity`]): every
//! key the claimer states has the same `jsonb` value in the pin (key order does not matter, nor do
//! keys of the pin that the claimer does not state). That is how a pin written by one release is
//! read by another: releases up to 4b79e14 also recorded when the fine rule starts (`from`, not
//! identity) and compared pins exactly; the release at 0d20be2 writes the rule's identity alone
//! (rate, grace, cap) and compares exactly; this one writes what 0d20be2 compares and reads both.
//!
//! A period being corrected is *held* by its correction ([`hold`], in the transaction that
//! re-pins it): until [`release`], in the transaction that completes the correction, every claim
//! of the period but the correction's own finds [`Pin::Correcting`] and claims nothing. So a run,
//! a sweep or a takeover cannot mark a half-corrected month SUCCESS under the new rule with the
//! old fines.

use super::{JobKey, Owner, Result};
use chrono::NaiveDate;
use sqlx::{PgConnection, PgExecutor};

/// A job's identifying parameters for one period: a JSON object.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(transparent)]
pub struct Params(pub serde_json::Value);

impl Params {
    /// The parameters of a job that has none (`{}`).
    pub fn none() -> Self {
        Params(serde_json::json!({}))
    }

    /// No parameters at all (`{}`): nothing to pin or compare, so a claim stores no pin (a daily
    /// job would otherwise add a row a day to `job_params`).
    pub fn is_empty(&self) -> bool {
        self.0.as_object().is_some_and(|o| o.is_empty())
    }
}

/// What a claim found for its period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pin {
    /// No parameters were pinned: this claim pinned its own.
    Pinned,
    /// The pinned parameters are this claim's.
    Same,
    /// The period is pinned to other parameters (these).
    Differs(Params),
    /// The period is held by an unfinished correction (its key, and since when): only that
    /// correction's claims may run it.
    Correcting {
        correction: String,
        since: chrono::DateTime<chrono::Utc>,
    },
}

/// SQL: true when the pin `pinned` holds every key of `mine` with the same `jsonb` value (a key
/// missing from the pin differs from any value, `null` included). Keys of the pin that `mine`
/// does not state are not its identity: releases up to 4b79e14 recorded the fine rule's `from`
/// there.
pub fn same_identity(pinned: &str, mine: &str) -> String {
    format!(
        "NOT EXISTS (SELECT 1 FROM jsonb_each({mine}::jsonb) AS mine(key, value)
                      WHERE ({pinned} -> mine.key) IS DISTINCT FROM mine.value)"
    )
}

/// A pin and a claimer's parameters that differ, each in words, or as JSON when the words are
/// the same (a difference the words do not show, such as a key the job does not describe).
pub fn describe_difference(
    pinned: &Params,
    mine: &Params,
    describe: &dyn Fn(&Params) -> String,
) -> (String, String) {
    let (a, b) = (describe(pinned), describe(mine));
    if a == b {
        (format!("{a} ({})", pinned.0), format!("{b} ({})", mine.0))
    } else {
        (a, b)
    }
}

/// Pins `params` for `key`'s period unless it has some, else compares them, inside the claim's
/// transaction `tx`. A concurrent first claim of the period with other parameters waits on the
/// pin's primary key, then compares against what that one pinned. The pin's row stays locked
/// (`FOR SHARE`) until `tx` ends, so a [`repin`] cannot slip between the comparison and the claim.
/// A period held by a correction other than `correction` is [`Pin::Correcting`].
pub async fn pin_or_compare(
    tx: &mut PgConnection,
    key: &JobKey,
    params: &Params,
    owner: &Owner,
    correction: Option<&str>,
) -> Result<Pin> {
    let inserted = sqlx::query(
        "INSERT INTO job_params (job_name, business_date, params, pinned_by)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (job_name, business_date) DO NOTHING",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(&params.0)
    .bind(&owner.0)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(Pin::Pinned);
    }
    type Row = (
        serde_json::Value,
        bool,
        Option<String>,
        Option<chrono::DateTime<chrono::Utc>>,
    );
    let (pinned, same, held_by, since): Row = sqlx::query_as(&format!(
        "SELECT params, {}, correction_key, correcting_since FROM job_params
              WHERE job_name = $1 AND business_date = $2
                FOR SHARE",
        same_identity("params", "$3")
    ))
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(&params.0)
    .fetch_one(&mut *tx)
    .await?;
    if let Some(held_by) = held_by.filter(|k| Some(k.as_str()) != correction) {
        return Ok(Pin::Correcting {
            correction: held_by,
            since: since.unwrap_or_default(),
        });
    }
    Ok(if same {
        Pin::Same
    } else {
        Pin::Differs(Params(pinned))
    })
}

/// Holds the period for the correction `correction` (inside the transaction that re-pinned it):
/// until [`release`], claims of the period other than the correction's find it held.
pub async fn hold(
    tx: &mut PgConnection,
    job_name: &str,
    business_date: NaiveDate,
    correction: &str,
) -> Result<()> {
    sqlx::query(
        "UPDATE job_params SET correction_key = $3, correcting_since = clock_timestamp()
          WHERE job_name = $1 AND business_date = $2",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(correction)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Ends the hold of `correction` on the period (inside the transaction that completes it).
pub async fn release(
    tx: &mut PgConnection,
    job_name: &str,
    business_date: NaiveDate,
    correction: &str,
) -> Result<()> {
    sqlx::query(
        "UPDATE job_params SET correction_key = NULL, correcting_since = NULL
          WHERE job_name = $1 AND business_date = $2 AND correction_key = $3",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(correction)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// The correction holding a period, and since when, if one does.
pub async fn held_by(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: NaiveDate,
) -> Result<Option<(String, chrono::DateTime<chrono::Utc>)>> {
    let row: Option<(Option<String>, Option<chrono::DateTime<chrono::Utc>>)> = sqlx::query_as(
        "SELECT correction_key, correcting_since FROM job_params
          WHERE job_name = $1 AND business_date = $2",
    )
    .bind(job_name)
    .bind(business_date)
    .fetch_optional(db)
    .await?;
    Ok(row.and_then(|(key, since)| Some((key?, since.unwrap_or_default()))))
}

/// The parameters pinned for a period, if any.
pub async fn pinned(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: NaiveDate,
) -> Result<Option<Params>> {
    let value: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT params FROM job_params WHERE job_name = $1 AND business_date = $2",
    )
    .bind(job_name)
    .bind(business_date)
    .fetch_optional(db)
    .await?;
    Ok(value.map(Params))
}

/// The parameters pinned for each of `dates` that has some.
pub async fn pinned_for(
    db: impl PgExecutor<'_>,
    job_name: &str,
    dates: &[NaiveDate],
) -> Result<Vec<(NaiveDate, Params)>> {
    let rows: Vec<(NaiveDate, serde_json::Value)> = sqlx::query_as(
        "SELECT business_date, params FROM job_params
          WHERE job_name = $1 AND business_date = ANY($2)",
    )
    .bind(job_name)
    .bind(dates)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|(d, p)| (d, Params(p))).collect())
}

/// Of `mine`, each period's parameters as a claimer would state them, those whose period is pinned
/// to other parameters ([`same_identity`]): what a claim of it would refuse, with the pinned ones.
/// A period held by a correction is not counted (its correction runs it, under its own pin).
pub async fn conflicts(
    db: impl PgExecutor<'_>,
    job_name: &str,
    mine: &[(NaiveDate, Params)],
) -> Result<Vec<(NaiveDate, Params)>> {
    let dates: Vec<NaiveDate> = mine.iter().map(|(d, _)| *d).collect();
    let params: Vec<&serde_json::Value> = mine.iter().map(|(_, p)| &p.0).collect();
    let rows: Vec<(NaiveDate, serde_json::Value)> = sqlx::query_as(&format!(
        "SELECT p.business_date, p.params
           FROM unnest($2::date[], $3::jsonb[]) AS m(business_date, mine)
           JOIN job_params p ON p.job_name = $1 AND p.business_date = m.business_date
          WHERE p.correction_key IS NULL AND NOT ({})
          ORDER BY p.business_date",
        same_identity("p.params", "m.mine")
    ))
    .bind(job_name)
    .bind(&dates)
    .bind(&params)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|(d, p)| (d, Params(p))).collect())
}

/// Pins `params` for the period of `job_name` and `business_date` whatever was pinned before, inside
/// `tx`, and returns what was (`None`: nothing). Locks the pin's row first, so it waits for the
/// claims comparing against it and every later claim compares against `params`.
pub async fn repin(
    tx: &mut PgConnection,
    job_name: &str,
    business_date: NaiveDate,
    params: &Params,
    owner: &Owner,
) -> Result<Option<Params>> {
    let old: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT params FROM job_params WHERE job_name = $1 AND business_date = $2 FOR UPDATE",
    )
    .bind(job_name)
    .bind(business_date)
    .fetch_optional(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO job_params (job_name, business_date, params, pinned_by)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (job_name, business_date)
         DO UPDATE SET params = EXCLUDED.params, pinned_by = EXCLUDED.pinned_by,
                       pinned_at = clock_timestamp()",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(&params.0)
    .bind(&owner.0)
    .execute(&mut *tx)
    .await?;
    Ok(old.map(Params))
}
