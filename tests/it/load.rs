//! Load: 1,000,000 loans, eight `serve` replicas over four shards (two per shard) started
//! together, and a manual `run --force` of shard 0 colliding with them. Every shard must end
//! SUCCESS and the loans table equal to one clean run. Prints the figures docs/RELIABILITY.md
//! records: wall time, each process's peak RSS, connections used, fencing rejections.
//!
//! `cargo test --release --test it -- --ignored --nocapture load::` (`.ci/run` runs it in the
//! ignored suite). `SETTLEMENTD_LOAD_LOANS` changes the size.

use crate::helpers::*;
use sqlx::PgPool;
use std::process::Stdio;
use std::time::{Duration, Instant};

const SHARDS: u32 = 4;
const REPLICAS_PER_SHARD: u32 = 2;

/// md5 over every loan's `(id, fine_cents, settled)`, in id order: the table as settlement left it.
async fn table_digest(pool: &PgPool) -> (i64, String) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE fine_settled_at IS NOT NULL),
                md5(string_agg(id::text || ':' || fine_cents::text || ':'
                               || (fine_settled_at IS NOT NULL)::text, ',' ORDER BY id))
           FROM loans",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn successes(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM job_runs WHERE status = 'SUCCESS' AND shards = $1")
        .bind(SHARDS as i32)
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// `settlementd run --force --json` of shard 0 of the month.
fn forced_run(url: &str, month: settlementd::calendar::BusinessDate) -> std::process::Command {
    let mut cmd = settlementd(Some(url));
    cmd.args([
        "run",
        "--business-date",
        &month.to_string(),
        "--shard",
        "0",
        "--shards",
        &SHARDS.to_string(),
        "--force",
        "--json",
    ]);
    cmd
}

