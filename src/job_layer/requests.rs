//! Run requests: the request layer of idempotency (`run_requests`, `run_request_shards`).
//!
//! A request asks for one job key's shards to run once — or, with `force`, to run once more. It
//! is stored with its client's idempotency key before it is answered, so a retried request (by a
//! client, a proxy, a second click, to any replica) finds the first one and its first answer
//! instead of starting the work again. Each targeted shard has a row whose state moves with the
//! job layer, in the same transactions as the claim and the final SUCCESS or FAILED
//! ([`super::claim`]): `pending` → `running` (with the attempt that serves it) → `succeeded` or
//! `failed` (then `running` again when the run is retried).
//!
//! Exactly one new attempt per accepted request and shard: the claim made for a request locks the
//! request's row and requires it to be open, so two replicas that both see it pending cannot both
//! force a run; the second finds it served. Every transaction that writes a request's row and a
//! key's locks the request's first ([`super::claim`], "One lock order"), so a claim for a request
//! never deadlocks with the SUCCESS of the attempt serving it (which would leave that attempt
//! RUNNING for a lease, then taken over as a second attempt).

use super::{JobKey, Result};
use chrono::{DateTime, NaiveDate, Utc};
use sqlx::{PgConnection, PgExecutor};

/// The channel a stored request is announced on (`LISTEN`), so replicas run it at once.
pub const CHANNEL: &str = "settlementd_run_requests";

/// A request to store: what to run, and the client's key for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    pub idempotency_key: String,
    pub job_name: String,
    pub business_date: NaiveDate,
    /// A range: every month from `business_date` to this one (month ends), each stored as a child
    /// request of this one and run in order. `None`: one month.
    pub to: Option<NaiveDate>,
    pub shards: u32,
    /// `None`: every shard of `shards`.
    pub shard: Option<u32>,
    pub force: bool,
}

impl NewRequest {
    /// What identifies the request's content: the same key with a different fingerprint is another
    /// request and is refused.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let canonical = format!(
            "{}|{}|{}|{}|{}{}",
            self.job_name,
            self.business_date,
            self.shards,
            self.shard.map_or("*".to_string(), |s| s.to_string()),
            self.force,
            self.to.map_or(String::new(), |to| format!("|to {to}"))
        );
        format!("{:x}", Sha256::digest(canonical.as_bytes()))
    }

    /// The shards the request targets.
    pub fn targets(&self) -> Vec<u32> {
        match self.shard {
            Some(shard) => vec![shard],
            None => (0..self.shards).collect(),
        }
    }
}

/// A request as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredRequest {
    pub request_id: String,
    pub idempotency_key: String,
    pub fingerprint: String,
    pub job_name: String,
    pub business_date: NaiveDate,
    /// A range's last month; its months are child requests ([`months_of`]).
    pub range_to: Option<NaiveDate>,
    pub shards: i32,
    pub shard: Option<i32>,
    pub force: bool,
    pub created_at: DateTime<Utc>,
    /// The exact body of the first answer.
    pub response: String,
}

/// What storing a request found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// This call stored it.
    New(StoredRequest),
    /// The key was stored before with the same request: the first one, unchanged.
    Replay(StoredRequest),
    /// The key was stored before with a different request.
    Conflict(StoredRequest),
}

/// Stores `request` under its idempotency key, with one `pending` row and one `requested` event
/// per targeted shard, and announces it — or finds the request stored under that key before.
/// `respond` builds the answer's body from the stored request (its id and time come from the
/// database); it is stored with the request and replayed byte for byte. Concurrent calls with the
/// same key store one request: the others wait on the key's unique index, then find it.
pub async fn store(
    conn: &mut PgConnection,
    request: &NewRequest,
    accepted_by: &str,
    respond: impl FnOnce(&StoredRequest) -> String,
) -> Result<Stored> {
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    let id = new_request_id();
    let fingerprint = request.fingerprint();
    let created: Option<DateTime<Utc>> = sqlx::query_scalar(
        "INSERT INTO run_requests (request_id, idempotency_key, fingerprint, job_name,
                                   business_date, shards, shard, force, accepted_by, response,
                                   range_to)
         VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9, '', $10)
         ON CONFLICT (idempotency_key) DO NOTHING
         RETURNING created_at",
    )
    .bind(&id)
    .bind(&request.idempotency_key)
    .bind(&fingerprint)
    .bind(&request.job_name)
    .bind(request.business_date)
    .bind(request.shards as i32)
    .bind(request.shard.map(|s| s as i32))
    .bind(request.force)
    .bind(accepted_by)
    .bind(request.to)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(created_at) = created else {
        let existing = by_key(&mut *tx, &request.idempotency_key).await?;
        tx.commit().await?;
        return Ok(if existing.fingerprint == fingerprint {
            Stored::Replay(existing)
        } else {
            Stored::Conflict(existing)
        });
    };
    let mut stored = StoredRequest {
        request_id: id,
        idempotency_key: request.idempotency_key.clone(),
        fingerprint,
        job_name: request.job_name.clone(),
        business_date: request.business_date,
        range_to: request.to,
        shards: request.shards as i32,
        shard: request.shard.map(|s| s as i32),
        force: request.force,
        created_at,
        response: String::new(),
    };
    // A range: a child request per month, in month order, each a request like any other.
    let months: Vec<NaiveDate> = match request.to {
        None => vec![request.business_date],
        Some(to) => month_ends(request.business_date, to),
    };
    let mut children = Vec::new();
    if request.to.is_some() {
        for month in &months {
            let child = new_request_id();
            sqlx::query(
                "INSERT INTO run_requests (request_id, idempotency_key, fingerprint, job_name,
                                           business_date, shards, shard, force, accepted_by,
                                           response, parent_id)
                 VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9, '', $10::uuid)",
            )
            .bind(&child)
            .bind(format!("{}/{month}", stored.request_id))
            .bind(&stored.fingerprint)
            .bind(&request.job_name)
            .bind(*month)
            .bind(request.shards as i32)
            .bind(request.shard.map(|s| s as i32))
            .bind(request.force)
            .bind(accepted_by)
            .bind(&stored.request_id)
            .execute(&mut *tx)
            .await?;
            children.push((*month, child));
        }
    } else {
        children.push((request.business_date, stored.request_id.clone()));
    }
    stored.response = respond(&stored);
    sqlx::query("UPDATE run_requests SET response = $2 WHERE request_id = $1::uuid")
        .bind(&stored.request_id)
        .bind(&stored.response)
        .execute(&mut *tx)
        .await?;
    for (month, child) in &children {
        let one = NewRequest {
            business_date: *month,
            ..request.clone()
        };
        add_targets(&mut tx, &one, child, accepted_by).await?;
    }
    // Delivered at commit: replicas serving these shards wake up and run it.
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(&stored.request_id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Stored::New(stored))
}

