//! `settlementd status`: one month of one job (`--job`, default the fine settlement) as the status
//! page shows it — each shard's claim, whether the month is closed (items waiting, rows held, a
//! correction unfinished), its pinned parameters, its facts (the settlement: settled rows, fine
//! sum, digest), each shard's latest events from the audit trail (`--history N`), and what the
//! job's replicas watch across the lookback (months not closed, items waiting before it, a pause).
//! It reads the page's own overview ([`crate::overview`]), with a command's patience instead of
//! the page's budget, so the two never disagree.

use crate::app::{business_date_or_default, AppError, Database, Result};
use crate::calendar::BusinessDate;
use crate::clock::{Clock, SystemClock};
use crate::config::{Settings, MAX_SHARDS};
use crate::job_layer::claim::JobRunRow;
use crate::job_layer::events::ShardEvent;
use crate::job_layer::fleet::Member;
use crate::job_layer::Cursor;
use crate::job_layer::Words;
use crate::overview::{self, Month, OverviewError, Scope, Totals, Watch};
use std::fmt::Write;
use std::time::Duration;

/// How long `status` lets its read take: a command waits for its answer.
pub const BUDGET: Duration = Duration::from_secs(600);

/// The most database time `status` spends counting a month's facts and what a run would write
/// (without `--count`): a month being run on a big library takes a minute to count, and `status`
/// is what an operator runs in an incident. Longer than the page's [`overview::COUNT_SLICE`]:
/// one command, not a page reloading every ten seconds.
pub const COUNT_SLICE: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Default)]
pub struct StatusRequest {
    /// The job (default: the registry's first).
    pub job: Option<String>,
    /// The month as its last day (default: last month's end in schedule.timezone).
    pub business_date: Option<String>,
    /// The shard count whose claims to show (default shard.count).
    pub shards: Option<u32>,
    /// How many of each shard's latest audit events to show (0: none).
    pub history: u32,
    /// Count the month's facts and preview however long it takes (within [`BUDGET`]); otherwise
    /// within [`COUNT_SLICE`].
    pub count: bool,
    pub embedded_db: bool,
}

/// One month as `status` shows it.
#[derive(Debug, Clone)]
pub struct MonthStatus {
    pub job: &'static str,
    pub words: Words,
    pub business_date: BusinessDate,
    pub shards: u32,
    pub month: Month,
    /// Each shard's latest audit events, by shard, newest first.
    pub history: Vec<ShardEvent>,
    /// What the job's replicas watch; `None` when it could not be read.
    pub watch: Option<Watch>,
    /// Every replica that reported in `replicas` ([`crate::job_layer::fleet`]); `None` when the
    /// schema predates it or it could not be read.
    pub fleet: Option<Vec<Member>>,
    /// `lease.heartbeat_secs`: a replica not reported for three is "gone?".
    pub heartbeat_secs: u64,
    /// `lease.ttl_secs`: a RUNNING claim whose heartbeat is older is nobody's.
    pub lease_ttl_secs: u64,
    /// The schedule's zone: the text shows every time in it, as the page does.
    pub tz: chrono_tz::Tz,
}

pub async fn status(settings: &Settings, request: &StatusRequest) -> Result<MonthStatus> {
    let job = super::run::job_of(settings, request.job.as_deref())?;
    let business_date =
        business_date_or_default(request.business_date.as_deref(), settings, &SystemClock)?;
    let shards = request.shards.unwrap_or(settings.shard.count);
    if !(1..=MAX_SHARDS).contains(&shards) {
        return Err(AppError::Invalid(format!(
            "--shards must be between 1 and {MAX_SHARDS}, got {shards}"
        )));
    }
    let database = Database::open_to_read(settings, request.embedded_db).await?;
    let slice = (!request.count).then_some(COUNT_SLICE);
    let reader = overview::Reader::with_budget(&database.pool, BUDGET, slice);
    let read = reader
        .read_with_history(
            settings,
            &job,
            SystemClock.now(),
            Scope::Month(business_date),
            shards,
            request.history,
        )
        .await;
    let fleet = reader.fleet().await;
    reader.close().await;
    database.close().await;
    let view = read.map_err(|e| match e {
        OverviewError::Job(e) => AppError::from(e),
        OverviewError::Db(e) => AppError::from(e),
        other => AppError::Failed(other.to_string()),
    })?;
    let month =
        view.months.into_iter().next().ok_or_else(|| {
            AppError::Failed(format!("{business_date}: the overview has no month"))
        })?;
    Ok(MonthStatus {
        tz: view.schedule.timezone,
        job: view.job,
        words: view.words,
        business_date,
        shards,
        month,
        history: view.history,
        watch: view.watch,
        fleet,
        heartbeat_secs: settings.lease.heartbeat_secs,
        lease_ttl_secs: settings.lease.ttl_secs,
    })
}

