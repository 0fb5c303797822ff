//! Is a month's money right? Proved from the money journal and the loans by primary key, so the
//! cost follows the month, not the table.
//!
//! A month is right when
//! - every loan whose last journal entry is in the month agrees with it: settled with the entry's
//!   fine (a fine edited by hand, or NULL, does not), still returned in the month on the dates the
//!   entry priced (a loan moved by an edit that was never queued does not);
//! - that fine is the month's rule's for the loan's dates;
//! - no return of the month is left unsettled, none is held, no edit of one of its loans waits to
//!   be re-priced, and no settled loan of it lacks a journal entry;
//! - the journal's chain is whole for its loans: each entry continued the one before it (seq one
//!   more, `before` the previous `after`, checked as it was appended and kept in the loan's head,
//!   `fine_heads`), a settled row is at its head's seq, and no settled loan is gone without its
//!   deletion recorded (one whose return was undone owes nothing).
//!
//! The rule is the month's pinned one ([`crate::job_layer::params`]); a month claimed before pins
//! existed is checked against the rule the configuration gives it, and the report says so. A
//! configured rule that differs from the pin is named (a replica with it is refused; `correct`
//! would apply it).

use super::{describe_params, rule_from_params, rule_of, MonthTotals, HELD_ROW, MONTH_KEY_L};
use crate::calendar::BusinessDate;
use crate::fine::{FineRule, FineSchedule};
use crate::job_layer::{params, JobError, ProveError, Report, HELD_IDS};
use sqlx::{Connection, Executor, PgConnection};
use std::fmt::Write;

/// Where the rule a month was checked against came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleSource {
    /// Pinned by the month's first claim (or its last correction).
    Pinned,
    /// The month has no pin (claimed before pins existed, or never): the configuration's rule.
    Configuration,
}

/// A settled loan whose fine is not what the rule gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    pub id: i64,
    /// `None`: the stored fine is NULL.
    pub stored_cents: Option<i64>,
    pub expected_cents: i64,
}

/// Loans found in one kind of trouble: how many, and the first [`HELD_IDS`] by id.
pub use crate::job_layer::Found;

/// What [`verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    pub business_date: String,
    pub rule: FineRule,
    pub rule_source: RuleSource,
    /// The configuration's rule for the month, when it is not the one checked against.
    pub configured: Option<FineRule>,
    /// Loans returned in the month: settled ones, unsettled ones and held ones.
    pub returned: i64,
    pub totals: MonthTotals,
    /// Settled loans whose fine differs from the rule: how many, the sum of (stored − expected),
    /// and the first [`HELD_IDS`] by id.
    pub mismatched: i64,
    pub mismatch_cents: i128,
    pub mismatches: Vec<Mismatch>,
    /// Returns of the month not settled yet that the rule can price.
    pub unsettled: Found,
    /// Returns of the month the rule cannot price (due date missing or infinite), left unsettled.
    pub held: Found,
    /// Loans whose stored fine is not what their last journal entry says (edited by hand, NULL,
    /// unsettled or settled behind settlementd's back).
    pub off_journal: Found,
    /// Loans whose dates are no longer those their last entry priced (moved out of the month, a
    /// due date changed) with no edit queued: changed while the edit triggers were off.
    pub stale: Found,
    /// Loans whose chain has an entry that did not continue it, whose settled row is not at the
    /// record's last entry (its `fine_seq` written or restored outside settlementd), or that are
    /// gone without their deletion recorded.
    pub broken: Found,
    /// Loans of the month with edits waiting to be re-priced.
    pub edits_waiting: Found,
    /// Settled loans of the month without any journal entry.
    pub unjournaled: Found,
    /// What the month's journal entries net to (each entry's after − before), and the fines its
    /// loans hold on the record (their last entries in the month): equal when the month's journal
    /// balances — money that left the month (another return date, a deletion, another member)
    /// was reversed out of it, and money that came in was settled in it.
    pub journal_net_cents: i128,
    pub record_cents: i128,
    /// settlementd's triggers on `loans` that are missing, disabled or changed
    /// ([`crate::db::Guards`]): libraryd's edits of settled loans are not queued while they are,
    /// so the record may no longer follow the loans, whatever else this month shows.
    pub loans_triggers: Vec<String>,
}

