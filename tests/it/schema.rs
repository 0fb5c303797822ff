//! Tests: schema. The loans indexes keep "unsettled and returned in month M" cheap, and a re-run
//! over a settled month reads nothing, checked on real plans (EXPLAIN ANALYZE, BUFFERS).

use crate::helpers::{bd, run_options, seed_month, settle_shards, test_db};
use serde_json::Value;
use settlementd::calendar::BusinessDate;
use settlementd::config::ShardSpec;
use settlementd::fine::FineRule;
use settlementd::jobs;
use settlementd::settlement::{self, FineSettlement};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

async fn settle(pool: &PgPool, month: BusinessDate) {
    assert!(settle_shards(pool, month, 1, 500).await > 0);
}

/// The plan of the month's "unsettled" question, as the settlement asks it, with its buffers.
async fn explain_unsettled(pool: &PgPool, month: BusinessDate) -> Value {
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
         SELECT id FROM loans
          WHERE returned_on BETWEEN '{}' AND '{}' AND fine_settled_at IS NULL",
        month.first_day(),
        month.date()
    );
    let plan: Value = sqlx::query_scalar(&sql).fetch_one(pool).await.unwrap();
    plan[0]["Plan"].clone()
}

/// Every node of a plan tree, depth first.
fn nodes(plan: &Value) -> Vec<&Value> {
    let mut out = vec![plan];
    if let Some(children) = plan["Plans"].as_array() {
        for child in children {
            out.extend(nodes(child));
        }
    }
    out
}

/// The plan of the question a run asks first (`FineSettlement::plan`): where do the month's
/// unsettled loans start and end? Two probes of the partial index per day of the month.
async fn explain_month_bounds(pool: &PgPool, month: BusinessDate) -> Value {
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)
         SELECT min(lo.id), max(hi.id)
           FROM generate_series('{}'::date, '{}'::date, interval '1 day') AS d(day)
          CROSS JOIN LATERAL (
                SELECT id FROM loans
                 WHERE returned_on = d.day::date AND fine_settled_at IS NULL
                 ORDER BY id LIMIT 1) lo
          CROSS JOIN LATERAL (
                SELECT id FROM loans
                 WHERE returned_on = d.day::date AND fine_settled_at IS NULL
                 ORDER BY id DESC LIMIT 1) hi",
        month.first_day(),
        month.date()
    );
    let plan: Value = sqlx::query_scalar(&sql).fetch_one(pool).await.unwrap();
    plan[0]["Plan"].clone()
}

fn blocks(plan: &Value) -> i64 {
    plan["Shared Hit Blocks"].as_i64().unwrap_or(0)
        + plan["Shared Read Blocks"].as_i64().unwrap_or(0)
}

async fn loans_pages(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_relation_size('loans') / current_setting('block_size')::bigint")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn unsettled_loans_of_a_month_are_found_through_the_partial_index_not_the_table() {
    let db = test_db().await;
    let (aug, sep, oct) = (bd("2026-08-31"), bd("2026-09-30"), bd("2026-10-31"));
    seed_month(&db.pool, aug, 4000, 1).await;
    seed_month(&db.pool, sep, 4000, 10_001).await;
    seed_month(&db.pool, oct, 4000, 20_001).await;
    settle(&db.pool, aug).await;
    settle(&db.pool, sep).await;
    sqlx::query("VACUUM ANALYZE loans")
        .execute(&db.pool)
        .await
        .unwrap();

    let plan = explain_unsettled(&db.pool, oct).await;
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM loans WHERE returned_on BETWEEN $1 AND $2")
            .bind(oct.first_day())
            .bind(oct.date())
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(plan["Actual Rows"].as_i64(), Some(rows));
    let all = nodes(&plan);
    assert!(
        all.iter()
            .any(|n| n["Index Name"].as_str() == Some("loans_unsettled_by_return")),
        "the month is read through the partial index: {plan:#}"
    );
    assert!(
        !all.iter()
            .any(|n| n["Node Type"].as_str() == Some("Seq Scan")),
        "no sequential scan of loans: {plan:#}"
    );
}

#[tokio::test]
async fn a_rerun_over_a_settled_month_reads_no_row_and_no_table_page() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month(&db.pool, oct, 5000, 1).await;
    settle(&db.pool, oct).await;
    sqlx::query("VACUUM ANALYZE loans")
        .execute(&db.pool)
        .await
        .unwrap();

    let plan = explain_month_bounds(&db.pool, oct).await;
    let all = nodes(&plan);
    let scans: Vec<_> = all
        .iter()
        .filter(|n| n["Relation Name"].as_str() == Some("loans"))
        .collect();
    assert!(!scans.is_empty());
    for scan in &scans {
        assert_eq!(
            scan["Index Name"].as_str(),
            Some("loans_unsettled_by_return"),
            "only the partial index is read: {plan:#}"
        );
        assert_eq!(scan["Actual Rows"].as_i64(), Some(0), "{plan:#}");
    }
    // 62 probes of an empty index range: about one leaf page each, and not one table page.
    let read = blocks(&plan);
    let pages = loans_pages(&db.pool).await;
    assert!(
        read <= 2 * 62,
        "read {read} buffers (the table has {pages} pages): {plan:#}"
    );
}

#[tokio::test]
async fn a_forced_rerun_right_after_a_run_settles_nothing_and_scans_nothing() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month(&db.pool, oct, 3000, 1).await;
    settle(&db.pool, oct).await;
    let job = FineSettlement {
        rule: FineRule::default(),
        batch_size: 500,
    };
    let opts = run_options(true, true);
    let key = settlement::key(oct, ShardSpec::new(0, 1).unwrap());
    let report = jobs::run_once(
        &db.pool,
        &job,
        key,
        &opts,
        &CancellationToken::new(),
        &|p| assert_eq!(p.total, Some(0), "the estimate finds nothing left"),
    )
    .await
    .unwrap();
    assert_eq!((report.scanned, report.updated), (0, 0));
    // Without VACUUM the dead index entries are still there; the month's plan still finds no row.
    let plan = explain_unsettled(&db.pool, oct).await;
    assert_eq!(plan["Actual Rows"].as_i64(), Some(0), "{plan:#}");
}
