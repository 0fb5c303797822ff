//! Tests: schema and plans. A batch reads only the month's entries of `loans_unsettled_by_month`
//! whatever the statistics say, and a re-run over a settled month reads nothing, checked on the
//! engine's real statement (EXPLAIN ANALYZE, BUFFERS, in a transaction that is rolled back).

use crate::helpers::{bd, eligible, run_options, seed_month, settle_shards, test_db};
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

/// The plan of one batch of shard `shard` of `shards` after `after`, exactly as the engine runs
/// it (plan pinned, same statement, same parameters), executed and rolled back.
async fn explain_batch(
    pool: &PgPool,
    month: BusinessDate,
    (shard, shards): (i64, i64),
    after: i64,
    batch: i64,
) -> Value {
    let mut tx = pool.begin_with(settlement::BEGIN_BATCH).await.unwrap();
    let rule = FineRule::default();
    let sql = format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
        settlement::batch_sql()
    );
    let plan: Value = sqlx::query_scalar(&sql)
        .persistent(false)
        .bind(month.first_day().and_time(chrono::NaiveTime::MIN))
        .bind(after)
        .bind(shards)
        .bind(shard)
        .bind(batch)
        .bind(rule.grace_days)
        .bind(rule.daily_rate_cents)
        .bind(rule.max_cents)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
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

/// Every scan of `loans` is an ordered scan of the month index (index-only for the page, a plain
/// index scan for the update); returns the index entries they read in all (rows returned plus
/// rows of other shards filtered out).
fn assert_month_index_only(plan: &Value) -> i64 {
    // Every node that reads a table or an index (ModifyTable names `loans` but reads nothing).
    let scans: Vec<&Value> = nodes(plan)
        .into_iter()
        .filter(|n| n["Node Type"].as_str().is_some_and(|t| t.ends_with("Scan")))
        .filter(|n| n["Relation Name"].as_str() == Some("loans") || n["Index Name"].is_string())
        .collect();
    assert!(!scans.is_empty(), "{plan:#}");
    let mut read = 0;
    for scan in scans {
        assert!(
            matches!(
                scan["Node Type"].as_str(),
                Some("Index Scan" | "Index Only Scan")
            ) && scan["Index Name"].as_str() == Some("loans_unsettled_by_month"),
            "only the month index is read: {plan:#}"
        );
        let loops = scan["Actual Loops"].as_i64().unwrap_or(1);
        read += loops
            * (scan["Actual Rows"].as_i64().unwrap_or(0)
                + scan["Rows Removed by Filter"].as_i64().unwrap_or(0));
    }
    read
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

/// `n` loans returned from `month`'s first day on, ids 37 apart, interleaved in id order with
/// `n` loans returned twenty days earlier (mostly the month before), as a real table has them.
async fn seed_interleaved(pool: &PgPool, month: BusinessDate, first: i64, n: i64) {
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i * 37, 1, 1, d - 30, d - 10, d
           FROM (SELECT i, CASE WHEN (i / 3) % 2 = 0 THEN $1::date ELSE $1::date - 20 END
                           + (i % 28)::int AS d
                   FROM generate_series($2::bigint, $2::bigint + 2 * $3 - 1) AS i) s",
    )
    .bind(month.first_day())
    .bind(first)
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn a_batch_reads_only_its_share_of_the_month_index_with_fresh_missing_or_stale_statistics() {
    let db = test_db().await;
    let (sep, oct) = (bd("2026-09-30"), bd("2026-10-31"));
    let (batch, shards) = (100, 2);
    // Stale: statistics taken when only September's loans existed.
    seed_interleaved(&db.pool, sep, 1, 1000).await;
    sqlx::query("ANALYZE loans")
        .execute(&db.pool)
        .await
        .unwrap();
    seed_interleaved(&db.pool, oct, 10_000, 4000).await;
    let rows = eligible(&db.pool, oct).await;
    assert!(rows > 10 * batch * shards, "{rows}");
    // The page reads about `shards` entries per row of its shard, the update the same range again.
    let bound = 2 * (2 * shards * batch + 2 * shards);
    for stats in ["stale", "fresh", "missing"] {
        match stats {
            "fresh" => sqlx::query("ANALYZE loans")
                .execute(&db.pool)
                .await
                .map(drop),
            "missing" => sqlx::query("DELETE FROM pg_statistic WHERE starelid = 'loans'::regclass")
                .execute(&db.pool)
                .await
                .map(drop),
            _ => Ok(()),
        }
        .unwrap();
        for after in [i64::MIN, 37 * 14_000] {
            let plan = explain_batch(&db.pool, oct, (1, shards), after, batch).await;
            let read = assert_month_index_only(&plan);
            assert!(
                read <= bound,
                "{stats} statistics, after {after}: read {read} index entries for a batch of \
                 {batch} (the month has {rows}): {plan:#}"
            );
        }
    }
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

    let rows = eligible(&db.pool, oct).await;
    // One batch as large as the month: the page reads the month's entries, the update reads the
    // same range once more, and nothing else is read.
    let plan = explain_batch(&db.pool, oct, (0, 1), i64::MIN, 1_000_000).await;
    assert_eq!(assert_month_index_only(&plan), 2 * rows, "{plan:#}");
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

    let plan = explain_batch(&db.pool, oct, (0, 1), i64::MIN, 500).await;
    assert_eq!(assert_month_index_only(&plan), 0, "{plan:#}");
    // One probe of an empty index range: a page or two of the index, and not one table page.
    let read = blocks(&plan);
    let pages = loans_pages(&db.pool).await;
    assert!(
        read <= 4,
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
        guards: Default::default(),
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
    // Without VACUUM the dead index entries are still there; the batch still finds no row.
    let plan = explain_batch(&db.pool, oct, (0, 1), i64::MIN, 500).await;
    assert_eq!(assert_month_index_only(&plan), 0, "{plan:#}");
}
