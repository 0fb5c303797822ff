//! Issue 34, part B: every job proves its month (`verify --job`), and the member statements stay
//! what the money journal says each member owes — under a takeover mid-run, journal rows that
//! commit out of id order, and edits of any month.
//!
//! Each claim is checked by `verify --job member-statements` and by a recompute done here from the
//! journal (`fine_journal_entries`), never by what the job itself wrote.

use crate::helpers::*;
use settlementd::calendar::BusinessDate;
use sqlx::PgPool;

const STATEMENTS: &str = settlementd::jobs::member_statements::JOB_NAME;
const OCTOBER: &str = "2026-10-31";

async fn sql(pool: &PgPool, statement: &str) {
    sqlx::query(statement).execute(pool).await.unwrap();
}

/// `settlementd run --job JOB --business-date MONTH --json` with `env`: its exit code and stderr.
fn run_job(url: &str, env: &[(&str, &str)], job: &str, month: &str) -> (Option<i32>, String) {
    let out = cli(
        url,
        env,
        &["run", "--job", job, "--business-date", month, "--json"],
    );
    (out.status.code(), stderr_of(&out))
}

/// [`run_job`], which must exit 0.
fn run_ok(url: &str, env: &[(&str, &str)], job: &str, month: &str) {
    let (code, stderr) = run_job(url, env, job, month);
    assert_eq!(code, Some(0), "run {job} {month}: {stderr}");
}

/// `settlementd verify --job JOB --business-date MONTH --json`: its exit code, report (Null when
/// stdout is not one JSON object) and stderr.
fn verify_job(url: &str, job: &str, month: &str) -> (Option<i32>, serde_json::Value, String) {
    let out = cli(
        url,
        &[],
        &["verify", "--job", job, "--business-date", month, "--json"],
    );
    let report = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code(), report, stderr_of(&out))
}

/// The statements of `month` say what the journal gives every member: `verify --job
/// member-statements` exits 0, and so does the recompute here.
async fn assert_stated(pool: &PgPool, url: &str, month: BusinessDate) {
    let (code, report, stderr) = verify_job(url, STATEMENTS, &month.to_string());
    assert_eq!(
        (code, &report["right"]),
        (Some(0), &serde_json::json!(true)),
        "{report} {stderr}"
    );
    assert_eq!(
        statements_of(pool, month).await,
        from_journal(pool, month).await,
        "the statements of {month} are not the journal's"
    );
}

