//! Retention: the audit trail, run requests and claims of periods closed long ago, deleted in
//! batches, so these tables do not grow for ever.
//!
//! A period of a job is **prunable** when nothing of it happened for `older_than_days`: every
//! `job_runs` row of it (any shard count) is SUCCESS and finished before then, no event of it is
//! younger, no correction holds it, and no run request of it is younger than the key window
//! (`greatest(older_than_days, 30)` days: an `Idempotency-Key` replays for at least
//! [`KEYS_KEPT_DAYS`] days); besides, it lies before the job's lookback (so no replica will run it
//! again by itself) and nothing waits in it ([`super::Job::pending`]). Then its `job_events`, its
//! `run_requests` whose every shard succeeded (a range request with its last month), and its
//! `job_runs` rows go, a batch per transaction. Never deleted: a period that is not closed, the
//! pinned parameters (`job_params`: the rule a month was settled under), and the jobs' own records
//! (for the fine settlement: the money journal and `fine_adjustments`).
//!
//! **Where it is decided.** The runtime role holds no DELETE on these tables: every delete goes
//! through `settlementd_prune_period` (migration 20261207000002), a `SECURITY DEFINER` function
//! owned by the migration role, which judges the period in the statement that deletes it, judges
//! it again after deleting (a re-open that committed while it waited for a lock undoes the call),
//! and refuses `older_than_days` below 1. The lookback and what waits are this module's own
//! checks, made in the batch's transaction; they can only keep more.
//!
//! **What a dry run counts** is what those same calls delete: [`Retention::prunable`] runs them in
//! a transaction that it rolls back, so a range request's parent, which goes with whichever of
//! its months goes last, is counted exactly where the prune deletes it.
//!
//! It runs as a job of its own ([`Retention`], name [`NAME`]): `serve` claims the day's key
//! `(retention, <today>, 1, 0)` like any run, so one replica a day does it (`retention.enabled`);
//! `settlementd prune` runs it by hand (forced), or only counts (`--dry-run`).

use super::registry::Registry;
use super::{Batch, Claim, Cursor, Job};
use chrono::NaiveDate;
use sqlx::{PgConnection, PgPool};

/// The retention job's name in `job_runs` (not a job of the registry: it serves them all).
pub const NAME: &str = "retention";

/// The fewest days a run request (its `Idempotency-Key`) is kept after it was stored, whatever
/// `older_than_days` says: a client may replay it that long (docs/OPERATIONS.md). The function
/// `settlementd_prune_period` holds the same number; a test checks both.
pub const KEYS_KEPT_DAYS: u32 = 30;

/// One prunable period, and what deleting it removes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Prunable {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub events: i64,
    pub requests: i64,
    pub runs: i64,
}

/// The retention job.
pub struct Retention {
    /// The jobs whose periods it prunes (and itself).
    pub registry: Registry,
    /// The shard count their replicas run under: what waits is asked for under it.
    pub shards: u32,
    pub older_than_days: u32,
    /// For each job, the first period of its lookback (periods from there on are watched by the
    /// replicas and never pruned).
    pub lookback_starts: Vec<(&'static str, NaiveDate)>,
    /// Rows deleted per batch transaction.
    pub batch: i64,
    /// The batches' server-side guards, also set on the counting transaction of
    /// [`Retention::prunable`]: a lock held elsewhere stalls neither for long.
    pub guards: super::lease::Guards,
}

/// What one call of `settlementd_prune_period` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
struct Pruned {
    events: i64,
    requests: i64,
    runs: i64,
    /// `more` (events left), `done` (the period is gone) or `kept` (not closed long enough, or
    /// changed meanwhile: nothing deleted).
    #[sqlx(try_from = "String")]
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    More,
    Done,
    Kept,
}

impl TryFrom<String> for State {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.as_str() {
            "more" => Ok(State::More),
            "done" => Ok(State::Done),
            "kept" => Ok(State::Kept),
            other => Err(format!("settlementd_prune_period said {other:?}")),
        }
    }
}