impl Verification {
    /// Every settled fine is its journal entry's and the rule's, nothing is left unsettled,
    /// waiting or held, and the journal is whole.
    pub fn is_right(&self) -> bool {
        self.mismatched == 0
            && self.journal_net_cents == self.record_cents
            && [
                &self.unsettled,
                &self.held,
                &self.off_journal,
                &self.stale,
                &self.broken,
                &self.edits_waiting,
                &self.unjournaled,
            ]
            .iter()
            .all(|f| f.count == 0)
            && self.loans_triggers.is_empty()
    }

}

/// Checks the month of `business_date` against its pinned rule, or, when it has none, against the
/// rule `rules` give it. `Err(Ok(why))`: no rule to check against (configuration); `Err(Err(e))`
/// a database error.
///
/// With a `helper` connection, the month's journal is read in two halves at once, one on each
/// connection, in one snapshot (exported by `conn`'s transaction): the probes of the loans and
/// their heads are most of a verify's time, and they split evenly.
pub async fn verify(
    conn: &mut PgConnection,
    helper: Option<&mut PgConnection>,
    business_date: BusinessDate,
    rules: &FineSchedule,
) -> Result<Verification, ProveError> {
    let configured = rule_of(rules, business_date.date()).map(|r| r.rule);
    let pinned = match params::pinned(&mut *conn, super::JOB_NAME, business_date.date()).await {
        Ok(pinned) => pinned,
        Err(JobError::Db(e)) => return Err(ProveError::Db(e)),
        Err(e) => return Err(ProveError::Cannot(e.to_string())),
    };
    let (rule, rule_source) = match pinned {
        Some(p) => match rule_from_params(&p) {
            Some(rule) => (rule, RuleSource::Pinned),
            None => {
                return Err(ProveError::Cannot(format!(
                    "{business_date} is pinned to parameters this version cannot read: {}",
                    describe_params(&p)
                )))
            }
        },
        None => (
            configured.clone().map_err(ProveError::Cannot)?,
            RuleSource::Configuration,
        ),
    };
    let configured = configured.ok().filter(|c| *c != rule);
    Ok(read(conn, helper, business_date, rule, rule_source, configured).await?)
}

