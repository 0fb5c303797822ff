//! Pausing a job: stop everything now without undeploying (Oban's pause, a CronJob's `suspend`).
//!
//! A pause is a row of `job_pauses`, so every replica sees it: a claim of a paused job claims
//! nothing ([`super::JobError::Paused`], checked in the claim's transaction), and a run in flight
//! stops at its next batch, marked FAILED
//! `interrupted: paused …` — resumed after [`resume`] like any interrupted run, at its committed
//! cursor. Who paused, when and why are kept for `status`, the page and
//! `settlementd_paused{job_name}`; every pause and resume also stays in `job_events` (who, why,
//! when: [`history`]).
//!
//! A run stops within a batch: each batch's progress write reads the pause in the batch's own
//! transaction ([`super::claim::record_batch`]), so once `pause` returns, no batch of the job
//! commits but those whose write was already past that point (one per run in flight).

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
            wrote: None,
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
        "WITH paused AS (
             INSERT INTO job_pauses (job_name, paused_by, reason) VALUES ($1, $2, $3)
             ON CONFLICT (job_name) DO NOTHING
             RETURNING job_name, paused_by, paused_at, reason
         )
         INSERT INTO job_events (job_name, business_date, shards, shard, event, owner, message, at)
         SELECT job_name, (paused_at AT TIME ZONE 'UTC')::date, 0, 0, 'paused', paused_by, reason,
                paused_at
           FROM paused",
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

/// Resumes `job_name`, as `by`; returns the pause it ended (`None`: it was not paused).
pub async fn resume(db: impl PgExecutor<'_>, job_name: &str, by: &str) -> Result<Option<Pause>> {
    Ok(sqlx::query_as(
        "WITH resumed AS (
             DELETE FROM job_pauses WHERE job_name = $1
             RETURNING job_name, paused_by, paused_at, reason
         ), event AS (
             INSERT INTO job_events (job_name, business_date, shards, shard, event, owner, message)
             SELECT job_name, (clock_timestamp() AT TIME ZONE 'UTC')::date, 0, 0, 'resumed', $2,
                    format('resumed the pause of %s by %s (%s)',
                           to_char(paused_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS \"UTC\"'),
                           paused_by, reason)
               FROM resumed
         )
         SELECT job_name, paused_by, paused_at, reason FROM resumed",
    )
    .bind(job_name)
    .bind(by)
    .fetch_optional(db)
    .await?)
}

/// A pause or a resume as the audit trail keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Change {
    pub job_name: String,
    /// `paused` or `resumed`.
    pub event: String,
    pub at: DateTime<Utc>,
    /// Who: the operator and the command or endpoint.
    pub by: String,
    /// The pause's reason; for a resume, which pause it ended.
    pub message: Option<String>,
}

/// The latest `limit` pauses and resumes of `job_name`, newest first. They are kept in
/// `job_events` under shard count 0, which no run uses, dated the day they happened (UTC).
pub async fn history(db: impl PgExecutor<'_>, job_name: &str, limit: i64) -> Result<Vec<Change>> {
    Ok(sqlx::query_as(
        "SELECT job_name, event, at, owner AS by, message FROM job_events
          WHERE job_name = $1 AND shards = 0 AND event IN ('paused', 'resumed')
          ORDER BY id DESC LIMIT $2",
    )
    .bind(job_name)
    .bind(limit)
    .fetch_all(db)
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
