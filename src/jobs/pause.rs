//! Pausing a job: stop everything now without undeploying (Oban's pause, a CronJob's `suspend`).
//!
//! A pause is a row of `job_pauses`, so every replica sees it: a claim of a paused job claims
//! nothing ([`super::JobError::Paused`], checked in the claim's transaction), and a run in flight
//! learns of it at its next heartbeat and stops after its current batch, marked FAILED
//! `interrupted: paused …` — resumed after [`resume`] like any interrupted run, at its committed
//! cursor. Who paused, when and why are kept for `status`, the page and
//! `settlementd_paused{job_name}`.

use super::Result;
use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

/// The longest reason accepted.
pub const MAX_REASON_LEN: usize = 2000;

/// A pause's reason, trimmed: it is what the next operator reads, so it must say something.
pub fn check_reason(reason: &str) -> std::result::Result<&str, String> {
    let reason = reason.trim();
    if reason.is_empty() || reason.len() > MAX_REASON_LEN {
        return Err(format!(
            "reason must say why, in 1 to {MAX_REASON_LEN} characters"
        ));
    }
    Ok(reason)
}

/// A job's pause as recorded.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Pause {
    pub job_name: String,
    pub paused_by: String,
    pub paused_at: DateTime<Utc>,
    pub reason: String,
}

/// The refusal of anything the pause stops: a run not started or stopped by it, a correction not
/// begun.
impl From<Pause> for super::JobError {
    fn from(pause: Pause) -> Self {
        super::JobError::Paused {
            job: pause.job_name,
            by: pause.paused_by,
            since: pause.paused_at,
            reason: pause.reason,
        }
    }
}

/// Pauses `job_name` (a pause already in place is kept as it was: who paused first, and why).
/// Returns the pause in force.
pub async fn pause(
    db: impl PgExecutor<'_> + Copy,
    job_name: &str,
    by: &str,
    reason: &str,
) -> Result<Pause> {
    sqlx::query(
        "INSERT INTO job_pauses (job_name, paused_by, reason) VALUES ($1, $2, $3)
         ON CONFLICT (job_name) DO NOTHING",
    )
    .bind(job_name)
    .bind(by)
    .bind(reason)
    .execute(db)
    .await?;
    let pause = of(db, job_name).await?;
    pause.ok_or_else(|| {
        super::JobError::Db(sqlx::Error::Protocol(format!(
            "the pause of {job_name} vanished"
        )))
    })
}

/// Resumes `job_name`; returns the pause it ended (`None`: it was not paused).
pub async fn resume(db: impl PgExecutor<'_>, job_name: &str) -> Result<Option<Pause>> {
    Ok(sqlx::query_as(
        "DELETE FROM job_pauses WHERE job_name = $1
         RETURNING job_name, paused_by, paused_at, reason",
    )
    .bind(job_name)
    .fetch_optional(db)
    .await?)
}

/// The pause of `job_name`, if it is paused.
pub async fn of(db: impl PgExecutor<'_>, job_name: &str) -> Result<Option<Pause>> {
    Ok(sqlx::query_as(
        "SELECT job_name, paused_by, paused_at, reason FROM job_pauses WHERE job_name = $1",
    )
    .bind(job_name)
    .fetch_optional(db)
    .await?)
}

/// Every pause in force, by job name.
pub async fn all(db: impl PgExecutor<'_>) -> Result<Vec<Pause>> {
    Ok(sqlx::query_as(
        "SELECT job_name, paused_by, paused_at, reason FROM job_pauses ORDER BY job_name",
    )
    .fetch_all(db)
    .await?)
}
