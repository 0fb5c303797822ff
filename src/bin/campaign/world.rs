//! The world one schedule plays in: a private PostgreSQL (shared by the schedules of one campaign),
//! a database per schedule holding libraryd's `loans` and the campaign's log tables, and the
//! settlementd processes, each behind its own [`Proxy`], with everything the checker needs to
//! account for them afterwards.
//!
//! **The logs.** Triggers the campaign owns write, in the writer's own transaction (so a write
//! and its record commit or vanish together, also across a crash):
//! - `campaign_loan_log`: every change of a loan's settlement columns or dates, old and new, with
//!   the transaction id and the writer's `application_name` (`settlementd`, or `libraryd` for the
//!   campaign's own edits);
//! - `campaign_journal_log`: every row written to, changed in or deleted from `fine_journal`;
//! - `campaign_run_log`: every insert and update of `job_runs` (claims, takeovers, heartbeats,
//!   fenced progress, SUCCESS and FAILED), with the old heartbeat, whether the write moved the
//!   run's progress, and the database clock;
//! - `campaign_pause_log`: every pause (insert into `job_pauses`) and resume (delete from it); the
//!   campaign stamps a pause's row `seen_at` once it has read it back committed
//!   ([`World::mark_pauses_seen`]), so the checker knows a time by which it was in force.
//!
//! A `campaign_run_log` row also carries its writer's transaction start (`now()`): when a claim
//! looked for a pause, when a batch began.
//!
//! A statement-level trigger makes every `UPDATE` of `loans` by settlementd sleep `slow` first,
//! so that signals land inside runs rather than between them.

use crate::proxy::Proxy;
use crate::schedule::{Plan, Rule};
use anyhow::{anyhow, bail, Context, Result};
use chrono::{Datelike, NaiveDate};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use settlementd::embedded_pg::{EmbeddedOptions, EmbeddedPg};
use sqlx::{Connection, PgConnection};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The bearer token of every replica's runs API.
pub const ADMIN_TOKEN: &str = "campaign-admin-token-0123456789";
/// Where Debian's libfaketime lives (`apt-get install faketime`).
pub const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The private PostgreSQL of a campaign.
pub struct Cluster {
    pg: Mutex<Option<EmbeddedPg>>,
    /// The server's socket file, for the proxies.
    pub socket: PathBuf,
    base_url: String,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// A durable cluster in a temporary directory (durable: a restart with `-m immediate` must
    /// lose no committed transaction but those committed with `synchronous_commit = off`).
    pub fn start() -> Result<Self> {
        let dir = tempfile::Builder::new().prefix("campaign-pg-").tempdir()?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let options = EmbeddedOptions {
            data_dir: Some(dir.path().join("pgdata")),
            bindir: None,
        };
        // fsync off is safe here: only the server is crashed, never the machine.
        let pg = EmbeddedPg::start_with(
            options,
            &[
                ("fsync", "off"),
                ("full_page_writes", "off"),
                ("max_connections", "300"),
            ],
        )
        .map_err(|e| anyhow!("cannot start PostgreSQL: {e}"))?;
        let base_url = pg.url("postgres");
        let options: sqlx::postgres::PgConnectOptions = base_url.parse()?;
        let socket = options
            .get_socket()
            .ok_or_else(|| anyhow!("the private server has no socket"))?
            .join(format!(".s.PGSQL.{}", options.get_port()));
        Ok(Self {
            pg: Mutex::new(Some(pg)),
            socket,
            base_url,
            _dir: dir,
        })
    }

    /// The URL of `database` over the socket.
    pub fn url(&self, database: &str) -> String {
        self.base_url
            .replacen("/postgres?", &format!("/{database}?"), 1)
    }

    /// The major version.
    pub fn version(&self) -> String {
        self.pg
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|pg| pg.version().to_string())
            .unwrap_or_default()
    }

    /// Stops the server as `pg_ctl stop -m immediate` does (blocking).
    pub fn stop_immediately(&self) {
        if let Some(pg) = self.pg.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            pg.stop_immediately();
        }
    }

    /// Starts it again on the same data directory (blocking; crash recovery first).
    pub fn restart(&self) -> Result<()> {
        if let Some(pg) = self.pg.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            pg.restart()
                .map_err(|e| anyhow!("cannot restart PostgreSQL: {e}"))?;
        }
        Ok(())
    }

    /// Stops it and removes its directory.
    pub fn stop(&self) {
        if let Some(pg) = self.pg.lock().unwrap_or_else(|p| p.into_inner()).take() {
            pg.stop();
        }
    }
}

