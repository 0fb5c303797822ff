//! The runs API and the audit trail: manual runs over HTTP applied once however often they are
//! retried, at process level with real replicas, and every claim, takeover, fencing rejection,
//! SUCCESS, FAILED and accepted request recorded.

use crate::helpers::*;
use settlementd::config::Settings;
use settlementd::job_layer::{claim, events, requests, JobKey, Owner};
use settlementd::jobs::fine_settlement;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "test-admin-token-0123456789";
const OCT: &str = "2026-10-31";

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

/// POST /v1/runs with the right token, `key` and `body`.
async fn post_run(addr: SocketAddr, key: &str, body: &str) -> Answer {
    let auth = bearer();
    http(
        addr,
        "POST",
        "/v1/runs",
        &[("Authorization", &auth), ("Idempotency-Key", key)],
        body,
    )
    .await
    .unwrap()
}

/// POSTs a request that must be accepted; returns its id.
async fn accepted(addr: SocketAddr, key: &str, body: &str) -> String {
    let answer = post_run(addr, key, body).await;
    assert_eq!(answer.status, 202, "{answer:?}");
    answer.json()["request_id"].as_str().unwrap().to_string()
}

/// An in-process HTTP server for `settings` on `pool`, stopped when the token is cancelled.
async fn server(
    pool: &sqlx::PgPool,
    settings: Settings,
) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
    serve_http(pool, settings).await
}

fn settings_with_token(token: Option<&str>) -> Settings {
    let env: Vec<(String, String)> = token
        .map(|t| ("SETTLEMENTD__HTTP__ADMIN_TOKEN".to_string(), t.to_string()))
        .into_iter()
        .collect();
    Settings::load_from(None, env).unwrap()
}

