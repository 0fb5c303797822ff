//! The fine-settlement job: the loans SQL, one batch per transaction.
//!
//! Shard `s` of `S` settles loans returned in the business date's month, still unsettled
//! (`fine_settled_at IS NULL`), with `id mod S = s`, written `(id % S + S) % S` so a negative id
//! (SQL's `%` keeps the dividend's sign) still belongs to exactly one shard.
//! The update is conditional (`AND fine_settled_at IS NULL`): a row settled meanwhile by anyone
//! counts as scanned, not updated. `fine_settled_at` is the done-marker, never `fine_cents`.
//!
//! Cost follows the month's unsettled rows of the shard, never the table: every statement reads
//! the partial index `loans_unsettled_by_month` on `(date_trunc('month', returned_on), id)`, whose
//! entries for one month are exactly that month's unsettled loans, in id order, wherever their ids
//! lie in the table (late returns, sparse ids, years of history). Batches walk it in id order, so
//! the cursor committed with each batch (`last_id`) means "every row of this shard's month up to
//! here is done", and a settled month has no entries at all.

use crate::calendar::BusinessDate;
use crate::config::{SessionGuards, ShardSpec};
use crate::fine::FineRule;
use crate::jobs::{Batch, Job, JobKey};
use chrono::{NaiveDateTime, NaiveTime};
use sqlx::{PgConnection, PgExecutor, PgPool};
use std::borrow::Cow;

pub const JOB_NAME: &str = "fine-settlement";

/// The job key of one shard's settlement of one month.
pub fn key(business_date: BusinessDate, shard: ShardSpec) -> JobKey {
    JobKey {
        job_name: JOB_NAME.to_string(),
        business_date: business_date.date(),
        shards: shard.count,
        shard: shard.index,
    }
}

#[derive(Debug, Clone)]
pub struct FineSettlement {
    pub rule: FineRule,
    pub batch_size: u32,
    /// Server-side limits of every batch transaction, derived from the lease
    /// ([`crate::config::LeaseSettings::guards`]).
    pub guards: SessionGuards,
}

/// Bounds of one run, fixed after the claim.
#[derive(Debug, Clone)]
pub struct MonthPlan {
    /// The month's first day at midnight: the key of its entries in `loans_unsettled_by_month`.
    month: NaiveDateTime,
    shards: i64,
    shard: i64,
}

impl MonthPlan {
    fn for_key(key: &JobKey) -> sqlx::Result<Self> {
        let business_date = BusinessDate::new(key.business_date)
            .map_err(|e| sqlx::Error::Protocol(format!("job key: {e}")))?;
        Ok(Self {
            month: business_date.first_day().and_time(NaiveTime::MIN),
            shards: key.shards.into(),
            shard: key.shard.into(),
        })
    }
}

/// The month's key in `loans_unsettled_by_month`, as the index expression computes it.
const MONTH_KEY: &str = "date_trunc('month', returned_on::timestamp)";

/// Opens a batch transaction (one round trip; `SET LOCAL`, so every setting ends with the
/// transaction):
///
/// - **plans pinned to what one batch costs.** With sequential scans, bitmap scans and sorts
///   disabled, the only way left to read "this month's unsettled rows from this id on, in id order"
///   is an ordered scan of `loans_unsettled_by_month`: the statements compare `id + 0`, an
///   expression only that index holds, so not even the primary key can serve them. Stale or missing
///   statistics can therefore change nothing. JIT is off because a disabled path, if one were ever
///   taken, is priced high enough to trigger it at every batch.
/// - **no wait for the WAL flush at commit.** A batch lost in a server crash is lost together with
///   its fenced progress (same transaction), so the next attempt resumes before it and settles
///   those rows again; the SUCCESS write commits synchronously and flushes every batch before it.
///
/// [`FineSettlement`] opens its batches with [`begin_batch_sql`]: this, plus the lease's guards.
pub const BEGIN_BATCH: &str = "BEGIN;
    SET LOCAL enable_seqscan = off;
    SET LOCAL enable_bitmapscan = off;
    SET LOCAL enable_sort = off;
    SET LOCAL jit = off;
    SET LOCAL synchronous_commit = off";

