//! `settlementd migrate`: apply the embedded migrations (safe from N replicas at once).

use crate::app::{Database, Result};
use crate::config::Settings;
use crate::db;

/// Applies every embedded migration to the configured (or embedded) database.
pub async fn migrate(settings: &Settings, embedded_db: bool) -> Result<()> {
    let database = Database::open(settings, embedded_db).await?;
    let result = db::migrate(&database.pool).await;
    database.close().await;
    Ok(result?)
}
