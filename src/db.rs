//! Connecting, and checking what is connected to. Migrations, embedded at compile time (see
//! build.rs), are applied by [`migrations`].
//!
//! Every pooled session gets server-side guards at connect ([`connect`]): a session idle inside a
//! transaction longer than the lease's guard is ended by the server, and TCP keepalives and
//! `client_connection_check_interval` let the server notice a client that vanished. These are
//! session settings, so settlementd refuses, at start, a pooler that shares server sessions
//! between client connections (transaction or statement pooling): there they would leak to other
//! clients, and sqlx's named prepared statements and the migrations' advisory lock break.
//!
//! TLS follows the URL's `sslmode` as libpq does ([`options`]). A certificate that does not verify, a
//! wrong host name or a server without TLS under `require` is a configuration error, like refused
//! credentials: no retry fixes it. A server that is down or full is not: the error carries the
//! server's own reason, and `serve` waits for it ([`check`]).
//!
//! Pooled connections unused for a quarter of a heartbeat are closed ([`idle_timeout`]), so a
//! replica between runs holds only the connection it listens on (docs/OPERATIONS.md,
//! "Connections").
//!
//! Nothing is written through a connection to a read-only server (a standby, or a primary with
//! `default_transaction_read_only`, as the old primary is during a failover): every connection is
//! checked when it is made (in the round trip of the session guards) and again each time the pool
//! hands it out ([`crate::job_layer::server`]); one to a read-only server is closed instead. A pool whose
//! endpoint leads only to a read-only server hands out nothing: [`connect`] says
//! [`DbError::ReadOnly`] (not a configuration error: a failover passes, and `serve` waits as for a
//! server that is down), and readiness asks [`writable`]. The pool says so once per change (the
//! server became read-only, it takes writes again), never at each connection it turns away.
//!
//! A command that only reads (`status`, `verify`, `jobs`, the dry runs) opens a pool of
//! [`Access::Read`] instead: it accepts a read-only server (a standby, where an operator looks
//! during an incident), and every one of its sessions is `default_transaction_read_only`, so the
//! server itself refuses any write through it.

pub mod migrations;
pub mod options;

use crate::job_layer::server::{self, Direct};
pub use migrations::{
    alters_loans, embedded, migrate, migrate_connection, schema_is_current, statements, Applied,
    LOANS_MIGRATIONS,
};

use crate::config::{redact_url, DatabaseSettings, SessionGuards};
use sqlx::postgres::{PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, Executor, PgConnection, PgPool, Row};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid database url '{url}': {reason}")]
    BadUrl { url: String, reason: String },
    #[error("cannot connect to the database at {url}: {source}{}", server_said(.reason))]
    Connect {
        url: String,
        source: sqlx::Error,
        /// What the server answered a direct attempt when the pool gave up waiting (too many
        /// connections, reserved slots, starting up): the pool's own error does not say.
        reason: Option<String>,
    },
    /// The server refused the credentials: a configuration mistake that no retry fixes.
    #[error(
        "cannot connect to the database at {url}: the server refused the credentials ({reason}); \
         check the user and the password of database.url, database.url_file or database.password_file"
    )]
    Auth { url: String, reason: String },
    /// pg_hba.conf has no line for this connection: which one is missing is in the server's
    /// message (often "no encryption": the server accepts only TLS).
    #[error("cannot connect to the database at {url}: the server refused the connection ({reason}); {hint}")]
    Hba {
        url: String,
        reason: String,
        hint: &'static str,
    },
    /// The database named in the URL does not exist on the server (a misspelt name, or one not
    /// created yet): no retry fixes it.
    #[error(
        "cannot connect to the database at {url}: {reason}; check the database name in \
         database.url, or create the database (createdb) and run `settlementd migrate`"
    )]
    NoDatabase { url: String, reason: String },
    /// TLS as the URL asks for it cannot be had: the server's certificate does not verify, names
    /// another host, or the server offers no TLS.
    #[error("cannot connect to the database at {url} with sslmode={mode}: {reason}")]
    Tls {
        url: String,
        mode: &'static str,
        reason: String,
    },
    /// Two client connections shared one server session: a pooler in transaction mode.
    #[error(
        "database.url {url} leads to a connection pooler in transaction or statement pooling mode \
         (two of settlementd's connections were served by one server session): settlementd needs \
         session pooling; set pool_mode = session for its database in pgbouncer.ini, or connect \
         directly"
    )]
    TransactionPooler { url: String },
    /// The endpoint leads to a read-only server: a standby (in recovery), or a primary with
    /// `default_transaction_read_only = on` (the old primary during a failover). It passes when
    /// the endpoint leads to the writer again; `serve` waits for that.
    #[error("the database at {url} is read-only ({READ_ONLY}): settlementd writes nothing through it; give it the primary's (writer) endpoint, or wait for a failover to finish")]
    ReadOnly { url: String },
    /// A column of an existing `loans` table is not of a type settlementd can read or write.
    #[error("loans does not fit settlementd: {0}; nothing was written")]
    Schema(String),
    /// The role may not read or write what it needs: a grant is missing (no restart fixes it).
    #[error("{0}")]
    Privilege(String),
    /// A step of `migrate` waited longer than [`migrations::LOCK_WAIT_SECS`] for a table another
    /// session holds (a long transaction of libraryd's on `loans`, a run's on settlementd's
    /// tables): it was rolled back whole, and the steps before it stay done. `step` says which, as
    /// "migration 20261130000002 was not applied".
    #[error(
        "{step}: it waited more than {} s for a lock ({reason}) that another session's \
         transaction holds, on libraryd's loans or one of settlementd's tables; the migrations \
         before it are applied. Run `settlementd migrate` again when that transaction has ended \
         (pg_stat_activity shows it), outside the settlement window",
        migrations::LOCK_WAIT_SECS
    )]
    LockWait { step: String, reason: String },
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Query(#[from] sqlx::Error),
}

