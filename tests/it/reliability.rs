//! Nothing stalls, nothing is lost (issue 9): a writer frozen inside its batch transaction, the
//! database stopped hard and restarted, replicas with skewed clocks, odd rows, bad credentials and
//! a database without its schema. What each test proves is in docs/RELIABILITY.md.
//!
//! The fast ones run in `cargo test`; those that freeze, crash or restart real processes and
//! servers are `#[ignore]`d and run by `cargo test --test it -- --ignored` (`.ci/run` does).

use crate::helpers::*;
use crate::journal::assert_settled_once;
use chrono::TimeDelta;
use settlementd::clock::ManualClock;
use settlementd::config::{LeaseSettings, Settings};
use settlementd::daemon::replica::{Replica, TickOutcome};
use settlementd::job_layer::{self, claim, ClaimOutcome, Job, JobError, JobKey, Owner};
use settlementd::jobs::fine_settlement::{self, FineSettlement, MonthPlan};
use sqlx::{Connection, PgConnection, PgPool};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A lease short enough to expire within a test: ttl 3 s, heartbeat 1 s, so the server-side guard
/// ends a session idle in a transaction after 1 s.
const SHORT_LEASE: [(&str, &str); 2] = [
    ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
    ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
];

fn short_lease_job(batch_size: u32) -> FineSettlement {
    FineSettlement {
        rules: Default::default(),
        batch_size,
        guards: LeaseSettings {
            ttl_secs: 3,
            heartbeat_secs: 1,
        }
        .guards(),
    }
}

