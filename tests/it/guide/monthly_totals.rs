//! The monthly-totals job: each shard's settled fines of a month (how many, and their sum) at or
//! above `min_fine_cents`, after the fine settlement.

use crate::config::Settings;
use crate::job_layer::registry::Configured;
use crate::job_layer::{
    Batch, BusinessDate, Claim, Cursor, Finding, Found, Job, Phrase, Proof, ProveError,
};
use sqlx::{PgConnection, PgPool};

/// `[jobs.monthly_totals]`: the job's own keys (besides `enabled` and `cron`).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TotalsSettings {
    /// Fines below this are left out of the totals.
    #[serde(default)]
    pub min_fine_cents: u32,
}

pub struct MonthlyTotals {
    min_fine_cents: i64,
}

impl Configured<Settings> for MonthlyTotals {
    type Settings = TotalsSettings;
    // 05:00 on the 1st; it waits for the settlement in any case.
    const DEFAULT_CRON: &'static str = "0 0 5 1 * *";

    fn build(_settings: &Settings, own: TotalsSettings) -> Result<Self, String> {
        if own.min_fine_cents > 100_000 {
            return Err(format!(
                "min_fine_cents = {}: at most 100000 (1,000.00)",
                own.min_fine_cents
            ));
        }
        Ok(MonthlyTotals {
            min_fine_cents: own.min_fine_cents.into(),
        })
    }
}

/// What a run's one batch needs from its claim.
pub struct TotalsPlan {
    month: BusinessDate,
    shards: i32,
    shard: i32,
}

impl Job for MonthlyTotals {
    type Plan = TotalsPlan;
    const NAME: &'static str = "monthly-totals";

    /// A month runs once the settlement has closed it on every shard. (By name: a job's module
    /// uses no other job's.)
    fn after(&self) -> Option<&'static str> {
        Some("fine-settlement")
    }

    /// `verify --job monthly-totals`: each shard's row holds what the loans give now, and the
    /// month has totals at all.
    async fn prove(&self, pool: &PgPool, month: BusinessDate) -> Result<Option<Proof>, ProveError> {
        let (rows, differ, shards): (i64, i64, Vec<i64>) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE (t.loans, t.fine_cents) <> (l.n, l.cents)),
                    COALESCE(array_agg(t.shard::bigint ORDER BY t.shard)
                             FILTER (WHERE (t.loans, t.fine_cents) <> (l.n, l.cents)), '{}')
               FROM monthly_fine_totals t,
                    LATERAL (SELECT count(*) AS n, COALESCE(sum(fine_cents), 0) AS cents
                               FROM loans
                              WHERE returned_on BETWEEN $2 AND $1 AND fine_settled_at IS NOT NULL
                                AND fine_cents >= $3
                                AND (t.shards = 1 OR (id % t.shards + t.shards) % t.shards = t.shard)
                    ) l
              WHERE t.business_date = $1",
        )
        .bind(month.date())
        .bind(month.first_day())
        .bind(self.min_fine_cents)
        .fetch_one(pool)
        .await?;
        let findings = [
            Finding {
                key: "differ",
                what: Phrase::new(
                    "shard whose totals differ from the loans",
                    "shards whose totals differ from the loans",
                ),
                found: Found::new(differ, Some(shards)),
            },
            Finding {
                key: "never_run",
                what: Phrase::new("month without totals", "months without totals"),
                found: Found::new((rows == 0).into(), None),
            },
        ];
        Ok(Some(Proof::of_findings(Self::NAME, month, &findings)))
    }

    async fn plan(
        &self,
        _pool: &PgPool,
        claim: &Claim,
        _estimate: bool,
    ) -> sqlx::Result<(TotalsPlan, Option<u64>)> {
        let plan = TotalsPlan {
            month: claim.month,
            shards: claim.key.shards as i32,
            shard: claim.key.shard as i32,
        };
        Ok((plan, Some(1)))
    }

    /// One batch: the shard's totals, written (again) in the claim's fenced transaction.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &TotalsPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let written = sqlx::query(
            "INSERT INTO monthly_fine_totals (business_date, shards, shard, loans, fine_cents)
             SELECT $1, $3, $4, count(*), COALESCE(sum(fine_cents), 0) FROM loans
              WHERE returned_on BETWEEN $2 AND $1 AND fine_settled_at IS NOT NULL
                AND fine_cents >= $5
                AND ($3 = 1 OR (id % $3 + $3) % $3 = $4)
             ON CONFLICT (business_date, shards, shard)
             DO UPDATE SET loans = EXCLUDED.loans, fine_cents = EXCLUDED.fine_cents",
        )
        .bind(plan.month.date())
        .bind(plan.month.first_day())
        .bind(plan.shards)
        .bind(plan.shard)
        .bind(self.min_fine_cents)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        Ok(Batch {
            scanned: 1,
            updated: written,
            ..Batch::nothing_left(cursor)
        })
    }
}
