//! Deterministic synthetic loans, loaded with `COPY`, in two layouts ([`Layout`]):
//!
//! - [`Layout::Month`] (the default of [`SeedSpec::new`]), the seed chapter's data: every loan
//!   belongs to one month and the ids are one contiguous block. 90% of the loans are returned
//!   within the month, 28% of those on time or early (fine 0), the rest 1–60 days late with most a
//!   few days late (a geometric tail, mean about a week, like real returns); the other 10% are
//!   still out.
//! - [`Layout::History`], a library's table: loans borrowed evenly over years, ids handed out at
//!   borrowing (optionally with gaps), returned days to weeks later and a few very late, so one
//!   month's returns are spread over the ids of many months.
//!
//! Invariants:
//! - the same seed gives the same rows: the generator is ChaCha8 seeded with [`SeedSpec::seed`]
//!   and only integer arithmetic maps its output to values (no floats, no `rand` distributions,
//!   whose algorithms may change between versions);
//! - ids continue after the current `max(id)`, read under a lock that keeps a concurrent seed out,
//!   so seeding twice appends and never collides;
//! - the load is one transaction: a failed seed leaves nothing behind.

use crate::calendar::BusinessDate;
use chrono::{Datelike, NaiveDate};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sqlx::PgPool;
use std::io::Write;
use std::time::{Duration, Instant};

/// More than this in one call is almost certainly a typo (and would take hours).
pub const MAX_LOANS: u64 = 100_000_000;
/// The largest mean id gap: with [`MAX_LOANS`] loans the ids stay far below `i64::MAX`.
pub const MAX_ID_GAP: u32 = 1_000_000;

/// `COPY` data is sent in chunks of about this many bytes.
const CHUNK_BYTES: usize = 1 << 20;
/// Loan period: due this many days after borrowing.
const LOAN_DAYS: i64 = 21;
/// On-time returns come back 0..=this many days before the due date.
const MAX_DAYS_EARLY: u64 = 7;

/// What to seed. Build with [`SeedSpec::new`] for the seed chapter's shape, then adjust fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedSpec {
    /// How many loans to insert.
    pub loans: u64,
    /// The month the returned loans are returned in.
    pub month: BusinessDate,
    /// The generator's seed: the same seed gives the same rows.
    pub seed: u64,
    /// Percent of loans returned within the month (the rest are still out).
    pub returned_percent: u32,
    /// Percent of the returned loans that come back on time or early (fine 0).
    pub on_time_percent: u32,
    /// The latest a late loan comes back, in days after its due date (at least 1).
    pub max_days_late: u32,
    /// Where ids and dates fall.
    pub layout: Layout,
}

/// Where the seeded loans' ids and dates fall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every loan belongs to `month`; ids are one contiguous block (an append-only table holding
    /// one month).
    Month,
    /// A library's history: loans borrowed evenly over `years` years up to [`HISTORY_TAIL_DAYS`]
    /// after `month`, ids in borrow order `mean_id_gap` apart on average (1: dense; gaps vary
    /// between 1 and twice the mean), each returned 5–70 days after borrowing, one in fifty
    /// 200–700 days after, and still out when that is after the last borrow day. The returns of
    /// `month` are spread over the ids of the months before it. `returned_percent`,
    /// `on_time_percent` and `max_days_late` do not apply.
    History { years: u32, mean_id_gap: u32 },
}

/// A history ends this many days after the month's last day ("today" for the generated table).
pub const HISTORY_TAIL_DAYS: u64 = 20;

impl SeedSpec {
    /// The seed chapter's shape: 90% returned, 28% of those on time, the rest 1–60 days late.
    pub fn new(loans: u64, month: BusinessDate, seed: u64) -> Self {
        Self {
            loans,
            month,
            seed,
            returned_percent: 90,
            on_time_percent: 28,
            max_days_late: 60,
            layout: Layout::Month,
        }
    }

    /// A library's history of `years` years ending just after `month` ([`Layout::History`]).
    pub fn history(
        loans: u64,
        month: BusinessDate,
        seed: u64,
        years: u32,
        mean_id_gap: u32,
    ) -> Self {
        Self {
            layout: Layout::History { years, mean_id_gap },
            ..Self::new(loans, month, seed)
        }
    }

