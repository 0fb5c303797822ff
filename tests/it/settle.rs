//! The settlement job end to end: sharding, duplicates, zombies, the seed's trap, resharding.

use crate::helpers::*;
use settlementd::calendar::BusinessDate;
use settlementd::config::ShardSpec;
use settlementd::demo::zero_fine_marker;
use settlementd::fine::FineRule;
use settlementd::job_layer::{self, claim, Batch, Cursor, Job, JobError, JobKey, Owner, RunReport};
use settlementd::jobs::fine_settlement::{self, FineSettlement, MonthPlan};
use sqlx::{PgConnection, PgPool};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

const OCT: &str = "2026-10-31";

fn job(batch_size: u32) -> FineSettlement {
    FineSettlement {
        rules: Default::default(),
        batch_size,
        guards: Default::default(),
    }
}

fn shard(index: u32, count: u32) -> ShardSpec {
    ShardSpec::new(index, count).unwrap()
}

async fn run(pool: &PgPool, month: BusinessDate, s: ShardSpec, force: bool) -> RunReport {
    run_job(pool, &job(100), month, s, force).await.unwrap()
}

async fn run_job<J: Job>(
    pool: &PgPool,
    job: &J,
    month: BusinessDate,
    s: ShardSpec,
    force: bool,
) -> Result<RunReport, JobError> {
    job_layer::run_once(
        pool,
        job,
        fine_settlement::key(month, s),
        &run_options(force, false),
        &CancellationToken::new(),
        &|_| {},
    )
    .await
}

#[tokio::test]
async fn three_shards_settle_every_eligible_row_once_and_nothing_else() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    seed_month(&db.pool, bd("2026-11-30"), 300, 5000).await;
    let mut updated = 0;
    for i in 0..3 {
        let report = run(&db.pool, oct, shard(i, 3), false).await;
        assert_eq!(report.skipped, None);
        assert_eq!(report.attempt, Some(1));
        assert_eq!(report.scanned, report.updated);
        updated += report.updated;
    }
    let eligible = eligible(&db.pool, oct).await;
    assert_eq!(updated as i64, eligible);
    assert_eq!(settled_count(&db.pool).await, eligible);
    // Nothing outside the month (before, after, unreturned) was touched.
    let outside: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL
            AND (returned_on IS NULL OR returned_on NOT BETWEEN $1 AND $2)",
    )
    .bind(oct.first_day())
    .bind(oct.date())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(outside, 0);
    let statuses: Vec<String> = sqlx::query_scalar("SELECT status FROM job_runs ORDER BY shard")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    assert_eq!(statuses, ["SUCCESS", "SUCCESS", "SUCCESS"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_concurrent_runs_of_one_shard_settle_every_row_once() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 2000, 1).await;
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let pool = db.pool.clone();
            tokio::spawn(async move { run(&pool, oct, shard(0, 1), false).await })
        })
        .collect();
    let mut reports = Vec::new();
    for r in runs {
        reports.push(r.await.unwrap());
    }
    let worked: Vec<_> = reports.iter().filter(|r| r.skipped.is_none()).collect();
    assert_eq!(
        worked.len(),
        1,
        "exactly one duplicate wins the claim: {reports:?}"
    );
    let updated: u64 = reports.iter().map(|r| r.updated).sum();
    assert_eq!(updated as i64, eligible(&db.pool, oct).await);
    assert_eq!(settled_count(&db.pool).await, eligible(&db.pool, oct).await);
}

