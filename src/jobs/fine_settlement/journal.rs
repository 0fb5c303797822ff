//! The money journal: every change settlementd makes to a fine, on the record, in the transaction
//! that makes it.
//!
//! `fine_journal` holds one row per batch and kind, its loans as parallel arrays (the
//! `fine_journal_entries` view reads it one entry per loan). Invariants, checked by `verify` and the
//! fault suite:
//! - every entry is written by the statement that changes the loan, so a fine never changes
//!   without its entry, nor an entry without its change;
//! - a loan's last entry is its head on the record (`fine_heads`, kept by a trigger on the journal
//!   for every writer), never found through libraryd's row: each entry continues the head (its seq
//!   the head's + 1, its `before_cents` the head's `after_cents`, 0 for a loan the journal does not
//!   know), and `loans.fine_seq` is set to the entry's seq, its `fine_cents` to its `after_cents`;
//! - an entry's month is the month whose money it is: the month the loan was priced in, or the
//!   month its fine is taken out of (reversed, deleted).
//!
//! Besides the settlement's own batches (`settled`, `late`: [`super::BatchSql`]) this module writes
//! the entries of libraryd's edits ([`reprice`] over `loan_changes`: `repriced`, `reversed`,
//! `deleted`), of corrections ([`reprice`] over a correction's loans: `corrected`, `reversed`), and
//! the opening entries of loans settled before the journal existed ([`open_unjournaled`]).
//!
//! **Edits of settled loans.** libraryd's triggers queue a change of a settled loan's `returned_on`
//! or `due_on`, and its deletion, in `loan_changes`, in libraryd's own transaction, under the month
//! the loan's fine is in. The run (or sweep) of that month and shard re-prices the loans whose
//! earliest queued change is in the month, under the month's pinned rule: a loan still returned in
//! the month with dates the rule can price gets the rule's fine for its new dates (`repriced`); one
//! whose return was undone, that moved to another month, or whose due date the rule cannot price
//! any more, is unsettled again with fine 0 (`reversed`) — an ordinary unsettled return of its new
//! month from then on, settled by that month's run as a late return, or held; a deleted loan's fine
//! is taken out (`deleted`). The queue rows of a loan go in the same transaction.

use crate::fine::FineRule;
use crate::mutant::{self, Mutant};
use chrono::NaiveDate;
use sqlx::{Connection, PgConnection};
use std::sync::OnceLock;

use super::{HELD_ROW, MONTH_KEY_L};

/// What an entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Settled by the month's run.
    Settled,
    /// Settled after the month closed (a late return).
    Late,
    /// A settled loan re-priced after libraryd changed its dates.
    Repriced,
    /// A settled loan unsettled again (fine 0): its return undone, moved to another month, or its
    /// due date made unpriceable.
    Reversed,
    /// A settled loan deleted in libraryd: its fine taken out.
    Deleted,
    /// Changed by `settlementd correct`.
    Corrected,
    /// A loan settled before the journal existed, as it was found.
    Opening,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Settled => "settled",
            Kind::Late => "late",
            Kind::Repriced => "repriced",
            Kind::Reversed => "reversed",
            Kind::Deleted => "deleted",
            Kind::Corrected => "corrected",
            Kind::Opening => "opening",
        }
    }
}

/// A rule's identity, as the journal, pins and corrections record it: what prices a fine.
pub fn rule_identity(rule: &FineRule) -> serde_json::Value {
    serde_json::json!({
        "daily_rate_cents": rule.daily_rate_cents,
        "grace_days": rule.grace_days,
        "max_cents": rule.max_cents,
    })
}

/// The seq of loan `l`'s next entry: one past its head on the record (`fine_heads`), whatever its
/// row says (`loans.fine_seq` is kept equal to the last entry's seq for readers and the release
/// before this one). Used by the opening entries.
pub const HEAD_SEQ_NEXT: &str =
    "COALESCE((SELECT h.seq FROM fine_heads h WHERE h.loan_id = l.id), 0) + 1";

/// Whether head `h`'s money leaves its place when loan `l` (with member `member`) is priced in the
/// month `$1`: the head prices money (neither a reversal nor a deletion, and not 0) in another
/// month, or for another member. Such a change writes two entries in one statement: the money out
/// of the head's month and member (`reversed`), and the loan's fine into the new place. A head
/// without a member (written by a release before 0.3.0) is the loan's member.
pub fn leaves(h: &str, member: &str) -> String {
    if mutant::planted(Mutant::MoveWithoutReversal) {
        return "false".to_string();
    }
    format!(
        "({h}.after_cents <> 0 AND {h}.kind NOT IN ('reversed', 'deleted')
          AND NOT ({h}.month = $1::date AND COALESCE({h}.member_id, {member}) = {member}))"
    )
}

