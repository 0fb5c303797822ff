//! `settlementd schedule`: the next fire times of a job and the months they run (no database).

use crate::clock::Clock;
use crate::config::Settings;
use crate::job_layer::registry::Registered;
use crate::schedule::{next_slots, Slot};
use chrono::SecondsFormat;

/// The next `n` slots of `job` after the clock's now.
pub fn next(settings: &Settings, job: &dyn Registered, clock: &dyn Clock, n: usize) -> Vec<Slot> {
    next_slots(
        &job.schedule().cron,
        settings.schedule.timezone,
        clock.now(),
        n,
    )
}

/// `<fire time with the zone's offset>  <what a run of the job does> <business date>` ("settles",
/// the job's [`Words::run_does`](crate::job_layer::Words)).
pub fn slot_line(job: &dyn Registered, slot: &Slot) -> String {
    format!(
        "{}  {} {}",
        slot.fire_at.to_rfc3339_opts(SecondsFormat::Secs, false),
        job.words().run_does,
        slot.business_date
    )
}
