//! Test harness: one private PostgreSQL cluster per test process, a fresh database per test.

#![allow(dead_code)]

use settlementd::calendar::BusinessDate;
use settlementd::embedded_pg::{EmbeddedOptions, EmbeddedPg};
use sqlx::{Connection, PgConnection, PgPool};
use std::sync::OnceLock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The server every test database lives on: an admin URL template with `{db}` for the name.
struct Server {
    url_template: String,
    /// Keeps the private cluster alive for the whole test process; the server dies with the process
    /// (PR_SET_PDEATHSIG) and its directory is cleaned up by the next run.
    _embedded: Option<EmbeddedPg>,
}

static SERVER: OnceLock<Server> = OnceLock::new();
static TEMPLATE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();

fn server() -> &'static Server {
    SERVER.get_or_init(|| {
        if let Ok(url) = std::env::var("TEST_DATABASE_URL") {
            let mut parsed = url::Url::parse(&url).expect("TEST_DATABASE_URL is a URL");
            parsed.set_path("/DBNAME");
            return Server {
                url_template: parsed.to_string(),
                _embedded: None,
            };
        }
        let pg = EmbeddedPg::start(EmbeddedOptions::default())
            .expect("start a private PostgreSQL for the tests");
        Server {
            url_template: pg.url("DBNAME"),
            _embedded: Some(pg),
        }
    })
}

pub fn url_for(db: &str) -> String {
    server().url_template.replace("DBNAME", db)
}

async fn admin() -> PgConnection {
    PgConnection::connect(&url_for("postgres"))
        .await
        .expect("connect to the test server")
}

/// Lets every session on database `name` find settlementd's schema first, as the binary's own
/// sessions do (`settlementd::db::SEARCH_PATH_SQL`): the tests' SQL names settlementd's tables
/// without their schema. A database's setting is not copied by `CREATE DATABASE … TEMPLATE`, so
/// each database gets it. The binary never relies on it: [`bare_db`] has none.
async fn find_settlementd_first(admin: &mut PgConnection, name: &str) {
    sqlx::query(&format!(
        "ALTER DATABASE {name} SET search_path = settlementd, public"
    ))
    .execute(admin)
    .await
    .unwrap();
}

/// A fresh database per test, cloned from a migrated template.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

pub async fn test_db() -> TestDb {
    let template = TEMPLATE
        .get_or_init(|| async {
            let name = format!("settlementd_tmpl_{}", std::process::id());
            let mut admin = admin().await;
            sqlx::query(&format!("DROP DATABASE IF EXISTS {name}"))
                .execute(&mut admin)
                .await
                .unwrap();
            sqlx::query(&format!("CREATE DATABASE {name}"))
                .execute(&mut admin)
                .await
                .unwrap();
            let mut conn = PgConnection::connect(&url_for(&name)).await.unwrap();
            settlementd::db::migrate_connection(&mut conn)
                .await
                .expect("migrate the template");
            conn.close().await.unwrap();
            name
        })
        .await;
    let name = format!("t_{:016x}", rand::random::<u64>());
    create_from_template(&name, template).await;
    let url = url_for(&name);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect(&url)
        .await
        .expect("connect to the test database");
    TestDb { name, url, pool }
}

/// An empty, unmigrated database (for migration tests).
pub async fn empty_db() -> (String, String) {
    let (name, url) = bare_db().await;
    find_settlementd_first(&mut admin().await, &name).await;
    (name, url)
}

/// An empty, unmigrated database whose sessions have PostgreSQL's default search path (`"$user",
/// public`): what a release before settlementd's schema, or an operator's psql, sees.
pub async fn bare_db() -> (String, String) {
    let name = format!("e_{:016x}", rand::random::<u64>());
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin().await)
        .await
        .unwrap();
    let url = url_for(&name);
    (name, url)
}

pub fn bd(text: &str) -> BusinessDate {
    BusinessDate::parse(text).unwrap()
}

