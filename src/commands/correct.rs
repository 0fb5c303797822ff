//! `settlementd correct`: a settled month recomputed under the rule the configuration gives it, on
//! the record (`fine_adjustments`, a `corrected` event per shard), once per key.

use crate::app::{
    business_date_or_default, check_schema, ensure_month_is_over, run_options, settlement_job,
    shutdown_on_signals, AppError, Database, Result,
};
use crate::calendar::BusinessDate;
use crate::clock::SystemClock;
use crate::config::{Settings, ShardSpec, MAX_SHARDS};
use crate::jobs::{self, Params, RunOptions, SkipReason};
use crate::settlement::correction::{self, Begun, Correction, FineCorrection, ShardRun};
use crate::settlement::{self, describe_params, rule_params};
use sqlx::PgPool;

/// The longest correction key accepted.
pub const MAX_KEY_LEN: usize = 200;
/// The longest reason accepted.
pub const MAX_REASON_LEN: usize = 2000;

#[derive(Debug, Clone, Default)]
pub struct CorrectRequest {
    /// The month as its last day.
    pub business_date: String,
    pub reason: String,
    /// The operator's key: the same key again changes nothing and reports the first result.
    pub key: String,
    /// The shard count to correct under (default: the one the month was settled with).
    pub shards: Option<u32>,
    pub embedded_db: bool,
}

/// What `correct` did (or, replayed, did the first time).
#[derive(Debug, Clone)]
pub struct Corrected {
    pub correction: Correction,
    /// True when the key had completed before: nothing was done now.
    pub replayed: bool,
    /// Per shard: shard, changed, net_cents, updated, held.
    pub result: serde_json::Value,
}

pub async fn correct(settings: &Settings, request: &CorrectRequest) -> Result<Corrected> {
    let key = request.key.as_str();
    if key.is_empty() || key.len() > MAX_KEY_LEN || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(AppError::Invalid(format!(
            "--key must be 1 to {MAX_KEY_LEN} visible ASCII characters (e.g. the ticket that \
             asked for the correction)"
        )));
    }
    let reason = request.reason.trim();
    if reason.is_empty() || reason.len() > MAX_REASON_LEN {
        return Err(AppError::Invalid(format!(
            "--reason must say why, in 1 to {MAX_REASON_LEN} characters"
        )));
    }
    if let Some(shards) = request.shards {
        ShardSpec::new(0, shards)
            .map_err(|_| AppError::Invalid(format!("--shards must be 1 to {MAX_SHARDS}")))?;
    }
    let business_date =
        business_date_or_default(Some(&request.business_date), settings, &SystemClock)?;
    ensure_month_is_over(business_date, settings, &SystemClock)?;
    let job = settlement_job(settings);
    let rule = rule_params(
        &job.rule_of(business_date.date())
            .map_err(|why| AppError::Invalid(format!("{business_date}: {why}")))?,
    );
    let database = Database::open(settings, request.embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        let pool = &database.pool;
        let existing = correction::find(pool, key).await?;
        let correction = match existing {
            Some(c) => resumable(c, business_date, &rule)?,
            None => {
                let shards = match request.shards {
                    Some(shards) => shards,
                    None => settled_shard_count(pool, business_date).await?,
                };
                let opts = run_options(settings, false, false);
                let mut conn = pool.acquire().await?;
                let begun = correction::begin(
                    &mut conn,
                    key,
                    business_date,
                    shards,
                    reason,
                    &rule,
                    &opts.owner,
                    opts.lease_ttl,
                )
                .await?;
                match begun {
                    Begun::Started(c) => c,
                    Begun::Existing(c) => resumable(c, business_date, &rule)?,
                    Begun::Running(runs) => {
                        return Err(AppError::Refused(format!(
                            "{business_date} has live runs ({}): correct it once they are done",
                            runs.join(", ")
                        )))
                    }
                }
            }
        };
        if correction.completed {
            let result = correction.result.clone().unwrap_or_default();
            return Ok(Corrected {
                correction,
                replayed: true,
                result,
            });
        }
        let runs = run_shards(settings, pool, &correction).await?;
        let opts = run_options(settings, false, false);
        let mut conn = pool.acquire().await?;
        let result = correction::complete(&mut conn, &correction, &runs, &opts.owner).await?;
        Ok(Corrected {
            correction,
            replayed: false,
            result,
        })
    }
    .await;
    database.close().await;
    result
}

