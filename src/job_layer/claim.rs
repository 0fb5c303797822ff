//! `job_runs` SQL: claim, takeover, and the fenced writes of a run.
//!
//! All lease arithmetic uses `clock_timestamp()` (the database's clock, not frozen at transaction
//! start like `now()`), so replicas with skewed clocks agree on who holds a lease. Every claim,
//! takeover, SUCCESS and FAILED is appended to `job_events` in the transaction that makes it, and
//! moves the state of the run request it serves, if any (`job_runs.request_id`).
//!
//! **One lock order.** A transaction that writes both a key's `job_runs` row and a run request's
//! row (`run_request_shards`) locks the request's row first: a claim made for a request, a
//! takeover that keeps serving the row's request, and the final SUCCESS or FAILED. Progress and
//! heartbeats lock the key's row alone. With two orders (the claim request-then-key, SUCCESS
//! key-then-request), a peer's claim for the request being finished deadlocked with the SUCCESS
//! write; PostgreSQL aborted one of them, and an aborted SUCCESS left the attempt RUNNING for a
//! lease, after which a peer took it over as a second attempt for one request. A SUCCESS or FAILED
//! aborted all the same (a deadlock with a release of another order during a rolling update, a
//! serialization failure) is written again under the same attempt ([`FINISH_TRIES`]).

use super::params::{self, Params, Pin};
use super::{events, requests, Batch, BusinessDate, Cursor, JobKey, Owner, Reopen, Result};
use crate::mutant::{self, Mutant};
use sqlx::{Connection, PgConnection, PgExecutor};
use std::time::Duration;

/// A claim this process holds: every write must carry its `attempt`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub key: JobKey,
    /// The key's month: the key's own business date for a monthly job ([`super::Job::MONTHLY`], which
    /// [`super::run_once`] checks before claiming), the month of its day for a daily one.
    pub month: BusinessDate,
    pub attempt: i32,
    pub owner: Owner,
    /// Progress committed by earlier attempts; a takeover resumes inside it.
    pub resume: Cursor,
    /// True when this claim replaced an earlier attempt (FAILED, stale or forced).
    pub took_over: bool,
    /// True when this claim re-opened the key for items that arrived after it was done, or for a
    /// correction ([`ClaimOptions::reopen`]): what the job writes may say so.
    pub reopened: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    Won(Claim),
    /// Another owner holds a live lease.
    Held {
        owner: String,
        attempt: i32,
    },
    /// The key is SUCCESS and the run was not forced.
    AlreadyDone {
        attempt: i32,
    },
    /// The request this claim was made for is already served (another replica got to it first).
    RequestServed,
    /// The key's period is pinned to other parameters than the claimer's (these): nothing was
    /// claimed, and a `rule_conflict` event says so.
    Conflict {
        pinned: Params,
    },
    /// The job is paused ([`super::pause`]): nothing was claimed.
    Paused(super::pause::Pause),
    /// The key's period is held by an unfinished correction (its key, since when): nothing was
    /// claimed; only that correction's claims may run it until it completes.
    Correcting {
        correction: String,
        since: chrono::DateTime<chrono::Utc>,
    },
}

/// How a claimer states its parameters: the parameters, and how to say them in words.
pub type Stated<'a> = (&'a Params, &'a (dyn Fn(&Params) -> String + Sync));

/// How a claim is made, besides its key, owner and lease.
#[derive(Clone, Copy, Default)]
pub struct ClaimOptions<'a> {
    /// Re-open a SUCCESS key: an operator's forced re-run (event `forced`).
    pub force: bool,
    /// Re-open the key whatever its state but a live RUNNING one (never stolen), from its first
    /// item, under the reopen's event: items that arrived after it was done, a correction.
    pub reopen: Option<&'a Reopen>,
    /// The stored run request this claim serves ([`claim_for`]).
    pub request: Option<&'a str>,
    /// The claimer's identifying parameters: pinned for the period by its first claim, compared by
    /// every later one ([`params`]). `None`: a claim that states none (tests, the demo's story).
    pub params: Option<Stated<'a>>,
    /// The correction this claim runs for: the only claims of a period held by a correction
    /// ([`params::hold`]) that are not refused.
    pub correction: Option<&'a str>,
    /// An attempt of the claimer's own (same owner) that is over though its lease has not
    /// expired: no run of it goes on in this process ([`super::run_once`] knows). Taken over like
    /// a stale one, at once, and only while the row is still that attempt's, RUNNING.
    pub own_dead: Option<i32>,
}

