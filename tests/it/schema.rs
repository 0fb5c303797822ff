//! Tests: schema and plans. A batch reads only the month's entries of `loans_unsettled_by_month`
//! whatever the statistics say, and a re-run over a settled month reads nothing, checked on the
//! engine's real statements (EXPLAIN ANALYZE, BUFFERS, in a transaction that is rolled back).

use crate::helpers::{bd, eligible, one_batch, run_options, seed_month, settle_shards, test_db};
use serde_json::Value;
use settlementd::calendar::BusinessDate;
use settlementd::config::ShardSpec;
use settlementd::fine::FineRule;
use settlementd::job_layer::{self, Job};
use settlementd::jobs::fine_settlement::{self, BatchSql, FineSettlement, Walk};
use sqlx::{PgConnection, PgPool, Row};
use tokio_util::sync::CancellationToken;

async fn settle(pool: &PgPool, month: BusinessDate) {
    assert!(settle_shards(pool, month, 1, 500).await > 0);
}

/// The plans of one batch of shard `shard` of `shards` over the ids `low..=high`, exactly as the
/// engine runs it (plan pinned, the shard's walk, the same three statements with the same
/// parameters), executed and rolled back: the page statement, then the odd rows' and the settle
/// statements (none when the page is empty).
async fn explain_batch(
    pool: &PgPool,
    month: BusinessDate,
    (shard, shards): (i64, i64),
    (low, high): (i64, i64),
    batch: i64,
) -> Vec<Value> {
    let mut tx = pool.begin_with(fine_settlement::BEGIN_BATCH).await.unwrap();
    let rule = FineRule::default();
    let walk = Walk::of_shard(shard as u32);
    let sql = BatchSql::of(walk);
    let month_key = month.first_day().and_time(chrono::NaiveTime::MIN);
    let page = [low, high, shards, shard, batch];
    let (last, known): (Option<i64>, bool) = sqlx::query_as(&format!(
        "SELECT last, known FROM ({}) p(n, last, known)",
        sql.page
    ))
    .persistent(false)
    .bind(month_key)
    .bind(low)
    .bind(high)
    .bind(shards)
    .bind(shard)
    .bind(batch)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let explain = |sql: &str| format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}");
    let mut plans =
        vec![first_column::<Value>(&mut tx, &explain(&sql.page), month_key, &page).await];
    if let Some(last) = last {
        let (from, to) = match walk {
            Walk::Up => (low, last),
            Walk::Down => (last, high),
        };
        let numbers = [
            from,
            to,
            shards,
            shard,
            rule.grace_days,
            rule.daily_rate_cents,
            rule.max_cents,
        ];
        // The settle statement the engine picks for the page: `settle` when a loan of it is
        // known to the journal, `settle_fresh` when none is.
        let settle = if known {
            &sql.settle
        } else {
            &sql.settle_fresh
        };
        for statement in [&sql.odd, settle] {
            plans.push(first_column(&mut tx, &explain(statement), month_key, &numbers).await);
        }
    }
    tx.rollback().await.unwrap();
    plans.into_iter().map(|p| p[0]["Plan"].clone()).collect()
}

/// The first column of the one row `sql` returns with the month key and then `numbers` as its
/// parameters, sent unnamed: planned for these parameters, as every batch of the engine is
/// (`every_batch_is_planned_for_its_own_cursor_also_after_five_executions`).
async fn first_column<T>(
    conn: &mut PgConnection,
    sql: &str,
    month_key: chrono::NaiveDateTime,
    numbers: &[i64],
) -> T
where
    T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    let mut query = sqlx::query(sql).persistent(false).bind(month_key);
    for n in numbers {
        query = query.bind(*n);
    }
    if sql.contains("$11") {
        // The batch statements' journal parameters: kind, rule identity, attempt.
        query = query.bind("settled").bind(serde_json::json!({})).bind(1i32);
    }
    query.fetch_one(conn).await.unwrap().get(0)
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
    // Every node that reads a table or an index (ModifyTable names `loans` but reads nothing; a
    // Tid Scan reads only the rows whose addresses it is given: the odd rows the batch found).
    let scans: Vec<&Value> = nodes(plan)
        .into_iter()
        .filter(|n| n["Node Type"].as_str().is_some_and(|t| t.ends_with("Scan")))
        .filter(|n| n["Node Type"].as_str() != Some("Tid Scan"))
        .filter(|n| n["Relation Name"].as_str() == Some("loans") || n["Index Name"].is_string())
        // The heads a batch's entries continue, by primary key (`fine_heads`), and the edits
        // queued for loans the journal knew, by loan (`loan_changes`), which the batch supersedes.
        .filter(|n| n["Relation Name"].as_str() != Some("fine_heads"))
        .filter(|n| n["Relation Name"].as_str() != Some("loan_changes"))
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

