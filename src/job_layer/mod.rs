//! The generic job layer: claim, lease, fencing. It knows nothing of loans.
//!
//! A run of a job is identified by a [`JobKey`] (job, business date, shard count, shard) and owns
//! one `job_runs` row while it works. Invariants:
//! - at most one live claim per key: `INSERT … ON CONFLICT DO NOTHING`, else a takeover that only
//!   succeeds on FAILED rows, RUNNING rows whose heartbeat is older than the lease (database clock),
//!   or — with `force` — SUCCESS rows; every takeover bumps `attempt`;
//! - every write of a run (batch, progress, success, failure) is fenced by `attempt` in the same
//!   transaction; zero rows affected means the claim was lost and nothing is written;
//! - SUCCESS blocks re-runs unless forced, or unless the job reports items of the key that arrived
//!   after it was done ([`Job::late_items`]): then the key is re-opened for them, a new fenced
//!   attempt like any other;
//! - a period (job, business date) is computed under one set of identifying parameters, pinned by
//!   its first claim and compared by every later one ([`params`]); a period being corrected is
//!   held by its correction, whose claims alone it admits;
//! - what is due is decided by the data, not by `job_runs` alone: a job reports the items of each
//!   period that wait for a run whatever its claims say ([`Job::pending`]), and [`due`] combines
//!   them with the periods started (pinned) but not SUCCESS under the current shard count.
//!
//! A [`Job`] supplies the work one batch at a time; [`runner::run_once`] drives it.

pub mod claim;
pub mod dry;
pub mod due;
pub mod events;
pub mod fleet;
pub mod lease;
pub mod month_facts;
pub mod params;
pub mod pause;
pub mod registry;
pub mod requests;
pub mod retention;
pub mod runner;
pub mod server;

pub use crate::calendar::BusinessDate;
use chrono::NaiveDate;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};
use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::time::Duration;

pub use crate::numbers::Phrase;

pub use claim::{Claim, ClaimOutcome};
pub use params::Params;
pub use runner::{run_once, Progress, RunOptions, RunReport, SkipReason};

/// The idempotency key of one run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JobKey {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub shards: u32,
    pub shard: u32,
}

impl JobKey {
    /// The key's period as a month end, or [`JobError::NotAPeriod`]: the one place a monthly job's
    /// date is checked ([`run_once`], before anything is claimed); jobs then read [`Claim::month`].
    pub fn month(&self) -> Result<BusinessDate> {
        BusinessDate::new(self.business_date).map_err(|e| JobError::NotAPeriod {
            key: self.clone(),
            why: e.to_string(),
        })
    }
}

impl fmt::Display for JobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} shard {}/{}",
            self.job_name, self.business_date, self.shard, self.shards
        )
    }
}

/// Who holds a claim: host (or pod) name plus a per-process id, so two processes on one host
/// (or one pod restarted, where the pid is 1 again) are different owners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner(pub String);

impl Owner {
    pub fn for_process() -> Self {
        let host = std::env::var("POD_NAME")
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| hostname::get().ok().and_then(|h| h.into_string().ok()))
            .unwrap_or_else(|| "unknown-host".into());
        let nonce: u32 = rand::random();
        Self(format!("{host}/{}-{nonce:08x}", std::process::id()))
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A run's committed progress over its key's ids, walked from either end: every item with id up to
/// `last_id`, and every item with id from `last_id_desc` on, is done; what is left lies between.
///
/// Each is its own `job_runs` column, so a walk in one direction never reinterprets the other's
/// cursor: a run resumed by a binary that knows only `last_id` starts below whatever a descending
/// walk left (redoing, never skipping), and a run resumed by this one stays inside both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Cursor {
    /// `job_runs.last_id`: the last id an ascending walk read.
    pub last_id: Option<i64>,
    /// `job_runs.last_id_desc`: the last id a descending walk read.
    pub last_id_desc: Option<i64>,
}

impl Cursor {
    /// The ids still to walk (inclusive bounds); `None` when the two ends have met.
    pub fn remaining(&self) -> Option<(i64, i64)> {
        let low = match self.last_id {
            None => i64::MIN,
            Some(id) => id.checked_add(1)?,
        };
        let high = match self.last_id_desc {
            None => i64::MAX,
            Some(id) => id.checked_sub(1)?,
        };
        (low <= high).then_some((low, high))
    }

    /// True when no walk has committed anything.
    pub fn is_start(&self) -> bool {
        self.last_id.is_none() && self.last_id_desc.is_none()
    }
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.last_id, self.last_id_desc) {
            (None, None) => f.write_str("from the start"),
            (Some(after), None) => write!(f, "after id {after}"),
            (None, Some(before)) => write!(f, "before id {before}"),
            (Some(after), Some(before)) => write!(f, "between ids {after} and {before}"),
        }
    }
}

/// A run's work planned up front as a list of items by id, in id order (the member statements:
/// each member's statement), walked a page per batch: what every such job's `run_batch` pages,
/// written once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned<T> {
    items: Vec<(i64, T)>,
}

/// One batch's page of a [`Planned`] list.
#[derive(Debug, PartialEq, Eq)]
pub struct PlannedPage<'a, T> {
    /// The items of this batch, in id order.
    pub items: &'a [(i64, T)],
    /// No items after these: the batch ends the run.
    pub done: bool,
}

impl<T> Planned<T> {
    /// The items, put in id order (an id given twice keeps its first item).
    pub fn new(mut items: Vec<(i64, T)>) -> Self {
        items.sort_by_key(|(id, _)| *id);
        items.dedup_by_key(|(id, _)| *id);
        Self { items }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The next at most `limit` items (at least 1) inside `cursor.remaining()`, ascending.
    pub fn page(&self, cursor: Cursor, limit: u32) -> PlannedPage<'_, T> {
        let Some((low, high)) = cursor.remaining() else {
            return PlannedPage {
                items: &[],
                done: true,
            };
        };
        let start = self.items.partition_point(|(id, _)| *id < low);
        let end = self.items.partition_point(|(id, _)| *id <= high);
        let stop = end.min(start + limit.max(1) as usize);
        PlannedPage {
            items: &self.items[start..stop],
            done: stop >= end,
        }
    }
}

