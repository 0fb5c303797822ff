//! The audit trail: `job_events`, appended and never updated or deleted.
//!
//! The job layer appends an event in the transaction that makes the change it records (a claim, a
//! takeover, SUCCESS, FAILED), so the trail and `job_runs` cannot disagree; a fencing rejection is
//! appended right after the refused write is rolled back, on a best-effort basis (the refusal
//! itself is what protects the data). What an auditor asks when a month was settled twice — who
//! re-ran it, when, and why — is answered by [`recent`].

use super::claim::Claim;
use super::{JobKey, Owner, Result};
use sqlx::PgExecutor;

/// Appends one event of `claim`'s attempt.
pub async fn append(
    db: impl PgExecutor<'_>,
    claim: &Claim,
    event: &str,
    request: Option<&str>,
    message: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO job_events
                (job_name, business_date, shards, shard, event, attempt, owner, request_id, message)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8::uuid, $9)",
    )
    .bind(&claim.key.job_name)
    .bind(claim.key.business_date)
    .bind(claim.key.shards as i32)
    .bind(claim.key.shard as i32)
    .bind(event)
    .bind(claim.attempt)
    .bind(&claim.owner.0)
    .bind(request)
    .bind(message)
    .execute(db)
    .await?;
    Ok(())
}

/// Appends one event of `key` that belongs to no attempt (a claim refused before it was made).
pub async fn append_unclaimed(
    db: impl PgExecutor<'_>,
    key: &JobKey,
    owner: &Owner,
    event: &str,
    request: Option<&str>,
    message: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO job_events
                (job_name, business_date, shards, shard, event, owner, request_id, message)
         VALUES ($1, $2, $3, $4, $5, $6, $7::uuid, $8)",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .bind(event)
    .bind(&owner.0)
    .bind(request)
    .bind(message)
    .execute(db)
    .await?;
    Ok(())
}

/// Records that a write of `claim`'s attempt was refused because a peer took the claim over. Best
/// effort: a failure to record it is logged, never raised over the lease loss itself.
pub async fn fencing_rejected(db: impl PgExecutor<'_>, claim: &Claim, what: &str) {
    let message = format!("{what} refused: the claim was taken over by a later attempt");
    if let Err(e) = append(db, claim, "fencing_rejected", None, Some(&message)).await {
        tracing::warn!(error = %e, "cannot record the fencing rejection in job_events");
    }
}

/// One row of the trail as `status` and the status page show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct JobEvent {
    pub shard: i32,
    pub at: chrono::DateTime<chrono::Utc>,
    pub event: String,
    pub attempt: Option<i32>,
    pub owner: String,
    pub request_id: Option<String>,
    pub message: Option<String>,
}

/// The last `per_shard` events of each shard of `job_name` for one business date and shard count,
/// newest first within each shard, shards in order.
pub async fn recent(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: chrono::NaiveDate,
    shards: u32,
    per_shard: u32,
) -> Result<Vec<JobEvent>> {
    Ok(sqlx::query_as(
        "SELECT e.shard, e.at, e.event, e.attempt, e.owner, e.request_id::text AS request_id,
                e.message
           FROM generate_series(0, $3 - 1) AS s(shard)
          CROSS JOIN LATERAL (
                SELECT * FROM job_events e
                 WHERE e.job_name = $1 AND e.shards = $3 AND e.shard = s.shard
                   AND e.business_date = $2
                 ORDER BY e.id DESC
                 LIMIT $4) e
          ORDER BY e.shard, e.id DESC",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(shards as i32)
    .bind(i64::from(per_shard))
    .fetch_all(db)
    .await?)
}

/// The events of one key, oldest first (for tests and audits).
pub async fn for_key(db: impl PgExecutor<'_>, key: &JobKey) -> Result<Vec<JobEvent>> {
    Ok(sqlx::query_as(
        "SELECT shard, at, event, attempt, owner, request_id::text AS request_id, message
           FROM job_events
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
          ORDER BY id",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .fetch_all(db)
    .await?)
}

/// The latest event of kind `event` of each shard of `job_name` under `shards`, for each of
/// `dates` that has one.
pub async fn latest_of_kind(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    dates: &[chrono::NaiveDate],
    event: &str,
) -> Result<Vec<ShardEvent>> {
    Ok(sqlx::query_as(
        "SELECT DISTINCT ON (e.business_date, e.shard)
                e.business_date, e.shard, e.at, e.event, e.attempt, e.owner,
                e.request_id::text AS request_id, e.message, NULL::text AS request_state
           FROM job_events e
          WHERE e.job_name = $1 AND e.shards = $2 AND e.business_date = ANY($3)
            AND e.event = $4
          ORDER BY e.business_date, e.shard, e.id DESC",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(dates)
    .bind(event)
    .fetch_all(db)
    .await?)
}

/// An event with its month and, for an event of a run request, where that request stands for the
/// event's shard now.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct ShardEvent {
    pub business_date: chrono::NaiveDate,
    #[sqlx(flatten)]
    #[serde(flatten)]
    pub event: JobEvent,
    /// `pending`, `running`, `succeeded` or `failed` (`run_request_shards.state`).
    pub request_state: Option<String>,
}

/// The last `per_shard` events of each shard of `job_name` under `shards`, across months (only
/// `month`'s, when given), newest first within each shard, shards in order; each run request's
/// current state for the shard joined to its events.
pub async fn latest_per_shard(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    month: Option<chrono::NaiveDate>,
    per_shard: u32,
) -> Result<Vec<ShardEvent>> {
    Ok(sqlx::query_as(
        "SELECT e.business_date, e.shard, e.at, e.event, e.attempt, e.owner,
                e.request_id::text AS request_id, e.message, r.state AS request_state
           FROM generate_series(0, $2 - 1) AS s(shard)
          CROSS JOIN LATERAL (
                SELECT * FROM job_events e
                 WHERE e.job_name = $1 AND e.shards = $2 AND e.shard = s.shard
                   AND ($3::date IS NULL OR e.business_date = $3)
                 ORDER BY e.id DESC
                 LIMIT $4) e
           LEFT JOIN run_request_shards r ON r.request_id = e.request_id AND r.shard = e.shard
          ORDER BY e.shard, e.id DESC",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(month)
    .bind(i64::from(per_shard))
    .fetch_all(db)
    .await?)
}
