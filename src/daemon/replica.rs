//! One replica of one shard, one decision at a time.
//!
//! [`Replica::tick`] is the whole scheduling policy: read "now" from the injected [`Clock`], find
//! the latest slot at or before it, and — unless that slot's month is known SUCCESS or a retry is
//! not yet due — call [`jobs::run_once`] for it. The serve loop calls `tick` at start-up, on every
//! cron wake-up and on a timer; tests call it directly with a [`crate::clock::ManualClock`].
//!
//! Invariants:
//! - the month worked on comes only from the clock and the schedule, never from which wake-up
//!   fired, so a late, early, missed or doubled scheduler fire cannot pick a wrong month or skip
//!   one; a doubled fire is harmless because `run_once` is idempotent;
//! - whether a month is done is decided in SQL by the claim; the in-process `settled` memo only
//!   saves a round-trip until the next slot;
//! - once shutdown is requested, nothing new is claimed;
//! - when the scheduled month needs nothing, the tick sweeps the shard's closed months inside
//!   `settle.lookback_months` for late returns ([`Replica::sweep`]): one index probe per closed
//!   month, and a new fenced attempt of a month that has some;
//! - a claim refused because the month is pinned to another rule is logged once per month and
//!   retried with the backoff, like a failure, so a fixed configuration finishes the month.

use super::metrics as m;
use crate::calendar::BusinessDate;
use crate::clock::Clock;
use crate::config::{RetrySettings, Settings, ShardSpec};
use crate::jobs::Job;
use crate::jobs::{self, JobError, Owner, RunOptions, RunReport, SkipReason};
use crate::schedule::{latest_slot_at_or_before, next_slot_after, Slot};
use crate::settlement::{self, FineSettlement};
use chrono::{DateTime, TimeDelta, Utc};
use chrono_tz::Tz;
use croner::Cron;
use sqlx::PgPool;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The shortest pause between two ticks, so a timer that wakes a hair early never spins.
const MIN_WAIT: Duration = Duration::from_millis(50);