#[tokio::test]
async fn zero_fine_rows_are_settled_and_a_forced_rerun_changes_no_byte() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    let first = run(&db.pool, oct, shard(0, 1), false).await;
    let zero_fines: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_cents = 0 AND fine_settled_at IS NOT NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        zero_fines > 100,
        "the data has on-time returns: {zero_fines}"
    );
    let before = loans_snapshot(&db.pool).await;
    let totals = fine_settlement::month_totals(&db.pool, oct).await.unwrap();

    let rerun = run(&db.pool, oct, shard(0, 1), true).await;
    assert_eq!(
        (rerun.scanned, rerun.updated, rerun.attempt),
        (0, 0, Some(2))
    );
    assert_eq!(
        loans_snapshot(&db.pool).await,
        before,
        "a forced re-run changes no byte"
    );
    assert_eq!(
        fine_settlement::month_totals(&db.pool, oct).await.unwrap(),
        totals
    );
    assert_eq!(first.updated as i64, totals.settled_rows);
}

#[tokio::test]
async fn the_zero_fine_marker_of_the_seed_rescans_every_zero_fine_row() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    let rule = FineRule::default();
    let first = zero_fine_marker::settle_with_zero_fine_marker(&db.pool, oct, rule)
        .await
        .unwrap();
    let zero_fines: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_cents = 0 AND returned_on BETWEEN $1 AND $2",
    )
    .bind(oct.first_day())
    .bind(oct.date())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let second = zero_fine_marker::settle_with_zero_fine_marker(&db.pool, oct, rule)
        .await
        .unwrap();
    assert_eq!(first as i64, eligible(&db.pool, oct).await);
    assert!(zero_fines > 0);
    assert_eq!(
        second as i64, zero_fines,
        "the trap: every zero-fine row is processed again"
    );
}

#[tokio::test]
async fn resharding_from_three_to_four_replicas_settles_nothing_new() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    for i in 0..3 {
        run(&db.pool, oct, shard(i, 3), false).await;
    }
    let before = loans_snapshot(&db.pool).await;
    for i in 0..4 {
        let report = run(&db.pool, oct, shard(i, 4), false).await;
        // Fresh claims (the shard count is in the key), and they find nothing left to do.
        assert_eq!(
            (report.skipped, report.attempt, report.updated),
            (None, Some(1), 0)
        );
    }
    assert_eq!(loans_snapshot(&db.pool).await, before);
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM job_runs WHERE status = 'SUCCESS'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(claims, 7);
}

#[tokio::test]
async fn the_settlement_sql_agrees_with_the_pure_fine_rule() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    let rule = FineRule {
        daily_rate_cents: 25,
        grace_days: 3,
        max_cents: 700,
    };
    let job = FineSettlement {
        rules: settlementd::fine::FineSchedule::single(rule),
        batch_size: 64,
        guards: Default::default(),
    };
    run_job(&db.pool, &job, oct, shard(0, 1), false)
        .await
        .unwrap();
    let rows: Vec<(chrono::NaiveDate, chrono::NaiveDate, i64)> = sqlx::query_as(
        "SELECT due_on, returned_on, fine_cents FROM loans WHERE fine_settled_at IS NOT NULL",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(rows.len() > 800);
    let mut capped = 0;
    for (due_on, returned_on, fine) in rows {
        assert_eq!(
            fine,
            rule.fine_cents(due_on, returned_on),
            "due {due_on} returned {returned_on}"
        );
        capped += usize::from(fine == 700);
    }
    assert!(capped > 0, "the cap is exercised");
}