    /// Rejects specs that cannot make sense, before anything touches the database.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.loans == 0 {
            return Err("--loans must be at least 1".into());
        }
        if self.loans > MAX_LOANS {
            return Err(format!(
                "--loans {} is more than the limit of {MAX_LOANS}; seed in several runs",
                self.loans
            ));
        }
        for (name, value) in [
            ("returned_percent", self.returned_percent),
            ("on_time_percent", self.on_time_percent),
        ] {
            if value > 100 {
                return Err(format!("{name} must be <= 100, got {value}"));
            }
        }
        if let Layout::History { years, mean_id_gap } = self.layout {
            if !(1..=100).contains(&years) {
                return Err(format!("--years must be between 1 and 100, got {years}"));
            }
            if !(1..=MAX_ID_GAP).contains(&mean_id_gap) {
                return Err(format!(
                    "--id-gap must be between 1 and {MAX_ID_GAP}, got {mean_id_gap}"
                ));
            }
        }
        if !(1..=3650).contains(&self.max_days_late) {
            return Err(format!(
                "max_days_late must be between 1 and 3650, got {}",
                self.max_days_late
            ));
        }
        Ok(())
    }
}

/// What a seed inserted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedSummary {
    pub loans: u64,
    /// First and last id inserted (inclusive).
    pub first_id: i64,
    pub last_id: i64,
    /// Loans returned within the month (the rows a settlement of the month settles).
    pub returned: u64,
    /// Returned loans that came back on time or early (fine 0).
    pub on_time: u64,
    pub elapsed: Duration,
}

/// One generated loan; `returned_on` is `None` for a loan still out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Loan {
    member_id: u64,
    book_id: u64,
    borrowed_on: NaiveDate,
    due_on: NaiveDate,
    returned_on: Option<NaiveDate>,
}

/// The deterministic loan generator: the n-th loan depends only on the spec and n.
struct Generator {
    rng: ChaCha8Rng,
    first_day: NaiveDate,
    days_in_month: u64,
    returned_percent: u64,
    on_time_percent: u64,
    max_days_late: u64,
    layout: Layout,
    /// History only: the first borrow day, how many days loans are borrowed over, how many loans.
    history_start: NaiveDate,
    history_days: u64,
    loans: u64,
}

impl Generator {
    fn new(spec: &SeedSpec) -> Self {
        let first_day = spec.month.first_day();
        Self {
            rng: ChaCha8Rng::seed_from_u64(spec.seed),
            first_day,
            days_in_month: u64::from(spec.month.date().day()),
            returned_percent: spec.returned_percent.into(),
            on_time_percent: spec.on_time_percent.into(),
            max_days_late: spec.max_days_late.into(),
            layout: spec.layout,
            history_start: history_end(spec) - days(history_days(spec)),
            history_days: history_days(spec),
            loans: spec.loans,
        }
    }

    /// How far the id after the previous one is: 1, or 1..=2×mean-1 (mean `mean_id_gap`).
    fn id_step(&mut self) -> i64 {
        match self.layout {
            Layout::History { mean_id_gap, .. } if mean_id_gap > 1 => {
                1 + self.below(2 * u64::from(mean_id_gap) - 1) as i64
            }
            _ => 1,
        }
    }

    /// The `n`-th loan (0-based) of the spec's layout.
    fn loan(&mut self, n: u64) -> Loan {
        match self.layout {
            Layout::Month => self.next_loan(),
            Layout::History { .. } => self.history_loan(n),
        }
    }

    fn history_loan(&mut self, n: u64) -> Loan {
        let member_id = 1 + self.below(5_000);
        let book_id = 1 + self.below(20_000);
        // Borrow days advance with the id: ids are handed out at borrowing.
        let offset =
            (u128::from(n) * u128::from(self.history_days) / u128::from(self.loans.max(1))) as u64;
        let borrowed_on = self.history_start + days(offset);
        let kept = if self.below(50) == 0 {
            200 + self.below(501)
        } else {
            5 + self.below(66)
        };
        let returned_on = borrowed_on + days(kept);
        let today = self.history_start + days(self.history_days);
        Loan {
            member_id,
            book_id,
            borrowed_on,
            due_on: borrowed_on + chrono::TimeDelta::days(LOAN_DAYS),
            returned_on: (returned_on <= today).then_some(returned_on),
        }
    }

    /// A value in `0..n` from the raw stream (multiply-shift: stable, bias below 2^-32 here).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.rng.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Days late, 1..=max: geometric with mean about 8, truncated (most late returns are days,
    /// not weeks, late — which is what makes the seed's totals).
    fn days_late(&mut self) -> u64 {
        let mut days = 1;
        while days < self.max_days_late && self.below(8) != 0 {
            days += 1;
        }
        days
    }