/// What makes a server read-only, in the words of [`DbError::ReadOnly`].
const READ_ONLY: &str = "a standby, or default_transaction_read_only";

fn server_said(reason: &Option<String>) -> String {
    reason
        .as_ref()
        .map(|r| format!(" (the server said: {r})"))
        .unwrap_or_default()
}

impl DbError {
    /// Configuration mistakes (exit 2) versus failures that may pass (exit 1).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            DbError::BadUrl { .. }
                | DbError::Auth { .. }
                | DbError::Hba { .. }
                | DbError::NoDatabase { .. }
                | DbError::Tls { .. }
                | DbError::TransactionPooler { .. }
                | DbError::Schema(_)
                | DbError::Privilege(_)
        )
    }
}

pub type Result<T, E = DbError> = std::result::Result<T, E>;

/// The schema everything of settlementd's lives in (its tables, views, functions and migration
/// ledgers), owned by the migration role, where no other role may create (migration
/// 20261210000001, docs/DESIGN.md "A schema of its own"). libraryd's `loans` stays in `public`.
pub const SCHEMA: &str = "settlementd";

/// Every session of settlementd's finds its own objects first, then libraryd's `loans` in
/// `public`: set on each pooled connection when it is made ([`pool`]) and on the connection that
/// migrates ([`migrate_connection`]), so nothing depends on a role's or a database's default
/// path. A session setting, as the guards are (a transaction-pooling pooler is refused).
pub const SEARCH_PATH_SQL: &str = "SELECT set_config('search_path', 'settlementd, public', false)";

/// The path settlementd's own reads of the catalog run with ([`catalog_only`]): PostgreSQL's names
/// alone, then the session's temporary schema (never searched for functions or operators).
pub const CATALOG_PATH_SQL: &str = "SELECT set_config('search_path', 'pg_catalog, pg_temp', true)";

/// A transaction on `conn` (a savepoint when `conn` is in one already) whose path is
/// [`CATALOG_PATH_SQL`], for settlementd's reads of the catalog: what `/readyz`, `verify` and
/// `migrate` decide from them must be PostgreSQL's answer, and nothing of libraryd's may run
/// with the reader's rights. [`SEARCH_PATH_SQL`] puts `public` on every session's path (where
/// `loans` is), and libraryd, which owns `public`, may create functions and operators there that
/// PostgreSQL picks over its own wherever their argument types fit better (`public."="(oid,
/// regclass)` over `oid = oid` for `c.oid = to_regclass(…)`). Roll it back when done: the path
/// is the session's again.
pub async fn catalog_only(
    conn: &mut PgConnection,
) -> sqlx::Result<sqlx::Transaction<'_, sqlx::Postgres>> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    tx.execute(CATALOG_PATH_SQL).await?;
    Ok(tx)
}

/// How long a pooled connection may sit unused before it is closed: a quarter of a heartbeat (the
/// replica's tick period), between 0.25 and 15 s. The pool hands out its idle connections in
/// turn, and sqlx closes idle ones on a pass every timeout (so one lives one to two timeouts
/// unused): with a longer timeout an idle replica's two job ticks and its liveness report, a
/// heartbeat apart each but at different offsets, would keep a pooled connection alive for good
/// (half a heartbeat did, docs/OPERATIONS.md "Connections"); with this one, a replica between runs
/// holds only its LISTEN connection, and opens one for each tick or probe.
pub fn idle_timeout(heartbeat: Duration) -> Duration {
    (heartbeat / 4).clamp(Duration::from_millis(250), Duration::from_secs(15))
}

