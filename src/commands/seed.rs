//! `settlementd seed`: deterministic synthetic loans in the configured database.

use crate::app::{business_date_or_default, AppError, Database, Result};
use crate::calendar::BusinessDate;
use crate::clock::SystemClock;
use crate::config::Settings;
use crate::db;
use crate::seed::{seed_loans, SeedSpec, SeedSummary};

#[derive(Debug, Clone)]
pub struct SeedRequest {
    pub loans: u64,
    /// The month most loans are returned in, `YYYY-MM` (default: last month in schedule.timezone).
    pub month: Option<String>,
    /// The generator's seed: the same seed gives the same loans.
    pub seed: u64,
    /// A library's history of this many years ending just after the month, instead of one month.
    pub years: Option<u32>,
    /// With `years`: the mean gap between consecutive ids (1: dense).
    pub id_gap: u32,
    pub embedded_db: bool,
}

/// What a seed inserted, and for which month.
#[derive(Debug, Clone)]
pub struct Seeded {
    pub month: BusinessDate,
    pub summary: SeedSummary,
}

/// Validates, connects (migrating a fresh database) and loads; `progress` gets the loans sent so far.
pub async fn seed(
    settings: &Settings,
    request: &SeedRequest,
    progress: impl Fn(u64),
) -> Result<Seeded> {
    let month = match request.month.as_deref() {
        Some(text) => BusinessDate::from_month(text)?,
        None => business_date_or_default(None, settings, &SystemClock)?,
    };
    let spec = match request.years {
        Some(years) => SeedSpec::history(request.loans, month, request.seed, years, request.id_gap),
        None if request.id_gap != 1 => {
            return Err(AppError::Invalid(
                "--id-gap needs --years (a history)".into(),
            ))
        }
        None => SeedSpec::new(request.loans, month, request.seed),
    };
    spec.validate().map_err(AppError::Invalid)?;

    let database = Database::open(settings, request.embedded_db).await?;
    let result = async {
        db::migrate(&database.pool).await?;
        Ok::<_, AppError>(seed_loans(&database.pool, &spec, progress).await?)
    }
    .await;
    database.close().await;
    Ok(Seeded {
        month,
        summary: result?,
    })
}

impl Seeded {
    /// The one line `seed` prints.
    pub fn line(&self) -> String {
        format!(
            "seeded {} loans for {} (ids {}..{}) in {} ms",
            self.summary.loans,
            self.month.first_day().format("%Y-%m"),
            self.summary.first_id,
            self.summary.last_id,
            self.summary.elapsed.as_millis()
        )
    }
}
