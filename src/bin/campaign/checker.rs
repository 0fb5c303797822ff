//! The offline checker: reads the quiesced database raw (loans, the journal, the claims, the
//! audit trail, the requests and the campaign's own logs) into [`Facts`], then judges them in
//! plain Rust, sharing no SQL with the product. Every fine is recomputed here from the month's
//! pinned rule and the loan's final dates ([`fine_of`]).
//!
//! The invariants, one check each:
//! - `open`: nothing RUNNING, no correction unfinished or holding a month, no edit queued;
//! - `keys`: every month SUCCESS on every shard of the final shard count, one `job_runs` row per
//!   key (the key is the table's primary key, so this is a row per month and shard);
//! - `claims`: every attempt of a key won by exactly one claim (one claim event), and made SUCCESS
//!   at most once;
//! - `leases`: a RUNNING claim taken over only once its heartbeat was older than the lease by the
//!   database's clock;
//! - `fences`: every transaction that wrote a loan's fine also wrote its run's fenced progress
//!   (`job_runs` of the same key and attempt, still RUNNING) — and its journal entries;
//! - `transitions`: every write of a fine by settlementd is one step of the loan's journal: a
//!   settlement only from unsettled (never settled twice), a re-pricing or correction of a settled
//!   loan, a reversal to unsettled; nobody else changes a fine; a loan is settled only while it is
//!   returned and its due date can be priced (held rows and loans still out never are);
//! - `journal`: each loan's entries numbered 1, 2, … without a gap, each `before` the previous
//!   `after`, the last one equal to the loan (`fine_seq`, `fine_cents`, settled or not, or gone);
//!   no journal row changed or deleted; every correction's `fine_adjustments` on its journal,
//!   none with old = new;
//! - `fines`: every returned loan of the months that the rule can price settled at the fine its
//!   month's pinned rule gives its final dates; held rows and loans still out unsettled;
//! - `statements`: every member's statement of each month (`member_fine_statements`) is what the
//!   loans say: the member's settled loans returned in the month with a fine above 0, how many
//!   and their sum; no statement for a member without one;
//! - `requests`: every request answered, every answer to one key the same, stored once, each
//!   targeted shard served (one new attempt at most) and not left open;
//! - `verify`: `settlementd verify` right for every month;
//! - `pauses`: while a job is paused (from when the campaign saw the pause committed until its
//!   resume began), no claim of it is won by a transaction that began in that time; and a run in
//!   flight stops at its next heartbeat: after the first heartbeat of its attempt that began
//!   while the job was paused (and so found the pause), at most one batch of it begins (the one
//!   its runner may start while that heartbeat's answer is on its way); no pause is left at the
//!   end;
//! - `exits`: every process's end explained by what the campaign did to it;
//! - `quiesce`: at rest within the bound.

use crate::schedule::Rule;
use crate::world::{month_end, Role, World};
use anyhow::Result;
use chrono::{DateTime, Datelike, NaiveDate, Utc};
use sqlx::PgConnection;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// One broken invariant: which check, and the minimal facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub check: &'static str,
    pub facts: String,
}

fn violation(check: &'static str, facts: impl Into<String>) -> Violation {
    Violation {
        check,
        facts: facts.into(),
    }
}

/// A date column as written: a day, infinite, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Day {
    None,
    On(NaiveDate),
    Infinite,
}

impl Day {
    pub fn parse(text: Option<&str>) -> Day {
        match text {
            None => Day::None,
            Some("infinity") | Some("-infinity") => Day::Infinite,
            Some(t) => t.parse().map_or(Day::Infinite, Day::On),
        }
    }

    fn day(self) -> Option<NaiveDate> {
        match self {
            Day::On(d) => Some(d),
            _ => None,
        }
    }
}

/// A loan as it ends.
#[derive(Debug, Clone)]
pub struct Loan {
    pub id: i64,
    pub member: i64,
    pub due: Day,
    pub returned: Day,
    pub fine: i64,
    pub settled: bool,
    pub seq: Option<i32>,
}

/// One logged write of a loan.
#[derive(Debug, Clone)]
pub struct LoanWrite {
    pub txid: i64,
    pub at: DateTime<Utc>,
    pub who: String,
    /// 'I', 'U' or 'D'.
    pub op: char,
    pub loan: i64,
    pub old_settled: Option<bool>,
    pub new_settled: Option<bool>,
    pub old_at: Option<DateTime<Utc>>,
    pub new_at: Option<DateTime<Utc>>,
    pub old_fine: Option<i64>,
    pub new_fine: Option<i64>,
    pub old_seq: Option<i32>,
    pub new_seq: Option<i32>,
    pub new_due: Day,
    pub new_returned: Day,
}

impl LoanWrite {
    /// The write changed what settlementd owns (fine, done-marker, journal seq).
    fn touches_fine(&self) -> bool {
        self.op == 'U'
            && (self.old_fine != self.new_fine
                || self.old_at != self.new_at
                || self.old_seq != self.new_seq)
    }
}

/// One journal entry.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub loan: i64,
    pub seq: i32,
    pub before: Option<i64>,
    pub after: i64,
    /// The member the entry's money is for (`None`: an entry that names none).
    pub member: Option<i64>,
}

/// One row of `fine_journal`, with the transaction that wrote it (from the campaign's log).
#[derive(Debug, Clone)]
pub struct JournalRow {
    pub id: i64,
    pub txid: Option<i64>,
    pub month: NaiveDate,
    pub kind: String,
    pub shards: Option<i32>,
    pub attempt: Option<i32>,
    pub correction_key: Option<String>,
    pub entries: Vec<Entry>,
}

/// A `job_runs` key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub job: String,
    pub date: NaiveDate,
    pub shards: i32,
    pub shard: i32,
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {}/{}",
            self.job, self.date, self.shard, self.shards
        )
    }
}

/// One logged write of `job_runs`.
#[derive(Debug, Clone)]
pub struct RunWrite {
    pub txid: i64,
    pub at: DateTime<Utc>,
    /// When the writer's transaction began (`now()`).
    pub xact_at: DateTime<Utc>,
    pub key: Key,
    pub op: char,
    pub old_status: Option<String>,
    pub new_status: Option<String>,
    pub old_attempt: Option<i32>,
    pub new_attempt: Option<i32>,
    pub old_heartbeat: Option<DateTime<Utc>>,
    /// The row's owner before the write (`None` for an insert) and after it.
    pub old_owner: Option<String>,
    pub owner: Option<String>,
    /// The write moved the run's progress (cursor, counts): a batch's fenced write. An update of a
    /// RUNNING row that keeps its attempt and moves nothing renews the lease: a heartbeat (or a
    /// run's last, empty batch, after which it only ends).
    pub progress: bool,
}

impl RunWrite {
    /// The write won a claim: a new RUNNING attempt (inserted, or taken over).
    fn wins(&self) -> bool {
        self.new_status.as_deref() == Some("RUNNING")
            && (self.op == 'I' || (self.op == 'U' && self.new_attempt > self.old_attempt))
    }

    /// The write renewed a running attempt, the same one.
    fn renews(&self) -> bool {
        self.op == 'U'
            && self.old_status.as_deref() == Some("RUNNING")
            && self.new_status.as_deref() == Some("RUNNING")
            && self.old_attempt == self.new_attempt
    }
}

/// A pause of a job, as the campaign's log tells it: in force for certain from `from` (when the
/// campaign read it back committed) until `to` (when its resume's delete ran, the earliest it can
/// have committed; `None`: never resumed).
#[derive(Debug, Clone)]
pub struct Paused {
    pub job: String,
    pub from: DateTime<Utc>,
    pub to: Option<DateTime<Utc>>,
}

impl Paused {
    /// Whether `t` lies inside the pause.
    fn holds_at(&self, t: DateTime<Utc>) -> bool {
        t > self.from && self.to.map_or(true, |to| t < to)
    }
}

/// One `job_events` row.
#[derive(Debug, Clone)]
pub struct Event {
    pub key: Key,
    pub event: String,
    pub attempt: Option<i32>,
    pub request: Option<String>,
    /// When it was written (the database clock), and what it says.
    pub at: DateTime<Utc>,
    pub message: Option<String>,
}

/// One targeted shard of a stored request.
#[derive(Debug, Clone)]
pub struct RequestShard {
    pub request: String,
    pub idempotency_key: String,
    pub shards: i32,
    pub shard: i32,
    pub state: String,
    pub detail: Option<String>,
}

/// Everything the checks read.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// The campaign's months (first days).
    pub months: Vec<NaiveDate>,
    pub ttl_secs: f64,
    pub final_shards: i32,
    pub loans: BTreeMap<i64, Loan>,
    pub loan_log: Vec<LoanWrite>,
    pub journal: Vec<JournalRow>,
    /// Journal rows changed or deleted: (op, journal id).
    pub journal_edits: Vec<(String, i64)>,
    pub run_log: Vec<RunWrite>,
    /// `job_runs` as it ends: key, status, attempt.
    pub runs: Vec<(Key, String, i32)>,
    /// Each month's pinned rule (by month end); `None`: a pin this checker cannot read.
    pub pins: BTreeMap<NaiveDate, Option<Rule>>,
    /// Months held by a correction: (month end, correction key).
    pub held: Vec<(NaiveDate, String)>,
    pub unfinished_corrections: Vec<String>,
    /// (correction key, loan, old cents, new cents).
    pub adjustments: Vec<(String, i64, i64, i64)>,
    pub events: Vec<Event>,
    pub request_shards: Vec<RequestShard>,
    pub edits_queued: i64,
    /// Every pause of the schedule, in the order they began.
    pub pauses: Vec<Paused>,
    /// Jobs still paused at the end.
    pub paused_left: Vec<String>,
    /// The member statements: (month end, member) → (fines, cents).
    pub statements: BTreeMap<(NaiveDate, i64), (i64, i64)>,
}

