//! The operational endpoints: `GET /healthz` (200 while the process runs), `GET /readyz` (200
//! when the database answers, takes writes and every migration is applied, else 503) and `GET /metrics`
//! (Prometheus text, with `settlementd_ready` re-evaluated at every scrape).

use super::HttpState;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use sqlx::PgPool;
use std::time::Duration;

/// How long `/readyz` waits for the database before answering 503.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn healthz() -> &'static str {
    "ok\n"
}

pub async fn readyz(State(state): State<HttpState>) -> (StatusCode, String) {
    match check_ready(&state.pool).await {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        ),
    }
}

/// The database answers within [`READY_TIMEOUT`], takes writes, and every migration is applied.
/// Also sets the `settlementd_ready` gauge, so the metric is as fresh as the last probe or scrape.
async fn check_ready(pool: &PgPool) -> Result<(), String> {
    let ready = async {
        crate::db::writable(pool).await?;
        crate::db::schema_is_current(pool).await
    };
    let result = match tokio::time::timeout(READY_TIMEOUT, ready).await {
        Ok(Ok(true)) => Ok(()),
        Ok(Ok(false)) => Err("database schema is not current (run migrations)".to_string()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("the database did not answer in time".to_string()),
    };
    metrics::gauge!(crate::daemon::metrics::READY).set(if result.is_ok() { 1.0 } else { 0.0 });
    result
}

pub async fn render_metrics(State(state): State<HttpState>) -> impl IntoResponse {
    // A scrape sees readiness even where nothing probes /readyz (compose, systemd).
    let _ = check_ready(&state.pool).await;
    // Without the exporter's own listener nothing else drains histograms: do it per scrape.
    state.metrics.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