async fn read(
    conn: &mut PgConnection,
    helper: Option<&mut PgConnection>,
    business_date: BusinessDate,
    rule: FineRule,
    rule_source: RuleSource,
    configured: Option<FineRule>,
) -> sqlx::Result<Verification> {
    // One snapshot for every statement (on both connections); loans reached by primary key or
    // the month index only.
    let mut tx = conn
        .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .await?;
    tx.execute(PLAN).await?;
    let month = business_date.first_day();
    let journal = match helper {
        None => journal_side(&mut tx, business_date, &rule, None).await?,
        Some(helper) => {
            let snapshot: String = sqlx::query_scalar("SELECT pg_export_snapshot()")
                .fetch_one(&mut *tx)
                .await?;
            let mut other = helper
                .begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                .await?;
            // The snapshot's name is PostgreSQL's own (hex digits and dashes), never input.
            other
                .execute(format!("SET TRANSACTION SNAPSHOT '{snapshot}'").as_str())
                .await?;
            other.execute(PLAN).await?;
            let (first, second) = tokio::join!(
                journal_side(&mut tx, business_date, &rule, Some(0)),
                journal_side(&mut other, business_date, &rule, Some(1)),
            );
            other.rollback().await?;
            first?.and(second?)
        }
    };
    let mut journal = journal;
    let totals = journal.totals();
    let (unsettled, held) = unsettled_side(&mut tx, business_date).await?;
    let edits_waiting = edits_side(&mut tx, business_date).await?;
    let unjournaled: (i64, Option<Vec<i64>>) = sqlx::query_as(&format!(
        "SELECT count(*), (array_agg(id ORDER BY id))[1:{HELD_IDS}] FROM (
             SELECT l.id::bigint AS id FROM loans l
              WHERE l.fine_settled_at IS NOT NULL AND l.fine_seq IS NULL
                AND l.returned_on BETWEEN $1 AND $2) u"
    ))
    .bind(month)
    .bind(business_date.date())
    .fetch_one(&mut *tx)
    .await?;
    let loans_triggers = crate::db::guards(&mut tx)
        .await
        .map_err(|e| match e {
            crate::db::DbError::Query(e) => e,
            other => sqlx::Error::Protocol(other.to_string()),
        })?
        .loans_triggers;
    tx.rollback().await?;
    Ok(Verification {
        business_date: business_date.to_string(),
        rule,
        rule_source,
        configured,
        returned: totals.settled_rows + unsettled.count + held.count,
        totals,
        mismatched: journal.mismatched,
        mismatch_cents: journal.mismatch_cents,
        mismatches: journal.mismatches,
        unsettled,
        held,
        off_journal: journal.off_journal,
        stale: journal.stale,
        broken: journal.broken,
        edits_waiting,
        unjournaled: Found::new(unjournaled.0, unjournaled.1),
        journal_net_cents: journal.journal_net_cents,
        record_cents: journal.record_cents,
        loans_triggers,
    })
}

/// The plan settings of a verify's transaction: nested loops over primary keys, as the month's
/// size asks for whatever the statistics say, and no memoize (every probe is of another loan).
const PLAN: &str = "SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off;
     SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off;
     SET LOCAL enable_memoize = off; SET LOCAL jit = off; SET LOCAL work_mem = '64MB'";

/// What the month's journal entries (all, or one half of its rows) and their loans say.
struct JournalSide {
    /// The settled loans' ids and fines, in no order.
    settled: Vec<(i64, Option<i64>)>,
    mismatched: i64,
    mismatch_cents: i128,
    mismatches: Vec<Mismatch>,
    off_journal: Found,
    stale: Found,
    broken: Found,
    /// What the month's entries net to (each one's after − before).
    journal_net_cents: i128,
    /// What its loans hold on the record: the fines of the entries that are their loans' heads.
    record_cents: i128,
}

impl JournalSide {
    /// Both halves of the month's journal rows as one. Every finding is of a loan's current entry,
    /// in exactly one journal row: the halves never count a loan twice, and the first ids of the
    /// whole are the first of the two halves' first ids.
    fn and(mut self, other: JournalSide) -> JournalSide {
        fn first(mut a: Vec<i64>, b: Vec<i64>) -> Vec<i64> {
            a.extend(b);
            a.sort_unstable();
            a.truncate(HELD_IDS);
            a
        }
        let found = |a: Found, b: Found| Found {
            count: a.count + b.count,
            ids: first(a.ids, b.ids),
        };
        self.settled.extend(other.settled);
        self.mismatches.extend(other.mismatches);
        self.mismatches.sort_unstable_by_key(|m| m.id);
        self.mismatches.truncate(HELD_IDS);
        JournalSide {
            settled: self.settled,
            mismatched: self.mismatched + other.mismatched,
            mismatch_cents: self.mismatch_cents + other.mismatch_cents,
            mismatches: self.mismatches,
            off_journal: found(self.off_journal, other.off_journal),
            stale: found(self.stale, other.stale),
            broken: found(self.broken, other.broken),
            journal_net_cents: self.journal_net_cents + other.journal_net_cents,
            record_cents: self.record_cents + other.record_cents,
        }
    }

    /// The month's totals, from the settled loans the sides found.
    fn totals(&mut self) -> MonthTotals {
        totals_of(std::mem::take(&mut self.settled))
    }
}

