//! What an open HTTP port meets, against real `settlementd serve` processes: a flood of half-open
//! connections that trickle their headers, a request body that never finishes, an idle kept-alive
//! connection, and wrong tokens. The replica must keep answering its probes within the
//! Kubernetes probe timeouts, close what is held within its timeouts, and count refused tokens.

use crate::helpers::*;
use settlementd::calendar::BusinessDate;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Kubernetes' liveness probe timeout (`timeoutSeconds` unset in deploy/kubernetes: 1 s) and the
/// readiness probe's (3 s there).
const LIVENESS_TIMEOUT: Duration = Duration::from_secs(1);
const READINESS_TIMEOUT: Duration = Duration::from_secs(3);

/// `serve` on `url` under the usual container limit of 1,024 open files.
fn serve_with_1024_files(url: &str, env: &[(&str, &str)]) -> ServeProcess {
    use std::os::unix::process::CommandExt;
    let addr = free_loopback_addr();
    let mut command = settlementd(Some(url));
    command
        .arg("serve")
        .env("SETTLEMENTD__HTTP__LISTEN", addr.to_string())
        .env("SETTLEMENTD__SHUTDOWN__GRACE_SECS", "2")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // SAFETY: setrlimit(2) between fork and exec touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: 1024,
                rlim_max: 1024,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    ServeProcess {
        child: command.spawn().unwrap(),
        addr,
    }
}