#[tokio::test]
async fn business_dates_cover_december_across_the_year_end_and_leap_february() {
    let db = test_db().await;
    let dec = bd("2026-12-31");
    let feb = bd("2028-02-29");
    seed_month(&db.pool, dec, 500, 1).await;
    seed_month(&db.pool, feb, 500, 1000).await;
    let report = run(&db.pool, dec, shard(0, 1), false).await;
    assert_eq!(report.updated as i64, eligible(&db.pool, dec).await);
    let on_29th: i64 =
        sqlx::query_scalar("SELECT count(*) FROM loans WHERE returned_on = '2028-02-29'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(on_29th > 0);
    let report = run(&db.pool, feb, shard(0, 1), false).await;
    assert_eq!(report.updated as i64, eligible(&db.pool, feb).await);
    let unsettled_29th: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE returned_on = '2028-02-29' AND fine_settled_at IS NULL",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(unsettled_29th, 0);
}

/// Pauses the first batch after its work, before the runner fences it, so a test can take the
/// claim over while the batch is in flight.
struct PausedFirstBatch {
    inner: FineSettlement,
    reached: Arc<Notify>,
    resume: Arc<Notify>,
}

impl Job for PausedFirstBatch {
    type Plan = MonthPlan;
    const NAME: &'static str = fine_settlement::JOB_NAME;
    fn params(&self, key: &JobKey) -> Result<settlementd::job_layer::Params, String> {
        self.inner.params(key)
    }
    async fn plan(
        &self,
        pool: &PgPool,
        claim: &settlementd::job_layer::Claim,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        self.inner.plan(pool, claim, estimate).await
    }
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let batch = self.inner.run_batch(tx, plan, cursor).await?;
        self.reached.notify_one();
        self.resume.notified().await;
        Ok(batch)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_zombie_batch_in_flight_during_a_takeover_is_rolled_back() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 600, 1).await;
    let (reached, resume) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let zombie_job = PausedFirstBatch {
        inner: job(100),
        reached: reached.clone(),
        resume: resume.clone(),
    };
    let pool = db.pool.clone();
    let zombie =
        tokio::spawn(async move { run_job(&pool, &zombie_job, oct, shard(0, 1), false).await });

    reached.notified().await;
    // The zombie has updated 100 rows in its open transaction. Its lease expires; an heir claims.
    age_heartbeat(&db.pool, oct, 1, 0, 3600).await;
    let mut conn = db.pool.acquire().await.unwrap();
    let key = fine_settlement::key(oct, shard(0, 1));
    let heir = match claim::claim(
        &mut conn,
        &key,
        &Owner("heir".into()),
        Duration::from_secs(60),
        false,
    )
    .await
    .unwrap()
    {
        claim::ClaimOutcome::Won(c) => c,
        other => panic!("heir should take over: {other:?}"),
    };
    drop(conn);
    resume.notify_one();
    let err = zombie.await.unwrap().unwrap_err();
    assert!(
        matches!(err, JobError::LeaseLost { attempt: 1, .. }),
        "{err}"
    );
    assert_eq!(
        settled_count(&db.pool).await,
        0,
        "the zombie's batch was rolled back"
    );
    let (status, attempt, owner): (String, i32, String) =
        sqlx::query_as("SELECT status, attempt, owner FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), attempt, owner.as_str()),
        ("RUNNING", 2, "heir")
    );

    // The heir dies too; the next run takes over and settles everything exactly once.
    assert!(
        claim::mark_failed(&mut db.pool.acquire().await.unwrap(), &heir, "heir crashed")
            .await
            .unwrap()
    );
    let last = run(&db.pool, oct, shard(0, 1), false).await;
    assert_eq!(last.attempt, Some(3));
    assert_eq!(last.updated as i64, eligible(&db.pool, oct).await);
}

#[tokio::test]
async fn an_interrupted_run_is_marked_failed_and_the_next_run_resumes_after_its_progress() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    let shutdown = CancellationToken::new();
    let stop_after_first_batch = {
        let shutdown = shutdown.clone();
        move |p: job_layer::Progress| {
            if p.scanned > 0 {
                shutdown.cancel();
            }
        }
    };
    let key = fine_settlement::key(oct, shard(0, 1));
    let err = job_layer::run_once(
        &db.pool,
        &job(100),
        key,
        &run_options(false, false),
        &shutdown,
        &stop_after_first_batch,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, JobError::Interrupted));
    let (status, error, last_id, updated): (String, Option<String>, Option<i64>, i64) =
        sqlx::query_as("SELECT status, last_error, last_id, updated FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), error.as_deref(), updated),
        ("FAILED", Some("interrupted: shutdown"), 100)
    );
    assert_eq!(
        settled_count(&db.pool).await,
        100,
        "the batch in flight committed"
    );

    let resumed = run(&db.pool, oct, shard(0, 1), false).await;
    assert_eq!(resumed.attempt, Some(2));
    assert_eq!(
        resumed.scanned as i64,
        eligible(&db.pool, oct).await - 100,
        "resumed after id {last_id:?}"
    );
    assert_eq!(settled_count(&db.pool).await, eligible(&db.pool, oct).await);
}

