//! `serve` and `schedule`: the replica's tick against real PostgreSQL with a manual clock, the
//! serve loop with its HTTP endpoints, and the binary's exit codes.

use crate::helpers::*;
use chrono::{DateTime, Utc};
use settlementd::calendar::BusinessDate;
use settlementd::clock::{ManualClock, SystemClock};
use settlementd::config::{Settings, ShardSpec};
use settlementd::daemon::replica::{Replica, TickOutcome};
use settlementd::daemon::{self, http};
use settlementd::job_layer::{self, claim, ClaimOutcome, JobKey, Owner};
use settlementd::jobs::fine_settlement;
use settlementd::schedule::{latest_slot_at_or_before, Slot};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn replica(pool: &PgPool, s: &Settings, clock: &ManualClock) -> Replica {
    Replica::new(
        pool.clone(),
        s,
        Arc::new(clock.clone()),
        CancellationToken::new(),
    )
}

fn key_of(month: &str, s: &Settings) -> JobKey {
    fine_settlement::key(bd(month), s.shard)
}

/// (business date, status, attempt, last_error) of every settlement row, by date.
async fn runs(pool: &PgPool) -> Vec<(String, String, i32, Option<String>)> {
    sqlx::query_as(
        "SELECT business_date::text, status, attempt, last_error FROM job_runs
          WHERE job_name = $1 ORDER BY business_date, shard",
    )
    .bind(fine_settlement::JOB_NAME)
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn settled_in(pool: &PgPool, month: &str) -> i64 {
    fine_settlement::month_totals(pool, bd(month))
        .await
        .unwrap()
        .settled_rows
}

/// Every eligible loan of each month is settled.
async fn assert_fully_settled(pool: &PgPool, months: &[&str]) {
    for month in months {
        assert_eq!(
            settled_in(pool, month).await,
            eligible(pool, bd(month)).await,
            "{month}"
        );
    }
}

fn settled(outcome: TickOutcome) -> (Slot, job_layer::RunReport) {
    match outcome {
        TickOutcome::Settled { slot, report } => (slot, report),
        other => panic!("expected the tick to settle a month, got {other:?}"),
    }
}

#[tokio::test]
async fn a_year_of_monthly_ticks_gives_twelve_runs_with_the_right_business_dates() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-02-28"), 300, 1).await;
    seed_month_alone(&db.pool, bd("2027-11-30"), 300, 10_000).await;
    let s = settings(&[("SCHEDULE__CATCH_UP", "false")]);
    // Start just before the first fire of 2027 (02:30 on the 1st, Shanghai).
    let clock = ManualClock::new(shanghai(2027, 1, 1, 2, 29, 59));
    let mut r = replica(&db.pool, &s, &clock);
    assert!(matches!(r.tick().await, TickOutcome::Idle));

    let mut dates = Vec::new();
    for month in 1..=12 {
        clock.set(shanghai(2027, month, 1, 2, 30, 1));
        let (slot, report) = settled(r.tick().await);
        assert_eq!(report.attempt, Some(1));
        dates.push(slot.business_date.to_string());
        // Later wake-ups within the same month change nothing.
        assert!(matches!(r.tick().await, TickOutcome::AlreadyDone { .. }));
        clock.advance(chrono::TimeDelta::days(20));
        assert!(matches!(r.tick().await, TickOutcome::AlreadyDone { .. }));
    }
    let expected: Vec<String> = [
        "2026-12-31",
        "2027-01-31",
        "2027-02-28",
        "2027-03-31",
        "2027-04-30",
        "2027-05-31",
        "2027-06-30",
        "2027-07-31",
        "2027-08-31",
        "2027-09-30",
        "2027-10-31",
        "2027-11-30",
    ]
    .map(String::from)
    .to_vec();
    assert_eq!(dates, expected);
    let rows = runs(&db.pool).await;
    assert_eq!(rows.len(), 12);
    assert!(
        rows.iter().all(|r| r.1 == "SUCCESS" && r.2 == 1),
        "{rows:?}"
    );
    assert_eq!(
        rows.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
        expected
    );
    assert_fully_settled(&db.pool, &["2027-02-28", "2027-11-30"]).await;
}

#[tokio::test]
async fn a_fire_missed_while_down_is_caught_up_at_start_up() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-02-28"), 200, 1).await;
    // The replica was down over 2027-03-01 02:30 and starts four days later.
    let clock = ManualClock::new(shanghai(2027, 3, 5, 9, 0, 0));

    let mut no_catch_up = replica(
        &db.pool,
        &settings(&[("SCHEDULE__CATCH_UP", "false")]),
        &clock,
    );
    assert!(matches!(no_catch_up.tick().await, TickOutcome::Idle));
    assert!(runs(&db.pool).await.is_empty());

    let mut r = replica(&db.pool, &settings(&[]), &clock);
    let (slot, _) = settled(r.tick().await);
    assert_eq!(slot.business_date, bd("2027-02-28"));
    assert_eq!(
        slot.fire_at.to_rfc3339(),
        "2027-03-01T02:30:00+08:00",
        "the business date comes from the slot, not from when the run starts"
    );
    assert_eq!(
        settled_in(&db.pool, "2027-02-28").await,
        eligible(&db.pool, bd("2027-02-28")).await
    );
}

#[tokio::test]
async fn a_pod_restarted_a_minute_before_the_fire_settles_the_previous_month_first() {
    let db = test_db().await;
    let clock = ManualClock::new(shanghai(2027, 3, 1, 2, 29, 0));
    let mut r = replica(&db.pool, &settings(&[]), &clock);
    let (slot, _) = settled(r.tick().await);
    assert_eq!(slot.business_date, bd("2027-01-31"));
    clock.set(shanghai(2027, 3, 1, 2, 30, 0));
    let (slot, _) = settled(r.tick().await);
    assert_eq!(slot.business_date, bd("2027-02-28"));
}

