//! Tests: `settlementd demo` through the real binary, and `seed` (library and binary).

use crate::helpers::{self, bd};
use settlementd::seed::{seed_loans, SeedSpec};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Output, Stdio};

/// Directories of temporary clusters started by process `pid` (`settlementd-pg-<pid>-...`).
fn clusters_of(pid: u32) -> Vec<String> {
    let prefix = format!("settlementd-pg-{pid}-");
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|name| name.starts_with(&prefix))
        .collect()
}

/// Runs the command to completion and returns its output with its pid.
fn run(mut cmd: Command) -> (u32, Output) {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start settlementd");
    let pid = child.id();
    (pid, child.wait_with_output().unwrap())
}

/// The `key=value` numbers of the line starting with `prefix`.
fn numbers(stdout: &str, prefix: &str) -> Vec<(String, i64)> {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix:?} in:\n{stdout}"));
    line.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
        .collect()
}

fn value(pairs: &[(String, i64)], key: &str) -> i64 {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("no {key}= in {pairs:?}"))
        .1
}

#[test]
fn demo_tells_the_story_exits_0_and_removes_its_cluster() {
    let mut cmd = helpers::settlementd(None);
    cmd.arg("demo");
    let (pid, out) = run(cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.contains(&"first acquire=1"), "{stdout}");
    assert!(lines.contains(&"second acquire=0"), "{stdout}");

    let naive = numbers(&stdout, "naive marker ");
    let (naive_first, zero_fines) = (value(&naive, "first"), value(&naive, "second"));
    assert!(zero_fines > 0, "the trap rescans zero-fine rows: {stdout}");
    assert!(zero_fines < naive_first);

    let forced = numbers(&stdout, "forced rerun ");
    assert_eq!(
        value(&forced, "first"),
        naive_first,
        "round 1 settles every returned loan"
    );
    assert_eq!(value(&forced, "second"), 0, "{stdout}");
    assert_eq!(value(&forced, "totalFirst"), value(&forced, "totalSecond"));
    assert!(value(&forced, "totalFirst") > 0);
    // Round 4: the two late returns are settled; round 5: the stale rule is refused, nothing moves.
    assert!(
        lines.contains(&"late returns keyed=2 settled=2 left=0"),
        "{stdout}"
    );
    assert!(
        lines.contains(
            &"rule conflict exit=3 unchanged=true (the month stays under the rule its first claim pinned)"
        ),
        "{stdout}"
    );
    // Round 6: the statements follow the late return for the one member it concerns; round 7: an
    // edit of a settled loan is re-priced on the record, and the month proves right.
    assert!(
        stdout.contains(
            "statements re-opened for 3 shard(s): member 7: fines=1 fine_cents=500; other \
             statements rewritten=0"
        ),
        "{stdout}"
    );
    assert!(
        stdout.contains("journal settled, repriced (cents 0 -> 750 -> 900)"),
        "{stdout}"
    );
    assert!(
        lines.contains(
            &"verify 2026-10: right (every settled fine is its journal entry's and the pinned rule's)"
        ),
        "{stdout}"
    );
    // On a machine without a server, the process that fetches PostgreSQL says so in one line.
    let noise = stderr
        .lines()
        .filter(|l| !l.contains("fetching PostgreSQL"));
    assert_eq!(noise.count(), 0, "no log noise on stderr: {stderr}");
    assert_eq!(clusters_of(pid), Vec::<String>::new());
}

#[test]
fn demo_interrupted_by_ctrl_c_stops_and_removes_its_cluster() {
    let mut child = helpers::settlementd(None)
        .arg("demo")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(stdout.read_line(&mut line).unwrap() > 0, "demo ended early");
        if line.starts_with("first acquire=") {
            break;
        }
    }
    // SAFETY: kill(2) on our own child, which has not been waited for.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGINT) }, 0);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(1), "{rest}\n{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert!(!rest.contains("forced rerun"), "{rest}");
    assert_eq!(clusters_of(pid), Vec::<String>::new());
}

type LoanRow = (
    i64,
    i64,
    i64,
    chrono::NaiveDate,
    chrono::NaiveDate,
    Option<chrono::NaiveDate>,
    i64,
);

