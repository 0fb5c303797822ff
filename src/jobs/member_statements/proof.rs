//! `verify --job member-statements`: are a month's statements what the money journal says each
//! member owes? Read-only, in one snapshot.
//!
//! The truth is the journal alone: each loan whose last entry on the record (its head,
//! `fine_heads`) is in the month and neither reverses nor deletes it holds that entry's fine
//! there, for the member the entry priced it for; a member owes the month the sum of their
//! loans' fines, and has a statement exactly when one of them is above 0 (the job writes no zero
//! rows: a member left without a fine loses the statement). A loan that moves to another member
//! or month moves its money with a pair of entries (out of the old place, into the new), so a
//! statement follows the loan. An entry written before 0.3.0 names no member: the loan's, read
//! by primary key. Cost: the month's journal rows (by `fine_journal_by_month`), their heads by
//! primary key (and the loans of entries without a member), and the month's statements (by their
//! primary key's first column) — never a scan of `loans`.

use super::JOB_NAME;
use crate::calendar::BusinessDate;
use crate::job_layer::{Found, Report, HELD_IDS};
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use std::fmt::Write;

/// A member whose statement is not what the journal gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Differs {
    pub member_id: i64,
    pub stated_fines: i64,
    pub stated_cents: i64,
    pub journal_fines: i64,
    pub journal_cents: i64,
}

/// The members' fines of a month, summed: how many members, fines and cents.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub members: i64,
    pub fines: i64,
    pub fine_cents: i64,
}

/// What [`prove`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatementsProof {
    pub business_date: BusinessDate,
    /// What the journal gives.
    pub journal: Totals,
    /// What `member_fine_statements` holds.
    pub stated: Totals,
    /// Members with a statement that differs from the journal: how many, the sum of
    /// (stated − journal) cents, the first [`HELD_IDS`] by member id.
    pub mismatched: i64,
    pub mismatch_cents: i64,
    pub mismatches: Vec<Differs>,
    /// Members who owe the month a fine and have no statement.
    pub missing: Found,
    /// Statements of members who owe the month nothing.
    pub extra: Found,
}

impl StatementsProof {
    pub fn is_right(&self) -> bool {
        self.mismatched == 0 && self.missing.count == 0 && self.extra.count == 0
    }
}

/// The month's proof as `verify` shows it ([`Report::into_proof`]).
impl Report for StatementsProof {
    /// What is wrong, in one line; `None` when the month is right.
    fn problems(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.mismatched > 0 {
            let ids: Vec<i64> = self.mismatches.iter().map(|d| d.member_id).collect();
            parts.push(format!(
                "{} statements differ from the journal (net {:+} cents), members {ids:?}",
                self.mismatched, self.mismatch_cents
            ));
        }
        let named = |f: &Found, what: &str| {
            (f.count > 0).then(|| format!("{} {what}, members {:?}", f.count, f.ids))
        };
        parts.extend(
            [
                named(&self.missing, "members owe a fine and have no statement"),
                named(&self.extra, "statements of members who owe nothing"),
            ]
            .into_iter()
            .flatten(),
        );
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "job": JOB_NAME,
            "business_date": self.business_date.to_string(),
            "right": self.is_right(),
            "journal": self.journal,
            "stated": self.stated,
            "mismatched": {
                "count": self.mismatched,
                "net_cents": self.mismatch_cents,
                "first": self.mismatches,
            },
            "missing": self.missing,
            "extra": self.extra,
        })
    }

    fn to_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let verdict = if self.is_right() {
            "right"
        } else {
            "NOT RIGHT"
        };
        let _ = writeln!(out, "{JOB_NAME} {}: {verdict}", self.business_date);
        let totals = |t: &Totals| {
            format!(
                "members={} fines={} fine_cents_sum={}",
                t.members, t.fines, t.fine_cents
            )
        };
        let _ = writeln!(out, "the journal gives: {}", totals(&self.journal));
        let _ = writeln!(out, "stated: {}", totals(&self.stated));
        let _ = writeln!(
            out,
            "statements that differ from the journal: {} (net {:+} cents)",
            self.mismatched, self.mismatch_cents
        );
        for d in &self.mismatches {
            let _ = writeln!(
                out,
                "  member {}: stated {} fines, {} cents; the journal gives {} fines, {} cents",
                d.member_id, d.stated_fines, d.stated_cents, d.journal_fines, d.journal_cents
            );
        }
        for (what, f) in [
            ("members who owe a fine without a statement", &self.missing),
            ("statements of members who owe nothing", &self.extra),
        ] {
            let _ = writeln!(out, "{what}: {}", f.count);
            if !f.ids.is_empty() {
                let _ = writeln!(out, "  members {:?}", f.ids);
            }
        }
        out
    }

}

