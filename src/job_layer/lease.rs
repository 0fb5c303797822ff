//! Heartbeat: keeps a claim's lease alive while a run works, and says when it is lost or its job
//! paused; and the server-side guards every batch transaction carries ([`Guards`]).
//!
//! The heartbeat runs on its own pooled connection, so a long batch never starves it. When a renewal
//! finds the claim gone (taken over after a stall), it cancels [`Heartbeat::lost`]; the runner
//! checks that token between batches, and the fence inside each batch catches the rest. When it
//! finds the job paused ([`super::pause`]), it cancels [`Heartbeat::paused`]: the run stops after
//! its batch.

use super::claim::{self, Claim};
use super::{abandon_if_broken, answered};
use sqlx::PgPool;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Server-side limits of every batch transaction, derived from the lease (`SET LOCAL`, so they end
/// with the transaction, also through a pooler): a writer frozen inside a batch has its session
/// ended by the server after `idle_in_transaction` (its batch rolls back, its locks go) before any
/// peer can take its claim over; a batch waits at most `lock_timeout` for a row lock and runs a
/// statement at most `statement_timeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guards {
    pub idle_in_transaction: Duration,
    pub lock_timeout: Duration,
    pub statement_timeout: Duration,
}

impl Guards {
    /// The `SET LOCAL` statements, `;`-separated.
    pub fn sql(&self) -> String {
        format!(
            "SET LOCAL idle_in_transaction_session_timeout = {};
    SET LOCAL lock_timeout = {};
    SET LOCAL statement_timeout = {}",
            self.idle_in_transaction.as_millis(),
            self.lock_timeout.as_millis(),
            self.statement_timeout.as_millis()
        )
    }
}

pub struct Heartbeat {
    lost: CancellationToken,
    paused: CancellationToken,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Heartbeat {
    pub fn spawn(pool: PgPool, claim: Claim, every: Duration) -> Self {
        let lost = CancellationToken::new();
        let paused = CancellationToken::new();
        let stop = CancellationToken::new();
        // In the run's span: its lines carry the run's job, business date, shard and attempt.
        let task = tokio::spawn(
            renew(
                pool,
                claim,
                every,
                Tokens {
                    lost: lost.clone(),
                    paused: paused.clone(),
                    stop: stop.clone(),
                },
            )
            .instrument(tracing::Span::current()),
        );
        Self {
            lost,
            paused,
            stop,
            task,
        }
    }

    /// Cancelled once a renewal finds the claim taken over.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Cancelled once a renewal finds the job paused.
    pub fn paused(&self) -> &CancellationToken {
        &self.paused
    }

    /// Stops renewing and waits for the task, so no renewal races the final status write.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// What a renewal tells the run.
struct Tokens {
    lost: CancellationToken,
    paused: CancellationToken,
    stop: CancellationToken,
}

async fn renew(pool: PgPool, claim: Claim, every: Duration, tokens: Tokens) {
    let Tokens { lost, paused, stop } = tokens;
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        // Stopping does not wait for a renewal in flight: on a connection that stopped answering
        // it would take a whole period, which the run's end would wait out.
        let renewed = tokio::select! {
            _ = stop.cancelled() => return,
            renewed = renew_once(&pool, &claim, every) => renewed,
        };
        match renewed {
            Ok(Renewed::Paused) => {
                tracing::info!("heartbeat found the job paused; stopping the run after its batch");
                paused.cancel();
            }
            Ok(Renewed::Yes) => tracing::debug!("heartbeat renewed"),
            Ok(Renewed::Lost) => {
                tracing::warn!("heartbeat found the claim taken over; stopping the run");
                metrics::counter!("settlementd_fencing_rejections_total", "job_name" => claim.key.job_name.clone())
                    .increment(1);
                super::events::fencing_rejected(&pool, &claim, "heartbeat").await;
                lost.cancel();
                return;
            }
            // A passing database error: the next tick tries again. If it lasts longer than the
            // lease, a peer takes over and the fence stops this run's next batch.
            Err(e) => tracing::warn!(error = %e, "heartbeat failed; retrying at the next tick"),
        }
    }
}

/// What a renewal found.
enum Renewed {
    Yes,
    /// Renewed, and the job is paused.
    Paused,
    /// The claim is gone.
    Lost,
}

/// One renewal, given one period to answer, getting a pooled connection included: a renewal stuck
/// on a half-open connection (or on the pool's ping of one) would otherwise hold the heartbeat,
/// and [`Heartbeat::stop`] with it, for as long as `database.acquire_timeout_secs` or forever. A
/// connection that did not answer is closed, not returned to the pool (which would ping it first,
/// without end).
async fn renew_once(pool: &PgPool, claim: &Claim, within: Duration) -> super::Result<Renewed> {
    let deadline = tokio::time::Instant::now() + within;
    let mut conn = answered(within, super::acquire(pool)).await?;
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let renewed = answered(left, claim::heartbeat(&mut *conn, claim)).await;
    let renewed = renewed.inspect_err(|e| abandon_if_broken(&mut conn, e))?;
    Ok(match renewed {
        None => Renewed::Lost,
        Some(true) => Renewed::Paused,
        Some(false) => Renewed::Yes,
    })
}
