//! Issue 47: the statements follow a loan wherever it goes, each month's journal balances, and
//! previews equal writes. Each scenario is the one the issue reports, with its numbers: loan 1
//! (member 10, 500 cents) and loan 2 (member 11, 350 cents), returned in September.
//!
//! Every scenario ends with the same check, against an oracle computed here from `loans` alone:
//! every member's statement of every month is the member's settled fines there (no `correct`, no
//! hand work), each month's journal entries net to the fines of the loans settled in it, and
//! `verify` of the settlement and of the statements says right.

use crate::helpers::*;
use chrono::NaiveDate;
use serde_json::Value;
use sqlx::PgPool;
use std::collections::BTreeMap;

const SEPTEMBER: &str = "2026-09-30";
const OCTOBER: &str = "2026-10-31";
const STATEMENTS: &str = settlementd::jobs::member_statements::JOB_NAME;

async fn sql(pool: &PgPool, statement: &str) {
    sqlx::raw_sql(statement).execute(pool).await.unwrap();
}

/// Loan 1 (member 10, due 1 September, back the 11th: 10 days late, 500 cents) and loan 2 (member
/// 11, due 3 September, back the 10th: 350 cents), settled, and September's statements.
async fn september(pool: &PgPool, url: &str) {
    sql(
        pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on) VALUES
            (1, 10, 1, '2026-08-18', '2026-09-01', '2026-09-11'),
            (2, 11, 2, '2026-08-20', '2026-09-03', '2026-09-10')",
    )
    .await;
    settle(url, SEPTEMBER);
    state(url, SEPTEMBER);
    assert_eq!(
        stated(pool).await,
        BTreeMap::from([
            ((day(SEPTEMBER), 10), (1, 500)),
            ((day(SEPTEMBER), 11), (1, 350))
        ])
    );
}

fn day(text: &str) -> NaiveDate {
    NaiveDate::parse_from_str(text, "%Y-%m-%d").unwrap()
}