/// Peak resident set size of a running process, from /proc (kB).
fn vm_hwm_kb(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Waits for a child and returns its exit code and peak RSS (kB) from wait4's rusage.
fn wait_with_peak_rss(child: std::process::Child) -> (Option<i32>, u64) {
    let mut status = 0;
    // SAFETY: a zeroed rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child's pid with valid pointers; it is reaped exactly once here.
    let pid = unsafe { libc::wait4(child.id() as libc::pid_t, &mut status, 0, &mut usage) };
    assert_eq!(pid, child.id() as libc::pid_t);
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    (code, usage.ru_maxrss as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "load test, a few minutes: run with --ignored"]
async fn load_eight_replicas_over_four_shards_and_a_forced_run_settle_a_million_loans_once() {
    let loans: u64 = std::env::var("SETTLEMENTD_LOAD_LOANS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1_000_000);
    let month = due_month();
    let month_arg = month.first_day().format("%Y-%m").to_string();

    let template = test_db().await;
    run_ok(settlementd(Some(&template.url)).args([
        "seed",
        "--loans",
        &loans.to_string(),
        "--month",
        &month_arg,
        "--seed",
        "9",
    ]));
    sqlx::query("ANALYZE loans")
        .execute(&template.pool)
        .await
        .unwrap();
    let in_month = eligible(&template.pool, month).await;
    settlementd::db::close(&template.pool).await;
    let (db, clean) = (
        clone_of(&template.name).await,
        clone_of(&template.name).await,
    );

    // One clean run: each shard once, one after the other.
    let started = Instant::now();
    for shard in 0..SHARDS {
        run_ok(settlementd(Some(&clean.url)).args([
            "run",
            "--business-date",
            &month.to_string(),
            "--shard",
            &shard.to_string(),
            "--shards",
            &SHARDS.to_string(),
        ]));
    }
    let clean_wall = started.elapsed();
    let expected = table_digest(&clean.pool).await;
    assert_eq!(expected.0, in_month);

    // Eight replicas and a forced run, all at once.
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let replicas: Vec<(u32, ServeProcess)> = (0..SHARDS * REPLICAS_PER_SHARD)
        .map(|i| {
            let shard = i % SHARDS;
            let index = shard.to_string();
            let count = SHARDS.to_string();
            let serve = ServeProcess::start_logged(
                &db.url,
                &[
                    ("SETTLEMENTD__SHARD__INDEX", index.as_str()),
                    ("SETTLEMENTD__SHARD__COUNT", count.as_str()),
                ],
                &dir.path().join(format!("replica-{i}.log")),
            );
            (shard, serve)
        })
        .collect();
    let forced = forced_run(&db.url, month)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();

    let mut peak_connections = 0i64;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let connections: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = $1 AND application_name = 'settlementd'",
        )
        .bind(&db.name)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        peak_connections = peak_connections.max(connections);
        if successes(&db.pool).await == SHARDS as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every shard SUCCESS in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wall = started.elapsed();
    let forced_stdout = {
        let mut out = String::new();
        use std::io::Read;
        let mut forced = forced;
        forced
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        let (code, rss) = wait_with_peak_rss(forced);
        assert_eq!(code, Some(0), "{out}");
        (out, rss)
    };

    // A forced re-run of the settled shard 0 while its replicas watch: a new attempt that reads
    // nothing and changes nothing.
    let again = run_ok(&mut forced_run(&db.url, month));
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(again["skipped"], false, "{again}");
    assert_eq!(again["updated"], 0, "{again}");
    assert_eq!(successes(&db.pool).await, SHARDS as i64);

    let mut rows = Vec::new();
    let mut fencing = 0.0;
    for (i, (shard, serve)) in replicas.iter().enumerate() {
        serve.wait_for("/readyz", 200).await;
        let rejected = serve.metric("settlementd_fencing_rejections_total").await;
        let settled = serve.metric("settlementd_rows_updated_total").await;
        fencing += rejected;
        rows.push(format!(
            "| replica {i} | {shard} | {:.1} MiB | {settled} | {rejected} |",
            vm_hwm_kb(serve.child.id()) as f64 / 1024.0
        ));
    }
    for (_, serve) in &replicas {
        serve.signal(libc::SIGTERM);
    }
    for (i, (_, mut serve)) in replicas.into_iter().enumerate() {
        let status = serve.child.wait().unwrap();
        let log = std::fs::read_to_string(dir.path().join(format!("replica-{i}.log"))).unwrap();
        assert_eq!(status.code(), Some(0), "{log}");
        assert!(!log.contains("panicked"), "{log}");
    }
    assert_eq!(table_digest(&db.pool).await, expected);
    let attempts: Vec<(i32, i32, String)> = sqlx::query_as(
        "SELECT shard, attempt, owner FROM job_runs WHERE shards = $1 ORDER BY shard",
    )
    .bind(SHARDS as i32)
    .fetch_all(&db.pool)
    .await
    .unwrap();

    eprintln!(
        "load: {loans} loans, {in_month} returned in {month} (settled by each shard of {SHARDS})"
    );
    eprintln!(
        "load: one clean run (4 shards one after the other): {:.1} s",
        clean_wall.as_secs_f64()
    );
    eprintln!(
        "load: 8 replicas + run --force, start to every shard SUCCESS: {:.1} s; peak connections {peak_connections}; fencing rejections {fencing}",
        wall.as_secs_f64()
    );
    eprintln!("| process | shard | peak RSS | rows settled | fencing rejections |");
    eprintln!("|---|---:|---:|---:|---:|");
    for row in rows {
        eprintln!("{row}");
    }
    eprintln!(
        "| run --force | 0 | {:.1} MiB | {} | — |",
        forced_stdout.1 as f64 / 1024.0,
        forced_stdout.0.trim()
    );
    eprintln!("| run --force, after SUCCESS | 0 | — | {again} | — |");
    eprintln!("load: job_runs (shard, attempt, owner): {attempts:?}");
    for db in [db, clean] {
        drop_db(db).await;
    }
}
