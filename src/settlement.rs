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
//! the cursor committed with each batch means "every row of this shard's month up to here is
//! done", and a settled month has no entries at all.
//!
//! Even shards walk up (cursor `last_id`), odd shards walk down (cursor `last_id_desc`): the
//! shards of one month interleave on the same heap pages (`id % S`), and two walks that start at
//! opposite ends meet only in the middle instead of contending for every page together
//! (docs/PERFORMANCE.md: two shards at once on an append-only table went from 1.0 to 1.25 × the
//! single `UPDATE`). A run always stays inside both cursors ([`Cursor::remaining`]), whichever
//! direction committed them.

use crate::calendar::BusinessDate;
use crate::config::{SessionGuards, ShardSpec};
use crate::fine::FineRule;
use crate::jobs::{Batch, Cursor, Job, JobKey};
use chrono::{NaiveDateTime, NaiveTime};
use sqlx::{PgConnection, PgExecutor, PgPool};
use std::borrow::Cow;
use std::sync::OnceLock;

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
    walk: Walk,
}

impl MonthPlan {
    fn for_key(key: &JobKey) -> sqlx::Result<Self> {
        let business_date = BusinessDate::new(key.business_date)
            .map_err(|e| sqlx::Error::Protocol(format!("job key: {e}")))?;
        Ok(Self {
            month: business_date.first_day().and_time(NaiveTime::MIN),
            shards: key.shards.into(),
            shard: key.shard.into(),
            walk: Walk::of_shard(key.shard),
        })
    }
}

/// The order a shard reads its month in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Walk {
    /// Ascending ids, committing `last_id` (even shards).
    Up,
    /// Descending ids, committing `last_id_desc` (odd shards).
    Down,
}

impl Walk {
    pub fn of_shard(shard: u32) -> Self {
        if shard % 2 == 0 {
            Walk::Up
        } else {
            Walk::Down
        }
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
/// - **a plan per batch.** `plan_cache_mode = force_custom_plan`: the batch statements are
///   prepared once per connection, and without this PostgreSQL would switch them to a generic
///   plan after five executions (one that knows neither the cursor nor the shard count).
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
    SET LOCAL plan_cache_mode = force_custom_plan;
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
        resume: Cursor,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        let plan = MonthPlan::for_key(key)?;
        if !estimate {
            return Ok((plan, None));
        }
        let remaining = unsettled(pool, &plan, resume).await?;
        Ok((plan, Some(remaining)))
    }

    /// One batch: the next `batch_size` unsettled loans of this shard's month inside `cursor`, in
    /// the shard's [`Walk`] order, settled by conditional UPDATEs in two statements
    /// ([`BatchSql`]):
    ///
    /// 1. `page` reads the batch from `loans_unsettled_by_month` (an index-only range scan that
    ///    starts at the cursor's end of the remaining ids and stops after `batch_size` rows of this
    ///    shard); in the same statement, the batch's odd rows ([`ODD_ROW`], rare) are settled and
    ///    counted.
    /// 2. `settle` updates the same index range, up to the page's last id, with the same filters:
    ///    every row the first statement did not settle. Its row count is the rest of `updated`.
    ///
    /// Both updates are conditional (`fine_settled_at IS NULL`, re-checked on the newest row
    /// version): a row settled meanwhile by someone else counts as scanned (it is in the page) but
    /// not updated, and a row that left the month meanwhile is left alone. The range holds only
    /// this month's unsettled rows (the index has nothing else). Counting the main update by its
    /// row count instead of carrying every updated row through a `RETURNING` is what the split
    /// buys: 0.80 → 0.87 × the single `UPDATE` (docs/PERFORMANCE.md).
    ///
    /// Both statements are prepared once per connection (sqlx's statement cache), so a batch
    /// sends each in one round trip; [`BEGIN_BATCH`]'s `plan_cache_mode = force_custom_plan` still
    /// plans every execution for its own cursor and shard count.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let Some((low, high)) = cursor.remaining() else {
            return Ok(Batch::nothing_left(cursor));
        };
        let limit = i64::from(self.batch_size.max(1));
        let sql = BatchSql::of(plan.walk);
        let (scanned, last, odd): (i64, Option<i64>, i64) = sqlx::query_as(&sql.page)
            .bind(plan.month)
            .bind(low)
            .bind(high)
            .bind(plan.shards)
            .bind(plan.shard)
            .bind(limit)
            .bind(self.rule.grace_days)
            .bind(self.rule.daily_rate_cents)
            .bind(self.rule.max_cents)
            .fetch_one(&mut *tx)
            .await?;
        let Some(last) = last else {
            return Ok(Batch::nothing_left(cursor));
        };
        let (from, to, cursor) = match plan.walk {
            Walk::Up => (
                low,
                last,
                Cursor {
                    last_id: Some(last),
                    ..cursor
                },
            ),
            Walk::Down => (
                last,
                high,
                Cursor {
                    last_id_desc: Some(last),
                    ..cursor
                },
            ),
        };
        let rest = sqlx::query(&sql.settle)
            .bind(plan.month)
            .bind(from)
            .bind(to)
            .bind(plan.shards)
            .bind(plan.shard)
            .bind(self.rule.grace_days)
            .bind(self.rule.daily_rate_cents)
            .bind(self.rule.max_cents)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        Ok(Batch {
            cursor,
            scanned: scanned as u64,
            updated: odd as u64 + rest,
            odd: odd as u64,
            // A short page read every remaining row of the shard's month.
            done: scanned < limit,
        })
    }
}

