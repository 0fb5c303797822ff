//! Corrections on the record: a settled month recomputed under the rule the configuration gives
//! it, every changed fine written down.
//!
//! A correction has the operator's key (`fine_corrections`): the same key again changes nothing
//! and reports the first result. It
//! 1. re-pins the month to the configured rule ([`begin`]; the only way a pin ever changes),
//!    refusing while a live run holds any shard of the month;
//! 2. runs [`FineCorrection`] on every shard of the month, through the job layer like every run
//!    (claim, lease, fencing): each batch recomputes its rows, updates the settled ones whose fine
//!    differs, and appends one `fine_adjustments` row per changed loan (old and new cents) in the
//!    same transaction; a return not settled yet is settled; a held row is left alone;
//! 3. appends a `corrected` event per shard (key, reason, old and new rule, rows changed, net
//!    cents) and marks the correction complete, in one transaction ([`complete`]).
//!
//! Killed at any point, it is finished by running it again with the same key: a batch that
//! committed left its rows equal to the rule, so they are not changed (nor recorded) again.

use super::{describe_params, rule_params, FineSettlement, HELD_ROW};
use crate::calendar::BusinessDate;
use crate::fine::FineRule;
use crate::jobs::{params, Batch, Cursor, Job, JobKey, Owner, Params, Reopen, HELD_IDS};
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
}

/// The correction with `key`, if any.
pub async fn find(db: impl PgExecutor<'_>, key: &str) -> sqlx::Result<Option<Correction>> {
    sqlx::query_as(
        "SELECT correction_key, business_date, shards, reason, old_rule, new_rule,
                completed_at IS NOT NULL AS completed, result
           FROM fine_corrections WHERE correction_key = $1",
    )
    .bind(key)
    .fetch_optional(db)
    .await
}

/// What [`begin`] did.
#[derive(Debug)]
pub enum Begun {
    /// Recorded now, and the month re-pinned.
    Started(Correction),
    /// A correction with this key was recorded before (possibly by a concurrent call).
    Existing(Correction),
    /// A live run holds these claims of the month: nothing was recorded.
    Running(Vec<String>),
}

/// Records the correction `key` of `business_date` under `shards`, re-pinning the month to `rule`,
/// in one transaction that first locks the month's pin (waiting for claims comparing against it)
/// and refuses while any run of the month, under any shard count, holds a live lease.
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
    let mut tx = conn.begin().await?;
    let old = params::repin(&mut tx, super::JOB_NAME, business_date.date(), rule, owner)
        .await
        .map_err(job_to_sqlx)?;
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
        // Recorded before: leave the pin as it was.
        tx.rollback().await?;
        let existing = find(&mut *conn, key).await?;
        return existing
            .map(Begun::Existing)
            .ok_or_else(|| sqlx::Error::Protocol(format!("correction {key:?} vanished")));
    }
    tx.commit().await?;
    let started = find(&mut *conn, key).await?;
    started
        .map(Begun::Started)
        .ok_or_else(|| sqlx::Error::Protocol(format!("correction {key:?} vanished")))
}

