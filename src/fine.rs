//! The fine rule: a pure function of a loan's dates and the configured rates, and the schedule of
//! rules over the months.
//!
//! `days_late = (returned_on - due_on) - grace_days`;
//! `fine_cents = min(max(days_late, 0) * daily_rate_cents, max_cents)`.
//! A zero fine is a valid result, never a "not settled" marker. The settlement SQL computes the
//! same expression (see [`FineRule::SQL_EXPR`]); a test checks both agree on real rows.
//!
//! Rules change over time: a [`FineSchedule`] holds rules effective from a month each, and the rule
//! of a month is the last one whose `from` is not after it ([`FineSchedule::rule_for`]). A month
//! is always settled under one rule; which one is pinned in the database with the month's first
//! claim (`src/jobs/params.rs`).

use chrono::NaiveDate;
use serde::Deserialize;

/// Money in cents. Never negative for fines.
pub type Cents = i64;

/// The configured rule (`[fine]` in the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FineRule {
    /// Cents charged per day late after the grace period.
    pub daily_rate_cents: i64,
    /// Days after `due_on` that cost nothing.
    pub grace_days: i64,
    /// Cap on one loan's fine.
    pub max_cents: i64,
}

impl Default for FineRule {
    fn default() -> Self {
        Self {
            daily_rate_cents: 50,
            grace_days: 0,
            max_cents: 10_000,
        }
    }
}

impl FineRule {
    /// The same rule in SQL over columns `returned_on`, `due_on` and parameters
    /// `$grace`, `$rate`, `$max` (bound as bigint). Kept next to [`FineRule::fine_cents`] so
    /// both change together.
    pub const SQL_EXPR: &'static str =
        "LEAST(GREATEST((l.returned_on - l.due_on)::bigint - $grace, 0) * $rate, $max)";

    /// [`FineRule::SQL_EXPR`] with `grace`, `rate` and `max` (SQL text: parameters or literals).
    pub fn sql_expr(grace: &str, rate: &str, max: &str) -> String {
        Self::SQL_EXPR
            .replace("$grace", grace)
            .replace("$rate", rate)
            .replace("$max", max)
    }

    /// [`FineRule::SQL_EXPR`] reading the rule from the statement's parameters `$first`,
    /// `$first + 1` and `$first + 2`: bind `grace_days`, `daily_rate_cents`, `max_cents` there.
    pub fn sql_params(first: usize) -> String {
        Self::sql_expr(
            &format!("${first}"),
            &format!("${}", first + 1),
            &format!("${}", first + 2),
        )
    }

    /// The fine for a loan returned on `returned_on` that was due on `due_on`.
    /// Saturating arithmetic: absurd inputs give the cap, never an overflow panic.
    pub fn fine_cents(&self, due_on: NaiveDate, returned_on: NaiveDate) -> Cents {
        let days = (returned_on - due_on).num_days();
        let days_late = days.saturating_sub(self.grace_days).max(0);
        days_late
            .saturating_mul(self.daily_rate_cents)
            .min(self.max_cents)
    }

    /// Upper bounds that keep the SQL expression inside bigint for any pair of PostgreSQL dates
    /// (at most ~5.9 million days apart), so a strange row can never overflow a batch.
    pub const MAX_DAILY_RATE_CENTS: i64 = 1_000_000_000;
    pub const MAX_GRACE_DAYS: i64 = 36_500;

    /// Every field must be non-negative and within the bounds above; `at` names the rule's keys
    /// in the error (`fine`, or `fine.rules[2]`).
    pub fn validate(&self, at: &str) -> Result<(), String> {
        for (name, value, max) in [
            (
                "daily_rate_cents",
                self.daily_rate_cents,
                Self::MAX_DAILY_RATE_CENTS,
            ),
            ("grace_days", self.grace_days, Self::MAX_GRACE_DAYS),
            ("max_cents", self.max_cents, i64::MAX),
        ] {
            if !(0..=max).contains(&value) {
                return Err(format!(
                    "{at}.{name} must be between 0 and {max}, got {value}"
                ));
            }
        }
        Ok(())
    }
}

/// A rule and the first month it applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatedRule {
    /// The first day of the first month the rule applies to.
    pub from: NaiveDate,
    pub rule: FineRule,
}

impl DatedRule {
    /// `from` as `YYYY-MM`.
    pub fn from_month(&self) -> String {
        self.from.format("%Y-%m").to_string()
    }
}

impl std::fmt::Display for FineRule {
    /// "50 cents a day after 0 grace days, at most 10000 cents".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} cents a day after {} grace days, at most {} cents",
            self.daily_rate_cents, self.grace_days, self.max_cents
        )
    }
}

impl std::fmt::Display for DatedRule {
    /// "50 cents a day after 0 grace days, at most 10000 cents (rule from 2020-01)".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (rule from {})", self.rule, self.from_month())
    }
}

/// The rules over time: sorted by `from`, no two from the same month, at least one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FineSchedule {
    rules: Vec<DatedRule>,
}

impl FineSchedule {
    /// The first day of the earliest month a business date may have (year 1): what "from the
    /// beginning of time" means for a single rule.
    pub fn beginning() -> NaiveDate {
        NaiveDate::from_ymd_opt(1, 1, 1).expect("year 1 is a valid date")
    }

    /// One rule for every month.
    pub fn single(rule: FineRule) -> Self {
        Self {
            rules: vec![DatedRule {
                from: Self::beginning(),
                rule,
            }],
        }
    }

