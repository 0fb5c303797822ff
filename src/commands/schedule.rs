//! `settlementd schedule`: the next fire times of a job and the months they run (no database).

use crate::clock::Clock;
use crate::config::Settings;
use crate::jobs::registry::Registered;
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

/// `<fire time with the zone's offset>  settles <business date>`.
pub fn slot_line(slot: &Slot) -> String {
    format!(
        "{}  settles {}",
        slot.fire_at.to_rfc3339_opts(SecondsFormat::Secs, false),
        slot.business_date
    )
}