/// `INSERT INTO fine_journal` of the entries of CTE `from` (columns `month`, `kind`, `rule`, `id`,
/// `seq`, `due_on`, `returned_on`, `before`, `after`, `member`), one journal row per month, kind
/// and rule it has. `shards`, `attempt` and `correction_key` are SQL expressions.
pub fn insert_entries(from: &str, shards: &str, attempt: &str, correction_key: &str) -> String {
    // The aggregates read the rows in one pass, so the arrays line up without sorting.
    let at_least = if mutant::planted(Mutant::SkipJournal) {
        2
    } else {
        1
    };
    format!(
        "INSERT INTO fine_journal (month, kind, rule, shards, attempt, correction_key, loan_ids,
                                   seqs, due_on, returned_on, before_cents, after_cents, member_ids)
         SELECT month, kind, rule, {shards}, {attempt}, {correction_key},
                array_agg(id), array_agg(seq), array_agg(due_on), array_agg(returned_on),
                array_agg(before), array_agg(after), array_agg(member)
           FROM {from}
          GROUP BY month, kind, rule
         HAVING count(*) >= {at_least}"
    )
}

/// The CTEs that write the entries of loans a statement settled along the month index (a batch
/// of the month's run, whose `UPDATE` is the CTE `settled`, named by the argument: columns `id`, `member_id`, `due_on`,
/// `returned_on`, `after`, `seq` — the seq it gave the loan — and `head`, the loan's head row as
/// it was, NULL for a loan the journal does not know): `walked` (each loan's place before), the
/// entries (`{prefix}entries`: the fine into the month for the loan's member, continuing the head
/// when it was there; and, for a loan whose head held money in another month or for another
/// member, that money out of it first), their journal rows, and the edits queued for loans the
/// journal knew, which pricing the loan as it is now supersedes. `$1` month, `$4` shard count,
/// `$9`..`$11` kind, rule identity and attempt.
pub fn walked_entries(prefix: &str, settled: &str) -> String {
    let p = prefix;
    let leaves = leaves("(s.head)", "s.member_id");
    // The planted bug continues the head wherever it was priced.
    let same_place = if mutant::planted(Mutant::MoveWithoutReversal) {
        "(s.head).loan_id IS NOT NULL"
    } else {
        "COALESCE((s.head).month = $1::date
                  AND COALESCE((s.head).member_id, s.member_id) = s.member_id, false)"
    };
    format!(
        "{p}walked AS MATERIALIZED (
             SELECT s.id, s.member_id, s.due_on, s.returned_on, s.after, s.seq,
                    (s.head).loan_id IS NOT NULL AS had_head,
                    COALESCE({leaves}, false) AS moves,
                    {same_place} AS same_place,
                    COALESCE((s.head).after_cents, 0) AS head_after, (s.head).month AS head_month,
                    COALESCE((s.head).member_id, s.member_id) AS head_member
               FROM {settled} s
         ), {p}entries AS (
             SELECT $1::date AS month, $9::text AS kind, $10::jsonb AS rule, id, seq, due_on,
                    returned_on, CASE WHEN same_place THEN head_after ELSE 0 END AS before, after,
                    member_id::bigint AS member
               FROM {p}walked
             UNION ALL
             SELECT head_month, 'reversed', NULL::jsonb, id, seq - 1, due_on, returned_on,
                    head_after, 0::bigint, head_member::bigint
               FROM {p}walked WHERE moves
         ), {p}journal AS ({insert}
         ), {p}dequeued AS (
             DELETE FROM loan_changes c
              USING (SELECT id FROM {p}walked WHERE had_head) k WHERE c.loan_id = k.id
         )",
        insert = insert_entries(&format!("{p}entries"), "$4::int", "$11::int", "NULL::text"),
    )
}

/// The seq a batch's `UPDATE` gives loan `l` priced in the month `$1`: one past its head, two
/// when the head's money leaves its place first ([`leaves`]). One probe of `fine_heads`.
pub fn walk_seq() -> String {
    format!(
        "(SELECT COALESCE(max(h.seq), 0) + 1 + COALESCE(bool_or({}), false)::int
            FROM fine_heads h WHERE h.loan_id = l.id)",
        leaves("h", "l.member_id")
    )
}

