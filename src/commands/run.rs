//! `settlementd run`: run one month of one job for one shard, once — or a range of months, in
//! order, for one shard or every shard.

use crate::app::{
    business_date_or_default, check_schema, ensure_month_is_over, run_options, shutdown_on_signals,
    AppError, Database, Result,
};
use crate::calendar::BusinessDate;
use crate::clock::SystemClock;
use crate::config::{Settings, ShardSpec};
use crate::db;
use crate::job_layer::dry::DryRun;
use crate::job_layer::registry::Registered;
use crate::job_layer::{JobError, JobKey, Progress, RunReport, SkipReason, Words};
use std::sync::Arc;

/// What to run; `None` fields fall back to the configuration.
#[derive(Debug, Clone, Default)]
pub struct RunRequest {
    /// The job (default: the registry's first, `fine-settlement`).
    pub job: Option<String>,
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
    /// taken over), as a `serve` replica does. Also wait while the job it follows has not closed
    /// the month (not ready), instead of refusing.
    pub wait: bool,
    /// Use a private PostgreSQL in `database.embedded_dir`.
    pub embedded_db: bool,
}

/// A range of months: `--from YYYY-MM --to YYYY-MM`, each month for one shard or every shard.
#[derive(Debug, Clone, Default)]
pub struct RangeRequest {
    pub run: RunRequest,
    pub from: String,
    pub to: String,
    /// Every shard of the shard count, one after the other, instead of one shard.
    pub all_shards: bool,
}

/// The job a command names (`--job`), or the registry's default.
pub fn job_of(settings: &Settings, name: Option<&str>) -> Result<Arc<dyn Registered>> {
    let registry = crate::jobs::build(settings);
    let name = name.unwrap_or(crate::jobs::default_job());
    registry
        .get(name)
        .cloned()
        .map_err(|why| AppError::Invalid(format!("--job: {why}")))
}