/// What one tick did.
#[derive(Debug)]
pub enum TickOutcome {
    /// No slot is due: the schedule never fired yet, or (without catch-up) its latest fire
    /// predates this replica.
    Idle,
    /// This tick ran the slot's month to SUCCESS.
    Settled { slot: Slot, report: RunReport },
    /// The slot's month is already SUCCESS (by this replica or a peer).
    AlreadyDone { slot: Slot },
    /// Another live replica holds the claim: check again in about a heartbeat, take over once
    /// its lease is stale.
    Watching { slot: Slot, reason: &'static str },
    /// The run failed with a retryable error (the row is FAILED); the next try is due after `after`.
    RetryScheduled {
        slot: Slot,
        failures: u32,
        after: Duration,
        error: String,
    },
    /// A retry is scheduled and not yet due.
    BackingOff { slot: Slot, until: DateTime<Utc> },
    /// Shutdown stopped the run between batches; it is marked FAILED `interrupted: shutdown`.
    Interrupted { slot: Slot },
    /// Shutdown was requested before this tick: nothing was claimed.
    ShuttingDown,
    /// This tick ran a stored run request for this shard ([`jobs::requests`]) to SUCCESS.
    Served {
        request_id: String,
        report: RunReport,
    },
    /// A stored run request's run failed; it is retried after `after`, like a scheduled month.
    RequestFailed {
        request_id: String,
        after: Duration,
        error: String,
    },
    /// The sweep settled late returns of a closed month of this shard.
    LateReturns {
        business_date: BusinessDate,
        report: RunReport,
    },
    /// The sweep's run of a closed month failed or was refused; it is retried after `after`.
    SweepFailed {
        business_date: BusinessDate,
        after: Duration,
        error: String,
    },
}

/// A pending retry of one month.
#[derive(Debug, Clone, Copy)]
struct Retry {
    business_date: BusinessDate,
    /// Consecutive failures of this month, for the backoff exponent.
    failures: u32,
    /// Clock time before which the month is not tried again.
    not_before: DateTime<Utc>,
}

pub struct Replica {
    pool: PgPool,
    job: FineSettlement,
    cron: Cron,
    tz: Tz,
    catch_up: bool,
    retry: RetrySettings,
    shard: ShardSpec,
    /// Owner, lease and heartbeat of every run this replica starts.
    opts: RunOptions,
    clock: Arc<dyn Clock>,
    /// Stops claiming and interrupts a run between batches.
    shutdown: CancellationToken,
    /// Clock time at start: without catch-up, slots that fired before it are not run.
    started_at: DateTime<Utc>,
    /// The month last seen SUCCESS: a shortcut until the next slot, never the source of truth.
    settled: Option<BusinessDate>,
    pending_retry: Option<Retry>,
    /// Run requests whose last run failed: consecutive failures and when to try again.
    request_retries: HashMap<String, (u32, DateTime<Utc>)>,
    /// Closed months whose late returns' run failed: consecutive failures and when to try again.
    sweep_retries: HashMap<BusinessDate, (u32, DateTime<Utc>)>,
    /// `settle.lookback_months`: how far back the sweep looks (0: it does not settle).
    lookback_months: u32,
    /// Months whose rule conflict has been logged: once per month is enough.
    conflicts_logged: HashSet<BusinessDate>,
    /// Every log line of this replica carries shard, shards and owner.
    span: tracing::Span,
}

impl Replica {
    pub fn new(
        pool: PgPool,
        settings: &Settings,
        clock: Arc<dyn Clock>,
        shutdown: CancellationToken,
    ) -> Self {
        let opts = crate::app::run_options(settings, false, false);
        let span = tracing::info_span!(
            "replica",
            shard = settings.shard.index,
            shards = settings.shard.count,
            owner = %opts.owner,
        );
        Self {
            pool,
            job: crate::app::settlement_job(settings),
            cron: settings.schedule.cron.clone(),
            tz: settings.schedule.timezone,
            catch_up: settings.schedule.catch_up,
            retry: settings.retry,
            shard: settings.shard,
            started_at: clock.now(),
            opts,
            clock,
            shutdown,
            settled: None,
            pending_retry: None,
            request_retries: HashMap::new(),
            sweep_retries: HashMap::new(),
            lookback_months: settings.settle.lookback_months,
            conflicts_logged: HashSet::new(),
            span,
        }
    }

    /// The same replica under `owner` (the process's name in claims and in the audit trail, shared
    /// with its HTTP endpoints).
    pub fn with_owner(mut self, owner: Owner) -> Self {
        self.span = tracing::info_span!(
            "replica",
            shard = self.shard.index,
            shards = self.shard.count,
            owner = %owner,
        );
        self.opts.owner = owner;
        self
    }

    pub fn owner(&self) -> &Owner {
        &self.opts.owner
    }

    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Decides what is due now and does it (at most one run), then publishes the latest month's
    /// state for the "month not closed" alert.
    pub async fn tick(&mut self) -> TickOutcome {
        let span = self.span.clone();
        let outcome = self.tick_inner().instrument(span.clone()).await;
        if !self.shutdown.is_cancelled() {
            self.publish_latest_month().instrument(span).await;
        }
        outcome
    }

    /// How long the serve loop may sleep before the next tick: at most one lease heartbeat (the
    /// periodic check that guards against a missed scheduler fire), less when the next fire or a
    /// retry is due sooner.
    pub fn next_wake(&self) -> Duration {
        let now = self.clock.now();
        let until = |t: DateTime<Utc>| (t - now).to_std().unwrap_or(Duration::ZERO);
        let mut wait = self.opts.heartbeat_every;
        if let Some(next) = next_slot_after(&self.cron, self.tz, now) {
            wait = wait.min(until(next.with_timezone(&Utc)));
        }
        if let Some(retry) = &self.pending_retry {
            if now < retry.not_before {
                wait = wait.min(until(retry.not_before));
            }
        }
        wait.max(MIN_WAIT)
    }