/// Loan `l`'s head row (`fine_heads`) for a batch's `RETURNING`, NULL when it has none.
pub const HEAD_ROW: &str = "(SELECT h FROM fine_heads h WHERE h.loan_id = l.id)";

/// Who writes a batch of re-pricings: the month, the rule it prices under, the run.
#[derive(Debug, Clone)]
pub struct Repricer {
    /// The month's first day.
    pub month: NaiveDate,
    /// The month's end (`fine_adjustments.business_date`).
    pub business_date: NaiveDate,
    pub shards: i64,
    pub shard: i64,
    pub rule: FineRule,
    pub attempt: i32,
    /// The correction this is part of (its changes are `corrected` and each gets a
    /// `fine_adjustments` row); `None`: a run re-pricing libraryd's edits (`repriced`).
    pub correction_key: Option<String>,
}

/// What one [`reprice`] batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Repriced {
    /// Loans looked at.
    pub loans: u64,
    /// Settled, or re-priced: priced under the rule.
    pub priced: u64,
    /// Unsettled again.
    pub reversed: u64,
    /// Deleted in libraryd: their fines taken out.
    pub deleted: u64,
    /// Left as they are because the rule cannot price them (corrections).
    pub held: u64,
    /// The first held ids.
    pub held_ids: Vec<i64>,
}

impl Repriced {
    /// Loans whose fine this batch wrote.
    pub fn written(&self) -> u64 {
        self.priced + self.reversed + self.deleted
    }
}

/// Which loans a [`reprice`] batch takes.
pub enum Source<'a> {
    /// The next `limit` loans whose earliest queued edit is in the month, of the shard, by id.
    Queue { limit: i64 },
    /// These loans (a correction's), each checked to be at its seq (`None`: any; an unsettled
    /// return).
    Loans {
        ids: &'a [i64],
        seqs: &'a [Option<i32>],
    },
}

/// Re-prices the loans of `source` under `by.rule` inside the caller's (fenced) transaction, and
/// writes their journal entries (and, for a correction, a `fine_adjustments` row for each fine
/// whose cents change: none where old = new) in the same statement:
/// - a loan returned in the month with dates the rule can price (settled, or a correction's
///   unsettled return): the rule's fine, for its member now (`repriced`; for a correction
///   `corrected`, only when it changes or its money is not where it belongs); when its money on
///   the record is in another month or for another member (a member merge, a loan re-created),
///   that money is taken out of there first, in the same statement ([`Pricing`]);
/// - a settled loan that is not, or one unsettled by hand whose money is still on the record:
///   unsettled (again), fine 0, its money taken out of the month and member that held it
///   (`reversed`);
/// - a loan queued as deleted that is gone: its fine taken out where it was (`deleted`).
///
/// So each month's entries net to the fines of the loans settled in it, whatever order months
/// run in. Queued edits of the loans it took are deleted: from the queue, every edit of each loan
/// it found; a correction's, only those of the loans it took, still in the month (a loan whose
/// money has left the month since the correction's plan keeps its edits for its own month's
/// run). Rows are locked (`FOR UPDATE`) before they are read, so a concurrent edit in libraryd is
/// waited for and priced as it ends.
pub async fn reprice(
    tx: &mut PgConnection,
    by: &Repricer,
    source: Source<'_>,
) -> sqlx::Result<Repriced> {
    let priced_kind = match by.correction_key {
        Some(_) => Kind::Corrected,
        None => Kind::Repriced,
    };
    let (sql, limit, loans) = match source {
        Source::Queue { limit } => (queue_sql(), limit, None),
        Source::Loans { ids, seqs } => (loans_sql(), ids.len() as i64, Some((ids, seqs))),
    };
    type Row = (i64, i64, i64, i64, i64, Vec<i64>);
    let query = sqlx::query_as(sql)
        .bind(by.month)
        .bind(by.shards)
        .bind(by.shard)
        .bind(limit)
        .bind(by.rule.grace_days)
        .bind(by.rule.daily_rate_cents)
        .bind(by.rule.max_cents)
        .bind(rule_identity(&by.rule))
        .bind(by.attempt)
        .bind(by.correction_key.as_deref())
        .bind(priced_kind.as_str())
        .bind(by.business_date);
    // The queue's statement takes no loans: it finds its own.
    let query = match loans {
        Some((ids, seqs)) => query.bind(ids).bind(seqs),
        None => query,
    };
    let (loans, priced, reversed, deleted, held, held_ids): Row = query.fetch_one(&mut *tx).await?;
    Ok(Repriced {
        loans: loans as u64,
        priced: priced as u64,
        reversed: reversed as u64,
        deleted: deleted as u64,
        held: held as u64,
        held_ids,
    })
}