#[tokio::test]
async fn a_failing_batch_commits_nothing_marks_the_run_failed_and_a_retry_finishes() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 1000, 1).await;
    // Row 451 cannot be settled: the fourth or fifth batch fails.
    sqlx::query(
        "CREATE FUNCTION refuse_451() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.id = 451 THEN RAISE EXCEPTION 'loan 451 is locked by libraryd'; END IF; RETURN NEW; END $$",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("CREATE TRIGGER refuse_451 BEFORE UPDATE ON loans FOR EACH ROW EXECUTE FUNCTION refuse_451()")
        .execute(&db.pool)
        .await
        .unwrap();
    let err = run_job(&db.pool, &job(100), oct, shard(0, 1), false)
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err}");
    let (status, error, last_id): (String, Option<String>, Option<i64>) =
        sqlx::query_as("SELECT status, last_error, last_id FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "FAILED");
    assert!(error.unwrap().contains("loan 451"));
    let last_id = last_id.expect("earlier batches committed progress");
    assert!(last_id < 451);
    let settled_beyond: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL AND id > $1",
    )
    .bind(last_id)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(settled_beyond, 0, "the failed batch committed nothing");

    sqlx::query("DROP TRIGGER refuse_451 ON loans")
        .execute(&db.pool)
        .await
        .unwrap();
    let retry = run(&db.pool, oct, shard(0, 1), false).await;
    assert_eq!(retry.attempt, Some(2));
    assert_eq!(settled_count(&db.pool).await, eligible(&db.pool, oct).await);
}

#[tokio::test]
async fn a_heartbeat_that_finds_its_claim_taken_over_reports_the_loss() {
    let db = test_db().await;
    let oct = bd(OCT);
    let key = fine_settlement::key(oct, shard(0, 1));
    let mut conn = db.pool.acquire().await.unwrap();
    let ttl = Duration::from_secs(60);
    let mine = match claim::claim(&mut conn, &key, &Owner("a".into()), ttl, false)
        .await
        .unwrap()
    {
        claim::ClaimOutcome::Won(c) => c,
        other => panic!("{other:?}"),
    };
    let heartbeat =
        job_layer::lease::Heartbeat::spawn(db.pool.clone(), mine, Duration::from_millis(20));
    age_heartbeat(&db.pool, oct, 1, 0, 3600).await;
    // The heartbeat may renew between the ageing and the takeover: age until the takeover wins.
    loop {
        if let claim::ClaimOutcome::Won(_) =
            claim::claim(&mut conn, &key, &Owner("b".into()), ttl, false)
                .await
                .unwrap()
        {
            break;
        }
        age_heartbeat(&db.pool, oct, 1, 0, 3600).await;
    }
    tokio::time::timeout(Duration::from_secs(30), heartbeat.lost().cancelled())
        .await
        .expect("the heartbeat notices the lost claim");
    heartbeat.stop().await;
}

#[tokio::test]
async fn negative_ids_belong_to_exactly_one_shard() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 300, 1).await;
    sqlx::query("UPDATE loans SET id = -id WHERE id % 2 = 0")
        .execute(&db.pool)
        .await
        .unwrap();
    let negative: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE id < 0 AND returned_on BETWEEN $1 AND $2",
    )
    .bind(oct.first_day())
    .bind(oct.date())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(negative > 100);
    let mut updated = 0;
    for i in 0..3 {
        updated += run(&db.pool, oct, shard(i, 3), false).await.updated;
    }
    assert_eq!(updated as i64, eligible(&db.pool, oct).await);
    assert_eq!(settled_count(&db.pool).await, eligible(&db.pool, oct).await);
}

