//! A dry run: what a run of a period would do, for one shard or several, read in one read-only
//! snapshot and written nowhere — no claim, no pin, no progress, no event, nothing of the job's.
//!
//! The job layer says what a run would decide before it writes (refused: paused, not covered by
//! the configuration, pinned to other parameters, held by a correction, not ready; skipped: held
//! by a live run, already SUCCESS with nothing left; or run), from the same rows the claim reads;
//! the job says what its batches would write ([`Job::preview`]). The transaction is `READ ONLY`,
//! so the server itself refuses any write a dry run would attempt.
//!
//! A dry run asked with a deadline (`POST /v1/runs/dry-run`, within the HTTP request's timeout)
//! gives its snapshot a `statement_timeout` of the time left: when the deadline passes, the server
//! cancels the statement in flight. Dropping the caller's future alone would not: sqlx returns the
//! connection to its pool, which waits for the statement to end before it reuses it, and the
//! server would go on reading a month of loans for nobody.

use super::registry::Registered;
use super::{params, pause, BusinessDate, JobKey, Preview, Result};
use chrono::NaiveDate;
use serde_json::{json, Map, Value};
use sqlx::PgPool;
use std::time::Duration;

/// The `BEGIN` of a dry run's snapshot.
pub const BEGIN_DRY_RUN: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

/// What a run of one shard would decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Would {
    /// Claim the key and run it.
    Run,
    /// Claim nothing: the key is SUCCESS and nothing is left (`already_success`), or a live run
    /// holds it (`held`).
    Skip(&'static str),
    /// Claim nothing: the period is refused (the reasons are the dry run's `refused`).
    Refuse,
}

/// One shard of a dry run.
#[derive(Debug, Clone)]
pub struct ShardDry {
    pub shard: u32,
    /// Its claim now: status and attempt, `None` when never claimed.
    pub claim: Option<(String, i32)>,
    pub would: Would,
}

/// What a dry run of a period found.
#[derive(Debug, Clone)]
pub struct DryRun {
    /// What is previewed: `run`, or `correction` (`correct --dry-run`).
    pub writer: &'static str,
    pub job: &'static str,
    pub business_date: NaiveDate,
    pub shards: u32,
    /// The parameters a run would pin (or compare with the pin), in words and as recorded.
    pub params: Option<(String, Value)>,
    /// The parameters pinned for the period, in words, when it has some.
    pub pinned: Option<String>,
    /// Every refusal that applies, in words: a run would claim nothing.
    pub refused: Vec<String>,
    pub by_shard: Vec<ShardDry>,
    /// What the job's batches would write; `None` when the job cannot tell.
    pub preview: Option<Preview>,
}

/// The dry run of `month` for `shards` of `count`: see the module. `force`: as `run
/// --force` (a SUCCESS key is run again). `deadline`: when the server stops its statements.
#[allow(clippy::too_many_arguments)]
pub async fn dry_run(
    pool: &PgPool,
    job: &dyn Registered,
    month: BusinessDate,
    count: u32,
    shards: &[u32],
    force: bool,
    lease_ttl: Duration,
    deadline: Option<tokio::time::Instant>,
) -> Result<DryRun> {
    let business_date = month.date();
    let mut tx = pool.begin_with(BEGIN_DRY_RUN).await?;
    if let Some(deadline) = deadline {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        stop_statements_after(&mut tx, left).await?;
    }
    let key = |shard: u32| JobKey {
        job_name: job.name().to_string(),
        business_date,
        shards: count,
        shard,
    };
    let mut refused = Vec::new();
    let mine = match job.params(&key(shards.first().copied().unwrap_or(0))) {
        Ok(p) => Some(p),
        Err(why) => {
            refused.push(format!(
                "{why} (the configuration does not cover the month)"
            ));
            None
        }
    };
    if let Some(p) = pause::of(&mut *tx, job.name()).await? {
        refused.push(format!(
            "{} is paused since {} by {}: {} (`settlementd resume --job {}`)",
            job.name(),
            crate::schedule::shown(p.paused_at),
            p.paused_by,
            p.reason,
            job.name()
        ));
    }
    if let Some((correction, since)) = params::held_by(&mut *tx, job.name(), business_date).await? {
        refused.push(format!(
            "the month is being corrected under key {correction:?} since {}",
            crate::schedule::shown(since)
        ));
    }
    let pinned = params::pinned(&mut *tx, job.name(), business_date).await?;
    if let (Some(pinned), Some(mine)) = (&pinned, &mine) {
        if !mine.is_empty() {
            let same: bool = sqlx::query_scalar(&format!(
                "SELECT {}",
                params::same_identity("$1::jsonb", "$2::jsonb")
            ))
            .bind(&pinned.0)
            .bind(&mine.0)
            .fetch_one(&mut *tx)
            .await?;
            if !same {
                refused.push(format!(
                    "the month is pinned to {}; this configuration's is {}",
                    job.describe(pinned),
                    job.describe(mine)
                ));
            }
        }
    }
    if let Some(before) = job.after() {
        let leader = job.leader();
        if let Some(why) =
            super::due::not_ready(&mut tx, before, leader, business_date, count).await?
        {
            refused.push(format!("not ready: {why}"));
        }
    }
    let claims: Vec<(i32, String, i32, bool)> = sqlx::query_as(
        "SELECT shard, status, attempt,
                heartbeat_at >= clock_timestamp() - make_interval(secs => $4)
           FROM job_runs
          WHERE job_name = $1 AND business_date = $2 AND shards = $3",
    )
    .bind(job.name())
    .bind(business_date)
    .bind(count as i32)
    .bind(lease_ttl.as_secs_f64())
    .fetch_all(&mut *tx)
    .await?;
    let preview = job.preview(&mut tx, month, count, shards).await?;
    tx.rollback().await?;
    let mut by_shard = Vec::new();
    for &shard in shards {
        let claim = claims.iter().find(|c| c.0 as u32 == shard);
        // As the claim decides: a SUCCESS key is skipped unless forced or the job reports items
        // that arrived after it was done ([`Job::late_items`], read from the job's own data).
        let would = match claim {
            _ if !refused.is_empty() => Would::Refuse,
            Some((_, status, _, true)) if status == "RUNNING" => Would::Skip("held"),
            Some((_, status, _, _)) if status == "SUCCESS" && !force => {
                match job.late_items(pool, &key(shard)).await? {
                    0 => Would::Skip("already_success"),
                    _ => Would::Run,
                }
            }
            _ => Would::Run,
        };
        by_shard.push(ShardDry {
            shard,
            claim: claim.map(|c| (c.1.clone(), c.2)),
            would,
        });
    }
    Ok(DryRun {
        writer: "run",
        job: job.name(),
        business_date,
        shards: count,
        params: mine
            .filter(|p| !p.is_empty())
            .map(|p| (job.describe(&p), p.0)),
        pinned: pinned.map(|p| job.describe(&p)),
        refused,
        by_shard,
        preview,
    })
}

