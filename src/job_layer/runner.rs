//! `run_once`: claim → heartbeat → fenced batches → SUCCESS (or FAILED).
//!
//! The claim states the job's identifying parameters for the key ([`Job::params`]): the first claim
//! of the period pins them, a later one that differs claims nothing ([`JobError::ParamsConflict`]).
//! A claim that finds the key SUCCESS asks the job for items that arrived after it was done
//! ([`Job::late_items`]) and, when there are some, claims the key again as a new attempt that does
//! them ([`Job::reopen`]); otherwise the run is skipped as done.
//!
//! The CLI, the daemon's cron callback and the tests all call this one function.
//! The claim is a short transaction on its own connection; each batch is a transaction on the pool
//! that commits the work together with the fenced progress update; no transaction spans the run.

use super::claim::{self, ClaimOptions, ClaimOutcome, Recorded, Stated};
use super::lease::{Guards, Heartbeat};
use super::registry::Registered;
use super::{
    abandon_if_broken, add_notes, answered, events, requests, Batch, Job, JobError, JobKey, Notes,
    Owner, Params, Reopen, Result,
};
use crate::mutant::{self, Mutant};
use sqlx::{Connection, PgConnection, PgPool};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How long a run waits for any answer on its connection, in leases: the claim, each batch
/// transaction (all its statements and the commit), the SUCCESS write; and, per renewal, the
/// heartbeat waits one period. The server ends any batch statement after one lease
/// (`statement_timeout`) and a lock wait after half of one, so a batch has never legitimately taken
/// this long: a connection silent for that long is half-open (the server or the network gone
/// without a word, which TCP alone does not notice while the client only waits to read). The run
/// then fails with [`JobError::Unanswered`], closes the connection, and is retried.
pub const ANSWER_WITHIN_LEASES: u32 = 3;

#[derive(Debug, Clone)]
pub struct RunOptions {
    pub owner: Owner,
    pub lease_ttl: Duration,
    pub heartbeat_every: Duration,
    /// The server-side limits every batch transaction carries, derived from the lease.
    pub guards: Guards,
    /// Reopen a SUCCESS claim (never a live RUNNING one).
    pub force: bool,
    /// Count the remaining work first, for a progress bar.
    pub estimate: bool,
    /// The stored run request this run serves ([`super::requests`]); `None` for the schedule and
    /// the command line.
    pub request: Option<String>,
    /// Re-open the key whatever its state (but a live run), from its first item, under this event:
    /// a correction. `None` for every other run.
    pub reopen: Option<Reopen>,
    /// The correction this run belongs to (its key): the only runs a period held by a correction
    /// admits ([`super::params::hold`]). `None` for every other run.
    pub correction: Option<String>,
}

impl RunOptions {
    /// How long the run waits for an answer on its connection ([`ANSWER_WITHIN_LEASES`]).
    pub fn answer_within(&self) -> Duration {
        self.lease_ttl * ANSWER_WITHIN_LEASES
    }
}

/// Why a run did no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// Another owner holds a live lease.
    Held,
    /// The key is already SUCCESS.
    AlreadyDone,
    /// The run request was already served by another replica.
    RequestServed,
}

#[derive(Debug, Clone)]
pub struct RunReport {
    pub key: JobKey,
    pub skipped: Option<SkipReason>,
    /// This run's attempt; `None` when skipped.
    pub attempt: Option<i32>,
    pub took_over: bool,
    /// The period's identifying parameters: pinned, and equal to this run's.
    pub params: Params,
    /// Items that arrived after the key was done, which this run re-opened it for (0 otherwise).
    pub late: u64,
    pub scanned: u64,
    pub updated: u64,
    /// The job's own counts over the run ([`super::Noted`]).
    pub notes: Notes,
    /// Batch transactions this run committed (0 when skipped).
    pub batches: u64,
    pub elapsed: Duration,
}