impl MonthStatus {
    fn row(&self, shard: u32) -> Option<&JobRunRow> {
        self.month.shards.get(shard as usize)?.run.as_ref()
    }

    /// The month's verdict ([`Month::verdict`]): the same judgement as the page's.
    pub fn verdict(&self) -> overview::Verdict {
        let paused = self.watch.as_ref().and_then(|w| w.paused.as_ref());
        // The shards a live replica runs, as the page's cells and Fleet say.
        let takers = self.fleet.as_ref().map(|fleet| {
            crate::job_layer::fleet::takers(
                fleet,
                self.job,
                self.shards,
                3.0 * self.heartbeat_secs as f64,
            )
        });
        let runners = takers.as_ref().map(|takers| overview::Runners {
            takers,
            lease_ttl_secs: self.lease_ttl_secs,
        });
        self.month.verdict(self.words, paused, self.tz, runners)
    }

    /// The `status --json` object.
    pub fn to_json(&self) -> serde_json::Value {
        let verdict = self.verdict();
        let runs: Vec<serde_json::Value> = self
            .month
            .shards
            .iter()
            .map(|shard| {
                let mut run = match &shard.run {
                    Some(row) => serde_json::to_value(row).unwrap_or_default(),
                    None => serde_json::json!({ "shard": shard.index, "status": "missing" }),
                };
                if let Some(pinned) = self.words.pinned {
                    run[format!("{pinned}_conflict")] = serde_json::json!(shard.conflict);
                }
                run
            })
            .collect();
        let totals = match &self.month.totals {
            Totals::Closed(facts) | Totals::SoFar(facts) => serde_json::Value::Object(
                facts
                    .iter()
                    .map(|f| (f.name.to_string(), f.value.clone()))
                    .collect(),
            ),
            _ => serde_json::Value::Null,
        };
        let watch = self.watch.as_ref().map(|w| {
            serde_json::json!({
                "lookback_months": w.lookback_months,
                "paused": w.paused,
                "months_not_closed": w.open().map(|n| serde_json::json!({
                    "business_date": n.business_date,
                    "state": n.state(),
                    "shards_not_success": n.unsettled_shards,
                    // null: not counted (a shard runs the month).
                    "waiting": n.counted.then_some(n.waiting),
                    "held": n.counted.then_some(n.held),
                    "correction_key": n.correction,
                })).collect::<Vec<_>>(),
                "months_held": w.held().map(|n| serde_json::json!({
                    "business_date": n.business_date,
                    "state": n.state(),
                    "held": n.held,
                })).collect::<Vec<_>>(),
                "waiting_before_lookback": w.before_lookback,
            })
        });
        let mut json = serde_json::json!({
            "job": self.job,
            "business_date": self.business_date.to_string(),
            "shards": self.shards,
            "closed": verdict.closed,
            "state": verdict.state,
            "verdict": verdict.words,
            "next": verdict.next,
            "held": self.month.unsettled.map(|u| u.held),
            "correction": self.month.correction.as_ref().map(|(key, since)| serde_json::json!({
                "key": key, "since": since,
            })),
            "watch": watch,
            "replicas": self.fleet,
            "heartbeat_secs": self.heartbeat_secs,
            "runs": runs,
            "totals": totals,
            "history": self.history.iter().map(|e| serde_json::json!({
                "business_date": e.business_date,
                "shard": e.event.shard,
                "at": e.event.at,
                "event": e.event.event,
                "attempt": e.event.attempt,
                "owner": e.event.owner,
                "request_id": e.event.request_id,
                "message": e.event.message,
            })).collect::<Vec<_>>(),
        });
        json[self.words.waiting_key] = serde_json::json!(self.month.unsettled.map(|u| u.late));
        if let Some(pinned) = self.words.pinned {
            json[pinned] = serde_json::json!(self.month.rule);
        }
        json
    }