/// Deterministic loans: `n` returned in `month`'s business date month (one in ten not returned),
/// lateness from 15 days early to 45 days late (about a quarter on time, so fine 0), plus a few
/// returned just before and just after the month, which a run must never touch.
pub async fn seed_month(pool: &PgPool, month: BusinessDate, n: i64, first_id: i64) {
    let days = (month.date() - month.first_day()).num_days() + 1;
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i, i % 997, i % 1543, r - (((i * 7919) % 61) - 15)::int - 14, r - (((i * 7919) % 61) - 15)::int,
                CASE WHEN i % 10 = 0 THEN NULL ELSE r END
           FROM (SELECT i, $2::date + ((i * 37) % $3)::int AS r
                   FROM generate_series($4::bigint, $4::bigint + $1 - 1) AS i) s",
    )
    .bind(n)
    .bind(month.first_day())
    .bind(days)
    .bind(first_id)
    .execute(pool)
    .await
    .unwrap();
    // Boundary rows: the day before the month and the day after it.
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES ($1, 1, 1, $2::date - 30, $2::date - 20, $2::date - 1),
                ($1 + 1, 1, 1, $3::date - 30, $3::date - 20, $3::date + 1)",
    )
    .bind(first_id + n)
    .bind(month.first_day())
    .bind(month.date())
    .execute(pool)
    .await
    .unwrap();
}

/// [`seed_month`] without its boundary rows: loans returned in `month` and loans still out, nothing
/// returned in the months around it. A replica settles every month whose returns wait, so the
/// schedule's tests seed only the months they are about.
pub async fn seed_month_alone(pool: &PgPool, month: BusinessDate, n: i64, first_id: i64) {
    seed_month(pool, month, n, first_id).await;
    sqlx::query("DELETE FROM loans WHERE id IN ($1, $1 + 1)")
        .bind(first_id + n)
        .execute(pool)
        .await
        .unwrap();
}