/// What a settlementd process was started as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Serve {
        shard: u32,
        shards: u32,
    },
    Run {
        month: NaiveDate,
        shard: u32,
        shards: u32,
        force: bool,
    },
    Correct {
        month: NaiveDate,
        key: String,
    },
}

/// Which fine rules a process is configured with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rules {
    /// The fleet's rule.
    Fleet,
    /// The other rule (a rule change).
    Other,
    /// Each month's pinned rule (the quiescing fleet, `verify`, a correction's finish).
    Pinned,
}

/// One settlementd process and what happened to it.
pub struct Proc {
    pub id: usize,
    pub role: Role,
    pub rules: Rules,
    /// Started to quiesce: no fault may touch it.
    pub clean: bool,
    pub skew_secs: Option<i64>,
    pub pid: u32,
    child: tokio::process::Child,
    pub proxy: Proxy,
    pub http: Option<u16>,
    pub started: Instant,
    pub exited: Option<(Instant, ExitStatus)>,
    /// Signals the campaign sent it, and when.
    pub signals: Vec<(Instant, &'static str)>,
    /// Stopped (SIGSTOP) and not continued yet.
    pub stopped: bool,
    pub log: PathBuf,
}

impl Proc {
    pub fn label(&self) -> String {
        let what = match &self.role {
            Role::Serve { shard, shards } => format!("serve {shard}/{shards}"),
            Role::Run {
                month,
                shard,
                shards,
                force,
            } => format!(
                "run{} {} {shard}/{shards}",
                if *force { " --force" } else { "" },
                month_end(*month)
            ),
            Role::Correct { month, key } => format!("correct {} key {key}", month_end(*month)),
        };
        let rules = match self.rules {
            Rules::Fleet => "",
            Rules::Other => " (other rule)",
            Rules::Pinned => " (pinned rules)",
        };
        let skew = self
            .skew_secs
            .map(|s| format!(" (clock {s:+} s)"))
            .unwrap_or_default();
        format!("p{} {what}{rules}{skew} pid {}", self.id, self.pid)
    }

    pub fn running(&self) -> bool {
        self.exited.is_none()
    }

    /// Sends `signal` (libc) and records it.
    pub fn signal(&mut self, signal: i32, name: &'static str) {
        if self.exited.is_some() {
            return;
        }
        // SAFETY: kill(2) on a child this process has not reaped (exited is None).
        unsafe {
            libc::kill(self.pid as i32, signal);
        }
        self.signals.push((Instant::now(), name));
        if signal == libc::SIGSTOP {
            self.stopped = true;
        } else if signal == libc::SIGCONT {
            self.stopped = false;
        }
    }

    fn reap(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(status)) => {
                self.exited = Some((Instant::now(), status));
                self.proxy.shut();
                true
            }
            _ => false,
        }
    }
}

/// A fault the campaign put in force, for the accounting of exits.
#[derive(Debug, Clone)]
pub struct Fault {
    pub what: String,
    /// The process it was aimed at; `None`: every process (the database).
    pub target: Option<usize>,
    pub from: Instant,
    pub to: Instant,
}

/// A request sent to the runs API and every answer it got.
#[derive(Debug, Clone)]
pub struct Request {
    pub key: String,
    pub body: String,
    /// (HTTP status, body, replayed) of each answer.
    pub answers: Vec<(u16, String, bool)>,
    /// Attempts that got no answer (connection refused or cut).
    pub unanswered: u32,
}

/// A correction the campaign started.
#[derive(Debug, Clone)]
pub struct CorrectionAsked {
    pub key: String,
    pub month: NaiveDate,
    pub shards: u32,
}

/// One schedule's world.
pub struct World {
    pub plan: Plan,
    pub cluster: Arc<Cluster>,
    pub database: String,
    pub url: String,
    pub bin: PathBuf,
    /// The planted bug `bin` switches on (`SETTLEMENTD_CAMPAIGN_MUTANT`), if any.
    pub mutant: Option<String>,
    pub dir: PathBuf,
    pub faketime: bool,
    pub procs: Mutex<Vec<Proc>>,
    pub faults: Mutex<Vec<Fault>>,
    pub requests: Mutex<Vec<Request>>,
    pub corrections: Mutex<Vec<CorrectionAsked>>,
    /// The fleet's shard count now.
    pub shards: AtomicU32,
    pub started: Instant,
    /// Things the campaign itself could not do (a refused edit, …), for the report.
    pub notes: Mutex<Vec<String>>,
}