impl<T> PlannedPage<'_, T> {
    /// `cursor` moved past this page (unchanged when it is empty).
    pub fn cursor(&self, cursor: Cursor) -> Cursor {
        match self.items.last() {
            Some((last, _)) => Cursor {
                last_id: Some(*last),
                ..cursor
            },
            None => cursor,
        }
    }

    /// The batch that did this page, from `cursor`: it read the page's items, `written` of them
    /// changed, and it ends the run when the page is the last.
    pub fn batch(&self, cursor: Cursor, written: u64) -> Batch {
        Batch {
            cursor: self.cursor(cursor),
            scanned: self.items.len() as u64,
            updated: written,
            done: self.done,
            ..Batch::default()
        }
    }
}

impl<'a, T> PlannedPage<'a, Option<T>> {
    /// The page's items as a job writes them ([`split`]): those with a value, and the ids of
    /// those without (whose row the job deletes).
    pub fn split(&self) -> (Vec<(i64, &'a T)>, Vec<i64>) {
        split(self.items)
    }
}

/// Planned items as a job writes them: the items with a value (to upsert), and the ids of those
/// with none (a row to delete: the item has nothing left), each in the order given.
pub fn split<'a, T: 'a>(
    items: impl IntoIterator<Item = &'a (i64, Option<T>)>,
) -> (Vec<(i64, &'a T)>, Vec<i64>) {
    let mut kept = Vec::new();
    let mut dropped = Vec::new();
    for (id, item) in items {
        match item {
            Some(item) => kept.push((*id, item)),
            None => dropped.push(*id),
        }
    }
    (kept, dropped)
}

/// A sum of cents read as PostgreSQL's `numeric` text (`sum(bigint)` outgrows an `i64`): what a
/// job's facts, proofs and previews read their money sums as.
pub fn parse_sum(text: &str) -> sqlx::Result<i128> {
    text.parse()
        .map_err(|e| sqlx::Error::Protocol(format!("a sum of cents {text:?}: {e}")))
}

/// How many items a note names by id: enough to find the rest.
pub const HELD_IDS: usize = 20;

/// A count a job keeps of its own over a run (the fine settlement: loans with contradictory dates,
/// loans held because the rule cannot price them), and, when the job names them, the first
/// [`HELD_IDS`] ids. The job layer sums them and reports them; what they mean is the job's
/// ([`Job::note_events`], [`Job::explain`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Noted {
    pub count: u64,
    /// `None`: the job does not name these items.
    pub ids: Option<Vec<i64>>,
}

/// Items a job's proof found in one kind of trouble ([`Job::prove`]): how many, and the first
/// [`HELD_IDS`] by id.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Found {
    pub count: i64,
    pub ids: Vec<i64>,
}

impl Found {
    pub fn new(count: i64, ids: Option<Vec<i64>>) -> Self {
        Self {
            count,
            ids: ids.unwrap_or_default(),
        }
    }
}

/// What a job's proof of a period found ([`Job::prove`]), as `verify --job` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Proof {
    /// The period is what the job's ground truth says it must be.
    pub right: bool,
    /// What is wrong, in one line; `None` when right.
    pub problems: Option<String>,
    /// Not right only because of items the job holds (it cannot process them as they are: the
    /// settlement's loans its rule cannot price, left unsettled): everything it wrote, the money,
    /// is right. `verify` exits 6 for it rather than 1, so a nightly check tells data to fix from
    /// wrong money ([`Report::into_proof_holding`]).
    pub held_only: bool,
    /// The `verify --json` object: `job`, `business_date`, `right`, `money_right` (right, or not
    /// right only because of held items), then the job's own counts (each `{count, ids}` or
    /// `{count, first}`, as the settlement's).
    pub json: serde_json::Value,
    /// What `verify` prints without `--json` (lines end with a newline).
    pub text: String,
}

/// A job's typed proof of a period (the settlement's `Verification`, the statements'
/// `StatementsProof`): what a [`Proof`] is made of. Right is derived: nothing wrong to say.
pub trait Report: Sized {
    /// What is wrong, in one line; `None` when the period is right.
    fn problems(&self) -> Option<String>;
    /// The `verify --json` object: `job`, `business_date`, `right`, then the job's own keys.
    fn to_json(&self) -> serde_json::Value;
    /// What `verify` prints without `--json` (lines end with a newline).
    fn to_text(&self) -> String;

    /// The proof as `verify` shows it.
    fn into_proof(self) -> Proof {
        let problems = self.problems();
        Proof::new(problems, false, self.to_json(), self.to_text())
    }

    /// The proof, the items the job holds set apart by `without_held` (this report, none held):
    /// when that one is right, what is wrong is only what is held ([`Proof::held_only`]).
    fn into_proof_holding(self, without_held: impl FnOnce(&Self) -> Self) -> Proof {
        let held_only = without_held(&self).problems().is_none();
        Proof::new(self.problems(), held_only, self.to_json(), self.to_text())
    }
}

/// One kind of trouble a proof looks for ([`Proof::of_findings`]): its key in `verify --json`,
/// what its items are in words, in one and many ("shard whose totals differ from the loans"),
/// and what was found.
#[derive(Debug, Clone)]
pub struct Finding {
    pub key: &'static str,
    pub what: Phrase,
    pub found: Found,
}