/// The month's journal entries joined to their heads and loans by primary key: each entry that is
/// its loan's last on the record (its head, `fine_heads`) is checked; earlier ones are history (the
/// loan was re-priced, or moved on to another month).
///
/// `half`: only the journal rows whose id has this parity (`None`: every row).
async fn journal_side(
    tx: &mut PgConnection,
    business_date: BusinessDate,
    rule: &FineRule,
    half: Option<i64>,
) -> sqlx::Result<JournalSide> {
    let half = match half {
        Some(parity) => format!("AND j.id % 2 = {parity}"),
        None => String::new(),
    };
    let fine = FineRule::sql_params(3);
    let in_month = "l_ret BETWEEN $1 AND $2";
    // The loan's last entry on the record (its head, `fine_heads`), of a loan still in `loans`,
    // of a kind that prices.
    let priced = "cur AND present AND kind NOT IN ('reversed', 'deleted')";
    let settled = format!("{priced} AND l_settled AND l_seq = h_seq AND {in_month}");
    let differs = format!("{settled} AND NOT l_held AND l_fine IS DISTINCT FROM expected");
    // The row against its last entry: settled with the entry's fine, or unsettled after a
    // reversal or deletion (an unsettled loan's fine_cents is not money).
    let off_journal = "cur AND present
         AND CASE WHEN kind IN ('reversed', 'deleted') THEN l_settled
                  ELSE NOT l_settled OR l_fine IS DISTINCT FROM after_cents END";
    // The subqueries run only for the rare rows the cheap conditions leave (CASE keeps the order).
    let queued = "EXISTS (SELECT 1 FROM loan_changes q WHERE q.loan_id = c.loan_id)";
    let stale = format!(
        "CASE WHEN {priced} AND (l_ret IS DISTINCT FROM returned_on OR l_due IS DISTINCT FROM due_on
                                 OR NOT {in_month})
              THEN NOT {queued} ELSE false END"
    );
    // The chain: every entry continued the one before it (its seq one more, its before the
    // previous after: checked as each entry is appended, kept in the head); a settled row is at
    // the record's last entry (not a seq libraryd wrote or restored); a loan gone from `loans`
    // has its deletion recorded or queued, or owed nothing (its return undone).
    let broken = format!(
        "(cur AND h_breaks > 0)
         OR (cur AND present AND l_settled AND l_seq IS DISTINCT FROM h_seq)
         OR CASE WHEN cur AND NOT present AND kind NOT IN ('reversed', 'deleted')
                 THEN NOT {queued} ELSE false END"
    );
    let sql = format!(
        "WITH e AS (
             SELECT j.id AS jid, j.kind, x.loan_id, x.seq, x.due_on, x.returned_on,
                    x.before_cents, x.after_cents
               FROM fine_journal j,
                    unnest(j.loan_ids, j.seqs, j.due_on, j.returned_on, j.before_cents,
                           j.after_cents)
                      AS x(loan_id, seq, due_on, returned_on, before_cents, after_cents)
              WHERE j.month = $1 {half}
         ), c AS (
             SELECT e.kind, e.loan_id, e.seq, e.due_on, e.returned_on, e.before_cents,
                    e.after_cents,
                    h.journal_id IS NOT DISTINCT FROM e.jid AS cur, h.seq AS h_seq,
                    h.breaks AS h_breaks,
                    l.id IS NOT NULL AS present, l.fine_seq AS l_seq,
                    l.fine_cents::bigint AS l_fine, l.fine_settled_at IS NOT NULL AS l_settled,
                    l.due_on AS l_due, l.returned_on AS l_ret,
                    {HELD_ROW} AS l_held,
                    CASE WHEN {HELD_ROW} OR l.returned_on IS NULL OR NOT isfinite(l.returned_on)
                         THEN NULL ELSE {fine} END AS expected
               FROM e LEFT JOIN fine_heads h ON h.loan_id = e.loan_id
                      LEFT JOIN loans l ON l.id = e.loan_id
         ), f AS (
             -- Each entry's verdicts, computed once (OFFSET 0 keeps the subquery a fence: the
             -- aggregates below read its columns instead of re-evaluating each condition).
             SELECT loan_id, l_fine, expected, before_cents, after_cents,
                    cur AND kind NOT IN ('reversed', 'deleted') AS on_record,
                    {settled} AS settled, {differs} AS differs,
                    {off_journal} AS off_journal, {stale} AS stale, {broken} AS broken
               FROM c OFFSET 0
         )
         SELECT array_agg(loan_id) FILTER (WHERE settled),
                array_agg(l_fine) FILTER (WHERE settled),
                count(*) FILTER (WHERE differs),
                COALESCE(sum(COALESCE(l_fine, 0)::numeric - expected)
                         FILTER (WHERE differs), 0)::text,
                (array_agg(loan_id ORDER BY loan_id) FILTER (WHERE differs))[1:{HELD_IDS}],
                (array_agg(l_fine ORDER BY loan_id) FILTER (WHERE differs))[1:{HELD_IDS}],
                (array_agg(expected ORDER BY loan_id) FILTER (WHERE differs))[1:{HELD_IDS}],
                count(DISTINCT loan_id) FILTER (WHERE off_journal),
                (array_agg(DISTINCT loan_id) FILTER (WHERE off_journal))[1:{HELD_IDS}],
                count(DISTINCT loan_id) FILTER (WHERE stale),
                (array_agg(DISTINCT loan_id) FILTER (WHERE stale))[1:{HELD_IDS}],
                count(DISTINCT loan_id) FILTER (WHERE broken),
                (array_agg(DISTINCT loan_id) FILTER (WHERE broken))[1:{HELD_IDS}],
                COALESCE(sum(after_cents::numeric - COALESCE(before_cents, 0)), 0)::text,
                COALESCE(sum(after_cents) FILTER (WHERE on_record), 0)::text
           FROM f"
    );
    type Row = (
        Option<Vec<i64>>,
        Option<Vec<Option<i64>>>,
        i64,
        String,
        Option<Vec<i64>>,
        Option<Vec<Option<i64>>>,
        Option<Vec<i64>>,
        i64,
        Option<Vec<i64>>,
        i64,
        Option<Vec<i64>>,
        i64,
        Option<Vec<i64>>,
        String,
        String,
    );
    let row: Row = sqlx::query_as(&sql)
        .bind(business_date.first_day())
        .bind(business_date.date())
        .bind(rule.grace_days)
        .bind(rule.daily_rate_cents)
        .bind(rule.max_cents)
        .fetch_one(&mut *tx)
        .await?;
    let mismatches = row
        .4
        .unwrap_or_default()
        .into_iter()
        .zip(row.5.unwrap_or_default())
        .zip(row.6.unwrap_or_default())
        .map(|((id, stored_cents), expected_cents)| Mismatch {
            id,
            stored_cents,
            expected_cents,
        })
        .collect();
    let settled: Vec<(i64, Option<i64>)> = row
        .0
        .unwrap_or_default()
        .into_iter()
        .zip(row.1.unwrap_or_default())
        .collect();
    Ok(JournalSide {
        settled,
        mismatched: row.2,
        mismatch_cents: super::parse_sum(&row.3)?,
        mismatches,
        off_journal: Found::new(row.7, row.8),
        stale: Found::new(row.9, row.10),
        broken: Found::new(row.11, row.12),
        journal_net_cents: super::parse_sum(&row.13)?,
        record_cents: super::parse_sum(&row.14)?,
    })
}

