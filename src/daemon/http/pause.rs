//! `POST /v1/pause` and `POST /v1/resume`: `settlementd pause` and `resume` over HTTP, with the
//! runs API's bearer token.
//!
//! `POST /v1/pause` with `{"job": "NAME", "reason": "…", "by": "alice"}` (`job` absent: every
//! job; `by` optional, who asks) answers `200` with the pauses in force; `POST /v1/resume` with
//! `{"job": "NAME", "by": "alice"}` (or `{}`) answers `200` with what it resumed. Each pause and
//! resume is kept in `job_events` with who, why and when. Both are idempotent by nature: pausing a paused job keeps its first pause,
//! resuming a running one changes nothing. Errors are `{"error": "…"}` as for the runs API.

use super::runs::{authorize, error, json, unavailable};
use super::HttpState;
use crate::job_layer::pause;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    job: Option<String>,
    reason: String,
    /// Who asks (recorded with the pause and in `job_events`); the token alone names nobody.
    by: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    job: Option<String>,
    by: Option<String>,
}

/// The longest `by` accepted.
const MAX_BY_LEN: usize = 200;

/// Who asked, as recorded: the body's `by` (1 to 200 characters, trimmed) with the endpoint and
/// the replica that took it; without one, "an unnamed client of the token".
fn asked_by(by: Option<&str>, endpoint: &str, owner: &str) -> Result<String, String> {
    let who = match by.map(str::trim) {
        None => "an unnamed client of the token",
        Some(by) if by.is_empty() || by.len() > MAX_BY_LEN || by.chars().any(char::is_control) => {
            return Err(format!(
                "by must name who asks, in 1 to {MAX_BY_LEN} printable characters"
            ))
        }
        Some(by) => by,
    };
    Ok(format!("{who} (POST {endpoint} on {owner})"))
}

/// The jobs a body names: that one, or every job.
fn targets(state: &HttpState, job: Option<&str>) -> Result<Vec<&'static str>, String> {
    match job {
        Some(name) => Ok(vec![state.registry.get(name)?.name()]),
        None => Ok(state.registry.names()),
    }
}

pub async fn pause(State(state): State<HttpState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = authorize(&state, &headers) {
        return refused;
    }
    let body: PauseBody = match serde_json::from_slice(&body) {
        Ok(body) => body,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            )
        }
    };
    let reason = match pause::check_reason(&body.reason) {
        Ok(reason) => reason.to_string(),
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let jobs = match targets(&state, body.job.as_deref()) {
        Ok(jobs) => jobs,
        Err(why) => return error(StatusCode::BAD_REQUEST, format!("job: {why}")),
    };
    let by = match asked_by(body.by.as_deref(), "/v1/pause", &state.owner) {
        Ok(by) => by,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let mut paused = Vec::new();
    for job in jobs {
        match pause::pause(&state.pool, job, &by, &reason).await {
            Ok(p) => {
                tracing::warn!(job, paused_by = %p.paused_by, reason = %p.reason, "job paused");
                paused.push(p);
            }
            Err(e) => return unavailable(e),
        }
    }
    json(
        StatusCode::OK,
        serde_json::json!({ "paused": paused }).to_string(),
    )
}

pub async fn resume(State(state): State<HttpState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = authorize(&state, &headers) {
        return refused;
    }
    let body: ResumeBody = if body.is_empty() {
        ResumeBody::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(body) => body,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!("invalid request body: {e}"),
                )
            }
        }
    };
    let jobs = match targets(&state, body.job.as_deref()) {
        Ok(jobs) => jobs,
        Err(why) => return error(StatusCode::BAD_REQUEST, format!("job: {why}")),
    };
    let by = match asked_by(body.by.as_deref(), "/v1/resume", &state.owner) {
        Ok(by) => by,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let mut resumed = Vec::new();
    for job in jobs {
        match pause::resume(&state.pool, job, &by).await {
            Ok(ended) => {
                if ended.is_some() {
                    tracing::info!(job, resumed_by = %by, "job resumed");
                }
                resumed.push(serde_json::json!({ "job": job, "was_paused": ended }));
            }
            Err(e) => return unavailable(e),
        }
    }
    json(
        StatusCode::OK,
        serde_json::json!({ "resumed": resumed }).to_string(),
    )
}