/// (member, fines, cents) of `month` from each loan's last entry of the month in the journal.
async fn from_journal(pool: &PgPool, month: BusinessDate) -> Vec<(i64, i64, i64)> {
    sqlx::query_as(
        "SELECT l.member_id, count(*) FILTER (WHERE e.after_cents > 0),
                sum(e.after_cents)::bigint
           FROM (SELECT DISTINCT ON (loan_id) loan_id, kind, after_cents
                   FROM fine_journal_entries WHERE month = $1
                  ORDER BY loan_id, seq DESC) e
           JOIN loans l ON l.id = e.loan_id
          WHERE e.kind NOT IN ('reversed', 'deleted')
          GROUP BY l.member_id
         HAVING count(*) FILTER (WHERE e.after_cents > 0) > 0
          ORDER BY l.member_id",
    )
    .bind(month.first_day())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A member of `month` with a statement below `below`, and one of their fined loans.
async fn member_and_loan(pool: &PgPool, month: BusinessDate, below: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT l.member_id, min(l.id) FROM loans l
           JOIN member_fine_statements s
             ON s.member_id = l.member_id AND s.business_date = $2
          WHERE l.returned_on BETWEEN $1 AND $2 AND l.fine_cents > 0 AND l.member_id < $3
          GROUP BY l.member_id ORDER BY l.member_id LIMIT 1",
    )
    .bind(month.first_day())
    .bind(month.date())
    .bind(below)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Before, `verify` proved the settlement only: nothing said whether a month's statements were
/// the journal's. Now `verify --job member-statements` does, with verify's exit codes and shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_of_the_statements_proves_each_member_against_the_journal() {
    let db = test_db().await;
    let month = bd(OCTOBER);
    seed_month_alone(&db.pool, month, 3000, 1).await;
    run_ok(&db.url, &[], "fine-settlement", OCTOBER);

    // Not stated yet: every member who owes is missing, named by id.
    let owed = from_journal(&db.pool, month).await;
    assert!(owed.len() > 500, "{}", owed.len());
    let (code, report, _) = verify_job(&db.url, STATEMENTS, OCTOBER);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(report["job"], STATEMENTS);
    assert_eq!(report["business_date"], OCTOBER);
    assert_eq!(report["right"], false);
    assert_eq!(report["missing"]["count"], owed.len() as i64, "{report}");
    let first: Vec<i64> = owed.iter().take(20).map(|s| s.0).collect();
    assert_eq!(report["missing"]["ids"], serde_json::json!(first));
    assert_eq!(report["stated"]["members"], 0);

    run_ok(&db.url, &[], STATEMENTS, OCTOBER);
    assert_stated(&db.pool, &db.url, month).await;
    let (_, report, _) = verify_job(&db.url, STATEMENTS, OCTOBER);
    let cents: i64 = owed.iter().map(|s| s.2).sum();
    assert_eq!(
        (&report["journal"], &report["stated"]),
        (
            &serde_json::json!({"members": owed.len(), "fines": owed.iter().map(|s| s.1).sum::<i64>(), "fine_cents": cents}),
            &report["journal"]
        ),
        "{report}"
    );

    // A statement edited by hand, and one for a member who owes nothing: both named.
    let (member, fines, stated) = owed[3];
    sql(
        &db.pool,
        &format!(
            "UPDATE member_fine_statements SET fine_cents = fine_cents + 100
              WHERE business_date = '{OCTOBER}' AND member_id = {member}"
        ),
    )
    .await;
    sql(
        &db.pool,
        &format!(
            "INSERT INTO member_fine_statements (business_date, member_id, fines, fine_cents)
             VALUES ('{OCTOBER}', 5000000, 1, 700)"
        ),
    )
    .await;
    let (code, report, stderr) = verify_job(&db.url, STATEMENTS, OCTOBER);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["mismatched"],
        serde_json::json!({"count": 1, "net_cents": 100, "first": [{
            "member_id": member, "stated_fines": fines, "stated_cents": stated + 100,
            "journal_fines": fines, "journal_cents": stated,
        }]}),
        "{report}"
    );
    assert_eq!(
        report["extra"],
        serde_json::json!({"count": 1, "ids": [5000000]})
    );
    assert_eq!(report["missing"]["count"], 0);
    let line = stderr.trim();
    assert!(
        line.contains("member-statements 2026-10-31 is not right") && !line.contains('\n'),
        "{stderr}"
    );
    // The text form says the same.
    let text = cli(
        &db.url,
        &[],
        &["verify", "--job", STATEMENTS, "--business-date", OCTOBER],
    );
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.starts_with("member-statements 2026-10-31: NOT RIGHT"),
        "{out}"
    );
    assert!(out.contains(&format!("member {member}: stated")), "{out}");

    // `verify` without --job, and with the settlement's name, is the settlement's verify.
    let (code, plain) = verify(&db.url, &[], OCTOBER);
    assert_eq!(
        (code, &plain["job"]),
        (Some(0), &serde_json::json!("fine-settlement"))
    );
    let (code, named, _) = verify_job(&db.url, "fine-settlement", OCTOBER);
    assert_eq!(code, Some(0));
    assert_eq!(named, plain);

    // A job the binary does not have: exit 2, one line naming those it has.
    let (code, report, stderr) = verify_job(&db.url, "member-statement", OCTOBER);
    assert_eq!((code, report), (Some(2), serde_json::Value::Null));
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("member-statements"), "{stderr}");
}