impl Proof {
    /// The proof of what `problems` says (`None`: right), with `money_right` in `json`.
    fn new(
        problems: Option<String>,
        held_only: bool,
        mut json: serde_json::Value,
        text: String,
    ) -> Self {
        let right = problems.is_none();
        let held_only = held_only && !right;
        if let Some(object) = json.as_object_mut() {
            object.insert("money_right".into(), (right || held_only).into());
        }
        Proof {
            right,
            problems,
            held_only,
            json,
            text,
        }
    }

    /// The proof of `job`'s period `business_date` from what it looked for: right when nothing
    /// was found; its problems one line of what was found, its JSON `job`, `business_date`,
    /// `right` and each finding's `{count, ids}` under its key, its text the verdict and each
    /// finding with its first ids.
    pub fn of_findings(job: &str, business_date: BusinessDate, findings: &[Finding]) -> Self {
        let found: Vec<&Finding> = findings.iter().filter(|f| f.found.count > 0).collect();
        let problems = found
            .iter()
            .map(|f| format!("{}, ids {:?}", f.what.count(f.found.count), f.found.ids))
            .collect::<Vec<_>>();
        let right = problems.is_empty();
        let mut json = serde_json::json!({
            "job": job,
            "business_date": business_date.to_string(),
            "right": right,
        });
        let mut text = format!(
            "{job} {business_date}: {}\n",
            if right { "right" } else { "NOT RIGHT" }
        );
        for f in findings {
            json[f.key] = serde_json::to_value(&f.found).unwrap_or_default();
            text.push_str(&format!("{}: {}\n", f.what, f.found.count));
            if !f.found.ids.is_empty() {
                text.push_str(&format!("  ids {:?}\n", f.found.ids));
            }
        }
        Proof::new((!right).then(|| problems.join("; ")), false, json, text)
    }
}

/// Why a job could not prove a period ([`Job::prove`]).
#[derive(Debug, thiserror::Error)]
pub enum ProveError {
    /// The period cannot be proved as asked, in words (`verify` exits 2): the fine settlement's
    /// month is pinned to a rule this version cannot read, or has no pin and no configured rule.
    #[error("{0}")]
    Cannot(String),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// What a run of a period would write, for a dry run ([`Job::preview`], [`dry`]).
#[derive(Debug, Clone, Default)]
pub struct Preview {
    /// By shard.
    pub shards: std::collections::BTreeMap<u32, ShardPreview>,
    /// The period's own keys of the dry run's JSON (the fine settlement: the members whose fines
    /// change) and its lines in words.
    pub json: serde_json::Map<String, serde_json::Value>,
    pub text: String,
}

/// What a run of one shard would write.
#[derive(Debug, Clone, Default)]
pub struct ShardPreview {
    /// Items it would write.
    pub writes: u64,
    /// The first items it would leave for an operator, each with why (the fine settlement: held
    /// loans and their due dates).
    pub held: Vec<(i64, String)>,
    /// Its keys in the shard's object of the dry run's JSON, and its lines in words.
    pub json: serde_json::Map<String, serde_json::Value>,
    pub text: String,
}

/// A run's notes, by the name the job gives them (also their key in `run --json`).
pub type Notes = std::collections::BTreeMap<&'static str, Noted>;

/// Adds `more` to `notes`, keeping at most [`HELD_IDS`] ids per note.
pub fn add_notes(notes: &mut Notes, more: &Notes) {
    for (name, noted) in more {
        let total = notes.entry(name).or_default();
        total.count += noted.count;
        if let Some(ids) = &noted.ids {
            let kept = total.ids.get_or_insert_with(Vec::new);
            let room = HELD_IDS.saturating_sub(kept.len());
            kept.extend(ids.iter().take(room));
        }
    }
}

/// What one committed batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// The run's cursor after this batch (unchanged when nothing was read).
    pub cursor: Cursor,
    /// Items read.
    pub scanned: u64,
    /// Items written.
    pub updated: u64,
    /// What the job's amount counter counts of this batch ([`Metrics::amount`]; the fine
    /// settlement: the fine cents it wrote), 0 for a job that declares none.
    pub amount: u64,
    /// The job's own counts of this batch ([`Noted`]).
    pub notes: Notes,
    /// No more work after this batch.
    pub done: bool,
}

impl Batch {
    /// The batch that finds nothing left to do: it reads nothing and ends the run.
    pub fn nothing_left(cursor: Cursor) -> Self {
        Batch {
            cursor,
            done: true,
            ..Batch::default()
        }
    }
}

/// What a job's items and runs are called, and the JSON keys that name them ([`Job::words`]):
/// every word a surface shows of one job is its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Words {
    /// Items waiting for a run in a period that is SUCCESS ("late return or edit waiting").
    pub waiting: Phrase,
    /// The key of their count in `run --json` and `status --json` ("late_returns").
    pub waiting_key: &'static str,
    /// Items left for an operator ("row held (bad dates)").
    pub held: Phrase,
    /// Items the job's upkeep does ([`Pending::upkeep`]).
    pub upkeep: Phrase,
    /// What a run's writes are, counted on the page: "1,604 rows updated by attempt 1".
    pub written: Phrase,
    /// What a period's facts are, on the page ("settled"; "so far" is added while it is open).
    pub facts_are: &'static str,
    /// What a run does to its period, before the period in `schedule` and on the page
    /// ("settles" 2026-12-31).
    pub run_does: &'static str,
    /// What the parameters a first claim pins are called in `status`, `run` and on the page
    /// ("rule"), and their key in `run --json` and `status --json` (with `_conflict` after it, a
    /// shard's refused claim); `None` for a job whose parameters decide nothing an operator reads
    /// (they are still pinned and compared): no such line, column or key is shown.
    pub pinned: Option<&'static str>,
}

/// Neutral words: "items waiting", "items held", "items written", a run "runs" its month, and no
/// pinned parameters. A job names what it changes (`..Words::default()` for the rest).
impl Default for Words {
    fn default() -> Self {
        Words {
            waiting: Phrase::new("item waiting", "items waiting"),
            waiting_key: "waiting",
            held: Phrase::new("item held", "items held"),
            upkeep: Phrase::new("item of upkeep waiting", "items of upkeep waiting"),
            written: Phrase::new("item written", "items written"),
            facts_are: "done",
            run_does: "runs",
            pinned: None,
        }
    }
}

