//! The registry: the jobs a binary has, one object each, as the floors above the job layer see
//! them.
//!
//! A [`Job`] is generic over its plan (its `run_once` is monomorphised); the command line, the
//! daemon, the runs API, `status`, the page, `schedule` and the metrics hold jobs of different
//! types side by side, so each is wrapped in an [`Entry`] and seen as a [`Registered`] trait
//! object. The list of jobs itself is not here (this layer knows no job): it is the binary's one
//! list of [`Registration`]s, each exported by its job's own module.

use super::{
    Cursor, Fact, Job, JobKey, Metrics, Noted, Params, PendingReport, Preview, Progress, Proof,
    Result, RunOptions, RunReport, Words,
};
use chrono::NaiveDate;
use croner::Cron;
use sqlx::{PgConnection, PgPool};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// A boxed future, for methods of the object-safe [`Registered`].
pub type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// How a job is scheduled, resolved from its configuration section.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// A disabled job is listed and may be run by hand, but no replica schedules it.
    pub enabled: bool,
    pub cron: Cron,
}

/// A job as everything above the job layer sees it.
pub trait Registered: Send + Sync {
    fn name(&self) -> &'static str;
    /// The job it follows ([`Job::after`]).
    fn after(&self) -> Option<&'static str>;
    fn schedule(&self) -> &Schedule;
    /// The identifying parameters of `key` ([`Job::params`]): `Err` when the configuration does not
    /// cover the key's period.
    fn params(&self, key: &JobKey) -> std::result::Result<Params, String>;
    fn describe(&self, params: &Params) -> String;
    fn explain(&self, name: &str, noted: &Noted) -> String;
    /// [`super::run_once`] of this job.
    fn run<'a>(
        &'a self,
        pool: &'a PgPool,
        key: JobKey,
        opts: &'a RunOptions,
        shutdown: &'a CancellationToken,
        on_progress: &'a (dyn Fn(Progress) + Send + Sync),
    ) -> Boxed<'a, Result<RunReport>>;
    fn pending<'a>(
        &'a self,
        db: &'a mut PgConnection,
        shards: u32,
        periods: &'a [NaiveDate],
    ) -> Boxed<'a, sqlx::Result<PendingReport>>;
    fn upkeep<'a>(&'a self, pool: &'a PgPool, until: Instant) -> Boxed<'a, sqlx::Result<u64>>;
    /// [`Job::late_items`]: what a claim of a SUCCESS key asks before it skips it.
    fn late_items<'a>(&'a self, pool: &'a PgPool, key: &'a JobKey) -> Boxed<'a, sqlx::Result<u64>>;
    fn facts<'a>(
        &'a self,
        db: &'a mut PgConnection,
        business_date: NaiveDate,
    ) -> Boxed<'a, sqlx::Result<Vec<Fact>>>;
    fn remaining<'a>(
        &'a self,
        db: &'a mut PgConnection,
        key: &'a JobKey,
        cursor: Cursor,
    ) -> Boxed<'a, sqlx::Result<Option<u64>>>;
    /// [`Job::prove`]: `None` when the job has no proof of its periods.
    fn prove<'a>(
        &'a self,
        db: &'a mut PgConnection,
        business_date: NaiveDate,
    ) -> Boxed<'a, sqlx::Result<Option<Proof>>>;
    /// [`Job::preview`]: `None` when the job cannot tell what its runs would write.
    fn preview<'a>(
        &'a self,
        db: &'a mut PgConnection,
        business_date: NaiveDate,
        count: u32,
        shards: &'a [u32],
    ) -> Boxed<'a, sqlx::Result<Option<Preview>>>;
    fn words(&self) -> Words;
    fn describe_metrics(&self);
    fn metrics(&self) -> Metrics;
}

/// A [`Job`] with its schedule: what the registry holds.
pub struct Entry<J> {
    pub job: J,
    pub schedule: Schedule,
}