/// The parameters of both statements: `$1` month (first day), `$2`/`$3` shard count and index,
/// `$4` how many loans at most, `$5`..`$7` the rule, `$8` its identity, `$9` attempt, `$10`
/// correction key, `$11` the kind of priced entries, `$12` the business date, and only in the
/// statement over given loans `$13`/`$14` their ids and seqs.
fn statement(targets: &str, settles_returns: bool) -> String {
    let on = Pricing {
        prefix: "",
        shard: &|id| format!("($2 = 1 OR ({id} % $2 + $2) % $2 = $3)"),
        settles_returns,
        lock: "FOR UPDATE OF l",
    };
    // The queued edits that go with the batch: every edit of the loans the queue found, and of a
    // correction's only those of the loans it took (`cur`, `gone`). Deleting the edits of every
    // loan it was given dropped another month's edits: a loan corrected in August, since settled
    // in September and edited there, lost its edit and kept September's fine for its old dates.
    let dequeued = if settles_returns {
        "(SELECT id AS loan_id FROM cur UNION ALL SELECT id FROM gone)"
    } else {
        "targets"
    };
    format!(
        "WITH {targets}, {pricing},
         updated AS (
             UPDATE loans l
                SET fine_cents = CASE WHEN w.stays THEN w.new ELSE 0 END,
                    fine_settled_at = CASE WHEN w.stays THEN COALESCE(l.fine_settled_at, now()) END,
                    fine_seq = w.last_seq
               FROM written w
              WHERE l.id = w.id
         ), journal AS ({journal}
         ), adjusted AS (
             INSERT INTO fine_adjustments
                    (correction_key, loan_id, business_date, old_cents, new_cents)
             SELECT $10, id, $12, was, CASE WHEN stays THEN new ELSE 0 END
               FROM written
              WHERE $10::text IS NOT NULL AND was IS DISTINCT FROM CASE WHEN stays THEN new ELSE 0 END
         ), dequeued AS (
             DELETE FROM loan_changes c USING {dequeued} t WHERE c.loan_id = t.loan_id
         )
         SELECT (SELECT count(*) FROM targets), (SELECT count(*) FROM written WHERE stays),
                (SELECT count(*) FROM written WHERE NOT stays), (SELECT count(*) FROM gone),
                (SELECT count(*) FROM cur WHERE held AND NOT settled),
                ARRAY(SELECT id FROM cur WHERE held AND NOT settled ORDER BY id
                      LIMIT {held_ids})",
        pricing = on.ctes(),
        journal = insert_entries("entries", "$2::int", "$9::int", "$10::text"),
        held_ids = crate::job_layer::HELD_IDS,
    )
}

/// How the loans of a re-pricing are priced, as CTEs over CTE `{prefix}targets` (`loan_id`,
/// `seq`): `{prefix}gone` (loans deleted in libraryd: their money taken out where it was),
/// `{prefix}cur` (each loan found with its money on the record — its head: seq, cents, month,
/// member — and as the rule makes it, and whether it stays in the month), `{prefix}written` (the
/// loans of `cur` whose row and record change) and `{prefix}entries`, every journal entry the
/// statement writes (columns as [`insert_entries`] reads them, besides `was`, a loan's fine in
/// `loans` before). What a batch writes ([`reprice`]) and what a dry run reports
/// ([`super::preview`]) are these same CTEs; the dry run reads them without a lock and for
/// several shards at once.
///
/// Parameters: `$1` month (first day), `$2` shard count, `$5`..`$7` the rule, `$8` its identity,
/// `$10` the correction key (NULL: a run), `$11` the kind of priced entries, and whatever `shard`
/// puts in the filter of a loan id (`$3`).
pub(super) struct Pricing<'a> {
    pub prefix: &'a str,
    pub shard: &'a dyn Fn(&str) -> String,
    /// A correction's loans (settles unsettled returns; takes a loan only at its seq), not the
    /// queue's.
    pub settles_returns: bool,
    /// What ends `cur`: `FOR UPDATE OF l` in a batch, nothing in a dry run.
    pub lock: &'a str,
}

