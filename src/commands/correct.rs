//! `settlementd correct`: a settled month recomputed under the rule the configuration gives it, on
//! the record (the money journal, `fine_adjustments`, a `corrected` event per shard), once per key.
//!
//! A key binds its request like the runs API's `Idempotency-Key`: month, rule, reason and shard
//! count. The same key with the same request finishes an unfinished correction or replays a
//! finished one; with anything else it is refused (exit 3), naming what differs. One process at a
//! time works a key (a session advisory lock on it): a second one waits, then finds it done.

use crate::app::{
    business_date_or_default, check_schema, ensure_month_is_over, run_options, settlement_job,
    shutdown_on_signals, AppError, Database, Result,
};
use crate::calendar::BusinessDate;
use crate::clock::SystemClock;
use crate::config::{Settings, ShardSpec, MAX_SHARDS};
use crate::job_layer::dry::{DryRun, ShardDry, Would};
use crate::job_layer::{self, Params, RunOptions, SkipReason};
use crate::jobs::fine_settlement::correction::{self, Begun, Correction, FineCorrection, ShardRun};
use crate::jobs::fine_settlement::preview::Writer;
use crate::jobs::fine_settlement::{self, describe_params, journal, rule_params};
use crate::numbers::things;
use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

/// The longest correction key accepted.
pub const MAX_KEY_LEN: usize = 200;
/// The longest reason accepted.
pub const MAX_REASON_LEN: usize = 2000;

