//! The replica's HTTP endpoints: `GET /healthz` (200 while the process runs), `GET /readyz` (200
//! when the database answers and every migration is applied, else 503) and `GET /metrics`
//! (Prometheus text).

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// How long `/readyz` waits for the database before answering 503.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
struct AppState {
    pool: PgPool,
    metrics: PrometheusHandle,
}

pub fn router(pool: PgPool, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render_metrics))
        .with_state(AppState { pool, metrics })
}

/// Serves the endpoints on `listener` until `shutdown` completes.
pub async fn run(
    listener: TcpListener,
    pool: PgPool,
    metrics: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(pool, metrics))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, String) {
    match tokio::time::timeout(READY_TIMEOUT, crate::db::schema_is_current(&state.pool)).await {
        Ok(Ok(true)) => (StatusCode::OK, "ready\n".into()),
        Ok(Ok(false)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: database schema is not current (run migrations)\n".into(),
        ),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {e}\n")),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the database did not answer in time\n".into(),
        ),
    }
}

async fn render_metrics(State(state): State<AppState>) -> impl IntoResponse {
    // Without the exporter's own listener nothing else drains histograms: do it per scrape.
    state.metrics.run_upkeep();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
