//! What every command shares, below all of them: the error type and its exit codes, opening and
//! closing the database (configured or embedded), logging, the shutdown signal, the run options and
//! the job built from [`Settings`], and the default business date.
//!
//! `cli`, `commands`, `daemon`, `demo` and `seed` use this module; it uses none of them.

use crate::calendar::{BusinessDate, CalendarError};
use crate::clock::Clock;
use crate::config::{ConfigError, LogFormat, Settings};
use crate::db::{self, DbError};
use crate::embedded_pg::{EmbeddedError, EmbeddedOptions, EmbeddedPg};
use crate::job_layer::{JobError, Owner, RunOptions};
use crate::jobs::fine_settlement::FineSettlement;
use sqlx::PgPool;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Every failure a command can end with, by exit code.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Exit 2: bad input or configuration; nothing was done.
    #[error("{0}")]
    Invalid(String),
    /// Exit 1: the work failed (database error, lost lease, interruption), or a check found the
    /// month wrong (`verify`).
    #[error("{0}")]
    Failed(String),
    /// Exit 3: refused because of what the database records: the month's pinned parameters
    /// differ from this replica's, the job is paused, or (`correct`) a live run holds the month.
    #[error("{0}")]
    Refused(String),
    /// Exit 4: stopped part-way by a pause, after committing some of its work (its claim is
    /// FAILED `interrupted: paused` and resumes where it stopped). `json`: what `--json` prints.
    #[error("{message}")]
    Paused {
        message: String,
        json: serde_json::Value,
    },
    /// Exit 5: a range of months ended with keys another run still holds (RUNNING under a lease
    /// that has not expired): they are not done, and `--wait` waits for them.
    #[error("{0}")]
    Held(String),
    /// Exit 6 (`verify`): the month's money is right, and it is not right only because of items
    /// its job holds (the settlement's rows the rule cannot price): data to fix, not money.
    #[error("{0}")]
    RowsHeld(String),
}

impl AppError {
    pub fn exit_code(&self) -> ExitCode {
        match self {
            AppError::Invalid(_) => ExitCode::from(2),
            AppError::Failed(_) => ExitCode::from(1),
            AppError::Refused(_) => ExitCode::from(3),
            AppError::Paused { .. } => ExitCode::from(4),
            AppError::Held(_) => ExitCode::from(5),
            AppError::RowsHeld(_) => ExitCode::from(6),
        }
    }
}

impl From<ConfigError> for AppError {
    fn from(e: ConfigError) -> Self {
        AppError::Invalid(e.to_string())
    }
}
impl From<CalendarError> for AppError {
    fn from(e: CalendarError) -> Self {
        AppError::Invalid(e.to_string())
    }
}
impl From<DbError> for AppError {
    fn from(e: DbError) -> Self {
        if e.is_config() {
            AppError::Invalid(e.to_string())
        } else {
            AppError::Failed(e.to_string())
        }
    }
}
impl From<JobError> for AppError {
    fn from(e: JobError) -> Self {
        if let JobError::Paused {
            job,
            by,
            since,
            reason,
            wrote: Some(wrote),
        } = &e
        {
            let json = serde_json::json!({
                "job": job,
                "stopped": "paused",
                "paused_after_batches": wrote.batches,
                "updated": wrote.updated,
                "paused_by": by,
                "paused_at": since,
                "reason": reason,
            });
            return AppError::Paused {
                message: e.to_string(),
                json,
            };
        }
        match e {
            JobError::ParamsConflict { .. }
            | JobError::BeingCorrected { .. }
            | JobError::NotReady { .. }
            | JobError::Paused { .. } => AppError::Refused(e.to_string()),
            JobError::NoParams { .. } | JobError::NotAPeriod { .. } => {
                AppError::Invalid(e.to_string())
            }
            _ => AppError::Failed(with_hint(e.to_string(), undefined_table(&e))),
        }
    }
}