impl Pricing<'_> {
    pub fn ctes(&self) -> String {
        let fine = FineRule::sql_params(5);
        let p = self.prefix;
        let shard = (self.shard)("t.loan_id");
        let lock = self.lock;
        // Which rows are taken. From the queue: settled ones, and unsettled ones whose money is
        // still on the record and that no month's walk settles (not returned, or held: a return
        // undone by hand, a loan re-created without one) — their earliest edit says their money
        // is in the month. An unsettled return the rule can price is its month's walk's alone:
        // the walk takes its money out of where it was as it settles it, and two writers of one
        // loan at once would each read its head before the other's entry (found by the fault
        // campaign, seed 9: a loan re-created in another month, reversed by its old month's queue
        // while its new month's walk moved it, reversed twice). A
        // correction's: a loan whose head is still the month's last entry of it, or a return
        // still unsettled; a loan whose money has left the month since the plan (re-priced,
        // reversed or settled in another month) is another month's, and so are its queued edits.
        let taken = if self.settles_returns {
            "CASE WHEN t.seq IS NULL THEN l.fine_settled_at IS NULL ELSE h.seq = t.seq END"
        } else {
            "(l.fine_settled_at IS NOT NULL
              OR (h.after_cents <> 0 AND h.kind NOT IN ('reversed', 'deleted')
                  AND NOT (l.returned_on IS NOT NULL AND isfinite(l.returned_on)
                           AND NOT (l.due_on IS NULL OR NOT isfinite(l.due_on)))))"
        };
        // A deletion waiting in the queue is the month's when its loan's money was: any the queue
        // finds (its earliest edit is in the month), a correction's only at its seq.
        let gone_taken = if self.settles_returns {
            "c.old_fine_seq = t.seq"
        } else {
            "true"
        };
        // A correction over the journal's loans writes only the fines it changes (and a loan
        // whose money is not where it belongs). An edit from the queue is always written, its
        // fine changed or not: the entry carries the loan's new dates, and the journal must
        // follow them (found by the fault campaign, seed 1018: a due date moved within the grace
        // days under a correction left the journal's old dates, and verify wrong).
        let written = if self.settles_returns {
            "(c.stays AND ($10::text IS NULL OR NOT c.settled OR c.old <> c.new OR NOT c.same_place))
             OR c.reverses"
        } else {
            "c.stays OR c.reverses"
        };
        // The member a head of a release before 0.3.0 priced (it kept none): the one the loan had
        // before its earliest queued edit, else the loan's.
        let legacy_member = "(SELECT q.old_member_id FROM loan_changes q
                                WHERE q.loan_id = l.id ORDER BY q.id LIMIT 1)";
        // The planted bug continues the head wherever it was priced.
        let same_place = if mutant::planted(Mutant::MoveWithoutReversal) {
            "h.loan_id IS NOT NULL".to_string()
        } else {
            format!(
                "COALESCE(h.month = $1::date
                          AND COALESCE(h.member_id, {legacy_member}, l.member_id) = l.member_id,
                          false)"
            )
        };
        format!(
            "{p}gone AS MATERIALIZED (
                 SELECT DISTINCT ON (c.loan_id) c.loan_id AS id,
                        COALESCE(h.seq, c.old_fine_seq, 0) + 1 AS seq,
                        c.old_due_on AS due_on, c.old_returned_on AS returned_on,
                        COALESCE(h.after_cents, c.old_fine_cents)::bigint AS before,
                        0::bigint AS after, COALESCE(h.month, c.month) AS month,
                        COALESCE(h.member_id, c.old_member_id)::bigint AS member
                   FROM loan_changes c JOIN {p}targets t ON t.loan_id = c.loan_id
                   LEFT JOIN fine_heads h ON h.loan_id = c.loan_id
                  WHERE c.deleted AND {gone_taken}
                    AND NOT EXISTS (SELECT 1 FROM loans l WHERE l.id = c.loan_id)
                  ORDER BY c.loan_id, c.id DESC
             ), {p}cur AS MATERIALIZED (
                 SELECT c.*,
                        c.stays AND NOT c.same_place AND c.priced_head AND c.head_after <> 0
                          AS moves,
                        NOT c.stays
                          AND (c.settled
                               OR (c.priced_head AND c.head_after <> 0 AND NOT c.walked))
                          AS reverses
                   FROM (
                     SELECT l.id::bigint AS id, l.member_id::bigint AS member_id, l.due_on,
                            l.returned_on, l.fine_cents::bigint AS old,
                            COALESCE(h.seq, 0) AS head_seq, COALESCE(h.after_cents, 0) AS head_after,
                            COALESCE(h.month, $1::date) AS head_month,
                            COALESCE(h.member_id, {legacy_member}, l.member_id)::bigint AS head_member,
                            COALESCE(h.kind NOT IN ('reversed', 'deleted'), false) AS priced_head,
                            {same_place} AS same_place,
                            l.fine_settled_at IS NOT NULL AS settled, {HELD_ROW} AS held,
                            (l.returned_on IS NOT NULL AND isfinite(l.returned_on)
                             AND NOT {HELD_ROW}) AS walked,
                            (l.returned_on IS NOT NULL AND isfinite(l.returned_on)
                             AND {MONTH_KEY_L} = $1::date::timestamp AND NOT {HELD_ROW}) AS stays,
                            CASE WHEN {HELD_ROW} OR l.returned_on IS NULL OR NOT isfinite(l.returned_on)
                                 THEN NULL ELSE {fine} END AS new
                       FROM {p}targets t JOIN loans l ON l.id = t.loan_id
                       LEFT JOIN fine_heads h ON h.loan_id = l.id
                      WHERE {shard} AND {taken}
                        {lock}
                   ) c
             ), {p}written AS MATERIALIZED (
                 SELECT c.*, c.head_seq + 1 + (c.stays AND c.moves)::int AS last_seq,
                        CASE WHEN c.settled THEN c.old ELSE 0 END AS was
                   FROM {p}cur c
                  WHERE {written}
             ), {p}entries AS (
                 SELECT $1::date AS month, $11::text AS kind, $8::jsonb AS rule, w.id, w.last_seq AS seq,
                        w.due_on, w.returned_on,
                        CASE WHEN w.same_place THEN w.head_after ELSE 0 END AS before,
                        w.new AS after, w.member_id AS member, w.was
                   FROM {p}written w WHERE w.stays
                 UNION ALL
                 SELECT w.head_month, 'reversed', NULL::jsonb, w.id, w.head_seq + 1, w.due_on,
                        w.returned_on, w.head_after, 0::bigint, w.head_member, w.was
                   FROM {p}written w WHERE w.moves OR w.reverses
                 UNION ALL
                 SELECT g.month, 'deleted', NULL::jsonb, g.id, g.seq, g.due_on, g.returned_on,
                        g.before, g.after, g.member, g.before
                   FROM {p}gone g
             )"
        )
    }
}

