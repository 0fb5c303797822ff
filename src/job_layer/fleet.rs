//! The fleet: which `serve` processes run, of which release, and whether each is ready (`replicas`).
//!
//! Every `serve` process upserts its row once a heartbeat ([`report`]): its owner name (the one its
//! claims carry), its release and commit, the jobs it schedules, its shard, and its readiness with
//! the reason. `status` and the page read them back ([`list`]) beside each claim's own release
//! (`job_runs.version`), so a rolling update's mixed fleet is seen as one. A release before 0.2.0
//! writes no row: its claims show no version, and its owners appear only in `job_runs`.
//!
//! Rows are a report, never a decision: nothing is claimed or skipped because of them. A row not
//! seen for [`FORGET_AFTER_SECS`] is deleted by the next report of any replica.

use super::{Owner, Result};
use sqlx::PgExecutor;

/// A replica's row is deleted when it has not reported for a day.
pub const FORGET_AFTER_SECS: i64 = 24 * 3600;

/// What one process reports about itself.
#[derive(Debug, Clone)]
pub struct Report<'a> {
    pub owner: &'a Owner,
    pub jobs: &'a [&'static str],
    pub shards: u32,
    pub shard: u32,
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// `None` when ready, else why not.
    pub not_ready: Option<&'a str>,
}

/// Upserts `report` as this process's row (release and commit of this binary, seen now on the
/// database clock) and forgets rows not seen for [`FORGET_AFTER_SECS`].
pub async fn report(db: impl PgExecutor<'_>, report: &Report<'_>) -> Result<()> {
    let jobs: Vec<&str> = report.jobs.to_vec();
    sqlx::query(
        "WITH forgotten AS (
             DELETE FROM replicas
              WHERE seen_at < clock_timestamp() - make_interval(secs => $10) AND owner <> $1
         )
         INSERT INTO replicas (owner, version, commit, jobs, shards, shard, started_at, seen_at,
                               ready, reason)
         VALUES ($1, $2, $3, $4, $5, $6, $7, clock_timestamp(), $8, $9)
         ON CONFLICT (owner) DO UPDATE
            SET version = EXCLUDED.version, commit = EXCLUDED.commit, jobs = EXCLUDED.jobs,
                shards = EXCLUDED.shards, shard = EXCLUDED.shard,
                started_at = EXCLUDED.started_at, seen_at = EXCLUDED.seen_at,
                ready = EXCLUDED.ready, reason = EXCLUDED.reason",
    )
    .bind(&report.owner.0)
    .bind(crate::version::VERSION)
    .bind(crate::version::COMMIT)
    .bind(&jobs)
    .bind(report.shards as i32)
    .bind(report.shard as i32)
    .bind(report.started_at)
    .bind(report.not_ready.is_none())
    .bind(report.not_ready)
    .bind(FORGET_AFTER_SECS as f64)
    .execute(db)
    .await?;
    Ok(())
}

/// Deletes this process's row: a replica that stops cleanly leaves the fleet at once.
pub async fn leave(db: impl PgExecutor<'_>, owner: &Owner) -> Result<()> {
    sqlx::query("DELETE FROM replicas WHERE owner = $1")
        .bind(&owner.0)
        .execute(db)
        .await?;
    Ok(())
}

/// One row of `replicas`, with how long ago it reported (database clock).
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct Member {
    pub owner: String,
    pub version: String,
    pub commit: String,
    pub jobs: Vec<String>,
    pub shards: i32,
    pub shard: i32,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub seen_at: chrono::DateTime<chrono::Utc>,
    pub seen_age_secs: f64,
    pub ready: bool,
    pub reason: Option<String>,
}

impl Member {
    /// Reported within `within_secs` (say three heartbeats): running, as far as anyone knows.
    pub fn is_live(&self, within_secs: f64) -> bool {
        self.seen_age_secs <= within_secs
    }
}

/// How many live replicas (reported within `live_within` seconds) of shard count `shards` own each
/// of its shards, by shard index.
pub fn owners(members: &[Member], shards: u32, live_within: f64) -> Vec<usize> {
    let mut owners = vec![0; shards as usize];
    for m in members {
        if m.is_live(live_within) && m.shards == shards as i32 {
            if let Some(n) = usize::try_from(m.shard)
                .ok()
                .and_then(|i| owners.get_mut(i))
            {
                *n += 1;
            }
        }
    }
    owners
}

/// Every replica's row, by shard count, shard and owner. `None` when the table is not there (the
/// schema predates it): the fleet is unknown, which is not an error for a reader.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Option<Vec<Member>>> {
    let rows = sqlx::query_as(
        "SELECT owner, version, commit, jobs, shards, shard, started_at, seen_at,
                extract(epoch FROM clock_timestamp() - seen_at)::float8 AS seen_age_secs,
                ready, reason
           FROM replicas
          ORDER BY shards, shard, owner",
    )
    .fetch_all(db)
    .await;
    match rows {
        Ok(rows) => Ok(Some(rows)),
        // undefined_table: a schema from before the fleet was recorded.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Ok(None),
        Err(e) => Err(e.into()),
    }
}
