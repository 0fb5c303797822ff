//! `settlementd prune --older-than DAYS [--dry-run]`: deletes the audit trail, run requests and
//! claims of periods closed more than DAYS ago, in batches ([`crate::job_layer::retention`]); with
//! `--dry-run`, only says what it would delete.

use crate::app::{check_schema, retention_job, retention_key, run_options, AppError, Database};
use crate::app::{shutdown_on_signals, Result};
use crate::clock::{Clock, SystemClock};
use crate::config::Settings;
use crate::job_layer::retention::Prunable;
use crate::job_layer::{self, RunReport};

#[derive(Debug, Clone, Default)]
pub struct PruneRequest {
    pub older_than_days: u32,
    pub dry_run: bool,
    pub embedded_db: bool,
}

/// What `prune` found, and (without `--dry-run`) the run that deleted it.
#[derive(Debug)]
pub struct Pruned {
    pub periods: Vec<Prunable>,
    pub run: Option<RunReport>,
}

pub async fn prune(settings: &Settings, request: &PruneRequest) -> Result<Pruned> {
    if !(1..=36_500).contains(&request.older_than_days) {
        return Err(AppError::Invalid(format!(
            "--older-than must be 1 to 36500 days, got {}",
            request.older_than_days
        )));
    }
    let now = SystemClock.now();
    let retention = retention_job(settings, request.older_than_days, now);
    let database = Database::open(settings, request.embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        let periods = retention.prunable(&database.pool).await?;
        if request.dry_run {
            return Ok(Pruned { periods, run: None });
        }
        // Claimed like any run (forced: the day's run by a replica may be done already).
        let opts = run_options(settings, true, false);
        let shutdown = shutdown_on_signals();
        let report = job_layer::run_once(
            &database.pool,
            &retention,
            retention_key(settings, now),
            &opts,
            &shutdown,
            &|_| {},
        )
        .await?;
        Ok(Pruned {
            periods,
            run: Some(report),
        })
    }
    .await;
    database.close().await;
    result
}

impl Pruned {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "dry_run": self.run.is_none(),
            "periods": self.periods,
            "deleted": self.run.as_ref().map(|r| r.updated),
            "skipped": self.run.as_ref().and_then(|r| r.skipped),
        })
    }

    pub fn to_text(&self) -> String {
        let mut out = String::new();
        let verb = if self.run.is_none() {
            "would delete"
        } else {
            "deleting"
        };
        for p in &self.periods {
            out.push_str(&format!(
                "{} {}: {verb} {} events, {} run requests, {} claims\n",
                p.job_name, p.business_date, p.events, p.requests, p.runs
            ));
        }
        match &self.run {
            None => out.push_str(&format!(
                "dry run: {} periods closed long enough; nothing deleted\n",
                self.periods.len()
            )),
            Some(r) if r.skipped.is_some() => out.push_str(
                "skipped: another process is pruning now (its claim is live); nothing deleted\n",
            ),
            Some(r) => out.push_str(&format!(
                "deleted {} rows of {} periods in {} batches\n",
                r.updated,
                self.periods.len(),
                r.batches
            )),
        }
        out
    }
}