/// What a pool's connections are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Reads and writes: nothing goes through a connection to a read-only server (module header).
    Write,
    /// Reads only: a read-only server is accepted, and every session is
    /// `default_transaction_read_only`, so the server refuses any write through it (SQLSTATE
    /// 25006). For the commands that only read: `status`, `verify`, `jobs`, the dry runs.
    Read,
}

/// A pool on `url` that fails within `acquire_timeout_secs` when the database is unreachable, whose
/// sessions carry `guards` (see the module header), after [`check`]: refuses a
/// transaction-pooling pooler, wrong credentials and TLS that does not verify. A pool for writing
/// ([`Access::Write`]): a read-only server is [`DbError::ReadOnly`], said as soon as the first
/// connection finds it.
pub async fn connect(
    url: &str,
    settings: &DatabaseSettings,
    guards: SessionGuards,
    heartbeat: Duration,
) -> Result<PgPool> {
    connect_for(Access::Write, url, settings, guards, heartbeat).await
}

/// [`connect`] for `access`: with [`Access::Read`], a read-only server is connected to.
pub async fn connect_for(
    access: Access,
    url: &str,
    settings: &DatabaseSettings,
    guards: SessionGuards,
    heartbeat: Duration,
) -> Result<PgPool> {
    let (pool, server) = build(access, url, settings, guards, heartbeat)?;
    let mut read_only = server.subscribe();
    // A writer's pool turns away every connection to a read-only server and tries again until its
    // acquire timeout; the first one it turns away says enough.
    let turned_away = async {
        match read_only.wait_for(|seen| *seen == Seen::ReadOnly).await {
            Ok(_) => DbError::ReadOnly {
                url: redact_url(url),
            },
            // The pool is gone: never, while `check` runs on it.
            Err(_) => std::future::pending().await,
        }
    };
    let checked = tokio::select! {
        checked = check(&pool, url) => checked,
        e = turned_away => Err(e),
    };
    match checked {
        Ok(()) => Ok(pool),
        Err(e) => {
            pool.close().await;
            Err(e)
        }
    }
}

/// The pool of [`connect`] without connecting: only the URL is checked (its form, and the files
/// its TLS parameters name). `serve` starts with it, so it can answer probes while the database is
/// not there yet.
pub fn pool(
    url: &str,
    settings: &DatabaseSettings,
    guards: SessionGuards,
    heartbeat: Duration,
) -> Result<PgPool> {
    Ok(build(Access::Write, url, settings, guards, heartbeat)?.0)
}

/// The pool of [`pool`] for `access`, and what its hooks find of the server ([`Server`]).
fn build(
    access: Access,
    url: &str,
    settings: &DatabaseSettings,
    guards: SessionGuards,
    heartbeat: Duration,
) -> Result<(PgPool, Arc<Server>)> {
    let connect = options::connect_options(url).map_err(|reason| DbError::BadUrl {
        url: redact_url(url),
        reason,
    })?;
    let connect = connect
        .application_name("settlementd")
        // Not sent at start-up: PgBouncer refuses start-up parameters it does not know
        // ("unsupported startup parameter: extra_float_digits"), and every value settlementd
        // reads is binary or an integer.
        .extra_float_digits(None)
        // Logged as one line naming the statement (the logging set up by the app), never its SQL.
        .log_slow_statements(
            log::LevelFilter::Warn,
            Duration::from_millis(settings.slow_statement_ms),
        );
    let server = Arc::new(Server::new(shown(&connect)));
    let options = PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .min_connections(0)
        .idle_timeout(Some(idle_timeout(heartbeat)))
        .acquire_timeout(Duration::from_secs(settings.acquire_timeout_secs));
    let guards = session_guards_sql(guards);
    let pool = match access {
        Access::Read => {
            // The schema path, the session guards, and no write: one round trip, a simple query.
            let session = format!("{SEARCH_PATH_SQL}; {guards}; {READ_ONLY_SESSION_SQL}");
            options
                .after_connect(move |conn, _meta| {
                    let sql = session.clone();
                    Box::pin(async move {
                        conn.execute(sql.as_str()).await?;
                        Ok(())
                    })
                })
                .connect_lazy_with(connect)
        }
        Access::Write => {
            // The schema path, the session guards and the read-only check in one round trip; a
            // plain string runs as a simple query, so no prepared statement is left behind.
            let session = format!("{SEARCH_PATH_SQL}; {guards}; {}", server::READ_ONLY_SQL);
            let (at_connect, at_hand_out) = (server.clone(), server.clone());
            options
                .after_connect(move |conn, _meta| {
                    let sql = session.clone();
                    let server = at_connect.clone();
                    Box::pin(async move {
                        // The guards' rows, then the check's one row.
                        let rows = conn.fetch_all(sql.as_str()).await?;
                        let read_only = rows
                            .last()
                            .map(|row| row.try_get::<bool, _>(0))
                            .transpose()?;
                        server.found(read_only != Some(false));
                        match read_only {
                            Some(false) => Ok(()),
                            _ => Err(read_only_refused()),
                        }
                    })
                })
                // The check at hand-out replaces sqlx's ping (it is one round trip as well): a
                // connection whose server became read-only since (a reload of
                // default_transaction_read_only, a demoted primary) is closed, and the pool opens
                // another through the endpoint.
                .test_before_acquire(false)
                .before_acquire(move |conn, _meta| {
                    let server = at_hand_out.clone();
                    Box::pin(async move {
                        let read_only = server::is_read_only(conn).await?;
                        server.found(read_only);
                        Ok(!read_only)
                    })
                })
                .connect_lazy_with(connect)
        }
    };
    Ok((pool, server))
}