/// [`BEGIN_BATCH`] plus the lease's [`SessionGuards`] as `SET LOCAL`: transaction-scoped, so they
/// hold for exactly the transactions that take row locks on `loans`, also through a pooler. A
/// writer frozen inside a batch has its session ended by the server after
/// `idle_in_transaction_session_timeout` (its batch rolls back, its locks go), before any peer can
/// take its claim over; a batch waits at most `lock_timeout` for a row lock and runs at most
/// `statement_timeout`.
pub fn begin_batch_sql(guards: &SessionGuards) -> String {
    format!(
        "{BEGIN_BATCH};
    SET LOCAL idle_in_transaction_session_timeout = {};
    SET LOCAL lock_timeout = {};
    SET LOCAL statement_timeout = {}",
        guards.idle_in_transaction.as_millis(),
        guards.lock_timeout.as_millis(),
        guards.statement_timeout.as_millis()
    )
}

impl Job for FineSettlement {
    type Plan = MonthPlan;

    fn begin_batch(&self) -> Cow<'static, str> {
        Cow::Owned(begin_batch_sql(&self.guards))
    }

    async fn plan(
        &self,
        pool: &PgPool,
        key: &JobKey,
        resume_after: Option<i64>,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        let plan = MonthPlan::for_key(key)?;
        if !estimate {
            return Ok((plan, None));
        }
        let remaining = unsettled(pool, &plan, resume_after).await?;
        Ok((plan, Some(remaining)))
    }

    /// One batch: the next `batch_size` unsettled loans of this shard's month after `after`, in id
    /// order, settled by one conditional UPDATE in the same statement (one snapshot).
    ///
    /// - `page` reads them from `loans_unsettled_by_month`: one index range scan that starts at
    ///   (month, after) and stops after `batch_size` rows of this shard.
    /// - `settled` updates the same index range, up to the page's last id, with the same filters
    ///   plus the conditional `fine_settled_at IS NULL`, re-checked on the newest row version: a
    ///   row settled meanwhile by someone else counts as scanned (it is in `page`) but not updated,
    ///   and a row that left the month meanwhile is left alone. The range holds only this month's
    ///   unsettled rows (the index has nothing else), so re-reading it costs one more pass over the
    ///   batch's index entries; joining `page` back by id or ctid measured slower (one probe or
    ///   fetch per row, docs/PERFORMANCE.md).
    ///
    /// The statement is sent unnamed (`persistent(false)`), so PostgreSQL plans it with the actual
    /// cursor each time instead of switching to a generic plan after five executions.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        after: Option<i64>,
    ) -> sqlx::Result<Batch> {
        let Some(from) = first_id_after(after) else {
            return Ok(Batch {
                last_id: after,
                scanned: 0,
                updated: 0,
                odd: 0,
                done: true,
            });
        };
        let limit = i64::from(self.batch_size.max(1));
        let (scanned, last_id, updated, odd): (i64, Option<i64>, i64, i64) =
            sqlx::query_as(&batch_sql())
                .persistent(false)
                .bind(plan.month)
                .bind(from)
                .bind(plan.shards)
                .bind(plan.shard)
                .bind(limit)
                .bind(self.rule.grace_days)
                .bind(self.rule.daily_rate_cents)
                .bind(self.rule.max_cents)
                .fetch_one(tx)
                .await?;
        Ok(Batch {
            last_id,
            scanned: scanned as u64,
            updated: updated as u64,
            odd: odd as u64,
            // A short page read every remaining row of the shard's month.
            done: scanned < limit,
        })
    }
}

/// How many loans the run of `key` still has to read after `after` (its committed `last_id`): what
/// its progress is measured against. One pass over the shard's month in `loans_unsettled_by_month`
/// (all of the month's unsettled entries: the shard is a filter), so callers that show it often
/// should keep it per attempt and bound it with a statement timeout.
pub async fn unsettled_after(
    db: impl PgExecutor<'_>,
    key: &JobKey,
    after: Option<i64>,
) -> sqlx::Result<u64> {
    unsettled(db, &MonthPlan::for_key(key)?, after).await
}

