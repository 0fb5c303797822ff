//! The server behind a connection: whether it takes writes, and what a refusal of them means.
//!
//! sqlx has no multi-host URLs or `target_session_attrs`, so settlementd follows whatever its one
//! endpoint leads to (a managed cluster's writer endpoint, a Kubernetes Service, a VIP, PgBouncer).
//! During and after a failover that may be the old primary, now a standby or read-only, and a pooled
//! connection may still be open to it. Invariant: nothing is written through a connection to a
//! read-only server. `db.rs` checks every connection with [`READ_ONLY_SQL`] when it is made and
//! when the pool hands it out; a refusal met mid-run ([`refusal`]: SQLSTATE 25006, or the server
//! shutting down, 57P01–57P03) ends the run like a lost lease
//! ([`super::JobError::WritesRefused`]): its connection is closed, never handed out again, and the
//! claim's attempt fencing makes the take-over safe.

use sqlx::{Connection, Executor, PgConnection, PgPool, Row};
use std::fmt;

/// True when the server will not write: a standby (in recovery), or a primary made read-only
/// (`default_transaction_read_only`, which a session inherits at connect and, from
/// `postgresql.conf` or `ALTER SYSTEM`, again at every reload). One row, one column; sent as a
/// simple query, so it leaves no prepared statement behind and works through any pooler.
pub const READ_ONLY_SQL: &str =
    "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'";

/// What the server behind a connection refused, by SQLSTATE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// 25006 `read_only_sql_transaction`: a standby, or a primary made read-only, as the old
    /// primary is during and after a failover.
    ReadOnly,
    /// 57P01 `admin_shutdown`, 57P02 `crash_shutdown`, 57P03 `cannot_connect_now`: the server is
    /// stopping, crashed, or not accepting connections yet (a failover, a restart, or an operator's
    /// `pg_terminate_backend`).
    ShuttingDown,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Refusal::ReadOnly => {
                "the server is read-only (a standby, or default_transaction_read_only: during or \
                 after a failover, the old primary)"
            }
            Refusal::ShuttingDown => {
                "the server ended the session: it is shutting down or restarting (a failover, a \
                 restart, or an administrator's command)"
            }
        })
    }
}

/// The refusal a database error stands for, if it is one.
pub fn refusal(e: &sqlx::Error) -> Option<Refusal> {
    let sqlx::Error::Database(db) = e else {
        return None;
    };
    match db.code().as_deref()? {
        "25006" => Some(Refusal::ReadOnly),
        "57P01" | "57P02" | "57P03" => Some(Refusal::ShuttingDown),
        _ => None,
    }
}

/// Asks the server behind `conn` whether it is read-only ([`READ_ONLY_SQL`]).
pub async fn is_read_only(conn: &mut PgConnection) -> sqlx::Result<bool> {
    conn.fetch_one(READ_ONLY_SQL).await?.try_get(0)
}

/// What one connection made directly with a pool's options (none of its hooks) found.
#[derive(Debug)]
pub enum Direct {
    /// Connected to a server that takes writes: the pool was merely busy.
    Writable,
    /// Connected to a read-only server: the pool turns such connections away.
    ReadOnly,
    /// The attempt failed: what the pool met while it retried (too many connections, slots
    /// reserved, starting up, a refused handshake).
    Failed(sqlx::Error),
    /// Nothing answered within the pool's acquire timeout.
    Silent,
}

/// One direct connection with `pool`'s options, bounded by its acquire timeout, asking the server
/// whether it takes writes: why the pool could hand out no connection, when its own error
/// (`PoolTimedOut`) does not say.
pub async fn ask_directly(pool: &PgPool) -> Direct {
    let options = pool.connect_options();
    let attempt = tokio::time::timeout(pool.options().get_acquire_timeout(), async {
        let mut conn = PgConnection::connect_with(&options).await?;
        let read_only = is_read_only(&mut conn).await;
        let _ = conn.close().await;
        read_only
    })
    .await;
    match attempt {
        Ok(Ok(true)) => Direct::ReadOnly,
        Ok(Ok(false)) => Direct::Writable,
        Ok(Err(e)) => Direct::Failed(e),
        Err(_) => Direct::Silent,
    }
}
