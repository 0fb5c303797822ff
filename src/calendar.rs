//! Pure calendar rules: which month a run settles.
//!
//! A business date is always the last day of a month; the run for it settles loans returned from
//! the first day of that month through the business date. The scheduler derives it from the
//! *scheduled fire time* in the configured zone: a fire on 2027-01-01 02:30 Asia/Shanghai settles
//! 2026-12-31.
//!
//! Business dates lie in years 1 to 9999 ([`FIRST_YEAR`], [`LAST_YEAR`]), the range the command line
//! and the runs API document: chrono reads years far outside what PostgreSQL stores (and year 0),
//! and such a date must be refused as input, never fail later as a database error.

use chrono::{DateTime, Datelike, NaiveDate, TimeZone};
use std::fmt;

/// The last day of a month: the only dates a settlement runs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BusinessDate(NaiveDate);

/// The first and last years a business date may fall in.
pub const FIRST_YEAR: i32 = 1;
pub const LAST_YEAR: i32 = 9999;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CalendarError {
    #[error("invalid date '{0}': expected YYYY-MM-DD, years 1 to 9999")]
    Unparsable(String),
    #[error("invalid business date {0}: it must be the last day of a month (e.g. {1})")]
    NotMonthEnd(NaiveDate, NaiveDate),
    #[error("invalid month '{0}': expected YYYY-MM, years 1 to 9999")]
    BadMonth(String),
    #[error("invalid business date {0}: the year must be between {FIRST_YEAR} and {LAST_YEAR}")]
    OutOfRange(NaiveDate),
}

impl BusinessDate {
    /// Accepts only the last day of a month in years [`FIRST_YEAR`] to [`LAST_YEAR`].
    pub fn new(date: NaiveDate) -> Result<Self, CalendarError> {
        if !(FIRST_YEAR..=LAST_YEAR).contains(&date.year()) {
            return Err(CalendarError::OutOfRange(date));
        }
        let end = month_end(date.year(), date.month())
            .ok_or(CalendarError::Unparsable(date.to_string()))?;
        if end == date {
            Ok(Self(date))
        } else {
            Err(CalendarError::NotMonthEnd(date, end))
        }
    }

    /// The business date of the month `date` is in: `date` itself when it is one. Unchecked
    /// against [`FIRST_YEAR`] and [`LAST_YEAR`]: for a key that [`BusinessDate::new`] accepted
    /// already, or a daily key's month.
    pub fn of_month(date: NaiveDate) -> Self {
        Self(month_end(date.year(), date.month()).unwrap_or(date))
    }

    pub fn parse(text: &str) -> Result<Self, CalendarError> {
        let date = NaiveDate::parse_from_str(text.trim(), "%Y-%m-%d")
            .map_err(|_| CalendarError::Unparsable(text.to_string()))?;
        Self::new(date)
    }

    /// The business date of a month given as `YYYY-MM`.
    pub fn from_month(text: &str) -> Result<Self, CalendarError> {
        let bad = || CalendarError::BadMonth(text.to_string());
        let (y, m) = text.trim().split_once('-').ok_or_else(bad)?;
        let (y, m): (i32, u32) = (y.parse().map_err(|_| bad())?, m.parse().map_err(|_| bad())?);
        let end = month_end(y, m).ok_or_else(bad)?;
        Self::new(end)
    }

    /// The month end strictly before the month containing `day`.
    pub fn month_before(day: NaiveDate) -> Self {
        // The first of day's month minus one day: always valid for chrono's date range.
        let first = day.with_day(1).expect("day 1 exists in every month");
        Self(first.pred_opt().expect("dates after year -262143"))
    }

    /// The business date of the month containing `day` (`None` outside years 1 to 9999).
    pub fn of_month_of(day: NaiveDate) -> Option<Self> {
        Self::new(month_end(day.year(), day.month())?).ok()
    }

    /// The business date `months` months before this one (`None` before the first year).
    pub fn months_before(&self, months: u32) -> Option<Self> {
        let first = self
            .first_day()
            .checked_sub_months(chrono::Months::new(months))?;
        Self::new(month_end(first.year(), first.month())?).ok()
    }

    /// The business date for an instant (a cron fire time) in a zone: last month's end there.
    pub fn for_instant<Z: TimeZone>(instant: &DateTime<Z>) -> Self {
        Self::month_before(instant.date_naive())
    }

    /// Last day of the month (the date itself).
    pub fn date(&self) -> NaiveDate {
        self.0
    }

    /// First day of the settled month.
    pub fn first_day(&self) -> NaiveDate {
        self.0.with_day(1).expect("day 1 exists in every month")
    }

    /// The first day of the month of any date.
    pub fn month_start(date: NaiveDate) -> NaiveDate {
        date.with_day(1).unwrap_or(date)
    }