/// What every session of an [`Access::Read`] pool starts with: no transaction of it writes.
const READ_ONLY_SESSION_SQL: &str =
    "SELECT set_config('default_transaction_read_only', 'on', false)";

/// What the hooks of a writer's pool last found behind its endpoint. A change is logged once (the
/// server became read-only; it takes writes again), where sqlx would log each connection the pool
/// turns away, up to hundreds a minute while it tries again until its acquire timeout (its own
/// line is hidden: [`is_sqlx_hook_failure`]). The first finding is not logged: what it means is
/// the caller's to say ([`connect`]: one error; `serve`: not ready, with the reason).
struct Server {
    /// Where the endpoint leads, for the log: host, port and database, never the password.
    at: String,
    seen: watch::Sender<Seen>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Nothing,
    Writable,
    ReadOnly,
}

impl Server {
    fn new(at: String) -> Self {
        Self {
            at,
            seen: watch::Sender::new(Seen::Nothing),
        }
    }

    fn subscribe(&self) -> watch::Receiver<Seen> {
        self.seen.subscribe()
    }

    /// A connection found the server `read_only` or not.
    fn found(&self, read_only: bool) {
        let now = if read_only {
            Seen::ReadOnly
        } else {
            Seen::Writable
        };
        let mut was = Seen::Nothing;
        self.seen.send_if_modified(|seen| {
            was = std::mem::replace(seen, now);
            was != now
        });
        match (was, now) {
            (Seen::Writable, Seen::ReadOnly) => tracing::warn!(
                database = %self.at,
                "the database became read-only ({READ_ONLY}): settlementd writes nothing through \
                 it, and turns its connections away until it takes writes again (said once, not \
                 at each connection)"
            ),
            (Seen::ReadOnly, Seen::Writable) => {
                tracing::info!(database = %self.at, "the database takes writes again")
            }
            _ => {}
        }
    }
}

/// Whether `meta` is sqlx's line for an `after_connect` hook that failed: for a writer's pool,
/// one per connection it turns away from a read-only server (each attempt until its acquire
/// timeout). [`Server`] says the same once per change; the logging of the app hides these.
pub fn is_sqlx_hook_failure(meta: &tracing::Metadata<'_>) -> bool {
    meta.target().starts_with("sqlx_core::pool")
        && *meta.level() == tracing::Level::ERROR
        && meta.fields().field("error").is_some()
}

/// The error `after_connect` returns for a connection to a read-only server: the pool closes the
/// connection and tries again until its acquire timeout.
fn read_only_refused() -> sqlx::Error {
    sqlx::Error::InvalidArgument(format!(
        "the server is read-only ({READ_ONLY}): settlementd closed the connection"
    ))
}

/// For readiness: `Ok` when the server behind `pool` takes writes, [`DbError::ReadOnly`] when it
/// is read-only. A connection the pool hands out was checked at hand-out; when it has none to give
/// within [`WRITABLE_WITHIN`] (it turns away every connection to a read-only server, until its
/// acquire timeout), one direct connection asks the server.
pub async fn writable(pool: &PgPool) -> Result<()> {
    if let Ok(Ok(_conn)) = tokio::time::timeout(WRITABLE_WITHIN, pool.acquire()).await {
        return Ok(());
    }
    match server::ask_directly(pool).await {
        Direct::Writable | Direct::Silent => Ok(()),
        Direct::ReadOnly => Err(DbError::ReadOnly {
            url: shown(&pool.connect_options()),
        }),
        Direct::Failed(e) => Err(DbError::Query(e)),
    }
}

/// How long [`writable`] waits for one of the pool's connections before it asks the server
/// directly: within readiness's own 2 s.
const WRITABLE_WITHIN: Duration = Duration::from_secs(1);

/// Where `options` lead, for a message: host (or socket directory), port, database; never the
/// password.
fn shown(options: &sqlx::postgres::PgConnectOptions) -> String {
    let host = match options.get_socket() {
        Some(dir) => dir.display().to_string(),
        None => options.get_host().to_string(),
    };
    let database = options.get_database().unwrap_or("");
    format!("{host}:{}/{database}", options.get_port())
}