/// The queue's targets, `{prefix}targets`: the next `limit` loans whose earliest queued edit is
/// in month `$1`, of the shard(s) `shard` lets through, by id.
pub(super) fn queue_targets(prefix: &str, shard: &dyn Fn(&str) -> String, limit: &str) -> String {
    let shard = shard("c.loan_id");
    // A loan's earliest queued edit says where its money is: its month's run takes it, and every
    // edit of it with it. The month's loans are read in id order from `loan_changes_by_month` and
    // each one's earliest edit is one probe of `loan_changes_by_loan`, so a batch stops after
    // `limit` of them: its cost follows the batch, not the queue (joining the month's loans to
    // every edit of theirs cost each batch the queue times the batch under the batch's
    // nested-loop plans).
    format!(
        "{prefix}mine AS (
             SELECT DISTINCT c.loan_id FROM loan_changes c
              WHERE c.month = $1::date AND {shard}
              ORDER BY c.loan_id
         ), {prefix}targets AS MATERIALIZED (
             SELECT m.loan_id, NULL::int AS seq
               FROM {prefix}mine m
               CROSS JOIN LATERAL (
                    SELECT e.month FROM loan_changes e WHERE e.loan_id = m.loan_id
                     ORDER BY e.id LIMIT 1
               ) earliest
              WHERE earliest.month = $1::date
              ORDER BY m.loan_id LIMIT {limit}
         )"
    )
}

fn queue_sql() -> &'static str {
    static SQL: OnceLock<String> = OnceLock::new();
    SQL.get_or_init(|| {
        statement(
            &queue_targets(
                "",
                &|id| format!("($2 = 1 OR ({id} % $2 + $2) % $2 = $3)"),
                "$4",
            ),
            false,
        )
    })
}

fn loans_sql() -> &'static str {
    static SQL: OnceLock<String> = OnceLock::new();
    SQL.get_or_init(|| {
        statement(
            "targets AS MATERIALIZED (
                 SELECT * FROM unnest($13::bigint[], $14::int[]) AS t(loan_id, seq) LIMIT $4
             )",
            true,
        )
    })
}

/// A queued edit of loan `c.loan_id` that its month's walk takes instead (an unsettled return of
/// the month `month` the rule can price: the walk prices the loan as it is and supersedes the
/// edit), so it is counted once, as a late return.
fn walked_instead(month: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM loans l
                  WHERE l.id = c.loan_id AND l.fine_settled_at IS NULL
                    AND l.returned_on IS NOT NULL AND {MONTH_KEY_L} = {month}::timestamp
                    AND NOT {HELD_ROW})"
    )
}