/// Every month end from `from` to `to`.
fn month_ends(from: NaiveDate, to: NaiveDate) -> Vec<NaiveDate> {
    let mut months = Vec::new();
    let mut month = from;
    while month <= to {
        months.push(month);
        let Some(next) = month
            .succ_opt()
            .and_then(|first| first.checked_add_months(chrono::Months::new(1)))
            .and_then(|after| after.pred_opt())
        else {
            break;
        };
        month = next;
    }
    months
}

/// The `pending` shard rows and `requested` events of one month's request.
async fn add_targets(
    tx: &mut PgConnection,
    request: &NewRequest,
    request_id: &str,
    accepted_by: &str,
) -> Result<()> {
    let targets: Vec<i32> = request.targets().into_iter().map(|s| s as i32).collect();
    sqlx::query(
        "INSERT INTO run_request_shards (request_id, shard, state)
         SELECT $1::uuid, s, 'pending' FROM unnest($2::int[]) AS s",
    )
    .bind(request_id)
    .bind(&targets)
    .execute(&mut *tx)
    .await?;
    let message = format!(
        "requested with Idempotency-Key {:?}{}",
        request.idempotency_key,
        if request.force { ", force" } else { "" }
    );
    sqlx::query(
        "INSERT INTO job_events
                (job_name, business_date, shards, shard, event, owner, request_id, message)
         SELECT $1, $2, $3, s, 'requested', $4, $5::uuid, $6 FROM unnest($7::int[]) AS s",
    )
    .bind(&request.job_name)
    .bind(request.business_date)
    .bind(request.shards as i32)
    .bind(accepted_by)
    .bind(request_id)
    .bind(&message)
    .bind(&targets)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// A random version-4 UUID: a request's own id (the idempotency key is the client's).
fn new_request_id() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

const SELECT_REQUEST: &str = "SELECT request_id::text AS request_id, idempotency_key, fingerprint,
                                     job_name, business_date, range_to, shards, shard, force,
                                     created_at, response
                                FROM run_requests";

/// A range request's months: each month's child request id, in month order.
pub async fn months_of(
    db: impl PgExecutor<'_>,
    request_id: &str,
) -> Result<Vec<(NaiveDate, String)>> {
    Ok(sqlx::query_as(
        "SELECT business_date, request_id::text FROM run_requests
          WHERE parent_id = $1::uuid ORDER BY business_date",
    )
    .bind(request_id)
    .fetch_all(db)
    .await?)
}

async fn by_key(db: impl PgExecutor<'_>, key: &str) -> Result<StoredRequest> {
    Ok(
        sqlx::query_as(&format!("{SELECT_REQUEST} WHERE idempotency_key = $1"))
            .bind(key)
            .fetch_one(db)
            .await?,
    )
}

/// The request with this id, if any (`id` need not be a valid UUID: then there is none).
pub async fn by_id(db: impl PgExecutor<'_>, id: &str) -> Result<Option<StoredRequest>> {
    Ok(
        sqlx::query_as(&format!("{SELECT_REQUEST} WHERE request_id::text = $1"))
            .bind(id)
            .fetch_optional(db)
            .await?,
    )
}

/// One targeted shard of a request.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct Target {
    pub shard: i32,
    /// `pending`, `running`, `succeeded` or `failed`.
    pub state: String,
    /// The attempt that served (or serves) the request.
    pub attempt: Option<i32>,
    pub updated_at: DateTime<Utc>,
    pub detail: Option<String>,
}