/// The totals of settled `(id, fine)` pairs, in any order: their count, sum and digest (`md5` of
/// `id:fine` joined by `,` in id order, as [`super::month_totals`] computes it in SQL, which
/// leaves a NULL fine out of the sum and the digest). Sorted and hashed here rather than by an
/// ordered aggregate in the query: the same digest, without the query's sort and string building.
fn totals_of(mut settled: Vec<(i64, Option<i64>)>) -> MonthTotals {
    use md5::{Digest, Md5};
    settled.sort_unstable();
    let mut hasher = Md5::new();
    let mut entry = String::with_capacity(44);
    for (id, fine) in settled.iter().filter_map(|(id, fine)| Some((id, (*fine)?))) {
        // Writing to a String cannot fail.
        let _ = write!(entry, "{id}:{fine}");
        hasher.update(entry.as_bytes());
        entry.clear();
        entry.push(',');
    }
    MonthTotals {
        settled_rows: settled.len() as i64,
        fine_cents_sum: settled
            .iter()
            .filter_map(|(_, fine)| *fine)
            .map(i128::from)
            .sum(),
        digest: format!("{:x}", hasher.finalize()),
    }
}

/// The month's unsettled returns, from the month index: those the rule can price, and held ones.
async fn unsettled_side(
    tx: &mut PgConnection,
    business_date: BusinessDate,
) -> sqlx::Result<(Found, Found)> {
    type Row = (i64, Option<Vec<i64>>, i64, Option<Vec<i64>>);
    let (unsettled, unsettled_ids, held, held_ids): Row = sqlx::query_as(&format!(
        "SELECT count(*) FILTER (WHERE NOT held),
                (array_agg(id ORDER BY id) FILTER (WHERE NOT held))[1:{HELD_IDS}],
                count(*) FILTER (WHERE held),
                (array_agg(id ORDER BY id) FILTER (WHERE held))[1:{HELD_IDS}]
           FROM (SELECT l.id::bigint AS id, {HELD_ROW} AS held FROM loans l
                  WHERE {MONTH_KEY_L} = $1::date::timestamp
                    AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL) u"
    ))
    .bind(business_date.first_day())
    .fetch_one(&mut *tx)
    .await?;
    Ok((
        Found::new(unsettled, unsettled_ids),
        Found::new(held, held_ids),
    ))
}

