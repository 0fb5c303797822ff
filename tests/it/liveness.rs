//! Liveness apart from work (issue 48): a replica reports itself in `replicas` and refreshes its
//! gauges on the heartbeat from a task of its own, whatever its runs do. Before, it reported only
//! between rounds of ticks, and a tick awaits its whole run: during every run longer than three
//! heartbeats the Fleet showed the live replica "gone?", its peers' `settlementd_shards_by_owners
//! {owners="0"}` counted its running shard as ownerless (`SettlementShardWithoutReplica` paged
//! after 10 min), and its own gauges (`settlementd_expired_leases`,
//! `settlementd_months_not_closed`, the owners too) froze until the run ended.

use crate::helpers::*;
use settlementd::calendar::BusinessDate;
use std::time::{Duration, Instant};

/// The value of one series of `/metrics`, named with its labels exactly as exported
/// (`settlementd_shards_by_owners{owners="0"}`); `None` when absent.
async fn series(replica: &ServeProcess, name_and_labels: &str) -> Option<f64> {
    let (_, body) = get(replica.addr, "/metrics").await.ok()?;
    body.lines().find_map(|l| {
        l.strip_prefix(name_and_labels)?
            .strip_prefix(' ')?
            .parse()
            .ok()
    })
}

/// Seconds since each shard's replica last wrote its row in `replicas` (database clock), and what
/// the fleet says each is doing, by shard.
async fn last_reports(pool: &sqlx::PgPool) -> Vec<(f64, String)> {
    let members = settlementd::job_layer::fleet::list(pool)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(members.len(), 2, "two replicas report: {members:?}");
    members
        .iter()
        .map(|m| {
            let doing: Vec<String> = m.doing.iter().map(ToString::to_string).collect();
            (m.seen_age_secs, doing.join("; "))
        })
        .collect()
}

async fn status_of(pool: &sqlx::PgPool, month: BusinessDate, shard: i32) -> String {
    sqlx::query_scalar(
        "SELECT status FROM job_runs
          WHERE job_name = 'fine-settlement' AND business_date = $1 AND shards = 2 AND shard = $2",
    )
    .bind(month.date())
    .bind(shard)
    .fetch_optional(pool)
    .await
    .unwrap()
    .unwrap_or_default()
}

/// What the test saw at one moment of shard 0's run.
#[derive(Debug)]
#[allow(dead_code)] // Read through Debug, in the failure's timeline.
struct Sample {
    /// Seconds into the run.
    at: f64,
    /// Seconds since each replica's last report, and what the fleet says each is doing.
    reports: Vec<(f64, String)>,
    /// Shards without a live replica, on the running replica and on the idle one.
    ownerless: (Option<f64>, Option<f64>),
    /// The running replica's gauges.
    expired_leases: Option<f64>,
    months_not_closed: Option<f64>,
    /// Whether the dead peer's claim was in the database.
    dead_peer: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_reports_and_refreshes_its_gauges_every_heartbeat_through_a_run_of_many_heartbeats(
) {
    let db = test_db().await;
    let month = due_month();
    // Shard 0 of 2: about 540 returns in batches of 5, each batch's UPDATE slowed by 0.1 s, a run of
    // 11 s or more with a heartbeat of 1 s. Shard 1 has none: its replica is idle.
    seed_month_alone(&db.pool, month, 1200, 1).await;
    sqlx::query("DELETE FROM loans WHERE id % 2 = 1")
        .execute(&db.pool)
        .await
        .unwrap();
    slow_updates(&db.pool, 0.1).await;
    let replica = |shard: &'static str| {
        ServeProcess::start(
            &db.url,
            &[
                ("SETTLEMENTD__SHARD__COUNT", "2"),
                ("SETTLEMENTD__SHARD__INDEX", shard),
                ("SETTLEMENTD__BATCH__SIZE", "5"),
                ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
                ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
            ],
        )
    };
    let (running, idle) = (replica("0"), replica("1"));
    assert!(
        eventually(30, || async {
            status_of(&db.pool, month, 0).await == "RUNNING"
                && status_of(&db.pool, month, 1).await == "SUCCESS"
        })
        .await,
        "shard 0's run starts, shard 1 has nothing to run"
    );
    // Each replica's first report may come before the other's row exists.
    let ownerless = "settlementd_shards_by_owners{owners=\"0\"}";
    assert!(
        eventually(5, || async {
            series(&running, ownerless).await == Some(0.0)
                && series(&idle, ownerless).await == Some(0.0)
        })
        .await,
        "both replicas count both shards owned once they have both reported"
    );