/// A metric family a job declares: its name and its help line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metric {
    pub name: &'static str,
    pub help: &'static str,
}

/// The metrics a job's runs and items are counted under ([`Job::metrics`]). A family left `None`
/// is one the job has no items for: `/metrics` shows no such series for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Metrics {
    /// What its batches read and write, in the help of `settlementd_rows_scanned_total` and
    /// `settlementd_rows_updated_total` ("loans").
    pub items: &'static str,
    /// The `outcome` of a run that ended in SUCCESS, in `settlementd_runs_total` and
    /// `settlementd_request_runs_total` ("settled").
    pub succeeded: &'static str,
    /// Claims refused because the period is pinned to other parameters (a counter), and the
    /// `outcome` such a run has in `settlementd_runs_total`. `None`: such a run counts as
    /// `failed`.
    pub conflicts: Option<(Metric, &'static str)>,
    /// Items done by runs that re-opened a done period (a counter).
    pub late_done: Option<Metric>,
    /// Items waiting in this shard's done periods inside the lookback (a gauge).
    pub waiting: Option<Metric>,
    /// Items of this shard's done periods left for an operator (a gauge).
    pub held: Option<Metric>,
    /// Items waiting in periods before the lookback, every shard (a gauge).
    pub beyond_lookback: Option<Metric>,
    /// What its committed batches amount to ([`Batch::amount`]), a counter labelled with the
    /// period's `business_date` besides `job_name`.
    pub amount: Option<Metric>,
    /// Also exports `settlementd_latest_fire_shards_not_success` under its old name,
    /// `settlementd_latest_month_unsettled_shards` (deprecated: the fine settlement's, kept for
    /// dashboards that read it).
    pub old_unsettled_shards: bool,
}

impl Metrics {
    /// The counters of its items it declares (refused claims, late items done, the amount).
    pub fn counters(&self) -> impl Iterator<Item = Metric> {
        [
            self.conflicts.map(|(counter, _)| counter),
            self.late_done,
            self.amount,
        ]
        .into_iter()
        .flatten()
    }

    /// The gauges of its items it declares (waiting, held, before the lookback).
    pub fn gauges(&self) -> impl Iterator<Item = Metric> {
        [self.waiting, self.held, self.beyond_lookback]
            .into_iter()
            .flatten()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            items: "items",
            succeeded: "succeeded",
            conflicts: None,
            late_done: None,
            waiting: None,
            held: None,
            beyond_lookback: None,
            amount: None,
            old_unsettled_shards: false,
        }
    }
}

/// A fact a job reports about one period, for `status` and the status page (the fine settlement:
/// settled rows, fine sum, digest).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Fact {
    /// Its key in `status --json` and in `status`'s text.
    pub name: Cow<'static, str>,
    /// What the page calls it ("rows", "fines", "digest").
    pub label: Cow<'static, str>,
    pub kind: FactKind,
    pub value: serde_json::Value,
}

impl Fact {
    /// A number of things: `name` (its key), `label` (what the page calls it), how many.
    pub fn count(name: &'static str, label: &'static str, count: i64) -> Self {
        Self {
            name: name.into(),
            label: label.into(),
            kind: FactKind::Count,
            value: count.into(),
        }
    }

    /// A sum of cents, shown as money (an `i128`: sums of `bigint` cents do not fit an `i64`).
    pub fn cents(name: &'static str, label: &'static str, cents: i128) -> Self {
        Self {
            name: name.into(),
            label: label.into(),
            kind: FactKind::Cents,
            // Cents beyond what JSON numbers hold exactly are written as serde_json writes i128.
            value: serde_json::to_value(cents).unwrap_or_default(),
        }
    }

    /// A fingerprint of the period's output.
    pub fn digest(name: &'static str, label: &'static str, digest: String) -> Self {
        Self {
            name: name.into(),
            label: label.into(),
            kind: FactKind::Digest,
            value: digest.into(),
        }
    }
}

/// How a fact reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum FactKind {
    /// A number of things: "1,081 rows".
    Count,
    /// Cents, shown as money: "fines 9,186.50".
    Cents,
    /// A fingerprint: "digest f7590c92f0be…".
    Digest,
}

/// Items of one period and shard that wait for a run whatever `job_runs` says: for the fine
/// settlement, returns not settled yet and edits of settled loans ([`Job::pending`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    pub business_date: NaiveDate,
    /// The shard of the shard count asked for.
    pub shard: u32,
    /// Items a run of the period's shard would do.
    pub late: u64,
    /// Items left as they are for an operator (the fine settlement: held rows, its `held` note).
    pub held: u64,
    /// Items the job's upkeep does on every replica's tick, outside any run (the fine settlement:
    /// settled loans without a journal entry, given their opening entry): not closed until done.
    pub upkeep: u64,
}

/// What [`Job::pending`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingReport {
    /// The periods asked for that have pending items, and periods outside them that the job tracks
    /// by itself (edits queued for a month of any age), by shard.
    pub by_period: Vec<Pending>,
    /// Items a run would do in periods before the first one asked for, every shard: what the
    /// lookback leaves behind.
    pub before: u64,
}

/// Why a done key is opened again: the audit event the re-opening claim writes, and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reopen {
    pub event: &'static str,
    pub message: String,
}

/// A unit of work the job layer can run idempotently, one batch per transaction.
pub trait Job: Sync {
    /// Per-run state computed once after the claim (bounds, parameters).
    type Plan: Send + Sync;

    /// The job's name, written once: its `job_runs` rows, its configuration section (`-` written
    /// `_`), its `job_name` label, `--job`.
    const NAME: &'static str;

