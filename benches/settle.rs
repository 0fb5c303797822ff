//! Settlement throughput against the physical limit, on tables shaped like users' tables, in one
//! run, on one private PostgreSQL.
//!
//! `cargo bench --bench settle` (cargo builds the `settlementd` binary with the release-like bench
//! profile and hands its path to this bench). It starts a temporary embedded cluster (fsync,
//! synchronous_commit and full_page_writes off, like every temporary cluster of settlementd: the
//! same settings for every case, so the ratios are fair; autovacuum off, so "right after the run"
//! is before any VACUUM and "not analyzed" stays true; shared_buffers 1 GB, or
//! `SETTLE_BENCH_SHARED_BUFFERS`, so the largest shape's table stays cached; huge pages when the
//! host has reserved them, or as `SETTLE_BENCH_HUGE_PAGES` says; see [`configure`]), and for each
//! **shape** generates a table
//! with the product's own generator ([`settlementd::seed`]), then measures, each case on a freshly
//! reset table (same rows, same physical order):
//!
//! - `L`: one set-based `UPDATE` of the month (the limit: one statement, one core);
//! - `L2`: two set-based `UPDATE`s at once, one per shard of two (`id % 2`), on two connections:
//!   the best two shards can do on these cores with nothing of the engine around them;
//! - `N` (append shape only): the seed's per-row approach: read the month's unsettled loans,
//!   compute fines in the client, per-row prepared `UPDATE … WHERE id = $1 AND fine_settled_at IS
//!   NULL` pipelined 500 at a time, one transaction per 500 (what JDBC `executeBatch` does);
//! - `S1`, `S2`, `S3`: real `settlementd run` processes, 1, 2 or 3 shards in parallel; wall time
//!   from the first spawn to the last exit, peak RSS of each process (`VmHWM`);
//! - `S1U`: `S1` with the binary built without the money journal (`--features
//!   bench-unjournaled`, built by this benchmark into `target/bench-bin/`): `S1 ÷ S1U` is what
//!   the journal costs a run;
//! - `J`: one set-based statement that updates the month and journals it (a row per 10,000 loans,
//!   as the engine's batches write them): the limit of a journaled run;
//! - `R`: `settlementd run --force` of the settled month right after `S1`, and again after VACUUM;
//! - `V`: `settlementd verify` of the month right after `S1` (before `R`): the month proved from
//!   its journal and the loans by primary key, each loan's chain through its head
//!   (`fine_heads`); must answer "right";
//! - `VS` (with `ST`): `settlementd run --job member-statements` of the month after `V`, then
//!   `settlementd verify --job member-statements`: every member's statement proved against the
//!   journal; must answer "right";
//! - `D`: `settlementd run --dry-run` of the unsettled month, 1 shard: it must report the loans
//!   and fines `L` writes, and leave the month unsettled; `D ÷ L` is what seeing the money before
//!   it moves costs (target ≤ 1.0);
//! - `C`: `settlementd correct` of the month right after `R`, to a rate 10 cents higher: every late
//!   loan's fine changes, each on the record (journal, `fine_adjustments`).
//!
//! Shapes (`SETTLE_BENCH_SHAPE`, comma-separated; sizes scale with `SETTLE_BENCH_LOANS`, default
//! 1,000,000 = `B`):
//! - `append`: B loans over four months, ids one block per month (an append-only table); the two
//!   months before the target are settled, the one after it is open;
//! - `history`: 1.5 B loans borrowed over three years, ids in borrow order, returned 5–70 days
//!   later, one in fifty 200–700 days later: the month's returns are spread over the ids of the
//!   months before it; everything returned before the month is settled;
//! - `history2x`: the same library over six years (3 B loans, the same month size);
//! - `sparse`: B loans over two years, ids about 300 apart, **not analyzed** when the run starts;
//! - `sparse-wide`: B loans over three years, ids about 30,000 apart, not analyzed;
//! - `sparse-small`: 20,000 loans over three years, ids about 65,536 apart, not analyzed (a month
//!   of about 550 rows: the table of issue 8's worst measurement, 56 s before);
//! - `doubling`: `history` and `history2x` side by side, one shard on each in turn, three times
//!   `SETTLE_BENCH_REPS` pairs: the doubling target measured in one interleaved set ([`doubling`]);
//! - `big` (only when asked for): one month of 5.6 B loans (about 5 B to settle), cases L, S1, R:
//!   the memory check.
//!
//! Every case must leave the month with the same `month_totals` (row count, fine sum, digest) as
//! `L`, or the benchmark fails. Other variables: `SETTLE_BENCH_REPS` (default 3; medians are
//! reported), `SETTLE_BENCH_CASES` (e.g. `L,S1`), `SETTLE_BENCH_BATCH` (one size or a list, passed
//! as `SETTLEMENTD__BATCH__SIZE`). Results: a table per shape on stdout, and
//! `bench-results/settle-<shape>-<loans>.csv` and `.json`.

use chrono::NaiveDate;
use settlementd::calendar::BusinessDate;
use settlementd::embedded_pg::{EmbeddedOptions, EmbeddedPg};
use settlementd::fine::FineRule;
use settlementd::jobs::fine_settlement::{self, MonthTotals};
use settlementd::seed::{self, SeedSpec};
use sqlx::{Connection, PgConnection};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The month every shape settles.
const MONTH: &str = "2026-09-30";
/// The seed's JDBC batch size.
const PIPELINE: usize = 500;
const DEFAULT_SHAPES: &str = "append,history,history2x,sparse,sparse-wide,sparse-small,doubling";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One table layout to measure on.
#[derive(Debug, Clone)]
struct Shape {
    name: &'static str,
    what: String,
    /// The generator calls that build the table, in order.
    seeds: Vec<SeedSpec>,
    /// Whether each case starts on a table with statistics (VACUUM ANALYZE) or on a freshly
    /// loaded one that was never analyzed.
    analyzed: bool,
    cases: &'static [&'static str],
}

fn shape(name: &str, base: u64) -> Result<Shape, BoxError> {
    let month = BusinessDate::parse(MONTH)?;
    let scaled = |f: f64| ((base as f64 * f) as u64).max(1000);
    const ALL: &[&str] = &["L", "L2", "D", "S1", "S2", "S3"];
    Ok(match name {
        "append" => {
            // Four months, ids one block per month: July, August (settled), September, October.
            let per_month = (base / 4).max(1000);
            let months = ["2026-07", "2026-08", "2026-09", "2026-10"];
            Shape {
                name: "append",
                what: format!(
                    "{} loans over four months, ids one block per month",
                    per_month * 4
                ),
                seeds: months
                    .iter()
                    .enumerate()
                    .map(|(m, mm)| {
                        Ok(SeedSpec::new(
                            per_month,
                            BusinessDate::from_month(mm)?,
                            42 + m as u64,
                        ))
                    })
                    .collect::<Result<_, BoxError>>()?,
                analyzed: true,
                cases: &["L", "L2", "N", "D", "S1", "S2", "S3"],
            }
        }
        "history" | "history2x" => {
            let (years, loans) = if name == "history" {
                (3, scaled(1.5))
            } else {
                (6, scaled(3.0))
            };
            Shape {
                name: if name == "history" { "history" } else { "history2x" },
                what: format!(
                    "{loans} loans over {years} years, ids in borrow order, returns 5–70 days later (2 % 200–700)"
                ),
                seeds: vec![SeedSpec::history(loans, month, 42, years, 1)],
                analyzed: true,
                cases: ALL,
            }
        }
        "sparse" | "sparse-wide" | "sparse-small" => {
            let (years, loans, gap, name) = match name {
                "sparse" => (2, scaled(1.0), 300, "sparse"),
                "sparse-wide" => (3, scaled(1.0), 30_000, "sparse-wide"),
                // The table of issue 8's worst measurement: 20,000 loans 65,536 ids apart.
                _ => (3, 20_000, 65_536, "sparse-small"),
            };
            Shape {
                name,
                what: format!(
                    "{loans} loans over {years} years, ids about {gap} apart, not analyzed"
                ),
                seeds: vec![SeedSpec::history(loans, month, 42, years, gap)],
                analyzed: false,
                cases: ALL,
            }
        }
        "big" => {
            let loans = scaled(5.6);
            Shape {
                name: "big",
                what: format!("{loans} loans in one month (the memory check)"),
                seeds: vec![SeedSpec::new(loans, month, 42)],
                analyzed: true,
                cases: &["L", "S1"],
            }
        }
        other => {
            return Err(format!("unknown shape {other:?} (known: {DEFAULT_SHAPES},big)").into())
        }
    })
}

