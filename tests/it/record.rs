//! Issue 34, part A: the record is settlementd's own. A loan's chain ends at its head in
//! `fine_heads`, kept by a trigger on the journal, never at a column of libraryd's row: a reload of
//! the table, a loan unsettled by hand, deleted and re-created, or renumbered is settled once more
//! from where its money stands, counted once, and a chain that is not whole is named by `verify`.
//!
//! Each test's doc comment says what main at 0033c45 did instead.

use crate::helpers::*;
use crate::journal::{assert_journal_whole, count, entries, entry, run_ok_json};
use sqlx::PgPool;

const OCTOBER: &str = "2026-10-31";
const STATEMENTS: &str = settlementd::jobs::member_statements::JOB_NAME;

async fn sql(pool: &PgPool, statement: &str) {
    sqlx::query(statement).execute(pool).await.unwrap();
}

/// October's settled loans in the table: (rows, cents).
async fn table_totals(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*), COALESCE(sum(fine_cents), 0)::bigint FROM loans
          WHERE fine_settled_at IS NOT NULL AND returned_on BETWEEN '2026-10-01' AND '2026-10-31'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `status --json`'s totals of October: (settled rows, cents).
fn status_totals(url: &str) -> (i64, i64) {
    let out = cli(url, &[], &["status", "--business-date", OCTOBER, "--json"]);
    assert_eq!(out.status.code(), Some(0), "status: {}", stderr_of(&out));
    let report = json_of(&out);
    let totals = &report["totals"];
    let number = |key: &str| {
        totals[key]
            .as_i64()
            .or_else(|| totals[key].as_str().and_then(|s| s.parse().ok()))
            .unwrap_or_else(|| panic!("status totals have no {key}: {report}"))
    };
    (number("settled_rows"), number("fine_cents_sum"))
}

/// `settlementd VERB --job member-statements --business-date 2026-10-31 --json`, which must exit 0.
fn statements_cli(url: &str, verb: &str) {
    let out = cli(
        url,
        &[],
        &[
            verb,
            "--job",
            STATEMENTS,
            "--business-date",
            OCTOBER,
            "--json",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{verb} --job {STATEMENTS}: {} {}",
        String::from_utf8_lossy(&out.stdout),
        stderr_of(&out)
    );
}

/// Runs October's settlement (one shard) and its statements.
fn settle_and_state(url: &str) {
    run_ok_json(url, &[], OCTOBER, 0, 1);
    statements_cli(url, "run");
}

/// `verify --job member-statements` of October: right.
fn assert_statements_right(url: &str) {
    statements_cli(url, "verify");
}

/// October ends right: `status` counts `totals`, `verify` of the settlement and of the statements
/// exit 0, and the journal is whole.
async fn assert_right(db: &TestDb, totals: (i64, i64)) {
    assert_eq!(status_totals(&db.url), totals);
    assert_verified(&db.url, &[], OCTOBER);
    assert_statements_right(&db.url);
    assert_journal_whole(&db.pool).await;
}

/// `verify` of October exits 1, and its journal check `check` names `id` alone.
fn assert_names_only(url: &str, check: &str, id: i64) {
    let (code, report) = verify(url, &[], OCTOBER);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"][check],
        serde_json::json!({"count": 1, "ids": [id]}),
        "{report}"
    );
}