/// Rows a run of `month` must settle.
pub async fn eligible(pool: &PgPool, month: BusinessDate) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM loans WHERE returned_on BETWEEN $1 AND $2")
        .bind(month.first_day())
        .bind(month.date())
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Every byte of the loans table that settlement may change, in id order.
pub async fn loans_snapshot(
    pool: &PgPool,
) -> Vec<(i64, i64, Option<chrono::DateTime<chrono::Utc>>)> {
    sqlx::query_as("SELECT id, fine_cents, fine_settled_at FROM loans ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Ages a claim's heartbeat in SQL, as if its holder stopped renewing `secs` seconds ago.
pub async fn age_heartbeat(
    pool: &PgPool,
    business_date: BusinessDate,
    shards: i32,
    shard: i32,
    secs: i64,
) {
    sqlx::query(
        "UPDATE job_runs SET heartbeat_at = heartbeat_at - make_interval(secs => $4)
          WHERE business_date = $1 AND shards = $2 AND shard = $3",
    )
    .bind(business_date.date())
    .bind(shards)
    .bind(shard)
    .bind(secs as f64)
    .execute(pool)
    .await
    .unwrap();
}

/// The `settlementd` binary with a clean environment pointing at `url` (when given).
pub fn settlementd(url: Option<&str>) -> std::process::Command {
    settlementd_at(std::path::Path::new(env!("CARGO_BIN_EXE_settlementd")), url)
}

/// [`settlementd`] of the binary at `bin` (another release's, for the upgrade tests).
pub fn settlementd_at(bin: &std::path::Path, url: Option<&str>) -> std::process::Command {
    let mut cmd = std::process::Command::new(bin);
    for (key, _) in std::env::vars() {
        if key.starts_with("SETTLEMENTD__") || key == "DATABASE_URL" || key == "RUST_LOG" {
            cmd.env_remove(key);
        }
    }
    if let Some(url) = url {
        cmd.env("SETTLEMENTD__DATABASE__URL", url);
    }
    cmd
}

/// `settlementd` with `args`, and `env` on top of a clean environment, against `url`, to completion.
pub fn cli(url: &str, env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    settlementd(Some(url))
        .envs(env.iter().copied())
        .args(args)
        .output()
        .unwrap()
}

/// Runs `command` to its end, which must come within `within` (a process that retries for ever
/// is killed and fails the test): its output.
pub fn output_within(
    command: &mut std::process::Command,
    within: std::time::Duration,
) -> std::process::Output {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {within:?}: {}", stderr_of(&out));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// `settlementd pause` of the fine settlement, which must succeed.
pub fn pause_settlement(url: &str, reason: &str) {
    run_ok(settlementd(Some(url)).args(["pause", "--job", "fine-settlement", "--reason", reason]));
}

/// What a finished process wrote on stderr.
pub fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The one JSON object a finished process printed on stdout.
pub fn json_of(out: &std::process::Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Runs `cmd` to completion and asserts it succeeded, showing its stderr otherwise.
pub fn run_ok(cmd: &mut std::process::Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Run options for tests: a fresh owner, a 60 s lease renewed every 10 s.
pub fn run_options(force: bool, estimate: bool) -> settlementd::job_layer::RunOptions {
    settlementd::job_layer::RunOptions {
        owner: settlementd::job_layer::Owner::for_process(),
        lease_ttl: std::time::Duration::from_secs(60),
        heartbeat_every: std::time::Duration::from_secs(10),
        force,
        estimate,
        request: None,
        reopen: None,
        correction: None,
        guards: settlementd::app::guards(&settings(&[])),
    }
}

/// Settles `month` cleanly: one run per shard of `shards`, in batches of `batch_size`.
/// Returns the rows updated.
pub async fn settle_shards(
    pool: &PgPool,
    month: BusinessDate,
    shards: u32,
    batch_size: u32,
) -> u64 {
    let job = settlementd::jobs::fine_settlement::FineSettlement {
        rules: Default::default(),
        batch_size,
        guards: Default::default(),
    };
    let mut updated = 0;
    for shard in 0..shards {
        let spec = settlementd::config::ShardSpec::new(shard, shards).unwrap();
        let key = settlementd::jobs::fine_settlement::key(month, spec);
        let report = settlementd::job_layer::run_once(
            pool,
            &job,
            key,
            &run_options(false, false),
            &tokio_util::sync::CancellationToken::new(),
            &|_| {},
        )
        .await
        .unwrap();
        updated += report.updated;
    }
    updated
}

/// Polls the month's claim until it is SUCCESS (at most 10 s); returns the last status seen.
pub async fn wait_for_success(pool: &PgPool, month: BusinessDate) -> String {
    let mut status = String::new();
    for _ in 0..400 {
        status = sqlx::query_scalar("SELECT status FROM job_runs WHERE business_date = $1")
            .bind(month.date())
            .fetch_optional(pool)
            .await
            .unwrap()
            .unwrap_or_default();
        if status == "SUCCESS" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    status
}

/// A raw HTTP/1.1 GET: (status, body).
pub async fn get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((status, body.to_string()))
}

/// A free loopback address to hand to a process, its port below Linux's ephemeral range
/// (32768–60999): a port in that range, found free and released, could be taken by any outgoing
/// connection on the machine before the process binds it (seen once in CI: "Address already in
/// use"); below it only an explicit bind takes a port. Never the same port twice in one test run.
pub fn free_loopback_addr() -> std::net::SocketAddr {
    use rand::Rng;
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    let mut rng = rand::rng();
    let port = (0..1000)
        .map(|_| rng.random_range(20_000..32_000))
        .find(|port| {
            !given.contains(port) && std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok()
        })
        .expect("no free loopback port in 20000..32000");
    given.push(port);
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

/// A `settlementd serve` process on a free loopback port, stopped (SIGTERM, then waited for) on drop.
pub struct ServeProcess {
    pub child: std::process::Child,
    pub addr: std::net::SocketAddr,
}

impl ServeProcess {
    /// Starts the binary's `serve` on `url` with `env` on top of a clean environment.
    pub fn start(url: &str, env: &[(&str, &str)]) -> Self {
        let addr = free_loopback_addr();
        let child = settlementd(Some(url))
            .arg("serve")
            .env("SETTLEMENTD__HTTP__LISTEN", addr.to_string())
            .env("SETTLEMENTD__SHUTDOWN__GRACE_SECS", "2")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        Self { child, addr }
    }

    /// GETs `path` until it answers `status` (at most 15 s); returns the last body.
    pub async fn wait_for(&self, path: &str, status: u16) -> String {
        let mut last = (0, String::new());
        for _ in 0..300 {
            if let Ok(answer) = get(self.addr, path).await {
                if answer.0 == status {
                    return answer.1;
                }
                last = answer;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        panic!("{path} never answered {status}; last: {last:?}");
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid; no memory is involved. SIGCONT first: a test
        // that failed while the process was stopped must not leave it (or itself) waiting.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT);
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

/// The HTTP endpoints' state for a replica with `settings`, on `pool`, with the system clock.
pub fn http_state(
    pool: &PgPool,
    settings: settlementd::config::Settings,
) -> settlementd::daemon::http::HttpState {
    settlementd::daemon::http::HttpState {
        pool: pool.clone(),
        metrics: settlementd::daemon::metrics::handle(),
        settings: std::sync::Arc::new(settings.clone()),
        clock: std::sync::Arc::new(settlementd::clock::SystemClock),
        owner: "test-replica".into(),
        overview: std::sync::Arc::new(settlementd::overview::Reader::new(pool)),
        registry: settlementd::jobs::build(&settings),
        // No replica reports to it: ready when the database answers and the schema is current.
        health: Default::default(),
    }
}

/// An in-process HTTP server for `settings` on `pool` ([`http_state`]) on a free loopback port,
/// stopped when the token is cancelled.
pub async fn serve_http(
    pool: &PgPool,
    settings: settlementd::config::Settings,
) -> (
    std::net::SocketAddr,
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let state = http_state(pool, settings);
    let shutdown = stop.clone().cancelled_owned();
    let task = tokio::spawn(async move {
        settlementd::daemon::http::run(listener, state, shutdown)
            .await
            .unwrap();
    });
    (addr, stop, task)
}

/// An HTTP answer as a test sees it.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// A raw HTTP/1.1 request with `headers` and `body`.
pub async fn http(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<Answer> {
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Answer {
        status,
        headers,
        body: body.to_string(),
    })
}

impl ServeProcess {
    /// As [`ServeProcess::start`], with the replica's stderr (its logs) appended to `log`.
    pub fn start_logged(url: &str, env: &[(&str, &str)], log: &std::path::Path) -> Self {
        Self::start_binary(
            std::path::Path::new(env!("CARGO_BIN_EXE_settlementd")),
            url,
            env,
            log,
        )
    }

    /// As [`ServeProcess::start_logged`], of the binary at `bin` (another release's).
    pub fn start_binary(
        bin: &std::path::Path,
        url: &str,
        env: &[(&str, &str)],
        log: &std::path::Path,
    ) -> Self {
        let addr = free_loopback_addr();
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = settlementd_at(bin, Some(url))
            .arg("serve")
            .env("SETTLEMENTD__HTTP__LISTEN", addr.to_string())
            .env("SETTLEMENTD__SHUTDOWN__GRACE_SECS", "2")
            .env("SETTLEMENTD__LOG__FORMAT", "json")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Self { child, addr }
    }

    /// The value of a counter or gauge on `/metrics` for the fine settlement: its series without
    /// labels or labelled `job_name="fine-settlement"`, summed over their other labels (0 when
    /// absent).
    pub async fn metric(&self, name: &str) -> f64 {
        self.metric_of(name, settlementd::jobs::fine_settlement::JOB_NAME)
            .await
    }

    /// [`ServeProcess::metric`] of the job `job`.
    pub async fn metric_of(&self, name: &str, job: &str) -> f64 {
        let (_, body) = get(self.addr, "/metrics").await.unwrap_or_default();
        let this_job = format!("job_name=\"{job}\"");
        body.lines()
            .filter(|l| l.starts_with(name))
            .filter(|l| match &l[name.len()..] {
                rest if rest.starts_with(' ') => true,
                rest if rest.starts_with('{') => {
                    let labels = &rest[..rest.find('}').unwrap_or(rest.len())];
                    !labels.contains("job_name=") || labels.contains(&this_job)
                }
                _ => false,
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: libc::c_int) {
        signal_pid(self.child.id(), signal);
    }
}

/// kill(2) on one of our children.
pub fn signal_pid(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a pid we spawned; no memory is involved.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}

/// What settlement may change in the loans table, whole, in id order: `(id, fine_cents, settled)`.
/// Two runs that end equal here are byte-identical but for the settlement timestamps.
pub async fn settled_rows(pool: &PgPool) -> Vec<(i64, i64, bool)> {
    sqlx::query_as("SELECT id, fine_cents, fine_settled_at IS NOT NULL FROM loans ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// A private, durable PostgreSQL cluster of its own (a test may stop it hard, restart it or change
/// its pg_hba.conf without disturbing the others) with one migrated database, `settle`.
pub struct PrivateCluster {
    pub pg: EmbeddedPg,
    pub url: String,
    /// Holds the data directory; removed on drop (after the server is stopped).
    pub data: tempfile::TempDir,
}

impl PrivateCluster {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// As [`PrivateCluster::start`], with server `settings` (`-c name=value`).
    pub async fn start_with(settings: &[(&str, &str)]) -> Self {
        let data = tempfile::Builder::new()
            .prefix("settlementd-private-")
            .tempdir()
            .unwrap();
        // The server runs as the postgres OS user when the tests run as root: let it in.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let dir = data.path().join("pgdata");
        let settings: Vec<(String, String)> = settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let pg = tokio::task::spawn_blocking(move || {
            let settings: Vec<(&str, &str)> = settings
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let options = EmbeddedOptions {
                data_dir: Some(dir),
                bindir: None,
            };
            EmbeddedPg::start_with(options, &settings)
        })
        .await
        .unwrap()
        .expect("start a private PostgreSQL");
        let url = create_database(&pg, "settle").await;
        let mut conn = PgConnection::connect(&url).await.unwrap();
        settlementd::db::migrate_connection(&mut conn)
            .await
            .unwrap();
        Self { pg, url, data }
    }

    /// A new, empty database `name` on this cluster; its superuser's URL.
    pub async fn database(&self, name: &str) -> String {
        create_database(&self.pg, name).await
    }

    /// A small pool on `settle` that gives up quickly while the server is down.
    pub async fn pool(&self) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(std::time::Duration::from_secs(2))
            .connect(&self.url)
            .await
            .unwrap()
    }
}

async fn create_database(pg: &EmbeddedPg, name: &str) -> String {
    let mut admin = PgConnection::connect(&pg.url("postgres")).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .unwrap();
    find_settlementd_first(&mut admin, name).await;
    pg.url(name)
}

/// The OS user and group the server runs as when the tests run as root (`postgres`), whose files
/// (a TLS key) it must own; `None` otherwise (the server runs as the tests do).
pub fn server_owner() -> Option<(u32, u32)> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    let line = passwd.lines().find(|l| l.starts_with("postgres:"))?;
    let fields: Vec<&str> = line.split(':').collect();
    Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?))
}

/// libraryd's `loans` as it makes it, on the empty database at `url`, and a connection of
/// libraryd's holding it in a long transaction that wrote it (ROW EXCLUSIVE until `ROLLBACK`):
/// what a migration that alters `loans` waits behind.
pub async fn loans_held_open(url: &str) -> sqlx::PgConnection {
    use sqlx::Connection as _;
    let mut libraryd = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::query(
        "CREATE TABLE public.loans (id bigint PRIMARY KEY, member_id bigint NOT NULL,
           book_id bigint NOT NULL, borrowed_on date NOT NULL, due_on date NOT NULL,
           returned_on date)",
    )
    .execute(&mut libraryd)
    .await
    .unwrap();
    sqlx::query("BEGIN").execute(&mut libraryd).await.unwrap();
    sqlx::query("LOCK TABLE public.loans IN ROW EXCLUSIVE MODE")
        .execute(&mut libraryd)
        .await
        .unwrap();
    libraryd
}

/// Polls `check` every 50 ms until it is true, for at most `secs` seconds; false if it never was.
pub async fn eventually<F, Fut>(secs: u64, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// A fresh database cloned from `template` (a test database whose pool is closed: PostgreSQL
/// copies a template only while nobody is connected to it).
pub async fn clone_of(template: &str) -> TestDb {
    let name = format!("c_{:016x}", rand::random::<u64>());
    create_from_template(&name, template).await;
    let url = url_for(&name);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    TestDb { name, url, pool }
}

/// `CREATE DATABASE name TEMPLATE template`, retried while someone else is on the template: a
/// sibling test cloning it right now, an autovacuum worker, or a pooled connection sqlx was still
/// handing back when its pool closed. After a few tries those sessions are ended (no test keeps
/// its own open on a template).
async fn create_from_template(name: &str, template: &str) {
    let mut admin = admin().await;
    for i in 0.. {
        match sqlx::query(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
            .execute(&mut admin)
            .await
        {
            Ok(_) => return find_settlementd_first(&mut admin, name).await,
            Err(e) if i < 50 && e.to_string().contains("being accessed") => {
                if i >= 3 {
                    sqlx::query(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                          WHERE datname = $1 AND pid <> pg_backend_pid()",
                    )
                    .bind(template)
                    .execute(&mut admin)
                    .await
                    .unwrap();
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await
            }
            Err(e) => panic!("create database {name} from {template}: {e}"),
        }
    }
}

/// Settings as the binary would load them, with `overrides` (`SECTION__KEY`, value) as
/// environment variables.
pub fn settings(overrides: &[(&str, &str)]) -> settlementd::config::Settings {
    let env = overrides
        .iter()
        .map(|(k, v)| (format!("SETTLEMENTD__{k}"), v.to_string()));
    let settings =
        settlementd::config::Settings::load_from(None, env).expect("valid test settings");
    settlementd::jobs::check(settings).expect("valid test job sections")
}

/// The cron of the fine settlement as `s` configure it (its section, `schedule.cron`, or its
/// default).
pub fn settlement_cron(s: &settlementd::config::Settings) -> croner::Cron {
    settlementd::jobs::build(s)
        .get(settlementd::jobs::fine_settlement::JOB_NAME)
        .expect("the registry has the fine settlement")
        .schedule()
        .cron
        .clone()
}

/// Instant of a wall-clock time in Shanghai (the default zone).
pub fn shanghai(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> chrono::DateTime<chrono::Utc> {
    use chrono::TimeZone;
    chrono_tz::Asia::Shanghai
        .with_ymd_and_hms(y, mo, d, h, mi, s)
        .unwrap()
        .with_timezone(&chrono::Utc)
}

/// The month `serve` settles right now on the real clock (default schedule).
pub fn due_month() -> BusinessDate {
    let s = settings(&[]);
    settlementd::schedule::Slot::new(
        settlementd::schedule::latest_slot_at_or_before(
            &settlement_cron(&s),
            s.schedule.timezone,
            chrono::Utc::now(),
        )
        .unwrap(),
    )
    .business_date
}

/// Drops a test database, disconnecting whoever is still on it.
pub async fn drop_db(db: TestDb) {
    db.pool.close().await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", db.name))
        .execute(&mut admin().await)
        .await
        .unwrap();
}

/// One batch of `plan` from `cursor` through the engine's own `run_batch`, in a transaction on
/// `conn` opened with `begin` (the job's `begin_batch`, or a variant of it), then committed or
/// rolled back. Without the claim: the fence is the runner's, not the job's.
pub async fn one_batch(
    conn: &mut PgConnection,
    job: &settlementd::jobs::fine_settlement::FineSettlement,
    plan: &settlementd::jobs::fine_settlement::MonthPlan,
    cursor: settlementd::job_layer::Cursor,
    begin: &str,
    commit: bool,
) -> settlementd::job_layer::Batch {
    use settlementd::job_layer::Job;
    let mut tx = conn.begin_with(begin.to_string()).await.unwrap();
    let batch = job.run_batch(&mut tx, plan, cursor).await.unwrap();
    match commit {
        true => tx.commit().await.unwrap(),
        false => tx.rollback().await.unwrap(),
    }
    batch
}

/// How many loans are settled, whatever the month.
pub async fn settled_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A TCP proxy in front of a test database whose connections can be made to stop answering, as a
/// half-open TCP connection does: [`FreezingProxy::freeze_existing`] makes every connection opened
/// so far swallow whatever either side sends, without closing anything; connections opened later
/// pass. Lives as long as the test's runtime.
pub struct FreezingProxy {
    pub addr: std::net::SocketAddr,
    /// The database URL with the proxy's address in place of the server's.
    proxied: url::Url,
    /// Connections numbered below this are frozen.
    frozen_below: std::sync::Arc<std::sync::atomic::AtomicU64>,
    opened: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl FreezingProxy {
    /// A proxy to the server of `url` (its Unix socket, or its TCP address).
    pub async fn start(url: &str) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::Arc;
        let options: sqlx::postgres::PgConnectOptions = url.parse().expect("a database URL");
        let target = match options.get_socket() {
            Some(dir) => Err(dir.join(format!(".s.PGSQL.{}", options.get_port()))),
            None => Ok(format!("{}:{}", options.get_host(), options.get_port())),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let frozen_below = Arc::new(AtomicU64::new(0));
        let opened = Arc::new(AtomicU64::new(0));
        let (frozen, count) = (frozen_below.clone(), opened.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let n = count.fetch_add(1, Ordering::SeqCst);
                match &target {
                    Err(path) => {
                        let server = tokio::net::UnixStream::connect(path).await.unwrap();
                        forward(client, server, n, &frozen);
                    }
                    Ok(host) => {
                        let server = tokio::net::TcpStream::connect(host).await.unwrap();
                        forward(client, server, n, &frozen);
                    }
                }
            }
        });
        let mut proxied = url::Url::parse(url).expect("a database URL");
        let query: Vec<(String, String)> = proxied
            .query_pairs()
            .filter(|(key, _)| key != "host" && key != "port")
            .map(|(key, value)| (key.into_owned(), value.into_owned()))
            .collect();
        proxied.set_query(None);
        if !query.is_empty() {
            proxied.query_pairs_mut().extend_pairs(query);
        }
        proxied.set_host(Some("127.0.0.1")).unwrap();
        proxied.set_port(Some(addr.port())).unwrap();
        Self {
            addr,
            proxied,
            frozen_below,
            opened,
        }
    }

    /// The database URL, through the proxy.
    pub fn url(&self) -> String {
        self.proxied.to_string()
    }

    /// From now on, every connection opened so far swallows what either side sends.
    pub fn freeze_existing(&self) {
        use std::sync::atomic::Ordering;
        let opened = self.opened.load(Ordering::SeqCst);
        self.frozen_below.store(opened, Ordering::SeqCst);
    }
}

/// Pipes `client` and `server` both ways, as connection number `connection`.
fn forward(
    client: tokio::net::TcpStream,
    server: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    connection: u64,
    frozen_below: &std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = tokio::io::split(server);
    tokio::spawn(pipe(
        client_read,
        server_write,
        connection,
        frozen_below.clone(),
    ));
    tokio::spawn(pipe(
        server_read,
        client_write,
        connection,
        frozen_below.clone(),
    ));
}

async fn pipe(
    mut from: impl tokio::io::AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
    connection: u64,
    frozen_below: std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(read) => read,
        };
        if connection < frozen_below.load(std::sync::atomic::Ordering::SeqCst) {
            // Half-open: nothing gets through any more, and nobody is told.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..read]).await.is_err() {
            return;
        }
    }
}

/// A claim of `key` as a first claim makes it (attempt 1, from the start), for tests that drive a
/// job's plan and batches themselves.
pub fn claim_of(key: &settlementd::job_layer::JobKey) -> settlementd::job_layer::Claim {
    settlementd::job_layer::Claim {
        month: key.month().expect("a month end"),
        key: key.clone(),
        attempt: 1,
        owner: settlementd::job_layer::Owner("test".into()),
        resume: settlementd::job_layer::Cursor::default(),
        took_over: false,
        reopened: false,
    }
}

/// `settlementd verify --json` of `month` with `env`: its exit code (0 right, 1 wrong, 6 the money
/// right and rows held) and its report.
pub fn verify(url: &str, env: &[(&str, &str)], month: &str) -> (Option<i32>, serde_json::Value) {
    let out = cli(url, env, &["verify", "--business-date", month, "--json"]);
    assert!(
        matches!(out.status.code(), Some(0 | 1 | 6)),
        "verify {month}: {:?} {}",
        out.status,
        stderr_of(&out)
    );
    (out.status.code(), json_of(&out))
}

/// `verify` says the month is right, exit 0.
pub fn assert_verified(url: &str, env: &[(&str, &str)], month: &str) {
    let (code, report) = verify(url, env, month);
    assert_eq!(
        (code, &report["right"]),
        (Some(0), &serde_json::json!(true)),
        "{month}: {report}"
    );
}

/// Every loan returned in `month`, by id: `(id, due_on, returned_on, fine_cents, settled)`.
pub async fn returns_of(
    pool: &PgPool,
    month: BusinessDate,
) -> Vec<(i64, chrono::NaiveDate, chrono::NaiveDate, i64, bool)> {
    sqlx::query_as(
        "SELECT id, due_on, returned_on, fine_cents, fine_settled_at IS NOT NULL FROM loans
          WHERE returned_on BETWEEN $1 AND $2 ORDER BY id",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Every loan returned in `month` is settled at the fine `rule` gives its dates, computed here.
pub async fn assert_priced_under(
    pool: &PgPool,
    month: BusinessDate,
    rule: settlementd::fine::FineRule,
) {
    let rows = returns_of(pool, month).await;
    assert!(!rows.is_empty());
    for (id, due, returned, fine, settled) in rows {
        assert!(settled, "loan {id} of {month} is not settled");
        assert_eq!(fine, rule.fine_cents(due, returned), "loan {id}");
    }
}

/// A statement-level trigger that makes every UPDATE of loans take `secs` longer, so a command's
/// batches can be caught mid-way (or killed there).
pub async fn slow_updates(pool: &PgPool, secs: f64) {
    for statement in [
        format!(
            "CREATE FUNCTION slow_down() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_sleep({secs}); RETURN NULL; END $$"
        ),
        "CREATE TRIGGER slow_down BEFORE UPDATE ON loans
           FOR EACH STATEMENT EXECUTE FUNCTION slow_down()"
            .to_string(),
    ] {
        sqlx::query(&statement).execute(pool).await.unwrap();
    }
}

/// Takes [`slow_updates`]' trigger away.
pub async fn no_slow_updates(pool: &PgPool) {
    sqlx::query("DROP TRIGGER slow_down ON loans")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("DROP FUNCTION slow_down()")
        .execute(pool)
        .await
        .unwrap();
}

/// One journal entry as two histories are compared: (loan, seq, kind, month, due_on,
/// returned_on, before, after, correction key). What may differ between a run under faults and a
/// clean one (attempt, time, which batch row holds it) is left out.
pub type JournalEntry = (
    i64,
    i32,
    String,
    chrono::NaiveDate,
    Option<chrono::NaiveDate>,
    Option<chrono::NaiveDate>,
    Option<i64>,
    i64,
    Option<String>,
);

/// Every journal entry, by loan and seq.
pub async fn journal_entries(pool: &PgPool) -> Vec<JournalEntry> {
    sqlx::query_as(
        "SELECT loan_id, seq, kind, month, due_on, returned_on, before_cents, after_cents,
                correction_key
           FROM fine_journal_entries ORDER BY loan_id, seq",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// How many journal entries of each kind, by kind.
pub async fn entries_by_kind(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT kind, count(*) FROM fine_journal_entries GROUP BY kind ORDER BY kind")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The journal on `chaos` is, entry for entry, the journal on `clean`: one entry per change, none
/// doubled by a retry, none lost. A difference names up to ten loans with both histories.
pub async fn assert_same_journal(chaos: &PgPool, clean: &PgPool) {
    let (mine, theirs) = (journal_entries(chaos).await, journal_entries(clean).await);
    if mine == theirs {
        return;
    }
    let by_loan = |entries: &[JournalEntry]| {
        let mut loans = std::collections::BTreeMap::<i64, Vec<JournalEntry>>::new();
        for e in entries {
            loans.entry(e.0).or_default().push(e.clone());
        }
        loans
    };
    let (mine_by_loan, theirs_by_loan) = (by_loan(&mine), by_loan(&theirs));
    let ids: std::collections::BTreeSet<i64> = mine_by_loan
        .keys()
        .chain(theirs_by_loan.keys())
        .copied()
        .collect();
    let differ: Vec<String> = ids
        .into_iter()
        .filter(|id| mine_by_loan.get(id) != theirs_by_loan.get(id))
        .map(|id| {
            format!(
                "loan {id}:\n  here  {:?}\n  clean {:?}",
                mine_by_loan.get(&id),
                theirs_by_loan.get(&id)
            )
        })
        .collect();
    panic!(
        "the journal differs from a clean run's for {} loans ({} entries here by kind {:?}, \
         {} there {:?}):\n{}",
        differ.len(),
        mine.len(),
        entries_by_kind(chaos).await,
        theirs.len(),
        entries_by_kind(clean).await,
        differ[..differ.len().min(10)].join("\n")
    );
}

/// A row trigger that makes every `events` (`UPDATE`, `INSERT OR UPDATE`) of a row of `table`
/// whose new values satisfy `when` fail, as a database error would.
pub async fn inject_failure(pool: &PgPool, events: &str, table: &str, when: &str) {
    for statement in [
        "CREATE OR REPLACE FUNCTION injected_failure() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'injected failure'; END $$"
            .to_string(),
        format!(
            "CREATE TRIGGER injected_failure BEFORE {events} ON {table} FOR EACH ROW
               WHEN ({when}) EXECUTE FUNCTION injected_failure()"
        ),
    ] {
        sqlx::query(&statement).execute(pool).await.unwrap();
    }
}

/// Drops [`inject_failure`]'s trigger on `table`.
pub async fn remove_failure(pool: &PgPool, table: &str) {
    sqlx::query(&format!("DROP TRIGGER injected_failure ON {table}"))
        .execute(pool)
        .await
        .unwrap();
}

/// The member statements of `month` as stored: (member, fines, cents), by member.
pub async fn statements_of(pool: &PgPool, month: BusinessDate) -> Vec<(i64, i64, i64)> {
    sqlx::query_as(
        "SELECT member_id, fines, fine_cents::bigint FROM member_fine_statements
          WHERE business_date = $1 ORDER BY member_id",
    )
    .bind(month.date())
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The replica of `job` for the shard of `s`, on a manual clock.
pub fn replica_of(
    pool: &PgPool,
    s: &settlementd::config::Settings,
    job: &str,
    clock: &settlementd::clock::ManualClock,
) -> settlementd::daemon::replica::Replica {
    let job = settlementd::jobs::build(s).get(job).unwrap().clone();
    settlementd::daemon::replica::Replica::for_job(
        pool.clone(),
        s,
        job,
        std::sync::Arc::new(clock.clone()),
        tokio_util::sync::CancellationToken::new(),
    )
}