#[derive(Debug, Clone, Default)]
pub struct CorrectRequest {
    /// The month as its last day.
    pub business_date: String,
    pub reason: String,
    /// The operator's key: the same key with the same request again changes nothing and reports
    /// the first result; with another request it is refused.
    pub key: String,
    /// The shard count to correct under (default: the one the month was last settled with).
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
            .map_err(|why| AppError::Invalid(format!("{business_date}: {why}")))?
            .rule,
    );
    let asked = Asked {
        business_date,
        rule: &rule,
        reason,
        shards: request.shards,
    };
    let database = Database::open(settings, request.embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        let pool = &database.pool;
        // One process at a time per key; released with the connection, also when killed.
        let _lock = lock_key(pool, key).await?;
        let correction = match correction::find(pool, key).await? {
            Some(c) => asked.same_as(c)?,
            None => {
                let mut conn = pool.acquire().await?;
                let unjournaled = journal::unjournaled(&mut conn).await?;
                if unjournaled > 0 {
                    return Err(AppError::Refused(format!(
                        "{unjournaled} settled loans have no journal entry yet, and a correction \
                         finds a month's loans through the journal: run `settlementd migrate` \
                         (it gives each an opening entry), then correct"
                    )));
                }
                let shards = match request.shards {
                    Some(shards) => shards,
                    None => settled_shard_count(pool, business_date).await?,
                };
                let opts = run_options(settings, false, false);
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
                    Begun::Existing(c) => asked.same_as(c)?,
                    Begun::Running(runs) => {
                        return Err(AppError::Refused(format!(
                            "{business_date} has live runs ({}): correct it once they are done",
                            runs.join(", ")
                        )))
                    }
                    Begun::Unfinished(other) => return Err(unfinished(&other)),
                    Begun::Paused(pause) => return Err(job_layer::JobError::from(pause).into()),
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

/// `correct --dry-run`: what a correction of the month to the configuration's rule would write,
/// shard by shard (the loans whose fines it changes, reverses or takes out, the cents, the held
/// loans) and member by member, read in one read-only snapshot; nothing is written, no key is
/// needed. What would refuse the correction is named (a pause, live runs, loans without a journal
/// entry, another correction unfinished).
pub async fn dry_run(settings: &Settings, request: &CorrectRequest) -> Result<DryRun> {
    if let Some(shards) = request.shards {
        ShardSpec::new(0, shards)
            .map_err(|_| AppError::Invalid(format!("--shards must be 1 to {MAX_SHARDS}")))?;
    }
    let business_date =
        business_date_or_default(Some(&request.business_date), settings, &SystemClock)?;
    let job = settlement_job(settings);
    let rule = job
        .rule_of(business_date.date())
        .map_err(|why| AppError::Invalid(format!("{business_date}: {why}")))?
        .rule;
    let database = Database::open_to_read(settings, request.embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        let pool = &database.pool;
        let shards = match request.shards {
            Some(shards) => shards,
            None => settled_shard_count(pool, business_date).await?,
        };
        let mut tx = pool.begin_with(job_layer::dry::BEGIN_DRY_RUN).await?;
        let mut refused = Vec::new();
        if let Err(e) = ensure_month_is_over(business_date, settings, &SystemClock) {
            refused.push(e.to_string());
        }
        let unjournaled = journal::unjournaled(&mut tx).await?;
        if unjournaled > 0 {
            refused.push(format!(
                "{unjournaled} settled loans have no journal entry yet (`settlementd migrate` \
                 gives each an opening entry)"
            ));
        }
        if let Some(p) = job_layer::pause::of(&mut *tx, fine_settlement::JOB_NAME).await? {
            refused.push(format!(
                "{} is paused since {} by {}: {}",
                fine_settlement::JOB_NAME,
                crate::schedule::shown(p.paused_at),
                p.paused_by,
                p.reason
            ));
        }
        if let Some(other) = correction::unfinished(&mut *tx).await?.first() {
            refused.push(format!(
                "{} is being corrected under key {:?}: that correction finishes first",
                other.business_date, other.correction_key
            ));
        }
        let claims: Vec<(i32, String, i32)> = sqlx::query_as(
            "SELECT shard, status, attempt FROM job_runs
              WHERE job_name = $1 AND business_date = $2 AND shards = $3 ORDER BY shard",
        )
        .bind(fine_settlement::JOB_NAME)
        .bind(business_date.date())
        .bind(shards as i32)
        .fetch_all(&mut *tx)
        .await?;
        let running: Vec<String> = claims
            .iter()
            .filter(|c| c.1 == "RUNNING")
            .map(|c| format!("shard {}/{shards}", c.0))
            .collect();
        if !running.is_empty() {
            refused.push(format!(
                "{business_date} has runs in progress ({}): a correction waits for them",
                running.join(", ")
            ));
        }
        let pinned =
            job_layer::params::pinned(&mut *tx, fine_settlement::JOB_NAME, business_date.date())
                .await?
                .map(|p| describe_params(&p));
        let all: Vec<u32> = (0..shards).collect();
        let found = fine_settlement::preview::preview(
            &mut tx,
            Writer::Correction,
            business_date,
            shards,
            &all,
            &rule,
        )
        .await?;
        tx.rollback().await?;
        let would = match refused.is_empty() {
            true => Would::Run,
            false => Would::Refuse,
        };
        let params = rule_params(&rule);
        Ok(DryRun {
            writer: "correction",
            job: fine_settlement::JOB_NAME,
            business_date: business_date.date(),
            shards,
            params: Some((describe_params(&params), params.0)),
            pinned,
            refused,
            by_shard: all
                .iter()
                .map(|&shard| ShardDry {
                    shard,
                    claim: claims
                        .iter()
                        .find(|c| c.0 as u32 == shard)
                        .map(|c| (c.1.clone(), c.2)),
                    would: would.clone(),
                })
                .collect(),
            preview: Some(found.to_preview(Writer::Correction, &all)),
        })
    }
    .await;
    database.close().await;
    result
}

/// The shard count the month was last settled with: that of its most recent claim. A month
/// resharded keeps claims under both counts; the newest is the one its replicas run now.
async fn settled_shard_count(pool: &PgPool, business_date: BusinessDate) -> Result<u32> {
    let count: Option<i32> = sqlx::query_scalar(
        "SELECT shards FROM job_runs WHERE job_name = $1 AND business_date = $2
          ORDER BY started_at DESC, shards DESC LIMIT 1",
    )
    .bind(fine_settlement::JOB_NAME)
    .bind(business_date.date())
    .fetch_optional(pool)
    .await?;
    count.map(|c| c as u32).ok_or_else(|| {
        AppError::Invalid(format!(
            "{business_date} has no claims under any shard count: settle it with `run` first, or \
             give --shards"
        ))
    })
}

/// What this invocation asks for, to compare with what a key recorded.
struct Asked<'a> {
    business_date: BusinessDate,
    rule: &'a Params,
    reason: &'a str,
    shards: Option<u32>,
}

impl Asked<'_> {
    /// The correction recorded under the key, when it was asked for with this request; else the
    /// refusal naming every difference.
    fn same_as(&self, c: Correction) -> Result<Correction> {
        let mut differs = Vec::new();
        if c.business_date != self.business_date.date() {
            differs.push(format!(
                "month {} (this request: {})",
                c.business_date, self.business_date
            ));
        }
        // By the rule's identity, as pins are compared: a key stored by another release may
        // record more than rate, grace and cap.
        let stored = fine_settlement::rule_from_params(&Params(c.new_rule.clone()));
        if stored.is_none() || stored != fine_settlement::rule_from_params(self.rule) {
            differs.push(format!(
                "rule {} (this configuration: {})",
                describe_params(&Params(c.new_rule.clone())),
                describe_params(self.rule)
            ));
        }
        if c.reason != self.reason {
            differs.push(format!(
                "reason {:?} (this request: {:?})",
                c.reason, self.reason
            ));
        }
        if let Some(shards) = self.shards.filter(|s| *s as i32 != c.shards) {
            differs.push(format!(
                "{} (this request: {shards})",
                things(c.shards, "shard", "shards")
            ));
        }
        if differs.is_empty() {
            return Ok(c);
        }
        Err(AppError::Refused(format!(
            "correction key {:?} was used for another request: {}; use a new key for a new \
             request, or repeat the first one exactly",
            c.correction_key,
            differs.join(", ")
        )))
    }
}

/// The refusal of a new correction while `other` is unfinished: which, since when, and the one
/// command that finishes it.
fn unfinished(other: &Correction) -> AppError {
    AppError::Refused(format!(
        "{} is being corrected under key {:?} since {}: finish that correction first with \
         `settlementd correct --business-date {} --key {} --reason {} --shards {}` (its \
         configuration's rule must be {})",
        other.business_date,
        other.correction_key,
        crate::schedule::shown(other.created_at),
        other.business_date,
        shell_word(&other.correction_key),
        shell_word(&other.reason),
        other.shards,
        describe_params(&Params(other.new_rule.clone())),
    ))
}

/// `text` as one shell word (single-quoted unless it is plain).
fn shell_word(text: &str) -> String {
    if !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./:=+,".contains(&b))
    {
        return text.to_string();
    }
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// Holds the key's session advisory lock on a connection of its own until dropped (the
/// connection goes back to the pool closed, so the lock ends with it). Waits, saying so once, while
/// another process holds it.
async fn lock_key(pool: &PgPool, key: &str) -> Result<KeyLock> {
    let mut conn = pool.acquire().await?;
    let lock = "hashtextextended('settlementd correction ' || $1, 0)";
    let got: bool = sqlx::query_scalar(&format!("SELECT pg_try_advisory_lock({lock})"))
        .bind(key)
        .fetch_one(&mut *conn)
        .await?;
    if !got {
        tracing::warn!(
            key,
            "another process is running this correction; waiting for it to end"
        );
        eprintln!("settlementd: another process is running correction {key:?}; waiting for it");
        sqlx::query(&format!("SELECT pg_advisory_lock({lock})"))
            .bind(key)
            .execute(&mut *conn)
            .await?;
    }
    Ok(KeyLock { conn })
}

/// A correction key's advisory lock: its connection is closed when this is dropped, which ends the
/// lock (an unlock on a connection going back to the pool could be skipped by a cancellation).
struct KeyLock {
    conn: PoolConnection<Postgres>,
}

impl Drop for KeyLock {
    fn drop(&mut self) {
        self.conn.close_on_drop();
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
        correction: Some(correction.correction_key.clone()),
        ..run_options(settings, false, false)
    };
    let mut runs = Vec::new();
    for shard in 0..correction.shards as u32 {
        let key = fine_settlement::key(
            business_date,
            ShardSpec::new(shard, correction.shards as u32)?,
        );
        let report = loop {
            let report =
                job_layer::run_once(pool, &job, key.clone(), &opts, &shutdown, &|_| {}).await?;
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
            held: report
                .notes
                .get(fine_settlement::HELD)
                .map_or(0, |h| h.count),
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
        "correction {:?} of {} ({}){}: {} changed, net {:+} cents; rule was {old}, is {}\n",
        c.correction.correction_key,
        c.correction.business_date,
        things(c.correction.shards, "shard", "shards"),
        if c.replayed {
            " was done before: nothing changed now"
        } else {
            ""
        },
        things(shard_sum(&c.result, "changed"), "row", "rows"),
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
