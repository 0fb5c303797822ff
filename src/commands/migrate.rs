//! `settlementd migrate`: apply the embedded migrations (safe from N replicas at once).

use crate::app::{check_schema, Database, Result};
use crate::config::Settings;
use crate::db;

/// Checks an existing `loans` table's columns, then applies every embedded migration to the
/// configured (or embedded) database.
pub async fn migrate(settings: &Settings, embedded_db: bool) -> Result<()> {
    let database = Database::open(settings, embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        Ok(db::migrate(&database.pool).await?)
    }
    .await;
    database.close().await;
    result
}
