//! The job layer against real PostgreSQL: claims, takeovers, fencing.

use crate::helpers::*;
use settlementd::job_layer::claim::{self, ClaimOutcome};
use settlementd::job_layer::{Batch, Cursor, JobKey, Owner};
use std::time::Duration;

const TTL: Duration = Duration::from_secs(60);

fn key() -> JobKey {
    JobKey {
        job_name: "test-job".into(),
        business_date: bd("2026-10-31").date(),
        shards: 3,
        shard: 1,
    }
}

fn owner(name: &str) -> Owner {
    Owner(name.into())
}

async fn claim_as(db: &TestDb, who: &str, force: bool) -> ClaimOutcome {
    let mut conn = db.pool.acquire().await.unwrap();
    claim::claim(&mut conn, &key(), &owner(who), TTL, force)
        .await
        .unwrap()
}

fn won(outcome: ClaimOutcome) -> claim::Claim {
    match outcome {
        ClaimOutcome::Won(c) => c,
        other => panic!("expected to win the claim, got {other:?}"),
    }
}

/// Commits one batch's progress under `claim` (cursors walking up and down, rows read and settled);
/// false when the fence refuses it.
async fn record(
    db: &TestDb,
    claim: &claim::Claim,
    (up, down): (Option<i64>, Option<i64>),
    rows: u64,
) -> bool {
    let batch = Batch {
        cursor: Cursor {
            last_id: up,
            last_id_desc: down,
        },
        scanned: rows,
        updated: rows,
        ..Batch::default()
    };
    let recorded = claim::record_batch(&mut db.pool.acquire().await.unwrap(), claim, &batch)
        .await
        .unwrap();
    recorded == claim::Recorded::Written
}

async fn set_status(db: &TestDb, status: &str) {
    sqlx::query("UPDATE job_runs SET status = $1")
        .bind(status)
        .execute(&db.pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_of_one_key_have_exactly_one_winner() {
    let db = test_db().await;
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let pool = db.pool.clone();
            tokio::spawn(async move {
                let mut conn = pool.acquire().await.unwrap();
                claim::claim(
                    &mut conn,
                    &key(),
                    &owner(&format!("replica-{i}")),
                    TTL,
                    false,
                )
                .await
                .unwrap()
            })
        })
        .collect();
    let mut winners = 0;
    for task in tasks {
        match task.await.unwrap() {
            ClaimOutcome::Won(c) => {
                winners += 1;
                assert_eq!(c.attempt, 1);
            }
            ClaimOutcome::Held { attempt, .. } => assert_eq!(attempt, 1),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners, 1);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1);
}

#[tokio::test]
async fn a_failed_claim_is_taken_over_with_the_next_attempt() {
    let db = test_db().await;
    let first = won(claim_as(&db, "a", false).await);
    assert!(
        claim::mark_failed(&mut db.pool.acquire().await.unwrap(), &first, "boom")
            .await
            .unwrap()
    );
    let second = won(claim_as(&db, "b", false).await);
    assert_eq!(second.attempt, 2);
    assert!(second.took_over);
    let (status, holder, err): (String, String, Option<String>) =
        sqlx::query_as("SELECT status, owner, last_error FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (status.as_str(), holder.as_str(), err),
        ("RUNNING", "b", None)
    );
}

#[tokio::test]
async fn a_stale_running_claim_is_taken_over_and_a_live_one_is_not() {
    let db = test_db().await;
    won(claim_as(&db, "a", false).await);
    // Live lease: nobody may take it, forced or not.
    assert_eq!(
        claim_as(&db, "b", false).await,
        ClaimOutcome::Held {
            owner: "a".into(),
            attempt: 1
        }
    );
    assert_eq!(
        claim_as(&db, "b", true).await,
        ClaimOutcome::Held {
            owner: "a".into(),
            attempt: 1
        }
    );
    // Just inside the lease: still live.
    age_heartbeat(&db.pool, bd("2026-10-31"), 3, 1, TTL.as_secs() as i64 - 5).await;
    assert!(matches!(
        claim_as(&db, "b", false).await,
        ClaimOutcome::Held { .. }
    ));
    // Past the lease on the database clock: taken over.
    age_heartbeat(&db.pool, bd("2026-10-31"), 3, 1, 10).await;
    let taken = won(claim_as(&db, "b", false).await);
    assert_eq!(taken.attempt, 2);
}