async fn unsettled(
    db: impl PgExecutor<'_>,
    plan: &MonthPlan,
    after: Option<i64>,
) -> sqlx::Result<u64> {
    let Some(from) = first_id_after(after) else {
        return Ok(0);
    };
    let remaining: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM loans
          WHERE {MONTH_KEY} = $1 AND fine_settled_at IS NULL AND returned_on IS NOT NULL
            AND id + 0 >= $2 AND (id % $3 + $3) % $3 = $4"
    ))
    .bind(plan.month)
    .bind(from)
    .bind(plan.shards)
    .bind(plan.shard)
    .fetch_one(db)
    .await?;
    Ok(remaining as u64)
}

/// The smallest id a walk resuming after `after` still has to read; `None` past `i64::MAX`.
fn first_id_after(after: Option<i64>) -> Option<i64> {
    match after {
        None => Some(i64::MIN),
        Some(id) => id.checked_add(1),
    }
}

/// Loans whose dates contradict each other: returned, or due, before they were borrowed. They are
/// settled by the same rule as every other loan (the rule only reads `due_on` and `returned_on`,
/// saturating, so any dates give a fine between 0 and the cap), and counted: `odd` in the run's
/// report, `settlementd_odd_rows_total`, a warning in the log. A loan returned decades late, or
/// due decades after it came back, is consistent, not odd: it gets the cap, or 0.
pub const ODD_ROW: &str = "(l.returned_on < l.borrowed_on OR l.due_on < l.borrowed_on)";

/// The batch statement: `$1` month key, `$2` first id to read, `$3`/`$4` shard count and index,
/// `$5` batch size, `$6`..`$8` the fine rule. Returns (rows read, last id read, rows updated, odd
/// rows updated, see [`ODD_ROW`]).
/// Run it in a transaction opened with [`BEGIN_BATCH`]. `id + 0` is the index's own id column
/// (see [`BEGIN_BATCH`]); `$3 = 1 OR …` lets the planner drop the shard test for one shard.
pub fn batch_sql() -> String {
    format!(
        "WITH page AS (
             SELECT id FROM loans
              WHERE {MONTH_KEY} = $1 AND fine_settled_at IS NULL AND returned_on IS NOT NULL
                AND id + 0 >= $2 AND ($3 = 1 OR (id % $3 + $3) % $3 = $4)
              ORDER BY id + 0
              LIMIT $5
         ), stats AS (
             SELECT count(*) AS n, max(id) AS last FROM page
         ), settled AS (
             UPDATE loans l
                SET fine_cents = {fine}, fine_settled_at = now()
              WHERE date_trunc('month', l.returned_on::timestamp) = $1
                AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                AND l.id + 0 >= $2 AND l.id + 0 <= (SELECT last FROM stats)
                AND ($3 = 1 OR (l.id % $3 + $3) % $3 = $4)
             RETURNING {ODD_ROW} AS odd
         )
         SELECT n, last, (SELECT count(*) FROM settled),
                (SELECT count(*) FILTER (WHERE odd) FROM settled) FROM stats",
        fine = FineRule::sql_params(6),
    )
}

/// What a month looks like after settlement, to compare runs byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MonthTotals {
    pub settled_rows: i64,
    pub fine_cents_sum: i64,
    /// md5 of `id:fine_cents` for every settled row of the month, in id order.
    pub digest: String,
}

pub async fn month_totals(
    db: impl PgExecutor<'_>,
    business_date: BusinessDate,
) -> sqlx::Result<MonthTotals> {
    let (settled_rows, fine_cents_sum, digest): (i64, i64, String) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum(fine_cents), 0)::bigint,
                md5(COALESCE(string_agg(id::text || ':' || fine_cents::text, ',' ORDER BY id), ''))
           FROM loans
          WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NOT NULL",
    )
    .bind(business_date.first_day())
    .bind(business_date.date())
    .fetch_one(db)
    .await?;
    Ok(MonthTotals {
        settled_rows,
        fine_cents_sum,
        digest,
    })
}
