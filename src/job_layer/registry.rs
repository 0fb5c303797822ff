//! The registry: the jobs a binary has, one object each, as the floors above the job layer see
//! them.
//!
//! A [`Job`] is generic over its plan (its `run_once` is monomorphised); the command line, the
//! daemon, the runs API, `status`, the page, `schedule` and the metrics hold jobs of different
//! types side by side, so each is wrapped in an [`Entry`] and seen as a [`Registered`] trait
//! object. The list of jobs itself is not here (this layer knows no job): it is the binary's one
//! list of [`Registration`]s, each exported by its job's own module.

use super::{
    BusinessDate, Cursor, Fact, Job, JobKey, Metrics, Noted, Params, PendingReport, Preview,
    Progress, Proof, ProveError, Result, RunOptions, RunReport, Words,
};
use chrono::NaiveDate;
use croner::Cron;
use serde::de::DeserializeOwned;
use sqlx::{PgConnection, PgPool};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
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
    /// Gives it the job it follows, by which its runs ask what still waits of a period in that
    /// job ([`Registry::new`] links each follower once).
    fn follow(&self, leader: Arc<dyn Registered>);
    /// The job it follows, once linked.
    fn leader(&self) -> Option<&dyn Registered>;
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
        month: BusinessDate,
    ) -> Boxed<'a, sqlx::Result<Vec<Fact>>>;
    /// [`Job::facts_mark`].
    fn facts_mark<'a>(
        &'a self,
        db: &'a mut PgConnection,
        month: BusinessDate,
    ) -> Boxed<'a, sqlx::Result<Option<i64>>>;
    fn remaining<'a>(
        &'a self,
        db: &'a mut PgConnection,
        key: &'a JobKey,
        cursor: Cursor,
    ) -> Boxed<'a, sqlx::Result<Option<u64>>>;
    /// [`Job::prove`]: `None` when the job has no proof of its periods.
    fn prove<'a>(
        &'a self,
        pool: &'a PgPool,
        month: BusinessDate,
    ) -> Boxed<'a, std::result::Result<Option<Proof>, ProveError>>;
    /// [`Job::preview`]: `None` when the job cannot tell what its runs would write.
    fn preview<'a>(
        &'a self,
        db: &'a mut PgConnection,
        month: BusinessDate,
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
    /// The job it follows, once the registry linked it ([`Registered::follow`]).
    leader: OnceLock<Arc<dyn Registered>>,
}

impl<J> Registered for Entry<J>
where
    J: Job + Send + Sync + 'static,
{
    fn name(&self) -> &'static str {
        J::NAME
    }

    fn after(&self) -> Option<&'static str> {
        self.job.after()
    }

    fn follow(&self, leader: Arc<dyn Registered>) {
        let _ = self.leader.set(leader);
    }

    fn leader(&self) -> Option<&dyn Registered> {
        self.leader.get().map(|l| &**l)
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
        Box::pin(super::runner::run_following(
            pool,
            &self.job,
            self.leader(),
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
        month: BusinessDate,
    ) -> Boxed<'a, sqlx::Result<Vec<Fact>>> {
        Box::pin(self.job.facts(db, month))
    }

    fn facts_mark<'a>(
        &'a self,
        db: &'a mut PgConnection,
        month: BusinessDate,
    ) -> Boxed<'a, sqlx::Result<Option<i64>>> {
        Box::pin(self.job.facts_mark(db, month))
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
        pool: &'a PgPool,
        month: BusinessDate,
    ) -> Boxed<'a, std::result::Result<Option<Proof>, ProveError>> {
        Box::pin(self.job.prove(pool, month))
    }

    fn preview<'a>(
        &'a self,
        db: &'a mut PgConnection,
        month: BusinessDate,
        count: u32,
        shards: &'a [u32],
    ) -> Boxed<'a, sqlx::Result<Option<Preview>>> {
        Box::pin(self.job.preview(db, month, count, shards))
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

/// How a job is made from the binary's settings (`S`, a type this layer does not know) and from
/// its own keys of `[jobs.<section>]`: what its [`Registration`] builds.
pub trait Configured<S>: Job + Sized + Send + Sync + 'static {
    /// Its own keys of `[jobs.<section>]`, besides `enabled` and `cron`, which every job's section
    /// has: typed, with `#[serde(deny_unknown_fields)]` so that a misspelt key is refused at start
    /// (exit 2) like every setting. [`NoSettings`] for a job without any.
    type Settings: DeserializeOwned;
    /// Its cron (six fields, seconds first, in `schedule.timezone`) when its section sets none.
    const DEFAULT_CRON: &'static str;
    /// Whether a replica schedules it when its section does not say.
    const ENABLED_BY_DEFAULT: bool = true;
    /// The job, from the binary's settings and its own; `Err`: why one of its own values is not
    /// valid, in words (the configuration's error then names the section).
    fn build(settings: &S, own: Self::Settings) -> std::result::Result<Self, String>;
}

/// The own settings of a job that has none: its section takes `enabled` and `cron` only.
#[derive(Debug, Clone, Copy, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoSettings {}

/// One job a binary has, as its list holds it ([`Registration::of`]): its name, its schedule's
/// defaults, and how to build it.
pub struct Registration<S> {
    pub name: &'static str,
    /// Its cron when its configuration section sets none.
    pub default_cron: &'static str,
    /// Whether it is scheduled when its section does not say.
    pub enabled_by_default: bool,
    build: Build<S>,
}

/// Builds a job from the binary's settings, its own keys (a JSON object) and its schedule.
type Build<S> =
    fn(&S, serde_json::Value, Schedule) -> std::result::Result<Arc<dyn Registered>, String>;

impl<S> Registration<S> {
    /// The registration of the job `J`: everything it says comes from `J`.
    pub const fn of<J: Configured<S>>() -> Self {
        Self {
            name: J::NAME,
            default_cron: J::DEFAULT_CRON,
            enabled_by_default: J::ENABLED_BY_DEFAULT,
            build: build::<S, J>,
        }
    }

    /// Its configuration section: the name with `-` written `_`, so a shell can export
    /// `SETTLEMENTD__JOBS__<SECTION>__CRON`.
    pub fn section(&self) -> String {
        section_of(self.name)
    }

    /// The job, from the binary's settings, its own keys of its section (`own`, an object; `{}`
    /// when it has no section) and its schedule; `Err`: what is wrong with its own keys.
    pub fn build(
        &self,
        settings: &S,
        own: serde_json::Value,
        schedule: Schedule,
    ) -> std::result::Result<Arc<dyn Registered>, String> {
        (self.build)(settings, own, schedule)
    }
}

fn build<S, J: Configured<S>>(
    settings: &S,
    own: serde_json::Value,
    schedule: Schedule,
) -> std::result::Result<Arc<dyn Registered>, String> {
    // serde's words for a struct's fields, said of a section's keys.
    let own: J::Settings = serde_json::from_value(own).map_err(|e| {
        e.to_string()
            .replace("unknown field", "unknown key")
            .replace(
                ", there are no fields",
                ": the section takes `enabled` and `cron` only",
            )
            .replace(", expected", "; besides `enabled` and `cron` it takes")
    })?;
    Ok(Arc::new(Entry {
        job: J::build(settings, own)?,
        schedule,
        leader: OnceLock::new(),
    }))
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
    /// The jobs, each follower linked to the job it follows when the list has it.
    pub fn new(jobs: Vec<Arc<dyn Registered>>) -> Self {
        for job in &jobs {
            if let Some(leader) = job
                .after()
                .and_then(|name| jobs.iter().find(|j| j.name() == name))
            {
                job.follow(leader.clone());
            }
        }
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