/// Missing tables mean the database was never migrated: say how to fix it.
fn undefined_table(e: &JobError) -> bool {
    matches!(e, JobError::Db(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01"))
}

fn with_hint(message: String, missing_schema: bool) -> String {
    if missing_schema {
        format!("{message} (run `settlementd migrate` first)")
    } else {
        message
    }
}
impl From<EmbeddedError> for AppError {
    fn from(e: EmbeddedError) -> Self {
        if e.is_config() {
            AppError::Invalid(e.to_string())
        } else {
            AppError::Failed(e.to_string())
        }
    }
}
impl From<sqlx::Error> for AppError {
    fn from(e: sqlx::Error) -> Self {
        AppError::from(JobError::Db(e))
    }
}

pub type Result<T, E = AppError> = std::result::Result<T, E>;

/// `default_level` for settlementd's own messages, with the cron scheduler's routine ones ("Job
/// creator created", each tick's bookkeeping) kept to warnings: they say nothing an operator acts
/// on. `RUST_LOG` replaces the whole filter.
fn quiet(default_level: &str) -> String {
    format!("{default_level},tokio_cron_scheduler=warn")
}

/// Sets up logging on stderr (stdout is for command output).
///
/// sqlx's slow-statement warnings carry the whole statement, over many lines; they are replaced by
/// one line of [`slow::Statements`] naming the statement, and never reach the formatter themselves.
/// Nor do its lines for each connection a writer's pool turns away from a read-only server: the
/// pool says that once per change ([`db::is_sqlx_hook_failure`]).
pub fn init_logging(format: LogFormat, default_level: &str) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{filter::filter_fn, EnvFilter, Layer};
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(quiet(default_level)));
    let json = match format {
        LogFormat::Json => true,
        LogFormat::Text => false,
        LogFormat::Auto => !std::io::stdout().is_terminal(),
    };
    // sqlx's line for each connection a writer's pool turns away is said once per change by the
    // pool itself ([`db::is_sqlx_hook_failure`]).
    let shown =
        || filter_fn(|meta| !slow::is_sqlx_slow_statement(meta) && !db::is_sqlx_hook_failure(meta));
    let json_layer = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(shown())
    });
    let text_layer = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .with_filter(shown())
    });
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(json_layer)
        .with(text_layer)
        // Last: its line is an event of its own, sent once the formatters are done with sqlx's
        // (an event sent from a layer before them would upset their filters' bookkeeping for the
        // event they are on).
        .with(slow::Statements)
        .try_init();
}

/// One line for each of sqlx's slow-statement warnings.
pub mod slow {
    use tracing::field::{Field, Visit};
    use tracing::{Event, Metadata, Subscriber};
    use tracing_subscriber::layer::{Context, Layer};

    /// sqlx's target for the statements it logs; its slow ones alone carry `slow_threshold`.
    const SQLX_QUERY: &str = "sqlx::query";

    /// Whether `meta` is the callsite of sqlx's slow-statement warning.
    pub fn is_sqlx_slow_statement(meta: &Metadata<'_>) -> bool {
        meta.target() == SQLX_QUERY && meta.fields().field("slow_threshold").is_some()
    }

    /// Logs `slow statement` at WARN with the statement's name ([`name`]), its time in
    /// milliseconds and its row counts, for each slow statement sqlx reports.
    pub struct Statements;

    impl<S: Subscriber> Layer<S> for Statements {
        fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
            if !is_sqlx_slow_statement(event.metadata()) {
                return;
            }
            let mut seen = Seen::default();
            event.record(&mut seen);
            tracing::warn!(
                target: "settlementd::db",
                statement = %name(&seen.summary),
                elapsed_ms = (seen.elapsed_secs * 1000.0).round() as u64,
                rows_affected = seen.rows_affected,
                rows_returned = seen.rows_returned,
                "slow statement (over database.slow_statement_ms)"
            );
        }
    }

    #[derive(Default)]
    struct Seen {
        summary: String,
        elapsed_secs: f64,
        rows_affected: u64,
        rows_returned: u64,
    }

    impl Visit for Seen {
        fn record_str(&mut self, field: &Field, value: &str) {
            if field.name() == "summary" {
                self.summary = value.to_string();
            }
        }
        fn record_f64(&mut self, field: &Field, value: f64) {
            if field.name() == "elapsed_secs" {
                self.elapsed_secs = value;
            }
        }
        fn record_u64(&mut self, field: &Field, value: u64) {
            match field.name() {
                "rows_affected" => self.rows_affected = value,
                "rows_returned" => self.rows_returned = value,
                _ => {}
            }
        }
        fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
    }

    /// A statement's name: the comment it starts with (`/* settle.batch */ UPDATE …`), or its
    /// first words (sqlx's summary) on one line.
    pub fn name(summary: &str) -> String {
        let summary = summary.trim_end_matches(" …").trim();
        if let Some(rest) = summary.strip_prefix("/*") {
            if let Some((name, _)) = rest.split_once("*/") {
                return name.trim().to_string();
            }
        }
        summary.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_statement_is_named_by_its_leading_comment_or_its_first_words() {
            assert_eq!(
                super::name("/* settle.batch */ WITH settled …"),
                "settle.batch"
            );
            assert_eq!(
                super::name("SELECT count(*) FROM\nloans …"),
                "SELECT count(*) FROM loans"
            );
            assert_eq!(super::name("SELECT 1"), "SELECT 1");
        }
    }
}