/// Connects two of `pool`'s connections and checks that they are two server sessions (no
/// transaction-pooling pooler). `url` is only for messages (redacted).
pub async fn check(pool: &PgPool, url: &str) -> Result<()> {
    let timeout = pool.options().get_acquire_timeout();
    // The check uses two of the pool's own connections (a run needs two anyway: batches and the
    // heartbeat), so it costs a few round trips, not two more connections. Both connect at once
    // (`connect_with` would open the first alone); a connection error is the same either way.
    let shared = tokio::time::timeout(timeout, async {
        let (mut a, mut b) = tokio::try_join!(pool.acquire(), pool.acquire())?;
        sessions_are_shared(&mut a, &mut b).await
    })
    .await;
    match shared {
        Ok(Ok(false)) => {
            // sqlx returns a released connection to the pool after a ping, in a task of its own;
            // a claim made before both are back would open a third connection (3 ms).
            let start = std::time::Instant::now();
            while pool.num_idle() < 2 && start.elapsed() < Duration::from_millis(100) {
                pause(start).await;
            }
            Ok(())
        }
        Ok(Ok(true)) => Err(DbError::TransactionPooler {
            url: redact_url(url),
        }),
        Ok(Err(e)) => Err(connect_error(pool, url, e).await),
        Err(_) => Err(connect_error(pool, url, sqlx::Error::PoolTimedOut).await),
    }
}

/// `source` as the error an operator can act on. When the pool only says it gave up waiting, one
/// direct attempt asks the server why (too many connections, slots reserved, starting up, or
/// read-only: the pool turns those connections away).
async fn connect_error(pool: &PgPool, url: &str, source: sqlx::Error) -> DbError {
    let source = match source {
        sqlx::Error::PoolTimedOut => match server::ask_directly(pool).await {
            Direct::Failed(e) => e,
            Direct::ReadOnly => {
                return DbError::ReadOnly {
                    url: redact_url(url),
                }
            }
            Direct::Writable | Direct::Silent => sqlx::Error::PoolTimedOut,
        },
        other => other,
    };
    classify(url, pool.connect_options().get_ssl_mode(), source)
}

fn classify(url: &str, mode: PgSslMode, source: sqlx::Error) -> DbError {
    let url_shown = redact_url(url);
    let tls = |reason: String| DbError::Tls {
        url: url_shown.clone(),
        mode: options::mode_name(mode),
        reason,
    };
    match &source {
        // 28P01 invalid_password; 28000 invalid_authorization_specification: a role that does not
        // exist, or no pg_hba.conf line for the connection.
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("28P01" | "28000")) => {
            let reason = db.message().to_string();
            if reason.contains("pg_hba.conf") {
                let hint = if reason.contains("no encryption") || reason.contains("SSL off") {
                    "the server accepts this user only over TLS: set sslmode=verify-full (with \
                     sslrootcert) or sslmode=require in the URL"
                } else {
                    "the server's pg_hba.conf has no line for this host, user, database and \
                     encryption: ask its administrator, or check the host and the sslmode"
                };
                DbError::Hba {
                    url: url_shown,
                    reason,
                    hint,
                }
            } else {
                DbError::Auth {
                    url: url_shown,
                    reason,
                }
            }
        }
        // 3D000 invalid_catalog_name: the database does not exist.
        sqlx::Error::Database(db) if db.code().as_deref() == Some("3D000") => DbError::NoDatabase {
            url: url_shown,
            reason: db.message().to_string(),
        },
        // sqlx's word when the server answers the TLS request with "no".
        sqlx::Error::Tls(e) if e.to_string().contains("does not support TLS") => tls(
            "the server does not offer TLS (it answered the TLS request with no): enable ssl on the \
             server, or lower sslmode (prefer takes TLS when offered)"
                .into(),
        ),
        sqlx::Error::Tls(e) => tls(format!("TLS failed: {e}")),
        sqlx::Error::Io(io) => match io.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
            Some(e) => tls(tls_verdict(e)),
            None => connect_failed(url_shown, source, None),
        },
        sqlx::Error::Database(db) => {
            let reason = Some(db.message().to_string());
            connect_failed(url_shown, source, reason)
        }
        _ => connect_failed(url_shown, source, None),
    }
}

fn connect_failed(url: String, source: sqlx::Error, reason: Option<String>) -> DbError {
    // A database error already carries the server's message; say it once.
    let reason = reason.filter(|_| !matches!(source, sqlx::Error::Database(_)));
    DbError::Connect {
        url,
        source,
        reason,
    }
}

