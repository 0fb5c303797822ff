//! Corrections on the record: a settled month recomputed under the rule the configuration gives
//! it, every changed fine written down.
//!
//! A correction has the operator's key (`fine_corrections`), which binds its request — month,
//! rule, reason, shard count: the same key again with the same request changes nothing and
//! reports the first result, with another it is refused (`commands::correct`). It
//! 1. re-pins the month to the configured rule and holds it ([`begin`], one transaction; the only
//!    way a pin ever changes), refusing while the job is paused, a live run holds any shard of the
//!    month or another correction of it is unfinished — a refusal leaves the pin and the hold as
//!    they were: from then until it completes, no run, sweep or takeover of the month's claims
//!    but its own can run (`jobs::params::hold`), and `status` says "being corrected";
//! 2. runs [`FineCorrection`] on every shard of the month, through the job layer like every run
//!    (claim, lease, fencing): each batch re-prices the edits queued for the month, then the
//!    month's loans — those whose last journal entry is in it, and its unsettled returns — by
//!    primary key ([`journal::reprice`]), from the first id (i64::MIN included): a settled fine
//!    that differs from the rule is changed, a return not settled yet is settled, a loan no longer
//!    returned in the month is unsettled again, a held row is left alone; each change gets its
//!    journal entry (`corrected`, with the key), and each whose cents change a `fine_adjustments`
//!    row (old and new cents), in the same transaction. A loan whose money has left the month
//!    since the plan (settled or re-priced in another month) is passed over with its queued edits,
//!    which its own month's run takes;
//! 3. appends a `corrected` event per shard (key, reason, old and new rule, rows changed, net
//!    cents), marks the correction complete and releases the month, in one transaction
//!    ([`complete`]), once: a second process with the same key finds it complete.
//!
//! Killed at any point, it is finished by running it again with the same key: a batch that
//! committed left its rows equal to the rule, so they are not changed (nor recorded) again.

use super::journal::{self, Repricer};
use super::{describe_params, rule_params, FineSettlement, MONTH_KEY_L};
use crate::calendar::BusinessDate;
use crate::job_layer::{params, Batch, Claim, Cursor, Job, JobKey, Noted, Notes, Owner, Params, Reopen};
use chrono::NaiveDate;
use sqlx::{Connection, PgConnection, PgExecutor, PgPool};
use std::borrow::Cow;
use std::time::Duration;

/// A correction as recorded.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Correction {
    pub correction_key: String,
    pub business_date: NaiveDate,
    pub shards: i32,
    pub reason: String,
    /// The month's pin before the correction (`None`: it had none).
    pub old_rule: Option<serde_json::Value>,
    pub new_rule: serde_json::Value,
    pub completed: bool,
    /// Per shard, once complete: rows changed, net cents, rows updated, rows held.
    pub result: Option<serde_json::Value>,
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// The correction with `key`, if any.
pub async fn find(db: impl PgExecutor<'_>, key: &str) -> sqlx::Result<Option<Correction>> {
    sqlx::query_as(
        "SELECT correction_key, business_date, shards, reason, old_rule, new_rule,
                completed_at IS NOT NULL AS completed, result, created_at
           FROM fine_corrections WHERE correction_key = $1",
    )
    .bind(key)
    .fetch_optional(db)
    .await
}

/// What [`begin`] did.
#[derive(Debug)]
pub enum Begun {
    /// Recorded now, and the month re-pinned and held.
    Started(Correction),
    /// A correction with this key was recorded before (possibly by a concurrent call).
    Existing(Correction),
    /// A live run holds these claims of the month: nothing was recorded.
    Running(Vec<String>),
    /// Another correction of the month is unfinished: nothing was recorded.
    Unfinished(Correction),
    /// The job is paused: nothing was recorded, the pin and its hold are as they were.
    Paused(crate::job_layer::pause::Pause),
}