/// Deletes up to `limit` rows of `(job_name, business_date)` as retention may, on `tx`.
async fn prune_period(
    tx: &mut PgConnection,
    job_name: &str,
    business_date: NaiveDate,
    older_than_days: u32,
    limit: i64,
) -> sqlx::Result<Pruned> {
    sqlx::query_as(
        "SELECT events, requests, runs, state FROM settlementd_prune_period($1, $2, $3, $4)",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(older_than_days as i32)
    .bind(limit.clamp(1, i64::from(i32::MAX)) as i32)
    .fetch_one(tx)
    .await
}

impl Retention {
    /// The candidates, oldest first: periods whose claims are all SUCCESS and finished long
    /// enough ago (the function decides the rest when it deletes).
    async fn candidates(&self, pool: &PgPool) -> sqlx::Result<Vec<(String, NaiveDate)>> {
        sqlx::query_as(
            "SELECT r.job_name, r.business_date FROM job_runs r
              GROUP BY r.job_name, r.business_date
             HAVING bool_and(r.status = 'SUCCESS')
                AND max(r.finished_at) < clock_timestamp() - make_interval(days => $1)
              ORDER BY r.business_date, r.job_name",
        )
        .bind(self.older_than_days as i32)
        .fetch_all(pool)
        .await
    }

    /// Whether this module keeps `(job_name, business_date)` whatever its age: a job this binary
    /// does not know, a period inside its job's lookback, or one where something waits (asked
    /// on `conn`, in the transaction that would delete it).
    async fn keeps(
        &self,
        conn: &mut PgConnection,
        job_name: &str,
        business_date: NaiveDate,
    ) -> sqlx::Result<bool> {
        if job_name == NAME {
            return Ok(false);
        }
        let Ok(job) = self.registry.get(job_name) else {
            // A job this binary does not know: its periods are not judged here.
            return Ok(true);
        };
        let watched = self
            .lookback_starts
            .iter()
            .find(|(name, _)| *name == job.name())
            .is_some_and(|(_, start)| business_date >= *start);
        if watched {
            return Ok(true);
        }
        let waiting = job
            .pending(conn, self.shards, std::slice::from_ref(&business_date))
            .await?;
        Ok(waiting
            .by_period
            .iter()
            .any(|p| p.business_date == business_date && p.late > 0))
    }

    /// The prunable periods, oldest first, with the rows each would free: the deletes the prune
    /// makes, made in one transaction and rolled back, so the counts are exactly the prune's.
    pub async fn prunable(&self, pool: &PgPool) -> sqlx::Result<Vec<Prunable>> {
        let candidates = self.candidates(pool).await?;
        let mut tx = pool
            .begin_with(format!("BEGIN; {}", self.guards.sql()))
            .await?;
        let mut prunable = Vec::new();
        for (job_name, business_date) in candidates {
            if self.keeps(&mut tx, &job_name, business_date).await? {
                continue;
            }
            let mut gone = Prunable {
                job_name,
                business_date,
                events: 0,
                requests: 0,
                runs: 0,
            };
            loop {
                let pruned = prune_period(
                    &mut tx,
                    &gone.job_name,
                    business_date,
                    self.older_than_days,
                    i64::from(i32::MAX),
                )
                .await?;
                gone.events += pruned.events;
                gone.requests += pruned.requests;
                gone.runs += pruned.runs;
                match pruned.state {
                    State::More => continue,
                    State::Done => prunable.push(gone),
                    State::Kept => {}
                }
                break;
            }
        }
        tx.rollback().await?;
        Ok(prunable)
    }
}

/// A retention run's periods, fixed after its claim, and where its cursor counts them from (a
/// takeover plans again: the periods an earlier attempt deleted are gone from its list).
pub struct RetentionPlan {
    periods: Vec<Prunable>,
    first: i64,
}

impl Job for Retention {
    type Plan = RetentionPlan;

    /// No identifying parameters (the default): how old is old enough is a run's option, not what
    /// it computes.
    const NAME: &'static str = NAME;
    const MONTHLY: bool = false;

    async fn plan(
        &self,
        pool: &PgPool,
        claim: &Claim,
        _estimate: bool,
    ) -> sqlx::Result<(RetentionPlan, Option<u64>)> {
        let periods = self.prunable(pool).await?;
        let total = periods
            .iter()
            .map(|p| (p.events + p.requests + p.runs) as u64);
        let total = total.sum();
        let first = claim.resume.last_id.map_or(0, |i| i + 1);
        Ok((RetentionPlan { periods, first }, Some(total)))
    }

    /// The next `batch` rows of the period at the cursor (`last_id`: the index of the period
    /// being deleted): its events first, then its finished requests and its claims; the cursor
    /// moves on when a period has nothing left. A period that is no longer prunable when its turn
    /// comes (run again meanwhile, or while this batch waited for a lock) is left alone: decided
    /// here and in `settlementd_prune_period`, in this batch's transaction.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &RetentionPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let next = cursor.last_id.map_or(0, |i| i + 1);
        let at = (next - plan.first).max(0) as usize;
        let Some(period) = plan.periods.get(at) else {
            return Ok(Batch::nothing_left(cursor));
        };
        let pruned = if self
            .keeps(&mut *tx, &period.job_name, period.business_date)
            .await?
        {
            None
        } else {
            Some(
                prune_period(
                    &mut *tx,
                    &period.job_name,
                    period.business_date,
                    self.older_than_days,
                    self.batch,
                )
                .await?,
            )
        };
        let deleted = pruned.map_or(0, |p| p.events + p.requests + p.runs);
        let moved_on = !pruned.is_some_and(|p| p.state == State::More);
        Ok(Batch {
            amount: 0,
            cursor: if moved_on {
                Cursor {
                    last_id: Some(next),
                    ..cursor
                }
            } else {
                cursor
            },
            scanned: 1,
            updated: deleted as u64,
            notes: Default::default(),
            done: moved_on && at + 1 >= plan.periods.len(),
        })
    }
}