impl<J> Registered for Entry<J>
where
    J: Job + Send + Sync + 'static,
{
    fn name(&self) -> &'static str {
        self.job.name()
    }

    fn after(&self) -> Option<&'static str> {
        self.job.after()
    }

    fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    fn params(&self, key: &JobKey) -> std::result::Result<Params, String> {
        self.job.params(key)
    }

    fn describe(&self, params: &Params) -> String {
        self.job.describe(params)
    }

    fn explain(&self, name: &str, noted: &Noted) -> String {
        self.job.explain(name, noted)
    }

    fn run<'a>(
        &'a self,
        pool: &'a PgPool,
        key: JobKey,
        opts: &'a RunOptions,
        shutdown: &'a CancellationToken,
        on_progress: &'a (dyn Fn(Progress) + Send + Sync),
    ) -> Boxed<'a, Result<RunReport>> {
        Box::pin(super::run_once(
            pool,
            &self.job,
            key,
            opts,
            shutdown,
            on_progress,
        ))
    }

    fn pending<'a>(
        &'a self,
        db: &'a mut PgConnection,
        shards: u32,
        periods: &'a [NaiveDate],
    ) -> Boxed<'a, sqlx::Result<PendingReport>> {
        Box::pin(self.job.pending(db, shards, periods))
    }

    fn upkeep<'a>(&'a self, pool: &'a PgPool, until: Instant) -> Boxed<'a, sqlx::Result<u64>> {
        Box::pin(self.job.upkeep(pool, until))
    }

    fn late_items<'a>(&'a self, pool: &'a PgPool, key: &'a JobKey) -> Boxed<'a, sqlx::Result<u64>> {
        Box::pin(self.job.late_items(pool, key))
    }

    fn facts<'a>(
        &'a self,
        db: &'a mut PgConnection,
        business_date: NaiveDate,
    ) -> Boxed<'a, sqlx::Result<Vec<Fact>>> {
        Box::pin(self.job.facts(db, business_date))
    }

    fn remaining<'a>(
        &'a self,
        db: &'a mut PgConnection,
        key: &'a JobKey,
        cursor: Cursor,
    ) -> Boxed<'a, sqlx::Result<Option<u64>>> {
        Box::pin(self.job.remaining(db, key, cursor))
    }

    fn prove<'a>(
        &'a self,
        db: &'a mut PgConnection,
        business_date: NaiveDate,
    ) -> Boxed<'a, sqlx::Result<Option<Proof>>> {
        Box::pin(self.job.prove(db, business_date))
    }

    fn preview<'a>(
        &'a self,
        db: &'a mut PgConnection,
        business_date: NaiveDate,
        count: u32,
        shards: &'a [u32],
    ) -> Boxed<'a, sqlx::Result<Option<Preview>>> {
        Box::pin(self.job.preview(db, business_date, count, shards))
    }

    fn words(&self) -> Words {
        self.job.words()
    }

    fn describe_metrics(&self) {
        self.job.describe_metrics()
    }

    fn metrics(&self) -> Metrics {
        self.job.metrics()
    }
}

/// One job a binary has: its name, its schedule's defaults, and how to build it from the
/// settings (`S`: the binary's settings type, which this layer does not know).
pub struct Registration<S> {
    pub name: &'static str,
    /// Its cron when its configuration section sets none.
    pub default_cron: &'static str,
    /// Whether it is scheduled when its section does not say.
    pub enabled_by_default: bool,
    /// Whether it also takes its cron from `schedule.cron` (the fine settlement's key from before
    /// jobs had sections of their own; never together with its section's `cron`).
    pub reads_schedule_cron: bool,
    pub build: fn(&S, Schedule) -> Arc<dyn Registered>,
}

impl<S> Registration<S> {
    /// Its configuration section: the name with `-` written `_`, so a shell can export
    /// `SETTLEMENTD__JOBS__<SECTION>__CRON`.
    pub fn section(&self) -> String {
        section_of(self.name)
    }
}

/// The configuration section of the job `name`.
pub fn section_of(name: &str) -> String {
    name.replace('-', "_")
}

/// The jobs of a binary, in the order of its list.
#[derive(Clone)]
pub struct Registry {
    jobs: Vec<Arc<dyn Registered>>,
}

impl Registry {
    pub fn new(jobs: Vec<Arc<dyn Registered>>) -> Self {
        Self { jobs }
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Registered>> {
        self.jobs.iter()
    }

    /// The jobs a replica schedules.
    pub fn enabled(&self) -> impl Iterator<Item = &Arc<dyn Registered>> {
        self.jobs.iter().filter(|j| j.schedule().enabled)
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.jobs.iter().map(|j| j.name()).collect()
    }

    /// The job called `name`, or why there is none (naming those there are).
    pub fn get(&self, name: &str) -> std::result::Result<&Arc<dyn Registered>, String> {
        self.jobs.iter().find(|j| j.name() == name).ok_or_else(|| {
            format!(
                "unknown job {name:?}: this binary has {}",
                self.names().join(", ")
            )
        })
    }
}