/// Cancelled on SIGINT or SIGTERM.
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGTERM");
                    let _ = tokio::signal::ctrl_c().await;
                    cancel.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutdown requested");
        cancel.cancel();
    });
    token
}

/// The database a command works on: the configured URL, or a private cluster when asked for.
pub struct Database {
    pub pool: PgPool,
    /// Kept alive as long as the pool; stopped on drop.
    pub embedded: Option<EmbeddedPg>,
}

impl Database {
    /// The database of a command that writes ([`db::Access::Write`]): a read-only server is
    /// refused in one line ([`DbError::ReadOnly`], exit 1).
    pub async fn open(settings: &Settings, embedded: bool) -> Result<Self> {
        Self::open_for(db::Access::Write, settings, embedded).await
    }

    /// The database of a command that only reads (`status`, `verify`, `jobs`, the dry runs): a
    /// read-only server (a standby) is accepted, and the server refuses any write through it
    /// ([`db::Access::Read`]).
    pub async fn open_to_read(settings: &Settings, embedded: bool) -> Result<Self> {
        Self::open_for(db::Access::Read, settings, embedded).await
    }

    async fn open_for(access: db::Access, settings: &Settings, embedded: bool) -> Result<Self> {
        if embedded || settings.database.embedded {
            let opts = EmbeddedOptions {
                data_dir: Some(settings.database.embedded_dir.clone()),
                bindir: None,
            };
            let pg = tokio::task::spawn_blocking(move || EmbeddedPg::start(opts))
                .await
                .map_err(|e| AppError::Failed(format!("embedded PostgreSQL: {e}")))??;
            let pool = db::connect_for(
                access,
                &pg.url("postgres"),
                &settings.database,
                settings.lease.guards(),
                heartbeat(settings),
            )
            .await?;
            return Ok(Self {
                pool,
                embedded: Some(pg),
            });
        }
        let pool = db::connect_for(
            access,
            settings.database_url()?,
            &settings.database,
            settings.lease.guards(),
            heartbeat(settings),
        )
        .await?;
        Ok(Self {
            pool,
            embedded: None,
        })
    }

    /// The configured database's pool, not connected yet: only the URL is checked. For `serve`,
    /// which connects when the server can take it ([`db::pool`]).
    pub fn unconnected(settings: &Settings) -> Result<Self> {
        let pool = db::pool(
            settings.database_url()?,
            &settings.database,
            settings.lease.guards(),
            heartbeat(settings),
        )?;
        Ok(Self {
            pool,
            embedded: None,
        })
    }

    /// Closes the pool, then stops a private cluster cleanly.
    pub async fn close(self) {
        db::close(&self.pool).await;
        if let Some(pg) = self.embedded {
            let _ = tokio::task::spawn_blocking(move || pg.stop()).await;
        }
    }
}

/// Refuses a `loans` table whose columns settlementd cannot read or write ([`db::check_loans`]), in
/// one line, before anything is written: every command that migrates or settles calls it first.
pub async fn check_schema(pool: &PgPool, settings: &Settings) -> Result<()> {
    Ok(db::check_loans(pool, settings.fine.max_cents()).await?)
}

/// The lease's heartbeat period: also the replica's tick, which sets how soon idle pooled
/// connections are closed ([`db::idle_timeout`]).
pub fn heartbeat(settings: &Settings) -> Duration {
    Duration::from_secs(settings.lease.heartbeat_secs)
}

/// The business date given on the command line, or last month's end in the configured zone.
pub fn business_date_or_default(
    given: Option<&str>,
    settings: &Settings,
    clock: &dyn Clock,
) -> Result<BusinessDate> {
    match given {
        Some(text) => Ok(BusinessDate::parse(text)?),
        None => Ok(BusinessDate::for_instant(
            &clock.now().with_timezone(&settings.schedule.timezone),
        )),
    }
}

