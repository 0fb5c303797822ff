//! `settlementd run`: settle one month for one shard, once.

use crate::app::{
    business_date_or_default, ensure_month_is_over, run_options, settlement_job,
    shutdown_on_signals, Database, Result,
};
use crate::clock::SystemClock;
use crate::config::{Settings, ShardSpec};
use crate::db;
use crate::jobs::{self, Progress, RunReport, SkipReason};
use crate::settlement;

/// What to run; `None` fields fall back to the configuration.
#[derive(Debug, Clone, Default)]
pub struct RunRequest {
    /// The month as its last day, `YYYY-MM-DD` (default: last month's end in schedule.timezone).
    pub business_date: Option<String>,
    pub shard: Option<u32>,
    pub shards: Option<u32>,
    /// Re-run a month whose claim is already SUCCESS (never steals a live run).
    pub force: bool,
    /// Count the remaining rows first, for a progress display.
    pub estimate: bool,
    /// Use a private PostgreSQL in `database.embedded_dir`.
    pub embedded_db: bool,
}

/// Validates the request, runs the month's shard through the job layer until it is done, skipped
/// or failed, and stops on SIGINT/SIGTERM after the batch in flight.
pub async fn run(
    settings: &Settings,
    request: &RunRequest,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<RunReport> {
    let shard = ShardSpec::new(
        request.shard.unwrap_or(settings.shard.index),
        request.shards.unwrap_or(settings.shard.count),
    )?;
    let business_date =
        business_date_or_default(request.business_date.as_deref(), settings, &SystemClock)?;
    ensure_month_is_over(business_date, settings, &SystemClock)?;
    let database = Database::open(settings, request.embedded_db).await?;
    if database.embedded.is_some() {
        db::migrate(&database.pool).await?;
    }
    let shutdown = shutdown_on_signals();
    let result = jobs::run_once(
        &database.pool,
        &settlement_job(settings),
        settlement::key(business_date, shard),
        &run_options(settings, request.force, request.estimate),
        &shutdown,
        on_progress,
    )
    .await;
    database.close().await;
    Ok(result?)
}

/// The `run --json` object.
pub fn report_json(report: &RunReport) -> serde_json::Value {
    serde_json::json!({
        "business_date": report.key.business_date.to_string(),
        "shard": report.key.shard,
        "shards": report.key.shards,
        "skipped": report.skipped.is_some(),
        "scanned": report.scanned,
        "updated": report.updated,
        "odd_rows": report.odd,
        "attempt": report.attempt,
        "elapsed_ms": report.elapsed.as_millis() as u64,
    })
}

/// The one-line summary `run` prints without `--json`.
pub fn report_line(report: &RunReport) -> String {
    let head = format!("{}", report.key);
    let ms = report.elapsed.as_millis();
    match report.skipped {
        Some(SkipReason::AlreadyDone) => {
            format!("{head}: skipped, already SUCCESS (use --force to re-run) [{ms} ms]")
        }
        Some(SkipReason::Held) => {
            format!("{head}: skipped, another replica holds a live claim [{ms} ms]")
        }
        None => format!(
            "{head}: SUCCESS attempt {}{}: scanned {}, updated {}{} in {ms} ms",
            report.attempt.unwrap_or_default(),
            if report.took_over { " (took over)" } else { "" },
            report.scanned,
            report.updated,
            if report.odd > 0 {
                format!(
                    " ({} with contradictory dates, settled all the same)",
                    report.odd
                )
            } else {
                String::new()
            }
        ),
    }
}