/// The fine a rule gives a loan due on `due` and returned on `returned`, computed here: days late
/// past the grace, times the daily rate, capped.
pub fn fine_of(rule: &Rule, due: NaiveDate, returned: NaiveDate) -> i64 {
    let late = (returned - due)
        .num_days()
        .saturating_sub(rule.grace_days)
        .max(0);
    late.saturating_mul(rule.daily_rate_cents)
        .min(rule.max_cents)
}

fn first_of(day: NaiveDate) -> NaiveDate {
    day.with_day(1).unwrap_or(day)
}

/// The shard of a loan under `shards` (never negative).
fn shard_of(loan: i64, shards: i32) -> i32 {
    let s = i64::from(shards.max(1));
    (((loan % s) + s) % s) as i32
}

/// Reads the facts of a quiesced database.
pub async fn read(
    conn: &mut PgConnection,
    months: &[NaiveDate],
    ttl_secs: f64,
    final_shards: i32,
) -> Result<Facts> {
    let mut facts = Facts {
        months: months.to_vec(),
        ttl_secs,
        final_shards,
        ..Facts::default()
    };
    type LoanRow = (
        i64,
        i64,
        Option<String>,
        Option<String>,
        i64,
        bool,
        Option<i32>,
    );
    let loans: Vec<LoanRow> = sqlx::query_as(
        "SELECT id, member_id, due_on::text, returned_on::text, fine_cents::bigint,
                fine_settled_at IS NOT NULL, fine_seq FROM loans",
    )
    .fetch_all(&mut *conn)
    .await?;
    for (id, member, due, ret, fine, settled, seq) in loans {
        facts.loans.insert(
            id,
            Loan {
                id,
                member,
                due: Day::parse(due.as_deref()),
                returned: Day::parse(ret.as_deref()),
                fine,
                settled,
                seq,
            },
        );
    }
    type WriteRow = (
        i64,
        i64,
        DateTime<Utc>,
        String,
        String,
        i64,
        Option<bool>,
        Option<bool>,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
        Option<i64>,
        Option<i64>,
        Option<i32>,
        Option<i32>,
        Option<String>,
        Option<String>,
    );
    let writes: Vec<WriteRow> = sqlx::query_as(
        "SELECT n, txid, at, who, op, loan_id, old_settled, new_settled, old_settled_at, new_settled_at,
                old_fine, new_fine, old_seq, new_seq, new_due, new_ret
           FROM campaign_loan_log ORDER BY n",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.loan_log = writes
        .into_iter()
        .map(|w| LoanWrite {
            txid: w.1,
            at: w.2,
            who: w.3,
            op: w.4.chars().next().unwrap_or('?'),
            loan: w.5,
            old_settled: w.6,
            new_settled: w.7,
            old_at: w.8,
            new_at: w.9,
            old_fine: w.10,
            new_fine: w.11,
            old_seq: w.12,
            new_seq: w.13,
            new_due: Day::parse(w.14.as_deref()),
            new_returned: Day::parse(w.15.as_deref()),
        })
        .collect();
    type JRow = (
        i64,
        Option<i64>,
        NaiveDate,
        String,
        Option<i32>,
        Option<i32>,
        Option<String>,
        Vec<i64>,
        Vec<i32>,
        Vec<Option<i64>>,
        Vec<Option<i64>>,
        Vec<Option<i64>>,
    );
    let rows: Vec<JRow> = sqlx::query_as(
        "SELECT j.id, (SELECT l.txid FROM campaign_journal_log l
                        WHERE l.journal_id = j.id AND l.op = 'I' ORDER BY l.n LIMIT 1),
                j.month, j.kind, j.shards, j.attempt, j.correction_key, j.loan_ids, j.seqs,
                j.before_cents, j.after_cents,
                COALESCE(j.member_ids, array_fill(NULL::bigint, ARRAY[cardinality(j.loan_ids)]))
           FROM fine_journal j ORDER BY j.id",
    )
    .fetch_all(&mut *conn)
    .await?;
    for r in rows {
        let entries =
            r.7.iter()
                .zip(&r.8)
                .zip(r.9.iter().zip(&r.10))
                .zip(&r.11)
                .map(|(((loan, seq), (before, after)), member)| Entry {
                    loan: *loan,
                    seq: *seq,
                    before: *before,
                    after: after.unwrap_or(i64::MIN),
                    member: *member,
                })
                .collect();
        facts.journal.push(JournalRow {
            id: r.0,
            txid: r.1,
            month: r.2,
            kind: r.3,
            shards: r.4,
            attempt: r.5,
            correction_key: r.6,
            entries,
        });
    }
    facts.journal_edits = sqlx::query_as(
        "SELECT op, journal_id FROM campaign_journal_log WHERE op <> 'I' ORDER BY n",
    )
    .fetch_all(&mut *conn)
    .await?;
    type RRow = (
        i64,
        DateTime<Utc>,
        DateTime<Utc>,
        Option<String>,
        Option<NaiveDate>,
        Option<i32>,
        Option<i32>,
        String,
        Option<String>,
        Option<String>,
        Option<i32>,
        Option<i32>,
        Option<DateTime<Utc>>,
        Option<bool>,
        Option<String>,
        Option<String>,
    );
    let runs: Vec<RRow> = sqlx::query_as(
        "SELECT txid, at, xact_at, job_name, business_date, shards, shard, op, old_status,
                new_status, old_attempt, new_attempt, old_heartbeat, progress, old_owner, owner
           FROM campaign_run_log ORDER BY n",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.run_log = runs
        .into_iter()
        .map(|r| RunWrite {
            txid: r.0,
            at: r.1,
            xact_at: r.2,
            key: Key {
                job: r.3.unwrap_or_default(),
                date: r.4.unwrap_or_default(),
                shards: r.5.unwrap_or_default(),
                shard: r.6.unwrap_or_default(),
            },
            op: r.7.chars().next().unwrap_or('?'),
            old_status: r.8,
            new_status: r.9,
            old_attempt: r.10,
            new_attempt: r.11,
            old_heartbeat: r.12,
            progress: r.13.unwrap_or(false),
            old_owner: r.14,
            owner: r.15,
        })
        .collect();
    let pauses: Vec<PauseRow> =
        sqlx::query_as("SELECT op, job_name, at, seen_at FROM campaign_pause_log ORDER BY n")
            .fetch_all(&mut *conn)
            .await?;
    facts.pauses = pause_windows(&pauses);
    facts.paused_left = sqlx::query_scalar("SELECT job_name FROM job_pauses ORDER BY job_name")
        .fetch_all(&mut *conn)
        .await?;
    let statements: Vec<(NaiveDate, i64, i64, i64)> = sqlx::query_as(
        "SELECT business_date, member_id, fines::bigint, fine_cents::bigint
           FROM member_fine_statements",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.statements = statements
        .into_iter()
        .map(|(month, member, fines, cents)| ((month, member), (fines, cents)))
        .collect();
    let finals: Vec<(String, NaiveDate, i32, i32, String, i32)> = sqlx::query_as(
        "SELECT job_name, business_date, shards, shard, status, attempt FROM job_runs",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.runs = finals
        .into_iter()
        .map(|(job, date, shards, shard, status, attempt)| {
            (
                Key {
                    job,
                    date,
                    shards,
                    shard,
                },
                status,
                attempt,
            )
        })
        .collect();
    let pins: Vec<(NaiveDate, serde_json::Value, Option<String>)> = sqlx::query_as(
        "SELECT business_date, params, correction_key FROM job_params
          WHERE job_name = 'fine-settlement'",
    )
    .fetch_all(&mut *conn)
    .await?;
    for (date, params, held) in pins {
        let int = |k: &str| params.get(k).and_then(serde_json::Value::as_i64);
        let rule = (|| {
            Some(Rule {
                daily_rate_cents: int("daily_rate_cents")?,
                grace_days: int("grace_days")?,
                max_cents: int("max_cents")?,
            })
        })();
        facts.pins.insert(date, rule);
        if let Some(key) = held {
            facts.held.push((date, key));
        }
    }
    facts.unfinished_corrections = sqlx::query_scalar(
        "SELECT correction_key FROM fine_corrections WHERE completed_at IS NULL ORDER BY 1",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.adjustments = sqlx::query_as(
        "SELECT correction_key, loan_id, old_cents, new_cents FROM fine_adjustments ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    type ERow = (
        String,
        NaiveDate,
        i32,
        i32,
        String,
        Option<i32>,
        Option<String>,
        DateTime<Utc>,
        Option<String>,
    );
    let events: Vec<ERow> = sqlx::query_as(
        "SELECT job_name, business_date, shards, shard, event, attempt, request_id::text, at,
                message
           FROM job_events ORDER BY id",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.events = events
        .into_iter()
        .map(
            |(job, date, shards, shard, event, attempt, request, at, message)| Event {
                key: Key {
                    job,
                    date,
                    shards,
                    shard,
                },
                event,
                attempt,
                request,
                at,
                message,
            },
        )
        .collect();
    type QRow = (String, String, i32, i32, String, Option<String>);
    let shards: Vec<QRow> = sqlx::query_as(
        "SELECT r.request_id::text, r.idempotency_key, r.shards, s.shard, s.state, s.detail
           FROM run_request_shards s JOIN run_requests r USING (request_id)
          ORDER BY r.created_at, s.shard",
    )
    .fetch_all(&mut *conn)
    .await?;
    facts.request_shards = shards
        .into_iter()
        .map(
            |(request, idempotency_key, shards, shard, state, detail)| RequestShard {
                request,
                idempotency_key,
                shards,
                shard,
                state,
                detail,
            },
        )
        .collect();
    facts.edits_queued = sqlx::query_scalar("SELECT count(*) FROM loan_changes")
        .fetch_one(&mut *conn)
        .await?;
    Ok(facts)
}

/// A row of `campaign_pause_log`: op, job, when written, when the campaign saw it committed.
type PauseRow = (String, String, DateTime<Utc>, Option<DateTime<Utc>>);

/// The pauses the log's rows tell, in order: each insert opens one (a pause nobody saw committed,
/// its answer lost and resumed before the campaign looked, opens none), the next delete of its
/// job closes it.
fn pause_windows(rows: &[PauseRow]) -> Vec<Paused> {
    let mut pauses: Vec<Paused> = Vec::new();
    let mut open: HashMap<&str, Option<usize>> = HashMap::new();
    for (op, job, at, seen) in rows {
        match op.as_str() {
            "I" => {
                let opened = seen.map(|from| {
                    pauses.push(Paused {
                        job: job.clone(),
                        from,
                        to: None,
                    });
                    pauses.len() - 1
                });
                open.insert(job, opened);
            }
            "D" => {
                if let Some(Some(n)) = open.remove(job.as_str()) {
                    pauses[n].to = Some(*at);
                }
            }
            _ => {}
        }
    }
    pauses
}

/// Every check of the database's facts.
pub fn check(facts: &Facts) -> Vec<Violation> {
    let mut out = Vec::new();
    check_open(facts, &mut out);
    check_keys(facts, &mut out);
    check_claims(facts, &mut out);
    check_leases(facts, &mut out);
    check_fences(facts, &mut out);
    check_transitions(facts, &mut out);
    check_journal(facts, &mut out);
    check_balance(facts, &mut out);
    check_fines(facts, &mut out);
    check_statements(facts, &mut out);
    check_request_shards(facts, &mut out);
    check_pauses(facts, &mut out);
    out
}

/// The checks of what the campaign recorded besides the database: requests' answers, `verify`,
/// exits, quiescing.
pub fn check_world(world: &World, facts: &Facts, played: &crate::faults::Played) -> Vec<Violation> {
    let mut out = Vec::new();
    if let Err(open) = &played.quiesced {
        out.push(violation(
            "quiesce",
            format!(
                "not at rest {} s after the faults stopped: {open}",
                crate::faults::QUIESCE_BOUND.as_secs()
            ),
        ));
    }
    for (month, code, stdout, stderr) in &played.verified {
        if let Some(wrong) = verify_disagrees(facts, *month, *code, stdout) {
            out.push(violation(
                "verify",
                format!(
                    "settlementd verify {month} (exit {code}): {wrong} {}",
                    one_line(stderr, 200)
                ),
            ));
        }
    }
    check_requests_sent(world, facts, &mut out);
    check_exits(world, &mut out);
    out
}

/// Why `verify --json` of `month` (its exit code and output) is not right, or disagrees with the
/// facts; `None` when it is right. Held rows make it exit 6 by design (the money right, rows
/// held): then it must name exactly the held rows the checker finds, and nothing else wrong.
fn verify_disagrees(f: &Facts, month: NaiveDate, code: i32, stdout: &str) -> Option<String> {
    let Some(json) = stdout
        .lines()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    else {
        return Some(format!("no JSON: {}", one_line(stdout, 200)));
    };
    let count = |path: &[&str]| {
        path.iter()
            .try_fold(&json, |v, k| v.get(k))
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(-1)
    };
    let first = first_of(month);
    let in_month = |l: &&Loan| matches!(l.returned, Day::On(r) if first_of(r) == first);
    let held = f
        .loans
        .values()
        .filter(in_month)
        .filter(|l| l.due.day().is_none() && !l.settled)
        .count() as i64;
    let settled: Vec<&Loan> = f
        .loans
        .values()
        .filter(in_month)
        .filter(|l| l.settled)
        .collect();
    let sum: i64 = settled.iter().map(|l| l.fine).sum();
    let mut wrong = Vec::new();
    for path in [
        &["mismatched", "count"][..],
        &["unsettled", "count"],
        &["journal", "off_journal", "count"],
        &["journal", "stale", "count"],
        &["journal", "broken", "count"],
        &["journal", "edits_waiting", "count"],
        &["journal", "unjournaled", "count"],
    ] {
        if count(path) != 0 {
            wrong.push(format!("{} = {}", path.join("."), count(path)));
        }
    }
    if count(&["held", "count"]) != held {
        wrong.push(format!(
            "held {} where the checker finds {held}",
            count(&["held", "count"])
        ));
    }
    if count(&["totals", "settled_rows"]) != settled.len() as i64 {
        wrong.push(format!(
            "{} settled rows where the checker finds {}",
            count(&["totals", "settled_rows"]),
            settled.len()
        ));
    }
    let total = json
        .get("totals")
        .and_then(|t| t.get("fine_cents_sum"))
        .map(|v| v.to_string().trim_matches('"').to_string());
    if total.as_deref() != Some(sum.to_string().as_str()) {
        wrong.push(format!("fine sum {total:?} where the checker finds {sum}"));
    }
    let expected_code = if held > 0 { 6 } else { 0 };
    if code != expected_code {
        wrong.push(format!("exit {code}, expected {expected_code}"));
    }
    if json.get("money_right") != Some(&serde_json::Value::Bool(true)) {
        wrong.push(format!(
            "money_right {:?}, where every fine is right",
            json.get("money_right")
        ));
    }
    (!wrong.is_empty()).then(|| wrong.join(", "))
}

fn check_open(f: &Facts, out: &mut Vec<Violation>) {
    for (key, status, attempt) in &f.runs {
        if status == "RUNNING" {
            out.push(violation(
                "open",
                format!("{key} left RUNNING (attempt {attempt})"),
            ));
        }
    }
    for (month, key) in &f.held {
        out.push(violation(
            "open",
            format!("{month} still held by correction {key}"),
        ));
    }
    for key in &f.unfinished_corrections {
        out.push(violation("open", format!("correction {key} unfinished")));
    }
    if f.edits_queued > 0 {
        out.push(violation(
            "open",
            format!("{} edits of settled loans still queued", f.edits_queued),
        ));
    }
    for job in &f.paused_left {
        out.push(violation("open", format!("{job} left paused")));
    }
}

fn check_keys(f: &Facts, out: &mut Vec<Violation>) {
    for first in &f.months {
        let date = month_end(*first);
        for shard in 0..f.final_shards {
            let key = Key {
                job: "fine-settlement".into(),
                date,
                shards: f.final_shards,
                shard,
            };
            match f.runs.iter().find(|(k, _, _)| *k == key) {
                Some((_, status, _)) if status == "SUCCESS" => {}
                Some((_, status, attempt)) => out.push(violation(
                    "keys",
                    format!("{key} is {status} (attempt {attempt}), not SUCCESS"),
                )),
                None => out.push(violation("keys", format!("{key} was never claimed"))),
            }
        }
    }
}

/// The events that open an attempt.
const CLAIM_EVENTS: &[&str] = &[
    "claimed",
    "took_over",
    "forced",
    "late_returns",
    "correcting",
    "reopened",
    "month_changed",
    "abandoned",
];

fn check_claims(f: &Facts, out: &mut Vec<Violation>) {
    let mut claims: BTreeMap<(Key, i32), Vec<&str>> = BTreeMap::new();
    let mut successes: BTreeMap<(Key, i32), usize> = BTreeMap::new();
    for e in &f.events {
        let Some(attempt) = e.attempt else { continue };
        if CLAIM_EVENTS.contains(&e.event.as_str()) {
            claims
                .entry((e.key.clone(), attempt))
                .or_default()
                .push(&e.event);
        }
        if e.event == "succeeded" {
            *successes.entry((e.key.clone(), attempt)).or_default() += 1;
        }
    }
    for ((key, attempt), events) in &claims {
        if events.len() > 1 {
            out.push(violation(
                "claims",
                format!(
                    "attempt {attempt} of {key} was won by {} claims: {events:?}",
                    events.len()
                ),
            ));
        }
    }
    for ((key, attempt), n) in &successes {
        if *n > 1 {
            out.push(violation(
                "claims",
                format!("attempt {attempt} of {key} was marked SUCCESS {n} times"),
            ));
        }
    }
    for (key, _, last) in &f.runs {
        for attempt in 1..=*last {
            if !claims.contains_key(&(key.clone(), attempt)) {
                out.push(violation(
                    "claims",
                    format!("attempt {attempt} of {key} has no claim event"),
                ));
            }
        }
    }
}

/// A RUNNING claim is taken over only once its lease expired by the database clock, or — the one
/// exception, [`settlementd::job_layer::claim::OWN_MARK`] — by its own owner (one process) for an
/// attempt that process had ended: its `took_over` event says so, and the attempt taken over writes
/// nothing after it (a run that went on would meet the fence and record `fencing_rejected`).
fn check_leases(f: &Facts, out: &mut Vec<Violation>) {
    use settlementd::job_layer::claim::OWN_MARK;
    for w in &f.run_log {
        let took_over = w.op == 'U'
            && w.old_status.as_deref() == Some("RUNNING")
            && w.new_attempt.is_some()
            && w.new_attempt > w.old_attempt;
        if !took_over {
            continue;
        }
        let Some(beat) = w.old_heartbeat else {
            continue;
        };
        let age = (w.at - beat).num_milliseconds() as f64 / 1000.0;
        if age >= f.ttl_secs {
            continue;
        }
        let own = w.old_owner.is_some()
            && w.old_owner == w.owner
            && f.events.iter().any(|e| {
                e.key == w.key
                    && e.attempt == w.new_attempt
                    && e.event == "took_over"
                    && e.message.as_deref().is_some_and(|m| m.contains(OWN_MARK))
            });
        if own {
            let after: Vec<&str> = f
                .events
                .iter()
                .filter(|e| e.key == w.key && e.attempt == w.old_attempt && e.at > w.at)
                .map(|e| e.event.as_str())
                .collect();
            if !after.is_empty() {
                out.push(violation(
                    "leases",
                    format!(
                        "attempt {} of {} took over its own owner's attempt {} ({age:.2} s into \
                         a {} s lease) while that run went on: it wrote {after:?} after",
                        w.new_attempt.unwrap_or_default(),
                        w.key,
                        w.old_attempt.unwrap_or_default(),
                        f.ttl_secs
                    ),
                ));
            }
        } else {
            out.push(violation(
                "leases",
                format!(
                    "attempt {} of {} took over a live lease: the holder's heartbeat was {age:.2} s \
                     old by the database clock (lease {} s)",
                    w.new_attempt.unwrap_or_default(),
                    w.key,
                    f.ttl_secs
                ),
            ));
        }
    }
}

fn check_fences(f: &Facts, out: &mut Vec<Violation>) {
    let mut by_tx: BTreeMap<i64, Vec<&LoanWrite>> = BTreeMap::new();
    for w in f
        .loan_log
        .iter()
        .filter(|w| w.who == "settlementd" && w.touches_fine())
    {
        by_tx.entry(w.txid).or_default().push(w);
    }
    let mut journal_by_tx: HashMap<i64, Vec<&JournalRow>> = HashMap::new();
    for j in &f.journal {
        if let Some(tx) = j.txid {
            journal_by_tx.entry(tx).or_default().push(j);
        }
    }
    let mut runs_by_tx: HashMap<i64, Vec<&RunWrite>> = HashMap::new();
    for r in &f.run_log {
        runs_by_tx.entry(r.txid).or_default().push(r);
    }
    let mut reported = 0;
    for (tx, writes) in &by_tx {
        let journal = journal_by_tx.get(tx).map(Vec::as_slice).unwrap_or(&[]);
        if journal.is_empty() {
            out.push(violation(
                "fences",
                format!(
                    "transaction {tx} changed the fines of {} loans (first {}) with no journal row",
                    writes.len(),
                    writes[0].loan
                ),
            ));
            continue;
        }
        for j in journal {
            let (Some(attempt), Some(shards)) = (j.attempt, j.shards) else {
                continue; // opening entries: judged by the journal check
            };
            let Some(first) = j.entries.first() else {
                continue;
            };
            let key = Key {
                job: "fine-settlement".into(),
                date: month_end(j.month),
                shards,
                shard: shard_of(first.loan, shards),
            };
            // A run's entries are in its month, but for money it took out of another month as a
            // loan moved (`reversed`, in the month the money left): those are fenced by the run
            // of a month this transaction wrote entries in.
            let months: BTreeSet<NaiveDate> = journal.iter().map(|o| month_end(o.month)).collect();
            let fenced = runs_by_tx.get(tx).is_some_and(|runs| {
                runs.iter().any(|r| {
                    (r.key == key
                        || (j.kind == "reversed"
                            && r.key.job == key.job
                            && r.key.shards == key.shards
                            && r.key.shard == key.shard
                            && months.contains(&r.key.date)))
                        && r.op == 'U'
                        && r.old_status.as_deref() == Some("RUNNING")
                        && r.new_status.as_deref() == Some("RUNNING")
                        && r.old_attempt == Some(attempt)
                        && r.new_attempt == Some(attempt)
                })
            });
            if !fenced && reported < 20 {
                reported += 1;
                let then = f
                    .runs
                    .iter()
                    .find(|(k, _, _)| *k == key)
                    .map(|(_, status, last)| format!("; the key ended at attempt {last}, {status}"))
                    .unwrap_or_default();
                out.push(violation(
                    "fences",
                    format!(
                        "transaction {tx} wrote {} {} entries (loans {:?}…) as attempt {attempt} of \
                         {key} without its fenced progress write{then}",
                        j.entries.len(),
                        j.kind,
                        j.entries.iter().take(3).map(|e| e.loan).collect::<Vec<_>>()
                    ),
                ));
            }
        }
    }
}

/// Each (loan, seq) entry with its row.
fn entries_by_loan(f: &Facts) -> BTreeMap<i64, Vec<(&JournalRow, Entry)>> {
    let mut by_loan: BTreeMap<i64, Vec<(&JournalRow, Entry)>> = BTreeMap::new();
    for j in &f.journal {
        for e in &j.entries {
            by_loan.entry(e.loan).or_default().push((j, *e));
        }
    }
    for entries in by_loan.values_mut() {
        entries.sort_by_key(|(j, e)| (e.seq, j.id));
    }
    by_loan
}

fn check_transitions(f: &Facts, out: &mut Vec<Violation>) {
    let by_loan = entries_by_loan(f);
    let mut reported = 0;
    let mut report = |out: &mut Vec<Violation>, facts: String| {
        if reported < 30 {
            out.push(violation("transitions", facts));
        }
        reported += 1;
    };
    for w in f.loan_log.iter().filter(|w| w.touches_fine()) {
        if w.who != "settlementd" {
            report(
                out,
                format!(
                    "loan {}'s fine changed outside settlementd (by {}): {:?} -> {:?} cents",
                    w.loan, w.who, w.old_fine, w.new_fine
                ),
            );
            continue;
        }
        let (old, new) = (
            w.old_settled.unwrap_or(false),
            w.new_settled.unwrap_or(false),
        );
        let seq = w.new_seq.unwrap_or(0);
        // The entries this transaction wrote for the loan: one, or two when its money left
        // another month or member first (`reversed` there, then the fine here).
        let chain = by_loan.get(&w.loan).map(Vec::as_slice).unwrap_or_default();
        let mine: Vec<&(&JournalRow, Entry)> = chain
            .iter()
            .filter(|(j, _)| j.txid == Some(w.txid))
            .collect();
        let Some((j, e)) = mine.last().copied() else {
            report(
                out,
                format!(
                    "loan {} written in transaction {} (seq {seq}) without its journal entry",
                    w.loan, w.txid
                ),
            );
            continue;
        };
        let moved = match mine.as_slice() {
            [_] => false,
            [(out_row, out_entry), _] => {
                if out_row.kind != "reversed"
                    || out_entry.after != 0
                    || out_entry.seq + 1 != e.seq
                    || e.before != Some(0)
                {
                    report(
                        out,
                        format!(
                            "loan {} has two entries in transaction {} that are not a move \
                             (out of {} as {} {:?} -> {}, in as {:?} -> {})",
                            w.loan,
                            w.txid,
                            out_row.month,
                            out_row.kind,
                            out_entry.before,
                            out_entry.after,
                            e.before,
                            e.after
                        ),
                    );
                }
                true
            }
            more => {
                report(
                    out,
                    format!(
                        "loan {} has {} entries in transaction {}: one change, one entry \
                         (two for a move)",
                        w.loan,
                        more.len(),
                        w.txid
                    ),
                );
                continue;
            }
        };
        // The chain before this transaction: its last seq. A row libraryd inserted again (a
        // reload, a loan re-created under its id) carries no seq of its own.
        let first_seq = mine[0].1.seq;
        let prev_seq = chain
            .iter()
            .map(|(_, e)| e.seq)
            .filter(|s| *s < first_seq)
            .max()
            .unwrap_or(0);
        if seq != e.seq
            || first_seq != prev_seq + 1
            || w.old_seq.is_some_and(|old_seq| old_seq != prev_seq)
        {
            report(
                out,
                format!(
                    "loan {}'s fine_seq went {:?} -> {:?} in transaction {}, its chain was at {prev_seq}",
                    w.loan, w.old_seq, w.new_seq, w.txid
                ),
            );
        }
        let kind = j.kind.as_str();
        // The row before, where it is the record's (its seq the chain's): its fine is where the
        // entry starts, unless the money moved in from elsewhere (then from 0).
        let before = if moved || !old { Some(0) } else { w.old_fine };
        let row_is_the_records = w.old_seq == Some(prev_seq);
        if (row_is_the_records && e.before.is_some() && e.before != before)
            || Some(e.after) != w.new_fine.map(|n| if new { n } else { 0 })
        {
            report(
                out,
                format!(
                    "loan {} entry {seq} ({kind}) says {:?} -> {} cents, the loan went {:?} -> {:?}",
                    w.loan, e.before, e.after, before, w.new_fine
                ),
            );
        }
        match (old, new) {
            (false, true) => {
                if !["settled", "late", "corrected"].contains(&kind) {
                    report(out, format!("loan {} settled by a {kind} entry", w.loan));
                }
                let priceable = matches!(w.new_due, Day::On(_));
                if !priceable || !matches!(w.new_returned, Day::On(_)) {
                    report(
                        out,
                        format!(
                            "loan {} settled while {} (due {:?}, returned {:?}), transaction {}",
                            w.loan,
                            if priceable { "still out" } else { "held" },
                            w.new_due,
                            w.new_returned,
                            w.txid
                        ),
                    );
                }
            }
            (true, true) => {
                if !["repriced", "corrected"].contains(&kind) || w.old_at != w.new_at {
                    report(
                        out,
                        format!(
                            "loan {} settled twice: a settled loan written again as {kind} \
                             (settled at {:?}, then {:?}), transaction {}",
                            w.loan, w.old_at, w.new_at, w.txid
                        ),
                    );
                }
            }
            (true, false) => {
                if kind != "reversed" {
                    report(out, format!("loan {} unsettled by a {kind} entry", w.loan));
                }
            }
            // A loan unsettled in `loans` whose money is still on the record (re-created, or its
            // return undone, by libraryd): that money reversed out.
            (false, false) if kind == "reversed" && e.before.is_some_and(|b| b != 0) => {}
            (false, false) => report(
                out,
                format!(
                    "loan {} rewritten while unsettled ({kind}), transaction {}",
                    w.loan, w.txid
                ),
            ),
        }
    }
}

fn check_journal(f: &Facts, out: &mut Vec<Violation>) {
    for (op, id) in &f.journal_edits {
        out.push(violation(
            "journal",
            format!(
                "journal row {id} was {}",
                if op == "D" { "deleted" } else { "changed" }
            ),
        ));
    }
    let by_loan = entries_by_loan(f);
    let mut reported = 0;
    let mut report = |out: &mut Vec<Violation>, facts: String| {
        if reported < 30 {
            out.push(violation("journal", facts));
        }
        reported += 1;
    };
    for (loan, entries) in &by_loan {
        let mut after = 0i64;
        for (n, (j, e)) in entries.iter().enumerate() {
            if e.seq != n as i32 + 1 {
                report(
                    out,
                    format!(
                        "loan {loan}'s journal has entry {} where {} belongs (a gap or a repeat)",
                        e.seq,
                        n + 1
                    ),
                );
                break;
            }
            if j.kind == "opening" {
                report(
                    out,
                    format!("loan {loan} has an opening entry: it was settled without one"),
                );
            } else if e.before != Some(after) {
                report(
                    out,
                    format!(
                        "loan {loan}'s entry {} ({}) starts from {:?} cents, the entry before ended at {after}",
                        e.seq, j.kind, e.before
                    ),
                );
            }
            after = e.after;
        }
        let Some((last_row, last)) = entries.last() else {
            continue;
        };
        match f.loans.get(loan) {
            None => {
                if last_row.kind != "deleted" {
                    report(
                        out,
                        format!(
                            "loan {loan} is gone but its last entry is {}",
                            last_row.kind
                        ),
                    );
                }
            }
            Some(l) => {
                let reversed = last_row.kind == "reversed";
                if last_row.kind == "deleted" {
                    report(
                        out,
                        format!("loan {loan} exists but its last entry says deleted"),
                    );
                } else if l.seq != Some(last.seq) {
                    report(
                        out,
                        format!(
                            "loan {loan} has fine_seq {:?}, its last entry is {}",
                            l.seq, last.seq
                        ),
                    );
                } else if l.settled == reversed || l.fine != if reversed { 0 } else { last.after } {
                    report(
                        out,
                        format!(
                            "loan {loan} is {} with {} cents, its last entry ({}) says {} cents",
                            if l.settled { "settled" } else { "unsettled" },
                            l.fine,
                            last_row.kind,
                            last.after
                        ),
                    );
                }
            }
        }
    }
    for l in f.loans.values() {
        if !by_loan.contains_key(&l.id) && (l.settled || l.seq.is_some()) {
            report(
                out,
                format!(
                    "loan {} is {} (fine {}, fine_seq {:?}) with no journal entry",
                    l.id,
                    if l.settled { "settled" } else { "unsettled" },
                    l.fine,
                    l.seq
                ),
            );
        }
    }
    for finding in adjustments_off_the_journal(f) {
        report(out, finding);
    }
}

/// Every adjustment a correction made is on the journal, under its key: a loan's entries of one
/// transaction under the key end at the adjustment's new cents (a move is two: its money out of
/// the old place, then the corrected fine into the new one). Its old cents are what the loan's row
/// held before that transaction, as the correction reads it (its fine if settled, else 0; the
/// campaign's loan log has it): a loan libraryd reloaded (deleted and inserted again, unsettled)
/// that the correction moves is 0 → new there, while the journal takes the record's money out
/// of the old place first. Without a logged write of the row, the first entry's before.
fn adjustments_off_the_journal(f: &Facts) -> Vec<String> {
    let mut findings = Vec::new();
    let mut row_before: BTreeMap<(i64, i64), i64> = BTreeMap::new();
    for w in f.loan_log.iter().filter(|w| w.op == 'U') {
        row_before
            .entry((w.txid, w.loan))
            .or_insert(if w.old_settled == Some(true) {
                w.old_fine.unwrap_or(0)
            } else {
                0
            });
    }
    let mut changes: BTreeMap<(String, i64, Option<i64>), Vec<Entry>> = BTreeMap::new();
    for j in &f.journal {
        let Some(key) = &j.correction_key else {
            continue;
        };
        for e in &j.entries {
            changes
                .entry((key.clone(), e.loan, j.txid))
                .or_default()
                .push(*e);
        }
    }
    let mut recorded: BTreeMap<(String, i64, i64, i64), usize> = BTreeMap::new();
    for ((key, loan, txid), mut entries) in changes {
        entries.sort_by_key(|e| e.seq);
        let (first, last) = (entries[0], entries[entries.len() - 1]);
        let before = txid
            .and_then(|t| row_before.get(&(t, loan)).copied())
            .unwrap_or(first.before.unwrap_or(0));
        *recorded.entry((key, loan, before, last.after)).or_default() += 1;
    }
    for (key, loan, old, new) in &f.adjustments {
        if old == new {
            findings.push(format!(
                "correction {key} wrote a no-op adjustment of loan {loan} ({old} -> {new})"
            ));
        }
        match recorded.get_mut(&(key.clone(), *loan, *old, *new)) {
            Some(n) if *n > 0 => *n -= 1,
            _ => findings.push(format!(
                "correction {key}'s adjustment of loan {loan} ({old} -> {new}) is not on the journal"
            )),
        }
    }
    findings
}

/// Each month's journal balances, member by member: the entries of a (month, member) net to the
/// fines of the member's loans settled in the month. Money that left a month or a member (another
/// return date, a deletion, a re-created or merged loan) was reversed out of it, and money that
/// came in was settled there, whatever order the months ran in.
fn check_balance(f: &Facts, out: &mut Vec<Violation>) {
    let mut journal: BTreeMap<(NaiveDate, Option<i64>), i64> = BTreeMap::new();
    for j in &f.journal {
        for e in &j.entries {
            let member = e.member.or_else(|| f.loans.get(&e.loan).map(|l| l.member));
            *journal.entry((j.month, member)).or_default() += e.after - e.before.unwrap_or(0);
        }
    }
    let mut loans: BTreeMap<(NaiveDate, Option<i64>), i64> = BTreeMap::new();
    for l in f.loans.values() {
        if let (true, Day::On(ret)) = (l.settled, l.returned) {
            *loans.entry((first_of(ret), Some(l.member))).or_default() += l.fine;
        }
    }
    journal.retain(|_, net| *net != 0);
    loans.retain(|_, held| *held != 0);
    let keys: BTreeSet<&(NaiveDate, Option<i64>)> = journal.keys().chain(loans.keys()).collect();
    let wrong: Vec<String> = keys
        .into_iter()
        .filter(|k| journal.get(*k) != loans.get(*k))
        .map(|(month, member)| {
            format!(
                "{month} for member {member:?}: the journal nets {} cents, the loans settled there hold {}",
                journal.get(&(*month, *member)).unwrap_or(&0),
                loans.get(&(*month, *member)).unwrap_or(&0)
            )
        })
        .collect();
    for w in wrong.iter().take(10) {
        out.push(violation("balance", w.clone()));
    }
    if wrong.len() > 10 {
        out.push(violation(
            "balance",
            format!("… {} (month, member) balances wrong in all", wrong.len()),
        ));
    }
}

fn check_fines(f: &Facts, out: &mut Vec<Violation>) {
    let months: BTreeSet<NaiveDate> = f.months.iter().copied().collect();
    let mut wrong = Vec::new();
    let mut unsettled = Vec::new();
    let mut held_settled = Vec::new();
    let mut out_settled = Vec::new();
    for l in f.loans.values() {
        match l.returned {
            Day::On(ret) if months.contains(&first_of(ret)) => {
                match l.due.day() {
                    Some(due) => {
                        if !l.settled {
                            unsettled.push(l.id);
                            continue;
                        }
                        match f.pins.get(&month_end(first_of(ret))) {
                            Some(Some(rule)) => {
                                let expected = fine_of(rule, due, ret);
                                if l.fine != expected {
                                    wrong.push(format!(
                                    "loan {} due {due} returned {ret}: {} cents, the pinned rule \
                                     ({} a day after {} days, at most {}) gives {expected}",
                                    l.id, l.fine, rule.daily_rate_cents, rule.grace_days, rule.max_cents
                                ));
                                }
                            }
                            _ => wrong.push(format!(
                                "loan {} is settled in {} which has no readable pin",
                                l.id,
                                month_end(first_of(ret))
                            )),
                        }
                    }
                    None => {
                        if l.settled {
                            held_settled.push(l.id);
                        }
                    }
                }
            }
            Day::None | Day::Infinite => {
                if l.settled {
                    out_settled.push(l.id);
                }
            }
            Day::On(_) => {}
        }
    }
    for w in wrong.iter().take(10) {
        out.push(violation("fines", w.clone()));
    }
    if wrong.len() > 10 {
        out.push(violation(
            "fines",
            format!("… {} wrong fines in all", wrong.len()),
        ));
    }
    let listed = |ids: &[i64]| format!("{} (first {:?})", ids.len(), &ids[..ids.len().min(10)]);
    if !unsettled.is_empty() {
        out.push(violation(
            "fines",
            format!(
                "returns of the months left unsettled: {}",
                listed(&unsettled)
            ),
        ));
    }
    if !held_settled.is_empty() {
        out.push(violation(
            "fines",
            format!("held rows settled: {}", listed(&held_settled)),
        ));
    }
    if !out_settled.is_empty() {
        out.push(violation(
            "fines",
            format!("loans still out settled: {}", listed(&out_settled)),
        ));
    }
}

/// Each month's member statements against the loans: per member, the settled loans returned in
/// the month with a fine above 0 (how many, their sum); a member without one has no statement.
fn check_statements(f: &Facts, out: &mut Vec<Violation>) {
    let months: BTreeSet<NaiveDate> = f.months.iter().copied().collect();
    let mut expected: BTreeMap<(NaiveDate, i64), (i64, i64)> = BTreeMap::new();
    for l in f.loans.values() {
        if let Day::On(ret) = l.returned {
            if l.settled && l.fine > 0 && months.contains(&first_of(ret)) {
                let s = expected
                    .entry((month_end(first_of(ret)), l.member))
                    .or_default();
                s.0 += 1;
                s.1 += l.fine;
            }
        }
    }
    let keys: BTreeSet<&(NaiveDate, i64)> = expected.keys().chain(f.statements.keys()).collect();
    let wrong: Vec<String> = keys
        .into_iter()
        .filter(|k| expected.get(*k) != f.statements.get(*k))
        .map(|(month, member)| {
            let show = |s: Option<&(i64, i64)>| {
                s.map_or("none".to_string(), |(n, c)| format!("{n} fines, {c} cents"))
            };
            format!(
                "member {member} in {month}: the statement says {}, the loans {}",
                show(f.statements.get(&(*month, *member))),
                show(expected.get(&(*month, *member)))
            )
        })
        .collect();
    for w in wrong.iter().take(10) {
        out.push(violation("statements", w.clone()));
    }
    if wrong.len() > 10 {
        out.push(violation(
            "statements",
            format!("… {} members' statements wrong in all", wrong.len()),
        ));
    }
}

/// Seconds from `a` to `b`.
fn secs(a: DateTime<Utc>, b: DateTime<Utc>) -> f64 {
    (b - a).num_milliseconds() as f64 / 1000.0
}

/// What the pauses of a schedule met, in one line for the report (`None`: no pause): how many,
/// how long in all, and how many running attempts a heartbeat found paused.
pub fn pause_summary(f: &Facts) -> Option<String> {
    if f.pauses.is_empty() {
        return None;
    }
    let last = f.run_log.iter().map(|w| w.at).max().unwrap_or_default();
    let held: f64 = f
        .pauses
        .iter()
        .map(|p| secs(p.from, p.to.unwrap_or(last)).max(0.0))
        .sum();
    let stopped: BTreeSet<(&Key, Option<i32>)> = f
        .run_log
        .iter()
        .filter(|w| w.renews() && !w.progress)
        .filter(|w| {
            f.pauses
                .iter()
                .any(|p| p.job == w.key.job && p.holds_at(w.xact_at))
        })
        .map(|w| (&w.key, w.new_attempt))
        .collect();
    Some(format!(
        "{} pauses, {held:.1} s in all; {} running attempts found paused at a heartbeat",
        f.pauses.len(),
        stopped.len()
    ))
}

fn check_pauses(f: &Facts, out: &mut Vec<Violation>) {
    for p in &f.pauses {
        let during = |t: DateTime<Utc>| p.holds_at(t);
        let until =
            p.to.map(|to| format!("{:.2} s later", secs(p.from, to)))
                .unwrap_or_else(|| "never".into());
        // A claim looks for the pause first thing in its transaction: one that began while the
        // job was paused must have found it.
        for w in f
            .run_log
            .iter()
            .filter(|w| w.key.job == p.job && w.wins() && during(w.xact_at))
        {
            out.push(violation(
                "pauses",
                format!(
                    "attempt {} of {} was claimed while {} was paused: its transaction began {:.2} s \
                     after the pause was in force (resumed: {until})",
                    w.new_attempt.unwrap_or_default(),
                    w.key,
                    p.job,
                    secs(p.from, w.xact_at)
                ),
            ));
        }
        // A run in flight: its first heartbeat that began while paused found the pause; its
        // runner starts no batch once it knows, so at most the one it may begin meanwhile.
        let mut attempts: BTreeMap<(&Key, i32), Vec<&RunWrite>> = BTreeMap::new();
        for w in f
            .run_log
            .iter()
            .filter(|w| w.key.job == p.job && w.renews())
        {
            if let Some(attempt) = w.new_attempt {
                attempts.entry((&w.key, attempt)).or_default().push(w);
            }
        }
        for ((key, attempt), writes) in attempts {
            let Some(found) = writes
                .iter()
                .find(|w| !w.progress && during(w.xact_at))
                .map(|w| w.at)
            else {
                continue;
            };
            let after: Vec<&&RunWrite> = writes
                .iter()
                .filter(|w| w.progress && w.xact_at > found)
                .collect();
            if after.len() > 1 {
                out.push(violation(
                    "pauses",
                    format!(
                        "attempt {attempt} of {key} began {} batches after its heartbeat found {} \
                         paused ({:.2} s into the pause; batches began {:?} s after it, \
                         transactions {:?})",
                        after.len(),
                        p.job,
                        secs(p.from, found),
                        after
                            .iter()
                            .map(|w| (secs(found, w.xact_at) * 100.0).round() / 100.0)
                            .collect::<Vec<_>>(),
                        after.iter().map(|w| w.txid).collect::<Vec<_>>()
                    ),
                ));
            }
        }
    }
}

/// Whether a request's shard is where it may end: served, or failed by a refusal (its month pinned
/// to another rule, or held by a correction). The `requests` check and the quiesce both ask this.
pub fn request_shard_at_rest(state: &str, detail: Option<&str>) -> bool {
    let refused = detail.is_some_and(|d| d.contains("pinned to") || d.contains("correct"));
    state == "succeeded" || (state == "failed" && refused)
}

fn check_request_shards(f: &Facts, out: &mut Vec<Violation>) {
    let mut served: BTreeMap<(String, i32), usize> = BTreeMap::new();
    for e in &f.events {
        if let Some(request) = &e.request {
            if e.event == "claimed" || e.event == "forced" {
                *served.entry((request.clone(), e.key.shard)).or_default() += 1;
            }
        }
    }
    for s in &f.request_shards {
        let n = served
            .get(&(s.request.clone(), s.shard))
            .copied()
            .unwrap_or(0);
        if n > 1 {
            out.push(violation(
                "requests",
                format!(
                    "request {} (key {}) shard {}/{} started {n} attempts",
                    s.request, s.idempotency_key, s.shard, s.shards
                ),
            ));
        }
        if !request_shard_at_rest(&s.state, s.detail.as_deref()) {
            out.push(violation(
                "requests",
                format!(
                    "request {} (key {}) shard {}/{} left {}{}",
                    s.request,
                    s.idempotency_key,
                    s.shard,
                    s.shards,
                    s.state,
                    s.detail
                        .as_deref()
                        .map(|d| format!(": {d}"))
                        .unwrap_or_default()
                ),
            ));
        }
    }
}

fn check_requests_sent(world: &World, f: &Facts, out: &mut Vec<Violation>) {
    let requests = world.requests.lock().unwrap_or_else(|p| p.into_inner());
    for r in requests.iter() {
        if r.answers.is_empty() {
            out.push(violation(
                "requests",
                format!(
                    "request {} was never answered ({} tries)",
                    r.key, r.unanswered
                ),
            ));
            continue;
        }
        let first = &r.answers[0];
        if r.answers.iter().any(|a| a.0 != first.0 || a.1 != first.1) {
            out.push(violation(
                "requests",
                format!(
                    "request {} got different answers: {:?}",
                    r.key,
                    r.answers
                        .iter()
                        .map(|a| (a.0, one_line(&a.1, 120)))
                        .collect::<Vec<_>>()
                ),
            ));
        }
        let stored = f
            .request_shards
            .iter()
            .filter(|s| s.idempotency_key == r.key)
            .map(|s| s.request.clone())
            .collect::<BTreeSet<_>>();
        if first.0 == 202 && stored.len() != 1 {
            out.push(violation(
                "requests",
                format!(
                    "request {} was answered 202 but stored {} times",
                    r.key,
                    stored.len()
                ),
            ));
        }
    }
}

fn check_exits(world: &World, out: &mut Vec<Violation>) {
    use std::os::unix::process::ExitStatusExt;
    let procs = world.procs.lock().unwrap_or_else(|p| p.into_inner());
    let faults = world.faults.lock().unwrap_or_else(|p| p.into_inner());
    for p in procs.iter() {
        let Some((at, status)) = p.exited else {
            out.push(violation("exits", format!("{} never exited", p.label())));
            continue;
        };
        let log = std::fs::read_to_string(&p.log).unwrap_or_default();
        let last = log
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(|l| one_line(l, 300))
            .unwrap_or_default();
        if log.contains("panicked at") {
            out.push(violation(
                "exits",
                format!("{} panicked: {last}", p.label()),
            ));
            continue;
        }
        let sent = |name: &str| p.signals.iter().any(|(_, s)| s.starts_with(name));
        if let Some(signal) = status.signal() {
            // SIGTERM before settlementd installed its handler ends it by the signal.
            let ours = (signal == libc::SIGKILL && sent("KILL"))
                || (signal == libc::SIGTERM && sent("TERM") && !p.clean);
            if !ours {
                out.push(violation(
                    "exits",
                    format!("{} died of signal {signal}", p.label()),
                ));
            }
            continue;
        }
        let code = status.code().unwrap_or(-1);
        if code == 0 {
            continue;
        }
        if p.clean {
            out.push(violation(
                "exits",
                format!("{} (clean, untouched) exited {code}: {last}", p.label()),
            ));
            continue;
        }
        let refused = code == 3
            && matches!(p.role, Role::Run { .. } | Role::Correct { .. })
            && (log.contains("pinned to")
                || log.contains("being corrected")
                || log.contains("correct")
                || log.contains("is paused since"));
        // Stopped part-way by a pause the campaign made: exit 4, saying how much it wrote.
        let refused = refused
            || (code == 4
                && matches!(p.role, Role::Run { .. })
                && log.contains("is paused since")
                && log.contains("stopped after"));
        let faulted = sent("TERM")
            || sent("STOP")
            || faults
                .iter()
                .any(|f| f.target.map_or(true, |t| t == p.id) && f.from <= at && f.to >= p.started);
        if !(refused || faulted) {
            out.push(violation(
                "exits",
                format!(
                    "{} exited {code} with no fault to explain it: {last}",
                    p.label()
                ),
            ));
        }
    }
}

/// `text` on one line, at most `max` characters.
pub fn one_line(text: &str, max: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        format!("{}…", flat.chars().take(max).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn day(y: i32, m: u32, d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(y, m, d).unwrap()
    }

    fn rule() -> Rule {
        Rule {
            daily_rate_cents: 50,
            grace_days: 1,
            max_cents: 300,
        }
    }

    /// A tiny settled world: one month, one shard, loan 1 settled once at 100 cents (3 days
    /// late, 1 of grace), loan 2 held, loan 3 still out; the run's fenced progress in the same
    /// transaction, one claim, one SUCCESS.
    fn tiny() -> Facts {
        let oct = day(2026, 10, 1);
        let key = Key {
            job: "fine-settlement".into(),
            date: day(2026, 10, 31),
            shards: 1,
            shard: 0,
        };
        let at = |s: i64| DateTime::<Utc>::from_timestamp(1_790_000_000 + s, 0).unwrap();
        let mut loans = BTreeMap::new();
        loans.insert(
            1,
            Loan {
                id: 1,
                member: 7,
                due: Day::On(day(2026, 10, 10)),
                returned: Day::On(day(2026, 10, 13)),
                fine: 100,
                settled: true,
                seq: Some(1),
            },
        );
        loans.insert(
            2,
            Loan {
                id: 2,
                member: 8,
                due: Day::None,
                returned: Day::On(day(2026, 10, 13)),
                fine: 0,
                settled: false,
                seq: None,
            },
        );
        loans.insert(
            3,
            Loan {
                id: 3,
                member: 9,
                due: Day::On(day(2026, 10, 20)),
                returned: Day::None,
                fine: 0,
                settled: false,
                seq: None,
            },
        );
        let mut pins = BTreeMap::new();
        pins.insert(day(2026, 10, 31), Some(rule()));
        Facts {
            months: vec![oct],
            ttl_secs: 3.0,
            final_shards: 1,
            loans,
            loan_log: vec![LoanWrite {
                txid: 77,
                at: at(5),
                who: "settlementd".into(),
                op: 'U',
                loan: 1,
                old_settled: Some(false),
                new_settled: Some(true),
                old_at: None,
                new_at: Some(at(5)),
                old_fine: Some(0),
                new_fine: Some(100),
                old_seq: None,
                new_seq: Some(1),
                new_due: Day::On(day(2026, 10, 10)),
                new_returned: Day::On(day(2026, 10, 13)),
            }],
            journal: vec![JournalRow {
                id: 1,
                txid: Some(77),
                month: oct,
                kind: "settled".into(),
                shards: Some(1),
                attempt: Some(1),
                correction_key: None,
                entries: vec![Entry {
                    loan: 1,
                    seq: 1,
                    before: Some(0),
                    after: 100,
                    member: Some(7),
                }],
            }],
            run_log: vec![
                RunWrite {
                    txid: 70,
                    at: at(1),
                    xact_at: at(1),
                    key: key.clone(),
                    op: 'I',
                    old_status: None,
                    new_status: Some("RUNNING".into()),
                    old_attempt: None,
                    new_attempt: Some(1),
                    old_heartbeat: None,
                    old_owner: None,
                    owner: Some("p1".into()),
                    progress: false,
                },
                RunWrite {
                    txid: 77,
                    at: at(5),
                    xact_at: at(5),
                    key: key.clone(),
                    op: 'U',
                    old_status: Some("RUNNING".into()),
                    new_status: Some("RUNNING".into()),
                    old_attempt: Some(1),
                    new_attempt: Some(1),
                    old_heartbeat: Some(at(4)),
                    old_owner: Some("p1".into()),
                    owner: Some("p1".into()),
                    progress: true,
                },
                RunWrite {
                    txid: 78,
                    at: at(6),
                    xact_at: at(6),
                    key: key.clone(),
                    op: 'U',
                    old_status: Some("RUNNING".into()),
                    new_status: Some("SUCCESS".into()),
                    old_attempt: Some(1),
                    new_attempt: Some(1),
                    old_heartbeat: Some(at(5)),
                    old_owner: Some("p1".into()),
                    owner: Some("p1".into()),
                    progress: false,
                },
            ],
            runs: vec![(key.clone(), "SUCCESS".into(), 1)],
            pins,
            statements: BTreeMap::from([((day(2026, 10, 31), 7), (1, 100))]),
            events: vec![
                Event {
                    key: key.clone(),
                    event: "claimed".into(),
                    attempt: Some(1),
                    request: None,
                    at: at(1),
                    message: None,
                },
                Event {
                    key,
                    event: "succeeded".into(),
                    attempt: Some(1),
                    request: None,
                    at: at(6),
                    message: None,
                },
            ],
            ..Facts::default()
        }
    }

    fn checks_of(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|v| v.check).collect()
    }

    /// Asserts that `check` finds, among its violations of `f`, one whose facts say `needle`.
    fn assert_caught(f: &Facts, check: &str, needle: &str) {
        let caught = super::check(f);
        assert!(
            caught
                .iter()
                .any(|v| v.check == check && v.facts.contains(needle)),
            "{caught:?}"
        );
    }

    #[test]
    fn the_fine_is_days_late_past_the_grace_times_the_rate_capped() {
        assert_eq!(fine_of(&rule(), day(2026, 10, 10), day(2026, 10, 13)), 100);
        assert_eq!(fine_of(&rule(), day(2026, 10, 10), day(2026, 10, 11)), 0);
        assert_eq!(fine_of(&rule(), day(2026, 10, 10), day(2026, 10, 1)), 0);
        assert_eq!(fine_of(&rule(), day(2026, 1, 10), day(2026, 10, 1)), 300);
    }

    #[test]
    fn a_tiny_settled_world_passes() {
        assert_eq!(check(&tiny()), vec![]);
    }

    /// Campaign seed 10 (CI of 5267ed5): libraryd reloaded loan 1 (deleted, inserted unsettled,
    /// returned in another month), then a correction moved it: the journal took the record's 100
    /// out of the old month and wrote the corrected 130 in the new one, and the adjustment says
    /// 0 → 130, what the row held. A checker that read the old cents off the first entry called
    /// that adjustment missing from the journal.
    #[test]
    fn a_corrections_adjustment_is_matched_to_what_the_loans_row_held_before_it() {
        let mut f = tiny();
        let sep = day(2026, 9, 1);
        let entry = |seq, before, after| Entry {
            loan: 1,
            seq,
            before: Some(before),
            after,
            member: Some(7),
        };
        for (id, month, kind, e) in [
            (2, sep, "reversed", entry(2, 100, 0)),
            (3, day(2026, 10, 1), "corrected", entry(3, 0, 130)),
        ] {
            f.journal.push(JournalRow {
                id,
                txid: Some(95),
                month,
                kind: kind.into(),
                shards: Some(1),
                attempt: Some(2),
                correction_key: Some("k".into()),
                entries: vec![e],
            });
        }
        let mut write = f.loan_log[0].clone();
        write.txid = 95;
        f.loan_log.push(write);
        // The row reloaded: unsettled, fine 0, before the correction's transaction.
        f.adjustments = vec![("k".into(), 1, 0, 130)];
        assert_eq!(adjustments_off_the_journal(&f), Vec::<String>::new());
        // The same adjustment claiming the record's 100 as the row's is not what happened.
        f.adjustments = vec![("k".into(), 1, 100, 130)];
        assert_eq!(
            adjustments_off_the_journal(&f),
            vec!["correction k's adjustment of loan 1 (100 -> 130) is not on the journal"]
        );
        // A moved loan whose row was still settled at 100: 100 → 130.
        let moved = f.loan_log.last_mut().unwrap();
        moved.old_settled = Some(true);
        moved.old_fine = Some(100);
        assert_eq!(adjustments_off_the_journal(&f), Vec::<String>::new());
        // A new cents the journal does not end at.
        f.adjustments = vec![("k".into(), 1, 100, 140)];
        assert_eq!(adjustments_off_the_journal(&f).len(), 1);
    }

    #[test]
    fn a_stale_or_missing_member_statement_is_caught() {
        let mut f = tiny();
        f.statements.insert((day(2026, 10, 31), 7), (1, 50));
        assert_caught(
            &f,
            "statements",
            "member 7 in 2026-10-31: the statement says 1 fines, 50",
        );
        f.statements.clear();
        assert_caught(
            &f,
            "statements",
            "the statement says none, the loans 1 fines, 100 cents",
        );
        let mut f = tiny();
        f.statements.insert((day(2026, 10, 31), 8), (1, 10));
        assert_caught(&f, "statements", "member 8");
    }

    #[test]
    fn a_wrong_fine_is_caught() {
        let mut f = tiny();
        f.loans.get_mut(&1).unwrap().fine = 150;
        assert!(checks_of(&check(&f)).contains(&"fines"));
    }

    #[test]
    fn a_second_settlement_of_a_settled_loan_is_caught() {
        let mut f = tiny();
        let mut again = f.loan_log[0].clone();
        again.txid = 90;
        again.old_settled = Some(true);
        again.old_at = again.new_at;
        again.new_at = Some(again.new_at.unwrap() + chrono::TimeDelta::seconds(9));
        again.old_fine = Some(100);
        again.old_seq = Some(1);
        again.new_seq = Some(2);
        f.loan_log.push(again);
        let mut row = f.journal[0].clone();
        row.id = 2;
        row.txid = Some(90);
        row.entries = vec![Entry {
            loan: 1,
            seq: 2,
            before: Some(100),
            after: 100,
            member: Some(7),
        }];
        f.journal.push(row);
        f.loans.get_mut(&1).unwrap().seq = Some(2);
        assert_caught(&f, "transitions", "settled twice");
    }

    #[test]
    fn money_left_on_the_old_member_or_month_is_caught_by_the_balance() {
        // The loan's entry names another member than the loan's: member 8's money in October
        // that no loan of 8 holds, and member 7's fine with no entry.
        let mut f = tiny();
        f.journal[0].entries[0].member = Some(8);
        assert_caught(&f, "balance", "member Some(8)");
        // The same money in the wrong month.
        let mut f = tiny();
        f.journal[0].month = day(2026, 9, 1);
        assert_caught(&f, "balance", "2026-09-01");
    }

    #[test]
    fn a_write_without_its_fence_is_caught() {
        let mut f = tiny();
        f.run_log.remove(1);
        assert!(checks_of(&check(&f)).contains(&"fences"));
    }

    #[test]
    fn a_takeover_of_a_live_lease_is_caught() {
        let mut f = tiny();
        let mut stolen = f.run_log[1].clone();
        stolen.txid = 99;
        stolen.new_attempt = Some(2);
        stolen.at = stolen.old_heartbeat.unwrap() + chrono::TimeDelta::seconds(1);
        f.run_log.push(stolen);
        assert!(checks_of(&check(&f)).contains(&"leases"));
    }

    #[test]
    fn a_held_row_or_a_loan_still_out_settled_is_caught() {
        let mut f = tiny();
        f.loans.get_mut(&2).unwrap().settled = true;
        f.loans.get_mut(&3).unwrap().settled = true;
        let v = check(&f);
        assert!(
            v.iter().any(|v| v.facts.starts_with("held rows settled")),
            "{v:?}"
        );
        assert!(
            v.iter()
                .any(|v| v.facts.starts_with("loans still out settled")),
            "{v:?}"
        );
    }

    /// The tiny world's clock: second `s` of it.
    fn at(s: i64) -> DateTime<Utc> {
        DateTime::<Utc>::from_timestamp(1_790_000_000 + s, 0).unwrap()
    }

    /// The fine settlement paused from second `from` to second `to` of the tiny world.
    fn paused(from: i64, to: Option<i64>) -> Paused {
        Paused {
            job: "fine-settlement".into(),
            from: at(from),
            to: to.map(at),
        }
    }

    /// A write of the tiny world's run that only renews its lease (a heartbeat) at second `s`, or
    /// with `progress`, a batch's fenced write begun then.
    fn renewal(f: &Facts, txid: i64, s: i64, progress: bool) -> RunWrite {
        RunWrite {
            txid,
            at: at(s),
            xact_at: at(s),
            old_heartbeat: Some(at(s - 1)),
            progress,
            ..f.run_log[1].clone()
        }
    }

    #[test]
    fn a_claim_won_while_its_job_was_paused_is_caught() {
        let mut f = tiny();
        f.pauses = vec![paused(2, Some(3))];
        assert_eq!(
            check(&f),
            vec![],
            "a pause after the claim, heard by no heartbeat"
        );
        f.pauses = vec![paused(0, Some(3))];
        assert_caught(&f, "pauses", "claimed while");
    }

    #[test]
    fn a_run_that_begins_batches_after_its_heartbeat_found_the_pause_is_caught() {
        let mut f = tiny();
        f.pauses = vec![paused(2, None)];
        // The heartbeat at 3 finds the pause; the batch begun at 5 may be the one its runner
        // started before the answer came back.
        let beat = renewal(&f, 73, 3, false);
        f.run_log.insert(1, beat);
        assert_eq!(check(&f), vec![]);
        // A second batch after it: the run went on.
        let batch = renewal(&f, 74, 4, true);
        f.run_log.insert(2, batch);
        assert_caught(&f, "pauses", "2 batches after");
    }

    #[test]
    fn a_pause_left_at_the_end_is_caught() {
        let mut f = tiny();
        f.paused_left = vec!["fine-settlement".into()];
        assert!(checks_of(&check(&f)).contains(&"open"));
    }

    #[test]
    fn the_pause_log_pairs_each_pause_with_the_next_resume_of_its_job() {
        let row = |op: &str, job: &str, s: i64, seen: Option<i64>| {
            (op.to_string(), job.to_string(), at(s), seen.map(at))
        };
        let windows = pause_windows(&[
            row("I", "fine-settlement", 1, Some(2)),
            row("I", "retention", 1, Some(2)),
            row("D", "fine-settlement", 5, None),
            // Never seen committed by the campaign: no window, and its resume closes nothing.
            row("I", "fine-settlement", 6, None),
            row("D", "fine-settlement", 7, None),
            row("I", "fine-settlement", 8, Some(9)),
        ]);
        let got: Vec<String> = windows
            .iter()
            .map(|p| format!("{} {} {:?}", p.job, p.from, p.to))
            .collect();
        let want =
            |job: &str, from: i64, to: Option<i64>| format!("{job} {} {:?}", at(from), to.map(at));
        assert_eq!(
            got,
            [
                want("fine-settlement", 2, Some(5)),
                want("retention", 2, None),
                want("fine-settlement", 9, None),
            ]
        );
    }

    /// `tiny` with its attempt 1 taken over at 3 s (its heartbeat 1 s old, lease 3 s) by attempt 2
    /// of `owner`, whose `took_over` event says `message`; attempt 2 then ends SUCCESS.
    fn taken_over_live(owner: &str, message: &str) -> Facts {
        let mut f = tiny();
        let key = f.run_log[0].key.clone();
        f.run_log.truncate(1);
        f.run_log.push(RunWrite {
            txid: 80,
            at: at(3),
            xact_at: at(3),
            key: key.clone(),
            op: 'U',
            old_status: Some("RUNNING".into()),
            new_status: Some("RUNNING".into()),
            old_attempt: Some(1),
            new_attempt: Some(2),
            old_heartbeat: Some(at(2)),
            old_owner: Some("p1".into()),
            owner: Some(owner.into()),
            progress: false,
        });
        f.run_log.push(RunWrite {
            txid: 77,
            at: at(5),
            old_attempt: Some(2),
            new_attempt: Some(2),
            old_heartbeat: Some(at(3)),
            old_owner: Some(owner.into()),
            progress: true,
            ..f.run_log[1].clone()
        });
        f.run_log.push(RunWrite {
            txid: 78,
            at: at(6),
            new_status: Some("SUCCESS".into()),
            old_heartbeat: Some(at(5)),
            progress: false,
            ..f.run_log[2].clone()
        });
        f.journal[0].attempt = Some(2);
        f.runs = vec![(key.clone(), "SUCCESS".into(), 2)];
        f.events.insert(
            1,
            Event {
                key,
                event: "took_over".into(),
                attempt: Some(2),
                request: None,
                at: at(3),
                message: Some(message.into()),
            },
        );
        f.events[2].attempt = Some(2);
        f
    }

    #[test]
    fn a_live_lease_taken_over_is_caught_unless_its_own_owner_had_ended_it() {
        let own = format!("attempt 1 {}", settlementd::job_layer::claim::OWN_MARK);
        assert_eq!(check(&taken_over_live("p1", &own)), vec![]);
        // Another owner, whatever its event says; the same owner without the rule's word.
        assert_caught(
            &taken_over_live("p2", &own),
            "leases",
            "took over a live lease",
        );
        assert_caught(
            &taken_over_live("p1", "resumes after 1"),
            "leases",
            "took over a live lease",
        );
        // Its own attempt, whose run went on: the fence refused its next write.
        let mut f = taken_over_live("p1", &own);
        let key = f.events[0].key.clone();
        f.events.insert(
            2,
            Event {
                key,
                event: "fencing_rejected".into(),
                attempt: Some(1),
                request: None,
                at: at(4),
                message: Some("batch refused: the claim was taken over by a later attempt".into()),
            },
        );
        assert_caught(&f, "leases", "while that run went on");
    }

    #[test]
    fn an_attempt_claimed_twice_is_caught() {
        let mut f = tiny();
        let twice = f.events[0].clone();
        f.events.push(twice);
        assert!(checks_of(&check(&f)).contains(&"claims"));
    }
}
