//! The Prometheus recorder and the daemon's own metrics.
//!
//! One recorder per process, installed on first use: `metrics` allows a single global recorder,
//! and tests start `serve` many times in one process. The recorder never opens a listener of its
//! own; `/metrics` renders it (see [`super::http`]).
//!
//! Every metric of a job carries `job_name`. Emitted by the job layer:
//! `settlementd_claims_total{result=won|lost|done}`, `settlementd_takeovers_total`,
//! `settlementd_fencing_rejections_total`, `settlementd_rows_scanned_total`,
//! `settlementd_rows_updated_total`, and the conflicts counter a job declares; by a job itself
//! (the fine settlement: `settlementd_odd_rows_total`). Emitted here: the rest.
//!
//! The families of a job's own items — late items done, items waiting and held, items before the
//! lookback, refused claims — and the outcome of its successful runs are what the job declares
//! ([`crate::job_layer::Job::metrics`]); a job that declares none has none, and every help line that
//! names jobs is written from the registry.

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// Runs by outcome: the job's own word for success (`succeeded` by default), `skipped` (already
/// SUCCESS or held by a live peer), `failed`, `lease_lost`, and the job's outcome for a claim
/// refused for other pinned parameters, if it declares one.
pub const RUNS_TOTAL: &str = "settlementd_runs_total";
/// Months inside the lookback that are not closed under the current shard count (every shard),
/// [`crate::job_layer::due::MonthState::Open`]: started or with items waiting, and not SUCCESS
/// on every shard, or with items waiting, or being corrected. Held months are not among them.
pub const MONTHS_NOT_CLOSED: &str = "settlementd_months_not_closed";
/// Months inside the lookback whose every shard is SUCCESS and nothing waits, but items are held
/// for an operator ([`crate::job_layer::due::MonthState::Held`]).
pub const MONTHS_HELD: &str = "settlementd_months_held";
/// 1 while the job is paused (`settlementd pause`), else 0.
pub const PAUSED: &str = "settlementd_paused";
/// Unix time the job was paused (0 while it is not): with the latest fire, whether a pause
/// outlived a fire.
pub const PAUSED_SINCE: &str = "settlementd_paused_since_timestamp_seconds";
/// Rows the daily retention run deleted (job_events, run_requests, job_runs).
pub const RETENTION_DELETED_TOTAL: &str = "settlementd_retention_deleted_total";
/// Corrections begun and not completed (every month): their months are held, "being corrected".
pub const CORRECTIONS_UNFINISHED: &str = "settlementd_corrections_unfinished";
/// Runs of stored run requests by outcome: the job's word for success, `failed`.
pub const REQUEST_RUNS_TOTAL: &str = "settlementd_request_runs_total";
/// Run requests accepted over HTTP (new ones, not replays).
pub const REQUESTS_ACCEPTED_TOTAL: &str = "settlementd_requests_accepted_total";
/// Seconds from claim to SUCCESS or failure, for runs that claimed.
pub const RUN_DURATION_SECONDS: &str = "settlementd_run_duration_seconds";
/// Unix time (replica clock) of the last SUCCESS this replica saw for its shard.
pub const LAST_SUCCESS_TIMESTAMP: &str = "settlementd_last_success_timestamp_seconds";
/// Unix time of the next scheduled fire.
pub const NEXT_FIRE_TIMESTAMP: &str = "settlementd_next_fire_timestamp_seconds";
/// How many seconds after its slot's fire time the last claimed run started.
pub const LAST_RUN_LATENESS_SECONDS: &str = "settlementd_last_run_lateness_seconds";
/// Unix time of the latest scheduled fire at or before now: the month that should be closed.
pub const LATEST_FIRE_TIMESTAMP: &str = "settlementd_latest_fire_timestamp_seconds";
/// Shards of `shard.count` whose claim for the latest fire's month is not SUCCESS, read from
/// `job_runs`: every replica reports the whole month, including shards whose replica is down.
pub const LATEST_FIRE_SHARDS_NOT_SUCCESS: &str = "settlementd_latest_fire_shards_not_success";
/// The old name of [`LATEST_FIRE_SHARDS_NOT_SUCCESS`], exported only for a job whose metrics ask
/// for it (the fine settlement: `Metrics::old_unsettled_shards`). Deprecated.
pub const LATEST_MONTH_UNSETTLED_SHARDS: &str = "settlementd_latest_month_unsettled_shards";
/// The configured `shard.count`, so alerts can compare it with the replicas that report.
pub const SHARDS: &str = "settlementd_shards";
/// 1 when `/readyz` would answer 200, else 0; evaluated every heartbeat and on every `/readyz` and
/// `/metrics` request ([`super::health`]).
pub const READY: &str = "settlementd_ready";
/// 1 for the reason the replica is not ready (`database`, `read_only`, `schema`, `starting`,
/// `rule_conflict`, `definer_owner`, `loans_triggers`), 0 for the others; all 0 when it is ready.
pub const NOT_READY: &str = "settlementd_not_ready";
/// settlementd's triggers on libraryd's `loans` that are missing, disabled or not as `migrate`
/// created them ([`crate::db::Guards`]): libraryd's edits of settled loans are not queued.
pub const LOANS_TRIGGERS_TAMPERED: &str = "settlementd_loans_triggers_tampered";
/// Always 1, labelled with this binary's `version` and `commit`: a fleet's releases in one query.
pub const BUILD_INFO: &str = "settlementd_build_info";
/// Months not closed (as [`MONTHS_NOT_CLOSED`] counts them) whose deadline has passed: the end of
/// day `settle.deadline_day` of the next month, in `schedule.timezone` (0 without a deadline).
pub const MONTHS_PAST_DEADLINE: &str = "settlementd_months_past_deadline";
/// Unix time of the latest fire's month's deadline (`settle.deadline_day`), for "time left".
pub const DEADLINE_TIMESTAMP: &str = "settlementd_deadline_timestamp_seconds";
/// Claims of the job, any month and shard count, RUNNING with a lease older than `lease.ttl_secs`
/// (database clock): a holder that stopped renewing, not yet taken over.
pub const EXPIRED_LEASES: &str = "settlementd_expired_leases";
/// Live replicas (reported within three heartbeats in `replicas`) that own this replica's shard,
/// itself included, labelled `shard`: 2 or more is a duplicate replica.
pub const SHARD_OWNERS: &str = "settlementd_shard_owners";
/// The shards of this replica's shard count by how many live replicas own them (`owners` = `0`,
/// `1`, `2+`), read from `replicas`: every replica reports the whole fleet, so a shard with no
/// replica, or with two, shows on whichever replica is scraped, and a duplicate cannot hide a
/// missing one.
pub const SHARDS_BY_OWNERS: &str = "settlementd_shards_by_owners";
/// The pool's connections by `state` (`idle`, `in_use`).
pub const POOL_CONNECTIONS: &str = "settlementd_db_pool_connections";
/// The pool's `database.max_connections`.
pub const POOL_MAX_CONNECTIONS: &str = "settlementd_db_pool_max_connections";
/// Requests to the runs API refused for a missing or wrong bearer token (`401`).
pub const AUTH_REFUSED_TOTAL: &str = "settlementd_auth_refused_total";

