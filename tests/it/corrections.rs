//! Issue 34, part C: corrections and libraryd's edits never lose each other. A correction takes
//! only its own month's queued edits; a loan moved into a month being corrected is re-priced and
//! counted; every id is corrected; no adjustment is written for a fine that did not change; a
//! refused correction (a paused job) leaves its month as it was.
//!
//! Each test's doc comment says what the code before (main at f7161ac) did instead.

use crate::helpers::*;
use crate::journal::{
    assert_journal_whole, correct, count, entries, entry, insert_loan, loan, run_ok_json, sql, RATE,
};
use settlementd::job_layer::Owner;
use settlementd::jobs::fine_settlement::{self, correction};
use sqlx::PgPool;
use std::time::Duration;

/// The queued edits of `id`.
async fn queued(pool: &PgPool, id: i64) -> i64 {
    count(
        pool,
        &format!("SELECT count(*) FROM loan_changes WHERE loan_id = {id}"),
    )
    .await
}

/// libraryd moves loan `id`'s return to `date`, in its own transaction.
async fn move_return(pool: &PgPool, id: i64, date: &str) {
    sqlx::query("UPDATE loans SET returned_on = $2::date WHERE id = $1")
        .bind(id)
        .bind(date)
        .execute(pool)
        .await
        .unwrap();
}

/// `correct`, which must exit 0; its `--json` reply.
fn correct_ok(
    url: &str,
    env: &[(&str, &str)],
    month: &str,
    key: &str,
    reason: &str,
) -> serde_json::Value {
    let out = correct(url, env, month, key, reason);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    json_of(&out)
}

/// The rule the corrections of October apply: 60 cents a day.
const NEW_RULE: [(&str, &str); 1] = [(RATE, "60")];

/// The correction of October to [`NEW_RULE`], which must exit 0; its `--json` reply.
fn correct_to_60(url: &str) -> serde_json::Value {
    correct_ok(url, &NEW_RULE, "2026-10-31", "RATE-60", "the rate is 60")
}