    async fn tick_inner(&mut self) -> TickOutcome {
        let outcome = self.scheduled().await;
        // At most one run per tick: the sweep runs when the schedule had nothing to run.
        let idle = matches!(
            outcome,
            TickOutcome::Idle
                | TickOutcome::AlreadyDone { .. }
                | TickOutcome::Watching { .. }
                | TickOutcome::BackingOff { .. }
        );
        if !idle || self.shutdown.is_cancelled() {
            return outcome;
        }
        match self.sweep().await {
            Some(swept) => swept,
            None => outcome,
        }
    }

    /// Run requests first, then the scheduled month (or the oldest unfinished one).
    async fn scheduled(&mut self) -> TickOutcome {
        let now = self.clock.now();
        if let Some(next) = next_slot_after(&self.cron, self.tz, now) {
            metrics::gauge!(m::NEXT_FIRE_TIMESTAMP).set(next.timestamp() as f64);
        }
        if self.shutdown.is_cancelled() {
            return TickOutcome::ShuttingDown;
        }
        if let Some(outcome) = self.serve_a_request(now).await {
            return outcome;
        }
        let Some(fire_at) = latest_slot_at_or_before(&self.cron, self.tz, now) else {
            return TickOutcome::Idle;
        };
        let mut slot = Slot::new(fire_at);
        if !self.catch_up && fire_at.with_timezone(&Utc) < self.started_at {
            return TickOutcome::Idle;
        }
        if self.catch_up {
            // A month this shard's deployment started but never finished comes before the latest
            // slot, oldest first: a month still failing when the next fire arrives, or months
            // missed by an outage spanning several fires, are never abandoned.
            match self.oldest_unfinished_before(slot.business_date).await {
                Ok(Some(older)) => {
                    slot = self.slot_of(older).unwrap_or(Slot {
                        fire_at,
                        business_date: older,
                    })
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "cannot look for unfinished months"),
            }
        }
        if self.settled == Some(slot.business_date) {
            return TickOutcome::AlreadyDone { slot };
        }
        if let Some(retry) = self.pending_retry {
            if retry.business_date != slot.business_date {
                // A new slot: the old month's retries are over (its row stays FAILED and is
                // caught up only if it is the latest slot again, which it is not).
                self.pending_retry = None;
            } else if now < retry.not_before {
                return TickOutcome::BackingOff {
                    slot,
                    until: retry.not_before,
                };
            }
        }

        let key = settlement::key(slot.business_date, self.shard);
        let started = Instant::now();
        let result = jobs::run_once(
            &self.pool,
            &self.job,
            key,
            &self.opts,
            &self.shutdown,
            &|_| {},
        )
        .await;
        let claimed = !matches!(&result, Ok(r) if r.skipped.is_some());
        if claimed {
            metrics::histogram!(m::RUN_DURATION_SECONDS).record(started.elapsed().as_secs_f64());
            let late = (now - fire_at.with_timezone(&Utc)).as_seconds_f64();
            metrics::gauge!(m::LAST_RUN_LATENESS_SECONDS).set(late.max(0.0));
        }
        match result {
            Ok(report) => match report.skipped {
                None => {
                    metrics::counter!(m::RUNS_TOTAL, "outcome" => "settled").increment(1);
                    metrics::gauge!(m::LAST_SUCCESS_TIMESTAMP)
                        .set(self.clock.now().timestamp() as f64);
                    self.settled = Some(slot.business_date);
                    self.pending_retry = None;
                    TickOutcome::Settled { slot, report }
                }
                Some(SkipReason::AlreadyDone) => {
                    metrics::counter!(m::RUNS_TOTAL, "outcome" => "skipped").increment(1);
                    self.settled = Some(slot.business_date);
                    self.pending_retry = None;
                    TickOutcome::AlreadyDone { slot }
                }
                Some(SkipReason::Held | SkipReason::RequestServed) => {
                    metrics::counter!(m::RUNS_TOTAL, "outcome" => "skipped").increment(1);
                    tracing::info!(business_date = %slot.business_date, "a live peer holds the claim; watching it");
                    TickOutcome::Watching {
                        slot,
                        reason: "held by a live peer",
                    }
                }
            },
            Err(JobError::Interrupted) => {
                metrics::counter!(m::RUNS_TOTAL, "outcome" => "failed").increment(1);
                TickOutcome::Interrupted { slot }
            }
            Err(e @ JobError::LeaseLost { .. }) => {
                metrics::counter!(m::RUNS_TOTAL, "outcome" => "lease_lost").increment(1);
                tracing::warn!(error = %e, "lost the claim to a peer; watching it");
                TickOutcome::Watching {
                    slot,
                    reason: "taken over by a peer",
                }
            }
            Err(e) => {
                metrics::counter!(m::RUNS_TOTAL, "outcome" => failed_outcome(&e)).increment(1);
                let failures = match self.pending_retry {
                    Some(r) if r.business_date == slot.business_date => r.failures + 1,
                    _ => 1,
                };
                let (after, not_before) = self.retry_after(failures);
                self.pending_retry = Some(Retry {
                    business_date: slot.business_date,
                    failures,
                    not_before,
                });
                self.log_failure(slot.business_date, &e, failures, after);
                TickOutcome::RetryScheduled {
                    slot,
                    failures,
                    after,
                    error: e.to_string(),
                }
            }
        }
    }