/// Loans as a library hands them out: ids in borrow order, `gap` apart, one borrowed every
/// `per_day`-th of a day from `from` on, returned 5 to 70 days later (every 50th one 200 to 700
/// days late), still out when that is after `today`.
async fn seed_history(pool: &PgPool, loans: i64, gap: i64, from: &str, today: &str) {
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i * $2, 1 + i % 97, 1 + i % 89, b, b + 21, CASE WHEN r <= $4::date THEN r END
           FROM (SELECT i, b, b + CASE WHEN i % 50 = 0 THEN 200 + ((i * 7919) % 500)::int
                                       ELSE 5 + ((i * 7919) % 66)::int END AS r
                   FROM (SELECT i, $3::date + (i / 40)::int AS b
                           FROM generate_series(1, $1::bigint) AS i) s) t",
    )
    .bind(loans)
    .bind(gap)
    .bind(from)
    .bind(today)
    .execute(pool)
    .await
    .unwrap();
}

/// Rows of `month` that are unsettled, or settled with a fine other than the rule's.
async fn wrongly_settled(pool: &PgPool, month: BusinessDate) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM loans l WHERE l.returned_on BETWEEN $1 AND $2
            AND (l.fine_settled_at IS NULL OR l.fine_cents <> {})",
        FineRule::sql_expr("0", "50", "10000")
    );
    sqlx::query_scalar(&sql)
        .bind(month.first_day())
        .bind(month.date())
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn settled_outside(pool: &PgPool, month: BusinessDate) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL
            AND (returned_on IS NULL OR returned_on NOT BETWEEN $1 AND $2)",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_sparse_unanalyzed_table_settles_completely_in_a_bounded_number_of_batches() {
    let db = test_db().await;
    // Never analyzed: autovacuum must not give the table statistics behind the test's back.
    sqlx::query("ALTER TABLE loans SET (autovacuum_enabled = false)")
        .execute(&db.pool)
        .await
        .unwrap();
    let oct = bd(OCT);
    // Ids 65,536 apart over two years, plus the two most extreme ids PostgreSQL allows.
    seed_history(&db.pool, 30_000, 65_536, "2025-01-01", "2026-11-20").await;
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (-9223372036854775808, 1, 1, '2026-09-01', '2026-09-22', '2026-10-05'),
                (9223372036854775807, 1, 1, '2026-09-01', '2026-09-22', '2026-10-31')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let analyzed: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
        "SELECT greatest(last_analyze, last_autoanalyze) FROM pg_stat_user_tables WHERE relname = 'loans'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(analyzed, None, "the table has no statistics");
    let rows = eligible(&db.pool, oct).await;
    assert!(rows > 1000, "{rows}");

    let batch_size = 50;
    let mut updated = 0;
    for i in 0..2 {
        let report = run_job(&db.pool, &job(batch_size), oct, shard(i, 2), false)
            .await
            .unwrap();
        let shard_rows = report.scanned;
        // Every batch but the last is full: the walk never comes back empty-handed.
        let bound = shard_rows.div_ceil(u64::from(batch_size)) + 1;
        assert!(
            report.batches <= bound,
            "shard {i}: {} batches for {shard_rows} rows of {batch_size}",
            report.batches
        );
        updated += report.updated;
    }
    assert_eq!(updated as i64, rows);
    assert_eq!(wrongly_settled(&db.pool, oct).await, 0);
    assert_eq!(settled_outside(&db.pool, oct).await, 0);
}