/// Records the correction `key` of `business_date` under `shards`, re-pinning the month to `rule`
/// and holding it ([`params::hold`]), in one transaction. It refuses while the job is paused
/// (checked first, before anything is written), then locks the month's pin (waiting for claims
/// comparing against it) and refuses while any run of the month, under any shard count, holds a
/// live lease, or another correction of the month is unfinished. Every refusal rolls the
/// transaction back: the pin and the hold are left exactly as they were, and nothing is recorded.
#[allow(clippy::too_many_arguments)]
pub async fn begin(
    conn: &mut PgConnection,
    key: &str,
    business_date: BusinessDate,
    shards: u32,
    reason: &str,
    rule: &Params,
    owner: &Owner,
    ttl: Duration,
) -> sqlx::Result<Begun> {
    if let Some(existing) = find(&mut *conn, key).await? {
        return Ok(Begun::Existing(existing));
    }
    let mut tx = conn.begin().await?;
    // A pause stops a correction as it stops a claim: before the month is touched.
    if let Some(pause) = crate::job_layer::pause::of(&mut *tx, super::JOB_NAME)
        .await
        .map_err(job_to_sqlx)?
    {
        tx.rollback().await?;
        return Ok(Begun::Paused(pause));
    }
    let old = params::repin(&mut tx, super::JOB_NAME, business_date.date(), rule, owner)
        .await
        .map_err(job_to_sqlx)?;
    // Under the pin's lock: a concurrent correction of the month waits here, then sees this one.
    let other: Option<String> = sqlx::query_scalar(
        "SELECT correction_key FROM fine_corrections
          WHERE business_date = $1 AND completed_at IS NULL AND correction_key <> $2
          ORDER BY created_at LIMIT 1",
    )
    .bind(business_date.date())
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(other) = other {
        tx.rollback().await?;
        let other = find(&mut *conn, &other).await?;
        return other
            .map(Begun::Unfinished)
            .ok_or_else(|| sqlx::Error::Protocol("an unfinished correction vanished".into()));
    }
    let running: Vec<String> = sqlx::query_scalar(
        "SELECT format('shard %s/%s (attempt %s, %s)', shard, shards, attempt, owner)
           FROM job_runs
          WHERE job_name = $1 AND business_date = $2 AND status = 'RUNNING'
            AND heartbeat_at >= clock_timestamp() - make_interval(secs => $3)
          ORDER BY shards, shard",
    )
    .bind(super::JOB_NAME)
    .bind(business_date.date())
    .bind(ttl.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    if !running.is_empty() {
        tx.rollback().await?;
        return Ok(Begun::Running(running));
    }
    let inserted = sqlx::query(
        "INSERT INTO fine_corrections
                (correction_key, business_date, shards, reason, old_rule, new_rule, requested_by)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (correction_key) DO NOTHING",
    )
    .bind(key)
    .bind(business_date.date())
    .bind(shards as i32)
    .bind(reason)
    .bind(old.as_ref().map(|p| &p.0))
    .bind(&rule.0)
    .bind(&owner.0)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if inserted == 0 {
        // Recorded meanwhile by a concurrent call: leave the pin as it was.
        tx.rollback().await?;
        let existing = find(&mut *conn, key).await?;
        return existing
            .map(Begun::Existing)
            .ok_or_else(|| sqlx::Error::Protocol(format!("correction {key:?} vanished")));
    }
    params::hold(&mut tx, super::JOB_NAME, business_date.date(), key)
        .await
        .map_err(job_to_sqlx)?;
    tx.commit().await?;
    let started = find(&mut *conn, key).await?;
    started
        .map(Begun::Started)
        .ok_or_else(|| sqlx::Error::Protocol(format!("correction {key:?} vanished")))
}

/// The unfinished corrections, oldest first.
pub async fn unfinished(db: impl PgExecutor<'_>) -> sqlx::Result<Vec<Correction>> {
    sqlx::query_as(
        "SELECT correction_key, business_date, shards, reason, old_rule, new_rule,
                completed_at IS NOT NULL AS completed, result, created_at
           FROM fine_corrections WHERE completed_at IS NULL ORDER BY created_at",
    )
    .fetch_all(db)
    .await
}

/// The loans a correction of month `$1` (first day) re-prices, shard `$3` of `$2`, by id, after
/// id `after` (an SQL expression, `NULL` for all): every loan with an entry in the month's
/// journal, at the seq of its last entry there, and every unsettled return of the month (seq
/// `NULL`). Its plan reads them; its dry run ([`super::preview`]) prices them, for the shards
/// `shard` lets through.
pub(super) fn loans_of_month(after: &str, shard: &dyn Fn(&str) -> String) -> String {
    let (journal_shard, loans_shard) = (shard("x.loan_id"), shard("l.id"));
    format!(
        "SELECT DISTINCT ON (id) id, seq FROM (
             SELECT x.loan_id AS id, x.seq
               FROM fine_journal j, unnest(j.loan_ids, j.seqs) AS x(loan_id, seq)
              WHERE j.month = $1::date AND ({after} IS NULL OR x.loan_id > {after})
                AND {journal_shard}
             UNION ALL
             SELECT l.id::bigint, NULL FROM loans l
              WHERE {MONTH_KEY_L} = $1::date::timestamp
                AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                AND ({after} IS NULL OR l.id + 0 > {after})
                AND {loans_shard}
         ) t
         ORDER BY id, seq DESC NULLS FIRST"
    )
}

