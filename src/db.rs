//! Connecting and migrating. Migrations are embedded at compile time (see build.rs); sqlx takes a
//! PostgreSQL advisory lock while migrating, so N replicas starting together is safe.

use crate::config::{redact_url, DatabaseSettings};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use std::str::FromStr;
use std::time::Duration;

pub static MIGRATOR: Migrator = sqlx::migrate!();

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid database url '{url}': {source}")]
    BadUrl { url: String, source: sqlx::Error },
    #[error("cannot connect to the database at {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Query(#[from] sqlx::Error),
}

impl DbError {
    /// Configuration mistakes (exit 2) versus failures that may pass (exit 1).
    pub fn is_config(&self) -> bool {
        matches!(self, DbError::BadUrl { .. })
    }
}

pub type Result<T, E = DbError> = std::result::Result<T, E>;

/// A pool on `url` that fails within `acquire_timeout_secs` when the database is unreachable.
pub async fn connect(url: &str, settings: &DatabaseSettings) -> Result<PgPool> {
    let options = PgConnectOptions::from_str(url).map_err(|source| DbError::BadUrl {
        url: redact_url(url),
        source,
    })?;
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(Duration::from_secs(settings.acquire_timeout_secs))
        .connect_with(options.application_name("settlementd"))
        .await
        .map_err(|source| DbError::Connect {
            url: redact_url(url),
            source,
        })
}

/// Closes `pool` until it is really empty (at most 2 s). `PgPool::close` can return while a
/// connection released a moment earlier is still on its way back (sqlx pings it first); stopping an
/// embedded server right then turns that ping into a logged warning.
pub async fn close(pool: &PgPool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    pool.close().await;
    while pool.size() > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
        pool.close().await;
    }
}

pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

/// True when every embedded migration is applied (what `/readyz` checks).
pub async fn schema_is_current(pool: &PgPool) -> Result<bool> {
    let latest = MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    let applied: Option<i64> =
        sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations WHERE success")
            .fetch_one(pool)
            .await
            .or_else(|e| match &e {
                // No migrations table yet: not current.
                sqlx::Error::Database(db) if db.code().as_deref() == Some("42P01") => Ok(None),
                _ => Err(e),
            })?;
    Ok(applied == Some(latest))
}
