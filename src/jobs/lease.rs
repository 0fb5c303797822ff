//! Heartbeat: keeps a claim's lease alive while a run works, and says when it is lost.
//!
//! The heartbeat runs on its own pooled connection, so a long batch never starves it. When a renewal
//! finds the claim gone (taken over after a stall), it cancels [`Heartbeat::lost`]; the runner
//! checks that token between batches, and the fence inside each batch catches the rest.

use super::claim::{self, Claim};
use super::{abandon_if_unanswered, answered};
use sqlx::PgPool;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub struct Heartbeat {
    lost: CancellationToken,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Heartbeat {
    pub fn spawn(pool: PgPool, claim: Claim, every: Duration) -> Self {
        let lost = CancellationToken::new();
        let stop = CancellationToken::new();
        let task = tokio::spawn(renew(pool, claim, every, lost.clone(), stop.clone()));
        Self { lost, stop, task }
    }

    /// Cancelled once a renewal finds the claim taken over.
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Stops renewing and waits for the task, so no renewal races the final status write.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

async fn renew(
    pool: PgPool,
    claim: Claim,
    every: Duration,
    lost: CancellationToken,
    stop: CancellationToken,
) {
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
            Ok(true) => tracing::debug!("heartbeat renewed"),
            Ok(false) => {
                tracing::warn!("heartbeat found the claim taken over; stopping the run");
                metrics::counter!("settlementd_fencing_rejections_total").increment(1);
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

/// One renewal, given one period to answer, getting a pooled connection included: a renewal stuck
/// on a half-open connection (or on the pool's ping of one) would otherwise hold the heartbeat,
/// and [`Heartbeat::stop`] with it, for as long as `database.acquire_timeout_secs` or forever. A
/// connection that did not answer is closed, not returned to the pool (which would ping it first,
/// without end).
async fn renew_once(pool: &PgPool, claim: &Claim, within: Duration) -> super::Result<bool> {
    let deadline = tokio::time::Instant::now() + within;
    let mut conn = answered(within, super::acquire(pool)).await?;
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let renewed = answered(left, claim::heartbeat(&mut *conn, claim)).await;
    renewed.inspect_err(|e| abandon_if_unanswered(&mut conn, e))
}
