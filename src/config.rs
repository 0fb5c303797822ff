//! Typed configuration, loaded in layers and validated before anything starts.
//!
//! Layers, later wins: `config/default.toml` (compiled in), the file given with `--config PATH`,
//! then environment variables `SETTLEMENTD__SECTION__KEY`. `database.url` falls back to
//! `database.url_file` (a file holding the URL), then to `DATABASE_URL`; `database.password_file`
//! sets the URL's password from a file. Both files are read at load time, so a Kubernetes Secret or
//! systemd credential mounted as a file never has to sit in an environment variable. The URL is a
//! secret: it prints as `[REDACTED]` and errors show it with the password masked ([`redact_url`]).
//!
//! Every integer setting is checked against [`INTEGER_KEYS`] before anything is deserialised: an
//! integer within its range and nothing else — not a boolean (the config crate would read `true` as
//! 1), a fraction, an exponent, an empty string or a value beyond the range (it would clamp) —
//! from a file and from the environment alike.
//!
//! The fine comes in two forms: the `[fine]` keys (one rule for every month) or a list of
//! `[[fine.rules]]`, each effective from a month ([`FineSchedule`]); never both.

use crate::calendar::BusinessDate;
use crate::fine::{DatedRule, FineRule, FineSchedule};
use chrono_tz::Tz;
use croner::Cron;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");
const ENV_PREFIX: &str = "SETTLEMENTD";

/// Upper bounds of some numeric settings, for code that needs them (every range is in
/// [`INTEGER_KEYS`]).
pub const MAX_SHARDS: u32 = 1024;

/// Every integer setting, with the range it accepts: `(key, min, max)`. A key under a list of tables
/// is written `list[].key`. Each bound is far beyond any sensible value and close enough that a typo
/// (an extra zero or three) is caught; a value outside is rejected, never clamped. A new integer
/// key is one line here (and one in the test that walks this table).
pub const INTEGER_KEYS: &[(&str, i128, i128)] = &[
    // Each replica uses two connections at a time (batch, heartbeat) plus probes.
    ("database.max_connections", 2, 100),
    ("database.acquire_timeout_secs", 1, 300),
    // An hour: a statement slower than that is an outage, not a warning.
    ("database.slow_statement_ms", 1, 3_600_000),
    ("shard.index", 0, MAX_SHARDS as i128 - 1),
    ("shard.count", 1, MAX_SHARDS as i128),
    // A batch is one transaction holding its rows' locks: a million rows is already minutes of locks.
    ("batch.size", 1, 1_000_000),
    // A day: a crashed replica's month waits at most this long for a takeover.
    ("lease.ttl_secs", 3, 86_400),
    ("lease.heartbeat_secs", 1, 3600),
    // A hundred years: beyond that, keep it for good (retention.enabled = false).
    ("retention.older_than_days", 1, 36_500),
    (
        "fine.daily_rate_cents",
        0,
        FineRule::MAX_DAILY_RATE_CENTS as i128,
    ),
    ("fine.grace_days", 0, FineRule::MAX_GRACE_DAYS as i128),
    ("fine.max_cents", 0, i64::MAX as i128),
    (
        "fine.rules[].daily_rate_cents",
        0,
        FineRule::MAX_DAILY_RATE_CENTS as i128,
    ),
    (
        "fine.rules[].grace_days",
        0,
        FineRule::MAX_GRACE_DAYS as i128,
    ),
    ("fine.rules[].max_cents", 0, i64::MAX as i128),
    // A hundred years of months.
    ("settle.lookback_months", 0, 1200),
    // Every month has a 28th.
    ("settle.deadline_day", 1, 28),
    ("retry.initial_secs", 1, 86_400),
    ("retry.max_secs", 1, 86_400),
    ("shutdown.grace_secs", 0, 3600),
    // HTTP: a request header takes one round trip to send; five minutes is a stuck client.
    ("http.header_read_timeout_secs", 1, 300),
    ("http.request_timeout_secs", 1, 3600),
    // Each connection is a file descriptor: far below the usual 1,024, a typo above it is caught.
    ("http.max_connections", 1, 65_536),
];

/// Invalid configuration: always exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub String);

pub type Result<T, E = ConfigError> = std::result::Result<T, E>;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub database: DatabaseSettings,
    pub shard: ShardSpec,
    pub batch: BatchSettings,
    pub lease: LeaseSettings,
    /// `[fine]` as written; [`Settings::fine`] is what it means.
    #[serde(rename = "fine", default)]
    fine_settings: FineSettings,
    /// The fine rules over the months, from `[fine]` (checked at load).
    #[serde(skip)]
    pub fine: FineSchedule,
    pub settle: SettleSettings,
    pub schedule: ScheduleSettings,
    pub retry: RetrySettings,
    pub shutdown: ShutdownSettings,
    pub http: HttpSettings,
    pub log: LogSettings,
    /// `[jobs.<section>]`, one per job of the binary's registry (a job's name with `-` written
    /// `_`): whether a replica schedules it and when, and its own keys. Which sections exist, and
    /// what a job's own keys are, is the list of jobs' to say (`src/jobs/mod.rs`).
    #[serde(default)]
    pub jobs: std::collections::BTreeMap<String, JobSettings>,
    pub retention: RetentionSettings,
}

/// The section whose `cron` the deprecated `schedule.cron` is (the fine settlement's).
const LEGACY_CRON_SECTION: &str = "fine_settlement";

/// `[jobs.<section>]`: one job's schedule — unset keys take the job's defaults — and its own keys,
/// which the job deserializes and checks itself (the list of jobs, `src/jobs/mod.rs`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct JobSettings {
    #[serde(default, deserialize_with = "de_opt_bool")]
    pub enabled: Option<bool>,
    /// Six fields, seconds first, in `schedule.timezone`.
    #[serde(default, deserialize_with = "de_opt_cron")]
    pub cron: Option<Cron>,
    /// Every other key of the section, as written: the job's own settings.
    #[serde(flatten)]
    pub own: serde_json::Map<String, serde_json::Value>,
}

/// `[retention]`: `serve` deletes the audit trail, run requests and claims of months closed longer
/// than `older_than_days` ago, once a day on one replica (`settlementd prune` does it by hand).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSettings {
    #[serde(deserialize_with = "de_bool")]
    pub enabled: bool,
    pub older_than_days: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// Connection URL; secret because it may carry a password.
    pub url: Option<SecretString>,
    /// A file whose content is the connection URL (a mounted secret), used when `url` is unset.
    pub url_file: Option<PathBuf>,
    /// A file whose content becomes the URL's password, so the URL itself can be plain config.
    pub password_file: Option<PathBuf>,
    pub max_connections: u32,
    /// Fail fast when the database is unreachable instead of sqlx's 30 s default.
    pub acquire_timeout_secs: u64,
    /// A statement that takes longer is logged as one `slow statement` warning naming it.
    pub slow_statement_ms: u64,
    /// `serve` applies migrations at start (safe with N replicas: sqlx takes an advisory lock).
    #[serde(deserialize_with = "de_bool")]
    pub migrate_on_start: bool,
    /// Use a private PostgreSQL in `embedded_dir` (run/serve/migrate/status/seed only when asked).
    #[serde(deserialize_with = "de_bool")]
    pub embedded: bool,
    pub embedded_dir: PathBuf,
}

