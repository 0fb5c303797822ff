//! `settlementd serve`: the long-running replica of one shard, for every enabled job of the
//! registry ([`crate::jobs`]).
//!
//! Start-up: the configuration was validated by the binary before anything here runs; `serve`
//! starts the HTTP endpoints, applies migrations when `database.migrate_on_start`, runs one
//! catch-up tick per job, then loops: tick every job on every cron wake-up (one schedule per
//! enabled job), on a timer of at most one lease heartbeat, and when a retry is due — until
//! shutdown. The jobs take turns in one loop, in the registry's order (a job that follows another
//! comes after it), at most one run that claims per job and tick.
//!
//! The cron library (tokio-cron-scheduler) is only a wake-up: its callback is one line that
//! notifies the loop. Which month is due is always recomputed from the injected [`Clock`] by
//! [`replica::Replica::tick`]. This guards against the scheduler's known time-zone problems
//! (it keeps the zone's UTC offset from job creation, so after a DST change it fires an hour
//! early or late — tokio-cron-scheduler issue #107) and against missed or repeated fires.
//!
//! Shutdown (SIGTERM/SIGINT, or the token passed to [`serve`]): nothing new is claimed; a run in
//! progress lets its batch commit, is marked FAILED `interrupted: shutdown` so a peer takes over
//! at once, and `serve` returns within `shutdown.grace_secs` even if the run does not stop.

pub mod gauges;
pub mod health;
pub mod http;
pub mod metrics;
pub mod replica;

use crate::app::{self, AppError, Database, Result};
use crate::clock::{Clock, SystemClock};
use crate::config::Settings;
use crate::db;
use crate::job_layer::{self, Owner};
use replica::{Replica, TickOutcome};
use sqlx::PgPool;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_cron_scheduler::{Job, JobScheduler};
use tokio_util::sync::CancellationToken;

/// `settlementd serve`: binds `http.listen` and serves until SIGTERM/SIGINT. The configured
/// database is not connected here but by [`serve`], which waits for a server that is down or full
/// instead of exiting.
pub async fn serve_command(settings: Settings, embedded: bool) -> Result<()> {
    jobs_cover_their_schedules(&settings, SystemClock.now())?;
    // First, before the database is looked at: a port another process holds is a mistake of the
    // configuration, found in a moment, and said before anything else.
    let listener = listen(settings.http.listen).await?;
    let database = if embedded || settings.database.embedded {
        Database::open(&settings, embedded).await?
    } else {
        let database = Database::unconnected(&settings)?;
        // A mistake no retry fixes (credentials, TLS, a transaction pooler) is one line and exit 2
        // before anything else is said; a server that is down or full is waited for once the
        // endpoints answer ([`wait_for_database`]).
        if let Err(e) = db::check(&database.pool, settings.database_url()?).await {
            if e.is_config() {
                database.close().await;
                return Err(e.into());
            }
            tracing::warn!(error = %e, "{NOT_CONNECTED}");
        }
        database
    };
    if database.embedded.is_some() && !settings.database.migrate_on_start {
        db::migrate(&database.pool).await?;
    }
    let shutdown = app::shutdown_on_signals();
    let result = serve(
        settings,
        database.pool.clone(),
        listener,
        Arc::new(SystemClock),
        shutdown,
    )
    .await;
    if tokio::time::timeout(Duration::from_secs(5), database.close())
        .await
        .is_err()
    {
        tracing::warn!("database did not close in time");
    }
    result
}

/// Binds `http.listen` ([`listen_refused`] says what a failure means).
pub async fn listen(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| listen_refused(addr, &e))
}