/// `statements`, each bound to the loan `id`, in one transaction.
async fn in_one_transaction(pool: &PgPool, id: i64, statements: &[&str]) {
    let mut tx = pool.begin().await.unwrap();
    for statement in statements {
        sqlx::query(statement)
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

/// The fined loan with the lowest id: (id, fine).
async fn first_fined(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT id, fine_cents FROM loans WHERE fine_cents > 0 ORDER BY id LIMIT 1")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A month of 60 loans settled and stated, and what it holds: (table totals, statements).
async fn october(db: &TestDb) -> ((i64, i64), Vec<(i64, i64, i64)>) {
    seed_month_alone(&db.pool, bd(OCTOBER), 60, 1).await;
    settle_and_state(&db.url);
    (table_totals(&db.pool).await, statements(&db.pool).await)
}

async fn statements(pool: &PgPool) -> Vec<(i64, i64, i64)> {
    sqlx::query_as(
        "SELECT member_id, fines::bigint, fine_cents::bigint FROM member_fine_statements
          WHERE business_date = '2026-10-31' ORDER BY member_id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// libraryd reloads its table from an export without settlementd's columns.
async fn reload(pool: &PgPool) {
    sql(
        pool,
        "CREATE TABLE loans_export AS
         SELECT id, member_id, book_id, borrowed_on, due_on, returned_on FROM loans",
    )
    .await;
    sql(pool, "TRUNCATE loans").await;
    sql(
        pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT * FROM loans_export",
    )
    .await;
    sql(pool, "DROP TABLE loans_export").await;
}

/// Before, the reloaded loans were settled again at seq 1, both seq-1 entries matched their rows,
/// and `status` counted every loan twice (and the statements doubled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_libraryds_table_is_settled_once_more_and_ends_as_before() {
    let db = test_db().await;
    let (totals, stated) = october(&db).await;
    assert!(totals.0 > 40 && totals.1 > 0, "{totals:?}");
    assert_eq!(status_totals(&db.url), totals);
    let journaled: i64 = count(&db.pool, "SELECT count(*) FROM fine_journal_entries").await;

    reload(&db.pool).await;
    // Until the next run the month is not right: its returns wait, and their rows are not what
    // the record says.
    let (code, report) = verify(&db.url, &[], OCTOBER);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(report["unsettled"]["count"], totals.0, "{report}");

    settle_and_state(&db.url);
    assert_eq!(table_totals(&db.pool).await, totals);
    assert_eq!(
        status_totals(&db.url),
        totals,
        "status counts each loan once"
    );
    assert_eq!(statements(&db.pool).await, stated);
    assert_verified(&db.url, &[], OCTOBER);
    assert_statements_right(&db.url);
    // Re-journaled once: one more entry per settled loan, each continuing its chain.
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM fine_journal_entries").await,
        journaled + totals.0
    );
    assert_journal_whole(&db.pool).await;
    let (fined, fine) = first_fined(&db.pool).await;
    assert_eq!(
        entries(&db.pool, fined).await,
        vec![
            entry(1, "settled", "2026-10-01", 0, fine),
            entry(2, "late", "2026-10-01", fine, fine),
        ]
    );
}

/// The same reload with one fine changed by hand after it: `verify` exits 1 naming that loan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fine_changed_by_hand_after_a_reload_is_named_by_verify() {
    let db = test_db().await;
    october(&db).await;
    reload(&db.pool).await;
    settle_and_state(&db.url);
    let id: i64 = count(
        &db.pool,
        "SELECT min(id) FROM loans WHERE fine_settled_at IS NOT NULL",
    )
    .await;
    sqlx::query("UPDATE loans SET fine_cents = fine_cents + 100 WHERE id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    assert_names_only(&db.url, "off_journal", id);
}

/// Before, a loan unsettled by hand (`fine_settled_at = NULL`) was settled again with an entry
/// from 0: its entries added up to twice its fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_unsettled_by_hand_is_settled_again_from_where_its_money_stands() {
    let db = test_db().await;
    let (totals, _) = october(&db).await;
    let (id, fine) = first_fined(&db.pool).await;
    sqlx::query("UPDATE loans SET fine_settled_at = NULL, fine_cents = 0 WHERE id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    settle_and_state(&db.url);
    assert_eq!(
        entries(&db.pool, id).await,
        vec![
            entry(1, "settled", "2026-10-01", 0, fine),
            entry(2, "late", "2026-10-01", fine, fine),
        ]
    );
    assert_right(&db, totals).await;
}

/// Before, a settled loan deleted and inserted again under its id in one transaction kept its
/// first entry beside a new seq-1 one: counted twice, its entries twice its fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_deleted_and_recreated_under_its_id_is_counted_once() {
    let db = test_db().await;
    let (totals, stated) = october(&db).await;
    let (id, fine) = first_fined(&db.pool).await;
    in_one_transaction(
        &db.pool,
        id,
        &[
            "CREATE TEMP TABLE kept ON COMMIT DROP AS
         SELECT id, member_id, book_id, borrowed_on, due_on, returned_on FROM loans WHERE id = $1",
            "DELETE FROM loans WHERE id = $1",
            "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT * FROM kept WHERE id = $1",
        ],
    )
    .await;
    settle_and_state(&db.url);
    assert_eq!(status_totals(&db.url), totals);
    assert_eq!(table_totals(&db.pool).await, totals);
    assert_eq!(statements(&db.pool).await, stated);
    // Settled again from where its money stood, once: the deletion libraryd's transaction queued
    // is superseded by pricing the loan as it is now, and goes with that batch (one entry per
    // loan per run).
    assert_eq!(
        entries(&db.pool, id).await,
        vec![
            entry(1, "settled", "2026-10-01", 0, fine),
            entry(2, "late", "2026-10-01", fine, fine),
        ]
    );
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM loan_changes WHERE loan_id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(queued, 0, "the superseded edit is gone with the batch");
    assert_journal_whole(&db.pool).await;
    assert_verified(&db.url, &[], OCTOBER);
    assert_statements_right(&db.url);
}

/// Before, a settled loan renumbered in libraryd kept its marks under the new id with no entry:
/// it vanished from `verify`'s totals and could never be journaled again, and the old id's fine
/// stayed on the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renumbered_loan_moves_its_money_to_its_new_id() {
    let db = test_db().await;
    let (totals, _) = october(&db).await;
    let (id, fine) = first_fined(&db.pool).await;
    let new_id = 1_000_000 + id;
    sqlx::query("UPDATE loans SET id = $2 WHERE id = $1")
        .bind(id)
        .bind(new_id)
        .execute(&db.pool)
        .await
        .unwrap();
    // The row under its new id is a loan the record has not settled yet.
    let (_, settled, seq) = crate::journal::loan(&db.pool, new_id).await;
    assert_eq!((settled, seq), (false, None));
    settle_and_state(&db.url);
    assert_eq!(
        entries(&db.pool, id).await,
        vec![
            entry(1, "settled", "2026-10-01", 0, fine),
            entry(2, "deleted", "2026-10-01", fine, 0),
        ]
    );
    assert_eq!(
        entries(&db.pool, new_id).await,
        vec![entry(1, "late", "2026-10-01", 0, fine)]
    );
    assert_right(&db, totals).await;
}

/// Before, `verify` never checked a chain's continuity: an entry written by the release before
/// this one after a reload (seq 1 again, before 0) beside the loan's first made it "right".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_that_does_not_continue_its_loans_chain_is_named_by_verify() {
    let db = test_db().await;
    october(&db).await;
    let (id, fine) = first_fined(&db.pool).await;
    assert_verified(&db.url, &[], OCTOBER);
    sqlx::query(
        "INSERT INTO fine_journal (month, kind, shards, attempt, loan_ids, seqs, due_on,
                                   returned_on, before_cents, after_cents)
         SELECT '2026-10-01', 'late', 1, 9, ARRAY[id], ARRAY[1], ARRAY[due_on],
                ARRAY[returned_on], ARRAY[0::bigint], ARRAY[fine_cents]
           FROM loans WHERE id = $1",
    )
    .bind(id)
    .execute(&db.pool)
    .await
    .unwrap();
    assert_names_only(&db.url, "broken", id);
    // The head records it, and the loan is counted once.
    let (entries_, breaks): (i32, i32) =
        sqlx::query_as("SELECT entries, breaks FROM fine_heads WHERE loan_id = $1")
            .bind(id)
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((entries_, breaks), (2, 1));
    assert!(fine > 0);
}

