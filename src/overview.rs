//! A job at a glance: which months and shards are done, what runs, what failed, what waits, what
//! the schedule does next. The status page shows it, one section per job of the registry;
//! `settlementd status` prints one month of it.
//!
//! Reading is read-only and bounded:
//! - A [`Reader`] has its own small pool (one connection for views, one for its background counter), so
//!   however many browsers refresh the page, it never takes a connection that the replica's runs
//!   and heartbeats need; views take turns.
//! - A view is read in one `REPEATABLE READ READ ONLY` transaction, one snapshot, so the grid, the
//!   history and the facts agree. Its statements share [`VIEW_BUDGET`], enforced by the server:
//!   `statement_timeout` is lowered before each statement to what is left. The claims and the
//!   history are cheap (primary keys, the trail's indexes) and must be read; what is costly
//!   degrades instead of making the view wait.
//! - A month's facts are the job's ([`crate::job_layer::Job::facts`]; the fine settlement: settled rows,
//!   fine sum and digest, read through the money journal). A **closed** month's (every shard
//!   SUCCESS) change only with a new attempt of the month or a journal row no attempt wrote, so
//!   they are counted once and kept, in this process and in `month_facts` for every process
//!   ([`month_facts`]), under their [`Marker`]: [`MonthRunRow::month_attempts`] and the job's
//!   mark ([`crate::job_layer::Job::facts_mark`]), both read in the view's snapshot. A view counts
//!   facts within [`COUNT_SLICE`] (the page) once; what does not fit is counted by the reader's
//!   background counter (one month after another, [`BACKGROUND_TIMEOUT`], marker and facts in one
//!   snapshot) and shown from a later view on. An **open** month's are counted live within the
//!   slice, or shown as unavailable.
//! - A running shard's progress bar needs how many items its run still has to read
//!   ([`crate::job_layer::Job::remaining`]); that is counted once per attempt, within the slice.
//!   A correction's attempt has none.
//! - A month whose every shard is SUCCESS is *closed* only when nothing waits for a run in it (the
//!   job's [`crate::job_layer::Job::pending`]; the fine settlement: late returns and edits of settled
//!   loans); a month held by an unfinished correction is "being corrected", never closed.
//! - Each month shows its pinned parameters, and a shard whose latest claim was refused because
//!   its replica's parameters differ (a `rule_conflict` event newer than the shard's claim) shows
//!   that.
//! - Across the lookback, the view says what the job's replicas watch ([`Watch`]): months not
//!   closed, items waiting before the lookback, a pause.
//!
//! The status page reads with [`VIEW_BUDGET`]; `settlementd status` reads the same overview with a
//! budget of its own ([`Reader::with_budget`]), so the two cannot disagree.

use crate::calendar::BusinessDate;
use crate::config::Settings;
use crate::job_layer::claim::{self, JobRunRow, MonthRunRow};
use crate::job_layer::due::{self, MonthState, NotClosed};
use crate::job_layer::events::{self, ShardEvent};
use crate::job_layer::month_facts::{self, Marker};
use crate::job_layer::pause::{self, Pause};
use crate::job_layer::registry::Registered;
use crate::job_layer::{params, Fact, JobError, JobKey, Params, Words};
use crate::schedule::{self, Slot};
use chrono::{DateTime, NaiveDate, Utc};
use chrono_tz::Tz;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// How many business dates the overview shows: a year of monthly runs.
pub const MONTHS: u32 = 12;
/// Audit events per shard in the overview (its latest, across months).
pub const HISTORY_LATEST: u32 = 5;
/// Audit events per shard in one month's view.
pub const HISTORY_MONTH: u32 = 20;
/// The database time one view may take, waiting for its turn included.
pub const VIEW_BUDGET: Duration = Duration::from_secs(2);
/// The most database time one view of the status page spends counting a month's facts, once: a
/// closed month's that `month_facts` does not keep yet (then counted in the background and kept),
/// an open month's so far (then not shown).
pub const COUNT_SLICE: Duration = Duration::from_millis(500);
/// How long a closed month's totals may take in the background.
pub const BACKGROUND_TIMEOUT: Duration = Duration::from_secs(600);
/// After an open month's facts did not fit in a view, how long before a view counts them again.
const RETRY_OPEN_AFTER: Duration = Duration::from_secs(60);
/// After a background computation failed, how long before a view starts another for that month.
const RETRY_BACKGROUND_AFTER: Duration = Duration::from_secs(60);
/// Kept entries beyond which the oldest months are forgotten (detail views can ask for any month).
const KEEP_AT_MOST: usize = 240;
/// SQLSTATE `query_canceled`: what `statement_timeout` raises.
const QUERY_CANCELED: &str = "57014";

#[derive(Debug, thiserror::Error)]
pub enum OverviewError {
    #[error("another view is reading the database and did not finish within {}s; try again", VIEW_BUDGET.as_secs())]
    Busy,
    #[error("the database did not answer within {}s", VIEW_BUDGET.as_secs())]
    TooSlow,
    #[error("database error: {0}")]
    Db(sqlx::Error),
    #[error(transparent)]
    Job(JobError),
}

impl From<sqlx::Error> for OverviewError {
    fn from(e: sqlx::Error) -> Self {
        if is_timeout(&e) || matches!(e, sqlx::Error::PoolTimedOut) {
            OverviewError::TooSlow
        } else {
            OverviewError::Db(e)
        }
    }
}

impl From<JobError> for OverviewError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::Db(e) => e.into(),
            other => OverviewError::Job(other),
        }
    }
}

pub type Result<T, E = OverviewError> = std::result::Result<T, E>;

fn is_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some(QUERY_CANCELED))
}

/// What a view shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The latest [`MONTHS`] business dates with any claim.
    Latest,
    /// One month, in detail.
    Month(BusinessDate),
}

impl Scope {
    fn month(self) -> Option<NaiveDate> {
        match self {
            Scope::Latest => None,
            Scope::Month(month) => Some(month.date()),
        }
    }
}

/// One view of a job under one shard count.
#[derive(Debug, Clone)]
pub struct Overview {
    /// The job's name.
    pub job: &'static str,
    /// The job whose months this one follows ([`crate::job_layer::Job::after`]).
    pub after: Option<&'static str>,
    /// What the job calls its items.
    pub words: Words,
    pub scope: Scope,
    pub shards: u32,
    /// Newest first; only months with at least one claim under `shards`.
    pub months: Vec<Month>,
    /// Each shard's latest audit events (across months, or of the month), by shard, newest first.
    pub history: Vec<ShardEvent>,
    pub schedule: Schedule,
    /// `lease.ttl_secs`: a RUNNING claim whose heartbeat is older may be taken over.
    pub lease_ttl_secs: u64,
    /// What the job's replicas watch over the lookback; `None` when it could not be read within
    /// the view's budget.
    pub watch: Option<Watch>,
}

/// What the job's replicas watch, across `settle.lookback_months` months ending at the latest
/// fire's month, under the view's shard count.
#[derive(Debug, Clone)]
pub struct Watch {
    pub lookback_months: u32,
    /// The job's pause, when it is paused.
    pub paused: Option<Pause>,
    /// The months of the lookback that are not closed, open or held, oldest first
    /// ([`due::not_closed`], [`Watch::open`], [`Watch::held`]).
    pub not_closed: Vec<NotClosed>,
    /// Items waiting in months before the lookback, every shard: no replica runs them by itself.
    pub before_lookback: u64,
}

impl Watch {
    /// The months of the lookback left open ([`MonthState::Open`]), oldest first.
    pub fn open(&self) -> impl Iterator<Item = &NotClosed> {
        self.not_closed
            .iter()
            .filter(|n| n.state() == MonthState::Open)
    }

    /// The months of the lookback held ([`MonthState::Held`]), oldest first.
    pub fn held(&self) -> impl Iterator<Item = &NotClosed> {
        self.not_closed
            .iter()
            .filter(|n| n.state() == MonthState::Held)
    }
}