/// Which slice of the loans this replica owns: `id % count = index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardSpec {
    pub index: u32,
    pub count: u32,
}

impl ShardSpec {
    pub fn new(index: u32, count: u32) -> Result<Self> {
        let spec = Self { index, count };
        spec.validate()?;
        Ok(spec)
    }

    fn validate(&self) -> Result<()> {
        if !(1..=MAX_SHARDS).contains(&self.count) {
            return Err(ConfigError(format!(
                "shard.count must be between 1 and {MAX_SHARDS}, got {}",
                self.count
            )));
        }
        if self.index >= self.count {
            return Err(ConfigError(format!(
                "shard.index must satisfy 0 <= index < shard.count ({}), got {}",
                self.count, self.index
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchSettings {
    pub size: u32,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseSettings {
    /// A RUNNING claim whose heartbeat is older than this may be taken over.
    pub ttl_secs: u64,
    /// How often a live run renews its heartbeat.
    pub heartbeat_secs: u64,
}

impl LeaseSettings {
    /// The server-side limits derived from this lease (see [`SessionGuards`]).
    pub fn guards(&self) -> SessionGuards {
        let ttl_ms = self.ttl_secs.saturating_mul(1000);
        SessionGuards {
            idle_in_transaction: Duration::from_millis((ttl_ms / 3).max(1000)),
            lock_timeout: Duration::from_millis((ttl_ms / 2).max(1000)),
            statement_timeout: Duration::from_millis(ttl_ms.max(1000)),
        }
    }
}

/// Server-side limits on settlementd's sessions, derived from the lease, so that a client that
/// stops (SIGSTOP, a long GC-like pause, a frozen VM, a half-open TCP connection) cannot hold row
/// locks past its lease: the server itself ends its session and rolls its transaction back.
///
/// - `idle_in_transaction` (`ttl / 3`, at least 1 s): a session idle inside a transaction that
///   long is terminated. A heartbeat is at most `ttl / 3` old when its holder stops (`ttl >= 3 x
///   heartbeat`, and every batch renews it), so the server releases a frozen writer's locks before
///   any peer may take its claim over: the taker never waits for them.
/// - `lock_timeout` (`ttl / 2`): a batch never waits longer than that for a row lock (held, say,
///   by a libraryd transaction); it fails, is retried, and the month does not stall behind a live
///   heartbeat.
/// - `statement_timeout` (`ttl`): no batch statement outlives one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionGuards {
    pub idle_in_transaction: Duration,
    pub lock_timeout: Duration,
    pub statement_timeout: Duration,
}

impl Default for SessionGuards {
    /// The guards of the default lease (60 s).
    fn default() -> Self {
        LeaseSettings {
            ttl_secs: 60,
            heartbeat_secs: 10,
        }
        .guards()
    }
}

/// `[fine]` as written: the single-rule keys, or `rules`. Unset single-rule keys take the defaults
/// of [`FineRule::default`]; `default.toml` sets none of them, so that a file giving `rules` does
/// not also give the single form.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FineSettings {
    daily_rate_cents: Option<i64>,
    grace_days: Option<i64>,
    max_cents: Option<i64>,
    rules: Option<Vec<RuleSettings>>,
}

/// One `[[fine.rules]]` entry: every key is required.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleSettings {
    /// The first month the rule applies to, `YYYY-MM`.
    from: String,
    daily_rate_cents: i64,
    grace_days: i64,
    max_cents: i64,
}

impl FineSettings {
    /// The schedule these settings mean, or why they mean none.
    fn schedule(&self) -> Result<FineSchedule> {
        let single = [
            ("daily_rate_cents", self.daily_rate_cents),
            ("grace_days", self.grace_days),
            ("max_cents", self.max_cents),
        ];
        let Some(rules) = &self.rules else {
            let d = FineRule::default();
            let rule = FineRule {
                daily_rate_cents: self.daily_rate_cents.unwrap_or(d.daily_rate_cents),
                grace_days: self.grace_days.unwrap_or(d.grace_days),
                max_cents: self.max_cents.unwrap_or(d.max_cents),
            };
            rule.validate("fine").map_err(ConfigError)?;
            return Ok(FineSchedule::single(rule));
        };
        if let Some((key, _)) = single.iter().find(|(_, v)| v.is_some()) {
            return Err(ConfigError(format!(
                "fine.rules and fine.{key} are both set: give the fine either as [fine] keys (one \
                 rule for every month) or as [[fine.rules]], not both"
            )));
        }
        let mut dated = Vec::with_capacity(rules.len());
        for (i, r) in rules.iter().enumerate() {
            let at = format!("fine.rules[{i}]");
            let from = BusinessDate::from_month(&r.from).map_err(|_| {
                ConfigError(format!(
                    "{at}.from '{}' is not a month: expected YYYY-MM, from 0001-01 to 9999-12",
                    r.from
                ))
            })?;
            let rule = FineRule {
                daily_rate_cents: r.daily_rate_cents,
                grace_days: r.grace_days,
                max_cents: r.max_cents,
            };
            rule.validate(&at).map_err(ConfigError)?;
            dated.push(DatedRule {
                from: from.first_day(),
                rule,
            });
        }
        FineSchedule::new(dated).map_err(ConfigError)
    }
}

/// `[settle]`: what a replica settles besides its scheduled month.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleSettings {
    /// How many months back (before the current one) a replica looks for late returns — loans
    /// returned in a month that was already closed — and settles them; 0 turns it off.
    pub lookback_months: u32,
    /// The day of the next month by the end of which (in `schedule.timezone`) a month must be
    /// closed: finance's deadline. A month still not closed after it counts in
    /// `settlementd_months_past_deadline` (the `SettlementMonthPastDeadline` alert). Unset: no
    /// deadline.
    #[serde(default)]
    pub deadline_day: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSettings {
    /// Deprecated: the fine settlement's cron from before jobs had sections of their own, the old
    /// name of `[jobs.fine_settlement] cron`. Still read: [`Settings::load`] moves it there (and
    /// refuses both set), so it is always `None` after loading.
    #[serde(default, deserialize_with = "de_opt_cron")]
    pub cron: Option<Cron>,
    #[serde(deserialize_with = "de_tz")]
    pub timezone: Tz,
    #[serde(deserialize_with = "de_bool")]
    pub catch_up: bool,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetrySettings {
    pub initial_secs: u64,
    pub max_secs: u64,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownSettings {
    pub grace_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    pub listen: SocketAddr,
    /// The bearer token of the runs API (`POST /v1/runs`); secret. Neither this nor
    /// `admin_token_file` set: the API answers 403.
    pub admin_token: Option<SecretString>,
    /// A file holding the token (a mounted secret), read at load.
    pub admin_token_file: Option<PathBuf>,
    /// Serve `GET /status` (read-only, no token); `false` answers 404, for sites that publish
    /// nothing about their runs without authentication.
    pub status_page: bool,
    /// A connection that has not sent a whole request header this long after it opened (or after
    /// its last answer, when kept alive) is closed: a client trickling a header holds nothing.
    pub header_read_timeout_secs: u64,
    /// A request not answered this long after its header arrived is answered 503 and dropped.
    pub request_timeout_secs: u64,
    /// The most connections held open at once. At the cap, a new connection replaces the one that
    /// has waited longest for a request header, so probes are answered during a flood.
    pub max_connections: u64,
}

/// The shortest admin token accepted: anything shorter is guessable.
pub const MIN_ADMIN_TOKEN_LEN: usize = 16;

impl HttpSettings {
    /// Reads `admin_token_file` into `admin_token`, and checks the token's form.
    fn read_token(&mut self) -> Result<()> {
        if let Some(path) = &self.admin_token_file {
            if self.admin_token.is_some() {
                return Err(ConfigError(format!(
                    "http.admin_token and http.admin_token_file ({}) are both set: keep one",
                    path.display()
                )));
            }
            self.admin_token = Some(SecretString::from(read_secret(
                "http.admin_token_file",
                path,
            )?));
        }
        if let Some(token) = &self.admin_token {
            let token = token.expose_secret();
            if token.len() < MIN_ADMIN_TOKEN_LEN || !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ConfigError(format!(
                    "http.admin_token must be at least {MIN_ADMIN_TOKEN_LEN} visible ASCII \
                     characters without spaces (e.g. `openssl rand -hex 32`)"
                )));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Json,
    Text,
    Auto,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    pub format: LogFormat,
}

/// The fields of a cron expression, in order (tokio-cron-scheduler's dialect, seconds first; a
/// seventh, the year, is optional).
const CRON_FIELDS: [&str; 7] = [
    "seconds",
    "minutes",
    "hours",
    "day of month",
    "month",
    "day of week",
    "year",
];

/// Parses a six-field cron expression (seconds first), the dialect tokio-cron-scheduler uses, and
/// refuses one that never fires. A refusal names the field at fault.
pub fn parse_cron(text: &str) -> Result<Cron> {
    let parse = |text: &str| {
        croner::parser::CronParser::builder()
            .seconds(croner::parser::Seconds::Required)
            .build()
            .parse(text)
    };
    let fields: Vec<&str> = text.split_whitespace().collect();
    let cron = parse(text).map_err(|e| {
        if !(6..=7).contains(&fields.len()) {
            return ConfigError(format!(
                "cron '{text}' has {} fields; it needs 6 (seconds, minutes, hours, day of month, \
                 month, day of week) or 7 (and a year)",
                fields.len()
            ));
        }
        // The first field that spoils a pattern that parses, in its place.
        let good = ["0", "0", "0", "1", "1", "*", "*"];
        let wrong = fields.iter().enumerate().find_map(|(i, field)| {
            let mut probe: Vec<&str> = good[..fields.len()].to_vec();
            probe[i] = field;
            parse(&probe.join(" ")).is_err().then_some(i)
        });
        match wrong {
            Some(i) => ConfigError(format!(
                "cron '{text}': its {} field '{}' is not valid ({e})",
                CRON_FIELDS[i], fields[i]
            )),
            None => ConfigError(format!("cron '{text}' is not a valid cron expression: {e}")),
        }
    })?;
    if cron
        .find_next_occurrence(&chrono::Utc::now(), false)
        .is_err()
    {
        return Err(ConfigError(format!(
            "cron '{text}' never fires (no date matches its day of month, month and day of week)"
        )));
    }
    Ok(cron)
}

pub fn parse_tz(text: &str) -> Result<Tz> {
    text.parse::<Tz>().map_err(|_| {
        ConfigError(format!(
            "schedule.timezone '{text}' is not a known IANA time zone"
        ))
    })
}

/// `true` or `false`, and nothing else: the config crate alone would read `2`, `on` or `yes` as
/// true, and `embedded = 2` is more likely a slip than a wish.
fn de_bool<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<bool, D::Error> {
    struct Strict;
    impl serde::de::Visitor<'_> for Strict {
        type Value = bool;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("true or false")
        }
        fn visit_bool<E: serde::de::Error>(self, v: bool) -> std::result::Result<bool, E> {
            Ok(v)
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<bool, E> {
            match v {
                "true" => Ok(true),
                "false" => Ok(false),
                _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
            }
        }
    }
    d.deserialize_any(Strict)
}

fn de_opt_cron<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Cron>, D::Error> {
    let text = String::deserialize(d)?;
    parse_cron(&text)
        .map(Some)
        .map_err(|e| serde::de::Error::custom(e.0))
}

fn de_opt_bool<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<bool>, D::Error> {
    de_bool(d).map(Some)
}

fn de_tz<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Tz, D::Error> {
    let text = String::deserialize(d)?;
    parse_tz(&text).map_err(|e| serde::de::Error::custom(e.0))
}

impl Settings {
    /// Loads defaults, then `file`, then the process environment, and validates.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        Self::load_from(file, std::env::vars())
    }

    /// `schedule.cron` moved to `[jobs.fine_settlement] cron`, its name since jobs have sections:
    /// the one place the old key is read.
    fn move_legacy_cron(&mut self) -> Result<()> {
        let Some(cron) = self.schedule.cron.take() else {
            return Ok(());
        };
        let section = self.jobs.entry(LEGACY_CRON_SECTION.into()).or_default();
        if section.cron.is_some() {
            return Err(ConfigError(format!(
                "schedule.cron and jobs.{LEGACY_CRON_SECTION}.cron are both set: they are the same \
                 setting, keep one (schedule.cron is its old name)"
            )));
        }
        section.cron = Some(cron);
        Ok(())
    }

    /// As [`Settings::load`] with an explicit environment (tests pass their own).
    pub fn load_from(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self> {
        let env: std::collections::HashMap<String, String> = env.into_iter().collect();
        let mut builder = config::Config::builder().add_source(config::File::from_str(
            DEFAULT_TOML,
            config::FileFormat::Toml,
        ));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError(format!(
                    "config file {} does not exist",
                    path.display()
                )));
            }
            check_toml_syntax(path)?;
            builder = builder.add_source(config::File::from(path).format(config::FileFormat::Toml));
        }
        let ours: config::Map<String, String> = env
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{ENV_PREFIX}__")))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .source(Some(ours)),
        );
        // Errors from here on may quote a value: the secrets' values are masked in them.
        let mut secrets: Vec<String> = [
            "SETTLEMENTD__DATABASE__URL",
            "SETTLEMENTD__HTTP__ADMIN_TOKEN",
            "DATABASE_URL",
        ]
        .iter()
        .filter_map(|k| env.get(*k).cloned())
        .collect();
        let raw = builder
            .build()
            .map_err(|e| ConfigError(masked(&one_line(&e.to_string()), &secrets)))?;
        secrets.extend(
            ["database.url", "http.admin_token"]
                .iter()
                .filter_map(|k| raw.get_string(k).ok()),
        );
        check_integers(&raw.cache, &env)?;
        let mut settings: Settings = raw
            .try_deserialize()
            .map_err(|e| ConfigError(masked(&one_line(&e.to_string()), &secrets)))?;
        settings.fine = settings.fine_settings.schedule()?;
        settings.move_legacy_cron()?;
        settings.database.read_secret_files()?;
        settings.http.read_token()?;
        if settings.database.url.is_none() {
            if let Some(url) = env.get("DATABASE_URL").filter(|u| !u.is_empty()) {
                settings.database.url = Some(SecretString::from(url.clone()));
            }
        }
        settings.database.apply_password_file()?;
        settings.validate()?;
        Ok(settings)
    }

    /// What the ranges of [`INTEGER_KEYS`] cannot say on their own (they were checked at load):
    /// the relations between settings, and the values that are not numbers.
    pub fn validate(&self) -> Result<()> {
        self.shard.validate()?;
        if self.database.embedded_dir.as_os_str().is_empty() {
            return Err(ConfigError(
                "database.embedded_dir must not be empty".into(),
            ));
        }
        let lease = self.lease;
        if lease.ttl_secs < lease.heartbeat_secs.saturating_mul(3) {
            return Err(ConfigError(format!(
                "lease.ttl_secs ({}) must be >= 3 x lease.heartbeat_secs ({})",
                lease.ttl_secs, lease.heartbeat_secs
            )));
        }
        if self.retry.max_secs < self.retry.initial_secs {
            return Err(ConfigError(format!(
                "retry needs retry.initial_secs ({}) <= retry.max_secs ({})",
                self.retry.initial_secs, self.retry.max_secs
            )));
        }
        if let Some(url) = &self.database.url {
            check_url(url.expose_secret(), "database.url")?;
        }
        Ok(())
    }

    /// One line for each secret file that every user of the host may read (`o+r`): a warning,
    /// not an error, since the file may be meant so on a single-user host. The files of
    /// `database.url_file`, `database.password_file`, `http.admin_token_file`, and the URL's
    /// `sslkey`.
    pub fn secret_file_warnings(&self) -> Vec<String> {
        let sslkey = self
            .database
            .url
            .as_ref()
            .and_then(|u| url::Url::parse(u.expose_secret()).ok())
            .and_then(|u| {
                u.query_pairs()
                    .find(|(k, _)| k == "sslkey" || k == "ssl-key")
                    .map(|(_, v)| PathBuf::from(v.into_owned()))
            });
        let files = [
            ("database.url_file", self.database.url_file.clone()),
            (
                "database.password_file",
                self.database.password_file.clone(),
            ),
            ("http.admin_token_file", self.http.admin_token_file.clone()),
            ("the database URL's sslkey", sslkey),
        ];
        files
            .into_iter()
            .filter_map(|(key, path)| {
                let path = path?;
                let mode = readable_by_others(&path)?;
                Some(format!(
                    "{key} {} can be read by every user of this host (mode {mode:04o}): \
                     chmod o-r it",
                    path.display()
                ))
            })
            .collect()
    }

    /// The database URL, or a configuration error naming how to set one.
    pub fn database_url(&self) -> Result<&str> {
        self.database
            .url
            .as_ref()
            .map(|u| u.expose_secret())
            .ok_or_else(|| {
                ConfigError(
                    "no database configured: set database.url, SETTLEMENTD__DATABASE__URL or DATABASE_URL".into(),
                )
            })
    }
}

/// `source` names where the URL came from (a key, or a key and its file) for the error.
fn check_url(url: &str, source: &str) -> Result<url::Url> {
    let parsed = url::Url::parse(url)
        .map_err(|e| ConfigError(format!("{source} '{}' is not a URL: {e}", redact_url(url))))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(ConfigError(format!(
            "{source} '{}' must start with postgres:// or postgresql://",
            redact_url(url)
        )));
    }
    Ok(parsed)
}

impl DatabaseSettings {
    /// Reads `url_file` into `url`. Both set is ambiguous (which one would an operator expect to
    /// win?), so it is an error rather than a silent precedence.
    fn read_secret_files(&mut self) -> Result<()> {
        let Some(path) = &self.url_file else {
            return Ok(());
        };
        if self.url.is_some() {
            return Err(ConfigError(format!(
                "database.url and database.url_file ({}) are both set: keep one",
                path.display()
            )));
        }
        let url = read_secret("database.url_file", path)?;
        check_url(&url, &format!("database.url_file {}:", path.display()))?;
        self.url = Some(SecretString::from(url));
        Ok(())
    }