/// What a TLS handshake's refusal means, in words.
fn tls_verdict(e: &rustls::Error) -> String {
    use rustls::CertificateError as C;
    match e {
        rustls::Error::InvalidCertificate(
            C::NotValidForName | C::NotValidForNameContext { .. },
        ) => {
            "the server's certificate is not valid for this host name (verify-full checks it, and \
             so does verify-ca here): connect by a name the certificate lists"
                .into()
        }
        rustls::Error::InvalidCertificate(C::UnknownIssuer) => {
            "the server's certificate was not signed by a trusted CA: sslrootcert must hold the \
             CA that signed it (for a managed service, the provider's CA bundle)"
                .into()
        }
        rustls::Error::InvalidCertificate(other) => {
            format!("the server's certificate does not verify: {other:?}")
        }
        rustls::Error::AlertReceived(alert) => {
            format!("the server ended the TLS handshake ({alert:?}): check sslcert and sslkey")
        }
        other => format!("the TLS handshake failed: {other}"),
    }
}
/// The session settings every pooled connection starts with: `set_config` of those the server
/// knows (`client_connection_check_interval` is PostgreSQL 14+), one statement, simple protocol.
/// The keepalives only apply to TCP connections (a Unix socket ignores them). Whether the server
/// knows a setting is asked with `current_setting(name, true)`: filtering on `pg_settings`
/// instead builds every setting's row and cost 2–4 ms per connection, 0.2 ms this way.
pub fn session_guards_sql(guards: SessionGuards) -> String {
    let idle_ms = guards.idle_in_transaction.as_millis();
    let idle_s = guards.idle_in_transaction.as_secs().max(1);
    format!(
        "SELECT set_config(v.name, v.setting, false)
           FROM (VALUES ('idle_in_transaction_session_timeout', '{idle_ms}'),
                        ('client_connection_check_interval', '{idle_ms}'),
                        ('tcp_keepalives_idle', '{idle_s}'),
                        ('tcp_keepalives_interval', '{}'),
                        ('tcp_keepalives_count', '3')) AS v(name, setting)
          WHERE current_setting(v.name, true) IS NOT NULL",
        (idle_s / 3).max(1)
    )
}

/// True when two client connections of ours are served by one server session, as behind a pooler
/// in transaction (or statement) mode; never on a direct connection or in session pooling, where a
/// client connection keeps its backend. Simple-protocol statements only, so the check itself is
/// safe through any pooler, and nothing is written.
///
/// `a` holds a transaction (pinning a server session) while `b` asks for its backend pid, then `a`
/// commits and `b` asks again. Directly, `b` sees its own backend twice and never `a`'s. Behind
/// PgBouncer's transaction mode, `b` is served by whatever session is free: `a`'s once `a`
/// commits (PgBouncer reuses the most recently used one), or `a`'s from the start when the pool
/// has one session (then `b` waits for `a`'s commit, which is why `a` does not wait for `b`).
async fn sessions_are_shared(a: &mut PgConnection, b: &mut PgConnection) -> sqlx::Result<bool> {
    a.execute("BEGIN").await?;
    let pid_a = backend_pid(a).await?;
    let pid_b1 = {
        let first_b = backend_pid(&mut *b);
        tokio::pin!(first_b);
        match tokio::time::timeout(Duration::from_millis(200), &mut first_b).await {
            Ok(pid) => {
                a.execute("COMMIT").await?;
                pid?
            }
            Err(_) => {
                a.execute("COMMIT").await?;
                first_b.await?
            }
        }
    };
    let pid_b2 = backend_pid(b).await?;
    Ok(pid_a == pid_b1 || pid_a == pid_b2 || pid_b1 != pid_b2)
}

async fn backend_pid(conn: &mut PgConnection) -> sqlx::Result<i32> {
    conn.fetch_one("SELECT pg_backend_pid()").await?.try_get(0)
}

/// Closes `pool` until it is really empty (at most 2 s). `PgPool::close` can return while a
/// connection released a moment earlier is still on its way back (sqlx pings it first); stopping an
/// embedded server right then turns that ping into a logged warning.
///
/// Bounded: sqlx's `close` waits until every permit of the pool is back, and a permit lost on
/// the way (an acquire cancelled while it connected to a server refusing connections, "remaining
/// connection slots are reserved") made `status` wait for ever with no connection left open. A
/// process that closes its pool is ending: after [`CLOSE_WITHIN`] it goes on, and its sockets
/// close with it.
pub async fn close(pool: &PgPool) {
    let start = std::time::Instant::now();
    let left = || CLOSE_WITHIN.saturating_sub(start.elapsed());
    let _ = tokio::time::timeout(left(), pool.close()).await;
    while pool.size() > 0 && start.elapsed() < CLOSE_WITHIN {
        pause(start).await;
        let _ = tokio::time::timeout(left(), pool.close()).await;
    }
}

/// How long [`close`] waits for a pool's connections to close.
pub const CLOSE_WITHIN: Duration = Duration::from_secs(2);

