//! Settlement throughput against the physical limit, in one run, on one private PostgreSQL.
//!
//! `cargo bench --bench settle` (cargo builds the `settlementd` binary with the release-like bench
//! profile and hands its path to this bench). It starts a temporary embedded cluster (fsync,
//! synchronous_commit and full_page_writes off, like every temporary cluster of settlementd: the
//! same settings for every case, so the ratios are fair), generates the loans once, and measures,
//! each case on a freshly reset table (same rows, same physical order, VACUUM ANALYZE, CHECKPOINT):
//!
//! - `L`: one set-based `UPDATE` of the month (the limit: one statement, one core);
//! - `N`: the seed's per-row approach: read the month's unsettled loans, compute fines in the
//!   client, then per-row prepared `UPDATE … WHERE id = $1 AND fine_settled_at IS NULL` pipelined
//!   500 at a time, one transaction per 500 (what JDBC `executeBatch` does);
//! - `S1`, `S2`, `S3`: real `settlementd run` processes, 1, 2 or 3 shards in parallel; wall time
//!   from the first spawn to the last exit, peak RSS of each process (`VmHWM`);
//! - `R`: `settlementd run --force` of the settled month right after `S1`, and again after VACUUM.
//!
//! Environment: `SETTLE_BENCH_LOANS` (default 1,000,000, over four months, the third is settled),
//! `SETTLE_BENCH_REPS` (default 3; medians are reported), `SETTLE_BENCH_CASES` (e.g. `L,S1`),
//! `SETTLE_BENCH_BATCH` (passed to the processes as `SETTLEMENTD__BATCH__SIZE`).
//! Results: a table on stdout, `bench-results/settle-<loans>.csv` and `.json`.