#[tokio::test]
async fn success_blocks_a_rerun_unless_forced() {
    let db = test_db().await;
    let first = won(claim_as(&db, "a", false).await);
    assert!(record(&db, &first, (Some(42), Some(900)), 5).await);
    assert!(
        claim::mark_success(&mut db.pool.acquire().await.unwrap(), &first, &[])
            .await
            .unwrap()
    );
    assert_eq!(
        claim_as(&db, "b", false).await,
        ClaimOutcome::AlreadyDone { attempt: 1 }
    );
    let forced = won(claim_as(&db, "b", true).await);
    assert_eq!(forced.attempt, 2);
    // A forced re-run starts from the beginning, not from the old cursors.
    assert_eq!(forced.resume, Cursor::default());
    let (scanned, last_id, last_id_desc): (i64, Option<i64>, Option<i64>) =
        sqlx::query_as("SELECT scanned, last_id, last_id_desc FROM job_runs")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((scanned, last_id, last_id_desc), (0, None, None));
}

#[tokio::test]
async fn a_takeover_resumes_after_committed_progress() {
    let db = test_db().await;
    let first = won(claim_as(&db, "a", false).await);
    // An ascending batch, then a descending one: each moves its own cursor only.
    for cursor in [(Some(1000), None), (None, Some(5000))] {
        assert!(record(&db, &first, cursor, 10).await);
    }
    set_status(&db, "FAILED").await;
    let second = won(claim_as(&db, "b", false).await);
    let both = Cursor {
        last_id: Some(1000),
        last_id_desc: Some(5000),
    };
    assert_eq!(second.resume, both);
    assert_eq!(both.remaining(), Some((1001, 4999)));
}

