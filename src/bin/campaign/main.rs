//! `campaign`: settlementd under random faults, replayable from a seed, judged by a checker that
//! is itself shown to catch planted bugs (docs/CAMPAIGN.md).
//!
//! For each schedule (seed `N`, `N + 1`, …): a fresh database on a private PostgreSQL with
//! libraryd's loans over four months; the real `settlementd` binary as `serve` replicas, one-shot
//! `run`s and `correct`s, each behind a proxy of the campaign's; the schedule's actions
//! (`schedule.rs`) played against them (`faults.rs`); then quiescing within a stated bound, and
//! the offline checker (`checker.rs`). The seed is printed first; a violation is printed with its
//! minimal facts and the command that replays the schedule.
//!
//! The binary is a thin harness: it drives settlementd as child processes (the `settlementd`
//! beside it, or `--settlementd PATH`), PostgreSQL through `settlementd::embedded_pg`, and checks
//! with SQL reads and Rust.

mod checker;
mod faults;
mod proxy;
mod schedule;
mod selftest;
mod world;

use anyhow::{anyhow, Context, Result};
use chrono::Datelike;
use clap::Parser;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use world::{Cluster, World};

/// settlementd under random faults, replayable from a seed.
#[derive(Parser, Debug)]
#[command(name = "campaign")]
struct Args {
    /// The first schedule's seed; schedule K of the run uses seed + K - 1.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How many schedules to play.
    #[arg(long, default_value_t = 1)]
    schedules: u64,
    /// Actions per schedule.
    #[arg(long, default_value_t = schedule::DEFAULT_STEPS)]
    steps: u32,
    /// The settlementd binary (default: the one beside this binary, rebuilt when older).
    #[arg(long, value_name = "PATH")]
    settlementd: Option<PathBuf>,
    /// The planted bug to switch on (`fence-off`, `claim-ignores-conflict`, `lease-local-clock`,
    /// `skip-journal`, `late-under-config-rule`, `statements-reopen-skips`, `move-without-reversal`), in a settlementd built with `--features
    /// campaign-mutants` (given with --settlementd).
    #[arg(long, value_name = "NAME", value_parser = mutant_name)]
    mutant: Option<String>,
    /// Play every schedule even after a violation.
    #[arg(long)]
    keep_going: bool,
    /// After one clean schedule, corrupt its database seven ways and show each caught.
    #[arg(long)]
    self_test: bool,
    /// Where logs of failing schedules are kept (default: a directory under the temp dir).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("campaign: cannot start the async runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match runtime.block_on(campaign(args)) {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("campaign: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// Plays the schedules; `Ok(false)` when any violated an invariant (or the self-test failed).
async fn campaign(args: Args) -> Result<bool> {
    let bin = settlementd_binary(args.settlementd.as_deref())?;
    let work = match &args.work_dir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("campaign-{}", std::process::id())),
    };
    std::fs::create_dir_all(&work)?;
    let cluster = Arc::new(tokio::task::spawn_blocking(Cluster::start).await??);
    let started = Instant::now();
    let mut clean = true;
    let mut played = 0u64;
    let mut violations = 0usize;
    for k in 0..args.schedules {
        let seed = args.seed + k;
        played += 1;
        let outcome = play_schedule(&cluster, &bin, seed, &args, &work).await;
        match outcome {
            Ok(found) => {
                violations += found;
                if found > 0 {
                    clean = false;
                    if let Some(mutant) = &args.mutant {
                        println!(
                            "campaign: mutant {mutant} caught at schedule {} (seed {seed})",
                            k + 1
                        );
                    }
                    if !args.keep_going {
                        break;
                    }
                }
            }
            Err(e) => {
                cluster.stop();
                return Err(e.context(format!("schedule seed={seed}")));
            }
        }
    }
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    println!(
        "campaign: {played} schedules (seeds {}..={}), {violations} violations, {:.1} min, {:.2} schedules per minute",
        args.seed,
        args.seed + played - 1,
        minutes,
        played as f64 / minutes.max(1e-9)
    );
    tokio::task::spawn_blocking({
        let cluster = cluster.clone();
        move || cluster.stop()
    })
    .await?;
    if clean && args.work_dir.is_none() {
        let _ = std::fs::remove_dir_all(&work);
    }
    Ok(clean)
}