    /// The table `status` prints without `--json` (lines end with a newline).
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{} {} with {} shard(s): {}",
            self.job,
            self.business_date,
            self.shards,
            self.verdict().words
        );
        if let Some(next) = self.verdict().next {
            let _ = writeln!(out, "next: {next}");
        }
        if let Some(pinned) = self.words.pinned {
            let _ = match &self.month.rule_text {
                Some(rule) => writeln!(out, "{pinned}: {rule}"),
                None => writeln!(out, "{pinned}: none pinned yet (no claim of the month)"),
            };
        }
        if self.month.held() > 0 {
            let _ = writeln!(
                out,
                "{}: left as they are until they are fixed",
                self.words.held.count(self.month.held())
            );
        }
        let _ = writeln!(
            out,
            "{:<6} {:<8} {:>7} {:<28} {:<12} {:>10} {:>12} {:>10} {:>10}  last_error",
            "shard",
            "status",
            "attempt",
            "owner",
            "release",
            "heartbeat",
            "cursor",
            "scanned",
            "updated"
        );
        for s in 0..self.shards {
            let _ = match self.row(s) {
                Some(r) => writeln!(
                    out,
                    "{:<6} {:<8} {:>7} {:<28} {:<12} {:>9.1}s {:>12} {:>10} {:>10}  {}",
                    s,
                    // A run the pause stopped: a pause, not a failure (the page says the same).
                    if r.stopped_by_pause() {
                        "PAUSED"
                    } else {
                        &r.status
                    },
                    r.attempt,
                    r.owner,
                    r.version.as_deref().unwrap_or("unrecorded"),
                    r.heartbeat_age_secs,
                    compact(r.cursor()),
                    r.scanned,
                    r.updated,
                    if r.stopped_by_pause() {
                        "stopped by the pause after its last committed batch; resumes where it \
                         stopped after `settlementd resume`"
                    } else {
                        r.last_error.as_deref().unwrap_or("")
                    }
                ),
                None => writeln!(out, "{s:<6} missing"),
            };
            if let Some(conflict) = self
                .month
                .shards
                .get(s as usize)
                .and_then(|x| x.conflict.as_ref())
            {
                let _ = writeln!(out, "       RULE CONFLICT: {conflict}");
            }
        }
        let _ = match &self.month.totals {
            Totals::Closed(facts) | Totals::SoFar(facts) => writeln!(
                out,
                "{}: {}",
                self.business_date.first_day().format("%Y-%m"),
                facts
                    .iter()
                    .map(|f| match (f.kind, plain(&f.value).parse::<i128>()) {
                        // Cents as the number, then as money: `fine_cents_sum=5217650 (52,176.50)`.
                        (crate::job_layer::FactKind::Cents, Ok(cents)) =>
                            format!("{}={cents} ({})", f.name, crate::numbers::money(cents)),
                        _ => format!("{}={}", f.name, plain(&f.value)),
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            Totals::Computing => writeln!(out, "totals: being computed"),
            Totals::Unavailable(why) => writeln!(out, "totals unavailable: {why}"),
        };
        if let Some(watch) = &self.watch {
            if let Some(p) = &watch.paused {
                let _ = writeln!(
                    out,
                    "PAUSED since {} by {}: {}",
                    crate::schedule::local_time(p.paused_at, self.tz),
                    p.paused_by,
                    p.reason
                );
            }
            for n in watch.open() {
                let _ = writeln!(
                    out,
                    "to settle within the lookback: {} ({})",
                    n.business_date,
                    overview::not_closed_words(n, self.words)
                );
            }
            for n in watch.held() {
                let _ = writeln!(
                    out,
                    "held within the lookback: {} ({}; fixed in libraryd, the next run takes them)",
                    n.business_date,
                    overview::not_closed_words(n, self.words)
                );
            }
            if watch.before_lookback > 0 {
                let _ = writeln!(
                    out,
                    "{} in months before the lookback of {}: no replica runs them by itself \
                     (`settlementd run --business-date D` does)",
                    self.words.waiting.count(watch.before_lookback),
                    crate::numbers::things(watch.lookback_months, "month", "months")
                );
            }
        }
        self.fleet_text(&mut out);
        if !self.history.is_empty() {
            let _ = writeln!(out, "history (newest first):");
        }
        for e in &self.history {
            let e = &e.event;
            let _ = writeln!(
                out,
                "  shard {:<3} {}  {:<16} {:<10} {:<28} {}{}",
                e.shard,
                crate::schedule::local_time(e.at, self.tz),
                e.event,
                e.attempt
                    .map(|a| format!("attempt {a}"))
                    .unwrap_or_default(),
                e.owner,
                e.message.as_deref().unwrap_or(""),
                e.request_id
                    .as_deref()
                    .map(|r| format!(" [request {r}]"))
                    .unwrap_or_default()
            );
        }
        out
    }
}

impl MonthStatus {
    /// The fleet's lines: one per replica that reported, and the releases when they differ.
    fn fleet_text(&self, out: &mut String) {
        let Some(fleet) = &self.fleet else {
            let _ = writeln!(out, "replicas: not recorded (the schema predates them)");
            return;
        };
        let releases: std::collections::BTreeSet<&str> =
            fleet.iter().map(|m| m.version.as_str()).collect();
        let _ = writeln!(
            out,
            "replicas ({} reported{}):",
            fleet.len(),
            match releases.len() {
                0 | 1 => String::new(),
                _ => format!(
                    "; mixed fleet: {}",
                    releases.into_iter().collect::<Vec<_>>().join(", ")
                ),
            }
        );
        let live_within = 3.0 * self.heartbeat_secs as f64;
        for m in fleet {
            let _ = writeln!(
                out,
                "  {:<28} {:<8} {:<10} shard {} of {}  last report {:.0}s ago{}  {}",
                m.owner,
                m.version,
                m.commit,
                m.shard,
                m.shards,
                m.seen_age_secs,
                if m.is_live(live_within) {
                    ""
                } else {
                    " (gone? no report for 3 heartbeats)"
                },
                match (&m.ready, &m.reason, m.is_live(live_within)) {
                    (true, _, true) => "ready".to_string(),
                    (false, reason, true) =>
                        format!("NOT READY: {}", reason.as_deref().unwrap_or("")),
                    (true, _, false) => "readiness unknown (last said ready)".to_string(),
                    (false, reason, false) => format!(
                        "readiness unknown (last said NOT READY: {})",
                        reason.as_deref().unwrap_or("")
                    ),
                }
            );
            let doing: Vec<String> = m.doing.iter().map(ToString::to_string).collect();
            let _ = match (doing.is_empty(), m.is_live(live_within)) {
                (true, true) => writeln!(out, "    idle: no claim held"),
                (true, false) => Ok(()),
                (false, true) => writeln!(out, "    running {}", doing.join("; ")),
                (false, false) => writeln!(out, "    held, when last seen: {}", doing.join("; ")),
            };
        }
    }
}

/// A JSON value as text, strings without their quotes.
fn plain(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A run's cursor in a table cell: `↑id` for an ascending walk's `last_id`, `↓id` for a
/// descending walk's `last_id_desc`, `-` before the first batch.
fn compact(cursor: Cursor) -> String {
    let up = cursor.last_id.map(|id| format!("↑{id}"));
    let down = cursor.last_id_desc.map(|id| format!("↓{id}"));
    match (up, down) {
        (None, None) => "-".into(),
        (Some(one), None) | (None, Some(one)) => one,
        (Some(up), Some(down)) => format!("{up} {down}"),
    }
}
