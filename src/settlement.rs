//! The fine-settlement job: the loans SQL, one keyset batch per transaction.
//!
//! Shard `s` of `S` settles loans returned in the business date's month (first day through the
//! business date, inclusive), still unsettled (`fine_settled_at IS NULL`), with `id mod S = s`,
//! written `(id % S + S) % S` so a negative id (SQL's `%` keeps the dividend's sign) still belongs
//! to exactly one shard.
//! The update is conditional (`AND fine_settled_at IS NULL`): a row settled meanwhile by anyone
//! counts as scanned, not updated. `fine_settled_at` is the done-marker, never `fine_cents`.

use crate::calendar::BusinessDate;
use crate::config::ShardSpec;
use crate::fine::FineRule;
use crate::jobs::{Batch, Job, JobKey};
use chrono::NaiveDate;
use sqlx::{PgConnection, PgExecutor, PgPool};

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
}

/// Bounds of one run, fixed after the claim.
#[derive(Debug, Clone)]
pub struct MonthPlan {
    first: NaiveDate,
    last: NaiveDate,
    shards: i64,
    shard: i64,
    /// The smallest and largest id of the month's unsettled loans when the run was planned;
    /// `None` when there is nothing to settle (a re-run over a settled month stops here).
    ids: Option<(i64, i64)>,
    /// Rows per id in the table (1.0 for dense ids), to size each batch's id window.
    density: f64,
}

impl Job for FineSettlement {
    type Plan = MonthPlan;

    async fn plan(
        &self,
        pool: &PgPool,
        key: &JobKey,
        resume_after: Option<i64>,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        let business_date = BusinessDate::new(key.business_date)
            .map_err(|e| sqlx::Error::Protocol(format!("job key: {e}")))?;
        let first = business_date.first_day();
        let last = business_date.date();
        let after = resume_after.unwrap_or(i64::MIN);
        let ids = month_id_bounds(pool, first, last, after).await?;
        let plan = MonthPlan {
            first,
            last,
            shards: key.shards.into(),
            shard: key.shard.into(),
            ids,
            density: match ids {
                Some(_) => id_density(pool).await?,
                None => 1.0,
            },
        };
        let total = match (estimate, plan.ids) {
            (false, _) => None,
            (true, None) => Some(0),
            (true, Some(_)) => {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM loans
                      WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL
                        AND returned_on IS NOT NULL AND (id % $3 + $3) % $3 = $4 AND id > $5",
                )
                .bind(plan.first)
                .bind(plan.last)
                .bind(plan.shards)
                .bind(plan.shard)
                .bind(after)
                .fetch_one(pool)
                .await?;
                Some(n as u64)
            }
        };
        Ok((plan, total))
    }

    /// One batch: the next `batch_size` unsettled loans of this shard's month in id order (the
    /// table's physical order for an append-only table), settled by one conditional UPDATE.
    ///
    /// - `page` picks up to `batch_size` eligible rows inside an id window computed here, about
    ///   twice as many ids as this shard needs. The window is what keeps the plan cheap whatever
    ///   the estimates say: `id % S = s` gets a 0.5 % selectivity guess, and without a bound the
    ///   planner would bitmap-scan and sort the whole month for every batch; inside a window
    ///   every possible plan costs one window.
    /// - `settled` updates the page's id range with the same filters plus the conditional
    ///   `fine_settled_at IS NULL`, re-checked on the newest row version: a row settled meanwhile
    ///   by someone else counts as scanned (it is in `page`) but not updated. Re-scanning the range
    ///   costs less than joining `page` back by id or ctid (one probe per row).
    ///
    /// The statement is sent unnamed (`persistent(false)`), so PostgreSQL plans it with the actual
    /// bounds each time instead of switching to a generic plan after five executions.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        after: Option<i64>,
    ) -> sqlx::Result<Batch> {
        let Some((lo, hi)) = plan.ids else {
            return Ok(Batch {
                last_id: None,
                scanned: 0,
                updated: 0,
                done: true,
            });
        };
        let after = after.unwrap_or(i64::MIN).max(lo.saturating_sub(1));
        let limit = i64::from(self.batch_size.max(1));
        let span = (2.0 * (limit * plan.shards) as f64 / plan.density).ceil() as i128;
        let upto = (i128::from(after) + span).min(i128::from(hi)) as i64;
        let sql = format!(
            "WITH page AS (
                 SELECT id FROM loans
                  WHERE id > $5 AND id <= $6
                    AND returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL
                    AND (id % $3 + $3) % $3 = $4
                  ORDER BY id
                  LIMIT $7
             ), stats AS (
                 SELECT count(*) AS n, max(id) AS last FROM page
             ), settled AS (
                 UPDATE loans l
                    SET fine_cents = {fine}, fine_settled_at = now()
                  WHERE l.id > $5 AND l.id <= (SELECT last FROM stats)
                    AND l.returned_on BETWEEN $1 AND $2 AND l.fine_settled_at IS NULL
                    AND (l.id % $3 + $3) % $3 = $4
                 RETURNING 1
             )
             SELECT n, last, (SELECT count(*) FROM settled) FROM stats",
            fine = FineRule::SQL_EXPR
                .replace("$grace", "$8")
                .replace("$rate", "$9")
                .replace("$max", "$10"),
        );
        let (scanned, page_end, updated): (i64, Option<i64>, i64) = sqlx::query_as(&sql)
            .persistent(false)
            .bind(plan.first)
            .bind(plan.last)
            .bind(plan.shards)
            .bind(plan.shard)
            .bind(after)
            .bind(upto)
            .bind(limit)
            .bind(self.rule.grace_days)
            .bind(self.rule.daily_rate_cents)
            .bind(self.rule.max_cents)
            .fetch_one(tx)
            .await?;
        // A full page may have left rows in the window: resume right after it. Otherwise the
        // whole window is done.
        let full = scanned >= limit;
        Ok(Batch {
            last_id: if full { page_end } else { Some(upto) },
            scanned: scanned as u64,
            updated: updated as u64,
            done: !full && upto >= hi,
        })
    }
}