/// (status, attempt, owner) of the only settlement row.
async fn the_run(pool: &PgPool) -> (String, i32, String) {
    // The settlement's: a `serve` replica also runs the member statements after it.
    sqlx::query_as("SELECT status, attempt, owner FROM job_runs WHERE job_name = $1")
        .bind(fine_settlement::JOB_NAME)
        .fetch_one(pool)
        .await
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Fast: in cargo test.
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_frozen_inside_its_batch_loses_its_session_and_locks_before_its_lease_expires() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 400, 1).await;
    let job = short_lease_job(100);
    let key = fine_settlement::key(month, settlementd::config::ShardSpec::new(0, 1).unwrap());
    let (plan, _) = job.plan(&db.pool, &claim_of(&key), false).await.unwrap();

    // The "frozen" writer: a batch that updated its rows, and then nothing — no commit, no
    // rollback, its connection simply stops talking (what SIGSTOP does to a client).
    let mut frozen = db.pool.begin_with(job.begin_batch()).await.unwrap();
    let batch = job
        .run_batch(&mut frozen, &plan, Cursor::default())
        .await
        .unwrap();
    assert_eq!(batch.updated, 100);
    let locked: i64 = sqlx::query_scalar(
        "SELECT min(id) FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let frozen_since = Instant::now();

    // A peer writing the same row waits for the frozen writer's lock only until the server ends
    // that session: within the guard (1 s for a 3 s lease), before the lease could be taken over.
    tokio::time::timeout(
        Duration::from_secs(10),
        sqlx::query("UPDATE loans SET fine_cents = fine_cents WHERE id = $1")
            .bind(locked)
            .execute(&db.pool),
    )
    .await
    .expect("the frozen writer's lock is still held after 10 s")
    .unwrap();
    let waited = frozen_since.elapsed();
    assert!(
        waited < Duration::from_secs(3),
        "the lock was held {waited:?}, longer than the lease"
    );

    // The frozen writer's work is gone with its session, and it learns so when it wakes up.
    let settled = settled_count(&db.pool).await;
    assert_eq!(settled, 0);
    // Waking up, it finds its session gone: the server's FATAL idle-in-transaction error, or the
    // closed socket it left behind.
    let woke = frozen.commit().await.unwrap_err();
    let said = JobError::Db(woke).to_string();
    assert!(
        said.contains("idle_in_transaction_session_timeout") || said.contains("Broken pipe"),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_connections_stop_answering_fails_within_its_deadline_and_the_retry_finishes_the_month(
) {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 400, 1).await;
    let proxy = FreezingProxy::start(&db.url).await;
    // The pool serve and run use (5 connections, 5 s acquire timeout, idle ones pinged before
    // they are handed out), with this lease's guards.
    let settings = settings(&SHORT_LEASE.map(|(k, v)| (k.trim_start_matches("SETTLEMENTD__"), v)));
    let pool = settlementd::db::pool(
        &proxy.url(),
        &settings.database,
        settings.lease.guards(),
        Duration::from_secs(60),
    )
    .unwrap();
    // Idle connections in the pool when the freeze comes (opened earlier, so frozen too): the
    // pool pings one before handing it out, and that ping never ends. Kept for the whole test
    // (the idle timeout above is 30 s), as a replica's pool may hold them between two runs.
    let warm: Vec<_> = futures_util::future::try_join_all((0..4).map(|_| pool.acquire()))
        .await
        .unwrap();
    drop(warm);
    assert!(eventually(5, || async { pool.num_idle() == 4 }).await);
    let job = short_lease_job(100);
    let key = fine_settlement::key(month, settlementd::config::ShardSpec::new(0, 1).unwrap());
    let opts = job_layer::RunOptions {
        lease_ttl: Duration::from_secs(3),
        heartbeat_every: Duration::from_secs(1),
        ..run_options(false, false)
    };

    // Once the first batch has committed, every connection the run has opened so far (its own,
    // the heartbeat's, the read-ahead's) swallows whatever is sent, as a half-open TCP connection
    // does; connections opened later work. The heartbeat renews the lease on a new connection,
    // so no peer could take the month over: only the run's own deadline can end its wait.
    let frozen_at = std::sync::Mutex::new(None);
    let freeze = |progress: job_layer::Progress| {
        if progress.batches == 1 {
            proxy.freeze_existing();
            *frozen_at.lock().unwrap() = Some(Instant::now());
        }
    };
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        job_layer::run_once(
            &pool,
            &job,
            key.clone(),
            &opts,
            &CancellationToken::new(),
            &freeze,
        ),
    )
    .await
    .expect("after 60 s the run still waits on a connection that stopped answering");
    let ended_after = frozen_at.lock().unwrap().expect("frozen").elapsed();
    let error = ran.expect_err("the run cannot finish on frozen connections");
    // The documented bound: three leases (9 s), plus the FAILED write's own budget of one
    // heartbeat; neither the heartbeat nor the pool's ping of a dead connection may add to it.
    println!("a run on connections that stopped answering ended {ended_after:?} after the freeze");
    assert!(
        ended_after <= Duration::from_secs(3 * 3 + 1),
        "ended {ended_after:?} after its connections stopped answering"
    );
    assert!(
        matches!(error, JobError::Unanswered { waited } if waited == Duration::from_secs(9)),
        "{error}"
    );
    assert!(error.is_retryable());

    // FAILED, on a connection opened after the freeze, saying why; the first batch stays committed.
    let (status, attempt, last_error): (String, i32, String) =
        sqlx::query_as("SELECT status, attempt, last_error FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), attempt), ("FAILED", 1));
    assert!(
        last_error.contains("did not answer within 9s"),
        "{last_error}"
    );
    let settled = settled_count(&db.pool).await;
    assert_eq!(settled, 100);

    // The retry takes the FAILED claim over at once and settles the rest, once.
    let report = job_layer::run_once(
        &db.pool,
        &job,
        key,
        &run_options(false, false),
        &CancellationToken::new(),
        &|_| {},
    )
    .await
    .unwrap();
    assert!(report.took_over);
    let eligible = eligible(&db.pool, month).await;
    assert_eq!(report.updated as i64, eligible - 100);
    let settled = settled_count(&db.pool).await;
    assert_eq!(settled, eligible);
}

#[tokio::test]
async fn leases_live_on_the_database_clock_so_replicas_hours_apart_agree() {
    let db = test_db().await;
    let month = "2027-02-28";
    seed_month_alone(&db.pool, bd(month), 200, 1).await;
    let s = settings(&[]);
    // A replica whose clock runs six hours ahead claims the month and then hangs (no heartbeat).
    let ahead = ManualClock::new(shanghai(2027, 3, 12, 12, 0, 0) + TimeDelta::hours(6));
    let behind = ManualClock::new(shanghai(2027, 3, 12, 12, 0, 0) - TimeDelta::hours(6));
    let mut conn = db.pool.acquire().await.unwrap();
    let key = fine_settlement::key(bd(month), s.shard);
    let ClaimOutcome::Won(_) = claim::claim(
        &mut conn,
        &key,
        &Owner("ahead".into()),
        Duration::from_secs(s.lease.ttl_secs),
        false,
    )
    .await
    .unwrap() else {
        panic!("the first claim wins")
    };
    drop(conn);
    // The heartbeat it wrote is the database's now, not its own clock's.
    let age: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM clock_timestamp() - heartbeat_at)::float8 FROM job_runs",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!((0.0..5.0).contains(&age), "heartbeat age {age}");

    // A replica twelve hours behind it sees a live lease: it watches, it does not take over.
    let mut r = Replica::new(
        db.pool.clone(),
        &s,
        Arc::new(behind.clone()),
        CancellationToken::new(),
    );
    for _ in 0..3 {
        let outcome = r.tick().await;
        assert!(
            matches!(outcome, TickOutcome::Watching { .. }),
            "{outcome:?}"
        );
        behind.advance(TimeDelta::hours(1));
    }
    // Its own clock moving hours on changes nothing; the database's clock passing the lease does.
    age_heartbeat(&db.pool, bd(month), 1, 0, s.lease.ttl_secs as i64 + 1).await;
    match r.tick().await {
        TickOutcome::Settled { report, .. } => {
            assert!(report.took_over);
            assert_eq!(report.attempt, Some(2));
        }
        other => panic!("expected a takeover, got {other:?}"),
    }
    // And the one running ahead agrees the month is done: nothing to run.
    let mut a = Replica::new(
        db.pool.clone(),
        &s,
        Arc::new(ahead),
        CancellationToken::new(),
    );
    assert!(matches!(a.tick().await, TickOutcome::AlreadyDone { .. }));
    assert_eq!(
        fine_settlement::month_totals(&db.pool, bd(month))
            .await
            .unwrap()
            .settled_rows,
        eligible(&db.pool, bd(month)).await
    );
}