    /// The pause before retry number `failures` of anything ([`backoff`], jittered), and the clock
    /// time it ends.
    fn retry_after(&self, failures: u32) -> (Duration, DateTime<Utc>) {
        let after = backoff(
            failures,
            self.retry.initial_secs,
            self.retry.max_secs,
            rand::random::<f64>(),
        );
        let not_before =
            self.clock.now() + TimeDelta::from_std(after).unwrap_or(TimeDelta::seconds(1));
        (after, not_before)
    }

    /// A failed or refused run, in the log: a rule conflict once per month (it repeats at every
    /// retry until the configuration or the pin changes), anything else every time.
    fn log_failure(&mut self, month: BusinessDate, e: &JobError, failures: u32, after: Duration) {
        if matches!(e, JobError::ParamsConflict { .. }) {
            if self.conflicts_logged.insert(month) {
                tracing::error!(
                    error = %e,
                    business_date = %month,
                    retry_in_secs = after.as_secs_f64(),
                    "rule conflict: this replica's fine rule for the month is not the one its first \
                     claim pinned; nothing of it is settled here until the configuration agrees \
                     (retrying with backoff)"
                );
            }
            return;
        }
        tracing::warn!(
            error = %e,
            retryable = e.is_retryable(),
            failures,
            retry_in_secs = after.as_secs_f64(),
            business_date = %month,
            "run failed; retrying with backoff"
        );
    }

