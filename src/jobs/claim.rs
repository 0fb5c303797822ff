//! `job_runs` SQL: claim, takeover, and the fenced writes of a run.
//!
//! All lease arithmetic uses `clock_timestamp()` (the database's clock, not frozen at transaction
//! start like `now()`), so replicas with skewed clocks agree on who holds a lease.

use super::{Batch, JobKey, Owner, Result};
use sqlx::{Connection, PgConnection, PgExecutor};
use std::time::Duration;

/// A claim this process holds: every write must carry its `attempt`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub key: JobKey,
    pub attempt: i32,
    pub owner: Owner,
    /// Progress committed by an earlier attempt; a takeover resumes after it.
    pub resume_after: Option<i64>,
    /// True when this claim replaced an earlier attempt (FAILED, stale or forced).
    pub took_over: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    Won(Claim),
    /// Another owner holds a live lease.
    Held {
        owner: String,
        attempt: i32,
    },
    /// The key is SUCCESS and the run was not forced.
    AlreadyDone {
        attempt: i32,
    },
}

/// Claims `key` in one short transaction on `conn`.
///
/// Inserts a RUNNING row (attempt 1); when the key exists, takes over a FAILED row, a RUNNING row
/// whose heartbeat is older than `ttl`, or (with `force`) a SUCCESS row, bumping `attempt`.
/// A RUNNING row with a live lease is never taken, forced or not.
pub async fn claim(
    conn: &mut PgConnection,
    key: &JobKey,
    owner: &Owner,
    ttl: Duration,
    force: bool,
) -> Result<ClaimOutcome> {
    let mut tx = conn.begin().await?;
    let inserted: Option<i32> = sqlx::query_scalar(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at)
         VALUES ($1, $2, $3, $4, 'RUNNING', 1, $5, clock_timestamp(), clock_timestamp())
         ON CONFLICT (job_name, business_date, shards, shard) DO NOTHING
         RETURNING attempt",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .bind(&owner.0)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(attempt) = inserted {
        tx.commit().await?;
        return Ok(ClaimOutcome::Won(Claim {
            key: key.clone(),
            attempt,
            owner: owner.clone(),
            resume_after: None,
            took_over: false,
        }));
    }

    // The row exists. Take it over only if its holder is gone (or it is done and we force).
    // A forced re-run starts from the beginning; a takeover resumes after committed progress.
    let taken: Option<(i32, Option<i64>)> = sqlx::query_as(
        "UPDATE job_runs
            SET status = 'RUNNING', attempt = attempt + 1, owner = $5,
                started_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
                finished_at = NULL, last_error = NULL,
                last_id = CASE WHEN status = 'SUCCESS' THEN NULL ELSE last_id END,
                scanned = CASE WHEN status = 'SUCCESS' THEN 0 ELSE scanned END,
                updated = CASE WHEN status = 'SUCCESS' THEN 0 ELSE updated END
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
            AND (status = 'FAILED'
                 OR (status = 'RUNNING'
                     AND heartbeat_at < clock_timestamp() - make_interval(secs => $6))
                 OR (status = 'SUCCESS' AND $7))
         RETURNING attempt, last_id",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .bind(&owner.0)
    .bind(ttl.as_secs_f64())
    .bind(force)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((attempt, resume_after)) = taken {
        tx.commit().await?;
        return Ok(ClaimOutcome::Won(Claim {
            key: key.clone(),
            attempt,
            owner: owner.clone(),
            resume_after,
            took_over: true,
        }));
    }

    let (status, attempt, holder): (String, i32, String) = sqlx::query_as(
        "SELECT status, attempt, owner FROM job_runs
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(if status == "SUCCESS" {
        ClaimOutcome::AlreadyDone { attempt }
    } else {
        ClaimOutcome::Held {
            owner: holder,
            attempt,
        }
    })
}

/// Verifies the claim, renews its heartbeat and records a batch's progress, inside the batch's
/// transaction. `false` means the claim is lost: the caller must roll the batch back.
pub async fn record_batch(conn: &mut PgConnection, claim: &Claim, batch: &Batch) -> Result<bool> {
    let rows = sqlx::query(
        "UPDATE job_runs
            SET heartbeat_at = clock_timestamp(),
                last_id = COALESCE($6, last_id),
                scanned = scanned + $7, updated = updated + $8
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
            AND attempt = $5 AND status = 'RUNNING'",
    )
    .bind(&claim.key.job_name)
    .bind(claim.key.business_date)
    .bind(claim.key.shards as i32)
    .bind(claim.key.shard as i32)
    .bind(claim.attempt)
    .bind(batch.last_id)
    .bind(batch.scanned as i64)
    .bind(batch.updated as i64)
    .execute(conn)
    .await?
    .rows_affected();
    Ok(rows == 1)
}

/// Renews the lease. `false` means the claim is lost.
pub async fn heartbeat(db: impl PgExecutor<'_>, claim: &Claim) -> Result<bool> {
    fenced_update(db, claim, "heartbeat_at = clock_timestamp()", None).await
}

/// Marks the run SUCCESS. `false` means the claim was lost and nothing was written.
pub async fn mark_success(db: impl PgExecutor<'_>, claim: &Claim) -> Result<bool> {
    fenced_update(
        db,
        claim,
        "status = 'SUCCESS', finished_at = clock_timestamp(), heartbeat_at = clock_timestamp(), last_error = NULL",
        None,
    )
    .await
}

/// Marks the run FAILED so a peer can take it over at once. `false`: the claim was already lost.
pub async fn mark_failed(db: impl PgExecutor<'_>, claim: &Claim, error: &str) -> Result<bool> {
    fenced_update(
        db,
        claim,
        "status = 'FAILED', finished_at = clock_timestamp(), last_error = $6",
        Some(error),
    )
    .await
}

async fn fenced_update(
    db: impl PgExecutor<'_>,
    claim: &Claim,
    set: &str,
    error: Option<&str>,
) -> Result<bool> {
    let sql = format!(
        "UPDATE job_runs SET {set}
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
            AND attempt = $5 AND status = 'RUNNING'"
    );
    let mut query = sqlx::query(&sql)
        .bind(&claim.key.job_name)
        .bind(claim.key.business_date)
        .bind(claim.key.shards as i32)
        .bind(claim.key.shard as i32)
        .bind(claim.attempt);
    if let Some(error) = error {
        query = query.bind(error);
    }
    Ok(query.execute(db).await?.rows_affected() == 1)
}

/// One `job_runs` row as `status` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct JobRunRow {
    pub shard: i32,
    pub status: String,
    pub attempt: i32,
    pub owner: String,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Seconds since the last heartbeat, on the database clock.
    pub heartbeat_age_secs: f64,
    pub last_id: Option<i64>,
    pub scanned: i64,
    pub updated: i64,
    pub last_error: Option<String>,
}

/// Every row of `job_name` for one business date and shard count, by shard.
pub async fn rows_for(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: chrono::NaiveDate,
    shards: u32,
) -> Result<Vec<JobRunRow>> {
    Ok(sqlx::query_as(
        "SELECT shard, status, attempt, owner, started_at, finished_at,
                extract(epoch FROM clock_timestamp() - heartbeat_at)::float8 AS heartbeat_age_secs,
                last_id, scanned, updated, last_error
           FROM job_runs
          WHERE job_name = $1 AND business_date = $2 AND shards = $3
          ORDER BY shard",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(shards as i32)
    .fetch_all(db)
    .await?)
}