fn job_to_sqlx(e: crate::job_layer::JobError) -> sqlx::Error {
    match e {
        crate::job_layer::JobError::Db(e) => e,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// What one shard's correction run did, for [`complete`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRun {
    pub shard: u32,
    pub attempt: i32,
    /// Rows this run updated: fines changed, and returns settled for the first time.
    pub updated: u64,
    pub held: u64,
}

/// Appends the `corrected` event of every shard and marks the correction complete, in one
/// transaction; returns its result (also stored, and replayed for the same key). Rows changed and
/// net cents are read from `fine_adjustments`, so a correction finished over several invocations
/// reports what it changed in all of them.
pub async fn complete(
    conn: &mut PgConnection,
    correction: &Correction,
    runs: &[ShardRun],
    owner: &Owner,
) -> sqlx::Result<serde_json::Value> {
    let mut tx = conn.begin().await?;
    // Once: a second process that finished the same key meanwhile has written the events.
    let done: Option<serde_json::Value> = sqlx::query_scalar(
        "SELECT COALESCE(result, 'null'::jsonb) FROM fine_corrections
          WHERE correction_key = $1 AND completed_at IS NOT NULL
            FOR UPDATE",
    )
    .bind(&correction.correction_key)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(result) = done {
        tx.rollback().await?;
        return Ok(result);
    }
    let shards = i64::from(correction.shards);
    let per_shard: Vec<(i32, i64, String)> = sqlx::query_as(
        "SELECT s::int, count(a.id), COALESCE(sum(a.new_cents::numeric - a.old_cents), 0)::text
           FROM generate_series(0, $2 - 1) AS s
           LEFT JOIN fine_adjustments a
             ON a.correction_key = $1 AND ($2 = 1 OR (a.loan_id % $2 + $2) % $2 = s)
          GROUP BY s ORDER BY s",
    )
    .bind(&correction.correction_key)
    .bind(shards)
    .fetch_all(&mut *tx)
    .await?;
    let old = correction
        .old_rule
        .clone()
        .map_or("none pinned".to_string(), |p| describe_params(&Params(p)));
    let new = describe_params(&Params(correction.new_rule.clone()));
    let mut result = Vec::new();
    for (shard, changed, net) in per_shard {
        let run = runs.iter().find(|r| r.shard as i32 == shard);
        let message = format!(
            "correction {:?} ({}): {changed} rows changed, net {} cents; rule was {old}, is {new}",
            correction.correction_key,
            correction.reason,
            signed(&net)
        );
        sqlx::query(
            "INSERT INTO job_events
                    (job_name, business_date, shards, shard, event, attempt, owner, message)
             VALUES ($1, $2, $3, $4, 'corrected', $5, $6, $7)",
        )
        .bind(super::JOB_NAME)
        .bind(correction.business_date)
        .bind(correction.shards)
        .bind(shard)
        .bind(run.map(|r| r.attempt))
        .bind(&owner.0)
        .bind(&message)
        .execute(&mut *tx)
        .await?;
        result.push(serde_json::json!({
            "shard": shard,
            "changed": changed,
            "net_cents": super::parse_sum(&net)?,
            "updated": run.map_or(0, |r| r.updated),
            "held": run.map_or(0, |r| r.held),
        }));
    }
    let result = serde_json::Value::Array(result);
    let marked = sqlx::query(
        "UPDATE fine_corrections SET completed_at = clock_timestamp(), result = $2
          WHERE correction_key = $1 AND completed_at IS NULL",
    )
    .bind(&correction.correction_key)
    .bind(&result)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if marked == 0 {
        // Completed by another process between the check and here: its events stand.
        tx.rollback().await?;
        let stored = find(&mut *conn, &correction.correction_key).await?;
        return Ok(stored.and_then(|c| c.result).unwrap_or_default());
    }
    params::release(
        &mut tx,
        super::JOB_NAME,
        correction.business_date,
        &correction.correction_key,
    )
    .await
    .map_err(job_to_sqlx)?;
    tx.commit().await?;
    Ok(result)
}

/// "+12" or "-3" (a numeric's text).
fn signed(net: &str) -> String {
    if net.starts_with('-') {
        net.to_string()
    } else {
        format!("+{net}")
    }
}

/// The correction of one shard of a month: a job like the settlement (same key, same rule, same
/// fencing), whose batches re-price the month's queued edits, then its loans by primary key: those
/// whose last journal entry is in the month, and its unsettled returns ([`journal::reprice`]).
/// What it reads follows the month, not the table.
#[derive(Debug, Clone)]
pub struct FineCorrection {
    /// The settlement whose rule and guards the correction uses.
    pub settlement: FineSettlement,
    pub correction_key: String,
}

/// The claim event of a correction's runs: it re-opens every shard, whatever its state, from the
/// first id.
pub fn reopen(correction: &Correction) -> Reopen {
    Reopen {
        event: "correcting",
        message: format!(
            "correction {:?}: {}",
            correction.correction_key, correction.reason
        ),
    }
}

/// A correction run's loans and how it writes.
#[derive(Debug)]
pub struct CorrectionPlan {
    /// The shard's loans of the month, by id: each with the seq of its last journal entry in the
    /// month, or `None` for an unsettled return. Whether that entry is still the loan's last (and
    /// the return still unsettled) is checked when the batch locks the loan (a loan that has left
    /// the month since, or was re-priced meanwhile, is passed over, and so are its queued edits);
    /// checking it here too read every loan a second time, 125 of the plan's 150 ms on 55,000
    /// loans.
    loans: Vec<(i64, Option<i32>)>,
    by: Repricer,
}

impl Job for FineCorrection {
    type Plan = CorrectionPlan;

    fn params(&self, key: &JobKey) -> Result<Params, String> {
        Ok(rule_params(
            &self.settlement.rule_of(key.business_date)?.rule,
        ))
    }

    fn describe(&self, params: &Params) -> String {
        describe_params(params)
    }

    const NAME: &'static str = super::JOB_NAME;

    fn note_events(&self, notes: &Notes) -> Vec<(&'static str, String)> {
        self.settlement.note_events(notes)
    }

    fn explain(&self, name: &str, noted: &Noted) -> String {
        self.settlement.explain(name, noted)
    }

    fn batch_settings(&self) -> Cow<'static, str> {
        self.settlement.batch_settings()
    }

    async fn plan(
        &self,
        pool: &PgPool,
        claim: &Claim,
        _estimate: bool,
    ) -> sqlx::Result<(CorrectionPlan, Option<u64>)> {
        let key = &claim.key;
        let month = claim.month;
        let rule = self
            .settlement
            .rule_of(key.business_date)
            .map_err(sqlx::Error::Protocol)?
            .rule;
        let (shards, shard) = (i64::from(key.shards), i64::from(key.shard));
        // `None`: from the first id, i64::MIN included (a bound of i64::MIN, exclusive, left the
        // loan with that id out).
        let after = claim.resume.last_id;
        let mut tx = pool.begin_with(self.settlement.begin_batch()).await?;
        let loans: Vec<(i64, Option<i32>)> = sqlx::query_as(&loans_of_month("$4::bigint", &|id| {
            format!("($2 = 1 OR ({id} % $2 + $2) % $2 = $3)")
        }))
        .bind(month.first_day())
        .bind(shards)
        .bind(shard)
        .bind(after)
        .fetch_all(&mut *tx)
        .await?;
        tx.rollback().await?;
        let total = loans.len() as u64;
        let by = Repricer {
            month: month.first_day(),
            business_date: month.date(),
            shards,
            shard,
            rule,
            attempt: claim.attempt,
            correction_key: Some(self.correction_key.clone()),
        };
        Ok((CorrectionPlan { loans, by }, Some(total)))
    }

    /// The month's queued edits first (a batch of them while there are some), then the next
    /// `batch.size` of the plan's loans after the cursor.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &CorrectionPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let limit = i64::from(self.settlement.batch_size.max(1));
        let edits = journal::reprice(tx, &plan.by, journal::Source::Queue { limit }).await?;
        if edits.loans as i64 >= limit {
            return Ok(Batch {
                cursor,
                scanned: edits.loans,
                updated: edits.written(),
                ..Batch::default()
            });
        }
        let start = match cursor.last_id {
            Some(after) => plan.loans.partition_point(|(id, _)| *id <= after),
            None => 0,
        };
        let page = &plan.loans[start..plan.loans.len().min(start + limit as usize)];
        let Some(&(last, _)) = page.last() else {
            return Ok(Batch {
                scanned: edits.loans,
                updated: edits.written(),
                ..Batch::nothing_left(cursor)
            });
        };
        let ids: Vec<i64> = page.iter().map(|(id, _)| *id).collect();
        let seqs: Vec<Option<i32>> = page.iter().map(|(_, seq)| *seq).collect();
        let done = journal::reprice(
            tx,
            &plan.by,
            journal::Source::Loans {
                ids: &ids,
                seqs: &seqs,
            },
        )
        .await?;
        Ok(Batch {
            amount: 0,
            cursor: Cursor {
                last_id: Some(last),
                ..cursor
            },
            scanned: edits.loans + page.len() as u64,
            updated: edits.written() + done.written(),
            notes: super::notes(0, done.held, done.held_ids),
            done: start + page.len() >= plan.loans.len(),
        })
    }
}
