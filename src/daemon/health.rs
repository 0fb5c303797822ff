//! Readiness: whether this replica can settle what it is asked to, for `/readyz`, the
//! `settlementd_ready` and `settlementd_not_ready{reason}` metrics, the log and the fleet's
//! registry ([`crate::job_layer::fleet`]).
//!
//! A replica is ready when the database answers and takes writes, every migration of this binary
//! is applied, and no job of it is refused a due month for its rule. The first three are asked of
//! the database at
//! each evaluation ([`evaluate`]); the rule is what each [`super::replica::Replica`] found at its
//! latest look at what is due ([`Health::looked`]), at every tick, so at most one heartbeat old.
//! Until every job has looked once the replica is not ready ("starting"): a rolling update waits
//! for the first look, not just for a database that answers.
//!
//! Evaluated on the heartbeat by the process's liveness task ([`Reporter`], whatever its runs do),
//! which logs each change once and reports it in `replicas`, and again at every `/readyz` and
//! `/metrics` request.

use crate::job_layer::fleet;
use crate::job_layer::Owner;
use sqlx::PgPool;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long an evaluation waits for the database before it counts as not answering.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// Why a replica is not ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotReady {
    /// The database did not answer, or answered with an error (its text).
    Database(String),
    /// Only a read-only server answers (a standby, or `default_transaction_read_only`): nothing
    /// is written through it (its text names the endpoint).
    ReadOnly(String),
    /// A migration of this binary is not applied.
    Schema,
    /// A job has not looked at what is due yet.
    Starting(&'static str),
    /// A job is refused a due month for its rule: what it found.
    RuleConflict(String),
    /// A `SECURITY DEFINER` function of settlementd's is owned by a superuser (named).
    DefinerOwner(String),
    /// settlementd's triggers on libraryd's `loans` are missing, disabled or changed (named):
    /// libraryd's edits of settled loans would not reach the record.
    LoansTriggers(String),
}

impl NotReady {
    /// Every value of the metric's `reason` label.
    pub const LABELS: [&'static str; 7] = [
        "database",
        "read_only",
        "schema",
        "starting",
        "rule_conflict",
        "definer_owner",
        "loans_triggers",
    ];

    /// The `reason` label of `settlementd_not_ready`.
    pub fn label(&self) -> &'static str {
        match self {
            NotReady::Database(_) => "database",
            NotReady::ReadOnly(_) => "read_only",
            NotReady::Schema => "schema",
            NotReady::Starting(_) => "starting",
            NotReady::RuleConflict(_) => "rule_conflict",
            NotReady::DefinerOwner(_) => "definer_owner",
            NotReady::LoansTriggers(_) => "loans_triggers",
        }
    }
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotReady::Database(e) | NotReady::ReadOnly(e) => write!(f, "{e}"),
            NotReady::Schema => write!(f, "database schema is not current (run migrations)"),
            NotReady::Starting(job) => {
                write!(f, "starting: {job} has not looked at what is due yet")
            }
            NotReady::RuleConflict(why) => write!(f, "rule conflict: {why}"),
            NotReady::DefinerOwner(which) => write!(
                f,
                "{which}: it would run with a superuser's rights; run deploy/sql/roles.sql, \
                 which gives every function of settlementd's to settlementd_migrator"
            ),
            NotReady::LoansTriggers(which) => write!(
                f,
                "settlementd's triggers on loans are not as migrate left them ({which}): \
                 libraryd's edits of settled loans are not queued; run `settlementd migrate` \
                 as the owner of loans, or re-enable them (ALTER TABLE loans ENABLE ALWAYS \
                 TRIGGER …)"
            ),
        }
    }
}

/// What the jobs of this process found at their latest look, shared by its replicas and its HTTP
/// handlers.
#[derive(Debug, Default)]
pub struct Health {
    /// By job: `None` until its first look, then the rule conflict it found (`Some(None)`: none).
    rules: Mutex<BTreeMap<&'static str, Option<Option<String>>>>,
}