/// Loans with edits waiting: queued under the month (their fine is in it), or settled elsewhere
/// and now returned in it.
async fn edits_side(tx: &mut PgConnection, business_date: BusinessDate) -> sqlx::Result<Found> {
    let (count, ids): (i64, Option<Vec<i64>>) = sqlx::query_as(&format!(
        "SELECT count(DISTINCT c.loan_id), (array_agg(DISTINCT c.loan_id))[1:{HELD_IDS}]
           FROM loan_changes c LEFT JOIN loans l ON l.id = c.loan_id
          WHERE c.month = $1 OR l.returned_on BETWEEN $1 AND $2"
    ))
    .bind(business_date.first_day())
    .bind(business_date.date())
    .fetch_one(&mut *tx)
    .await?;
    Ok(Found::new(count, ids))
}

/// A sum of cents as a JSON number, however large.
fn number(n: i128) -> serde_json::Value {
    n.to_string()
        .parse::<serde_json::Value>()
        .unwrap_or(serde_json::Value::Null)
}

/// The month's proof as `verify` shows it ([`Report::into_proof`]).
impl Report for Verification {
    /// What is wrong, in one line; `None` when the month is right.
    fn problems(&self) -> Option<String> {
        let mut parts = Vec::new();
        if !self.loans_triggers.is_empty() {
            parts.push(format!(
                "settlementd's triggers on loans are not as migrate left them, so libraryd's \
                 edits of settled loans are not queued: {}",
                self.loans_triggers.join("; ")
            ));
        }
        if self.journal_net_cents != self.record_cents {
            parts.push(format!(
                "the month's journal does not balance: its entries net {} cents, its loans hold {} \
                 cents on the record",
                self.journal_net_cents, self.record_cents
            ));
        }
        if self.mismatched > 0 {
            parts.push(format!(
                "{} settled fines differ from the rule (net {:+} cents)",
                self.mismatched, self.mismatch_cents
            ));
        }
        let named = |f: &Found, what: &str| {
            (f.count > 0).then(|| format!("{} {what}, ids {:?}", f.count, f.ids))
        };
        parts.extend(
            [
                named(&self.unsettled, "returns are not settled"),
                named(&self.held, "rows held (bad dates)"),
                named(
                    &self.off_journal,
                    "fines differ from their journal entry (edited outside settlementd)",
                ),
                named(
                    &self.stale,
                    "loans' dates changed after they were priced, with no edit queued",
                ),
                named(&self.broken, "loans whose journal chain is broken"),
                named(&self.edits_waiting, "edits wait to be re-priced"),
                named(&self.unjournaled, "settled loans have no journal entry"),
            ]
            .into_iter()
            .flatten(),
        );
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    /// The `verify --json` object.
    fn to_json(&self) -> serde_json::Value {
        let v = self;
        serde_json::json!({
            "job": super::JOB_NAME,
            "business_date": v.business_date,
            "right": v.is_right(),
            "rule": super::rule_params(&v.rule),
            "rule_source": v.rule_source,
            "configured_rule": v.configured.as_ref().map(super::rule_params),
            "returned": v.returned,
            "totals": v.totals,
            "mismatched": {
                "count": v.mismatched,
                "net_cents": v.mismatch_cents,
                "first": v.mismatches,
            },
            "unsettled": v.unsettled,
            "held": v.held,
            "loans_triggers": v.loans_triggers,
            "journal": {
                "net_cents": number(v.journal_net_cents),
                "record_cents": number(v.record_cents),
                "balanced": v.journal_net_cents == v.record_cents,
                "off_journal": v.off_journal,
                "stale": v.stale,
                "broken": v.broken,
                "edits_waiting": v.edits_waiting,
                "unjournaled": v.unjournaled,
            },
        })
    }

    /// What `verify` prints without `--json` (lines end with a newline).
    fn to_text(&self) -> String {
        let v = self;
        let mut out = String::new();
        // Writing to a String cannot fail.
        let verdict = if v.is_right() { "right" } else { "NOT RIGHT" };
        let _ = writeln!(
            out,
            "{} {}: {verdict}",
            super::JOB_NAME,
            v.business_date
        );
        let source = match v.rule_source {
            RuleSource::Pinned => "the month's pinned rule",
            RuleSource::Configuration => {
                "the month has no pinned rule: checked against the configuration's"
            }
        };
        let _ = writeln!(out, "rule: {} ({source})", v.rule);
        if let Some(configured) = &v.configured {
            let _ = writeln!(
                out,
                "the configuration gives this month another rule: {configured} (a replica with it is \
                 refused; `settlementd correct` would apply it)"
            );
        }
        let _ = writeln!(
            out,
            "returned in the month: {}; settled: rows={} fine_cents_sum={} digest={}",
            v.returned, v.totals.settled_rows, v.totals.fine_cents_sum, v.totals.digest
        );
        let _ = writeln!(
            out,
            "journal: its entries net {} cents, its loans hold {} cents on the record{}",
            v.journal_net_cents,
            v.record_cents,
            if v.journal_net_cents == v.record_cents {
                " (balanced)"
            } else {
                " (NOT BALANCED)"
            }
        );
        let _ = writeln!(
            out,
            "fines that differ from the rule: {} (net {:+} cents)",
            v.mismatched, v.mismatch_cents
        );
        for m in &v.mismatches {
            let stored = m.stored_cents.map_or("NULL".into(), |c| c.to_string());
            let _ = writeln!(
                out,
                "  loan {}: stored {stored} cents, the rule gives {}",
                m.id, m.expected_cents
            );
        }
        let found = |out: &mut String, what: &str, f: &Found| {
            let _ = writeln!(out, "{what}: {}", f.count);
            if !f.ids.is_empty() {
                let _ = writeln!(out, "  ids {:?}", f.ids);
            }
        };
        found(&mut out, "returns not settled", &v.unsettled);
        found(
            &mut out,
            "rows held (bad dates: due_on missing or infinite)",
            &v.held,
        );
        found(
            &mut out,
            "fines that differ from their journal entry (edited outside settlementd)",
            &v.off_journal,
        );
        found(
            &mut out,
            "loans whose dates changed after pricing with no edit queued",
            &v.stale,
        );
        found(&mut out, "loans whose journal chain is broken", &v.broken);
        found(&mut out, "edits waiting to be re-priced", &v.edits_waiting);
        found(
            &mut out,
            "settled loans without a journal entry",
            &v.unjournaled,
        );
        let _ = writeln!(
            out,
            "settlementd's triggers on loans not as migrate left them: {}",
            v.loans_triggers.len()
        );
        for which in &v.loans_triggers {
            let _ = writeln!(out, "  {which}");
        }
        out
    }

}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_md5_of_id_and_fine_in_id_order_whatever_order_they_come_in() {
        // md5("1:50,2:0,10:7") and md5(""), as PostgreSQL computes them.
        let totals = totals_of(vec![(10, Some(7)), (1, Some(50)), (2, Some(0))]);
        assert_eq!(totals.digest, "6659a05cce563eaa7a46c438b576dabf");
        assert_eq!((totals.settled_rows, totals.fine_cents_sum), (3, 57));
        assert_eq!(
            totals_of(Vec::new()).digest,
            "d41d8cd98f00b204e9800998ecf8427e"
        );
        let with_null = totals_of(vec![(3, None), (1, Some(5))]);
        assert_eq!((with_null.settled_rows, with_null.fine_cents_sum), (2, 5));
        assert_eq!(with_null.digest, totals_of(vec![(1, Some(5))]).digest);
    }