pub async fn targets(db: impl PgExecutor<'_>, request_id: &str) -> Result<Vec<Target>> {
    Ok(sqlx::query_as(
        "SELECT shard, state, attempt, updated_at, detail FROM run_request_shards
          WHERE request_id = $1::uuid ORDER BY shard",
    )
    .bind(request_id)
    .fetch_all(db)
    .await?)
}

/// A request a replica should run for its shard, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Open {
    pub request_id: String,
    pub business_date: NaiveDate,
    /// The shard count the request was accepted under, and the shard of it to run.
    pub shards: i32,
    pub shard: i32,
    /// Force only a request that has not started yet: once it has an attempt, a retry resumes it.
    pub force: bool,
    pub state: String,
}

/// The open requests (not yet `succeeded`) that shard `shard` of `shards` serves for `job_name`:
/// its own shard's of requests accepted under `shards`, then the shards `s` with `s % shards ==
/// shard` of requests accepted under another count (before a reshard), which no replica of that
/// count is left to serve (found by the fault campaign, seed 1009). Such a request runs under its
/// own key (its count, its shard): the loans it asked for, no others; a replica of the old count
/// still alive competes for the same key, and the claim decides.
pub async fn open_for(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    shard: u32,
) -> Result<Vec<Open>> {
    Ok(sqlx::query_as(
        "SELECT r.request_id::text AS request_id, r.business_date, r.shards, s.shard,
                r.force AND s.state = 'pending' AS force, s.state
           FROM run_request_shards s JOIN run_requests r USING (request_id)
          WHERE s.state <> 'succeeded' AND r.job_name = $1
            AND CASE WHEN r.shards = $2 THEN s.shard = $3 ELSE s.shard % $2 = $3 END
          ORDER BY r.shards <> $2, r.created_at, r.request_id, s.shard",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(shard as i32)
    .fetch_all(db)
    .await?)
}

/// The key a request's shard runs under: the request's month, shard count and shard.
pub fn key_of(job_name: &str, open: &Open) -> JobKey {
    JobKey {
        job_name: job_name.to_string(),
        business_date: open.business_date,
        shards: open.shards as u32,
        shard: open.shard as u32,
    }
}

/// Locks a request's row for `shard` inside the claim's transaction; `false` when it is already
/// `succeeded` (served) or does not exist.
pub(super) async fn lock_open(tx: &mut PgConnection, request: &str, shard: u32) -> Result<bool> {
    let state: Option<String> = sqlx::query_scalar(
        "SELECT state FROM run_request_shards
          WHERE request_id = $1::uuid AND shard = $2 FOR UPDATE",
    )
    .bind(request)
    .bind(shard as i32)
    .fetch_optional(tx)
    .await?;
    Ok(matches!(state.as_deref(), Some(s) if s != "succeeded"))
}

/// Locks the row of the request that `attempt` of `key` serves, if it serves one, inside the
/// transaction of its SUCCESS or FAILED, before that writes the key's row: the order every claim
/// locks them in ([`super::claim`], "One lock order"). The attempt's request is read without a
/// lock: it is set by the claim that made the attempt and never changes under the same attempt.
pub(super) async fn lock_served(tx: &mut PgConnection, key: &JobKey, attempt: i32) -> Result<()> {
    sqlx::query(
        "SELECT 1 FROM run_request_shards r
          WHERE r.shard = $4
            AND r.request_id = (SELECT j.request_id FROM job_runs j
                                 WHERE j.job_name = $1 AND j.business_date = $2
                                   AND j.shards = $3 AND j.shard = $4 AND j.attempt = $5)
            FOR UPDATE OF r",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .bind(attempt)
    .execute(tx)
    .await?;
    Ok(())
}

/// The request's shard is served by `attempt` from now on.
pub(super) async fn start(
    db: impl PgExecutor<'_>,
    request: &str,
    shard: u32,
    attempt: i32,
) -> Result<()> {
    sqlx::query(
        "UPDATE run_request_shards
            SET state = 'running', attempt = $3, updated_at = clock_timestamp(), detail = NULL
          WHERE request_id = $1::uuid AND shard = $2 AND state <> 'succeeded'",
    )
    .bind(request)
    .bind(shard as i32)
    .bind(attempt)
    .execute(db)
    .await?;
    Ok(())
}

/// The request's shard ends in `state` without a run of its own (see [`super::claim::claim_for`]);
/// `attempt` is the key's, when there is one.
pub(super) async fn finish(
    db: impl PgExecutor<'_>,
    request: &str,
    shard: u32,
    state: &str,
    attempt: Option<i32>,
    detail: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "UPDATE run_request_shards
            SET state = $3, attempt = $4, updated_at = clock_timestamp(), detail = $5
          WHERE request_id = $1::uuid AND shard = $2",
    )
    .bind(request)
    .bind(shard as i32)
    .bind(state)
    .bind(attempt)
    .bind(detail)
    .execute(db)
    .await?;
    Ok(())
}