/// Validates the request, runs the month's shard through the job layer until it is done, skipped
/// or failed, and stops on SIGINT/SIGTERM after the batch in flight.
pub async fn run(
    settings: &Settings,
    request: &RunRequest,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<RunReport> {
    let job = job_of(settings, request.job.as_deref())?;
    let shard = ShardSpec::new(
        request.shard.unwrap_or(settings.shard.index),
        request.shards.unwrap_or(settings.shard.count),
    )?;
    let business_date =
        business_date_or_default(request.business_date.as_deref(), settings, &SystemClock)?;
    let key = checked_key(settings, &job, business_date, shard)?;
    let database = open(settings, request.embedded_db).await?;
    let shutdown = shutdown_on_signals();
    let result = run_key(
        settings,
        &database,
        &job,
        key,
        request,
        &shutdown,
        on_progress,
    )
    .await;
    database.close().await;
    result
}

/// What one month of a range did (or why it stopped there).
#[derive(Debug)]
pub struct MonthDone {
    pub business_date: BusinessDate,
    /// One report per shard run (several with `--all-shards`).
    pub reports: Vec<RunReport>,
}

/// Runs every month from `from` to `to` in order, for the shard or every shard, calling
/// `on_month` after each month. Stops at the first failure: the error names the month and says
/// that running the same command again resumes (months done are skipped as SUCCESS). A range
/// whose every key ran but some were held by another run ends with [`AppError::Held`] (exit 5)
/// naming them.
pub async fn run_range(
    settings: &Settings,
    request: &RangeRequest,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
    on_month: &mut (dyn FnMut(&MonthDone) + Send),
) -> Result<Vec<MonthDone>> {
    let job = job_of(settings, request.run.job.as_deref())?;
    let months = range_months(request)?;
    let shards = request.run.shards.unwrap_or(settings.shard.count);
    let targets: Vec<ShardSpec> = if request.all_shards {
        if request.run.shard.is_some() {
            return Err(AppError::Invalid(
                "--shard and --all-shards exclude each other".into(),
            ));
        }
        (0..shards)
            .map(|s| ShardSpec::new(s, shards))
            .collect::<std::result::Result<_, _>>()?
    } else {
        vec![ShardSpec::new(
            request.run.shard.unwrap_or(settings.shard.index),
            shards,
        )?]
    };
    // Every month is checked before anything runs: a range is refused whole, not half run.
    let mut keys = Vec::new();
    for month in &months {
        for shard in &targets {
            keys.push(checked_key(settings, &job, *month, *shard)?);
        }
    }
    let database = open(settings, request.run.embedded_db).await?;
    let shutdown = shutdown_on_signals();
    let mut done = Vec::new();
    let mut keys = keys.into_iter().peekable();
    let result = async {
        for month in months {
            let mut reports = Vec::new();
            while let Some(key) = keys.next_if(|k| k.business_date == month.date()) {
                let ran = run_key(
                    settings,
                    &database,
                    &job,
                    key,
                    &request.run,
                    &shutdown,
                    on_progress,
                )
                .await;
                match ran {
                    Ok(report) => reports.push(report),
                    Err(e) => {
                        return Err(stopped(e, month, &request.from, &request.to));
                    }
                }
            }
            let month_done = MonthDone {
                business_date: month,
                reports,
            };
            on_month(&month_done);
            done.push(month_done);
        }
        Ok(())
    }
    .await;
    database.close().await;
    result?;
    match held(&done) {
        Some(why) => Err(AppError::Held(why)),
        None => Ok(done),
    }
}

/// `run --dry-run`: what runs of each month of the request would do, for its shard or every
/// shard, read in one read-only snapshot per month ([`jobs::dry`]); nothing is written. A month
/// not over yet, or one the configuration does not cover, is shown with that refusal rather than
/// refused whole: a dry run of any month says what stands in its way.
pub async fn dry_run(settings: &Settings, request: &RangeRequest) -> Result<Vec<DryRun>> {
    let job = job_of(settings, request.run.job.as_deref())?;
    let months: Vec<BusinessDate> = if request.from.is_empty() {
        vec![business_date_or_default(
            request.run.business_date.as_deref(),
            settings,
            &SystemClock,
        )?]
    } else {
        range_months(request)?
    };
    let count = request.run.shards.unwrap_or(settings.shard.count);
    let shards: Vec<u32> = if request.all_shards {
        (0..ShardSpec::new(0, count)?.count).collect()
    } else {
        vec![ShardSpec::new(request.run.shard.unwrap_or(settings.shard.index), count)?.index]
    };
    let database = open_to_read(settings, request.run.embedded_db).await?;
    let result = crate::app::dry_months(
        settings,
        &database.pool,
        job.as_ref(),
        &months,
        count,
        &shards,
        request.run.force,
        None,
    )
    .await;
    database.close().await;
    result
}

/// The months of `--from`/`--to`, in order; `--to` before `--from` is refused.
fn range_months(request: &RangeRequest) -> Result<Vec<BusinessDate>> {
    let from = BusinessDate::from_month(&request.from)
        .map_err(|e| AppError::Invalid(format!("--from: {e}")))?;
    let to = BusinessDate::from_month(&request.to)
        .map_err(|e| AppError::Invalid(format!("--to: {e}")))?;
    if to < from {
        return Err(AppError::Invalid(format!(
            "--to {} is before --from {}",
            request.to, request.from
        )));
    }
    Ok(crate::calendar::months_between(from, to)
        .into_iter()
        .filter_map(|d| BusinessDate::new(d).ok())
        .collect())
}

/// What a range that ended with keys held by another run says (exit 5), or `None` when none was.
fn held(done: &[MonthDone]) -> Option<String> {
    let held: Vec<String> = done
        .iter()
        .flat_map(|m| &m.reports)
        .filter(|r| r.skipped == Some(SkipReason::Held))
        .map(|r| {
            format!(
                "{} shard {}/{}",
                r.key.business_date.format("%Y-%m"),
                r.key.shard,
                r.key.shards
            )
        })
        .collect();
    if held.is_empty() {
        return None;
    }
    let (n, them) = match held.len() {
        1 => ("1 month's shard".to_string(), "it is"),
        n => (format!("{n} months' shards"), "they are"),
    };
    Some(format!(
        "the range ended with {n} held by another run, RUNNING under a lease that has not \
         expired (a live holder, or a dead one whose lease runs out after lease.ttl_secs): {}; \
         {them} not done — run the same command again with --wait to wait for each to finish or \
         be taken over (done months are skipped)",
        held.join(", ")
    ))
}

/// A range's failure at `month`, saying where it stopped and how to resume.
fn stopped(e: AppError, month: BusinessDate, from: &str, to: &str) -> AppError {
    let how = format!(
        "stopped at {}: {e}; the months before it are done — run the same command again (--from \
         {from} --to {to}) to resume: done months are skipped",
        month.first_day().format("%Y-%m")
    );
    match e {
        AppError::Invalid(_) => AppError::Invalid(how),
        AppError::Failed(_) => AppError::Failed(how),
        AppError::Refused(_) => AppError::Refused(how),
        AppError::Paused { json, .. } => AppError::Paused { message: how, json },
        AppError::Held(_) => AppError::Held(how),
        AppError::RowsHeld(_) => AppError::RowsHeld(how),
    }
}

/// The key of `month` for `shard`, once the month is over and the job's configuration covers it.
fn checked_key(
    settings: &Settings,
    job: &Arc<dyn Registered>,
    business_date: BusinessDate,
    shard: ShardSpec,
) -> Result<JobKey> {
    ensure_month_is_over(business_date, settings, &SystemClock)?;
    let key = JobKey {
        job_name: job.name().to_string(),
        business_date: business_date.date(),
        shards: shard.count,
        shard: shard.index,
    };
    job.params(&key)
        .map_err(|why| AppError::Invalid(format!("{business_date}: {why}")))?;
    Ok(key)
}

/// The database, its `loans` checked (and migrated when private).
async fn open(settings: &Settings, embedded_db: bool) -> Result<Database> {
    checked(Database::open(settings, embedded_db).await?, settings).await
}

/// [`open`] for a dry run, which writes nothing: a read-only server (a standby) will do. A private
/// database is migrated first, so it is opened as a writer's.
async fn open_to_read(settings: &Settings, embedded_db: bool) -> Result<Database> {
    if embedded_db || settings.database.embedded {
        return open(settings, embedded_db).await;
    }
    checked(Database::open_to_read(settings, false).await?, settings).await
}

/// `database`, once its `loans` are checked (and migrated when private).
async fn checked(database: Database, settings: &Settings) -> Result<Database> {
    if let Err(e) = check_schema(&database.pool, settings).await {
        database.close().await;
        return Err(e);
    }
    if database.embedded.is_some() {
        if let Err(e) = db::migrate(&database.pool).await {
            database.close().await;
            return Err(e.into());
        }
    }
    Ok(database)
}

/// One key, to completion: waiting out a live claim with `wait`.
async fn run_key(
    settings: &Settings,
    database: &Database,
    job: &Arc<dyn Registered>,
    key: JobKey,
    request: &RunRequest,
    shutdown: &tokio_util::sync::CancellationToken,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<RunReport> {
    let opts = run_options(settings, request.force, request.estimate);
    loop {
        let result = job
            .run(&database.pool, key.clone(), &opts, shutdown, on_progress)
            .await;
        match &result {
            Ok(r) if request.wait && r.skipped == Some(SkipReason::Held) => {
                tracing::info!("a live run holds the claim; waiting for it to finish or go stale")
            }
            Err(JobError::NotReady { why, .. }) if request.wait => {
                tracing::info!("not ready: {why}; waiting for it")
            }
            _ => return Ok(result?),
        }
        tokio::select! {
            _ = tokio::time::sleep(opts.heartbeat_every) => {}
            _ = shutdown.cancelled() => return Ok(result?),
        }
    }
}

/// The `run --json` object: the report, with each of the job's notes as a key (and, when the job
/// names the items, `<note>_ids`).
pub fn report_json(report: &RunReport, words: &Words) -> serde_json::Value {
    let mut json = serde_json::json!({
        "job": report.key.job_name,
        "business_date": report.key.business_date.to_string(),
        "shard": report.key.shard,
        "shards": report.key.shards,
        "skipped": report.skipped.is_some(),
        "skipped_because": report.skipped.map(|why| match why {
            SkipReason::Held => "held",
            SkipReason::AlreadyDone => "already_success",
            SkipReason::RequestServed => "request_served",
        }),
        "scanned": report.scanned,
        "updated": report.updated,
        "attempt": report.attempt,
        "elapsed_ms": report.elapsed.as_millis() as u64,
    });
    json[words.waiting_key] = report.late.into();
    if let Some(pinned) = words.pinned {
        json[pinned] = serde_json::json!(report.params);
    }
    for (name, noted) in &report.notes {
        json[*name] = noted.count.into();
        if let Some(ids) = &noted.ids {
            json[format!("{name}_ids")] = serde_json::json!(ids);
        }
    }
    json
}

/// The one-line summary `run` prints without `--json`.
pub fn report_line(job: &dyn Registered, report: &RunReport) -> String {
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
        None => {
            let notes: String = report
                .notes
                .iter()
                .filter(|(_, noted)| noted.count > 0)
                .map(|(name, noted)| format!("; {}", job.explain(name, noted)))
                .collect();
            let pinned = match job.words().pinned {
                Some(word) => format!("; {word}: {}", job.describe(&report.params)),
                None => String::new(),
            };
            format!(
                "{head}: SUCCESS attempt {}{}: scanned {}, updated {}{notes} in {ms} ms{pinned}",
                report.attempt.unwrap_or_default(),
                if report.late > 0 {
                    format!(" (for {} late items)", report.late)
                } else if report.took_over {
                    " (took over)".to_string()
                } else {
                    String::new()
                },
                report.scanned,
                report.updated,
            )
        }
    }
}