/// Claims `key` in one short transaction on `conn`, stating no parameters.
///
/// Inserts a RUNNING row (attempt 1); when the key exists, takes over a FAILED row, a RUNNING row
/// whose heartbeat is older than `ttl`, or (with `force`) a SUCCESS row, bumping `attempt`.
/// A RUNNING row with a live lease is never taken, forced or not. The claim, or takeover, is
/// recorded in `job_events` in the same transaction.
pub async fn claim(
    conn: &mut PgConnection,
    key: &JobKey,
    owner: &Owner,
    ttl: Duration,
    force: bool,
) -> Result<ClaimOutcome> {
    let opts = ClaimOptions {
        force,
        ..ClaimOptions::default()
    };
    claim_for(conn, key, owner, ttl, opts).await
}

/// [`claim`] with [`ClaimOptions`]:
/// - with `params`, the period's pin is set or compared first, in the same transaction; parameters
///   that differ claim nothing ([`ClaimOutcome::Conflict`], a `rule_conflict` event, and a served
///   request's shard `failed` with the reason);
/// - with `reopen`, a SUCCESS key is taken over as with `force`, and any claim won starts from the
///   key's first item (no committed progress is resumed), under the reopen's event;
/// - with `request`, the request's row for this shard is locked and must still be open, and it
///   moves with the claim (`running` with the attempt won). A request that another replica already
///   served is [`ClaimOutcome::RequestServed`]; one whose key is SUCCESS is left to the caller.
pub async fn claim_for(
    conn: &mut PgConnection,
    key: &JobKey,
    owner: &Owner,
    ttl: Duration,
    opts: ClaimOptions<'_>,
) -> Result<ClaimOutcome> {
    let month = BusinessDate::of_month(key.business_date);
    let request = opts.request;
    let mut tx = conn.begin().await?;
    // A pause committed before this claim stops it; one committed after it reaches the run at its
    // next heartbeat.
    if let Some(pause) = super::pause::of(&mut *tx, &key.job_name).await? {
        tx.commit().await?;
        return Ok(ClaimOutcome::Paused(pause));
    }
    if let Some(request) = request {
        if !requests::lock_open(&mut tx, request, key.shard).await? {
            tx.commit().await?;
            return Ok(ClaimOutcome::RequestServed);
        }
    }
    // Planted bug (the campaign only): a late-return sweep claims without the pin's comparison,
    // both the claim that finds its key SUCCESS and the one that re-opens it for the late returns.
    let sweep = mutant::planted(Mutant::LateUnderConfigRule)
        && (opts.reopen.is_some()
            || (!opts.force
                && existing(&mut tx, key)
                    .await?
                    .is_some_and(|row| row.status == "SUCCESS")));
    let compared = opts.params.filter(|_| !sweep);
    if let Some((mine, describe)) = compared {
        let pin = params::pin_or_compare(&mut tx, key, mine, owner, opts.correction).await?;
        if let Pin::Correcting { correction, since } = pin {
            tx.commit().await?;
            return Ok(ClaimOutcome::Correcting { correction, since });
        }
        if let Pin::Differs(pinned) = pin {
            let (was, is) = params::describe_difference(&pinned, mine, describe);
            let message =
                format!("claimed nothing: the month is pinned to {was}; this claimer's is {is}");
            events::append_unclaimed(&mut *tx, key, owner, "rule_conflict", request, &message)
                .await?;
            if let Some(request) = request {
                requests::finish(&mut *tx, request, key.shard, "failed", None, Some(&message))
                    .await?;
            }
            tx.commit().await?;
            return Ok(ClaimOutcome::Conflict { pinned });
        }
    }
    let rule = opts.params.map(|(mine, describe)| describe(mine));
    let inserted: Option<(i32, Option<String>)> = sqlx::query_as(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at, request_id, version, version_attempt)
         VALUES ($1, $2, $3, $4, 'RUNNING', 1, $5, clock_timestamp(), clock_timestamp(), $6::uuid,
                 $7, 1)
         ON CONFLICT (job_name, business_date, shards, shard) DO NOTHING
         RETURNING attempt, request_id::text",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .bind(&owner.0)
    .bind(request)
    .bind(crate::version::VERSION)
    .fetch_optional(&mut *tx)
    .await?;
    let inserted = match inserted {
        None if mutant::planted(Mutant::ClaimIgnoresConflict) => {
            // Planted bug (the campaign only): the conflict is ignored, the existing row taken.
            existing(&mut tx, key)
                .await?
                .map(|row| (row.attempt, row.request_id))
        }
        inserted => inserted,
    };
    if let Some((attempt, lineage)) = inserted {
        let claim = Claim {
            month,
            key: key.clone(),
            attempt,
            owner: owner.clone(),
            resume: Cursor::default(),
            took_over: false,
            reopened: opts.reopen.is_some(),
        };
        won(
            &mut tx,
            &claim,
            None,
            &opts,
            lineage.as_deref(),
            rule.as_deref(),
        )
        .await?;
        tx.commit().await?;
        return Ok(ClaimOutcome::Won(claim));
    }

    // The row exists. Take it over only if its holder is gone (or it is done and we force).
    // A forced re-run starts from the beginning and serves only its own request (none from the
    // CLI); a takeover resumes after committed progress and keeps serving the request it served.
    // One lock order (module header): a takeover made for no request keeps serving the row's, so
    // that request's row is locked before the key's, and the takeover happens only while the row
    // still serves it (else another claim took it meanwhile: held).
    let served = match request {
        Some(_) => None,
        None => existing(&mut tx, key).await?.and_then(|row| row.request_id),
    };
    if let Some(served) = &served {
        requests::lock_open(&mut tx, served, key.shard).await?;
    }
    let takeover = lease_now(
        "WITH prior AS (
             SELECT status FROM job_runs
              WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
              FOR UPDATE
         )
         UPDATE job_runs j
            SET status = 'RUNNING', attempt = j.attempt + 1, owner = $5, version = $10,
                version_attempt = j.attempt + 1,
                started_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
                finished_at = NULL, last_error = NULL,
                last_id = CASE WHEN j.status = 'SUCCESS' OR $9 THEN NULL ELSE j.last_id END,
                last_id_desc = CASE WHEN j.status = 'SUCCESS' OR $9 THEN NULL
                                    ELSE j.last_id_desc END,
                scanned = CASE WHEN j.status = 'SUCCESS' OR $9 THEN 0 ELSE j.scanned END,
                updated = CASE WHEN j.status = 'SUCCESS' OR $9 THEN 0 ELSE j.updated END,
                request_id = CASE WHEN j.status = 'SUCCESS' THEN $8::uuid
                                  ELSE COALESCE($8::uuid, j.request_id) END
           FROM prior
          WHERE j.job_name = $1 AND j.business_date = $2 AND j.shards = $3 AND j.shard = $4
            AND (j.status = 'FAILED'
                 OR (j.status = 'RUNNING'
                     AND j.heartbeat_at < clock_timestamp() - make_interval(secs => $6))
                 OR (j.status = 'RUNNING' AND j.owner = $5 AND j.attempt = $12)
                 OR (j.status = 'SUCCESS' AND $7))
            AND ($8::uuid IS NOT NULL OR j.request_id IS NOT DISTINCT FROM $11::uuid)
         RETURNING j.attempt, j.last_id, j.last_id_desc, prior.status AS prior,
                   j.request_id::text AS lineage",
    );
    let takeover = if mutant::planted(Mutant::OwnTakeoverOfAPeer) {
        takeover
            .replace(
                "AND j.owner = $5 AND j.attempt = $12",
                "AND j.attempt = $12",
            )
            .into()
    } else {
        takeover
    };
    let takeover = sqlx::query_as::<_, Taken>(&takeover)
        .bind(&key.job_name)
        .bind(key.business_date)
        .bind(key.shards as i32)
        .bind(key.shard as i32)
        .bind(&owner.0)
        .bind(ttl.as_secs_f64())
        .bind(opts.force || opts.reopen.is_some())
        .bind(request)
        .bind(opts.reopen.is_some())
        .bind(crate::version::VERSION)
        .bind(served.as_deref())
        .bind(opts.own_dead);
    let takeover = if mutant::planted(Mutant::LeaseLocalClock) {
        takeover.bind(chrono::Utc::now())
    } else {
        takeover
    };
    let taken = takeover.fetch_optional(&mut *tx).await?;
    if let Some(Taken {
        attempt,
        last_id,
        last_id_desc,
        prior,
        lineage,
    }) = taken
    {
        let claim = Claim {
            month,
            key: key.clone(),
            attempt,
            owner: owner.clone(),
            resume: Cursor {
                last_id,
                last_id_desc,
            },
            took_over: true,
            reopened: opts.reopen.is_some(),
        };
        won(
            &mut tx,
            &claim,
            Some(&prior),
            &opts,
            lineage.as_deref(),
            rule.as_deref(),
        )
        .await?;
        tx.commit().await?;
        return Ok(ClaimOutcome::Won(claim));
    }

    let Existing {
        status,
        attempt,
        owner: holder,
        ..
    } = existing(&mut tx, key)
        .await?
        .ok_or(sqlx::Error::RowNotFound)?;
    // A forced claim for a request finds SUCCESS here only when another run took the key and
    // finished it between the takeover and this read: that run served another request, so this
    // one is held, not done, and runs once that one is over (one new attempt per request).
    let raced = opts.force && request.is_some();
    let outcome = if status == "SUCCESS" && !raced {
        ClaimOutcome::AlreadyDone { attempt }
    } else {
        ClaimOutcome::Held {
            owner: holder,
            attempt,
        }
    };
    tx.commit().await?;
    Ok(outcome)
}