    /// Whether its periods are months: its keys' business dates are month ends, checked before
    /// anything is claimed ([`JobError::NotAPeriod`]), and [`Claim::month`] is the key's. Default:
    /// true (the job layer's own retention is daily).
    const MONTHLY: bool = true;

    /// The job whose periods this one follows: a period runs only once that job's period is SUCCESS
    /// on every shard of the shard count, no correction holds it and, run from the registry,
    /// nothing of that job waits in it ([`runner::run_following`] checks; [`JobError::NotReady`]
    /// otherwise). Default: none.
    fn after(&self) -> Option<&'static str> {
        None
    }

    /// The parameters that decide what a run of `key` computes (for the fine settlement: the
    /// month's fine rule), pinned by the first claim of the key's period and compared by every
    /// later one ([`params`]). `Err` says why the job has none for this key (a configuration that
    /// does not cover it): nothing is claimed. Default: none ([`Params::none`]: nothing pinned).
    fn params(&self, _key: &JobKey) -> std::result::Result<Params, String> {
        Ok(Params::none())
    }

    /// `params` in words, for errors and the audit trail.
    fn describe(&self, params: &Params) -> String {
        params.0.to_string()
    }

    /// How many items of `key` are left to do although its claim is SUCCESS: items that arrived
    /// after the key was done (for the fine settlement: late returns). A claim that finds the key
    /// SUCCESS asks, and re-opens the key as a new attempt when there are some. Default: none.
    fn late_items(
        &self,
        _pool: &PgPool,
        _key: &JobKey,
    ) -> impl Future<Output = sqlx::Result<u64>> + Send {
        async { Ok(0) }
    }

    /// The audit event and message of a claim that re-opens a done key for `late` late items.
    fn reopen(&self, late: u64) -> Reopen {
        Reopen {
            event: "reopened",
            message: format!("{late} items arrived after SUCCESS"),
        }
    }

    /// The notes of a run that did nothing: every note the job reports, at zero, so that a report
    /// has the same keys whatever the run did (`run --json`). Default: none.
    fn empty_notes(&self) -> Notes {
        Notes::new()
    }

    /// The audit events a SUCCESS writes for the run's notes (the fine settlement: `held_rows`,
    /// naming the loans the rule cannot price); each is also logged as a warning. Default: none.
    fn note_events(&self, _notes: &Notes) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// A note in words, for a run's one-line summary. Default: "N name".
    fn explain(&self, name: &str, noted: &Noted) -> String {
        format!("{} {name}", noted.count)
    }

    /// Work a replica does between runs that needs no claim because it changes nothing a run
    /// computes (the fine settlement: opening journal entries of loans settled before the
    /// journal), for at most until `until`; returns how many items it did. Default: none.
    fn upkeep(
        &self,
        _pool: &PgPool,
        _until: std::time::Instant,
    ) -> impl Future<Output = sqlx::Result<u64>> + Send {
        async { Ok(0) }
    }

    /// How many items the run of `key` still has to read after `cursor` (its committed progress),
    /// for a running shard's progress bar; `None` when the job cannot tell. Default: `None`.
    fn remaining(
        &self,
        _db: &mut PgConnection,
        _key: &JobKey,
        _cursor: Cursor,
    ) -> impl Future<Output = sqlx::Result<Option<u64>>> + Send {
        async { Ok(None) }
    }

    /// Declares the job's own metrics (present, at 0, before its first run), labelled `job_name`.
    /// Default: none.
    fn describe_metrics(&self) {}

    /// The names its runs and items are counted under by the job layer and the daemon (see
    /// [`Metrics`]). Default: runs `succeeded`, and no families of items.
    fn metrics(&self) -> Metrics {
        Metrics::default()
    }

    /// Every word a surface shows of the job, and its JSON keys ([`Words`]). Default:
    /// [`Words::default`], neutral.
    fn words(&self) -> Words {
        Words::default()
    }

    /// What the job reports about a period for `status` and the status page (the fine
    /// settlement: its settled rows, fine sum and digest). Default: nothing.
    fn facts(
        &self,
        _db: &mut PgConnection,
        _month: BusinessDate,
    ) -> impl Future<Output = sqlx::Result<Vec<Fact>>> + Send {
        async { Ok(Vec::new()) }
    }

    /// Where what [`Job::facts`] counts of `month` stands, beyond its attempts: a number that
    /// moves whenever the facts may change without a new attempt of the month (the fine
    /// settlement: the month's last journal row, which libraryd's deletions move too). The month's
    /// kept facts ([`month_facts`]) are counted again when it or the month's attempts moved. One
    /// index probe. `None`: the attempts alone tell (the default).
    fn facts_mark(
        &self,
        _db: &mut PgConnection,
        _month: BusinessDate,
    ) -> impl Future<Output = sqlx::Result<Option<i64>>> + Send {
        async { Ok(None) }
    }

    /// Proves the period `month` against the job's ground truth, read-only (in a snapshot of
    /// its own, on connections of `pool`), at a cost that follows the period (`verify`, `verify
    /// --job`). `None`: the job has no proof. Default: none.
    fn prove(
        &self,
        _pool: &PgPool,
        _month: BusinessDate,
    ) -> impl Future<Output = std::result::Result<Option<Proof>, ProveError>> + Send {
        async { Ok(None) }
    }

    /// What runs of `month` for `shards` of `count` would write, read on `db` (the dry
    /// run's read-only snapshot: [`dry`]) and written nowhere, at no more than a run's cost.
    /// `None`: the job cannot tell. Default: `None`.
    fn preview(
        &self,
        _db: &mut PgConnection,
        _month: BusinessDate,
        _count: u32,
        _shards: &[u32],
    ) -> impl Future<Output = sqlx::Result<Option<Preview>>> + Send {
        async { Ok(None) }
    }

    /// The items waiting in each of `periods` (business dates, oldest first) under `shards`, by
    /// shard, whatever `job_runs` says of them, and what waits before the first of them
    /// ([`PendingReport`]). The scheduler runs a period of its shard that has some, the status
    /// page and the gauges count them. On `db`, inside whatever transaction it is in (the status
    /// page's snapshot, under its statement timeout): settings the job sets are undone before it
    /// returns. Default: nothing ever waits outside a run.
    fn pending(
        &self,
        _db: &mut PgConnection,
        _shards: u32,
        _periods: &[NaiveDate],
    ) -> impl Future<Output = sqlx::Result<PendingReport>> + Send {
        async { Ok(PendingReport::default()) }
    }

    /// Prepares the run of `claim` (its key, its attempt, and `claim.resume`, the committed
    /// progress of earlier attempts). With `estimate`, also returns how many items remain, for
    /// progress display only.
    fn plan(
        &self,
        pool: &PgPool,
        claim: &Claim,
        estimate: bool,
    ) -> impl Future<Output = sqlx::Result<(Self::Plan, Option<u64>)>> + Send;

    /// `SET LOCAL` settings the job's batch statements rely on (plan settings), sent with the
    /// `BEGIN` of each batch transaction after the lease's guards, which the runner sets for every
    /// job ([`lease::Guards`]). Default: none.
    fn batch_settings(&self) -> Cow<'static, str> {
        Cow::Borrowed("")
    }

    /// Does one batch inside the caller's transaction, from `cursor` (the run's progress so far),
    /// and returns the cursor moved past it. Must be idempotent in effect: items already done
    /// count as scanned but not updated, and nothing outside `cursor.remaining()` is touched.
    fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &Self::Plan,
        cursor: Cursor,
    ) -> impl Future<Output = sqlx::Result<Batch>> + Send;
}