    /// The first days of the months of `periods` (business dates; a date that is not one is
    /// passed over): the months a job's `pending` reads.
    pub fn first_days(periods: &[NaiveDate]) -> Vec<NaiveDate> {
        periods
            .iter()
            .filter_map(|d| BusinessDate::new(*d).ok())
            .map(|d| d.first_day())
            .collect()
    }
}

impl fmt::Display for BusinessDate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The months of a lookback of `months` ending at `latest` (at least `latest`), oldest first.
pub fn lookback(latest: BusinessDate, months: u32) -> Vec<NaiveDate> {
    let earliest = latest.months_before(months.max(1) - 1).unwrap_or(latest);
    months_between(earliest, latest)
}

/// Every business date from `earliest` to `latest`, oldest first.
pub fn months_between(earliest: BusinessDate, latest: BusinessDate) -> Vec<NaiveDate> {
    let mut dates = Vec::new();
    let mut month = Some(earliest);
    while let Some(m) = month.filter(|m| *m <= latest) {
        dates.push(m.date());
        month = m.date().succ_opt().and_then(BusinessDate::of_month_of);
    }
    dates
}

fn month_end(year: i32, month: u32) -> Option<NaiveDate> {
    let next = if month == 12 {
        NaiveDate::from_ymd_opt(year.checked_add(1)?, 1, 1)?
    } else {
        NaiveDate::from_ymd_opt(year, month.checked_add(1)?, 1)?
    };
    NaiveDate::from_ymd_opt(year, month, 1)?;
    next.pred_opt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono_tz::Asia::Shanghai;

    fn d(s: &str) -> NaiveDate {
        s.parse().unwrap()
    }

    #[test]
    fn january_settles_the_previous_december() {
        assert_eq!(
            BusinessDate::month_before(d("2027-01-01")).date(),
            d("2026-12-31")
        );
        assert_eq!(
            BusinessDate::month_before(d("2027-01-31")).date(),
            d("2026-12-31")
        );
    }

    #[test]
    fn march_of_a_leap_year_settles_february_29() {
        assert_eq!(
            BusinessDate::month_before(d("2028-03-01")).date(),
            d("2028-02-29")
        );
        assert_eq!(
            BusinessDate::month_before(d("2027-03-01")).date(),
            d("2027-02-28")
        );
        assert!(BusinessDate::parse("2028-02-29").is_ok());
        assert!(BusinessDate::parse("2027-02-29").is_err());
    }

    #[test]
    fn only_month_ends_are_business_dates() {
        assert_eq!(
            BusinessDate::parse("2026-10-30"),
            Err(CalendarError::NotMonthEnd(d("2026-10-30"), d("2026-10-31")))
        );
        assert!(matches!(
            BusinessDate::parse("31/10/2026"),
            Err(CalendarError::Unparsable(_))
        ));
        assert_eq!(
            BusinessDate::parse("2026-10-31").unwrap().first_day(),
            d("2026-10-01")
        );
    }

    #[test]
    fn the_fire_time_is_read_in_the_configured_zone() {
        // 2026-12-31 18:30 UTC is already 2027-01-01 02:30 in Shanghai.
        let fire = chrono::Utc
            .with_ymd_and_hms(2026, 12, 31, 18, 30, 0)
            .unwrap();
        assert_eq!(BusinessDate::for_instant(&fire).date(), d("2026-11-30"));
        assert_eq!(
            BusinessDate::for_instant(&fire.with_timezone(&Shanghai)).date(),
            d("2026-12-31")
        );
    }

    #[test]
    fn business_dates_lie_in_years_1_to_9999() {
        assert!(BusinessDate::parse("0001-01-31").is_ok());
        assert!(BusinessDate::parse("9999-12-31").is_ok());
        for text in ["0000-12-31", "-4714-12-31", "-262143-01-31", "+10000-01-31"] {
            match BusinessDate::parse(text) {
                Err(CalendarError::OutOfRange(_)) => {}
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(BusinessDate::from_month("0000-12").is_err());
        assert!(BusinessDate::from_month("10000-01").is_err());
        assert_eq!(
            BusinessDate::from_month("0001-01").unwrap().first_day(),
            d("0001-01-01")
        );
    }

    #[test]
    fn a_business_date_some_months_before_is_that_months_last_day() {
        let nov = BusinessDate::parse("2026-11-30").unwrap();
        assert_eq!(nov.months_before(0), Some(nov));
        assert_eq!(nov.months_before(9).unwrap().date(), d("2026-02-28"));
        assert_eq!(nov.months_before(11).unwrap().date(), d("2025-12-31"));
        let early = BusinessDate::parse("0001-02-28").unwrap();
        assert_eq!(early.months_before(1).unwrap().date(), d("0001-01-31"));
        assert_eq!(early.months_before(2), None);
    }

    #[test]
    fn months_parse_to_their_last_day() {
        assert_eq!(
            BusinessDate::from_month("2028-02").unwrap().date(),
            d("2028-02-29")
        );
        assert!(BusinessDate::from_month("2028-13").is_err());
        assert!(BusinessDate::from_month("nope").is_err());
    }
}
