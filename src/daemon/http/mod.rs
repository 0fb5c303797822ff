//! The replica's HTTP server: one router, one file per group of endpoints.
//!
//! - [`probes`]: `GET /healthz`, `GET /readyz`, `GET /metrics` (no token);
//! - [`runs`]: `POST /v1/runs`, `GET /v1/runs/{id}` — manual runs, applied once however often a
//!   request is retried (bearer token, idempotency key); `POST /v1/runs/dry-run` — what such a
//!   run would write, written nowhere (bearer token);
//! - [`pause`]: `POST /v1/pause`, `POST /v1/resume` — a job, or every job, paused everywhere
//!   (bearer token);
//! - [`status`]: `GET /status` — the months and shards at a glance, an HTML page (no token;
//!   `http.status_page = false` turns it off).
//!
//! Handlers are thin: parse and check the request, call the job layer, render. What they share is
//! [`HttpState`]. What bounds a client's hold on the port (timeouts, the connection cap) is
//! [`server`].

pub mod pause;
pub mod probes;
pub mod runs;
pub mod server;
pub mod status;

use crate::clock::Clock;
use crate::config::Settings;
use axum::routing::{get, post};
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;

/// What every handler may use.
#[derive(Clone)]
pub struct HttpState {
    pub pool: PgPool,
    pub metrics: PrometheusHandle,
    pub settings: Arc<Settings>,
    /// Decides whether a requested month is over (the schedule's zone, this clock).
    pub clock: Arc<dyn Clock>,
    /// The replica's owner name, written into the audit trail of the requests it accepts.
    pub owner: String,
    /// Reads the status page's data, on its own small pool, and keeps closed months' totals.
    pub overview: Arc<crate::overview::Reader>,
    /// The jobs of the binary: the runs API and the page serve each.
    pub registry: crate::job_layer::registry::Registry,
    /// What the replicas found at their latest look: `/readyz` and `/metrics` read it.
    pub health: Arc<crate::daemon::health::Health>,
}

pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(probes::healthz))
        .route("/readyz", get(probes::readyz))
        .route("/metrics", get(probes::render_metrics))
        .route("/v1/runs", post(runs::create))
        .route("/v1/runs/dry-run", post(runs::dry_run))
        .route("/v1/runs/{id}", get(runs::show))
        .route("/v1/pause", post(pause::pause))
        .route("/v1/resume", post(pause::resume))
        .route("/status", get(status::page))
        .with_state(state)
}

/// Serves the endpoints on `listener` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    state: HttpState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = server::Limits::of(&state.settings.http);
    server::serve(listener, router(state), limits, shutdown).await
}