/// How many claims of `job_name`, under any shard count, are RUNNING with a lease older than
/// `lease_ttl` on the database clock: held by a holder that stopped renewing (dead, frozen or cut
/// off). A live replica of the shard takes such a claim over at its next tick; one that stays
/// has no live replica of its shard and count.
pub async fn expired_leases(
    db: impl PgExecutor<'_>,
    job_name: &str,
    lease_ttl: std::time::Duration,
) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM job_runs
          WHERE job_name = $1 AND status = 'RUNNING'
            AND heartbeat_at < clock_timestamp() - make_interval(secs => $2)",
    )
    .bind(job_name)
    .bind(lease_ttl.as_secs_f64())
    .fetch_one(db)
    .await?)
}

/// Closes the claims of `job_name` under a shard count other than `shards` that were left RUNNING
/// and whose lease has expired (by the database's clock): their holder died (SIGKILL, a lost node)
/// before the fleet moved to `shards`, and no replica of this count ever looks at another count's
/// keys, so nobody would take them over. Each is closed as a takeover would start: a new attempt
/// (so the old holder, should it wake, is fenced off), written FAILED at once with the reason and
/// an `abandoned` event, in one statement. A replica of that count still alive, or a `run` with
/// it, takes a FAILED row over as usual. Returns how many were closed. (Found by the fault
/// campaign, seed 1002: a holder killed, then a reshard, left its month RUNNING under the old
/// count for good.)
pub async fn close_abandoned(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    owner: &Owner,
    ttl: Duration,
) -> Result<u64> {
    let closed: i64 = sqlx::query_scalar(
        "WITH closed AS (
             UPDATE job_runs
                SET status = 'FAILED', attempt = attempt + 1, owner = $3, version = $5,
                    version_attempt = attempt + 1,
                    heartbeat_at = clock_timestamp(), finished_at = clock_timestamp(),
                    last_error = format('abandoned: left RUNNING by its holder, whose lease expired, '
                                        'while the fleet runs %s shards', $2::int)
              WHERE job_name = $1 AND shards <> $2 AND status = 'RUNNING'
                AND heartbeat_at < clock_timestamp() - make_interval(secs => $4)
             RETURNING job_name, business_date, shards, shard, attempt, request_id, last_error
         ), event AS (
             INSERT INTO job_events
                    (job_name, business_date, shards, shard, event, attempt, owner, request_id,
                     message)
             SELECT job_name, business_date, shards, shard, 'abandoned', attempt, $3, request_id,
                    last_error
               FROM closed
         )
         SELECT count(*) FROM closed",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(&owner.0)
    .bind(ttl.as_secs_f64())
    .bind(crate::version::VERSION)
    .fetch_one(db)
    .await?;
    Ok(closed as u64)
}

