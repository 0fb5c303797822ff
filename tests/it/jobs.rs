//! Issue 29, "jobs, not a job", with real `settlementd` processes and replicas ticked one at a
//! time: the registry (`settlementd jobs`, `[jobs.<section>]`, `--job`); the member statements,
//! which wait for the settlement to close a month and follow its journal; pause and resume, seen by
//! every replica; ranges of months from the command line and the runs API; and retention, which
//! deletes the audit rows of months closed long ago and never the money.
//!
//! The statements are checked against a recompute done here from the loans' dates alone, never
//! against what the settlement wrote.

use crate::helpers::*;
use chrono::{DateTime, NaiveDate, Utc};
use settlementd::calendar::BusinessDate;
use settlementd::clock::ManualClock;
use settlementd::config::Settings;
use settlementd::daemon::replica::TickOutcome;
use settlementd::job_layer::registry::Registered;
use settlementd::job_layer::requests::{self, NewRequest, Stored};
use settlementd::job_layer::{JobKey, RunOptions, RunReport};
use settlementd::jobs::fine_settlement;
use settlementd::jobs::member_statements;
use sqlx::PgPool;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

const SETTLEMENT: &str = fine_settlement::JOB_NAME;
const STATEMENTS: &str = member_statements::JOB_NAME;
const TOKEN: &str = "test-admin-token-0123456789";
const RATE: &str = "SETTLEMENTD__FINE__DAILY_RATE_CENTS";
/// A `serve` replica that ticks every second, takes a stale claim over after three, and retries
/// after one.
const FAST: [(&str, &str); 3] = [
    ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
    ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
    ("SETTLEMENTD__RETRY__INITIAL_SECS", "1"),
];

/// A member's statement of a month: (member_id, fines, fine_cents).
type Statement = (i64, i64, i64);

/// One claim: (business date, shards, shard, status, attempt, last_error).
type RunRow = (NaiveDate, i32, i32, String, i32, Option<String>);

async fn sql(pool: &PgPool, statement: &str) {
    sqlx::query(statement).execute(pool).await.unwrap();
}

async fn count(pool: &PgPool, query: &str) -> i64 {
    sqlx::query_scalar(query).fetch_one(pool).await.unwrap()
}

/// Every job of the registry, in its order (a job added to the binary is in every list these tests
/// check).
fn every_job() -> Vec<String> {
    let settings = Settings::load_from(None, []).unwrap();
    settlementd::jobs::build(&settings)
        .names()
        .into_iter()
        .map(String::from)
        .collect()
}

/// The JSON lines a finished process printed on stdout.
fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The object of `job` among `jobs --json`'s lines (wherever the list puts it).
fn job_json<'a>(lines: &'a [serde_json::Value], job: &str) -> &'a serde_json::Value {
    lines
        .iter()
        .find(|l| l["name"] == job)
        .unwrap_or_else(|| panic!("no {job} in {lines:?}"))
}

/// The line of `job` in `settlementd jobs`'s text (wherever the list puts it).
fn line_of<'a>(text: &'a str, job: &str) -> &'a str {
    text.lines()
        .find(|l| l.starts_with(&format!("{job} ")))
        .unwrap_or_else(|| panic!("no {job} in {text}"))
}

/// A month as the range options and the runs API write it: `YYYY-MM`.
fn ym(month: BusinessDate) -> String {
    month.first_day().format("%Y-%m").to_string()
}

/// `settlementd run --job JOB --business-date MONTH --json` with `env`, which must exit 0; its
/// report.
fn run_month(url: &str, env: &[(&str, &str)], job: &str, month: BusinessDate) -> serde_json::Value {
    let date = month.to_string();
    let out = cli(
        url,
        env,
        &["run", "--job", job, "--business-date", &date, "--json"],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "run {job} {date}: {}",
        stderr_of(&out)
    );
    json_of(&out)
}