async fn stored_requests(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM run_requests")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_runs_api_refuses_without_a_token_a_wrong_token_a_bad_key_or_body_storing_nothing() {
    let db = test_db().await;
    let (addr, stop, task) = server(&db.pool, settings_with_token(None)).await;
    let answer = post_run(addr, "k1", &format!(r#"{{"business_date":"{OCT}"}}"#)).await;
    assert_eq!(answer.status, 403, "{answer:?}");
    let error = answer.json()["error"].as_str().unwrap().to_string();
    assert!(
        error.contains("http.admin_token_file") && error.contains("SETTLEMENTD__HTTP__ADMIN_TOKEN"),
        "{error}"
    );
    stop.cancel();
    task.await.unwrap();

    let (addr, stop, task) = server(&db.pool, settings_with_token(Some(TOKEN))).await;
    let ok_body = format!(r#"{{"business_date":"{OCT}"}}"#);
    for auth in [None, Some("Bearer wrong-token-0123456789"), Some(TOKEN)] {
        let mut headers = vec![("Idempotency-Key", "k1")];
        if let Some(auth) = auth {
            headers.push(("Authorization", auth));
        }
        let answer = http(addr, "POST", "/v1/runs", &headers, &ok_body)
            .await
            .unwrap();
        assert_eq!(answer.status, 401, "{auth:?}: {answer:?}");
        assert_eq!(answer.header("www-authenticate"), Some("Bearer"));
        assert!(!answer.body.contains(TOKEN));
    }
    let auth = bearer();
    let no_key = http(
        addr,
        "POST",
        "/v1/runs",
        &[("Authorization", &auth)],
        &ok_body,
    )
    .await
    .unwrap();
    assert_eq!(no_key.status, 400, "{no_key:?}");
    assert!(no_key.json()["error"]
        .as_str()
        .unwrap()
        .contains("Idempotency-Key"));
    let too_long = "k".repeat(201);
    for key in [too_long.as_str(), "with space", "tab\tkey"] {
        let answer = post_run(addr, key, &ok_body).await;
        assert_eq!(answer.status, 400, "{key:?}: {answer:?}");
    }
    let bad_bodies = [
        ("not json", "invalid request body"),
        (
            r#"{"business_date":"2026-10-31","sharts":2}"#,
            "unknown field",
        ),
        (r#"{"business_date":"2026-10-30"}"#, "last day of a month"),
        (r#"{"business_date":"2099-12-31"}"#, "not over"),
        (r#"{"business_date":"2031-01-31"}"#, "not over"),
        (r#"{"business_date":"2026-10-31","shards":0}"#, "shards"),
        (
            r#"{"business_date":"2026-10-31","shards":3,"shard":3}"#,
            "shard",
        ),
        (r#"{"business_date":"2026-10-31","force":"yes"}"#, "invalid"),
        (r#"{"shards":1}"#, "business_date"),
    ];
    for (body, needle) in bad_bodies {
        let answer = post_run(addr, "k-bad", body).await;
        assert_eq!(answer.status, 400, "{body}: {answer:?}");
        let error = answer.json()["error"].as_str().unwrap().to_string();
        assert!(
            error.contains(needle),
            "{body}: '{error}' should say {needle}"
        );
    }
    assert_eq!(stored_requests(&db.pool).await, 0, "nothing stored");

    // The same key with another request is refused; the stored one is untouched.
    let first = post_run(addr, "k-conflict", &ok_body).await;
    assert_eq!(first.status, 202, "{first:?}");
    let other = post_run(
        addr,
        "k-conflict",
        &format!(r#"{{"business_date":"{OCT}","force":true}}"#),
    )
    .await;
    assert_eq!(other.status, 422, "{other:?}");
    assert_eq!(stored_requests(&db.pool).await, 1);

    let unknown = http(
        addr,
        "GET",
        "/v1/runs/00000000-0000-4000-8000-000000000000",
        &[("Authorization", &auth)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(unknown.status, 404, "{unknown:?}");
    let unauthorized = http(
        addr,
        "GET",
        first.json()["status_url"].as_str().unwrap(),
        &[],
        "",
    )
    .await
    .unwrap();
    assert_eq!(unauthorized.status, 401);
    stop.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn an_accepted_request_answers_with_its_contract_keys_and_replays_byte_for_byte() {
    let db = test_db().await;
    let (addr, stop, task) = server(&db.pool, settings_with_token(Some(TOKEN))).await;
    let body = format!(r#"{{"business_date":"{OCT}","shards":3,"shard":1}}"#);
    let first = post_run(addr, "settle-2026-10-shard-1", &body).await;
    assert_eq!(first.status, 202, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), None);
    let v = first.json();
    let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "business_date",
            "created_at",
            "force",
            "idempotency_key",
            "job",
            "request_id",
            "shard",
            "shards",
            "status_url"
        ]
    );
    assert_eq!(
        (
            v["business_date"].as_str(),
            v["shards"].as_u64(),
            v["shard"].as_u64(),
            v["force"].as_bool()
        ),
        (Some(OCT), Some(3), Some(1), Some(false))
    );
    // The same request again — even written differently — is the same request.
    for again in [
        body.clone(),
        format!(r#"{{"shard":1,"force":false,"shards":3,"business_date":"{OCT}"}}"#),
    ] {
        let replay = post_run(addr, "settle-2026-10-shard-1", &again).await;
        assert_eq!(replay.status, 202);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(replay.body, first.body, "byte-identical");
    }
    // Every shard by default: shards defaults to the replica's shard.count (1 here).
    let all = post_run(
        addr,
        "settle-2026-10-all",
        &format!(r#"{{"business_date":"{OCT}"}}"#),
    )
    .await;
    assert_eq!(all.status, 202);
    assert_eq!(all.json()["shard"], serde_json::Value::Null);
    assert_eq!(all.json()["shards"].as_u64(), Some(1));

    let auth = bearer();
    let status = http(
        addr,
        "GET",
        v["status_url"].as_str().unwrap(),
        &[("Authorization", &auth)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(status.status, 200, "{status:?}");
    let s = status.json();
    assert_eq!(s["request"], v);
    assert_eq!(s["shards"][0]["shard"].as_u64(), Some(1));
    assert_eq!(
        s["shards"][0]["state"].as_str(),
        Some("pending"),
        "no replica serves shard 1 of 3 here: it stays pending, visibly"
    );
    // The acceptance is in the audit trail.
    let requested: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM job_events WHERE event = 'requested' AND request_id = $1::uuid",
    )
    .bind(v["request_id"].as_str().unwrap())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(requested, 1);
    stop.cancel();
    task.await.unwrap();
}

/// Polls the request's shards until every one is `succeeded` (at most 30 s); returns the states.
async fn wait_until_served(pool: &sqlx::PgPool, request_id: &str) -> Vec<requests::Target> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let targets = requests::targets(pool, request_id).await.unwrap();
        if targets.iter().all(|t| t.state == "succeeded") || Instant::now() > deadline {
            return targets;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Settings of a replica whose schedule's latest fire settles October 2026 whatever today is (the
/// cron fires once a year, on 1 November), so its catch-up is the "cron fire" of these tests.
fn replica_env(shards: u32, shard: u32) -> Vec<(&'static str, String)> {
    vec![
        ("SETTLEMENTD__SCHEDULE__CRON", "0 30 2 1 11 *".to_string()),
        ("SETTLEMENTD__HTTP__ADMIN_TOKEN", TOKEN.to_string()),
        ("SETTLEMENTD__SHARD__COUNT", shards.to_string()),
        ("SETTLEMENTD__SHARD__INDEX", shard.to_string()),
        ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1".to_string()),
        ("SETTLEMENTD__LEASE__TTL_SECS", "3".to_string()),
        ("SETTLEMENTD__BATCH__SIZE", "200".to_string()),
    ]
}

fn start_replica(url: &str, shards: u32, shard: u32) -> ServeProcess {
    let env = replica_env(shards, shard);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    ServeProcess::start(url, &env)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_identical_concurrent_requests_to_two_replicas_start_one_new_attempt_per_shard() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month_alone(&db.pool, oct, 2000, 1).await;
    settle_shards(&db.pool, oct, 2, 500).await;
    let replicas = [start_replica(&db.url, 2, 0), start_replica(&db.url, 2, 1)];
    for r in &replicas {
        r.wait_for("/readyz", 200).await;
    }
    let before = settlementd::jobs::fine_settlement::month_totals(&db.pool, oct)
        .await
        .unwrap();

    let body = format!(r#"{{"business_date":"{OCT}","force":true}}"#);
    let sends: Vec<_> = (0..10)
        .map(|i| {
            let addr = replicas[i % 2].addr;
            let body = body.clone();
            tokio::spawn(async move { post_run(addr, "rerun-2026-10-ticket-4711", &body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for send in sends {
        answers.push(send.await.unwrap());
    }
    assert!(answers.iter().all(|a| a.status == 202), "{answers:?}");
    assert!(
        answers.iter().all(|a| a.body == answers[0].body),
        "every answer is the same"
    );
    let fresh = answers
        .iter()
        .filter(|a| a.header("idempotent-replayed").is_none())
        .count();
    assert_eq!(fresh, 1, "one request stored, nine replays");
    assert_eq!(stored_requests(&db.pool).await, 1);

    let request_id = answers[0].json()["request_id"]
        .as_str()
        .unwrap()
        .to_string();
    let targets = wait_until_served(&db.pool, &request_id).await;
    assert_eq!(targets.len(), 2);
    for t in &targets {
        assert_eq!(
            (t.state.as_str(), t.attempt),
            ("succeeded", Some(2)),
            "{targets:?}"
        );
    }
    let forced: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT shard, count(*) FROM job_events WHERE event = 'forced' GROUP BY shard ORDER BY shard",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        forced,
        [(0, 1), (1, 1)],
        "exactly one new attempt per shard"
    );
    let attempts: Vec<i32> = sqlx::query_scalar(
        "SELECT attempt FROM job_runs WHERE job_name = 'fine-settlement' ORDER BY shard",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(attempts, [2, 2]);
    assert_eq!(
        settlementd::jobs::fine_settlement::month_totals(&db.pool, oct)
            .await
            .unwrap(),
        before,
        "a forced re-run of a settled month changes nothing"
    );
}

/// Five `serve` processes of the one shard, and thirty forced requests, each under its own key,
/// sent at once to the replicas in turn: every request's shard is served by exactly one new
/// attempt, and PostgreSQL detected no deadlock. With two lock orders (a claim for a request
/// locking the request's row then `job_runs`, the SUCCESS write `job_runs` then the request's
/// row), a replica's claim for the request being finished deadlocked with its SUCCESS; an aborted
/// SUCCESS left the attempt RUNNING for a lease, and a peer took it over as a second attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_forced_requests_to_five_replicas_of_a_shard_start_one_new_attempt_each_and_no_deadlock(
) {
    const REPLICAS: usize = 5;
    const REQUESTS: usize = 30;
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month_alone(&db.pool, oct, 300, 1).await;
    settle_shards(&db.pool, oct, 1, 500).await;
    let logs = tempfile::tempdir().unwrap();
    let env = replica_env(1, 0);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let replicas: Vec<ServeProcess> = (0..REPLICAS)
        .map(|i| {
            ServeProcess::start_logged(&db.url, &env, &logs.path().join(format!("replica-{i}")))
        })
        .collect();
    for r in &replicas {
        r.wait_for("/readyz", 200).await;
    }

    let body = format!(r#"{{"business_date":"{OCT}","force":true}}"#);
    let sends: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let addr = replicas[i % REPLICAS].addr;
            let body = body.clone();
            tokio::spawn(async move { accepted(addr, &format!("rerun-2026-10-{i}"), &body).await })
        })
        .collect();
    let mut ids = Vec::new();
    for send in sends {
        ids.push(send.await.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    for id in &ids {
        let left = deadline.saturating_duration_since(Instant::now());
        let served = eventually(left.as_secs().max(1), || async {
            let targets = requests::targets(&db.pool, id).await.unwrap();
            targets.iter().all(|t| t.state == "succeeded")
        })
        .await;
        assert!(served, "request {id} not served within 120 s");
    }
    drop(replicas); // SIGTERM, waited for: their sessions end, and with them their statistics
    let mut log = String::new();
    for i in 0..REPLICAS {
        log.push_str(&std::fs::read_to_string(logs.path().join(format!("replica-{i}"))).unwrap());
    }

    // Per request: its claims (a new attempt each) and the attempt its shard row names.
    let claims: Vec<(String, i64, Option<i32>, Option<i32>)> = sqlx::query_as(
        "SELECT r.request_id::text,
                (SELECT count(*) FROM job_events e
                  WHERE e.request_id = r.request_id
                    AND e.event IN ('claimed', 'forced', 'took_over')),
                (SELECT max(e.attempt) FROM job_events e
                  WHERE e.request_id = r.request_id
                    AND e.event IN ('claimed', 'forced', 'took_over')),
                s.attempt
           FROM run_requests r JOIN run_request_shards s USING (request_id)
          ORDER BY r.created_at",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(claims.len(), REQUESTS);
    let twice: Vec<_> = claims.iter().filter(|c| c.1 != 1).collect();
    assert!(
        twice.is_empty(),
        "{} of {REQUESTS} requests did not start exactly one new attempt (request, attempts \
         started, last attempt, attempt that served it): {twice:?}",
        twice.len()
    );
    for (id, _, started, served) in &claims {
        assert_eq!(
            started, served,
            "request {id}: served by the attempt it started"
        );
    }
    let attempt: i32 =
        sqlx::query_scalar("SELECT attempt FROM job_runs WHERE job_name = 'fine-settlement'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        attempt as usize,
        1 + REQUESTS,
        "the first run, then one attempt per request"
    );
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&db.pool)
        .await
        .unwrap();
    let deadlocks: i64 = sqlx::query_scalar(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let logged = log.lines().filter(|l| l.contains("deadlock")).count();
    assert_eq!(
        (deadlocks, logged),
        (0, 0),
        "deadlocks PostgreSQL detected, lines of the replicas' logs naming one: {}",
        log.lines()
            .filter(|l| l.contains("deadlock"))
            .take(3)
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop_db(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_outlives_the_replica_that_accepted_it_and_runs_when_its_shard_is_served() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month_alone(&db.pool, oct, 1000, 1).await;
    // The receiving replica serves shard 1 of 2; the request is for the one shard of 1.
    let mut receiver = start_replica(&db.url, 2, 1);
    receiver.wait_for("/readyz", 200).await;
    let request_id = accepted(
        receiver.addr,
        "settle-2026-10-single",
        &format!(r#"{{"business_date":"{OCT}","shards":1}}"#),
    )
    .await;
    receiver.child.kill().unwrap(); // SIGKILL right after the answer
    receiver.child.wait().unwrap();
    let targets = requests::targets(&db.pool, &request_id).await.unwrap();
    assert_eq!(
        targets[0].state, "pending",
        "stored, and nobody serves it yet"
    );

    let _server = start_replica(&db.url, 1, 0);
    let targets = wait_until_served(&db.pool, &request_id).await;
    assert_eq!(targets[0].state, "succeeded", "{targets:?}");
    let (status, served_by): (String, Option<String>) =
        sqlx::query_as("SELECT status, request_id::text FROM job_runs WHERE shards = 1")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(status, "SUCCESS");
    assert_eq!(served_by.as_deref(), Some(request_id.as_str()));
    assert_eq!(
        settlementd::jobs::fine_settlement::month_totals(&db.pool, oct)
            .await
            .unwrap()
            .settled_rows,
        eligible(&db.pool, oct).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_the_schedule_and_a_forced_cli_run_colliding_leave_the_month_as_one_clean_run() {
    let oct = bd(OCT);
    let clean = test_db().await;
    let chaos = test_db().await;
    for db in [&clean, &chaos] {
        seed_month_alone(&db.pool, oct, 20_000, 1).await;
    }
    settle_shards(&clean.pool, oct, 1, 500).await;

    // The replica's catch-up fires for October at start (the schedule's latest slot), while a
    // forced request and a forced command-line run arrive.
    let replica = start_replica(&chaos.url, 1, 0);
    let cli = settlementd(Some(&chaos.url))
        .args(["run", "--business-date", OCT, "--shards", "1", "--force"])
        .env("SETTLEMENTD__BATCH__SIZE", "300")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    replica.wait_for("/healthz", 200).await;
    let request_id = accepted(
        replica.addr,
        "rerun-2026-10-collide",
        &format!(r#"{{"business_date":"{OCT}","force":true}}"#),
    )
    .await;
    let cli = tokio::task::spawn_blocking(move || cli.wait_with_output().unwrap())
        .await
        .unwrap();
    assert_eq!(cli.status.code(), Some(0), "run --force: done or skipped");
    let targets = wait_until_served(&chaos.pool, &request_id).await;
    assert_eq!(targets[0].state, "succeeded", "{targets:?}");
    assert_eq!(wait_for_success(&chaos.pool, oct).await, "SUCCESS");

    let rows = |db: &TestDb| {
        let pool = db.pool.clone();
        async move {
            sqlx::query_as::<_, (i64, i64, bool)>(
                "SELECT id, fine_cents, fine_settled_at IS NOT NULL FROM loans ORDER BY id",
            )
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(rows(&chaos).await, rows(&clean).await);
    assert_eq!(
        fine_settlement::month_totals(&chaos.pool, oct)
            .await
            .unwrap(),
        fine_settlement::month_totals(&clean.pool, oct)
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn claims_takeovers_fencing_rejections_successes_and_failures_are_in_the_audit_trail() {
    let db = test_db().await;
    let key = JobKey {
        job_name: "audited".into(),
        business_date: bd(OCT).date(),
        shards: 2,
        shard: 1,
    };
    let ttl = Duration::from_secs(60);
    let mut conn = db.pool.acquire().await.unwrap();
    let won = |o: claim::ClaimOutcome| match o {
        claim::ClaimOutcome::Won(c) => c,
        other => panic!("{other:?}"),
    };
    let first = won(
        claim::claim(&mut conn, &key, &Owner("a".into()), ttl, false)
            .await
            .unwrap(),
    );
    assert!(
        claim::mark_failed(&mut db.pool.acquire().await.unwrap(), &first, "disk full")
            .await
            .unwrap()
    );
    let second = won(
        claim::claim(&mut conn, &key, &Owner("b".into()), ttl, false)
            .await
            .unwrap(),
    );
    // The first owner, back from the dead, tries to finish: refused, and recorded.
    assert!(
        !claim::mark_success(&mut db.pool.acquire().await.unwrap(), &first, &[])
            .await
            .unwrap()
    );
    events::fencing_rejected(&db.pool, &first, "SUCCESS").await;
    assert!(
        claim::mark_success(&mut db.pool.acquire().await.unwrap(), &second, &[])
            .await
            .unwrap()
    );
    let third = won(claim::claim(&mut conn, &key, &Owner("c".into()), ttl, true)
        .await
        .unwrap());
    assert!(
        claim::mark_success(&mut db.pool.acquire().await.unwrap(), &third, &[])
            .await
            .unwrap()
    );

    let trail: Vec<(String, Option<i32>, String)> = events::for_key(&db.pool, &key)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.event, e.attempt, e.owner))
        .collect();
    let expect = [
        ("claimed", 1, "a"),
        ("failed", 1, "a"),
        ("took_over", 2, "b"),
        ("fencing_rejected", 1, "a"),
        ("succeeded", 2, "b"),
        ("forced", 3, "c"),
        ("succeeded", 3, "c"),
    ];
    assert_eq!(
        trail,
        expect
            .iter()
            .map(|(e, a, o)| (e.to_string(), Some(*a), o.to_string()))
            .collect::<Vec<_>>()
    );
    let failed: Option<String> =
        sqlx::query_scalar("SELECT message FROM job_events WHERE event = 'failed'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(failed.as_deref(), Some("disk full"));
    // The runtime role cannot rewrite history (deploy/sql/roles.sql); settlementd never does.
    let rewrites: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_user_tables
          WHERE relname = 'job_events' AND (n_tup_upd > 0 OR n_tup_del > 0)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(rewrites, 0);
}

#[tokio::test]
async fn status_shows_each_shards_latest_events_in_text_and_json() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month_alone(&db.pool, oct, 300, 1).await;
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", OCT, "--shards", "2"]));
    run_ok(settlementd(Some(&db.url)).args([
        "run",
        "--business-date",
        OCT,
        "--shards",
        "2",
        "--force",
    ]));
    let out = run_ok(settlementd(Some(&db.url)).args([
        "status",
        "--business-date",
        OCT,
        "--shards",
        "2",
        "--history",
        "3",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let history = v["history"].as_array().unwrap();
    let events: Vec<(u64, &str)> = history
        .iter()
        .map(|e| (e["shard"].as_u64().unwrap(), e["event"].as_str().unwrap()))
        .collect();
    assert_eq!(
        events,
        [(0, "succeeded"), (0, "forced"), (0, "succeeded")],
        "newest first, at most 3, only the shards that have events"
    );
    let out = run_ok(settlementd(Some(&db.url)).args([
        "status",
        "--business-date",
        OCT,
        "--shards",
        "2",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("history") && text.contains("forced") && text.contains("claimed"),
        "{text}"
    );
    let out = run_ok(settlementd(Some(&db.url)).args([
        "status",
        "--business-date",
        OCT,
        "--history",
        "0",
    ]));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("history"));
}

/// A replica of the one shard driven one tick at a time, its clock in mid-November.
fn ticking_replica(pool: &sqlx::PgPool) -> settlementd::daemon::replica::Replica {
    use chrono::TimeZone;
    let settings = Settings::load_from(None, []).unwrap();
    let clock = settlementd::clock::ManualClock::new(
        chrono::Utc.with_ymd_and_hms(2026, 11, 15, 0, 0, 0).unwrap(),
    );
    settlementd::daemon::replica::Replica::new(
        pool.clone(),
        &settings,
        std::sync::Arc::new(clock),
        CancellationToken::new(),
    )
}

async fn store(pool: &sqlx::PgPool, key: &str, force: bool) -> String {
    store_under(pool, key, force, 1).await
}

/// A request for October accepted while the fleet ran `shards` shards.
async fn store_under(pool: &sqlx::PgPool, key: &str, force: bool, shards: u32) -> String {
    let request = requests::NewRequest {
        to: None,
        idempotency_key: key.into(),
        job_name: fine_settlement::JOB_NAME.into(),
        business_date: bd(OCT).date(),
        shards,
        shard: None,
        force,
    };
    let mut conn = pool.acquire().await.unwrap();
    match requests::store(&mut conn, &request, "test", |_| "{}".into())
        .await
        .unwrap()
    {
        requests::Stored::New(stored) => stored.request_id,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn without_force_a_request_reports_a_settled_month_as_done_and_starts_no_attempt() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month_alone(&db.pool, oct, 500, 1).await;
    settle_shards(&db.pool, oct, 1, 100).await;
    let id = store(&db.pool, "settle-2026-10-again", false).await;
    let mut replica = ticking_replica(&db.pool);
    replica.tick().await;
    let targets = requests::targets(&db.pool, &id).await.unwrap();
    assert_eq!(
        (targets[0].state.as_str(), targets[0].attempt),
        ("succeeded", Some(1)),
        "{targets:?}"
    );
    assert!(targets[0]
        .detail
        .as_deref()
        .unwrap()
        .contains("already SUCCESS"));
    let attempt: i32 = sqlx::query_scalar("SELECT attempt FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempt, 1, "not re-run");

    // With force, two requests are two re-runs; each is served once, however often ticked.
    let a = store(&db.pool, "rerun-a", true).await;
    let b = store(&db.pool, "rerun-b", true).await;
    for _ in 0..4 {
        replica.tick().await;
    }
    for id in [&a, &b] {
        assert_eq!(
            requests::targets(&db.pool, id).await.unwrap()[0].state,
            "succeeded"
        );
    }
    let attempt: i32 = sqlx::query_scalar("SELECT attempt FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(attempt, 3, "one new attempt per forced request");
}

/// Fault campaign seed 1009 (`cargo run --release --bin campaign -- --seed 1009 --schedules 1`): a
/// request accepted under 2 shards, then the fleet moved to 1 (here) or 3: no replica of the old
/// count was left to serve it, and it stayed open for good. A replica of the new count serves it
/// under the request's own keys (its count, each of its shards), so its loans are settled once and
/// the request is answered.
#[tokio::test]
async fn a_request_accepted_before_a_reshard_is_served_under_its_own_shard_count() {
    let db = test_db().await;
    let oct = bd(OCT);
    seed_month_alone(&db.pool, oct, 500, 1).await;
    let id = store_under(&db.pool, "before-the-reshard", false, 2).await;
    let mut replica = ticking_replica(&db.pool);
    for _ in 0..4 {
        replica.tick().await;
    }
    let states: Vec<(i32, String)> = requests::targets(&db.pool, &id)
        .await
        .unwrap()
        .into_iter()
        .map(|t| (t.shard, t.state))
        .collect();
    assert_eq!(
        states,
        vec![(0, "succeeded".to_string()), (1, "succeeded".to_string())]
    );
    let runs: Vec<(i32, i32, String)> = sqlx::query_as(
        "SELECT shards, shard, status FROM job_runs WHERE request_id IS NOT NULL
          ORDER BY shards, shard",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        runs,
        vec![(2, 0, "SUCCESS".to_string()), (2, 1, "SUCCESS".to_string())],
        "served under the request's own keys"
    );
    let (settled, journaled, loans): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL),
                (SELECT count(*) FROM fine_journal_entries),
                (SELECT count(DISTINCT loan_id) FROM fine_journal_entries)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM loans WHERE fine_settled_at IS NULL
            AND returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND due_on IS NOT NULL AND isfinite(due_on)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(
        settled > 0 && waiting == 0,
        "{settled} settled, {waiting} waiting"
    );
    assert_eq!((journaled, loans), (settled, settled), "each loan once");
}