/// The takeover statement `sql` judging leases on the database's clock, as written; or, with the
/// campaign's planted bug, on the claimer's own clock (bound as `$13`).
fn lease_now(sql: &str) -> std::borrow::Cow<'_, str> {
    if mutant::planted(Mutant::LeaseLocalClock) {
        let local = "$13::timestamptz - make_interval(secs => $6)";
        sql.replace("clock_timestamp() - make_interval(secs => $6)", local)
            .into()
    } else {
        sql.into()
    }
}

/// A key's row as it stands.
#[derive(sqlx::FromRow)]
struct Existing {
    status: String,
    attempt: i32,
    owner: String,
    request_id: Option<String>,
}

async fn existing(tx: &mut PgConnection, key: &JobKey) -> Result<Option<Existing>> {
    Ok(sqlx::query_as(
        "SELECT status, attempt, owner, request_id::text AS request_id FROM job_runs
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .fetch_optional(tx)
    .await?)
}

/// The row a takeover leaves: its new attempt, the progress it resumes, the status it replaced and
/// the request it serves.
#[derive(sqlx::FromRow)]
struct Taken {
    attempt: i32,
    last_id: Option<i64>,
    last_id_desc: Option<i64>,
    prior: String,
    lineage: Option<String>,
}

/// What every won claim writes besides the row: the audit event (which kind of claim, why, where it
/// resumes, under which parameters), and the state of the request the attempt serves. `prior`: the
/// status of the row it took over (`None`: it inserted the row).
async fn won(
    tx: &mut PgConnection,
    claim: &Claim,
    prior: Option<&str>,
    opts: &ClaimOptions<'_>,
    request: Option<&str>,
    rule: Option<&str>,
) -> Result<()> {
    let (event, why) = match (prior, opts.reopen) {
        (_, Some(reopen)) => (reopen.event, Some(reopen.message.as_str())),
        (None, None) => ("claimed", None),
        (Some("SUCCESS"), None) => ("forced", None),
        (Some(_), None) => ("took_over", None),
    };
    let resumes = (event == "took_over" && !claim.resume.is_start())
        .then(|| format!("resumes {}", claim.resume));
    let own = opts
        .own_dead
        .filter(|_| event == "took_over")
        .map(|attempt| format!("attempt {attempt} {OWN_MARK}"));
    let rule = rule.map(|r| format!("rule: {r}"));
    let parts: Vec<&str> = [why, own.as_deref(), resumes.as_deref(), rule.as_deref()]
        .into_iter()
        .flatten()
        .collect();
    let message = (!parts.is_empty()).then(|| parts.join("; "));
    events::append(&mut *tx, claim, event, request, message.as_deref()).await?;
    if let Some(request) = request {
        requests::start(&mut *tx, request, claim.key.shard, claim.attempt).await?;
    }
    Ok(())
}

/// What [`record_batch`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The claim holds; the batch's progress is written.
    Written,
    /// The claim is lost: the caller must roll the batch back.
    Lost,
    /// The job was paused before this write (its statement's snapshot): the caller must roll the
    /// batch back and stop.
    Paused,
}