#[tokio::test]
async fn odd_rows_are_settled_by_the_rule_counted_and_reported_never_skipped() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 200, 1).await;
    // (id, borrowed, due, returned): contradictory dates (odd), decades apart (not odd), extreme
    // ids, and a loan returned in 9999 (settled only by that month's run).
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on) VALUES
           (9223372036854775807, 1, 1, '2026-10-20', '2026-10-30', '2026-10-05'),
           (-9223372036854775808, 1, 1, '2026-10-20', '2026-09-01', '2026-10-25'),
           (5000001, 1, 1, '1950-01-01', '1950-01-15', '2026-10-31'),
           (5000002, 1, 1, '2026-10-01', '2071-10-01', '2026-10-02'),
           (5000003, 1, 1, '9999-12-01', '9999-12-15', '9999-12-31')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out =
        run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-10-31", "--json"]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let odd: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM loans l WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND {}",
        fine_settlement::ODD_ROW
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(odd >= 2, "{odd}");
    assert_eq!(v["odd_rows"].as_i64(), Some(odd), "{v}");
    assert_eq!(v["updated"].as_i64(), Some(eligible(&db.pool, month).await));
    let fines: Vec<(i64, i64, bool)> = sqlx::query_as(
        "SELECT id, fine_cents, fine_settled_at IS NOT NULL FROM loans
          WHERE id IN (9223372036854775807, -9223372036854775808, 5000001, 5000002, 5000003)
          ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        fines,
        [
            // due 2026-09-01, returned 2026-10-25: 54 days at 50 cents.
            (i64::MIN, 2700, true),
            // 76 years late: the cap.
            (5000001, 10000, true),
            // due 45 years after its return: no fine.
            (5000002, 0, true),
            // December 9999 is not this month.
            (5000003, 0, false),
            // returned before it was due (and before it was borrowed): no fine.
            (i64::MAX, 0, true),
        ]
    );

    // The far-future month settles too, when its own run comes (the job layer has no calendar
    // check; the CLI refuses a month that is not over).
    let report = job_layer::run_once(
        &db.pool,
        &short_lease_job(10),
        fine_settlement::key(
            bd("9999-12-31"),
            settlementd::config::ShardSpec::new(0, 1).unwrap(),
        ),
        &run_options(false, false),
        &CancellationToken::new(),
        &|_| {},
    )
    .await
    .unwrap();
    assert_eq!(
        (
            report.updated,
            report.notes[fine_settlement::ODD_ROWS].count
        ),
        (1, 0)
    );
}

#[tokio::test]
async fn a_wrong_password_is_one_line_and_exit_2_and_the_password_never_shows() {
    let cluster = PrivateCluster::start().await;
    let mut admin = PgConnection::connect(&cluster.url).await.unwrap();
    sqlx::query("CREATE ROLE settler LOGIN PASSWORD 'Right-Secret-1'")
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::raw_sql(
        "GRANT ALL ON ALL TABLES IN SCHEMA public, settlementd TO settler;
         GRANT USAGE ON SCHEMA settlementd TO settler",
    )
    .execute(&mut admin)
    .await
    .unwrap();
    // The cluster trusts local connections; make this role prove its password.
    let hba = cluster.pg.data_dir().join("pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).unwrap();
    std::fs::write(&hba, format!("local all settler scram-sha-256\n{rules}")).unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&mut admin)
        .await
        .unwrap();
    let with_password = |password: &str| {
        cluster
            .url
            .replacen("settlementd@", &format!("settler:{password}@"), 1)
    };

    let secret_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(secret_file.path(), "Wrong-Secret-2\n").unwrap();
    let attempts = [
        settlementd(Some(&with_password("Wrong-Secret-2")))
            .args(["run", "--business-date", "2026-10-31"])
            .env("RUST_LOG", "trace")
            .output()
            .unwrap(),
        settlementd(Some(&with_password("placeholder")))
            .args(["run", "--business-date", "2026-10-31"])
            .env("SETTLEMENTD__DATABASE__PASSWORD_FILE", secret_file.path())
            .output()
            .unwrap(),
        settlementd(Some(&with_password("Wrong-Secret-2")))
            .arg("serve")
            .env("SETTLEMENTD__HTTP__LISTEN", "127.0.0.1:0")
            .output()
            .unwrap(),
    ];
    for out in attempts {
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.contains("refused the credentials"), "{err}");
        assert!(err.contains("password_file"), "{err}");
        assert!(
            !err.contains("Wrong-Secret-2") && !err.contains("placeholder"),
            "{err}"
        );
    }
    // The right password gets in (and settles an empty month).
    run_ok(settlementd(Some(&with_password("Right-Secret-1"))).args([
        "run",
        "--business-date",
        "2026-10-31",
    ]));
}

#[test]
fn secrets_never_appear_in_debug_output_or_errors() {
    let dir = tempfile::tempdir().unwrap();
    let url_file = dir.path().join("url");
    std::fs::write(&url_file, "postgres://u:Url-File-h1dden@h/db\n").unwrap();
    let pw_file = dir.path().join("pw");
    std::fs::write(&pw_file, "Password-File-h1dden\n").unwrap();
    for env in [
        vec![(
            "SETTLEMENTD__DATABASE__URL",
            "postgres://u:Url-h1dden@h/db".to_string(),
        )],
        vec![(
            "SETTLEMENTD__DATABASE__URL_FILE",
            url_file.display().to_string(),
        )],
        vec![
            ("DATABASE_URL", "postgres://u@h/db".to_string()),
            (
                "SETTLEMENTD__DATABASE__PASSWORD_FILE",
                pw_file.display().to_string(),
            ),
        ],
    ] {
        let s =
            Settings::load_from(None, env.iter().map(|(k, v)| (k.to_string(), v.clone()))).unwrap();
        let shown = format!("{s:?} {:?} {:#?}", s.database, s);
        if let Some(at) = shown.find("h1dden") {
            panic!("{}", &shown[at.saturating_sub(80)..at + 20]);
        }
        assert!(s.database_url().unwrap().contains("h1dden"));
    }
    // A URL that does not parse: neither the error nor its Debug form repeat it.
    let bad = "postgres://u:Bad-Url-h1dden@h:notaport/db";
    let err =
        Settings::load_from(None, [("DATABASE_URL".to_string(), bad.to_string())]).unwrap_err();
    assert!(!format!("{err} {err:?}").contains("h1dden"), "{err:?}");
}

