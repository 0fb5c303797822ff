//! The fine-settlement job: the loans SQL, one keyset batch per transaction.
//!
//! Shard `s` of `S` settles loans returned in the business date's month (first day through the
//! business date, inclusive), still unsettled (`fine_settled_at IS NULL`), with `id % S = s`.
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
}

impl Job for FineSettlement {
    type Plan = MonthPlan;

    fn name(&self) -> &str {
        JOB_NAME
    }

    async fn plan(
        &self,
        pool: &PgPool,
        key: &JobKey,
        resume_after: Option<i64>,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        let business_date = BusinessDate::new(key.business_date)
            .map_err(|e| sqlx::Error::Protocol(format!("job key: {e}")))?;
        let plan = MonthPlan {
            first: business_date.first_day(),
            last: business_date.date(),
            shards: key.shards.into(),
            shard: key.shard.into(),
        };
        let total = if estimate {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM loans
                  WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL
                    AND returned_on IS NOT NULL AND id % $3 = $4 AND id > $5",
            )
            .bind(plan.first)
            .bind(plan.last)
            .bind(plan.shards)
            .bind(plan.shard)
            .bind(resume_after.unwrap_or(i64::MIN))
            .fetch_one(pool)
            .await?;
            Some(n as u64)
        } else {
            None
        };
        Ok((plan, total))
    }

    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        after: Option<i64>,
    ) -> sqlx::Result<Batch> {
        let sql = format!(
            "WITH batch AS (
                 SELECT id FROM loans
                  WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL
                    AND returned_on IS NOT NULL AND id % $3 = $4 AND id > $5
                  ORDER BY id
                  LIMIT $6
             ), settled AS (
                 UPDATE loans l
                    SET fine_cents = {fine}, fine_settled_at = now()
                   FROM batch
                  WHERE l.id = batch.id AND l.fine_settled_at IS NULL
                 RETURNING 1
             )
             SELECT (SELECT count(*) FROM batch), (SELECT max(id) FROM batch),
                    (SELECT count(*) FROM settled)",
            fine = FineRule::SQL_EXPR
                .replace("$grace", "$7")
                .replace("$rate", "$8")
                .replace("$max", "$9"),
        );
        let (scanned, last_id, updated): (i64, Option<i64>, i64) = sqlx::query_as(&sql)
            .bind(plan.first)
            .bind(plan.last)
            .bind(plan.shards)
            .bind(plan.shard)
            .bind(after.unwrap_or(i64::MIN))
            .bind(i64::from(self.batch_size))
            .bind(self.rule.grace_days)
            .bind(self.rule.daily_rate_cents)
            .bind(self.rule.max_cents)
            .fetch_one(tx)
            .await?;
        Ok(Batch {
            last_id,
            scanned: scanned as u64,
            updated: updated as u64,
            done: scanned < i64::from(self.batch_size),
        })
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

/// The seed's broken first attempt, kept only to demonstrate its trap: it uses `fine_cents = 0` as
/// the "not settled" marker, so every loan whose fine is legitimately zero is settled again by each
/// run. Returns how many rows this run (re)processed. Never used by the real job.
pub async fn settle_with_zero_fine_marker(
    db: impl PgExecutor<'_>,
    business_date: BusinessDate,
    rule: FineRule,
) -> sqlx::Result<u64> {
    let sql = format!(
        "UPDATE loans l SET fine_cents = {fine}
          WHERE l.returned_on BETWEEN $1 AND $2 AND l.fine_cents = 0",
        fine = FineRule::SQL_EXPR
            .replace("$grace", "$3")
            .replace("$rate", "$4")
            .replace("$max", "$5"),
    );
    Ok(sqlx::query(&sql)
        .bind(business_date.first_day())
        .bind(business_date.date())
        .bind(rule.grace_days)
        .bind(rule.daily_rate_cents)
        .bind(rule.max_cents)
        .execute(db)
        .await?
        .rows_affected())
}