/// Why `http.listen` cannot be bound, as `serve` exits with it. An address already in use (another
/// process, another replica on the same host), one this host does not have, or a port this user
/// may not bind is a mistake of the configuration that no restart fixes: exit 2, one line naming
/// the address and the key (systemd's unit does not restart on 2). Anything else (out of file
/// descriptors, say) may pass: exit 1.
pub fn listen_refused(addr: SocketAddr, e: &std::io::Error) -> AppError {
    const KEY: &str = "set http.listen (SETTLEMENTD__HTTP__LISTEN)";
    let why = match e.kind() {
        std::io::ErrorKind::AddrInUse => format!(
            "another process already listens on it (a second settlementd on this host?); stop \
             it, or {KEY} to a free address"
        ),
        std::io::ErrorKind::AddrNotAvailable => {
            format!("this host has no such address; {KEY} to one of its own, or 0.0.0.0:PORT")
        }
        std::io::ErrorKind::PermissionDenied => format!(
            "this user may not listen on port {} (below 1024 needs CAP_NET_BIND_SERVICE); {KEY} \
             to a port from 1024 up",
            addr.port()
        ),
        _ => return AppError::Failed(format!("cannot listen on http.listen {addr}: {e}")),
    };
    AppError::Invalid(format!("cannot listen on http.listen {addr}: {why} ({e})"))
}

/// Refuses a configuration that does not cover the months an enabled job's schedule runs now and
/// next (for the fine settlement: a `[[fine.rules]]` list starting after them): such a replica
/// could run nothing.
pub fn jobs_cover_their_schedules(
    settings: &Settings,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<()> {
    let tz = settings.schedule.timezone;
    for job in crate::jobs::build(settings).enabled() {
        let cron = &job.schedule().cron;
        let slots = [
            crate::schedule::latest_slot_at_or_before(cron, tz, now),
            crate::schedule::next_slot_after(cron, tz, now),
        ];
        for fire_at in slots.into_iter().flatten() {
            let month = crate::schedule::Slot::new(fire_at).business_date;
            let key = crate::job_layer::JobKey {
                job_name: job.name().to_string(),
                business_date: month.date(),
                shards: settings.shard.count,
                shard: settings.shard.index,
            };
            job.params(&key).map_err(|why| {
                AppError::Invalid(format!(
                    "{} runs {month} by its schedule: {why}",
                    job.name()
                ))
            })?;
        }
    }
    Ok(())
}

/// Runs a replica until `shutdown` is cancelled: HTTP on `listener`, migrations (when
/// configured), catch-up, cron wake-ups, retries. Returns `Ok` after a graceful shutdown.
pub async fn serve(
    settings: Settings,
    pool: PgPool,
    listener: TcpListener,
    clock: Arc<dyn Clock>,
    shutdown: CancellationToken,
) -> Result<()> {
    let metrics_handle = metrics::handle();
    metrics::describe(&crate::jobs::build(&settings));

    let owner = Owner::for_process();
    let settings = Arc::new(settings);
    let registry = crate::jobs::build(&settings);
    let jobs: Vec<&'static str> = registry.enabled().map(|job| job.name()).collect();
    let health = Arc::new(health::Health::new(&jobs));
    let http_stop = CancellationToken::new();
    let local = listener.local_addr().ok();
    let http = tokio::spawn(http::run(
        listener,
        http::HttpState {
            pool: pool.clone(),
            metrics: metrics_handle,
            settings: settings.clone(),
            clock: clock.clone(),
            owner: owner.0.clone(),
            overview: Arc::new(crate::overview::Reader::new(&pool)),
            registry,
            health: health.clone(),
        },
        http_stop.clone().cancelled_owned(),
    ));
    tracing::info!(
        listen = local.map(tracing::field::display),
        "HTTP endpoints up: /healthz /readyz /metrics /v1/runs /status"
    );
    let reporter = health::Reporter::new(
        pool.clone(),
        health.clone(),
        owner.clone(),
        jobs,
        settings.shard,
        Duration::from_secs(settings.lease.heartbeat_secs),
    );

    let result = run_replica(&settings, pool, clock, owner, health, reporter, shutdown).await;

    http_stop.cancel();
    match tokio::time::timeout(Duration::from_secs(2), http).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => tracing::warn!(error = %e, "HTTP server stopped with an error"),
        Ok(Err(e)) => tracing::warn!(error = %e, "HTTP server task failed"),
        Err(_) => tracing::warn!("HTTP server did not stop in time"),
    }
    result
}