/// The statements of `month` computed here from the loans' dates alone, at `rate` cents a day (no
/// grace days, at most 10 000 cents): for each member with a fine, how many of their loans
/// returned in the month carry one, and the sum.
async fn expected_statements(pool: &PgPool, month: BusinessDate, rate: i64) -> Vec<Statement> {
    sqlx::query_as(
        "SELECT member_id::bigint, count(*), sum(fine)::bigint
           FROM (SELECT member_id, LEAST(GREATEST(returned_on - due_on, 0) * $3, 10000) AS fine
                   FROM loans WHERE returned_on BETWEEN $1 AND $2) l
          WHERE fine > 0
          GROUP BY member_id ORDER BY member_id",
    )
    .bind(month.first_day())
    .bind(month.date())
    .bind(rate)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The stored statements of `month` are [`expected_statements`] at `rate`; a failure names the
/// members that differ, not the whole month.
async fn assert_statements(pool: &PgPool, month: BusinessDate, rate: i64) {
    let stored = statements_of(pool, month).await;
    let expected = expected_statements(pool, month, rate).await;
    let missing: Vec<&Statement> = expected.iter().filter(|s| !stored.contains(s)).collect();
    let extra: Vec<&Statement> = stored.iter().filter(|s| !expected.contains(s)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the statements of {month} are not the recompute at {rate} cents a day: {} stored, {} \
         expected; (member, fines, cents) expected and not stored: {missing:?}; stored and not \
         expected: {extra:?}",
        stored.len(),
        expected.len()
    );
}

/// When each member's statement of `month` was last written, by member.
async fn computed_at(pool: &PgPool, month: BusinessDate) -> Vec<(i64, DateTime<Utc>)> {
    sqlx::query_as(
        "SELECT member_id, computed_at FROM member_fine_statements
          WHERE business_date = $1 ORDER BY member_id",
    )
    .bind(month.date())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every claim of `job`, by month and shard.
async fn runs_of(pool: &PgPool, job: &str) -> Vec<RunRow> {
    sqlx::query_as(
        "SELECT business_date, shards, shard, status, attempt, last_error FROM job_runs
          WHERE job_name = $1 ORDER BY business_date, shards, shard",
    )
    .bind(job)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The status of each of `job`'s claims of `month`, by shard.
async fn statuses(pool: &PgPool, job: &str, month: BusinessDate) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT status FROM job_runs WHERE job_name = $1 AND business_date = $2
          ORDER BY shards, shard",
    )
    .bind(job)
    .bind(month.date())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The report of a tick that ran `month` to SUCCESS.
fn settled(outcome: TickOutcome, month: BusinessDate) -> RunReport {
    match outcome {
        TickOutcome::Settled { slot, report } if slot.business_date == month => report,
        other => panic!("expected the tick to run {month}, got {other:?}"),
    }
}

/// Why a tick found `month` not ready.
fn not_ready(outcome: TickOutcome, month: BusinessDate) -> String {
    match outcome {
        TickOutcome::NotReady { slot, why } if slot.business_date == month => why,
        other => panic!("expected {month} not ready, got {other:?}"),
    }
}

/// A statement-level trigger that makes every UPDATE of loans take `secs` longer, so a run's
/// batches can be caught mid-way.
async fn slow_updates(pool: &PgPool, secs: f64) {
    sql(
        pool,
        &format!(
            "CREATE FUNCTION slow_down() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep({secs}); RETURN NULL; END $$"
        ),
    )
    .await;
    sql(
        pool,
        "CREATE TRIGGER slow_down BEFORE UPDATE ON loans
           FOR EACH STATEMENT EXECUTE FUNCTION slow_down()",
    )
    .await;
}

/// A row trigger that makes every update of a loan returned in `month` fail, as a database error
/// would.
async fn fail_updates_in(pool: &PgPool, month: BusinessDate) {
    let when = format!(
        "NEW.returned_on BETWEEN '{}' AND '{}'",
        month.first_day(),
        month.date()
    );
    inject_failure(pool, "UPDATE", "loans", &when).await;
}

async fn no_failures(pool: &PgPool) {
    remove_failure(pool, "loans").await;
}

/// What a `serve` replica logged, for failure messages.
fn logs(paths: &[&Path]) -> String {
    paths
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n----\n")
}

/// Stores a run request of `job` for `month` (to `to`, a range) on shard 0 of 1, as the runs API
/// does; its id.
async fn store_request(
    pool: &PgPool,
    key: &str,
    job: &str,
    month: BusinessDate,
    to: Option<BusinessDate>,
) -> String {
    let request = NewRequest {
        idempotency_key: key.into(),
        job_name: job.into(),
        business_date: month.date(),
        to: to.map(|t| t.date()),
        shards: 1,
        shard: None,
        force: false,
    };
    let mut conn = pool.acquire().await.unwrap();
    match requests::store(&mut conn, &request, "test", |_| "{}".into())
        .await
        .unwrap()
    {
        Stored::New(stored) => stored.request_id,
        other => panic!("{other:?}"),
    }
}

/// Runs request `request` of `job` for `month` on shard 0 of 1, as a replica serving it does.
async fn serve_request(pool: &PgPool, job: &str, request: &str, month: BusinessDate) {
    let s = settings(&[]);
    let job: Arc<dyn Registered> = settlementd::jobs::build(&s).get(job).unwrap().clone();
    let opts = RunOptions {
        request: Some(request.to_string()),
        ..settlementd::app::run_options(&s, false, false)
    };
    let key = JobKey {
        job_name: job.name().to_string(),
        business_date: month.date(),
        shards: 1,
        shard: 0,
    };
    let report = job
        .run(pool, key, &opts, &CancellationToken::new(), &|_| {})
        .await
        .unwrap();
    assert!(report.skipped.is_none(), "{report:?}");
}

/// An in-process HTTP server for `settings` on `pool`, stopped when the token is cancelled.
async fn http_server(
    pool: &PgPool,
    token: Option<&str>,
) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
    let env: Vec<(String, String)> = token
        .map(|t| ("SETTLEMENTD__HTTP__ADMIN_TOKEN".to_string(), t.to_string()))
        .into_iter()
        .collect();
    let settings = Settings::load_from(None, env).unwrap();
    serve_http(pool, settings).await
}

/// POSTs `body` to `path` with the admin token.
async fn post_admin(addr: SocketAddr, path: &str, key: Option<&str>, body: &str) -> Answer {
    let auth = format!("Bearer {TOKEN}");
    let mut headers = vec![("Authorization", auth.as_str())];
    if let Some(key) = key {
        headers.push(("Idempotency-Key", key));
    }
    http(addr, "POST", path, &headers, body).await.unwrap()
}

/// GETs a run request with the admin token.
async fn get_request(addr: SocketAddr, id: &str) -> serde_json::Value {
    let auth = format!("Bearer {TOKEN}");
    let answer = http(
        addr,
        "GET",
        &format!("/v1/runs/{id}"),
        &[("Authorization", &auth)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 200, "{answer:?}");
    answer.json()
}

/// The pauses in force: (job, paused_by, reason), by job.
async fn pauses(pool: &PgPool) -> Vec<(String, String, String)> {
    sqlx::query_as("SELECT job_name, paused_by, reason FROM job_pauses ORDER BY job_name")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Today in Shanghai (the default zone): the day of the retention run's key.
fn today() -> NaiveDate {
    Utc::now()
        .with_timezone(&chrono_tz::Asia::Shanghai)
        .date_naive()
}

/// A `jobs --json` line's next fire is in the future, at `time` (Shanghai), and its month is the
/// one that fire runs.
fn assert_next_fire(line: &serde_json::Value, time: &str) {
    let fire_at = line["next_fire"].as_str().unwrap();
    assert!(fire_at.ends_with(time), "{line}");
    let parsed = DateTime::parse_from_rfc3339(fire_at).unwrap();
    assert!(parsed > Utc::now(), "{line}");
    assert_eq!(
        line["next_business_date"],
        BusinessDate::for_instant(&parsed).to_string(),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_lists_both_jobs_with_their_schedule_and_last_closed_month() {
    let db = test_db().await;
    let (sep, oct) = (bd("2026-09-30"), bd("2026-10-31"));
    seed_month_alone(&db.pool, sep, 60, 1).await;
    seed_month_alone(&db.pool, oct, 60, 1_000).await;
    for month in [sep, oct] {
        run_month(&db.url, &[], SETTLEMENT, month);
    }
    run_month(&db.url, &[], STATEMENTS, sep);
    let reason = "statements are being redesigned";
    let out = cli(
        &db.url,
        &[],
        &["pause", "--job", STATEMENTS, "--reason", reason],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));

    let out = cli(&db.url, &[], &["jobs", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let lines = json_lines(&out);
    assert_eq!(lines.len(), every_job().len(), "{lines:?}");
    for line in &lines {
        let mut keys: Vec<&String> = line.as_object().unwrap().keys().collect();
        keys.sort();
        assert_eq!(
            keys,
            [
                "after",
                "cron",
                "enabled",
                "held_after_last_closed",
                "last_closed",
                "name",
                "next_business_date",
                "next_fire",
                "paused",
                "timezone"
            ],
            "{line}"
        );
    }
    let (fines, stated) = (job_json(&lines, SETTLEMENT), job_json(&lines, STATEMENTS));
    assert_eq!(
        (
            &fines["name"],
            &fines["enabled"],
            &fines["cron"],
            &fines["timezone"]
        ),
        (
            &SETTLEMENT.into(),
            &true.into(),
            &"0 30 2 1 * *".into(),
            &"Asia/Shanghai".into()
        ),
        "{fines}"
    );
    assert_eq!(fines["after"], serde_json::Value::Null, "{fines}");
    assert_eq!(fines["last_closed"], "2026-10-31", "{fines}");
    assert_eq!(fines["paused"], serde_json::Value::Null, "{fines}");
    assert_next_fire(fines, "T02:30:00+08:00");
    assert_eq!(
        (
            &stated["name"],
            &stated["enabled"],
            &stated["cron"],
            &stated["after"]
        ),
        (
            &STATEMENTS.into(),
            &true.into(),
            &"0 0 4 1 * *".into(),
            &SETTLEMENT.into()
        ),
        "{stated}"
    );
    assert_eq!(stated["last_closed"], "2026-09-30", "{stated}");
    assert_eq!(stated["paused"]["job_name"], STATEMENTS, "{stated}");
    assert_eq!(stated["paused"]["reason"], reason, "{stated}");
    assert!(
        stated["paused"]["paused_by"]
            .as_str()
            .unwrap()
            .ends_with("(settlementd pause)"),
        "{stated}"
    );
    assert_next_fire(stated, "T04:00:00+08:00");

    let out = cli(&db.url, &[], &["jobs"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), every_job().len(), "{text}");
    let (fines, stated) = (line_of(&text, SETTLEMENT), line_of(&text, STATEMENTS));
    for needle in [
        " enabled ",
        "0 30 2 1 * *",
        "Asia/Shanghai",
        "last closed 2026-10-31",
    ] {
        assert!(fines.contains(needle), "{needle}: {text}");
    }
    assert!(!fines.contains("PAUSED"), "{text}");
    for needle in [
        "0 0 4 1 * *",
        "last closed 2026-09-30",
        "after fine-settlement",
        "PAUSED since",
        reason,
    ] {
        assert!(stated.contains(needle), "{needle}: {text}");
    }

    // Closed means SUCCESS on every shard of the configured count: under 2 shards, nothing is.
    let out = cli(
        &db.url,
        &[("SETTLEMENTD__SHARD__COUNT", "2")],
        &["jobs", "--json"],
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), every_job().len(), "{}", stderr_of(&out));
    assert!(
        lines.iter().all(|l| l["last_closed"].is_null()),
        "{lines:?}"
    );

    // As configured: schedule.cron is the settlement's; a section sets the statements' cron and
    // turns them off.
    let out = cli(
        &db.url,
        &[
            ("SETTLEMENTD__SCHEDULE__CRON", "0 0 3 1 * *"),
            ("SETTLEMENTD__JOBS__MEMBER_STATEMENTS__CRON", "0 15 6 2 * *"),
            ("SETTLEMENTD__JOBS__MEMBER_STATEMENTS__ENABLED", "false"),
        ],
        &["jobs", "--json"],
    );
    let lines = json_lines(&out);
    assert_eq!(lines.len(), every_job().len(), "{}", stderr_of(&out));
    assert_eq!(
        (
            &job_json(&lines, SETTLEMENT)["cron"],
            &job_json(&lines, SETTLEMENT)["enabled"]
        ),
        (&"0 0 3 1 * *".into(), &true.into())
    );
    assert_next_fire(job_json(&lines, SETTLEMENT), "T03:00:00+08:00");
    assert_eq!(
        (
            &job_json(&lines, STATEMENTS)["cron"],
            &job_json(&lines, STATEMENTS)["enabled"]
        ),
        (&"0 15 6 2 * *".into(), &false.into())
    );
    assert_next_fire(job_json(&lines, STATEMENTS), "T06:15:00+08:00");
    let out = cli(
        &db.url,
        &[("SETTLEMENTD__JOBS__MEMBER_STATEMENTS__ENABLED", "false")],
        &["jobs"],
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(line_of(&text, STATEMENTS).contains(" disabled "), "{text}");
}

/// An address nothing listens on: reaching it would fail with exit 1, not 2.
const UNREACHABLE: &str = "postgres://u@127.0.0.1:1/x";

/// `cmd` exits 2 with one line on stderr holding every needle.
fn assert_refused(cmd: &mut std::process::Command, needles: &[&str]) {
    let out = cmd.output().unwrap();
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{cmd:?}: {stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{cmd:?}: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{cmd:?}: {needle} in {stderr}");
    }
}

#[test]
fn job_sections_are_checked() {
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let known = "[jobs.fine_settlement], [jobs.member_statements]";

    // The job's name as a section: its `-` must be `_`, in a file and in the environment.
    let dashed = file(
        "dashed.toml",
        "[jobs.member-statements]\ncron = \"0 0 5 1 * *\"\n",
    );
    assert_refused(
        settlementd(None)
            .arg("--config")
            .arg(&dashed)
            .arg("schedule"),
        &[
            "[jobs.member-statements]",
            "[jobs.member_statements]",
            "SETTLEMENTD__JOBS__MEMBER_STATEMENTS__CRON",
        ],
    );
    assert_refused(
        settlementd(None)
            .env("SETTLEMENTD__JOBS__MEMBER-STATEMENTS__CRON", "0 0 5 1 * *")
            .arg("schedule"),
        &["[jobs.member_statements]"],
    );
    // A section naming no job names the ones there are.
    let unknown = file("unknown.toml", "[jobs.fine_setlement]\nenabled = true\n");
    assert_refused(
        settlementd(None)
            .arg("--config")
            .arg(&unknown)
            .arg("schedule"),
        &["[jobs.fine_setlement]", known],
    );
    assert_refused(
        settlementd(None)
            .env("SETTLEMENTD__JOBS__PAYROLL__ENABLED", "true")
            .arg("schedule"),
        &["[jobs.payroll]", known],
    );
    // A key a job's section does not take: a job without settings of its own takes `enabled`
    // and `cron` only, in a file and in the environment.
    let misspelt = file(
        "misspelt.toml",
        "[jobs.member_statements]\ncrn = \"0 0 5 1 * *\"\n",
    );
    assert_refused(
        settlementd(None)
            .arg("--config")
            .arg(&misspelt)
            .arg("schedule"),
        &[
            "[jobs.member_statements]",
            "unknown key `crn`",
            "takes `enabled` and `cron` only",
        ],
    );
    assert_refused(
        settlementd(None)
            .env("SETTLEMENTD__JOBS__FINE_SETTLEMENT__BATCH", "5")
            .arg("jobs"),
        &["[jobs.fine_settlement]", "unknown key `batch`"],
    );
    // The settlement's cron given twice: as schedule.cron and in its section.
    assert_refused(
        settlementd(None)
            .env("SETTLEMENTD__SCHEDULE__CRON", "0 0 3 1 * *")
            .env("SETTLEMENTD__JOBS__FINE_SETTLEMENT__CRON", "0 0 3 1 * *")
            .arg("schedule"),
        &["schedule.cron", "jobs.fine_settlement.cron"],
    );
    let twice = file(
        "twice.toml",
        "[schedule]\ncron = \"0 0 3 1 * *\"\n[jobs.fine_settlement]\ncron = \"0 0 4 1 * *\"\n",
    );
    assert_refused(
        settlementd(None)
            .arg("--config")
            .arg(&twice)
            .arg("schedule"),
        &["schedule.cron", "jobs.fine_settlement.cron"],
    );
    // A section's keys are checked like every key.
    assert_refused(
        settlementd(None)
            .env("SETTLEMENTD__JOBS__MEMBER_STATEMENTS__CRON", "61 * * * * *")
            .arg("schedule"),
        &["jobs.member_statements.cron"],
    );
    let stray = file("stray.toml", "[jobs.member_statements]\nschedule = \"x\"\n");
    assert_refused(
        settlementd(None)
            .arg("--config")
            .arg(&stray)
            .arg("schedule"),
        &["jobs.member_statements", "schedule"],
    );
    // --job names a job of the registry, checked before any connection.
    for args in [
        &["run", "--job", "payroll"][..],
        &["status", "--job", "payroll"],
        &["schedule", "--job", "payroll"],
        &["pause", "--job", "payroll", "--reason", "x"],
        &["resume", "--job", "payroll"],
    ] {
        assert_refused(
            settlementd(Some(UNREACHABLE)).args(args),
            &[
                "unknown job \"payroll\"",
                "fine-settlement, member-statements",
            ],
        );
    }

    // Spelt right, a section sets its job's schedule and no other.
    let right = file(
        "right.toml",
        "[jobs.member_statements]\ncron = \"0 0 5 1 * *\"\n",
    );
    for (job, time) in [
        (STATEMENTS, "T05:00:00+08:00"),
        (SETTLEMENT, "T02:30:00+08:00"),
    ] {
        let out = run_ok(
            settlementd(None)
                .arg("--config")
                .arg(&right)
                .args(["schedule", "--job", job, "--next", "2", "--json"]),
        );
        let lines = json_lines(&out);
        assert_eq!(lines.len(), 2);
        for line in lines {
            assert!(
                line["fire_at"].as_str().unwrap().ends_with(time),
                "{job}: {line}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_runs_both_jobs_the_statements_after_the_settlement() {
    let db = test_db().await;
    let feb = bd("2027-02-28");
    seed_month_alone(&db.pool, feb, 400, 1).await;
    // After both fires of 2027-03-01 (02:30 and 04:00 in Shanghai).
    let clock = ManualClock::new(shanghai(2027, 3, 1, 5, 0, 0));
    let shard = |index: &str| settings(&[("SHARD__INDEX", index), ("SHARD__COUNT", "2")]);
    let (s0, s1) = (shard("0"), shard("1"));
    let order = settlementd::jobs::build(&s0).names();
    let at = |job: &str| order.iter().position(|j| *j == job);
    assert!(
        at(SETTLEMENT) < at(STATEMENTS),
        "replicas tick the settlement before the statements that follow it: {order:?}"
    );
    let mut fines0 = replica_of(&db.pool, &s0, SETTLEMENT, &clock);
    let mut stated0 = replica_of(&db.pool, &s0, STATEMENTS, &clock);
    let mut fines1 = replica_of(&db.pool, &s1, SETTLEMENT, &clock);
    let mut stated1 = replica_of(&db.pool, &s1, STATEMENTS, &clock);

    // Before the settlement, the statements wait: nothing claimed, nothing written.
    let why = not_ready(stated1.tick().await, feb);
    assert!(why.contains("fine-settlement 2027-02-28"), "{why}");

    // Shard 0's replica ticks its jobs in order: the settlement settles its shard; the statements
    // still wait for shard 1's.
    let report = settled(fines0.tick().await, feb);
    assert!(report.updated > 0);
    let why = not_ready(stated0.tick().await, feb);
    assert!(why.contains("SUCCESS on 1 of its 2 shards"), "{why}");
    assert!(runs_of(&db.pool, STATEMENTS).await.is_empty());
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM member_fine_statements").await,
        0
    );

    // Shard 1's replica closes the month, then its statements run at once; shard 0's follow at
    // its next tick.
    settled(fines1.tick().await, feb);
    let written1 = settled(stated1.tick().await, feb).updated;
    assert!(matches!(
        fines0.tick().await,
        TickOutcome::AlreadyDone { .. }
    ));
    let written0 = settled(stated0.tick().await, feb).updated;

    let expected = expected_statements(&db.pool, feb, 50).await;
    assert!(expected.len() > 100, "{}", expected.len());
    assert_statements(&db.pool, feb, 50).await;
    // Each shard wrote its own members (member_id % 2).
    let members_of = |s: i64| expected.iter().filter(|(m, _, _)| m % 2 == s).count() as u64;
    assert_eq!((written0, written1), (members_of(0), members_of(1)));
    assert_eq!(
        runs_of(&db.pool, STATEMENTS).await,
        [
            (feb.date(), 2, 0, "SUCCESS".to_string(), 1, None),
            (feb.date(), 2, 1, "SUCCESS".to_string(), 1, None),
        ]
    );
    // Nothing is left to do for any of them.
    for replica in [&mut fines0, &mut stated0, &mut fines1, &mut stated1] {
        let outcome = replica.tick().await;
        assert!(
            matches!(outcome, TickOutcome::AlreadyDone { .. }),
            "{outcome:?}"
        );
    }
}

/// Under two shards, a journal row re-opens the month on both statement shards: the member's
/// shard writes their statement, the other has nothing of theirs to write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_return_changes_only_its_members_statement_under_two_shards() {
    let db = test_db().await;
    let feb = bd("2027-02-28");
    seed_month_alone(&db.pool, feb, 400, 1).await;
    let clock = ManualClock::new(shanghai(2027, 3, 1, 5, 0, 0));
    let shard = |index: &str| settings(&[("SHARD__INDEX", index), ("SHARD__COUNT", "2")]);
    let (s0, s1) = (shard("0"), shard("1"));
    let mut fines0 = replica_of(&db.pool, &s0, SETTLEMENT, &clock);
    let mut fines1 = replica_of(&db.pool, &s1, SETTLEMENT, &clock);
    let mut stated0 = replica_of(&db.pool, &s0, STATEMENTS, &clock);
    let mut stated1 = replica_of(&db.pool, &s1, STATEMENTS, &clock);
    settled(fines0.tick().await, feb);
    settled(fines1.tick().await, feb);
    settled(stated0.tick().await, feb);
    settled(stated1.tick().await, feb);
    assert_statements(&db.pool, feb, 50).await;

    // A return keyed late for an even member (statements shard 0) on an odd loan (settlement
    // shard 1): shard 1's settlement sweeps it in, then both statement shards see the month
    // changed, and only that member's statement changes.
    let before = statements_of(&db.pool, feb).await;
    let stamps = computed_at(&db.pool, feb).await;
    let (member, fines, cents) = *before.iter().find(|s| s.0 % 2 == 0).unwrap();
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (100001, $1, 1, '2027-01-18', '2027-02-01', '2027-02-21')",
    )
    .bind(member)
    .execute(&db.pool)
    .await
    .unwrap();
    let late = |outcome: TickOutcome| match outcome {
        TickOutcome::LateReturns {
            business_date,
            report,
        } if business_date == feb => report,
        other => panic!("expected {feb} re-opened, got {other:?}"),
    };
    assert_eq!(late(fines1.tick().await).updated, 1);
    let mine = late(stated0.tick().await);
    let theirs = stated1.tick().await;
    let after = statements_of(&db.pool, feb).await;
    assert_statements(&db.pool, feb, 50).await;
    let changed: Vec<Statement> = after
        .iter()
        .filter(|s| !before.contains(s))
        .copied()
        .collect();
    assert_eq!(changed, [(member, fines + 1, cents + 1000)]);
    let rewritten: Vec<i64> = computed_at(&db.pool, feb)
        .await
        .into_iter()
        .filter(|s| !stamps.contains(s))
        .map(|(m, _)| m)
        .collect();
    assert_eq!(rewritten, [member]);
    assert_eq!((mine.scanned, mine.updated), (1, 1));
    // Shard 1 has none of its members to write.
    match theirs {
        TickOutcome::LateReturns { report, .. } => assert_eq!(report.updated, 0, "{report:?}"),
        TickOutcome::AlreadyDone { .. } => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_every_enabled_job_in_one_process_with_a_page_section_for_each() {
    let db = test_db().await;
    let month = due_month();
    seed_month_alone(&db.pool, month, 200, 1).await;
    let dir = tempfile::tempdir().unwrap();
    let (off_log, on_log) = (dir.path().join("off.log"), dir.path().join("on.log"));

    // With the statements disabled, the process runs the settlement alone.
    let mut env = FAST.to_vec();
    env.push(("SETTLEMENTD__JOBS__MEMBER_STATEMENTS__ENABLED", "false"));
    let serve = ServeProcess::start_logged(&db.url, &env, &off_log);
    assert!(
        eventually(20, || async {
            statuses(&db.pool, SETTLEMENT, month).await == ["SUCCESS"]
        })
        .await,
        "{}",
        logs(&[&off_log])
    );
    // Three heartbeats later, still no statement claim.
    assert!(
        !eventually(3, || async {
            !runs_of(&db.pool, STATEMENTS).await.is_empty()
        })
        .await,
        "a disabled job ran: {:?}",
        runs_of(&db.pool, STATEMENTS).await
    );
    drop(serve);

    // Enabled (the default), the same process runs the statements after the settlement.
    let serve = ServeProcess::start_logged(&db.url, &FAST, &on_log);
    assert!(
        eventually(20, || async {
            statuses(&db.pool, STATEMENTS, month).await == ["SUCCESS"]
        })
        .await,
        "{}",
        logs(&[&on_log])
    );
    assert_statements(&db.pool, month, 50).await;
    // The page has a section per job, in the registry's order, its ids prefixed with the job.
    let (status, page) = get(serve.addr, "/status").await.unwrap();
    assert_eq!(status, 200, "{page}");
    let at = |needle: String| {
        page.find(&needle)
            .unwrap_or_else(|| panic!("{needle} not on the page: {page}"))
    };
    let settlement_section = at(format!(r#"id="{SETTLEMENT}""#));
    let statements_section = at(format!(r#"id="{STATEMENTS}""#));
    assert!(settlement_section < statements_section);
    assert!(at(format!(r#"id="{SETTLEMENT}-verdict-{month}""#)) < statements_section);
    assert!(at(format!(r#"id="{STATEMENTS}-verdict-{month}""#)) > statements_section);
    drop(serve);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_statements_wait_for_the_settlement_to_close_the_month() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month_alone(&db.pool, oct, 200, 1).await;
    let statements_of_shard = |shard: &str| {
        cli(
            &db.url,
            &[],
            &[
                "run",
                "--job",
                STATEMENTS,
                "--business-date",
                "2026-10-31",
                "--shard",
                shard,
                "--shards",
                "2",
                "--json",
            ],
        )
    };
    let settle_shard = |shard: &str| {
        run_ok(settlementd(Some(&db.url)).args([
            "run",
            "--business-date",
            "2026-10-31",
            "--shard",
            shard,
            "--shards",
            "2",
        ]))
    };
    let nothing_of_the_statements = || async {
        for table in [
            "SELECT count(*) FROM member_fine_statements",
            "SELECT count(*) FROM member_statement_marks",
            "SELECT count(*) FROM job_runs WHERE job_name = 'member-statements'",
            "SELECT count(*) FROM job_params WHERE job_name = 'member-statements'",
        ] {
            assert_eq!(count(&db.pool, table).await, 0, "{table}");
        }
    };

    // Nothing settled yet: refused, exit 3, one line saying why.
    let out = statements_of_shard("0");
    let line = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{line}");
    assert_eq!(line.trim().lines().count(), 1, "{line}");
    for needle in ["is not ready", "fine-settlement 2026-10-31"] {
        assert!(line.contains(needle), "{needle}: {line}");
    }
    nothing_of_the_statements().await;

    // One shard of two settled is not the month closed.
    settle_shard("0");
    let out = statements_of_shard("1");
    let line = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{line}");
    assert!(line.contains("SUCCESS on 1 of its 2 shards"), "{line}");
    nothing_of_the_statements().await;

    // Closed: both shards run.
    settle_shard("1");
    for shard in ["0", "1"] {
        let out = statements_of_shard(shard);
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
        let report = json_of(&out);
        assert_eq!(
            (&report["job"], &report["skipped"]),
            (&STATEMENTS.into(), &false.into()),
            "{report}"
        );
    }
    assert_statements(&db.pool, oct, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_follows_a_late_return_for_the_member_concerned_only() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month_alone(&db.pool, oct, 300, 1).await;
    run_month(&db.url, &[], SETTLEMENT, oct);
    let first = run_month(&db.url, &[], STATEMENTS, oct);
    assert_eq!(first["job"], STATEMENTS, "{first}");
    let before = statements_of(&db.pool, oct).await;
    assert_statements(&db.pool, oct, 50).await;
    let stamps = computed_at(&db.pool, oct).await;
    let (member, fines, cents) = before[before.len() / 2];

    // A return keyed late for the member: 20 days late, 1000 cents.
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (100000, $1, 1, '2026-09-17', '2026-10-01', '2026-10-21')",
    )
    .bind(member)
    .execute(&db.pool)
    .await
    .unwrap();
    // The statements follow the settled money, not the raw loans: while the return waits for the
    // settlement, their run is refused as not ready (issue 48: a follower runs a month only when
    // nothing of its leader waits there), and changes nothing.
    let date = oct.to_string();
    let out = cli(
        &db.url,
        &[],
        &["run", "--job", STATEMENTS, "--business-date", &date],
    );
    assert_eq!(
        (
            out.status.code(),
            stderr_of(&out).contains("1 late return or edit waiting")
        ),
        (Some(3), true),
        "{}",
        stderr_of(&out)
    );
    assert_eq!(statements_of(&db.pool, oct).await, before);

    // The settlement's run settles it (journal `late`)...
    let report = run_month(&db.url, &[], SETTLEMENT, oct);
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM fine_journal_entries WHERE loan_id = 100000 AND kind = 'late'"
        )
        .await,
        1
    );
    // ...and the statements re-open the month for that journal row and compute that member alone.
    let report = run_month(&db.url, &[], STATEMENTS, oct);
    assert_eq!(
        (
            &report["skipped"],
            report["journal_rows_waiting"].as_u64(),
            report["scanned"].as_u64(),
            report["updated"].as_u64()
        ),
        (&false.into(), Some(1), Some(1), Some(1)),
        "{report}"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM job_events
              WHERE job_name = 'member-statements' AND event = 'month_changed'"
        )
        .await,
        1
    );
    let after = statements_of(&db.pool, oct).await;
    assert_statements(&db.pool, oct, 50).await;
    let changed: Vec<Statement> = after
        .iter()
        .filter(|s| !before.contains(s))
        .copied()
        .collect();
    assert_eq!(changed, [(member, fines + 1, cents + 1000)]);
    let rewritten: Vec<i64> = computed_at(&db.pool, oct)
        .await
        .into_iter()
        .filter(|s| !stamps.contains(s))
        .map(|(m, _)| m)
        .collect();
    assert_eq!(rewritten, [member], "only the member's row was written");

    // `status --job` shows the statements' month.
    let out = cli(
        &db.url,
        &[],
        &[
            "status",
            "--job",
            STATEMENTS,
            "--business-date",
            "2026-10-31",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let status = json_of(&out);
    assert_eq!(
        (
            &status["job"],
            &status["closed"],
            &status["totals"]["members"]
        ),
        (&STATEMENTS.into(), &true.into(), &after.len().into()),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_changes_every_statement_of_the_month() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month_alone(&db.pool, oct, 300, 1).await;
    run_month(&db.url, &[], SETTLEMENT, oct);
    run_month(&db.url, &[], STATEMENTS, oct);
    let before = statements_of(&db.pool, oct).await;
    assert_statements(&db.pool, oct, 50).await;

    let out = cli(
        &db.url,
        &[(RATE, "60")],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--key",
            "FIX-60",
            "--reason",
            "the rate is 60 since October",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));

    let report = run_month(&db.url, &[], STATEMENTS, oct);
    assert_eq!(report["skipped"], false, "{report}");
    assert!(
        report["journal_rows_waiting"].as_u64() > Some(0),
        "{report}"
    );
    assert_eq!(report["scanned"].as_u64(), Some(before.len() as u64));
    let after = statements_of(&db.pool, oct).await;
    assert_statements(&db.pool, oct, 60).await;
    assert_eq!(after.len(), before.len());
    for (old, new) in before.iter().zip(&after) {
        assert_eq!((old.0, old.1), (new.0, new.1));
        assert_ne!(old.2, new.2, "member {}", old.0);
    }
}

/// A correction under two shards: each shard's statements re-open for the correction's journal
/// rows, and each writes its own members' statements, leaving the other shard's in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_under_two_shards_changes_every_statement_and_drops_none() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month_alone(&db.pool, oct, 300, 1).await;
    let run_shards = |env: &[(&str, &str)], args: &[&str]| {
        for shard in ["0", "1"] {
            run_ok(
                settlementd(Some(&db.url))
                    .envs(env.iter().copied())
                    .args(args)
                    .args(["--business-date", "2026-10-31", "--shards", "2"])
                    .args(["--shard", shard]),
            );
        }
    };
    run_shards(&[], &["run"]);
    run_shards(&[], &["run", "--job", STATEMENTS]);
    assert_statements(&db.pool, oct, 50).await;
    let before = statements_of(&db.pool, oct).await;
    run_ok(settlementd(Some(&db.url)).env(RATE, "60").args([
        "correct",
        "--business-date",
        "2026-10-31",
        "--shards",
        "2",
        "--key",
        "FIX-60",
        "--reason",
        "the rate is 60 since October",
    ]));
    run_shards(&[], &["run", "--job", STATEMENTS]);
    assert_statements(&db.pool, oct, 60).await;
    let after = statements_of(&db.pool, oct).await;
    assert_eq!(
        after.iter().map(|s| s.0).collect::<Vec<_>>(),
        before.iter().map(|s| s.0).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_held_by_a_correction_is_not_closed_for_the_statements_nor_for_jobs() {
    let db = test_db().await;
    let (sep, oct) = (bd("2026-09-30"), bd("2026-10-31"));
    seed_month_alone(&db.pool, sep, 40, 1).await;
    seed_month_alone(&db.pool, oct, 120, 1_000).await;
    for month in [sep, oct] {
        run_month(&db.url, &[], SETTLEMENT, month);
    }
    // A correction of October dies after its first batch: October is held until the same key
    // finishes it.
    slow_updates(&db.pool, 0.2).await;
    let mut killed = settlementd(Some(&db.url))
        .env(RATE, "60")
        .env("SETTLEMENTD__BATCH__SIZE", "5")
        .args([
            "correct",
            "--business-date",
            "2026-10-31",
            "--key",
            "FIX-60",
            "--reason",
            "the rate is 60 since October",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let first_batch = eventually(20, || async {
        count(&db.pool, "SELECT count(*) FROM fine_adjustments").await > 0
    })
    .await;
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(first_batch, "the correction committed a batch");
    sql(&db.pool, "DROP TRIGGER slow_down ON loans").await;

    // `jobs`: the last month the settlement closed is September.
    let out = cli(&db.url, &[], &["jobs", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(json_lines(&out)[0]["last_closed"], "2026-09-30");
    // The statements of October wait for the correction, naming it.
    let out = cli(
        &db.url,
        &[],
        &["run", "--job", STATEMENTS, "--business-date", "2026-10-31"],
    );
    let line = stderr_of(&out);
    assert!(
        line.contains("is not ready") && line.contains(r#"being corrected under key "FIX-60""#),
        "{line}"
    );
    assert_eq!(out.status.code(), Some(3), "{line}");
    assert!(statements_of(&db.pool, oct).await.is_empty());

    // Finished, the month is closed again, and its statements are the corrected fines.
    age_heartbeat(&db.pool, oct, 1, 0, 120).await;
    let out = cli(
        &db.url,
        &[(RATE, "60")],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--key",
            "FIX-60",
            "--reason",
            "the rate is 60 since October",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    run_month(&db.url, &[], STATEMENTS, oct);
    assert_statements(&db.pool, oct, 60).await;
    let out = cli(&db.url, &[], &["jobs", "--json"]);
    assert_eq!(json_lines(&out)[0]["last_closed"], "2026-10-31");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_loan_makes_the_statements_recompute_only_the_member_its_deletion_entry_names() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month_alone(&db.pool, oct, 300, 1).await;
    run_month(&db.url, &[], SETTLEMENT, oct);
    run_month(&db.url, &[], STATEMENTS, oct);
    let before = statements_of(&db.pool, oct).await;
    let (loan, member, fine): (i64, i64, i64) = sqlx::query_as(
        "SELECT id, member_id::bigint, fine_cents FROM loans
          WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31' AND fine_cents > 0
          ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();

    // libraryd deletes a settled loan; the settlement takes its fine out (journal `deleted`).
    sqlx::query("DELETE FROM loans WHERE id = $1")
        .bind(loan)
        .execute(&db.pool)
        .await
        .unwrap();
    let report = run_month(&db.url, &[], SETTLEMENT, oct);
    assert_eq!(report["late_returns"].as_u64(), Some(1), "{report}");
    // The deletion's journal entry names the member whose money it took out (before 0.3.0 an
    // entry named none, and every member of the shard was computed again): that member alone.
    let named: Vec<Option<i64>> = sqlx::query_scalar(
        "SELECT member_id FROM fine_journal_entries WHERE loan_id = $1 AND kind = 'deleted'",
    )
    .bind(loan)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(named, vec![Some(member)]);
    let report = run_month(&db.url, &[], STATEMENTS, oct);
    assert_eq!(
        (report["scanned"].as_i64(), report["updated"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    let after = statements_of(&db.pool, oct).await;
    assert_statements(&db.pool, oct, 50).await;
    let old = before.iter().find(|s| s.0 == member).unwrap();
    let new = after.iter().find(|s| s.0 == member);
    let expected_new = (old.1 > 1).then_some((member, old.1 - 1, old.2 - fine));
    assert_eq!(new.copied(), expected_new);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_is_seen_by_every_replica_within_a_heartbeat_and_a_run_in_flight_stops_after_its_batch(
) {
    let db = test_db().await;
    let month = due_month();
    seed_month_alone(&db.pool, month, 200, 1).await;
    slow_updates(&db.pool, 0.25).await;
    let dir = tempfile::tempdir().unwrap();
    let (log_a, log_b) = (dir.path().join("a.log"), dir.path().join("b.log"));
    let mut env = FAST.to_vec();
    env.push(("SETTLEMENTD__BATCH__SIZE", "10"));
    let a = ServeProcess::start_logged(&db.url, &env, &log_a);
    let b = ServeProcess::start_logged(&db.url, &env, &log_b);
    let said = || logs(&[&log_a, &log_b]);
    let claim = || async {
        sqlx::query_as::<_, (String, i32, i64, Option<String>)>(
            "SELECT status, attempt, updated, last_error FROM job_runs
              WHERE job_name = $1 AND business_date = $2",
        )
        .bind(SETTLEMENT)
        .bind(month.date())
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    };

    // A replica is settling the month, a batch at a time.
    assert!(
        eventually(20, || async {
            matches!(claim().await, Some((s, _, updated, _)) if s == "RUNNING" && updated > 0)
        })
        .await,
        "{}",
        said()
    );
    let reason = "auditors are reading the month";
    let out = cli(&db.url, &[], &["pause", "--reason", reason]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let printed = String::from_utf8(out.stdout).unwrap();
    let printed: Vec<&str> = printed.lines().collect();
    assert_eq!(printed.len(), every_job().len(), "{printed:?}");
    assert!(printed[0].starts_with("fine-settlement paused since"));
    assert!(printed[1].starts_with("member-statements paused since"));
    let paused_at: DateTime<Utc> =
        sqlx::query_scalar("SELECT paused_at FROM job_pauses WHERE job_name = $1")
            .bind(SETTLEMENT)
            .fetch_one(&db.pool)
            .await
            .unwrap();

    // The run stops after its batch: FAILED, interrupted by the pause; what it committed stays.
    assert!(
        eventually(10, || async {
            claim().await.is_some_and(|c| c.0 == "FAILED")
        })
        .await,
        "{:?} {}",
        claim().await,
        said()
    );
    let (_, attempt, updated, error) = claim().await.unwrap();
    let error = error.unwrap_or_default();
    assert!(
        error.starts_with("interrupted:") && error.contains("paused") && error.contains(reason),
        "{error}"
    );
    assert_eq!(
        settled_count(&db.pool).await,
        updated,
        "its committed batches, and nothing more"
    );
    assert!(updated < eligible(&db.pool, month).await, "stopped mid-way");

    // Every replica sees the pause on its next tick.
    for serve in [&a, &b] {
        for job in [SETTLEMENT, STATEMENTS] {
            assert!(
                eventually(5, || async {
                    serve.metric_of("settlementd_paused", job).await == 1.0
                })
                .await,
                "{job} on {}: {}",
                serve.addr,
                said()
            );
        }
        assert_eq!(
            serve
                .metric_of("settlementd_paused_since_timestamp_seconds", SETTLEMENT)
                .await,
            paused_at.timestamp() as f64
        );
    }
    // `status` and the page say since when, who paused and why.
    let date = month.to_string();
    for job in [SETTLEMENT, STATEMENTS] {
        let out = cli(
            &db.url,
            &[],
            &["status", "--job", job, "--business-date", &date, "--json"],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
        let paused = json_of(&out)["watch"]["paused"].clone();
        assert_eq!(paused["reason"], reason, "{job}: {paused}");
        assert!(
            paused["paused_by"]
                .as_str()
                .unwrap_or("")
                .ends_with("(settlementd pause)"),
            "{job}: {paused}"
        );
    }
    let (_, page) = get(b.addr, "/status").await.unwrap();
    for needle in [
        r#"id="fine-settlement-paused""#,
        r#"id="member-statements-paused""#,
        "PAUSED since",
        reason,
    ] {
        assert!(page.contains(needle), "{needle}: {page}");
    }

    // Nothing is claimed while paused: three heartbeats later the row and the trail are as they
    // were.
    let trail = "SELECT count(*) FROM job_events";
    let (frozen, events) = (claim().await, count(&db.pool, trail).await);
    assert!(
        !eventually(3, || async { claim().await != frozen }).await,
        "claimed while paused: {:?}",
        claim().await
    );
    assert_eq!(count(&db.pool, trail).await, events);
    assert!(runs_of(&db.pool, STATEMENTS).await.is_empty());

    // Resumed: a replica takes the run over at once and finishes it; the statements follow.
    sql(&db.pool, "DROP TRIGGER slow_down ON loans").await;
    let out = cli(&db.url, &[], &["resume"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let printed = String::from_utf8(out.stdout).unwrap();
    assert!(
        printed.contains("fine-settlement resumed")
            && printed.contains("member-statements resumed"),
        "{printed}"
    );
    assert!(
        eventually(15, || async {
            claim().await.is_some_and(|c| c.0 == "SUCCESS")
        })
        .await,
        "{}",
        said()
    );
    assert_eq!(claim().await.unwrap().1, attempt + 1, "one takeover");
    assert!(
        eventually(15, || async {
            statuses(&db.pool, STATEMENTS, month).await == ["SUCCESS"]
        })
        .await,
        "{}",
        said()
    );
    assert_statements(&db.pool, month, 50).await;
    for serve in [&a, &b] {
        assert!(
            eventually(5, || async {
                serve.metric_of("settlementd_paused", SETTLEMENT).await == 0.0
            })
            .await
        );
    }
    drop((a, b));

    // The month is what a clean run makes of it.
    let clean = test_db().await;
    seed_month_alone(&clean.pool, month, 200, 1).await;
    settle_shards(&clean.pool, month, 1, 10).await;
    assert_eq!(
        settled_rows(&db.pool).await,
        settled_rows(&clean.pool).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_job_claims_nothing_and_run_names_who_paused_it_and_why() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month_alone(&db.pool, oct, 100, 1).await;
    let reason = "auditors are reading October";
    let out = cli(
        &db.url,
        &[],
        &["pause", "--job", SETTLEMENT, "--reason", reason],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let printed = String::from_utf8(out.stdout).unwrap();
    assert_eq!(printed.lines().count(), 1, "{printed}");
    assert!(
        printed.starts_with("fine-settlement paused since") && printed.contains(reason),
        "{printed}"
    );
    let paused = pauses(&db.pool).await;
    assert_eq!(paused.len(), 1, "{paused:?}");
    let paused_by = paused[0].1.clone();

    // A run is refused, exit 3, naming who paused the job and why; nothing is claimed.
    let out = cli(&db.url, &[], &["run", "--business-date", "2026-10-31"]);
    let line = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{line}");
    for needle in ["fine-settlement is paused", &paused_by, reason, "resume"] {
        assert!(line.contains(needle), "{needle}: {line}");
    }
    assert!(runs_of(&db.pool, SETTLEMENT).await.is_empty());
    assert_eq!(settled_count(&db.pool).await, 0);

    // Pausing again keeps the first pause; resuming twice is harmless.
    let out = cli(
        &db.url,
        &[],
        &["pause", "--job", SETTLEMENT, "--reason", "another"],
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(reason));
    assert_eq!(pauses(&db.pool).await, paused);
    let out = cli(&db.url, &[], &["resume", "--job", SETTLEMENT]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("fine-settlement resumed ("));
    let out = cli(&db.url, &[], &["resume", "--job", SETTLEMENT]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "fine-settlement was not paused"
    );
    run_month(&db.url, &[], SETTLEMENT, oct);
    assert_eq!(settled_count(&db.pool).await, eligible(&db.pool, oct).await);

    // Without --job: every job; a reason must say something.
    run_ok(settlementd(Some(&db.url)).args(["pause", "--reason", "year-end freeze"]));
    assert_eq!(pauses(&db.pool).await.len(), every_job().len());
    run_ok(settlementd(Some(&db.url)).args(["resume"]));
    assert!(pauses(&db.pool).await.is_empty());
    assert_refused(
        settlementd(Some(&db.url)).args(["pause", "--reason", "  "]),
        &["reason"],
    );
    assert!(pauses(&db.pool).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_resume_over_http_need_the_admin_token() {
    let db = test_db().await;
    let pause_body = r#"{"reason":"year-end freeze"}"#;

    // No token configured: the API is off.
    let (addr, stop, task) = http_server(&db.pool, None).await;
    for (path, body) in [("/v1/pause", pause_body), ("/v1/resume", "{}")] {
        let answer = post_admin(addr, path, None, body).await;
        assert_eq!(answer.status, 403, "{path}: {answer:?}");
    }
    stop.cancel();
    task.await.unwrap();

    let (addr, stop, task) = http_server(&db.pool, Some(TOKEN)).await;
    for (path, body) in [("/v1/pause", pause_body), ("/v1/resume", "{}")] {
        for auth in [None, Some("Bearer wrong-token-0123456789"), Some(TOKEN)] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("Authorization", a)).into_iter().collect();
            let answer = http(addr, "POST", path, &headers, body).await.unwrap();
            assert_eq!(answer.status, 401, "{path} {auth:?}: {answer:?}");
            assert_eq!(answer.header("www-authenticate"), Some("Bearer"));
        }
    }
    for (path, body, needle) in [
        ("/v1/pause", "not json", "invalid request body"),
        ("/v1/pause", "{}", "reason"),
        ("/v1/pause", r#"{"reason":"   "}"#, "reason"),
        (
            "/v1/pause",
            r#"{"reason":"x","jobs":["a"]}"#,
            "unknown field",
        ),
        (
            "/v1/pause",
            r#"{"job":"payroll","reason":"x"}"#,
            "unknown job",
        ),
        (
            "/v1/pause",
            r#"{"reason":"x","by":"  "}"#,
            "by must name who asks",
        ),
        ("/v1/resume", "not json", "invalid request body"),
        ("/v1/resume", r#"{"job":"payroll"}"#, "unknown job"),
        (
            "/v1/resume",
            r#"{"by":"a\u0007b"}"#,
            "by must name who asks",
        ),
    ] {
        let answer = post_admin(addr, path, None, body).await;
        assert_eq!(answer.status, 400, "{path} {body}: {answer:?}");
        let error = answer.json()["error"].as_str().unwrap().to_string();
        assert!(error.contains(needle), "{path} {body}: {error}");
    }
    assert!(pauses(&db.pool).await.is_empty());

    // One job by name.
    let answer = post_admin(
        addr,
        "/v1/pause",
        None,
        r#"{"job":"member-statements","reason":"statements are off","by":"alice"}"#,
    )
    .await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let paused = answer.json()["paused"].clone();
    assert_eq!(paused.as_array().map(Vec::len), Some(1), "{paused}");
    assert_eq!(
        (&paused[0]["job_name"], &paused[0]["reason"]),
        (&STATEMENTS.into(), &"statements are off".into())
    );
    assert!(
        paused[0]["paused_by"]
            .as_str()
            .unwrap()
            .starts_with("alice (POST /v1/pause on "),
        "{paused}"
    );
    // Every job: the statements keep their first pause.
    let answer = post_admin(addr, "/v1/pause", None, pause_body).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let reasons: Vec<(String, String)> = pauses(&db.pool)
        .await
        .into_iter()
        .map(|(job, _, reason)| (job, reason))
        .collect();
    // Every job paused; the statements kept their first pause's reason.
    let expected: Vec<(String, String)> = every_job()
        .into_iter()
        .map(|job| {
            let reason = if job == STATEMENTS {
                "statements are off"
            } else {
                "year-end freeze"
            };
            (job, reason.to_string())
        })
        .collect();
    let mut reasons = reasons;
    reasons.sort();
    let mut expected = expected;
    expected.sort();
    assert_eq!(reasons, expected);
    // Resume one, then (an empty body) every job.
    let answer = post_admin(addr, "/v1/resume", None, r#"{"job":"fine-settlement"}"#).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let resumed = answer.json()["resumed"].clone();
    assert_eq!(resumed[0]["job"], SETTLEMENT, "{resumed}");
    assert_eq!(resumed[0]["was_paused"]["reason"], "year-end freeze");
    assert_eq!(pauses(&db.pool).await.len(), every_job().len() - 1);
    let answer = post_admin(addr, "/v1/resume", None, "").await;
    assert_eq!(answer.status, 200, "{answer:?}");
    let resumed = answer.json()["resumed"].clone();
    assert_eq!(
        resumed.as_array().map(Vec::len),
        Some(every_job().len()),
        "{resumed}"
    );
    assert!(resumed[0]["was_paused"].is_null(), "{resumed}");
    assert_eq!(resumed[1]["was_paused"]["reason"], "statements are off");
    assert!(pauses(&db.pool).await.is_empty());
    // Each pause and resume stays in the audit trail, with who asked (the API's too).
    let history = settlementd::job_layer::pause::history(&db.pool, STATEMENTS, 10)
        .await
        .unwrap();
    let told: Vec<(&str, &str)> = history
        .iter()
        .map(|c| (c.event.as_str(), c.by.split(" (").next().unwrap_or("")))
        .collect();
    assert_eq!(
        told,
        [
            ("resumed", "an unnamed client of the token"),
            ("paused", "alice")
        ],
        "{history:?}"
    );
    stop.cancel();
    task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_of_24_months_runs_in_order_and_resumes_after_a_failure() {
    let db = test_db().await;
    let months: Vec<BusinessDate> = (0..24)
        .rev()
        .map(|n| bd("2026-09-30").months_before(n).unwrap())
        .collect();
    assert_eq!(months[0], bd("2024-10-31"));
    for (k, month) in months.iter().enumerate() {
        seed_month_alone(&db.pool, *month, 20, 1 + 1000 * k as i64).await;
    }
    let failing = months[12];
    assert_eq!(failing, bd("2025-10-31"));
    fail_updates_in(&db.pool, failing).await;
    let dates = |reports: &[serde_json::Value]| -> Vec<String> {
        reports
            .iter()
            .map(|r| r["business_date"].as_str().unwrap().to_string())
            .collect()
    };
    let all: Vec<String> = months.iter().map(|m| m.to_string()).collect();
    let range = ["run", "--from", "2024-10", "--to", "2026-09", "--json"];

    // The range stops at the failing month, a database error (exit 1), saying how to resume.
    let out = cli(&db.url, &[], &range);
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.trim().lines().last().unwrap_or("");
    for needle in [
        "stopped at 2025-10",
        "injected failure",
        "run the same command again",
        "--from 2024-10 --to 2026-09",
    ] {
        assert!(last.contains(needle), "{needle}: {stderr}");
    }
    let reports = json_lines(&out);
    assert_eq!(dates(&reports), all[..12]);
    assert!(
        reports
            .iter()
            .all(|r| r["job"] == SETTLEMENT && r["skipped"] == false),
        "{reports:?}"
    );
    let runs = runs_of(&db.pool, SETTLEMENT).await;
    assert_eq!(runs.len(), 13, "nothing after the failing month: {runs:?}");
    assert!(runs[..12].iter().all(|r| r.3 == "SUCCESS"), "{runs:?}");
    assert_eq!(
        (runs[12].0, runs[12].3.as_str()),
        (failing.date(), "FAILED")
    );
    assert!(
        runs[12]
            .5
            .as_deref()
            .unwrap_or("")
            .contains("injected failure"),
        "{runs:?}"
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM loans
              WHERE returned_on >= '2025-10-01' AND fine_settled_at IS NOT NULL"
        )
        .await,
        0
    );
    // In order: each month's claim started once the one before it had finished.
    let times: Vec<(DateTime<Utc>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT started_at, finished_at FROM job_runs WHERE job_name = $1 ORDER BY business_date",
    )
    .bind(SETTLEMENT)
    .fetch_all(&db.pool)
    .await
    .unwrap();
    for pair in times.windows(2) {
        assert!(pair[1].0 >= pair[0].1, "{pair:?}");
    }

    // Fixed, the same command resumes: the done months are skipped, the rest run.
    no_failures(&db.pool).await;
    let out = cli(&db.url, &[], &range);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let reports = json_lines(&out);
    assert_eq!(dates(&reports), all);
    assert!(reports[..12].iter().all(|r| r["skipped"] == true));
    assert!(reports[12..].iter().all(|r| r["skipped"] == false));
    assert_eq!(reports[12]["attempt"], 2, "the failed month taken over");
    let runs = runs_of(&db.pool, SETTLEMENT).await;
    assert_eq!(runs.len(), 24);
    assert!(runs.iter().all(|r| r.3 == "SUCCESS"), "{runs:?}");
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM loans WHERE returned_on IS NOT NULL AND fine_settled_at IS NULL"
        )
        .await,
        0
    );

    // The statements' range, by name, follows the closed months.
    let out = cli(
        &db.url,
        &[],
        &[
            "run", "--job", STATEMENTS, "--from", "2024-10", "--to", "2026-09", "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let reports = json_lines(&out);
    assert_eq!(dates(&reports), all);
    assert!(reports.iter().all(|r| r["job"] == STATEMENTS));
    for month in &months {
        assert_statements(&db.pool, *month, 50).await;
    }
    // Under 2 shards the settlement closed none of them: refused at the first month (exit 3).
    let out = cli(
        &db.url,
        &[],
        &[
            "run",
            "--job",
            STATEMENTS,
            "--from",
            "2024-10",
            "--to",
            "2026-09",
            "--all-shards",
            "--shards",
            "2",
            "--json",
        ],
    );
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("stopped at 2024-10") && stderr.contains("not ready"),
        "{stderr}"
    );
    assert!(json_lines(&out).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runs_api_takes_a_job_and_a_range() {
    let db = test_db().await;
    // Three months before every replica's lookback: only the request runs them.
    let latest = due_month();
    let months: Vec<BusinessDate> = [18, 17, 16]
        .map(|n| latest.months_before(n).unwrap())
        .to_vec();
    for (k, month) in months.iter().enumerate() {
        seed_month_alone(&db.pool, *month, 60, 1 + 1000 * k as i64).await;
    }
    let (from, to) = (ym(months[0]), ym(months[2]));
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let mut env = FAST.to_vec();
    env.push(("SETTLEMENTD__HTTP__ADMIN_TOKEN", TOKEN));
    let serve = ServeProcess::start_logged(&db.url, &env, &log);
    serve.wait_for("/healthz", 200).await;
    let stored = || async { count(&db.pool, "SELECT count(*) FROM run_requests").await };

    for (body, needle) in [
        (format!(r#"{{"from":"{from}"}}"#), "from and to"),
        (
            format!(
                r#"{{"business_date":"{}","from":"{from}","to":"{to}"}}"#,
                months[0]
            ),
            "not both",
        ),
        (format!(r#"{{"from":"{to}","to":"{from}"}}"#), "before"),
        (
            format!(r#"{{"job":"payroll","from":"{from}","to":"{to}"}}"#),
            "unknown job",
        ),
        (format!(r#"{{"from":"{from}","to":"2099-01"}}"#), "not over"),
        (format!(r#"{{"from":"{from}-15","to":"{to}"}}"#), "from"),
    ] {
        let answer = post_admin(serve.addr, "/v1/runs", Some("bad"), &body).await;
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
        let error = answer.json()["error"].as_str().unwrap().to_string();
        assert!(error.contains(needle), "{body}: {error}");
    }
    assert_eq!(stored().await, 0);

    // The settlement's range: one request, a child request per month, run in month order.
    let body = format!(r#"{{"job":"fine-settlement","from":"{from}","to":"{to}"}}"#);
    let answer = post_admin(serve.addr, "/v1/runs", Some("backfill-fines"), &body).await;
    assert_eq!(answer.status, 202, "{answer:?}");
    let accepted = answer.json();
    assert_eq!(
        (&accepted["job"], &accepted["from"], &accepted["to"]),
        (&SETTLEMENT.into(), &from.clone().into(), &to.clone().into()),
        "{accepted}"
    );
    let id = accepted["request_id"].as_str().unwrap().to_string();
    let served = |id: String| async move {
        let shown = get_request(serve.addr, &id).await;
        shown["months"].as_array().is_some_and(|months| {
            months.iter().all(|m| {
                m["shards"]
                    .as_array()
                    .is_some_and(|s| s.iter().all(|t| t["state"] == "succeeded"))
            })
        })
    };
    assert!(
        eventually(20, || served(id.clone())).await,
        "{} {}",
        get_request(serve.addr, &id).await,
        logs(&[&log])
    );
    let shown = get_request(serve.addr, &id).await;
    assert_eq!(shown["request"], accepted);
    let shown_months = shown["months"].as_array().unwrap();
    assert_eq!(shown_months.len(), 3, "{shown}");
    for (month, shown) in months.iter().zip(shown_months) {
        assert_eq!(shown["business_date"], month.to_string(), "{shown}");
        assert!(shown["request_id"].is_string(), "{shown}");
        assert_eq!(shown["shards"].as_array().map(Vec::len), Some(1), "{shown}");
        assert_eq!(
            (&shown["shards"][0]["shard"], &shown["shards"][0]["attempt"]),
            (&0.into(), &1.into()),
            "{shown}"
        );
    }
    let started: Vec<(NaiveDate, DateTime<Utc>)> = sqlx::query_as(
        "SELECT business_date, started_at FROM job_runs
          WHERE job_name = $1 AND business_date < $2 ORDER BY started_at",
    )
    .bind(SETTLEMENT)
    .bind(latest.months_before(12).unwrap().date())
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let order: Vec<NaiveDate> = started.iter().map(|(d, _)| *d).collect();
    assert_eq!(order, months.iter().map(|m| m.date()).collect::<Vec<_>>());
    for month in &months {
        assert_eq!(statuses(&db.pool, SETTLEMENT, *month).await, ["SUCCESS"]);
    }

    // The statements' range, by name.
    let body = format!(r#"{{"job":"member-statements","from":"{from}","to":"{to}"}}"#);
    let answer = post_admin(serve.addr, "/v1/runs", Some("backfill-statements"), &body).await;
    assert_eq!(answer.status, 202, "{answer:?}");
    assert_eq!(answer.json()["job"], STATEMENTS);
    let id = answer.json()["request_id"].as_str().unwrap().to_string();
    assert!(
        eventually(20, || served(id.clone())).await,
        "{} {}",
        get_request(serve.addr, &id).await,
        logs(&[&log])
    );
    for month in &months {
        assert_statements(&db.pool, *month, 50).await;
    }
    // A retry gets the first answer, byte for byte, and stores nothing.
    let requests_stored = stored().await;
    let again = post_admin(serve.addr, "/v1/runs", Some("backfill-statements"), &body).await;
    assert_eq!(
        (again.status, again.header("idempotent-replayed")),
        (202, Some("true"))
    );
    assert_eq!(again.body, answer.body);
    assert_eq!(stored().await, requests_stored);
    drop(serve);
}

/// Ages every claim, audit event and run request of every month but `except`, as if all of it
/// had happened 400 days ago.
async fn age_claims_except(pool: &PgPool, except: &[BusinessDate]) {
    let except: Vec<NaiveDate> = except.iter().map(|m| m.date()).collect();
    for aging in [
        "UPDATE job_runs SET started_at = started_at - interval '400 days',
                             heartbeat_at = heartbeat_at - interval '400 days',
                             finished_at = finished_at - interval '400 days'
          WHERE NOT business_date = ANY ($1)",
        "UPDATE job_events SET at = at - interval '400 days' WHERE NOT business_date = ANY ($1)",
        "UPDATE run_requests SET created_at = created_at - interval '400 days'
          WHERE NOT business_date = ANY ($1)",
    ] {
        sqlx::query(aging)
            .bind(&except)
            .execute(pool)
            .await
            .unwrap();
    }
}

/// Row counts of the tables retention may never touch, and the loans whole.
async fn money(pool: &PgPool) -> (Vec<i64>, Vec<(i64, i64, bool)>) {
    let mut counts = Vec::new();
    for query in [
        "SELECT count(*) FROM fine_journal",
        "SELECT count(*) FROM fine_adjustments",
        "SELECT count(*) FROM fine_corrections",
        // The months' pinned rules (a retention run, with no parameters, pins nothing).
        "SELECT count(*) FROM job_params",
        "SELECT count(*) FROM member_fine_statements",
        "SELECT count(*) FROM member_statement_marks",
    ] {
        counts.push(count(pool, query).await);
    }
    (counts, settled_rows(pool).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_only_months_closed_long_enough_and_never_the_money_records() {
    let db = test_db().await;
    let latest = due_month();
    let at = |n: u32| latest.months_before(n).unwrap();
    // Before the lookback: closed (statements too, one request served, one still pending),
    // corrected, failed, closed recently, closed with a return waiting. Inside it: closed.
    let (closed, corrected, failed, recent, waiting, inside) =
        (at(30), at(29), at(28), at(27), at(26), at(2));
    for (k, month) in [closed, corrected, failed, recent, waiting, inside]
        .iter()
        .enumerate()
    {
        seed_month_alone(&db.pool, *month, 30, 1 + 1000 * k as i64).await;
    }
    let served = store_request(&db.pool, "rerun-closed", SETTLEMENT, closed, None).await;
    serve_request(&db.pool, SETTLEMENT, &served, closed).await;
    let pending = store_request(&db.pool, "later-closed", SETTLEMENT, closed, None).await;
    run_month(&db.url, &[], STATEMENTS, closed);
    run_month(&db.url, &[], SETTLEMENT, corrected);
    let date = corrected.to_string();
    run_ok(settlementd(Some(&db.url)).env(RATE, "60").args([
        "correct",
        "--business-date",
        &date,
        "--key",
        "FIX-60",
        "--reason",
        "the rate was 60",
    ]));
    fail_updates_in(&db.pool, failed).await;
    let out = cli(
        &db.url,
        &[],
        &["run", "--business-date", &failed.to_string()],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    no_failures(&db.pool).await;
    for month in [recent, waiting, inside] {
        run_month(&db.url, &[], SETTLEMENT, month);
    }
    run_month(&db.url, &[], STATEMENTS, inside);
    // A return keyed into `waiting` after it closed, not settled yet.
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (900000, 1, 1, $1::date - 20, $1::date, $1::date + 5)",
    )
    .bind(waiting.first_day())
    .execute(&db.pool)
    .await
    .unwrap();
    age_claims_except(&db.pool, &[recent]).await;
    assert!(count(&db.pool, "SELECT count(*) FROM fine_adjustments").await > 0);

    let money_before = money(&db.pool).await;
    let audit = [
        "SELECT count(*) FROM job_events",
        "SELECT count(*) FROM job_runs",
        "SELECT count(*) FROM run_requests",
        "SELECT count(*) FROM run_request_shards",
    ];
    let mut audit_before = Vec::new();
    for query in audit {
        audit_before.push(count(&db.pool, query).await);
    }
    let of_period = |table: &str, job: &str, month: BusinessDate| {
        format!(
            "SELECT count(*) FROM {table} WHERE job_name = '{job}' AND business_date = '{month}'"
        )
    };
    let expected_periods = [
        (SETTLEMENT, closed),
        (STATEMENTS, closed),
        (SETTLEMENT, corrected),
    ];
    let mut expected = Vec::new();
    for (job, month) in expected_periods {
        let events = count(&db.pool, &of_period("job_events", job, month)).await;
        let runs = count(&db.pool, &of_period("job_runs", job, month)).await;
        let requests = if (job, month) == (SETTLEMENT, closed) {
            1
        } else {
            0
        };
        expected.push(serde_json::json!({
            "job_name": job,
            "business_date": month.to_string(),
            "events": events,
            "requests": requests,
            "runs": runs,
        }));
    }
    let total: i64 = expected
        .iter()
        .map(|p| {
            p["events"].as_i64().unwrap()
                + p["requests"].as_i64().unwrap()
                + p["runs"].as_i64().unwrap()
        })
        .sum();

    // A dry run says what it would delete, and deletes nothing.
    let out = cli(
        &db.url,
        &[],
        &["prune", "--older-than", "30", "--dry-run", "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let dry = json_of(&out);
    assert_eq!(dry["dry_run"], true, "{dry}");
    assert_eq!(dry["periods"], serde_json::json!(expected), "{dry}");
    assert!(dry["deleted"].is_null(), "{dry}");
    for (query, before) in audit.iter().zip(&audit_before) {
        assert_eq!(count(&db.pool, query).await, *before, "{query}");
    }

    // In batches of 2 rows, the periods go; everything else stays.
    let out = cli(
        &db.url,
        &[("SETTLEMENTD__BATCH__SIZE", "2")],
        &["prune", "--older-than", "30", "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let pruned = json_of(&out);
    assert_eq!(pruned["dry_run"], false, "{pruned}");
    assert_eq!(pruned["periods"], serde_json::json!(expected), "{pruned}");
    assert_eq!(pruned["deleted"].as_i64(), Some(total), "{pruned}");
    for (job, month) in expected_periods {
        for table in ["job_events", "job_runs"] {
            assert_eq!(
                count(&db.pool, &of_period(table, job, month)).await,
                0,
                "{table} {job} {month}"
            );
        }
    }
    let requests_left: Vec<String> =
        sqlx::query_scalar("SELECT request_id::text FROM run_requests")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(requests_left, [pending], "the served one is gone");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM run_request_shards").await,
        1
    );
    for (month, statuses_left) in [
        (failed, vec!["FAILED"]),
        (recent, vec!["SUCCESS"]),
        (waiting, vec!["SUCCESS"]),
        (inside, vec!["SUCCESS"]),
    ] {
        assert_eq!(
            statuses(&db.pool, SETTLEMENT, month).await,
            statuses_left,
            "{month}"
        );
    }
    assert_eq!(statuses(&db.pool, STATEMENTS, inside).await, ["SUCCESS"]);
    let money_after = money(&db.pool).await;
    assert_eq!(money_after.0, money_before.0, "rows of the money tables");
    assert!(money_after.1 == money_before.1, "the loans changed");
    // It ran as the day's retention job, in more batches than periods.
    let (status, batches): (String, i64) = sqlx::query_as(
        "SELECT status, scanned FROM job_runs
          WHERE job_name = 'retention' AND business_date = $1 AND shards = 1 AND shard = 0",
    )
    .bind(today())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(status, "SUCCESS");
    assert!(batches > 3, "{batches} batches");

    // Nothing is left to prune.
    let out = cli(&db.url, &[], &["prune", "--older-than", "30", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let again = json_of(&out);
    assert_eq!(
        (&again["periods"], &again["deleted"]),
        (&serde_json::json!([]), &0.into()),
        "{again}"
    );
}

/// Three months before the lookback, seeded alone, and a range request over them (key
/// `backfill`) served month by month as replicas serve it: the months, the range's id and its
/// child requests (month, id).
async fn a_served_range_of_three_old_months(
    pool: &PgPool,
) -> (Vec<BusinessDate>, String, Vec<(NaiveDate, String)>) {
    let latest = due_month();
    let months: Vec<BusinessDate> = [32, 31, 30]
        .map(|n| latest.months_before(n).unwrap())
        .to_vec();
    for (k, month) in months.iter().enumerate() {
        seed_month_alone(pool, *month, 20, 1 + 1000 * k as i64).await;
    }
    let range = store_request(pool, "backfill", SETTLEMENT, months[0], Some(months[2])).await;
    let children = requests::months_of(pool, &range).await.unwrap();
    assert_eq!(children.len(), 3);
    for (month, child) in &children {
        let month = BusinessDate::new(*month).unwrap();
        serve_request(pool, SETTLEMENT, child, month).await;
    }
    (months, range, children)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_a_range_request_only_with_every_month_it_ran() {
    let db = test_db().await;
    let (months, range, children) = a_served_range_of_three_old_months(&db.pool).await;
    let requests_left = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT request_id::text FROM run_requests ORDER BY business_date, parent_id NULLS FIRST",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };

    // The first two months closed long ago, the last one recently: the range stays whole until
    // its last month goes.
    age_claims_except(&db.pool, &[months[2]]).await;
    let out = cli(&db.url, &[], &["prune", "--older-than", "30", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    for month in &months[..2] {
        assert!(statuses(&db.pool, SETTLEMENT, *month).await.is_empty());
    }
    assert_eq!(statuses(&db.pool, SETTLEMENT, months[2]).await, ["SUCCESS"]);
    let left = requests_left().await;
    assert!(
        left.contains(&range) && left.contains(&children[2].1),
        "the range and its last month's request stay: {left:?}"
    );

    // Once its last month has closed long ago too, all of it goes.
    age_claims_except(&db.pool, &[]).await;
    let out = cli(&db.url, &[], &["prune", "--older-than", "30", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert!(
        requests_left().await.is_empty(),
        "{:?}",
        requests_left().await
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM run_request_shards").await,
        0
    );
}

/// `settlementd prune --older-than DAYS --json` (with `--dry-run` when `dry`) with `env`, which
/// must exit 0; its answer.
fn prune_json(url: &str, env: &[(&str, &str)], days: &str, dry: bool) -> serde_json::Value {
    let mut args = vec!["prune", "--older-than", days, "--json"];
    if dry {
        args.push("--dry-run");
    }
    let out = cli(url, env, &args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    json_of(&out)
}

/// The rows of job_events, job_runs and run_requests together: what `prune` counts and deletes.
async fn audit_rows(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT (SELECT count(*) FROM job_events) + (SELECT count(*) FROM job_runs)
              + (SELECT count(*) FROM run_requests)",
    )
    .await
}

/// The sum of a `prune --json` answer's per-period counts.
fn counted(answer: &serde_json::Value) -> i64 {
    answer["periods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            p["events"].as_i64().unwrap()
                + p["requests"].as_i64().unwrap()
                + p["runs"].as_i64().unwrap()
        })
        .sum()
}

/// The issue's race, made deterministic: the prune is stalled on a row lock of the month's audit
/// trail (held here), and meanwhile a late return re-opens the month and a run settles it. Once
/// the lock goes, the prune must see that the month is no longer closed long ago: its seconds-old
/// claim and its `late_returns`/`succeeded` events are kept, and so is everything else of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_re_opened_while_the_prune_waits_for_a_lock_is_kept_whole() {
    let db = test_db().await;
    let month = due_month().months_before(30).unwrap();
    seed_month_alone(&db.pool, month, 20, 1).await;
    run_month(&db.url, &[], SETTLEMENT, month);
    age_claims_except(&db.pool, &[]).await;
    let of_month = format!(
        "SELECT id FROM job_events WHERE job_name = '{SETTLEMENT}' AND business_date = '{month}'
          ORDER BY id"
    );
    let events_before: Vec<i64> = sqlx::query_scalar(&of_month)
        .fetch_all(&db.pool)
        .await
        .unwrap();

    // A row lock on the month's first event, held while the prune starts.
    let mut holder = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM job_events WHERE id = $1 FOR UPDATE")
        .bind(events_before[0])
        .execute(&mut *holder)
        .await
        .unwrap();
    let url = db.url.clone();
    let prune = tokio::task::spawn_blocking(move || {
        cli(&url, &[], &["prune", "--older-than", "30", "--json"])
    });
    let waiting = "SELECT count(*) FROM pg_stat_activity
                    WHERE datname = current_database() AND wait_event_type = 'Lock'";
    assert!(
        eventually(20, || async { count(&db.pool, waiting).await > 0 }).await,
        "the prune never waited for the lock"
    );

    // Meanwhile a late return re-opens the month, and a run settles it.
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (900000, 1, 1, $1::date - 20, $1::date, $1::date + 5)",
    )
    .bind(month.first_day())
    .execute(&db.pool)
    .await
    .unwrap();
    run_month(&db.url, &[], SETTLEMENT, month);
    let fresh = format!(
        "SELECT count(*) FROM job_events WHERE job_name = '{SETTLEMENT}'
            AND business_date = '{month}' AND event IN ('late_returns', 'succeeded')
            AND at > now() - interval '1 hour'"
    );
    assert_eq!(count(&db.pool, &fresh).await, 2);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    holder.commit().await.unwrap();

    let out = prune.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(statuses(&db.pool, SETTLEMENT, month).await, ["SUCCESS"]);
    assert_eq!(count(&db.pool, &fresh).await, 2, "the re-open's events");
    let events_after: Vec<i64> = sqlx::query_scalar(&of_month)
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert!(
        events_before.iter().all(|id| events_after.contains(id)),
        "older events of the re-opened month were deleted: {events_before:?} → {events_after:?}"
    );
    let settled: bool =
        sqlx::query_scalar("SELECT fine_settled_at IS NOT NULL FROM loans WHERE id = 900000")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(settled);
}

/// A range request's parent row goes with the last of its months: the dry run counts it there,
/// and its count is exactly what the prune then deletes (the issue: 67 counted, 68 deleted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_dry_run_counts_exactly_the_rows_the_prune_deletes_with_a_range_request() {
    let db = test_db().await;
    let latest = due_month();
    let (months, _, _) = a_served_range_of_three_old_months(&db.pool).await;
    // And a plain request, of a month of its own.
    let alone = latest.months_before(33).unwrap();
    seed_month_alone(&db.pool, alone, 20, 5000).await;
    let single = store_request(&db.pool, "run-one", SETTLEMENT, alone, None).await;
    serve_request(&db.pool, SETTLEMENT, &single, alone).await;
    run_month(&db.url, &[], STATEMENTS, months[2]);
    age_claims_except(&db.pool, &[]).await;
    let before = audit_rows(&db.pool).await;

    let dry = prune_json(&db.url, &[], "30", true);
    assert_eq!(
        audit_rows(&db.pool).await,
        before,
        "a dry run deletes nothing"
    );
    // The range's parent is counted with its last month: 1 child + the parent.
    let last = dry["periods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["job_name"] == SETTLEMENT && p["business_date"] == months[2].to_string())
        .cloned()
        .unwrap_or_else(|| panic!("{dry}"));
    assert_eq!(last["requests"], 2, "{dry}");

    let pruned = prune_json(&db.url, &[("SETTLEMENTD__BATCH__SIZE", "2")], "30", false);
    // What went: the audit rows before, less those after, less the prune's own claim and events.
    let own = count(
        &db.pool,
        "SELECT (SELECT count(*) FROM job_runs WHERE job_name = 'retention')
              + (SELECT count(*) FROM job_events WHERE job_name = 'retention')",
    )
    .await;
    let gone = before - (audit_rows(&db.pool).await - own);
    assert_eq!(pruned["deleted"].as_i64(), Some(gone), "{pruned}");
    assert_eq!(counted(&dry), gone, "dry run {dry} / prune {pruned}");
    assert_eq!(counted(&pruned), gone, "{pruned}");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM run_requests").await,
        0
    );
}

/// OPERATIONS promises that a request's `Idempotency-Key` replays days later: retention keeps
/// a run request (and its month) for at least `KEYS_KEPT_DAYS`, however small `--older-than`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_key_replays_for_thirty_days_whatever_older_than_says() {
    use settlementd::job_layer::retention::KEYS_KEPT_DAYS;
    let db = test_db().await;
    let month = due_month().months_before(30).unwrap();
    seed_month_alone(&db.pool, month, 20, 1).await;
    // The month settled for a request; then everything of it ages but the request, stored (and
    // its event written) `days` ago.
    let id = store_request(&db.pool, "ticket-4711", SETTLEMENT, month, None).await;
    serve_request(&db.pool, SETTLEMENT, &id, month).await;
    age_claims_except(&db.pool, &[]).await;
    let stored_days_ago = |days: u32| {
        let pool = db.pool.clone();
        let id = id.clone();
        async move {
            for sql in [
                "UPDATE run_requests SET created_at = now() - make_interval(days => $2)
                  WHERE request_id = $1::uuid",
                "UPDATE job_events SET at = now() - make_interval(days => $2)
                  WHERE request_id = $1::uuid",
            ] {
                sqlx::query(sql)
                    .bind(&id)
                    .bind(days as i32)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    };
    let replay = || async {
        let request = NewRequest {
            idempotency_key: "ticket-4711".into(),
            job_name: SETTLEMENT.into(),
            business_date: month.date(),
            to: None,
            shards: 1,
            shard: None,
            force: false,
        };
        let mut conn = db.pool.acquire().await.unwrap();
        requests::store(&mut conn, &request, "test", |_| "{}".into())
            .await
            .unwrap()
    };

    stored_days_ago(KEYS_KEPT_DAYS - 1).await;
    let kept = prune_json(&db.url, &[], "1", false);
    assert_eq!(kept["deleted"], 0, "{kept}");
    assert_eq!(statuses(&db.pool, SETTLEMENT, month).await, ["SUCCESS"]);
    match replay().await {
        Stored::Replay(stored) => assert_eq!(stored.request_id, id),
        other => panic!("the key no longer replays: {other:?}"),
    }

    stored_days_ago(KEYS_KEPT_DAYS + 1).await;
    let pruned = prune_json(&db.url, &[], "1", false);
    assert!(pruned["deleted"].as_i64().unwrap() > 0, "{pruned}");
    assert!(statuses(&db.pool, SETTLEMENT, month).await.is_empty());
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM run_requests").await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_retention_enabled_prunes_once_a_day_on_one_replica() {
    let db = test_db().await;
    let old = due_month().months_before(30).unwrap();
    seed_month_alone(&db.pool, old, 30, 1).await;
    run_month(&db.url, &[], SETTLEMENT, old);
    run_month(&db.url, &[], STATEMENTS, old);
    age_claims_except(&db.pool, &[]).await;
    let date = old.to_string();
    let to_delete = count(
        &db.pool,
        &format!(
            "SELECT (SELECT count(*) FROM job_events WHERE business_date = '{date}')
                  + (SELECT count(*) FROM job_runs WHERE business_date = '{date}')"
        ),
    )
    .await;
    assert!(to_delete > 0);

    let dir = tempfile::tempdir().unwrap();
    let (log_a, log_b) = (dir.path().join("a.log"), dir.path().join("b.log"));
    let mut env = FAST.to_vec();
    env.push(("SETTLEMENTD__RETENTION__ENABLED", "true"));
    env.push(("SETTLEMENTD__RETENTION__OLDER_THAN_DAYS", "30"));
    let a = ServeProcess::start_logged(&db.url, &env, &log_a);
    let b = ServeProcess::start_logged(&db.url, &env, &log_b);
    let said = || logs(&[&log_a, &log_b]);
    let old_rows = || async {
        count(
            &db.pool,
            &format!("SELECT count(*) FROM job_runs WHERE business_date = '{date}'"),
        )
        .await
    };
    assert!(
        eventually(20, || async { old_rows().await == 0 }).await,
        "{}",
        said()
    );
    let retention = || async {
        sqlx::query_as::<_, (NaiveDate, i32, i32, String, i32)>(
            "SELECT business_date, shards, shard, status, attempt FROM job_runs
              WHERE job_name = 'retention'",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let once = vec![(today(), 1, 0, "SUCCESS".to_string(), 1)];
    assert!(
        eventually(10, || async { retention().await == once }).await,
        "{:?} {}",
        retention().await,
        said()
    );
    // Both replicas tick on for three heartbeats: the day's run is not done again.
    assert!(
        !eventually(3, || async { retention().await != once }).await,
        "{:?}",
        retention().await
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM job_events WHERE job_name = 'retention' AND event = 'claimed'"
        )
        .await,
        1
    );
    // One replica deleted everything; the other nothing.
    let deleted = [
        a.metric("settlementd_retention_deleted_total").await,
        b.metric("settlementd_retention_deleted_total").await,
    ];
    assert_eq!(deleted.iter().sum::<f64>(), to_delete as f64, "{deleted:?}");
    assert!(deleted.contains(&0.0), "{deleted:?}");
    drop((a, b));
}

/// The CronJob form: one process per shard runs `run --all-jobs --wait`. Shard 0 starts alone: it
/// settles its shard, then its statements wait (not ready: shard 1 has not settled); shard 1
/// starts later, settles, writes its statements; shard 0's statements follow. Both exit 0 with one
/// JSON line per job, and the statements are the recompute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_all_jobs_wait_runs_every_job_and_the_statements_wait_for_every_shard() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 400, 1).await;
    let all_jobs = |shard: &str| {
        let mut cmd = settlementd(Some(&db.url));
        cmd.envs(FAST).args([
            "run",
            "--all-jobs",
            "--wait",
            "--json",
            "--business-date",
            "2026-10-31",
            "--shard",
            shard,
            "--shards",
            "2",
        ]);
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = all_jobs("0");
    // Shard 0's settlement is done and its statements are waiting before shard 1 starts.
    for _ in 0..300 {
        let settled = count(
            &db.pool,
            "SELECT count(*) FROM job_runs WHERE job_name = 'fine-settlement' AND status = 'SUCCESS'",
        )
        .await;
        if settled == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM job_runs WHERE job_name = 'member-statements'"
        )
        .await,
        0,
        "the statements claimed nothing before the settlement closed the month"
    );
    let second = all_jobs("1");
    for (shard, child) in [(0, first), (1, second)] {
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "shard {shard}: {}",
            stderr_of(&out)
        );
        let jobs: Vec<String> = json_lines(&out)
            .iter()
            .map(|r| r["job"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(jobs, every_job(), "shard {shard}");
    }
    assert_statements(&db.pool, month, 50).await;
}

/// `run` of the due month in the background while `pause --wait` is given once it has committed a
/// few batches: what was settled when `pause` returned, what at the end, and how long the run went
/// on after it. The heartbeat is the default (10 s): the run stops at its next batch, not at its
/// next heartbeat.
async fn pause_mid_run(batch_size: &str, loans: i64, slow_secs: f64) {
    let db = test_db().await;
    let month = due_month();
    seed_month_alone(&db.pool, month, loans, 1).await;
    if slow_secs > 0.0 {
        slow_updates(&db.pool, slow_secs).await;
    }
    let env = [("SETTLEMENTD__BATCH__SIZE", batch_size)];
    let date = month.to_string();
    let run = settlementd(Some(&db.url))
        .envs(env)
        .args(["run", "--business-date", &date, "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    assert!(
        eventually(60, || async { settled_count(&db.pool).await >= 3 }).await,
        "the run settles"
    );
    let reason = "finance asked to look first";
    let out = cli(
        &db.url,
        &[],
        &["pause", "--job", SETTLEMENT, "--reason", reason],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    // Once `pause` has returned, at most the batch already past its pause check commits.
    let at_pause = settled_count(&db.pool).await;
    let asked = std::time::Instant::now();
    let out = cli(&db.url, &[], &["pause", "--reason", reason, "--wait"]);
    let paused_in = asked.elapsed();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    // `--wait` returned: nothing of the job runs any more.
    let at_return = settled_count(&db.pool).await;
    let size: i64 = batch_size.parse().unwrap();
    assert!(
        at_return - at_pause <= size,
        "{} loans settled after pause returned, more than the batch in flight ({size})",
        at_return - at_pause
    );
    let status: String = sqlx::query_scalar("SELECT status FROM job_runs WHERE job_name = $1")
        .bind(SETTLEMENT)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(status, "FAILED", "pause --wait returned while the run ran");
    let run = run.wait_with_output().unwrap();
    let after = settled_count(&db.pool).await;
    assert_eq!(
        after, at_return,
        "a batch committed after pause --wait returned"
    );
    assert!(after < eligible(&db.pool, month).await, "stopped mid-way");

    // The run says it was stopped, and how much it wrote: exit 4, distinct from a refusal (3).
    assert_eq!(run.status.code(), Some(4), "{}", stderr_of(&run));
    let json: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(json["stopped"], "paused", "{json}");
    assert_eq!(json["updated"], after, "{json}");
    assert_eq!(json["reason"], reason, "{json}");
    let batches = json["paused_after_batches"].as_u64().unwrap();
    assert!(batches >= 1, "{json}");
    let line = stderr_of(&run);
    assert!(
        line.contains(&format!("stopped after {batches} committed batch")),
        "{line}"
    );

    // A pause shown as a pause, in the schedule's zone (issue 48 item 5: a red FAILED with the
    // error's UTC time beside the page's +08:00): `status` and the page, while it lasts.
    let out = cli(&db.url, &[], &["status", "--business-date", &date]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let shard = text
        .lines()
        .find(|l| l.starts_with("0 "))
        .unwrap_or_else(|| panic!("no shard line: {text}"));
    assert!(
        shard.contains(" PAUSED ")
            && shard.contains("stopped by the pause after its last committed batch"),
        "{text}"
    );
    assert!(
        !text.contains(" UTC") && text.contains("PAUSED since "),
        "{text}"
    );
    assert!(
        text.lines()
            .filter(|l| l.starts_with("PAUSED since ") || l.starts_with("  shard "))
            .all(|l| l.contains(" +08:00")),
        "every time in the schedule's zone: {text}"
    );
    let replica = ServeProcess::start(&db.url, &[]);
    replica.wait_for("/healthz", 200).await;
    let (_, page) = get(
        replica.addr,
        &format!("/status?business_date={date}&shards=1"),
    )
    .await
    .unwrap();
    let cell = crate::status::text_of(&page, &format!("cell-{date}-0"));
    assert!(
        cell.starts_with("PAUSED attempt 1")
            && cell.contains("stopped by the pause after its last committed batch")
            && !cell.contains("is paused since"),
        "{cell}"
    );
    assert!(!page.contains(" UTC"), "one zone on the page: {page}");
    drop(replica);

    // The pause and the resume stay in the audit trail: who, why, when.
    let resumed = cli(&db.url, &[], &["resume", "--job", SETTLEMENT]);
    assert_eq!(resumed.status.code(), Some(0), "{}", stderr_of(&resumed));
    let history = settlementd::job_layer::pause::history(&db.pool, SETTLEMENT, 10)
        .await
        .unwrap();
    let events: Vec<&str> = history.iter().map(|c| c.event.as_str()).collect();
    assert_eq!(events, ["resumed", "paused"], "{history:?}");
    assert!(
        history[1].by.ends_with("(settlementd pause)"),
        "{history:?}"
    );
    assert_eq!(history[1].message.as_deref(), Some(reason));
    assert!(
        history[0].by.ends_with("(settlementd resume)"),
        "{history:?}"
    );
    assert!(
        history[0].message.as_deref().unwrap_or("").contains(reason),
        "{history:?}"
    );
    eprintln!(
        "batch size {batch_size}: {} loans settled after pause returned; pause --wait returned \
         {:.2} s after it was asked; {after} loans settled in {batches} batches",
        at_return - at_pause,
        paused_in.as_secs_f64(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_stops_a_run_at_its_next_batch_and_run_says_how_much_it_wrote_at_batch_size_1() {
    pause_mid_run("1", 200, 0.05).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_stops_a_run_at_its_next_batch_at_the_default_batch_size() {
    pause_mid_run("10000", 60_000, 0.0).await;
}

/// With both jobs paused, `run --job member-statements` of a month the settlement has not closed
/// names every refusal that applies: the month not closed, the settlement's pause and the
/// statements' own, each with who paused it and how to resume. Nothing is claimed.
#[tokio::test]
async fn a_refused_run_names_every_refusal_that_applies_both_pauses_included() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2026-10-31"), 20, 1).await;
    pause_settlement(&db.url, "libraryd is being reloaded");
    let out = cli(
        &db.url,
        &[],
        &[
            "pause",
            "--job",
            STATEMENTS,
            "--reason",
            "statements redesign",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let out = cli(
        &db.url,
        &[],
        &["run", "--job", STATEMENTS, "--business-date", "2026-10-31"],
    );
    let line = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{line}");
    assert_eq!(line.trim().lines().count(), 1, "{line}");
    for needle in [
        "is not ready",
        "fine-settlement 2026-10-31 is not closed: SUCCESS on 0 of its 1 shard, 1 shard never \
         claimed under this shard count",
        "fine-settlement is paused since",
        "libraryd is being reloaded",
        "member-statements itself is paused since",
        "statements redesign",
        "settlementd resume --job member-statements",
    ] {
        assert!(line.contains(needle), "{needle}: {line}");
    }
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM job_runs").await,
        0,
        "nothing claimed"
    );
}

/// Adds the settlement's claim of `month`'s `shard` of `shards` with `status`, held by a live
/// owner that is not this test's.
async fn leader_claim(pool: &PgPool, month: BusinessDate, shards: i32, shard: i32, status: &str) {
    sqlx::query(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at)
         VALUES ($1, $2, $3, $4, $5, 1, 'peer-0/1-0000abcd', clock_timestamp(), clock_timestamp())",
    )
    .bind(SETTLEMENT)
    .bind(month.date())
    .bind(shards)
    .bind(shard)
    .bind(status)
    .execute(pool)
    .await
    .unwrap();
}

/// Issue 48: member-statements said "has no SUCCESS claim … (never run, or pruned by retention):
/// run it first" of a month whose settlement shards were claimed and RUNNING (re-opened for late
/// returns) or FAILED. What it says now is what the claims are, and what closes the month.
#[tokio::test]
async fn a_month_the_leader_has_not_closed_is_said_as_its_shards_are_running_failed_or_missing() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    let closed = || async {
        settlementd::job_layer::due::closed(&db.pool, SETTLEMENT, month.date(), 3)
            .await
            .unwrap()
            .expect("not closed")
    };
    let why = closed().await;
    assert!(
        why.contains("SUCCESS on 0 of its 3 shards, 3 shards never claimed under this shard count")
            && why.contains("run it, `settlementd run --job fine-settlement --from 2026-10"),
        "{why}"
    );
    for shard in 0..3 {
        leader_claim(&db.pool, month, 3, shard, "RUNNING").await;
    }
    let why = closed().await;
    assert!(
        why.contains("SUCCESS on 0 of its 3 shards, 3 shards RUNNING; it closes when they finish"),
        "{why}"
    );
    for wrong in ["never", "run it", "no SUCCESS claim"] {
        assert!(!why.contains(wrong), "{wrong}: {why}");
    }
    sqlx::query(
        "UPDATE job_runs SET status = CASE shard WHEN 0 THEN 'SUCCESS' ELSE 'FAILED' END
          WHERE shard < 2",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let why = closed().await;
    assert!(
        why.contains(
            "SUCCESS on 1 of its 3 shards, 1 shard RUNNING, 1 shard FAILED; its replicas run"
        ),
        "{why}"
    );
    sqlx::query("UPDATE job_runs SET status = 'SUCCESS'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        settlementd::job_layer::due::closed(&db.pool, SETTLEMENT, month.date(), 3)
            .await
            .unwrap(),
        None
    );
}

/// Issue 48: a replica of the statements logged why a month was not ready at every tick (9 times
/// in the issue's run). It says it once, and again only when it changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_says_once_why_a_followed_month_is_not_ready_not_at_every_tick() {
    let db = test_db().await;
    let month = due_month();
    // The settlement's one shard is claimed by a live peer: the statements' month is not ready.
    leader_claim(&db.pool, month, 1, 0, "RUNNING").await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("replica.log");
    let replica = ServeProcess::start_logged(
        &db.url,
        &[
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "60"),
            ("SETTLEMENTD__SCHEDULE__CATCH_UP", "true"),
        ],
        &log,
    );
    replica.wait_for("/readyz", 200).await;
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let text = std::fs::read_to_string(&log).unwrap();
    // The statements' lines (a job added by docs/ADDING-A-JOB.md follows the settlement too, and
    // says so once as well).
    let job = format!("\"job\":\"{STATEMENTS}\"");
    let said: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("not ready: ") && l.contains(&job))
        .collect();
    assert_eq!(said.len(), 1, "{said:#?}\n{text}");
    assert!(said[0].contains("1 shard RUNNING"), "{}", said[0]);
    assert!(
        said[0].contains(&format!("\"business_date\":\"{month}\"")),
        "{}",
        said[0]
    );
    assert!(
        runs_of(&db.pool, STATEMENTS).await.is_empty(),
        "the statements claimed nothing"
    );
}
