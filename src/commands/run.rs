//! `settlementd run`: settle one month for one shard, once.

use crate::app::{
    business_date_or_default, check_schema, ensure_month_is_over, run_options, settlement_job,
    shutdown_on_signals, AppError, Database, Result,
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
    /// When a live run holds the key, wait for it — every `lease.heartbeat_secs` — instead of
    /// skipping: until it is SUCCESS (then skipped as done) or its lease expires or it fails (then
    /// taken over), as a `serve` replica does.
    pub wait: bool,
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
    let job = settlement_job(settings);
    job.rule_of(business_date.date())
        .map_err(|why| AppError::Invalid(format!("{business_date}: {why}")))?;
    let database = Database::open(settings, request.embedded_db).await?;
    if let Err(e) = check_schema(&database.pool, settings).await {
        database.close().await;
        return Err(e);
    }
    if database.embedded.is_some() {
        db::migrate(&database.pool).await?;
    }
    let shutdown = shutdown_on_signals();
    let opts = run_options(settings, request.force, request.estimate);
    let result = loop {
        let result = jobs::run_once(
            &database.pool,
            &job,
            settlement::key(business_date, shard),
            &opts,
            &shutdown,
            on_progress,
        )
        .await;
        let held = matches!(&result, Ok(r) if r.skipped == Some(SkipReason::Held));
        if !(request.wait && held) {
            break result;
        }
        tracing::info!("a live run holds the claim; waiting for it to finish or go stale");
        tokio::select! {
            _ = tokio::time::sleep(opts.heartbeat_every) => {}
            _ = shutdown.cancelled() => break result,
        }
    };
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
        "held": report.held,
        "held_ids": report.held_ids,
        "late_returns": report.late,
        "rule": report.params,
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
        Some(SkipReason::RequestServed) => {
            format!("{head}: skipped, the run request was already served [{ms} ms]")
        }
        None => format!(
            "{head}: SUCCESS attempt {}{}{}: scanned {}, updated {}{}{} in {ms} ms; rule: {}",
            report.attempt.unwrap_or_default(),
            if report.took_over && report.late == 0 {
                " (took over)"
            } else {
                ""
            },
            if report.late > 0 {
                format!(" (for {} late returns)", report.late)
            } else {
                String::new()
            },
            report.scanned,
            report.updated,
            if report.odd > 0 {
                format!(
                    " ({} with contradictory dates, settled all the same)",
                    report.odd
                )
            } else {
                String::new()
            },
            if report.held > 0 {
                format!(
                    "; {} rows held (bad dates), left unsettled: ids {:?}",
                    report.held, report.held_ids
                )
            } else {
                String::new()
            },
            settlement::describe_params(&report.params)
        ),
    }
}