/// `database.migrate_on_start`: applies the migrations. One that waited too long for a lock
/// ([`db::DbError::LockWait`]: a long transaction of libraryd's on `loans`, or of a replica of the
/// release before on settlementd's tables) changed nothing; it is tried again every heartbeat
/// while the replica stays up and not ready (`schema`), said once, as with `migrate_on_start =
/// false` — no crash loop. `false` on shutdown.
async fn migrate_on_start(
    settings: &Settings,
    pool: &PgPool,
    shutdown: &CancellationToken,
) -> Result<bool> {
    let mut waited = false;
    loop {
        let migrated = tokio::select! {
            migrated = db::migrate(pool) => migrated,
            _ = shutdown.cancelled() => return Ok(false),
        };
        match migrated {
            Ok(applied) => {
                tracing::info!(applied = applied.len(), "migrations checked");
                return Ok(true);
            }
            Err(e @ db::DbError::LockWait { .. }) => {
                if !waited {
                    tracing::warn!(error = %e, "not ready: a migration waits for another session's lock; `serve` tries again every heartbeat");
                    waited = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(settings.lease.heartbeat_secs)) => {}
                    _ = shutdown.cancelled() => return Ok(false),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

async fn run_replica(
    settings: &Settings,
    pool: PgPool,
    clock: Arc<dyn Clock>,
    owner: Owner,
    health: Arc<health::Health>,
    reporter: health::Reporter,
    shutdown: CancellationToken,
) -> Result<()> {
    if !wait_for_database(settings, &pool, &shutdown).await? {
        return Ok(());
    }
    // A loans table of another shape is refused before anything is written (exit 2).
    tokio::select! {
        checked = app::check_schema(&pool, settings) => checked?,
        _ = shutdown.cancelled() => return Ok(()),
    }
    if settings.database.migrate_on_start {
        if !migrate_on_start(settings, &pool, &shutdown).await? {
            return Ok(());
        }
    } else if !db::wait_for_schema(
        &pool,
        Duration::from_secs(settings.lease.heartbeat_secs),
        &shutdown,
    )
    .await
    {
        return Ok(());
    }

    let wake = Arc::new(Notify::new());
    let registry = crate::jobs::build(settings);
    let mut scheduler = start_wakeups(settings, &registry, wake.clone()).await;
    let open = Arc::new(replica::OpenMonths::default());
    let replicas: Vec<Replica> = registry
        .enabled()
        .map(|job| {
            Replica::for_job(
                pool.clone(),
                settings,
                job.clone(),
                clock.clone(),
                shutdown.clone(),
            )
            .with_owner(owner.clone())
            .with_health(health.clone())
            .with_open_months(open.clone())
        })
        .collect();
    for replica in &replicas {
        replica.span().in_scope(|| {
            tracing::info!(
                cron = %replica.job().schedule().cron.pattern,
                timezone = %settings.schedule.timezone,
                catch_up = settings.schedule.catch_up,
                "replica started"
            )
        });
    }
    let retention = settings.retention.enabled.then(|| RetentionTicker {
        settings: settings.clone(),
        pool: pool.clone(),
        clock: clock.clone(),
        owner: owner.clone(),
        shutdown: shutdown.clone(),
        done: None,
    });
    let looked = Arc::new(Notify::new());
    let stop_liveness = CancellationToken::new();
    let mut liveness = tokio::spawn(liveness(
        pool.clone(),
        wake.clone(),
        reporter,
        replicas.iter().map(Replica::gauges).collect(),
        Duration::from_secs(settings.lease.heartbeat_secs),
        looked.clone(),
        stop_liveness.clone(),
    ));
    let mut worker = tokio::spawn(tick_loop(
        replicas,
        retention,
        looked,
        wake,
        shutdown.clone(),
    ));

    let grace = Duration::from_secs(settings.shutdown.grace_secs);
    tokio::select! {
        _ = &mut worker => {}
        _ = shutdown.cancelled() => {
            tracing::info!(grace_secs = grace.as_secs(), "shutting down: no new claims; waiting for the run in progress");
            if tokio::time::timeout(grace, &mut worker).await.is_err() {
                tracing::warn!("the run did not stop within shutdown.grace_secs; exiting anyway (its lease will expire)");
                worker.abort();
            }
        }
    }
    // The process leaves the fleet once its work has stopped (the run in progress marked FAILED
    // for a peer to take over): until then it is live, and says so.
    stop_liveness.cancel();
    if tokio::time::timeout(LEAVE_WITHIN, &mut liveness)
        .await
        .is_err()
    {
        tracing::warn!("the liveness task did not stop in time");
        liveness.abort();
    }
    if let Some(scheduler) = scheduler.as_mut() {
        if tokio::time::timeout(Duration::from_secs(1), scheduler.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("cron scheduler did not stop in time");
        }
    }
    tracing::info!("stopped");
    Ok(())
}

const NOT_CONNECTED: &str = "cannot connect to the database; not ready, retrying with backoff";

/// Connects (two connections, the checks of [`db::check`]) until it works or `shutdown` (false).
/// A server that is down or full is waited for, with the retry backoff, one warning per attempt
/// carrying the server's reason; the replica is up and not ready meanwhile. A mistake no retry
/// fixes (credentials, TLS, a pooler in transaction mode) ends `serve` with exit 2.
async fn wait_for_database(
    settings: &Settings,
    pool: &PgPool,
    shutdown: &CancellationToken,
) -> Result<bool> {
    let url = settings.database_url().unwrap_or("postgres://(embedded)");
    let mut failures = 0;
    loop {
        let error = tokio::select! {
            checked = db::check(pool, url) => match checked {
                Ok(()) => {
                    if failures > 0 {
                        tracing::info!(failures, "connected to the database");
                    }
                    return Ok(true);
                }
                Err(e) if e.is_config() => return Err(AppError::from(e)),
                Err(e) => e,
            },
            _ = shutdown.cancelled() => return Ok(false),
        };
        failures += 1;
        let after = replica::backoff(
            failures,
            settings.retry.initial_secs,
            settings.retry.max_secs,
            rand::random(),
        );
        tracing::warn!(
            error = %error,
            failures,
            retry_in_secs = after.as_secs_f64(),
            "{NOT_CONNECTED}"
        );
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(false),
            _ = tokio::time::sleep(after) => {}
        }
    }
}

/// Every how many heartbeats the liveness task evaluates readiness and looks at what is not closed
/// (in between, it says it is there and refreshes the latest month's gauges).
const FULL_EVERY: u64 = 3;

/// How long a stopping process waits for its liveness task's last report and leave.
const LEAVE_WITHIN: Duration = Duration::from_secs(3);

/// The process's liveness, apart from its work: on the heartbeat it reports itself in `replicas`
/// (release, readiness; what it runs is its claims in `job_runs`), publishes the shard-owner gauges
/// ([`health::Reporter`]) and refreshes each job's gauges ([`gauges::Gauges::refresh`]), whatever
/// the ticks are doing: a tick awaits its whole run, which lasts hours at a large month's end, and
/// a replica that reported only between ticks looked gone, its shard ownerless, its gauges frozen.
/// The first report waits for every job's first look at what is due (`looked`, so it says ready
/// at once) or a heartbeat; the process leaves the fleet when `stop` is cancelled.
///
/// On the process's pool, one connection at a time; each job's own look at what is not closed
/// stops after its share of half a heartbeat, so the next report is on time.
async fn liveness(
    pool: PgPool,
    wake: Arc<Notify>,
    mut reporter: health::Reporter,
    gauges: Vec<Arc<gauges::Gauges>>,
    heartbeat: Duration,
    looked: Arc<Notify>,
    stop: CancellationToken,
) {
    let mut requests = Requests::new(&pool);
    requests.connect().await;
    let first = tokio::time::sleep(heartbeat);
    tokio::pin!(first);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = looked.notified() => break,
            _ = &mut first => break,
            woken = requests.recv() => if woken { wake.notify_one() },
        }
    }
    let budget = heartbeat / (2 * gauges.len().max(1) as u32);
    let mut every = tokio::time::interval_at(tokio::time::Instant::now() + heartbeat, heartbeat);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beats: u64 = 0;
    while !stop.is_cancelled() {
        // Every FULL_EVERY heartbeats, readiness evaluated again, the gauges refreshed and what is
        // not closed looked at, on the pool; in between only the row and the owners, on the LISTEN
        // connection when there is one: on a server whose connections are all taken, each
        // statement more per heartbeat is one more wait for the runs' own acquires, and an idle
        // replica keeps that one connection alone.
        if beats % FULL_EVERY == 0 {
            reporter.report().await;
            for job in &gauges {
                job.refresh(heartbeat * FULL_EVERY as u32, budget).await;
            }
        } else {
            match requests.listener.as_mut() {
                Some(listener) => reporter.report_seen_on(listener).await,
                None => reporter.report_seen().await,
            }
        }
        beats += 1;
        if requests.listener.is_none() {
            requests.connect().await;
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = every.tick() => break,
                woken = requests.recv() => if woken { wake.notify_one() },
            }
        }
    }
    reporter.leave().await;
}