    fn side(ids: std::ops::Range<i64>, step: usize) -> JournalSide {
        let ids: Vec<i64> = ids.step_by(step).collect();
        let found = || {
            Found::new(
                ids.len() as i64,
                Some(ids.iter().take(HELD_IDS).copied().collect()),
            )
        };
        JournalSide {
            settled: ids.iter().map(|id| (*id, Some(*id))).collect(),
            mismatched: ids.len() as i64,
            mismatch_cents: ids.len() as i128,
            mismatches: ids
                .iter()
                .take(HELD_IDS)
                .map(|id| Mismatch {
                    id: *id,
                    stored_cents: Some(1),
                    expected_cents: 0,
                })
                .collect(),
            off_journal: found(),
            stale: found(),
            broken: found(),
            journal_net_cents: ids.iter().map(|id| i128::from(*id)).sum(),
            record_cents: ids.len() as i128,
        }
    }

    #[test]
    fn two_halves_of_the_journal_make_the_whole_counts_and_its_first_ids() {
        // Odd ids in one half, even in the other, as the two connections read them.
        let mut whole = side(1..101, 1);
        let mut halves = side(1..101, 2).and(side(2..101, 2));
        assert_eq!(halves.totals(), whole.totals());
        assert_eq!(
            (halves.mismatched, halves.mismatch_cents),
            (whole.mismatched, whole.mismatch_cents)
        );
        assert_eq!(halves.mismatches, whole.mismatches);
        assert_eq!(
            (halves.journal_net_cents, halves.record_cents),
            (whole.journal_net_cents, whole.record_cents)
        );
        for (half, all) in [
            (&halves.off_journal, &whole.off_journal),
            (&halves.stale, &whole.stale),
            (&halves.broken, &whole.broken),
        ] {
            assert_eq!((half.count, &half.ids), (100, &all.ids));
            assert_eq!(half.ids, (1..=20).collect::<Vec<i64>>());
        }
    }
}