    /// The rules sorted by `from`; an error names a duplicate month or an empty list.
    pub fn new(mut rules: Vec<DatedRule>) -> Result<Self, String> {
        if rules.is_empty() {
            return Err("fine.rules is empty: give at least one rule".into());
        }
        rules.sort_by_key(|r| r.from);
        if let Some(pair) = rules.windows(2).find(|p| p[0].from == p[1].from) {
            return Err(format!(
                "fine.rules has two rules from {}: keep one",
                pair[0].from_month()
            ));
        }
        Ok(Self { rules })
    }

    /// The rule of the month starting on `first_day`: the last one whose `from` is not after it.
    /// `None` when the month comes before every rule.
    pub fn rule_for(&self, first_day: NaiveDate) -> Option<&DatedRule> {
        self.rules.iter().rev().find(|r| r.from <= first_day)
    }

    pub fn rules(&self) -> &[DatedRule] {
        &self.rules
    }

    /// The highest cap of any rule: the largest fine settlement can write.
    pub fn max_cents(&self) -> Cents {
        self.rules
            .iter()
            .map(|r| r.rule.max_cents)
            .max()
            .unwrap_or(0)
    }
}

impl Default for FineSchedule {
    fn default() -> Self {
        Self::single(FineRule::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(s: &str) -> NaiveDate {
        s.parse().unwrap()
    }

    #[test]
    fn on_time_and_early_returns_cost_nothing() {
        let rule = FineRule::default();
        assert_eq!(rule.fine_cents(d("2026-10-10"), d("2026-10-10")), 0);
        assert_eq!(rule.fine_cents(d("2026-10-10"), d("2026-10-01")), 0);
    }

    #[test]
    fn each_late_day_costs_the_daily_rate_up_to_the_cap() {
        let rule = FineRule::default();
        assert_eq!(rule.fine_cents(d("2026-10-10"), d("2026-10-13")), 150);
        assert_eq!(rule.fine_cents(d("2026-01-01"), d("2026-12-31")), 10_000);
    }

    #[test]
    fn grace_days_are_free() {
        let rule = FineRule {
            grace_days: 2,
            ..FineRule::default()
        };
        assert_eq!(rule.fine_cents(d("2026-10-10"), d("2026-10-12")), 0);
        assert_eq!(rule.fine_cents(d("2026-10-10"), d("2026-10-13")), 50);
    }

    #[test]
    fn negative_settings_are_rejected() {
        let rule = FineRule {
            max_cents: -1,
            ..FineRule::default()
        };
        assert!(rule
            .validate("fine")
            .unwrap_err()
            .contains("fine.max_cents"));
    }

    fn dated(from: &str, rate: i64) -> DatedRule {
        DatedRule {
            from: d(from),
            rule: FineRule {
                daily_rate_cents: rate,
                ..FineRule::default()
            },
        }
    }

    #[test]
    fn the_rule_of_a_month_is_the_last_one_whose_from_is_not_after_it() {
        let schedule =
            FineSchedule::new(vec![dated("2027-01-01", 60), dated("2020-01-01", 50)]).unwrap();
        let rate = |month| schedule.rule_for(d(month)).map(|r| r.rule.daily_rate_cents);
        assert_eq!(rate("2019-12-01"), None);
        assert_eq!(rate("2020-01-01"), Some(50));
        assert_eq!(rate("2026-12-01"), Some(50));
        assert_eq!(rate("2027-01-01"), Some(60));
        assert_eq!(rate("9999-12-01"), Some(60));
        assert_eq!(schedule.rules()[0].from, d("2020-01-01"), "sorted");
    }

    #[test]
    fn a_single_rule_covers_every_month_and_two_rules_may_not_share_a_month() {
        let single = FineSchedule::default();
        assert_eq!(
            single.rule_for(d("0001-01-01")).unwrap().from_month(),
            "0001-01"
        );
        let err =
            FineSchedule::new(vec![dated("2020-01-01", 50), dated("2020-01-01", 60)]).unwrap_err();
        assert!(err.contains("two rules from 2020-01"), "{err}");
        assert!(FineSchedule::new(vec![]).is_err());
    }

    proptest! {
        #[test]
        fn fine_is_between_zero_and_the_cap(
            due in 0i64..100_000, late in -1000i64..100_000,
            rate in 0i64..1_000_000, grace in 0i64..1000, max in 0i64..i64::MAX,
        ) {
            let rule = FineRule { daily_rate_cents: rate, grace_days: grace, max_cents: max };
            let base = NaiveDate::from_ymd_opt(1900, 1, 1).unwrap();
            let due_on = base + chrono::Days::new(due as u64);
            let returned_on = due_on + chrono::TimeDelta::days(late);
            let fine = rule.fine_cents(due_on, returned_on);
            prop_assert!((0..=max).contains(&fine));
        }

        #[test]
        fn fine_never_decreases_with_lateness(late in 0i64..5000, extra in 0i64..5000) {
            let rule = FineRule::default();
            let due_on = NaiveDate::from_ymd_opt(2026, 1, 1).unwrap();
            let a = rule.fine_cents(due_on, due_on + chrono::TimeDelta::days(late));
            let b = rule.fine_cents(due_on, due_on + chrono::TimeDelta::days(late + extra));
            prop_assert!(a <= b);
        }
    }
}