#[tokio::test]
async fn a_month_interleaved_with_years_of_other_months_settles_only_its_own_rows() {
    let db = test_db().await;
    let (sep, oct, nov) = (bd("2026-09-30"), bd(OCT), bd("2026-11-30"));
    seed_history(&db.pool, 40_000, 1, "2024-06-01", "2026-12-20").await;
    // The months around October are interleaved with it in id order (returns 5–70 days after
    // borrowing), and the late tail reaches back to loans borrowed in 2025.
    let late: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND borrowed_on < '2026-06-01'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(late > 0, "October has long-overdue returns");
    let (before, after) = (eligible(&db.pool, sep).await, eligible(&db.pool, nov).await);
    assert!(before > 0 && after > 0);

    let updated = settle_shards(&db.pool, oct, 3, 70).await;
    assert_eq!(updated as i64, eligible(&db.pool, oct).await);
    assert_eq!(wrongly_settled(&db.pool, oct).await, 0);
    assert_eq!(settled_outside(&db.pool, oct).await, 0);
    // Shards 0 and 2 walk up and end at their month's largest id; shard 1 walks down and ends
    // at its smallest.
    type Cursors = (i32, Option<i64>, Option<i64>, Option<i64>, Option<i64>);
    let cursors: Vec<Cursors> = sqlx::query_as(
        "SELECT j.shard, j.last_id, j.last_id_desc, m.max, m.min
           FROM job_runs j,
                LATERAL (SELECT max(id), min(id) FROM loans
                          WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                            AND id % 3 = j.shard) m
          ORDER BY shard",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(cursors.len(), 3);
    for (shard, up, down, max, min) in cursors {
        let expected = if shard == 1 { (None, min) } else { (max, None) };
        assert_eq!((up, down), expected, "shard {shard}");
    }
}

/// A takeover resumes after the committed cursor, on both walks: shard 0 of 2 walks up
/// (`last_id`), shard 1 of 2 walks down (`last_id_desc`).
#[tokio::test]
async fn a_takeover_resumes_after_the_committed_cursor_of_the_month_walk() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_history(&db.pool, 20_000, 3, "2025-06-01", "2026-12-20").await;
    for index in [0, 1] {
        let rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                AND fine_settled_at IS NULL AND id % 2 = $1",
        )
        .bind(i64::from(index))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        // The first owner commits two batches of 60, then stops without marking anything: its
        // lease goes stale as if it had been killed.
        let shutdown = CancellationToken::new();
        let stop = {
            let shutdown = shutdown.clone();
            move |p: job_layer::Progress| {
                if p.batches == 2 {
                    shutdown.cancel();
                }
            }
        };
        let key = fine_settlement::key(oct, shard(index, 2));
        let err = job_layer::run_once(
            &db.pool,
            &job(60),
            key,
            &run_options(false, false),
            &shutdown,
            &stop,
        )
        .await
        .unwrap_err();
        assert!(matches!(err, JobError::Interrupted));
        sqlx::query("UPDATE job_runs SET status = 'RUNNING' WHERE shard = $1")
            .bind(index as i32)
            .execute(&db.pool)
            .await
            .unwrap();
        age_heartbeat(&db.pool, oct, 2, index as i32, 3600).await;

        // The cursor means "every row of the shard's month on this side of here is done, none
        // on the other".
        let (up, down): (Option<i64>, Option<i64>) =
            sqlx::query_as("SELECT last_id, last_id_desc FROM job_runs WHERE shard = $1")
                .bind(index as i32)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        let (cursor, walked_up) = match (up, down) {
            (Some(id), None) if index == 0 => (id, true),
            (None, Some(id)) if index == 1 => (id, false),
            other => panic!("shard {index}: cursors {other:?}"),
        };
        let (done_inside, done_beyond, open_inside): (i64, i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE fine_settled_at IS NOT NULL AND inside),
                    count(*) FILTER (WHERE fine_settled_at IS NOT NULL AND NOT inside),
                    count(*) FILTER (WHERE fine_settled_at IS NULL AND inside)
               FROM (SELECT fine_settled_at, CASE WHEN $3 THEN id <= $2 ELSE id >= $2 END AS inside
                       FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
                        AND id % 2 = $1) s",
        )
        .bind(i64::from(index))
        .bind(cursor)
        .bind(walked_up)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            (done_inside, done_beyond, open_inside),
            (120, 0, 0),
            "shard {index}"
        );

        let heir = run_job(&db.pool, &job(60), oct, shard(index, 2), false)
            .await
            .unwrap();
        assert!(heir.took_over);
        assert_eq!(heir.attempt, Some(2));
        assert_eq!(
            heir.scanned as i64,
            rows - 120,
            "shard {index} resumed from id {cursor}"
        );
    }
    assert_eq!(settled_count(&db.pool).await, eligible(&db.pool, oct).await);
    assert_eq!(wrongly_settled(&db.pool, oct).await, 0);
}