    /// Replaces (or sets) the password of the URL, wherever the URL came from, with the content of
    /// `password_file`. Without a URL there is nothing to apply it to; that is reported when a
    /// command needs the database.
    fn apply_password_file(&mut self) -> Result<()> {
        let (Some(path), Some(url)) = (&self.password_file, &self.url) else {
            return Ok(());
        };
        let password = read_secret("database.password_file", path)?;
        let mut parsed = check_url(url.expose_secret(), "database.url")?;
        // Encode every byte that is not alphanumeric: the url crate leaves '%' alone, so a password
        // like "50%off" would otherwise be read back as something else.
        let encoded =
            percent_encoding::utf8_percent_encode(&password, percent_encoding::NON_ALPHANUMERIC)
                .to_string();
        if parsed.username().is_empty() || parsed.set_password(Some(&encoded)).is_err() {
            return Err(ConfigError(format!(
                "database.password_file {} needs a user name in the database URL '{}'",
                path.display(),
                redact_url(url.expose_secret())
            )));
        }
        self.url = Some(SecretString::from(String::from(parsed)));
        Ok(())
    }
}

/// A secret file's content without the trailing newline that `echo` and most editors add. Errors
/// name the key and the file, never the content.
fn read_secret(key: &str, path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("{key}: cannot read {}: {e}", path.display())))?;
    let secret = text.trim_end_matches(['\n', '\r']);
    if secret.is_empty() {
        return Err(ConfigError(format!("{key}: {} is empty", path.display())));
    }
    Ok(secret.to_string())
}

