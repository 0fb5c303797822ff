//! The command line, on top of everything: clap types, parsing (a bad command line is one line on
//! stderr and exit 2), dispatch to [`crate::commands`], `daemon` and `demo`, and printing what they
//! return. Nothing imports this module but the binary.

use crate::app::Result;
use crate::clock::SystemClock;
use crate::commands::{
    self, correct::CorrectRequest, prune::PruneRequest, run::RangeRequest, run::RunRequest,
    seed::SeedRequest, status::StatusRequest, verify::VerifyRequest,
};
use crate::config::Settings;
use crate::job_layer::{Progress, RunReport};
use clap::{Args, Parser, Subcommand};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "settlementd",
    version = crate::version::LONG,
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
    /// Run one month of a job for one shard, once (idempotent: re-running changes nothing), or a
    /// range of months (--from, --to).
    Run(RunArgs),
    /// Show each shard's job_runs row for a business date and the month's facts.
    Status(StatusArgs),
    /// List the jobs of this binary: enabled, cron, zone, next fire, last month closed.
    Jobs(JobsArgs),
    /// Pause a job (or every job) everywhere: nothing new is claimed, runs stop after their batch.
    Pause(PauseArgs),
    /// Resume a paused job (or every job).
    Resume(ResumeArgs),
    /// Delete job_events, run_requests and job_runs of months closed more than DAYS ago.
    Prune(PruneArgs),
    /// Check a month's fines against its rule (read-only): exit 0 right, 1 not right, 6 the money
    /// right but rows held.
    Verify(VerifyArgs),
    /// Recompute a settled month under the configured rule, recording every changed fine.
    Correct(CorrectArgs),
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
    /// The job to run (default: fine-settlement; `settlementd jobs` lists them).
    #[arg(long, value_name = "NAME")]
    pub job: Option<String>,
    /// Every enabled job, one after the other in the order `settlementd jobs` lists them (a job
    /// that follows another after it); one report per job.
    #[arg(long, conflicts_with = "job")]
    pub all_jobs: bool,
    /// The month to settle, as its last day (default: last month's end in schedule.timezone).
    #[arg(long, value_name = "YYYY-MM-DD", conflicts_with_all = ["from", "to"])]
    pub business_date: Option<String>,
    /// The first month of a range, run in order through --to.
    #[arg(long, value_name = "YYYY-MM", requires = "to")]
    pub from: Option<String>,
    /// The last month of a range.
    #[arg(long, value_name = "YYYY-MM", requires = "from")]
    pub to: Option<String>,
    /// Every shard of the shard count, one after the other (of the month, or of each month of
    /// --from/--to).
    #[arg(long, conflicts_with = "shard")]
    pub all_shards: bool,
    /// This run's shard index (overrides shard.index).
    #[arg(long, value_name = "N")]
    pub shard: Option<u32>,
    /// The shard count (overrides shard.count).
    #[arg(long, value_name = "M")]
    pub shards: Option<u32>,
    /// Re-run a month whose claim is already SUCCESS (never steals a live run).
    #[arg(long)]
    pub force: bool,
    /// When a live run holds the claim, wait until it ends (done) or goes stale (taken over)
    /// instead of skipping; for schedulers that retry a killed run while its lease is still live.
    /// Also wait while the job this one follows has not closed the month, instead of refusing.
    #[arg(long)]
    pub wait: bool,
    /// Say what the run would write — per shard the loans it would settle, re-price or hold, the
    /// cents, the rule it would pin, and the members whose fines change — and write nothing (no
    /// claim, no pin, no journal entry, no event). One report per month (and job).
    #[arg(long, conflicts_with = "wait")]
    pub dry_run: bool,
    /// Print one JSON object on stdout (one per line per month, shard and job with --from/--to
    /// or --all-jobs; one per month and job with --dry-run).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The job to show (default: fine-settlement).
    #[arg(long, value_name = "NAME")]
    pub job: Option<String>,
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub business_date: Option<String>,
    /// The shard count whose claims to show (default shard.count).
    #[arg(long, value_name = "M")]
    pub shards: Option<u32>,
    /// How many of each shard's latest audit events to show (who claimed, took over, re-ran,
    /// failed; 0 for none).
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub history: u32,
    /// Count the month's totals and what a run would write however long it takes (seconds to
    /// minutes on a big month being run); without it, at most 2 s of database time: what does
    /// not fit is said not counted.
    #[arg(long)]
    pub count: bool,
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// The job whose month to prove (default: fine-settlement).
    #[arg(long, value_name = "NAME")]
    pub job: Option<String>,
    /// The month as its last day (default: last month's end in schedule.timezone).
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub business_date: Option<String>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct CorrectArgs {
    /// The month as its last day.
    #[arg(long, value_name = "YYYY-MM-DD")]
    pub business_date: String,
    /// Why the month is corrected (recorded with every shard's `corrected` event).
    #[arg(long, value_name = "TEXT", required_unless_present = "dry_run")]
    pub reason: Option<String>,
    /// The correction's key, from the ticket that asked for it: the same key again changes
    /// nothing and reports the first result.
    #[arg(long, value_name = "KEY", required_unless_present = "dry_run")]
    pub key: Option<String>,
    /// Say what the correction would write — per shard the loans whose fines it changes, the
    /// cents, the held loans, and the members whose fines change — and write nothing (no key,
    /// reason or claim needed or recorded).
    #[arg(long)]
    pub dry_run: bool,
    /// The shard count to correct under (default: the one the month was settled with).
    #[arg(long, value_name = "M")]
    pub shards: Option<u32>,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct JobsArgs {
    /// One JSON object per job, one per line.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct PauseArgs {
    /// The job to pause (default: every job).
    #[arg(long, value_name = "NAME")]
    pub job: Option<String>,
    /// Why: shown by status, the page and the log until it is resumed.
    #[arg(long, value_name = "TEXT")]
    pub reason: String,
    /// Return only once no run of the paused jobs is running anywhere (each stops at its next
    /// batch; a claim whose holder is gone does not count).
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The job to resume (default: every job).
    #[arg(long, value_name = "NAME")]
    pub job: Option<String>,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Delete what belongs to months closed more than this many days ago.
    #[arg(long, value_name = "DAYS")]
    pub older_than: u32,
    /// Only say what would be deleted.
    #[arg(long)]
    pub dry_run: bool,
    /// Print exactly one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

#[derive(Debug, Args)]
pub struct ScheduleArgs {
    /// The job whose schedule to show (default: fine-settlement).
    #[arg(long, value_name = "NAME")]
    pub job: Option<String>,
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
    /// Seed a library's history instead: loans borrowed over N years up to just after the month,
    /// ids in borrow order, returns 5-70 days later (one in fifty 200-700).
    #[arg(long, value_name = "N")]
    pub years: Option<u32>,
    /// With --years: the mean gap between consecutive ids (1 = dense).
    #[arg(long, value_name = "G", default_value_t = 1)]
    pub id_gap: u32,
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
                eprintln!("{} (see --help)", one_line(&e.render().to_string()));
                ExitCode::from(2)
            }
        }
    })
}