/// Makes the first `n` UPDATE statements on loans fail (a sequence is not rolled back with them).
async fn fail_first_updates(pool: &PgPool, n: i64) {
    for sql in [
        "CREATE SEQUENCE injected_failures".to_string(),
        format!(
            "CREATE FUNCTION fail_first() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               IF nextval('injected_failures') <= {n} THEN
                 RAISE EXCEPTION 'injected failure';
               END IF;
               RETURN NULL;
             END $$"
        ),
        "CREATE TRIGGER fail_first BEFORE UPDATE ON loans
           FOR EACH STATEMENT EXECUTE FUNCTION fail_first()"
            .to_string(),
    ] {
        sqlx::query(&sql).execute(pool).await.unwrap();
    }
}

#[tokio::test]
async fn a_failed_run_is_retried_with_growing_backoff_until_success() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-02-28"), 200, 1).await;
    fail_first_updates(&db.pool, 2).await;
    let s = settings(&[("RETRY__INITIAL_SECS", "8"), ("RETRY__MAX_SECS", "300")]);
    let clock = ManualClock::new(shanghai(2027, 3, 1, 2, 30, 5));
    let mut r = replica(&db.pool, &s, &clock);

    let first = match r.tick().await {
        TickOutcome::RetryScheduled {
            failures: 1,
            after,
            error,
            ..
        } => {
            assert!(error.contains("injected failure"), "{error}");
            after
        }
        other => panic!("expected a retry, got {other:?}"),
    };
    assert!((4.0..=8.0).contains(&first.as_secs_f64()), "{first:?}");
    let rows = runs(&db.pool).await;
    assert_eq!(rows[0].1, "FAILED");
    assert!(rows[0]
        .3
        .as_deref()
        .unwrap_or("")
        .contains("injected failure"));

    // Not before the backoff has passed on the replica's clock.
    clock.advance(
        chrono::TimeDelta::from_std(first).unwrap() - chrono::TimeDelta::milliseconds(100),
    );
    assert!(matches!(r.tick().await, TickOutcome::BackingOff { .. }));
    assert!(r.next_wake() <= Duration::from_millis(150));
    clock.advance(chrono::TimeDelta::milliseconds(100));

    let second = match r.tick().await {
        TickOutcome::RetryScheduled {
            failures: 2, after, ..
        } => after,
        other => panic!("expected a second retry, got {other:?}"),
    };
    assert!((8.0..=16.0).contains(&second.as_secs_f64()), "{second:?}");
    clock.advance(chrono::TimeDelta::from_std(second).unwrap());

    let (_, report) = settled(r.tick().await);
    assert_eq!(report.attempt, Some(3));
    assert!(report.took_over);
    assert_eq!(runs(&db.pool).await[0].1, "SUCCESS");
    assert_eq!(
        settled_in(&db.pool, "2027-02-28").await,
        eligible(&db.pool, bd("2027-02-28")).await
    );
}