/// One step of a short wait that began at `start`. What is waited for (a connection on its way
/// back to the pool: one round trip) takes a fraction of a millisecond, less than the timer's
/// resolution, so the first 2 ms only yield; after that, a millisecond per step.
async fn pause(start: std::time::Instant) {
    if start.elapsed() < Duration::from_millis(2) {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Checks the columns of `loans` that settlementd reads and writes, when the table exists (a new
/// database gets it from the migrations): `borrowed_on`, `due_on` and `returned_on` are `date` (a
/// domain over `date` too; `due_on` may be nullable: such loans are held), `id` an integer type,
/// and `fine_cents`, where it exists, `bigint` — or a narrower integer that `max_fine` (the
/// configuration's highest cap) fits. Run before migrating and before any run, so a table of
/// another shape is refused in one line before anything is written, instead of failing in a
/// migration ("functions in index expression must be marked IMMUTABLE") or in a batch ("integer
/// out of range") with its rows left unsettled.
pub async fn check_loans(pool: &PgPool, max_fine: i64) -> Result<()> {
    let mut conn = pool.acquire().await?;
    let mut tx = catalog_only(&mut conn).await?;
    let columns: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), b.typname::text
           FROM pg_attribute a
           JOIN pg_type t ON t.oid = a.atttypid
           JOIN pg_type b ON b.oid = CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END
          WHERE a.attrelid = to_regclass('public.loans') AND a.attnum > 0 AND NOT a.attisdropped
            AND a.attname IN ('id', 'member_id', 'borrowed_on', 'due_on', 'returned_on',
                              'fine_cents')",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.rollback().await?;
    // No such column at all: no table yet (the migrations create it; another process may be doing
    // so right now).
    if columns.is_empty() {
        return Ok(());
    }
    loans_fit(&columns, max_fine).map_err(DbError::Schema)
}

/// [`check_loans`] on `(column, type as written, base type name)` rows.
fn loans_fit(
    columns: &[(String, String, String)],
    max_fine: i64,
) -> std::result::Result<(), String> {
    let find = |name: &str| columns.iter().find(|c| c.0 == name);
    for name in ["id", "member_id", "borrowed_on", "due_on", "returned_on"] {
        if find(name).is_none() {
            return Err(format!("it has no column {name}"));
        }
    }
    for (name, found, base) in columns {
        let needed = match name.as_str() {
            "id" | "member_id" if matches!(base.as_str(), "int2" | "int4" | "int8") => continue,
            "id" | "member_id" => "an integer type (bigint, integer or smallint)",
            "borrowed_on" | "due_on" | "returned_on" if base == "date" => continue,
            "borrowed_on" | "due_on" | "returned_on" => "date",
            "fine_cents" => {
                let fits = match base.as_str() {
                    "int8" => continue,
                    "int4" => i64::from(i32::MAX),
                    "int2" => i64::from(i16::MAX),
                    _ => return Err(format!("column fine_cents is {found}; it must be bigint")),
                };
                if max_fine <= fits {
                    continue;
                }
                return Err(format!(
                    "column fine_cents is {found}, which holds at most {fits}, but the configured \
                     cap fine.max_cents is {max_fine}: make the column bigint (ALTER TABLE loans \
                     ALTER COLUMN fine_cents TYPE bigint) or lower the cap"
                ));
            }
            _ => continue,
        };
        return Err(format!("column {name} is {found}; it must be {needed}"));
    }
    Ok(())
}

/// What stands between libraryd and settlementd's record, as the catalog shows it now: each
/// `SECURITY DEFINER` function of settlementd's owned by a superuser (it would run anything a
/// planted object makes it run with a superuser's rights), and each of settlementd's triggers on
/// `loans` that is missing, not enabled `ALWAYS`, or not the trigger `migrate` created (libraryd
/// owns `loans` and may always disable or drop them: then its edits of settled loans are not
/// queued, and the record goes stale). Read by `/readyz` (a reason of its own for each), the
/// `settlementd_loans_triggers_tampered` gauge and `verify`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Guards {
    /// "function f() of settlementd's is owned by superuser s".
    pub superuser_definers: Vec<String>,
    /// "settlementd_settled_deleted is disabled", "… is missing", "… was changed: …".
    pub loans_triggers: Vec<String>,
}

impl Guards {
    pub fn intact(&self) -> bool {
        self.superuser_definers.is_empty() && self.loans_triggers.is_empty()
    }
}

/// See [`Guards`]. Reads the catalog and `settlementd.loans_triggers` (what `migrate` left), with
/// PostgreSQL's names alone on the path ([`catalog_only`]): call it once the schema is current.
pub async fn guards(conn: &mut PgConnection) -> Result<Guards> {
    let mut tx = catalog_only(conn).await?;
    let superuser_definers: Vec<String> = sqlx::query_scalar(migrations::SUPERUSER_DEFINERS)
        .fetch_all(&mut *tx)
        .await?;
    let loans_triggers: Vec<String> = sqlx::query_scalar(
        "SELECT e.name || CASE
                    WHEN t.oid IS NULL THEN ' is missing on loans'
                    WHEN t.tgenabled = 'D' THEN ' is disabled'
                    WHEN t.tgenabled <> 'A' THEN
                        ' fires only in ' || CASE t.tgenabled WHEN 'R' THEN 'replica' ELSE 'origin' END
                        || ' sessions (it must be ENABLE ALWAYS)'
                    ELSE ' is not the trigger settlementd created: '
                         || settlementd.trigger_definition(t.oid)
                END
           FROM settlementd.loans_triggers e
           LEFT JOIN pg_trigger t ON t.tgrelid = to_regclass('public.loans') AND t.tgname = e.name
          WHERE t.oid IS NULL OR t.tgenabled <> 'A'
             OR settlementd.trigger_definition(t.oid) <> e.definition
          ORDER BY e.name",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.rollback().await?;
    Ok(Guards {
        superuser_definers,
        loans_triggers,
    })
}

/// Waits until every migration is applied (checking every `every`) or `shutdown`, for a replica
/// that must not migrate by itself (`database.migrate_on_start = false`). Says so in one warning,
/// not once per check: the replica is not ready meanwhile (`/readyz` 503), it does not crash-loop,
/// and it starts by itself once `settlementd migrate` has run. Returns false on shutdown.
pub async fn wait_for_schema(pool: &PgPool, every: Duration, shutdown: &CancellationToken) -> bool {
    let mut warned = false;
    loop {
        match schema_is_current(pool).await {
            Ok(true) => {
                if warned {
                    tracing::info!("database schema is current; starting");
                }
                return true;
            }
            Ok(false) if !warned => {
                tracing::warn!(
                    "database schema is not current (a migration of this binary is missing) and \
                     database.migrate_on_start = false: not ready, waiting for `settlementd migrate`"
                );
                warned = true;
            }
            Ok(false) => {}
            Err(e) => tracing::debug!(error = %e, "cannot check the schema yet"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return false,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::loans_fit;

    fn columns(list: &[(&str, &str, &str)]) -> Vec<(String, String, String)> {
        list.iter()
            .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
            .collect()
    }

    /// The columns every test table has besides `id` and `fine_cents`.
    const DATES: [(&str, &str, &str); 4] = [
        ("member_id", "bigint", "int8"),
        ("borrowed_on", "date", "date"),
        ("due_on", "date", "date"),
        ("returned_on", "date", "date"),
    ];

    #[test]
    fn a_loans_table_of_settlementds_shape_fits() {
        let mut ok = columns(&DATES);
        ok.extend(columns(&[
            ("id", "bigint", "int8"),
            ("fine_cents", "bigint", "int8"),
        ]));
        assert_eq!(loans_fit(&ok, i64::MAX), Ok(()));
    }

    #[test]
    fn each_mismatch_names_the_column_the_type_found_and_the_type_needed() {
        type Column<'a> = (&'a str, &'a str, &'a str);
        let cases: &[(&[Column], i64, &str)] = &[
            (
                &[("returned_on", "timestamp with time zone", "timestamptz")],
                0,
                "column returned_on is timestamp with time zone; it must be date",
            ),
            (
                &[("id", "numeric", "numeric")],
                0,
                "column id is numeric; it must be an integer type",
            ),
            (
                &[("fine_cents", "integer", "int4")],
                3_000_000_000,
                "column fine_cents is integer, which holds at most 2147483647, but the configured cap fine.max_cents is 3000000000",
            ),
            (
                &[("fine_cents", "numeric(12,2)", "numeric")],
                0,
                "column fine_cents is numeric(12,2); it must be bigint",
            ),
        ];
        for (replace, cap, needle) in cases {
            let mut table = columns(&DATES);
            table.push(("id".into(), "bigint".into(), "int8".into()));
            for (name, found, base) in replace.iter() {
                table.retain(|c| c.0 != *name);
                table.push((name.to_string(), found.to_string(), base.to_string()));
            }
            let err = loans_fit(&table, *cap).unwrap_err();
            assert!(err.contains(needle), "{err}");
        }
        let mut narrow = columns(&DATES);
        narrow.extend(columns(&[
            ("id", "integer", "int4"),
            ("fine_cents", "integer", "int4"),
        ]));
        assert_eq!(loans_fit(&narrow, 10_000), Ok(()), "a cap that fits");
        let mut no_returns = columns(&DATES[..3]);
        no_returns.push(("id".into(), "bigint".into(), "int8".into()));
        assert!(loans_fit(&no_returns, 0)
            .unwrap_err()
            .contains("no column returned_on"));
    }
}