/// Verifies the claim, renews its heartbeat and records a batch's progress, inside the batch's
/// transaction, and says whether the job was paused meanwhile ([`Recorded`]).
pub async fn record_batch(
    conn: &mut PgConnection,
    claim: &Claim,
    batch: &Batch,
) -> Result<Recorded> {
    let paused: Option<bool> = sqlx::query_scalar(
        "UPDATE job_runs
            SET heartbeat_at = clock_timestamp(),
                last_id = COALESCE($6, last_id),
                last_id_desc = COALESCE($7, last_id_desc),
                scanned = scanned + $8, updated = updated + $9
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
            AND attempt = $5 AND status = 'RUNNING'
         RETURNING EXISTS (SELECT 1 FROM job_pauses p WHERE p.job_name = $1)",
    )
    .bind(&claim.key.job_name)
    .bind(claim.key.business_date)
    .bind(claim.key.shards as i32)
    .bind(claim.key.shard as i32)
    .bind(claim.attempt)
    .bind(batch.cursor.last_id)
    .bind(batch.cursor.last_id_desc)
    .bind(batch.scanned as i64)
    .bind(batch.updated as i64)
    .fetch_optional(conn)
    .await?;
    Ok(match paused {
        None => Recorded::Lost,
        Some(true) => Recorded::Paused,
        Some(false) => Recorded::Written,
    })
}