/// How many loans have edits queued for `month` (first day) whose earliest edit is in it, for
/// shard `shard` of `shards`, but those the month's walk settles instead.
pub async fn edits_waiting(
    db: &mut PgConnection,
    month: NaiveDate,
    shards: i64,
    shard: i64,
) -> sqlx::Result<u64> {
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM (
             SELECT DISTINCT ON (c.loan_id) c.loan_id, c.month FROM loan_changes c
              WHERE c.loan_id IN (SELECT loan_id FROM loan_changes
                                   WHERE month = $1 AND ($2 = 1 OR (loan_id % $2 + $2) % $2 = $3))
              ORDER BY c.loan_id, c.id
         ) c WHERE c.month = $1 AND NOT {}",
        walked_instead("$1::date")
    ))
    .bind(month)
    .bind(shards)
    .bind(shard)
    .fetch_one(db)
    .await?;
    Ok(n as u64)
}

/// Loans with queued edits by (month, shard of `shards`), each under the month of its earliest
/// edit, but those the month's walk settles instead (counted as late returns).
pub async fn edits_by_month(
    db: &mut PgConnection,
    shards: i64,
) -> sqlx::Result<Vec<(NaiveDate, i64, i64)>> {
    sqlx::query_as(&format!(
        "SELECT month, ((loan_id % $1 + $1) % $1)::bigint, count(*) FROM (
             SELECT DISTINCT ON (loan_id) loan_id, month FROM loan_changes ORDER BY loan_id, id
         ) c WHERE NOT {} GROUP BY 1, 2 ORDER BY 1, 2",
        walked_instead("c.month")
    ))
    .bind(shards)
    .fetch_all(db)
    .await
}

/// Gives the next `limit` settled loans without a journal entry an opening entry (the loan as it
/// is: its dates, its fine), in one statement of its own transaction; returns how many. A settled
/// loan that was never returned (a return undone before the journal existed) is also queued as an
/// edit, so the run of its month takes its fine out. Idempotent and safe next to anything: a loan
/// journaled meanwhile is skipped.
pub async fn open_unjournaled(db: &mut PgConnection, limit: i64) -> sqlx::Result<u64> {
    let mut tx = db.begin().await?;
    sqlx::query(PIN_OPENING).execute(&mut *tx).await?;
    let n: i64 = sqlx::query_scalar(opening_statement())
        .bind(limit)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(n as u64)
}

/// The plan settings of [`opening_statement`]'s transaction: the batch's loans are read through
/// the partial index and updated by id, whatever the statistics say. (Statistics taken before
/// the loans were settled estimate that index empty; the planner then joined the batch's ids
/// to the index scan in a nested loop, 100,000 × 100,000 comparisons: one batch of a migrate ran
/// for minutes.)
pub const PIN_OPENING: &str = "SELECT set_config('enable_seqscan', 'off', true),
       set_config('enable_bitmapscan', 'off', true), set_config('enable_hashjoin', 'off', true),
       set_config('enable_mergejoin', 'off', true), set_config('jit', 'off', true)";

/// The statement of [`open_unjournaled`] (`$1`: how many loans), after [`PIN_OPENING`]: the
/// batch's ids are one array, so the update finds each loan by id and there is no join to plan.
pub fn opening_statement() -> &'static str {
    static SQL: OnceLock<String> = OnceLock::new();
    SQL.get_or_init(|| {
        let unreturned = "l.returned_on IS NULL OR NOT isfinite(l.returned_on)";
        format!(
            "WITH opened AS (
                 UPDATE loans l SET fine_seq = {HEAD_SEQ_NEXT}
                  WHERE l.id = ANY (ARRAY(
                            SELECT id FROM loans
                             WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL
                             ORDER BY id LIMIT $1))
                    AND l.fine_seq IS NULL AND l.fine_settled_at IS NOT NULL
                 RETURNING l.id::bigint AS id, l.fine_seq AS seq, l.due_on, l.returned_on,
                           l.member_id::bigint AS member,
                           (SELECT h.after_cents FROM fine_heads h WHERE h.loan_id = l.id)
                             AS before,
                           l.fine_cents::bigint AS after,
                           CASE WHEN {unreturned}
                                THEN (date_trunc('month', l.fine_settled_at AT TIME ZONE 'UTC')
                                      - interval '1 month')::date
                                ELSE date_trunc('month', l.returned_on)::date END AS month,
                           {unreturned} AS unreturned
             ), journal AS (
                 INSERT INTO fine_journal (month, kind, loan_ids, seqs, due_on, returned_on,
                                           before_cents, after_cents, member_ids)
                 SELECT month, 'opening', array_agg(id), array_agg(seq), array_agg(due_on),
                        array_agg(returned_on), array_agg(before), array_agg(after),
                        array_agg(member)
                   FROM opened GROUP BY month
             ), queued AS (
                 INSERT INTO loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq,
                                           old_due_on, old_returned_on, old_member_id)
                 SELECT id, month, false, after, seq, due_on, returned_on, member
                   FROM opened WHERE unreturned
             )
             SELECT count(*) FROM opened"
        )
    })
}

