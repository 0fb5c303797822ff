//! The runs API: manual runs over HTTP, applied once however often the request is retried.
//!
//! `POST /v1/runs` with `Authorization: Bearer <http.admin_token>`, `Idempotency-Key: <key>` and
//! `{"job": "fine-settlement", "business_date": "YYYY-MM-DD", "shards": M, "shard": N, "force":
//! true}` — or `"from": "YYYY-MM", "to": "YYYY-MM"` instead of `business_date`, a range run month
//! by month — stores the request under the key ([`crate::job_layer::requests::store`]) before answering
//! `202`; replicas serving the targeted shards run it ([`crate::daemon::replica`]). `job` defaults
//! to the registry's first job. The key comes from the client's business request
//! (a retry sends the same key): the same key with the same body, at once or days later, to any
//! replica, gets the first answer byte for byte with `Idempotent-Replayed: true`; with another
//! body, `422`. `GET /v1/runs/{id}` shows the request and each targeted shard's state.
//!
//! Errors are `{"error": "…"}`: `403` when no token is configured, `401` for a missing or wrong
//! token, `400` for a bad key or body (nothing stored), `404` for an unknown request, `503` when
//! the database does not answer.

use super::HttpState;
use crate::app::ensure_month_is_over;
use crate::calendar::BusinessDate;
use crate::daemon::metrics as m;
use crate::job_layer::requests::{self, NewRequest, Stored, StoredRequest};
use crate::job_layer::JobKey;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::SecondsFormat;
use secrecy::ExposeSecret;
use subtle::ConstantTimeEq;

/// The most shards a request may name (a guard against typos like 30000).
pub const MAX_SHARDS: u32 = 1024;
/// The longest idempotency key accepted.
pub const MAX_KEY_LEN: usize = 200;

/// The body of `POST /v1/runs`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    job: Option<String>,
    business_date: Option<String>,
    from: Option<String>,
    to: Option<String>,
    shards: Option<u32>,
    shard: Option<u32>,
    force: Option<bool>,
}

pub async fn create(State(state): State<HttpState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = authorize(&state, &headers) {
        return refused;
    }
    let key = match idempotency_key(&headers) {
        Ok(key) => key,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let request = match parse(&state, key, &body) {
        Ok(request) => request,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let stored = async {
        let mut conn = state.pool.acquire().await?;
        requests::store(&mut conn, &request, &state.owner, response_body).await
    }
    .await;
    match stored {
        Ok(Stored::New(stored)) => {
            metrics::counter!(m::REQUESTS_ACCEPTED_TOTAL).increment(1);
            tracing::info!(
                request_id = %stored.request_id,
                job = %stored.job_name,
                business_date = %stored.business_date,
                range_to = stored.range_to.map(tracing::field::display),
                shards = stored.shards,
                shard = stored.shard,
                force = stored.force,
                "run request accepted"
            );
            accepted(&stored, false)
        }
        Ok(Stored::Replay(stored)) => accepted(&stored, true),
        Ok(Stored::Conflict(stored)) => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "Idempotency-Key {:?} was already used for another request ({}); use a new key \
                 for a new request",
                stored.idempotency_key, stored.request_id
            ),
        ),
        Err(e) => unavailable(e),
    }
}