/// Plays one schedule; returns how many violations it found (printed).
async fn play_schedule(
    cluster: &Arc<Cluster>,
    bin: &Path,
    seed: u64,
    args: &Args,
    work: &Path,
) -> Result<usize> {
    let started = Instant::now();
    println!("campaign seed={seed} schedule=1 steps={}", args.steps);
    let last_month = {
        let today = chrono::Utc::now().date_naive();
        let first = today.with_day0(0).unwrap_or(today);
        schedule::months_before(first, 2)
    };
    let plan = schedule::plan(seed, args.steps, last_month);
    println!(
        "  {} shards x {} replicas{} (reshard to {}), batch {}, writes slowed {} ms, lease {} s, \
         rule {}/{}/{} (other {}/{}/{}), {} loans a month over {}..{}, settlementd {}{}, PostgreSQL {}",
        plan.shards,
        plan.replicas,
        plan.skewed_at_start
            .map(|s| format!(" + 1 with its clock {s:+} s"))
            .unwrap_or_default(),
        plan.reshard_to,
        plan.batch_size,
        plan.slow.as_millis(),
        plan.ttl_secs,
        plan.rule.daily_rate_cents,
        plan.rule.grace_days,
        plan.rule.max_cents,
        plan.other_rule.daily_rate_cents,
        plan.other_rule.grace_days,
        plan.other_rule.max_cents,
        plan.loans_per_month,
        plan.months[0].format("%Y-%m"),
        plan.months[plan.months.len() - 1].format("%Y-%m"),
        bin.display(),
        args.mutant
            .as_deref()
            .map(|m| format!(" (mutant {m})"))
            .unwrap_or_default(),
        cluster.version(),
    );
    let dir = work.join(format!("seed-{seed}"));
    let steps = plan.steps.clone();
    let world = World::create(
        plan,
        cluster.clone(),
        bin.to_path_buf(),
        args.mutant.clone(),
        dir.clone(),
    )
    .await
    .context("setting up the world")?;
    if !world.faketime {
        println!("  (libfaketime not installed: clock-skew actions are skipped; apt-get install faketime)");
    }
    faults::start_fleet(&world).await?;
    let mut background = tokio::task::JoinSet::new();
    for (n, step) in steps.iter().enumerate() {
        tokio::time::sleep(step.wait).await;
        world.reap();
        let what = faults::play(&world, n + 1, step, &mut background).await?;
        println!(
            "  [{:5.1} s] step {}: {what}",
            world.started.elapsed().as_secs_f64(),
            n + 1
        );
        faults::orchestrate(&world).await?;
    }
    let played = faults::quiesce(&world, &mut background).await?;
    let mut conn = world.connect("campaign").await?;
    let facts = checker::read(
        &mut conn,
        &world.plan.months,
        world.plan.ttl_secs as f64,
        world.shards.load(std::sync::atomic::Ordering::SeqCst) as i32,
    )
    .await?;
    sqlx::Connection::close(conn).await?;
    let mut violations = checker::check(&facts);
    violations.extend(checker::check_world(&world, &facts, &played));
    let settled_writes = facts
        .loan_log
        .iter()
        .filter(|w| w.who == "settlementd")
        .count();
    let procs = world.procs.lock().unwrap_or_else(|p| p.into_inner()).len();
    match &played.quiesced {
        Ok(t) => println!(
            "  quiesced in {:.1} s (bound {} s); {procs} processes, {settled_writes} fine writes and {} journal rows logged",
            t.as_secs_f64(),
            faults::QUIESCE_BOUND.as_secs(),
            facts.journal.len()
        ),
        Err(open) => println!("  NOT quiesced: {open}"),
    }
    if let Some(paused) = checker::pause_summary(&facts) {
        println!("  paused: {paused}");
    }
    let writes: Vec<_> = facts
        .loan_log
        .iter()
        .filter(|w| w.who == "settlementd")
        .collect();
    if let (Some(first), Some(last)) = (writes.first(), writes.last()) {
        let span = (last.at - first.at).num_milliseconds() as f64 / 1000.0;
        println!("  settlementd wrote fines for {span:.1} s");
    }
    for f in world
        .faults
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        println!(
            "  fault at {:.1} s: {}{}",
            (f.from - world.started).as_secs_f64(),
            f.what,
            f.target.map(|t| format!(" on p{t}")).unwrap_or_default()
        );
    }
    for note in world.notes.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        println!("  note: {note}");
    }
    let mut self_test_ok = true;
    if args.self_test && violations.is_empty() {
        let (lines, ok) = selftest::run(&world).await?;
        for line in lines {
            println!("  {line}");
        }
        self_test_ok = ok;
    }
    for v in &violations {
        println!("VIOLATION seed={seed} [{}] {}", v.check, v.facts);
    }
    if !violations.is_empty() {
        let mut replay = format!(
            "cargo run --release --bin campaign -- --seed {seed} --schedules 1 --steps {}",
            args.steps
        );
        if let Some(mutant) = &args.mutant {
            replay.push_str(&format!(
                " --settlementd {} --mutant {mutant}   (the mutant build: cargo build --release \
                 --features campaign-mutants --bin settlementd, copied there)",
                bin.display()
            ));
        }
        println!("  replay: {replay}");
        dump(&world, &dir).await;
        println!(
            "  logs, and the tables the checker read (JSON), kept in {}",
            dir.display()
        );
    } else {
        drop_database(cluster, &world.database).await;
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!(
        "  seed={seed}: {} violations in {:.1} s",
        violations.len(),
        started.elapsed().as_secs_f64()
    );
    if !self_test_ok {
        return Ok(violations.len().max(1));
    }
    Ok(violations.len())
}

