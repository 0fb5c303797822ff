//! One replica of one shard, one decision at a time.
//!
//! [`Replica::tick`] is the whole scheduling policy: read "now" from the injected [`Clock`], find
//! the latest slot at or before it, and decide what is due **from the data** ([`job_layer::due`]): in
//! the months of `settle.lookback_months` ending at the slot's month, every month some claim
//! started (under any shard count) whose key of this shard is not SUCCESS under the current count,
//! every month whose loans have items waiting for this shard (returns not settled yet, edits of
//! settled loans), and the slot's own month — then run the oldest that is not backing off through
//! [`job_layer::run_once`]. The serve loop calls `tick` at start-up, on every cron wake-up and on a
//! timer of at most one heartbeat; tests call it directly with a [`crate::clock::ManualClock`].
//!
//! Invariants:
//! - the months worked on come only from the clock, the schedule and the database, never from
//!   which wake-up fired, so a late, early, missed or doubled scheduler fire cannot pick a wrong
//!   month or skip one; a doubled fire is harmless because `run_once` is idempotent;
//! - whether a month is done is decided in SQL by the claim; nothing in process memory says a
//!   month is settled;
//! - a month its peers claimed and this shard never did, one settled under another shard count,
//!   one left FAILED, one whose loans changed after it closed: each is due, within a heartbeat;
//! - once shutdown is requested, nothing new is claimed;
//! - a month held by an unfinished correction is never run here (its correction runs it);
//! - a claim refused because the month is pinned to another rule is logged once per month and
//!   retried with the backoff, like a failure, so a fixed configuration finishes the month;
//! - every tick publishes what is not closed from its own look at what is due ([`Gauges`]:
//!   `settlementd_months_not_closed`, with the months the job it follows has not closed,
//!   [`OpenMonths`]; `settlementd_corrections_unfinished`; the families the job declares,
//!   [`job_layer::Metrics`]); while a run holds the ticks, the process's liveness task refreshes
//!   the same gauges on the heartbeat ([`Replica::gauges`]).

use super::gauges::{Gauges, Looked};
use super::health::Health;
use super::metrics as m;
use crate::calendar::BusinessDate;
use crate::clock::Clock;
use crate::config::{RetrySettings, Settings, ShardSpec};
use crate::job_layer::due::{self, Due, Why};
use crate::job_layer::params::Params;
use crate::job_layer::registry::Registered;
use crate::job_layer::JobKey;
use crate::job_layer::{self, JobError, Owner, RunOptions, RunReport, SkipReason};
use crate::schedule::{latest_slot_at_or_before, next_slot_after, Slot};
use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
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
    /// This tick ran a stored run request for this shard ([`job_layer::requests`]) to SUCCESS.
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
    /// The job is paused ([`job_layer::pause`]): nothing was claimed.
    Paused { since: DateTime<Utc>, by: String },
    /// The slot's month is held by an unfinished correction (its key): only that correction runs
    /// it, and it is not SUCCESS until it completes.
    BeingCorrected { slot: Slot, correction: String },
    /// The slot's month is not ready for this job: the job it follows has not closed it.
    NotReady { slot: Slot, why: String },
}

impl TickOutcome {
    /// The outcome's name, for logs.
    pub fn label(&self) -> &'static str {
        match self {
            TickOutcome::Idle => "idle",
            TickOutcome::Settled { .. } => "succeeded",
            TickOutcome::AlreadyDone { .. } => "already_done",
            TickOutcome::Watching { .. } => "watching",
            TickOutcome::RetryScheduled { .. } => "retry_scheduled",
            TickOutcome::BackingOff { .. } => "backing_off",
            TickOutcome::Interrupted { .. } => "interrupted",
            TickOutcome::ShuttingDown => "shutting_down",
            TickOutcome::Served { .. } => "served",
            TickOutcome::RequestFailed { .. } => "request_failed",
            TickOutcome::LateReturns { .. } => "late_items_done",
            TickOutcome::SweepFailed { .. } => "sweep_failed",
            TickOutcome::Paused { .. } => "paused",
            TickOutcome::BeingCorrected { .. } => "being_corrected",
            TickOutcome::NotReady { .. } => "not_ready",
        }
    }
}