const DURATION_BUCKETS: &[f64] = &[
    0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();

fn process() -> &'static metrics_process::Collector {
    PROCESS.get_or_init(metrics_process::Collector::default)
}

/// What is read when it is scraped rather than when it changes: the process's own metrics
/// (`process_cpu_seconds_total`, `process_resident_memory_bytes`, `process_open_fds`, …) and the
/// pool's connections.
pub fn sample(pool: &sqlx::PgPool) {
    process().collect();
    let size = pool.size();
    let idle = pool.num_idle() as u32;
    metrics::gauge!(POOL_CONNECTIONS, "state" => "idle").set(f64::from(idle));
    metrics::gauge!(POOL_CONNECTIONS, "state" => "in_use")
        .set(f64::from(size.saturating_sub(idle)));
    metrics::gauge!(POOL_MAX_CONNECTIONS).set(f64::from(pool.options().get_max_connections()));
}

/// The process's recorder handle, installing the recorder the first time.
///
/// If some other recorder was installed first, returns a handle to a detached recorder (it renders
/// nothing) rather than failing: metrics are an aid, not a reason to stop settling.
pub fn handle() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new();
            let builder = match builder.set_buckets_for_metric(
                Matcher::Full(RUN_DURATION_SECONDS.to_string()),
                DURATION_BUCKETS,
            ) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, "metrics: default histogram buckets");
                    PrometheusBuilder::new()
                }
            };
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if let Err(e) = metrics::set_global_recorder(recorder) {
                tracing::warn!(error = %e, "metrics: another recorder is installed; /metrics will be empty");
            }
            handle
        })
        .clone()
}

