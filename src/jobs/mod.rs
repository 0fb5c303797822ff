//! The jobs of this binary, one module each under its own name, and their one list ([`JOBS`]).
//!
//! A job's module holds everything of the job: its [`Job`](crate::job_layer::Job) and
//! [`Configured`] implementation (name, default cron, own settings), its words and metrics, its
//! proof and its tools. It uses the layers below (the job layer, the settings, the database) and
//! no other job's module: the arrows point inward only. The command line, the daemon, the runs
//! API, `status`, the page, `schedule` and the metrics iterate the [`Registry`] built here and
//! name no job themselves. Adding a job is its own module, migration and test, plus one line in
//! [`JOBS`] (docs/ADDING-A-JOB.md).

use crate::config::{ConfigError, Settings};
use crate::job_layer::registry::{section_of, Registration, Registry, Schedule};

/// Declares each job's module (`src/jobs/<module>.rs` or `src/jobs/<module>/mod.rs`) and lists
/// its type in [`JOBS`]: one line per job.
macro_rules! jobs {
    ($($module:ident :: $job:ident,)+) => {
        $(pub mod $module;)+

        /// Every job this binary has, in the order they are listed, scheduled and shown. The first
        /// is the default of `--job` and of the runs API's `job`.
        pub const JOBS: &[Registration<Settings>] = &[$(Registration::of::<$module::$job>(),)+];
    };
}

jobs! {
    fine_settlement::FineSettlement,
    member_statements::MemberStatements,
}

/// The job `--job` and the runs API mean when they name none.
pub fn default_job() -> &'static str {
    JOBS[0].name
}

/// The registry of `settings`, which [`check`] accepted (as [`load`] does): every job built from
/// its section.
pub fn build(settings: &Settings) -> Registry {
    match try_build(settings) {
        Ok(registry) => registry,
        // Unreachable from the binary, whose settings come through `load`.
        Err(e) => panic!("settings not checked by jobs::check: {e}"),
    }
}

fn try_build(settings: &Settings) -> Result<Registry, ConfigError> {
    let jobs = JOBS.iter().map(|r| {
        let section = settings.jobs.get(&r.section());
        let own = section.map(|s| s.own.clone()).unwrap_or_default();
        r.build(settings, own.into(), schedule_of(r, settings))
            .map_err(|e| ConfigError(format!("[jobs.{}]: {e}", r.section())))
    });
    Ok(Registry::new(jobs.collect::<Result<_, _>>()?))
}

/// A job's schedule: its section's keys, else its defaults.
fn schedule_of(r: &Registration<Settings>, settings: &Settings) -> Schedule {
    let section = settings.jobs.get(&r.section());
    let cron = section.and_then(|s| s.cron.clone()).unwrap_or_else(|| {
        crate::config::parse_cron(r.default_cron).expect("a job's default cron parses")
    });
    Schedule {
        enabled: section
            .and_then(|s| s.enabled)
            .unwrap_or(r.enabled_by_default),
        cron,
    }
}

/// Checks the settings' `[jobs.<section>]`s:
/// - a section that names no job of [`JOBS`] is refused — naming the right spelling when only the
///   `-` is wrong;
/// - every job is built from its section: a job's own key that is unknown or of a bad value is
///   refused, naming the section.
pub fn check(settings: Settings) -> Result<Settings, ConfigError> {
    let sections: Vec<String> = JOBS.iter().map(|r| r.section()).collect();
    for key in settings.jobs.keys() {
        if sections.contains(key) {
            continue;
        }
        let underscored = section_of(key);
        if sections.contains(&underscored) {
            return Err(ConfigError(format!(
                "[jobs.{key}]: write the section as [jobs.{underscored}] (a job's `-` is `_` in \
                 its section and its variables: SETTLEMENTD__JOBS__{}__CRON)",
                underscored.to_uppercase()
            )));
        }
        return Err(ConfigError(format!(
            "unknown job section [jobs.{key}]: this binary has {}",
            sections
                .iter()
                .map(|s| format!("[jobs.{s}]"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    try_build(&settings)?;
    Ok(settings)
}

/// [`Settings::load`] and [`check`]: what the binary runs with.
pub fn load(file: Option<&std::path::Path>) -> Result<Settings, ConfigError> {
    check(Settings::load(file)?)
}