    // A month five months back, whose shard 0 a peer claimed and died with an hour ago: not closed,
    // and a lease expired. Written a second and a half into the run: only a look during the run
    // sees it.
    let dead_peers_month =
        BusinessDate::of_month_of(month.first_day() - chrono::Months::new(5)).unwrap();
    let job = |name: &str| format!("{name}{{job_name=\"fine-settlement\"}}");
    let run_started = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    let mut dead_peer = false;
    // Seven heartbeats of the run, twice a heartbeat: what is not closed is looked at every three.
    while run_started.elapsed() < Duration::from_secs(7) {
        if !dead_peer && run_started.elapsed() >= Duration::from_millis(1500) {
            sqlx::query(
                "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt,
                                       owner, started_at, heartbeat_at)
                 VALUES ('fine-settlement', $1, 2, 0, 'RUNNING', 1, 'a-dead-peer',
                         now() - interval '1 hour', now() - interval '1 hour')",
            )
            .bind(dead_peers_month.date())
            .execute(&db.pool)
            .await
            .unwrap();
            dead_peer = true;
        }
        samples.push(Sample {
            at: run_started.elapsed().as_secs_f64(),
            reports: last_reports(&db.pool).await,
            ownerless: (
                series(&running, ownerless).await,
                series(&idle, ownerless).await,
            ),
            expired_leases: series(&running, &job("settlementd_expired_leases")).await,
            months_not_closed: series(&running, &job("settlementd_months_not_closed")).await,
            dead_peer,
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let still = status_of(&db.pool, month, 0).await;
    let timeline = samples
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(still, "RUNNING", "the run lasted the heartbeats observed");

    // The Fleet: both replicas reported within two heartbeats throughout, the running one with its
    // month, the idle one with nothing — or, once the dead peer's month is written, that month's
    // shard 1, which is its own to run (the month is in its lookback and not closed).
    let doing = format!("fine-settlement {} shard 0 of 2", month.date());
    let its_own = format!("fine-settlement {} shard 1 of 2", dead_peers_month.date());
    assert!(
        samples.iter().all(|s| s.reports[0].0 <= 2.0
            && s.reports[1].0 <= 2.0
            && s.reports[0].1.contains(&doing)
            && (s.reports[1].1.is_empty() || (s.dead_peer && s.reports[1].1.contains(&its_own)))),
        "each replica's last report (seconds ago) and what it is doing, by shard, through the \
         run:\n{timeline}"
    );
    // The shard-owner gauge, on either replica: the running shard has its live owner throughout.
    assert!(
        samples
            .iter()
            .all(|s| s.ownerless == (Some(0.0), Some(0.0))),
        "settlementd_shards_by_owners{{owners=\"0\"}} on the running and the idle replica through \
         the run:\n{timeline}"
    );
    // The running replica's other gauges follow the database during the run: within about four
    // heartbeats of the dead peer's claim (a look every three), one expired lease and one more
    // month not closed.
    let before = samples
        .iter()
        .rev()
        .find(|s| !s.dead_peer)
        .and_then(|s| s.months_not_closed);
    let after = samples.last().unwrap();
    assert!(
        samples
            .iter()
            .filter(|s| !s.dead_peer)
            .all(|s| s.expired_leases == Some(0.0))
            && after.expired_leases == Some(1.0)
            && after.months_not_closed == before.map(|n| n + 1.0),
        "the running replica's settlementd_expired_leases and settlementd_months_not_closed \
         through the run (the dead peer's claim written at 1.5 s):\n{timeline}"
    );
}
