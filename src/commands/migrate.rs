//! `settlementd migrate`: apply the embedded migrations (safe from N replicas at once), then give
//! every settled loan without a journal entry its opening entry, in batches.

use crate::app::{check_schema, Database, Result};
use crate::config::Settings;
use crate::db;
use crate::jobs::fine_settlement::journal;

/// What `migrate` did.
#[derive(Debug, Clone, Default)]
pub struct Migrated {
    /// The migrations applied now, oldest first (none: the schema was current).
    pub applied: Vec<db::Applied>,
    /// How many migrations this binary embeds (all applied now).
    pub known: usize,
    /// Settled loans given an opening journal entry now.
    pub opened: u64,
    /// The migrating role may not read `loans` (a least-privilege migration role,
    /// deploy/sql/roles.sql): the opening entries are left to the replicas, which write them as
    /// the runtime role, a batch at a time.
    pub opening_left_to_replicas: bool,
}

/// Checks an existing `loans` table's columns, applies every embedded migration to the configured
/// (or embedded) database, then writes the opening journal entries of loans settled before the
/// journal existed, `batch.size` loans per transaction: killed, it resumes where it stopped when
/// run again (each batch takes the next loans still without an entry).
pub async fn migrate(settings: &Settings, embedded_db: bool) -> Result<Migrated> {
    let database = Database::open(settings, embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        let applied = db::migrate(&database.pool).await?;
        let known = db::embedded().count();
        let mut conn = database.pool.acquire().await?;
        let batch = i64::from(settings.batch.size.max(1));
        let mut opened = 0;
        loop {
            let n = match journal::open_unjournaled(&mut conn, batch).await {
                Ok(n) => n,
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => {
                    return Ok(Migrated {
                        applied,
                        known,
                        opened,
                        opening_left_to_replicas: true,
                    });
                }
                Err(e) => return Err(e.into()),
            };
            opened += n;
            if n > 0 {
                tracing::info!(opened, "opening journal entries written");
            }
            if (n as i64) < batch {
                break;
            }
        }
        Ok(Migrated {
            applied,
            known,
            opened,
            opening_left_to_replicas: false,
        })
    }
    .await;
    database.close().await;
    result
}