/// Errors of the job layer. [`JobError::is_retryable`] tells a scheduler whether trying the same
/// key again soon can help.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("database error: {}", describe_db_error(.0))]
    Db(sqlx::Error),
    #[error("lease lost: {key} attempt {attempt} was taken over by another owner; stopped without writing")]
    LeaseLost { key: JobKey, attempt: i32 },
    #[error("interrupted: shutdown")]
    Interrupted,
    /// The key's period is pinned to other identifying parameters than this claimer's: it claimed
    /// nothing. Only a configuration that agrees, or a correction that re-pins, ends it.
    #[error(
        "the month's recorded parameters differ from this replica's: {key} is pinned to {pinned}; \
         this replica's is {mine}. Nothing was settled"
    )]
    ParamsConflict {
        key: JobKey,
        pinned: String,
        mine: String,
    },
    /// The key's business date is not a period (a month's last day): nothing was claimed.
    #[error("{key}: not a period: {why}; nothing was run")]
    NotAPeriod { key: JobKey, why: String },
    /// The job has no parameters for the key: its configuration does not cover it.
    #[error("{key}: {why}")]
    NoParams { key: JobKey, why: String },
    /// The period is not ready for this job yet: the job it follows has not closed it, or something
    /// of that job still waits in it. Nothing was claimed or written; a scheduler tries again with
    /// its backoff.
    #[error("{key} is not ready: {why}; nothing was run")]
    NotReady { key: JobKey, why: String },
    /// The job is paused ([`pause`]): nothing new is claimed, and a run in flight stops at its
    /// next batch (marked FAILED `interrupted: paused`, resumed like any interrupted run). `wrote`:
    /// what the run had committed when it stopped (`None`: it claimed nothing).
    #[error(
        "{job} is paused since {} by {by}: {reason}{} (`settlementd resume` lets it go on)",
        crate::schedule::shown(*since),
        wrote.map(|w| w.words()).unwrap_or_else(|| "; nothing was run".to_string())
    )]
    Paused {
        job: String,
        by: String,
        since: chrono::DateTime<chrono::Utc>,
        reason: String,
        wrote: Option<Wrote>,
    },
    /// The key's period is held by an unfinished correction: nothing was claimed. It ends when
    /// that correction completes (running it again with its key finishes it).
    #[error(
        "{key} is being corrected under key {correction:?} since {}: nothing was run; the \
         correction holds the month until it completes (run it again with the same key to finish it)",
        crate::schedule::shown(*since)
    )]
    BeingCorrected {
        key: JobKey,
        correction: String,
        since: chrono::DateTime<chrono::Utc>,
    },
    /// A connection stopped answering: nothing came back within `waited`. For a run's claim,
    /// batches and SUCCESS write that is [`runner::ANSWER_WITHIN_LEASES`] leases, longer than the
    /// server's own guards let a batch run; for a heartbeat renewal, one period. What a half-open
    /// TCP connection does (the server or the network gone without a word); the connection is
    /// closed, never reused.
    #[error(
        "the database did not answer within {waited:?}: the connection is presumed dead (half-open: \
         the server or the network gone without a word) and was closed"
    )]
    Unanswered { waited: Duration },
    /// The pool had no connection to give within its acquire timeout; `reason` is what the server
    /// answered a direct attempt (too many connections, slots reserved, starting up), when it did.
    #[error("no database connection could be had (all in use, or the server unreachable or full){}", reason.as_ref().map(|r| format!(": the server said: {r}")).unwrap_or_default())]
    NoConnection { reason: Option<String> },
    /// The server refused the run's writes or ended its session, as the old primary does during a
    /// failover ([`server::refusal`]), or the pool could hand out no connection because the
    /// endpoint leads to a read-only server. The run ends like a lost lease: the connection is
    /// closed, never returned to the pool, nothing more is written through it, and the claim's
    /// fencing makes the take-over safe (FAILED at once, RUNNING once its lease expires).
    #[error("the database refused the run's writes: {refusal}: {detail}; the run stopped and closed its connection")]
    WritesRefused {
        refusal: server::Refusal,
        /// What the server said, or how the refusal was found.
        detail: String,
    },
}

