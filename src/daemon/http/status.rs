//! `GET /status`: the jobs' months and shards at a glance, as an HTML page a person opens in a
//! browser, one section per job of the registry.
//!
//! `GET /status` shows, for each job, the latest business dates with any claim under the replica's
//! shard count (`?shards=M` for another count; `?job=NAME` for one job), what its replicas watch
//! (a pause, months of the lookback not closed, items waiting before it); `GET
//! /status?business_date=YYYY-MM-DD&shards=M` shows one month in detail. Element ids are prefixed
//! with the job's name (`fine-settlement-verdict-2026-10-31`). The page is read-only and needs no token; `http.status_page = false` answers
//! 404. It has no external assets and no JavaScript (clusters are often offline): the CSS is
//! inline, links are relative to the page (so a path prefix added by a proxy keeps working), and a
//! page showing a RUNNING shard refreshes itself with `<meta http-equiv="refresh">`.
//!
//! The handler parses the query, asks [`crate::overview::Reader`] (bounded database time, closed
//! months' totals kept) and renders with the maud templates below. maud escapes every value it
//! interpolates, so owner names and error texts from the database show as text; the
//! `Content-Security-Policy` header forbids scripts besides.

use super::HttpState;
use crate::calendar::{BusinessDate, CalendarError};
use crate::job_layer::due::MonthState;
use crate::job_layer::fleet::Member;
use crate::numbers::{count, money, things};
use crate::overview::{Month, Overview, Progress, Scope, Shard, Totals};
use crate::overview::{HISTORY_LATEST, HISTORY_MONTH, MONTHS, VIEW_BUDGET};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use maud::{html, Markup, PreEscaped, DOCTYPE};
use std::collections::{BTreeMap, BTreeSet};

/// The most shards a page may show (the runs API's bound: a guard against typos like 30000).
pub const MAX_SHARDS: u32 = super::runs::MAX_SHARDS;
/// How often a page showing a RUNNING shard reloads itself.
pub const REFRESH_SECS: u32 = 10;

/// What the browser may do with the page: show it with its inline style, nothing else.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// A query string the page cannot show.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error(
        "unknown parameter {0:?}: /status takes business_date=YYYY-MM-DD, shards=M and job=NAME"
    )]
    Unknown(String),
    #[error("the parameter {0} is given more than once")]
    Repeated(&'static str),
    #[error("business_date: {0}")]
    BusinessDate(#[from] CalendarError),
    #[error("shards must be a whole number from 1 to {MAX_SHARDS}, got {0:?}")]
    Shards(String),
}

/// What the query string asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageQuery {
    pub scope: Scope,
    pub shards: u32,
    /// One job only (`job=NAME`; checked against the registry by the handler).
    pub job: Option<String>,
}

impl PageQuery {
    /// Parses `business_date` and `shards` (default `default_shards`); an empty value counts as
    /// absent, anything else unknown or malformed is refused.
    pub fn parse(query: &str, default_shards: u32) -> Result<Self, QueryError> {
        let (mut business_date, mut shards, mut job) = (None, None, None);
        for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let (slot, name) = match name.as_ref() {
                "business_date" => (&mut business_date, "business_date"),
                "shards" => (&mut shards, "shards"),
                "job" => (&mut job, "job"),
                other => return Err(QueryError::Unknown(other.to_string())),
            };
            if slot.replace(value.into_owned()).is_some() {
                return Err(QueryError::Repeated(name));
            }
        }
        let scope = match business_date.filter(|v| !v.is_empty()) {
            None => Scope::Latest,
            Some(text) => Scope::Month(BusinessDate::parse(&text)?),
        };
        let shards = match shards.filter(|v| !v.is_empty()) {
            None => default_shards,
            Some(text) => text
                .parse()
                .ok()
                .filter(|n| (1..=MAX_SHARDS).contains(n))
                .ok_or(QueryError::Shards(text))?,
        };
        Ok(Self {
            scope,
            shards,
            job: job.filter(|j| !j.is_empty()),
        })
    }
}

