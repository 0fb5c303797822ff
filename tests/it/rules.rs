//! Settled means right (issue 22), with real `settlementd` processes: one fine rule per month,
//! pinned by its first claim; late returns settled by `run` and by the replicas' sweep; `verify`
//! proves a month; `correct` changes one on the record, once per key.

use crate::helpers::*;
use settlementd::calendar::BusinessDate;
use settlementd::fine::FineRule;
use settlementd::job_layer::events;
use settlementd::jobs::fine_settlement;
use sqlx::PgPool;
use std::time::{Duration, Instant};

const RATE: &str = "SETTLEMENTD__FINE__DAILY_RATE_CENTS";

fn rule(rate: i64) -> FineRule {
    FineRule {
        daily_rate_cents: rate,
        ..FineRule::default()
    }
}

fn run_shard(
    url: &str,
    env: &[(&str, &str)],
    month: BusinessDate,
    shard: u32,
    shards: u32,
) -> std::process::Output {
    let (month, shard, shards) = (month.to_string(), shard.to_string(), shards.to_string());
    cli(
        url,
        env,
        &[
            "run",
            "--business-date",
            &month,
            "--shard",
            &shard,
            "--shards",
            &shards,
            "--json",
        ],
    )
}

/// Loans returned into `month` after it was settled: `ids`, each returned 12 days late.
async fn key_in_late_returns(pool: &PgPool, month: BusinessDate, ids: &[i64]) {
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT id, 7, 7, $1::date - 40, $1::date - 2, $1::date + 10 FROM unnest($2::bigint[]) id",
    )
    .bind(month.first_day())
    .bind(ids)
    .execute(pool)
    .await
    .unwrap();
}

async fn unsettled_in(pool: &PgPool, month: BusinessDate) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn events_named(pool: &PgPool, month: BusinessDate, event: &str) -> Vec<events::JobEvent> {
    let mut found = Vec::new();
    for shards in 1..=2 {
        for shard in 0..shards {
            let key = fine_settlement::key(
                month,
                settlementd::config::ShardSpec::new(shard, shards).unwrap(),
            );
            found.extend(
                events::for_key(pool, &key)
                    .await
                    .unwrap()
                    .into_iter()
                    .filter(|e| e.event == event),
            );
        }
    }
    found
}