    fn next_loan(&mut self) -> Loan {
        let member_id = 1 + self.below(5_000);
        let book_id = 1 + self.below(20_000);
        let day = days(self.below(self.days_in_month));
        if self.below(100) >= self.returned_percent {
            // Still out: due some time around the month.
            let due_on = self.first_day + day + days(self.below(30));
            return Loan {
                member_id,
                book_id,
                borrowed_on: due_on - chrono::TimeDelta::days(LOAN_DAYS),
                due_on,
                returned_on: None,
            };
        }
        let returned_on = self.first_day + day;
        let due_on = if self.below(100) < self.on_time_percent {
            returned_on + days(self.below(MAX_DAYS_EARLY + 1))
        } else {
            returned_on - days(self.days_late())
        };
        Loan {
            member_id,
            book_id,
            borrowed_on: due_on - chrono::TimeDelta::days(LOAN_DAYS),
            due_on,
            returned_on: Some(returned_on),
        }
    }
}

fn days(n: u64) -> chrono::TimeDelta {
    chrono::TimeDelta::days(n as i64)
}

/// The last borrow day of a history ("today" for the generated table).
fn history_end(spec: &SeedSpec) -> NaiveDate {
    spec.month.date() + days(HISTORY_TAIL_DAYS)
}

/// How many days a history spans (0 for the month layout).
fn history_days(spec: &SeedSpec) -> u64 {
    match spec.layout {
        Layout::History { years, .. } => u64::from(years) * 365,
        Layout::Month => 0,
    }
}