fn main() -> Result<(), BoxError> {
    let base: u64 = env_or("SETTLE_BENCH_LOANS", 1_000_000);
    let reps: usize = env_or("SETTLE_BENCH_REPS", 3);
    let shared_buffers =
        std::env::var("SETTLE_BENCH_SHARED_BUFFERS").unwrap_or_else(|_| "1GB".into());
    let huge_pages = std::env::var("SETTLE_BENCH_HUGE_PAGES").unwrap_or_else(|_| "try".into());
    if !matches!(huge_pages.as_str(), "try" | "on" | "off") {
        return Err(
            format!("SETTLE_BENCH_HUGE_PAGES={huge_pages:?}: expected try, on or off").into(),
        );
    }
    // One size or a comma-separated list (one S row per size, all in this run).
    let batches: Vec<Option<u32>> = match std::env::var("SETTLE_BENCH_BATCH") {
        Ok(list) => list
            .split(',')
            .map(|b| b.trim().replace('_', "").parse().map(Some))
            .collect::<Result<_, _>>()?,
        Err(_) => vec![None],
    };
    let cases: Option<Vec<String>> = std::env::var("SETTLE_BENCH_CASES")
        .ok()
        .map(|c| c.split(',').map(|c| c.trim().to_uppercase()).collect());
    let names = std::env::var("SETTLE_BENCH_SHAPE").unwrap_or_else(|_| DEFAULT_SHAPES.into());
    let names: Vec<&str> = names.split(',').map(str::trim).collect();
    // The doubling pass runs one shard (S1) with the first batch size.
    let with_doubling =
        names.contains(&"doubling") && cases.as_ref().map_or(true, |c| c.iter().any(|c| c == "S1"));
    let shapes: Vec<Shape> = names
        .iter()
        .filter(|&&name| name != "doubling")
        .map(|name| shape(name, base))
        .collect::<Result<_, _>>()?;
    let started = Instant::now();
    let wants = |c: &str| cases.as_ref().map_or(true, |cs| cs.iter().any(|x| x == c));
    let binaries = Binaries::prepare(wants("S1U"))?;
    let mut pg = EmbeddedPg::start(EmbeddedOptions::default())?;
    let url = pg.url("postgres");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(configure(&mut pg, &url, &shared_buffers, &huge_pages))?;
    let result = runtime.block_on(async {
        let mut all = Vec::new();
        for shape in &shapes {
            let rows = bench(
                &pg,
                &url,
                shape,
                reps,
                &batches,
                cases.as_deref(),
                &binaries,
            )
            .await?;
            all.push((shape.name, rows));
        }
        let batch = batches.first().copied().flatten();
        let doubled = match with_doubling {
            true => Some(doubling(&url, base, 3 * reps, batch, &binaries).await?),
            false => None,
        };
        Ok::<_, BoxError>((all, doubled))
    });
    drop(runtime);
    pg.stop();
    let (all, doubled) = result?;
    print_summary(&all, doubled.as_ref());
    println!("whole benchmark: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The cluster's settings for every shape, before the first one: no autovacuum ("right after the
/// run" must mean before any VACUUM, "not analyzed" must stay true, and no background vacuum may
/// compete for the cores during a case), and `shared_buffers` large enough for the largest
/// shape's table, its copy and their indexes (history2x: about 700 MB), as on a server sized for
/// its working set. With the default 128 MB, the cache's state after each reset decided the
/// timings: L itself took 1.23 × as long on history2x as on history, and varied by ±15 %
/// between repetitions (docs/PERFORMANCE.md). `huge_pages` is PostgreSQL's setting: `try` (its
/// default) puts shared memory in huge pages when the host has reserved enough of them
/// (`vm.nr_hugepages`), `off` never does; see [`huge_pages_in_use`].
async fn configure(
    pg: &mut EmbeddedPg,
    url: &str,
    shared_buffers: &str,
    huge_pages: &str,
) -> Result<(), BoxError> {
    let mut db = PgConnection::connect(url).await?;
    sqlx::query("ALTER SYSTEM SET autovacuum = off")
        .execute(&mut db)
        .await?;
    sqlx::query(&format!("ALTER SYSTEM SET huge_pages = '{huge_pages}'"))
        .execute(&mut db)
        .await?;
    sqlx::query(&format!(
        "ALTER SYSTEM SET shared_buffers = '{}'",
        shared_buffers.replace('\'', "")
    ))
    .execute(&mut db)
    .await?;
    // The benchmark's own SQL names settlementd's tables without their schema (the binary sets
    // its sessions' path itself).
    sqlx::query("ALTER DATABASE postgres SET search_path = settlementd, public")
        .execute(&mut db)
        .await?;
    sqlx::query("CHECKPOINT").execute(&mut db).await?;
    db.close().await?;
    // shared_buffers takes a restart; nothing is lost (checkpointed, and the data is throwaway).
    pg.stop_immediately();
    pg.restart()?;
    Ok(())
}

/// Whether the server's shared memory sits in huge pages: "in use", "not in use" or "unknown".
///
/// It decides what a new backend pays on its first touch of each shared buffer (a run's
/// connections are new backends; `L`'s is not): a page fault per 4 kB page without huge pages,
/// one per 2 MB with them (docs/PERFORMANCE.md). Read from the postmaster's `smaps`.
fn huge_pages_in_use(pg: &EmbeddedPg) -> &'static str {
    let Ok(smaps) = std::fs::read_to_string(format!("/proc/{}/smaps", pg.pid())) else {
        return "unknown";
    };
    let huge = smaps.lines().any(|line| {
        line.starts_with("KernelPageSize:")
            && line.split_whitespace().nth(1).is_some_and(|kb| kb != "4")
    });
    if huge {
        "in use"
    } else {
        "not in use"
    }
}

/// The cargo profile that built `binary`, from its directory: `target/release` is the bench
/// profile's (`cargo bench`), `target/debug` the dev profile's (`cargo bench --profile dev`, CI's
/// smoke test, which reuses what `cargo test` built), any other the custom profile of that name.
fn profile_of(binary: &Path) -> String {
    match binary
        .parent()
        .and_then(Path::file_name)
        .and_then(|d| d.to_str())
    {
        Some("debug") => "dev".into(),
        Some("release") | None => "bench".into(),
        Some(custom) => custom.into(),
    }
}

/// The binaries the process cases run: the one cargo built for this benchmark, copied aside, and
/// (for `S1U`) the same code built with `--features bench-unjournaled`. Both are built in this
/// crate's target directory with the same profile ([`profile_of`]); the feature build replaces cargo's
/// `settlementd` there (cargo rebuilds it at its next build), so each is copied to
/// `target/bench-bin/` first and run from there.
struct Binaries {
    settlementd: PathBuf,
    unjournaled: Option<PathBuf>,
}

impl Binaries {
    fn prepare(unjournaled: bool) -> Result<Self, BoxError> {
        let built = PathBuf::from(env!("CARGO_BIN_EXE_settlementd"));
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-bin");
        std::fs::create_dir_all(&dir)?;
        let settlementd = dir.join("settlementd");
        std::fs::copy(&built, &settlementd)?;
        if !unjournaled {
            return Ok(Self {
                settlementd,
                unjournaled: None,
            });
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let profile = profile_of(&built);
        println!("building the unjournaled baseline (cargo build --profile {profile} --features bench-unjournaled)");
        let t = Instant::now();
        let status = Command::new(cargo)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args([
                "build",
                "--quiet",
                "--profile",
                &profile,
                "--features",
                "bench-unjournaled",
                "--bin",
                "settlementd",
            ])
            .status()?;
        if !status.success() {
            return Err(format!("building the unjournaled baseline failed: {status}").into());
        }
        let unjournaled = dir.join("settlementd-unjournaled");
        std::fs::copy(&built, &unjournaled)?;
        // Cargo's own copy is the baseline now: put the benchmark's back.
        std::fs::copy(&settlementd, &built)?;
        println!("built in {:.0} s", t.elapsed().as_secs_f64());
        Ok(Self {
            settlementd,
            unjournaled: Some(unjournaled),
        })
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// One measured execution of a case.
#[derive(Debug, Clone, Default, serde::Serialize)]
struct Sample {
    wall_ms: f64,
    /// `elapsed_ms` as the processes report it (max over shards), for process cases.
    engine_ms: Option<f64>,
    scanned: u64,
    updated: u64,
    /// Largest peak RSS of the case's processes, KiB.
    peak_rss_kib: Option<u64>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    case: String,
    what: String,
    reps: usize,
    wall_ms: f64,
    engine_ms: Option<f64>,
    rows: u64,
    rows_per_s: f64,
    ratio_to_l: Option<f64>,
    scanned: u64,
    peak_rss_mib: Option<f64>,
    samples_ms: Vec<f64>,
}

async fn bench(
    pg: &EmbeddedPg,
    url: &str,
    shape: &Shape,
    reps: usize,
    batches: &[Option<u32>],
    only: Option<&[String]>,
    binaries: &Binaries,
) -> Result<Vec<Row>, BoxError> {
    let mut db = PgConnection::connect(url).await?;
    settlementd::db::migrate_connection(&mut db).await?;
    let shared_buffers: String = sqlx::query_scalar("SHOW shared_buffers")
        .fetch_one(&mut db)
        .await?;
    let huge_pages: String = sqlx::query_scalar("SHOW huge_pages")
        .fetch_one(&mut db)
        .await?;
    let cluster = format!(
        "temporary cluster: fsync=off, synchronous_commit=off, full_page_writes=off, \
         autovacuum=off, shared_buffers={shared_buffers}, huge_pages={huge_pages} ({})",
        huge_pages_in_use(pg)
    );
    let month = BusinessDate::parse(MONTH)?;
    let t = Instant::now();
    let (loans, expected) = generate(&mut db, url, shape, month).await?;
    println!(
        "\n=== shape {}: {} ===\nPostgreSQL {} ({cluster}), {} cores; {loans} loans, {expected} to \
         settle in {}; generated in {:.1} s",
        shape.name,
        shape.what,
        pg.version(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        month.first_day().format("%Y-%m"),
        t.elapsed().as_secs_f64()
    );
    let want =
        |c: &str| shape.cases.contains(&c) && only.map_or(true, |o| o.iter().any(|x| x == c));
    let want_rerun = only.map_or(true, |o| o.iter().any(|x| x == "R"));
    let want_verify = only.map_or(true, |o| o.iter().any(|x| x == "V"));
    let want_statements = only.map_or(true, |o| o.iter().any(|x| x == "VS"));
    let want_correct = only.map_or(true, |o| o.iter().any(|x| x == "C"));
    let want_journal = only.map_or(true, |o| o.iter().any(|x| x == "J"));
    let want_unjournaled =
        binaries.unjournaled.is_some() && only.map_or(true, |o| o.iter().any(|x| x == "S1U"));
    // Case names in table order; a case with several batch sizes gets one row per size.
    let label = |case: &str, b: Option<u32>| match (batches.len() > 1, b) {
        (true, Some(b)) => format!("{case}@{b}"),
        _ => case.to_string(),
    };
    let mut samples: Vec<(String, Vec<Sample>)> = Vec::new();
    for case in ["L", "J", "L2", "N", "D"] {
        samples.push((case.to_string(), Vec::new()));
    }
    for (i, &b) in batches.iter().enumerate() {
        samples.push((label("S1", b), Vec::new()));
        if i == 0 {
            samples.push(("S1U".into(), Vec::new()));
            samples.push(("V-after-run".into(), Vec::new()));
            samples.push(("ST-after-run".into(), Vec::new()));
            samples.push(("VS-after-run".into(), Vec::new()));
            samples.push(("R-after-run".into(), Vec::new()));
            samples.push(("R-after-vacuum".into(), Vec::new()));
            samples.push(("C-after-run".into(), Vec::new()));
        }
        samples.push((label("S2", b), Vec::new()));
        samples.push((label("S3", b), Vec::new()));
    }
    let mut push = |case: &str, s: Sample| {
        if let Some((_, v)) = samples.iter_mut().find(|(c, _)| c == case) {
            v.push(s);
        }
    };
    let mut runs: Vec<(&str, Option<u32>, bool)> = vec![
        ("L", None, false),
        ("J", None, false),
        ("L2", None, false),
        ("N", None, false),
        ("D", None, false),
    ];
    for (i, &b) in batches.iter().enumerate() {
        for case in ["S1", "S1U", "S2", "S3"] {
            if case == "S1U" && (i > 0 || !want_unjournaled) {
                continue;
            }
            runs.push((case, b, i == 0 && case == "S1"));
        }
    }
    let mut reference: Option<MonthTotals> = None;
    let mut sizes = Vec::new();
    for rep in 1..=reps {
        for &(case, batch, with_rerun) in &runs {
            let wanted = match case {
                "J" => want_journal,
                "S1U" => want_unjournaled,
                _ => want(case),
            };
            if !wanted {
                continue;
            }
            let name = label(case, batch);
            reset(&mut db, shape.analyzed, "loans_pristine").await?;
            if case == "D" {
                let dry = dry_run_process(&binaries.settlementd, url, month, expected)?;
                let fines = reference.as_ref().map(|r| r.fine_cents_sum);
                if fines.is_some_and(|f| f != dry.1) {
                    return Err(format!(
                        "the dry run reports fines of {} cents, L wrote {fines:?}",
                        dry.1
                    )
                    .into());
                }
                let after = fine_settlement::month_totals(&mut db, month).await?;
                if after.settled_rows != 0 {
                    return Err(format!("the dry run settled {} rows", after.settled_rows).into());
                }
                println!(
                    "rep {rep} D         {:>8.0} ms, writes nothing",
                    dry.0.wall_ms
                );
                push("D", dry.0);
                continue;
            }
            let sample = match case {
                "L" => set_based(&mut db, month, None).await?,
                "J" => set_based_journaled(&mut db, month).await?,
                "L2" => set_based_by_shard(url, month).await?,
                "N" => per_row_pipelined(url, month).await?,
                "S1" => processes(&binaries.settlementd, url, month, 1, batch, false)?,
                "S1U" => processes(
                    binaries
                        .unjournaled
                        .as_deref()
                        .ok_or("no unjournaled build")?,
                    url,
                    month,
                    1,
                    batch,
                    false,
                )?,
                "S2" => processes(&binaries.settlementd, url, month, 2, batch, false)?,
                _ => processes(&binaries.settlementd, url, month, 3, batch, false)?,
            };
            // Every case must leave the month exactly as the set-based UPDATE (the first) does.
            let totals =
                checked(&mut db, month, &name, &sample, expected, reference.as_ref()).await?;
            reference.get_or_insert(totals);
            println!(
                "rep {rep} {name:<9} {:>8.0} ms{}",
                sample.wall_ms,
                sample.peak_rss_kib.map_or(String::new(), |k| format!(
                    "  peak RSS {:.1} MiB",
                    k as f64 / 1024.0
                ))
            );
            if rep == 1 && (case == "L" || with_rerun) {
                sizes.push((name.clone(), relation_sizes(&mut db).await?));
            }
            push(&name, sample);
            if with_rerun && want_verify {
                let verified = verify_process(&binaries.settlementd, url, month, expected)?;
                println!(
                    "rep {rep} V         {:>8.1} ms right after the run",
                    verified.wall_ms
                );
                push("V-after-run", verified);
            }
            if with_rerun && want_statements {
                let stated = statements_process(&binaries.settlementd, url, month, "run")?;
                println!(
                    "rep {rep} ST        {:>8.1} ms: the member statements of the month",
                    stated.wall_ms
                );
                push("ST-after-run", stated);
                let proved = statements_process(&binaries.settlementd, url, month, "verify")?;
                println!(
                    "rep {rep} VS        {:>8.1} ms: verify of the member statements",
                    proved.wall_ms
                );
                push("VS-after-run", proved);
            }
            if with_rerun && want_rerun {
                let again = processes(&binaries.settlementd, url, month, 1, batch, true)?;
                check_noop(&again)?;
                println!(
                    "rep {rep} R         {:>8.1} ms right after the run",
                    again.wall_ms
                );
                push("R-after-run", again);
                sqlx::query("VACUUM loans").execute(&mut db).await?;
                let again = processes(&binaries.settlementd, url, month, 1, batch, true)?;
                check_noop(&again)?;
                println!("rep {rep} R         {:>8.1} ms after VACUUM", again.wall_ms);
                push("R-after-vacuum", again);
            }
            if with_rerun && want_correct {
                let corrected = correct_process(&binaries.settlementd, url, month, rep)?;
                println!(
                    "rep {rep} C         {:>8.1} ms, {} fines changed",
                    corrected.wall_ms, corrected.updated
                );
                push("C-after-run", corrected);
            }
        }
    }

    let rows = summarize(&samples, expected);
    print_table(shape, &rows, loans, expected, batches);
    for (case, s) in &sizes {
        println!("after {case}: {s}");
    }
    let server = Server {
        version: pg.version(),
        settings: &cluster,
    };
    write_results(shape, &rows, loans, expected, batches, &sizes, &server)?;
    Ok(rows)
}

/// The month's totals after a case, once the case has updated `expected` rows and left the month
/// as `reference` (when given) says.
async fn checked(
    db: &mut PgConnection,
    month: BusinessDate,
    name: &str,
    sample: &Sample,
    expected: u64,
    reference: Option<&MonthTotals>,
) -> Result<MonthTotals, BoxError> {
    if sample.updated != expected {
        return Err(format!("{name}: updated {} of {expected}", sample.updated).into());
    }
    let totals = fine_settlement::month_totals(db, month).await?;
    match reference {
        Some(r) if *r != totals => {
            Err(format!("{name}: month totals {totals:?} differ from {r:?}").into())
        }
        _ => Ok(totals),
    }
}

fn check_noop(s: &Sample) -> Result<(), BoxError> {
    if s.scanned != 0 || s.updated != 0 {
        return Err(format!("forced re-run scanned {} updated {}", s.scanned, s.updated).into());
    }
    Ok(())
}

/// Builds the shape's table with the product's generator (`seed::seed_loans`, COPY), settles
/// every month before the target with one set-based UPDATE (what earlier runs would have done),
/// and keeps a pristine copy to reset from, plus an empty copy of the table's definition for the
/// shapes that start without statistics. Returns (loans, rows the target month settles).
async fn generate(
    db: &mut PgConnection,
    url: &str,
    shape: &Shape,
    month: BusinessDate,
) -> Result<(u64, u64), BoxError> {
    for sql in [
        "DROP TABLE IF EXISTS loans_pristine, loans_definition",
        "TRUNCATE loans, job_runs, fine_journal, fine_heads, loan_changes, job_params,
                  job_events, fine_adjustments, fine_corrections, member_fine_statements,
                  member_statement_marks, member_moves",
        "CREATE TABLE loans_definition (LIKE loans INCLUDING ALL)",
    ] {
        sqlx::query(sql).execute(&mut *db).await?;
    }
    let pool = sqlx::PgPool::connect(url).await?;
    let mut loans = 0;
    for spec in &shape.seeds {
        loans += seed::seed_loans(&pool, spec, |_| {}).await?.loans;
    }
    pool.close().await;
    settle_before(&mut *db, month).await?;
    // The earlier months on the record, as `settlementd migrate` leaves a database settled before
    // the journal: every settled loan with its opening entry.
    while settlementd::jobs::fine_settlement::journal::open_unjournaled(&mut *db, 100_000).await?
        > 0
    {}
    for sql in [
        "CREATE TABLE loans_pristine AS SELECT * FROM loans ORDER BY id",
        "DROP TABLE IF EXISTS journal_pristine",
        "CREATE TABLE journal_pristine AS SELECT * FROM fine_journal ORDER BY id",
    ] {
        sqlx::query(sql).execute(&mut *db).await?;
    }
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans_pristine
          WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(&mut *db)
    .await?;
    Ok((loans, n as u64))
}

/// Settles every loan returned before `month`, as the runs of earlier months would have.
async fn settle_before(db: &mut PgConnection, month: BusinessDate) -> Result<(), BoxError> {
    let rule = FineRule::default();
    let sql = format!(
        "UPDATE loans l SET fine_cents = {}, fine_settled_at = now()
          WHERE l.returned_on < $1 AND l.fine_settled_at IS NULL",
        FineRule::sql_params(2)
    );
    sqlx::query(&sql)
        .bind(month.first_day())
        .bind(rule.grace_days)
        .bind(rule.daily_rate_cents)
        .bind(rule.max_cents)
        .execute(&mut *db)
        .await?;
    Ok(())
}

/// Restores the unsettled state: the same rows in the same physical order. An analyzed shape
/// keeps the table and refills it, then VACUUM ANALYZE (until every page is all-visible, as on a
/// table at rest); a shape "not analyzed" gets a brand-new table from the migration's definition
/// (no statistics at all, not even stale ones), loaded and never analyzed. CHECKPOINT and sync(2)
/// either way, so every case starts with nothing dirty in shared buffers or in the kernel's page
/// cache.
async fn reset(db: &mut PgConnection, analyzed: bool, pristine: &str) -> Result<(), BoxError> {
    // Everything a case writes besides the loans: claims, pins, the trail, the journal (back to
    // the earlier months' entries), corrections.
    for sql in [
        "TRUNCATE job_runs, job_params, job_events, loan_changes, fine_adjustments, fine_corrections,
                  member_fine_statements, member_statement_marks, member_moves",
        // The heads go with the journal: re-inserting the earlier months' entries makes them anew.
        "TRUNCATE fine_journal, fine_heads",
        &format!(
            "INSERT INTO fine_journal OVERRIDING SYSTEM VALUE SELECT * FROM {}",
            journal_of(pristine)
        ),
        "VACUUM ANALYZE fine_journal",
    ] {
        sqlx::query(sql).execute(&mut *db).await?;
    }
    let refill = format!("INSERT INTO loans SELECT * FROM {pristine} ORDER BY id");
    if analyzed {
        for sql in [
            "TRUNCATE loans",
            &refill,
            "VACUUM ANALYZE loans",
            "VACUUM ANALYZE job_runs",
        ] {
            sqlx::query(sql).execute(&mut *db).await?;
        }
        // VACUUM can miss pages whose inserting commit is not yet known to be flushed: repeat.
        for _ in 0..20 {
            let (visible, pages): (i32, i32) = sqlx::query_as(
                "SELECT relallvisible, relpages FROM pg_class WHERE oid = 'loans'::regclass",
            )
            .fetch_one(&mut *db)
            .await?;
            if visible >= pages {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            sqlx::query("VACUUM loans").execute(&mut *db).await?;
        }
    } else {
        // LIKE copies no triggers: settlementd's triggers on loans (which `verify` checks) are
        // made again from their definitions, ENABLE ALWAYS as `migrate` leaves them.
        let triggers: Vec<(String, String)> = sqlx::query_as(
            "SELECT pg_catalog.pg_get_triggerdef(oid),
                    'ALTER TABLE public.loans ENABLE '
                    || CASE tgenabled WHEN 'A' THEN 'ALWAYS ' WHEN 'R' THEN 'REPLICA ' ELSE '' END
                    || 'TRIGGER ' || quote_ident(tgname::text)
               FROM pg_catalog.pg_trigger
              WHERE tgrelid = 'public.loans'::regclass AND NOT tgisinternal ORDER BY tgname",
        )
        .fetch_all(&mut *db)
        .await?;
        for sql in [
            "DROP TABLE public.loans",
            "CREATE TABLE public.loans (LIKE loans_definition INCLUDING ALL)",
        ]
        .into_iter()
        .chain(triggers.iter().flat_map(|(c, e)| [c.as_str(), e.as_str()]))
        .chain([refill.as_str()])
        {
            sqlx::query(sql).execute(&mut *db).await?;
        }
    }
    sqlx::query("CHECKPOINT").execute(&mut *db).await?;
    // The checkpoint wrote its buffers to the kernel's page cache; the kernel writes them to disk
    // in the background at a moment of its choosing (`fsync` is off), which could fall into the
    // case that follows. Write them now.
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    Ok(())
}

/// The pristine journal kept with the pristine loans table `pristine`.
fn journal_of(pristine: &str) -> String {
    match pristine {
        "loans_pristine" => "journal_pristine".into(),
        other => format!("{other}_journal"),
    }
}

async fn relation_sizes(db: &mut PgConnection) -> Result<String, BoxError> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(c.oid)
           FROM pg_class c
          WHERE c.oid = 'loans'::regclass
             OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'loans'::regclass)
          ORDER BY c.relname",
    )
    .fetch_all(&mut *db)
    .await?;
    Ok(rows
        .iter()
        .map(|(n, b)| format!("{n} {:.1} MB", *b as f64 / 1e6))
        .collect::<Vec<_>>()
        .join(", "))
}

/// L: the whole month in one statement (the same fine expression the engine uses), written to
/// use the month index as a user who knows the schema would; the planner picks the plan. With
/// `shard` (index, count): only that shard's rows, as the engine splits them.
async fn set_based(
    db: &mut PgConnection,
    month: BusinessDate,
    shard: Option<(u32, u32)>,
) -> Result<Sample, BoxError> {
    let rule = FineRule::default();
    let only = shard.map_or(String::new(), |(index, count)| {
        format!(" AND (l.id % {count} + {count}) % {count} = {index}")
    });
    let sql = format!(
        "UPDATE loans l SET fine_cents = {}, fine_settled_at = now()
          WHERE date_trunc('month', l.returned_on::timestamp) = $1
            AND l.returned_on IS NOT NULL AND l.fine_settled_at IS NULL{only}",
        FineRule::sql_params(2)
    );
    let t = Instant::now();
    let n = sqlx::query(&sql)
        .bind(month.first_day().and_time(chrono::NaiveTime::MIN))
        .bind(rule.grace_days)
        .bind(rule.daily_rate_cents)
        .bind(rule.max_cents)
        .execute(&mut *db)
        .await?
        .rows_affected();
    Ok(Sample {
        wall_ms: ms(t.elapsed()),
        scanned: n,
        updated: n,
        ..Sample::default()
    })
}

/// J: the month updated and journaled in one statement — the set-based UPDATE of `L`, returning
/// what the journal records, written as the engine writes it (a row per 10,000 loans, arrays of
/// ids, seqs, dates and cents): what a journaled run can reach at best.
async fn set_based_journaled(
    db: &mut PgConnection,
    month: BusinessDate,
) -> Result<Sample, BoxError> {
    let rule = FineRule::default();
    let sql = format!(
        "WITH settled AS (
             UPDATE loans l SET fine_cents = {}, fine_settled_at = now(),
                               fine_seq = COALESCE(l.fine_seq, 0) + 1
              WHERE date_trunc('month', l.returned_on::timestamp) = $1
                AND l.returned_on IS NOT NULL AND l.fine_settled_at IS NULL
             RETURNING l.id, l.fine_seq, l.due_on, l.returned_on, l.fine_cents
         ), numbered AS (
             SELECT *, row_number() OVER () / 10000 AS part FROM settled
         ), journal AS (
             INSERT INTO fine_journal (month, kind, rule, shards, attempt, loan_ids, seqs, due_on,
                                       returned_on, before_cents, after_cents)
             SELECT $1::date, 'settled', '{{}}'::jsonb, 1, 1, array_agg(id), array_agg(fine_seq),
                    array_agg(due_on), array_agg(returned_on), array_agg(0::bigint),
                    array_agg(fine_cents)
               FROM numbered GROUP BY part
         )
         SELECT count(*) FROM settled",
        FineRule::sql_params(2)
    );
    let t = Instant::now();
    let n: i64 = sqlx::query_scalar(&sql)
        .bind(month.first_day().and_time(chrono::NaiveTime::MIN))
        .bind(rule.grace_days)
        .bind(rule.daily_rate_cents)
        .bind(rule.max_cents)
        .fetch_one(&mut *db)
        .await?;
    Ok(Sample {
        wall_ms: ms(t.elapsed()),
        scanned: n as u64,
        updated: n as u64,
        ..Sample::default()
    })
}

/// L2: what two shards can reach at best on these cores, with nothing of the engine: the set-based
/// UPDATE of each shard of two (`id % 2`), both at once on two connections opened beforehand;
/// wall time until both are done. S2 against L2 is the engine's cost; L2 against L is what
/// splitting a month by `id % 2` allows.
async fn set_based_by_shard(url: &str, month: BusinessDate) -> Result<Sample, BoxError> {
    let (mut a, mut b) = tokio::try_join!(PgConnection::connect(url), PgConnection::connect(url))?;
    let t = Instant::now();
    let (x, y) = tokio::try_join!(
        set_based(&mut a, month, Some((0, 2))),
        set_based(&mut b, month, Some((1, 2)))
    )?;
    let wall_ms = ms(t.elapsed());
    tokio::try_join!(a.close(), b.close())?;
    Ok(Sample {
        wall_ms,
        scanned: x.scanned + y.scanned,
        updated: x.updated + y.updated,
        ..Sample::default()
    })
}

/// N: the seed's approach. Reads the month's unsettled loans once, computes each fine in the
/// client, then sends per-row prepared UPDATEs, 500 pipelined requests per transaction on one
/// connection (tokio-postgres pipelines concurrent requests like JDBC `executeBatch`).
async fn per_row_pipelined(url: &str, month: BusinessDate) -> Result<Sample, BoxError> {
    let socket = url::Url::parse(url)?
        .query_pairs()
        .find(|(k, _)| k == "host")
        .map(|(_, v)| v.into_owned())
        .ok_or("no socket directory in the URL")?;
    let (mut client, connection) = tokio_postgres::Config::new()
        .host_path(&socket)
        .port(5432)
        .user(settlementd::embedded_pg::SUPERUSER)
        .dbname("postgres")
        .connect(tokio_postgres::NoTls)
        .await?;
    let conn_task = tokio::spawn(connection);
    let rule = FineRule::default();
    let t = Instant::now();
    let rows = client
        .query(
            "SELECT id, due_on, returned_on FROM loans
              WHERE date_trunc('month', returned_on::timestamp) = $1
                AND returned_on IS NOT NULL AND fine_settled_at IS NULL ORDER BY id",
            &[&month.first_day().and_time(chrono::NaiveTime::MIN)],
        )
        .await?;
    let loans: Vec<(i64, i64)> = rows
        .iter()
        .map(|r| {
            let due: NaiveDate = r.get(1);
            let returned: NaiveDate = r.get(2);
            (r.get::<_, i64>(0), rule.fine_cents(due, returned))
        })
        .collect();
    drop(rows);
    let update = client
        .prepare(
            "UPDATE loans SET fine_cents = $2, fine_settled_at = now()
              WHERE id = $1 AND fine_settled_at IS NULL",
        )
        .await?;
    let mut updated = 0;
    for chunk in loans.chunks(PIPELINE) {
        let tx = client.transaction().await?;
        let (tx_ref, update) = (&tx, &update);
        let counts = futures_util::future::try_join_all(
            chunk
                .iter()
                .map(|(id, fine)| async move { tx_ref.execute(update, &[id, fine]).await }),
        )
        .await?;
        tx.commit().await?;
        updated += counts.iter().filter(|&&c| c > 0).count() as u64;
    }
    let wall_ms = ms(t.elapsed());
    drop(client);
    let _ = conn_task.await;
    Ok(Sample {
        wall_ms,
        scanned: loans.len() as u64,
        updated,
        ..Sample::default()
    })
}

/// `shards` `settlementd run` processes in parallel; wall time from the first spawn to the last
/// exit; each process's peak RSS from its `VmHWM`.
fn processes(
    binary: &Path,
    url: &str,
    month: BusinessDate,
    shards: u32,
    batch: Option<u32>,
    force: bool,
) -> Result<Sample, BoxError> {
    let t = Instant::now();
    let mut children = Vec::new();
    for shard in 0..shards {
        let mut cmd = command(binary, url);
        cmd.env("SETTLEMENTD_BENCH_UNJOURNALED", "1");
        cmd.env("SETTLEMENTD__DATABASE__URL", url)
            .env("RUST_LOG", "warn")
            .args(["run", "--json", "--business-date"])
            .arg(month.to_string())
            .args([
                "--shard",
                &shard.to_string(),
                "--shards",
                &shards.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if force {
            cmd.arg("--force");
        }
        if let Some(b) = batch {
            cmd.env("SETTLEMENTD__BATCH__SIZE", b.to_string());
        }
        children.push(cmd.spawn()?);
    }
    // One thread per process: drain its pipes, watch its VmHWM, then reap exactly that pid.
    let waiters: Vec<_> = children
        .into_iter()
        .map(|mut child| {
            std::thread::spawn(move || -> Result<(String, Instant, u64), String> {
                let hwm = watch_hwm(child.id());
                let mut out = String::new();
                let mut err = String::new();
                let mut stdout = child.stdout.take().expect("piped");
                let mut stderr = child.stderr.take().expect("piped");
                let err_reader = std::thread::spawn(move || {
                    let _ = stderr.read_to_string(&mut err);
                    err
                });
                let _ = stdout.read_to_string(&mut out);
                let err = err_reader.join().unwrap_or_default();
                let (status, ended) = reap(child.id() as i32).map_err(|e| e.to_string())?;
                let rss = hwm.join().unwrap_or(0);
                if status != 0 {
                    return Err(format!("settlementd exited with {status}: {err}"));
                }
                Ok((out, ended, rss))
            })
        })
        .collect();
    let mut sample = Sample::default();
    let mut last_exit = t;
    let mut engine = 0f64;
    let mut rss = 0;
    for w in waiters {
        let (out, ended, peak) = w.join().map_err(|_| "waiter panicked")??;
        last_exit = last_exit.max(ended);
        rss = rss.max(peak);
        let v: serde_json::Value = serde_json::from_str(out.trim())
            .map_err(|e| format!("settlementd printed {out:?}: {e}"))?;
        if v["skipped"].as_bool() != Some(false) {
            return Err(format!("settlementd skipped: {out}").into());
        }
        sample.scanned += v["scanned"].as_u64().unwrap_or(0);
        sample.updated += v["updated"].as_u64().unwrap_or(0);
        engine = engine.max(v["elapsed_ms"].as_f64().unwrap_or(0.0));
    }
    sample.wall_ms = ms(last_exit - t);
    sample.engine_ms = Some(engine);
    sample.peak_rss_kib = Some(rss);
    Ok(sample)
}

/// Peak RSS of a running process in KiB: its `VmHWM`, polled every millisecond until it exits.
/// (`ru_maxrss` from `wait4` would not do: Linux carries the pre-exec image, a copy of this
/// benchmark process, into the child's maximum.)
/// `binary` on the bench's database, none of this environment's settings passed on.
fn command(binary: &Path, url: &str) -> Command {
    let mut cmd = Command::new(binary);
    for (key, _) in std::env::vars() {
        if key.starts_with("SETTLEMENTD__") || key == "DATABASE_URL" || key == "RUST_LOG" {
            cmd.env_remove(key);
        }
    }
    cmd.env("SETTLEMENTD__DATABASE__URL", url);
    cmd
}

/// `settlementd verify --json` of `month`, timed from spawn to exit; it must find the month right
/// with `expected` rows settled.
/// `settlementd ARGS` against `url`, timed from spawn to exit: its wall time, whether it exited 0,
/// and the one JSON object it printed.
fn json_process(
    binary: &Path,
    url: &str,
    args: &[&str],
) -> Result<(f64, bool, serde_json::Value), BoxError> {
    let t = Instant::now();
    let out = command(binary, url)
        .env("SETTLEMENTD__DATABASE__URL", url)
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let wall_ms = ms(t.elapsed());
    let v = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "settlementd {} printed {:?} ({e}): {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    Ok((wall_ms, out.status.success(), v))
}

/// `settlementd run --dry-run --json` of the unsettled `month`, 1 shard, timed from spawn to exit:
/// it must report `expected` loans to settle; also returns the fines it reports.
fn dry_run_process(
    binary: &Path,
    url: &str,
    month: BusinessDate,
    expected: u64,
) -> Result<(Sample, i128), BoxError> {
    let month = month.to_string();
    let args = [
        "run",
        "--dry-run",
        "--json",
        "--shards",
        "1",
        "--shard",
        "0",
    ];
    let (wall_ms, success, v) = json_process(
        binary,
        url,
        &[&args[..], &["--business-date", &month]].concat(),
    )?;
    let settle = &v["by_shard"][0]["settle"];
    if !success || settle["loans"].as_u64() != Some(expected) {
        return Err(format!("the dry run did not report {expected} loans to settle: {v}").into());
    }
    let fines = settle["cents"].to_string().parse::<i128>()?;
    Ok((
        Sample {
            wall_ms,
            scanned: expected,
            ..Sample::default()
        },
        fines,
    ))
}

fn verify_process(
    binary: &Path,
    url: &str,
    month: BusinessDate,
    expected: u64,
) -> Result<Sample, BoxError> {
    let month = month.to_string();
    let (wall_ms, success, v) = json_process(
        binary,
        url,
        &["verify", "--json", "--business-date", &month],
    )?;
    let settled = v["totals"]["settled_rows"].as_u64();
    if !success || v["right"] != true || settled != Some(expected) {
        return Err(
            format!("verify did not find the month right with {expected} rows: {v}").into(),
        );
    }
    Ok(Sample {
        wall_ms,
        scanned: v["returned"].as_u64().unwrap_or(0),
        ..Sample::default()
    })
}

/// `settlementd VERB --job member-statements --json` of `month` (`run`, or `verify`, which must
/// find it right), timed from spawn to exit.
fn statements_process(
    binary: &Path,
    url: &str,
    month: BusinessDate,
    verb: &str,
) -> Result<Sample, BoxError> {
    let mut cmd = command(binary, url);
    let t = Instant::now();
    let out = cmd
        .env("SETTLEMENTD__DATABASE__URL", url)
        .args([
            verb,
            "--job",
            settlementd::jobs::member_statements::JOB_NAME,
            "--json",
        ])
        .args(["--business-date", &month.to_string()])
        .stdin(Stdio::null())
        .output()?;
    let wall_ms = ms(t.elapsed());
    let right = verb != "verify"
        || serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .is_ok_and(|v| v["right"] == true);
    if !out.status.success() || !right {
        return Err(format!(
            "{verb} --job member-statements of {month} failed: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    Ok(Sample {
        wall_ms,
        ..Sample::default()
    })
}

/// `settlementd correct --json` of `month` to a rate 10 cents higher than the default (every late
/// loan's fine changes), under a key of its own; timed from spawn to exit.
fn correct_process(
    binary: &Path,
    url: &str,
    month: BusinessDate,
    rep: usize,
) -> Result<Sample, BoxError> {
    let mut cmd = command(binary, url);
    let rate = FineRule::default().daily_rate_cents + 10;
    let t = Instant::now();
    let out = cmd
        .env("SETTLEMENTD__DATABASE__URL", url)
        .env("SETTLEMENTD__FINE__DAILY_RATE_CENTS", rate.to_string())
        .args(["correct", "--json", "--business-date"])
        .arg(month.to_string())
        .args(["--reason", "benchmark: a higher rate", "--key"])
        .arg(format!("bench-{rep}-{}", std::process::id()))
        .stdin(Stdio::null())
        .output()?;
    let wall_ms = ms(t.elapsed());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "correct printed {:?} ({e}): {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if !out.status.success() || v["replayed"] != false {
        return Err(format!("correct failed: {v}").into());
    }
    Ok(Sample {
        wall_ms,
        updated: v["changed"].as_u64().unwrap_or(0),
        ..Sample::default()
    })
}

fn watch_hwm(pid: u32) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let path = format!("/proc/{pid}/status");
        let mut peak = 0;
        while let Ok(status) = std::fs::read_to_string(&path) {
            let Some(kib) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            else {
                break; // a zombie has no memory left to report
            };
            peak = peak.max(kib);
            std::thread::sleep(Duration::from_millis(1));
        }
        peak
    })
}

/// Reaps `pid`, returning its exit code and when it exited.
fn reap(pid: i32) -> std::io::Result<(i32, Instant)> {
    let mut status = 0;
    loop {
        // SAFETY: a valid pointer to a local; pid is our own unreaped child.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    let ended = Instant::now();
    let code = if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    };
    Ok((code, ended))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn batch_sizes(batches: &[Option<u32>]) -> String {
    batches
        .iter()
        .map(|b| b.map_or("default".to_string(), |b| b.to_string()))
        .collect::<Vec<_>>()
        .join(",")
}

fn summarize(samples: &[(String, Vec<Sample>)], expected: u64) -> Vec<Row> {
    let what = |case: &str| match case.split('@').next().unwrap_or(case) {
        "L" => "one set-based UPDATE of the month (the limit)",
        "L2" => "two set-based UPDATEs at once, one per shard of 2 (the limit for 2 shards)",
        "N" => "per-row prepared UPDATE, pipelined 500 per transaction (the seed)",
        "S1" => "settlementd run, 1 shard (process)",
        "S2" => "settlementd run, 2 shards in parallel (processes)",
        "S3" => "settlementd run, 3 shards in parallel (processes)",
        "R-after-run" => "settlementd run --force of the settled month, right after S1",
        "V-after-run" => {
            "settlementd verify of the month (read-only, each loan's chain), right after S1"
        }
        "ST-after-run" => "settlementd run --job member-statements of the month, after V",
        "VS-after-run" => "settlementd verify --job member-statements of the month, after ST",
        "C-after-run" => "settlementd correct of the month to another rate, after R",
        "S1U" => "settlementd run, 1 shard, built without the money journal (baseline)",
        "J" => "one set-based UPDATE of the month that also journals it",
        "D" => "settlementd run --dry-run of the unsettled month, 1 shard (writes nothing)",
        _ => "settlementd run --force of the settled month, after VACUUM",
    };
    let l_rate = samples
        .iter()
        .find(|(c, _)| c == "L")
        .filter(|(_, v)| !v.is_empty())
        .map(|(_, v)| expected as f64 / (median(v.iter().map(|s| s.wall_ms).collect()) / 1000.0));
    samples
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(case, v)| {
            let wall = median(v.iter().map(|s| s.wall_ms).collect());
            // A re-run or a verify settles nothing: no rate, no ratio to L (the summary compares
            // verify's time with L's).
            let rerun = case.starts_with('R')
                || case.starts_with('V')
                || case.starts_with('C')
                || case == "D";
            let rows = if rerun { 0 } else { expected };
            let rate = rows as f64 / (wall / 1000.0);
            Row {
                case: case.to_string(),
                what: what(case).to_string(),
                reps: v.len(),
                wall_ms: wall,
                engine_ms: v
                    .iter()
                    .map(|s| s.engine_ms)
                    .collect::<Option<Vec<_>>>()
                    .map(median),
                rows,
                rows_per_s: rate,
                ratio_to_l: if rerun {
                    None
                } else {
                    l_rate.map(|l| rate / l)
                },
                scanned: v.iter().map(|s| s.scanned).max().unwrap_or(0),
                peak_rss_mib: v
                    .iter()
                    .filter_map(|s| s.peak_rss_kib)
                    .max()
                    .map(|k| k as f64 / 1024.0),
                samples_ms: v.iter().map(|s| s.wall_ms).collect(),
            }
        })
        .collect()
}

fn print_table(shape: &Shape, rows: &[Row], loans: u64, expected: u64, batches: &[Option<u32>]) {
    println!();
    println!(
        "shape {} ({}): {loans} loans, {expected} settled per case, batch.size {}, medians of each \
         case's repetitions",
        shape.name,
        shape.what,
        batch_sizes(batches)
    );
    println!(
        "{:<15} {:>4} {:>10} {:>10} {:>11} {:>7} {:>8} {:>9}",
        "case", "reps", "wall ms", "engine ms", "rows/s", "× L", "scanned", "RSS MiB"
    );
    for r in rows {
        println!(
            "{:<15} {:>4} {:>10.1} {:>10} {:>11.0} {:>7} {:>8} {:>9}",
            r.case,
            r.reps,
            r.wall_ms,
            r.engine_ms.map_or("-".into(), |e| format!("{e:.0}")),
            r.rows_per_s,
            r.ratio_to_l.map_or("-".into(), |x| format!("{x:.2}")),
            r.scanned,
            r.peak_rss_mib.map_or("-".into(), |m| format!("{m:.1}")),
        );
    }
}

/// `bench-results/` in the crate, created if missing.
fn results_dir() -> std::io::Result<std::path::PathBuf> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The server a shape was measured on, for the results file.
struct Server<'a> {
    version: &'a str,
    settings: &'a str,
}

