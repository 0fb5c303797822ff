//! The seed's broken first attempt at settlement, kept only so the demo (and a test) can show its
//! trap: it uses `fine_cents = 0` as the "not settled" marker, so every loan whose fine is
//! legitimately zero is settled again by each run. The real job ([`crate::jobs::fine_settlement`]) uses
//! `fine_settled_at` and never calls this.

use crate::calendar::BusinessDate;
use crate::fine::FineRule;
use sqlx::PgExecutor;

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
        fine = FineRule::sql_params(3),
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