fn job_to_sqlx(e: crate::jobs::JobError) -> sqlx::Error {
    match e {
        crate::jobs::JobError::Db(e) => e,
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
    sqlx::query(
        "UPDATE fine_corrections SET completed_at = clock_timestamp(), result = $2
          WHERE correction_key = $1 AND completed_at IS NULL",
    )
    .bind(&correction.correction_key)
    .bind(&result)
    .execute(&mut *tx)
    .await?;
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
/// fencing), whose batches walk every loan of the shard's month in id order — settled or not, which
/// the month index does not hold, so along the primary key: a pass over the table per shard, once
/// per correction.
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

/// A correction run's bounds and rule.
#[derive(Debug)]
pub struct CorrectionPlan {
    first_day: NaiveDate,
    last_day: NaiveDate,
    business_date: NaiveDate,
    shards: i64,
    shard: i64,
    rule: FineRule,
}

impl Job for FineCorrection {
    type Plan = CorrectionPlan;

    fn params(&self, key: &JobKey) -> Result<Params, String> {
        Ok(rule_params(&self.settlement.rule_of(key.business_date)?))
    }

    fn describe(&self, params: &Params) -> String {
        describe_params(params)
    }

    fn held_means(&self) -> &'static str {
        self.settlement.held_means()
    }

    fn begin_batch(&self) -> Cow<'static, str> {
        self.settlement.begin_batch()
    }

    async fn plan(
        &self,
        _pool: &PgPool,
        key: &JobKey,
        _resume: Cursor,
        _estimate: bool,
    ) -> sqlx::Result<(CorrectionPlan, Option<u64>)> {
        let month = BusinessDate::new(key.business_date)
            .map_err(|e| sqlx::Error::Protocol(format!("job key: {e}")))?;
        let rule = self
            .settlement
            .rule_of(key.business_date)
            .map_err(sqlx::Error::Protocol)?;
        Ok((
            CorrectionPlan {
                first_day: month.first_day(),
                last_day: month.date(),
                business_date: month.date(),
                shards: key.shards.into(),
                shard: key.shard.into(),
                rule: rule.rule,
            },
            None,
        ))
    }

    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &CorrectionPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let Some((low, high)) = cursor.remaining() else {
            return Ok(Batch::nothing_left(cursor));
        };
        let limit = i64::from(self.settlement.batch_size.max(1));
        let (read, last, updated, held, held_ids): (i64, Option<i64>, i64, i64, Vec<i64>) =
            sqlx::query_as(correction_sql())
                .bind(plan.first_day)
                .bind(plan.last_day)
                .bind(low)
                .bind(high)
                .bind(plan.shards)
                .bind(plan.shard)
                .bind(limit)
                .bind(plan.rule.grace_days)
                .bind(plan.rule.daily_rate_cents)
                .bind(plan.rule.max_cents)
                .bind(&self.correction_key)
                .bind(plan.business_date)
                .fetch_one(&mut *tx)
                .await?;
        let Some(last) = last else {
            return Ok(Batch::nothing_left(cursor));
        };
        Ok(Batch {
            cursor: Cursor {
                last_id: Some(last),
                ..cursor
            },
            scanned: read as u64,
            updated: updated as u64,
            odd: 0,
            held: held as u64,
            held_ids,
            done: read < limit,
        })
    }
}

/// One correction batch: the next page of the shard's month along the primary key, locked; the
/// rows whose fine differs from the rule (or that are not settled yet) updated; one adjustment per
/// settled row changed. Returns (rows read, last id read, rows updated, rows held, first held ids).
fn correction_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        let fine = FineRule::sql_params(8);
        format!(
            "WITH page AS MATERIALIZED (
                 SELECT l.id, l.fine_cents AS old, l.fine_settled_at IS NOT NULL AS settled,
                        {HELD_ROW} AS held,
                        CASE WHEN {HELD_ROW} THEN NULL ELSE {fine} END AS new
                   FROM loans l
                  WHERE l.id BETWEEN $3 AND $4
                    AND l.returned_on BETWEEN $1 AND $2
                    AND ($5 = 1 OR (l.id % $5 + $5) % $5 = $6)
                  ORDER BY l.id
                  LIMIT $7
                    FOR UPDATE OF l
             ), changed AS (
                 UPDATE loans l
                    SET fine_cents = p.new, fine_settled_at = COALESCE(l.fine_settled_at, now())
                   FROM page p
                  WHERE l.id = p.id AND NOT p.held AND (NOT p.settled OR p.old <> p.new)
                 RETURNING l.id, p.old, p.new, p.settled
             ), adjusted AS (
                 INSERT INTO fine_adjustments
                        (correction_key, loan_id, business_date, old_cents, new_cents)
                 SELECT $11, id, $12, old, new FROM changed WHERE settled
             )
             SELECT (SELECT count(*) FROM page), (SELECT max(id)::bigint FROM page),
                    (SELECT count(*) FROM changed),
                    (SELECT count(*) FROM page WHERE held),
                    ARRAY(SELECT id::bigint FROM page WHERE held ORDER BY id LIMIT {HELD_IDS})"
        )
    })
}