    /// Looks for late returns of this shard in its closed months inside the lookback — the months
    /// whose claim is SUCCESS, from `settle.lookback_months` months before the current one up to
    /// last month — with one index probe per month, publishes what waits and what is held, and
    /// runs the oldest month that has late returns (not backing off) as a new fenced attempt
    /// under the month's pinned rule. `None` when nothing was run.
    async fn sweep(&mut self) -> Option<TickOutcome> {
        let now = self.clock.now();
        let today = now.with_timezone(&self.tz).date_naive();
        let latest = BusinessDate::month_before(today);
        // The gauges cover last month at least, also with the sweep turned off.
        let months_back = self.lookback_months.max(1);
        let earliest = latest
            .months_before(months_back - 1)
            .unwrap_or_else(|| BusinessDate::from_month("0001-01").unwrap_or(latest));
        let found = match self.closed_with_unsettled(earliest, latest).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for late returns");
                return None;
            }
        };
        let waiting: u64 = found.iter().map(|(_, u)| u.late).sum();
        let held: u64 = found.iter().map(|(_, u)| u.held).sum();
        metrics::gauge!(m::UNSETTLED_IN_CLOSED_MONTHS).set(waiting as f64);
        metrics::gauge!(m::HELD_ROWS).set(held as f64);
        self.sweep_retries
            .retain(|month, _| found.iter().any(|(m, _)| m == month));
        if self.lookback_months == 0 {
            return None;
        }
        for (month, unsettled) in found {
            if unsettled.late == 0
                || self
                    .sweep_retries
                    .get(&month)
                    .is_some_and(|(_, not_before)| now < *not_before)
            {
                continue;
            }
            let key = settlement::key(month, self.shard);
            let result = jobs::run_once(
                &self.pool,
                &self.job,
                key,
                &self.opts,
                &self.shutdown,
                &|_| {},
            )
            .await;
            match result {
                Ok(report) if report.skipped.is_none() => {
                    metrics::counter!(m::RUNS_TOTAL, "outcome" => "settled").increment(1);
                    metrics::counter!(m::LATE_RETURNS_SETTLED_TOTAL).increment(report.updated);
                    self.sweep_retries.remove(&month);
                    self.conflicts_logged.remove(&month);
                    tracing::info!(business_date = %month, late = report.late, updated = report.updated, "late returns settled");
                    return Some(TickOutcome::LateReturns {
                        business_date: month,
                        report,
                    });
                }
                // A peer of this shard is on it, or they were settled meanwhile.
                Ok(_) => continue,
                Err(JobError::Interrupted) => return Some(TickOutcome::ShuttingDown),
                Err(e @ JobError::LeaseLost { .. }) => {
                    tracing::warn!(business_date = %month, error = %e, "lost a late-return run to a peer");
                    continue;
                }
                Err(e) => {
                    metrics::counter!(m::RUNS_TOTAL, "outcome" => failed_outcome(&e)).increment(1);
                    let failures = self.sweep_retries.get(&month).map_or(0, |r| r.0) + 1;
                    let (after, not_before) = self.retry_after(failures);
                    self.sweep_retries.insert(month, (failures, not_before));
                    self.log_failure(month, &e, failures, after);
                    return Some(TickOutcome::SweepFailed {
                        business_date: month,
                        after,
                        error: e.to_string(),
                    });
                }
            }
        }
        None
    }

    /// The closed months of this shard between `earliest` and `latest` (business dates) and
    /// their unsettled returns, oldest first; a closed month with none is left out.
    async fn closed_with_unsettled(
        &self,
        earliest: BusinessDate,
        latest: BusinessDate,
    ) -> sqlx::Result<Vec<(BusinessDate, settlement::Unsettled)>> {
        let mut tx = self.pool.begin_with(self.job.begin_batch()).await?;
        let closed = jobs::claim::done_between(
            &mut *tx,
            settlement::JOB_NAME,
            self.shard.count,
            self.shard.index,
            earliest.date(),
            latest.date(),
        )
        .await
        .map_err(|e| match e {
            JobError::Db(e) => e,
            other => sqlx::Error::Protocol(other.to_string()),
        })?;
        let months: Vec<BusinessDate> = closed
            .into_iter()
            .filter_map(|d| BusinessDate::new(d).ok())
            .collect();
        let keys: Vec<chrono::NaiveDateTime> = months
            .iter()
            .map(|m| m.first_day().and_time(chrono::NaiveTime::MIN))
            .collect();
        let counts = settlement::unsettled_by_month(
            &mut tx,
            &keys,
            self.shard.count.into(),
            self.shard.index.into(),
        )
        .await?;
        tx.rollback().await?;
        Ok(counts
            .into_iter()
            .filter_map(|u| {
                let month = months
                    .iter()
                    .find(|m| m.first_day().and_time(chrono::NaiveTime::MIN) == u.month)?;
                Some((*month, u))
            })
            .collect())
    }
}