/// Refuses a month that has not ended yet in the configured zone: a SUCCESS claim for it would make
/// the scheduled run skip every loan returned after this moment.
pub fn ensure_month_is_over(
    business_date: BusinessDate,
    settings: &Settings,
    clock: &dyn Clock,
) -> Result<()> {
    let zone = settings.schedule.timezone;
    let today = clock.now().with_timezone(&zone).date_naive();
    if business_date.date() >= today {
        return Err(AppError::Invalid(format!(
            "business date {business_date} is not over yet in {zone} (today is {today}): settling it now \
             would skip loans returned later in the month"
        )));
    }
    Ok(())
}

/// The job options a run of `settings` uses.
pub fn run_options(settings: &Settings, force: bool, estimate: bool) -> RunOptions {
    RunOptions {
        owner: Owner::for_process(),
        lease_ttl: Duration::from_secs(settings.lease.ttl_secs),
        heartbeat_every: Duration::from_secs(settings.lease.heartbeat_secs),
        guards: guards(settings),
        force,
        estimate,
        request: None,
        reopen: None,
        correction: None,
    }
}

pub fn settlement_job(settings: &Settings) -> FineSettlement {
    FineSettlement::of(settings)
}

/// The lease's server-side guards of every batch transaction ([`crate::job_layer::lease::Guards`]).
pub fn guards(settings: &Settings) -> crate::job_layer::lease::Guards {
    let g = settings.lease.guards();
    crate::job_layer::lease::Guards {
        idle_in_transaction: g.idle_in_transaction,
        lock_timeout: g.lock_timeout,
        statement_timeout: g.statement_timeout,
    }
}

/// The retention job of `settings` ([`crate::job_layer::retention`]) deleting what closed more than
/// `older_than_days` ago, never a period inside a job's lookback as of `now`.
pub fn retention_job(
    settings: &Settings,
    older_than_days: u32,
    now: chrono::DateTime<chrono::Utc>,
) -> crate::job_layer::retention::Retention {
    let registry = crate::jobs::build(settings);
    let tz = settings.schedule.timezone;
    let lookback_starts = registry
        .iter()
        .map(|job| {
            let latest = crate::schedule::latest_slot_at_or_before(&job.schedule().cron, tz, now)
                .map(|fire| crate::schedule::Slot::new(fire).business_date)
                .unwrap_or_else(|| BusinessDate::for_instant(&now.with_timezone(&tz)));
            let window = crate::calendar::lookback(latest, settings.settle.lookback_months);
            (job.name(), window.first().copied().unwrap_or(latest.date()))
        })
        .collect();
    crate::job_layer::retention::Retention {
        registry,
        shards: settings.shard.count,
        older_than_days,
        lookback_starts,
        batch: i64::from(settings.batch.size.max(1)),
        guards: guards(settings),
    }
}

/// The key of the retention run of the day `now` falls on in `schedule.timezone`: one a day.
pub fn retention_key(
    settings: &Settings,
    now: chrono::DateTime<chrono::Utc>,
) -> crate::job_layer::JobKey {
    crate::job_layer::JobKey {
        job_name: crate::job_layer::retention::NAME.to_string(),
        business_date: now.with_timezone(&settings.schedule.timezone).date_naive(),
        shards: 1,
        shard: 0,
    }
}

/// The dry runs of `months` for `shards` of `count` (`run --dry-run`, `POST /v1/runs/dry-run`),
/// a month not over yet shown refused. With a `deadline`, the server stops each month's
/// statements when it passes ([`crate::job_layer::dry::dry_run`]).
#[allow(clippy::too_many_arguments)]
pub async fn dry_months(
    settings: &Settings,
    pool: &PgPool,
    job: &dyn crate::job_layer::registry::Registered,
    months: &[BusinessDate],
    count: u32,
    shards: &[u32],
    force: bool,
    deadline: Option<tokio::time::Instant>,
) -> Result<Vec<crate::job_layer::dry::DryRun>> {
    let mut out = Vec::new();
    for month in months {
        let mut dry = crate::job_layer::dry::dry_run(
            pool,
            job,
            *month,
            count,
            shards,
            force,
            std::time::Duration::from_secs(settings.lease.ttl_secs),
            deadline,
        )
        .await?;
        if let Err(e) = ensure_month_is_over(*month, settings, &crate::clock::SystemClock) {
            dry.refused.insert(0, e.to_string());
            dry.by_shard
                .iter_mut()
                .for_each(|s| s.would = crate::job_layer::dry::Would::Refuse);
        }
        out.push(dry);
    }
    Ok(out)
}