/// Raises this process's soft limit of open files to at least `wanted` (up to its hard limit).
fn raise_own_file_limit(wanted: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit(2) on a struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < wanted {
            limit.rlim_cur = wanted.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
    assert!(
        limit.rlim_cur >= wanted,
        "this test opens {wanted} files; the hard limit is {}",
        limit.rlim_max
    );
}

/// GET `path` within `limit`: the status, or why not.
async fn probe(addr: SocketAddr, path: &str, limit: Duration) -> Result<u16, String> {
    match tokio::time::timeout(limit, get(addr, path)).await {
        Ok(Ok((status, _))) => Ok(status),
        Ok(Err(e)) => Err(format!("{path}: {e}")),
        Err(_) => Err(format!("{path}: no answer within {limit:?}")),
    }
}

/// A connection that sends half a request header, then one more header line every second, until
/// the server closes it; returns how long after `since` it was closed (or `None` when it was
/// still open at `deadline`).
async fn half_open(mut stream: TcpStream, since: Instant, deadline: Instant) -> Option<Duration> {
    let mut buf = [0u8; 256];
    if stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: flood\r\n")
        .await
        .is_err()
    {
        return Some(since.elapsed());
    }
    loop {
        tokio::select! {
            read = stream.read(&mut buf) => match read {
                Ok(0) | Err(_) => return Some(since.elapsed()),
                Ok(_) => {}
            },
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if stream.write_all(b"X-Trickle: 1\r\n").await.is_err() {
                    return Some(since.elapsed());
                }
            }
            _ = tokio::time::sleep_until(deadline.into()) => return None,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_half_open_connections_neither_delays_the_probes_nor_outlives_the_header_timeout(
) {
    let db = test_db().await;
    // The defaults: a 5 s header-read timeout, at most 256 connections.
    let header_timeout = Duration::from_secs(5);
    let server = serve_with_1024_files(&db.url, &[]);
    server.wait_for("/readyz", 200).await;

    // More connections than the replica may open files, as in the issue: 1,100. This process
    // needs that many too.
    raise_own_file_limit(1200);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(60);
    let mut flood = Vec::new();
    for _ in 0..1100 {
        let stream = TcpStream::connect(server.addr).await.unwrap();
        flood.push(tokio::spawn(half_open(stream, started, deadline)));
    }
    let opened = started.elapsed();

    // While the flood holds what it can, the probes answer within Kubernetes' timeouts.
    let mut slowest = Duration::ZERO;
    for _ in 0..6 {
        for (path, limit) in [
            ("/healthz", LIVENESS_TIMEOUT),
            ("/readyz", READINESS_TIMEOUT),
        ] {
            let asked = Instant::now();
            assert_eq!(probe(server.addr, path, limit).await, Ok(200));
            slowest = slowest.max(asked.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Every flooding connection is closed by the server: replaced by a newer one at the cap, or
    // cut at the header timeout (counted from its opening, at the latest `opened`).
    let bound = opened + header_timeout + Duration::from_secs(5);
    let mut closed_at = Vec::new();
    for task in flood {
        closed_at.push(task.await.unwrap());
    }
    let still_open = closed_at.iter().filter(|c| c.is_none()).count();
    assert_eq!(still_open, 0, "connections still open after 60 s");
    let last = closed_at.iter().flatten().max().unwrap();
    assert!(
        *last <= bound,
        "the last flooding connection was closed {last:?} after the flood began (opened in \
         {opened:?}; header timeout {header_timeout:?})"
    );
    eprintln!(
        "flood: 1,100 connections opened in {opened:?}; slowest probe {slowest:?}; the last one \
         closed {last:?} after the flood began"
    );
    assert_eq!(
        probe(server.addr, "/healthz", LIVENESS_TIMEOUT).await,
        Ok(200)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_ends_gets_503_at_the_request_timeout_and_an_idle_connection_is_closed() {
    let db = test_db().await;
    let server = ServeProcess::start(
        &db.url,
        &[
            ("SETTLEMENTD__HTTP__REQUEST_TIMEOUT_SECS", "2"),
            ("SETTLEMENTD__HTTP__HEADER_READ_TIMEOUT_SECS", "2"),
        ],
    );
    server.wait_for("/healthz", 200).await;

    // A request whose header arrived but whose body stops after 10 of 100 bytes.
    let mut slow = TcpStream::connect(server.addr).await.unwrap();
    slow.write_all(b"POST /v1/runs HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{\"business")
        .await
        .unwrap();
    let sent = Instant::now();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(30), slow.read_to_string(&mut answer))
        .await
        .expect("the server ends the request")
        .ok();
    let took = sent.elapsed();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer:?}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(10),
        "answered after {took:?}, with a request timeout of 2 s"
    );

    // A kept-alive connection that goes quiet after its answer is closed at the header timeout.
    let mut idle = TcpStream::connect(server.addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    let answered = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match idle.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the idle connection is still open after 30 s"
    );
    let held = answered.elapsed();
    assert!(
        held >= Duration::from_millis(1900) && held < Duration::from_secs(10),
        "closed {held:?} after its answer, with a header timeout of 2 s"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_tokens_are_counted_on_metrics_and_an_accepted_one_is_not() {
    let db = test_db().await;
    let token = "a-token-of-thirty-two-characters";
    let server = ServeProcess::start(&db.url, &[("SETTLEMENTD__HTTP__ADMIN_TOKEN", token)]);
    server.wait_for("/readyz", 200).await;
    assert_eq!(server.metric("settlementd_auth_refused_total").await, 0.0);
    for given in ["", "Bearer wrong-token-wrong-token", "Basic abc"] {
        let headers: Vec<(&str, &str)> = if given.is_empty() {
            vec![]
        } else {
            vec![("Authorization", given)]
        };
        let answer = http(server.addr, "GET", "/v1/runs/none", &headers, "")
            .await
            .unwrap();
        assert_eq!(answer.status, 401, "{given:?}: {}", answer.body);
    }
    let bearer = format!("Bearer {token}");
    let answer = http(
        server.addr,
        "GET",
        "/v1/runs/none",
        &[("Authorization", &bearer)],
        "",
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 404, "{}", answer.body);
    assert_eq!(server.metric("settlementd_auth_refused_total").await, 3.0);
}

const DRY_TOKEN: &str = "a-dry-run-token-0123456789";

/// POST /v1/runs/dry-run with the token, `body` and, when given, `content_type`.
async fn dry(addr: SocketAddr, body: &str, content_type: Option<&str>) -> Answer {
    let bearer = format!("Bearer {DRY_TOKEN}");
    let mut headers = vec![("Authorization", bearer.as_str())];
    if let Some(content_type) = content_type {
        headers.push(("Content-Type", content_type));
    }
    http(addr, "POST", "/v1/runs/dry-run", &headers, body)
        .await
        .unwrap()
}

/// `from`–`to` of 2024 (outside a replica's lookback: nothing settles it meanwhile) under `shards`.
fn dry_body(from: &str, to: &str, shards: u32) -> String {
    format!(r#"{{"from":"{from}","to":"{to}","shards":{shards}}}"#)
}

/// The dry run's bounds: the issue's request (every month since 2000 of 1,024 shards, which took a
/// minute and gigabytes) is refused at once with a 400 naming both caps, as is one month or one
/// shard too many; at the caps it answers; a body declared as anything but JSON is 415.
#[tokio::test]
async fn a_dry_run_over_its_caps_is_400_naming_them_and_a_body_not_declared_json_is_415() {
    let db = test_db().await;
    let settings = settings(&[("HTTP__ADMIN_TOKEN", DRY_TOKEN)]);
    let (addr, stop, task) = serve_http(&db.pool, settings).await;

    let asked = Instant::now();
    let refused = dry(addr, &dry_body("2000-01", "2024-12", 1024), None).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        asked.elapsed() < Duration::from_secs(2),
        "{:?}",
        asked.elapsed()
    );
    let why = refused.json()["error"].as_str().unwrap().to_string();
    assert!(
        why.contains("at most 12 months and 1024 shards × months")
            && why.contains("300 months × 1024 shards"),
        "{why}"
    );
    for (body, asks) in [
        (dry_body("2023-12", "2024-12", 1), "13 months × 1 shard"),
        (dry_body("2024-01", "2024-12", 86), "12 months × 86 shards"),
        (dry_body("2024-11", "2024-12", 513), "2 months × 513 shards"),
    ] {
        let refused = dry(addr, &body, None).await;
        assert_eq!(refused.status, 400, "{body}: {}", refused.body);
        assert!(refused.body.contains(asks), "{body}: {}", refused.body);
    }
    // One shard of many is one shard.
    let one = r#"{"from":"2024-01","to":"2024-12","shards":1024,"shard":7}"#;
    for body in [
        dry_body("2024-01", "2024-12", 85),
        r#"{"business_date":"2024-12-31","shards":1024}"#.to_string(),
        one.to_string(),
    ] {
        let answer = dry(addr, &body, None).await;
        assert_eq!(answer.status, 200, "{body}: {}", answer.body);
    }

    let body = r#"{"business_date":"2024-12-31","shards":2}"#;
    for declared in [
        "application/json",
        "application/json; charset=utf-8",
        "application/merge-patch+json",
    ] {
        let answer = dry(addr, body, Some(declared)).await;
        assert_eq!(answer.status, 200, "{declared}: {}", answer.body);
    }
    for declared in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let answer = dry(addr, body, Some(declared)).await;
        assert_eq!(answer.status, 415, "{declared}: {}", answer.body);
        let why = answer.json()["error"].as_str().unwrap().to_string();
        assert!(why.contains("Content-Type: application/json"), "{why}");
    }
    let not_json = dry(addr, "business_date=2024-12-31", None).await;
    assert_eq!(not_json.status, 400, "{}", not_json.body);
    stop.cancel();
    task.await.unwrap();
    drop_db(db).await;
}

/// A process's resident memory now and its peak (`VmRSS`, `VmHWM` of /proc/PID/status), in KiB.
fn memory_kib(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| -> u64 {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The largest dry runs the caps allow (12 months of 85 shards, one month of 1,024), on a year of
/// loans, grow a real `serve` process by less than 64 MiB at their peak (its StatefulSet limit is
/// 256 MiB): the peak is reset before each (`/proc/PID/clear_refs`), and the growth is its peak
/// over its resident memory just before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_dry_runs_allowed_grow_a_replica_by_less_than_64_mib() {
    let db = test_db().await;
    for (i, month) in (1..=12).enumerate() {
        let month =
            BusinessDate::of_month_of(chrono::NaiveDate::from_ymd_opt(2024, month, 1).unwrap())
                .unwrap();
        seed_month(&db.pool, month, 3000, 1 + i as i64 * 10_000).await;
    }
    let server = ServeProcess::start(&db.url, &[("SETTLEMENTD__HTTP__ADMIN_TOKEN", DRY_TOKEN)]);
    server.wait_for("/readyz", 200).await;
    let pid = server.child.id();
    // Warm: the pool's connections, the code paths.
    let warm = dry(server.addr, &dry_body("2024-12", "2024-12", 2), None).await;
    assert_eq!(warm.status, 200, "{}", warm.body);

    for body in [
        dry_body("2024-01", "2024-12", 85),
        r#"{"business_date":"2024-12-31","shards":1024}"#.to_string(),
    ] {
        let reset = std::fs::write(format!("/proc/{pid}/clear_refs"), "5").is_ok();
        let (before, _) = memory_kib(pid);
        let asked = Instant::now();
        let answer = dry(server.addr, &body, None).await;
        let took = asked.elapsed();
        assert_eq!(answer.status, 200, "{body}: {}", answer.body);
        let (after, peak) = memory_kib(pid);
        let grew = peak.saturating_sub(before);
        let shards: usize = answer.json()["dry_runs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["by_shard"].as_array().unwrap().len())
            .sum();
        eprintln!(
            "dry run {body}: {shards} shard objects, {} bytes of JSON in {took:?}; resident \
             {before} KiB before, peak {peak} KiB (+{grew} KiB), {after} KiB after{}",
            answer.body.len(),
            if reset {
                ""
            } else {
                " (peak not reset: since start)"
            }
        );
        assert!(shards >= 1020, "{body}: {shards} shard objects");
        assert!(
            grew < 64 * 1024,
            "{body}: the replica grew by {grew} KiB (resident {before} KiB, peak {peak} KiB)"
        );
    }
}

/// A dry run that outlives the request timeout (its month's loans locked by another session, so
/// its statement waits) answers 503 before the server's own timeout, and the database is no
/// longer working for it: its statement is cancelled, not left to run for nobody. The replica
/// answers the next dry run once the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_past_the_request_timeout_is_503_and_its_statement_stops_with_it() {
    use sqlx::Connection;
    let db = test_db().await;
    seed_month(&db.pool, bd("2024-06-30"), 500, 1).await;
    let server = ServeProcess::start(
        &db.url,
        &[
            ("SETTLEMENTD__HTTP__ADMIN_TOKEN", DRY_TOKEN),
            ("SETTLEMENTD__HTTP__REQUEST_TIMEOUT_SECS", "2"),
            // The sessions' own guards are far longer than the request: only the dry run's
            // deadline can stop its statement in time.
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "10"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "60"),
        ],
    );
    server.wait_for("/readyz", 200).await;
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("LOCK TABLE loans IN ACCESS EXCLUSIVE MODE")
        .execute(&mut holder)
        .await
        .unwrap();

    let body = r#"{"business_date":"2024-06-30","shards":4}"#;
    let asked = Instant::now();
    let answer = dry(server.addr, body, None).await;
    let took = asked.elapsed();
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert!(
        answer.body.contains("did not finish within 1.8 s"),
        "its own answer, not the server's timeout: {}",
        answer.body
    );
    assert!(
        took < Duration::from_millis(2500),
        "answered after {took:?}"
    );
    // Still holding the lock: nothing of the dry run waits for it any more.
    let waiting = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND query LIKE '/* preview.run */%'
                AND state = 'active'",
        )
        .fetch_one(&db.pool)
        .await
        .unwrap()
    };
    let stopped = eventually(1, || async { waiting().await == 0 }).await;
    assert!(
        stopped,
        "the dry run's statement still runs {:?} after its 503",
        asked.elapsed() - took
    );
    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let answer = dry(server.addr, body, None).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    drop_db(db).await;
}