/// [`assert_month_index_only`] over every statement of a batch: the entries read in all.
fn month_index_reads(plans: &[Value]) -> i64 {
    plans.iter().map(assert_month_index_only).sum()
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
    // The page reads about `shards` entries per row of its shard; the odd rows' update and the
    // settle statement read the same range again: about 3 × shards × batch in all, within the
    // bound this test has always had.
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
        // Shard 0 walks up, shard 1 down; each from its end and from the middle of the month.
        let middle = 37 * 14_000;
        for (shard, ids) in [
            (0, (i64::MIN, i64::MAX)),
            (0, (middle, i64::MAX)),
            (1, (i64::MIN, i64::MAX)),
            (1, (i64::MIN, middle)),
        ] {
            let plans = explain_batch(&db.pool, oct, (shard, shards), ids, batch).await;
            let read = month_index_reads(&plans);
            assert!(
                read <= bound,
                "{stats} statistics, shard {shard}, ids {ids:?}: read {read} index entries for a \
                 batch of {batch} (the month has {rows}): {plans:#?}"
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
    let odd: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM loans l
          WHERE l.returned_on BETWEEN '2026-10-01' AND '2026-10-31' AND {}",
        fine_settlement::ODD_ROW
    ))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(odd > 0, "the seed has loans with contradictory dates");
    // One batch as large as the month: the page reads the month's entries, the odd rows'
    // statement reads the same range once more (to find the held and odd rows, then settles the
    // odd ones where it found them), the settle statement reads the range a third time (the odd
    // rows' entries are no longer visible to it), and nothing else is read.
    let plans = explain_batch(&db.pool, oct, (0, 1), (i64::MIN, i64::MAX), 1_000_000).await;
    assert_eq!(plans.len(), 3);
    assert_eq!(month_index_reads(&plans), 3 * rows - odd, "{plans:#?}");
    let tid_scans: Vec<&Value> = plans
        .iter()
        .flat_map(nodes)
        .filter(|n| n["Node Type"].as_str() == Some("Tid Scan"))
        .collect();
    let odd_rows_read: i64 = tid_scans
        .iter()
        .map(|n| n["Actual Rows"].as_i64().unwrap_or(0))
        .sum();
    assert_eq!(
        odd_rows_read, odd,
        "the odd rows, by their addresses: {tid_scans:#?}"
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

    let plans = explain_batch(&db.pool, oct, (0, 1), (i64::MIN, i64::MAX), 500).await;
    assert_eq!(plans.len(), 1, "an empty page: no settle statement");
    let plan = &plans[0];
    assert_eq!(assert_month_index_only(plan), 0, "{plan:#}");
    // One probe of an empty index range and not one table page: no heap fetch, and a handful of
    // index pages (metapage, root, a leaf: 3-4 alone; 5 seen once in a full CI run, all of them
    // the index's, with no heap fetch: leaves VACUUM had not emptied yet on a loaded machine)
    // against the table's hundred.
    let fetched: i64 = nodes(plan)
        .into_iter()
        .filter(|n| n["Relation Name"].as_str() == Some("loans"))
        .map(|n| n["Heap Fetches"].as_i64().unwrap_or(0))
        .sum();
    let read = blocks(plan);
    let pages = loans_pages(&db.pool).await;
    assert!(
        fetched == 0 && read <= 8,
        "read {read} buffers, {fetched} heap fetches (the table has {pages} pages): {plan:#}"
    );
}

#[tokio::test]
async fn a_forced_rerun_right_after_a_run_settles_nothing_and_scans_nothing() {
    let db = test_db().await;
    let oct = bd("2026-10-31");
    seed_month(&db.pool, oct, 3000, 1).await;
    settle(&db.pool, oct).await;
    let job = FineSettlement {
        rules: Default::default(),
        batch_size: 500,
        guards: Default::default(),
    };
    let opts = run_options(true, true);
    let key = fine_settlement::key(oct, ShardSpec::new(0, 1).unwrap());
    let report = job_layer::run_once(
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
    let plans = explain_batch(&db.pool, oct, (0, 1), (i64::MIN, i64::MAX), 500).await;
    assert_eq!(plans.len(), 1, "an empty page: no settle statement");
    let plan = &plans[0];
    assert_eq!(assert_month_index_only(plan), 0, "{plan:#}");
}

/// Runs eight batches of shard 1 of 2 on one connection through the engine's own `run_batch`,
/// each in a transaction opened with `begin` and rolled back (the cursor still moves on), and
/// returns how PostgreSQL planned the settle statement on that connection: (generic plans, custom
/// plans).
async fn settle_plans(pool: &PgPool, job: &FineSettlement, begin: &str) -> (i64, i64) {
    let month = bd("2026-09-30");
    let key = fine_settlement::key(month, ShardSpec::new(1, 2).unwrap());
    let (plan, _) = job
        .plan(pool, &crate::helpers::claim_of(&key), false)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let mut cursor = job_layer::Cursor::default();
    for _ in 0..8 {
        let batch = one_batch(&mut conn, job, &plan, cursor, begin, false).await;
        assert_eq!(batch.scanned, u64::from(job.batch_size));
        cursor = batch.cursor;
    }
    // The month's loans are new to the journal: every batch is `settle_fresh`.
    let settle = &BatchSql::of(Walk::of_shard(1)).settle_fresh;
    let plans: (i64, i64) = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
    )
    .bind(settle)
    .fetch_one(&mut *conn)
    .await
    .expect("the settle statement is prepared once on its connection");
    conn.close().await.unwrap();
    plans
}

/// The batch statements are prepared once per connection (a batch then costs one round trip per
/// statement, not two), and every batch is still planned for its own cursor and shard count:
/// `BEGIN_BATCH` sets `plan_cache_mode = force_custom_plan`. Without it, PostgreSQL switches the
/// same statements to a generic plan after five executions (the control below), which would read
/// the month index with the shard test left unfolded and the range unknown.
#[tokio::test]
async fn every_batch_is_planned_for_its_own_cursor_also_after_five_executions() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-09-30"), 3000, 1).await;
    let job = FineSettlement {
        rules: Default::default(),
        batch_size: 100,
        guards: Default::default(),
    };
    let (generic, custom) = settle_plans(&db.pool, &job, &job.begin_batch()).await;
    assert_eq!((generic, custom), (0, 8), "the engine's batches");
    let without_pin = fine_settlement::BEGIN_BATCH
        .replace("\n    SET LOCAL plan_cache_mode = force_custom_plan;", "");
    assert_ne!(without_pin, fine_settlement::BEGIN_BATCH);
    let (generic, _) = settle_plans(&db.pool, &job, &without_pin).await;
    assert!(
        generic > 0,
        "control: without the setting the plan turns generic"
    );
}