/// The last day of the month starting `first`.
pub fn month_end(first: NaiveDate) -> NaiveDate {
    first
        .checked_add_months(chrono::Months::new(1))
        .and_then(|d| d.pred_opt())
        .unwrap_or(first)
}

impl World {
    /// Creates the schedule's database: libraryd's loans, migrated, the logs installed.
    pub async fn create(
        plan: Plan,
        cluster: Arc<Cluster>,
        bin: PathBuf,
        mutant: Option<String>,
        dir: PathBuf,
    ) -> Result<Arc<World>> {
        let database = format!("campaign_{}", plan.seed);
        let mut admin = PgConnection::connect(&cluster.url("postgres")).await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
            .execute(&mut admin)
            .await?;
        sqlx::query(&format!("CREATE DATABASE {database}"))
            .execute(&mut admin)
            .await?;
        admin.close().await?;
        let url = cluster.url(&database);
        std::fs::create_dir_all(&dir)?;
        let world = Arc::new(World {
            shards: AtomicU32::new(plan.shards),
            plan,
            cluster,
            database,
            url,
            bin,
            mutant,
            dir,
            faketime: Path::new(FAKETIME_LIB).exists(),
            procs: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            requests: Mutex::new(Vec::new()),
            corrections: Mutex::new(Vec::new()),
            started: Instant::now(),
            notes: Mutex::new(Vec::new()),
        });
        let mut conn = world.connect("libraryd").await?;
        seed_loans(&mut conn, &world.plan).await?;
        conn.close().await?;
        world.write_configs()?;
        let migrate = world.command_output(&["migrate"], Rules::Fleet).await?;
        if !migrate.status.success() {
            bail!(
                "settlementd migrate failed: {}",
                String::from_utf8_lossy(&migrate.stderr)
            );
        }
        let mut conn = world.connect("campaign").await?;
        install_logs(&mut conn, world.plan.slow).await?;
        conn.close().await?;
        Ok(world)
    }

