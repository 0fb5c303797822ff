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
//! the database does not answer. The dry run is bounded ([`dry_run`]): `400` past its caps, `415`
//! for a body declared as anything but JSON, `503` past its share of the request timeout.

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
use std::time::Duration;
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

/// The most months one dry run answers.
pub const MAX_DRY_MONTHS: usize = 12;
/// The most shard objects one dry run answers: months × shards (one month of 1,024 shards, or 12
/// months of 85). Each is a few kilobytes in memory while the answer is built: the cap keeps a
/// replica's growth for any request far below its 256 MiB limit (`tests/it/http_limits.rs`
/// measures it), and its time within the request timeout on a big library.
pub const MAX_DRY_SHARD_MONTHS: usize = 1024;

/// `POST /v1/runs/dry-run`: the body of `POST /v1/runs`, checked the same way, answered `200`
/// with `{"dry_runs": [...]}`, one `run --dry-run --json` object per month (every shard of the
/// count, or `shard`): what the run would write, written nowhere ([`crate::job_layer::dry`]). Stores
/// nothing, so it needs no `Idempotency-Key`.
///
/// Bounded: a JSON body only (another declared `Content-Type` is `415`); at most
/// [`MAX_DRY_MONTHS`] months and [`MAX_DRY_SHARD_MONTHS`] shards × months (`400` naming both); and
/// done within the request timeout, less a margin to answer ([`dry_budget`]): past it the server
/// cancels the statement in flight and the answer is `503` saying so.
pub async fn dry_run(State(state): State<HttpState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(refused) = authorize(&state, &headers) {
        return refused;
    }
    if let Err(refused) = json_only(&headers) {
        return refused;
    }
    let request = match parse(&state, "dry-run".into(), &body) {
        Ok(request) => request,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let Ok(job) = state.registry.get(&request.job_name) else {
        return error(StatusCode::BAD_REQUEST, "job: unknown".into());
    };
    let asked_months = request
        .to
        .map_or(1, |to| months_from_to(request.business_date, to));
    let asked_shards = if request.shard.is_some() {
        1
    } else {
        request.shards as usize
    };
    if let Err(why) = within_dry_caps(asked_months, asked_shards) {
        return error(StatusCode::BAD_REQUEST, why);
    }
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
    let budget = dry_budget(Duration::from_secs(
        state.settings.http.request_timeout_secs,
    ));
    let deadline = tokio::time::Instant::now() + budget;
    let found = tokio::time::timeout_at(
        deadline,
        crate::app::dry_months(
            &state.settings,
            &state.pool,
            job.as_ref(),
            &months,
            request.shards,
            &shards,
            request.force,
            Some(deadline),
        ),
    )
    .await;
    match found {
        Ok(Ok(dry)) => {
            // Written month by month: one month's JSON tree at a time, never the whole answer's.
            let mut body = String::from(r#"{"dry_runs":["#);
            for (i, month) in dry.iter().enumerate() {
                if i > 0 {
                    body.push(',');
                }
                body.push_str(&month.to_json().to_string());
            }
            body.push_str("]}");
            json(StatusCode::OK, body)
        }
        Err(_) => out_of_time(budget),
        Ok(Err(_)) if tokio::time::Instant::now() >= deadline => out_of_time(budget),
        Ok(Err(e)) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// `Ok` when a dry run of `months` months of `shards` shards is within the caps; else the `400`'s
/// words, naming both caps and what was asked.
pub fn within_dry_caps(months: usize, shards: usize) -> Result<(), String> {
    if months <= MAX_DRY_MONTHS && months.saturating_mul(shards) <= MAX_DRY_SHARD_MONTHS {
        return Ok(());
    }
    Err(format!(
        "a dry run answers at most {MAX_DRY_MONTHS} months and {MAX_DRY_SHARD_MONTHS} shards × \
         months per request; this one asks {months} month{} × {shards} shard{} = {}: ask for fewer \
         months (from, to) or one shard (shard), and send the rest as further requests",
        if months == 1 { "" } else { "s" },
        if shards == 1 { "" } else { "s" },
        months.saturating_mul(shards)
    ))
}

/// How many months from `from`'s to `to`'s, both counted.
fn months_from_to(from: chrono::NaiveDate, to: chrono::NaiveDate) -> usize {
    use chrono::Datelike;
    let index = |d: chrono::NaiveDate| i64::from(d.year()) * 12 + i64::from(d.month0());
    usize::try_from(index(to) - index(from) + 1).unwrap_or(0)
}

/// How long a dry run may take: the request timeout less a tenth of it (at most 1 s), so that its
/// own `503` answers before the server's timeout drops the request without a word.
pub fn dry_budget(request_timeout: Duration) -> Duration {
    request_timeout - (request_timeout / 10).min(Duration::from_secs(1))
}

fn out_of_time(budget: Duration) -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "the dry run did not finish within {:.1} s (http.request_timeout_secs, less a margin to \
             answer): the database cancelled its statement and nothing of it is left running; ask \
             for fewer months or one shard",
            budget.as_secs_f64()
        ),
    )
}

/// `Ok` unless the request declares a body that is not JSON: a `Content-Type` other than
/// `application/json` (or an `application/…+json` type) is `415`. A body without one is read as
/// JSON, and is `400` when it is not.
#[allow(clippy::result_large_err)]
pub(super) fn json_only(headers: &HeaderMap) -> Result<(), Response> {
    let Some(declared) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let text = declared.to_str().unwrap_or("(not text)");
    let essence = text
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let json = essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"));
    if json {
        return Ok(());
    }
    Err(error(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        format!(
            "the body must be JSON, sent as Content-Type: application/json (got {text:?}); with \
             curl: --json '{{…}}', or -H 'Content-Type: application/json' with -d"
        ),
    ))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dry_run_is_capped_at_twelve_months_and_1024_shard_months_and_answers_within_the_timeout() {
        for (months, shards) in [(1, 1), (12, 1), (12, 85), (1, 1024), (2, 512)] {
            assert!(
                within_dry_caps(months, shards).is_ok(),
                "{months} x {shards}"
            );
        }
        for (months, shards) in [(13, 1), (12, 86), (1, 1025), (322, 1024), (usize::MAX, 2)] {
            let why = within_dry_caps(months, shards).unwrap_err();
            assert!(
                why.contains("at most 12 months and 1024 shards × months"),
                "{why}"
            );
        }
        let why = within_dry_caps(1, 1025).unwrap_err();
        assert!(why.contains("asks 1 month × 1025 shards = 1025"), "{why}");
        assert_eq!(dry_budget(Duration::from_secs(30)), Duration::from_secs(29));
        assert_eq!(
            dry_budget(Duration::from_secs(1)),
            Duration::from_millis(900)
        );
        assert_eq!(months_from_to(date(2000, 1, 31), date(2026, 10, 31)), 322);
        assert_eq!(months_from_to(date(2024, 12, 31), date(2024, 12, 31)), 1);
    }

    fn date(y: i32, m: u32, d: u32) -> chrono::NaiveDate {
        chrono::NaiveDate::from_ymd_opt(y, m, d).unwrap()
    }
}