/// Progress after each committed batch.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    pub total: Option<u64>,
    pub scanned: u64,
    pub updated: u64,
    pub batches: u64,
}

/// Runs `job` for `key` once, idempotently. `shutdown` stops the run between batches (the batch in
/// flight commits) and marks it FAILED with `interrupted: shutdown` so a peer takes over at once.
///
/// A job that follows another ([`Job::after`]) runs a period only once that job closed it: every
/// shard SUCCESS, no correction holding it. Run from the registry ([`run_following`]), it also
/// waits while anything of that job waits in the period.
pub async fn run_once<J: Job>(
    pool: &PgPool,
    job: &J,
    key: JobKey,
    opts: &RunOptions,
    shutdown: &CancellationToken,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<RunReport> {
    run_following(pool, job, None, key, opts, shutdown, on_progress).await
}

/// [`run_once`] of a job that follows `leader` (the job its [`Job::after`] names, as the registry
/// holds it): a period runs only when that job closed it and nothing of it waits there — late
/// items its next run would do, or its upkeep ([`Registered::pending`]), on any shard. Items the
/// leader holds for an operator do not wait for a run: they do not stop the follower.
pub async fn run_following<J: Job>(
    pool: &PgPool,
    job: &J,
    leader: Option<&dyn Registered>,
    key: JobKey,
    opts: &RunOptions,
    shutdown: &CancellationToken,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<RunReport> {
    let span = tracing::info_span!(
        "run",
        job = %key.job_name,
        business_date = %key.business_date,
        shard = key.shard,
        shards = key.shards,
        attempt = tracing::field::Empty,
        owner = %opts.owner,
    );
    run_in_span(
        pool,
        job,
        leader,
        key,
        opts,
        shutdown,
        on_progress,
        span.clone(),
    )
    .instrument(span)
    .await
}

#[allow(clippy::too_many_arguments)]
async fn run_in_span<J: Job>(
    pool: &PgPool,
    job: &J,
    leader: Option<&dyn Registered>,
    key: JobKey,
    opts: &RunOptions,
    shutdown: &CancellationToken,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
    span: tracing::Span,
) -> Result<RunReport> {
    let started = Instant::now();
    if J::MONTHLY {
        key.month()?;
    }
    let params = job.params(&key).map_err(|why| JobError::NoParams {
        key: key.clone(),
        why,
    })?;
    if let Some(before) = job.after() {
        // Only once the job it follows has closed the period: nothing is claimed or written before.
        let within = opts.answer_within();
        let closed = answered(within, async {
            let mut conn = pool.acquire().await?;
            super::due::not_ready(&mut conn, before, leader, key.business_date, key.shards).await
        })
        .await?;
        if let Some(why) = closed {
            // Every refusal that applies is named: a pause of either job too.
            let why = answered(within, async {
                let mut why = why;
                for (name, whose) in [(before, ""), (J::NAME, " itself")] {
                    if let Some(p) = super::pause::of(pool, name).await? {
                        why.push_str(&format!(
                            "; and {name}{whose} is paused since {} by {}: {} (`settlementd resume --job {name}`)",
                            crate::schedule::shown(p.paused_at),
                            p.paused_by,
                            p.reason
                        ));
                    }
                }
                Ok::<_, JobError>(why)
            })
            .await?;
            // Said by the caller: a replica once per change, `run` in its one line.
            tracing::debug!(after = before, "not ready: {why}");
            return Err(JobError::NotReady { key, why });
        }
    }
    let describe = |p: &Params| job.describe(p);
    let stated: Stated = (&params, &describe);
    // From here to the end, a run of this key is in flight in this process under this owner.
    let _in_flight = InFlight::enter(&opts.owner, &key);
    let mut own_dead: Option<i32> = None;
    // One connection carries the run: the claim, every batch, SUCCESS. (The heartbeat takes its own
    // from the pool, and FAILED is written on a fresh one, in case this one is what broke.)
    let mut conn = super::acquire(pool).await?;
    let within = opts.answer_within();
    let mut reopen: Option<(u64, Reopen)> = opts.reopen.clone().map(|r| (0, r));
    let claim = loop {
        let claimed = answered(
            within,
            claim::claim_for(
                &mut conn,
                &key,
                &opts.owner,
                opts.lease_ttl,
                ClaimOptions {
                    force: opts.force,
                    reopen: reopen.as_ref().map(|(_, r)| r),
                    request: opts.request.as_deref(),
                    params: (!params.is_empty()).then_some(stated),
                    correction: opts.correction.as_deref(),
                    own_dead,
                },
            ),
        )
        .await;
        let outcome = claimed.inspect_err(|e| abandon_if_broken(&mut conn, e))?;
        let skip = match outcome {
            ClaimOutcome::Won(claim) => break claim,
            // This process's own attempt, and no run of the key goes on here besides this one:
            // it is over (its final write went unanswered, or its FAILED could not be written),
            // whatever its lease says. Nobody else may hold this owner: take it over at once.
            ClaimOutcome::Held { owner, attempt }
                if (owner == opts.owner.0
                    || crate::mutant::planted(crate::mutant::Mutant::OwnTakeoverOfAPeer))
                    && own_dead.is_none()
                    && InFlight::alone(&opts.owner, &key) =>
            {
                tracing::warn!(
                    holder_attempt = attempt,
                    "the claim is held by this process's own attempt {attempt}, which no run here \
                     carries on: taking it over now instead of waiting out its lease"
                );
                own_dead = Some(attempt);
                continue;
            }
            ClaimOutcome::Held { owner, attempt } => {
                metrics::counter!("settlementd_claims_total", "job_name" => J::NAME, "result" => "lost")
                    .increment(1);
                if owner == opts.owner.0 {
                    tracing::info!(
                        holder_attempt = attempt,
                        "skipped: the claim is held by another run of this process"
                    );
                } else {
                    tracing::info!(holder = %owner, holder_attempt = attempt, "skipped: the claim is held under a lease that has not expired (a live run, or one gone whose lease has not run out)");
                }
                SkipReason::Held
            }
            ClaimOutcome::AlreadyDone { attempt } if reopen.is_none() => {
                let late =
                    answered(within, async { Ok(job.late_items(pool, &key).await?) }).await?;
                if late > 0 {
                    tracing::info!(
                        late,
                        holder_attempt = attempt,
                        "SUCCESS, with items that arrived after it: opening the key again for them"
                    );
                    reopen = Some((late, job.reopen(late)));
                    continue;
                }
                metrics::counter!("settlementd_claims_total", "job_name" => J::NAME, "result" => "done")
                    .increment(1);
                tracing::info!(holder_attempt = attempt, "skipped: already SUCCESS");
                if let Some(request) = &opts.request {
                    // Without force, a settled month is reported as done, not re-run.
                    let detail =
                        format!("already SUCCESS (attempt {attempt}); not re-run without force");
                    requests::finish(
                        &mut *conn,
                        request,
                        key.shard,
                        "succeeded",
                        Some(attempt),
                        Some(&detail),
                    )
                    .await?;
                }
                SkipReason::AlreadyDone
            }
            // Another run re-opened the key and finished it meanwhile.
            ClaimOutcome::AlreadyDone { .. } => SkipReason::AlreadyDone,
            ClaimOutcome::RequestServed => {
                tracing::info!(
                    request = opts.request.as_deref(),
                    "skipped: the request was already served"
                );
                SkipReason::RequestServed
            }
            ClaimOutcome::Conflict { pinned } => {
                if let Some((counter, _)) = job.metrics().conflicts {
                    metrics::counter!(counter.name, "job_name" => J::NAME).increment(1);
                }
                let (pinned, mine) =
                    super::params::describe_difference(&pinned, &params, &describe);
                return Err(JobError::ParamsConflict { key, pinned, mine });
            }
            ClaimOutcome::Paused(pause) => {
                tracing::info!(paused_by = %pause.paused_by, "skipped: the job is paused");
                return Err(pause.into());
            }
            ClaimOutcome::Correcting { correction, since } => {
                tracing::info!(correction = %correction, "skipped: the month is held by an unfinished correction");
                return Err(JobError::BeingCorrected {
                    key,
                    correction,
                    since,
                });
            }
        };
        return Ok(skipped(key, params, skip, started, job.empty_notes()));
    };
    span.record("attempt", claim.attempt);
    let job_name = J::NAME;
    metrics::counter!("settlementd_claims_total", "job_name" => job_name, "result" => "won")
        .increment(1);
    if claim.took_over {
        metrics::counter!("settlementd_takeovers_total", "job_name" => job_name).increment(1);
    }
    let late = reopen.map_or(0, |(late, _)| late);
    tracing::info!(took_over = claim.took_over, resume = %claim.resume, late, params = %describe(&params), "claimed");

    let heartbeat = Heartbeat::spawn(pool.clone(), claim.clone(), opts.heartbeat_every);
    let stops = Stops {
        lost: heartbeat.lost(),
        paused: heartbeat.paused(),
        shutdown,
    };
    let worked = work(pool, &mut conn, job, &claim, opts, stops, on_progress).await;
    heartbeat.stop().await;
    let worked = worked.inspect_err(|e| abandon_if_broken(&mut conn, e));

    let failure = match worked {
        Ok((progress, notes)) => {
            let Progress {
                scanned,
                updated,
                batches,
                ..
            } = progress;
            let noted = job.note_events(&notes);
            for (event, message) in &noted {
                tracing::warn!(event, "done; {message}");
            }
            let marked = answered(within, claim::mark_success(&mut conn, &claim, &noted)).await;
            // Unanswered here, the SUCCESS write may or may not have committed: the row stays as
            // it is (RUNNING, or SUCCESS) and no FAILED is written over it. With the heartbeat
            // stopped, a RUNNING row goes stale after one lease, and the retry that takes it over
            // finds nothing left to settle.
            if !marked.inspect_err(|e| abandon_if_broken(&mut conn, e))? {
                metrics::counter!("settlementd_fencing_rejections_total", "job_name" => job_name)
                    .increment(1);
                events::fencing_rejected(pool, &claim, "SUCCESS").await;
                return Err(lease_lost(&claim));
            }
            tracing::info!(scanned, updated, batches, notes = %in_words(&notes), "SUCCESS");
            return Ok(RunReport {
                key,
                skipped: None,
                attempt: Some(claim.attempt),
                took_over: claim.took_over,
                params,
                late,
                scanned,
                updated,
                notes,
                batches,
                elapsed: started.elapsed(),
            });
        }
        Err(e @ JobError::LeaseLost { .. }) => return Err(e),
        Err(e) => e,
    };
    // Best effort: if this write fails too, the lease expires and a peer takes over.
    match mark_failed(pool, &claim, &failure, opts.heartbeat_every).await {
        Ok(true) => tracing::warn!(error = %failure, "marked FAILED"),
        Ok(false) => {
            // A peer took the claim over while this run was stopped (paused, cut off, its session
            // ended by the server's guards): say that, not the error it met on waking up.
            tracing::warn!(error = %failure, "failed, and the claim was already taken over");
            metrics::counter!("settlementd_fencing_rejections_total", "job_name" => job_name)
                .increment(1);
            events::fencing_rejected(pool, &claim, "FAILED").await;
            return Err(lease_lost(&claim));
        }
        Err(e) => {
            tracing::warn!(error = %failure, mark_error = %e, "failed; could not mark FAILED")
        }
    }
    Err(failure)
}

/// The runs of this process in flight, by owner and key: each from before its claim to its end.
/// A claim held by this process's owner whose key has no run here but the one asking is an attempt
/// of this process that is over though its lease is not ([`ClaimOptions::own_dead`]). The owner
/// names one process (host, pid and a random nonce: [`Owner::for_process`]), so no other process
/// can hold a claim under it.
struct InFlight(Owner, JobKey);

type Runs = std::collections::HashMap<(String, JobKey), usize>;

fn in_flight() -> std::sync::MutexGuard<'static, Runs> {
    static RUNS: std::sync::OnceLock<std::sync::Mutex<Runs>> = std::sync::OnceLock::new();
    RUNS.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl InFlight {
    /// Counts a run of `key` under `owner` until the guard is dropped.
    fn enter(owner: &Owner, key: &JobKey) -> Self {
        *in_flight()
            .entry((owner.0.clone(), key.clone()))
            .or_default() += 1;
        Self(owner.clone(), key.clone())
    }

    /// True when the one run of `key` under `owner` in this process is the caller's.
    fn alone(owner: &Owner, key: &JobKey) -> bool {
        in_flight().get(&(owner.0.clone(), key.clone())).copied() == Some(1)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut runs = in_flight();
        let at = (self.0 .0.clone(), self.1.clone());
        if let Some(n) = runs.get_mut(&at) {
            *n -= 1;
            if *n == 0 {
                runs.remove(&at);
            }
        }
    }
}

/// Writes FAILED with `failure`. After a connection stopped answering, on a new connection given
/// one heartbeat period: the pool's idle connections may be as dead, and the pool pings one before
/// handing it out, for as long as its acquire timeout, which the run's end would wait out.
async fn mark_failed(
    pool: &PgPool,
    claim: &claim::Claim,
    failure: &JobError,
    within: Duration,
) -> Result<bool> {
    let error = match failure {
        // Left like a run stopped by a shutdown: FAILED, taken over at once once resumed.
        // `interrupted: paused by WHO: WHY; this run stopped after …`: no time in it (the pause
        // has its own, shown in the reader's zone), so the trail never mixes zones.
        JobError::Paused {
            by, reason, wrote, ..
        } => format!(
            "{} by {by}: {reason}{}",
            claim::PAUSED_MARK,
            wrote.as_ref().map(|w| w.words()).unwrap_or_default()
        ),
        _ => failure.to_string(),
    };
    if !matches!(failure, JobError::Unanswered { .. }) {
        let mut conn = super::acquire(pool).await?;
        return claim::mark_failed(&mut conn, claim, &error).await;
    }
    let fresh = async {
        let mut conn = PgConnection::connect_with(&pool.connect_options()).await?;
        let marked = claim::mark_failed(&mut conn, claim, &error).await;
        let _ = conn.close().await;
        marked
    };
    answered(within, fresh).await
}

/// What stops a run between batches: its claim taken over, its job paused, the process shutting
/// down.
struct Stops<'a> {
    lost: &'a CancellationToken,
    paused: &'a CancellationToken,
    shutdown: &'a CancellationToken,
}

async fn work<J: Job>(
    pool: &PgPool,
    conn: &mut PgConnection,
    job: &J,
    claim: &claim::Claim,
    opts: &RunOptions,
    stops: Stops<'_>,
    on_progress: &(dyn Fn(Progress) + Send + Sync),
) -> Result<(Progress, Notes)> {
    let (plan, total) = job.plan(pool, claim, opts.estimate).await?;
    let mut progress = Progress {
        total,
        ..Progress::default()
    };
    on_progress(progress);
    let mut notes = job.empty_notes();
    let mut cursor = claim.resume;
    let begin = format!("BEGIN; {}; {}", opts.guards.sql(), job.batch_settings());
    let job_name = J::NAME;
    let amounts = job.metrics().amount;
    let business_date = claim.key.business_date.to_string();
    loop {
        if stops.lost.is_cancelled() {
            return Err(lease_lost(claim));
        }
        if stops.shutdown.is_cancelled() {
            return Err(JobError::Interrupted);
        }
        if stops.paused.is_cancelled() {
            let pause = super::pause::of(pool, job_name).await?;
            if let Some(pause) = pause {
                return Err(paused(pause, &progress));
            }
        }
        // The batch's own progress write says whether the job was paused before it: a pause
        // committed before that statement rolls the batch back, so once `pause` has returned no
        // batch of the job commits but those already past it.
        let batch = answered(opts.answer_within(), async {
            let mut tx = conn.begin_with(begin.clone()).await?;
            let batch = job.run_batch(&mut tx, &plan, cursor).await?;
            match claim::record_batch(&mut tx, claim, &batch).await? {
                Recorded::Lost if !mutant::planted(Mutant::FenceOff) => {
                    tx.rollback().await?;
                    return Ok(Committed::Lost);
                }
                Recorded::Paused => {
                    tx.rollback().await?;
                    return Ok(Committed::Paused);
                }
                Recorded::Written | Recorded::Lost => {}
            }
            tx.commit().await?;
            Ok(Committed::Batch(batch))
        })
        .await?;
        let batch = match batch {
            Committed::Batch(batch) => batch,
            Committed::Lost => {
                metrics::counter!("settlementd_fencing_rejections_total", "job_name" => job_name)
                    .increment(1);
                events::fencing_rejected(pool, claim, "batch").await;
                return Err(lease_lost(claim));
            }
            // Resumed meanwhile: the batch is done again from the same cursor.
            Committed::Paused => match super::pause::of(pool, job_name).await? {
                Some(pause) => return Err(paused(pause, &progress)),
                None => continue,
            },
        };
        progress.scanned += batch.scanned;
        progress.updated += batch.updated;
        progress.batches += 1;
        add_notes(&mut notes, &batch.notes);
        metrics::counter!("settlementd_rows_scanned_total", "job_name" => job_name)
            .increment(batch.scanned);
        metrics::counter!("settlementd_rows_updated_total", "job_name" => job_name)
            .increment(batch.updated);
        if let Some(amount) = amounts {
            metrics::counter!(amount.name, "job_name" => job_name, "business_date" => business_date.clone())
                .increment(batch.amount);
        }
        on_progress(progress);
        cursor = batch.cursor;
        if batch.done {
            return Ok((progress, notes));
        }
    }
}

/// A run's notes for its log line: `name=count` for each, the ids named after the count
/// (`held=2 [17, 23]`), so that a log reader, text or JSON, gets plain words.
fn in_words(notes: &super::Notes) -> String {
    notes
        .iter()
        .map(|(name, noted)| match &noted.ids {
            Some(ids) if !ids.is_empty() => {
                let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
                format!("{name}={} [{}]", noted.count, ids.join(", "))
            }
            _ => format!("{name}={}", noted.count),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a batch's transaction ended with.
enum Committed {
    Batch(Batch),
    /// Rolled back: the claim was taken over.
    Lost,
    /// Rolled back: the job was paused before the batch's progress write.
    Paused,
}

/// The error of a run stopped by `pause` after `progress`.
fn paused(pause: super::pause::Pause, progress: &Progress) -> JobError {
    let mut stopped = JobError::from(pause);
    if let JobError::Paused { wrote, .. } = &mut stopped {
        *wrote = Some(super::Wrote {
            batches: progress.batches,
            updated: progress.updated,
        });
    }
    stopped
}

fn lease_lost(claim: &claim::Claim) -> JobError {
    JobError::LeaseLost {
        key: claim.key.clone(),
        attempt: claim.attempt,
    }
}

fn skipped(
    key: JobKey,
    params: Params,
    reason: SkipReason,
    started: Instant,
    notes: Notes,
) -> RunReport {
    RunReport {
        key,
        skipped: Some(reason),
        attempt: None,
        took_over: false,
        params,
        late: 0,
        scanned: 0,
        updated: 0,
        notes,
        batches: 0,
        elapsed: started.elapsed(),
    }
}
