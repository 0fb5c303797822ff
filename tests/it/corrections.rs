//! Issue 34, part C: corrections and libraryd's edits never lose each other. A correction takes
//! only its own month's queued edits; a loan moved into a month being corrected is re-priced and
//! counted; every id is corrected; no adjustment is written for a fine that did not change; a
//! refused correction (a paused job) leaves its month as it was.
//!
//! Each test's doc comment says what the code before (main at f7161ac) did instead.

use crate::helpers::*;
use crate::journal::{assert_journal_whole, correct, count, insert_loan, loan, run_ok_json, RATE};
use sqlx::PgPool;

/// The `fine_adjustments` rows, by loan: (loan, old, new).
async fn adjustments(pool: &PgPool) -> Vec<(i64, i64, i64)> {
    sqlx::query_as("SELECT loan_id, old_cents, new_cents FROM fine_adjustments ORDER BY loan_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Before, a correction's plan read the loans after i64::MIN, exclusive: the loan with that id was
/// never corrected (it kept the old rule's 500 cents, the new rule gives 600).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_corrects_every_id_from_i64_min_to_i64_max() {
    let db = test_db().await;
    let ids = [i64::MIN, -1, 0, 5, i64::MAX];
    for id in ids {
        insert_loan(&db.pool, id, "2026-10-01", Some("2026-10-11")).await;
    }
    for shard in 0..2 {
        run_ok_json(&db.url, &[], "2026-10-31", shard, 2);
    }
    let new_rule = [(RATE, "60")];
    let out = correct(
        &db.url,
        &new_rule,
        "2026-10-31",
        "RATE-60",
        "the rate is 60",
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(json_of(&out)["changed"], ids.len());
    for id in ids {
        assert_eq!(loan(&db.pool, id).await, (600, true, Some(2)), "loan {id}");
    }
    let mut expected: Vec<(i64, i64, i64)> = ids.iter().map(|id| (*id, 500, 600)).collect();
    expected.sort();
    assert_eq!(adjustments(&db.pool).await, expected);
    assert_verified(&db.url, &new_rule, "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, `correct` on a paused job re-pinned the month to the new rule and held it, then exited
/// 3 when its first claim found the pause: the month stayed pinned to a rule nothing had applied,
/// and held by a correction nobody had asked to finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_on_a_paused_job_is_refused_before_it_repins_or_holds_the_month() {
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2026-10-31"), 30, 1).await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    let params = || {
        sqlx::query_scalar::<_, serde_json::Value>(
            "SELECT to_jsonb(p) FROM job_params p ORDER BY job_name, business_date",
        )
        .fetch_all(&db.pool)
    };
    let before = params().await.unwrap();
    let fines = loans_snapshot(&db.pool).await;
    run_ok(settlementd(Some(&db.url)).args([
        "pause",
        "--job",
        "fine-settlement",
        "--reason",
        "an audit of October",
    ]));

    let new_rule = [(RATE, "60")];
    let out = correct(
        &db.url,
        &new_rule,
        "2026-10-31",
        "RATE-60",
        "the rate is 60",
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("is paused since") && err.contains("an audit of October"),
        "{err}"
    );
    assert_eq!(
        params().await.unwrap(),
        before,
        "the pin or its hold changed"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM fine_corrections").await,
        0
    );
    assert_eq!(loans_snapshot(&db.pool).await, fines);

    run_ok(settlementd(Some(&db.url)).args(["resume", "--job", "fine-settlement"]));
    let out = correct(
        &db.url,
        &new_rule,
        "2026-10-31",
        "RATE-60",
        "the rate is 60",
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_verified(&db.url, &new_rule, "2026-10-31");
    assert_journal_whole(&db.pool).await;
}