/// Appends `spec.loans` loans after the current `max(id)` in one transaction, streaming them with
/// `COPY`. `progress` is called with the number of loans sent so far after each chunk. An invalid
/// spec ([`SeedSpec::validate`]) is refused as `sqlx::Error::Protocol` before any query.
pub async fn seed_loans(
    pool: &PgPool,
    spec: &SeedSpec,
    progress: impl Fn(u64),
) -> sqlx::Result<SeedSummary> {
    spec.validate().map_err(sqlx::Error::Protocol)?;
    let started = Instant::now();
    let mut tx = pool.begin().await?;
    // Blocks a concurrent seed (and any writer) until commit, so max(id) stays ours.
    sqlx::query("LOCK TABLE loans IN SHARE ROW EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await?;
    let max_id: Option<i64> = sqlx::query_scalar("SELECT max(id) FROM loans")
        .fetch_one(&mut *tx)
        .await?;
    let first_id = max_id.unwrap_or(0) + 1;
    let mut last_id = first_id;

    let mut generator = Generator::new(spec);
    let (mut returned, mut on_time) = (0u64, 0u64);
    let mut copy = tx
        .copy_in_raw(
            "COPY loans (id, member_id, book_id, borrowed_on, due_on, returned_on) FROM STDIN",
        )
        .await?;
    let mut chunk = Vec::with_capacity(CHUNK_BYTES + 256);
    let mut sent = 0u64;
    let month = spec.month.first_day()..=spec.month.date();
    let mut id = first_id;
    for n in 0..spec.loans {
        let loan = generator.loan(n);
        if let Some(returned_on) = loan.returned_on.filter(|r| month.contains(r)) {
            returned += 1;
            on_time += u64::from(returned_on <= loan.due_on);
        }
        write_row(&mut chunk, id, &loan);
        last_id = id;
        id += generator.id_step();
        if chunk.len() >= CHUNK_BYTES {
            copy.send(chunk.as_slice()).await?;
            chunk.clear();
            sent = n + 1;
            progress(sent);
        }
    }
    if !chunk.is_empty() {
        copy.send(chunk.as_slice()).await?;
    }
    let copied = copy.finish().await?;
    tx.commit().await?;
    // Fresh statistics, so the settlement's first plan over a bulk load is not a guess.
    sqlx::query("ANALYZE loans").execute(pool).await?;
    if sent != spec.loans {
        progress(spec.loans);
    }
    Ok(SeedSummary {
        loans: copied,
        first_id,
        last_id,
        returned,
        on_time,
        elapsed: started.elapsed(),
    })
}

/// One line of `COPY … FROM STDIN` text format (tab-separated, `\N` for NULL).
fn write_row(out: &mut Vec<u8>, id: i64, loan: &Loan) {
    // Writing into a Vec cannot fail.
    let _ = write!(
        out,
        "{id}\t{}\t{}\t{}\t{}\t",
        loan.member_id, loan.book_id, loan.borrowed_on, loan.due_on
    );
    match loan.returned_on {
        Some(date) => {
            let _ = writeln!(out, "{date}");
        }
        None => out.extend_from_slice(b"\\N\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(loans: u64, seed: u64) -> SeedSpec {
        SeedSpec::new(loans, BusinessDate::from_month("2026-10").unwrap(), seed)
    }

    fn rows(spec: &SeedSpec) -> Vec<Loan> {
        let mut generator = Generator::new(spec);
        (0..spec.loans).map(|_| generator.next_loan()).collect()
    }

    #[test]
    fn the_same_seed_gives_the_same_loans() {
        assert_eq!(rows(&spec(500, 7)), rows(&spec(500, 7)));
        assert_ne!(rows(&spec(500, 7)), rows(&spec(500, 8)));
    }

    #[test]
    fn returned_loans_fall_within_the_month_and_at_most_max_days_late() {
        let spec = spec(20_000, 1);
        for loan in rows(&spec) {
            assert_eq!(loan.due_on - loan.borrowed_on, chrono::TimeDelta::days(21));
            if let Some(r) = loan.returned_on {
                assert!((spec.month.first_day()..=spec.month.date()).contains(&r));
                let late = (r - loan.due_on).num_days();
                assert!((-7..=60).contains(&late), "{late} days late");
            }
        }
    }

    #[test]
    fn rows_are_copy_text_with_null_for_loans_still_out() {
        let d = |s: &str| s.parse::<NaiveDate>().unwrap();
        let mut out = Vec::new();
        let mut loan = Loan {
            member_id: 3,
            book_id: 4,
            borrowed_on: d("2026-09-20"),
            due_on: d("2026-10-11"),
            returned_on: Some(d("2026-10-12")),
        };
        write_row(&mut out, 9, &loan);
        loan.returned_on = None;
        write_row(&mut out, 10, &loan);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "9\t3\t4\t2026-09-20\t2026-10-11\t2026-10-12\n10\t3\t4\t2026-09-20\t2026-10-11\t\\N\n"
        );
    }

    #[test]
    fn a_history_spreads_one_months_returns_over_the_ids_of_earlier_months() {
        let spec = SeedSpec::history(
            100_000,
            BusinessDate::from_month("2026-10").unwrap(),
            3,
            2,
            1,
        );
        let mut generator = Generator::new(&spec);
        let loans: Vec<Loan> = (0..spec.loans).map(|n| generator.loan(n)).collect();
        let month = spec.month.first_day()..=spec.month.date();
        let returned_in_month: Vec<usize> = loans
            .iter()
            .enumerate()
            .filter(|(_, l)| l.returned_on.is_some_and(|r| month.contains(&r)))
            .map(|(n, _)| n)
            .collect();
        // About a month's worth of two years' loans, borrowed over more than a year.
        assert!(
            (3_000..5_500).contains(&returned_in_month.len()),
            "{}",
            returned_in_month.len()
        );
        let span = loans[*returned_in_month.last().unwrap()].borrowed_on
            - loans[returned_in_month[0]].borrowed_on;
        assert!(span.num_days() > 365, "{span}");
        for pair in loans.windows(2) {
            assert!(
                pair[0].borrowed_on <= pair[1].borrowed_on,
                "ids in borrow order"
            );
        }
        for loan in &loans {
            if let Some(r) = loan.returned_on {
                let kept = (r - loan.borrowed_on).num_days();
                assert!(
                    (5..=70).contains(&kept) || (200..=700).contains(&kept),
                    "{kept}"
                );
                assert!(r <= history_end(&spec));
            }
        }
    }

    #[test]
    fn history_ids_are_gapped_around_the_mean() {
        let spec = SeedSpec::history(
            20_000,
            BusinessDate::from_month("2026-10").unwrap(),
            3,
            1,
            300,
        );
        let mut generator = Generator::new(&spec);
        let total: i64 = (0..spec.loans).map(|_| generator.id_step()).sum();
        let mean = total as f64 / spec.loans as f64;
        assert!((280.0..320.0).contains(&mean), "{mean}");
        let dense = SeedSpec::history(10, spec.month, 3, 1, 1);
        let mut generator = Generator::new(&dense);
        assert!((0..10).all(|_| generator.id_step() == 1));
    }

    #[test]
    fn zero_and_absurd_counts_are_rejected() {
        assert!(spec(0, 1).validate().unwrap_err().contains("at least 1"));
        assert!(spec(MAX_LOANS + 1, 1).validate().is_err());
        assert!(spec(1, 1).validate().is_ok());
        let month = BusinessDate::from_month("2026-10").unwrap();
        assert!(SeedSpec::history(1, month, 1, 0, 1).validate().is_err());
        assert!(SeedSpec::history(1, month, 1, 3, 0).validate().is_err());
        assert!(SeedSpec::history(1, month, 1, 3, MAX_ID_GAP + 1)
            .validate()
            .is_err());
    }
}