/// The URL with any password replaced by `***`, wherever it is (`user:password@`, or the
/// `password` query parameter that sqlx and libpq also accept); unparsable text, and text that
/// parses only as an opaque URL (`user:password@host` without a scheme reads as scheme `user`),
/// is hidden entirely.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(parsed) if parsed.cannot_be_a_base() => "<unparsable url>".to_string(),
        Ok(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some("***"));
            }
            if parsed.query_pairs().any(|(k, _)| k == "password") {
                let pairs: Vec<(String, String)> = parsed
                    .query_pairs()
                    .map(|(k, v)| {
                        let v = if k == "password" {
                            "***".into()
                        } else {
                            v.into_owned()
                        };
                        (k.into_owned(), v)
                    })
                    .collect();
                parsed.query_pairs_mut().clear().extend_pairs(pairs);
            }
            parsed.to_string()
        }
        Err(_) => "<unparsable url>".to_string(),
    }
}

/// The permission bits of `path` when every user of the host may read it (`o+r`).
fn readable_by_others(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).ok()?.permissions().mode() & 0o777;
    (mode & 0o004 != 0).then_some(mode)
}

/// `message` with every one of `secrets` (and, for a URL, its password in either place) masked.
fn masked(message: &str, secrets: &[String]) -> String {
    let mut parts: Vec<String> = Vec::new();
    for secret in secrets {
        parts.push(secret.clone());
        if let Ok(parsed) = url::Url::parse(secret) {
            parts.extend(parsed.password().map(str::to_string));
            parts.extend(
                parsed
                    .query_pairs()
                    .filter(|(k, _)| k == "password")
                    .map(|(_, v)| v.into_owned()),
            );
        }
    }
    // Longest first, so a URL is masked whole before its password alone.
    parts.sort_by_key(|p| std::cmp::Reverse(p.len()));
    let mut out = message.to_string();
    for part in parts.iter().filter(|p| p.len() >= 3) {
        out = out.replace(part.as_str(), "***");
    }
    out
}