/// A binary older than the descending cursor re-runs a SUCCESS row with its own claim statement,
/// which resets `last_id` only. The cursor a descending walk left must not survive into that
/// re-run, or a later takeover by this binary would skip the ids above it.
#[tokio::test]
async fn a_rerun_claimed_by_an_older_binary_forgets_the_descending_cursor() {
    let db = test_db().await;
    let first = won(claim_as(&db, "a", false).await);
    assert!(record(&db, &first, (None, Some(900)), 5).await);
    assert!(
        claim::mark_success(&mut db.pool.acquire().await.unwrap(), &first, &[])
            .await
            .unwrap()
    );
    // The previous release's forced takeover, as it was written.
    sqlx::query(
        "UPDATE job_runs j
            SET status = 'RUNNING', attempt = j.attempt + 1, owner = 'old-binary',
                started_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
                finished_at = NULL, last_error = NULL,
                last_id = CASE WHEN j.status = 'SUCCESS' THEN NULL ELSE j.last_id END,
                scanned = CASE WHEN j.status = 'SUCCESS' THEN 0 ELSE j.scanned END,
                updated = CASE WHEN j.status = 'SUCCESS' THEN 0 ELSE j.updated END",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    set_status(&db, "FAILED").await;
    let heir = won(claim_as(&db, "b", false).await);
    assert_eq!(heir.attempt, 3);
    assert_eq!(heir.resume, Cursor::default(), "the re-run starts over");
}

#[tokio::test]
async fn a_zombie_whose_claim_was_taken_over_can_write_nothing() {
    let db = test_db().await;
    let zombie = won(claim_as(&db, "zombie", false).await);
    age_heartbeat(&db.pool, bd("2026-10-31"), 3, 1, 3600).await;
    let heir = won(claim_as(&db, "heir", false).await);
    assert_eq!(heir.attempt, 2);

    assert!(!record(&db, &zombie, (Some(7), Some(9)), 1).await);
    assert_eq!(claim::heartbeat(&db.pool, &zombie).await.unwrap(), None);
    assert!(
        !claim::mark_success(&mut db.pool.acquire().await.unwrap(), &zombie, &[])
            .await
            .unwrap()
    );
    assert!(!claim::mark_failed(
        &mut db.pool.acquire().await.unwrap(),
        &zombie,
        "zombie says hi"
    )
    .await
    .unwrap());

    let (status, attempt, holder, last_id, err): (
        String,
        i32,
        String,
        Option<i64>,
        Option<String>,
    ) = sqlx::query_as("SELECT status, attempt, owner, last_id, last_error FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        (status.as_str(), attempt, holder.as_str(), last_id, err),
        ("RUNNING", 2, "heir", None, None)
    );
}

#[tokio::test]
async fn owners_of_two_processes_on_one_host_differ() {
    let (a, b) = (Owner::for_process(), Owner::for_process());
    assert_ne!(a, b);
    assert!(a.0.contains(&std::process::id().to_string()));
}

#[tokio::test]
async fn the_shard_count_is_part_of_the_key() {
    let db = test_db().await;
    let three = won(claim_as(&db, "a", false).await);
    assert!(
        claim::mark_success(&mut db.pool.acquire().await.unwrap(), &three, &[])
            .await
            .unwrap()
    );
    let four = JobKey { shards: 4, ..key() };
    let mut conn = db.pool.acquire().await.unwrap();
    let outcome = claim::claim(&mut conn, &four, &owner("a"), TTL, false)
        .await
        .unwrap();
    assert_eq!(won(outcome).attempt, 1);
}

#[tokio::test]
async fn the_harness_runs_the_server_binaries_it_was_given() {
    let db = test_db().await;
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    if std::env::var("TEST_DATABASE_URL").is_ok() {
        return; // An external server: no binaries of ours to compare with.
    }
    let bindir = settlementd::embedded_pg::find_bindir().unwrap();
    let out = std::process::Command::new(bindir.join("postgres"))
        .arg("--version")
        .output()
        .unwrap();
    let expected = String::from_utf8_lossy(&out.stdout);
    let major = version.split(['.', ' ']).next().unwrap();
    assert!(
        expected.contains(&format!(" {major}.")),
        "server {version}, binaries say {expected}"
    );
    eprintln!("PostgreSQL server under test: {version}");
}

/// A claim of shard `shard` of `shards` of the test job's month, stating `params`.
async fn claim_stating(
    db: &TestDb,
    shards: u32,
    shard: u32,
    params: &settlementd::job_layer::Params,
) -> ClaimOutcome {
    let key = JobKey {
        shards,
        shard,
        ..key()
    };
    let describe = |p: &settlementd::job_layer::Params| p.0.to_string();
    let opts = claim::ClaimOptions {
        params: Some((params, &describe)),
        ..claim::ClaimOptions::default()
    };
    let mut conn = db.pool.acquire().await.unwrap();
    claim::claim_for(&mut conn, &key, &owner("p"), TTL, opts)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_first_claim_of_a_period_pins_its_parameters_and_other_parameters_claim_nothing() {
    let db = test_db().await;
    let (a, b) = (
        settlementd::job_layer::Params(serde_json::json!({"rate": 37, "from": "2020-01"})),
        settlementd::job_layer::Params(serde_json::json!({"rate": 99, "from": "2020-01"})),
    );
    won(claim_stating(&db, 3, 0, &a).await);
    // Any shard, any shard count: the period is pinned to `a`.
    for (shards, shard) in [(3, 1), (4, 0), (1, 0)] {
        match claim_stating(&db, shards, shard, &b).await {
            ClaimOutcome::Conflict { pinned } => assert_eq!(pinned, a),
            other => panic!("{shards}/{shard}: {other:?}"),
        }
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(rows, 1, "a refused claim writes no claim");
    let refused: Vec<String> = sqlx::query_scalar(
        "SELECT message FROM job_events WHERE event = 'rule_conflict' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(refused.len(), 3);
    assert!(refused[0].contains("\"rate\":37") && refused[0].contains("\"rate\":99"));
    // The same parameters, in another key order, are the same parameters.
    let same = settlementd::job_layer::Params(serde_json::json!({"from": "2020-01", "rate": 37}));
    won(claim_stating(&db, 4, 0, &same).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_claims_with_two_parameter_sets_pin_one_and_refuse_the_other() {
    let db = test_db().await;
    let sets = [
        settlementd::job_layer::Params(serde_json::json!({"rate": 1})),
        settlementd::job_layer::Params(serde_json::json!({"rate": 2})),
    ];
    let mut tasks = Vec::new();
    for shard in 0..8u32 {
        let pool = db.pool.clone();
        let params = sets[(shard % 2) as usize].clone();
        let url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            let db = TestDb {
                name: String::new(),
                url,
                pool,
            };
            (params.clone(), claim_stating(&db, 8, shard, &params).await)
        }));
    }
    let mut winners = Vec::new();
    let mut refused = 0;
    for task in tasks {
        match task.await.unwrap() {
            (params, ClaimOutcome::Won(_)) => winners.push(params),
            (_, ClaimOutcome::Conflict { .. }) => refused += 1,
            (_, other) => panic!("{other:?}"),
        }
    }
    assert_eq!((winners.len(), refused), (4, 4));
    assert!(winners.iter().all(|w| *w == winners[0]), "{winners:?}");
    let pinned: serde_json::Value =
        sqlx::query_scalar("SELECT params FROM job_params WHERE job_name = 'test-job'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(pinned, winners[0].0);
}

/// Fault campaign seed 1002 (`cargo run --release --bin campaign -- --seed 1002 --schedules 1`): a
/// replica holding shard 0 of 2 was killed, then the fleet moved to 3 shards; nobody of the new
/// count looks at the old count's keys, so the month stayed RUNNING under 2 shards for good. A
/// replica of the new count now closes such a claim once its lease has expired: FAILED, as a new
/// attempt (the dead holder's writes are fenced off), with an `abandoned` event.
#[tokio::test]
async fn a_claim_of_another_shard_count_left_running_by_a_dead_holder_is_closed_once_its_lease_expires(
) {
    let db = test_db().await;
    let old = JobKey {
        shards: 2,
        shard: 0,
        ..key()
    };
    let mut conn = db.pool.acquire().await.unwrap();
    let dead = match claim::claim(&mut conn, &old, &owner("dead"), TTL, false)
        .await
        .unwrap()
    {
        ClaimOutcome::Won(c) => c,
        other => panic!("expected to win the claim, got {other:?}"),
    };
    let close = |shards: u32| {
        let pool = db.pool.clone();
        async move {
            claim::close_abandoned(&pool, "test-job", shards, &owner("new fleet"), TTL)
                .await
                .unwrap()
        }
    };
    assert_eq!(close(3).await, 0, "a live lease is left alone");
    age_heartbeat(&db.pool, bd("2026-10-31"), 2, 0, 61).await;
    assert_eq!(
        close(2).await,
        0,
        "a replica of the claim's own count takes it over instead"
    );
    assert_eq!(close(3).await, 1);
    let (status, attempt): (String, i32) =
        sqlx::query_as("SELECT status, attempt FROM job_runs WHERE shards = 2 AND shard = 0")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((status.as_str(), attempt), ("FAILED", 2));
    let events: Vec<(String, i32)> = sqlx::query_as(
        "SELECT event, attempt FROM job_events WHERE shards = 2 AND shard = 0 ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        events,
        vec![("claimed".to_string(), 1), ("abandoned".to_string(), 2)]
    );
    assert!(
        claim::heartbeat(&db.pool, &dead).await.unwrap().is_none(),
        "the dead holder's attempt is fenced off"
    );
    assert!(matches!(
        claim::claim(&mut conn, &old, &owner("old fleet"), TTL, false)
            .await
            .unwrap(),
        ClaimOutcome::Won(claim::Claim { attempt: 3, .. })
    ));
}

/// Issue 48: a claim re-opened for a late return and every correction attempt showed "a release
/// before 0.2.0": the upgrade trigger cleared `version` whenever the attempt changed and the
/// version did not, also when this release wrote its own version again. Every attempt this
/// release makes now records it.
#[tokio::test]
async fn every_attempt_this_release_makes_records_its_release() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 40, 1).await;
    let version = || async {
        sqlx::query_as::<_, (i32, Option<String>)>(
            "SELECT attempt, version FROM job_runs
              WHERE job_name = 'fine-settlement' AND business_date = '2026-10-31'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let mine = Some(env!("CARGO_PKG_VERSION").to_string());
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-10-31"]));
    assert_eq!(version().await, (1, mine.clone()));
    // A late return re-opens the month: a new attempt, by this release.
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (900001, 1, 1, '2026-09-20', '2026-10-01', '2026-10-20')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-10-31"]));
    assert_eq!(version().await, (2, mine.clone()), "a re-open");
    // A correction's attempt.
    run_ok(settlementd(Some(&db.url)).args([
        "correct",
        "--business-date",
        "2026-10-31",
        "--key",
        "K-1",
        "--reason",
        "check",
    ]));
    assert_eq!(version().await, (3, mine.clone()), "a correction");
    // A forced re-run.
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-10-31", "--force"]));
    assert_eq!(version().await, (4, mine), "a forced re-run");
}
