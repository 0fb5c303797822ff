//! The command line: argument types, the commands that are thin wrappers over the library, and the
//! mapping of every error to an exit code (0 done or skipped, 1 failed, 2 invalid input/config).

use crate::app::{
    business_date_or_default, ensure_month_is_over, run_options, settlement_job,
    shutdown_on_signals, AppError, Database, Result,
};
use crate::clock::SystemClock;
use crate::config::{Settings, ShardSpec};
use crate::db;
use crate::jobs::{self, RunReport, SkipReason};
use crate::settlement;
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "settlementd",
    version,
    about = "Idempotent monthly settlement of library-loan fines"
)]
pub struct Cli {
    /// A TOML file layered over the built-in defaults (environment variables SETTLEMENTD__SECTION__KEY win over both).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the embedded database migrations.
    Migrate(DbArgs),
    /// Settle one month for one shard, once (idempotent: re-running changes nothing).
    Run(RunArgs),
    /// Show each shard's job_runs row for a business date and the month's settled totals.
    Status(StatusArgs),
    /// Run as a long-lived replica: cron schedule, catch-up, retries, health and metrics.
    Serve(DbArgs),
    /// Print the next fire times and their business dates (no database needed).
    Schedule(ScheduleArgs),
    /// Insert deterministic synthetic loans into the configured database.
    Seed(SeedArgs),
    /// The seed's experiment on a private temporary PostgreSQL, in one command.
    Demo,
}

#[derive(Debug, Args)]
pub struct DbArgs {
    /// Use a private PostgreSQL in database.embedded_dir instead of database.url.
    #[arg(long)]
    pub embedded_db: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The month to settle, as its last day (default: last month's end in schedule.timezone).
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub business_date: Option<String>,
    /// This run's shard index (overrides shard.index).
    #[arg(long, value_name = "N")]
    pub shard: Option<u32>,
    /// The shard count (overrides shard.count).
    #[arg(long, value_name = "M")]
    pub shards: Option<u32>,
    /// Re-run a month whose claim is already SUCCESS (never steals a live run).
    #[arg(long)]
    pub force: bool,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub business_date: Option<String>,
    /// The shard count whose claims to show (default shard.count).
    #[arg(long, value_name = "M")]
    pub shards: Option<u32>,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct ScheduleArgs {
    /// How many fire times to print.
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub next: usize,
    /// One JSON object per line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct SeedArgs {
    /// How many loans to insert.
    #[arg(long, value_name = "N")]
    pub loans: u64,
    /// The month most loans are returned in (default: last month in schedule.timezone).
    #[arg(long, value_name = "YYYY-MM")]
    pub month: Option<String>,
    /// Random seed: the same seed gives the same loans.
    #[arg(long, value_name = "S", default_value_t = 42)]
    pub seed: u64,
    #[command(flatten)]
    pub db: DbArgs,
}

/// Parses the command line; help and version print and exit 0, anything else invalid is one line
/// on stderr and exit 2.
pub fn parse() -> std::result::Result<Cli, ExitCode> {
    Cli::try_parse().map_err(|e| {
        use clap::error::ErrorKind;
        match e.kind() {
            ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
                let _ = e.print();
                ExitCode::SUCCESS
            }
            _ => {
                let text = e.render().to_string();
                let first = text
                    .lines()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("invalid arguments");
                eprintln!("{} (see --help)", first.trim());
                ExitCode::from(2)
            }
        }
    })
}

/// Runs one parsed command to completion.
pub async fn execute(cli: Cli, settings: Settings) -> Result<()> {
    match cli.command {
        Command::Migrate(args) => {
            let database = Database::open(&settings, args.embedded_db).await?;
            let result = db::migrate(&database.pool).await;
            database.close().await;
            result?;
            println!("migrations applied");
            Ok(())
        }
        Command::Run(args) => run_command(args, settings).await,
        Command::Status(args) => status_command(args, settings).await,
        Command::Serve(args) => crate::daemon::serve_command(settings, args.embedded_db).await,
        Command::Schedule(args) => {
            crate::daemon::schedule::print_next(&settings, &SystemClock, args.next, args.json)
        }
        Command::Seed(args) => crate::seed::seed_command(args, settings).await,
        Command::Demo => crate::demo::run(settings).await,
    }
}

async fn run_command(args: RunArgs, settings: Settings) -> Result<()> {
    let shard = ShardSpec::new(
        args.shard.unwrap_or(settings.shard.index),
        args.shards.unwrap_or(settings.shard.count),
    )?;
    let business_date =
        business_date_or_default(args.business_date.as_deref(), &settings, &SystemClock)?;
    ensure_month_is_over(business_date, &settings, &SystemClock)?;
    let database = Database::open(&settings, args.db.embedded_db).await?;
    if database.embedded.is_some() {
        db::migrate(&database.pool).await?;
    }
    let shutdown = shutdown_on_signals();
    let show_bar = !args.json && std::io::stderr().is_terminal();
    let bar = indicatif::ProgressBar::hidden();
    if show_bar {
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} rows {per_sec} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    }
    let on_progress = |p: jobs::Progress| {
        if let Some(total) = p.total {
            bar.set_length(total);
        }
        bar.set_position(p.scanned);
    };
    let result = jobs::run_once(
        &database.pool,
        &settlement_job(&settings),
        settlement::key(business_date, shard),
        &run_options(&settings, args.force, show_bar),
        &shutdown,
        &on_progress,
    )
    .await;
    bar.finish_and_clear();
    database.close().await;
    let report = result?;
    if args.json {
        println!("{}", report_json(&report));
    } else {
        println!("{}", report_line(&report));
    }
    Ok(())
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
        "attempt": report.attempt,
        "elapsed_ms": report.elapsed.as_millis() as u64,
    })
}

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
            "{head}: SUCCESS attempt {}{}: scanned {}, updated {} in {ms} ms",
            report.attempt.unwrap_or_default(),
            if report.took_over { " (took over)" } else { "" },
            report.scanned,
            report.updated
        ),
    }
}