/// An attempt of a binary that walked every shard up left `last_id`; this binary walks shard 1
/// down and stops where that attempt's progress begins. The rows the cursor calls done are left
/// unsettled here, so a walk that went past the cursor would show.
#[tokio::test]
async fn a_descending_walk_stops_at_the_ascending_cursor_of_an_earlier_attempt() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_history(&db.pool, 20_000, 3, "2025-06-01", "2026-12-20").await;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND id % 2 = 1 ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert!(ids.len() > 300, "{}", ids.len());
    // The earlier attempt committed the shard's month up to its 100th id, then failed.
    let cursor = ids[99];
    sqlx::query(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at, last_id, scanned, updated)
         VALUES ($1, $2, 2, 1, 'FAILED', 1, 'older-binary', now(), now(), $3, 100, 100)",
    )
    .bind(fine_settlement::JOB_NAME)
    .bind(oct.date())
    .bind(cursor)
    .execute(&db.pool)
    .await
    .unwrap();

    let heir = run_job(&db.pool, &job(60), oct, shard(1, 2), false)
        .await
        .unwrap();
    assert_eq!(heir.attempt, Some(2));
    assert_eq!(
        (heir.scanned as usize, heir.updated as usize),
        (ids.len() - 100, ids.len() - 100),
        "stopped at id {cursor}"
    );
    let (settled_above, settled_below): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE id > $1), count(*) FILTER (WHERE id <= $1)
           FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND id % 2 = 1 AND fine_settled_at IS NOT NULL",
    )
    .bind(cursor)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        (settled_above as usize, settled_below),
        (ids.len() - 100, 0)
    );
    let (up, down): (Option<i64>, Option<i64>) =
        sqlx::query_as("SELECT last_id, last_id_desc FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((up, down), (Some(cursor), Some(ids[100])));
}

/// Walks shard `s` of `month` through the engine's own `plan` and `run_batch`, one committed
/// transaction per batch as the runner does (without the claim); returns (calls of `run_batch`,
/// batches that found their page read ahead, rows updated). `before_batch` runs on the batch
/// connection before each batch (its number, from 1).
async fn walk_month(
    pool: &PgPool,
    job: &FineSettlement,
    month: BusinessDate,
    s: ShardSpec,
    before_batch: impl Fn(u64) -> Option<&'static str>,
) -> (u64, u64, u64) {
    let key = fine_settlement::key(month, s);
    let (plan, _) = job.plan(pool, &claim_of(&key), false).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let (mut cursor, mut calls, mut updated) = (Cursor::default(), 0, 0);
    loop {
        calls += 1;
        if let Some(sql) = before_batch(calls) {
            sqlx::query(sql).execute(&mut *conn).await.unwrap();
        }
        let batch = one_batch(&mut conn, job, &plan, cursor, &job.begin_batch(), true).await;
        updated += batch.updated;
        cursor = batch.cursor;
        if batch.done {
            return (calls, plan.pages_read_ahead(), updated);
        }
    }
}