impl Replica {
    /// Runs the oldest open run request for this shard that is not waiting for a retry, if any
    /// can run now. A request whose key a live run holds (the schedule's run, a peer's, a CLI
    /// `run`) waits for it; one already served elsewhere is skipped.
    async fn serve_a_request(&mut self, now: DateTime<Utc>) -> Option<TickOutcome> {
        let open = match jobs::requests::open_for(
            &self.pool,
            settlement::JOB_NAME,
            self.shard.count,
            self.shard.index,
        )
        .await
        {
            Ok(open) => open,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the open run requests");
                return None;
            }
        };
        self.request_retries
            .retain(|id, _| open.iter().any(|o| &o.request_id == id));
        for request in open {
            if self
                .request_retries
                .get(&request.request_id)
                .is_some_and(|(_, not_before)| now < *not_before)
            {
                continue;
            }
            let key = jobs::requests::key_of(
                settlement::JOB_NAME,
                &request,
                self.shard.count,
                self.shard.index,
            );
            let opts = RunOptions {
                force: request.force,
                request: Some(request.request_id.clone()),
                ..self.opts.clone()
            };
            let result =
                jobs::run_once(&self.pool, &self.job, key, &opts, &self.shutdown, &|_| {}).await;
            let id = request.request_id;
            match result {
                Ok(report) if report.skipped.is_none() => {
                    metrics::counter!(m::REQUEST_RUNS_TOTAL, "outcome" => "settled").increment(1);
                    self.request_retries.remove(&id);
                    tracing::info!(request_id = %id, business_date = %request.business_date, "run request served");
                    return Some(TickOutcome::Served {
                        request_id: id,
                        report,
                    });
                }
                // Held by a live run (tried again next tick), served elsewhere, or already done.
                Ok(_) => continue,
                Err(JobError::Interrupted) => return Some(TickOutcome::ShuttingDown),
                Err(e @ JobError::LeaseLost { .. }) => {
                    tracing::warn!(request_id = %id, error = %e, "lost a run request's claim to a peer");
                    continue;
                }
                Err(e) => {
                    metrics::counter!(m::REQUEST_RUNS_TOTAL, "outcome" => "failed").increment(1);
                    let failures = self.request_retries.get(&id).map_or(0, |r| r.0) + 1;
                    let (after, not_before) = self.retry_after(failures);
                    self.request_retries
                        .insert(id.clone(), (failures, not_before));
                    tracing::warn!(request_id = %id, error = %e, failures, retry_in_secs = after.as_secs_f64(), "run request failed; retrying with backoff");
                    return Some(TickOutcome::RequestFailed {
                        request_id: id,
                        after,
                        error: e.to_string(),
                    });
                }
            }
        }
        None
    }

    /// Sets the latest fire time and how many shards of this shard count have no SUCCESS row for
    /// its month. Read from `job_runs`, not from this replica's memory, so a shard whose replica
    /// is down still counts; a failed read leaves the gauges as they were.
    async fn publish_latest_month(&self) {
        metrics::gauge!(m::SHARDS).set(f64::from(self.shard.count));
        let Some(fire_at) = latest_slot_at_or_before(&self.cron, self.tz, self.clock.now()) else {
            return;
        };
        let month = Slot::new(fire_at).business_date;
        match jobs::claim::rows_for(
            &self.pool,
            settlement::JOB_NAME,
            month.date(),
            self.shard.count,
        )
        .await
        {
            Ok(rows) => {
                let settled = rows.iter().filter(|r| r.status == "SUCCESS").count() as f64;
                metrics::gauge!(m::LATEST_FIRE_TIMESTAMP).set(fire_at.timestamp() as f64);
                metrics::gauge!(m::LATEST_MONTH_UNSETTLED_SHARDS)
                    .set(f64::from(self.shard.count) - settled);
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the latest month's claims"),
        }
    }

    /// The oldest month before `latest` with no SUCCESS row for this shard, counting only months
    /// since this shard count's first claim (months before the deployment are not its business).
    async fn oldest_unfinished_before(
        &self,
        latest: BusinessDate,
    ) -> sqlx::Result<Option<BusinessDate>> {
        let month: Option<chrono::NaiveDate> = sqlx::query_scalar(
            "SELECT (m + interval '1 month' - interval '1 day')::date
               FROM generate_series(
                      (SELECT date_trunc('month', min(business_date)::timestamp) FROM job_runs
                        WHERE job_name = $1 AND shards = $2 AND shard = $3),
                      date_trunc('month', $4::date::timestamp) - interval '1 month',
                      interval '1 month') AS m
              WHERE NOT EXISTS (
                      SELECT 1 FROM job_runs j
                       WHERE j.job_name = $1 AND j.shards = $2 AND j.shard = $3
                         AND j.business_date = (m + interval '1 month' - interval '1 day')::date
                         AND j.status = 'SUCCESS')
              ORDER BY 1
              LIMIT 1",
        )
        .bind(settlement::JOB_NAME)
        .bind(self.shard.count as i32)
        .bind(self.shard.index as i32)
        .bind(latest.date())
        .fetch_optional(&self.pool)
        .await?;
        Ok(month.and_then(|d| BusinessDate::new(d).ok()))
    }

    /// The slot that settles `month`: the first fire at or after the start of the next month.
    fn slot_of(&self, month: BusinessDate) -> Option<Slot> {
        use chrono::TimeZone;
        let next_month = month.date().succ_opt()?.and_hms_opt(0, 0, 0)?;
        let start = self.tz.from_local_datetime(&next_month).earliest()?;
        let slot = Slot::new(self.cron.find_next_occurrence(&start, true).ok()?);
        (slot.business_date == month).then_some(slot)
    }
}