/// Before, libraryd's edits made under `session_replication_role = replica` (a restore or
/// replication tool's setting) escaped settlementd's triggers: a settled loan's due date moved
/// back ten days kept its old fine, and nothing waited. Now every trigger on loans fires ALWAYS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_made_as_a_replication_tool_is_repriced() {
    let db = test_db().await;
    october(&db).await;
    // A fine below the rule's cap, so that ten more days cost more.
    let (id, fine): (i64, i64) = sqlx::query_as(
        "SELECT id, fine_cents FROM loans WHERE fine_cents BETWEEN 1 AND 5000 ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    in_one_transaction(
        &db.pool,
        id,
        &[
            "SET LOCAL session_replication_role = replica",
            "UPDATE loans SET due_on = due_on - 10 WHERE id = $1",
        ],
    )
    .await;
    settle_and_state(&db.url);
    let repriced: i64 = sqlx::query_scalar("SELECT fine_cents FROM loans WHERE id = $1")
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(repriced > fine, "{fine} c before, {repriced} c after");
    assert_eq!(
        entries(&db.pool, id).await,
        vec![
            entry(1, "settled", "2026-10-01", 0, fine),
            entry(2, "repriced", "2026-10-01", fine, repriced),
        ]
    );
    assert_statements_right(&db.url);
}

/// Before, a settled loan without a journal entry (settled by a release before the journal, or
/// its `fine_seq` lost) was left out of `status` totals while the month said "closed"; only
/// `verify` named it. Now the month is not closed until the loan has its opening entry, and says
/// what gives it one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_loan_without_a_journal_entry_keeps_its_month_open_until_it_has_one() {
    let db = test_db().await;
    october(&db).await;
    // A loan settled as a release before the journal did: its fine, no entry, no seq.
    sql(
        &db.pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents,
                            fine_settled_at)
         VALUES (900001, 1, 1, '2026-09-18', '2026-10-01', '2026-10-21', 1000, now())",
    )
    .await;
    let status = |url: &str| {
        let out = cli(url, &[], &["status", "--business-date", OCTOBER, "--json"]);
        assert_eq!(out.status.code(), Some(0), "status: {}", stderr_of(&out));
        json_of(&out)
    };
    let report = status(&db.url);
    assert_eq!(report["closed"], false, "{report}");
    let verdict = report["verdict"].as_str().unwrap_or_default();
    assert!(
        verdict.contains("1 settled loan without a journal entry"),
        "{report}"
    );
    assert!(
        report["next"]
            .as_str()
            .is_some_and(|n| n.contains("opening entry")),
        "{report}"
    );

    // `migrate` gives it its opening entry: closed, and counted.
    let out = cli(&db.url, &[], &["migrate"]);
    assert_eq!(out.status.code(), Some(0), "migrate: {}", stderr_of(&out));
    let report = status(&db.url);
    assert_eq!(
        (&report["closed"], &report["verdict"]),
        (&serde_json::json!(true), &serde_json::json!("closed")),
        "{report}"
    );
    // The opening entry is a journal row of the month: its member's statement follows.
    statements_cli(&db.url, "run");
    assert_right(&db, table_totals(&db.pool).await).await;
}