/// Why a month is not closed, in words: "2 of 3 shards not SUCCESS, 4 late returns or edits
/// waiting, being corrected under key \"T-1\"", or, for a held one, "held: 3 rows held (bad
/// dates)".
pub fn not_closed_words(n: &NotClosed, words: Words) -> String {
    if n.state() == MonthState::Held {
        return format!("{}: {}", MonthState::Held.word(), words.held.count(n.held));
    }
    let mut parts = Vec::new();
    if n.unsettled_shards > 0 {
        parts.push(format!(
            "{} not SUCCESS",
            crate::numbers::things(n.unsettled_shards, "shard", "shards")
        ));
    }
    if !n.counted {
        parts.push(format!("{} not counted while a shard runs", words.waiting));
    } else if n.waiting > 0 {
        parts.push(words.waiting.count(n.waiting));
    }
    if n.held > 0 {
        parts.push(words.held.count(n.held));
    }
    if let Some(key) = &n.correction {
        parts.push(format!("being corrected under key {key:?}"));
    }
    if let Some(upstream) = n.upstream {
        parts.push(format!("{upstream} has not closed it"));
    }
    parts.join(", ")
}

/// Marks, in each view of a job that follows another ([`Overview::after`]), the months of the
/// lookback that the job it follows leaves open (a held month does not stop a follower,
/// [`MonthState::Held`]): a follower's month is not closed before its input is, even when the follower has nothing waiting (a fresh database, say). `views` holds
/// one view per job, read at the same time; a follower whose upstream is not among them is left
/// as it is.
pub fn follow_upstreams(views: &mut [Overview]) {
    let open: HashMap<&'static str, Vec<NaiveDate>> = views
        .iter()
        .filter_map(|v| {
            let watch = v.watch.as_ref()?;
            // Held items do not wait for a run: a follower runs a held month.
            Some((
                v.job,
                watch
                    .not_closed
                    .iter()
                    .filter(|n| n.state() == MonthState::Open)
                    .map(|n| n.business_date)
                    .collect(),
            ))
        })
        .collect();
    for view in views.iter_mut() {
        let (Some(upstream), Some(watch)) = (view.after, view.watch.as_mut()) else {
            continue;
        };
        for &date in open.get(upstream).into_iter().flatten() {
            match watch
                .not_closed
                .iter_mut()
                .find(|n| n.business_date == date)
            {
                Some(n) => n.upstream = Some(upstream),
                None => watch.not_closed.push(NotClosed {
                    business_date: date,
                    unsettled_shards: 0,
                    waiting: 0,
                    held: 0,
                    correction: None,
                    upstream: Some(upstream),
                    counted: true,
                }),
            }
        }
        watch.not_closed.sort_by_key(|n| n.business_date);
    }
}

/// Who runs a month's shards, for [`Month::verdict`]: the shards a live replica runs
/// ([`crate::job_layer::fleet::takers`]), and the lease after which a RUNNING claim is nobody's.
#[derive(Debug, Clone, Copy)]
pub struct Runners<'a> {
    pub takers: &'a std::collections::BTreeSet<u32>,
    pub lease_ttl_secs: u64,
}

/// A month's verdict ([`Month::verdict`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Verdict {
    /// `state` is [`MonthState::Closed`].
    pub closed: bool,
    pub state: MonthState,
    /// "closed", "held: " and the items held, "unknown: " and what was not counted, or
    /// "not closed: " and every reason.
    pub words: String,
    /// What resolves it: the command, the event or the wait; `None` when closed.
    pub next: Option<String>,
}

/// Items of a month whose every shard is SUCCESS: waiting for a run, and held for an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Waiting {
    pub late: u64,
    pub held: u64,
    /// Items of the job's upkeep ([`crate::job_layer::Pending::upkeep`]).
    pub upkeep: u64,
}

impl Overview {
    pub fn month(&self, business_date: NaiveDate) -> Option<&Month> {
        self.months
            .iter()
            .find(|m| m.business_date == business_date)
    }

    /// Whether a shard of a shown month is RUNNING: the view is worth refreshing.
    pub fn is_running(&self) -> bool {
        self.months
            .iter()
            .flat_map(|m| &m.shards)
            .any(|s| s.state() == State::Running)
    }
}

/// The schedule as of the view.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub timezone: Tz,
    /// The next fire and the month it will settle.
    pub next: Option<Slot>,
    /// The latest fire at or before now: the month that should be closed.
    pub latest: Option<Slot>,
}

/// One business date under the view's shard count.
#[derive(Debug, Clone)]
pub struct Month {
    pub business_date: NaiveDate,
    /// Every shard of the count, in order.
    pub shards: Vec<Shard>,
    pub totals: Totals,
    /// The parameters the month's first claim pinned (or its last correction); `None`: none yet.
    pub rule: Option<Params>,
    /// The same in words ([`crate::job_layer::Job::describe`]).
    pub rule_text: Option<String>,
    /// When every shard is SUCCESS: the items still waiting for a run, and held. `None` when not
    /// counted (an open month, or the count did not fit in the view's budget).
    pub unsettled: Option<Waiting>,
    /// The unfinished correction holding the month (its key, since when): "being corrected".
    pub correction: Option<(String, DateTime<Utc>)>,
    /// One month's view only: what a run of it would do now ([`crate::job_layer::Job::preview`], the
    /// dry run's numbers, within the view's budget) — its held items with why among them. `None`
    /// in the overview, or for a job that cannot tell; `Err` when it did not fit.
    pub preview: Option<std::result::Result<crate::job_layer::Preview, String>>,
}

impl Month {
    /// Every shard SUCCESS.
    pub fn all_success(&self) -> bool {
        self.shards.iter().all(|s| s.state() == State::Success)
    }

    /// Late returns waiting in a month whose every shard is SUCCESS (0 when not counted).
    pub fn late_returns(&self) -> u64 {
        self.unsettled.map_or(0, |u| u.late)
    }

    /// Held rows (bad dates) of a month whose every shard is SUCCESS (0 when not counted).
    pub fn held(&self) -> u64 {
        self.unsettled.map_or(0, |u| u.held)
    }

    /// The month's state ([`MonthState::of`]): settled when every shard is SUCCESS, none refused
    /// and no correction holds it; then what waits and what is held decide, `Unknown` while they
    /// could not be counted ([`Month::verdict`] says why in words).
    pub fn state(&self) -> MonthState {
        MonthState::of(
            self.all_success()
                && self.correction.is_none()
                && self.shards.iter().all(|s| s.conflict.is_none()),
            self.unsettled.map(|u| (u.late + u.upkeep, u.held)),
        )
    }

    /// [`MonthState::Closed`]: every shard SUCCESS and none refused, nothing waits or is held, no
    /// correction holds it.
    pub fn closed(&self) -> bool {
        self.state() == MonthState::Closed
    }