pub async fn page(State(state): State<HttpState>, uri: Uri) -> Response {
    if !state.settings.http.status_page {
        return respond(
            StatusCode::NOT_FOUND,
            notice(
                "Not found",
                "The status page is turned off on this replica (http.status_page = false).",
            ),
        );
    }
    let query = match PageQuery::parse(uri.query().unwrap_or(""), state.settings.shard.count) {
        Ok(query) => query,
        Err(e) => {
            return respond(
                StatusCode::BAD_REQUEST,
                notice("Bad request", &e.to_string()),
            )
        }
    };
    let jobs: Vec<_> = match &query.job {
        None => state.registry.iter().cloned().collect(),
        Some(name) => match state.registry.get(name) {
            Ok(job) => vec![job.clone()],
            Err(why) => {
                return respond(
                    StatusCode::BAD_REQUEST,
                    notice("Bad request", &format!("job: {why}")),
                )
            }
        },
    };
    let now = state.clock.now();
    // This replica's own readiness, as /readyz says it now: first on the page, and in its own row
    // of the fleet (whose rows are as of each replica's last report, which a database that takes
    // no writes stops).
    // Asked beside the view's reads, not before them: on a slow database the page keeps to its
    // budget (the evaluation waits at most `health::ANSWER_WITHIN`).
    let readiness = async {
        crate::daemon::health::evaluate(&state.pool, &state.health)
            .await
            .err()
            .map(|why| why.to_string())
    };
    let read = async {
        let fleet = state.overview.fleet().await;
        let mut views = Vec::new();
        for job in &jobs {
            views.push(
                state
                    .overview
                    .read(&state.settings, job, now, query.scope, query.shards)
                    .await?,
            );
        }
        crate::overview::follow_upstreams(&mut views);
        Ok::<_, crate::overview::OverviewError>((views, fleet))
    };
    let (not_ready, read) = tokio::join!(readiness, read);
    match read {
        Ok((views, fleet)) => {
            let replica = Replica {
                owner: &state.owner,
                shard: state.settings.shard.index,
                shards: state.settings.shard.count,
                heartbeat_secs: state.settings.lease.heartbeat_secs,
                not_ready: not_ready.as_deref(),
            };
            let page = render(&views, fleet.as_deref(), &query, &replica, now);
            respond(StatusCode::OK, page)
        }
        Err(e) => {
            tracing::warn!(error = %e, "status page: cannot read the database");
            let own = match &not_ready {
                Some(why) => format!(" This replica is NOT READY: {why}."),
                None => String::new(),
            };
            respond(
                StatusCode::SERVICE_UNAVAILABLE,
                notice_reloading(
                    "Database unavailable",
                    &format!(
                        "{e}.{own} This page reloads itself every {REFRESH_SECS} s until the database answers."
                    ),
                ),
            )
        }
    }
}

fn respond(status: StatusCode, page: Markup) -> Response {
    let mut response = (status, page.into_string()).into_response();
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        (header::CACHE_CONTROL, "no-store"),
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

// ---- Templates ----------------------------------------------------------------------------

/// Who serves the page.
struct Replica<'a> {
    owner: &'a str,
    shard: u32,
    shards: u32,
    /// `lease.heartbeat_secs`: a replica that has not reported for three is shown as gone.
    heartbeat_secs: u64,
    /// Why this replica is not ready now (`/readyz`'s reason), or `None` when it is.
    not_ready: Option<&'a str>,
}