/// Declares every metric at start-up so `/metrics` lists them before the first run, the per-job
/// ones for each job of `registry` (and each job's own).
pub fn describe(registry: &crate::job_layer::registry::Registry) {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    for job in registry.iter() {
        job.describe_metrics();
        let names = job.metrics();
        for counter in names.counters() {
            describe_counter!(counter.name, counter.help);
        }
        for gauge in names.gauges() {
            describe_gauge!(gauge.name, gauge.help);
        }
    }
    let by_job = |say: &dyn Fn(crate::job_layer::Metrics) -> String| {
        registry
            .iter()
            .map(|j| format!("{}: {}", j.name(), say(j.metrics())))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let succeeded = by_job(&|m| m.succeeded.to_string());
    let refused = by_job(&|m| {
        m.conflicts
            .map_or("none", |(_, outcome)| outcome)
            .to_string()
    });
    let items = by_job(&|m| m.items.to_string());
    describe_counter!(
        RUNS_TOTAL,
        format!("Runs by outcome: the job's success ({succeeded}), skipped, failed, lease_lost, and a claim refused for other pinned parameters ({refused})")
    );
    describe_histogram!(
        RUN_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of runs that claimed"
    );
    describe_gauge!(
        LAST_SUCCESS_TIMESTAMP,
        Unit::Seconds,
        "Unix time of the last SUCCESS"
    );
    describe_gauge!(
        NEXT_FIRE_TIMESTAMP,
        Unit::Seconds,
        "Unix time of the next scheduled fire"
    );
    describe_gauge!(
        LAST_RUN_LATENESS_SECONDS,
        Unit::Seconds,
        "Seconds between the slot's fire time and the start of its last claimed run"
    );
    describe_gauge!(
        LATEST_FIRE_TIMESTAMP,
        Unit::Seconds,
        "Unix time of the latest scheduled fire at or before now"
    );
    describe_gauge!(
        LATEST_FIRE_SHARDS_NOT_SUCCESS,
        "Shards of the shard count whose claim for the latest fire's month is not SUCCESS"
    );
    describe_gauge!(
        LATEST_MONTH_UNSETTLED_SHARDS,
        "Deprecated: settlementd_latest_fire_shards_not_success under its old name (the fine settlement only)"
    );
    describe_gauge!(SHARDS, "The configured shard.count");
    describe_gauge!(
        MONTHS_NOT_CLOSED,
        "Months inside settle.lookback_months not closed under the current shard count (a shard not SUCCESS, items waiting, or a correction unfinished), every shard; held months are counted apart"
    );
    describe_gauge!(
        MONTHS_HELD,
        "Months inside settle.lookback_months held: every shard SUCCESS and nothing waits, but items are held for an operator (rows with bad dates)"
    );
    describe_gauge!(
        PAUSED,
        "1 while the job is paused (settlementd pause), else 0"
    );
    describe_gauge!(
        PAUSED_SINCE,
        Unit::Seconds,
        "Unix time the job was paused (0 while it runs)"
    );
    describe_counter!(
        RETENTION_DELETED_TOTAL,
        "Rows of job_events, run_requests and job_runs the daily retention run deleted"
    );
    describe_gauge!(
        CORRECTIONS_UNFINISHED,
        "Corrections begun and not completed: their months are held, being corrected"
    );
    describe_gauge!(
        READY,
        "1 when /readyz would answer 200: the database answers and takes writes, the schema is current, and no due month is refused for the replica's rule"
    );
    describe_gauge!(
        NOT_READY,
        "1 for the reason the replica is not ready (database, read_only, schema, starting, rule_conflict, definer_owner, loans_triggers), else 0"
    );
    describe_gauge!(
        LOANS_TRIGGERS_TAMPERED,
        "settlementd's triggers on loans that are missing, disabled or changed: libraryd's edits of settled loans are not queued"
    );
    describe_gauge!(
        BUILD_INFO,
        "Always 1, labelled with the binary's version and commit"
    );
    metrics::gauge!(
        BUILD_INFO,
        "version" => crate::version::VERSION,
        "commit" => crate::version::COMMIT
    )
    .set(1.0);
    describe_counter!(
        REQUEST_RUNS_TOTAL,
        format!("Runs of stored run requests by outcome: the job's success ({succeeded}), failed")
    );
    describe_counter!(
        REQUESTS_ACCEPTED_TOTAL,
        "Run requests accepted over HTTP (new ones, not replays)"
    );
    describe_counter!(
        "settlementd_claims_total",
        "Claim attempts by result: won, lost, done"
    );
    describe_counter!(
        "settlementd_takeovers_total",
        "Claims that replaced a FAILED or stale run"
    );
    describe_counter!(
        "settlementd_fencing_rejections_total",
        "Writes refused because the claim was taken over"
    );
    describe_counter!(
        "settlementd_rows_scanned_total",
        format!("Items the job's batches read ({items})")
    );
    describe_counter!(
        "settlementd_rows_updated_total",
        format!("Items the job's batches wrote ({items})")
    );
    describe_counter!(
        AUTH_REFUSED_TOTAL,
        "Runs API requests refused for a missing or wrong bearer token (401)"
    );
    describe_gauge!(
        MONTHS_PAST_DEADLINE,
        "Months not closed after their deadline: the end of day settle.deadline_day of the next month (0 without a deadline)"
    );
    describe_gauge!(
        DEADLINE_TIMESTAMP,
        Unit::Seconds,
        "Unix time of the deadline of the latest fire's month (settle.deadline_day)"
    );
    describe_gauge!(
        EXPIRED_LEASES,
        "Claims RUNNING with a lease older than lease.ttl_secs (database clock), any month and shard count: a holder that stopped renewing"
    );
    describe_gauge!(
        SHARD_OWNERS,
        "Live replicas in the replicas table that own this replica's shard, itself included (1 is right)"
    );
    describe_gauge!(
        SHARDS_BY_OWNERS,
        "Shards of this replica's shard count by how many live replicas own them (owners=0, 1, 2+), from the replicas table"
    );
    describe_gauge!(
        POOL_CONNECTIONS,
        "The database pool's connections by state (idle, in_use)"
    );
    describe_gauge!(POOL_MAX_CONNECTIONS, "database.max_connections");
    process().describe();
    metrics::counter!(AUTH_REFUSED_TOTAL).increment(0);
    metrics::gauge!(CORRECTIONS_UNFINISHED).set(0.0);
    metrics::counter!(RETENTION_DELETED_TOTAL).increment(0);
    for job in registry.iter() {
        let names = job.metrics();
        let job = job.name();
        let conflict = names.conflicts.map(|(_, outcome)| outcome);
        let outcomes = [names.succeeded, "skipped", "failed", "lease_lost"];
        for outcome in outcomes.into_iter().chain(conflict) {
            metrics::counter!(RUNS_TOTAL, "job_name" => job, "outcome" => outcome).increment(0);
        }
        for outcome in [names.succeeded, "failed"] {
            metrics::counter!(REQUEST_RUNS_TOTAL, "job_name" => job, "outcome" => outcome)
                .increment(0);
        }
        // Set by the replica at each tick; present (0) from the start.
        for gauge in [
            MONTHS_NOT_CLOSED,
            MONTHS_HELD,
            MONTHS_PAST_DEADLINE,
            PAUSED,
            PAUSED_SINCE,
            EXPIRED_LEASES,
        ] {
            metrics::gauge!(gauge, "job_name" => job).set(0.0);
        }
        for gauge in names.gauges() {
            metrics::gauge!(gauge.name, "job_name" => job).set(0.0);
        }
        for result in ["won", "lost", "done"] {
            metrics::counter!("settlementd_claims_total", "job_name" => job, "result" => result)
                .increment(0);
        }
        for name in [
            "settlementd_takeovers_total",
            "settlementd_fencing_rejections_total",
            "settlementd_rows_scanned_total",
            "settlementd_rows_updated_total",
        ] {
            metrics::counter!(name, "job_name" => job).increment(0);
        }
        // The amount is counted by month: no series without one.
        for counter in names.counters().filter(|c| Some(*c) != names.amount) {
            metrics::counter!(counter.name, "job_name" => job).increment(0);
        }
    }
    metrics::counter!(REQUESTS_ACCEPTED_TOTAL).increment(0);
}
