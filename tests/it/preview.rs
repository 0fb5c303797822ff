//! Issue 35, part A: a dry run of any month reports what the run then writes, and writes nothing.
//!
//! The comparisons read what the real run wrote from the money journal (its new entries, by
//! kind, shard and member), never from the dry run's own words.

use crate::helpers::*;
use crate::journal::{count, sql, RATE};
use serde_json::Value;
use settlementd::seed::{seed_loans, SeedSpec};
use sqlx::PgPool;
use std::collections::BTreeMap;

/// The month every test previews.
const MONTH: &str = "2026-10-31";

/// `run --dry-run --all-shards` of October under 2 shards: its one JSON object.
fn dry_run(url: &str, env: &[(&str, &str)]) -> Value {
    let out = cli(
        url,
        env,
        &[
            "run",
            "--dry-run",
            "--business-date",
            MONTH,
            "--all-shards",
            "--shards",
            "2",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    json_of(&out)
}

/// The real run of October, both shards; must exit 0.
fn run_for_real(url: &str) {
    let out = cli(
        url,
        &[],
        &[
            "run",
            "--business-date",
            MONTH,
            "--all-shards",
            "--shards",
            "2",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
}

/// What the journal entries after `after` (a journal id) say, by (shard, kind as the dry run
/// names it): (loans, changed, sum of after, net).
async fn written_since(pool: &PgPool, after: i64) -> BTreeMap<(i64, String), (i64, i64, i64, i64)> {
    let rows: Vec<(i64, String, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT (loan_id % 2 + 2) % 2,
                CASE kind WHEN 'settled' THEN 'settle' WHEN 'late' THEN 'settle'
                          WHEN 'repriced' THEN 'reprice' WHEN 'reversed' THEN 'reverse'
                          WHEN 'deleted' THEN 'delete' WHEN 'corrected' THEN 'correct' END,
                count(*), count(*) FILTER (WHERE after_cents <> before_cents),
                sum(after_cents)::bigint, sum(after_cents - before_cents)::bigint
           FROM fine_journal_entries WHERE journal_id > $1 GROUP BY 1, 2",
    )
    .bind(after)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(s, k, n, c, a, d)| ((s, k), (n, c, a, d)))
        .collect()
}

/// The same, from a dry run's JSON: every kind with loans.
fn previewed(dry: &Value) -> BTreeMap<(i64, String), (i64, i64, i64, i64)> {
    let mut out = BTreeMap::new();
    for shard in dry["by_shard"].as_array().unwrap() {
        for kind in ["settle", "reprice", "correct", "reverse", "delete"] {
            let k = &shard[kind];
            if k.is_null() || k["loans"].as_i64() == Some(0) {
                continue;
            }
            out.insert(
                (shard["shard"].as_i64().unwrap(), kind.to_string()),
                (
                    k["loans"].as_i64().unwrap(),
                    k["changed"].as_i64().unwrap(),
                    k["cents"].as_i64().unwrap(),
                    k["net_cents"].as_i64().unwrap(),
                ),
            );
        }
    }
    out
}

/// Each member's change in the journal entries after `after` (each entry names the member its
/// money is for), the largest first as the dry run lists them: (member, change); and how many
/// members changed.
async fn members_since(pool: &PgPool, after: i64) -> (i64, Vec<(Option<i64>, i64)>) {
    let rows: Vec<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT e.member_id, sum(e.after_cents - e.before_cents)::bigint AS change
           FROM fine_journal_entries e
          WHERE e.journal_id > $1
          GROUP BY e.member_id HAVING sum(e.after_cents - e.before_cents) <> 0
          ORDER BY abs(sum(e.after_cents - e.before_cents)) DESC, e.member_id NULLS LAST",
    )
    .bind(after)
    .fetch_all(pool)
    .await
    .unwrap();
    let n = rows.len() as i64;
    (n, rows.into_iter().take(20).collect())
}

fn previewed_members(dry: &Value) -> (i64, Vec<(Option<i64>, i64)>) {
    let members = dry["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["member_id"].as_i64(), m["change_cents"].as_i64().unwrap()))
        .collect();
    (dry["members_changed"].as_i64().unwrap(), members)
}

async fn last_journal_id(pool: &PgPool) -> i64 {
    count(pool, "SELECT COALESCE(max(id), 0) FROM fine_journal").await
}

/// The dry run's members are those whose money the journal entries after `before` changed: as
/// many, with the same largest changes. Returns the dry run's list.
async fn assert_same_members(pool: &PgPool, before: i64, dry: &Value) -> Vec<(Option<i64>, i64)> {
    let (n, members) = members_since(pool, before).await;
    let (dry_n, dry_members) = previewed_members(dry);
    assert_eq!(dry_n, n, "{dry}");
    assert_eq!(changes(&dry_members), changes(&members), "{dry}");
    dry_members
}

/// Of the listed members, the changes (a tie in |change| may order two members either way).
fn changes(members: &[(Option<i64>, i64)]) -> Vec<i64> {
    members.iter().map(|(_, c)| c.abs()).collect()
}

/// The benchmark's history shape (loans borrowed over three years, ids in borrow order, the
/// month's returns spread over the ids of the months before it), everything before October
/// settled and journaled. Then, twice, a dry run of October and the real run are compared: first
/// the month's own settlement (with held and odd rows among its returns), then after libraryd
/// edited settled loans of October (due dates moved: re-priced; a return undone: reversed; a loan
/// deleted: its fine taken out) and late returns arrived.
#[tokio::test]
async fn a_dry_run_on_the_history_shape_reports_the_loans_cents_and_members_the_run_then_writes() {
    let db = test_db().await;
    let pool = &db.pool;
    let spec = SeedSpec::history(40_000, bd(MONTH), 7, 3, 1);
    seed_loans(pool, &spec, |_| {}).await.unwrap();
    sql(
        pool,
        "UPDATE loans SET fine_cents = 0, fine_settled_at = now()
          WHERE returned_on < '2026-10-01' AND fine_settled_at IS NULL",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    while settlementd::jobs::fine_settlement::journal::open_unjournaled(&mut conn, 100_000)
        .await
        .unwrap()
        > 0
    {}
    drop(conn);
    // Held (no due date: a nullable `due_on` of an older table; an infinite one) and odd
    // (returned before borrowed) returns of October.
    sql(pool, "ALTER TABLE loans ALTER COLUMN due_on DROP NOT NULL").await;
    sql(
        pool,
        "UPDATE loans SET due_on = NULL WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
              ORDER BY id LIMIT 3)",
    )
    .await;
    sql(
        pool,
        "UPDATE loans SET due_on = '-infinity' WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                AND due_on IS NOT NULL ORDER BY id DESC LIMIT 2)",
    )
    .await;
    sql(
        pool,
        "UPDATE loans SET borrowed_on = returned_on + 3 WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                AND due_on IS NOT NULL AND isfinite(due_on) ORDER BY id LIMIT 4 OFFSET 10)",
    )
    .await;
    let to_settle = count(
        pool,
        "SELECT count(*) FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND due_on IS NOT NULL AND isfinite(due_on)",
    )
    .await;
    assert!(
        to_settle > 1000,
        "the shape gives October {to_settle} returns"
    );

    // 1. The month's own settlement.
    let dry = dry_run(&db.url, &[]);
    assert_eq!(dry["writer"], "run");
    assert_eq!(dry["refused"], serde_json::json!([]));
    assert_eq!(dry["pinned"], Value::Null, "{dry}");
    let held: i64 = dry["by_shard"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["hold"]["loans"].as_i64().unwrap())
        .sum();
    assert_eq!(held, 5, "{dry}");
    let odd: i64 = dry["by_shard"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["odd_rows"].as_i64().unwrap())
        .sum();
    assert_eq!(odd, 4, "{dry}");
    let before = last_journal_id(pool).await;
    run_for_real(&db.url);
    let written = written_since(pool, before).await;
    assert_eq!(previewed(&dry), written, "{dry}");
    let settled: i64 = written.values().map(|w| w.0).sum();
    assert_eq!(settled, to_settle);
    let dry_members = assert_same_members(pool, before, &dry).await;
    assert_eq!(dry_members.len(), 20);

    // 2. libraryd's edits of settled October loans, and late returns.
    sql(
        pool,
        "UPDATE loans SET due_on = due_on - 9 WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                AND fine_settled_at IS NOT NULL ORDER BY id LIMIT 40)",
    )
    .await;
    sql(
        pool,
        "UPDATE loans SET returned_on = NULL WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                AND fine_settled_at IS NOT NULL AND fine_cents > 0 ORDER BY id DESC LIMIT 6)",
    )
    .await;
    sql(
        pool,
        "DELETE FROM loans WHERE id IN (
             SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                AND fine_settled_at IS NOT NULL AND fine_cents > 0 ORDER BY id LIMIT 5 OFFSET 100)",
    )
    .await;
    sql(
        pool,
        "UPDATE loans SET returned_on = '2026-10-30' WHERE id IN (
             SELECT id FROM loans WHERE returned_on IS NULL ORDER BY id LIMIT 30)",
    )
    .await;
    let dry = dry_run(&db.url, &[]);
    let shown = previewed(&dry);
    for kind in ["settle", "reprice", "reverse", "delete"] {
        assert!(
            shown.keys().any(|(_, k)| k == kind),
            "the edits give {kind}: {dry}"
        );
    }
    let before = last_journal_id(pool).await;
    run_for_real(&db.url);
    assert_eq!(shown, written_since(pool, before).await, "{dry}");
    let dry_members = assert_same_members(pool, before, &dry).await;
    // A deleted loan's money is taken out of the member its entry names: none is "(deleted)".
    assert!(
        dry_members.iter().all(|(m, _)| m.is_some()),
        "every change names its member: {dry}"
    );

    // Done: a dry run says so, and writes nothing.
    let dry = dry_run(&db.url, &[]);
    assert_eq!(dry["writes"], 0, "{dry}");
    for shard in dry["by_shard"].as_array().unwrap() {
        assert_eq!(shard["would"], "skip", "{dry}");
        assert_eq!(shard["skipped_because"], "already_success", "{dry}");
    }
    drop_db(db).await;
}

/// Every write to settlementd's tables or to `loans` fails while the triggers are there: a
/// statement-level trigger on each table of the schema raises. The dry runs (`run --dry-run` of a
/// month, a range, every shard; `correct --dry-run`) succeed and report; the real run, under the
/// same triggers, fails — so the triggers would have caught a dry run's write.
#[tokio::test]
async fn a_dry_run_writes_nothing_every_write_to_settlementds_tables_or_loans_fails_meanwhile() {
    let db = test_db().await;
    let pool = &db.pool;
    seed_month(pool, bd("2026-09-30"), 2_000, 1).await;
    seed_month(pool, bd(MONTH), 3_000, 10_001).await;
    let out = cli(
        &db.url,
        &[],
        &[
            "run",
            "--business-date",
            "2026-09-30",
            "--shards",
            "2",
            "--all-shards",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    sql(
        pool,
        "UPDATE loans SET due_on = due_on - 3 WHERE id BETWEEN 1 AND 50",
    )
    .await;
    sql(
        pool,
        "CREATE FUNCTION no_writes() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'write to % during a dry run', TG_TABLE_NAME; END $$",
    )
    .await;
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables
          WHERE schemaname IN ('public', 'settlementd') ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for needed in [
        "public.loans",
        "settlementd.job_runs",
        "settlementd.job_params",
        "settlementd.job_events",
        "settlementd.fine_journal",
        "settlementd.replicas",
    ] {
        assert!(tables.iter().any(|t| t == needed), "{needed} in {tables:?}");
    }
    for table in &tables {
        sql(
            pool,
            &format!(
                "CREATE TRIGGER no_writes BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
                 FOR EACH STATEMENT EXECUTE FUNCTION no_writes()"
            ),
        )
        .await;
    }
    let snapshot = || async {
        let mut all = Vec::new();
        for table in &tables {
            all.push(count(pool, &format!("SELECT count(*) FROM {table}")).await);
        }
        all
    };
    let rows_before = snapshot().await;

    let dry = dry_run(&db.url, &[]);
    assert!(dry["writes"].as_i64().unwrap() > 2000, "{dry}");
    let out = cli(
        &db.url,
        &[],
        &[
            "run",
            "--dry-run",
            "--from",
            "2026-09",
            "--to",
            "2026-10",
            "--shards",
            "2",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "one object per month");
    let september = &lines[0]["by_shard"][0];
    assert!(
        september["reprice"]["loans"].as_i64().unwrap() > 0,
        "September's edits wait: {september}"
    );
    let out = cli(
        &db.url,
        &[(RATE, "70")],
        &[
            "correct",
            "--dry-run",
            "--business-date",
            "2026-09-30",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let corrected = json_of(&out);
    assert_eq!(corrected["writer"], "correction");
    assert!(corrected["writes"].as_i64().unwrap() > 0, "{corrected}");
    let text = cli(
        &db.url,
        &[],
        &["run", "--dry-run", "--business-date", MONTH],
    );
    assert_eq!(text.status.code(), Some(0), "{}", stderr_of(&text));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("nothing is written"), "{text}");
    assert!(text.contains(" cents)"), "money with its unit: {text}");
    assert_eq!(snapshot().await, rows_before);

    // The same triggers stop the real run: they would have stopped a dry run's write.
    let out = cli(&db.url, &[], &["run", "--business-date", MONTH]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        stderr_of(&out).contains("during a dry run"),
        "{}",
        stderr_of(&out)
    );
    drop_db(db).await;
}

/// `correct --dry-run` reports per shard the loans and cents the correction then changes (its
/// `fine_adjustments` and journal entries), and per member the same change.
#[tokio::test]
async fn a_corrections_dry_run_reports_what_the_correction_then_writes() {
    let db = test_db().await;
    let pool = &db.pool;
    seed_month(pool, bd(MONTH), 4_000, 1).await;
    run_for_real(&db.url);
    // A late return, and an edit waiting: the correction takes both.
    sql(
        pool,
        "UPDATE loans SET returned_on = '2026-10-29' WHERE id = 10",
    )
    .await;
    sql(
        pool,
        "UPDATE loans SET due_on = due_on - 5 WHERE id IN (11, 12, 13)",
    )
    .await;
    let env = [(RATE, "65")];
    let out = cli(
        &db.url,
        &env,
        &["correct", "--dry-run", "--business-date", MONTH, "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let dry = json_of(&out);
    assert_eq!(dry["refused"], serde_json::json!([]), "{dry}");
    assert_eq!(dry["shards"], 2, "the month's shard count");
    let before = last_journal_id(pool).await;
    let out = cli(
        &db.url,
        &env,
        &[
            "correct",
            "--business-date",
            MONTH,
            "--key",
            "RATE-65",
            "--reason",
            "the rate is 65",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(previewed(&dry), written_since(pool, before).await, "{dry}");
    assert_same_members(pool, before, &dry).await;
    drop_db(db).await;
}

/// `POST /v1/runs/dry-run` answers what `run --dry-run --json` prints, with the bearer token and
/// without an idempotency key, and stores no request.
#[tokio::test]
async fn the_runs_api_dry_run_answers_what_the_cli_prints_and_stores_nothing() {
    let db = test_db().await;
    let pool = &db.pool;
    seed_month(pool, bd(MONTH), 1_000, 1).await;
    let settings = settings(&[
        ("HTTP__ADMIN_TOKEN", "s3cret-token-0123456789"),
        ("SHARD__COUNT", "2"),
    ]);
    let (addr, stop, task) = serve_http(pool, settings).await;
    let body = format!(r#"{{"business_date": "{MONTH}", "shards": 2}}"#);
    let refused = http(addr, "POST", "/v1/runs/dry-run", &[], &body)
        .await
        .unwrap();
    assert_eq!(refused.status, 401);
    let answer = http(
        addr,
        "POST",
        "/v1/runs/dry-run",
        &[("Authorization", "Bearer s3cret-token-0123456789")],
        &body,
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    let api = answer.json()["dry_runs"][0].clone();
    let cli = dry_run(&db.url, &[]);
    assert_eq!(api, cli);
    assert!(api["writes"].as_i64().unwrap() > 0);
    assert_eq!(count(pool, "SELECT count(*) FROM run_requests").await, 0);
    assert_eq!(count(pool, "SELECT count(*) FROM job_runs").await, 0);
    stop.cancel();
    task.await.unwrap();
    drop_db(db).await;
}