/// The process's `LISTEN` for run requests ([`crate::job_layer::requests::CHANNEL`]), on a small
/// pool of its own (one connection held for good), which the liveness task also reports on. If
/// LISTEN is unavailable or the connection drops, the tick loop's timer (at most one heartbeat)
/// still finds stored requests; this only makes them prompt. Tried again at most every 5 s.
struct Requests {
    own: PgPool,
    listener: Option<sqlx::postgres::PgListener>,
    retry_at: Option<tokio::time::Instant>,
    warned: bool,
}

impl Requests {
    fn new(pool: &PgPool) -> Self {
        let options = (*pool.connect_options()).clone();
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(options);
        Self {
            own,
            listener: None,
            retry_at: None,
            warned: false,
        }
    }

    async fn connect(&mut self) {
        if self
            .retry_at
            .is_some_and(|at| tokio::time::Instant::now() < at)
        {
            return;
        }
        let listened = async {
            let mut listener = sqlx::postgres::PgListener::connect_with(&self.own).await?;
            listener.listen(crate::job_layer::requests::CHANNEL).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        match tokio::time::timeout(Duration::from_secs(5), listened).await {
            Ok(Ok(listener)) => {
                tracing::debug!("listening for run requests");
                self.listener = Some(listener);
                self.retry_at = None;
            }
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "the database did not answer in time".to_string(),
                };
                self.lost(&error);
            }
        }
    }

    fn lost(&mut self, error: &str) {
        if !self.warned {
            tracing::warn!(error = %error, "cannot LISTEN for run requests; polling for them every heartbeat instead");
            self.warned = true;
        }
        self.listener = None;
        self.retry_at = Some(tokio::time::Instant::now() + Duration::from_secs(5));
    }

    /// Waits for a notification: true when one came; false when the connection broke (then
    /// [`Requests::connect`] tries again). Pending for ever without a listener. Cancel-safe
    /// (`PgListener::recv` is).
    async fn recv(&mut self) -> bool {
        let Some(listener) = self.listener.as_mut() else {
            return std::future::pending().await;
        };
        match listener.recv().await {
            Ok(_) => true,
            Err(e) => {
                self.lost(&e.to_string());
                false
            }
        }
    }
}

