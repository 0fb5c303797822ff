//! The fleet: which `serve` processes run, of which release, and whether each is ready (`replicas`).
//!
//! Every `serve` process upserts its row once a heartbeat ([`report`]), from a task of its own
//! whatever its runs do (`crate::daemon`'s liveness task): its owner name (the one its claims
//! carry), its release and commit, the jobs it schedules, its shard, and its readiness with the
//! reason. `status` and the page read them back ([`list`]) with what each one is doing — the claims
//! it holds RUNNING in `job_runs`, which its own heartbeats keep — beside each claim's own release
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

/// A claim a replica holds RUNNING in `job_runs`: what it is doing.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Running {
    pub job_name: String,
    pub business_date: chrono::NaiveDate,
    pub shards: i32,
    pub shard: i32,
    pub attempt: i32,
    /// Seconds since the claim's heartbeat (database clock).
    pub heartbeat_age_secs: f64,
}

impl std::fmt::Display for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} shard {} of {} (attempt {})",
            self.job_name, self.business_date, self.shard, self.shards, self.attempt
        )
    }
}

/// One row of `replicas`, with how long ago it reported (database clock), and what it runs.
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
    /// The claims it holds RUNNING, read from `job_runs` with its row (the claims are the
    /// ground truth of what a replica runs: its own heartbeats keep them); empty: idle.
    #[sqlx(json)]
    pub doing: Vec<Running>,
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

/// The shards of count `shards` that a live replica (reported within `live_within` seconds) of
/// `job` owns: those a replica runs by itself. The page's cells and every verdict's advice ask it.
pub fn takers(
    members: &[Member],
    job: &str,
    shards: u32,
    live_within: f64,
) -> std::collections::BTreeSet<u32> {
    members
        .iter()
        .filter(|m| m.is_live(live_within) && m.shards == shards as i32)
        .filter(|m| m.jobs.iter().any(|j| j == job))
        .filter_map(|m| u32::try_from(m.shard).ok())
        .collect()
}

/// Every replica's row, by shard count, shard and owner, with the claims it holds RUNNING. `None`
/// when the table is not there (the schema predates it): the fleet is unknown, which is not an
/// error for a reader.
pub async fn list(db: impl PgExecutor<'_>) -> Result<Option<Vec<Member>>> {
    let rows = sqlx::query_as(
        "SELECT r.owner, r.version, r.commit, r.jobs, r.shards, r.shard, r.started_at, r.seen_at,
                extract(epoch FROM clock_timestamp() - r.seen_at)::float8 AS seen_age_secs,
                r.ready, r.reason,
                (SELECT coalesce(json_agg(json_build_object(
                            'job_name', j.job_name, 'business_date', j.business_date,
                            'shards', j.shards, 'shard', j.shard, 'attempt', j.attempt,
                            'heartbeat_age_secs',
                            extract(epoch FROM clock_timestamp() - j.heartbeat_at)::float8)
                          ORDER BY j.job_name, j.business_date, j.shards, j.shard), '[]')
                   FROM job_runs j
                  WHERE j.owner = r.owner AND j.status = 'RUNNING') AS doing
           FROM replicas r
          ORDER BY r.shards, r.shard, r.owner",
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