    /// Closed or not, and why, in words an operator acts on: the one judgement `status` (text and
    /// JSON) and the page show. Closed only when every shard is SUCCESS and nothing waits, is held,
    /// is refused or is being corrected; otherwise each of those is named, and what resolves it —
    /// which, while the job is `paused`, is its resume. Times are in `tz`, the schedule's zone, as
    /// everywhere else on the page and in `status`. `runners`: who runs the shards (`None` when
    /// the fleet is unknown); what waits on a shard nobody runs is said to wait for one, as that
    /// shard's cell says, never to be run within a heartbeat.
    pub fn verdict(
        &self,
        words: Words,
        paused: Option<&Pause>,
        tz: Tz,
        runners: Option<Runners<'_>>,
    ) -> Verdict {
        let mut open = Vec::new();
        let mut next = Vec::new();
        if let Some((key, since)) = &self.correction {
            open.push(format!(
                "being corrected under key {key:?} since {}",
                schedule::local_time(*since, tz)
            ));
            next.push("`settlementd correct` with the same key finishes it".to_string());
        }
        let shards = self.open_shards();
        let refused = self.shards.iter().any(|s| s.conflict.is_some());
        if !shards.is_empty() {
            open.push(shards);
        } else if self.unsettled.is_none() {
            open.push(format!(
                "every shard SUCCESS; {} not counted",
                words.waiting
            ));
            next.push("the count did not fit in the view's database time".to_string());
        }
        if self.late_returns() > 0 {
            open.push(words.waiting.count(self.late_returns()));
        }
        let upkeep = self.unsettled.map_or(0, |u| u.upkeep);
        if upkeep > 0 {
            open.push(words.upkeep.count(upkeep));
            next.push(
                "every replica's tick gives them their opening entry (`settlementd migrate` does \
                 it too); until then `status` totals leave them out and `verify` names them"
                    .to_string(),
            );
        }
        let fix_held =
            "fix them in libraryd (`settlementd verify` and the month's page name them); \
                        the next run takes them";
        if self.held() > 0 {
            open.push(words.held.count(self.held()));
            next.push(fix_held.to_string());
        }
        let state = self.state();
        match state {
            MonthState::Closed => {
                return Verdict {
                    closed: true,
                    state,
                    words: state.word().into(),
                    next: None,
                }
            }
            MonthState::Held => {
                return Verdict {
                    closed: false,
                    state,
                    words: format!("{}: {}", state.word(), words.held.count(self.held())),
                    next: Some(fix_held.to_string()),
                }
            }
            MonthState::Unknown => {
                return Verdict {
                    closed: false,
                    state,
                    words: format!(
                        "{}: every shard SUCCESS; {} not counted",
                        state.word(),
                        words.waiting
                    ),
                    next: Some("the count did not fit in the view's database time".into()),
                }
            }
            MonthState::Open => {}
        }
        let waits = !self.all_success() || self.late_returns() > 0;
        if refused {
            next.push(
                "a replica's rule is not the month's: fix its configuration, or `settlementd \
                 correct` re-pins the month"
                    .to_string(),
            );
        }
        match paused {
            Some(p) if waits => next.push(format!(
                "the job is paused since {} by {}: nothing runs until `settlementd resume`",
                schedule::local_time(p.paused_at, tz),
                p.paused_by
            )),
            None if waits && !refused && self.correction.is_none() => {
                next.push(self.who_runs(runners))
            }
            _ => {}
        }
        Verdict {
            closed: false,
            state,
            words: format!("{}: {}", state.word(), open.join("; ")),
            next: (!next.is_empty()).then(|| next.join("; ")),
        }
    }

