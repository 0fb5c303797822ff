//! The operational endpoints: `GET /healthz` (200 while the process runs), `GET /readyz` (200
//! when the replica can settle what it is asked to, else 503 with the reason: see
//! [`crate::daemon::health`]) and `GET /metrics` (Prometheus text, with `settlementd_ready`
//! re-evaluated at every scrape).

use super::HttpState;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;

pub async fn healthz() -> &'static str {
    "ok\n"
}

pub async fn readyz(State(state): State<HttpState>) -> (StatusCode, String) {
    match crate::daemon::health::evaluate(&state.pool, &state.health).await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        ),
    }
}

pub async fn render_metrics(State(state): State<HttpState>) -> impl IntoResponse {
    // A scrape sees readiness even where nothing probes /readyz (compose, systemd).
    let _ = crate::daemon::health::evaluate(&state.pool, &state.health).await;
    // Without the exporter's own listener nothing else drains histograms: do it per scrape.
    state.metrics.run_upkeep();
    crate::daemon::metrics::sample(&state.pool);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
