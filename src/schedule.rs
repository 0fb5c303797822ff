//! Fire times and their business dates: pure functions of (cron, zone, now).
//!
//! These decide *which month* a replica works on, so they never read the wall clock: callers pass
//! `now` from an injected [`crate::clock::Clock`]. The slots of a schedule are the sequence croner's forward
//! search produces in the configured zone; [`latest_slot_at_or_before`] is defined on that same
//! sequence, so "the slot that is due" and "the next fire time" can never disagree.
//!
//! Daylight-saving time (croner's rules, tested below in America/New_York):
//! - spring gap: a fire time that does not exist that day (02:30 when clocks jump 02:00 → 03:00)
//!   fires once at the first valid instant after the gap (03:00 the same day);
//! - autumn repeat: a fire time that exists twice (01:30 when clocks fall back 02:00 → 01:00)
//!   fires once, at its first (daylight-time) occurrence.
//!
//! The business date of a slot is the month end before the slot's date *in the zone*.

use crate::calendar::BusinessDate;
use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use chrono_tz::Tz;
use croner::Cron;
use std::sync::OnceLock;

/// One scheduled fire time and the month it settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub fire_at: DateTime<Tz>,
    pub business_date: BusinessDate,
}

impl Slot {
    pub fn new(fire_at: DateTime<Tz>) -> Self {
        Self {
            fire_at,
            business_date: BusinessDate::for_instant(&fire_at),
        }
    }

    /// `{"fire_at": "<RFC 3339 with the zone's offset>", "business_date": "YYYY-MM-DD"}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "fire_at": self.fire_at.to_rfc3339_opts(SecondsFormat::Secs, false),
            "business_date": self.business_date.to_string(),
        })
    }
}

/// `at` in the schedule's zone as every surface shows a time — the page, `status`, `jobs`:
/// `2026-11-01 02:30:00 +08:00`, so one look never mixes zones.
pub fn local_time(at: DateTime<Utc>, tz: Tz) -> String {
    at.with_timezone(&tz)
        .format("%Y-%m-%d %H:%M:%S %:z")
        .to_string()
}

/// The zone the messages of the job layer and the commands show times in (a pause's, a
/// correction's): the schedule's, set once by the binary when its configuration is read
/// ([`show_times_in`]), so a refusal says the time the page and `status` say. UTC until then (a
/// caller of the library that did not set it).
static SHOWN_IN: OnceLock<Tz> = OnceLock::new();

/// Makes [`shown`] use `tz` (the binary's `schedule.timezone`) for the rest of the process; a
/// second call changes nothing.
pub fn show_times_in(tz: Tz) {
    let _ = SHOWN_IN.set(tz);
}

/// `at` as a message shows it: [`local_time`] in the zone of [`show_times_in`].
pub fn shown(at: DateTime<Utc>) -> String {
    local_time(at, SHOWN_IN.get().copied().unwrap_or(chrono_tz::UTC))
}

/// The first fire time strictly after `now`, in `tz`; `None` when the pattern never fires again.
pub fn next_slot_after(cron: &Cron, tz: Tz, now: DateTime<Utc>) -> Option<DateTime<Tz>> {
    cron.find_next_occurrence(&now.with_timezone(&tz), false)
        .ok()
}

/// The most recent fire time at or before `now`, in `tz`; `None` when the pattern never fired.
///
/// croner's backward search is only a starting point: it does not snap into a spring gap the way
/// the forward search does, and in an autumn repeat it may land on the second occurrence. So we
/// step back far enough to be before any DST transition near the candidate, then walk forward
/// with the same search that produces [`next_slot_after`].
pub fn latest_slot_at_or_before(cron: &Cron, tz: Tz, now: DateTime<Utc>) -> Option<DateTime<Tz>> {
    // DST shifts are at most a couple of hours; three covers every zone in the tz database.
    const MARGIN: TimeDelta = TimeDelta::hours(3);
    // Bounds the forward walk for very frequent patterns (a per-second cron walks 3 h of slots).
    const MAX_STEPS: usize = 100_000;
    let local_now = now.with_timezone(&tz);
    let mut probe = local_now;
    // A few rounds: if a round's start turns out to be after the true latest slot, go further back.
    for _ in 0..4 {
        let candidate = cron.find_previous_occurrence(&probe, true).ok()?;
        let start = candidate.with_timezone(&Utc) - MARGIN;
        let mut latest = None;
        let mut cursor = start;
        for _ in 0..MAX_STEPS {
            match next_slot_after(cron, tz, cursor) {
                Some(next) if next <= local_now => {
                    latest = Some(next);
                    cursor = next.with_timezone(&Utc);
                }
                _ => break,
            }
        }
        if latest.is_some() {
            return latest;
        }
        probe = start.with_timezone(&tz);
    }
    None
}