const CSS: &str = "\
body{font:14px/1.45 system-ui,'Liberation Sans',sans-serif;margin:1.5em;color:#1f2328;background:#fff}
h1{font-size:1.5em;margin:0}h2{font-size:1.15em;margin:1.6em 0 .5em}h3{font-size:1em;margin:1em 0 .3em}
a{color:#0550ae}.note{color:#59636e}.note,.small{font-size:.9em}
table{border-collapse:collapse}th,td{border:1px solid #d1d9e0;padding:.35em .6em;vertical-align:top;text-align:left}
thead th{background:#f6f8fa}.wrap{overflow-x:auto}td.cell{min-width:15em}
.status{font-weight:700;letter-spacing:.03em}.num{text-align:right;font-variant-numeric:tabular-nums}
.s-success{background:#dafbe1}.s-success .status,.closed{color:#116329}
.s-running{background:#ddf4ff}.s-running .status{color:#0550ae}
.s-failed{background:#ffebe9}.s-failed .status,.open,.error{color:#a40e26}
.s-missing,.s-paused{background:#fff8c5}.s-missing .status,.s-paused .status{color:#7d4e00}
.late{color:#7d4e00;font-weight:700}.unknown{color:#59636e;font-weight:700}.conflict{color:#a40e26;font-weight:700}
.closed,.open{font-weight:700}.error{font-family:ui-monospace,monospace;white-space:pre-wrap;overflow-wrap:anywhere;max-width:30em}
progress{width:100%;height:.8em}code{font-family:ui-monospace,monospace}dt{font-weight:700}dd{margin:0 0 .5em 1em}
th a,code,.nowrap{white-space:nowrap}
tr.empty th,tr.empty td{color:#59636e;font-weight:400}
@media (max-width:640px){body{margin:.6em}table.stack,table.stack tbody,table.stack tr,table.stack th,table.stack td{display:block;width:auto}
table.stack thead{display:none}table.stack tr{border:1px solid #d1d9e0;margin:0 0 .8em}table.stack td,table.stack th{border:0;border-top:1px solid #d1d9e0}
table.stack td[data-label]::before{content:attr(data-label);display:block;font-size:.85em;color:#59636e}td.cell{min-width:0}
.wrap{overflow-x:visible}.error{max-width:none}code{white-space:normal;overflow-wrap:anywhere}
table.stack td{text-align:left}#fleet-table td{display:inline-block;vertical-align:top;border:0;padding:.2em .6em}}
";

/// The whole page: a section per job.
fn render(
    views: &[Overview],
    fleet: Option<&[Member]>,
    query: &PageQuery,
    replica: &Replica,
    now: DateTime<Utc>,
) -> Markup {
    let tz = views
        .first()
        .map_or(chrono_tz::UTC, |v| v.schedule.timezone);
    let running = views.iter().any(Overview::is_running);
    let title = match query.scope {
        Scope::Latest => format!("settlementd status: {} shards", query.shards),
        Scope::Month(month) => format!("settlementd status: {month}, {} shards", query.shards),
    };
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if running {
                    meta http-equiv="refresh" content=(REFRESH_SECS);
                }
                title { (title) }
                style { (PreEscaped(CSS)) }
            }
            body {
                header {
                    h1 { (title) }
                    @if let Some(why) = replica.not_ready {
                        p.open #own-readiness { "This replica is NOT READY: " (why) }
                    }
                    p.note {
                        "jobs: "
                        @for (i, view) in views.iter().enumerate() {
                            @if i > 0 { ", " }
                            a href=(format!("#{}", view.job)) { (view.job) }
                        }
                        " · served by replica " code { (replica.owner) }
                        " (shard " (replica.shard) " of " (replica.shards) ") · as of " (local(now, tz))
                        @if running {
                            " · reloads every " (REFRESH_SECS) " s while a shard is RUNNING"
                        }
                    }
                    @if let Scope::Month(_) = query.scope {
                        p { a href=(format!("?shards={}", query.shards)) { "← every month" } }
                    }
                }
                (fleet_section(fleet, &doing(views), replica))
                @for view in views {
                    (job_section(view, takers(fleet, view, replica.heartbeat_secs)))
                }
                footer.note {
                    p {
                        "Read-only. A month is closed when every shard of the count is SUCCESS, nothing waits to be run in it, nothing is held and no correction holds it; "
                        "held when all of that is true but for items a job holds for an operator, which stay as they are, named, until they are fixed; "
                        "unknown (grey) when every shard is SUCCESS but what waits could not be counted in time; otherwise not closed. "
                        "Totals are the month's, whatever the shard count that ran it: "
                        "computed once for a closed month, at each view for an open one, "
                        "within " (VIEW_BUDGET.as_secs()) " s of database time per view. "
                        "Heartbeat ages are on the database clock; times are in " (tz.name()) "."
                    }
                }
            }
        }
    }
}

/// Every replica that reported in `replicas`: its release, shard, readiness and last report. A
/// mixed fleet (more than one release among the live ones) is said so above the table.
/// What each owner is doing: the RUNNING claims it holds on the page, by owner.
fn doing(views: &[Overview]) -> BTreeMap<String, Vec<String>> {
    let mut by_owner: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for view in views {
        for month in &view.months {
            for shard in &month.shards {
                let Some(run) = shard.run.as_ref().filter(|r| r.status == "RUNNING") else {
                    continue;
                };
                let progress = shard
                    .progress
                    .map(|p| format!(" ({} %)", p.percent()))
                    .unwrap_or_default();
                by_owner.entry(run.owner.clone()).or_default().push(format!(
                    "{} {} shard {} of {}{progress}",
                    view.job, month.business_date, shard.index, view.shards
                ));
            }
        }
    }
    by_owner
}

fn fleet_section(
    fleet: Option<&[Member]>,
    doing: &BTreeMap<String, Vec<String>>,
    replica: &Replica,
) -> Markup {
    let live_within = 3.0 * replica.heartbeat_secs as f64;
    // The serving replica's row says its readiness of now; the others', as they last reported,
    // and a replica gone quiet's is not known (grey, with what it last said), never green.
    let readiness = |m: &Member| -> Option<String> {
        if m.owner == replica.owner {
            replica.not_ready.map(str::to_string)
        } else if m.ready {
            None
        } else {
            Some(m.reason.clone().unwrap_or_default())
        }
    };
    // The serving replica is alive whatever its last report says: it answers this page (a
    // read-only database stops its reports, not it).
    let live = |m: &Member| m.owner == replica.owner || m.is_live(live_within);
    let quiet = |m: &Member| !live(m);
    let releases: BTreeMap<&str, usize> = fleet
        .unwrap_or_default()
        .iter()
        .filter(|m| live(m))
        .fold(BTreeMap::new(), |mut by, m| {
            *by.entry(m.version.as_str()).or_default() += 1;
            by
        });
    html! {
        section #fleet {
            h2 { "Fleet" }
            @match fleet {
                None => p.note { "The fleet is not recorded here: the schema predates the replicas table (run settlementd migrate)." },
                Some([]) => p.note { "No replica has reported yet." },
                Some(members) => {
                    @if replica.not_ready.is_some() {
                        p.note #fleet-as-reported {
                            "Each other replica's row is as of its last report: a database that takes no writes stops them."
                        }
                    }
                    @if releases.len() > 1 {
                        p.late #fleet-mixed {
                            "Mixed fleet: "
                            @for (i, (version, n)) in releases.iter().enumerate() {
                                @if i > 0 { ", " }
                                (n) " on " (version)
                            }
                            " (a rolling update, or one that stopped half-way)"
                        }
                    }
                    div.wrap {
                        table.stack #fleet-table {
                            thead { tr { th { "replica" } th { "release" } th { "shard" } th { "jobs" } th { "ready" } th { "doing" } th { "last report" } } }
                            tbody {
                                @for m in members {
                                    tr data-owner=(m.owner) data-version=(m.version) {
                                        td { code { (m.owner) } }
                                        td data-label="release" { (m.version) " " span.small { "(commit " code { (m.commit) } ")" } }
                                        td.num data-label="shard" { (m.shard) " of " (m.shards) }
                                        td data-label="jobs" { (m.jobs.join(", ")) }
                                        @match (readiness(m), quiet(m)) {
                                            (None, false) => td.closed data-label="ready" { "ready" },
                                            (Some(why), false) => td.error data-label="ready" { "NOT READY: " (why) },
                                            (None, true) => td data-label="ready" { span.unknown { "unknown" } " " span.small { "(last said ready)" } },
                                            (Some(why), true) => td data-label="ready" { span.unknown { "unknown" } " " span.small { "(last said NOT READY: " (why) ")" } },
                                        }
                                        td.small.doing data-label="doing" {
                                            @match doing.get(&m.owner) {
                                                Some(runs) if live(m) => { "running " (runs.join("; ")) }
                                                Some(runs) => { "held, when last seen: " (runs.join("; ")) " (its lease decides who goes on)" }
                                                None if live(m) => "idle: no claim held",
                                                None => "",
                                            }
                                        }
                                        td.small data-label="last report" {
                                            (age(m.seen_age_secs)) " ago"
                                            @if quiet(m) { " · " strong { "gone?" } " (no report for 3 heartbeats)" }
                                            @else if !m.is_live(live_within) { " · serves this page: its reports wait for the database" }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    p.note { "A claim without a release was made by a release that did not record itself on that attempt (0.1.0, or 0.2.0 re-opening or correcting a month)." }
                }
            }
        }
    }
}

/// One job: what its replicas watch, its schedule, its months, its history.
/// The shards of `view`'s count that a live replica of the fleet runs `view`'s job for (reported
/// within three heartbeats): those that would take over an expired lease. `None`: the fleet is
/// not known.
fn takers(fleet: Option<&[Member]>, view: &Overview, heartbeat_secs: u64) -> Option<BTreeSet<u32>> {
    fleet.map(|fleet| {
        crate::job_layer::fleet::takers(fleet, view.job, view.shards, 3.0 * heartbeat_secs as f64)
    })
}

fn job_section(view: &Overview, takers: Option<BTreeSet<u32>>) -> Markup {
    html! {
        section.job #(view.job) {
            h2 { "Job " code { (view.job) } }
            (watch(view))
            (schedule(view, takers.as_ref()))
            (months(view, takers.as_ref()))
            @if let Scope::Month(_) = view.scope { (would_now(view)) }
            (history(view))
        }
    }
}

/// The pause, the months of the lookback not closed, what waits before it.
fn watch(view: &Overview) -> Markup {
    let id = |what: &str| format!("{}-{what}", view.job);
    let tz = view.schedule.timezone;
    html! {
        div.watch #(id("watch")) {
            @match &view.watch {
                None => p.note { "What the replicas watch could not be read within this view's database time." }
                Some(w) => {
                    @if let Some(p) = &w.paused {
                        p.open #(id("paused")) {
                            "PAUSED since " (local(p.paused_at, tz)) " by " code { (p.paused_by) } ": " (p.reason)
                            br; span.small { "nothing new is claimed; `settlementd resume` (or POST /v1/resume) lets it go on" }
                        }
                    }
                    @let (open, held): (Vec<_>, Vec<_>) = (w.open().collect(), w.held().collect());
                    p #(id("not-closed")) {
                        @if open.is_empty() && held.is_empty() {
                            span.closed { "every month of the lookback (" (things(w.lookback_months, "month", "months")) ") is closed" }
                        } @else if open.is_empty() {
                            span.closed { "no month of the lookback (" (things(w.lookback_months, "month", "months")) ") is left open" }
                        } @else {
                            span.open { (things(open.len() as i128, "month", "months")) " of the lookback not closed: " }
                            @for (i, n) in open.iter().enumerate() {
                                @if i > 0 { "; " }
                                a href=(month_link_date(n.business_date, view.shards)) { (n.business_date) }
                                " (" (crate::overview::not_closed_words(n, view.words)) ")"
                            }
                        }
                    }
                    @if !held.is_empty() {
                        p #(id("months-held")) {
                            span.late { (things(held.len() as i128, "month", "months")) " of the lookback held: " }
                            @for (i, n) in held.iter().enumerate() {
                                @if i > 0 { "; " }
                                a href=(month_link_date(n.business_date, view.shards)) { (n.business_date) }
                                " (" (view.words.held.count(n.held)) ")"
                            }
                            br; span.small { "every shard SUCCESS, nothing waits for a run: fix the held items in libraryd and the next run takes them" }
                        }
                    }
                    @if w.before_lookback > 0 {
                        p.late #(id("before-lookback")) {
                            (view.words.waiting.count(w.before_lookback)) " in months before the lookback: no replica runs them by itself"
                        }
                    }
                }
            }
        }
    }
}

fn schedule(view: &Overview, takers: Option<&BTreeSet<u32>>) -> Markup {
    let tz = view.schedule.timezone;
    let id = |what: &str| format!("{}-{what}", view.job);
    html! {
        div.schedule #(id("schedule")) {
            h3 { "Schedule" }
            dl {
                dt { "Next fire" }
                dd #(id("next-fire")) {
                    @match &view.schedule.next {
                        Some(slot) => {
                            (slot.fire_at.format("%Y-%m-%d %H:%M:%S %:z")) " (" (tz.name()) "), " (view.words.run_does) " "
                            a href=(month_link(slot.business_date, view.shards)) { (slot.business_date) }
                        }
                        None => "none: the cron never fires again",
                    }
                }
                @if let (Scope::Latest, Some(slot)) = (view.scope, &view.schedule.latest) {
                    dt { "Latest fire" }
                    dd #(id("latest-fire")) {
                        (slot.fire_at.format("%Y-%m-%d %H:%M:%S %:z")) ", " (view.words.run_does) " "
                        a href=(month_link(slot.business_date, view.shards)) { (slot.business_date) } ": "
                        @match view.month(slot.business_date.date()) {
                            Some(month) => (verdict(month, view, takers)),
                            None => { span.open { "not closed" } " (no shard of " (view.shards) " has claimed it)" }
                        }
                    }
                }
            }
        }
    }
}

fn months(view: &Overview, takers: Option<&BTreeSet<u32>>) -> Markup {
    let detail = matches!(view.scope, Scope::Month(_));
    html! {
        div.months #{ (view.job) "-months" } {
            h3 {
                @match view.scope {
                    Scope::Latest => { "Months (the latest " (MONTHS) " with any claim under " (view.shards) " shards, newest first)" }
                    Scope::Month(month) => { "Month " (month) " under " (view.shards) " shards" }
                }
            }
            @if view.months.is_empty() {
                p.open {
                    @match view.scope {
                        Scope::Latest => { "No claims under " (view.shards) " shards yet." }
                        Scope::Month(month) => { "No shard of " (view.shards) " has claimed " (month) ": every shard is missing." }
                    }
                }
            } @else {
                div.wrap {
                    table.grid.stack {
                        thead {
                            tr {
                                th { "Month" } th { "Closed" } th { "Totals" }
                                @if let Some(pinned) = view.words.pinned { th { (pinned) " (pinned)" } }
                                @for shard in 0..view.shards { th { "shard " (shard) } }
                            }
                        }
                        tbody {
                            @for run in collapsed(&view.months, detail) {
                                @match run {
                                    Rows::One(month) => (month_row(month, view, detail, takers)),
                                    Rows::Empty(empty) => (empty_row(empty, view)),
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The rows of the months table: a month, or a run of consecutive closed months that had
/// nothing to do (every fact a count of 0), shown as one row.
enum Rows<'a> {
    One(&'a Month),
    Empty(Vec<&'a Month>),
}

/// A closed month whose counts are all 0: every shard SUCCESS, nothing done, nothing waiting.
fn is_empty(month: &Month) -> bool {
    let Totals::Closed(facts) = &month.totals else {
        return false;
    };
    month.closed()
        && facts
            .iter()
            .filter(|f| f.kind == crate::job_layer::FactKind::Count)
            .all(|f| f.value.as_i64() == Some(0) || f.value.as_str() == Some("0"))
        && month
            .shards
            .iter()
            .all(|s| s.run.as_ref().is_some_and(|r| r.updated == 0))
}

/// `months` with each run of two or more empty months as one row (never on one month's page).
fn collapsed(months: &[Month], detail: bool) -> Vec<Rows<'_>> {
    let mut out: Vec<Rows> = Vec::new();
    for month in months {
        match out.last_mut() {
            Some(Rows::Empty(run)) if !detail && is_empty(month) => run.push(month),
            _ if !detail && is_empty(month) => out.push(Rows::Empty(vec![month])),
            _ => out.push(Rows::One(month)),
        }
    }
    out.into_iter()
        .flat_map(|rows| match rows {
            Rows::Empty(run) if run.len() == 1 => vec![Rows::One(run[0])],
            rows => vec![rows],
        })
        .collect()
}

/// A run of empty months (newest first): one row naming them.
fn empty_row(months: Vec<&Month>, view: &Overview) -> Markup {
    let (newest, oldest) = (
        months[0].business_date,
        months[months.len() - 1].business_date,
    );
    html! {
        tr.empty #{ (view.job) "-empty-" (oldest) "-" (newest) } {
            th { a href=(month_link_date(oldest, view.shards)) { (oldest) } " – " a href=(month_link_date(newest, view.shards)) { (newest) } }
            td colspan=(view.shards + 2 + u32::from(view.words.pinned.is_some())) {
                (things(months.len() as i128, "month", "months")) " closed with nothing to do (every shard SUCCESS, nothing "
                (view.words.facts_are) ", nothing waiting)"
            }
        }
    }
}

fn month_row(
    month: &Month,
    view: &Overview,
    detail: bool,
    takers: Option<&BTreeSet<u32>>,
) -> Markup {
    let date = month.business_date;
    let job = view.job;
    html! {
        tr #{ (job) "-month-" (date) } {
            th { a href=(month_link_date(date, view.shards)) { (date) } }
            td.verdict #{ (job) "-verdict-" (date) } data-label="closed" { (verdict(month, view, takers)) }
            td.totals #{ (job) "-totals-" (date) } data-label="totals" { (totals(&month.totals, view.words, detail)) }
            @if let Some(pinned) = view.words.pinned {
                td.rule.small #{ (job) "-rule-" (date) } data-label=(format!("{pinned} (pinned)")) {
                    @match &month.rule_text {
                        Some(rule) => (rule),
                        None => "none pinned yet",
                    }
                }
            }
            @for shard in &month.shards {
                (cell((job, view.words), date, shard, (view.lease_ttl_secs, view.schedule.timezone), detail, (takers, month.correction.as_ref().map(|(key, _)| key.as_str()))))
            }
        }
    }
}

/// Closed; being corrected; closed but for items waiting; or not closed and why. Held rows are
/// named either way: they are what the month's own data keeps from being done.
/// One month's page: what a run of it would do now (the dry run's numbers: `settlementd run
/// --dry-run`), each shard's items held with why.
fn would_now(view: &Overview) -> Markup {
    let id = format!("{}-would", view.job);
    let Some(month) = view.months.first() else {
        return html! {};
    };
    let command = format!(
        "settlementd run --dry-run --job {} --business-date {} --all-shards --shards {}",
        view.job, month.business_date, view.shards
    );
    html! {
        div.would #(id) {
            h3 { "What a run would do now" }
            @match &month.preview {
                None => p.note { (view.job) " cannot tell what its runs would write." },
                Some(Err(why)) => p.note { "The dry run " (why) ": " code { (command) } " tells." },
                Some(Ok(preview)) => {
                    @let writes: u64 = preview.shards.values().map(|s| s.writes).sum();
                    p {
                        @if writes == 0 { "Nothing to write: a run now would change nothing." }
                        @else { "A run of every shard now would write " (things(writes as i128, "item", "items")) ": " }
                        @for (shard, p) in preview.shards.iter().filter(|(_, p)| p.writes > 0) {
                            " shard " (shard) " " (count(p.writes as i64)) ";"
                        }
                    }
                    @let held: Vec<(u32, &(i64, String))> = preview.shards.iter().flat_map(|(s, p)| p.held.iter().map(move |h| (*s, h))).collect();
                    @if !held.is_empty() {
                        p.late { (view.words.held) ", left as they are until fixed (the first of each shard):" }
                        div.wrap {
                            table.held.stack #{ (view.job) "-held" } {
                                thead { tr { th { "shard" } th { "id" } th { "why" } } }
                                tbody {
                                    @for (shard, (item, why)) in held {
                                        tr { td.num { (shard) } td.num { code { (item) } } td { (why) } }
                                    }
                                }
                            }
                        }
                    }
                    p.note { "Read in this view's snapshot and written nowhere; the whole report: " code { (command) } }
                }
            }
        }
    }
}

fn verdict(month: &Month, view: &Overview, takers: Option<&BTreeSet<u32>>) -> Markup {
    let paused = view.watch.as_ref().and_then(|w| w.paused.as_ref());
    let runners = takers.map(|takers| crate::overview::Runners {
        takers,
        lease_ttl_secs: view.lease_ttl_secs,
    });
    let verdict = month.verdict(view.words, paused, view.schedule.timezone, runners);
    html! {
        @match verdict.state {
            MonthState::Closed => span.closed { (verdict.words) },
            MonthState::Held => span.late { (verdict.words) },
            MonthState::Unknown => span.unknown { (verdict.words) },
            MonthState::Open if month.all_success() && month.correction.is_none() => span.late { (verdict.words) },
            MonthState::Open => span.open { (verdict.words) },
        }
        @if let Some(next) = &verdict.next {
            br; span.small.next { (next) }
        }
    }
}

/// A month's facts: counts as numbers, sums of cents as money, a digest as code.
fn totals(totals: &Totals, words: crate::job_layer::Words, detail: bool) -> Markup {
    use crate::job_layer::FactKind;
    let facts = |facts: &[crate::job_layer::Fact], label: String| {
        html! {
            div.small { (label) }
            @for fact in facts {
                @let text = match &fact.value {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                @match fact.kind {
                    FactKind::Count => div {
                        @match text.parse::<i128>() {
                            // A label is plural ("rows"): one is "1 row".
                            Ok(n) => (things(n, fact.label.strip_suffix('s').unwrap_or(&fact.label), &fact.label)),
                            Err(_) => { (text) " " (fact.label) }
                        }
                    },
                    FactKind::Cents => div {
                        (fact.label) " " (text.parse::<i128>().map_or(text.clone(), money))
                        " " span.small { "(" (text.parse::<i128>().map_or(text.clone(), count)) " cents)" }
                    },
                    FactKind::Digest => {
                        @let short = if detail || text.len() <= 12 { text.clone() } else { format!("{}…", &text[..12]) };
                        div.small { (fact.label) " " code title=(text) { (short) } }
                    }
                }
            }
        }
    };
    match totals {
        Totals::Closed(t) => facts(t, words.facts_are.to_string()),
        Totals::SoFar(t) => facts(t, format!("{} so far", words.facts_are)),
        Totals::Computing => html! {
            span.small { "totals being computed in the background (a closed month: once); reload in a moment" }
        },
        Totals::Unavailable(why) => html! { span.small { "totals unavailable: " (why) } },
    }
}

/// A month's shard: its claim, and what happens next. An expired lease says who takes it over: a
/// live replica of the shard (`takers`), or nobody until one starts; a correction's attempt
/// (`correction`, the key of the correction holding the month) only that correction, which no
/// replica runs.
fn cell(
    (job, words): (&str, crate::job_layer::Words),
    date: chrono::NaiveDate,
    shard: &Shard,
    (ttl_secs, tz): (u64, Tz),
    detail: bool,
    (takers, correction): (Option<&BTreeSet<u32>>, Option<&str>),
) -> Markup {
    let state = shard.state();
    // A run the pause stopped is FAILED in the table, and a pause on the page.
    let paused = shard
        .run
        .as_ref()
        .is_some_and(crate::job_layer::claim::JobRunRow::stopped_by_pause);
    let word = if paused { "PAUSED" } else { state.word() };
    let taken_over = match (correction, takers) {
        (Some(key), _) => format!(
            "no replica takes over a correction's attempt: `settlementd correct` with the same key ({key:?}) finishes it"
        ),
        (None, Some(t)) if !t.contains(&shard.index) => {
            "no live replica runs this shard: start one, or `settlementd run --wait` of the month and shard takes it over".to_string()
        }
        (None, Some(_)) => "a live replica of this shard takes it over within a heartbeat".to_string(),
        (None, None) => "a replica of this shard may take it over".to_string(),
    };
    let class = format!("cell s-{}", word.to_ascii_lowercase());
    html! {
        td class=(class) #{ (job) "-cell-" (date) "-" (shard.index) } data-status=(state.word()) data-label=(format!("shard {}", shard.index)) {
            div.status { (word) }
            @match &shard.run {
                None => div.small { "no claim: no replica of this shard has started the month" },
                Some(run) => {
                    div { "attempt " (run.attempt) }
                    div.small { "owner " code { (run.owner) } }
                    @match (run.status.as_str(), run.finished_at) {
                        ("SUCCESS", Some(finished)) => div.small.finished {
                            "finished " (local(finished, tz)) " · took " (age((finished - run.started_at).num_milliseconds() as f64 / 1000.0))
                        },
                        _ => div.small {
                            "heartbeat " (age(run.heartbeat_age_secs)) " ago"
                            @if shard.lease_expired(ttl_secs) {
                                " · " strong { "lease expired" } ": " (taken_over)
                            }
                        },
                    }
                    div.small { "release " (run.version.as_deref().unwrap_or("not recorded")) }
                    div.updated {
                        (words.written.count(run.updated)) " by attempt " (run.attempt)
                        @if run.attempt > 1 && run.updated == 0 && run.status == "SUCCESS" {
                            br; span.small { "earlier attempts' writes stay as they made them (the month's totals count them)" }
                        }
                    }
                    @if let Some(progress) = shard.progress {
                        (bar(progress, run.started_age_secs, shard.lease_expired(ttl_secs)))
                    }
                    @if detail {
                        div.small { "read " (count(run.scanned)) " · resumes " (run.cursor()) }
                        div.small { "started " (local(run.started_at, tz)) }
                    }
                    @if paused {
                        div.small { "stopped by the pause after its last committed batch: it resumes where it stopped after " code { "settlementd resume" } }
                    } @else if let Some(error) = &run.last_error {
                        div.error { (error) }
                    }
                }
            }
            @if let Some(conflict) = &shard.conflict {
                div.error.conflict { "rule conflict: " (conflict) }
            }
        }
    }
}

/// A running shard's progress: read of its total, at what rate since its attempt started
/// (`running_secs` ago), and about how long is left at that rate. A claim whose lease `expired`
/// runs nowhere: no rate and no time left, only where it stopped (the cell says who takes it over).
fn bar(progress: Progress, running_secs: f64, expired: bool) -> Markup {
    let rate = (running_secs > 0.5 && !expired).then(|| progress.read as f64 / running_secs);
    let left = rate
        .filter(|r| *r > 0.0)
        .map(|r| progress.total.saturating_sub(progress.read) as f64 / r);
    html! {
        progress max=(progress.total) value=(progress.read.min(progress.total)) {}
        div.small.rate {
            "read " (count(progress.read as i64)) " of " (count(progress.total as i64)) " (" (progress.percent()) " %)"
            @if let Some(rate) = rate {
                " · " (count(rate.round() as i64)) " a second"
            }
            @if let Some(left) = left {
                " · about " (age(left)) " left"
            }
            @if expired {
                " · stopped there: nothing runs it while its lease is expired"
            }
        }
    }
}

fn history(view: &Overview) -> Markup {
    let tz = view.schedule.timezone;
    html! {
        div.history #{ (view.job) "-history" } {
            h3 {
                @match view.scope {
                    Scope::Latest => { "Recent history (the audit trail: each shard's latest " (HISTORY_LATEST) " events, newest first)" }
                    Scope::Month(_) => { "History (each shard's latest " (HISTORY_MONTH) " events of the month, newest first)" }
                }
            }
            @for shard in 0..view.shards as i32 {
                div.shard-history #{ (view.job) "-history-" (shard) } {
                    h3 { "shard " (shard) }
                    @let events: Vec<_> = view.history.iter().filter(|e| e.event.shard == shard).collect();
                    @if events.is_empty() {
                        p.note { "No audit events (the trail starts with the version that added it)." }
                    } @else {
                        div.wrap {
                            table.history.stack {
                                thead { tr { th { "When" } th { "Month" } th { "Event" } th { "Attempt" } th { "By" } th { "Detail" } } }
                                tbody {
                                    @for e in events {
                                        tr {
                                            td.small.nowrap data-label="when" { (local(e.event.at, tz)) }
                                            td.nowrap data-label="month" { (e.business_date) }
                                            td data-label="event" { (e.event.event) }
                                            td.num data-label="attempt" { (e.event.attempt.map_or(String::new(), |a| a.to_string())) }
                                            td.small data-label="by" { code { (e.event.owner) } }
                                            td.small data-label="detail" {
                                                (e.event.message.as_deref().unwrap_or(""))
                                                @if let Some(request) = &e.event.request_id {
                                                    br; "request " code title=(request) { (request.get(..8).unwrap_or(request)) "…" }
                                                    @if let Some(state) = &e.request_state { " · now " strong { (state) } }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A short page for errors and the turned-off page.
fn notice(title: &str, message: &str) -> Markup {
    notice_page(title, message, false)
}

/// [`notice`] of a state that passes (the database down): it reloads itself.
fn notice_reloading(title: &str, message: &str) -> Markup {
    notice_page(title, message, true)
}

fn notice_page(title: &str, message: &str, reloads: bool) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if reloads {
                    meta http-equiv="refresh" content=(REFRESH_SECS);
                }
                title { (title) " — settlementd status" }
                style { (PreEscaped(CSS)) }
            }
            body {
                h1 { (title) }
                p { (message) }
                p.note { "GET /status shows the latest months of every job; GET /status?business_date=YYYY-MM-DD&shards=M one month; job=NAME one job." }
            }
        }
    }
}

// ---- Formatting ---------------------------------------------------------------------------

fn month_link(month: BusinessDate, shards: u32) -> String {
    month_link_date(month.date(), shards)
}

fn month_link_date(date: chrono::NaiveDate, shards: u32) -> String {
    format!("?business_date={date}&shards={shards}")
}

fn local(at: DateTime<Utc>, tz: Tz) -> String {
    crate::schedule::local_time(at, tz)
}

/// "12 s", "5 min 3 s", "3 h 12 min", "4 d 3 h".
fn age(secs: f64) -> String {
    let s = if secs.is_finite() && secs > 0.0 {
        secs as u64
    } else {
        0
    };
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {} s", s / 60, s % 60),
        3600..86400 => format!("{} h {} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {} h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_query_is_the_overview_under_the_configured_count() {
        assert_eq!(
            PageQuery::parse("", 3),
            Ok(PageQuery {
                scope: Scope::Latest,
                shards: 3,
                job: None,
            })
        );
        assert_eq!(
            PageQuery::parse("business_date=&shards=", 3).unwrap().scope,
            Scope::Latest
        );
    }

    #[test]
    fn a_month_and_a_count_select_one_month_in_detail() {
        let query = PageQuery::parse("business_date=2026-10-31&shards=4", 3).unwrap();
        assert_eq!(
            query.scope,
            Scope::Month(BusinessDate::parse("2026-10-31").unwrap())
        );
        assert_eq!(query.shards, 4);
    }

    #[test]
    fn bad_queries_are_refused_with_the_reason() {
        let cases = [
            ("business_date=2026-10-30", "last day of a month"),
            ("business_date=31.10.2026", "expected YYYY-MM-DD"),
            ("shards=0", "from 1 to 1024"),
            ("shards=1025", "from 1 to 1024"),
            ("shards=-1", "from 1 to 1024"),
            ("shards=two", "from 1 to 1024"),
            ("shard=1", "unknown parameter \"shard\""),
            ("shards=1&shards=2", "more than once"),
            ("business_date=%3Cscript%3E", "expected YYYY-MM-DD"),
        ];
        for (query, expected) in cases {
            let error = PageQuery::parse(query, 3).unwrap_err().to_string();
            assert!(error.contains(expected), "{query}: {error}");
        }
    }

    #[test]
    fn numbers_ages_and_money_read_as_a_person_writes_them() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(5379), "5,379");
        assert_eq!(count(-1234567), "-1,234,567");
        assert_eq!(money(1572250), "15,722.50");
        assert_eq!(money(5), "0.05");
        assert_eq!(money(-105), "-1.05");
        assert_eq!(age(-1.0), "0 s");
        assert_eq!(age(12.7), "12 s");
        assert_eq!(age(303.0), "5 min 3 s");
        assert_eq!(age(11_520.0), "3 h 12 min");
        assert_eq!(age(356_400.0), "4 d 3 h");
    }

    #[test]
    fn values_from_the_database_are_escaped() {
        let markup = html! { div.error { ("<script>alert(1)</script>") } };
        assert_eq!(
            markup.into_string(),
            r#"<div class="error">&lt;script&gt;alert(1)&lt;/script&gt;</div>"#
        );
    }
}