/// The tables the checker read, as JSON files in `dir`, for a violation's post-mortem.
async fn dump(world: &World, dir: &Path) {
    let Ok(mut conn) = world.connect("campaign").await else {
        return;
    };
    for table in [
        "loans",
        "fine_journal",
        "job_runs",
        "job_events",
        "job_params",
        "run_requests",
        "run_request_shards",
        "fine_corrections",
        "fine_adjustments",
        "loan_changes",
        "campaign_loan_log",
        "campaign_journal_log",
        "campaign_run_log",
        "campaign_pause_log",
        "job_pauses",
    ] {
        let sql = format!("SELECT COALESCE(json_agg(t), '[]')::text FROM {table} t");
        if let Ok(text) = sqlx::query_scalar::<_, String>(&sql)
            .fetch_one(&mut conn)
            .await
        {
            let _ = std::fs::write(dir.join(format!("{table}.json")), text);
        }
    }
    let _ = sqlx::Connection::close(conn).await;
}

async fn drop_database(cluster: &Cluster, database: &str) {
    if let Ok(mut admin) =
        <sqlx::PgConnection as sqlx::Connection>::connect(&cluster.url("postgres")).await
    {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
            .execute(&mut admin)
            .await;
        let _ = sqlx::Connection::close(admin).await;
    }
}

/// The settlementd binary to drive: `given`, or the one beside this binary — built first with
/// cargo when it is missing or older than this one (`cargo run --bin campaign` builds only this
/// binary).
/// `--mutant`'s value: one of the planted bugs settlementd knows.
fn mutant_name(name: &str) -> std::result::Result<String, String> {
    let names: Vec<&str> = settlementd::mutant::Mutant::ALL
        .iter()
        .map(|(_, n)| *n)
        .collect();
    if names.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!("expected one of {}", names.join(", ")))
    }
}

fn settlementd_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = given {
        if !path.exists() {
            return Err(anyhow!("--settlementd {}: no such file", path.display()));
        }
        return Ok(path.to_path_buf());
    }
    let me = std::env::current_exe()?;
    let dir = me
        .parent()
        .ok_or_else(|| anyhow!("this binary has no directory"))?;
    let sibling = dir.join("settlementd");
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let stale = match (modified(&sibling), modified(&me)) {
        (Some(theirs), Some(mine)) => theirs < mine,
        _ => true,
    };
    if stale {
        let release = dir.file_name().is_some_and(|n| n == "release");
        println!(
            "campaign: building settlementd beside this binary (cargo build{} --bin settlementd)",
            if release { " --release" } else { "" }
        );
        let mut cargo =
            std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cargo
            .args(["build", "--bin", "settlementd", "--manifest-path"])
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"));
        if release {
            cargo.arg("--release");
        }
        let status = cargo.status().context("cannot run cargo")?;
        if !status.success() || !sibling.exists() {
            return Err(anyhow!(
                "cannot build settlementd; build it (cargo build --release --bin settlementd) or pass --settlementd PATH"
            ));
        }
    }
    Ok(sibling)
}