    /// "shard 1 RUNNING; shards 2, 3 missing; shard 3 refused (rule conflict)"; empty when every
    /// shard is SUCCESS and none was refused. A run the pause stopped is "stopped by the pause",
    /// not FAILED ([`JobRunRow::stopped_by_pause`]).
    pub fn open_shards(&self) -> String {
        let paused: Vec<u32> = self
            .shards
            .iter()
            .filter(|s| s.run.as_ref().is_some_and(JobRunRow::stopped_by_pause))
            .map(|s| s.index)
            .collect();
        let by_state = [State::Running, State::Failed, State::Missing]
            .into_iter()
            .map(|state| {
                let shards = self.in_state(state);
                (
                    shards.into_iter().filter(|s| !paused.contains(s)).collect(),
                    state.word(),
                )
            })
            .chain([(paused.clone(), "stopped by the pause")]);
        let conflicts: Vec<u32> = self
            .shards
            .iter()
            .filter(|s| s.conflict.is_some())
            .map(|s| s.index)
            .collect();
        by_state
            .chain([(conflicts, "refused (rule conflict)")])
            .filter_map(|(shards, word)| {
                let list: Vec<String> = shards.iter().map(u32::to_string).collect();
                match shards.len() {
                    0 => None,
                    1 => Some(format!("shard {} {word}", list[0])),
                    _ => Some(format!("shards {} {word}", list.join(", "))),
                }
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The shards in `state`.
    /// Who runs what waits in the month: a replica of each shard within a heartbeat, or, for the
    /// shards that wait (not SUCCESS; every shard while items wait, which any may hold) with no
    /// live replica among the runners' takers and no live lease (a RUNNING claim whose heartbeat
    /// is within the lease: some process runs it), nobody until one starts or an operator runs
    /// them.
    fn who_runs(&self, runners: Option<Runners<'_>>) -> String {
        let everyone = self.late_returns() > 0 || self.unsettled.is_some_and(|u| u.upkeep > 0);
        let unrun: Vec<u32> = match runners {
            None => Vec::new(),
            Some(Runners {
                takers,
                lease_ttl_secs,
            }) => self
                .shards
                .iter()
                .filter(|s| everyone || s.state() != State::Success)
                .filter(|s| s.state() != State::Running || s.lease_expired(lease_ttl_secs))
                .map(|s| s.index)
                .filter(|i| !takers.contains(i))
                .collect(),
        };
        if unrun.is_empty() {
            return "a replica of each shard runs what waits within a heartbeat".to_string();
        }
        let list = unrun
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "no live replica runs {} {list}: start one, or `settlementd run --business-date {} \
             --shard N --shards {} --wait` runs it by hand",
            if unrun.len() == 1 { "shard" } else { "shards" },
            self.business_date,
            self.shards.len()
        )
    }

    pub fn in_state(&self, state: State) -> Vec<u32> {
        self.shards
            .iter()
            .filter(|s| s.state() == state)
            .map(|s| s.index)
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Success,
    Running,
    Failed,
    /// No claim: no replica of this shard count has started the month's shard.
    Missing,
}

impl State {
    /// As `job_runs.status` spells it; `missing` for no row.
    pub fn word(self) -> &'static str {
        match self {
            State::Success => "SUCCESS",
            State::Running => "RUNNING",
            State::Failed => "FAILED",
            State::Missing => "missing",
        }
    }
}

/// One shard of a month.
#[derive(Debug, Clone)]
pub struct Shard {
    pub index: u32,
    /// Its claim; `None` when missing.
    pub run: Option<JobRunRow>,
    /// A running shard's loans read so far against all it has to read, when known.
    pub progress: Option<Progress>,
    /// A claim of this shard was refused after its latest claim because the replica's rule differs
    /// from the month's pinned one: the refusal's message. The replica retries with its backoff,
    /// so this stands until its configuration agrees (or a correction re-pins the month).
    pub conflict: Option<String>,
}

impl Shard {
    pub fn state(&self) -> State {
        match self.run.as_ref().map(|r| r.status.as_str()) {
            None => State::Missing,
            Some("SUCCESS") => State::Success,
            Some("RUNNING") => State::Running,
            // The table allows nothing else.
            Some(_) => State::Failed,
        }
    }

    /// RUNNING with a heartbeat older than the lease: its holder is gone and a replica of the
    /// shard may take it over.
    pub fn lease_expired(&self, ttl_secs: u64) -> bool {
        self.state() == State::Running
            && self
                .run
                .as_ref()
                .is_some_and(|r| r.heartbeat_age_secs > ttl_secs as f64)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Loans read by the run so far (all attempts since the month was last forced).
    pub read: u64,
    /// Loans read plus those left to read, as counted once for this attempt.
    pub total: u64,
}

impl Progress {
    /// 0 to 100.
    pub fn percent(&self) -> u64 {
        if self.total == 0 {
            return 100;
        }
        (self.read.min(self.total) * 100) / self.total
    }
}

/// A month's facts ([`crate::job_layer::Job::facts`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Totals {
    /// A closed month's, computed once.
    Closed(Vec<Fact>),
    /// An open month's: what is done so far, computed in this view.
    SoFar(Vec<Fact>),
    /// A closed month's facts are being computed in the background.
    Computing,
    /// Not computed: why.
    Unavailable(String),
}

/// Reads overviews for one process and keeps what cannot change. Cheap to share (`Arc`).
pub struct Reader {
    pool: PgPool,
    /// One view at a time.
    turn: Semaphore,
    kept: Arc<Mutex<Kept>>,
    /// The database time one view may take ([`VIEW_BUDGET`] for the status page).
    budget: Duration,
    /// Writes the closed months it counts to `month_facts` (`serve`'s page; not the read-only
    /// `status`).
    stores: bool,
    /// A month's own view prices what a run would write ([`Month::preview`]: the page shows it;
    /// `status` does not, and does not spend its time on it).
    previews: bool,
    /// The most database time one view spends counting a month's facts ([`COUNT_SLICE`] for the
    /// page), once: a view that gave up counts nothing more. `None`: what is left of the budget.
    count_slice: Option<Duration>,
}

/// What a view may still spend counting months' facts (a closed month's not kept yet, an open
/// month's so far).
struct Counting {
    slice: Option<Duration>,
    /// Why the view stopped counting, once a count did not fit.
    stopped: Option<String>,
}

impl Counting {
    fn new(slice: Option<Duration>) -> Self {
        Self {
            slice,
            stopped: None,
        }
    }

    /// Until when the next count may run: the view's deadline, or sooner with a slice; `None`
    /// once a count did not fit.
    fn until(&self, deadline: Instant) -> Option<Instant> {
        match (&self.stopped, self.slice) {
            (Some(_), _) => None,
            (None, None) => Some(deadline),
            (None, Some(slice)) => Some(deadline.min(Instant::now() + slice)),
        }
    }

    /// A count did not fit (`why`): with a slice the view counts nothing more. Says why: the
    /// view's budget, when it is spent, or the slice.
    fn gave_up(&mut self, why: String, deadline: Instant) -> String {
        let why = match self.slice {
            Some(_) if left(deadline).is_zero() => why,
            Some(slice) => format!(
                "not counted in this view: counting it takes more than {} ms of database time (`settlementd status --count` counts it)",
                slice.as_millis()
            ),
            None => why,
        };
        if self.slice.is_some() {
            self.stopped = Some(why.clone());
        }
        why
    }

    fn why(&self) -> String {
        self.stopped.clone().unwrap_or_default()
    }
}

#[derive(Default)]
struct Kept {
    /// By job name and business date.
    totals: BTreeMap<(&'static str, NaiveDate), KeptTotals>,
    /// Loans read plus left to read, per run attempt (job key and attempt).
    run_totals: HashMap<(JobKey, i32), u64>,
    /// Open months whose facts did not fit in a view: until when no view counts them, and why.
    too_big: HashMap<(&'static str, NaiveDate), (Instant, String)>,
    /// Closed months queued for the background counter, oldest first.
    queue: VecDeque<(Arc<dyn Registered>, BusinessDate)>,
    /// The background counter runs.
    background: bool,
}

#[derive(Debug, Clone)]
enum KeptTotals {
    Ready {
        marker: Marker,
        totals: Vec<Fact>,
    },
    /// Queued for the background counter, or being counted there.
    Computing,
    Failed {
        retry_at: Instant,
        why: String,
    },
}

impl Reader {
    /// A reader on the database of `pool`, with its own pool of at most two connections (opened
    /// when first needed, closed as soon as `pool` closes its unused ones) named
    /// `settlementd-status`.
    pub fn new(pool: &PgPool) -> Self {
        Self {
            stores: true,
            previews: true,
            count_slice: Some(COUNT_SLICE),
            ..Self::with_budget(pool, VIEW_BUDGET, None)
        }
    }

    /// A reader whose views may take `budget` of database time (the command line's `status`
    /// waits for its answer as long as a command does), spending at most `count_slice` counting
    /// facts (`None`: what is left of the budget), and that writes nothing and counts nothing in
    /// the background: what `month_facts` does not keep and does not fit is said not counted.
    pub fn with_budget(pool: &PgPool, budget: Duration, count_slice: Option<Duration>) -> Self {
        let options = (*pool.connect_options())
            .clone()
            .application_name("settlementd-status");
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .min_connections(0)
            // A connection is waited for as long as the view's budget, and never longer than the
            // replica's own pool waits (`database.acquire_timeout_secs`): `status`, whose budget
            // is 10 min, on a full server gives up when any command would.
            .acquire_timeout(budget.min(pool.options().get_acquire_timeout()))
            // Released as soon as the replica's own pool releases its connections: an open page
            // must not hold connections between its reloads (docs/OPERATIONS.md, "Connections").
            .idle_timeout(pool.options().get_idle_timeout())
            .connect_lazy_with(options);
        Self {
            pool,
            turn: Semaphore::new(1),
            kept: Arc::default(),
            budget,
            stores: false,
            previews: false,
            count_slice,
        }
    }

    /// The fleet's replicas ([`crate::job_layer::fleet::list`]) within the view's budget; `None` when
    /// the schema predates the registry or it could not be read in time.
    pub async fn fleet(&self) -> Option<Vec<crate::job_layer::fleet::Member>> {
        match tokio::time::timeout(self.budget, crate::job_layer::fleet::list(&self.pool)).await {
            Ok(Ok(fleet)) => fleet,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "cannot read the fleet");
                None
            }
            Err(_) => None,
        }
    }

    /// Closes the reader's own pool (a command that is done with it).
    pub async fn close(&self) {
        crate::db::close(&self.pool).await;
    }

    /// Reads what `scope` shows of `job` under `shards`, with the schedule as of `now`.
    pub async fn read(
        &self,
        settings: &Settings,
        job: &Arc<dyn Registered>,
        now: DateTime<Utc>,
        scope: Scope,
        shards: u32,
    ) -> Result<Overview> {
        let per_shard = match scope {
            Scope::Latest => HISTORY_LATEST,
            Scope::Month(_) => HISTORY_MONTH,
        };
        self.read_with_history(settings, job, now, scope, shards, per_shard)
            .await
    }

    /// [`Reader::read`] with each shard's latest `per_shard` audit events.
    pub async fn read_with_history(
        &self,
        settings: &Settings,
        job: &Arc<dyn Registered>,
        now: DateTime<Utc>,
        scope: Scope,
        shards: u32,
        per_shard: u32,
    ) -> Result<Overview> {
        let budget = self.budget;
        let deadline = Instant::now() + budget;
        let _turn = tokio::time::timeout(budget, self.turn.acquire())
            .await
            .map_err(|_| OverviewError::Busy)?
            .map_err(|_| OverviewError::Busy)?;
        let mut tx = tokio::time::timeout_at(
            deadline.into(),
            self.pool
                .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"),
        )
        .await
        .map_err(|_| OverviewError::TooSlow)??;
        let months = match scope {
            Scope::Latest => MONTHS,
            Scope::Month(_) => 1,
        };
        let name = job.name();
        set_timeout(&mut tx, left(deadline)).await?;
        let rows = claim::latest_months(&mut *tx, name, shards, scope.month(), months).await?;
        set_timeout(&mut tx, left(deadline)).await?;
        let history = match per_shard {
            0 => Vec::new(),
            n => events::latest_per_shard(&mut *tx, name, shards, scope.month(), n).await?,
        };
        let mut grouped = by_month(rows);
        if let (Scope::Month(month), true) = (scope, grouped.is_empty()) {
            // One month asked for, and no shard of the count has claimed it: every shard missing,
            // and whatever is done of it (under another count, say) all the same.
            grouped.push((month.date(), 0, Vec::new()));
        }
        let dates: Vec<NaiveDate> = grouped.iter().map(|(d, _, _)| *d).collect();
        set_timeout(&mut tx, left(deadline)).await?;
        let mut rules: HashMap<NaiveDate, Params> = params::pinned_for(&mut *tx, name, &dates)
            .await?
            .into_iter()
            .collect();
        let mut conflicts =
            events::latest_of_kind(&mut *tx, name, shards, &dates, "rule_conflict").await?;
        let (cron, timezone) = (&job.schedule().cron, settings.schedule.timezone);
        let latest = schedule::latest_slot_at_or_before(cron, timezone, now).map(Slot::new);
        let watch_dates: Vec<NaiveDate> = latest
            .map(|slot| {
                crate::calendar::lookback(slot.business_date, settings.settle.lookback_months)
            })
            .unwrap_or_default();
        set_timeout(&mut tx, left(deadline)).await?;
        let periods = match watch_dates.first().zip(watch_dates.last()) {
            Some((first, last)) => {
                due::periods(&mut *tx, name, shards, shards, *first, *last).await?
            }
            None => Vec::new(),
        };
        let held_by: HashMap<NaiveDate, (String, DateTime<Utc>)> = periods
            .iter()
            .filter_map(|p| {
                Some((
                    p.business_date,
                    (
                        p.correction_key.clone()?,
                        p.correcting_since.unwrap_or_default(),
                    ),
                ))
            })
            .collect();
        let mut held_months = HashMap::new();
        for date in &dates {
            if !held_by.contains_key(date) {
                if let Some(held) = params::held_by(&mut *tx, name, *date).await? {
                    held_months.insert(*date, held);
                }
            }
        }
        // What waits, from the job's own probes (index probes for the fine settlement), within
        // what is left of the budget: every month from the oldest shown to the latest fire's, so
        // that what waits before the lookback is counted whole.
        let asked: Vec<NaiveDate> = match (
            dates.iter().chain(&watch_dates).min(),
            dates.iter().chain(&watch_dates).max(),
        ) {
            (Some(first), Some(last)) => match (
                BusinessDate::new(*first).ok(),
                BusinessDate::new(*last).ok(),
            ) {
                (Some(first), Some(last)) => crate::calendar::months_between(first, last),
                _ => dates.clone(),
            },
            _ => Vec::new(),
        };
        // Not a month a shard runs: its run reads what waits in it as it goes (its bar says how
        // much is left), and counting that in every view is the month's size — seconds to minutes
        // at a big library's month end, which left every other month unknown. The first month
        // asked stays: what waits before it is counted from it.
        let uncounted: HashSet<NaiveDate> = grouped
            .iter()
            .filter(|(_, _, runs)| runs.iter().any(|r| r.status == "RUNNING"))
            .map(|(date, _, _)| *date)
            .filter(|date| asked.first() != Some(date))
            .collect();
        let asked: Vec<NaiveDate> = asked
            .into_iter()
            .filter(|date| !uncounted.contains(date))
            .collect();
        // In the view's snapshot, within what is left of its budget.
        let pending = {
            let job = job.clone();
            costly(&mut tx, (deadline, self.budget), move |c| {
                Box::pin(async move { job.pending(c, shards, &asked).await })
            })
            .await?
            .ok()
        };
        let watch = match (&pending, latest) {
            (Some(pending), Some(_)) => {
                let mut window = pending.clone();
                let start = watch_dates.first().copied().unwrap_or(NaiveDate::MAX);
                window.before = pending.before
                    + pending
                        .by_period
                        .iter()
                        .filter(|p| p.business_date < start)
                        .map(|p| p.late)
                        .sum::<u64>();
                let mut not_closed = due::not_closed(&periods, &window, shards, &watch_dates);
                for n in &mut not_closed {
                    n.counted = !uncounted.contains(&n.business_date);
                }
                Some(Watch {
                    lookback_months: settings.settle.lookback_months,
                    paused: pause::of(&mut *tx, name).await?,
                    not_closed,
                    before_lookback: window.before,
                })
            }
            (None, _) => None,
            (Some(_), None) => Some(Watch {
                lookback_months: settings.settle.lookback_months,
                paused: pause::of(&mut *tx, name).await?,
                not_closed: Vec::new(),
                before_lookback: 0,
            }),
        };
        set_timeout(&mut tx, left(deadline)).await?;
        let mut stored = month_facts::read(&mut tx, name, &dates).await?;
        let mut counting = Counting::new(self.count_slice);
        let mut months = Vec::new();
        for (business_date, month_attempts, runs) in grouped {
            let all_success =
                runs.len() == shards as usize && runs.iter().all(|r| r.status == "SUCCESS");
            let counted = match (&pending, all_success) {
                (Some(found), true) => Some(
                    found
                        .by_period
                        .iter()
                        .filter(|p| p.business_date == business_date)
                        .fold(Waiting::default(), |w, p| Waiting {
                            late: w.late + p.late,
                            held: w.held + p.held,
                            upkeep: w.upkeep + p.upkeep,
                        }),
                ),
                _ => None,
            };
            let correction = held_by
                .get(&business_date)
                .or_else(|| held_months.get(&business_date))
                .cloned();
            let mut month = self
                .costly_reads(
                    &mut tx,
                    job,
                    deadline,
                    (business_date, month_attempts),
                    runs,
                    (shards, matches!(scope, Scope::Month(_))),
                    (counted, correction),
                    (stored.remove(&business_date), &mut counting),
                )
                .await?;
            month.rule = rules.remove(&business_date);
            month.rule_text = month.rule.as_ref().map(|p| job.describe(p));
            for shard in &mut month.shards {
                let refused = conflicts.iter().position(|e| {
                    e.business_date == business_date && e.event.shard == shard.index as i32
                });
                let Some(refused) = refused.map(|i| conflicts.swap_remove(i)) else {
                    continue;
                };
                let after_claim = match &shard.run {
                    None => true,
                    Some(run) => refused.event.at > run.started_at,
                };
                if after_claim {
                    shard.conflict = refused.event.message;
                }
            }
            months.push(month);
        }
        // Read-only: nothing to commit.
        tx.rollback().await?;
        Ok(Overview {
            job: name,
            after: job.after(),
            words: job.words(),
            scope,
            shards,
            months,
            history,
            schedule: Schedule {
                timezone,
                next: schedule::next_slot_after(cron, timezone, now).map(Slot::new),
                latest,
            },
            lease_ttl_secs: settings.lease.ttl_secs,
            watch,
        })
    }

    /// One month's shards, running shards' progress and facts, each costly read within what is
    /// left of the view's budget. `counted`: the month's waiting items, when every shard is
    /// SUCCESS and they could be counted; `correction`: the correction holding it.
    #[allow(clippy::too_many_arguments)]
    async fn costly_reads(
        &self,
        tx: &mut PgConnection,
        job: &Arc<dyn Registered>,
        deadline: Instant,
        (business_date, month_attempts): (NaiveDate, i64),
        runs: Vec<JobRunRow>,
        (shards, detail): (u32, bool),
        (unsettled, correction): (Option<Waiting>, Option<(String, DateTime<Utc>)>),
        (stored, counting): (Option<month_facts::Kept>, &mut Counting),
    ) -> Result<Month> {
        let mut runs: BTreeMap<u32, JobRunRow> =
            runs.into_iter().map(|r| (r.shard as u32, r)).collect();
        let mut month_shards = Vec::new();
        for index in 0..shards {
            let run = runs.remove(&index);
            // A correction's attempt re-prices what is settled: what the job counts as left to
            // read (its unsettled items) is not what the correction has left, so it has no bar.
            let progress = match (&run, counting.until(deadline)) {
                (Some(run), Some(until)) if run.status == "RUNNING" && correction.is_none() => {
                    let key = JobKey {
                        job_name: job.name().to_string(),
                        business_date,
                        shards,
                        shard: index,
                    };
                    match self.progress(tx, job, until, key, run).await? {
                        Ok(progress) => progress,
                        Err(why) => {
                            counting.gave_up(why, deadline);
                            None
                        }
                    }
                }
                _ => None,
            };
            month_shards.push(Shard {
                index,
                run,
                progress,
                conflict: None,
            });
        }
        // Every shard SUCCESS: what is done of it changes only with a new attempt (a late return
        // waits unsettled, an edit waits queued, until a run takes them; a correction runs), so
        // its facts are kept under the month's attempts.
        let closed = month_shards.iter().all(|s| s.state() == State::Success);
        let totals = match BusinessDate::new(business_date) {
            // Claims are made for month ends only; a row written by hand may not be one.
            Err(e) => Totals::Unavailable(e.to_string()),
            Ok(date) if closed => {
                let at = (month_attempts, stored);
                self.closed_totals(tx, job, (deadline, counting), date, at)
                    .await?
            }
            // An open month's facts move with every batch: counted live, if at all, and not
            // tried again for a while once they did not fit (a month-end run's views would each
            // spend their slice on it).
            Ok(date) => {
                let at = (job.name(), business_date);
                let skip = self.kept().too_big.get(&at).cloned();
                match (counting.until(deadline), skip) {
                    (None, _) => Totals::Unavailable(counting.why()),
                    (Some(_), Some((until, ref why))) if Instant::now() < until => {
                        Totals::Unavailable(why.clone())
                    }
                    (Some(until), _) => {
                        match costly(tx, (until, self.budget), facts_of(job, date)).await? {
                            Ok(facts) => {
                                self.kept().too_big.remove(&at);
                                Totals::SoFar(facts)
                            }
                            // The view's budget spent elsewhere says nothing of the month.
                            Err(why) if left(deadline).is_zero() => {
                                Totals::Unavailable(counting.gave_up(why, deadline))
                            }
                            Err(why) => {
                                let why = counting.gave_up(why, deadline);
                                let mut kept = self.kept();
                                if kept.too_big.len() >= KEEP_AT_MOST {
                                    kept.too_big.clear();
                                }
                                let again = Instant::now() + RETRY_OPEN_AFTER;
                                kept.too_big.insert(at, (again, why.clone()));
                                Totals::Unavailable(why)
                            }
                        }
                    }
                }
            }
        };
        // What a run would do: priced over every item that waits, so counted within the slice.
        let detail = detail && self.previews;
        let preview = match (
            detail,
            BusinessDate::new(business_date),
            counting.until(deadline),
        ) {
            (false, _, _) | (_, Err(_), _) => None,
            (true, Ok(_), None) => Some(Err(counting.why())),
            (true, Ok(month), Some(until)) => {
                let job = job.clone();
                let all: Vec<u32> = (0..shards).collect();
                match costly(tx, (until, self.budget), move |c| {
                    Box::pin(async move { job.preview(c, month, shards, &all).await })
                })
                .await?
                {
                    Ok(preview) => preview.map(Ok),
                    Err(why) => Some(Err(counting.gave_up(why, deadline))),
                }
            }
        };
        Ok(Month {
            business_date,
            shards: month_shards,
            totals,
            rule: None,
            rule_text: None,
            unsettled,
            correction,
            preview,
        })
    }

    async fn progress(
        &self,
        tx: &mut PgConnection,
        job: &Arc<dyn Registered>,
        deadline: Instant,
        key: JobKey,
        run: &JobRunRow,
    ) -> Result<Result<Option<Progress>, String>> {
        let read = run.scanned.max(0) as u64;
        let id = (key.clone(), run.attempt);
        let known = self.kept().run_totals.get(&id).copied();
        let total = match known {
            Some(total) => total,
            None => {
                let job = job.clone();
                let cursor = run.cursor();
                let remaining = costly(tx, (deadline, self.budget), move |c| {
                    Box::pin(async move { job.remaining(c, &key, cursor).await })
                })
                .await?;
                match remaining {
                    Ok(Some(left)) => {
                        let total = read + left;
                        let mut kept = self.kept();
                        if kept.run_totals.len() >= KEEP_AT_MOST {
                            kept.run_totals.clear();
                        }
                        kept.run_totals.insert(id, total);
                        total
                    }
                    Ok(None) => return Ok(Ok(None)),
                    Err(why) => return Ok(Err(why)),
                }
            }
        };
        Ok(Ok(Some(Progress { read, total })))
    }

    /// A closed month's facts: kept (in this process, or in `month_facts` by any process) under
    /// the month's marker as it stands in this view's snapshot, computed now within the budget and
    /// kept, or computed in the background when the budget does not suffice.
    async fn closed_totals(
        &self,
        tx: &mut PgConnection,
        job: &Arc<dyn Registered>,
        (deadline, counting): (Instant, &mut Counting),
        month: BusinessDate,
        (month_attempts, stored): (i64, Option<month_facts::Kept>),
    ) -> Result<Totals> {
        let mark = {
            let job = job.clone();
            costly(tx, (deadline, self.budget), move |c| {
                Box::pin(async move { job.facts_mark(c, month).await })
            })
            .await?
        };
        let at = (job.name(), month.date());
        let kept = self.kept().totals.get(&at).cloned();
        let marker = match mark {
            Ok(mark) => Marker {
                month_attempts,
                mark,
            },
            // Not even the mark fitted: whatever is kept cannot be checked; the background
            // counter reads the marker with the facts.
            Err(why) => {
                return Ok(match kept {
                    Some(KeptTotals::Failed { retry_at, why }) if Instant::now() < retry_at => {
                        Totals::Unavailable(why)
                    }
                    _ => self.not_counted(job, month, why),
                })
            }
        };
        match kept {
            Some(KeptTotals::Ready { totals, marker: m }) if m == marker => {
                return Ok(Totals::Closed(totals))
            }
            Some(KeptTotals::Computing) => return Ok(Totals::Computing),
            Some(KeptTotals::Failed { retry_at, why }) if Instant::now() < retry_at => {
                return Ok(Totals::Unavailable(why))
            }
            _ => {}
        }
        if let Some(stored) = stored.filter(|k| k.marker == marker) {
            self.keep(
                at,
                KeptTotals::Ready {
                    marker,
                    totals: stored.facts.clone(),
                },
            );
            return Ok(Totals::Closed(stored.facts));
        }
        let Some(until) = counting.until(deadline) else {
            return Ok(self.not_counted(job, month, counting.why()));
        };
        match costly(tx, (until, self.budget), facts_of(job, month)).await? {
            Ok(totals) => {
                self.keep(
                    at,
                    KeptTotals::Ready {
                        marker,
                        totals: totals.clone(),
                    },
                );
                self.store(job.name(), month, marker, &totals);
                Ok(Totals::Closed(totals))
            }
            Err(why) => {
                let why = counting.gave_up(why, deadline);
                Ok(self.not_counted(job, month, why))
            }
        }
    }

    /// A closed month whose facts are not kept and were not counted in this view (`why`): the
    /// page's reader counts them in the background; `status`'s, which ends with the command,
    /// says so.
    fn not_counted(&self, job: &Arc<dyn Registered>, month: BusinessDate, why: String) -> Totals {
        if self.stores {
            self.compute_in_background(job, month)
        } else {
            Totals::Unavailable(why)
        }
    }

    /// Writes a month's counted facts to `month_facts` for every process, in a task of its own,
    /// when this reader keeps them there ([`Reader::new`]); a failure (a read-only server) leaves
    /// them in this process's memory only, and says so in the debug log.
    fn store(&self, job: &'static str, month: BusinessDate, marker: Marker, facts: &[Fact]) {
        if !self.stores {
            return;
        }
        let (pool, facts) = (self.pool.clone(), facts.to_vec());
        tokio::spawn(async move {
            if let Err(e) = month_facts::store(&pool, job, month.date(), marker, &facts).await {
                tracing::debug!(job, business_date = %month, error = %e, "cannot keep a month's counted facts");
            }
        });
    }

    /// Queues `month`'s facts for the background counter, unless they are queued already; it
    /// counts what is queued one month after another on a connection of its own, each month's
    /// marker and facts in one snapshot (and keeps them in `month_facts` when this reader stores).
    fn compute_in_background(&self, job: &Arc<dyn Registered>, month: BusinessDate) -> Totals {
        let at = (job.name(), month.date());
        let start = {
            let mut kept = self.kept();
            if matches!(kept.totals.get(&at), Some(KeptTotals::Computing)) {
                return Totals::Computing;
            }
            kept.queue.push_back((job.clone(), month));
            kept.totals.insert(at, KeptTotals::Computing);
            !std::mem::replace(&mut kept.background, true)
        };
        if start {
            let (pool, kept, stores) = (self.pool.clone(), self.kept.clone(), self.stores);
            tokio::spawn(count_in_background(pool, kept, stores));
        }
        Totals::Computing
    }

    fn keep(&self, at: (&'static str, NaiveDate), entry: KeptTotals) {
        let mut kept = self.kept();
        kept.totals.insert(at, entry);
        while kept.totals.len() > KEEP_AT_MOST {
            kept.totals.pop_first();
        }
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        lock(&self.kept)
    }
}

/// Counts the queued closed months one after another until none is queued.
async fn count_in_background(pool: PgPool, kept: Arc<Mutex<Kept>>, stores: bool) {
    loop {
        let next = {
            let mut kept = lock(&kept);
            match kept.queue.pop_front() {
                Some(next) => next,
                None => {
                    kept.background = false;
                    return;
                }
            }
        };
        let (job, month) = next;
        let at = (job.name(), month.date());
        let entry = match totals_in_background(&pool, &job, month).await {
            Ok((marker, totals)) => {
                if stores {
                    if let Err(e) =
                        month_facts::store(&pool, job.name(), month.date(), marker, &totals).await
                    {
                        tracing::debug!(job = job.name(), business_date = %month, error = %e, "cannot keep a month's counted facts");
                    }
                }
                KeptTotals::Ready { marker, totals }
            }
            Err(e) => {
                tracing::warn!(job = job.name(), business_date = %month, error = %e, "status page: cannot compute a closed month's totals");
                KeptTotals::Failed {
                    retry_at: Instant::now() + RETRY_BACKGROUND_AFTER,
                    why: format!(
                        "the last attempt failed ({e}); tried again after {} s",
                        RETRY_BACKGROUND_AFTER.as_secs()
                    ),
                }
            }
        };
        lock(&kept).totals.insert(at, entry);
    }
}

/// A closed month's marker and facts in one snapshot, on a connection of its own, with a timeout
/// of its own: kept under that marker, they are exactly what it marks.
async fn totals_in_background(
    pool: &PgPool,
    job: &Arc<dyn Registered>,
    month: BusinessDate,
) -> sqlx::Result<(Marker, Vec<Fact>)> {
    let mut tx = pool
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await?;
    set_timeout(&mut tx, BACKGROUND_TIMEOUT).await?;
    let month_attempts = claim::month_attempts(&mut *tx, job.name(), month.date()).await?;
    let mark = job.facts_mark(&mut tx, month).await?;
    let facts = job.facts(&mut tx, month).await?;
    tx.rollback().await?;
    Ok((
        Marker {
            month_attempts,
            mark,
        },
        facts,
    ))
}

/// Never held across an await; a panic while held cannot leave it half-written in a way that
/// matters (at worst a month's totals are computed again).
fn lock(kept: &Mutex<Kept>) -> MutexGuard<'_, Kept> {
    kept.lock().unwrap_or_else(|e| e.into_inner())
}

/// Rows grouped by business date, newest first (the order they come in).
fn by_month(rows: Vec<MonthRunRow>) -> Vec<(NaiveDate, i64, Vec<JobRunRow>)> {
    let mut out: Vec<(NaiveDate, i64, Vec<JobRunRow>)> = Vec::new();
    for row in rows {
        match out.last_mut() {
            Some((date, _, runs)) if *date == row.business_date => runs.push(row.run),
            _ => out.push((row.business_date, row.month_attempts, vec![row.run])),
        }
    }
    out
}

fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// `SET LOCAL statement_timeout` (until the transaction, or the savepoint, ends); at least 1 ms,
/// since 0 would mean no limit.
async fn set_timeout(tx: &mut PgConnection, limit: Duration) -> sqlx::Result<()> {
    let ms = limit.as_millis().clamp(1, i32::MAX as u128);
    sqlx::query("SELECT set_config('statement_timeout', $1, true)")
        .bind(ms.to_string())
        .execute(tx)
        .await?;
    Ok(())
}

/// A read of the database, boxed so [`costly`] can hand it its connection.
type Read<'a, T> = Pin<Box<dyn Future<Output = sqlx::Result<T>> + Send + 'a>>;

/// The job's facts of `month`, as a read [`costly`] runs.
fn facts_of(
    job: &Arc<dyn Registered>,
    month: BusinessDate,
) -> impl for<'a> FnOnce(&'a mut PgConnection) -> Read<'a, Vec<Fact>> {
    let job = job.clone();
    move |c| Box::pin(async move { job.facts(c, month).await })
}

