//! The gauges of one job's state that a replica exports, read from the database: what is not closed
//! and what waits (`settlementd_months_not_closed`, `settlementd_months_past_deadline`,
//! `settlementd_corrections_unfinished`, and the families the job declares,
//! [`job_layer::Metrics`]), its latest fire's month (`settlementd_latest_fire_*`, the deadline),
//! its pause and its expired leases.
//!
//! Two writers keep them, both reading the database, never process memory: the replica's tick,
//! which looks at what is due anyway ([`Gauges::look`], then [`Gauges::publish_not_closed`] and
//! [`Gauges::publish_latest_month`]), and the process's liveness task ([`super::liveness`]), which
//! calls [`Gauges::refresh`] on the heartbeat: the latest month's gauges each time, and a look of
//! its own at what is not closed whenever no tick looked within a heartbeat. A tick awaits its
//! whole run (hours at a large month's end), so during a run the liveness task is the one that
//! keeps them; an idle replica's ticks look every heartbeat, and nothing is looked at twice.
//!
//! Invariant: whatever the runs do, no gauge here is older than about a heartbeat, or its last
//! look failed (then it keeps its value, and the failure is in the debug log).

use super::metrics as m;
use super::replica::{deadline, OpenMonths};
use crate::calendar::BusinessDate;
use crate::clock::Clock;
use crate::config::{Settings, ShardSpec};
use crate::job_layer::due::{self, Period};
use crate::job_layer::registry::Registered;
use crate::job_layer::{self, JobError, PendingReport};
use crate::schedule::{latest_slot_at_or_before, Slot};
use chrono::NaiveDate;
use chrono_tz::Tz;
use croner::Cron;
use sqlx::{Connection, PgPool};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What one look at the database says about a job's months: the periods the window's claims
/// started (with this shard's key), what waits in them, and how many corrections are unfinished.
#[derive(Debug)]
pub struct Looked {
    /// The months of `settle.lookback_months` ending at the latest slot's, oldest first.
    pub window: Vec<NaiveDate>,
    pub periods: Vec<Period>,
    /// What waits, in months up to the latest slot's (edits queued for later months wait for it).
    pub pending: PendingReport,
    pub corrections: i64,
}

/// One job's gauges in a `serve` process, shared by its replica and the liveness task.
pub struct Gauges {
    pool: PgPool,
    job: Arc<dyn Registered>,
    cron: Cron,
    tz: Tz,
    shard: ShardSpec,
    /// `settle.lookback_months`: the window looked at.
    lookback_months: u32,
    /// `settle.deadline_day`: when a month not closed is past its deadline.
    deadline_day: Option<u32>,
    /// `lease.ttl_secs`: a RUNNING claim whose heartbeat is older holds an expired lease.
    lease_ttl: Duration,
    clock: Arc<dyn Clock>,
    /// What each job of the process last found not closed: a follower counts its upstream's.
    open: Arc<OpenMonths>,
    /// When what is not closed was last published (by a tick or by [`Gauges::refresh`]).
    published: Mutex<Option<Instant>>,
}

impl Gauges {
    /// `job`'s gauges for a replica with `settings`, counting only its own months not closed
    /// until [`Gauges::with_open_months`] shares the process's.
    pub fn new(
        pool: PgPool,
        settings: &Settings,
        job: Arc<dyn Registered>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        Self {
            pool,
            cron: job.schedule().cron.clone(),
            job,
            tz: settings.schedule.timezone,
            shard: settings.shard,
            lookback_months: settings.settle.lookback_months,
            deadline_day: settings.settle.deadline_day,
            lease_ttl: Duration::from_secs(settings.lease.ttl_secs),
            clock,
            open: Arc::new(OpenMonths::default()),
            published: Mutex::new(None),
        }
    }

    /// The same gauges sharing `open` with the other jobs' of the process.
    pub fn with_open_months(&self, open: Arc<OpenMonths>) -> Self {
        Self {
            pool: self.pool.clone(),
            job: self.job.clone(),
            cron: self.cron.clone(),
            tz: self.tz,
            shard: self.shard,
            lookback_months: self.lookback_months,
            deadline_day: self.deadline_day,
            lease_ttl: self.lease_ttl,
            clock: self.clock.clone(),
            open,
            published: Mutex::new(None),
        }
    }

    /// Looks at `job`'s months in the window ending at `latest`, as one transaction on one pooled
    /// connection; each statement stops after `budget` when one is given (the liveness task's look
    /// must not hold its next report).
    pub async fn look(
        &self,
        latest: BusinessDate,
        budget: Option<Duration>,
    ) -> Result<Looked, JobError> {
        let window = crate::calendar::lookback(latest, self.lookback_months);
        let earliest = window
            .first()
            .and_then(|d| BusinessDate::new(*d).ok())
            .unwrap_or(latest);
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        if let Some(budget) = budget {
            sqlx::query(&format!(
                "SET LOCAL statement_timeout = {}",
                budget.as_millis().max(1)
            ))
            .execute(&mut *tx)
            .await?;
        }
        let periods = due::periods(
            &mut *tx,
            self.job.name(),
            self.shard.count,
            self.shard.index,
            earliest.date(),
            latest.date(),
        )
        .await?;
        let corrections = due::corrections_unfinished(&mut *tx).await?;
        // Last: a job's count may set plan settings for the rest of the transaction.
        let mut pending = self.job.pending(&mut tx, self.shard.count, &window).await?;
        tx.rollback().await?;
        pending
            .by_period
            .retain(|p| p.business_date <= latest.date());
        Ok(Looked {
            window,
            periods,
            pending,
            corrections,
        })
    }

