//! Issue 48: on a read-only server — a streaming standby, where an operator looks during an
//! incident, or a primary with `default_transaction_read_only` — the commands that only read
//! (`status`, `verify`, `jobs`, `schedule`, `run --dry-run`, `correct --dry-run`) answer as on the
//! primary, and those that write (`run`, `correct`, `migrate`, `pause`, `resume`, `prune`,
//! `seed`) refuse in one line, exit 1; and `serve` says once that the server became read-only and
//! once that it takes writes again, where sqlx logged every connection it turned away.
//!
//! The database made read-only for new sessions (`ALTER DATABASE … SET`) runs in `cargo test`;
//! the real standby (`pg_basebackup -R`, as `failover.rs` makes it) in the ignored suite.

use crate::failover::set_read_only;
use crate::helpers::*;
use std::time::{Duration, Instant};

const MONTH: &str = "2026-10-31";

/// What the pool says once a read-only server turns its connections away.
const READ_ONLY: &str =
    "is read-only (a standby, or default_transaction_read_only): settlementd writes nothing through it";

/// An acquire timeout longer than any answer below may take: a writer that waited for the pool
/// to give up, as before issue 48, would take this long.
const ACQUIRE: (&str, &str) = ("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "10");

/// The commands that only read, with their exit code: `verify` says 6, the money right and a row
/// held ([`settled_month`]).
const READERS: &[(&[&str], i32)] = &[
    (&["status", "--business-date", MONTH, "--json"], 0),
    (&["verify", "--business-date", MONTH, "--json"], 6),
    (&["jobs", "--json"], 0),
    (&["run", "--dry-run", "--business-date", MONTH, "--json"], 0),
    (
        &["correct", "--dry-run", "--business-date", MONTH, "--json"],
        0,
    ),
    (&["schedule", "--next", "2", "--json"], 0),
];

/// The commands that write.
const WRITERS: &[&[&str]] = &[
    &["run", "--business-date", MONTH],
    &["run", "--business-date", MONTH, "--force"],
    &[
        "correct",
        "--business-date",
        MONTH,
        "--reason",
        "a standby",
        "--key",
        "INC-1",
    ],
    &["migrate"],
    &["pause", "--reason", "an incident"],
    &["resume"],
    &["prune", "--older-than", "400"],
    &["seed", "--loans", "10", "--month", "2026-10"],
];

/// What a reading command's JSON must say alike on the writer and on the read-only server: all of
/// it, but for what moves with the clock (heartbeat ages, the next fire).
fn steady(args: &[&str], out: &std::process::Output) -> Vec<serde_json::Value> {
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{args:?}: {e}: {l}")))
        .collect();
    lines
        .into_iter()
        .map(|json| match args[0] {
            "status" => serde_json::json!([
                json["closed"],
                json["verdict"],
                json["totals"],
                json["runs"]
                    .as_array()
                    .map(|r| r.iter().map(|r| r["status"].clone()).collect::<Vec<_>>())
            ]),
            "jobs" => serde_json::json!([json["name"], json["last_closed"], json["paused"]]),
            "schedule" => serde_json::json!(json["business_date"]),
            _ => json,
        })
        .collect()
}

/// The reading commands' answers on `url` (the writer), to compare.
fn answers(url: &str) -> Vec<Vec<serde_json::Value>> {
    READERS
        .iter()
        .map(|(args, code)| {
            let out = cli(url, &[ACQUIRE], args);
            assert_eq!(
                out.status.code(),
                Some(*code),
                "{args:?}: {}",
                stderr_of(&out)
            );
            steady(args, &out)
        })
        .collect()
}

/// On `url`, a read-only server: every reading command answers as `on_writer` says, writing
/// nothing on stderr; every writing command refuses in one line, exit 1, at once.
fn read_only_answers(url: &str, on_writer: &[Vec<serde_json::Value>]) {
    for ((args, code), expected) in READERS.iter().zip(on_writer) {
        let out = output_within(
            settlementd(Some(url)).env(ACQUIRE.0, ACQUIRE.1).args(*args),
            Duration::from_secs(60),
        );
        let stderr = stderr_of(&out);
        assert_eq!(out.status.code(), Some(*code), "{args:?}: {stderr}");
        if *code == 0 {
            assert_eq!(stderr, "", "{args:?} said something on stderr");
        } else {
            assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        }
        assert_eq!(&steady(args, &out), expected, "{args:?}");
    }
    for args in WRITERS {
        let started = Instant::now();
        let out = output_within(
            settlementd(Some(url)).env(ACQUIRE.0, ACQUIRE.1).args(*args),
            Duration::from_secs(60),
        );
        let took = started.elapsed();
        let stderr = stderr_of(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "{args:?} says it in one line:\n{stderr}"
        );
        assert!(
            stderr.starts_with("settlementd: the database at ") && stderr.contains(READ_ONLY),
            "{args:?}: {stderr}"
        );
        assert!(
            took < Duration::from_secs(5),
            "{args:?} waited {took:?}, as for the pool's acquire timeout"
        );
    }
}

/// A month settled with one held row (no due date), so `verify` has something to say.
async fn settled_month(pool: &sqlx::PgPool, url: &str) {
    seed_month(pool, bd(MONTH), 300, 1).await;
    sqlx::query("ALTER TABLE loans ALTER COLUMN due_on DROP NOT NULL")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("UPDATE loans SET due_on = NULL WHERE id = 7")
        .execute(pool)
        .await
        .unwrap();
    run_ok(settlementd(Some(url)).args(["run", "--business-date", MONTH]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_that_only_read_answer_from_a_read_only_database_and_those_that_write_refuse_in_one_line(
) {
    let db = test_db().await;
    settled_month(&db.pool, &db.url).await;
    let on_writer = answers(&db.url);
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM job_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();

    set_read_only(&db.pool, &db.name, true).await;
    read_only_answers(&db.url, &on_writer);

    set_read_only(&db.pool, &db.name, false).await;
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM job_events")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(before, after, "nothing was written");
    // Writable again, the writers work.
    run_ok(settlementd(Some(&db.url)).args(["pause", "--reason", "over"]));
    run_ok(settlementd(Some(&db.url)).args(["resume"]));
}

/// The JSON log lines of `log` whose message contains `needle`.
fn lines_with(log: &std::path::Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_says_once_that_the_database_became_read_only_and_once_that_it_takes_writes_again() {
    let db = test_db().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("replica.log");
    let replica = ServeProcess::start_logged(
        &db.url,
        &[
            ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "1"),
            ("SETTLEMENTD__RETRY__INITIAL_SECS", "1"),
            ("SETTLEMENTD__RETRY__MAX_SECS", "1"),
        ],
        &log,
    );
    replica.wait_for("/readyz", 200).await;

    // Read-only while it serves: its sessions end, as a failover ends them, and every new one is
    // read-only. Ticks, probes and scrapes go on meanwhile, each trying the pool.
    set_read_only(&db.pool, &db.name, true).await;
    // Twice, 300 ms apart: a session still starting up when the first call looked (no
    // application_name yet, so not matched) read the database's settings before it became
    // read-only, and would survive, writable, to be seen once more between two read-only ones; by
    // the second call it has its name. In CI that said "became
    // read-only" twice, 37 ms apart: the server was read-only, writable, then read-only again.
    for _ in 0..2 {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
              WHERE datname = current_database()
                AND application_name IN ('settlementd', 'settlementd-status')",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let read_only_since = Instant::now();
    while read_only_since.elapsed() < Duration::from_secs(6) {
        let _ = get(replica.addr, "/readyz").await;
        let _ = get(replica.addr, "/metrics").await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let answer = get(replica.addr, "/readyz").await.unwrap();
    assert_eq!(answer.0, 503, "{answer:?}");
    assert!(answer.1.contains(READ_ONLY), "{answer:?}");
    // The page says so first (issue 48 item 5: every /readyz 503 while the Fleet showed each
    // replica ready); its own Fleet row too, which `status::the_page_says_the_serving_replicas_*`
    // checks where no session is ended under it.
    let page = get(replica.addr, "/status").await.unwrap();
    let own = page
        .1
        .split_once("This replica is NOT READY: ")
        .map(|(_, said)| said.split('<').next().unwrap_or_default())
        .unwrap_or_else(|| {
            panic!(
                "the page does not say this replica is not ready:\n{}",
                page.1
            )
        });
    assert!(own.contains(READ_ONLY), "{own}");

    set_read_only(&db.pool, &db.name, false).await;
    replica.wait_for("/readyz", 200).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let hooks = lines_with(&log, "after_connect");
    assert!(hooks.is_empty(), "sqlx's line per connection: {hooks:#?}");
    let became = lines_with(&log, "the database became read-only");
    assert_eq!(became.len(), 1, "{became:#?}");
    let again = lines_with(&log, "the database takes writes again");
    assert_eq!(again.len(), 1, "{again:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs a primary and a streaming standby; run by .ci/run"]
async fn commands_that_only_read_answer_from_a_streaming_standby_and_those_that_write_refuse_in_one_line(
) {
    let primary = PrivateCluster::start().await;
    let pool = primary.pool().await;
    settled_month(&pool, &primary.url).await;
    let on_primary = answers(&primary.url);

    let standby = {
        let pg = &primary.pg;
        tokio::task::block_in_place(|| pg.start_standby()).expect("a streaming standby")
    };
    let standby_url = standby.url("settle");
    let standby_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&standby_url)
        .await
        .unwrap();
    assert!(sqlx::query_scalar::<_, bool>("SELECT pg_is_in_recovery()")
        .fetch_one(&standby_pool)
        .await
        .unwrap());
    // The standby has replayed everything the primary wrote.
    let wrote: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        eventually(30, || async {
            sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                .bind(&wrote)
                .fetch_one(&standby_pool)
                .await
                .unwrap()
        })
        .await,
        "the standby did not catch up"
    );

    read_only_answers(&standby_url, &on_primary);
}