/// `POST /v1/runs/dry-run`: the body of `POST /v1/runs`, checked the same way, answered `200`
/// with `{"dry_runs": [...]}`, one `run --dry-run --json` object per month (every shard of the
/// count, or `shard`): what the run would write, written nowhere ([`crate::job_layer::dry`]). Stores
/// nothing, so it needs no `Idempotency-Key`.
pub async fn dry_run(State(state): State<HttpState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = authorize(&state, &headers) {
        return refused;
    }
    let request = match parse(&state, "dry-run".into(), &body) {
        Ok(request) => request,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let Ok(job) = state.registry.get(&request.job_name) else {
        return error(StatusCode::BAD_REQUEST, "job: unknown".into());
    };
    let months = || -> Result<Vec<BusinessDate>, crate::calendar::CalendarError> {
        let first = BusinessDate::new(request.business_date)?;
        let dates = match request.to {
            None => vec![first.date()],
            Some(to) => crate::calendar::months_between(first, BusinessDate::new(to)?),
        };
        dates.into_iter().map(BusinessDate::new).collect()
    };
    let months = match months() {
        Ok(months) => months,
        Err(e) => return error(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let shards: Vec<u32> = match request.shard {
        Some(shard) => vec![shard],
        None => (0..request.shards).collect(),
    };
    let found = crate::app::dry_months(
        &state.settings,
        &state.pool,
        job.as_ref(),
        &months,
        request.shards,
        &shards,
        request.force,
    )
    .await;
    match found {
        Ok(dry) => {
            let body: Vec<serde_json::Value> = dry.iter().map(|d| d.to_json()).collect();
            json(
                StatusCode::OK,
                serde_json::json!({ "dry_runs": body }).to_string(),
            )
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

pub async fn show(
    State(state): State<HttpState>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(refused) = authorize(&state, &headers) {
        return refused;
    }
    let found = async {
        let Some(stored) = requests::by_id(&state.pool, &id).await? else {
            return Ok(None);
        };
        let targets = requests::targets(&state.pool, &stored.request_id).await?;
        let mut months = Vec::new();
        for (month, child) in requests::months_of(&state.pool, &stored.request_id).await? {
            months.push(serde_json::json!({
                "business_date": month.to_string(),
                "request_id": child,
                "shards": requests::targets(&state.pool, &child).await?,
            }));
        }
        Ok(Some((stored, targets, months)))
    }
    .await;
    match found {
        Ok(Some((stored, targets, months))) => {
            let request: serde_json::Value =
                serde_json::from_str(&stored.response).unwrap_or(serde_json::Value::Null);
            let body = match stored.range_to {
                None => serde_json::json!({ "request": request, "shards": targets }),
                Some(_) => serde_json::json!({ "request": request, "months": months }),
            };
            json(StatusCode::OK, body.to_string())
        }
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no run request {id:?}")),
        Err(e) => unavailable(e),
    }
}

/// `Ok` when a token is configured and the request carries it. The comparison takes the same time
/// whatever the bytes (`subtle`), so the token cannot be guessed byte by byte; it is never logged.
#[allow(clippy::result_large_err)]
pub(super) fn authorize(state: &HttpState, headers: &HeaderMap) -> Result<(), Response> {
    let Some(token) = &state.settings.http.admin_token else {
        return Err(error(
            StatusCode::FORBIDDEN,
            "the runs API is disabled: set http.admin_token_file (a file holding the token) or \
             http.admin_token (SETTLEMENTD__HTTP__ADMIN_TOKEN)"
                .into(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(token.expose_secret().as_bytes())) {
        return Ok(());
    }
    metrics::counter!(m::AUTH_REFUSED_TOTAL).increment(1);
    let mut refused = error(
        StatusCode::UNAUTHORIZED,
        "missing or wrong bearer token (Authorization: Bearer <http.admin_token>)".into(),
    );
    refused
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    Err(refused)
}

/// The `Idempotency-Key` header: 1 to [`MAX_KEY_LEN`] visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<String, String> {
    let Some(value) = headers.get("idempotency-key") else {
        return Err(
            "the Idempotency-Key header is required: a key from your business request \
                    (e.g. \"settle-2026-10-all-shards\"), the same on every retry"
                .into(),
        );
    };
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > MAX_KEY_LEN || !bytes.iter().all(u8::is_ascii_graphic) {
        return Err(format!(
            "Idempotency-Key must be 1 to {MAX_KEY_LEN} visible ASCII characters"
        ));
    }
    Ok(String::from_utf8_lossy(bytes).into_owned())
}

/// Checks the body as the command line checks `run`: a job of the registry, a month end (or a
/// range of months) whose months are over and covered by the job's configuration, a shard count
/// and shard in range. Nothing is stored when this fails.
fn parse(state: &HttpState, idempotency_key: String, body: &[u8]) -> Result<NewRequest, String> {
    let body: Body =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    let job_name = body.job.as_deref().unwrap_or(crate::jobs::default_job());
    let job = state
        .registry
        .get(job_name)
        .map_err(|why| format!("job: {why}"))?;
    let (first, last) = match (&body.business_date, &body.from, &body.to) {
        (Some(date), None, None) => {
            let date = BusinessDate::parse(date).map_err(|e| e.to_string())?;
            (date, None)
        }
        (None, Some(from), Some(to)) => {
            let from = BusinessDate::from_month(from).map_err(|e| format!("from: {e}"))?;
            let to = BusinessDate::from_month(to).map_err(|e| format!("to: {e}"))?;
            if to < from {
                return Err(format!("to {to} is before from {from}"));
            }
            (from, Some(to))
        }
        _ => {
            return Err(
                "give either business_date (YYYY-MM-DD) or from and to (YYYY-MM), not both".into(),
            )
        }
    };
    let shards = body.shards.unwrap_or(state.settings.shard.count);
    if !(1..=MAX_SHARDS).contains(&shards) {
        return Err(format!(
            "shards must be between 1 and {MAX_SHARDS}, got {shards}"
        ));
    }
    if let Some(shard) = body.shard {
        if shard >= shards {
            return Err(format!(
                "shard must satisfy 0 <= shard < shards ({shards}), got {shard}"
            ));
        }
    }
    let months = match last {
        None => vec![first.date()],
        Some(last) => crate::calendar::months_between(first, last),
    };
    for month in &months {
        let month = BusinessDate::new(*month).map_err(|e| e.to_string())?;
        ensure_month_is_over(month, &state.settings, state.clock.as_ref())
            .map_err(|e| e.to_string())?;
        let key = JobKey {
            job_name: job.name().to_string(),
            business_date: month.date(),
            shards,
            shard: body.shard.unwrap_or(0),
        };
        job.params(&key).map_err(|why| format!("{month}: {why}"))?;
    }
    Ok(NewRequest {
        idempotency_key,
        job_name: job.name().to_string(),
        business_date: first.date(),
        to: last.map(|l| l.date()),
        shards,
        shard: body.shard,
        force: body.force.unwrap_or(false),
    })
}

/// The `202` body, built once and stored with the request.
fn response_body(stored: &StoredRequest) -> String {
    let mut body = serde_json::json!({
        "request_id": stored.request_id,
        "idempotency_key": stored.idempotency_key,
        "job": stored.job_name,
        "business_date": stored.business_date.to_string(),
        "shards": stored.shards,
        "shard": stored.shard,
        "force": stored.force,
        "created_at": stored.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        "status_url": status_url(&stored.request_id),
    });
    if let Some(to) = stored.range_to {
        // A range: the first and last months, instead of one business date.
        body["from"] = stored.business_date.format("%Y-%m").to_string().into();
        body["to"] = to.format("%Y-%m").to_string().into();
    }
    body.to_string()
}

fn status_url(request_id: &str) -> String {
    format!("/v1/runs/{request_id}")
}

fn accepted(stored: &StoredRequest, replayed: bool) -> Response {
    let mut response = json(StatusCode::ACCEPTED, stored.response.clone());
    let headers = response.headers_mut();
    if let Ok(location) = HeaderValue::from_str(&status_url(&stored.request_id)) {
        headers.insert(header::LOCATION, location);
    }
    if replayed {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

pub(super) fn unavailable(e: crate::job_layer::JobError) -> Response {
    tracing::warn!(error = %e, "runs API: database error");
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("the database did not answer: {e}; retry with the same Idempotency-Key"),
    )
}

pub(super) fn error(status: StatusCode, message: String) -> Response {
    json(status, serde_json::json!({ "error": message }).to_string())
}

pub(super) fn json(status: StatusCode, body: String) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}