async fn status_command(args: StatusArgs, settings: Settings) -> Result<()> {
    let business_date =
        business_date_or_default(args.business_date.as_deref(), &settings, &SystemClock)?;
    let shards = args.shards.unwrap_or(settings.shard.count);
    if shards < 1 {
        return Err(AppError::Invalid("--shards must be >= 1".into()));
    }
    let database = Database::open(&settings, args.db.embedded_db).await?;
    let result = async {
        let rows = jobs::claim::rows_for(
            &database.pool,
            settlement::JOB_NAME,
            business_date.date(),
            shards,
        )
        .await?;
        let totals = settlement::month_totals(&database.pool, business_date).await?;
        Ok::<_, AppError>((rows, totals))
    }
    .await;
    database.close().await;
    let (rows, totals) = result?;
    if args.json {
        let shard_list: Vec<serde_json::Value> = (0..shards as i32)
            .map(|s| match rows.iter().find(|r| r.shard == s) {
                Some(row) => serde_json::to_value(row).unwrap_or_default(),
                None => serde_json::json!({ "shard": s, "status": "missing" }),
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "job": settlement::JOB_NAME,
                "business_date": business_date.to_string(),
                "shards": shards,
                "runs": shard_list,
                "totals": totals,
            })
        );
        return Ok(());
    }
    println!(
        "{} {} with {shards} shard(s)",
        settlement::JOB_NAME,
        business_date
    );
    println!(
        "{:<6} {:<8} {:>7} {:<28} {:>10} {:>12} {:>10} {:>10}  last_error",
        "shard", "status", "attempt", "owner", "heartbeat", "last_id", "scanned", "updated"
    );
    for s in 0..shards as i32 {
        match rows.iter().find(|r| r.shard == s) {
            Some(r) => println!(
                "{:<6} {:<8} {:>7} {:<28} {:>9.1}s {:>12} {:>10} {:>10}  {}",
                s,
                r.status,
                r.attempt,
                r.owner,
                r.heartbeat_age_secs,
                r.last_id
                    .map(|i| i.to_string())
                    .unwrap_or_else(|| "-".into()),
                r.scanned,
                r.updated,
                r.last_error.as_deref().unwrap_or("")
            ),
            None => println!("{s:<6} missing"),
        }
    }
    println!(
        "settled in {}: rows={} fine_cents_sum={} digest={}",
        business_date.first_day().format("%Y-%m"),
        totals.settled_rows,
        totals.fine_cents_sum,
        totals.digest
    );
    Ok(())
}