/// A correction recorded before under the same key: it must be of the same month, and (when not
/// complete) under the rule the configuration gives now, or it could not be finished as begun.
fn resumable(c: Correction, business_date: BusinessDate, rule: &Params) -> Result<Correction> {
    if c.business_date != business_date.date() {
        return Err(AppError::Invalid(format!(
            "correction key {:?} was used for {} already: use a new key",
            c.correction_key, c.business_date
        )));
    }
    if !c.completed && c.new_rule != rule.0 {
        return Err(AppError::Invalid(format!(
            "correction {:?} was begun under {}, and this configuration gives {}: finish it with \
             the configuration it was begun with, or use a new key",
            c.correction_key,
            describe_params(&Params(c.new_rule.clone())),
            describe_params(rule)
        )));
    }
    Ok(c)
}

/// The shard count the month was settled with: the one count with claims for it.
async fn settled_shard_count(pool: &PgPool, business_date: BusinessDate) -> Result<u32> {
    let counts: Vec<i32> = sqlx::query_scalar(
        "SELECT DISTINCT shards FROM job_runs
          WHERE job_name = $1 AND business_date = $2 ORDER BY shards",
    )
    .bind(settlement::JOB_NAME)
    .bind(business_date.date())
    .fetch_all(pool)
    .await?;
    match counts.as_slice() {
        [one] => Ok(*one as u32),
        [] => Err(AppError::Invalid(format!(
            "{business_date} has no claims under any shard count: settle it with `run` first, or \
             give --shards"
        ))),
        many => Err(AppError::Invalid(format!(
            "{business_date} has claims under several shard counts ({many:?}): say which to \
             correct under with --shards"
        ))),
    }
}

/// Runs the correction of every shard, one after the other, waiting out a live run of a shard
/// (every `lease.heartbeat_secs`) instead of skipping it.
async fn run_shards(
    settings: &Settings,
    pool: &PgPool,
    correction: &Correction,
) -> Result<Vec<ShardRun>> {
    let job = FineCorrection {
        settlement: settlement_job(settings),
        correction_key: correction.correction_key.clone(),
    };
    let business_date = BusinessDate::new(correction.business_date)?;
    let shutdown = shutdown_on_signals();
    let opts = RunOptions {
        reopen: Some(correction::reopen(correction)),
        ..run_options(settings, false, false)
    };
    let mut runs = Vec::new();
    for shard in 0..correction.shards as u32 {
        let key = settlement::key(
            business_date,
            ShardSpec::new(shard, correction.shards as u32)?,
        );
        let report = loop {
            let report = jobs::run_once(pool, &job, key.clone(), &opts, &shutdown, &|_| {}).await?;
            if report.skipped != Some(SkipReason::Held) {
                break report;
            }
            tracing::warn!(shard, "a live run holds the shard; waiting for it to end");
            tokio::select! {
                _ = tokio::time::sleep(opts.heartbeat_every) => {}
                _ = shutdown.cancelled() => return Err(AppError::Failed("interrupted".into())),
            }
        };
        runs.push(ShardRun {
            shard,
            attempt: report.attempt.unwrap_or_default(),
            updated: report.updated,
            held: report.held,
        });
    }
    Ok(runs)
}

/// The `correct --json` object.
pub fn to_json(c: &Corrected) -> serde_json::Value {
    let changed: i64 = shard_sum(&c.result, "changed");
    serde_json::json!({
        "correction_key": c.correction.correction_key,
        "business_date": c.correction.business_date.to_string(),
        "shards": c.correction.shards,
        "reason": c.correction.reason,
        "old_rule": c.correction.old_rule,
        "new_rule": c.correction.new_rule,
        "replayed": c.replayed,
        "changed": changed,
        "net_cents": net_cents(&c.result),
        "per_shard": c.result,
    })
}

/// What `correct` prints without `--json`.
pub fn to_text(c: &Corrected) -> String {
    let old = c
        .correction
        .old_rule
        .clone()
        .map_or("none pinned".into(), |p| describe_params(&Params(p)));
    format!(
        "correction {:?} of {} ({} shards){}: {} rows changed, net {:+} cents; rule was {old}, is {}\n",
        c.correction.correction_key,
        c.correction.business_date,
        c.correction.shards,
        if c.replayed {
            " was done before: nothing changed now"
        } else {
            ""
        },
        shard_sum(&c.result, "changed"),
        net_cents(&c.result),
        describe_params(&Params(c.correction.new_rule.clone()))
    )
}

fn shard_sum(result: &serde_json::Value, field: &str) -> i64 {
    result
        .as_array()
        .map(|shards| shards.iter().filter_map(|s| s.get(field)?.as_i64()).sum())
        .unwrap_or(0)
}

fn net_cents(result: &serde_json::Value) -> i128 {
    result
        .as_array()
        .map(|shards| {
            shards
                .iter()
                .filter_map(|s| s.get("net_cents")?.to_string().parse::<i128>().ok())
                .sum()
        })
        .unwrap_or(0)
}
