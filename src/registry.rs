//! The binary's jobs: the one list ([`JOBS`]), and their schedules resolved from the settings.
//!
//! Each job's module exports its [`Registration`] (name, default cron, how to build it); the
//! command line, the daemon, the runs API, `status`, the page, `schedule` and the metrics iterate
//! the [`Registry`] built here and name no job themselves. Adding a job is its own module and
//! migration, plus one line here.

use crate::config::{ConfigError, Settings};
use crate::jobs::registry::{section_of, Registration, Registry, Schedule};

/// Every job this binary has, in the order they are listed, scheduled and shown. The first is the
/// default of `--job` and of the runs API's `job`.
pub const JOBS: &[Registration<Settings>] = &[
    crate::settlement::REGISTRATION,
    crate::statements::REGISTRATION,
];

/// The job `--job` and the runs API mean when they name none.
pub fn default_job() -> &'static str {
    JOBS[0].name
}

/// The registry of `settings` (checked by [`check`] when they were loaded).
pub fn build(settings: &Settings) -> Registry {
    Registry::new(
        JOBS.iter()
            .map(|r| (r.build)(settings, schedule_of(r, settings)))
            .collect(),
    )
}

/// A job's schedule: its section's keys, else (for the job that reads it) `schedule.cron`, else
/// its defaults.
fn schedule_of(r: &Registration<Settings>, settings: &Settings) -> Schedule {
    let section = settings.jobs.get(&r.section());
    let legacy = r
        .reads_schedule_cron
        .then(|| settings.schedule.cron.clone())
        .flatten();
    let cron = section
        .and_then(|s| s.cron.clone())
        .or(legacy)
        .unwrap_or_else(|| {
            crate::config::parse_cron(r.default_cron).expect("a job's default cron parses")
        });
    Schedule {
        enabled: section
            .and_then(|s| s.enabled)
            .unwrap_or(r.enabled_by_default),
        cron,
    }
}

/// Refuses `[jobs.<section>]` sections that name no job of [`JOBS`] — naming the right spelling
/// when only the `-` is wrong — and a job's cron given twice.
pub fn check(settings: &Settings) -> Result<(), ConfigError> {
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
    for r in JOBS.iter().filter(|r| r.reads_schedule_cron) {
        let own = settings
            .jobs
            .get(&r.section())
            .is_some_and(|s| s.cron.is_some());
        if own && settings.schedule.cron.is_some() {
            return Err(ConfigError(format!(
                "schedule.cron and jobs.{}.cron are both set: they are the same setting, keep one",
                r.section()
            )));
        }
    }
    Ok(())
}

/// [`Settings::load`] and [`check`]: what the binary runs with.
pub fn load(file: Option<&std::path::Path>) -> Result<Settings, ConfigError> {
    let settings = Settings::load(file)?;
    check(&settings)?;
    Ok(settings)
}