/// The months each job of a process last found not closed ([`Replica::tick`]), shared by the
/// process's replicas: a job's months are not closed while the job it follows
/// ([`crate::job_layer::Job::after`]) has not closed them, as `status` and the page say
/// ([`crate::overview::follow_upstreams`]). A job whose upstream is not scheduled in the process
/// counts its own months only.
#[derive(Debug, Default)]
pub struct OpenMonths(std::sync::Mutex<HashMap<&'static str, Vec<NaiveDate>>>);

impl OpenMonths {
    /// Keeps `open` as what `job` found, and returns the months not closed for it: its own and
    /// those the job it follows (`after`) last found.
    pub fn publish(
        &self,
        job: &'static str,
        after: Option<&'static str>,
        open: Vec<NaiveDate>,
    ) -> std::collections::BTreeSet<NaiveDate> {
        let mut found = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut months: std::collections::BTreeSet<NaiveDate> = open.iter().copied().collect();
        if let Some(upstream) = after.and_then(|a| found.get(a)) {
            months.extend(upstream.iter().copied());
        }
        found.insert(job, open);
        months
    }
}

/// The end of day `day` of the month after `month`'s (a business date, its last day) in `tz`:
/// the month's deadline (`settle.deadline_day`). `None` for a day no month has.
pub fn deadline(month: NaiveDate, day: u32, tz: Tz) -> Option<DateTime<Utc>> {
    use chrono::TimeZone;
    let next = month.checked_add_days(chrono::Days::new(1))?;
    let end = chrono::Datelike::with_day(&next, day)?.checked_add_days(chrono::Days::new(1))?;
    let at = tz
        .from_local_datetime(&end.and_hms_opt(0, 0, 0)?)
        .earliest()?;
    Some(at.with_timezone(&Utc))
}

pub struct Replica {
    pool: PgPool,
    /// The job this replica schedules (one replica per enabled job in a `serve` process).
    job: Arc<dyn Registered>,
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
    /// Months whose last run failed: consecutive failures and the clock time before which the
    /// month is not tried again.
    retries: HashMap<BusinessDate, (u32, DateTime<Utc>)>,
    /// Run requests whose last run failed: consecutive failures and when to try again.
    request_retries: HashMap<(String, i32), (u32, DateTime<Utc>)>,
    /// `settle.lookback_months`: how many months, ending at the latest slot's, are looked at (0:
    /// only that month is run, the others are only counted).
    lookback_months: u32,
    /// Months whose rule conflict has been logged: once per month is enough.
    conflicts_logged: HashSet<BusinessDate>,
    /// Why each month was last found not ready (the job it follows has not closed it), as logged:
    /// said again only when it changes, not at every tick.
    not_ready_logged: HashMap<BusinessDate, String>,
    /// Where each look at what is due leaves the rule conflict it found, for readiness.
    health: Arc<Health>,
    /// The job's gauges: published by each tick from what it looks at, and refreshed by the
    /// process's liveness task while a run holds the ticks ([`Gauges`]).
    gauges: Arc<Gauges>,
    /// Every log line of this replica carries shard, shards and owner.
    span: tracing::Span,
}

impl Replica {
    /// The replica of the registry's first job ([`crate::jobs::default_job`]).
    pub fn new(
        pool: PgPool,
        settings: &Settings,
        clock: Arc<dyn Clock>,
        shutdown: CancellationToken,
    ) -> Self {
        let registry = crate::jobs::build(settings);
        let job = registry
            .get(crate::jobs::default_job())
            .expect("the registry lists its default job")
            .clone();
        Self::for_job(pool, settings, job, clock, shutdown)
    }

    /// The replica of `job`.
    pub fn for_job(
        pool: PgPool,
        settings: &Settings,
        job: Arc<dyn Registered>,
        clock: Arc<dyn Clock>,
        shutdown: CancellationToken,
    ) -> Self {
        let opts = crate::app::run_options(settings, false, false);
        let gauges = Gauges::new(pool.clone(), settings, job.clone(), clock.clone());
        let span = tracing::info_span!(
            "replica",
            job = job.name(),
            shard = settings.shard.index,
            shards = settings.shard.count,
            owner = %opts.owner,
        );
        Self {
            pool,
            cron: job.schedule().cron.clone(),
            job,
            tz: settings.schedule.timezone,
            catch_up: settings.schedule.catch_up,
            retry: settings.retry,
            shard: settings.shard,
            started_at: clock.now(),
            opts,
            clock,
            shutdown,
            retries: HashMap::new(),
            request_retries: HashMap::new(),
            lookback_months: settings.settle.lookback_months,
            conflicts_logged: HashSet::new(),
            not_ready_logged: HashMap::new(),
            health: Arc::new(Health::default()),
            gauges: Arc::new(gauges),
            span,
        }
    }

    /// The same replica sharing `open` with the other jobs' replicas of the process, so that the
    /// months of a job that follows another are counted not closed while that one's are not.
    pub fn with_open_months(mut self, open: Arc<OpenMonths>) -> Self {
        self.gauges = Arc::new(self.gauges.with_open_months(open));
        self
    }

    /// The job's gauges, for the process's liveness task to refresh while this replica runs.
    pub fn gauges(&self) -> Arc<Gauges> {
        self.gauges.clone()
    }

    /// The same replica reporting what it finds to `health` (shared with the process's probes).
    pub fn with_health(mut self, health: Arc<Health>) -> Self {
        self.health = health;
        self
    }

    /// The same replica under `owner` (the process's name in claims and in the audit trail, shared
    /// with its HTTP endpoints).
    pub fn with_owner(mut self, owner: Owner) -> Self {
        self.span = tracing::info_span!(
            "replica",
            job = self.job.name(),
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

    pub fn job(&self) -> &Arc<dyn Registered> {
        &self.job
    }

    /// The key of `month` for this replica's job and shard.
    fn key(&self, month: BusinessDate) -> JobKey {
        JobKey {
            job_name: self.job.name().to_string(),
            business_date: month.date(),
            shards: self.shard.count,
            shard: self.shard.index,
        }
    }

    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// The span of this replica's lines about `month`'s run, with the fields of the run's own
    /// ([`job_layer::run_once`]): `job`, `business_date`, `shard`, `shards`, `attempt` (when one
    /// was claimed) and `owner`, so every line about a run can be found by them.
    pub fn month_span(&self, month: BusinessDate, attempt: Option<i32>) -> tracing::Span {
        self.run_span(&self.key(month), attempt)
    }

    /// [`Replica::month_span`] of `key` (a run request's may have another shard count).
    fn run_span(&self, key: &JobKey, attempt: Option<i32>) -> tracing::Span {
        let span = tracing::info_span!(
            "run",
            job = %key.job_name,
            business_date = %key.business_date,
            shard = key.shard,
            shards = key.shards,
            attempt = tracing::field::Empty,
            owner = %self.opts.owner,
        );
        if let Some(attempt) = attempt {
            span.record("attempt", attempt);
        }
        span
    }

    /// Decides what is due now and does it (at most one run), then publishes the latest month's
    /// state for the "month not closed" alert.
    pub async fn tick(&mut self) -> TickOutcome {
        let span = self.span.clone();
        let outcome = self.tick_inner().instrument(span.clone()).await;
        if !self.shutdown.is_cancelled() {
            self.gauges.publish_latest_month().instrument(span).await;
        }
        outcome
    }

    /// Looks at what is due without running anything, so readiness knows at once whether this
    /// job is refused a due month (the serve loop does it for every job before the first tick:
    /// ticks run one job's month at a time, and a long run would otherwise keep the next job
    /// "starting").
    pub async fn look(&mut self) {
        let span = self.span.clone();
        async {
            let paused = job_layer::pause::of(&self.pool, self.job.name()).await;
            let now = self.clock.now();
            match (paused, latest_slot_at_or_before(&self.cron, self.tz, now)) {
                (Ok(Some(_)), _) | (_, None) => self.health.looked_unless_known(self.job.name()),
                (_, Some(fire_at)) => {
                    let slot = Slot::new(fire_at);
                    let scheduled = (self.catch_up
                        || fire_at.with_timezone(&Utc) >= self.started_at)
                        .then_some(slot.business_date);
                    self.due(slot.business_date, scheduled).await;
                }
            }
        }
        .instrument(span)
        .await
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
        for (_, not_before) in self.retries.values() {
            if now < *not_before {
                wait = wait.min(until(*not_before));
            }
        }
        wait.max(MIN_WAIT)
    }

    async fn tick_inner(&mut self) -> TickOutcome {
        let now = self.clock.now();
        if let Some(next) = next_slot_after(&self.cron, self.tz, now) {
            metrics::gauge!(m::NEXT_FIRE_TIMESTAMP, "job_name" => self.job.name())
                .set(next.timestamp() as f64);
        }
        if self.shutdown.is_cancelled() {
            return TickOutcome::ShuttingDown;
        }
        // A paused job claims nothing (its claims would be refused one by one): one look a tick.
        match job_layer::pause::of(&self.pool, self.job.name()).await {
            Ok(Some(pause)) => {
                // Paused on purpose: nothing is asked of it, so nothing to be ready for.
                self.health.looked_unless_known(self.job.name());
                return TickOutcome::Paused {
                    since: pause.paused_at,
                    by: pause.paused_by,
                };
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "cannot read the job's pause"),
        }
        let Some(fire_at) = latest_slot_at_or_before(&self.cron, self.tz, now) else {
            self.health.looked_unless_known(self.job.name());
            return self.serve_a_request(now).await.unwrap_or(TickOutcome::Idle);
        };
        let slot = Slot::new(fire_at);
        self.upkeep().await;
        let scheduled = (self.catch_up || fire_at.with_timezone(&Utc) >= self.started_at)
            .then_some(slot.business_date);
        // What is due is looked at (and readiness told) before run requests are served, which
        // come first among the runs: an operator asked for them.
        let (due, held) = self.due(slot.business_date, scheduled).await;
        if let Some(outcome) = self.serve_a_request(now).await {
            return outcome;
        }
        self.retries
            .retain(|month, _| due.iter().any(|d| d.business_date == month.date()));
        // At most one run that claims per tick, oldest month first; a month held by a live peer
        // or backing off gives way to the next.
        let mut idle = match (scheduled, held) {
            (Some(_), Some(correction)) => TickOutcome::BeingCorrected { slot, correction },
            (Some(_), None) => TickOutcome::AlreadyDone { slot },
            (None, _) => TickOutcome::Idle,
        };
        // Read again: the look above may have waited out acquire timeouts (a database that was
        // down or read-only until a moment ago), and a retry due meanwhile runs now, not a tick later.
        let now = self.clock.now();
        for d in due {
            let Ok(month) = BusinessDate::new(d.business_date) else {
                continue;
            };
            let month_slot = if month == slot.business_date {
                slot
            } else {
                self.slot_of(month).unwrap_or(Slot {
                    fire_at,
                    business_date: month,
                })
            };
            if let Some(&(_, until)) = self.retries.get(&month) {
                if now < until {
                    if month == slot.business_date {
                        idle = TickOutcome::BackingOff {
                            slot: month_slot,
                            until,
                        };
                    }
                    continue;
                }
            }
            match self.run_month(month_slot, &d, fire_at).await {
                Some(TickOutcome::NotReady { slot, why }) if month == slot.business_date => {
                    idle = TickOutcome::NotReady { slot, why };
                    continue;
                }
                Some(TickOutcome::NotReady { .. }) => continue,
                Some(outcome) => return outcome,
                None => {}
            }
            if month == slot.business_date {
                idle = TickOutcome::Watching {
                    slot,
                    reason: "held by a live peer",
                };
            }
            if self.shutdown.is_cancelled() {
                return TickOutcome::ShuttingDown;
            }
        }
        idle
    }

    /// What is due for this shard now ([`due::due`]), publishing what is not closed on the way,
    /// and the correction holding the latest slot's month, if one does. When the database cannot
    /// say, the schedule's month alone (its run then reports why).
    async fn due(
        &self,
        latest: BusinessDate,
        scheduled: Option<BusinessDate>,
    ) -> (Vec<Due>, Option<String>) {
        let fallback = || {
            let due = scheduled
                .map(|date| Due {
                    business_date: date.date(),
                    why: Why::Scheduled,
                })
                .into_iter()
                .collect();
            (due, None)
        };
        let looked = match self.gauges.look(latest, None).await {
            Ok(looked) => looked,
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for what is due; running the schedule's month only");
                return fallback();
            }
        };
        self.gauges.publish_not_closed(&looked);
        let Looked {
            periods,
            mut pending,
            ..
        } = looked;
        if self.lookback_months == 0 {
            // Only the schedule's month is run; the others are counted above.
            pending
                .by_period
                .retain(|p| p.business_date == latest.date());
        }
        let periods: Vec<due::Period> = periods
            .into_iter()
            .filter(|p| self.lookback_months > 0 || p.business_date == latest.date())
            .collect();
        let held = periods
            .iter()
            .find(|p| p.business_date == latest.date())
            .and_then(|p| p.correction_key.clone());
        let due = due::due(
            &periods,
            &pending,
            due::Ask {
                shard: self.shard.index,
                scheduled: scheduled.map(|d| d.date()),
                start_waiting: self.catch_up,
            },
        );
        self.look_at_rules(&due).await;
        (due, held)
    }

    /// Tells readiness whether a due month is pinned to another rule than this replica's: what
    /// its claim would refuse ([`job_layer::params::conflicts`]). A look that fails leaves the last one.
    async fn look_at_rules(&self, due: &[Due]) {
        let mine: Vec<(chrono::NaiveDate, Params)> = due
            .iter()
            .filter_map(|d| {
                let params = self
                    .job
                    .params(&self.key(BusinessDate::new(d.business_date).ok()?));
                Some((d.business_date, params.ok().filter(|p| !p.is_empty())?))
            })
            .collect();
        let found = if mine.is_empty() {
            Ok(Vec::new())
        } else {
            job_layer::params::conflicts(&self.pool, self.job.name(), &mine).await
        };
        let found = match found {
            Ok(found) => found,
            Err(e) => {
                tracing::debug!(error = %e, "cannot compare the due months' rules with this replica's");
                return;
            }
        };
        let conflict = found.first().and_then(|(date, pinned)| {
            let (_, ours) = mine.iter().find(|(d, _)| d == date)?;
            let (was, is) =
                job_layer::params::describe_difference(pinned, ours, &|p| self.job.describe(p));
            let more = match found.len() {
                1 => String::new(),
                n => format!(" ({} more due months refused)", n - 1),
            };
            Some(format!(
                "{} shard {} of {} cannot settle {date}: it is pinned to {was}; this replica's \
                 rule is {is}{more}. Nothing of it is settled here until the configuration agrees \
                 (or `settlementd correct` re-pins the month)",
                self.job.name(),
                self.shard.index,
                self.shard.count,
            ))
        });
        self.health.looked(self.job.name(), conflict);
    }

    /// The job's upkeep between runs ([`crate::job_layer::Job::upkeep`]: for the fine settlement,
    /// opening journal entries of loans an older binary settled during a rolling upgrade, or that
    /// `settlementd migrate` has not reached yet), for at most half a heartbeat: a backlog goes at
    /// the speed of the database, and the tick comes back to the schedule soon.
    async fn upkeep(&self) {
        let until = Instant::now() + self.opts.heartbeat_every / 2;
        match self.job.upkeep(&self.pool, until).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(items = n, "upkeep done"),
            Err(e) => tracing::warn!(error = %e, "upkeep failed; trying again at the next tick"),
        }
        // Claims of another shard count left RUNNING by a holder that died before a reshard: no
        // replica of that count is left to take them over (found by the fault campaign, seed 1002).
        let closed = job_layer::claim::close_abandoned(
            &self.pool,
            self.job.name(),
            self.shard.count,
            &self.opts.owner,
            self.opts.lease_ttl,
        )
        .await;
        match closed {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                closed = n,
                "claims of another shard count left RUNNING by a dead holder closed as FAILED"
            ),
            Err(e) => tracing::debug!(error = %e, "cannot close abandoned claims"),
        }
    }

    /// Runs one due month of this shard. `None` when it claimed nothing (a live peer holds it, or
    /// it was done meanwhile): the tick goes on to the next due month.
    async fn run_month(
        &mut self,
        slot: Slot,
        due: &Due,
        latest_fire: DateTime<chrono_tz::Tz>,
    ) -> Option<TickOutcome> {
        let month = slot.business_date;
        let key = self.key(month);
        let started = Instant::now();
        let result = self
            .job
            .run(&self.pool, key, &self.opts, &self.shutdown, &|_| {})
            .await;
        let job = self.job.name();
        let attempt = result.as_ref().ok().and_then(|r| r.attempt);
        let _in_month = self.month_span(month, attempt).entered();
        if !matches!(&result, Err(JobError::NotReady { .. })) {
            self.not_ready_logged.remove(&month);
        }
        let waiting = matches!(due.why, Why::Waiting(_));
        let claimed = !matches!(&result, Ok(r) if r.skipped.is_some());
        if claimed {
            metrics::histogram!(m::RUN_DURATION_SECONDS, "job_name" => job)
                .record(started.elapsed().as_secs_f64());
            if month == Slot::new(latest_fire).business_date {
                let late = (self.clock.now() - latest_fire.with_timezone(&Utc)).as_seconds_f64();
                metrics::gauge!(m::LAST_RUN_LATENESS_SECONDS, "job_name" => job).set(late.max(0.0));
            }
        }
        match result {
            Ok(report) => match report.skipped {
                None => {
                    let succeeded = self.job.metrics().succeeded;
                    metrics::counter!(m::RUNS_TOTAL, "job_name" => job, "outcome" => succeeded)
                        .increment(1);
                    metrics::gauge!(m::LAST_SUCCESS_TIMESTAMP, "job_name" => job)
                        .set(self.clock.now().timestamp() as f64);
                    self.retries.remove(&month);
                    self.conflicts_logged.remove(&month);
                    if report.late > 0 {
                        if let Some(late) = self.job.metrics().late_done {
                            metrics::counter!(late.name, "job_name" => job)
                                .increment(report.updated);
                        }
                        tracing::info!(
                            late = report.late,
                            updated = report.updated,
                            what = self.job.words().waiting.many,
                            "items that arrived after the month was done are done"
                        );
                        return Some(TickOutcome::LateReturns {
                            business_date: month,
                            report,
                        });
                    }
                    Some(TickOutcome::Settled { slot, report })
                }
                Some(SkipReason::AlreadyDone) => {
                    metrics::counter!(m::RUNS_TOTAL, "job_name" => job, "outcome" => "skipped")
                        .increment(1);
                    None
                }
                Some(SkipReason::Held | SkipReason::RequestServed) => {
                    metrics::counter!(m::RUNS_TOTAL, "job_name" => job, "outcome" => "skipped")
                        .increment(1);
                    tracing::info!("a live peer holds the claim; watching it");
                    None
                }
            },
            Err(JobError::Interrupted) => {
                metrics::counter!(m::RUNS_TOTAL, "job_name" => job, "outcome" => "failed")
                    .increment(1);
                Some(TickOutcome::Interrupted { slot })
            }
            // The job it follows has not closed the month: nothing claimed, nothing to retry but
            // at the next tick.
            Err(JobError::NotReady { why, .. }) => {
                if self.not_ready_logged.get(&month) != Some(&why) {
                    tracing::info!(after = self.job.after(), "not ready: {why}");
                    self.not_ready_logged.insert(month, why.clone());
                }
                Some(TickOutcome::NotReady { slot, why })
            }
            // Paused meanwhile (a run stopped after its batch is FAILED `interrupted: paused`,
            // taken over at once after a resume).
            Err(JobError::Paused { by, since, .. }) => Some(TickOutcome::Paused { since, by }),
            Err(e @ JobError::LeaseLost { .. }) => {
                metrics::counter!(m::RUNS_TOTAL, "job_name" => job, "outcome" => "lease_lost")
                    .increment(1);
                tracing::warn!(error = %e, "lost the claim to a peer; watching it");
                None
            }
            Err(e) => {
                let outcome = failed_outcome(&e, &self.job.metrics());
                metrics::counter!(m::RUNS_TOTAL, "job_name" => job, "outcome" => outcome)
                    .increment(1);
                let failures = self.retries.get(&month).map_or(0, |r| r.0) + 1;
                let (after, not_before) = self.retry_after(failures, &e);
                self.retries.insert(month, (failures, not_before));
                self.log_failure(month, &e, failures, after);
                if waiting {
                    return Some(TickOutcome::SweepFailed {
                        business_date: month,
                        after,
                        error: e.to_string(),
                    });
                }
                Some(TickOutcome::RetryScheduled {
                    slot,
                    failures,
                    after,
                    error: e.to_string(),
                })
            }
        }
    }

    /// The pause before retry number `failures` of anything ([`retry_pause`], jittered), after
    /// `error`, and the clock time it ends.
    fn retry_after(&self, failures: u32, error: &JobError) -> (Duration, DateTime<Utc>) {
        let after = retry_pause(
            failures,
            &self.retry,
            error.is_outage().then_some(self.opts.lease_ttl),
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
}

impl Replica {
    /// Runs the oldest open run request for this shard that is not waiting for a retry, if any
    /// can run now. A request whose key a live run holds (the schedule's run, a peer's, a CLI
    /// `run`) waits for it; one already served elsewhere is skipped.
    async fn serve_a_request(&mut self, now: DateTime<Utc>) -> Option<TickOutcome> {
        let open = match job_layer::requests::open_for(
            &self.pool,
            self.job.name(),
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
        self.request_retries.retain(|(id, shard), _| {
            open.iter()
                .any(|o| &o.request_id == id && o.shard == *shard)
        });
        for request in open {
            let retry_key = (request.request_id.clone(), request.shard);
            if self
                .request_retries
                .get(&retry_key)
                .is_some_and(|(_, not_before)| now < *not_before)
            {
                continue;
            }
            let key = job_layer::requests::key_of(self.job.name(), &request);
            let opts = RunOptions {
                force: request.force,
                request: Some(request.request_id.clone()),
                ..self.opts.clone()
            };
            let result = self
                .job
                .run(&self.pool, key.clone(), &opts, &self.shutdown, &|_| {})
                .await;
            let attempt = result.as_ref().ok().and_then(|r| r.attempt);
            let _in_run = self.run_span(&key, attempt).entered();
            let id = request.request_id;
            match result {
                Ok(report) if report.skipped.is_none() => {
                    metrics::counter!(m::REQUEST_RUNS_TOTAL, "job_name" => self.job.name(), "outcome" => self.job.metrics().succeeded)
                        .increment(1);
                    self.request_retries.remove(&retry_key);
                    tracing::info!(request_id = %id, "run request served");
                    return Some(TickOutcome::Served {
                        request_id: id,
                        report,
                    });
                }
                // Held by a live run (tried again next tick), served elsewhere, or already done.
                Ok(_) => continue,
                Err(JobError::Interrupted) => return Some(TickOutcome::ShuttingDown),
                Err(JobError::Paused { by, since, .. }) => {
                    return Some(TickOutcome::Paused { since, by })
                }
                Err(e @ JobError::LeaseLost { .. }) => {
                    tracing::warn!(request_id = %id, error = %e, "lost a run request's claim to a peer");
                    continue;
                }
                Err(e) => {
                    metrics::counter!(m::REQUEST_RUNS_TOTAL, "job_name" => self.job.name(), "outcome" => "failed")
                        .increment(1);
                    let failures = self.request_retries.get(&retry_key).map_or(0, |r| r.0) + 1;
                    let (after, not_before) = self.retry_after(failures, &e);
                    self.request_retries
                        .insert(retry_key, (failures, not_before));
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

    /// The slot that settles `month`: the first fire at or after the start of the next month.
    fn slot_of(&self, month: BusinessDate) -> Option<Slot> {
        use chrono::TimeZone;
        let next_month = month.date().succ_opt()?.and_hms_opt(0, 0, 0)?;
        let start = self.tz.from_local_datetime(&next_month).earliest()?;
        let slot = Slot::new(self.cron.find_next_occurrence(&start, true).ok()?);
        (slot.business_date == month).then_some(slot)
    }
}

/// The `settlementd_runs_total` outcome of a run that ended with `e`: refused for other pinned
/// parameters (the outcome the job names, [`job_layer::Metrics::conflicts`]), or failed.
fn failed_outcome(e: &JobError, metrics: &job_layer::Metrics) -> &'static str {
    match (e, metrics.conflicts) {
        (JobError::ParamsConflict { .. }, Some((_, outcome))) => outcome,
        _ => "failed",
    }
}

/// The pause before retry number `failures` (1-based) with `retry`'s [`backoff`], and at most
/// `within` for an outage of the database ([`JobError::is_outage`]: a failover, a restart), whose
/// end does not depend on how often it was met: the retry after a failover comes within a lease,
/// not after a backoff that doubled at each refusal while it lasted.
pub fn retry_pause(
    failures: u32,
    retry: &RetrySettings,
    within: Option<Duration>,
    jitter: f64,
) -> Duration {
    let after = backoff(failures, retry.initial_secs, retry.max_secs, jitter);
    within.map_or(after, |within| after.min(within))
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
    fn an_outage_is_retried_within_a_lease_however_often_it_was_met() {
        let retry = RetrySettings {
            initial_secs: 5,
            max_secs: 300,
        };
        let lease = Some(Duration::from_secs(60));
        let pauses: Vec<u64> = (1..=9)
            .map(|n| retry_pause(n, &retry, lease, 0.0).as_secs())
            .collect();
        assert_eq!(pauses, [5, 10, 20, 40, 60, 60, 60, 60, 60]);
        assert_eq!(retry_pause(9, &retry, None, 0.0).as_secs(), 300);
    }

    #[test]
    fn jitter_shortens_a_pause_by_at_most_half() {
        for j in [0.0, 0.25, 0.5, 0.999, 1.0, -3.0, 7.0, f64::NAN] {
            let d = backoff(3, 5, 300, j).as_secs_f64();
            assert!((10.0..=20.0).contains(&d), "jitter {j}: {d}");
        }
    }
}
