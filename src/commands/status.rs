//! `settlementd status`: each shard's claim for one month, the month's settled totals, and each
//! shard's latest events from the audit trail (`--history N`).

use crate::app::{business_date_or_default, AppError, Database, Result};
use crate::calendar::BusinessDate;
use crate::clock::SystemClock;
use crate::config::Settings;
use crate::jobs::claim::{self, JobRunRow};
use crate::jobs::events::{self, JobEvent};
use crate::jobs::Cursor;
use crate::settlement::{self, MonthTotals};
use std::fmt::Write;

#[derive(Debug, Clone, Default)]
pub struct StatusRequest {
    /// The month as its last day (default: last month's end in schedule.timezone).
    pub business_date: Option<String>,
    /// The shard count whose claims to show (default shard.count).
    pub shards: Option<u32>,
    /// How many of each shard's latest audit events to show (0: none).
    pub history: u32,
    pub embedded_db: bool,
}

/// One month as `status` shows it.
#[derive(Debug, Clone)]
pub struct MonthStatus {
    pub business_date: BusinessDate,
    pub shards: u32,
    /// The claims that exist, by shard; a shard without a row is "missing".
    pub rows: Vec<JobRunRow>,
    pub totals: MonthTotals,
    /// Each shard's latest audit events, by shard, newest first.
    pub history: Vec<JobEvent>,
}

pub async fn status(settings: &Settings, request: &StatusRequest) -> Result<MonthStatus> {
    let business_date =
        business_date_or_default(request.business_date.as_deref(), settings, &SystemClock)?;
    let shards = request.shards.unwrap_or(settings.shard.count);
    if shards < 1 {
        return Err(AppError::Invalid("--shards must be >= 1".into()));
    }
    let database = Database::open(settings, request.embedded_db).await?;
    let result = async {
        let rows = claim::rows_for(
            &database.pool,
            settlement::JOB_NAME,
            business_date.date(),
            shards,
        )
        .await?;
        let totals = settlement::month_totals(&database.pool, business_date).await?;
        let history = match request.history {
            0 => Vec::new(),
            n => {
                events::recent(
                    &database.pool,
                    settlement::JOB_NAME,
                    business_date.date(),
                    shards,
                    n,
                )
                .await?
            }
        };
        Ok::<_, AppError>((rows, totals, history))
    }
    .await;
    database.close().await;
    let (rows, totals, history) = result?;
    Ok(MonthStatus {
        business_date,
        shards,
        rows,
        totals,
        history,
    })
}

impl MonthStatus {
    fn row(&self, shard: i32) -> Option<&JobRunRow> {
        self.rows.iter().find(|r| r.shard == shard)
    }

    /// The `status --json` object.
    pub fn to_json(&self) -> serde_json::Value {
        let runs: Vec<serde_json::Value> = (0..self.shards as i32)
            .map(|s| match self.row(s) {
                Some(row) => serde_json::to_value(row).unwrap_or_default(),
                None => serde_json::json!({ "shard": s, "status": "missing" }),
            })
            .collect();
        serde_json::json!({
            "job": settlement::JOB_NAME,
            "business_date": self.business_date.to_string(),
            "shards": self.shards,
            "runs": runs,
            "totals": self.totals,
            "history": self.history,
        })
    }

    /// The table `status` prints without `--json` (lines end with a newline).
    pub fn to_text(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{} {} with {} shard(s)",
            settlement::JOB_NAME,
            self.business_date,
            self.shards
        );
        let _ = writeln!(
            out,
            "{:<6} {:<8} {:>7} {:<28} {:>10} {:>12} {:>10} {:>10}  last_error",
            "shard", "status", "attempt", "owner", "heartbeat", "cursor", "scanned", "updated"
        );
        for s in 0..self.shards as i32 {
            let _ = match self.row(s) {
                Some(r) => writeln!(
                    out,
                    "{:<6} {:<8} {:>7} {:<28} {:>9.1}s {:>12} {:>10} {:>10}  {}",
                    s,
                    r.status,
                    r.attempt,
                    r.owner,
                    r.heartbeat_age_secs,
                    compact(r.cursor()),
                    r.scanned,
                    r.updated,
                    r.last_error.as_deref().unwrap_or("")
                ),
                None => writeln!(out, "{s:<6} missing"),
            };
        }
        let _ = writeln!(
            out,
            "settled in {}: rows={} fine_cents_sum={} digest={}",
            self.business_date.first_day().format("%Y-%m"),
            self.totals.settled_rows,
            self.totals.fine_cents_sum,
            self.totals.digest
        );
        if !self.history.is_empty() {
            let _ = writeln!(out, "history (newest first):");
        }
        for e in &self.history {
            let _ = writeln!(
                out,
                "  shard {:<3} {}  {:<16} {:<10} {:<28} {}{}",
                e.shard,
                e.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                e.event,
                e.attempt
                    .map(|a| format!("attempt {a}"))
                    .unwrap_or_default(),
                e.owner,
                e.message.as_deref().unwrap_or(""),
                e.request_id
                    .as_deref()
                    .map(|r| format!(" [request {r}]"))
                    .unwrap_or_default()
            );
        }
        out
    }
}

/// A run's cursor in a table cell: `↑id` for an ascending walk's `last_id`, `↓id` for a
/// descending walk's `last_id_desc`, `-` before the first batch.
fn compact(cursor: Cursor) -> String {
    let up = cursor.last_id.map(|id| format!("↑{id}"));
    let down = cursor.last_id_desc.map(|id| format!("↓{id}"));
    match (up, down) {
        (None, None) => "-".into(),
        (Some(one), None) | (None, Some(one)) => one,
        (Some(up), Some(down)) => format!("{up} {down}"),
    }
}