/// Each member of the month beside what the journal gives them and what they are stated: `m`,
/// `jf`/`jc` (journal; NULL when they owe nothing), `sf`/`sc` (stated; NULL without a statement).
/// $1: the month's first day, $2: its last.
const COMPARED: &str = "
    WITH last AS (
        SELECT x.loan_id, j.kind, x.after_cents, h.member_id
          FROM fine_journal j
         CROSS JOIN LATERAL unnest(j.loan_ids, j.after_cents) AS x(loan_id, after_cents)
          JOIN fine_heads h ON h.loan_id = x.loan_id AND h.journal_id = j.id
         WHERE j.month = $1
    ), owed AS (
        SELECT COALESCE(s.member_id, l.member_id) AS m,
               count(*) FILTER (WHERE s.after_cents > 0) AS jf,
               COALESCE(sum(s.after_cents), 0)::bigint AS jc
          FROM last s
          LEFT JOIN LATERAL (SELECT member_id FROM loans
                              WHERE id = s.loan_id AND s.member_id IS NULL) l ON true
         WHERE s.kind NOT IN ('reversed', 'deleted')
           AND COALESCE(s.member_id, l.member_id) IS NOT NULL
         GROUP BY 1
        HAVING count(*) FILTER (WHERE s.after_cents > 0) > 0
    ), stated AS (
        SELECT member_id AS m, fines AS sf, fine_cents::bigint AS sc
          FROM member_fine_statements WHERE business_date = $2
    ), compared AS (
        SELECT COALESCE(o.m, s.m) AS m, o.jf, o.jc, s.sf, s.sc
          FROM owed o FULL JOIN stated s ON s.m = o.m
    )";

/// Proves the statements of `month` against the journal, in one repeatable-read snapshot.
pub async fn prove(db: &mut PgConnection, month: BusinessDate) -> sqlx::Result<StatementsProof> {
    let mut tx = db
        .begin_with(
            "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY;
             SET LOCAL enable_seqscan = off; SET LOCAL jit = off",
        )
        .await?;
    let differs = "jf IS NOT NULL AND sf IS NOT NULL AND (jf, jc) IS DISTINCT FROM (sf, sc)";
    #[allow(clippy::type_complexity)]
    let row: (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        Option<Vec<i64>>,
        i64,
        Option<Vec<i64>>,
    ) = sqlx::query_as(&format!(
        "{COMPARED}
         SELECT count(jf), COALESCE(sum(jf), 0)::bigint, COALESCE(sum(jc), 0)::bigint,
                count(sf), COALESCE(sum(sf), 0)::bigint, COALESCE(sum(sc), 0)::bigint,
                count(*) FILTER (WHERE {differs}),
                COALESCE(sum(sc - jc) FILTER (WHERE {differs}), 0)::bigint,
                count(*) FILTER (WHERE sf IS NULL),
                (array_agg(m ORDER BY m) FILTER (WHERE sf IS NULL))[1:{HELD_IDS}],
                count(*) FILTER (WHERE jf IS NULL),
                (array_agg(m ORDER BY m) FILTER (WHERE jf IS NULL))[1:{HELD_IDS}]
           FROM compared"
    ))
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(&mut *tx)
    .await?;
    let mismatches: Vec<(i64, i64, i64, i64, i64)> = if row.6 > 0 {
        sqlx::query_as(&format!(
            "{COMPARED}
             SELECT m, sf, sc, jf, jc FROM compared WHERE {differs} ORDER BY m LIMIT {HELD_IDS}"
        ))
        .bind(month.first_day())
        .bind(month.date())
        .fetch_all(&mut *tx)
        .await?
    } else {
        Vec::new()
    };
    tx.rollback().await?;
    Ok(StatementsProof {
        business_date: month,
        journal: Totals {
            members: row.0,
            fines: row.1,
            fine_cents: row.2,
        },
        stated: Totals {
            members: row.3,
            fines: row.4,
            fine_cents: row.5,
        },
        mismatched: row.6,
        mismatch_cents: row.7,
        mismatches: mismatches
            .into_iter()
            .map(
                |(member_id, stated_fines, stated_cents, journal_fines, journal_cents)| Differs {
                    member_id,
                    stated_fines,
                    stated_cents,
                    journal_fines,
                    journal_cents,
                },
            )
            .collect(),
        missing: Found::new(row.8, row.9),
        extra: Found::new(row.10, row.11),
    })
}