/// Sets the transaction's `statement_timeout` to `left` (at least 1 ms: `0` would turn it off):
/// each statement after it is cancelled by the server once it has run that long.
async fn stop_statements_after(tx: &mut sqlx::PgConnection, left: Duration) -> Result<()> {
    let millis = left.as_millis().clamp(1, i32::MAX as u128);
    sqlx::query("SELECT set_config('statement_timeout', $1, true)")
        .bind(millis.to_string())
        .execute(tx)
        .await?;
    Ok(())
}

impl DryRun {
    /// Items the runs it shows would write (0 for shards refused or skipped).
    pub fn writes(&self) -> u64 {
        self.by_shard
            .iter()
            .filter(|s| s.would == Would::Run)
            .filter_map(|s| self.preview.as_ref()?.shards.get(&s.shard))
            .map(|s| s.writes)
            .sum()
    }

    /// The `run --dry-run --json` object of the period.
    pub fn to_json(&self) -> Value {
        let by_shard: Vec<Value> = self
            .by_shard
            .iter()
            .map(|s| {
                let mut o = Map::new();
                o.insert("shard".into(), s.shard.into());
                o.insert(
                    "claim".into(),
                    s.claim.as_ref().map_or(
                        Value::Null,
                        |(status, attempt)| json!({"status": status, "attempt": attempt}),
                    ),
                );
                let (would, because) = match &s.would {
                    Would::Run => ("run", Value::Null),
                    Would::Skip(why) => ("skip", (*why).into()),
                    Would::Refuse => ("refuse", Value::Null),
                };
                o.insert("would".into(), would.into());
                o.insert("skipped_because".into(), because);
                if let Some(shard) = self.preview.as_ref().and_then(|p| p.shards.get(&s.shard)) {
                    o.extend(shard.json.clone());
                }
                Value::Object(o)
            })
            .collect();
        let mut out = Map::new();
        out.insert("dry_run".into(), true.into());
        out.insert("writer".into(), self.writer.into());
        out.insert("job".into(), self.job.into());
        out.insert(
            "business_date".into(),
            self.business_date.to_string().into(),
        );
        out.insert("shards".into(), self.shards.into());
        out.insert(
            "params".into(),
            self.params.as_ref().map_or(Value::Null, |(_, v)| v.clone()),
        );
        out.insert(
            "pinned".into(),
            self.pinned.clone().map_or(Value::Null, Value::from),
        );
        out.insert("refused".into(), json!(self.refused));
        out.insert("by_shard".into(), Value::Array(by_shard));
        out.insert("writes".into(), self.writes().into());
        out.insert("preview".into(), self.preview.is_some().into());
        if let Some(p) = &self.preview {
            out.extend(p.json.clone());
        }
        Value::Object(out)
    }

    /// The period in words, for people.
    pub fn to_text(&self) -> String {
        let of = match self.writer {
            "run" => String::new(),
            writer => format!("a {writer} of "),
        };
        let mut out = format!(
            "dry run of {of}{} {} (shard count {}): nothing is written\n",
            self.job, self.business_date, self.shards
        );
        if let Some((words, _)) = &self.params {
            let pin = match &self.pinned {
                None => "not pinned yet: the first claim pins it".to_string(),
                Some(p) if *p == *words => "the month's pin".to_string(),
                Some(p) => format!("the month is pinned to {p}"),
            };
            out.push_str(&format!("  rule: {words} ({pin})\n"));
        }
        for why in &self.refused {
            out.push_str(&format!("  refused: {why}\n"));
        }
        for s in &self.by_shard {
            let claim = s
                .claim
                .as_ref()
                .map_or("never claimed".to_string(), |(st, a)| {
                    format!("{st}, attempt {a}")
                });
            let would = match &s.would {
                Would::Run => "would run",
                Would::Skip("held") => "would skip it: a live run holds it (`--wait` waits)",
                Would::Skip(_) => {
                    "would skip it: SUCCESS and nothing left (`--force` runs it again)"
                }
                Would::Refuse => "would claim nothing (refused)",
            };
            out.push_str(&format!(
                "  shard {}/{} ({claim}): {would}\n",
                s.shard, self.shards
            ));
            if let Some(shard) = self.preview.as_ref().and_then(|p| p.shards.get(&s.shard)) {
                out.push_str(&shard.text);
            }
        }
        match &self.preview {
            Some(p) => out.push_str(&p.text),
            None => out.push_str(&format!(
                "  {} cannot tell what its runs would write\n",
                self.job
            )),
        }
        out
    }
}