/// While a batch of a month's only shard settles, the next batch's page is read on a spare
/// connection; a pool with no connection to spare (two: batches and heartbeat) reads every page
/// inside its batch, and so does every shard of a month split in two. Each settles exactly the
/// same rows with the same fines, in the same batches.
#[tokio::test]
async fn the_next_page_is_read_ahead_and_a_pool_without_a_spare_connection_settles_the_same() {
    let (oct, nov) = (bd(OCT), bd("2026-11-30"));
    let (ahead, inline) = (test_db().await, test_db().await);
    let two = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&inline.url)
        .await
        .unwrap();
    let job = job(150);
    let mut walks = Vec::new();
    for (db, pool) in [(&ahead, &ahead.pool), (&inline, &two)] {
        seed_month(&db.pool, oct, 3000, 1).await;
        let eligible = eligible(&db.pool, oct).await as u64;
        let walk = walk_month(pool, &job, oct, shard(0, 1), |_| None).await;
        assert_eq!(walk.2, eligible);
        walks.push((
            walk,
            fine_settlement::month_totals(&db.pool, oct).await.unwrap(),
        ));
    }
    let [((calls, read_ahead, _), ahead_totals), ((inline_calls, inline_read_ahead, _), inline_totals)] =
        &walks[..]
    else {
        unreachable!()
    };
    assert!(*calls > 15, "{calls}");
    assert_eq!(*read_ahead, calls - 1, "every batch after the first");
    assert_eq!(
        *inline_read_ahead, 0,
        "no spare connection, no reading ahead"
    );
    assert_eq!(calls, inline_calls);
    assert_eq!(ahead_totals, inline_totals);

    seed_month(&ahead.pool, nov, 3000, 100_001).await;
    let eligible = eligible(&ahead.pool, nov).await as u64;
    let mut updated = 0;
    for index in 0..2 {
        let (calls, read_ahead, rows) =
            walk_month(&ahead.pool, &job, nov, shard(index, 2), |_| None).await;
        assert!(calls > 5, "{calls}");
        assert_eq!(read_ahead, 0, "shard {index} of 2 reads its own pages");
        updated += rows;
    }
    assert_eq!(updated, eligible);
}

/// A read-ahead whose connection breaks costs the run nothing: the page already read is used,
/// the failed read is dropped, and every later batch reads its own page.
#[tokio::test]
async fn a_broken_read_ahead_connection_costs_the_run_nothing() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 3000, 1).await;
    let eligible = eligible(&db.pool, oct).await as u64;
    // Before the second batch, end every other session of the database: the read-ahead
    // connection among them (it read the second batch's page during the first batch).
    let kill = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()";
    let (calls, read_ahead, updated) = walk_month(&db.pool, &job(200), oct, shard(0, 1), |n| {
        (n == 2).then_some(kill)
    })
    .await;
    assert!(calls > 5, "{calls}");
    assert_eq!(
        read_ahead, 1,
        "only the page read before the connection broke"
    );
    assert_eq!(updated, eligible);
    assert_eq!(settled_count(&db.pool).await as u64, eligible);
}

/// A page read ahead is used only by the batch it was read for: a batch from another cursor
/// reads its own.
#[tokio::test]
async fn a_page_read_ahead_serves_only_the_cursor_it_was_read_for() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month(&db.pool, oct, 3000, 1).await;
    let job = job(100);
    let key = fine_settlement::key(oct, shard(0, 1));
    let (plan, _) = job.plan(&db.pool, &claim_of(&key), false).await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let begin = job.begin_batch();
    let first = one_batch(&mut conn, &job, &plan, Cursor::default(), &begin, false).await;
    // The page after `first` was read ahead; a batch from the start again does not take it.
    let again = one_batch(&mut conn, &job, &plan, Cursor::default(), &begin, false).await;
    assert_eq!(again, first);
    assert_eq!(plan.pages_read_ahead(), 0);
    let second = one_batch(&mut conn, &job, &plan, first.cursor, &begin, false).await;
    assert_eq!(plan.pages_read_ahead(), 1);
    assert_eq!(second.scanned, 100);
    assert!(second.cursor.last_id > first.cursor.last_id);
}