/// clap's message in one line: its first paragraph (for a missing argument, the arguments it
/// names) and its tips (a similar argument, a value that exists), without the usage.
fn one_line(rendered: &str) -> String {
    let mut paragraphs = rendered.split("\n\n").map(|p| {
        p.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    });
    let first = paragraphs.next().unwrap_or_default();
    let tips: Vec<String> = paragraphs.filter(|p| p.starts_with("tip:")).collect();
    let first = if first.is_empty() {
        "invalid arguments".to_string()
    } else {
        first
    };
    std::iter::once(first)
        .chain(tips)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Runs one parsed command to completion and prints what it produced on stdout.
pub async fn execute(cli: Cli, settings: Settings) -> Result<()> {
    match cli.command {
        Command::Migrate(args) => {
            let migrated = commands::migrate::migrate(&settings, args.embedded_db).await?;
            match migrated.applied.as_slice() {
                [] => println!(
                    "the schema is current: all {} migrations were already applied",
                    migrated.known
                ),
                applied => {
                    let s = if applied.len() == 1 { "" } else { "s" };
                    println!("applied {} migration{s}:", applied.len());
                    for m in applied {
                        println!("  {} {}", m.version, m.description);
                    }
                }
            }
            if migrated.opened > 0 {
                println!(
                    "{} settled loans given an opening journal entry",
                    migrated.opened
                );
            }
            if migrated.opening_left_to_replicas {
                println!(
                    "this role may not read loans: the opening journal entries of loans settled \
                     before the journal are left to the replicas, which write them as they run"
                );
            }
        }
        Command::Run(args) => {
            let jobs: Vec<Option<String>> = if args.all_jobs {
                crate::jobs::build(&settings)
                    .iter()
                    .filter(|j| j.schedule().enabled)
                    .map(|j| Some(j.name().to_string()))
                    .collect()
            } else {
                vec![args.job.clone()]
            };
            for job in jobs {
                match args.dry_run {
                    true => dry_run_job(&settings, &args, job).await?,
                    false => run_job(&settings, &args, job).await?,
                }
            }
        }
        Command::Status(args) => {
            let request = StatusRequest {
                job: args.job,
                business_date: args.business_date,
                shards: args.shards,
                history: args.history,
                count: args.count,
                embedded_db: args.db.embedded_db,
            };
            let status = commands::status::status(&settings, &request).await?;
            if args.json {
                println!("{}", status.to_json());
            } else {
                print!("{}", status.to_text());
            }
        }
        Command::Jobs(args) => {
            for line in commands::jobs::jobs(&settings, &SystemClock, args.db.embedded_db).await? {
                if args.json {
                    println!("{}", line.to_json());
                } else {
                    println!("{}", line.to_text());
                }
            }
        }
        Command::Pause(args) => {
            let paused = commands::pause::pause_command(
                &settings,
                args.job.as_deref(),
                &args.reason,
                args.wait,
                args.db.embedded_db,
            )
            .await?;
            for p in paused {
                println!("{}", commands::pause::pause_line(&p));
            }
        }
        Command::Resume(args) => {
            let resumed = commands::pause::resume_command(
                &settings,
                args.job.as_deref(),
                args.db.embedded_db,
            )
            .await?;
            for (job, pause) in resumed {
                match pause {
                    Some(p) => println!("{job} resumed ({})", commands::pause::pause_line(&p)),
                    None => println!("{job} was not paused"),
                }
            }
        }
        Command::Prune(args) => {
            let request = PruneRequest {
                older_than_days: args.older_than,
                dry_run: args.dry_run,
                embedded_db: args.db.embedded_db,
            };
            let pruned = commands::prune::prune(&settings, &request).await?;
            if args.json {
                println!("{}", pruned.to_json());
            } else {
                print!("{}", pruned.to_text());
            }
        }
        Command::Verify(args) => {
            let request = VerifyRequest {
                business_date: args.business_date,
                job: args.job,
                embedded_db: args.db.embedded_db,
            };
            let proof = commands::verify::verify(&settings, &request).await?;
            if args.json {
                println!("{}", proof.json);
            } else {
                print!("{}", proof.text);
            }
            if let Some(failure) = commands::verify::failure(&proof) {
                return Err(failure);
            }
        }
        Command::Correct(args) => {
            let request = CorrectRequest {
                business_date: args.business_date,
                reason: args.reason.unwrap_or_default(),
                key: args.key.unwrap_or_default(),
                shards: args.shards,
                embedded_db: args.db.embedded_db,
            };
            if args.dry_run {
                let dry = commands::correct::dry_run(&settings, &request).await?;
                match args.json {
                    true => println!("{}", dry.to_json()),
                    false => print!("{}", dry.to_text()),
                }
                return Ok(());
            }
            let corrected = commands::correct::correct(&settings, &request).await?;
            if args.json {
                println!("{}", commands::correct::to_json(&corrected));
            } else {
                print!("{}", commands::correct::to_text(&corrected));
            }
        }
        Command::Serve(args) => crate::daemon::serve_command(settings, args.embedded_db).await?,
        Command::Schedule(args) => {
            let job = commands::run::job_of(&settings, args.job.as_deref())?;
            for slot in commands::schedule::next(&settings, job.as_ref(), &SystemClock, args.next) {
                if args.json {
                    println!("{}", slot.to_json());
                } else {
                    println!("{}", commands::schedule::slot_line(job.as_ref(), &slot));
                }
            }
        }
        Command::Seed(args) => {
            let request = SeedRequest {
                loans: args.loans,
                month: args.month,
                seed: args.seed,
                years: args.years,
                id_gap: args.id_gap,
                embedded_db: args.db.embedded_db,
            };
            let bar = progress_bar(
                std::io::stderr().is_terminal(),
                "{bar:40} {pos}/{len} loans {per_sec} {eta}",
            );
            bar.set_length(args.loans);
            let result = commands::seed::seed(&settings, &request, |n| bar.set_position(n)).await;
            bar.finish_and_clear();
            println!("{}", result?.line());
        }
        Command::Demo => crate::demo::run(settings).await?,
    }
    Ok(())
}

/// `run` of one job (`None`: the default): a month, or a range of months, printing each report.
/// `run --dry-run` of one job: a report per month, in words or one JSON object per line.
async fn dry_run_job(settings: &Settings, args: &RunArgs, job: Option<String>) -> Result<()> {
    let (from, to) = (args.from.clone(), args.to.clone());
    let request = RangeRequest {
        run: RunRequest {
            job,
            business_date: args.business_date.clone(),
            shard: args.shard,
            shards: args.shards,
            force: args.force,
            embedded_db: args.db.embedded_db,
            ..RunRequest::default()
        },
        from: from.unwrap_or_default(),
        to: to.unwrap_or_default(),
        all_shards: args.all_shards,
    };
    for dry in commands::run::dry_run(settings, &request).await? {
        match args.json {
            true => println!("{}", dry.to_json()),
            false => print!("{}", dry.to_text()),
        }
    }
    Ok(())
}

async fn run_job(settings: &Settings, args: &RunArgs, job: Option<String>) -> Result<()> {
    let show_bar = !args.json && std::io::stderr().is_terminal();
    let request = RunRequest {
        job,
        business_date: args.business_date.clone(),
        shard: args.shard,
        shards: args.shards,
        force: args.force,
        wait: args.wait,
        estimate: show_bar,
        embedded_db: args.db.embedded_db,
    };
    let job = commands::run::job_of(settings, request.job.as_deref())?;
    let bar = progress_bar(show_bar, "{bar:40} {pos}/{len} items {per_sec} {msg}");
    let on_progress = |p: Progress| {
        if let Some(total) = p.total {
            bar.set_length(total);
        }
        bar.set_position(p.scanned);
    };
    let print = |report: &RunReport| {
        if args.json {
            let words = commands::run::job_of(settings, Some(&report.key.job_name))
                .map(|j| j.words())
                .unwrap_or_else(|_| job.words());
            println!("{}", commands::run::report_json(report, &words));
        } else {
            println!("{}", commands::run::report_line(job.as_ref(), report));
        }
    };
    // `--all-shards` of one month (`--business-date`, or the default month) is the range of that
    // month alone.
    let range = match (args.from.clone(), args.to.clone()) {
        (Some(from), Some(to)) => Some((from, to)),
        _ if args.all_shards => {
            let month = crate::app::business_date_or_default(
                args.business_date.as_deref(),
                settings,
                &crate::clock::SystemClock,
            )?;
            let month = month.first_day().format("%Y-%m").to_string();
            Some((month.clone(), month))
        }
        _ => None,
    };
    if let Some((from, to)) = range {
        let range = RangeRequest {
            run: request,
            from,
            to,
            all_shards: args.all_shards,
        };
        // The range's bar counts its months; the month's own items are its message.
        let months = range_months(&range.from, &range.to);
        let bar = progress_bar(show_bar, "{bar:40} {pos}/{len} months {msg}");
        bar.set_length(months);
        let on_progress = |p: Progress| bar.set_message(items_message(p));
        let mut on_month = |done: &commands::run::MonthDone| {
            bar.suspend(|| done.reports.iter().for_each(print));
            bar.inc(1);
        };
        let result = commands::run::run_range(settings, &range, &on_progress, &mut on_month).await;
        bar.finish_and_clear();
        result.inspect_err(|e| print_stopped(args, e))?;
        return Ok(());
    }
    let result = commands::run::run(settings, &request, &on_progress).await;
    bar.finish_and_clear();
    print(&result.inspect_err(|e| print_stopped(args, e))?);
    Ok(())
}

/// A run stopped part-way by a pause is a result too: with `--json`, its object on stdout ("paused
/// after N batches"), besides the line on stderr and exit 4.
fn print_stopped(args: &RunArgs, e: &crate::app::AppError) {
    if let (true, crate::app::AppError::Paused { json, .. }) = (args.json, e) {
        println!("{json}");
    }
}

/// How many months `--from` … `--to` holds (0 when either does not parse: the range refuses it).
fn range_months(from: &str, to: &str) -> u64 {
    use crate::calendar::BusinessDate;
    match (BusinessDate::from_month(from), BusinessDate::from_month(to)) {
        (Ok(from), Ok(to)) => crate::calendar::months_between(from, to).len() as u64,
        _ => 0,
    }
}

/// The message of a range's bar: where the month's run is ("· 1200 of 5000 items of the month").
fn items_message(p: Progress) -> String {
    match p.total {
        Some(total) => format!("· {} of {} items of the month", p.scanned, total),
        None => format!("· {} items of the month", p.scanned),
    }
}

/// A progress bar on stderr when `visible`, else one that draws nothing.
fn progress_bar(visible: bool, template: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::hidden();
    if visible {
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            indicatif::ProgressStyle::with_template(template)
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranges_bar_counts_its_months_and_says_where_the_month_is() {
        assert_eq!(range_months("2025-11", "2026-10"), 12);
        assert_eq!(range_months("2026-10", "2026-10"), 1);
        assert_eq!(range_months("2026-13", "2026-10"), 0);
        let at = |total| Progress {
            total,
            scanned: 1200,
            ..Progress::default()
        };
        assert_eq!(
            items_message(at(Some(5000))),
            "· 1200 of 5000 items of the month"
        );
        assert_eq!(items_message(at(None)), "· 1200 items of the month");
    }
}