/// Before, a takeover planned only the members after its predecessor's cursor, with a new mark:
/// a member below the cursor whose money changed in between kept the old statement for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_mid_run_restates_members_below_the_cursor_whose_money_changed() {
    let db = test_db().await;
    let month = bd(OCTOBER);
    seed_month_alone(&db.pool, month, 3000, 1).await;
    run_ok(&db.url, &[], "fine-settlement", OCTOBER);

    // The statements fail once they reach member 500, after their batches below it committed.
    let small = [("SETTLEMENTD__BATCH__SIZE", "50")];
    let when = "NEW.member_id >= 500";
    inject_failure(&db.pool, "INSERT OR UPDATE", "member_fine_statements", when).await;
    let (code, stderr) = run_job(&db.url, &small, STATEMENTS, OCTOBER);
    assert_ne!(code, Some(0), "{stderr}");
    let written = statements_of(&db.pool, month).await;
    assert!(
        written.len() > 100 && written.iter().all(|s| s.0 < 500),
        "{}",
        written.len()
    );

    // Meanwhile libraryd moves a stated member's due date back ten days; the settlement re-prices
    // it (a `repriced` journal row of the month), and a late return of another stated member is
    // settled.
    let (member, loan) = member_and_loan(&db.pool, month, 500).await;
    sql(
        &db.pool,
        &format!("UPDATE loans SET due_on = due_on - 10 WHERE id = {loan}"),
    )
    .await;
    let (other, _) = member_and_loan(&db.pool, month, 500)
        .await
        .max((member + 1, 0));
    sql(
        &db.pool,
        &format!(
            "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             VALUES (900001, {other}, 1, '2026-09-18', '2026-10-01', '2026-10-21')"
        ),
    )
    .await;
    run_ok(&db.url, &[], "fine-settlement", OCTOBER);

    // The takeover finishes the month: every member, below the cursor too, is the journal's.
    remove_failure(&db.pool, "member_fine_statements").await;
    run_ok(&db.url, &small, STATEMENTS, OCTOBER);
    assert_stated(&db.pool, &db.url, month).await;
}

/// Before, the statements' mark was the highest journal id seen: a journal row whose transaction
/// took its id first but committed after a higher id was read was never stated. Now the mark
/// keeps its snapshot, and a row it did not see is after it whatever its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_row_that_commits_after_a_higher_id_was_read_is_stated() {
    let db = test_db().await;
    let month = bd(OCTOBER);
    seed_month_alone(&db.pool, month, 3000, 1).await;
    run_ok(&db.url, &[], "fine-settlement", OCTOBER);
    run_ok(&db.url, &[], STATEMENTS, OCTOBER);
    assert_stated(&db.pool, &db.url, month).await;

    // A writer (as a correction's batch does) takes a journal id for a member's loan, +300 cents,
    // and does not commit yet.
    let (member, loan) = member_and_loan(&db.pool, month, i64::MAX).await;
    let mut slow = db.pool.begin().await.unwrap();
    sqlx::query(
        "WITH moved AS (
             UPDATE loans SET fine_cents = fine_cents + 300, fine_seq = fine_seq + 1
              WHERE id = $1 RETURNING id, fine_seq, due_on, returned_on, fine_cents)
         INSERT INTO fine_journal (month, kind, loan_ids, seqs, due_on, returned_on,
                                   before_cents, after_cents)
         SELECT $2, 'corrected', ARRAY[id], ARRAY[fine_seq], ARRAY[due_on], ARRAY[returned_on],
                ARRAY[fine_cents - 300], ARRAY[fine_cents]
           FROM moved",
    )
    .bind(loan)
    .bind(month.first_day())
    .execute(&mut *slow)
    .await
    .unwrap();
    // Meanwhile a late return of another member is settled (a higher journal id, committed), and
    // the statements follow it.
    sql(
        &db.pool,
        &format!(
            "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             VALUES (900001, {}, 1, '2026-09-18', '2026-10-01', '2026-10-21')",
            member + 1
        ),
    )
    .await;
    run_ok(&db.url, &[], "fine-settlement", OCTOBER);
    run_ok(&db.url, &[], STATEMENTS, OCTOBER);
    // The writer commits below the mark; the next run states it.
    slow.commit().await.unwrap();
    let started = std::time::Instant::now();
    run_ok(&db.url, &[], STATEMENTS, OCTOBER);
    println!(
        "the statements' run after the late commit: {:?}",
        started.elapsed()
    );
    assert_stated(&db.pool, &db.url, month).await;
    let mine: i64 = sqlx::query_scalar(
        "SELECT fine_cents::bigint FROM member_fine_statements
          WHERE business_date = $1 AND member_id = $2",
    )
    .bind(month.date())
    .bind(member)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let journal = from_journal(&db.pool, month).await;
    assert_eq!(
        journal.iter().find(|s| s.0 == member).map(|s| s.2),
        Some(mine)
    );
}