/// A database error as the job layer reads it: a refusal of writes ([`server::refusal`]) is
/// [`JobError::WritesRefused`], wherever in a run it is met; anything else is [`JobError::Db`].
impl From<sqlx::Error> for JobError {
    fn from(e: sqlx::Error) -> Self {
        match server::refusal(&e) {
            Some(refusal) => JobError::WritesRefused {
                refusal,
                detail: e.to_string(),
            },
            None => JobError::Db(e),
        }
    }
}

/// A connection of `pool`, or why none could be had when the pool gave up waiting (its own error
/// does not say): [`JobError::WritesRefused`] when the endpoint leads to a read-only server (the
/// pool turns its connections away), else [`JobError::NoConnection`] with the server's reason.
pub async fn acquire(pool: &PgPool) -> Result<PoolConnection<Postgres>> {
    match pool.acquire().await {
        Ok(conn) => Ok(conn),
        Err(sqlx::Error::PoolTimedOut) => Err(match server::ask_directly(pool).await {
            server::Direct::ReadOnly => JobError::WritesRefused {
                refusal: server::Refusal::ReadOnly,
                detail: "the pool turned away every connection it made".into(),
            },
            server::Direct::Failed(sqlx::Error::Database(db)) => JobError::NoConnection {
                reason: Some(db.message().to_string()),
            },
            server::Direct::Failed(e) => JobError::NoConnection {
                reason: Some(e.to_string()),
            },
            server::Direct::Writable | server::Direct::Silent => {
                JobError::NoConnection { reason: None }
            }
        }),
        Err(e) => Err(e.into()),
    }
}

/// `work` given `within` to answer: [`JobError::Unanswered`] when nothing came back in time (the
/// run's claim, batches and SUCCESS write, and each heartbeat renewal).
async fn answered<T>(within: Duration, work: impl Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(within, work)
        .await
        .unwrap_or(Err(JobError::Unanswered { waited: within }))
}

/// Closes `conn` instead of returning it to the pool when it stopped answering (the pool would
/// check it first, and on a half-open connection that check never ends) or its server refused
/// writes (a connection to a read-only server is never handed out again).
fn abandon_if_broken(conn: &mut PoolConnection<Postgres>, e: &JobError) {
    if matches!(
        e,
        JobError::Unanswered { .. } | JobError::WritesRefused { .. }
    ) {
        conn.close_on_drop();
    }
}

/// What a run had committed when a pause stopped it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Wrote {
    /// Batches committed by this attempt.
    pub batches: u64,
    /// Items written by them.
    pub updated: u64,
}

impl Wrote {
    fn words(&self) -> String {
        format!(
            "; this run stopped after {} committed {} ({} written), its claim FAILED \
             `interrupted: paused`, to resume where it stopped",
            self.batches,
            if self.batches == 1 {
                "batch"
            } else {
                "batches"
            },
            self.updated
        )
    }
}

impl JobError {
    pub fn is_retryable(&self) -> bool {
        match self {
            JobError::Db(_)
            | JobError::Unanswered { .. }
            | JobError::NoConnection { .. }
            | JobError::WritesRefused { .. } => true,
            // The job it follows closes the period by itself; trying again later can help.
            JobError::NotReady { .. } => true,
            // Waits for an operator's resume.
            JobError::Paused { .. } => false,
            // Someone else owns the key now; the scheduler watches it instead of fighting.
            JobError::LeaseLost { .. } | JobError::Interrupted => false,
            // The same configuration gets the same answer (a scheduler may still look again later:
            // a correction can re-pin the period).
            JobError::ParamsConflict { .. }
            | JobError::NoParams { .. }
            | JobError::NotAPeriod { .. }
            | JobError::BeingCorrected { .. } => false,
        }
    }

    /// True when the database, not the run, failed: it refused writes or ended the session (a
    /// failover, a restart), stopped answering, or gave no connection, or the connection broke. Such
    /// an outage ends on its own time, however often it was met during it, so a scheduler retries
    /// these within a lease rather than after a backoff that grew while it lasted.
    pub fn is_outage(&self) -> bool {
        match self {
            JobError::WritesRefused { .. }
            | JobError::Unanswered { .. }
            | JobError::NoConnection { .. } => true,
            // A connection that broke, in the handshake too (an endpoint that accepts TCP with no
            // server behind it answers nothing that makes sense), or none to be had.
            JobError::Db(
                sqlx::Error::Io(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed,
            ) => true,
            // connection_exception, too_many_connections.
            JobError::Db(sqlx::Error::Database(db)) => {
                let code = db.code().unwrap_or_default();
                code.starts_with("08") || code == "53300"
            }
            _ => false,
        }
    }
}

/// A database error, with what the server's guards and restarts mean in words: those are the
/// errors an operator sees after a pause, a lock wait or a restart, and the SQLSTATE alone says
/// little.
fn describe_db_error(e: &sqlx::Error) -> String {
    let code = match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => {
            return format!(
                "the connection to the database broke or none could be had (server down or \
                 restarting, network cut, or the session ended by the server): {e}"
            )
        }
        _ => None,
    };
    let meaning = match code.as_deref() {
        Some("25P03") => {
            "the server ended the session: it sat idle inside a transaction longer than \
             idle_in_transaction_session_timeout (the process was paused or cut off)"
        }
        Some("55P03") => "a row lock was not granted within lock_timeout",
        Some("57014") => "the statement was cancelled (statement_timeout, or an operator)",
        Some("57P01" | "57P02" | "57P03") => "the database server is shutting down or restarting",
        Some("26000" | "42P05") => {
            "a prepared statement went missing or collided: a pooler in transaction mode \
             (use pool_mode = session)"
        }
        _ => return e.to_string(),
    };
    format!("{meaning}: {e}")
}