    /// A connection to the schedule's database as `application_name`, retried while the server
    /// restarts.
    pub async fn connect(&self, application_name: &str) -> Result<PgConnection> {
        let options: sqlx::postgres::PgConnectOptions = self.url.parse()?;
        let options = options.application_name(application_name);
        let mut last = None;
        for _ in 0..100 {
            match PgConnection::connect_with(&options).await {
                Ok(conn) => return Ok(conn),
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(anyhow!(
            "cannot connect: {}",
            last.map(|e| e.to_string()).unwrap_or_default()
        ))
    }

    fn config_path(&self, rules: Rules) -> PathBuf {
        self.dir.join(match rules {
            Rules::Fleet => "fleet.toml",
            Rules::Other => "other.toml",
            Rules::Pinned => "pinned.toml",
        })
    }

    fn write_configs(&self) -> Result<()> {
        let one = |rule: &Rule| rules_toml(&[("2000-01".to_string(), *rule)]);
        std::fs::write(self.config_path(Rules::Fleet), one(&self.plan.rule))?;
        std::fs::write(self.config_path(Rules::Other), one(&self.plan.other_rule))?;
        std::fs::write(self.config_path(Rules::Pinned), one(&self.plan.rule))?;
        Ok(())
    }

    /// Writes the configuration that gives each month its pinned rule (the fleet's elsewhere).
    pub async fn write_pinned_config(&self) -> Result<()> {
        let pins = self.pins().await?;
        let mut rules = vec![("2000-01".to_string(), self.plan.rule)];
        for (i, first) in self.plan.months.iter().enumerate() {
            let rule = pins
                .iter()
                .find(|(m, _)| m == first)
                .map_or(self.plan.rule, |(_, r)| *r);
            if rules.last().map(|(_, r)| *r) != Some(rule) {
                rules.push((first.format("%Y-%m").to_string(), rule));
            }
            if i + 1 == self.plan.months.len() && rule != self.plan.rule {
                let next = first
                    .checked_add_months(chrono::Months::new(1))
                    .unwrap_or(*first);
                rules.push((next.format("%Y-%m").to_string(), self.plan.rule));
            }
        }
        std::fs::write(self.config_path(Rules::Pinned), rules_toml(&rules))?;
        Ok(())
    }

    /// The pinned rule of each campaign month that has one (months as first days).
    pub async fn pins(&self) -> Result<Vec<(NaiveDate, Rule)>> {
        let mut conn = self.connect("campaign").await?;
        let rows: Vec<(NaiveDate, serde_json::Value)> = sqlx::query_as(
            "SELECT business_date, params FROM job_params WHERE job_name = 'fine-settlement'",
        )
        .fetch_all(&mut conn)
        .await?;
        conn.close().await?;
        Ok(rows
            .into_iter()
            .filter_map(|(date, params)| {
                let int = |k: &str| params.get(k).and_then(serde_json::Value::as_i64);
                Some((
                    date.with_day(1)?,
                    Rule {
                        daily_rate_cents: int("daily_rate_cents")?,
                        grace_days: int("grace_days")?,
                        max_cents: int("max_cents")?,
                    },
                ))
            })
            .collect())
    }

    /// The environment every settlementd process gets (less its shard and URL).
    fn base_env(&self) -> Vec<(String, String)> {
        let p = &self.plan;
        [
            ("SETTLEMENTD__LEASE__TTL_SECS", p.ttl_secs.to_string()),
            (
                "SETTLEMENTD__LEASE__HEARTBEAT_SECS",
                p.heartbeat_secs.to_string(),
            ),
            ("SETTLEMENTD__BATCH__SIZE", p.batch_size.to_string()),
            ("SETTLEMENTD__RETRY__INITIAL_SECS", "1".into()),
            ("SETTLEMENTD__RETRY__MAX_SECS", "2".into()),
            ("SETTLEMENTD__SHUTDOWN__GRACE_SECS", "5".into()),
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false".into()),
            ("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "2".into()),
            ("SETTLEMENTD__HTTP__ADMIN_TOKEN", ADMIN_TOKEN.into()),
            ("SETTLEMENTD__LOG__FORMAT", "text".into()),
            ("RUST_LOG", "info".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(
            self.mutant
                .iter()
                .map(|m| ("SETTLEMENTD_CAMPAIGN_MUTANT".to_string(), m.clone())),
        )
        .collect()
    }

    /// Runs a settlementd command straight on the database (no proxy) and waits for it.
    pub async fn command_output(
        &self,
        args: &[&str],
        rules: Rules,
    ) -> Result<std::process::Output> {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("--config").arg(self.config_path(rules)).args(args);
        clear_settlementd_env(&mut cmd);
        cmd.envs(self.base_env())
            .env("SETTLEMENTD__DATABASE__URL", &self.url)
            .env(
                "SETTLEMENTD__SHARD__COUNT",
                self.shards.load(Ordering::SeqCst).to_string(),
            )
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
            .await
            .map_err(|_| anyhow!("settlementd {args:?} did not end within 120 s"))??;
        Ok(out)
    }

    /// Starts a settlementd process behind a proxy of its own; returns its id.
    pub async fn spawn(
        &self,
        role: Role,
        rules: Rules,
        clean: bool,
        skew_secs: Option<i64>,
    ) -> Result<usize> {
        let proxy = Proxy::start(self.cluster.socket.clone()).await?;
        let id = self.procs.lock().unwrap_or_else(|p| p.into_inner()).len();
        let url = format!(
            "postgres://{}@127.0.0.1:{}/{}?sslmode=disable",
            settlementd::embedded_pg::SUPERUSER,
            proxy.port,
            self.database
        );
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("--config").arg(self.config_path(rules));
        let (shard, shards) = match &role {
            Role::Serve { shard, shards } => {
                cmd.arg("serve");
                (*shard, *shards)
            }
            Role::Run {
                month,
                shard,
                shards,
                force,
            } => {
                cmd.args(["run", "--json", "--business-date"])
                    .arg(month_end(*month).to_string())
                    .args([
                        "--shard",
                        &shard.to_string(),
                        "--shards",
                        &shards.to_string(),
                    ]);
                if *force {
                    cmd.arg("--force");
                }
                (*shard, *shards)
            }
            Role::Correct { month, key } => {
                let shards = self.shards.load(Ordering::SeqCst);
                cmd.args(["correct", "--json", "--business-date"])
                    .arg(month_end(*month).to_string())
                    .args(["--reason", "campaign: the month moves to the other rule"])
                    .args(["--key", key, "--shards", &shards.to_string()]);
                (0, shards)
            }
        };
        let http = match role {
            Role::Serve { .. } => Some(free_port()?),
            _ => None,
        };
        clear_settlementd_env(&mut cmd);
        cmd.envs(self.base_env())
            .env("SETTLEMENTD__DATABASE__URL", &url)
            .env("SETTLEMENTD__SHARD__INDEX", shard.to_string())
            .env("SETTLEMENTD__SHARD__COUNT", shards.to_string())
            .env(
                "SETTLEMENTD__HTTP__LISTEN",
                format!("127.0.0.1:{}", http.unwrap_or(0)),
            )
            .env("POD_NAME", format!("camp-p{id}"));
        if let Some(secs) = skew_secs {
            cmd.env("LD_PRELOAD", FAKETIME_LIB)
                .env("FAKETIME", format!("{secs:+}s"))
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let log = self.dir.join(format!("p{id}.log"));
        let file = std::fs::File::create(&log)?;
        cmd.stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let child = cmd.spawn().context("cannot start settlementd")?;
        let pid = child.id().unwrap_or(0);
        let proc = Proc {
            id,
            role,
            rules,
            clean,
            skew_secs,
            pid,
            child,
            proxy,
            http,
            started: Instant::now(),
            exited: None,
            signals: Vec::new(),
            stopped: false,
            log,
        };
        self.procs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(proc);
        Ok(id)
    }

    /// Notes every process that exited since the last look; returns how many are still running.
    pub fn reap(&self) -> usize {
        let mut procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        for p in procs.iter_mut() {
            p.reap();
        }
        procs.iter().filter(|p| p.running()).count()
    }

    /// Runs `f` on process `id`.
    pub fn with_proc<T>(&self, id: usize, f: impl FnOnce(&mut Proc) -> T) -> Option<T> {
        let mut procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        procs.get_mut(id).map(f)
    }

    /// The ids of running processes that `keep` accepts.
    pub fn running(&self, keep: impl Fn(&Proc) -> bool) -> Vec<usize> {
        self.reap();
        let procs = self.procs.lock().unwrap_or_else(|p| p.into_inner());
        procs
            .iter()
            .filter(|p| p.running() && keep(p))
            .map(|p| p.id)
            .collect()
    }

    /// Records a fault for the accounting of exits.
    pub fn fault(
        &self,
        what: impl Into<String>,
        target: Option<usize>,
        from: Instant,
        to: Instant,
    ) {
        self.faults
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Fault {
                what: what.into(),
                target,
                from,
                to,
            });
    }

    pub fn note(&self, note: impl Into<String>) {
        self.notes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(note.into());
    }

    /// The process ids (`camp-p<id>`) of the owners of RUNNING claims.
    pub async fn holders(&self) -> Vec<usize> {
        let Ok(mut conn) = self.connect("campaign").await else {
            return Vec::new();
        };
        let owners: Vec<String> = sqlx::query_scalar(
            "SELECT owner FROM job_runs WHERE status = 'RUNNING' ORDER BY owner",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap_or_default();
        let _ = conn.close().await;
        let mut ids: Vec<usize> = owners
            .iter()
            .filter_map(|o| o.strip_prefix("camp-p")?.split('/').next()?.parse().ok())
            .collect();
        ids.dedup();
        let live = self.running(|_| true);
        ids.retain(|id| live.contains(id));
        ids
    }

    /// `POST /v1/runs` of `body` under `key` to the replica `id`'s API; records the answer.
    pub async fn post(&self, id: usize, key: &str, body: &str) {
        let port = self.with_proc(id, |p| p.http).flatten();
        let answer = match port {
            Some(port) => post_json(port, "/v1/runs", Some(key), body).await.ok(),
            None => None,
        };
        let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        let request = match requests.iter_mut().find(|r| r.key == key) {
            Some(r) => r,
            None => {
                requests.push(Request {
                    key: key.to_string(),
                    body: body.to_string(),
                    answers: Vec::new(),
                    unanswered: 0,
                });
                requests.last_mut().expect("just pushed")
            }
        };
        match answer {
            // 503: the replica could not reach the database; the client retries.
            Some((status, _, _)) if status >= 500 => request.unanswered += 1,
            Some(answer) => request.answers.push(answer),
            None => request.unanswered += 1,
        }
    }

    /// `POST <path>` of `body` (no idempotency key) to the replica `id`'s API: its status and
    /// body, or why there was none.
    pub async fn post_admin(&self, id: usize, path: &str, body: &str) -> Result<(u16, String)> {
        let port = self
            .with_proc(id, |p| p.http)
            .flatten()
            .ok_or_else(|| anyhow!("p{id} has no HTTP port"))?;
        let (status, body, _) = post_json(port, path, None, body).await?;
        Ok((status, body))
    }

    /// Stamps every pause the campaign's log holds and has not seen yet with the database clock
    /// now: a row this statement reads has committed, so the pause was in force by then. Called
    /// after each pause and before each resume the campaign plays, and before quiescing resumes.
    pub async fn mark_pauses_seen(&self) -> Result<u64> {
        let mut conn = self.connect("campaign").await?;
        let marked = sqlx::query(
            "UPDATE campaign_pause_log SET seen_at = clock_timestamp()
              WHERE op = 'I' AND seen_at IS NULL",
        )
        .execute(&mut conn)
        .await?
        .rows_affected();
        conn.close().await?;
        Ok(marked)
    }
}

/// `[[fine.rules]]` entries for `(from, rule)`.
fn rules_toml(rules: &[(String, Rule)]) -> String {
    let mut out = String::from("# Written by the fault campaign.\n");
    for (from, rule) in rules {
        out.push_str(&format!(
            "[[fine.rules]]\nfrom = \"{from}\"\ndaily_rate_cents = {}\ngrace_days = {}\nmax_cents = {}\n",
            rule.daily_rate_cents, rule.grace_days, rule.max_cents
        ));
    }
    out
}

/// Removes `SETTLEMENTD__*` variables the campaign itself was started with.
fn clear_settlementd_env(cmd: &mut tokio::process::Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("SETTLEMENTD") {
            cmd.env_remove(name);
        }
    }
}

/// A port for a replica's HTTP listener, free now: outside the kernel's ephemeral range (32768 and
/// up by default), so that no outgoing connection (a replica's to its proxy, the proxy's own) can
/// take it between this look and settlementd's bind; each campaign process walks a block of its
/// own (two may run side by side).
fn free_port() -> Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let block = 20_000 + (std::process::id() % 10) * 1_000;
    for _ in 0..1_000 {
        let port = (block + NEXT.fetch_add(1, Ordering::Relaxed) % 1_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Err(anyhow!("no free port in {block}..{}", block + 1_000))
}

/// Whether the replica listening on `port` answers `GET /healthz` with 200.
pub async fn healthy(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    match tokio::time::timeout(Duration::from_secs(2), exchange).await {
        Ok(Ok(raw)) => raw.starts_with(b"HTTP/1.1 200"),
        _ => false,
    }
}

/// One `POST <path>` with the admin token (and `key` as its `Idempotency-Key`) over a fresh
/// connection: (status, body, replayed).
async fn post_json(
    port: u16,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> std::io::Result<(u16, String, bool)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let key = key
            .map(|k| format!("Idempotency-Key: {k}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\
             {key}Content-Type: application/json\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(8), exchange)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no header end"))?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "no status"))?;
    let replayed = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("idempotent-replayed: true")
    });
    Ok((status, body.to_string(), replayed))
}

/// libraryd's table and its loans, drawn from the plan's data seed: each month's returns (on time,
/// late, capped), held rows (due date NULL or infinite), odd rows (returned before borrowed), and
/// loans still out (some of them due in the months, for late returns).
async fn seed_loans(conn: &mut PgConnection, plan: &Plan) -> Result<()> {
    sqlx::query(
        "CREATE TABLE loans (
             id bigint PRIMARY KEY, member_id bigint NOT NULL, book_id bigint NOT NULL,
             borrowed_on date NOT NULL, due_on date, returned_on date,
             fine_cents bigint NOT NULL DEFAULT 0, fine_settled_at timestamptz)",
    )
    .execute(&mut *conn)
    .await?;
    let mut rng = ChaCha8Rng::seed_from_u64(plan.data_seed);
    let per_month = plan.loans_per_month as usize;
    let total = per_month * plan.months.len() * 11 / 10;
    // Ids handed out in an order unrelated to the months, as libraryd does over years.
    let mut ids: Vec<i64> = (1..=total as i64).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let (mut id, mut borrowed, mut due, mut returned) = (vec![], vec![], vec![], vec![]);
    for (n, loan) in ids.iter().enumerate() {
        let month = plan.months[n % plan.months.len()];
        let days = month_end(month).day() as i64;
        let ret = month + chrono::Days::new(rng.random_range(0..days) as u64);
        let late: i64 = match rng.random_range(0..10) {
            0..=3 => -rng.random_range(0..10),
            4..=8 => rng.random_range(1..40),
            _ => rng.random_range(40..400),
        };
        let due_on = ret - chrono::TimeDelta::days(late);
        let mut borrowed_on = due_on - chrono::TimeDelta::days(14);
        let mut due_text = Some(due_on.to_string());
        let mut ret_text = Some(ret.to_string());
        let roll = rng.random_range(0..1000);
        if n >= per_month * plan.months.len() || roll < 80 {
            ret_text = None; // still out
        } else if roll < 100 {
            due_text = None; // held: no due date
        } else if roll < 108 {
            due_text = Some("infinity".into());
        } else if roll < 112 {
            due_text = Some("-infinity".into());
        } else if roll < 130 {
            borrowed_on = ret + chrono::TimeDelta::days(3); // odd: returned before borrowed
        }
        id.push(*loan);
        borrowed.push(borrowed_on);
        due.push(due_text);
        returned.push(ret_text);
    }
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i, i % 97, i % 389, b, d::date, r::date
           FROM unnest($1::bigint[], $2::date[], $3::text[], $4::text[]) AS t(i, b, d, r)",
    )
    .bind(&id)
    .bind(&borrowed)
    .bind(&due)
    .bind(&returned)
    .execute(&mut *conn)
    .await?;
    sqlx::query("ANALYZE loans").execute(&mut *conn).await?;
    Ok(())
}

