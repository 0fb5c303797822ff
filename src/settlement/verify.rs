//! Is a month's money right? Every loan returned in the month recomputed from the month's rule, in
//! one read-only pass over the month's rows.
//!
//! A month is right when every settled loan's `fine_cents` is what the rule gives its dates, no
//! return of the month is left unsettled, and no loan of it is held (dates the rule cannot price).
//! The rule is the month's pinned one ([`crate::jobs::params`]); a month claimed before pins
//! existed is checked against the rule the configuration gives it, and the report says so.

use super::{describe_params, rule_from_params, rule_of, MonthTotals, HELD_ROW, TOTALS_SQL};
use crate::calendar::BusinessDate;
use crate::fine::{DatedRule, FineRule, FineSchedule};
use crate::jobs::{params, JobError, HELD_IDS};
use sqlx::PgConnection;

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
    pub stored_cents: i64,
    pub expected_cents: i64,
}

/// What [`verify`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verification {
    pub business_date: String,
    pub rule: DatedRule,
    pub rule_source: RuleSource,
    /// Loans returned in the month.
    pub returned: i64,
    pub totals: MonthTotals,
    /// Settled loans whose fine differs from the rule: how many, the sum of (stored − expected),
    /// and the first [`HELD_IDS`] by id.
    pub mismatched: i64,
    pub mismatch_cents: i128,
    pub mismatches: Vec<Mismatch>,
    /// Returns of the month not settled yet that the rule can price.
    pub unsettled: i64,
    pub unsettled_ids: Vec<i64>,
    /// Loans of the month the rule cannot price (due date missing or infinite), settled or not.
    pub held: i64,
    pub held_ids: Vec<i64>,
}

impl Verification {
    /// Every settled fine is the rule's, nothing is left unsettled, nothing is held.
    pub fn is_right(&self) -> bool {
        self.mismatched == 0 && self.unsettled == 0 && self.held == 0
    }

    /// What is wrong, in one line; `None` when the month is right.
    pub fn problems(&self) -> Option<String> {
        let mut parts = Vec::new();
        if self.mismatched > 0 {
            parts.push(format!(
                "{} settled fines differ from the rule (net {:+} cents)",
                self.mismatched, self.mismatch_cents
            ));
        }
        if self.unsettled > 0 {
            parts.push(format!("{} returns are not settled", self.unsettled));
        }
        if self.held > 0 {
            parts.push(format!(
                "{} rows held (bad dates), ids {:?}",
                self.held, self.held_ids
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// Checks the month of `business_date` against its pinned rule, or, when it has none, against the
/// rule `rules` give it. `Err(Ok(why))`: no rule to check against (configuration); `Err(Err(e))`
/// a database error.
pub async fn verify(
    conn: &mut PgConnection,
    business_date: BusinessDate,
    rules: &FineSchedule,
) -> Result<Verification, Result<String, JobError>> {
    let pinned = params::pinned(&mut *conn, super::JOB_NAME, business_date.date())
        .await
        .map_err(Err)?;
    let (rule, rule_source) = match pinned {
        Some(p) => match rule_from_params(&p) {
            Some(rule) => (rule, RuleSource::Pinned),
            None => {
                return Err(Ok(format!(
                    "{business_date} is pinned to parameters this version cannot read: {}",
                    describe_params(&p)
                )))
            }
        },
        None => (
            rule_of(rules, business_date.date()).map_err(Ok)?,
            RuleSource::Configuration,
        ),
    };
    read(conn, business_date, rule, rule_source)
        .await
        .map_err(|e| Err(JobError::Db(e)))
}

async fn read(
    conn: &mut PgConnection,
    business_date: BusinessDate,
    rule: DatedRule,
    rule_source: RuleSource,
) -> sqlx::Result<Verification> {
    let fine = FineRule::sql_params(3);
    let differs = "settled AND NOT held AND fine_cents <> expected";
    let sql = format!(
        "SELECT count(*),
                {TOTALS_SQL},
                count(*) FILTER (WHERE {differs}),
                COALESCE(sum(fine_cents::numeric - expected) FILTER (WHERE {differs}), 0)::text,
                (array_agg(id ORDER BY id) FILTER (WHERE {differs}))[1:{HELD_IDS}],
                (array_agg(fine_cents ORDER BY id) FILTER (WHERE {differs}))[1:{HELD_IDS}],
                (array_agg(expected ORDER BY id) FILTER (WHERE {differs}))[1:{HELD_IDS}],
                count(*) FILTER (WHERE NOT settled AND NOT held),
                (array_agg(id ORDER BY id) FILTER (WHERE NOT settled AND NOT held))[1:{HELD_IDS}],
                count(*) FILTER (WHERE held),
                (array_agg(id ORDER BY id) FILTER (WHERE held))[1:{HELD_IDS}]
           FROM (SELECT l.id::bigint AS id, l.fine_cents::bigint AS fine_cents, l.fine_settled_at,
                        l.fine_settled_at IS NOT NULL AS settled,
                        {HELD_ROW} AS held,
                        CASE WHEN {HELD_ROW} THEN NULL ELSE {fine} END AS expected
                   FROM loans l
                  WHERE l.returned_on BETWEEN $1 AND $2) month"
    );
    type Row = (
        i64,
        i64,
        String,
        String,
        i64,
        String,
        Option<Vec<i64>>,
        Option<Vec<i64>>,
        Option<Vec<i64>>,
        i64,
        Option<Vec<i64>>,
        i64,
        Option<Vec<i64>>,
    );
    let r = &rule.rule;
    let row: Row = sqlx::query_as(&sql)
        .bind(business_date.first_day())
        .bind(business_date.date())
        .bind(r.grace_days)
        .bind(r.daily_rate_cents)
        .bind(r.max_cents)
        .fetch_one(conn)
        .await?;
    let (returned, settled_rows, sum, digest, mismatched, mismatch_sum, ids, stored, expected) = (
        row.0, row.1, row.2, row.3, row.4, row.5, row.6, row.7, row.8,
    );
    let mismatches = ids
        .unwrap_or_default()
        .into_iter()
        .zip(stored.unwrap_or_default())
        .zip(expected.unwrap_or_default())
        .map(|((id, stored_cents), expected_cents)| Mismatch {
            id,
            stored_cents,
            expected_cents,
        })
        .collect();
    Ok(Verification {
        business_date: business_date.to_string(),
        rule,
        rule_source,
        returned,
        totals: MonthTotals {
            settled_rows,
            fine_cents_sum: super::parse_sum(&sum)?,
            digest,
        },
        mismatched,
        mismatch_cents: super::parse_sum(&mismatch_sum)?,
        mismatches,
        unsettled: row.9,
        unsettled_ids: row.10.unwrap_or_default(),
        held: row.11,
        held_ids: row.12.unwrap_or_default(),
    })
}
