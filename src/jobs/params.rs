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
//! old value. Parameters are JSON objects compared as `jsonb` (key order does not matter).

use super::{JobKey, Owner, Result};
use chrono::NaiveDate;
use sqlx::{PgConnection, PgExecutor};

/// A job's identifying parameters for one period: a JSON object.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(transparent)]
pub struct Params(pub serde_json::Value);

/// What a claim found for its period.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pin {
    /// No parameters were pinned: this claim pinned its own.
    Pinned,
    /// The pinned parameters are this claim's.
    Same,
    /// The period is pinned to other parameters (these).
    Differs(Params),
}

/// Pins `params` for `key`'s period unless it has some, else compares them, inside the claim's
/// transaction `tx`. A concurrent first claim of the period with other parameters waits on the
/// pin's primary key, then compares against what that one pinned. The pin's row stays locked
/// (`FOR SHARE`) until `tx` ends, so a [`repin`] cannot slip between the comparison and the claim.
pub async fn pin_or_compare(
    tx: &mut PgConnection,
    key: &JobKey,
    params: &Params,
    owner: &Owner,
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
    let (pinned, same): (serde_json::Value, bool) = sqlx::query_as(
        "SELECT params, params = $3 FROM job_params
          WHERE job_name = $1 AND business_date = $2
            FOR SHARE",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(&params.0)
    .fetch_one(&mut *tx)
    .await?;
    Ok(if same {
        Pin::Same
    } else {
        Pin::Differs(Params(pinned))
    })
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