/// Runs one costly read in a savepoint, limited to what is left of the budget. `Ok(Err(why))`
/// when it did not fit or failed: the view goes on without it. `Err` only when the transaction
/// itself is broken.
async fn costly<T>(
    tx: &mut PgConnection,
    (deadline, whole): (Instant, Duration),
    read: impl for<'a> FnOnce(&'a mut PgConnection) -> Read<'a, T>,
) -> Result<Result<T, String>> {
    let budget = left(deadline);
    if budget.is_zero() {
        return Ok(Err(spent(whole)));
    }
    sqlx::query("SAVEPOINT costly").execute(&mut *tx).await?;
    set_timeout(tx, budget).await?;
    match read(&mut *tx).await {
        Ok(value) => {
            sqlx::query("RELEASE SAVEPOINT costly")
                .execute(&mut *tx)
                .await?;
            Ok(Ok(value))
        }
        Err(e) => {
            // Also undoes the SET LOCAL above.
            sqlx::query("ROLLBACK TO SAVEPOINT costly")
                .execute(&mut *tx)
                .await?;
            Ok(Err(if is_timeout(&e) {
                spent(whole)
            } else {
                format!("failed: {e}")
            }))
        }
    }
}

fn spent(budget: Duration) -> String {
    format!(
        "did not fit in this view's {} s of database time",
        budget.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Datelike;

    fn run(shard: i32, status: &str, heartbeat_age_secs: f64) -> JobRunRow {
        JobRunRow {
            shard,
            status: status.into(),
            attempt: 1,
            owner: "o".into(),
            started_at: Utc::now(),
            finished_at: None,
            heartbeat_age_secs,
            started_age_secs: heartbeat_age_secs,
            last_id: None,
            last_id_desc: None,
            scanned: 0,
            updated: 0,
            last_error: None,
            version: None,
        }
    }

    fn month(runs: Vec<Option<JobRunRow>>) -> Month {
        Month {
            business_date: NaiveDate::from_ymd_opt(2026, 10, 31).unwrap(),
            shards: runs
                .into_iter()
                .enumerate()
                .map(|(index, run)| Shard {
                    index: index as u32,
                    run,
                    progress: None,
                    conflict: None,
                })
                .collect(),
            totals: Totals::Computing,
            rule: None,
            rule_text: None,
            unsettled: None,
            correction: None,
            preview: None,
        }
    }

    #[test]
    fn a_month_is_closed_only_when_every_shard_of_the_count_is_success() {
        let mut all = month(vec![
            Some(run(0, "SUCCESS", 1.0)),
            Some(run(1, "SUCCESS", 1.0)),
        ]);
        assert!(
            !all.closed(),
            "not while its unsettled returns are not counted"
        );
        all.unsettled = Some(Waiting {
            late: 0,
            held: 0,
            upkeep: 0,
        });
        assert!(all.closed());
        let one_missing = month(vec![Some(run(0, "SUCCESS", 1.0)), None]);
        assert!(!one_missing.closed());
        assert_eq!(one_missing.in_state(State::Missing), vec![1]);
        let one_failed = month(vec![
            Some(run(0, "FAILED", 1.0)),
            Some(run(1, "SUCCESS", 1.0)),
        ]);
        assert!(!one_failed.closed());
        assert_eq!(one_failed.in_state(State::Failed), vec![0]);
    }

    const WORDS: Words = Words {
        waiting: crate::numbers::Phrase::new(
            "late return or edit waiting",
            "late returns or edits waiting",
        ),
        held: crate::numbers::Phrase::new("row held (bad dates)", "rows held (bad dates)"),
        upkeep: crate::numbers::Phrase::new(
            "settled loan without a journal entry",
            "settled loans without a journal entry",
        ),
        waiting_key: "late_returns",
        written: crate::numbers::Phrase::new("row updated", "rows updated"),
        facts_are: "settled",
        run_does: "settles",
        pinned: Some("rule"),
    };

    fn a_pause() -> Pause {
        Pause {
            job_name: "fine-settlement".into(),
            paused_by: "ops@bastion (settlementd pause)".into(),
            paused_at: Utc::now(),
            reason: "audit".into(),
        }
    }

    #[test]
    fn a_month_with_late_returns_waiting_is_not_closed_one_with_rows_held_is_held_and_each_says_what_resolves_it(
    ) {
        let mut month = month(vec![Some(run(0, "SUCCESS", 1.0))]);
        let counted = |late, held| Waiting {
            late,
            held,
            upkeep: 0,
        };
        month.unsettled = Some(counted(2, 0));
        assert!(month.all_success() && !month.closed());
        assert_eq!(month.late_returns(), 2);
        let verdict = month.verdict(WORDS, None, chrono_tz::UTC, None);
        assert_eq!(verdict.words, "not closed: 2 late returns or edits waiting");
        assert!(verdict.next.unwrap().contains("within a heartbeat"));
        month.unsettled = Some(counted(0, 3));
        assert!(!month.closed(), "held rows are not done");
        assert_eq!(month.held(), 3);
        let verdict = month.verdict(WORDS, None, chrono_tz::UTC, None);
        assert_eq!(verdict.state, MonthState::Held);
        assert_eq!(verdict.words, "held: 3 rows held (bad dates)");
        assert!(verdict.next.unwrap().contains("settlementd verify"));
        month.unsettled = Some(counted(1, 3));
        let verdict = month.verdict(WORDS, None, chrono_tz::UTC, None);
        assert_eq!(
            verdict.state,
            MonthState::Open,
            "waiting items keep it open"
        );
        assert_eq!(
            verdict.words,
            "not closed: 1 late return or edit waiting; 3 rows held (bad dates)"
        );
        month.unsettled = None;
        let verdict = month.verdict(WORDS, None, chrono_tz::UTC, None);
        assert_eq!(
            (verdict.state, verdict.words.as_str()),
            (
                MonthState::Unknown,
                "unknown: every shard SUCCESS; late returns or edits waiting not counted"
            ),
            "not counted is no verdict"
        );
        month.unsettled = Some(counted(0, 0));
        assert_eq!(
            month.verdict(WORDS, Some(&a_pause()), chrono_tz::UTC, None),
            Verdict {
                closed: true,
                state: MonthState::Closed,
                words: "closed".into(),
                next: None
            },
            "a closed month of a paused job is closed"
        );
    }

    #[test]
    fn what_waits_behind_a_pause_or_a_rule_conflict_is_never_said_to_run_within_a_heartbeat() {
        let mut month = month(vec![Some(run(0, "SUCCESS", 1.0)), None]);
        month.unsettled = Some(Waiting {
            late: 1,
            held: 0,
            upkeep: 0,
        });
        let paused = month.verdict(WORDS, Some(&a_pause()), chrono_tz::UTC, None);
        assert!(!paused.closed);
        let next = paused.next.unwrap();
        assert!(
            next.contains("paused") && next.contains("settlementd resume"),
            "{next}"
        );
        assert!(!next.contains("heartbeat"), "{next}");
        month.shards[1].run = Some(run(1, "SUCCESS", 1.0));
        month.shards[1].conflict = Some("pinned to 50 cents a day".into());
        assert!(!month.closed(), "a refused shard is not done");
        let refused = month.verdict(WORDS, None, chrono_tz::UTC, None);
        assert_eq!(
            refused.words,
            "not closed: shard 1 refused (rule conflict); 1 late return or edit waiting"
        );
        let next = refused.next.unwrap();
        assert!(
            next.contains("settlementd correct") && !next.contains("heartbeat"),
            "{next}"
        );
    }

    #[test]
    fn what_waits_on_a_shard_no_live_replica_runs_is_never_said_to_run_within_a_heartbeat() {
        let mut month = month(vec![
            Some(run(0, "SUCCESS", 1.0)),
            Some(run(1, "FAILED", 1.0)),
            None,
        ]);
        month.unsettled = None;
        let next = |m: &Month, takers: Option<&[u32]>| {
            let takers: Option<std::collections::BTreeSet<u32>> =
                takers.map(|t| t.iter().copied().collect());
            let runners = takers.as_ref().map(|takers| Runners {
                takers,
                lease_ttl_secs: 60,
            });
            m.verdict(WORDS, None, chrono_tz::UTC, runners)
                .next
                .unwrap()
        };
        let said = next(&month, Some(&[0]));
        assert!(
            said.contains("no live replica runs shards 1, 2: start one")
                && !said.contains("within a heartbeat"),
            "{said}"
        );
        assert!(next(&month, Some(&[0, 1])).contains("no live replica runs shard 2: start"));
        for known in [Some(&[1, 2][..]), None] {
            assert!(
                next(&month, known)
                    .contains("a replica of each shard runs what waits within a heartbeat"),
                "shard 0 is SUCCESS, and an unknown fleet is not said to be missing"
            );
        }
        // Items waiting: any shard may hold them, so every shard needs a replica.
        month.shards[1].run = Some(run(1, "SUCCESS", 1.0));
        month.shards[2].run = Some(run(2, "SUCCESS", 1.0));
        month.unsettled = Some(Waiting {
            late: 4,
            held: 0,
            upkeep: 0,
        });
        assert!(next(&month, Some(&[1, 2])).contains("no live replica runs shard 0: start"));
        // A RUNNING claim within its lease is run by its holder, whatever reports in the fleet;
        // one whose lease expired is nobody's.
        month.unsettled = None;
        month.shards[0].run = Some(run(0, "RUNNING", 10.0));
        assert!(next(&month, Some(&[])).contains("within a heartbeat"));
        month.shards[0].run = Some(run(0, "RUNNING", 61.0));
        assert!(next(&month, Some(&[])).contains("no live replica runs shard 0: start"));
    }

    #[test]
    fn closed_and_the_verdict_never_disagree() {
        for late in [0, 1] {
            for held in [0, 1] {
                for conflict in [false, true] {
                    for correcting in [false, true] {
                        for status in ["SUCCESS", "RUNNING", "FAILED"] {
                            let mut m = month(vec![Some(run(0, status, 1.0))]);
                            m.unsettled = Some(Waiting {
                                late,
                                held,
                                upkeep: 0,
                            });
                            if conflict {
                                m.shards[0].conflict = Some("other rule".into());
                            }
                            if correcting {
                                m.correction = Some(("K".into(), Utc::now()));
                            }
                            let verdict = m.verdict(WORDS, None, chrono_tz::UTC, None);
                            assert_eq!(verdict.closed, m.closed(), "{verdict:?}");
                            assert_eq!(verdict.words == "closed", m.closed(), "{verdict:?}");
                            assert_eq!(verdict.state, m.state(), "{verdict:?}");
                            assert!(verdict.words.starts_with(m.state().word()), "{verdict:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn only_a_running_claim_older_than_the_lease_has_an_expired_lease() {
        let shard = |status, age| Shard {
            index: 0,
            run: Some(run(0, status, age)),
            progress: None,
            conflict: None,
        };
        assert!(shard("RUNNING", 61.0).lease_expired(60));
        assert!(!shard("RUNNING", 59.0).lease_expired(60));
        assert!(!shard("FAILED", 600.0).lease_expired(60));
        assert!(!shard("SUCCESS", 600.0).lease_expired(60));
    }

    #[test]
    fn progress_is_a_percentage_that_never_passes_100() {
        let percent = |read, total| Progress { read, total }.percent();
        assert_eq!(percent(150, 361), 41);
        assert_eq!(percent(0, 10), 0);
        assert_eq!(percent(12, 10), 100, "rows added to the month meanwhile");
        assert_eq!(percent(0, 0), 100, "nothing to read");
    }

    #[test]
    fn a_view_with_a_slice_stops_counting_after_one_count_that_did_not_fit_and_says_why() {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut page = Counting::new(Some(COUNT_SLICE));
        let until = page.until(deadline).expect("the first count may run");
        assert!(until <= Instant::now() + COUNT_SLICE);
        let why = page.gave_up("timeout".into(), deadline);
        assert!(why.contains("more than 500 ms"), "{why}");
        assert_eq!(page.until(deadline), None, "nothing more is counted");
        assert_eq!(page.why(), why);

        // The budget spent elsewhere is said as such.
        let mut page = Counting::new(Some(Duration::from_millis(100)));
        let spent = Instant::now();
        assert_eq!(page.gave_up(spent_text(), spent), spent_text());

        // Without a slice (`status`), a count that did not fit stops nothing.
        let mut status = Counting::new(None);
        assert_eq!(status.until(deadline), Some(deadline));
        assert_eq!(status.gave_up("timeout".into(), deadline), "timeout");
        assert_eq!(status.until(deadline), Some(deadline));
    }

    fn spent_text() -> String {
        spent(VIEW_BUDGET)
    }

    #[test]
    fn rows_are_grouped_by_month_in_the_order_they_come() {
        let row = |day, shard| MonthRunRow {
            business_date: NaiveDate::from_ymd_opt(2026, 10, day).unwrap(),
            month_attempts: i64::from(day),
            run: run(shard, "SUCCESS", 1.0),
        };
        let grouped = by_month(vec![row(31, 0), row(31, 2), row(30, 1)]);
        let shape: Vec<_> = grouped
            .iter()
            .map(|(d, a, runs)| {
                (
                    d.day(),
                    *a,
                    runs.iter().map(|r| r.shard).collect::<Vec<_>>(),
                )
            })
            .collect();
        assert_eq!(shape, vec![(31, 31, vec![0, 2]), (30, 30, vec![1])]);
    }
}