    /// The gauges of what is not closed and what waits, from `looked`.
    pub fn publish_not_closed(&self, looked: &Looked) {
        let Looked {
            window,
            periods,
            pending,
            corrections,
        } = looked;
        let job = self.job.name();
        let names = self.job.metrics();
        let (open, held): (Vec<_>, Vec<_>) =
            due::not_closed(periods, pending, self.shard.count, window)
                .into_iter()
                .partition(|n| n.state() == due::MonthState::Open);
        let open = self.open.publish(
            job,
            self.job.after(),
            open.into_iter().map(|n| n.business_date).collect(),
        );
        metrics::gauge!(m::MONTHS_NOT_CLOSED, "job_name" => job).set(open.len() as f64);
        // A held month the job it follows leaves open is counted open, once.
        let held = held
            .iter()
            .filter(|n| !open.contains(&n.business_date))
            .count();
        metrics::gauge!(m::MONTHS_HELD, "job_name" => job).set(held as f64);
        // Without a deadline, no month is past it.
        let now = self.clock.now();
        let late = open
            .iter()
            .filter(|month| {
                self.deadline_day
                    .and_then(|day| deadline(**month, day, self.tz))
                    .is_some_and(|at| at <= now)
            })
            .count();
        metrics::gauge!(m::MONTHS_PAST_DEADLINE, "job_name" => job).set(late as f64);
        metrics::gauge!(m::CORRECTIONS_UNFINISHED).set(*corrections as f64);
        let mine = pending
            .by_period
            .iter()
            .filter(|p| p.shard == self.shard.index && window.contains(&p.business_date));
        let (waiting, held) = mine.fold((0, 0), |(w, h), p| (w + p.late, h + p.held));
        for (metric, value) in [
            (names.beyond_lookback, pending.before),
            (names.waiting, waiting),
            (names.held, held),
        ] {
            if let Some(metric) = metric {
                metrics::gauge!(metric.name, "job_name" => job).set(value as f64);
            }
        }
        *self.lock() = Some(Instant::now());
    }

    /// Sets the latest fire time, how many shards of this shard count have no SUCCESS row for its
    /// month, the job's pause and its expired leases. Read from `job_runs`, not from a replica's
    /// memory, so a shard whose replica is down still counts; a failed read leaves the gauges as
    /// they were.
    pub async fn publish_latest_month(&self) {
        metrics::gauge!(m::SHARDS).set(f64::from(self.shard.count));
        let job = self.job.name();
        match job_layer::pause::of(&self.pool, job).await {
            Ok(Some(pause)) => {
                metrics::gauge!(m::PAUSED, "job_name" => job).set(1.0);
                metrics::gauge!(m::PAUSED_SINCE, "job_name" => job)
                    .set(pause.paused_at.timestamp() as f64);
            }
            Ok(None) => {
                metrics::gauge!(m::PAUSED, "job_name" => job).set(0.0);
                metrics::gauge!(m::PAUSED_SINCE, "job_name" => job).set(0.0);
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the job's pause"),
        }
        let Some(fire_at) = latest_slot_at_or_before(&self.cron, self.tz, self.clock.now()) else {
            return;
        };
        match job_layer::claim::expired_leases(&self.pool, job, self.lease_ttl).await {
            Ok(n) => metrics::gauge!(m::EXPIRED_LEASES, "job_name" => job).set(n as f64),
            Err(e) => tracing::debug!(error = %e, "cannot count the expired leases"),
        }
        let month = Slot::new(fire_at).business_date;
        if let Some(day) = self.deadline_day {
            if let Some(at) = deadline(month.date(), day, self.tz) {
                metrics::gauge!(m::DEADLINE_TIMESTAMP, "job_name" => job)
                    .set(at.timestamp() as f64);
            }
        }
        match job_layer::claim::rows_for(&self.pool, job, month.date(), self.shard.count).await {
            Ok(rows) => {
                let settled = rows.iter().filter(|r| r.status == "SUCCESS").count() as f64;
                metrics::gauge!(m::LATEST_FIRE_TIMESTAMP, "job_name" => job)
                    .set(fire_at.timestamp() as f64);
                let not_success = f64::from(self.shard.count) - settled;
                metrics::gauge!(m::LATEST_FIRE_SHARDS_NOT_SUCCESS, "job_name" => job)
                    .set(not_success);
                if self.job.metrics().old_unsettled_shards {
                    metrics::gauge!(m::LATEST_MONTH_UNSETTLED_SHARDS, "job_name" => job)
                        .set(not_success);
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the latest month's claims"),
        }
    }

    /// The liveness task's refresh, on the heartbeat: the latest month's gauges, and what is not
    /// closed when it was not published within `stale_after` (the job's replica is in a run, or
    /// another job's), looking with at most `budget` per statement.
    pub async fn refresh(&self, stale_after: Duration, budget: Duration) {
        self.publish_latest_month().await;
        if self.lock().is_some_and(|at| at.elapsed() < stale_after) {
            return;
        }
        let Some(fire_at) = latest_slot_at_or_before(&self.cron, self.tz, self.clock.now()) else {
            return;
        };
        match self
            .look(Slot::new(fire_at).business_date, Some(budget))
            .await
        {
            Ok(looked) => self.publish_not_closed(&looked),
            Err(e) => tracing::debug!(error = %e, "cannot look at what is not closed"),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // A panic while holding this lock leaves an instant that is still whole.
        self.published.lock().unwrap_or_else(|e| e.into_inner())
    }
}