#[tokio::test]
async fn a_second_replica_waits_for_a_live_claim_then_takes_over_once_its_heartbeat_is_stale() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-02-28"), 200, 1).await;
    let s = settings(&[]);
    // The first replica claimed the month and then hung: its lease is live but not renewed.
    let mut conn = db.pool.acquire().await.unwrap();
    let first = claim::claim(
        &mut conn,
        &key_of("2027-02-28", &s),
        &Owner("replica-0-hung".into()),
        Duration::from_secs(s.lease.ttl_secs),
        false,
    )
    .await
    .unwrap();
    assert!(matches!(first, claim::ClaimOutcome::Won(_)));
    drop(conn);

    let clock = ManualClock::new(shanghai(2027, 3, 1, 2, 30, 0));
    let mut second = replica(&db.pool, &s, &clock);
    for _ in 0..3 {
        assert!(matches!(second.tick().await, TickOutcome::Watching { .. }));
        // It keeps watching about once per heartbeat.
        assert!(second.next_wake() <= Duration::from_secs(s.lease.heartbeat_secs));
    }
    assert_eq!(settled_in(&db.pool, "2027-02-28").await, 0);

    age_heartbeat(
        &db.pool,
        bd("2027-02-28"),
        1,
        0,
        s.lease.ttl_secs as i64 + 1,
    )
    .await;
    let (_, report) = settled(second.tick().await);
    assert!(report.took_over);
    assert_eq!(report.attempt, Some(2));
    let owner: String = sqlx::query_scalar("SELECT owner FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(owner, second.owner().0);
    // Once SUCCESS it stops: further ticks run nothing.
    assert!(matches!(
        second.tick().await,
        TickOutcome::AlreadyDone { .. }
    ));
    assert_eq!(runs(&db.pool).await[0].2, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_mid_run_leaves_a_failed_row_a_peer_takes_over_at_once_with_the_same_loans_as_one_clean_run(
) {
    let month = bd("2027-02-28");
    let (db, clean) = (test_db().await, test_db().await);
    seed_month_alone(&db.pool, month, 600, 1).await;
    seed_month_alone(&clean.pool, month, 600, 1).await;
    // Slow every batch down so the shutdown lands mid-run.
    for sql in [
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(0.03); RETURN NULL; END $$",
        "CREATE TRIGGER slow BEFORE UPDATE ON loans FOR EACH STATEMENT EXECUTE FUNCTION slow()",
    ] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let s = settings(&[("BATCH__SIZE", "10")]);
    let clock = ManualClock::new(shanghai(2027, 3, 1, 2, 30, 0));

    let stop = CancellationToken::new();
    let mut first = Replica::new(db.pool.clone(), &s, Arc::new(clock.clone()), stop.clone());
    let run = tokio::spawn(async move { first.tick().await });
    // Wait for committed progress, then send the "SIGTERM".
    let mut scanned = 0i64;
    for _ in 0..200 {
        scanned = sqlx::query_scalar("SELECT COALESCE(max(scanned), 0) FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if scanned > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(scanned > 0, "the run never committed a batch");
    stop.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("the run stops soon after shutdown")
        .unwrap();
    assert!(
        matches!(outcome, TickOutcome::Interrupted { .. }),
        "{outcome:?}"
    );
    let (status, err, scanned): (String, Option<String>, i64) =
        sqlx::query_as("SELECT status, last_error, scanned FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "FAILED");
    assert_eq!(err.as_deref(), Some("interrupted: shutdown"));
    let total: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE returned_on BETWEEN '2027-02-01' AND '2027-02-28'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        scanned > 0 && scanned < total,
        "interrupted mid-run: {scanned}/{total}"
    );

    // A peer takes over at once: no heartbeat aging, no waiting for the lease.
    sqlx::query("DROP TRIGGER slow ON loans")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut peer = replica(&db.pool, &s, &clock);
    let (_, report) = settled(peer.tick().await);
    assert!(report.took_over);
    assert_eq!(report.attempt, Some(2));

    let mut single = replica(&clean.pool, &s, &clock);
    settled(single.tick().await);
    let fines = |rows: Vec<(i64, i64, Option<DateTime<Utc>>)>| {
        rows.into_iter()
            .map(|(id, cents, at)| (id, cents, at.is_some()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        fines(loans_snapshot(&db.pool).await),
        fines(loans_snapshot(&clean.pool).await)
    );
    assert_eq!(
        fine_settlement::month_totals(&db.pool, month)
            .await
            .unwrap(),
        fine_settlement::month_totals(&clean.pool, month)
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn shutdown_requested_before_a_tick_claims_nothing() {
    let db = test_db().await;
    let stop = CancellationToken::new();
    stop.cancel();
    let clock = ManualClock::new(shanghai(2027, 3, 2, 0, 0, 0));
    let mut r = Replica::new(db.pool.clone(), &settings(&[]), Arc::new(clock), stop);
    assert!(matches!(r.tick().await, TickOutcome::ShuttingDown));
    assert!(runs(&db.pool).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_catches_up_at_start_up_answers_probes_and_exits_cleanly_on_shutdown() {
    let db = test_db().await;
    let s = settings(&[("SHUTDOWN__GRACE_SECS", "5")]);
    // What is due right now on the real clock: serve must settle it without any cron fire.
    let due = Slot::new(
        latest_slot_at_or_before(&settlement_cron(&s), s.schedule.timezone, Utc::now()).unwrap(),
    );
    seed_month_alone(&db.pool, due.business_date, 200, 1).await;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(daemon::serve(
        s,
        db.pool.clone(),
        listener,
        Arc::new(SystemClock),
        stop.clone(),
    ));

    assert_eq!(
        wait_for_success(&db.pool, due.business_date).await,
        "SUCCESS"
    );
    assert_eq!(
        settled_in(&db.pool, &due.business_date.to_string()).await,
        eligible(&db.pool, due.business_date).await
    );

    assert_eq!(get(addr, "/healthz").await.unwrap().0, 200);
    assert_eq!(get(addr, "/readyz").await.unwrap().0, 200);
    let (code, body) = get(addr, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    for needle in [
        "settlementd_runs_total{job_name=\"fine-settlement\",outcome=\"settled\"}",
        "settlementd_runs_total{job_name=\"fine-settlement\",outcome=\"lease_lost\"}",
        "settlementd_run_duration_seconds_bucket",
        "settlementd_last_success_timestamp_seconds",
        "settlementd_next_fire_timestamp_seconds",
        "settlementd_last_run_lateness_seconds",
        "settlementd_claims_total{job_name=\"fine-settlement\",result=\"won\"}",
        "settlementd_takeovers_total",
        "settlementd_fencing_rejections_total",
        "settlementd_rows_scanned_total",
        "settlementd_rows_updated_total",
    ] {
        assert!(body.contains(needle), "/metrics lacks {needle}:\n{body}");
    }
    let settled_count: f64 = body
        .lines()
        .find(|l| {
            l.starts_with(
                "settlementd_runs_total{job_name=\"fine-settlement\",outcome=\"settled\"}",
            )
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(settled_count >= 1.0);

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(7), server)
        .await
        .expect("serve returns within shutdown.grace_secs")
        .unwrap()
        .expect("a graceful shutdown is a success");
    assert!(
        get(addr, "/healthz").await.is_err(),
        "the listener is closed"
    );
}

#[tokio::test]
async fn readyz_is_503_until_the_schema_is_migrated() {
    let (_name, url) = empty_db().await;
    let pool = PgPool::connect(&url).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(http::run(
        listener,
        http_state(&pool, Settings::load_from(None, []).unwrap()),
        stop.clone().cancelled_owned(),
    ));
    assert_eq!(get(addr, "/healthz").await.unwrap().0, 200);
    let (code, body) = get(addr, "/readyz").await.unwrap();
    assert_eq!(code, 503, "{body}");
    settlementd::db::migrate(&pool).await.unwrap();
    assert_eq!(get(addr, "/readyz").await.unwrap().0, 200);
    stop.cancel();
    server.await.unwrap().unwrap();
}

/// An address nothing listens on: reaching it would fail with exit 1, not 2.
const UNREACHABLE: &str = "postgres://u@127.0.0.1:1/x";

fn exit_and_stderr(cmd: &mut std::process::Command) -> (i32, String) {
    let out = cmd.output().expect("run settlementd");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn serve_rejects_invalid_configuration_with_exit_2_before_touching_the_database() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (
            &[("SETTLEMENTD__SCHEDULE__TIMEZONE", "Mars/Olympus")],
            "schedule.timezone",
        ),
        (
            &[("SETTLEMENTD__SCHEDULE__CRON", "0 30 2 1 *")],
            "schedule.cron",
        ),
        (
            &[
                ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "10"),
                ("SETTLEMENTD__LEASE__TTL_SECS", "29"),
            ],
            "lease.ttl_secs",
        ),
        (
            &[
                ("SETTLEMENTD__SHARD__INDEX", "3"),
                ("SETTLEMENTD__SHARD__COUNT", "3"),
            ],
            "shard.index",
        ),
    ];
    for (env, needle) in cases {
        let mut cmd = settlementd(Some(UNREACHABLE));
        cmd.arg("serve").envs(env.iter().copied());
        let (code, stderr) = exit_and_stderr(&mut cmd);
        assert_eq!(code, 2, "{env:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{env:?}: {stderr}");
        assert!(stderr.contains(needle), "{env:?}: {stderr}");
        assert!(!stderr.contains("connect"), "{env:?}: {stderr}");
    }
    // The same database with a valid configuration is tried, and is a failure to wait out: serve
    // stays up, not ready, saying why; so the exit 2 above came from validation, before any
    // connection.
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut replica = ServeProcess::start_logged(
        UNREACHABLE,
        &[("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "1")],
        log.path(),
    );
    let said = || std::fs::read_to_string(log.path()).unwrap_or_default();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !said().contains("cannot connect to the database") {
        assert!(std::time::Instant::now() < deadline, "{}", said());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(replica.child.try_wait().unwrap().is_none(), "{}", said());
}

/// A port another process holds is a mistake of the configuration: `serve` exits 2 at once with
/// one line naming the address and the key, before it looks at the database (reachable or not),
/// so systemd does not restart it for ever (`RestartPreventExitStatus=2`).
#[tokio::test]
async fn serve_on_a_port_already_taken_exits_2_with_one_line_naming_the_address() {
    let db = test_db().await;
    let addr = free_loopback_addr();
    let _holder = std::net::TcpListener::bind(addr).unwrap();
    for url in [db.url.as_str(), UNREACHABLE] {
        let mut cmd = settlementd(Some(url));
        cmd.arg("serve")
            .env("SETTLEMENTD__HTTP__LISTEN", addr.to_string())
            .env("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "1");
        let out = output_within(&mut cmd, Duration::from_secs(30));
        let stderr = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert_eq!(stderr.trim_end().lines().count(), 1, "{url}: {stderr}");
        assert!(
            stderr.contains(&addr.to_string()) && stderr.contains("http.listen"),
            "{url}: {stderr}"
        );
        assert!(stderr.contains("already listens"), "{url}: {stderr}");
    }
    drop_db(db).await;
}

/// `serve --embedded-db` on a data directory another server runs on (a second settlementd with the
/// same `database.embedded_dir`) is a mistake of the configuration too: exit 2 (`is_config`), one
/// line naming the directory, not exit 1 and a restart for ever.
#[tokio::test]
async fn an_embedded_data_directory_another_server_runs_on_is_a_configuration_error() {
    use settlementd::embedded_pg::{EmbeddedOptions, EmbeddedPg};
    let running = PrivateCluster::start().await;
    let dir = running.pg.data_dir().to_path_buf();
    let options = EmbeddedOptions {
        data_dir: Some(dir.clone()),
        bindir: None,
    };
    let second = tokio::task::spawn_blocking(move || EmbeddedPg::start(options))
        .await
        .unwrap();
    let error = second.err().expect("a second server on a directory in use");
    let line = error.to_string();
    assert!(error.is_config(), "{line}");
    assert!(
        line.contains("in use by another running server")
            && line.contains(&dir.display().to_string())
            && !line.contains('\n'),
        "{line}"
    );
    let settlementd::app::AppError::Invalid(_) = settlementd::app::AppError::from(error) else {
        panic!("not exit 2: {line}");
    };
}

#[test]
fn serve_without_a_database_is_a_configuration_error() {
    let (code, stderr) = exit_and_stderr(settlementd(None).arg("serve"));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no database configured"), "{stderr}");
}

#[test]
fn schedule_prints_the_next_fire_times_with_their_business_dates_as_json_lines() {
    let out = settlementd(None)
        .args(["schedule", "--next", "3", "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    let mut previous: Option<DateTime<chrono::FixedOffset>> = None;
    for line in &lines {
        let fire_at = line["fire_at"].as_str().unwrap();
        assert!(fire_at.ends_with("T02:30:00+08:00"), "{fire_at}");
        let parsed = DateTime::parse_from_rfc3339(fire_at).unwrap();
        assert!(parsed > Utc::now());
        let business = BusinessDate::parse(line["business_date"].as_str().unwrap()).unwrap();
        assert_eq!(business, BusinessDate::for_instant(&parsed));
        if let Some(p) = previous {
            assert!(parsed > p);
        }
        previous = Some(parsed);
    }
}

#[test]
fn schedule_uses_the_configured_zone_and_needs_no_database() {
    let out = settlementd(Some(UNREACHABLE))
        .args(["schedule", "--next", "12"])
        .env("SETTLEMENTD__SCHEDULE__TIMEZONE", "America/New_York")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 12);
    // A year of New York fires shows both offsets, each still at 02:30 local time.
    assert!(text.contains("T02:30:00-05:00"), "{text}");
    assert!(text.contains("T02:30:00-04:00"), "{text}");
}

#[test]
fn schedule_rejects_an_invalid_zone_or_cron_with_exit_2_and_one_line() {
    for (key, value) in [
        ("SETTLEMENTD__SCHEDULE__TIMEZONE", "Mars/Olympus"),
        ("SETTLEMENTD__SCHEDULE__CRON", "61 * * * * *"),
        ("SETTLEMENTD__SCHEDULE__CRON", "0 30 2 1 *"),
    ] {
        let (code, stderr) = exit_and_stderr(settlementd(None).arg("schedule").env(key, value));
        assert_eq!(code, 2, "{key}={value}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    }
}

#[tokio::test]
async fn shard_keys_follow_the_configured_shard() {
    // The replica settles only its own shard: shard 1 of 2 leaves shard 0's rows alone.
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-02-28"), 200, 1).await;
    let s = settings(&[("SHARD__INDEX", "1"), ("SHARD__COUNT", "2")]);
    assert_eq!(s.shard, ShardSpec { index: 1, count: 2 });
    let clock = ManualClock::new(shanghai(2027, 3, 1, 3, 0, 0));
    settled(replica(&db.pool, &s, &clock).tick().await);
    let (odd_unsettled, even_settled): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE id % 2 = 1 AND fine_settled_at IS NULL),
                count(*) FILTER (WHERE id % 2 = 0 AND fine_settled_at IS NOT NULL)
           FROM loans WHERE returned_on BETWEEN '2027-02-01' AND '2027-02-28'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((odd_unsettled, even_settled), (0, 0));
    assert_eq!(runs(&db.pool).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_settles_the_due_month_logs_json_with_run_fields_and_exits_0_on_sigterm() {
    let db = test_db().await;
    let s = settings(&[]);
    let due = Slot::new(
        latest_slot_at_or_before(&settlement_cron(&s), s.schedule.timezone, Utc::now()).unwrap(),
    );
    seed_month_alone(&db.pool, due.business_date, 100, 1).await;
    let child = settlementd(Some(&db.url))
        .arg("serve")
        .env("SETTLEMENTD__HTTP__LISTEN", "127.0.0.1:0")
        .env("SETTLEMENTD__LOG__FORMAT", "json")
        .env("SETTLEMENTD__SHUTDOWN__GRACE_SECS", "5")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    assert_eq!(
        wait_for_success(&db.pool, due.business_date).await,
        "SUCCESS"
    );
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0);
    let started = std::time::Instant::now();
    let exit = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(6));
    let stderr = String::from_utf8_lossy(&exit.stderr);
    assert_eq!(exit.status.code(), Some(0), "{stderr}");
    let success: serde_json::Value = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "SUCCESS")
        .unwrap_or_else(|| panic!("no SUCCESS log line in:\n{stderr}"));
    let span = &success["span"];
    assert_eq!(span["business_date"], due.business_date.to_string());
    assert_eq!(span["job"], fine_settlement::JOB_NAME);
    for field in ["shard", "shards", "attempt", "owner"] {
        assert!(!span[field].is_null(), "{field} missing in {success}");
    }
    // The replica's own line about the month has the run's span too (issue 48: "month run to
    // SUCCESS" had no `business_date` in its span, so a filter on the span missed it).
    let settled: serde_json::Value = stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["message"] == "month run to SUCCESS")
        .unwrap_or_else(|| panic!("no 'month run to SUCCESS' line in:\n{stderr}"));
    assert_eq!(
        settled["span"]["business_date"],
        due.business_date.to_string(),
        "{settled}"
    );
    assert_eq!(settled["span"]["attempt"], span["attempt"], "{settled}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_exits_within_the_grace_period_even_when_a_batch_does_not_stop() {
    let db = test_db().await;
    let s = settings(&[("SHUTDOWN__GRACE_SECS", "1")]);
    let due = Slot::new(
        latest_slot_at_or_before(&settlement_cron(&s), s.schedule.timezone, Utc::now()).unwrap(),
    );
    seed_month_alone(&db.pool, due.business_date, 50, 1).await;
    // A batch that would take a minute: shutdown cannot wait for it.
    for sql in [
        "CREATE FUNCTION stuck() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(60); RETURN NULL; END $$",
        "CREATE TRIGGER stuck BEFORE UPDATE ON loans FOR EACH STATEMENT EXECUTE FUNCTION stuck()",
    ] {
        sqlx::query(sql).execute(&db.pool).await.unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(daemon::serve(
        s,
        db.pool.clone(),
        listener,
        Arc::new(SystemClock),
        stop.clone(),
    ));
    // Wait until the run's first batch is inside the stuck trigger.
    let mut stuck = false;
    for _ in 0..400 {
        stuck = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE query LIKE '%UPDATE loans%' AND wait_event = 'PgSleep')",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if stuck {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(stuck, "the run's batch never started");
    let started = std::time::Instant::now();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(4), server)
        .await
        .expect("serve returns soon after shutdown.grace_secs")
        .unwrap()
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(900));
    // The batch never committed; the claim is left to expire (RUNNING, nothing settled).
    assert_eq!(runs(&db.pool).await[0].1, "RUNNING");
    assert_eq!(
        settled_in(&db.pool, &due.business_date.to_string()).await,
        0
    );
}

#[tokio::test]
async fn a_month_still_failed_when_the_next_fire_arrives_is_settled_before_the_new_one() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-02-28"), 200, 1).await;
    seed_month_alone(&db.pool, bd("2027-03-31"), 200, 1_000).await;
    let s = settings(&[]);
    // February's run was claimed in March and left FAILED (say, retries ran out with the pod).
    let feb = key_of("2027-02-28", &s);
    let mut conn = db.pool.acquire().await.unwrap();
    let ClaimOutcome::Won(c) = claim::claim(
        &mut conn,
        &feb,
        &Owner("old-pod".into()),
        Duration::from_secs(60),
        false,
    )
    .await
    .unwrap() else {
        panic!("claim February")
    };
    assert!(claim::mark_failed(
        &mut db.pool.acquire().await.unwrap(),
        &c,
        "database restarted"
    )
    .await
    .unwrap());
    drop(conn);

    let clock = ManualClock::new(shanghai(2027, 4, 1, 2, 30, 5));
    let mut r = replica(&db.pool, &s, &clock);
    let (first, _) = settled(r.tick().await);
    assert_eq!(
        first.business_date,
        bd("2027-02-28"),
        "the older month first"
    );
    assert_eq!(
        first.fire_at.with_timezone(&Utc),
        shanghai(2027, 3, 1, 2, 30, 0)
    );
    let (second, _) = settled(r.tick().await);
    assert_eq!(second.business_date, bd("2027-03-31"));
    assert!(matches!(r.tick().await, TickOutcome::AlreadyDone { .. }));
    assert_fully_settled(&db.pool, &["2027-02-28", "2027-03-31"]).await;
}

#[tokio::test]
async fn months_missed_by_an_outage_over_several_fires_are_settled_oldest_first() {
    let db = test_db().await;
    for (i, month) in ["2027-01-31", "2027-02-28", "2027-03-31", "2027-04-30"]
        .iter()
        .enumerate()
    {
        seed_month_alone(&db.pool, bd(month), 100, 1 + 1_000 * i as i64).await;
    }
    let s = settings(&[]);
    let clock = ManualClock::new(shanghai(2027, 2, 1, 2, 30, 1));
    let (jan, _) = settled(replica(&db.pool, &s, &clock).tick().await);
    assert_eq!(jan.business_date, bd("2027-01-31"));

    // Down from February to May: three fires missed.
    clock.set(shanghai(2027, 5, 2, 8, 0, 0));
    let mut r = replica(&db.pool, &s, &clock);
    let mut order = Vec::new();
    for _ in 0..3 {
        order.push(settled(r.tick().await).0.business_date.to_string());
    }
    assert_eq!(order, ["2027-02-28", "2027-03-31", "2027-04-30"]);
    assert!(matches!(r.tick().await, TickOutcome::AlreadyDone { .. }));
}

#[tokio::test]
async fn a_month_nobody_claimed_is_settled_when_its_returns_wait_inside_the_lookback_and_left_alone_beyond_it(
) {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2027-03-31"), 100, 1).await;
    seed_month_alone(&db.pool, bd("2027-04-30"), 100, 1_000).await;
    let clock = ManualClock::new(shanghai(2027, 5, 1, 2, 30, 1));
    // A lookback of one month: only April is looked at; March waits, beyond it.
    let mut short = replica(
        &db.pool,
        &settings(&[("SETTLE__LOOKBACK_MONTHS", "1")]),
        &clock,
    );
    let (slot, _) = settled(short.tick().await);
    assert_eq!(slot.business_date, bd("2027-04-30"));
    assert!(matches!(
        short.tick().await,
        TickOutcome::AlreadyDone { .. }
    ));
    assert_eq!(settled_in(&db.pool, "2027-03-31").await, 0);

    // The default lookback covers March: its waiting returns make it due, though no replica ever
    // claimed it; then nothing is left.
    let mut r = replica(&db.pool, &settings(&[]), &clock);
    let (slot, report) = settled(r.tick().await);
    assert_eq!(slot.business_date, bd("2027-03-31"));
    assert_eq!(report.attempt, Some(1));
    assert!(matches!(r.tick().await, TickOutcome::AlreadyDone { .. }));
    assert_fully_settled(&db.pool, &["2027-03-31", "2027-04-30"]).await;
}

/// Readiness waits for every job's first look at what is due, and ticks run one job's month at a
/// time: before, a replica whose settlement had a long run due stayed "starting" (its second job
/// not looked at) until that run ended, and a rollout waited for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_ready_while_its_first_run_is_in_flight() {
    let db = test_db().await;
    let month = due_month();
    seed_month_alone(&db.pool, month, 200, 1).await;
    slow_updates(&db.pool, 0.05).await;
    let replica = ServeProcess::start(&db.url, &[("SETTLEMENTD__BATCH__SIZE", "5")]);
    let status = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT status FROM job_runs WHERE job_name = 'fine-settlement'",
        )
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    };
    assert!(
        eventually(20, || async {
            status().await.as_deref() == Some("RUNNING")
        })
        .await,
        "the month's run starts"
    );
    let (code, body) = get(replica.addr, "/readyz").await.unwrap();
    assert_eq!((code, body.as_str()), (200, "ready\n"));
    assert_eq!(
        status().await.as_deref(),
        Some("RUNNING"),
        "asked while the run was in flight"
    );
}

/// Before, `/metrics` declared the fine settlement's families for every job
/// (`settlementd_held_rows{job_name="member-statements"}`, its late returns, its rule conflicts,
/// `outcome="settled"`), and member statements' `settlementd_months_not_closed` stayed 0 for a
/// month the settlement had not closed while `status` and the page said "not closed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_job_shows_only_its_own_metrics_and_a_follower_counts_the_months_its_upstream_has_not_closed(
) {
    let db = test_db().await;
    seed_month_alone(&db.pool, due_month(), 20, 1).await;
    // The settlement's month is claimed and fails, again and again: not closed.
    fail_first_updates(&db.pool, 1_000_000).await;
    let replica = ServeProcess::start(&db.url, &[]);
    let statements = "member-statements";
    assert!(
        eventually(30, || async {
            replica.metric("settlementd_months_not_closed").await >= 1.0
        })
        .await,
        "the failing settlement's month is not closed"
    );
    assert!(
        eventually(30, || async {
            replica
                .metric_of("settlementd_months_not_closed", statements)
                .await
                >= 1.0
        })
        .await,
        "member statements count the month the settlement has not closed"
    );
    let (_, body) = get(replica.addr, "/metrics").await.unwrap();
    for family in [
        "settlementd_held_rows",
        "settlementd_late_returns_settled_total",
        "settlementd_rule_conflicts_total",
        "settlementd_unsettled_in_closed_months",
        "settlementd_unsettled_beyond_lookback",
    ] {
        let of = |job: &str| format!("{family}{{job_name=\"{job}\"}}");
        assert!(
            body.contains(&of(fine_settlement::JOB_NAME)),
            "{family}:\n{body}"
        );
        assert!(!body.contains(&of(statements)), "{family}:\n{body}");
    }
    let runs = |job: &str, outcome: &str| {
        format!("settlementd_runs_total{{job_name=\"{job}\",outcome=\"{outcome}\"}}")
    };
    assert!(
        body.contains(&runs(fine_settlement::JOB_NAME, "settled")),
        "{body}"
    );
    assert!(
        body.contains(&runs(fine_settlement::JOB_NAME, "rule_conflict")),
        "{body}"
    );
    assert!(body.contains(&runs(statements, "succeeded")), "{body}");
    assert!(!body.contains(&runs(statements, "settled")), "{body}");
    assert!(!body.contains(&runs(statements, "rule_conflict")), "{body}");
    let help = body
        .lines()
        .find(|l| l.starts_with("# HELP settlementd_rows_updated_total"))
        .unwrap_or_default();
    assert!(
        help.contains("fine-settlement: loans") && help.contains("member-statements: members"),
        "{help}"
    );
}

/// The sum of the series of `name` on `body` whose labels contain every one of `labels`.
fn series(body: &str, name: &str, labels: &[&str]) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The fleet seen from `/metrics`: two replicas of shard 0 of 2 and none of shard 1, whose month
/// is left RUNNING under a lease nobody renews. Each replica reports the shard with two owners and
/// the one with none, the expired lease, the month past its deadline (day 1 of the next month) on
/// the replica with that deadline and not on the one whose deadline is day 28 of a month after
/// the next, the fine cents its runs settled for the month (both together: the month's shard 0
/// fines on the table), the pool and the process.
#[tokio::test]
async fn the_fleet_on_metrics_shows_a_shard_owned_twice_one_owned_by_none_its_expired_lease_the_deadline_and_the_cents_settled(
) {
    let db = test_db().await;
    let month = due_month();
    seed_month_alone(&db.pool, month, 40, 1).await;
    sqlx::query(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at)
         VALUES ($1, $2, 2, 1, 'RUNNING', 1, 'gone', now() - interval '1 hour',
                 now() - interval '1 hour')",
    )
    .bind(fine_settlement::JOB_NAME)
    .bind(month.date())
    .execute(&db.pool)
    .await
    .unwrap();
    let common = [
        ("SETTLEMENTD__SHARD__INDEX", "0"),
        ("SETTLEMENTD__SHARD__COUNT", "2"),
        ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
        ("SETTLEMENTD__LEASE__TTL_SECS", "5"),
    ];
    let with = |day: &'static str| {
        let mut env = common.to_vec();
        env.push(("SETTLEMENTD__SETTLE__DEADLINE_DAY", day));
        env
    };
    let early = ServeProcess::start(&db.url, &with("1"));
    let late = ServeProcess::start(&db.url, &with("28"));
    let settled = sqlx::query_scalar::<_, i64>(
        "SELECT coalesce(sum(fine_cents), 0)::bigint FROM loans
          WHERE id % 2 = 0 AND returned_on >= $1 AND returned_on <= $2",
    )
    .bind(month.first_day())
    .bind(month.date());
    let shard0_done = || async {
        let rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM job_runs
              WHERE job_name = $1 AND shards = 2 AND shard = 0 AND status = 'SUCCESS'",
        )
        .bind(fine_settlement::JOB_NAME)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        rows == 1
    };
    assert!(eventually(30, shard0_done).await, "shard 0 is settled");
    let cents = settled.fetch_one(&db.pool).await.unwrap();
    assert!(cents > 0, "the month's shard 0 has fines to count");
    let body_of = |replica: &ServeProcess| {
        let addr = replica.addr;
        async move { get(addr, "/metrics").await.unwrap().1 }
    };
    for (replica, past) in [(&early, 1.0), (&late, 0.0)] {
        let seen = eventually(30, || async {
            let body = body_of(replica).await;
            series(&body, "settlementd_shard_owners", &["shard=\"0\""]) == 2.0
                && series(&body, "settlementd_shards_by_owners", &["owners=\"0\""]) == 1.0
                && series(&body, "settlementd_shards_by_owners", &["owners=\"2+\""]) == 1.0
                && series(&body, "settlementd_shards_by_owners", &["owners=\"1\""]) == 0.0
                && series(&body, "settlementd_expired_leases", &["fine-settlement"]) == 1.0
                && series(
                    &body,
                    "settlementd_months_past_deadline",
                    &["fine-settlement"],
                ) == past
        })
        .await;
        let body = body_of(replica).await;
        assert!(seen, "the fleet's gauges (deadline past: {past}):\n{body}");
        assert_eq!(
            series(&body, "settlementd_db_pool_max_connections", &[]),
            5.0,
            "{body}"
        );
        assert!(
            series(
                &body,
                "settlementd_db_pool_connections",
                &["state=\"idle\""]
            ) >= 0.0
                && body.contains("settlementd_db_pool_connections{state=\"in_use\"}"),
            "{body}"
        );
        assert!(
            series(&body, "process_resident_memory_bytes", &[]) > 0.0,
            "{body}"
        );
        assert!(series(&body, "process_open_fds", &[]) > 0.0, "{body}");
    }
    let deadline =
        settlementd::daemon::replica::deadline(month.date(), 1, chrono_tz::Asia::Shanghai).unwrap();
    let body = body_of(&early).await;
    assert_eq!(
        series(
            &body,
            "settlementd_deadline_timestamp_seconds",
            &["fine-settlement"]
        ),
        deadline.timestamp() as f64,
        "{body}"
    );
    let month_label = format!("business_date=\"{}\"", month.date());
    let counted = series(
        &body_of(&early).await,
        "settlementd_fine_cents_settled_total",
        &[&month_label],
    ) + series(
        &body_of(&late).await,
        "settlementd_fine_cents_settled_total",
        &[&month_label],
    );
    assert_eq!(counted, cents as f64, "the cents the two replicas counted");
}

/// The fine settlement, whose batches wait at `gate` until the test lets them through.
struct Gated {
    inner: fine_settlement::FineSettlement,
    gate: Arc<tokio::sync::Semaphore>,
}

impl job_layer::Job for Gated {
    type Plan = fine_settlement::MonthPlan;
    const NAME: &'static str = fine_settlement::JOB_NAME;
    fn params(&self, key: &JobKey) -> Result<job_layer::Params, String> {
        self.inner.params(key)
    }
    async fn plan(
        &self,
        pool: &PgPool,
        claim: &job_layer::Claim,
        estimate: bool,
    ) -> sqlx::Result<(fine_settlement::MonthPlan, Option<u64>)> {
        self.inner.plan(pool, claim, estimate).await
    }
    fn batch_settings(&self) -> std::borrow::Cow<'static, str> {
        self.inner.batch_settings()
    }
    async fn run_batch(
        &self,
        tx: &mut sqlx::PgConnection,
        plan: &fine_settlement::MonthPlan,
        cursor: job_layer::Cursor,
    ) -> sqlx::Result<job_layer::Batch> {
        let _pass = self.gate.acquire().await.expect("the gate stays open");
        self.inner.run_batch(tx, plan, cursor).await
    }
}

/// Issue 48: a replica found a claim left RUNNING by its own process — an attempt whose final
/// write went unanswered, or whose FAILED could not be written — logged "a live peer holds the
/// claim; watching it" and waited a lease. The owner names this process alone, and no run of the
/// key goes on in it: it takes the attempt over at once. A claim of another process of the same
/// host (a restart: another pid or nonce) it cannot know dead, and watches.
#[tokio::test]
async fn a_replica_takes_over_its_own_processs_attempt_that_no_run_carries_on_at_once() {
    let db = test_db().await;
    let month = "2027-02-28";
    seed_month_alone(&db.pool, bd(month), 200, 1).await;
    let s = settings(&[]);
    let clock = ManualClock::new(shanghai(2027, 3, 1, 2, 30, 0));
    let mut replica = replica(&db.pool, &s, &clock);
    let ttl = Duration::from_secs(s.lease.ttl_secs);

    // Another process of this host holds a live lease: watched, never taken.
    let mut conn = db.pool.acquire().await.unwrap();
    let other = Owner::for_process();
    assert_ne!(other, *replica.owner());
    let claimed = claim::claim(&mut conn, &key_of(month, &s), &other, ttl, false)
        .await
        .unwrap();
    assert!(matches!(claimed, ClaimOutcome::Won(_)));
    assert!(matches!(replica.tick().await, TickOutcome::Watching { .. }));
    assert_eq!(settled_in(&db.pool, month).await, 0);

    // This process's own attempt, its lease as live, and nothing of it running here.
    sqlx::query("UPDATE job_runs SET owner = $1, heartbeat_at = clock_timestamp()")
        .bind(&replica.owner().0)
        .execute(&db.pool)
        .await
        .unwrap();
    drop(conn);
    let (_, report) = settled(replica.tick().await);
    assert!(report.took_over);
    assert_eq!(report.attempt, Some(2));
    assert_fully_settled(&db.pool, &[month]).await;
    let event: (String, Option<String>) = sqlx::query_as(
        "SELECT event, message FROM job_events WHERE attempt = 2 ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(event.0, "took_over");
    assert!(
        event
            .1
            .as_deref()
            .unwrap_or_default()
            .contains("attempt 1 was this owner's own"),
        "{event:?}"
    );
}

/// The other side of the takeover above: while a run of the key goes on in this process, a claim
/// under the same owner is that run's, live, and a second run of the key skips it as held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_never_takes_over_its_own_processs_attempt_while_that_run_goes_on() {
    let db = test_db().await;
    let month = bd("2027-02-28");
    seed_month_alone(&db.pool, month, 200, 1).await;
    let key = fine_settlement::key(month, ShardSpec::new(0, 1).unwrap());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let job = Arc::new(Gated {
        inner: fine_settlement::FineSettlement {
            rules: Default::default(),
            batch_size: 50,
            guards: Default::default(),
        },
        gate: gate.clone(),
    });
    let opts = run_options(false, false);
    let first = {
        let (pool, job, key, opts) = (db.pool.clone(), job.clone(), key.clone(), opts.clone());
        tokio::spawn(async move {
            job_layer::run_once(
                &pool,
                job.as_ref(),
                key,
                &opts,
                &CancellationToken::new(),
                &|_| {},
            )
            .await
        })
    };
    assert!(
        eventually(10, || async { !runs(&db.pool).await.is_empty() }).await,
        "the first run claimed"
    );
    let second = job_layer::run_once(
        &db.pool,
        job.as_ref(),
        key.clone(),
        &opts,
        &CancellationToken::new(),
        &|_| {},
    )
    .await
    .unwrap();
    assert_eq!(second.skipped, Some(job_layer::SkipReason::Held));
    gate.add_permits(1000);
    let first = first.await.unwrap().unwrap();
    assert_eq!((first.attempt, first.took_over), (Some(1), false));
    assert_eq!(runs(&db.pool).await[0].2, 1, "one attempt");
    assert_fully_settled(&db.pool, &["2027-02-28"]).await;
}