/// `settlementd run` of `month` (one shard), which must exit 0; its report.
fn settle(url: &str, month: &str) -> Value {
    let out = cli(url, &[], &["run", "--business-date", month, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    json_of(&out)
}

/// September and October settled in the order asked (October first or not), then their member
/// statements in the same order.
fn settle_and_state_both(url: &str, october_first: bool) {
    let months = if october_first {
        [OCTOBER, SEPTEMBER]
    } else {
        [SEPTEMBER, OCTOBER]
    };
    for month in months {
        settle(url, month);
    }
    for month in months {
        state(url, month);
    }
}

/// The member statements of `month`, which must exit 0.
fn state(url: &str, month: &str) {
    let out = cli(
        url,
        &[],
        &[
            "run",
            "--job",
            STATEMENTS,
            "--business-date",
            month,
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
}

/// Every statement: (month's end, member) → (fines, cents).
async fn stated(pool: &PgPool) -> BTreeMap<(NaiveDate, i64), (i64, i64)> {
    let rows: Vec<(NaiveDate, i64, i64, i64)> = sqlx::query_as(
        "SELECT business_date, member_id, fines, fine_cents::bigint FROM member_fine_statements",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(m, member, f, c)| ((m, member), (f, c)))
        .collect()
}

/// The oracle: each member's settled fines above 0 per month of return, from `loans` alone.
async fn owed(pool: &PgPool) -> BTreeMap<(NaiveDate, i64), (i64, i64)> {
    let rows: Vec<(NaiveDate, i64, i64, i64)> = sqlx::query_as(
        "SELECT (date_trunc('month', returned_on) + interval '1 month - 1 day')::date, member_id,
                count(*), sum(fine_cents)::bigint
           FROM loans WHERE fine_settled_at IS NOT NULL AND fine_cents > 0 GROUP BY 1, 2",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(m, member, f, c)| ((m, member), (f, c)))
        .collect()
}

/// Per month (first day): what its journal entries net to, and the fines of its settled loans.
async fn nets(pool: &PgPool) -> (BTreeMap<NaiveDate, i64>, BTreeMap<NaiveDate, i64>) {
    let journal: Vec<(NaiveDate, i64)> = sqlx::query_as(
        "SELECT month, sum(after_cents - COALESCE(before_cents, 0))::bigint
           FROM fine_journal_entries GROUP BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let loans: Vec<(NaiveDate, i64)> = sqlx::query_as(
        "SELECT date_trunc('month', returned_on)::date, sum(fine_cents)::bigint
           FROM loans WHERE fine_settled_at IS NOT NULL GROUP BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut journal: BTreeMap<NaiveDate, i64> = journal.into_iter().collect();
    // A month whose money all left it nets to 0, and holds no settled loan.
    journal.retain(|_, net| *net != 0);
    (journal, loans.into_iter().collect())
}

/// The end of every scenario: statements as the loans say, every month's journal balanced, and
/// `verify` of both jobs right for `months`.
async fn assert_follows(pool: &PgPool, url: &str, months: &[&str]) {
    assert_eq!(stated(pool).await, owed(pool).await, "statements = loans");
    let (journal, loans) = nets(pool).await;
    assert_eq!(journal, loans, "each month's journal nets to its loans");
    for month in months {
        let (code, report) = verify(url, &[], month);
        assert_eq!(code, Some(0), "verify {month}: {report}");
        assert_eq!(report["journal"]["balanced"], true, "{report}");
        let out = cli(
            url,
            &[],
            &[
                "verify",
                "--job",
                STATEMENTS,
                "--business-date",
                month,
                "--json",
            ],
        );
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}

/// The first report: loan 1 deleted and inserted again under its id for member 99 stated
/// member 10 owing 500 *and* member 99 owing 500 (1,350 cents for 850 of fines), and `status`
/// called the month closed.
#[tokio::test]
async fn a_loan_re_created_for_another_member_leaves_the_old_members_statement() {
    let db = test_db().await;
    september(&db.pool, &db.url).await;
    sql(
        &db.pool,
        "BEGIN;
         DELETE FROM loans WHERE id = 1;
         INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (1, 99, 1, '2026-08-18', '2026-09-01', '2026-09-11');
         COMMIT",
    )
    .await;
    let report = settle(&db.url, SEPTEMBER);
    assert_eq!(report["updated"], 1, "one write for the loan: {report}");
    state(&db.url, SEPTEMBER);
    assert_eq!(
        stated(&db.pool).await,
        BTreeMap::from([
            ((day(SEPTEMBER), 11), (1, 350)),
            ((day(SEPTEMBER), 99), (1, 500))
        ])
    );
    // The money left member 10 and came to member 99 in one statement: two entries, one run.
    let entries: Vec<(String, Option<i64>, Option<i64>, i64)> = sqlx::query_as(
        "SELECT kind, member_id, before_cents, after_cents FROM fine_journal_entries
          WHERE loan_id = 1 ORDER BY seq",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        entries,
        [
            ("settled".to_string(), Some(10), Some(0), 500),
            ("reversed".to_string(), Some(10), Some(500), 0),
            ("late".to_string(), Some(99), Some(0), 500),
        ]
    );
    assert_follows(&db.pool, &db.url, &[SEPTEMBER]).await;
    drop_db(db).await;
}

/// The second report: a reload of libraryd's loans (TRUNCATE, then every row inserted
/// again without settlementd's columns) that moves loan 1's return from September to October
/// billed member 10 500 cents in September and 1,250 in October for one loan. Run in either order.
#[tokio::test]
async fn a_reload_that_moves_a_return_to_another_month_bills_it_once_in_either_order() {
    for october_first in [false, true] {
        let db = test_db().await;
        september(&db.pool, &db.url).await;
        sql(
            &db.pool,
            "BEGIN;
             CREATE TEMP TABLE kept ON COMMIT DROP AS
                 SELECT id, member_id, book_id, borrowed_on, due_on, returned_on FROM loans;
             UPDATE kept SET returned_on = '2026-10-06' WHERE id = 1;
             TRUNCATE loans;
             INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
                 SELECT * FROM kept;
             COMMIT",
        )
        .await;
        settle_and_state_both(&db.url, october_first);
        // 35 days late: 1,750 cents, in October alone.
        assert_eq!(
            stated(&db.pool).await,
            BTreeMap::from([
                ((day(SEPTEMBER), 11), (1, 350)),
                ((day(OCTOBER), 10), (1, 1750))
            ]),
            "october first: {october_first}"
        );
        assert_follows(&db.pool, &db.url, &[SEPTEMBER, OCTOBER]).await;
        drop_db(db).await;
    }
}

/// The fourth report: loan 1 un-settled by hand and moved to October. October's run
/// continued its head (500 → 1,750) and September's queued edit then reversed 1,750 September
/// never held (September netting −1,400 against 350 of fines); in the other order September kept
/// 500 it no longer had. Now both orders end with September netting 350 and October 1,750.
#[tokio::test]
async fn a_loan_unsettled_by_hand_and_moved_balances_both_months_in_either_order() {
    for october_first in [false, true] {
        let db = test_db().await;
        september(&db.pool, &db.url).await;
        sql(
            &db.pool,
            "UPDATE loans SET fine_settled_at = NULL, returned_on = '2026-10-06' WHERE id = 1",
        )
        .await;
        settle_and_state_both(&db.url, october_first);
        let (journal, _) = nets(&db.pool).await;
        assert_eq!(
            journal,
            BTreeMap::from([(day("2026-09-01"), 350), (day("2026-10-01"), 1750)]),
            "october first: {october_first}"
        );
        assert_follows(&db.pool, &db.url, &[SEPTEMBER, OCTOBER]).await;
        drop_db(db).await;
    }
}

/// A member merge in libraryd (UPDATE of `member_id`) moves the fine between the statements,
/// the old member's statement going with it.
#[tokio::test]
async fn a_settled_loan_given_to_another_member_moves_its_money_between_statements() {
    let db = test_db().await;
    september(&db.pool, &db.url).await;
    sql(&db.pool, "UPDATE loans SET member_id = 11 WHERE id = 1").await;
    let report = settle(&db.url, SEPTEMBER);
    assert_eq!(report["updated"], 1, "{report}");
    state(&db.url, SEPTEMBER);
    assert_eq!(
        stated(&db.pool).await,
        BTreeMap::from([((day(SEPTEMBER), 11), (2, 850))])
    );
    assert_follows(&db.pool, &db.url, &[SEPTEMBER]).await;
    drop_db(db).await;
}

/// The fifth report: three fines zeroed by hand. `verify` named them (net −850), `correct
/// --dry-run` said "0 changed, net 0" (it priced from the journal), and `correct` then changed 3
/// loans, net +850. The dry run now prices from what `loans` holds, as the correction does.
#[tokio::test]
async fn a_corrections_dry_run_counts_fines_edited_by_hand_as_the_correction_then_does() {
    let db = test_db().await;
    september(&db.pool, &db.url).await;
    sql(
        &db.pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on) VALUES
            (3, 12, 3, '2026-08-20', '2026-09-05', '2026-09-05')",
    )
    .await;
    settle(&db.url, SEPTEMBER);
    sql(
        &db.pool,
        "UPDATE loans SET fine_cents = 0 WHERE id IN (1, 2, 3)",
    )
    .await;
    let (code, report) = verify(&db.url, &[], SEPTEMBER);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(report["journal"]["off_journal"]["count"], 2, "{report}");

    let out = cli(
        &db.url,
        &[],
        &[
            "correct",
            "--dry-run",
            "--business-date",
            SEPTEMBER,
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let dry = json_of(&out);
    let shard = &dry["by_shard"][0];
    let previewed = (
        shard["correct"]["changed"].as_i64().unwrap(),
        shard["net_cents"].as_i64().unwrap(),
        shard["writes"].as_i64().unwrap(),
    );
    let out = cli(
        &db.url,
        &[],
        &[
            "correct",
            "--business-date",
            SEPTEMBER,
            "--key",
            "HAND-EDITS",
            "--reason",
            "fines zeroed by hand",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let done = json_of(&out);
    let result = &done["per_shard"][0];
    // Loan 3 (on time, 0 cents) was 0 before and after: neither changed nor written.
    assert_eq!(previewed, (2, 850, 2), "{dry}");
    assert_eq!(
        (
            result["changed"].as_i64().unwrap(),
            result["net_cents"].as_i64().unwrap(),
            result["updated"].as_i64().unwrap()
        ),
        previewed,
        "the correction writes what its dry run said: {done}"
    );
    assert_follows(&db.pool, &db.url, &[SEPTEMBER]).await;
    drop_db(db).await;
}

/// The last report: a loan un-settled by hand and edited in the same statement got two
/// entries in one run (`late`, then `repriced`, `late_returns: 2`) while the dry run said one
/// write. Now the run settles it once (the edit queued for it is superseded), as the dry run says.
#[tokio::test]
async fn a_loan_unsettled_and_edited_at_once_is_written_once_as_its_dry_run_says() {
    let db = test_db().await;
    september(&db.pool, &db.url).await;
    sql(
        &db.pool,
        "UPDATE loans SET fine_settled_at = NULL, due_on = '2026-09-04' WHERE id = 1",
    )
    .await;
    let out = cli(
        &db.url,
        &[],
        &["run", "--dry-run", "--business-date", SEPTEMBER, "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let dry = json_of(&out);
    assert_eq!(dry["writes"], 1, "{dry}");
    let before: i64 = sqlx::query_scalar("SELECT count(*) FROM fine_journal_entries")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let report = settle(&db.url, SEPTEMBER);
    assert_eq!(report["updated"], 1, "{report}");
    assert_eq!(report["late_returns"], 1, "{report}");
    let after: i64 = sqlx::query_scalar("SELECT count(*) FROM fine_journal_entries")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(after - before, 1, "one entry for the loan");
    state(&db.url, SEPTEMBER);
    assert_follows(&db.pool, &db.url, &[SEPTEMBER]).await;
    drop_db(db).await;
}

/// Issue 48, item 3: a follower runs a month only when nothing of the job it follows waits in it.
/// September is settled on its one shard and stated; a loan is then returned into it (member 12,
/// 4 days late). The statements used to follow "every shard SUCCESS" and ran September without it
/// (the report: a month stated while 450,172 returns waited on a refused shard). Now their run is
/// refused, exit 3, naming what waits; once the settlement has settled it, they run, and the
/// member is stated.
#[tokio::test]
async fn the_statements_wait_while_a_return_waits_in_a_month_the_settlement_shows_success() {
    let db = test_db().await;
    september(&db.pool, &db.url).await;
    sql(
        &db.pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on) VALUES
            (3, 12, 3, '2026-08-20', '2026-09-05', '2026-09-09')",
    )
    .await;
    let out = cli(
        &db.url,
        &[],
        &["run", "--job", STATEMENTS, "--business-date", SEPTEMBER],
    );
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("is not ready")
            && stderr.contains("fine-settlement 2026-09-30 has 1 late return or edit waiting"),
        "{stderr}"
    );
    assert_eq!(stated(&db.pool).await.len(), 2, "nothing stated meanwhile");
    settle(&db.url, SEPTEMBER);
    state(&db.url, SEPTEMBER);
    assert_eq!(
        stated(&db.pool).await.get(&(day(SEPTEMBER), 12)),
        Some(&(1, 200)),
        "member 12 stated once its return is settled"
    );
    assert_follows(&db.pool, &db.url, &[SEPTEMBER]).await;
    drop_db(db).await;
}