/// Whether any settled loan has no journal entry yet (one probe of a partial index that is empty
/// in steady state).
///
/// The probe is pinned to the partial index (sequential and bitmap scans off, for its own
/// transaction): with statistics from before a month's run (most rows then unsettled, most
/// `fine_seq` NULL) the planner expected a matching row early in a sequential scan of `loans`,
/// and every idle tick after a large run read the whole table to find none (1.4–4.2 s on 12 M
/// loans, logged as a slow statement each time).
pub async fn any_unjournaled(db: &mut PgConnection) -> sqlx::Result<bool> {
    let mut tx = db.begin().await?;
    sqlx::query(PIN_OPENING).execute(&mut *tx).await?;
    let any = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM loans WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL)",
    )
    .fetch_one(&mut *tx)
    .await?;
    tx.rollback().await?;
    Ok(any)
}

/// Settled loans without a journal entry by (month of their return, shard of `shards`): what the
/// replicas' upkeep gives an opening entry ([`open_unjournaled`]). Read through
/// `loans_settled_unjournaled`, empty in steady state.
pub async fn unjournaled_by_month(
    db: &mut PgConnection,
    shards: i64,
) -> sqlx::Result<Vec<(NaiveDate, i64, i64)>> {
    sqlx::query_as(
        "SELECT date_trunc('month', returned_on)::date, ((id % $1 + $1) % $1)::bigint, count(*)
           FROM loans
          WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL
            AND returned_on IS NOT NULL AND isfinite(returned_on)
          GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .bind(shards)
    .fetch_all(db)
    .await
}

/// How many settled loans have no journal entry yet (an index probe: none, in steady state).
pub async fn unjournaled(db: &mut PgConnection) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL",
    )
    .fetch_one(db)
    .await
}

/// A month's settled loans as the journal and the loans say together: the loans whose last entry
/// prices them in the month, settled and still returned in it — their count, and the sum and
/// digest of the fines *on the record* (the last entries' `after_cents`; `md5` of `id:fine` in id
/// order, as [`super::month_totals`] computes it over the table, equal to it while the two agree).
/// A fine edited by hand in `loans` changes neither: what settlementd settled is what status
/// says, and `verify` names the loan whose fine the record does not hold. So a closed month's
/// totals, kept by the status page, cannot drift from what `status` reads afresh.
/// Reads the month's journal rows and each loan by primary key (the plan is pinned to nested
/// loops for the rest of the transaction), so it costs what the month holds.
pub async fn totals(
    db: &mut PgConnection,
    month: crate::calendar::BusinessDate,
) -> sqlx::Result<super::MonthTotals> {
    sqlx::query(
        "SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true),
                set_config('enable_hashjoin', 'off', true), set_config('enable_mergejoin', 'off', true),
                set_config('jit', 'off', true)",
    )
    .execute(&mut *db)
    .await?;
    let (settled_rows, sum, digest): (i64, String, String) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum(h.after_cents), 0)::text,
                md5(COALESCE(string_agg(l.id::text || ':' || h.after_cents::text, ',' ORDER BY l.id),
                             ''))
           FROM (SELECT j.id AS jid, j.kind, x.loan_id
                   FROM fine_journal j, unnest(j.loan_ids) AS x(loan_id)
                  WHERE j.month = $1) e
           JOIN fine_heads h ON h.loan_id = e.loan_id AND h.journal_id = e.jid
           JOIN loans l ON l.id = e.loan_id AND l.fine_seq = h.seq
          WHERE e.kind NOT IN ('reversed', 'deleted') AND l.fine_settled_at IS NOT NULL
            AND l.returned_on BETWEEN $1 AND $2",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(&mut *db)
    .await?;
    Ok(super::MonthTotals {
        settled_rows,
        fine_cents_sum: super::parse_sum(&sum)?,
        digest,
    })
}