#[tokio::test]
async fn a_connection_error_names_the_server_but_never_the_password_even_in_debug_form() {
    let settings = settings(&[("DATABASE__ACQUIRE_TIMEOUT_SECS", "1")]);
    let err = settlementd::db::connect(
        "postgres://u:Conn-Secret@127.0.0.1:1/db",
        &settings.database,
        settings.lease.guards(),
        Duration::from_secs(10),
    )
    .await
    .unwrap_err();
    let shown = format!("{err} {err:?}");
    assert!(shown.contains("127.0.0.1:1"), "{shown}");
    assert!(!shown.contains("Conn-Secret"), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_the_schema_and_migrate_on_start_false_waits_not_ready_with_one_log_line() {
    let (_name, url) = empty_db().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let serve = ServeProcess::start_logged(
        &url,
        &[
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
        ],
        &log,
    );
    serve.wait_for("/healthz", 200).await;
    let body = serve.wait_for("/readyz", 503).await;
    assert!(body.contains("schema"), "{body}");
    // Several checks later: still up, still not ready, said so once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(get(serve.addr, "/readyz").await.unwrap().0, 503);
    let text = std::fs::read_to_string(&log).unwrap();
    let waiting = text
        .lines()
        .filter(|l| l.contains("waiting for `settlementd migrate`"))
        .count();
    assert_eq!(waiting, 1, "{text}");
    assert!(!text.contains("run failed"), "{text}");
    assert!(!text.contains("panicked"), "{text}");

    run_ok(settlementd(Some(&url)).arg("migrate"));
    serve.wait_for("/readyz", 200).await;
    assert!(
        eventually(10, || async {
            std::fs::read_to_string(&log)
                .unwrap()
                .contains("schema is current; starting")
        })
        .await
    );
    let metrics = serve.wait_for("/metrics", 200).await;
    assert!(metrics.contains("settlementd_odd_rows_total"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_whose_migration_waits_behind_a_long_transaction_stays_up_not_ready_and_applies_it_after(
) {
    let (_name, url) = empty_db().await;
    let mut libraryd = loans_held_open(&url).await;

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let serve = ServeProcess::start_logged(
        &url,
        &[
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "true"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
        ],
        &log,
    );
    serve.wait_for("/healthz", 200).await;
    let said = |text: &str| {
        text.lines()
            .filter(|l| l.contains("a migration waits for another session's lock"))
            .count()
    };
    // Two lock waits of 5 s at least: still up, still not ready, said once.
    assert!(
        eventually(30, || async {
            said(&std::fs::read_to_string(&log).unwrap()) == 1
        })
        .await,
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
    tokio::time::sleep(Duration::from_secs(7)).await;
    let (code, body) = get(serve.addr, "/readyz").await.unwrap();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("schema"), "{body}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(said(&text), 1, "{text}");
    assert!(
        text.contains("migration 20261130000002 was not applied"),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");

    // libraryd commits: the next try applies every migration and the replica starts.
    sqlx::query("ROLLBACK")
        .execute(&mut libraryd)
        .await
        .unwrap();
    serve.wait_for("/readyz", 200).await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("migrations checked"), "{text}");
}

/// A superuser's `migrate` gives settlementd's objects to `settlementd_migrator`, one ACCESS
/// EXCLUSIVE lock after another, as the release before keeps working on them (a rolling upgrade).
/// Here a transaction holds one it gives last and then asks for one it has taken: PostgreSQL
/// breaks the deadlock by rolling the hand-over back (its check runs first: the database's
/// `deadlock_timeout` is 2 s, the other session's 60 s), and `migrate` tries it again once that
/// transaction ended, exit 0, everything handed over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_whose_hand_over_a_deadlock_rolled_back_tries_it_again_and_succeeds() {
    let db = test_db().await;
    let owner = |table: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "SELECT pg_get_userbyid(relowner)::text FROM pg_class
                  WHERE oid = to_regclass('settlementd.' || $1)",
            )
            .bind(table)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(owner("job_runs").await, "settlementd_migrator");
    // Two tables a superuser owns again (as after the previous release's migrate): the hand-over
    // gives job_runs, then replicas.
    for sql in [
        "ALTER TABLE settlementd.job_runs OWNER TO CURRENT_USER".to_string(),
        "ALTER TABLE settlementd.replicas OWNER TO CURRENT_USER".to_string(),
        format!("ALTER DATABASE {} SET deadlock_timeout = '2s'", db.name),
    ] {
        sqlx::query(&sql).execute(&db.pool).await.unwrap();
    }
    let mut other = PgConnection::connect(&db.url).await.unwrap();
    for sql in [
        "SET deadlock_timeout = '60s'",
        "BEGIN",
        "LOCK TABLE settlementd.replicas IN ROW EXCLUSIVE MODE",
    ] {
        sqlx::query(sql).execute(&mut other).await.unwrap();
    }

    let migrate = settlementd(Some(&db.url))
        .arg("migrate")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The hand-over holds job_runs and waits for replicas.
    let waiting = || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                             WHERE a.datname = current_database()
                               AND a.application_name = 'settlementd' AND NOT l.granted
                               AND l.relation = 'settlementd.replicas'::regclass)",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    assert!(eventually(30, waiting).await, "the hand-over never waited");
    // Now this transaction asks for job_runs: a deadlock, which PostgreSQL breaks by rolling the
    // hand-over back; this one then has job_runs, and ends.
    sqlx::query("LOCK TABLE settlementd.job_runs IN ACCESS SHARE MODE")
        .execute(&mut other)
        .await
        .unwrap();
    sqlx::query("COMMIT").execute(&mut other).await.unwrap();

    let out = tokio::task::spawn_blocking(move || migrate.wait_with_output().unwrap())
        .await
        .unwrap();
    let stderr = stderr_of(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rolled this step of migrate back; trying it again")
            && stderr.contains("deadlock detected"),
        "{stderr}"
    );
    for table in ["job_runs", "replicas"] {
        assert_eq!(owner(table).await, "settlementd_migrator", "{table}");
    }
    other.close().await.unwrap();
    drop_db(db).await;
}

/// The hand-over behind a long transaction waits 5 s for its lock, not for as long as the
/// transaction lasts (while it waits, every later user of the table queues behind it): exit 1, one
/// line that says what was not done and to run `migrate` again, nothing given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_whose_hand_over_waits_behind_a_long_transaction_gives_up_in_seconds_and_says_so() {
    let db = test_db().await;
    sqlx::query("ALTER TABLE settlementd.replicas OWNER TO CURRENT_USER")
        .execute(&db.pool)
        .await
        .unwrap();
    let mut other = PgConnection::connect(&db.url).await.unwrap();
    for sql in [
        "BEGIN",
        "LOCK TABLE settlementd.replicas IN ROW EXCLUSIVE MODE",
    ] {
        sqlx::query(sql).execute(&mut other).await.unwrap();
    }
    let out = tokio::task::spawn_blocking({
        let url = db.url.clone();
        move || settlementd(Some(&url)).arg("migrate").output().unwrap()
    })
    .await
    .unwrap();
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("settlementd: "))
        .unwrap_or_default();
    assert!(
        line.contains("settlementd's objects were not given to settlementd_migrator")
            && line.contains("waited more than 5 s for a lock")
            && line.contains("Run `settlementd migrate` again"),
        "{stderr}"
    );
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    let owner: String = sqlx::query_scalar(
        "SELECT pg_get_userbyid(relowner)::text FROM pg_class
          WHERE oid = 'settlementd.replicas'::regclass",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_ne!(owner, "settlementd_migrator");
    run_ok(settlementd(Some(&db.url)).arg("migrate"));
    other.close().await.unwrap();
    drop_db(db).await;
}

// ---------------------------------------------------------------------------------------------
// Slow: real processes frozen, servers stopped hard. `cargo test --test it -- --ignored`.
// ---------------------------------------------------------------------------------------------

/// `settlementd <args>` on `url` with a short lease, small batches and its stderr in `log`.
fn spawn_logged(url: &str, args: &[&str], log: &Path) -> Child {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap();
    settlementd(Some(url))
        .args(args)
        .envs(SHORT_LEASE)
        .env("SETTLEMENTD__BATCH__SIZE", "200")
        .env("SETTLEMENTD__LOG__FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .unwrap()
}

/// Backends of settlementd processes on database `db` in `state`, holding a transaction id (so
/// holding the row locks of their writes) when `writing`.
async fn settlementd_backends(pool: &PgPool, db: &str, state: &str, writing: bool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = $1 AND application_name = 'settlementd' AND state = $2
            AND (NOT $3 OR backend_xid IS NOT NULL)",
    )
    .bind(db)
    .bind(state)
    .bind(writing)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Stops `pid` (SIGSTOP) at a moment when its batch transaction is open and has written: its
/// backend `idle in transaction` with a transaction id, holding the batch's row locks. Tries
/// again (SIGCONT, a few ms later) when the stop landed elsewhere; panics if it never lands.
async fn freeze_inside_a_batch(pool: &PgPool, db: &str, pid: u32) {
    for attempt in 0..400 {
        signal_pid(pid, libc::SIGSTOP);
        // Let the server finish a statement the process had already sent.
        tokio::time::sleep(Duration::from_millis(40)).await;
        if settlementd_backends(pool, db, "idle in transaction", true).await == 1 {
            return;
        }
        signal_pid(pid, libc::SIGCONT);
        tokio::time::sleep(Duration::from_millis(1 + attempt % 7)).await;
    }
    panic!("never caught the process inside a batch transaction");
}

async fn wait_for_progress(pool: &PgPool) {
    assert!(
        eventually(30, || async {
            sqlx::query_scalar::<_, i64>("SELECT COALESCE(max(scanned), 0) FROM job_runs")
                .fetch_one(pool)
                .await
                .unwrap()
                > 0
        })
        .await,
        "no batch committed"
    );
}

/// Seconds until the frozen holder's lease is stale on the database clock.
async fn wait_for_stale_lease(pool: &PgPool) {
    assert!(
        eventually(30, || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT bool_and(heartbeat_at < clock_timestamp() - interval '3 seconds') FROM job_runs",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        })
        .await
    );
}

/// Continues and kills a process when dropped, so a failing test leaves no stopped process.
/// Forget it once the process has been waited for.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        signal_pid(self.0, libc::SIGCONT);
        signal_pid(self.0, libc::SIGKILL);
    }
}

fn wait_exit(child: &mut Child, secs: u64) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "freezes real processes: run with --ignored"]
async fn a_run_frozen_inside_its_batch_is_taken_over_within_seconds_and_writes_nothing_when_it_wakes(
) {
    let month = bd("2026-10-31");
    let (chaos, clean) = (test_db().await, test_db().await);
    for db in [&chaos, &clean] {
        seed_month(&db.pool, month, 60_000, 1).await;
    }
    settle_shards(&clean.pool, month, 1, 200).await;
    let dir = tempfile::tempdir().unwrap();
    let args = ["run", "--business-date", "2026-10-31"];

    let mut zombie = spawn_logged(&chaos.url, &args, &dir.path().join("zombie.log"));
    let reaper = KillOnDrop(zombie.id());
    wait_for_progress(&chaos.pool).await;
    freeze_inside_a_batch(&chaos.pool, &chaos.name, zombie.id()).await;
    let frozen_at = Instant::now();

    // The server ends the frozen session (and releases its locks) within the guard.
    assert!(
        eventually(10, || async {
            settlementd_backends(&chaos.pool, &chaos.name, "idle in transaction", false).await == 0
        })
        .await,
        "the frozen session kept its transaction"
    );
    let released_after = frozen_at.elapsed();
    wait_for_stale_lease(&chaos.pool).await;
    let stale_at = Instant::now();

    // The taker: attempt 2, never waiting for the frozen writer's locks.
    let mut taker = spawn_logged(&chaos.url, &args, &dir.path().join("taker.log"));
    let status = wait_exit(&mut taker, 60).expect("the taker finishes");
    assert!(status.success(), "{status:?}");
    let took = stale_at.elapsed();
    assert_eq!(the_run(&chaos.pool).await.0, "SUCCESS");
    assert_eq!(the_run(&chaos.pool).await.1, 2);
    let settled = settled_rows(&chaos.pool).await;

    // The zombie wakes up: it writes nothing and exits 1, saying it lost its lease.
    signal_pid(zombie.id(), libc::SIGCONT);
    let status = wait_exit(&mut zombie, 30).expect("the zombie exits");
    // Reaped: its pid may be reused, so nothing must be sent to it any more.
    std::mem::forget(reaper);
    assert_eq!(status.code(), Some(1));
    let log = std::fs::read_to_string(dir.path().join("zombie.log")).unwrap();
    assert!(log.contains("lease lost"), "{log}");
    assert_eq!(settled_rows(&chaos.pool).await, settled);
    assert_eq!(the_run(&chaos.pool).await.1, 2);
    assert_eq!(settled, settled_rows(&clean.pool).await);
    assert_settled_once(&chaos.pool, &clean.pool).await;
    eprintln!(
        "frozen run: session ended {released_after:?} after the freeze; the taker finished {took:?} after the lease expired"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "freezes real processes: run with --ignored"]
async fn a_serve_replica_frozen_inside_its_batch_is_taken_over_and_goes_back_to_watching() {
    let month = due_month();
    let (chaos, clean) = (test_db().await, test_db().await);
    for db in [&chaos, &clean] {
        // Nothing returned in the months around it: the replica would settle those too.
        seed_month_alone(&db.pool, month, 60_000, 1).await;
    }
    settle_shards(&clean.pool, month, 1, 200).await;
    let dir = tempfile::tempdir().unwrap();
    let (zombie_log, taker_log) = (dir.path().join("zombie.log"), dir.path().join("taker.log"));
    let env = [
        SHORT_LEASE[0],
        SHORT_LEASE[1],
        ("SETTLEMENTD__BATCH__SIZE", "200"),
    ];

    let zombie = ServeProcess::start_logged(&chaos.url, &env, &zombie_log);
    wait_for_progress(&chaos.pool).await;
    freeze_inside_a_batch(&chaos.pool, &chaos.name, zombie.child.id()).await;
    wait_for_stale_lease(&chaos.pool).await;
    let stale_at = Instant::now();
    let taker = ServeProcess::start_logged(&chaos.url, &env, &taker_log);
    assert!(
        eventually(60, || async { the_run(&chaos.pool).await.0 == "SUCCESS" }).await,
        "the taker did not finish"
    );
    let took = stale_at.elapsed();
    let (_, attempt, owner) = the_run(&chaos.pool).await;
    assert_eq!(attempt, 2);
    let settled = settled_rows(&chaos.pool).await;
    assert_eq!(settled, settled_rows(&clean.pool).await);

    zombie.signal(libc::SIGCONT);
    assert!(
        eventually(30, || async {
            std::fs::read_to_string(&zombie_log)
                .unwrap()
                .contains("lost the claim to a peer; watching it")
        })
        .await,
        "{}",
        std::fs::read_to_string(&zombie_log).unwrap()
    );
    // Still serving, nothing written, the taker's row untouched.
    assert_eq!(get(zombie.addr, "/healthz").await.unwrap().0, 200);
    assert!(zombie.metric("settlementd_fencing_rejections_total").await >= 1.0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(settled_rows(&chaos.pool).await, settled);
    assert_eq!(the_run(&chaos.pool).await, ("SUCCESS".into(), 2, owner));
    assert_settled_once(&chaos.pool, &clean.pool).await;
    drop(taker);
    drop(zombie);
    eprintln!("frozen serve replica: the taker finished {took:?} after the lease expired");
}

/// A private cluster with `rows` loans of `month` (and a pool on it), and the same loans in a test
/// database settled cleanly by `shards` shards, to compare with. Nothing is returned in the months
/// around `month`: a `serve` replica would settle those too.
async fn restart_fixture(
    month: settlementd::calendar::BusinessDate,
    rows: i64,
    shards: u32,
) -> (PrivateCluster, PgPool, TestDb) {
    let cluster = PrivateCluster::start().await;
    let pool = cluster.pool().await;
    let clean = test_db().await;
    seed_month_alone(&pool, month, rows, 1).await;
    seed_month_alone(&clean.pool, month, rows, 1).await;
    settle_shards(&clean.pool, month, shards, 200).await;
    (cluster, pool, clean)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "stops a PostgreSQL server hard: run with --ignored"]
async fn three_serve_replicas_ride_out_an_immediate_database_stop_and_end_as_one_clean_run() {
    let month = due_month();
    let (mut cluster, pool, clean) = restart_fixture(month, 30_000, 3).await;
    // Slow batches down so the stop lands mid-run.
    for sql in [
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(0.02); RETURN NULL; END $$",
        "CREATE TRIGGER slow BEFORE UPDATE ON loans FOR EACH STATEMENT EXECUTE FUNCTION slow()",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let replicas: Vec<ServeProcess> = (0..3)
        .map(|shard| {
            let index = shard.to_string();
            ServeProcess::start_logged(
                &cluster.url,
                &[
                    ("SETTLEMENTD__SHARD__INDEX", index.as_str()),
                    ("SETTLEMENTD__SHARD__COUNT", "3"),
                    SHORT_LEASE[0],
                    SHORT_LEASE[1],
                    ("SETTLEMENTD__BATCH__SIZE", "200"),
                    ("SETTLEMENTD__RETRY__INITIAL_SECS", "1"),
                    ("SETTLEMENTD__RETRY__MAX_SECS", "2"),
                    ("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "2"),
                ],
                &dir.path().join(format!("replica-{shard}.log")),
            )
        })
        .collect();
    wait_for_progress(&pool).await;
    pool.close().await;

    cluster.pg.stop_immediately();
    let stopped_at = Instant::now();
    for replica in &replicas {
        let body = replica.wait_for("/readyz", 503).await;
        assert!(body.contains("not ready"), "{body}");
        assert_eq!(get(replica.addr, "/healthz").await.unwrap().0, 200);
    }
    tokio::time::sleep(Duration::from_secs(3).saturating_sub(stopped_at.elapsed())).await;
    cluster.pg.restart().unwrap();

    let pool = cluster.pool().await;
    assert!(
        eventually(90, || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM job_runs WHERE job_name = $1 AND status = 'SUCCESS'",
            )
            .bind(fine_settlement::JOB_NAME)
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
                == 3
        })
        .await,
        "not every shard finished after the restart"
    );
    for replica in &replicas {
        replica.wait_for("/readyz", 200).await;
    }
    assert_eq!(settled_rows(&pool).await, settled_rows(&clean.pool).await);
    assert_settled_once(&pool, &clean.pool).await;
    let attempts: i64 = sqlx::query_scalar("SELECT max(attempt)::bigint FROM job_runs")
        .fetch_one(&pool)
        .await
        .unwrap();
    for mut replica in replicas {
        replica.signal(libc::SIGTERM);
        let status = replica.child.wait().unwrap();
        assert_eq!(status.code(), Some(0));
    }
    for shard in 0..3 {
        let log = std::fs::read_to_string(dir.path().join(format!("replica-{shard}.log"))).unwrap();
        assert!(!log.contains("panicked"), "{log}");
    }
    pool.close().await;
    eprintln!("database stopped hard for 3 s: every shard SUCCESS, highest attempt {attempts}");
}

/// The fine settlement, with the database stopped hard right after the claim, before the first
/// batch, and started again two seconds later.
struct StopBeforeFirstBatch {
    inner: FineSettlement,
    pg: Arc<std::sync::Mutex<settlementd::embedded_pg::EmbeddedPg>>,
    fired: AtomicBool,
}

impl Job for StopBeforeFirstBatch {
    type Plan = MonthPlan;
    const NAME: &'static str = fine_settlement::JOB_NAME;
    fn params(&self, key: &JobKey) -> Result<settlementd::job_layer::Params, String> {
        self.inner.params(key)
    }
    async fn plan(
        &self,
        pool: &PgPool,
        claim: &settlementd::job_layer::Claim,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        if !self.fired.swap(true, Ordering::SeqCst) {
            self.pg.lock().unwrap().stop_immediately();
            let pg = self.pg.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(2));
                pg.lock().unwrap().restart().unwrap();
            });
        }
        self.inner.plan(pool, claim, estimate).await
    }
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        self.inner.run_batch(tx, plan, cursor).await
    }
}

