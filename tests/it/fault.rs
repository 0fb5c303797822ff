//! Fault suite (run with `cargo test --test it -- --ignored`; `.ci/run` does): real `settlementd run`
//! processes killed with SIGKILL and SIGTERM at random moments, restarted, duplicated, until every
//! shard is SUCCESS. The loans table must end exactly as after one clean run.

use crate::helpers::*;
use rand::{Rng, SeedableRng};
use settlementd::settlement;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const MONTH: &str = "2026-10-31";
const SHARDS: u32 = 3;

fn spawn_run(url: &str, shard: u32) -> Child {
    settlementd(Some(url))
        .args([
            "run",
            "--business-date",
            MONTH,
            "--shard",
            &shard.to_string(),
            "--shards",
            &SHARDS.to_string(),
        ])
        .env("SETTLEMENTD__BATCH__SIZE", "500")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[tokio::test]
#[ignore = "fault suite: slow; run with --ignored"]
async fn fault_killed_restarted_and_duplicated_replicas_end_as_one_clean_run() {
    let month = bd(MONTH);
    let clean = test_db().await;
    let chaos = test_db().await;
    for db in [&clean, &chaos] {
        seed_month(&db.pool, month, 150_000, 1).await;
    }
    settle_shards(&clean.pool, month, SHARDS, 500).await;

    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let deadline = Instant::now() + Duration::from_secs(240);
    let (mut kills, mut terms) = (0, 0);
    for round in 0.. {
        assert!(
            Instant::now() < deadline,
            "not settled after {round} rounds"
        );
        let done: i64 =
            sqlx::query_scalar("SELECT count(*) FROM job_runs WHERE status = 'SUCCESS'")
                .fetch_one(&chaos.pool)
                .await
                .unwrap();
        if done == SHARDS as i64 {
            break;
        }
        // Every shard, plus a duplicate of a random one.
        let mut children: Vec<Child> = (0..SHARDS).map(|s| spawn_run(&chaos.url, s)).collect();
        children.push(spawn_run(&chaos.url, rng.random_range(0..SHARDS)));
        tokio::time::sleep(Duration::from_millis(rng.random_range(30..300))).await;
        for child in &mut children {
            match rng.random_range(0..3) {
                0 => {
                    let _ = child.kill(); // SIGKILL: leaves a RUNNING row with a dying heartbeat
                    kills += 1;
                }
                1 => {
                    // SIGTERM: the batch in flight commits and the row becomes FAILED.
                    // SAFETY: kill(2) on our own child's pid.
                    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
                    terms += 1;
                }
                _ => {}
            }
        }
        for mut child in children {
            let status = child.wait().unwrap();
            // 0 done or skipped; 1 interrupted or lease lost; killed → no code. Never 2.
            assert_ne!(status.code(), Some(2), "{status:?}");
        }
        // The killed replicas' leases would expire after lease.ttl_secs; age them instead of waiting.
        sqlx::query("UPDATE job_runs SET heartbeat_at = heartbeat_at - interval '1 hour' WHERE status = 'RUNNING'")
            .execute(&chaos.pool)
            .await
            .unwrap();
    }
    assert!(
        kills > 0 && terms > 0,
        "the faults happened: {kills} kills, {terms} terms"
    );
    assert_eq!(
        settled_rows(&chaos.pool).await,
        settled_rows(&clean.pool).await
    );
    assert_eq!(
        settlement::month_totals(&chaos.pool, month).await.unwrap(),
        settlement::month_totals(&clean.pool, month).await.unwrap()
    );
    let attempts: i64 = sqlx::query_scalar("SELECT max(attempt)::bigint FROM job_runs")
        .fetch_one(&chaos.pool)
        .await
        .unwrap();
    eprintln!("settled after {kills} SIGKILLs and {terms} SIGTERMs; highest attempt {attempts}");
}