/// Renews the lease, and says whether the job is paused: `Some(paused)`, or `None` when the claim
/// is lost.
pub async fn heartbeat(db: impl PgExecutor<'_>, claim: &Claim) -> Result<Option<bool>> {
    Ok(sqlx::query_scalar(
        "UPDATE job_runs SET heartbeat_at = clock_timestamp()
          WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
            AND attempt = $5 AND status = 'RUNNING'
         RETURNING EXISTS (SELECT 1 FROM job_pauses p WHERE p.job_name = $1)",
    )
    .bind(&claim.key.job_name)
    .bind(claim.key.business_date)
    .bind(claim.key.shards as i32)
    .bind(claim.key.shard as i32)
    .bind(claim.attempt)
    .fetch_optional(db)
    .await?)
}

/// An audit event a run's final write appends with it: `(event, message)`.
pub type Note = (&'static str, String);

/// How often a SUCCESS or FAILED that PostgreSQL aborted for a deadlock or a serialization failure
/// (SQLSTATE 40P01, 40001: the whole transaction rolled back, nothing of it written) is written
/// again under the same attempt. Fenced by the attempt, a write that lost its claim meanwhile
/// writes nothing; given up, the error is the caller's as before.
pub const FINISH_TRIES: u32 = 3;

/// Marks the run SUCCESS, records it in `job_events` with `notes` (what the run leaves for an
/// operator: held items) and closes the request it served, in one transaction on `conn`. `false`
/// means the claim was lost and nothing was written.
pub async fn mark_success(conn: &mut PgConnection, claim: &Claim, notes: &[Note]) -> Result<bool> {
    finish_again_if_aborted(conn, claim, None, notes).await
}

/// Marks the run FAILED so a peer can take it over at once, with the same records as
/// [`mark_success`]. `false`: the claim was already lost.
pub async fn mark_failed(conn: &mut PgConnection, claim: &Claim, error: &str) -> Result<bool> {
    finish_again_if_aborted(conn, claim, Some(error), &[]).await
}

/// [`finish`], again while PostgreSQL aborts it for a deadlock or a serialization failure, at most
/// [`FINISH_TRIES`] times.
async fn finish_again_if_aborted(
    conn: &mut PgConnection,
    claim: &Claim,
    error: Option<&str>,
    notes: &[Note],
) -> Result<bool> {
    let mut tries = 1;
    loop {
        match finish(conn, claim, error, notes).await {
            Err(e) if tries < FINISH_TRIES && aborted_by_a_conflict(&e) => {
                tracing::warn!(error = %e, tries, attempt = claim.attempt, "the run's final write was aborted; writing it again under the same attempt");
                tries += 1;
            }
            finished => return finished,
        }
    }
}

/// A transaction PostgreSQL rolled back whole to break a deadlock or a serialization conflict.
fn aborted_by_a_conflict(e: &super::JobError) -> bool {
    matches!(e, super::JobError::Db(sqlx::Error::Database(db))
        if matches!(db.code().as_deref(), Some("40P01" | "40001")))
}

/// SUCCESS without `error`, FAILED with it, with `notes`, in one transaction on `conn`: the
/// request's row locked first, then the key's (one lock order, the module header).
async fn finish(
    conn: &mut PgConnection,
    claim: &Claim,
    error: Option<&str>,
    notes: &[Note],
) -> Result<bool> {
    let (status, event, state) = match error {
        None => ("SUCCESS", "succeeded", "succeeded"),
        Some(_) => ("FAILED", "failed", "failed"),
    };
    let mut tx = conn.begin().await?;
    requests::lock_served(&mut tx, &claim.key, claim.attempt).await?;
    let done: i64 = sqlx::query_scalar(
        "WITH done AS (
             UPDATE job_runs
                SET status = $6, finished_at = clock_timestamp(), heartbeat_at = clock_timestamp(),
                    last_error = $9
              WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4
                AND attempt = $5 AND status = 'RUNNING'
             RETURNING request_id, scanned, updated
         ), event AS (
             INSERT INTO job_events
                    (job_name, business_date, shards, shard, event, attempt, owner, request_id, message)
             SELECT $1, $2, $3, $4, $7, $5, $10, request_id,
                    COALESCE($9, format('scanned %s, updated %s', scanned, updated))
               FROM done
         ), request AS (
             UPDATE run_request_shards r
                SET state = $8, attempt = $5, updated_at = clock_timestamp(), detail = $9
               FROM done
              WHERE r.request_id = done.request_id AND r.shard = $4
         )
         SELECT count(*) FROM done",
    )
    .bind(&claim.key.job_name)
    .bind(claim.key.business_date)
    .bind(claim.key.shards as i32)
    .bind(claim.key.shard as i32)
    .bind(claim.attempt)
    .bind(status)
    .bind(event)
    .bind(state)
    .bind(error)
    .bind(&claim.owner.0)
    .fetch_one(&mut *tx)
    .await?;
    if done != 1 {
        tx.rollback().await?;
        return Ok(false);
    }
    for (event, message) in notes {
        events::append(&mut *tx, claim, event, None, Some(message)).await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// How `last_error` of a claim its run left at a pause begins (`interrupted: paused by WHO: WHY;
/// this run stopped after …`).
pub const PAUSED_MARK: &str = "interrupted: paused";

/// What the `took_over` event of an own-attempt takeover ([`ClaimOptions::own_dead`]) says after
/// "attempt N": the campaign's checker excuses a takeover of a live lease only under it, and only
/// when the attempt taken over wrote nothing after it.
pub const OWN_MARK: &str = "was this owner's own, over though its lease was not";

/// One `job_runs` row as `status` shows it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct JobRunRow {
    pub shard: i32,
    pub status: String,
    pub attempt: i32,
    pub owner: String,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub finished_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Seconds since the last heartbeat, on the database clock.
    pub heartbeat_age_secs: f64,
    /// Seconds since the attempt started, on the database clock (a run's rate and time left).
    pub started_age_secs: f64,
    pub last_id: Option<i64>,
    pub last_id_desc: Option<i64>,
    pub scanned: i64,
    pub updated: i64,
    pub last_error: Option<String>,
    /// The release that made the current attempt; `None` when the release that made it did not
    /// record itself (0.1.0; 0.2.0 on a re-open or a correction): the migration's trigger clears
    /// it when the attempt changes and no release said it made the new one (`version_attempt`).
    pub version: Option<String>,
}

impl JobRunRow {
    /// A FAILED claim its run left when its job was paused ([`PAUSED_MARK`], as the runner writes
    /// it; `interrupted: JOB is paused since …` before 0.3.0): stopped after a committed batch, it
    /// resumes at its cursor after `settlementd resume`. A pause, not a failure: the page and
    /// `status` show it as one.
    pub fn stopped_by_pause(&self) -> bool {
        self.status == "FAILED"
            && self.last_error.as_deref().is_some_and(|e| {
                e.starts_with(PAUSED_MARK)
                    || (e.starts_with("interrupted: ") && e.contains(" is paused since "))
            })
    }

    /// The run's committed progress.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            last_id: self.last_id,
            last_id_desc: self.last_id_desc,
        }
    }
}