/// What following commit order costs: the late check of a month whose journal holds 50,000 rows,
/// beside the id-only check it replaces (printed; both by index, neither reading the month's rows
/// before the mark).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commit_order_check_reads_only_the_rows_after_the_marks_snapshot() {
    let db = test_db().await;
    let month = bd(OCTOBER);
    sql(
        &db.pool,
        "INSERT INTO fine_journal (month, kind, loan_ids, seqs, due_on, returned_on,
                                   before_cents, after_cents)
         SELECT '2026-10-01', 'settled', ARRAY[i], ARRAY[1], ARRAY['2026-10-01'::date],
                ARRAY['2026-10-02'::date], ARRAY[0::bigint], ARRAY[50::bigint]
           FROM generate_series(1, 50000) AS i",
    )
    .await;
    sql(&db.pool, "ANALYZE fine_journal").await;
    sql(
        &db.pool,
        "INSERT INTO member_statement_marks (business_date, shards, shard, journal_id, snapshot)
         SELECT '2026-10-31', 1, 0, max(id), pg_current_snapshot() FROM fine_journal",
    )
    .await;
    let explain = |late: String| {
        format!(
            "EXPLAIN (ANALYZE, FORMAT JSON)
             SELECT {late}
               FROM (SELECT journal_id, snapshot FROM member_statement_marks
                      WHERE business_date = '2026-10-31' AND shards = 1 AND shard = 0) k"
        )
    };
    let first_day = format!("'{}'::date", month.first_day());
    let id_only = format!(
        "(SELECT count(*) FROM fine_journal j WHERE j.month = {first_day} AND j.id > k.journal_id)"
    );
    let mut times = Vec::new();
    for (name, late) in [
        ("id only", id_only),
        (
            "commit order",
            settlementd::jobs::member_statements::late_rows(&first_day),
        ),
    ] {
        let mut best = f64::MAX;
        let mut plan = String::new();
        for _ in 0..5 {
            let out: serde_json::Value = sqlx::query_scalar(&explain(late.clone()))
                .fetch_one(&db.pool)
                .await
                .unwrap();
            best = best.min(out[0]["Execution Time"].as_f64().unwrap());
            plan = out.to_string();
        }
        assert!(!plan.contains("Seq Scan"), "{name}: {plan}");
        println!("late check, {name}: {best:.3} ms on a 50,000-row month");
        times.push(best);
    }
    assert!(times[1] < 5.0, "{times:?}");
}

