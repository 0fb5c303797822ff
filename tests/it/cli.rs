//! The binary's contract: JSON output, exit codes, one-line errors, secrets kept out of errors.

use crate::helpers::*;
use std::process::Output;

/// Exit 2 with exactly one line on stderr and no panic or backtrace.
fn assert_invalid(out: &Output, needle: &str) {
    let err = stderr_of(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line expected: {err}"
    );
    assert!(err.contains(needle), "'{err}' should mention '{needle}'");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
}

const UNREACHABLE: &str = "postgres://settle:hunter2@127.0.0.1:1/libraryd";

#[tokio::test]
async fn run_json_prints_exactly_one_object_with_the_contract_keys() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 300, 1).await;
    const ARGS: [&str; 8] = [
        "run",
        "--business-date",
        "2026-10-31",
        "--shard",
        "1",
        "--shards",
        "2",
        "--json",
    ];
    let out = settlementd(Some(&db.url)).args(ARGS).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim_end().lines().count(), 1, "{stdout}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let mut keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "attempt",
            "business_date",
            "elapsed_ms",
            "held",
            "held_ids",
            "job",
            "late_returns",
            "odd_rows",
            "rule",
            "scanned",
            "shard",
            "shards",
            "skipped",
            "skipped_because",
            "updated"
        ]
    );
    assert_eq!(
        v["rule"],
        serde_json::json!({"daily_rate_cents": 50, "grace_days": 0, "max_cents": 10000})
    );
    assert_eq!(
        (v["held"].as_u64(), v["late_returns"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(v["business_date"], "2026-10-31");
    assert_eq!(
        (v["shard"].as_u64(), v["shards"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(
        (v["skipped"].as_bool(), v["attempt"].as_i64()),
        (Some(false), Some(1))
    );
    let expected: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31' AND id % 2 = 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(v["updated"].as_i64(), Some(expected));

    // The same run again is skipped, still exit 0, still one object.
    let again = settlementd(Some(&db.url)).args(ARGS).output().unwrap();
    assert_eq!(again.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(
        (
            v["skipped"].as_bool(),
            v["scanned"].as_u64(),
            v["updated"].as_u64()
        ),
        (Some(true), Some(0), Some(0))
    );
}

#[tokio::test]
async fn run_prints_a_readable_summary_and_status_shows_every_shard() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 300, 1).await;
    let out = settlementd(Some(&db.url))
        .args(["run", "--business-date", "2026-10-31", "--shards", "3"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("SUCCESS attempt 1") && text.contains("shard 0/3"),
        "{text}"
    );

    let out = settlementd(Some(&db.url))
        .args([
            "status",
            "--business-date",
            "2026-10-31",
            "--shards",
            "3",
            "--json",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["status"], "SUCCESS");
    assert_eq!(
        (runs[1]["status"].as_str(), runs[2]["status"].as_str()),
        (Some("missing"), Some("missing"))
    );
    let totals = settlementd::jobs::fine_settlement::month_totals(&db.pool, bd("2026-10-31"))
        .await
        .unwrap();
    assert_eq!(
        v["totals"]["settled_rows"].as_i64(),
        Some(totals.settled_rows)
    );
    assert_eq!(v["totals"]["digest"].as_str(), Some(totals.digest.as_str()));

    let out = settlementd(Some(&db.url))
        .args(["status", "--business-date", "2026-10-31", "--shards", "3"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("SUCCESS") && text.contains("missing") && text.contains(&totals.digest),
        "{text}"
    );
}

#[tokio::test]
async fn bad_command_line_input_exits_2_with_one_line() {
    let cases: &[(&[&str], &str)] = &[
        (&["run", "--bogus"], "--bogus"),
        (
            &["run", "--business-date", "2026-10-30"],
            "last day of a month",
        ),
        (&["run", "--business-date", "yesterday"], "YYYY-MM-DD"),
        (
            &[
                "run",
                "--business-date",
                "2026-10-31",
                "--shard",
                "3",
                "--shards",
                "3",
            ],
            "shard.index",
        ),
        (
            &["run", "--business-date", "2026-10-31", "--shards", "0"],
            "shard.count",
        ),
        (&["run", "--shard", "-1"], "-1"),
        (&["status", "--shards", "0"], "shards"),
        (&["run", "--business-date", "2999-12-31"], "not over yet"),
        (&["frobnicate"], "frobnicate"),
    ];
    for (args, needle) in cases {
        // An unreachable database: input errors must be reported before any connection attempt.
        let out = settlementd(Some(UNREACHABLE)).args(*args).output().unwrap();
        assert_invalid(&out, needle);
    }
}

#[tokio::test]
async fn bad_configuration_exits_2_with_one_line_naming_the_key() {
    let cases: &[(&str, &str, &str)] = &[
        ("SETTLEMENTD__LEASE__TTL_SECS", "20", "lease.ttl_secs"),
        ("SETTLEMENTD__SHARD__INDEX", "7", "shard.index"),
        (
            "SETTLEMENTD__SCHEDULE__TIMEZONE",
            "Mars/Olympus",
            "schedule.timezone",
        ),
        (
            "SETTLEMENTD__SCHEDULE__CRON",
            "every monday",
            "schedule.cron",
        ),
        ("SETTLEMENTD__BATCH__SIZE", "lots", "size"),
        ("SETTLEMENTD__FINE__MAX_CENTS", "-5", "fine.max_cents"),
        (
            "SETTLEMENTD__FINE__DAILY_RATE_CENTS",
            "99999999999",
            "fine.daily_rate_cents",
        ),
    ];
    for (key, value, needle) in cases {
        let out = settlementd(Some(UNREACHABLE))
            .env(key, value)
            .args(["run", "--business-date", "2026-10-31"])
            .output()
            .unwrap();
        assert_invalid(&out, needle);
    }
    let out = settlementd(Some(UNREACHABLE))
        .args(["--config", "/nonexistent.toml", "run"])
        .output()
        .unwrap();
    assert_invalid(&out, "/nonexistent.toml");
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "[shard]\nindex = \"two\"\n").unwrap();
    let out = settlementd(Some(UNREACHABLE))
        .args(["--config", file.path().to_str().unwrap(), "run"])
        .output()
        .unwrap();
    assert_invalid(&out, "index");
    let out = settlementd(None)
        .args(["run", "--business-date", "2026-10-31"])
        .output()
        .unwrap();
    assert_invalid(&out, "DATABASE_URL");
}

#[tokio::test]
async fn running_against_an_unmigrated_database_says_to_migrate() {
    let (_name, url) = empty_db().await;
    let out = settlementd(Some(&url))
        .args(["run", "--business-date", "2026-10-31"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("settlementd migrate"), "{err}");
}

/// A migration that alters `loans` waits for libraryd's open transaction on it, and every later
/// writer of `loans` queues behind the migration: it gives up after its lock wait (exit 1, saying
/// which migration and what to do), leaves the migrations before it applied and
/// itself not, and the next `migrate` after that transaction ends applies the rest.
#[tokio::test]
async fn a_migration_behind_a_long_transaction_on_loans_gives_up_after_its_lock_wait_and_applies_on_the_next_try(
) {
    let (_name, url) = empty_db().await;
    let mut libraryd = loans_held_open(&url).await;

    let out = output_within(
        settlementd(Some(&url)).arg("migrate"),
        std::time::Duration::from_secs(60),
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("migration 20261130000002 was not applied")
            && err.contains("waited more than 5 s for a lock")
            && err.contains("Run `settlementd migrate` again"),
        "{err}"
    );
    let mut admin = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
        .await
        .unwrap();
    let applied: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM public._sqlx_migrations ORDER BY version")
            .fetch_all(&mut admin)
            .await
            .unwrap();
    assert_eq!(
        applied,
        vec![20261130000001],
        "only the migration before it"
    );
    let columns: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.columns
          WHERE table_schema = 'public' AND table_name = 'loans'",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(
        columns, 6,
        "loans as libraryd made it: the migration was rolled back"
    );

    sqlx::query("ROLLBACK")
        .execute(&mut libraryd)
        .await
        .unwrap();
    let out = output_within(
        settlementd(Some(&url)).arg("migrate"),
        std::time::Duration::from_secs(120),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let pending: bool = sqlx::query_scalar(
        "SELECT count(*) = 0 FROM settlementd.settlementd_migrations WHERE version = 20261210000001",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert!(!pending, "the next migrate applied every migration");
}

#[tokio::test]
async fn an_unreachable_database_fails_with_exit_1_and_no_password() {
    let out = settlementd(Some(UNREACHABLE))
        .args(["run", "--business-date", "2026-10-31"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("127.0.0.1:1"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

#[tokio::test]
async fn a_database_that_does_not_exist_is_exit_2_naming_the_setting_and_serve_does_not_retry_it() {
    let db = test_db().await;
    let mut url = url::Url::parse(&db.url).unwrap();
    url.set_path("/no_such_database");
    let url = url.to_string();
    for args in [
        &["run", "--business-date", "2026-10-31"][..],
        &["serve"][..],
    ] {
        let out = output_within(
            settlementd(Some(&url))
                .env("SETTLEMENTD__HTTP__LISTEN", "127.0.0.1:0")
                .args(args),
            std::time::Duration::from_secs(60),
        );
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains("\"no_such_database\" does not exist")
                && err.contains("check the database name in database.url"),
            "{args:?}: {err}"
        );
    }
}

#[tokio::test]
async fn a_config_file_sits_between_the_defaults_and_the_environment() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 200, 1).await;
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        "[shard]\nindex = 1\ncount = 2\n[fine]\ndaily_rate_cents = 7\n",
    )
    .unwrap();
    let out = settlementd(Some(&db.url))
        .env("SETTLEMENTD__SHARD__INDEX", "0")
        .args([
            "--config",
            file.path().to_str().unwrap(),
            "run",
            "--business-date",
            "2026-10-31",
            "--json",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["shard"].as_u64(), v["shards"].as_u64()),
        (Some(0), Some(2))
    );
    let max_fine: i64 = sqlx::query_scalar("SELECT max(fine_cents) FROM loans")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(max_fine % 7, 0, "the file's fine rate applied");
    assert!(max_fine > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_safe_when_replicas_apply_them_at_once() {
    let (_name, url) = empty_db().await;
    let children: Vec<_> = (0..4)
        .map(|_| {
            settlementd(Some(&url))
                .arg("migrate")
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    }
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    assert!(settlementd::db::schema_is_current(&pool).await.unwrap());
    let applied: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM _sqlx_migrations) + (SELECT count(*) FROM settlementd_migrations)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(applied as usize, settlementd::db::embedded().count());
}

#[tokio::test]
async fn migrating_an_existing_libraryd_table_only_adds_what_it_lacks() {
    let (_name, url) = empty_db().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    sqlx::query(
        "CREATE TABLE loans (id bigint PRIMARY KEY, member_id bigint NOT NULL, book_id bigint NOT NULL,
                             borrowed_on date NOT NULL, due_on date NOT NULL, returned_on date,
                             librarian_note text)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO loans VALUES (1, 1, 1, '2026-09-01', '2026-09-15', '2026-10-02', 'kept')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let out = settlementd(Some(&url)).arg("migrate").output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let (note, fine, settled): (String, i64, Option<chrono::DateTime<chrono::Utc>>) =
        sqlx::query_as("SELECT librarian_note, fine_cents, fine_settled_at FROM loans")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((note.as_str(), fine, settled), ("kept", 0, None));
}

#[test]
fn help_prints_and_exits_0() {
    let out = settlementd(None).arg("--help").output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for command in [
        "migrate", "run", "status", "serve", "schedule", "seed", "demo",
    ] {
        assert!(text.contains(command), "{text}");
    }
}

#[test]
fn a_wrong_server_bin_directory_is_a_set_up_error_with_exit_2() {
    let out = settlementd(None)
        .env("SETTLEMENTD_PG_BINDIR", "/nonexistent/bin")
        .arg("demo")
        .output()
        .unwrap();
    assert_invalid(&out, "SETTLEMENTD_PG_BINDIR=/nonexistent/bin");
}

#[test]
fn an_embedded_data_directory_the_server_user_cannot_reach_is_exit_2() {
    // Only meaningful as root, where the server runs as an unprivileged OS user.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let private = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let data = private.path().join("data");
    let out = settlementd(None)
        .env("SETTLEMENTD__DATABASE__EMBEDDED_DIR", &data)
        .args(["migrate", "--embedded-db"])
        .output()
        .unwrap();
    assert_invalid(&out, "not searchable");
}

/// October's claim as a run killed without SIGTERM leaves it: RUNNING, heartbeat fresh, nobody
/// renewing it.
async fn killed_a_moment_ago(pool: &sqlx::PgPool) {
    sqlx::query(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at)
         VALUES ('fine-settlement', '2026-10-31', 1, 0, 'RUNNING', 1, 'killed-pod',
                 clock_timestamp(), clock_timestamp())",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn run_wait_waits_out_a_dead_runs_lease_and_takes_the_month_over() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 300, 1).await;
    // A run killed without SIGTERM: RUNNING, heartbeat fresh, nobody renewing it.
    killed_a_moment_ago(&db.pool).await;
    let args = ["run", "--business-date", "2026-10-31", "--json"];
    let lease = [
        ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
        ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
    ];
    let skipped = run_ok(settlementd(Some(&db.url)).args(args).envs(lease));
    let v: serde_json::Value = serde_json::from_slice(&skipped.stdout).unwrap();
    assert_eq!(v["skipped"], true, "without --wait a held claim is skipped");

    let waited = run_ok(
        settlementd(Some(&db.url))
            .args(args)
            .arg("--wait")
            .envs(lease),
    );
    let v: serde_json::Value = serde_json::from_slice(&waited.stdout).unwrap();
    assert_eq!(
        (v["skipped"].as_bool(), v["attempt"].as_i64()),
        (Some(false), Some(2)),
        "{v}"
    );
    assert_eq!(
        v["updated"].as_i64(),
        Some(eligible(&db.pool, bd("2026-10-31")).await)
    );
}

/// Fault campaign seed 1003 (`cargo run --release --bin campaign -- --seed 1003 --schedules 1`):
/// the fine settlement was paused (`settlementd pause`, step 3), then a one-shot `settlementd run
/// --force` of a month exited 1, as for a failure that a retry may fix. A pause is a refusal
/// recorded in the database, like a month pinned to another rule: exit 3, and nothing claimed, so
/// that a scheduler does not retry a paused job as a failed one; resumed, the run goes on.
#[tokio::test]
async fn run_of_a_paused_job_is_refused_with_exit_3_and_claims_nothing() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 30, 1).await;
    let run = ["run", "--business-date", "2026-10-31", "--force", "--json"];
    pause_settlement(&db.url, "an audit of October");
    let refused = settlementd(Some(&db.url)).args(run).output().unwrap();
    let err = stderr_of(&refused);
    assert_eq!(refused.status.code(), Some(3), "{err}");
    // The pause's time in the schedule's zone (Asia/Shanghai by default), as the page says it.
    let paused_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT paused_at FROM job_pauses WHERE job_name = 'fine-settlement'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    let shown = settlementd::schedule::local_time(paused_at, chrono_tz::Asia::Shanghai);
    assert!(
        err.contains(&format!("is paused since {shown} by")),
        "{shown}: {err}"
    );
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(claims, 0, "a paused job claims nothing");

    run_ok(settlementd(Some(&db.url)).args(["resume", "--job", "fine-settlement"]));
    let ran = json_of(&run_ok(settlementd(Some(&db.url)).args(run)));
    assert_eq!(
        ran["updated"].as_i64(),
        Some(eligible(&db.pool, bd("2026-10-31")).await)
    );
}

/// Before, clap's message was cut to its first line: "the following required arguments were not
/// provided: (see --help)", naming none; a misspelt flag lost clap's suggestion.
#[test]
fn a_missing_or_misspelt_argument_is_named_in_one_line_with_clap_s_suggestion() {
    let out = settlementd(None).arg("pause").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("the following required arguments were not provided: --reason <TEXT>"),
        "{err}"
    );
    let out = settlementd(None)
        .args(["run", "--job-name", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("unexpected argument '--job-name'")
            && err.contains("a similar argument exists: '--job'"),
        "{err}"
    );
}

/// Before, `settlementd schedule --next 1000 | head -1` panicked on the closed pipe (exit 101,
/// a backtrace on stderr).
#[test]
fn a_reader_that_goes_away_ends_the_command_quietly_as_unix_tools_do() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let mut child = settlementd(None)
        .args(["schedule", "--next", "100000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.contains("settles"), "{first}");
    // The reader is dropped here: the pipe closes with most of the output unwritten.
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}", out.status);
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!err.contains("panicked"), "{err}");
}

/// sqlx's slow-statement warning carries the whole statement over many lines; settlementd logs
/// it as one line naming the statement (its leading comment, `settle.batch`), in text and in
/// JSON, and the statement's text never reaches the log. Every `UPDATE loans` is slowed by a
/// trigger past `database.slow_statement_ms`.
#[tokio::test]
async fn a_slow_statement_is_one_log_line_naming_it_never_the_statement() {
    for format in ["text", "json"] {
        let db = test_db().await;
        seed_month(&db.pool, bd("2026-10-31"), 50, 1).await;
        sqlx::raw_sql(
            "CREATE FUNCTION slow_down() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep(0.05); RETURN NULL; END $$;
             CREATE TRIGGER slow_down BEFORE UPDATE ON loans
                 FOR EACH STATEMENT EXECUTE FUNCTION slow_down();",
        )
        .execute(&db.pool)
        .await
        .unwrap();
        let out = output_within(
            settlementd(Some(&db.url))
                .env("SETTLEMENTD__DATABASE__SLOW_STATEMENT_MS", "40")
                .env("SETTLEMENTD__LOG__FORMAT", format)
                .args(["run", "--business-date", "2026-10-31"]),
            std::time::Duration::from_secs(60),
        );
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(0), "{format}: {err}");
        let slow: Vec<&str> = err
            .lines()
            .filter(|l| l.contains("slow statement"))
            .collect();
        let named = match format {
            "text" => "statement=settle.batch",
            _ => "\"statement\":\"settle.batch\"",
        };
        assert!(
            slow.iter()
                .any(|l| l.contains(named) && l.contains("elapsed_ms")),
            "{format}: {err}"
        );
        for text in ["UPDATE loans", "WITH settled", "RETURNING", "db.statement"] {
            assert!(!err.contains(text), "{format}: {text} in the log:\n{err}");
        }
        if format == "json" {
            for line in err.lines() {
                assert!(
                    serde_json::from_str::<serde_json::Value>(line).is_ok(),
                    "a line that is not JSON: {line}"
                );
            }
        }
    }
}

/// A range that ends with a month's shard still RUNNING under a lease that has not expired (a
/// holder killed a moment ago) says so: exit 5, the month named on stderr with `--wait`, and its
/// JSON line `"skipped_because": "held"` where a month already done says `already_success`. The
/// same range with `--wait` takes the month over once its lease expires, and exits 0.
#[tokio::test]
async fn a_range_that_ends_with_a_held_month_says_so_and_wait_finishes_it() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2026-09-30"), 50, 1).await;
    seed_month_alone(&db.pool, bd("2026-10-31"), 50, 1_000).await;
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-09-30"]));
    killed_a_moment_ago(&db.pool).await;
    let args = ["run", "--from", "2026-09", "--to", "2026-10", "--json"];
    let lease = [
        ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
        ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
    ];
    let out = settlementd(Some(&db.url))
        .args(args)
        .envs(lease)
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    for needle in ["held by another run", "2026-10 shard 0/1", "--wait"] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let because: Vec<_> = lines
        .iter()
        .map(|v| (v["business_date"].clone(), v["skipped_because"].clone()))
        .collect();
    assert_eq!(
        because,
        [
            (
                serde_json::json!("2026-09-30"),
                serde_json::json!("already_success")
            ),
            (serde_json::json!("2026-10-31"), serde_json::json!("held")),
        ]
    );

    let waited = run_ok(
        settlementd(Some(&db.url))
            .args(args)
            .arg("--wait")
            .envs(lease),
    );
    let last: serde_json::Value = serde_json::from_slice(
        waited
            .stdout
            .split(|b| *b == b'\n')
            .rfind(|l| !l.is_empty())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (last["skipped_because"].clone(), last["attempt"].as_i64()),
        (serde_json::Value::Null, Some(2)),
        "{last}"
    );
}
