//! settlementd through PgBouncer (Debian's `pgbouncer` package, started here on a free loopback
//! port in front of the test server). Session pooling works unchanged; transaction pooling is
//! refused at start with one line naming the setting, and the traps that make it unusable are
//! shown for real. `#[ignore]`d because they need the package (`.ci/run` installs it): run with
//! `cargo test --test it -- --ignored`.

use crate::helpers::*;
use crate::journal::assert_settled_once;
use sqlx::{Connection, PgConnection};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A PgBouncer in front of the test server, stopped on drop.
struct Bouncer {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Bouncer {
    fn start(pool_mode: &str) -> Self {
        let binary = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|p| std::path::Path::new(p).is_file())
            .expect("pgbouncer is not installed: apt-get install pgbouncer (.ci/run does)");
        // The server the tests use: its Unix socket directory, or host and port.
        let server = url::Url::parse(&url_for("x")).unwrap();
        let socket = server
            .query_pairs()
            .find(|(k, _)| k == "host")
            .map(|(_, v)| v.into_owned());
        let target = match socket {
            Some(dir) => format!("host={dir} port={}", server.port().unwrap_or(5432)),
            None => format!(
                "host={} port={}",
                server.host_str().unwrap(),
                server.port().unwrap_or(5432)
            ),
        };
        let user = server.username().to_string();
        let port = free_loopback_addr().port();
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let d = dir.path().display();
        std::fs::write(dir.path().join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        std::fs::write(
            dir.path().join("pgbouncer.ini"),
            format!(
                "[databases]\n* = {target}\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {d}/users.txt\npool_mode = {pool_mode}\n\
                 default_pool_size = 20\nmax_client_conn = 200\n\
                 logfile = {d}/pgbouncer.log\npidfile = {d}/pgbouncer.pid\n"
            ),
        )
        .unwrap();
        let stderr = std::fs::File::create(dir.path().join("stderr.log")).unwrap();
        let mut command = Command::new(binary);
        command
            .arg(dir.path().join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(stderr);
        // PgBouncer refuses to run as root: run it as the server's OS user, like the server.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } == 0 {
            let name = std::ffi::CString::new("postgres").unwrap();
            // SAFETY: getpwnam returns static storage or NULL; the ids are copied at once.
            let pw = unsafe { libc::getpwnam(name.as_ptr()) };
            assert!(!pw.is_null(), "no postgres OS user to run pgbouncer as");
            // SAFETY: checked non-null above.
            let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
            // Its log and pid file go in the directory.
            std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
            command.uid(uid).gid(gid);
        }
        let child = command.spawn().unwrap();
        let bouncer = Self { child, port, dir };
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return bouncer;
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        panic!("pgbouncer did not start: {}", bouncer.log());
    }