/// A member's statement of `month`: (fines, cents), None when they have none.
async fn statement_of(pool: &PgPool, month: BusinessDate, member: i64) -> Option<(i64, i64)> {
    sqlx::query_as(
        "SELECT fines, fine_cents::bigint FROM member_fine_statements
          WHERE business_date = $1 AND member_id = $2",
    )
    .bind(month.date())
    .bind(member)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// `settlementd run --job JOB --business-date OCTOBER --all-shards` over two shards, which must
/// exit 0.
fn run_two_shards(url: &str, job: &str) {
    let out = cli(
        url,
        &[("SETTLEMENTD__SHARD__COUNT", "2")],
        &[
            "run",
            "--job",
            job,
            "--business-date",
            OCTOBER,
            "--all-shards",
            "--json",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "run {job}: {} {}",
        String::from_utf8_lossy(&out.stdout),
        stderr_of(&out)
    );
}

/// Before, a settled loan moved to another member (a member merge in libraryd) wrote nothing: the
/// old member's statement kept its fine and the new member's never had it, for good, and
/// `verify --job member-statements` said so for ever. Now the move is remembered and queued as an
/// edit of the loan's month: the settlement re-journals the loan, and the statements recompute the
/// old member and the new one, on whichever shards they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_loan_moved_to_another_member_moves_its_fine_between_their_statements() {
    let db = test_db().await;
    let month = bd(OCTOBER);
    seed_month_alone(&db.pool, month, 600, 1).await;
    run_two_shards(&db.url, "fine-settlement");
    run_two_shards(&db.url, STATEMENTS);
    assert_stated(&db.pool, &db.url, month).await;

    // One fined loan to another member with a statement (of the other shard when there is one),
    // and one to a member who has none.
    let (from, loan) = member_and_loan(&db.pool, month, i64::MAX).await;
    let to: i64 = sqlx::query_scalar(
        "SELECT member_id FROM member_fine_statements
          WHERE business_date = $1 AND member_id <> $2
          ORDER BY (member_id % 2) = ($2 % 2), member_id LIMIT 1",
    )
    .bind(month.date())
    .bind(from)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let second: i64 = sqlx::query_scalar(
        "SELECT id FROM loans
          WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31' AND fine_cents > 0
            AND member_id NOT IN ($1, $2) ORDER BY id LIMIT 1",
    )
    .bind(from)
    .bind(to)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let before = (
        statement_of(&db.pool, month, from).await,
        statement_of(&db.pool, month, to).await,
    );
    let newcomer = 990_001;
    sql(
        &db.pool,
        &format!(
            "UPDATE loans SET member_id = CASE id WHEN {loan} THEN {to} ELSE {newcomer} END
              WHERE id IN ({loan}, {second})"
        ),
    )
    .await;
    // Until the settlement takes the move, the record still holds the fine for its old member:
    // the statements follow the record (right), and the settlement's verify names the loan whose
    // edit waits.
    let (code, report, _) = verify_job(&db.url, STATEMENTS, OCTOBER);
    assert_eq!(code, Some(0), "the statements follow the journal: {report}");
    let (code, report) = verify(&db.url, &[], OCTOBER);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(report["journal"]["edits_waiting"]["count"], 2, "{report}");

    run_two_shards(&db.url, "fine-settlement");
    run_two_shards(&db.url, STATEMENTS);
    assert_stated(&db.pool, &db.url, month).await;
    let after = (
        statement_of(&db.pool, month, from).await,
        statement_of(&db.pool, month, to).await,
    );
    assert_ne!(before, after, "the moved fine left {from} for {to}");
    assert!(statement_of(&db.pool, month, newcomer).await.is_some());
}

/// Before, the statements looked only at the months of the lookback: an edit of an earlier month
/// was re-priced by the settlement (it takes libraryd's edits of any month) but never reached the
/// month's statements (fine 500 → 100, statement 500). Now every month a shard has stated is
/// watched, whatever its age.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_of_a_month_before_the_lookback_reaches_its_statements() {
    let db = test_db().await;
    let january = bd("2026-01-31");
    seed_month_alone(&db.pool, january, 300, 1).await;
    run_ok(&db.url, &[], "fine-settlement", "2026-01-31");
    run_ok(&db.url, &[], STATEMENTS, "2026-01-31");
    let (member, loan) = member_and_loan(&db.pool, january, i64::MAX).await;
    let stated = statement_of(&db.pool, january, member).await;
    sql(
        &db.pool,
        &format!("UPDATE loans SET due_on = returned_on WHERE id = {loan}"),
    )
    .await;

    // Replicas in June looking back one month (May): January is before it.
    let clock = settlementd::clock::ManualClock::new(shanghai(2026, 6, 1, 4, 0, 1));
    let s = settings(&[("SETTLE__LOOKBACK_MONTHS", "1")]);
    let mut fines = replica_of(&db.pool, &s, "fine-settlement", &clock);
    let mut statements = replica_of(&db.pool, &s, STATEMENTS, &clock);
    for _ in 0..3 {
        fines.tick().await;
    }
    let fine: i64 = sqlx::query_scalar("SELECT fine_cents FROM loans WHERE id = $1")
        .bind(loan)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(fine, 0, "the settlement re-priced January's edit");
    for _ in 0..3 {
        statements.tick().await;
    }
    assert_stated(&db.pool, &db.url, january).await;
    assert_ne!(statement_of(&db.pool, january, member).await, stated);
}