use settlementd::job_layer::{Batch, Cursor};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "stops a PostgreSQL server hard: run with --ignored"]
async fn a_database_restart_between_the_claim_and_the_first_batch_is_retried_to_one_clean_run() {
    let month = bd("2026-10-31");
    let (cluster, pool, clean) = restart_fixture(month, 5_000, 1).await;
    let url = cluster.url.clone();
    let PrivateCluster {
        pg, data: _data, ..
    } = cluster;
    let job = StopBeforeFirstBatch {
        inner: short_lease_job(200),
        pg: Arc::new(std::sync::Mutex::new(pg)),
        fired: AtomicBool::new(false),
    };
    let key = fine_settlement::key(month, settlementd::config::ShardSpec::new(0, 1).unwrap());
    let mut opts = run_options(false, false);
    opts.lease_ttl = Duration::from_secs(3);
    opts.heartbeat_every = Duration::from_secs(1);
    // What a replica does: retry a retryable failure (after a pause) until the month is done.
    let mut outcomes = Vec::new();
    let report = loop {
        assert!(outcomes.len() < 60, "never settled: {outcomes:?}");
        match job_layer::run_once(
            &pool,
            &job,
            key.clone(),
            &opts,
            &CancellationToken::new(),
            &|_| {},
        )
        .await
        {
            Ok(report) if report.skipped.is_none() => break report,
            Ok(report) => outcomes.push(format!("skipped {:?}", report.skipped)),
            Err(e) => {
                assert!(e.is_retryable(), "{e}");
                outcomes.push(e.to_string());
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert!(!outcomes.is_empty(), "the restart was not noticed");
    assert_eq!(report.key, key);
    let check = sqlx::postgres::PgPoolOptions::new()
        .connect(&url)
        .await
        .unwrap();
    assert_eq!(the_run(&check).await.0, "SUCCESS");
    assert_eq!(settled_rows(&check).await, settled_rows(&clean.pool).await);
    assert_settled_once(&check, &clean.pool).await;
    check.close().await;
    pool.close().await;
    eprintln!(
        "restart before the first batch: {outcomes:?}, then attempt {:?}",
        report.attempt
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "stops a PostgreSQL server hard: run with --ignored"]
async fn a_database_restart_during_the_success_write_leaves_a_running_row_the_next_run_completes() {
    let month = bd("2026-10-31");
    let (mut cluster, pool, clean) = restart_fixture(month, 5_000, 1).await;
    // The SUCCESS write waits, so the stop lands while it is in flight.
    for sql in [
        "CREATE FUNCTION hold_success() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(30); RETURN NEW; END $$",
        "CREATE TRIGGER hold_success BEFORE UPDATE ON job_runs FOR EACH ROW
         WHEN (NEW.status = 'SUCCESS' AND OLD.status = 'RUNNING') EXECUTE FUNCTION hold_success()",
    ] {
        sqlx::query(sql).execute(&pool).await.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let args = ["run", "--business-date", "2026-10-31"];
    let mut first = spawn_logged(&cluster.url, &args, &dir.path().join("first.log"));
    assert!(
        eventually(30, || async {
            sqlx::query_scalar::<_, i64>(
                // Only the trigger on the SUCCESS write sleeps.
                "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event = 'PgSleep' AND application_name = 'settlementd'",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 1
        })
        .await,
        "the SUCCESS write never started"
    );
    pool.close().await;
    cluster.pg.stop_immediately();
    let status = wait_exit(&mut first, 30).expect("the run ends when the server goes");
    assert_eq!(status.code(), Some(1));
    let log = std::fs::read_to_string(dir.path().join("first.log")).unwrap();
    assert_eq!(
        log.lines()
            .filter(|l| l.starts_with("settlementd:"))
            .count(),
        1,
        "{log}"
    );
    cluster.pg.restart().unwrap();

    let pool = cluster.pool().await;
    // SUCCESS never committed: the row is RUNNING. Batches commit without waiting for the WAL
    // flush, so the last of them may be gone too, but only together with their progress: what
    // is settled is exactly what the row says was.
    assert_eq!(the_run(&pool).await.0, "RUNNING");
    let (updated, settled): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT updated FROM job_runs),
                (SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(updated, settled);
    // The journal went with them: a batch lost in the crash lost its entries too.
    crate::journal::assert_journal_whole(&pool).await;
    sqlx::query("DROP TRIGGER hold_success ON job_runs")
        .execute(&pool)
        .await
        .unwrap();
    let mut second = spawn_logged(&cluster.url, &args, &dir.path().join("second.log"));
    // Held by the dead run until its lease expires (3 s), then taken over.
    let mut runs = 1;
    loop {
        let status = wait_exit(&mut second, 30).expect("the second run ends");
        assert!(status.success(), "{status:?}");
        if the_run(&pool).await.0 == "SUCCESS" {
            break;
        }
        assert!(runs < 20, "never completed");
        runs += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
        second = spawn_logged(&cluster.url, &args, &dir.path().join("second.log"));
    }
    let (_, attempt, _) = the_run(&pool).await;
    assert_eq!(attempt, 2);
    assert_eq!(settled_rows(&pool).await, settled_rows(&clean.pool).await);
    assert_settled_once(&pool, &clean.pool).await;
    pool.close().await;
}
