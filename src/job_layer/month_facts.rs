//! A closed month's facts, kept where every process reads them (`month_facts`): the status page of
//! each replica and `settlementd status` answer a month's facts from one row, not by reading the
//! month again (a month of a big library is hundreds of thousands of journal entries: seconds).
//!
//! A row is its facts and the marker they were counted at ([`Marker`]): the month's attempts
//! (every claim of the month raises them, a late run, a correction and a takeover included) and
//! the job's own mark ([`super::Job::facts_mark`]; the fine settlement: the month's last journal
//! row). A reader takes the row only when both still hold: it reads the attempts with the claims
//! and the mark with one index probe, in the snapshot it shows, so a kept row is never newer or
//! older than what the page draws beside it. A row whose marker moved is counted again, by the
//! next replica's view that has the time (or in its background) and written over. Never an empty
//! value as a marker: a month without a row has not been counted.
//!
//! Who writes: `serve`'s status page, after counting a closed month ([`store`], best effort: a
//! read-only server keeps the count in the replica's memory). `settlementd status` reads, and
//! counts what is not kept itself, without writing. The release before this one never reads or
//! writes the table; the journal rows it writes move the mark.

use super::Fact;
use chrono::{DateTime, NaiveDate, Utc};
use sqlx::types::Json;
use sqlx::{PgConnection, PgExecutor};
use std::collections::HashMap;

/// What a month's facts were counted at: they hold while both are unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    /// The sum of the month's attempts over its shards' claims
    /// ([`super::claim::MonthRunRow::month_attempts`]).
    pub month_attempts: i64,
    /// The job's mark ([`super::Job::facts_mark`]); `None` when the job has none, or the month
    /// nothing it marks.
    pub mark: Option<i64>,
}

/// One month's kept facts.
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    pub marker: Marker,
    pub facts: Vec<Fact>,
    pub counted_at: DateTime<Utc>,
}

/// A row of `month_facts`: date, attempts, mark, facts, counted at.
type Row = (
    NaiveDate,
    i64,
    Option<i64>,
    serde_json::Value,
    DateTime<Utc>,
);

/// The kept facts of `job`'s `dates`, by date; a date without a row, or whose row cannot be read
/// (facts written by another release in another shape), is absent: it is counted again. Nothing
/// when the database predates the table (`settlementd migrate` not run yet).
pub async fn read(
    db: &mut PgConnection,
    job: &str,
    dates: &[NaiveDate],
) -> sqlx::Result<HashMap<NaiveDate, Kept>> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('settlementd.month_facts') IS NOT NULL")
            .fetch_one(&mut *db)
            .await?;
    if !exists || dates.is_empty() {
        return Ok(HashMap::new());
    }
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT business_date, month_attempts, mark, facts, counted_at
               FROM settlementd.month_facts
              WHERE job_name = $1 AND business_date = ANY($2)",
    )
    .bind(job)
    .bind(dates)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|(date, month_attempts, mark, facts, counted_at)| {
            let facts = match serde_json::from_value::<Vec<Fact>>(facts) {
                Ok(facts) => facts,
                Err(e) => {
                    tracing::debug!(job, business_date = %date, error = %e, "kept facts unreadable: counted again");
                    return None;
                }
            };
            Some((
                date,
                Kept {
                    marker: Marker {
                        month_attempts,
                        mark,
                    },
                    facts,
                    counted_at,
                },
            ))
        })
        .collect())
}

/// Keeps `facts` of `job`'s month `date`, counted at `marker`, over whatever was kept.
pub async fn store(
    db: impl PgExecutor<'_>,
    job: &str,
    date: NaiveDate,
    marker: Marker,
    facts: &[Fact],
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO settlementd.month_facts AS k
                (job_name, business_date, month_attempts, mark, facts, counted_at)
         VALUES ($1, $2, $3, $4, $5, now())
         ON CONFLICT (job_name, business_date) DO UPDATE
            SET month_attempts = excluded.month_attempts, mark = excluded.mark,
                facts = excluded.facts, counted_at = excluded.counted_at",
    )
    .bind(job)
    .bind(date)
    .bind(marker.month_attempts)
    .bind(marker.mark)
    .bind(Json(facts))
    .execute(db)
    .await?;
    Ok(())
}
