//! A fleet inside the server's connection budget (issue 25): a server full at start is waited
//! for, not exited on, and its reason is shown; more replicas than the server can hold at full
//! pool settle every shard; idle replicas keep no connection unused past a heartbeat but their
//! LISTEN connection, so `status` still connects afterwards. Real processes against a real server with `max_connections = 20`.

use crate::helpers::*;
use crate::roles::{apply_roles_sql, as_role};
use sqlx::{Connection, PgConnection, PgPool};
use std::time::{Duration, Instant};

/// Replicas in the fleet, one shard each: at full pool (5), plus LISTEN and the status page's
/// two, they would want 80 connections; the server has 17 for them.
const REPLICAS: u32 = 10;
/// How long the whole fleet may take to settle its month once the server has room.
const SETTLED_WITHIN: Duration = Duration::from_secs(120);

/// Sessions of `role` on the server, by application name.
async fn sessions_of(admin: &PgPool, role: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT application_name FROM pg_stat_activity
          WHERE usename = $1 AND backend_type = 'client backend' ORDER BY 1",
    )
    .bind(role)
    .fetch_all(admin)
    .await
    .unwrap()
}

async fn shards_done(admin: &PgPool, month: settlementd::calendar::BusinessDate) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM job_runs WHERE business_date = $1 AND shards = $2 AND status = 'SUCCESS'",
    )
    .bind(month.date())
    .bind(REPLICAS as i32)
    .fetch_one(admin)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_larger_than_the_servers_connections_settles_every_shard_and_leaves_room_for_status(
) {
    let cluster = PrivateCluster::start_with(&[("max_connections", "20")]).await;
    apply_roles_sql(&cluster.url).await;
    // The superuser's pool, opened first (it may also use the reserved slots).
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .min_connections(2)
        .connect(&cluster.url)
        .await
        .unwrap();
    let month = due_month();
    seed_month_alone(&admin, month, 12_000, 1).await;
    let app = as_role(&cluster.url, "settlementd_app");
    let dir = tempfile::Builder::new()
        .prefix("settlementd-fleet-")
        .tempdir()
        .unwrap();
    let dir_path = dir.path().to_path_buf();
    if std::env::var_os("SETTLEMENTD_KEEP_FLEET_LOGS").is_some() {
        std::mem::forget(dir);
    }
    let dir = &dir_path;
    let env = |shard: u32| {
        vec![
            ("SETTLEMENTD__SHARD__INDEX", shard.to_string()),
            ("SETTLEMENTD__SHARD__COUNT", REPLICAS.to_string()),
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false".into()),
            ("SETTLEMENTD__BATCH__SIZE", "200".into()),
            ("SETTLEMENTD__LEASE__TTL_SECS", "6".into()),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "2".into()),
            ("SETTLEMENTD__RETRY__INITIAL_SECS", "1".into()),
            ("SETTLEMENTD__RETRY__MAX_SECS", "4".into()),
        ]
    };
    let start = |shard: u32| {
        let env = env(shard);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        ServeProcess::start_logged(&app, &env, &dir.join(format!("replica-{shard}.log")))
    };

    // The server full: every connection the runtime role may have is taken (the superuser's two
    // count too).
    let ordinary: i32 = sqlx::query_scalar(
        "SELECT current_setting('max_connections')::int
              - current_setting('superuser_reserved_connections')::int
              - coalesce(current_setting('reserved_connections', true)::int, 0)
              - (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')::int",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    let mut hogs = Vec::new();
    for _ in 0..ordinary {
        hogs.push(PgConnection::connect(&app).await.unwrap());
    }
    // `status` says why it cannot connect, in the server's words, and exits 1 (transient).
    let out = settlementd(Some(&app))
        .args(["status", "--json"])
        .env("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("remaining connection slots are reserved"),
        "{stderr}"
    );
    // serve started on the full server stays up, not ready, saying why, and retries.
    let mut replicas = vec![start(0)];
    replicas[0].wait_for("/healthz", 200).await;
    let log0 = dir.join("replica-0.log");
    assert!(
        eventually(30, || async {
            std::fs::read_to_string(&log0)
                .unwrap_or_default()
                .contains("remaining connection slots are reserved")
        })
        .await,
        "serve did not say why it cannot connect"
    );
    let (ready, _) = get(replicas[0].addr, "/readyz").await.unwrap();
    assert_eq!(ready, 503);
    assert!(
        replicas[0].child.try_wait().unwrap().is_none(),
        "serve exited on a full server"
    );

    // Room again: the rest of the fleet starts at once, and every shard settles.
    drop(hogs);
    let started = Instant::now();
    for shard in 1..REPLICAS {
        replicas.push(start(shard));
    }
    let mut most = 0;
    while shards_done(&admin, month).await < REPLICAS as i64 {
        most = most.max(sessions_of(&admin, "settlementd_app").await.len());
        assert!(
            started.elapsed() < SETTLED_WITHIN,
            "{} of {REPLICAS} shards settled after {:?}",
            shards_done(&admin, month).await,
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled_in = started.elapsed();
    assert_eq!(settled_count(&admin).await, eligible(&admin, month).await);
    for (shard, replica) in replicas.iter_mut().enumerate() {
        assert!(
            replica.child.try_wait().unwrap().is_none(),
            "replica {shard} exited"
        );
    }

    // Idle, each replica keeps only its LISTEN connection: a pooled one closes after a quarter of
    // a heartbeat unused (0.5 s), and a tick or a probe opens one for a moment. From 3 s after the
    // fleet settled (the runs' connections closed by then), the connections left unused from
    // 2 s before a 6-s window to its end — over four heartbeats, sixteen times the pool's timeout
    // — are at most one per replica, its LISTEN. A pool that kept what its run opened (issue 25)
    // leaves every replica's unused connections there for good. Not sampled through the window:
    // on a loaded machine (the whole suite, 10 replicas ticking two jobs every 2 s on 2 cores) a
    // pool's reaper may close a connection a few seconds late (CI saw 11 for a moment), which is
    // not a connection kept.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let window_from: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(&admin)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let idle = sqlx::query_scalar::<_, String>(
        "SELECT application_name FROM pg_stat_activity
          WHERE usename = 'settlementd_app' AND backend_type = 'client backend'
            AND state = 'idle' AND state_change < $1 - interval '2 seconds'",
    )
    .bind(window_from)
    .fetch_all(&admin)
    .await
    .unwrap();
    assert!(
        idle.len() <= REPLICAS as usize,
        "idle replicas kept {} connections unused through the window: {idle:?}",
        idle.len()
    );
    // And `status` connects: within 30 s, not the default 5, in one of three tries. The seven
    // slots beside the LISTEN connections are the ticks' and probes' (each held for a moment, as
    // checked above), and ten debug-built replicas ticking two jobs on 2 cores, beside the rest of
    // the suite, can keep them all in use for long: in two runs (one of this test alone) `status`
    // found no slot within 5 s, in one of the whole suite none within 30 s, and in another it took
    // 40 s. A fleet that kept its connections would refuse all three.
    let mut tries = 0;
    let out = loop {
        tries += 1;
        let out = settlementd(Some(&app))
            .args(["status", "--json", "--shards", &REPLICAS.to_string()])
            .env("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "30")
            .output()
            .unwrap();
        if out.status.code() == Some(0) || tries == 3 {
            break out;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = status["runs"].as_array().unwrap();
    assert_eq!(runs.len(), REPLICAS as usize);
    assert!(runs.iter().all(|r| r["status"] == "SUCCESS"), "{status}");
    let mut failures = 0;
    for shard in 0..REPLICAS {
        let log = std::fs::read_to_string(dir.join(format!("replica-{shard}.log"))).unwrap();
        failures += log.lines().filter(|l| l.contains("\"WARN\"")).count();
    }
    println!(
        "fleet of {REPLICAS} replicas on the {ordinary} connections left to them: settled in {settled_in:?}, at most {most} \
         connections at once, {} kept idle, status in {tries} tries ({} warnings logged)",
        idle.len(),
        failures
    );
}