use chrono::NaiveDate;
use settlementd::calendar::BusinessDate;
use settlementd::embedded_pg::{EmbeddedOptions, EmbeddedPg};
use settlementd::fine::FineRule;
use settlementd::seed::{self, SeedSpec};
use settlementd::settlement::{self, MonthTotals};
use sqlx::{Connection, PgConnection};
use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The months the loans are returned in; the third one is settled by every case.
const MONTHS: [&str; 4] = ["2026-07-31", "2026-08-31", "2026-09-30", "2026-10-31"];
const TARGET: usize = 2;
/// The seed's JDBC batch size.
const PIPELINE: usize = 500;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> Result<(), BoxError> {
    let loans: i64 = env_or("SETTLE_BENCH_LOANS", 1_000_000);
    let reps: usize = env_or("SETTLE_BENCH_REPS", 3);
    // One size or a comma-separated list (one S row per size, all in this run).
    let batches: Vec<Option<u32>> = match std::env::var("SETTLE_BENCH_BATCH") {
        Ok(list) => list
            .split(',')
            .map(|b| b.trim().replace('_', "").parse().map(Some))
            .collect::<Result<_, _>>()?,
        Err(_) => vec![None],
    };
    let cases: Vec<String> = std::env::var("SETTLE_BENCH_CASES")
        .unwrap_or_else(|_| "L,N,S1,S2,S3".into())
        .split(',')
        .map(|c| c.trim().to_uppercase())
        .collect();
    let started = Instant::now();
    let pg = EmbeddedPg::start(EmbeddedOptions::default())?;
    let url = pg.url("postgres");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = runtime.block_on(bench(&pg, &url, loans, reps, &batches, &cases));
    drop(runtime);
    pg.stop();
    let report = result?;
    println!("whole benchmark: {:.1} s", started.elapsed().as_secs_f64());
    let _ = report;
    Ok(())
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
    loans: i64,
    reps: usize,
    batches: &[Option<u32>],
    cases: &[String],
) -> Result<Vec<Row>, BoxError> {
    let mut db = PgConnection::connect(url).await?;
    settlementd::db::MIGRATOR.run(&mut db).await?;
    // No autovacuum: "right after the run" must mean before any VACUUM, and no background vacuum
    // may compete for the cores during a case. Every VACUUM here is explicit.
    sqlx::query("ALTER SYSTEM SET autovacuum = off")
        .execute(&mut db)
        .await?;
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut db)
        .await?;
    let month = BusinessDate::parse(MONTHS[TARGET])?;
    let t = Instant::now();
    let expected = generate(&mut db, url, loans).await?;
    println!(
        "PostgreSQL {} (temporary cluster: fsync=off, synchronous_commit=off, full_page_writes=off), \
         {} cores; {loans} loans over four months, {expected} to settle in {}; generated in {:.1} s",
        pg.version(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        month.first_day().format("%Y-%m"),
        t.elapsed().as_secs_f64()
    );
    let want = |c: &str| cases.iter().any(|x| x == c);
    // Case names in table order; a case with several batch sizes gets one row per size.
    let label = |case: &str, b: Option<u32>| match (batches.len() > 1, b) {
        (true, Some(b)) => format!("{case}@{b}"),
        _ => case.to_string(),
    };
    let mut samples: Vec<(String, Vec<Sample>)> = Vec::new();
    for case in ["L", "N"] {
        samples.push((case.to_string(), Vec::new()));
    }
    for (i, &b) in batches.iter().enumerate() {
        samples.push((label("S1", b), Vec::new()));
        if i == 0 {
            samples.push(("R-after-run".into(), Vec::new()));
            samples.push(("R-after-vacuum".into(), Vec::new()));
        }
        samples.push((label("S2", b), Vec::new()));
        samples.push((label("S3", b), Vec::new()));
    }
    let mut push = |case: &str, s: Sample| {
        if let Some((_, v)) = samples.iter_mut().find(|(c, _)| c == case) {
            v.push(s);
        }
    };
    let mut runs: Vec<(&str, Option<u32>, bool)> = vec![("L", None, false), ("N", None, false)];
    for (i, &b) in batches.iter().enumerate() {
        for case in ["S1", "S2", "S3"] {
            runs.push((case, b, i == 0 && case == "S1"));
        }
    }
    let mut reference: Option<MonthTotals> = None;
    let mut sizes = Vec::new();
    for rep in 1..=reps {
        for &(case, batch, with_rerun) in &runs {
            if !want(case) {
                continue;
            }
            let name = label(case, batch);
            reset(&mut db).await?;
            let sample = match case {
                "L" => set_based(&mut db, month).await?,
                "N" => per_row_pipelined(url, month).await?,
                "S1" => processes(url, month, 1, batch, false)?,
                "S2" => processes(url, month, 2, batch, false)?,
                _ => processes(url, month, 3, batch, false)?,
            };
            if sample.updated != expected {
                return Err(format!("{name}: updated {} of {expected}", sample.updated).into());
            }
            // Every case must leave the month exactly as the set-based UPDATE does.
            let totals = settlement::month_totals(&mut db, month).await?;
            match &reference {
                None => reference = Some(totals),
                Some(r) if *r != totals => {
                    return Err(format!("{name}: month totals {totals:?} differ from {r:?}").into())
                }
                Some(_) => {}
            }
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
            if with_rerun {
                let again = processes(url, month, 1, batch, true)?;
                check_noop(&again)?;
                println!(
                    "rep {rep} R         {:>8.1} ms right after the run",
                    again.wall_ms
                );
                push("R-after-run", again);
                sqlx::query("VACUUM loans").execute(&mut db).await?;
                let again = processes(url, month, 1, batch, true)?;
                check_noop(&again)?;
                println!("rep {rep} R         {:>8.1} ms after VACUUM", again.wall_ms);
                push("R-after-vacuum", again);
            }
        }
    }

    let rows = summarize(&samples, expected);
    print_table(&rows, loans, expected, batches);
    for (case, s) in &sizes {
        println!("after {case}: {s}");
    }
    write_results(&rows, loans, expected, batches, &sizes, pg.version())?;
    Ok(rows)
}

fn check_noop(s: &Sample) -> Result<(), BoxError> {
    if s.scanned != 0 || s.updated != 0 {
        return Err(format!("forced re-run scanned {} updated {}", s.scanned, s.updated).into());
    }
    Ok(())
}