/// The `settlementd_runs_total` outcome of a run that ended with `e`: refused for another rule, or
/// failed.
fn failed_outcome(e: &JobError) -> &'static str {
    match e {
        JobError::ParamsConflict { .. } => "rule_conflict",
        _ => "failed",
    }
}

/// The pause before retry number `failures` (1-based): `initial` doubling per failure up to
/// `max`, then jittered down by up to half (`jitter` in [0, 1)) so replicas that failed together
/// do not retry in lockstep.
pub fn backoff(failures: u32, initial_secs: u64, max_secs: u64, jitter: f64) -> Duration {
    let exp = failures.saturating_sub(1).min(32);
    let base = initial_secs
        .saturating_mul(1u64 << exp)
        .min(max_secs)
        .max(1) as f64;
    let jitter = if jitter.is_finite() {
        jitter.clamp(0.0, 1.0)
    } else {
        0.0
    };
    Duration::from_secs_f64(base * (1.0 - jitter / 2.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_initial_up_to_max() {
        let no_jitter: Vec<u64> = (1..=8).map(|n| backoff(n, 5, 300, 0.0).as_secs()).collect();
        assert_eq!(no_jitter, [5, 10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(backoff(u32::MAX, 5, 300, 0.0).as_secs(), 300);
    }

    #[test]
    fn jitter_shortens_a_pause_by_at_most_half() {
        for j in [0.0, 0.25, 0.5, 0.999, 1.0, -3.0, 7.0, f64::NAN] {
            let d = backoff(3, 5, 300, j).as_secs_f64();
            assert!((10.0..=20.0).contains(&d), "jitter {j}: {d}");
        }
    }
}