/// The business dates from `from` to `to` whose key of shard `shard` of `shards` is SUCCESS,
/// oldest first.
pub async fn done_between(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    shard: u32,
    from: chrono::NaiveDate,
    to: chrono::NaiveDate,
) -> Result<Vec<chrono::NaiveDate>> {
    Ok(sqlx::query_scalar(
        "SELECT business_date FROM job_runs
          WHERE job_name = $1 AND shards = $2 AND shard = $3 AND status = 'SUCCESS'
            AND business_date BETWEEN $4 AND $5
          ORDER BY business_date",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(shard as i32)
    .bind(from)
    .bind(to)
    .fetch_all(db)
    .await?)
}

/// Every row of `job_name` for one business date and shard count, by shard.
pub async fn rows_for(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: chrono::NaiveDate,
    shards: u32,
) -> Result<Vec<JobRunRow>> {
    let rows = latest_months(db, job_name, shards, Some(business_date), 1).await?;
    Ok(rows.into_iter().map(|r| r.run).collect())
}

/// A [`JobRunRow`] with its business date.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct MonthRunRow {
    pub business_date: chrono::NaiveDate,
    /// The sum of the attempts of every claim of this business date, under any shard count. Every
    /// claim and takeover raises it, so a reader that saw the same number before knows that no
    /// run of the month has started since.
    pub month_attempts: i64,
    #[sqlx(flatten)]
    pub run: JobRunRow,
}