/// The replicas' ticks until shutdown: every job at start-up (catch-up), then on every wake-up,
/// and the day's retention run, when it is enabled. `looked` is told once every job has looked
/// at what is due.
async fn tick_loop(
    mut replicas: Vec<Replica>,
    mut retention: Option<RetentionTicker>,
    looked: Arc<Notify>,
    wake: Arc<Notify>,
    shutdown: CancellationToken,
) {
    for replica in replicas.iter_mut() {
        replica.look().await;
    }
    looked.notify_one();
    loop {
        if let Some(retention) = retention.as_mut() {
            retention.tick().await;
        }
        let mut again = false;
        for replica in replicas.iter_mut() {
            let outcome = replica.tick().await;
            let _in_span = replica.span().enter();
            match &outcome {
                TickOutcome::Interrupted { .. } | TickOutcome::ShuttingDown => return,
                TickOutcome::Settled { slot, report } => {
                    replica
                        .month_span(slot.business_date, report.attempt)
                        .in_scope(|| {
                            tracing::info!(business_date = %slot.business_date, fire_at = %slot.fire_at, "month run to SUCCESS")
                        });
                    again = true;
                }
                // Another request, the schedule or another month may be due: look again at once.
                TickOutcome::Served { .. }
                | TickOutcome::RequestFailed { .. }
                | TickOutcome::LateReturns { .. } => again = true,
                other => tracing::debug!(outcome = other.label(), "tick"),
            }
            if shutdown.is_cancelled() {
                return;
            }
        }
        if again {
            continue;
        }
        let wait = replicas
            .iter()
            .map(Replica::next_wake)
            .min()
            .unwrap_or(Duration::from_secs(1));
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = wake.notified() => tracing::debug!("cron wake-up"),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// The day's retention run ([`crate::job_layer::retention`]), claimed like a job: one replica a day
/// does it, the others find the day's key SUCCESS (or held) and skip it.
struct RetentionTicker {
    settings: Settings,
    pool: PgPool,
    clock: Arc<dyn Clock>,
    owner: Owner,
    shutdown: CancellationToken,
    /// The day this process last saw its retention done: a shortcut until the next day, never the
    /// source of truth (the day's key in `job_runs` is).
    done: Option<chrono::NaiveDate>,
}

impl RetentionTicker {
    async fn tick(&mut self) {
        let now = self.clock.now();
        let key = app::retention_key(&self.settings, now);
        if self.done == Some(key.business_date) || self.shutdown.is_cancelled() {
            return;
        }
        let job = app::retention_job(&self.settings, self.settings.retention.older_than_days, now);
        let opts = job_layer::RunOptions {
            owner: self.owner.clone(),
            ..app::run_options(&self.settings, false, false)
        };
        match job_layer::run_once(
            &self.pool,
            &job,
            key.clone(),
            &opts,
            &self.shutdown,
            &|_| {},
        )
        .await
        {
            Ok(report) => {
                if report.skipped.is_none() {
                    ::metrics::counter!(metrics::RETENTION_DELETED_TOTAL).increment(report.updated);
                    tracing::info!(
                        deleted = report.updated,
                        batches = report.batches,
                        "retention: old months' audit rows deleted"
                    );
                }
                if report.skipped != Some(job_layer::SkipReason::Held) {
                    self.done = Some(key.business_date);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "retention run failed; trying again at the next tick")
            }
        }
    }
}

/// Starts tokio-cron-scheduler as a wake-up source: one schedule per enabled job. A failure here is
/// logged, not fatal: the tick loop's own timer still wakes at every fire time.
async fn start_wakeups(
    settings: &Settings,
    registry: &crate::job_layer::registry::Registry,
    wake: Arc<Notify>,
) -> Option<JobScheduler> {
    let crons: Vec<String> = registry
        .enabled()
        .map(|job| job.schedule().cron.pattern.to_string())
        .collect();
    let started = async {
        let scheduler = JobScheduler::new().await?;
        for pattern in &crons {
            let wake = wake.clone();
            let job = Job::new_tz(pattern.as_str(), settings.schedule.timezone, move |_, _| {
                wake.notify_one()
            })?;
            scheduler.add(job).await?;
        }
        scheduler.start().await?;
        Ok::<_, tokio_cron_scheduler::JobSchedulerError>(scheduler)
    }
    .await;
    match started {
        Ok(scheduler) => Some(scheduler),
        Err(e) => {
            tracing::warn!(error = %e, crons = %crons.join(" | "), "cron scheduler did not start; relying on the tick timer");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Error, ErrorKind};

    #[test]
    fn a_port_taken_an_address_not_here_or_a_port_not_allowed_is_exit_2_naming_the_address() {
        let addr: SocketAddr = "127.0.0.1:80".parse().unwrap();
        for (kind, says) in [
            (ErrorKind::AddrInUse, "already listens on it"),
            (ErrorKind::AddrNotAvailable, "this host has no such address"),
            (ErrorKind::PermissionDenied, "may not listen on port 80"),
        ] {
            let refused = listen_refused(addr, &Error::from(kind));
            let line = refused.to_string();
            assert!(matches!(refused, AppError::Invalid(_)), "{kind:?}: {line}");
            assert!(line.contains("http.listen 127.0.0.1:80"), "{line}");
            assert!(line.contains(says) && !line.contains('\n'), "{line}");
        }
        let other = listen_refused(addr, &Error::from(ErrorKind::OutOfMemory));
        assert!(matches!(other, AppError::Failed(_)), "{other}");
    }
}