/// How many loans the run of `key` still has to read inside `cursor` (its committed progress):
/// what its progress is measured against. One pass over the shard's month in
/// `loans_unsettled_by_month` (all of the month's unsettled entries: the shard is a filter), so
/// callers that show it often should keep it per attempt and bound it with a statement timeout.
pub async fn unsettled_after(
    db: impl PgExecutor<'_>,
    key: &JobKey,
    cursor: Cursor,
) -> sqlx::Result<u64> {
    unsettled(db, &MonthPlan::for_key(key)?, cursor).await
}

async fn unsettled(db: impl PgExecutor<'_>, plan: &MonthPlan, cursor: Cursor) -> sqlx::Result<u64> {
    let Some((low, high)) = cursor.remaining() else {
        return Ok(0);
    };
    let remaining: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM loans
          WHERE {MONTH_KEY} = $1 AND fine_settled_at IS NULL AND returned_on IS NOT NULL
            AND id + 0 BETWEEN $2 AND $3 AND (id % $4 + $4) % $4 = $5"
    ))
    .bind(plan.month)
    .bind(low)
    .bind(high)
    .bind(plan.shards)
    .bind(plan.shard)
    .fetch_one(db)
    .await?;
    Ok(remaining as u64)
}

/// Loans whose dates contradict each other: returned, or due, before they were borrowed. They are
/// settled by the same rule as every other loan (the rule only reads `due_on` and `returned_on`,
/// saturating, so any dates give a fine between 0 and the cap), and counted: `odd` in the run's
/// report, `settlementd_odd_rows_total`, a warning in the log. A loan returned decades late, or
/// due decades after it came back, is consistent, not odd: it gets the cap, or 0.
pub const ODD_ROW: &str = "(l.returned_on < l.borrowed_on OR l.due_on < l.borrowed_on)";

/// The two statements of a batch of one walk.
///
/// `page`: `$1` month key, `$2`..`$3` the ids still to walk (inclusive), `$4`/`$5` shard count and
/// index, `$6` batch size, `$7`..`$9` the fine rule. Returns (rows read, last id read, odd rows
/// settled, see [`ODD_ROW`]); the last id read is the largest of the page walking up, the
/// smallest walking down.
///
/// `settle`: `$1` month key, `$2`..`$3` the batch's ids (from the remaining range's start to the
/// page's last id, or from the page's last id to the range's end), `$4`/`$5` shard count and
/// index, `$6`..`$8` the fine rule.
#[derive(Debug)]
pub struct BatchSql {
    pub page: String,
    pub settle: String,
}

impl BatchSql {
    pub fn of(walk: Walk) -> &'static BatchSql {
        static UP: OnceLock<BatchSql> = OnceLock::new();
        static DOWN: OnceLock<BatchSql> = OnceLock::new();
        match walk {
            Walk::Up => {
                UP.get_or_init(|| BatchSql::new("", "max", "$2", "(SELECT last FROM stats)"))
            }
            Walk::Down => {
                DOWN.get_or_init(|| BatchSql::new(" DESC", "min", "(SELECT last FROM stats)", "$3"))
            }
        }
    }

    fn new(order: &str, last: &str, from: &str, to: &str) -> BatchSql {
        let page = format!(
            "WITH page AS (
                 SELECT id FROM loans
                  WHERE {MONTH_KEY} = $1 AND fine_settled_at IS NULL AND returned_on IS NOT NULL
                    AND id + 0 BETWEEN $2 AND $3 AND ($4 = 1 OR (id % $4 + $4) % $4 = $5)
                  ORDER BY id + 0{order}
                  LIMIT $6
             ), stats AS (
                 SELECT count(*) AS n, {last}(id) AS last FROM page
             ), odd AS (
                 UPDATE loans l
                    SET fine_cents = {fine}, fine_settled_at = now()
                  WHERE date_trunc('month', l.returned_on::timestamp) = $1
                    AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                    AND l.id + 0 BETWEEN {from} AND {to}
                    AND ($4 = 1 OR (l.id % $4 + $4) % $4 = $5)
                    AND {ODD_ROW}
                 RETURNING 1
             )
             SELECT n, last, (SELECT count(*) FROM odd) FROM stats",
            fine = FineRule::sql_params(7),
        );
        let settle = format!(
            "UPDATE loans l
                SET fine_cents = {fine}, fine_settled_at = now()
              WHERE date_trunc('month', l.returned_on::timestamp) = $1
                AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                AND l.id + 0 BETWEEN $2 AND $3
                AND ($4 = 1 OR (l.id % $4 + $4) % $4 = $5)",
            fine = FineRule::sql_params(6),
        );
        BatchSql { page, settle }
    }
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