/// [`MonthRunRow::month_attempts`] of one business date, alone (the status page's background
/// counter reads it in the snapshot it counts in): the same sum [`latest_months`] reads per month.
pub async fn month_attempts(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: chrono::NaiveDate,
) -> sqlx::Result<i64> {
    sqlx::query_scalar(
        "SELECT COALESCE(sum(attempt), 0)::bigint FROM job_runs
          WHERE job_name = $1 AND business_date = $2",
    )
    .bind(job_name)
    .bind(business_date)
    .fetch_one(db)
    .await
}

/// The rows of `job_name` under `shards` for the latest `months` business dates that have any
/// (only `month`, when given): newest month first, by shard.
pub async fn latest_months(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    month: Option<chrono::NaiveDate>,
    months: u32,
) -> Result<Vec<MonthRunRow>> {
    Ok(sqlx::query_as(
        "WITH months AS (
             SELECT business_date FROM job_runs
              WHERE job_name = $1 AND shards = $2 AND ($3::date IS NULL OR business_date = $3)
              GROUP BY business_date
              ORDER BY business_date DESC
              LIMIT $4
         )
         SELECT m.business_date,
                (SELECT sum(a.attempt) FROM job_runs a
                  WHERE a.job_name = $1 AND a.business_date = m.business_date)::bigint
                  AS month_attempts,
                j.shard, j.status, j.attempt, j.owner, j.started_at, j.finished_at,
                extract(epoch FROM clock_timestamp() - j.heartbeat_at)::float8 AS heartbeat_age_secs,
                extract(epoch FROM clock_timestamp() - j.started_at)::float8 AS started_age_secs,
                j.last_id, j.last_id_desc, j.scanned, j.updated, j.last_error, j.version
           FROM months m
           JOIN job_runs j
             ON j.job_name = $1 AND j.business_date = m.business_date AND j.shards = $2
          ORDER BY m.business_date DESC, j.shard",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(month)
    .bind(i64::from(months))
    .fetch_all(db)
    .await?)
}