/// The `fine_adjustments` rows, by loan: (loan, old, new).
async fn adjustments(pool: &PgPool) -> Vec<(i64, i64, i64)> {
    sqlx::query_as("SELECT loan_id, old_cents, new_cents FROM fine_adjustments ORDER BY loan_id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Before, a correction deleted the queued edits of every loan of its plan, taken or not: loan 1,
/// corrected in August long ago and settled in September since, lost the edit libraryd queued
/// under September while August was corrected, and kept 2,500 cents where the rule gives 1,750.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_takes_only_its_own_months_queued_edits() {
    let db = test_db().await;
    insert_loan(&db.pool, 1, "2026-08-01", Some("2026-08-11")).await;
    insert_loan(&db.pool, 2, "2026-08-01", Some("2026-08-05")).await;
    run_ok_json(&db.url, &[], "2026-08-31", 0, 1);
    // Loan 1 moves to September: reversed in August, settled in September.
    move_return(&db.pool, 1, "2026-09-20").await;
    run_ok_json(&db.url, &[], "2026-08-31", 0, 1);
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    assert_eq!(loan(&db.pool, 1).await, (2500, true, Some(3)));

    // libraryd edits both: loan 1's edit is September's money, loan 2's August's.
    move_return(&db.pool, 1, "2026-09-05").await;
    move_return(&db.pool, 2, "2026-08-07").await;
    correct_ok(&db.url, &[], "2026-08-31", "AUG-1", "recheck August");

    // August's edit was taken by its correction; September's waits for September.
    assert_eq!(queued(&db.pool, 2).await, 0);
    assert_eq!(loan(&db.pool, 2).await, (300, true, Some(2)));
    assert_eq!(queued(&db.pool, 1).await, 1, "September's edit was dropped");
    assert_eq!(loan(&db.pool, 1).await, (2500, true, Some(3)));
    assert_verified(&db.url, &[], "2026-08-31");

    let report = run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    assert_eq!(report["updated"], 1, "{report}");
    assert_eq!(loan(&db.pool, 1).await, (1750, true, Some(4)));
    assert_eq!(
        entries(&db.pool, 1).await[3],
        entry(4, "repriced", "2026-09-01", 2500, 1750)
    );
    for month in ["2026-08-31", "2026-09-30"] {
        assert_verified(&db.url, &[], month);
    }
    assert_journal_whole(&db.pool).await;
}

/// Before, a settled loan libraryd moved back into October while October was being corrected lost
/// its queued edit to the correction (its plan held the loan's old October entry): October's
/// `verify` said right with the loan missing from `returned`, and no later run re-priced it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_moved_into_a_month_being_corrected_is_repriced_and_counted_by_verify() {
    let db = test_db().await;
    // Loan 10 is October's, then moves to September (reversed in October, late in September).
    insert_loan(&db.pool, 10, "2026-09-01", Some("2026-10-11")).await;
    insert_loan(&db.pool, 11, "2026-10-01", Some("2026-10-03")).await;
    insert_loan(&db.pool, 12, "2026-09-01", Some("2026-09-11")).await;
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    move_return(&db.pool, 10, "2026-09-21").await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    assert_eq!(loan(&db.pool, 10).await, (1000, true, Some(3)));

    // October's correction begins: the month is re-pinned and held.
    let s = settings(&[]);
    let rule = settlementd::app::settlement_job(&s)
        .rule_of(bd("2026-10-31").date())
        .unwrap()
        .rule;
    let mut conn = db.pool.acquire().await.unwrap();
    let begun = correction::begin(
        &mut conn,
        "OCT-1",
        bd("2026-10-31"),
        1,
        "recheck October",
        &fine_settlement::rule_params(&rule),
        &Owner("test".into()),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(matches!(begun, correction::Begun::Started(_)), "{begun:?}");
    drop(conn);

    // While it is held, libraryd moves two settled September loans into October: loan 12 is
    // re-priced out of September at once (an unsettled October return for the correction), loan
    // 10's edit still waits in September's queue when the correction runs.
    move_return(&db.pool, 12, "2026-10-08").await;
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    assert_eq!(loan(&db.pool, 12).await, (0, false, Some(2)));
    move_return(&db.pool, 10, "2026-10-06").await;
    correct_ok(&db.url, &[], "2026-10-31", "OCT-1", "recheck October");
    assert_eq!(loan(&db.pool, 12).await, (1850, true, Some(3)));

    // Loan 10 is October's now, its edit not re-priced yet: October is not right, and says why.
    assert_eq!(
        queued(&db.pool, 10).await,
        1,
        "the correction dropped its edit"
    );
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["edits_waiting"]["ids"],
        serde_json::json!([10])
    );

    // September's sweep takes its money out; October's next run settles it under October's pin.
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    let report = run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    assert_eq!(report["updated"], 1, "{report}");
    assert_eq!(loan(&db.pool, 10).await, (1750, true, Some(5)));
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["returned"], 3, "{report}");
    assert_eq!(report["totals"]["fine_cents_sum"], 100 + 1750 + 1850);
    assert_verified(&db.url, &[], "2026-09-30");
    assert_journal_whole(&db.pool).await;
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
    let reply = correct_to_60(&db.url);
    assert_eq!(reply["changed"], ids.len());
    for id in ids {
        assert_eq!(loan(&db.pool, id).await, (600, true, Some(2)), "loan {id}");
    }
    let mut expected: Vec<(i64, i64, i64)> = ids.iter().map(|id| (*id, 500, 600)).collect();
    expected.sort();
    assert_eq!(adjustments(&db.pool).await, expected);
    assert_verified(&db.url, &NEW_RULE, "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, a correction wrote a `fine_adjustments` row with old = new for every queued edit it
/// re-priced to the same fine and every return it settled at 0, and counted each one as changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_writes_no_adjustment_for_a_fine_that_did_not_change() {
    let db = test_db().await;
    insert_loan(&db.pool, 1, "2026-10-01", Some("2026-10-11")).await; // 500, 600 at 60
    insert_loan(&db.pool, 2, "2026-10-20", Some("2026-10-18")).await; // 0, edited: still 0
    insert_loan(&db.pool, 3, "2026-03-01", Some("2026-10-10")).await; // the cap, edited: still
    insert_loan(&db.pool, 4, "2026-10-20", Some("2026-10-18")).await; // 0, untouched
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    insert_loan(&db.pool, 5, "2026-10-20", Some("2026-10-15")).await; // unsettled, 0
    sql(
        &db.pool,
        "UPDATE loans SET returned_on = returned_on + 1 WHERE id IN (2, 3)",
    )
    .await;

    let reply = correct_to_60(&db.url);
    assert_eq!(adjustments(&db.pool).await, [(1, 500, 600)]);
    assert_eq!(
        (reply["changed"].as_i64(), reply["net_cents"].as_i64()),
        (Some(1), Some(100))
    );

    // The journal follows what changed besides the fine: the edited dates, the first settlement.
    let dates = |id: i64| {
        sqlx::query_scalar::<_, chrono::NaiveDate>(
            "SELECT returned_on FROM fine_journal_entries WHERE loan_id = $1
              ORDER BY seq DESC LIMIT 1",
        )
        .bind(id)
        .fetch_one(&db.pool)
    };
    assert_eq!(dates(2).await.unwrap().to_string(), "2026-10-19");
    assert_eq!(dates(3).await.unwrap().to_string(), "2026-10-11");
    assert_eq!(
        entries(&db.pool, 5).await,
        [entry(1, "corrected", "2026-10-01", 0, 0)]
    );
    // A fine and dates that did not change get no entry at all.
    assert_eq!(
        entries(&db.pool, 4).await,
        [entry(1, "settled", "2026-10-01", 0, 0)]
    );
    assert_eq!(loan(&db.pool, 3).await, (10_000, true, Some(2)));
    assert_verified(&db.url, &NEW_RULE, "2026-10-31");
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
    pause_settlement(&db.url, "an audit of October");

    let out = correct(
        &db.url,
        &NEW_RULE,
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
    let reply = correct_to_60(&db.url);
    assert!(reply["changed"].as_i64() > Some(0), "{reply}");
    assert_verified(&db.url, &NEW_RULE, "2026-10-31");
    assert_journal_whole(&db.pool).await;
}