/// Four months of loans from the product's own generator (`settlementd seed`: COPY, ids appended
/// per month, so they are contiguous per month as in an append-only table; 90 % returned within the
/// month, 28 % of those on time). The two months before the target are settled by a set-based
/// UPDATE; the month after it stays open. Keeps a pristine copy to reset from. Returns how many
/// loans the target month settles.
async fn generate(db: &mut PgConnection, url: &str, loans: i64) -> Result<u64, BoxError> {
    let per_month = (loans / MONTHS.len() as i64).max(1) as u64;
    let pool = sqlx::PgPool::connect(url).await?;
    for (m, date) in MONTHS.iter().enumerate() {
        let month = BusinessDate::parse(date)?;
        seed::seed_loans(
            &pool,
            &SeedSpec::new(per_month, month, 42 + m as u64),
            |_| {},
        )
        .await?;
        if m < TARGET {
            set_based(&mut *db, month).await?;
        }
    }
    pool.close().await;
    sqlx::query("DROP TABLE IF EXISTS loans_pristine")
        .execute(&mut *db)
        .await?;
    sqlx::query("CREATE TABLE loans_pristine AS SELECT * FROM loans ORDER BY id")
        .execute(&mut *db)
        .await?;
    let month = BusinessDate::parse(MONTHS[TARGET])?;
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans_pristine
          WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(&mut *db)
    .await?;
    Ok(n as u64)
}

/// Restores the unsettled state: the same rows in the same physical order, into the table as
/// the migration defines it (storage options, indexes), then VACUUM ANALYZE and CHECKPOINT so
/// every case starts from the same physical state with nothing dirty in shared buffers.
async fn reset(db: &mut PgConnection) -> Result<(), BoxError> {
    for sql in [
        "TRUNCATE loans, job_runs",
        "INSERT INTO loans SELECT * FROM loans_pristine ORDER BY id",
        "VACUUM ANALYZE loans",
        "VACUUM ANALYZE job_runs",
    ] {
        sqlx::query(sql).execute(&mut *db).await?;
    }
    // Every page all-visible (index-only scans and hint bits as on a table at rest). VACUUM can
    // miss pages whose inserting commit is not yet known to be flushed: repeat until it did not.
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
    sqlx::query("CHECKPOINT").execute(&mut *db).await?;
    Ok(())
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

/// L: the whole month in one statement (the same fine expression the engine uses).
async fn set_based(db: &mut PgConnection, month: BusinessDate) -> Result<Sample, BoxError> {
    let rule = FineRule::default();
    let sql = format!(
        "UPDATE loans l SET fine_cents = {}, fine_settled_at = now()
          WHERE l.returned_on BETWEEN $1 AND $2 AND l.fine_settled_at IS NULL",
        FineRule::SQL_EXPR
            .replace("$grace", "$3")
            .replace("$rate", "$4")
            .replace("$max", "$5")
    );
    let t = Instant::now();
    let n = sqlx::query(&sql)
        .bind(month.first_day())
        .bind(month.date())
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
              WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL ORDER BY id",
            &[&month.first_day(), &month.date()],
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
    url: &str,
    month: BusinessDate,
    shards: u32,
    batch: Option<u32>,
    force: bool,
) -> Result<Sample, BoxError> {
    let t = Instant::now();
    let mut children = Vec::new();
    for shard in 0..shards {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_settlementd"));
        for (key, _) in std::env::vars() {
            if key.starts_with("SETTLEMENTD__") || key == "DATABASE_URL" || key == "RUST_LOG" {
                cmd.env_remove(key);
            }
        }
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
        "N" => "per-row prepared UPDATE, pipelined 500 per transaction (the seed)",
        "S1" => "settlementd run, 1 shard (process)",
        "S2" => "settlementd run, 2 shards in parallel (processes)",
        "S3" => "settlementd run, 3 shards in parallel (processes)",
        "R-after-run" => "settlementd run --force of the settled month, right after S1",
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
            let rerun = case.starts_with('R');
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

fn print_table(rows: &[Row], loans: i64, expected: u64, batches: &[Option<u32>]) {
    println!();
    println!(
        "{loans} loans, {expected} settled per case, batch.size {}, medians of each case's repetitions",
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

fn write_results(
    rows: &[Row],
    loans: i64,
    expected: u64,
    batches: &[Option<u32>],
    sizes: &[(String, String)],
    version: &str,
) -> Result<(), BoxError> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("bench-results");
    std::fs::create_dir_all(&dir)?;
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
    let base = dir.join(format!("settle-{loans}"));
    std::fs::write(base.with_extension("csv"), csv)?;
    let json = serde_json::json!({
        "postgres": version,
        "cluster": "temporary embedded: fsync=off, synchronous_commit=off, full_page_writes=off",
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