/// The campaign's log tables, their triggers, and the slowing trigger.
async fn install_logs(conn: &mut PgConnection, slow: Duration) -> Result<()> {
    let sql = format!(
        "CREATE TABLE campaign_config (slow_ms integer NOT NULL);
         INSERT INTO campaign_config VALUES ({slow});
         CREATE FUNCTION campaign_slow() RETURNS trigger LANGUAGE plpgsql AS $$
         DECLARE ms integer;
         BEGIN
             IF current_setting('application_name') = 'settlementd' THEN
                 SELECT slow_ms INTO ms FROM campaign_config;
                 IF ms > 0 THEN PERFORM pg_sleep(ms / 1000.0); END IF;
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER campaign_slow BEFORE UPDATE ON loans
             FOR EACH STATEMENT EXECUTE FUNCTION campaign_slow();

         CREATE TABLE campaign_loan_log (
             n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             txid bigint NOT NULL DEFAULT txid_current(),
             at timestamptz NOT NULL DEFAULT clock_timestamp(),
             who text NOT NULL DEFAULT current_setting('application_name'),
             op text NOT NULL, loan_id bigint NOT NULL,
             old_settled boolean, new_settled boolean,
             old_settled_at timestamptz, new_settled_at timestamptz,
             old_fine bigint, new_fine bigint, old_seq integer, new_seq integer,
             old_due text, new_due text, old_ret text, new_ret text);
         CREATE FUNCTION campaign_log_loan() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF TG_OP = 'INSERT' THEN
                 INSERT INTO campaign_loan_log (op, loan_id, new_settled, new_settled_at, new_fine,
                                                new_seq, new_due, new_ret)
                 VALUES ('I', NEW.id, NEW.fine_settled_at IS NOT NULL, NEW.fine_settled_at,
                         NEW.fine_cents, NEW.fine_seq, NEW.due_on::text, NEW.returned_on::text);
             ELSIF TG_OP = 'DELETE' THEN
                 INSERT INTO campaign_loan_log (op, loan_id, old_settled, old_settled_at, old_fine,
                                                old_seq, old_due, old_ret)
                 VALUES ('D', OLD.id, OLD.fine_settled_at IS NOT NULL, OLD.fine_settled_at,
                         OLD.fine_cents, OLD.fine_seq, OLD.due_on::text, OLD.returned_on::text);
             ELSE
                 INSERT INTO campaign_loan_log (op, loan_id, old_settled, new_settled,
                                                old_settled_at, new_settled_at, old_fine, new_fine,
                                                old_seq, new_seq, old_due, new_due, old_ret, new_ret)
                 VALUES ('U', NEW.id, OLD.fine_settled_at IS NOT NULL,
                         NEW.fine_settled_at IS NOT NULL, OLD.fine_settled_at, NEW.fine_settled_at,
                         OLD.fine_cents, NEW.fine_cents, OLD.fine_seq, NEW.fine_seq,
                         OLD.due_on::text, NEW.due_on::text, OLD.returned_on::text,
                         NEW.returned_on::text);
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER campaign_log_loan AFTER INSERT OR DELETE ON loans
             FOR EACH ROW EXECUTE FUNCTION campaign_log_loan();
         CREATE TRIGGER campaign_log_loan_update AFTER UPDATE ON loans
             FOR EACH ROW WHEN (OLD.fine_cents IS DISTINCT FROM NEW.fine_cents
                                OR OLD.fine_settled_at IS DISTINCT FROM NEW.fine_settled_at
                                OR OLD.fine_seq IS DISTINCT FROM NEW.fine_seq
                                OR OLD.due_on IS DISTINCT FROM NEW.due_on
                                OR OLD.returned_on IS DISTINCT FROM NEW.returned_on)
             EXECUTE FUNCTION campaign_log_loan();

         CREATE TABLE campaign_journal_log (
             n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             txid bigint NOT NULL DEFAULT txid_current(),
             at timestamptz NOT NULL DEFAULT clock_timestamp(),
             who text NOT NULL DEFAULT current_setting('application_name'),
             op text NOT NULL, journal_id bigint NOT NULL);
         CREATE FUNCTION campaign_log_journal() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO campaign_journal_log (op, journal_id)
             VALUES (left(TG_OP, 1), CASE WHEN TG_OP = 'DELETE' THEN OLD.id ELSE NEW.id END);
             RETURN NULL;
         END $$;
         CREATE TRIGGER campaign_log_journal AFTER INSERT OR UPDATE OR DELETE ON fine_journal
             FOR EACH ROW EXECUTE FUNCTION campaign_log_journal();

         CREATE TABLE campaign_run_log (
             n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             txid bigint NOT NULL DEFAULT txid_current(),
             at timestamptz NOT NULL DEFAULT clock_timestamp(),
             xact_at timestamptz NOT NULL DEFAULT now(),
             job_name text, business_date date, shards integer, shard integer, op text,
             old_status text, new_status text, old_attempt integer, new_attempt integer,
             old_heartbeat timestamptz, old_owner text, owner text, progress boolean);
         CREATE FUNCTION campaign_log_run() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF TG_OP = 'INSERT' THEN
                 INSERT INTO campaign_run_log (job_name, business_date, shards, shard, op,
                                               new_status, new_attempt, owner)
                 VALUES (NEW.job_name, NEW.business_date, NEW.shards, NEW.shard, 'I',
                         NEW.status, NEW.attempt, NEW.owner);
             ELSE
                 INSERT INTO campaign_run_log (job_name, business_date, shards, shard, op,
                                               old_status, new_status, old_attempt, new_attempt,
                                               old_heartbeat, old_owner, owner, progress)
                 VALUES (NEW.job_name, NEW.business_date, NEW.shards, NEW.shard, left(TG_OP, 1),
                         OLD.status, NEW.status, OLD.attempt, NEW.attempt, OLD.heartbeat_at,
                         OLD.owner, NEW.owner,
                         (OLD.last_id, OLD.last_id_desc, OLD.scanned, OLD.updated)
                             IS DISTINCT FROM (NEW.last_id, NEW.last_id_desc, NEW.scanned,
                                               NEW.updated));
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER campaign_log_run AFTER INSERT OR UPDATE OR DELETE ON job_runs
             FOR EACH ROW EXECUTE FUNCTION campaign_log_run();

         CREATE TABLE campaign_pause_log (
             n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             txid bigint NOT NULL DEFAULT txid_current(),
             at timestamptz NOT NULL DEFAULT clock_timestamp(),
             op text NOT NULL, job_name text NOT NULL, paused_by text,
             seen_at timestamptz);
         CREATE FUNCTION campaign_log_pause() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF TG_OP = 'INSERT' THEN
                 INSERT INTO campaign_pause_log (op, job_name, paused_by)
                 VALUES ('I', NEW.job_name, NEW.paused_by);
             ELSE
                 INSERT INTO campaign_pause_log (op, job_name, paused_by)
                 VALUES (left(TG_OP, 1), OLD.job_name, OLD.paused_by);
             END IF;
             RETURN NULL;
         END $$;
         CREATE TRIGGER campaign_log_pause AFTER INSERT OR UPDATE OR DELETE ON job_pauses
             FOR EACH ROW EXECUTE FUNCTION campaign_log_pause();",
        slow = slow.as_millis()
    );
    sqlx::raw_sql(&sql).execute(&mut *conn).await?;
    Ok(())
}