/// A replica of shard `shard` of 2 with a one-second heartbeat and retries every second.
fn quick_replica(
    url: &str,
    shard: &str,
    extra: &[(&str, &str)],
    log: &std::path::Path,
) -> ServeProcess {
    let mut env = vec![
        ("SETTLEMENTD__SHARD__INDEX", shard),
        ("SETTLEMENTD__SHARD__COUNT", "2"),
        ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
        ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
        ("SETTLEMENTD__RETRY__INITIAL_SECS", "1"),
        ("SETTLEMENTD__RETRY__MAX_SECS", "1"),
    ];
    env.extend_from_slice(extra);
    ServeProcess::start_logged(url, &env, log)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_rule_settles_nothing_of_the_month_and_finishes_it_once_its_config_agrees(
) {
    let db = test_db().await;
    let month = due_month();
    seed_month_alone(&db.pool, month, 400, 1).await;

    // Shard 0 settles the month under 37 cents a day: the month is pinned to that rule.
    let out = run_shard(&db.url, &[(RATE, "37")], month, 0, 2);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(json_of(&out)["rule"]["daily_rate_cents"], 37);

    // Shard 1 on a stale configuration (99 cents) is refused: exit 3, one line naming the month,
    // the pinned rule and its own; nothing of its shard is settled.
    let before = settled_rows(&db.pool).await;
    let out = run_shard(&db.url, &[(RATE, "99")], month, 1, 2);
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    let line = stderr_of(&out);
    assert_eq!(line.trim_end().lines().count(), 1, "{line}");
    for needle in [
        month.to_string().as_str(),
        "pinned to 37 cents a day",
        "this replica's is 99 cents a day",
    ] {
        assert!(line.contains(needle), "{needle}: {line}");
    }
    assert!(out.stdout.is_empty());
    assert_eq!(settled_rows(&db.pool).await, before);
    // Forcing does not get around it, for a settled shard either.
    let forced = cli(
        &db.url,
        &[(RATE, "99")],
        &[
            "run",
            "--business-date",
            &month.to_string(),
            "--shard",
            "0",
            "--shards",
            "2",
            "--force",
        ],
    );
    assert_eq!(forced.status.code(), Some(3), "{}", stderr_of(&forced));
    assert_eq!(settled_rows(&db.pool).await, before);

    // A serve replica on the stale configuration: refused at every retry, logged once, counted,
    // shown in red, while it keeps serving its probes.
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("stale.log");
    let stale = quick_replica(&db.url, "1", &[(RATE, "99")], &log);
    stale.wait_for("/healthz", 200).await;
    // Not ready from its first answer on (starting, then the conflict): a rolling update stops at
    // this pod instead of going on to the next.
    let mut answers = Vec::new();
    loop {
        let answer = get(stale.addr, "/readyz").await.unwrap();
        let conflict = answer.1.contains("rule conflict");
        answers.push(answer);
        if conflict || answers.len() > 400 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        answers.iter().all(|(status, _)| *status == 503),
        "never ready: {answers:?}"
    );
    let (_, reason) = answers.last().unwrap();
    for needle in [
        "not ready: rule conflict: fine-settlement shard 1 of 2 cannot settle",
        "pinned to 37 cents a day",
        "this replica's rule is 99 cents a day",
    ] {
        assert!(reason.contains(needle), "{needle}: {reason}");
    }
    let (_, metrics) = get(stale.addr, "/metrics").await.unwrap();
    assert!(
        metrics.contains("settlementd_not_ready{reason=\"rule_conflict\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("settlementd_ready 0"), "{metrics}");
    assert!(
        eventually(20, || async {
            stale.metric("settlementd_rule_conflicts_total").await >= 3.0
        })
        .await,
        "the replica retries the month with its backoff"
    );
    assert_eq!(get(stale.addr, "/readyz").await.unwrap().0, 503);
    // A request over HTTP is refused the same way: its shard fails with the reason.
    let token = "0123456789abcdef0123456789abcdef";
    let api = ServeProcess::start(
        &db.url,
        &[
            ("SETTLEMENTD__SHARD__INDEX", "0"),
            ("SETTLEMENTD__SHARD__COUNT", "2"),
            ("SETTLEMENTD__HTTP__ADMIN_TOKEN", token),
            (RATE, "99"),
        ],
    );
    api.wait_for("/healthz", 200).await;
    let auth = format!("Bearer {token}");
    let answer = http(
        api.addr,
        "POST",
        "/v1/runs",
        &[("Authorization", &auth), ("Idempotency-Key", "stale-force")],
        &format!(
            "{{\"business_date\": \"{month}\", \"shards\": 2, \"shard\": 0, \"force\": true}}"
        ),
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 202, "{}", answer.body);
    let status_url = answer.json()["status_url"].as_str().unwrap().to_string();
    let mut shown = serde_json::Value::Null;
    for _ in 0..300 {
        let answer = http(
            api.addr,
            "GET",
            &status_url,
            &[("Authorization", &auth)],
            "",
        )
        .await
        .unwrap();
        shown = answer.json();
        if shown["shards"][0]["state"] == "failed" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(shown["shards"][0]["state"], "failed", "{shown}");
    assert!(
        shown["shards"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("pinned to 37 cents a day"),
        "{shown}"
    );
    drop(api);
    assert_eq!(settled_rows(&db.pool).await, before);
    let page = stale.wait_for("/status", 200).await;
    let cell_start = page
        .find(&format!("id=\"fine-settlement-cell-{month}-1\""))
        .expect("shard 1's cell");
    let cell = &page[cell_start..cell_start + page[cell_start..].find("</td>").unwrap()];
    assert!(
        cell.contains("class=\"error conflict\"") && cell.contains("rule conflict"),
        "{cell}"
    );
    let status = cli(
        &db.url,
        &[(RATE, "37")],
        &[
            "status",
            "--business-date",
            &month.to_string(),
            "--shards",
            "2",
            "--json",
        ],
    );
    let status = json_of(&status);
    assert!(status["runs"][1]["rule_conflict"].is_string(), "{status}");
    assert_eq!(status["rule"]["daily_rate_cents"], 37);
    drop(stale);
    let logged = std::fs::read_to_string(&log).unwrap();
    let conflict_lines = logged
        .lines()
        .filter(|l| l.contains("rule conflict") && !l.contains("not ready"))
        .count();
    assert_eq!(conflict_lines, 1, "logged once per month:\n{logged}");
    let not_ready_lines = logged
        .lines()
        .filter(|l| l.contains("not ready: rule conflict"))
        .count();
    assert_eq!(
        not_ready_lines, 1,
        "readiness logged once per change:\n{logged}"
    );
    // The cron scheduler's routine messages stay out of an operator's log.
    assert!(!logged.contains("tokio_cron_scheduler"), "{logged}");
    assert!(events_named(&db.pool, month, "rule_conflict").await.len() >= 3);
    assert_eq!(settled_rows(&db.pool).await, before);

    // The rolling update reaches it: the same replica with the month's rule finishes the month.
    let fixed = quick_replica(&db.url, "1", &[(RATE, "37")], &log);
    assert!(
        eventually(20, || async { unsettled_in(&db.pool, month).await == 0 }).await,
        "the fixed replica settles shard 1"
    );
    fixed.wait_for("/readyz", 200).await;
    drop(fixed);
    assert_priced_under(&db.pool, month, rule(37)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_a_closed_month_settles_its_late_returns_under_the_pinned_rule() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 300, 1).await;
    for shard in 0..2 {
        let out = run_shard(&db.url, &[(RATE, "41")], month, shard, 2);
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    }
    // Two returns keyed in after the month closed, one per shard.
    key_in_late_returns(&db.pool, month, &[100_000, 100_001]).await;
    let out = run_shard(&db.url, &[(RATE, "41")], month, 1, 2);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let report = json_of(&out);
    assert_eq!(report["skipped"], false, "{report}");
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    assert_eq!(report["attempt"], 2);
    let late = events_named(&db.pool, month, "late_returns").await;
    assert_eq!(late.len(), 1);
    assert!(late[0]
        .message
        .as_deref()
        .unwrap()
        .starts_with("1 late returns"));
    // The other shard's late return waits: status and verify say so.
    let status = json_of(&cli(
        &db.url,
        &[(RATE, "41")],
        &[
            "status",
            "--business-date",
            "2026-10-31",
            "--shards",
            "2",
            "--json",
        ],
    ));
    assert_eq!(status["closed"], false, "{status}");
    assert_eq!(
        status["verdict"],
        "not closed: 1 late return or edit waiting"
    );
    // No replica runs here (the `replicas` table is empty): any shard may hold the return.
    assert_eq!(
        status["next"],
        "no live replica runs shards 0, 1: start one, or `settlementd run --business-date \
         2026-10-31 --shard N --shards 2 --wait` runs it by hand"
    );
    assert_eq!(status["late_returns"], 1);
    let out = cli(
        &db.url,
        &[(RATE, "41")],
        &["verify", "--business-date", "2026-10-31"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("1 returns are not settled"));
    let out = run_shard(&db.url, &[(RATE, "41")], month, 0, 2);
    assert_eq!(json_of(&out)["late_returns"], 1);
    // A run with nothing late is skipped as before.
    let out = run_shard(&db.url, &[(RATE, "41")], month, 0, 2);
    assert_eq!(json_of(&out)["skipped"], true);
    assert_priced_under(&db.pool, month, rule(41)).await;
    let out = cli(
        &db.url,
        &[(RATE, "41")],
        &["verify", "--business-date", "2026-10-31", "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(json_of(&out)["right"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_replicas_settle_late_returns_of_their_closed_months_within_a_heartbeat() {
    let db = test_db().await;
    let (latest, older) = (due_month(), due_month().months_before(2).unwrap());
    for (month, first) in [(latest, 1), (older, 10_001)] {
        seed_month(&db.pool, month, 200, first).await;
        for shard in 0..2 {
            let out = run_shard(&db.url, &[], month, shard, 2);
            assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let replicas: Vec<ServeProcess> = ["0", "1"]
        .iter()
        .map(|s| quick_replica(&db.url, s, &[], &dir.path().join(format!("{s}.log"))))
        .collect();
    for r in &replicas {
        r.wait_for("/readyz", 200).await;
    }
    // Idle: the scheduled month is SUCCESS. Returns keyed into both closed months, both shards.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    key_in_late_returns(&db.pool, latest, &[500_000, 500_001]).await;
    key_in_late_returns(&db.pool, older, &[600_000, 600_001]).await;
    let keyed = Instant::now();
    assert!(
        eventually(20, || async {
            unsettled_in(&db.pool, latest).await + unsettled_in(&db.pool, older).await == 0
        })
        .await,
        "the sweep settles them"
    );
    let took = keyed.elapsed();
    eprintln!(
        "late returns in two closed months, two shards: settled {took:?} after they were keyed in"
    );
    // Documented bound: one heartbeat (1 s here) plus a second; generous for a busy machine.
    assert!(took < Duration::from_secs(10), "took {took:?}");
    // The counters move once each sweep has returned, a moment after its commit.
    let settled = || async {
        let mut sum = 0.0;
        for r in &replicas {
            sum += r.metric("settlementd_late_returns_settled_total").await;
        }
        sum
    };
    assert!(
        eventually(5, || async { settled().await == 4.0 }).await,
        "{}",
        settled().await
    );
    for r in &replicas {
        assert!(
            eventually(5, || async {
                r.metric("settlementd_unsettled_in_closed_months").await == 0.0
            })
            .await
        );
    }
    drop(replicas);
    assert_priced_under(&db.pool, latest, FineRule::default()).await;
    assert_priced_under(&db.pool, older, FineRule::default()).await;
    assert_eq!(
        events_named(&db.pool, latest, "late_returns").await.len(),
        2
    );
    assert_eq!(events_named(&db.pool, older, "late_returns").await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_keyed_into_a_month_while_its_run_works_is_settled_by_the_run_or_the_next() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 3000, 1).await;
    // One shard in small batches, so the run takes a while; returns are keyed in meanwhile, some
    // behind its cursor (ids below it, and loans still out that come back), some ahead.
    let run = settlementd(Some(&db.url))
        .env("SETTLEMENTD__BATCH__SIZE", "3")
        .args(["run", "--business-date", "2026-10-31", "--json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut keyed = 0;
    for round in 0..40i64 {
        key_in_late_returns(&db.pool, month, &[-1000 - round, 1_000_000 + round]).await;
        // A loan still out (every tenth of the seed) comes back within the month.
        sqlx::query(
            "UPDATE loans SET returned_on = $1::date + 20
              WHERE id = (SELECT min(id) FROM loans WHERE returned_on IS NULL AND id > $2)",
        )
        .bind(month.first_day())
        .bind(round * 70)
        .execute(&db.pool)
        .await
        .unwrap();
        keyed += 3;
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let first = tokio::task::spawn_blocking(move || run.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.status.code(), Some(0), "{}", stderr_of(&first));
    let first = json_of(&first);
    assert_eq!(
        first["late_returns"], 0,
        "the first run was a plain run: {first}"
    );
    let left = unsettled_in(&db.pool, month).await;
    assert!(
        left < keyed,
        "the run settled those ahead of its cursor ({left} of {keyed} left)"
    );
    // Those keyed behind its cursor (negative ids, at least) it passed by.
    assert!(left > 0, "{first}");
    let settled_by_first: Vec<(i64, Option<chrono::DateTime<chrono::Utc>>)> = sqlx::query_as(
        "SELECT id, fine_settled_at FROM loans WHERE fine_settled_at IS NOT NULL ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    // The next run of the closed month settles what the first one passed by, and nothing twice.
    let out = cli(
        &db.url,
        &[],
        &["run", "--business-date", "2026-10-31", "--json"],
    );
    let second = json_of(&out);
    assert_eq!(second["late_returns"].as_i64(), Some(left), "{second}");
    assert_eq!(second["updated"].as_i64(), Some(left), "{second}");
    assert_priced_under(&db.pool, month, FineRule::default()).await;
    let again: Vec<(i64, Option<chrono::DateTime<chrono::Utc>>)> =
        sqlx::query_as("SELECT id, fine_settled_at FROM loans WHERE id = ANY($1) ORDER BY id")
            .bind(settled_by_first.iter().map(|r| r.0).collect::<Vec<_>>())
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        again, settled_by_first,
        "a settled loan is never settled again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_edited_by_hand_fails_verify_passes_after_correct_and_the_same_key_changes_nothing()
{
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 500, 1).await;
    for shard in 0..2 {
        assert_eq!(
            run_shard(&db.url, &[], month, shard, 2).status.code(),
            Some(0)
        );
    }
    let out = cli(
        &db.url,
        &[],
        &["verify", "--business-date", "2026-10-31", "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let clean = json_of(&out);
    assert_eq!(clean["right"], true);
    assert_eq!(clean["rule_source"], "pinned");

    // By hand: two fines edited, one return date corrected after settlement.
    sqlx::query(
        "UPDATE loans SET fine_cents = fine_cents + 500 WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
              ORDER BY id LIMIT 2)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE loans SET returned_on = returned_on + 3 WHERE id = (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-20'
                AND due_on < returned_on ORDER BY id DESC LIMIT 1)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = cli(
        &db.url,
        &[],
        &["verify", "--business-date", "2026-10-31", "--json"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let wrong = json_of(&out);
    assert_eq!(wrong["mismatched"]["count"], 3, "{wrong}");
    assert_eq!(wrong["mismatched"]["first"].as_array().unwrap().len(), 3);
    // 1000 cents too much, one return 3 days later: 150 cents too little.
    assert_eq!(wrong["mismatched"]["net_cents"], 1000 - 150, "{wrong}");
    assert_eq!(
        wrong["totals"]["settled_rows"],
        clean["totals"]["settled_rows"]
    );

    // Corrected on the record, under the configuration's rule (the same rule here).
    let correct = |key: &str| {
        cli(
            &db.url,
            &[],
            &[
                "correct",
                "--business-date",
                "2026-10-31",
                "--reason",
                "fines edited by hand; a return date fixed after settlement",
                "--key",
                key,
                "--json",
            ],
        )
    };
    let out = correct("TICKET-4711");
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let first = json_of(&out);
    assert_eq!(
        (first["changed"].as_i64(), first["replayed"].as_bool()),
        (Some(3), Some(false))
    );
    assert_eq!(first["net_cents"], -(1000 - 150));
    assert_eq!(first["shards"], 2, "the month's own shard count");
    let adjustments: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT correction_key, old_cents, new_cents FROM fine_adjustments ORDER BY loan_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(adjustments.len(), 3);
    assert!(adjustments.iter().all(|a| a.0 == "TICKET-4711"));
    assert_eq!(
        adjustments.iter().map(|a| a.2 - a.1).sum::<i64>(),
        -(1000 - 150)
    );
    assert_eq!(events_named(&db.pool, month, "corrected").await.len(), 2);
    let out = cli(&db.url, &[], &["verify", "--business-date", "2026-10-31"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));

    // The same key again changes nothing and reports the first result; a new key with nothing
    // to change changes nothing.
    let snapshot = loans_snapshot(&db.pool).await;
    let out = correct("TICKET-4711");
    let replay = json_of(&out);
    assert_eq!(replay["replayed"], true);
    assert_eq!(
        (replay["changed"].clone(), replay["net_cents"].clone()),
        (first["changed"].clone(), first["net_cents"].clone())
    );
    let out = correct("TICKET-4712");
    assert_eq!(json_of(&out)["changed"], 0);
    assert_eq!(loans_snapshot(&db.pool).await, snapshot);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM fine_adjustments")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(count, 3);
    // A key reused for another request is refused, naming what differs.
    let out = cli(
        &db.url,
        &[],
        &[
            "correct",
            "--business-date",
            "2026-09-30",
            "--reason",
            "x",
            "--key",
            "TICKET-4711",
            "--shards",
            "2",
        ],
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("month 2026-10-31 (this request: 2026-09-30)"),
        "{}",
        stderr_of(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_settled_under_a_wrong_rule_is_re_pinned_by_correct_and_refused_to_the_old_rule() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 400, 1).await;
    assert_eq!(
        run_shard(&db.url, &[(RATE, "99")], month, 0, 1)
            .status
            .code(),
        Some(0)
    );
    // The configuration is fixed to 60 cents: runs refuse the month (pinned to 99), verify
    // checks against the pinned rule (right by it).
    assert_eq!(
        run_shard(&db.url, &[(RATE, "60")], month, 0, 1)
            .status
            .code(),
        Some(3)
    );
    let out = cli(
        &db.url,
        &[(RATE, "60")],
        &["verify", "--business-date", "2026-10-31", "--json"],
    );
    assert_eq!(json_of(&out)["rule"]["daily_rate_cents"], 99);
    let out = cli(
        &db.url,
        &[(RATE, "60")],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--reason",
            "the rate is 60",
            "--key",
            "RATE-60",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let corrected = json_of(&out);
    assert_eq!(corrected["old_rule"]["daily_rate_cents"], 99);
    assert_eq!(corrected["new_rule"]["daily_rate_cents"], 60);
    assert_priced_under(&db.pool, month, rule(60)).await;
    let out = cli(
        &db.url,
        &[(RATE, "60")],
        &["verify", "--business-date", "2026-10-31"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    // Now the old rule is the one refused.
    let out = run_shard(&db.url, &[(RATE, "99")], month, 0, 1);
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("pinned to 60 cents a day"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_is_refused_while_a_shard_of_the_month_runs() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 100, 1).await;
    assert_eq!(run_shard(&db.url, &[], month, 0, 2).status.code(), Some(0));
    // Shard 1 is claimed by a live run (its heartbeat fresh).
    let key = fine_settlement::key(month, settlementd::config::ShardSpec::new(1, 2).unwrap());
    let mut conn = db.pool.acquire().await.unwrap();
    let claimed = settlementd::job_layer::claim::claim(
        &mut conn,
        &key,
        &settlementd::job_layer::Owner("live".into()),
        Duration::from_secs(60),
        false,
    )
    .await
    .unwrap();
    assert!(matches!(
        claimed,
        settlementd::job_layer::ClaimOutcome::Won(_)
    ));
    let out = cli(
        &db.url,
        &[],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--reason",
            "x",
            "--key",
            "K1",
        ],
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("shard 1/2"), "{}", stderr_of(&out));
    let recorded: i64 = sqlx::query_scalar("SELECT count(*) FROM fine_corrections")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(recorded, 0, "nothing recorded");
}

#[tokio::test]
async fn verify_and_correct_refuse_bad_input_with_exit_2() {
    let db = test_db().await;
    for args in [
        &["verify", "--business-date", "2026-10-30"][..],
        &["verify", "--business-date", "0000-12-31"],
        &["verify", "--business-date", "2999-12-31"],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--reason",
            "x",
            "--key",
            "has space",
        ],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--reason",
            " ",
            "--key",
            "K",
        ],
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--reason",
            "x",
            "--key",
            "K",
            "--shards",
            "0",
        ],
        // Never settled, and no shard count given.
        &[
            "correct",
            "--business-date",
            "2026-10-31",
            "--reason",
            "x",
            "--key",
            "K",
        ],
        &["correct", "--business-date", "2026-10-31", "--reason", "x"],
    ] {
        let out = cli(&db.url, &[], args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr_of(&out));
        assert_eq!(stderr_of(&out).trim_end().lines().count(), 1, "{args:?}");
    }
}
