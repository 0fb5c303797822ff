//! The generic job layer: claim, lease, fencing. It knows nothing of loans.
//!
//! A run of a job is identified by a [`JobKey`] (job, business date, shard count, shard) and owns
//! one `job_runs` row while it works. Invariants:
//! - at most one live claim per key: `INSERT … ON CONFLICT DO NOTHING`, else a takeover that only
//!   succeeds on FAILED rows, RUNNING rows whose heartbeat is older than the lease (database clock),
//!   or — with `force` — SUCCESS rows; every takeover bumps `attempt`;
//! - every write of a run (batch, progress, success, failure) is fenced by `attempt` in the same
//!   transaction; zero rows affected means the claim was lost and nothing is written;
//! - SUCCESS blocks re-runs unless forced.
//!
//! A [`Job`] supplies the work one batch at a time; [`runner::run_once`] drives it.

pub mod claim;
pub mod events;
pub mod lease;
pub mod requests;
pub mod runner;

use chrono::NaiveDate;
use sqlx::{PgConnection, PgPool};
use std::borrow::Cow;
use std::fmt;
use std::future::Future;

pub use claim::{Claim, ClaimOutcome};
pub use runner::{run_once, Progress, RunOptions, RunReport, SkipReason};

/// The idempotency key of one run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JobKey {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub shards: u32,
    pub shard: u32,
}

impl fmt::Display for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} shard {}/{}",
            self.job_name, self.business_date, self.shard, self.shards
        )
    }
}

/// Who holds a claim: host (or pod) name plus a per-process id, so two processes on one host
/// (or one pod restarted, where the pid is 1 again) are different owners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner(pub String);

impl Owner {
    pub fn for_process() -> Self {
        let host = std::env::var("POD_NAME")
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| hostname::get().ok().and_then(|h| h.into_string().ok()))
            .unwrap_or_else(|| "unknown-host".into());
        let nonce: u32 = rand::random();
        Self(format!("{host}/{}-{nonce:08x}", std::process::id()))
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What one committed batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Batch {
    /// Keyset cursor after this batch (the last id read); `None` when nothing was read.
    pub last_id: Option<i64>,
    pub scanned: u64,
    pub updated: u64,
    /// Items done that the job flags for an operator's attention (for the fine settlement: loans
    /// whose dates contradict each other). Counted in the report and a metric, never skipped.
    pub odd: u64,
    /// No more work after this batch.
    pub done: bool,
}

/// A unit of work the job layer can run idempotently, one batch per transaction.
pub trait Job: Sync {
    /// Per-run state computed once after the claim (bounds, parameters).
    type Plan: Send + Sync;

    /// Prepares a run of `key` that resumes after `resume_after`. With `estimate`, also returns
    /// how many items remain, for progress display only.
    fn plan(
        &self,
        pool: &PgPool,
        key: &JobKey,
        resume_after: Option<i64>,
        estimate: bool,
    ) -> impl Future<Output = sqlx::Result<(Self::Plan, Option<u64>)>> + Send;

    /// The statement that opens each batch transaction: `BEGIN`, optionally followed (in the same
    /// round trip) by `SET LOCAL` settings the job's statements rely on (plan settings, and the
    /// server-side timeouts that keep a paused writer from holding locks past its lease).
    fn begin_batch(&self) -> Cow<'static, str> {
        Cow::Borrowed("BEGIN")
    }

    /// Does one batch inside the caller's transaction. Must be idempotent in effect: items already
    /// done count as scanned but not updated.
    fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &Self::Plan,
        after: Option<i64>,
    ) -> impl Future<Output = sqlx::Result<Batch>> + Send;
}

/// Errors of the job layer. [`JobError::is_retryable`] tells a scheduler whether trying the same
/// key again soon can help.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("database error: {}", describe_db_error(.0))]
    Db(#[from] sqlx::Error),
    #[error("lease lost: {key} attempt {attempt} was taken over by another owner; stopped without writing")]
    LeaseLost { key: JobKey, attempt: i32 },
    #[error("interrupted: shutdown")]
    Interrupted,
}

impl JobError {
    pub fn is_retryable(&self) -> bool {
        match self {
            JobError::Db(_) => true,
            // Someone else owns the key now; the scheduler watches it instead of fighting.
            JobError::LeaseLost { .. } | JobError::Interrupted => false,
        }
    }
}

/// A database error, with what the server's guards and restarts mean in words: those are the
/// errors an operator sees after a pause, a lock wait or a restart, and the SQLSTATE alone says
/// little.
fn describe_db_error(e: &sqlx::Error) -> String {
    let code = match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => {
            return format!(
                "the connection to the database broke or none could be had (server down or \
                 restarting, network cut, or the session ended by the server): {e}"
            )
        }
        _ => None,
    };
    let meaning = match code.as_deref() {
        Some("25P03") => {
            "the server ended the session: it sat idle inside a transaction longer than \
             idle_in_transaction_session_timeout (the process was paused or cut off)"
        }
        Some("55P03") => "a row lock was not granted within lock_timeout",
        Some("57014") => "the statement was cancelled (statement_timeout, or an operator)",
        Some("57P01" | "57P02" | "57P03") => "the database server is shutting down or restarting",
        Some("26000" | "42P05") => {
            "a prepared statement went missing or collided: a pooler in transaction mode \
             (use pool_mode = session)"
        }
        _ => return e.to_string(),
    };
    format!("{meaning}: {e}")
}

pub type Result<T, E = JobError> = std::result::Result<T, E>;