/// Issue 48: after a large run every idle tick logged a slow statement: the upkeep's "is any
/// settled loan without a journal entry?" planned a sequential scan of `loans` on statistics from
/// before the run (when most settled rows had no `fine_seq`) and read the whole table to find
/// none. The probe is pinned to its partial index, whatever the statistics say.
#[tokio::test]
async fn the_upkeeps_probe_reads_its_partial_index_on_statistics_from_before_a_run() {
    let db = test_db().await;
    // Statistics of a table whose settled rows mostly have no journal entry yet.
    sqlx::raw_sql(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents,
                            fine_settled_at)
         SELECT i, 1, 1, '2026-09-01', '2026-09-10', '2026-09-12', 100, now()
           FROM generate_series(1, 20000) i;
         ANALYZE loans;
         UPDATE loans SET fine_seq = 1;",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let scans = |plan: &Value| -> Vec<String> {
        nodes(&plan[0]["Plan"])
            .into_iter()
            .filter(|n| n["Relation Name"].as_str() == Some("loans"))
            .map(|n| n["Node Type"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    let explain = "EXPLAIN (FORMAT JSON)
         SELECT EXISTS (SELECT 1 FROM loans WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL)";
    // The control: unpinned, these statistics choose the table.
    let unpinned: Value = sqlx::query_scalar(explain)
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(scans(&unpinned), ["Seq Scan"], "{unpinned:#}");
    // As the upkeep runs it.
    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    sqlx::query(fine_settlement::journal::PIN_OPENING)
        .execute(&mut *tx)
        .await
        .unwrap();
    let pinned: Value = sqlx::query_scalar(explain)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert!(
        scans(&pinned).iter().all(|s| s.starts_with("Index")),
        "{pinned:#}"
    );
    tx.rollback().await.unwrap();
    assert!(!fine_settlement::journal::any_unjournaled(&mut conn)
        .await
        .unwrap());
}