/// The smallest and largest id of the month's unsettled loans after `after`, from the partial
/// index: two index probes per day of the month (about a millisecond) instead of reading every
/// entry of the month. A settled month has no live entries, so this finds nothing.
async fn month_id_bounds(
    db: impl PgExecutor<'_>,
    first: NaiveDate,
    last: NaiveDate,
    after: i64,
) -> sqlx::Result<Option<(i64, i64)>> {
    let (lo, hi): (Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT min(lo.id), max(hi.id)
           FROM generate_series($1::date, $2::date, interval '1 day') AS d(day)
          CROSS JOIN LATERAL (
                SELECT id FROM loans
                 WHERE returned_on = d.day::date AND fine_settled_at IS NULL AND id > $3
                 ORDER BY id LIMIT 1) lo
          CROSS JOIN LATERAL (
                SELECT id FROM loans
                 WHERE returned_on = d.day::date AND fine_settled_at IS NULL AND id > $3
                 ORDER BY id DESC LIMIT 1) hi",
    )
    .bind(first)
    .bind(last)
    .bind(after)
    .fetch_one(db)
    .await?;
    Ok(lo.zip(hi))
}

/// Rows per id over the whole table, from the planner's row count and the primary key's ends
/// (two index probes). Sparse ids widen each batch's window; a wrong guess only changes how many
/// rows a batch finds, never which rows are settled.
async fn id_density(db: impl PgExecutor<'_>) -> sqlx::Result<f64> {
    let density: Option<f64> = sqlx::query_scalar(
        "SELECT (SELECT reltuples FROM pg_class WHERE oid = 'loans'::regclass)::float8
                / NULLIF((SELECT max(id) FROM loans) - (SELECT min(id) FROM loans) + 1, 0)::float8",
    )
    .fetch_one(db)
    .await?;
    // reltuples is -1 before the first ANALYZE: assume dense ids then.
    Ok(match density {
        Some(d) if d > 0.0 => d.clamp(1e-9, 1.0),
        _ => 1.0,
    })
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