/// A configuration file that is not TOML, named by file, line and key: never the line itself,
/// which the config crate's message would quote (with whatever secret it holds).
fn check_toml_syntax(path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("config file {}: cannot read: {e}", path.display())))?;
    let Err(e) = text.parse::<toml::Table>() else {
        return Ok(());
    };
    let at = e.span().map(|s| s.start).unwrap_or(0).min(text.len());
    let line_no = text[..at].matches('\n').count() + 1;
    let line = text.lines().nth(line_no - 1).unwrap_or("");
    // The key is what precedes `=`, when that is a key; nothing else of the line is shown.
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim())
        .filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        })
        .map(|k| format!(", key `{k}`"))
        .unwrap_or_default();
    Err(ConfigError(format!(
        "config file {} is not valid TOML: line {line_no}{key}: {}",
        path.display(),
        one_line(e.message())
    )))
}

/// Checks every value of an [`INTEGER_KEYS`] key in `raw` (the merged layers): an integer within its
/// range. The error names the key and the value as written: the environment variable's text when
/// the value came from there (the config crate has already turned `1e19` into a float and `true`
/// into a boolean), else the value.
fn check_integers(
    raw: &config::Value,
    env: &std::collections::HashMap<String, String>,
) -> Result<()> {
    for &(pattern, min, max) in INTEGER_KEYS {
        for (key, value) in find_values(raw, pattern) {
            let whole = match &value.kind {
                config::ValueKind::I64(n) => Some(i128::from(*n)),
                config::ValueKind::U64(n) => Some(i128::from(*n)),
                config::ValueKind::I128(n) => Some(*n),
                config::ValueKind::U128(n) => i128::try_from(*n).ok(),
                _ => None,
            };
            if whole.is_some_and(|n| (min..=max).contains(&n)) {
                continue;
            }
            let var = format!("{ENV_PREFIX}__{}", key.replace('.', "__").to_uppercase());
            let given = match env.get(&var) {
                Some(text) => format!("{text:?} (from {var})"),
                None => describe_value(value),
            };
            return Err(ConfigError(format!(
                "{key} must be a whole number from {min} to {max}, got {given}"
            )));
        }
    }
    Ok(())
}

/// The values at `pattern` (`a.b`, or `a.list[].b` for a key of every table in a list), with the
/// path of each (`a.list[2].b`).
fn find_values<'a>(root: &'a config::Value, pattern: &str) -> Vec<(String, &'a config::Value)> {
    let mut found = vec![(String::new(), root)];
    for part in pattern.split('.') {
        let (name, each) = match part.strip_suffix("[]") {
            Some(name) => (name, true),
            None => (part, false),
        };
        let mut next = Vec::new();
        for (path, value) in found {
            let config::ValueKind::Table(table) = &value.kind else {
                continue;
            };
            let Some(child) = table.get(name) else {
                continue;
            };
            let path = if path.is_empty() {
                name.to_string()
            } else {
                format!("{path}.{name}")
            };
            match (&child.kind, each) {
                (config::ValueKind::Array(items), true) => next.extend(
                    items
                        .iter()
                        .enumerate()
                        .map(|(i, item)| (format!("{path}[{i}]"), item)),
                ),
                (_, true) => {}
                (_, false) => next.push((path, child)),
            }
        }
        found = next;
    }
    found
}

/// A value as an error shows it.
fn describe_value(value: &config::Value) -> String {
    match &value.kind {
        config::ValueKind::Nil => "nothing".into(),
        config::ValueKind::Boolean(b) => b.to_string(),
        config::ValueKind::I64(n) => n.to_string(),
        config::ValueKind::I128(n) => n.to_string(),
        config::ValueKind::U64(n) => n.to_string(),
        config::ValueKind::U128(n) => n.to_string(),
        config::ValueKind::Float(f) => f.to_string(),
        config::ValueKind::String(text) => format!("{text:?}"),
        config::ValueKind::Table(_) => "a table".into(),
        config::ValueKind::Array(_) => "a list".into(),
    }
}