impl Health {
    /// Health for `jobs`, none of which has looked yet.
    pub fn new(jobs: &[&'static str]) -> Self {
        Self {
            rules: Mutex::new(jobs.iter().map(|j| (*j, None)).collect()),
        }
    }

    /// `job` looked at what is due: `conflict` is what refuses it, if anything.
    pub fn looked(&self, job: &'static str, conflict: Option<String>) {
        self.lock().insert(job, Some(conflict));
    }

    /// `job` has nothing to look at (paused, or no fire yet): not starting any more, and a conflict
    /// found before stands.
    pub fn looked_unless_known(&self, job: &'static str) {
        self.lock().entry(job).or_insert(None).get_or_insert(None);
    }

    /// The first job not looked yet, else the first conflict found.
    pub fn jobs(&self) -> Result<(), NotReady> {
        let rules = self.lock();
        if let Some((job, _)) = rules.iter().find(|(_, r)| r.is_none()) {
            return Err(NotReady::Starting(job));
        }
        match rules.values().flatten().flatten().next() {
            Some(conflict) => Err(NotReady::RuleConflict(conflict.clone())),
            None => Ok(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Option<Option<String>>>> {
        // A panic while holding this lock leaves a map that is still whole.
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether the replica is ready now; sets `settlementd_ready` and `settlementd_not_ready`. When
/// the pool has no connection to give, the server is asked directly whether it is read-only
/// ([`crate::db::writable`]), so `/readyz` says so during a failover.
pub async fn evaluate(pool: &PgPool, health: &Health) -> Result<(), NotReady> {
    evaluate_with(pool, health, true).await
}

/// [`evaluate`], asking the server directly (a connection beyond the pool) only when `direct`:
/// the process's own periodic look never does, so a fleet on a full server is not crowded
/// further by its readiness.
async fn evaluate_with(pool: &PgPool, health: &Health, direct: bool) -> Result<(), NotReady> {
    let answered = async {
        if direct {
            crate::db::writable(pool).await?;
        }
        if !crate::db::schema_is_current(pool).await? {
            return Ok(None);
        }
        let mut conn = pool.acquire().await?;
        Ok(Some(crate::db::guards(&mut conn).await?))
    };
    let result = match tokio::time::timeout(ANSWER_WITHIN, answered).await {
        Ok(Ok(Some(guards))) => {
            metrics::gauge!(super::metrics::LOANS_TRIGGERS_TAMPERED)
                .set(guards.loans_triggers.len() as f64);
            if let Some(which) = guards.superuser_definers.first() {
                Err(NotReady::DefinerOwner(which.clone()))
            } else if !guards.loans_triggers.is_empty() {
                Err(NotReady::LoansTriggers(guards.loans_triggers.join("; ")))
            } else {
                health.jobs()
            }
        }
        Ok(Ok(None)) => Err(NotReady::Schema),
        Ok(Err(e @ crate::db::DbError::ReadOnly { .. })) => Err(NotReady::ReadOnly(e.to_string())),
        Ok(Err(e)) => Err(NotReady::Database(e.to_string())),
        Err(_) => Err(NotReady::Database(
            "the database did not answer in time".to_string(),
        )),
    };
    publish(&result);
    result
}

fn publish(result: &Result<(), NotReady>) {
    use super::metrics as m;
    metrics::gauge!(m::READY).set(if result.is_ok() { 1.0 } else { 0.0 });
    let now = result.as_ref().err().map(NotReady::label);
    for label in NotReady::LABELS {
        let value = if now == Some(label) { 1.0 } else { 0.0 };
        metrics::gauge!(m::NOT_READY, "reason" => label).set(value);
    }
}

/// Reports this process in `replicas` ([`crate::job_layer::fleet`]) and publishes the shard-owner
/// gauges, once a heartbeat from the process's liveness task (`crate::daemon`), on the process's
/// pool (no connection of its own), and logs each change of readiness once.
pub struct Reporter {
    pool: PgPool,
    health: Arc<Health>,
    owner: Owner,
    jobs: Vec<&'static str>,
    shard: crate::config::ShardSpec,
    /// A replica that has not reported for three of these is not counted as an owner.
    heartbeat: Duration,
    started_at: chrono::DateTime<chrono::Utc>,
    last: Option<Result<(), NotReady>>,
}

impl Reporter {
    pub fn new(
        pool: PgPool,
        health: Arc<Health>,
        owner: Owner,
        jobs: Vec<&'static str>,
        shard: crate::config::ShardSpec,
        heartbeat: Duration,
    ) -> Self {
        Self {
            pool,
            health,
            owner,
            jobs,
            shard,
            heartbeat,
            started_at: chrono::Utc::now(),
            last: None,
        }
    }

    /// Upserts the row with the readiness last evaluated (one statement), and publishes the
    /// shard-owner gauges: the liveness task's report between two full ones ([`Reporter::report`]).
    pub async fn report_seen(&mut self) {
        let Some(last) = self.last.clone() else {
            return self.report().await;
        };
        self.upsert(&last).await;
        self.publish_owners().await;
    }

    /// [`Reporter::report_seen`] on `listener`'s connection (the one the process keeps for
    /// LISTEN): an idle replica opens no other connection to say it is there.
    pub async fn report_seen_on(&mut self, listener: &mut sqlx::postgres::PgListener) {
        let Some(last) = self.last.clone() else {
            return self.report().await;
        };
        let reason = last.as_ref().err().map(ToString::to_string);
        let report = fleet::Report {
            owner: &self.owner,
            jobs: &self.jobs,
            shards: self.shard.count,
            shard: self.shard.index,
            started_at: self.started_at,
            not_ready: reason.as_deref(),
        };
        let reported =
            tokio::time::timeout(ANSWER_WITHIN, fleet::report(&mut *listener, &report)).await;
        if !matches!(reported, Ok(Ok(()))) {
            tracing::debug!("cannot report this replica in replicas");
        }
        let listed = tokio::time::timeout(ANSWER_WITHIN, fleet::list(&mut *listener)).await;
        match listed {
            Ok(Ok(Some(members))) => self.publish_owners_of(&members),
            _ => tracing::debug!("cannot read replicas for the shard owners"),
        }
    }

    async fn upsert(&self, now: &Result<(), NotReady>) {
        let reason = now.as_ref().err().map(ToString::to_string);
        let report = fleet::Report {
            owner: &self.owner,
            jobs: &self.jobs,
            shards: self.shard.count,
            shard: self.shard.index,
            started_at: self.started_at,
            not_ready: reason.as_deref(),
        };
        let reported =
            tokio::time::timeout(ANSWER_WITHIN, fleet::report(&self.pool, &report)).await;
        if !matches!(reported, Ok(Ok(()))) {
            tracing::debug!("cannot report this replica in replicas");
        }
    }

    /// Evaluates readiness on the pool alone, logs it when it changed, and upserts the row.
    pub async fn report(&mut self) {
        let now = evaluate_with(&self.pool, &self.health, false).await;
        if self.last.as_ref() != Some(&now) {
            match &now {
                Ok(()) => tracing::info!("ready"),
                Err(why @ NotReady::Starting(_)) => {
                    tracing::info!(reason = why.label(), "not ready: {why}")
                }
                Err(why) => tracing::error!(reason = why.label(), "not ready: {why}"),
            }
        }
        self.upsert(&now).await;
        self.last = Some(now);
        self.publish_owners().await;
    }

    /// The shard-owner gauges, from `replicas` as every replica last reported.
    async fn publish_owners(&self) {
        let listed = tokio::time::timeout(ANSWER_WITHIN, fleet::list(&self.pool)).await;
        let Ok(Ok(Some(members))) = listed else {
            tracing::debug!("cannot read replicas for the shard owners");
            return;
        };
        self.publish_owners_of(&members);
    }

    fn publish_owners_of(&self, members: &[fleet::Member]) {
        use super::metrics as m;
        let owners = fleet::owners(
            members,
            self.shard.count,
            3.0 * self.heartbeat.as_secs_f64(),
        );
        let mine = owners.get(self.shard.index as usize).copied().unwrap_or(0);
        metrics::gauge!(m::SHARD_OWNERS, "shard" => self.shard.index.to_string()).set(mine as f64);
        for (label, wanted) in [("0", 0..=0), ("1", 1..=1), ("2+", 2..=usize::MAX)] {
            let shards = owners.iter().filter(|n| wanted.contains(n)).count();
            metrics::gauge!(m::SHARDS_BY_OWNERS, "owners" => label).set(shards as f64);
        }
    }

    /// Removes this process's row (within a second: a database that does not answer must not
    /// hold the exit).
    pub async fn leave(&self) {
        let left = tokio::time::timeout(
            Duration::from_secs(1),
            fleet::leave(&self.pool, &self.owner),
        )
        .await;
        if !matches!(left, Ok(Ok(()))) {
            tracing::debug!("cannot remove this replica from replicas");
        }
    }
}