/// The next `n` slots after `now`.
pub fn next_slots(cron: &Cron, tz: Tz, now: DateTime<Utc>, n: usize) -> Vec<Slot> {
    let mut slots = Vec::with_capacity(n.min(1024));
    let mut cursor = now;
    while slots.len() < n {
        let Some(fire_at) = next_slot_after(cron, tz, cursor) else {
            break;
        };
        slots.push(Slot::new(fire_at));
        cursor = fire_at.with_timezone(&Utc);
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use chrono_tz::America::New_York;
    use chrono_tz::Asia::Shanghai;

    fn cron(text: &str) -> Cron {
        crate::config::parse_cron(text).unwrap()
    }

    fn utc(tz: Tz, y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
        tz.with_ymd_and_hms(y, mo, d, h, mi, s)
            .earliest()
            .unwrap()
            .with_timezone(&Utc)
    }

    fn rfc(dt: DateTime<Tz>) -> String {
        dt.to_rfc3339_opts(SecondsFormat::Secs, false)
    }

    fn bd(slot: &Slot) -> String {
        slot.business_date.to_string()
    }

    #[test]
    fn a_slot_is_due_from_its_fire_time_inclusive() {
        let c = cron("0 30 2 1 * *");
        let at = utc(Shanghai, 2027, 1, 1, 2, 30, 0);
        let slot = Slot::new(latest_slot_at_or_before(&c, Shanghai, at).unwrap());
        assert_eq!(rfc(slot.fire_at), "2027-01-01T02:30:00+08:00");
        assert_eq!(bd(&slot), "2026-12-31");

        let just_before = at - TimeDelta::seconds(1);
        let slot = Slot::new(latest_slot_at_or_before(&c, Shanghai, just_before).unwrap());
        assert_eq!(rfc(slot.fire_at), "2026-12-01T02:30:00+08:00");
        assert_eq!(bd(&slot), "2026-11-30");
        assert_eq!(
            next_slot_after(&c, Shanghai, just_before)
                .map(rfc)
                .as_deref(),
            Some("2027-01-01T02:30:00+08:00")
        );
        // Strictly after: at the fire time itself the next slot is a month later.
        assert_eq!(
            next_slot_after(&c, Shanghai, at).map(rfc).as_deref(),
            Some("2027-02-01T02:30:00+08:00")
        );
    }

    #[test]
    fn the_fire_time_is_read_in_the_zone_not_in_utc() {
        // 2026-12-31 18:30 UTC is 2027-01-01 02:30 in Shanghai: December is settled, not November.
        let c = cron("0 30 2 1 * *");
        let now = Utc.with_ymd_and_hms(2026, 12, 31, 18, 30, 0).unwrap();
        let slot = Slot::new(latest_slot_at_or_before(&c, Shanghai, now).unwrap());
        assert_eq!(bd(&slot), "2026-12-31");
    }

    #[test]
    fn slots_across_year_ends_and_leap_years_settle_the_previous_month() {
        let c = cron("0 30 2 1 * *");
        let slots = next_slots(&c, Shanghai, utc(Shanghai, 2027, 12, 15, 0, 0, 0), 15);
        let got: Vec<(String, String)> = slots.iter().map(|s| (rfc(s.fire_at), bd(s))).collect();
        assert_eq!(got.len(), 15);
        assert_eq!(
            got[0],
            ("2028-01-01T02:30:00+08:00".into(), "2027-12-31".into())
        );
        assert_eq!(
            got[2],
            ("2028-03-01T02:30:00+08:00".into(), "2028-02-29".into())
        );
        assert_eq!(
            got[12],
            ("2029-01-01T02:30:00+08:00".into(), "2028-12-31".into())
        );
        assert_eq!(
            got[14],
            ("2029-03-01T02:30:00+08:00".into(), "2029-02-28".into())
        );
        // Every month exactly once, in order.
        for pair in slots.windows(2) {
            assert!(pair[0].fire_at < pair[1].fire_at);
            assert_ne!(pair[0].business_date, pair[1].business_date);
        }
    }

    #[test]
    fn walking_latest_slot_over_a_year_visits_every_month_once() {
        let c = cron("0 30 2 1 * *");
        let mut now = utc(Shanghai, 2027, 1, 1, 0, 0, 0);
        let mut seen = Vec::new();
        while now < utc(Shanghai, 2028, 1, 1, 0, 0, 0) {
            let slot = Slot::new(latest_slot_at_or_before(&c, Shanghai, now).unwrap());
            if seen.last() != Some(&slot.business_date) {
                seen.push(slot.business_date);
            }
            now += TimeDelta::hours(7);
        }
        let got: Vec<String> = seen.iter().map(|d| d.to_string()).collect();
        assert_eq!(got.len(), 13, "{got:?}");
        assert_eq!(got[0], "2026-11-30");
        assert_eq!(got[1], "2026-12-31");
        assert_eq!(got[12], "2027-11-30");
    }

    #[test]
    fn in_the_new_york_spring_gap_0230_fires_once_at_0300_the_same_day() {
        let c = cron("0 30 2 * * *");
        // 2027-03-14: clocks jump from 02:00 EST to 03:00 EDT.
        let before = utc(New_York, 2027, 3, 14, 1, 0, 0);
        let slots = next_slots(&c, New_York, before, 2);
        assert_eq!(rfc(slots[0].fire_at), "2027-03-14T03:00:00-04:00");
        assert_eq!(rfc(slots[1].fire_at), "2027-03-15T02:30:00-04:00");
        // The due slot agrees with the forward sequence (croner's own backward search does not).
        for (h, m) in [(3, 0), (3, 1), (4, 0), (23, 59)] {
            let now = utc(New_York, 2027, 3, 14, h, m, 0);
            assert_eq!(
                latest_slot_at_or_before(&c, New_York, now)
                    .map(rfc)
                    .as_deref(),
                Some("2027-03-14T03:00:00-04:00"),
                "at {h}:{m}"
            );
        }
        let now = utc(New_York, 2027, 3, 14, 1, 59, 59);
        assert_eq!(
            latest_slot_at_or_before(&c, New_York, now)
                .map(rfc)
                .as_deref(),
            Some("2027-03-13T02:30:00-05:00")
        );
    }

    #[test]
    fn in_the_new_york_autumn_repeat_0130_fires_once_at_its_first_occurrence() {
        let c = cron("0 30 1 * * *");
        // 2026-11-01: 01:00-02:00 happens twice (EDT, then EST).
        let slots = next_slots(&c, New_York, utc(New_York, 2026, 11, 1, 0, 0, 0), 2);
        assert_eq!(rfc(slots[0].fire_at), "2026-11-01T01:30:00-04:00");
        assert_eq!(rfc(slots[1].fire_at), "2026-11-02T01:30:00-05:00");
        // During the second pass through 01:30 (EST), the due slot is still the first one.
        let second_pass = Utc.with_ymd_and_hms(2026, 11, 1, 6, 45, 0).unwrap();
        assert_eq!(
            latest_slot_at_or_before(&c, New_York, second_pass)
                .map(rfc)
                .as_deref(),
            Some("2026-11-01T01:30:00-04:00")
        );
        assert_eq!(
            next_slot_after(&c, New_York, second_pass)
                .map(rfc)
                .as_deref(),
            Some("2026-11-02T01:30:00-05:00")
        );
    }

    #[test]
    fn a_monthly_new_york_schedule_keeps_its_months_through_both_transitions() {
        let c = cron("0 30 2 1 * *");
        let slots = next_slots(&c, New_York, utc(New_York, 2026, 9, 15, 0, 0, 0), 8);
        let got: Vec<String> = slots.iter().map(|s| rfc(s.fire_at)).collect();
        assert_eq!(got[1], "2026-11-01T02:30:00-05:00");
        assert_eq!(got[6], "2027-04-01T02:30:00-04:00");
        let dates: Vec<String> = slots.iter().map(bd).collect();
        assert_eq!(dates[0], "2026-09-30");
        assert_eq!(dates[7], "2027-04-30");
    }

    #[test]
    fn json_lines_carry_the_zone_offset_and_the_business_date() {
        let c = cron("0 30 2 1 * *");
        let slot = next_slots(&c, Shanghai, utc(Shanghai, 2028, 2, 10, 0, 0, 0), 1)[0];
        assert_eq!(
            slot.to_json().to_string(),
            r#"{"business_date":"2028-02-29","fire_at":"2028-03-01T02:30:00+08:00"}"#
        );
    }
}