fn write_results(
    shape: &Shape,
    rows: &[Row],
    loans: u64,
    expected: u64,
    batches: &[Option<u32>],
    sizes: &[(String, String)],
    server: &Server,
) -> Result<(), BoxError> {
    let dir = results_dir()?;
    let mut csv = String::from(
        "case,reps,wall_ms,engine_ms,rows,rows_per_s,ratio_to_l,scanned,peak_rss_mib,what\n",
    );
    for r in rows {
        csv.push_str(&format!(
            "{},{},{:.1},{},{},{:.0},{},{},{},\"{}\"\n",
            r.case,
            r.reps,
            r.wall_ms,
            r.engine_ms.map_or(String::new(), |e| format!("{e:.0}")),
            r.rows,
            r.rows_per_s,
            r.ratio_to_l.map_or(String::new(), |x| format!("{x:.3}")),
            r.scanned,
            r.peak_rss_mib.map_or(String::new(), |m| format!("{m:.1}")),
            r.what
        ));
    }
    let base = dir.join(format!("settle-{}-{loans}", shape.name));
    std::fs::write(base.with_extension("csv"), csv)?;
    let json = serde_json::json!({
        "shape": shape.name,
        "layout": shape.what,
        "analyzed": shape.analyzed,
        "postgres": server.version,
        "cluster": server.settings,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "loans": loans,
        "settled_per_case": expected,
        "batch_size": batch_sizes(batches),
        "sizes": sizes.iter().map(|(c, s)| serde_json::json!({"after": c, "relations": s})).collect::<Vec<_>>(),
        "rows": rows,
    });
    std::fs::write(
        base.with_extension("json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    println!("wrote {}.csv and .json", base.display());
    Ok(())
}

/// What doubling the history costs one shard, `verify` and `correct`: [`doubling`].
#[derive(Debug, serde::Serialize)]
struct Doubled {
    /// S1 wall times on `history`, then on `history2x`, in repetition order.
    history_ms: Vec<f64>,
    history2x_ms: Vec<f64>,
    /// Median over repetitions of `history2x` time / `history` time.
    ratio: f64,
    /// The same for `verify` right after the run, and for `correct` after it.
    verify_ratio: f64,
    correct_ratio: f64,
}

/// The doubling target in one interleaved set: `history` and `history2x` are generated and kept
/// side by side (`doubling_1x`, `doubling_2x`), and each repetition runs one shard on each, on a
/// freshly reset table, the order alternating between repetitions. The ratio is the median of the
/// repetitions' own ratios, so the two times of a ratio come from the same minute of the machine.
/// Comparing the two shapes' S1 medians, measured minutes apart, gave 0.90–1.34 from one run to
/// the next on a machine whose cores change speed (docs/PERFORMANCE.md). Pairs are cheap, and a
/// single slow run still lands on one side of a pair, so the pass takes three times
/// `SETTLE_BENCH_REPS` of them.
async fn doubling(
    url: &str,
    base: u64,
    reps: usize,
    batch: Option<u32>,
    binaries: &Binaries,
) -> Result<Doubled, BoxError> {
    let mut db = PgConnection::connect(url).await?;
    settlementd::db::migrate_connection(&mut db).await?;
    let month = BusinessDate::parse(MONTH)?;
    let mut tables = Vec::new();
    for (name, table) in [("history", "doubling_1x"), ("history2x", "doubling_2x")] {
        let shape = shape(name, base)?;
        let (loans, expected) = generate(&mut db, url, &shape, month).await?;
        for sql in [
            format!("DROP TABLE IF EXISTS {table}, {table}_journal"),
            format!("ALTER TABLE loans_pristine RENAME TO {table}"),
            format!("ALTER TABLE journal_pristine RENAME TO {table}_journal"),
        ] {
            sqlx::query(&sql).execute(&mut db).await?;
        }
        // What every run on this table must leave: the month as the set-based UPDATE leaves it.
        reset(&mut db, shape.analyzed, table).await?;
        set_based(&mut db, month, None).await?;
        let reference = fine_settlement::month_totals(&mut db, month).await?;
        tables.push((name, table, shape.analyzed, expected, reference));
        println!("doubling: {name}, {loans} loans, {expected} to settle, kept as {table}");
    }
    let mut times = [Vec::new(), Vec::new()];
    let mut verifies = [Vec::new(), Vec::new()];
    let mut corrects = [Vec::new(), Vec::new()];
    for rep in 0..reps {
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let (name, table, analyzed, expected, reference) = &tables[i];
            reset(&mut db, *analyzed, table).await?;
            let sample = processes(&binaries.settlementd, url, month, 1, batch, false)?;
            let case = format!("doubling, {name}");
            checked(&mut db, month, &case, &sample, *expected, Some(reference)).await?;
            let verified = verify_process(&binaries.settlementd, url, month, *expected)?;
            let corrected = correct_process(&binaries.settlementd, url, month, rep)?;
            println!(
                "rep {} S1 {name:<9} {:>8.0} ms  V {:>7.0} ms  C {:>7.0} ms",
                rep + 1,
                sample.wall_ms,
                verified.wall_ms,
                corrected.wall_ms
            );
            times[i].push(sample.wall_ms);
            verifies[i].push(verified.wall_ms);
            corrects[i].push(corrected.wall_ms);
        }
    }
    sqlx::query("DROP TABLE doubling_1x, doubling_2x, doubling_1x_journal, doubling_2x_journal")
        .execute(&mut db)
        .await?;
    let ratio_of = |pairs: &[Vec<f64>; 2]| {
        median(
            pairs[0]
                .iter()
                .zip(&pairs[1])
                .map(|(one, two)| two / one)
                .collect(),
        )
    };
    let (verify_ratio, correct_ratio) = (ratio_of(&verifies), ratio_of(&corrects));
    let ratio = ratio_of(&times);
    let [history_ms, history2x_ms] = times;
    let doubled = Doubled {
        history_ms,
        history2x_ms,
        ratio,
        verify_ratio,
        correct_ratio,
    };
    let dir = results_dir()?;
    std::fs::write(
        dir.join(format!("settle-doubling-{base}.json")),
        serde_json::to_string_pretty(&doubled)?,
    )?;
    Ok(doubled)
}

/// One line per shape with the targets' ratios, and the history-doubling ratio: interleaved
/// ([`doubling`]) when measured, else the two shapes' S1 medians.
fn print_summary(all: &[(&str, Vec<Row>)], doubled: Option<&Doubled>) {
    let get = |shape: &str, case: &str| {
        all.iter()
            .find(|(s, _)| *s == shape)
            .and_then(|(_, rows)| rows.iter().find(|r| r.case == case))
    };
    let ratio = |shape: &str, case: &str| get(shape, case).and_then(|r| r.ratio_to_l);
    let fmt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
    println!(
        "
summary (× L, medians; L2: two set-based UPDATEs, one per shard of 2, at once; R in ms)"
    );
    println!(
        "{:<12} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>9}",
        "shape",
        "S1",
        "S2",
        "S3",
        "best",
        "L2",
        "J÷L",
        "S1÷S1U",
        "V÷L",
        "VS÷L",
        "C÷L",
        "D÷L",
        "S1 ms",
        "R ms",
        "RSS MiB"
    );
    for (shape, rows) in all {
        let best = ["S2", "S3"]
            .iter()
            .filter_map(|c| ratio(shape, c))
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
        let rss = rows
            .iter()
            .filter_map(|r| r.peak_rss_mib)
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))));
        // Times against L's (lower is better): verify's (target ≤ 1), correct's (≤ 3), the
        // journaled statement's; and the run's against the run without the journal (≤ 1.4).
        let over = |case: &str, base: &str| {
            get(shape, case)
                .zip(get(shape, base))
                .map(|(v, l)| v.wall_ms / l.wall_ms)
        };
        println!(
            "{:<12} {:>6} {:>6} {:>6} {:>6} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>9}",
            shape,
            fmt(ratio(shape, "S1")),
            fmt(ratio(shape, "S2")),
            fmt(ratio(shape, "S3")),
            fmt(best),
            fmt(ratio(shape, "L2")),
            fmt(over("J", "L")),
            fmt(over("S1", "S1U")),
            fmt(over("V-after-run", "L")),
            fmt(over("VS-after-run", "L")),
            fmt(over("C-after-run", "L")),
            fmt(over("D", "L")),
            get(shape, "S1").map_or("-".into(), |r| format!("{:.0}", r.wall_ms)),
            get(shape, "R-after-run").map_or("-".into(), |r| format!("{:.1}", r.wall_ms)),
            rss.map_or("-".into(), |m| format!("{m:.1}")),
        );
    }
    if let Some(d) = doubled {
        println!(
            "doubling the history, one shard, interleaved: {:.2} × the time (median of {} \
             repetitions' ratios; medians {:.0} ms against {:.0} ms); verify {:.2} ×, correct \
             {:.2} ×",
            d.ratio,
            d.history_ms.len(),
            median(d.history2x_ms.clone()),
            median(d.history_ms.clone()),
            d.verify_ratio,
            d.correct_ratio
        );
    } else if let (Some(one), Some(two)) = (get("history", "S1"), get("history2x", "S1")) {
        println!(
            "history2x / history, one shard: {:.2} × the time ({:.0} ms against {:.0} ms)",
            two.wall_ms / one.wall_ms,
            two.wall_ms,
            one.wall_ms
        );
    }
}