pub type Result<T, E = JobError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::{Cursor, JobError};

    #[test]
    fn a_broken_connection_or_none_to_be_had_is_an_outage_and_a_sql_error_is_not() {
        let outages = [
            JobError::Db(sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())),
            JobError::Db(sqlx::Error::Protocol(
                "unexpected response from SSLRequest".into(),
            )),
            JobError::Db(sqlx::Error::PoolTimedOut),
            JobError::NoConnection { reason: None },
            JobError::Unanswered {
                waited: std::time::Duration::from_secs(9),
            },
            JobError::WritesRefused {
                refusal: super::server::Refusal::ReadOnly,
                detail: "25006".into(),
            },
        ];
        for e in outages {
            assert!(e.is_outage() && e.is_retryable(), "{e}");
        }
        assert!(!JobError::Db(sqlx::Error::RowNotFound).is_outage());
        assert!(!JobError::Interrupted.is_outage());
    }

    fn cursor(last_id: Option<i64>, last_id_desc: Option<i64>) -> Cursor {
        Cursor {
            last_id,
            last_id_desc,
        }
    }

    #[test]
    fn a_cursor_leaves_the_ids_between_its_two_ends() {
        assert_eq!(cursor(None, None).remaining(), Some((i64::MIN, i64::MAX)));
        assert_eq!(cursor(Some(10), None).remaining(), Some((11, i64::MAX)));
        assert_eq!(cursor(None, Some(10)).remaining(), Some((i64::MIN, 9)));
        assert_eq!(cursor(Some(10), Some(12)).remaining(), Some((11, 11)));
    }

    #[test]
    fn a_cursor_whose_ends_met_or_reached_the_extreme_ids_leaves_nothing() {
        assert_eq!(cursor(Some(10), Some(11)).remaining(), None);
        assert_eq!(cursor(Some(10), Some(3)).remaining(), None);
        assert_eq!(cursor(Some(i64::MAX), None).remaining(), None);
        assert_eq!(cursor(None, Some(i64::MIN)).remaining(), None);
    }

    #[test]
    fn a_planned_list_is_paged_in_id_order_inside_the_cursor_and_ends_on_its_last_item() {
        let planned = super::Planned::new(vec![(5, 'e'), (1, 'a'), (3, 'c'), (9, 'i')]);
        let first = planned.page(Cursor::default(), 2);
        assert_eq!(
            (first.items, first.done),
            (&[(1, 'a'), (3, 'c')][..], false)
        );
        let at = first.cursor(Cursor::default());
        assert_eq!(at.last_id, Some(3));
        let second = planned.page(at, 2);
        assert_eq!(
            (second.items, second.done),
            (&[(5, 'e'), (9, 'i')][..], true)
        );
        // A descending walk's end bounds it too; a limit of 0 still moves.
        let bounded = planned.page(cursor(Some(1), Some(9)), 0);
        assert_eq!((bounded.items, bounded.done), (&[(3, 'c')][..], false));
        let end = planned.page(cursor(Some(9), None), 5);
        assert_eq!((end.items.len(), end.done), (0, true));
        assert_eq!(end.cursor(cursor(Some(9), None)), cursor(Some(9), None));
    }

    #[test]
    fn a_proof_of_findings_is_right_only_when_nothing_was_found_and_names_what_was() {
        let month = crate::calendar::BusinessDate::parse("2026-10-31").unwrap();
        let finding = |count, ids: Vec<i64>| super::Finding {
            key: "differ",
            what: super::Phrase::new("shard whose totals differ", "shards whose totals differ"),
            found: super::Found { count, ids },
        };
        let right = super::Proof::of_findings("totals", month, &[finding(0, vec![])]);
        assert!(right.right && right.problems.is_none());
        assert_eq!(right.json["differ"]["count"], 0);
        assert_eq!(
            right.text,
            "totals 2026-10-31: right\nshards whose totals differ: 0\n"
        );
        let wrong = super::Proof::of_findings("totals", month, &[finding(2, vec![0, 3])]);
        assert!(!wrong.right);
        assert_eq!(
            wrong.problems.as_deref(),
            Some("2 shards whose totals differ, ids [0, 3]")
        );
        let one = super::Proof::of_findings("totals", month, &[finding(1, vec![3])]);
        assert_eq!(
            one.problems.as_deref(),
            Some("1 shard whose totals differ, ids [3]")
        );
        assert_eq!(
            (
                &wrong.json["job"],
                &wrong.json["business_date"],
                &wrong.json["right"]
            ),
            (&"totals".into(), &"2026-10-31".into(), &false.into())
        );
        assert_eq!(wrong.json["differ"]["ids"], serde_json::json!([0, 3]));
        assert!(wrong.text.contains("NOT RIGHT\n") && wrong.text.contains("  ids [0, 3]\n"));
    }

    #[test]
    fn a_planned_page_splits_into_items_to_write_and_ids_to_delete_and_is_its_batch() {
        let planned = super::Planned::new(vec![(4, None), (2, Some('b')), (7, Some('g'))]);
        let page = planned.page(Cursor::default(), 2);
        assert_eq!(page.split(), (vec![(2, &'b')], vec![4]));
        let batch = page.batch(Cursor::default(), 1);
        assert_eq!(
            (batch.cursor, batch.scanned, batch.updated, batch.done),
            (cursor(Some(4), None), 2, 1, false)
        );
        let last = planned.page(batch.cursor, 2);
        assert_eq!(last.split(), (vec![(7, &'g')], vec![]));
        assert!(last.batch(batch.cursor, 0).done);
    }

    #[test]
    fn a_cursor_says_where_a_run_resumes() {
        assert_eq!(cursor(None, None).to_string(), "from the start");
        assert_eq!(cursor(Some(7), None).to_string(), "after id 7");
        assert_eq!(cursor(None, Some(9)).to_string(), "before id 9");
        assert_eq!(cursor(Some(7), Some(9)).to_string(), "between ids 7 and 9");
    }
}