/// Config errors can span lines; operators get one.
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cron_refused_names_its_field_and_one_that_never_fires_is_refused() {
        let refused = |text: &str| parse_cron(text).unwrap_err().to_string();
        assert!(
            refused("0 30 25 1 * *").contains("its hours field '25' is not valid"),
            "{}",
            refused("0 30 25 1 * *")
        );
        assert!(refused("0 61 2 1 * *").contains("its minutes field '61'"));
        assert!(refused("0 30 2 1 13 *").contains("its month field '13'"));
        assert!(refused("30 2 1 * *").contains("has 5 fields; it needs 6"));
        assert!(refused("0 0 0 31 2 *").contains("never fires"));
        assert!(refused("0 0 0 1 1 * 2020").contains("never fires"));
        assert!(parse_cron("0 30 2 1 * *").is_ok());
        assert!(parse_cron("0 30 2 1 * * 2099").is_ok());
    }

    fn load(env: &[(&str, &str)]) -> Result<Settings> {
        Settings::load_from(
            None,
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    #[test]
    fn defaults_are_valid() {
        let s = load(&[]).unwrap();
        assert_eq!(s.shard, ShardSpec { index: 0, count: 1 });
        assert_eq!(s.batch.size, 10000);
        assert_eq!(s.schedule.timezone, chrono_tz::Asia::Shanghai);
        assert_eq!(s.fine, FineSchedule::default());
        assert_eq!(s.settle.lookback_months, 12);
        assert!(s.database.url.is_none());
    }

    #[test]
    fn environment_overrides_with_double_underscores() {
        let s = load(&[
            ("SETTLEMENTD__SHARD__INDEX", "2"),
            ("SETTLEMENTD__SHARD__COUNT", "3"),
            ("SETTLEMENTD__SCHEDULE__TIMEZONE", "America/New_York"),
            ("SETTLEMENTD_UNRELATED", "x"),
        ])
        .unwrap();
        assert_eq!(s.shard, ShardSpec { index: 2, count: 3 });
        assert_eq!(s.schedule.timezone, chrono_tz::America::New_York);
    }

    #[test]
    fn database_url_falls_back_to_database_url_env() {
        let s = load(&[("DATABASE_URL", "postgres://a:secret@h/db")]).unwrap();
        assert_eq!(s.database_url().unwrap(), "postgres://a:secret@h/db");
        assert!(!format!("{s:?}").contains("secret"));
        let s = load(&[
            ("DATABASE_URL", "postgres://a@h/one"),
            ("SETTLEMENTD__DATABASE__URL", "postgres://a@h/two"),
        ])
        .unwrap();
        assert_eq!(s.database_url().unwrap(), "postgres://a@h/two");
    }

    #[test]
    fn invalid_values_are_rejected_with_the_key_named() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[
                    ("SETTLEMENTD__SHARD__INDEX", "3"),
                    ("SETTLEMENTD__SHARD__COUNT", "3"),
                ],
                "shard.index",
            ),
            (&[("SETTLEMENTD__SHARD__COUNT", "0")], "shard.count"),
            (&[("SETTLEMENTD__SHARD__INDEX", "-1")], "index"),
            (&[("SETTLEMENTD__BATCH__SIZE", "0")], "batch.size"),
            (&[("SETTLEMENTD__LEASE__TTL_SECS", "29")], "lease.ttl_secs"),
            (
                &[("SETTLEMENTD__FINE__GRACE_DAYS", "-2")],
                "fine.grace_days",
            ),
            (
                &[("SETTLEMENTD__SCHEDULE__TIMEZONE", "Mars/Olympus")],
                "schedule.timezone",
            ),
            (
                &[("SETTLEMENTD__SCHEDULE__CRON", "0 30 2 1 *")],
                "schedule.cron",
            ),
            (&[("SETTLEMENTD__SHARD__WHAT", "1")], "what"),
            (&[("SETTLEMENTD__HTTP__LISTEN", "nowhere")], "listen"),
        ];
        for (env, needle) in cases {
            let err = load(env).unwrap_err().to_string();
            assert!(
                err.contains(needle),
                "{env:?}: '{err}' should name {needle}"
            );
            assert!(!err.contains('\n'), "{err}");
        }
    }

    /// Every key of the configuration, with a value of the wrong type, one out of its range (where
    /// it has one), and a misspelling: each is rejected, in one line naming the key.
    #[test]
    fn every_key_rejects_a_wrong_type_a_value_out_of_range_and_a_misspelling() {
        let cases: &[(&str, &str, &str)] = &[
            ("DATABASE__URL", "mysql://u@h/db", "database.url"),
            ("DATABASE__MAX_CONNECTIONS", "many", "max_connections"),
            ("DATABASE__MAX_CONNECTIONS", "1", "database.max_connections"),
            (
                "DATABASE__MAX_CONNECTIONS",
                "101",
                "database.max_connections",
            ),
            (
                "DATABASE__ACQUIRE_TIMEOUT_SECS",
                "-1",
                "acquire_timeout_secs",
            ),
            (
                "DATABASE__ACQUIRE_TIMEOUT_SECS",
                "0",
                "database.acquire_timeout_secs",
            ),
            (
                "DATABASE__ACQUIRE_TIMEOUT_SECS",
                "301",
                "database.acquire_timeout_secs",
            ),
            ("DATABASE__MIGRATE_ON_START", "maybe", "migrate_on_start"),
            ("DATABASE__EMBEDDED", "2", "embedded"),
            ("DATABASE__EMBEDDED", "yes", "embedded"),
            ("DATABASE__EMBEDDED_DIR", "", "database.embedded_dir"),
            ("DATABASE__URL_FILES", "/x", "url_files"),
            ("SHARD__INDEX", "one", "index"),
            ("SHARD__INDEX", "-1", "index"),
            ("SHARD__COUNT", "1025", "shard.count"),
            ("SHARD__COUNT", "0", "shard.count"),
            ("SHARD__COUNT", "99999999999", "count"),
            ("BATCH__SIZE", "5k", "size"),
            ("BATCH__SIZE", "0", "batch.size"),
            ("BATCH__SIZE", "1000001", "batch.size"),
            ("BATCH__ROWS", "10", "rows"),
            (
                "LEASE__TTL_SECS",
                "90.5",
                "lease.ttl_secs must be a whole number from 3 to 86400, got \"90.5\"",
            ),
            ("LEASE__TTL_SECS", "86401", "lease.ttl_secs"),
            ("LEASE__HEARTBEAT_SECS", "0", "lease.heartbeat_secs"),
            ("LEASE__HEARTBEAT_SECS", "3601", "lease.heartbeat_secs"),
            ("FINE__DAILY_RATE_CENTS", "fifty", "daily_rate_cents"),
            ("FINE__DAILY_RATE_CENTS", "-1", "fine.daily_rate_cents"),
            ("FINE__GRACE_DAYS", "36501", "fine.grace_days"),
            ("FINE__MAX_CENTS", "-5", "fine.max_cents"),
            (
                "FINE__MAX_CENTS",
                "10.5",
                "fine.max_cents must be a whole number",
            ),
            ("SETTLE__LOOKBACK_MONTHS", "1201", "settle.lookback_months"),
            ("SETTLE__LOOKBACK", "3", "lookback"),
            ("SCHEDULE__CRON", "0 30 2 1 13 *", "schedule.cron"),
            ("SCHEDULE__TIMEZONE", "UTC+8", "schedule.timezone"),
            ("SCHEDULE__CATCH_UP", "yes please", "catch_up"),
            ("RETRY__INITIAL_SECS", "0", "retry.initial_secs"),
            ("RETRY__INITIAL_SECS", "soon", "initial_secs"),
            ("RETRY__MAX_SECS", "86401", "retry.max_secs"),
            ("SHUTDOWN__GRACE_SECS", "3601", "shutdown.grace_secs"),
            ("SHUTDOWN__GRACE_SECS", "-3", "grace_secs"),
            ("HTTP__LISTEN", "9464", "listen"),
            ("HTTP__LISTEN", "0.0.0.0:99999", "listen"),
            (
                "HTTP__HEADER_READ_TIMEOUT_SECS",
                "0",
                "http.header_read_timeout_secs",
            ),
            (
                "HTTP__HEADER_READ_TIMEOUT_SECS",
                "301",
                "http.header_read_timeout_secs",
            ),
            (
                "HTTP__REQUEST_TIMEOUT_SECS",
                "0",
                "http.request_timeout_secs",
            ),
            (
                "HTTP__REQUEST_TIMEOUT_SECS",
                "3601",
                "http.request_timeout_secs",
            ),
            ("HTTP__REQUEST_TIMEOUT_SECS", "soon", "request_timeout_secs"),
            ("HTTP__MAX_CONNECTIONS", "0", "http.max_connections"),
            ("HTTP__MAX_CONNECTIONS", "65537", "http.max_connections"),
            ("LOG__FORMAT", "yaml", "format"),
            ("LOG__LEVEL", "debug", "level"),
            ("TRACING__FORMAT", "json", "tracing"),
        ];
        for (key, value, needle) in cases {
            let var = format!("SETTLEMENTD__{key}");
            let err = match load(&[(var.as_str(), value)]) {
                Ok(_) => panic!("{var}={value} was accepted"),
                Err(e) => e.to_string(),
            };
            assert!(
                err.contains(needle),
                "{var}={value}: '{err}' should name {needle}"
            );
            assert!(!err.contains('\n'), "{err}");
        }
        // The edges of every range are accepted.
        for (key, value) in [
            ("DATABASE__MAX_CONNECTIONS", "2"),
            ("DATABASE__MAX_CONNECTIONS", "100"),
            ("DATABASE__ACQUIRE_TIMEOUT_SECS", "300"),
            ("SHARD__COUNT", "1024"),
            ("BATCH__SIZE", "1"),
            ("BATCH__SIZE", "1000000"),
            ("SHUTDOWN__GRACE_SECS", "0"),
            ("RETRY__MAX_SECS", "86400"),
            ("HTTP__LISTEN", "[::1]:0"),
        ] {
            let var = format!("SETTLEMENTD__{key}");
            assert!(load(&[(var.as_str(), value)]).is_ok(), "{var}={value}");
        }
        let s = load(&[
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "3600"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "86400"),
        ])
        .unwrap();
        assert_eq!(s.lease.ttl_secs, 86_400);
    }

    /// A config file with `toml` in it, loaded with `env`.
    fn load_file(toml: &str, env: &[(&str, &str)]) -> Result<Settings> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("settlementd.toml");
        std::fs::write(&path, toml).unwrap();
        Settings::load_from(
            Some(&path),
            env.iter().map(|(k, v)| (k.to_string(), v.to_string())),
        )
    }

    /// Every integer key of [`INTEGER_KEYS`] refuses what is not an integer within its range —
    /// a boolean, a fraction, an exponent, an empty string, a value beyond the range, one below —
    /// from the environment and from a file alike, in one line naming the key and the value; and
    /// accepts both ends of its range. A key added to the table is covered by adding its line here
    /// (the test fails until it is).
    #[test]
    fn every_integer_key_accepts_an_integer_in_its_range_and_nothing_else() {
        // (key as in INTEGER_KEYS, the [section] or list it lives in for a file, settings it needs
        // to be valid at its extremes)
        let keys: &[(&str, &str)] = &[
            ("database.max_connections", ""),
            ("database.acquire_timeout_secs", ""),
            ("database.slow_statement_ms", ""),
            ("shard.index", "[shard]\ncount = 1024\n"),
            ("shard.count", ""),
            ("batch.size", ""),
            ("lease.ttl_secs", "[lease]\nheartbeat_secs = 1\n"),
            ("lease.heartbeat_secs", "[lease]\nttl_secs = 86400\n"),
            ("retention.older_than_days", ""),
            ("fine.daily_rate_cents", ""),
            ("fine.grace_days", ""),
            ("fine.max_cents", ""),
            ("fine.rules[].daily_rate_cents", ""),
            ("fine.rules[].grace_days", ""),
            ("fine.rules[].max_cents", ""),
            ("settle.lookback_months", ""),
            ("settle.deadline_day", ""),
            ("retry.initial_secs", "[retry]\nmax_secs = 86400\n"),
            ("retry.max_secs", "[retry]\ninitial_secs = 1\n"),
            ("shutdown.grace_secs", ""),
            ("http.header_read_timeout_secs", ""),
            ("http.request_timeout_secs", ""),
            ("http.max_connections", ""),
        ];
        let listed: Vec<&str> = INTEGER_KEYS.iter().map(|k| k.0).collect();
        let tested: Vec<&str> = keys.iter().map(|k| k.0).collect();
        assert_eq!(listed, tested, "every key of INTEGER_KEYS, in order");
        for &(key, min, max) in INTEGER_KEYS {
            let setup = keys.iter().find(|k| k.0 == key).unwrap().1;
            let bad = [
                ("true".to_string(), "true"),
                ("false".to_string(), "false"),
                ("1.5".to_string(), "1.5"),
                ("1e3".to_string(), "1e3"),
                ("\"\"".to_string(), ""),
                ((max + 1).to_string(), ""),
                ((min - 1).to_string(), ""),
                ("9223372036854775808".to_string(), "9223372036854775808"),
            ];
            for (toml_value, env_value) in &bad {
                let from_file = load_file(&file_with(key, toml_value, setup), &[]);
                let err = match from_file {
                    Ok(_) => panic!("{key} = {toml_value} in a file was accepted"),
                    Err(e) => e.to_string(),
                };
                let named = key.replace("[]", "[0]");
                // 2^63 is no TOML integer: the file fails to parse, named by its line and the key
                // as written there.
                let named = match toml_value.as_str() {
                    "9223372036854775808" => format!("key `{}`", key.rsplit('.').next().unwrap()),
                    _ => named,
                };
                assert!(
                    err.contains(&named) && !err.contains('\n'),
                    "{key} = {toml_value}: {err}"
                );
                // Values the environment can carry (a list of tables it cannot).
                if key.contains("[]") || env_value.is_empty() && *toml_value != "\"\"" {
                    continue;
                }
                let var = format!("SETTLEMENTD__{}", key.replace('.', "__").to_uppercase());
                let from_env = load_file(setup, &[(var.as_str(), env_value)]);
                let err = match from_env {
                    Ok(_) => panic!("{var}={env_value} was accepted"),
                    Err(e) => e.to_string(),
                };
                assert!(
                    err.contains(key) && err.contains(&format!("{env_value:?}")),
                    "{var}={env_value}: {err}"
                );
            }
            for good in [min, max] {
                let loaded = load_file(&file_with(key, &good.to_string(), setup), &[]);
                assert!(loaded.is_ok(), "{key} = {good}: {:?}", loaded.err());
            }
        }
    }

    /// A file setting `key` (`section.name`, or `fine.rules[].name` in a complete rule) to
    /// `value`, after `setup`.
    fn file_with(key: &str, value: &str, setup: &str) -> String {
        if let Some(name) = key.strip_prefix("fine.rules[].") {
            let mut rule = [
                ("from", "\"2020-01\"".to_string()),
                ("daily_rate_cents", "50".into()),
                ("grace_days", "0".into()),
                ("max_cents", "10000".into()),
            ];
            rule.iter_mut()
                .filter(|(k, _)| *k == name)
                .for_each(|(_, v)| *v = value.to_string());
            let body: Vec<String> = rule.iter().map(|(k, v)| format!("{k} = {v}")).collect();
            return format!("{setup}[[fine.rules]]\n{}\n", body.join("\n"));
        }
        let (section, name) = key.split_once('.').unwrap();
        if setup.starts_with(&format!("[{section}]")) {
            return format!("{setup}{name} = {value}\n");
        }
        format!("{setup}[{section}]\n{name} = {value}\n")
    }

    #[test]
    fn fine_rules_are_effective_from_a_month_and_the_single_keys_mean_one_rule_for_all() {
        let s = load_file(
            "[[fine.rules]]\nfrom = \"2027-01\"\ndaily_rate_cents = 60\ngrace_days = 2\nmax_cents = 12000\n\
             [[fine.rules]]\nfrom = \"2020-01\"\ndaily_rate_cents = 50\ngrace_days = 0\nmax_cents = 10000\n",
            &[],
        )
        .unwrap();
        let rate = |s: &Settings, month: &str| {
            s.fine
                .rule_for(BusinessDate::from_month(month).unwrap().first_day())
                .map(|r| r.rule.daily_rate_cents)
        };
        assert_eq!(rate(&s, "2019-12"), None);
        assert_eq!(rate(&s, "2026-12"), Some(50));
        assert_eq!(rate(&s, "2027-01"), Some(60));
        let single = load(&[("SETTLEMENTD__FINE__DAILY_RATE_CENTS", "37")]).unwrap();
        assert_eq!(rate(&single, "0001-01"), Some(37));
        assert_eq!(
            single.fine.rules()[0].rule.max_cents,
            FineRule::default().max_cents,
            "unset keys keep their defaults"
        );
    }

    #[test]
    fn fine_rules_with_the_single_keys_a_duplicate_month_or_a_bad_month_are_refused() {
        let rule = |from: &str| {
            format!(
                "[[fine.rules]]\nfrom = \"{from}\"\ndaily_rate_cents = 50\ngrace_days = 0\nmax_cents = 1\n"
            )
        };
        let cases = [
            (
                format!("[fine]\nmax_cents = 5\n{}", rule("2020-01")),
                &[][..],
                "fine.rules and fine.max_cents are both set",
            ),
            (
                rule("2020-01"),
                &[("SETTLEMENTD__FINE__GRACE_DAYS", "1")][..],
                "fine.rules and fine.grace_days are both set",
            ),
            (
                format!("{}{}", rule("2020-01"), rule("2020-01")),
                &[][..],
                "two rules from 2020-01",
            ),
            (rule("2020-13"), &[][..], "fine.rules[0].from '2020-13'"),
            (rule("2020-1-1"), &[][..], "is not a month"),
            (rule("0000-12"), &[][..], "is not a month"),
            (
                "[[fine.rules]]\nfrom = \"2020-01\"\ndaily_rate_cents = 50\n".into(),
                &[][..],
                "grace_days",
            ),
            (
                "[fine]\nrules = []\n".into(),
                &[][..],
                "fine.rules is empty",
            ),
        ];
        for (file, env, needle) in cases {
            let err = load_file(&file, env).unwrap_err().to_string();
            assert!(err.contains(needle), "{file}: '{err}' should say {needle}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn the_guards_end_a_frozen_writer_before_its_lease_can_be_taken_over() {
        for (ttl, heartbeat) in [(3, 1), (60, 10), (61, 20), (86_400, 3600)] {
            let lease = LeaseSettings {
                ttl_secs: ttl,
                heartbeat_secs: heartbeat,
            };
            let g = lease.guards();
            let ttl = Duration::from_secs(ttl);
            // A stopped holder's heartbeat is at most one period old: the server ends its session
            // (and releases its locks) before the heartbeat is older than the lease.
            assert!(
                Duration::from_secs(heartbeat) + g.idle_in_transaction < ttl,
                "{g:?}"
            );
            assert!(
                g.idle_in_transaction <= g.lock_timeout && g.lock_timeout <= g.statement_timeout
            );
            assert!(g.statement_timeout <= ttl, "{g:?}");
        }
    }

    /// A file in a fresh temporary directory (kept alive by the returned guard).
    fn secret_file(content: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, content).unwrap();
        (dir, path.to_str().unwrap().to_string())
    }

    #[test]
    fn url_file_is_read_and_trimmed_of_its_trailing_newline() {
        let (_dir, path) = secret_file("postgres://app:s3cret@db:5432/libraryd\n");
        let s = load(&[("SETTLEMENTD__DATABASE__URL_FILE", &path)]).unwrap();
        assert_eq!(
            s.database_url().unwrap(),
            "postgres://app:s3cret@db:5432/libraryd"
        );
        assert!(!format!("{s:?}").contains("s3cret"));
        // The file wins over DATABASE_URL, like database.url does.
        let s = load(&[
            ("SETTLEMENTD__DATABASE__URL_FILE", &path),
            ("DATABASE_URL", "postgres://other@h/db"),
        ])
        .unwrap();
        assert!(s.database_url().unwrap().contains("@db:5432"));
    }

    #[test]
    fn password_file_sets_or_replaces_the_password_of_any_url_source() {
        // Characters that must be escaped in a URL survive the round trip.
        let (_dir, path) = secret_file("p@ss:w/rd%\r\n");
        let expect = "postgres://app:p%40ss%3Aw%2Frd%25@db/libraryd";
        for (key, url) in [
            ("SETTLEMENTD__DATABASE__URL", "postgres://app@db/libraryd"),
            ("DATABASE_URL", "postgres://app:old@db/libraryd"),
        ] {
            let s = load(&[(key, url), ("SETTLEMENTD__DATABASE__PASSWORD_FILE", &path)]).unwrap();
            let got = s.database_url().unwrap();
            assert_eq!(got, expect, "{key}");
            let parsed = url::Url::parse(got).unwrap();
            let query = format!("p={}", parsed.password().unwrap());
            let decoded = url::form_urlencoded::parse(query.as_bytes())
                .next()
                .unwrap()
                .1;
            assert_eq!(decoded, "p@ss:w/rd%");
            assert!(!format!("{s:?}").contains("p%40ss"));
        }
    }

    #[test]
    fn secret_file_errors_are_one_line_naming_the_key_and_file_and_never_the_secret() {
        let (_dir, empty) = secret_file("\n");
        let (_dir2, url) = secret_file("mysql://u:hunter2@h/db\n");
        let (_dir3, password) = secret_file("hunter2\n");
        let cases: &[(&[(&str, &str)], &str)] = &[
            (
                &[("SETTLEMENTD__DATABASE__URL_FILE", "/nonexistent/url")],
                "database.url_file: cannot read /nonexistent/url",
            ),
            (
                &[
                    ("SETTLEMENTD__DATABASE__URL", "postgres://u@h/db"),
                    ("SETTLEMENTD__DATABASE__PASSWORD_FILE", "/nonexistent/pw"),
                ],
                "database.password_file: cannot read /nonexistent/pw",
            ),
            (
                &[
                    ("SETTLEMENTD__DATABASE__URL", "postgres://u@h/db"),
                    ("SETTLEMENTD__DATABASE__PASSWORD_FILE", &empty),
                ],
                "is empty",
            ),
            (
                &[("SETTLEMENTD__DATABASE__URL_FILE", &url)],
                "must start with postgres://",
            ),
            (
                &[
                    ("SETTLEMENTD__DATABASE__URL", "postgres://u:hunter2@h/db"),
                    ("SETTLEMENTD__DATABASE__URL_FILE", &url),
                ],
                "both set",
            ),
            (
                &[
                    ("SETTLEMENTD__DATABASE__URL", "postgres://h/db"),
                    ("SETTLEMENTD__DATABASE__PASSWORD_FILE", &password),
                ],
                "needs a user name",
            ),
            (
                &[("SETTLEMENTD__DATABASE__PASSWORD_FLIE", &password)],
                "password_flie",
            ),
        ];
        for (env, needle) in cases {
            let err = load(env).unwrap_err().to_string();
            assert!(err.contains(needle), "{env:?}: '{err}' should say {needle}");
            assert!(!err.contains("hunter2"), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn the_admin_token_comes_from_a_file_or_the_environment_and_must_be_long_enough() {
        let (_dir, path) = secret_file("0123456789abcdef0123\n");
        let s = load(&[("SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE", &path)]).unwrap();
        assert_eq!(
            s.http.admin_token.as_ref().map(|t| t.expose_secret()),
            Some("0123456789abcdef0123")
        );
        assert!(!format!("{s:?}").contains("0123456789abcdef"));
        assert!(load(&[]).unwrap().http.admin_token.is_none());
        for (env, needle) in [
            (
                vec![("SETTLEMENTD__HTTP__ADMIN_TOKEN", "short")],
                "at least 16",
            ),
            (
                vec![(
                    "SETTLEMENTD__HTTP__ADMIN_TOKEN",
                    "has a space in it somewhere",
                )],
                "without spaces",
            ),
            (
                vec![
                    ("SETTLEMENTD__HTTP__ADMIN_TOKEN", "0123456789abcdef0123"),
                    ("SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE", path.as_str()),
                ],
                "both set",
            ),
            (
                vec![("SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE", "/nonexistent/token")],
                "http.admin_token_file: cannot read",
            ),
        ] {
            let err = load(&env).unwrap_err().to_string();
            assert!(err.contains(needle), "{env:?}: {err}");
            assert!(!err.contains("0123456789abcdef"), "{err}");
        }
    }

    #[test]
    fn passwords_never_appear_in_url_errors() {
        let err = load(&[("DATABASE_URL", "mysql://u:hunter2@h/db")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("postgres://"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        assert_eq!(
            redact_url("postgres://u:hunter2@h:5/db"),
            "postgres://u:***@h:5/db"
        );
    }
}