async fn all_loans(pool: &sqlx::PgPool) -> Vec<LoanRow> {
    sqlx::query_as(
        "SELECT id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents
           FROM loans ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn seed_gives_identical_rows_for_the_same_seed() {
    let spec = SeedSpec::new(3000, bd("2026-10-31"), 7);
    let (a, b) = (helpers::test_db().await, helpers::test_db().await);
    seed_loans(&a.pool, &spec, |_| {}).await.unwrap();
    seed_loans(&b.pool, &spec, |_| {}).await.unwrap();
    let rows = all_loans(&a.pool).await;
    assert_eq!(rows.len(), 3000);
    assert_eq!(rows, all_loans(&b.pool).await);

    let other = helpers::test_db().await;
    seed_loans(&other.pool, &SeedSpec { seed: 8, ..spec }, |_| {})
        .await
        .unwrap();
    assert_ne!(rows, all_loans(&other.pool).await);
}

#[tokio::test]
async fn seed_has_the_seed_chapters_shape() {
    let db = helpers::test_db().await;
    let month = bd("2026-10-31");
    let summary = seed_loans(&db.pool, &SeedSpec::new(6000, month, 42), |_| {})
        .await
        .unwrap();
    assert_eq!(
        (summary.loans, summary.first_id, summary.last_id),
        (6000, 1, 6000)
    );

    let (total, returned, in_month, on_time, max_late, min_late_of_late): (
        i64,
        i64,
        i64,
        i64,
        i32,
        i32,
    ) = sqlx::query_as(
        "SELECT count(*),
                count(returned_on),
                count(*) FILTER (WHERE returned_on BETWEEN $1 AND $2),
                count(*) FILTER (WHERE returned_on <= due_on),
                COALESCE(max(returned_on - due_on), 0),
                COALESCE(min(returned_on - due_on) FILTER (WHERE returned_on > due_on), 1)
           FROM loans",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(total, 6000);
    assert_eq!(
        returned, in_month,
        "every returned loan is returned in the month"
    );
    assert_eq!(returned as u64, summary.returned);
    assert_eq!(on_time as u64, summary.on_time);
    let returned_share = returned as f64 / total as f64;
    assert!((0.87..=0.93).contains(&returned_share), "{returned_share}");
    let on_time_share = on_time as f64 / returned as f64;
    assert!((0.25..=0.31).contains(&on_time_share), "{on_time_share}");
    assert!(
        max_late <= 60 && min_late_of_late >= 1,
        "{min_late_of_late}..{max_late}"
    );
    let untouched: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_cents <> 0 OR fine_settled_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(untouched, 0, "seeded loans are unsettled");
}

#[tokio::test]
async fn seeding_again_appends_after_the_existing_ids() {
    let db = helpers::test_db().await;
    let month = bd("2026-10-31");
    helpers::seed_month(&db.pool, month, 100, 500).await; // ids 500..=601
    let first = seed_loans(&db.pool, &SeedSpec::new(50, month, 1), |_| {})
        .await
        .unwrap();
    assert_eq!((first.first_id, first.last_id), (602, 651));
    let second = seed_loans(&db.pool, &SeedSpec::new(50, month, 1), |_| {})
        .await
        .unwrap();
    assert_eq!((second.first_id, second.last_id), (652, 701));
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM loans")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 202);
}

#[tokio::test]
async fn seed_command_migrates_a_fresh_database_and_prints_one_line() {
    let (_name, url) = helpers::empty_db().await;
    let mut cmd = helpers::settlementd(Some(&url));
    cmd.args([
        "seed", "--loans", "250", "--month", "2026-10", "--seed", "3",
    ]);
    let out = tokio::task::spawn_blocking(move || run(cmd).1)
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stdout.starts_with("seeded 250 loans for 2026-10 (ids 1..250) in "),
        "{stdout}"
    );
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    assert_eq!(all_loans(&pool).await.len(), 250);
    pool.close().await;
}

#[test]
fn seed_rejects_zero_loans_and_bad_months_with_exit_2() {
    for (args, expected) in [
        (&["seed", "--loans", "0"][..], "at least 1"),
        (
            &["seed", "--loans", "10", "--month", "2026-13"][..],
            "2026-13",
        ),
        (&["seed", "--loans", "1000000000000"][..], "limit"),
    ] {
        let mut cmd = helpers::settlementd(None);
        cmd.args(args);
        let (_, out) = run(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}