    /// A URL for `db` through this PgBouncer.
    fn url(&self, db: &str) -> String {
        let user = url::Url::parse(&url_for("x"))
            .unwrap()
            .username()
            .to_string();
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    fn log(&self) -> String {
        let read = |name| std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        format!("{}{}", read("stderr.log"), read("pgbouncer.log"))
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        signal_pid(self.child.id(), libc::SIGTERM);
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Debian's pgbouncer package: run with --ignored"]
async fn run_and_serve_work_unchanged_through_pgbouncer_in_session_mode() {
    let bouncer = Bouncer::start("session");
    let month = due_month();
    let (db, clean) = (test_db().await, test_db().await);
    // Nothing returned in the months around it: the replica would settle those too.
    seed_month_alone(&db.pool, month, 3_000, 1).await;
    seed_month_alone(&clean.pool, month, 3_000, 1).await;
    settle_shards(&clean.pool, month, 2, 500).await;
    let url = bouncer.url(&db.name);

    // Shard 0 by hand, shard 1 by a replica; both through the pooler.
    let date = month.to_string();
    let out = run_ok(settlementd(Some(&url)).args([
        "run",
        "--business-date",
        &date,
        "--shard",
        "0",
        "--shards",
        "2",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["skipped"], false, "{v}");
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut serve = ServeProcess::start_logged(
        &url,
        &[
            ("SETTLEMENTD__SHARD__INDEX", "1"),
            ("SETTLEMENTD__SHARD__COUNT", "2"),
            ("SETTLEMENTD__BATCH__SIZE", "500"),
        ],
        log.path(),
    );
    serve.wait_for("/readyz", 200).await;
    assert!(
        eventually(30, || async {
            // Both shards settled, and the replica's member statements that follow them done
            // too (stopped inside them, it would log their interruption).
            sqlx::query_scalar::<_, bool>(
                "SELECT count(*) FILTER (WHERE job_name = $1 AND status = 'SUCCESS') = 2
                        AND count(*) FILTER (WHERE job_name <> $1 AND status = 'SUCCESS') > 0
                        AND count(*) FILTER (WHERE status <> 'SUCCESS') = 0
                   FROM job_runs",
            )
            .bind(settlementd::jobs::fine_settlement::JOB_NAME)
            .fetch_one(&db.pool)
            .await
            .unwrap()
        })
        .await,
        "{}",
        std::fs::read_to_string(log.path()).unwrap()
    );
    assert_eq!(
        settled_rows(&db.pool).await,
        settled_rows(&clean.pool).await
    );
    assert_settled_once(&db.pool, &clean.pool).await;
    serve.signal(libc::SIGTERM);
    assert_eq!(serve.child.wait().unwrap().code(), Some(0));
    let text = std::fs::read_to_string(log.path()).unwrap();
    // No failure on the way (the only warning is the seed's loans with contradictory dates).
    assert!(
        text.lines()
            .filter(|l| l.contains("\"level\":\"WARN\"") || l.contains("\"level\":\"ERROR\""))
            .all(|l| l.contains("flags as odd")),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Debian's pgbouncer package: run with --ignored"]
async fn run_and_serve_refuse_transaction_pooling_at_start_with_one_line_naming_the_setting() {
    let bouncer = Bouncer::start("transaction");
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 500, 1).await;
    let url = bouncer.url(&db.name);
    for args in [
        &["run", "--business-date", "2026-10-31"][..],
        &["serve"][..],
        &["migrate"][..],
    ] {
        let out = settlementd(Some(&url))
            .args(args)
            .env("SETTLEMENTD__HTTP__LISTEN", "127.0.0.1:0")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains("pool_mode = session"), "{args:?}: {err}");
    }
    // Nothing was claimed or settled.
    let (runs, settled): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM job_runs),
                (SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!((runs, settled), (0, 0));
}

/// Why transaction pooling is refused, shown on PgBouncer as Debian ships it (1.18, without
/// protocol-level prepared statements): two sqlx connections each prepare their first statement
/// as `sqlx_s_1`, and once the pooler hands both the same server session, the second collides
/// (or finds a statement missing on another session). Session settings leak the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Debian's pgbouncer package: run with --ignored"]
async fn through_transaction_pooling_prepared_statements_collide_and_session_settings_leak() {
    let bouncer = Bouncer::start("transaction");
    let db = test_db().await;
    let url = bouncer.url(&db.name);
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let options = options.extra_float_digits(None);
    let mut a = PgConnection::connect_with(&options).await.unwrap();
    let mut b = PgConnection::connect_with(&options).await.unwrap();

    // A session setting made by one client connection is seen by the other.
    sqlx::raw_sql("SET application_name = 'set-by-a'")
        .execute(&mut a)
        .await
        .unwrap();
    let seen: String = sqlx::query_scalar("SELECT current_setting('application_name')")
        .persistent(false)
        .fetch_one(&mut b)
        .await
        .unwrap_or_default();
    let leaked = seen == "set-by-a";

    // Named prepared statements: each connection prepares (and caches) its own.
    let mut errors = Vec::new();
    for i in 0..20 {
        for conn in [&mut a, &mut b] {
            if let Err(e) = sqlx::query_scalar::<_, i32>("SELECT $1::int4")
                .bind(i)
                .fetch_one(&mut *conn)
                .await
            {
                errors.push(e.to_string());
            }
        }
    }
    assert!(
        errors
            .iter()
            .any(|e| e.contains("already exists") || e.contains("does not exist")),
        "no prepared-statement error through transaction pooling: {errors:?}"
    );
    eprintln!(
        "transaction pooling: session setting leaked: {leaked}; prepared statements: {} errors, first: {}",
        errors.len(),
        errors[0]
    );
    // And the start-up parameter sqlx sends by default is refused by PgBouncer.
    let default_options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let refused = PgConnection::connect_with(&default_options).await;
    eprintln!(
        "default sqlx start-up (extra_float_digits): {}",
        match &refused {
            Ok(_) => "accepted".to_string(),
            Err(e) => e.to_string(),
        }
    );
}
