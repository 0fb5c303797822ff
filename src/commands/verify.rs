//! `settlementd verify`: is a month's money what its rule gives, or (`--job`) is a month of
//! another job what its ground truth says? Read-only.

use crate::app::{
    business_date_or_default, check_schema, ensure_month_is_over, AppError, Database, Result,
};
use crate::calendar::BusinessDate;
use crate::clock::SystemClock;
use crate::config::Settings;
use crate::job_layer::Proof;
use crate::jobs::fine_settlement::verify::{self, Found, RuleSource, Verification};
use crate::jobs::fine_settlement::{self, rule_params};
use sqlx::PgPool;
use std::fmt::Write;
use std::future::Future;

#[derive(Debug, Clone, Default)]
pub struct VerifyRequest {
    /// The month as its last day (default: last month's end in schedule.timezone).
    pub business_date: Option<String>,
    /// The job whose month to prove (default: the fine settlement, [`verify`]).
    pub job: Option<String>,
    pub embedded_db: bool,
}

/// What `verify` found: the settlement's month, or another job's proof.
#[derive(Debug, Clone)]
pub enum Verified {
    Settlement(Box<Verification>),
    Job(Proof),
}

impl Verified {
    /// The `verify --json` object.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            Verified::Settlement(v) => to_json(v),
            Verified::Job(p) => p.json.clone(),
        }
    }

    /// What `verify` prints without `--json`.
    pub fn to_text(&self) -> String {
        match self {
            Verified::Settlement(v) => to_text(v),
            Verified::Job(p) => p.text.clone(),
        }
    }

    /// Why `verify` exits 1, in one line; `None` when the month is right.
    pub fn failure(&self) -> Option<AppError> {
        match self {
            Verified::Settlement(v) => failure(v),
            Verified::Job(p) => p.problems.as_ref().map(|why| {
                let (job, date) = (&p.json["job"], &p.json["business_date"]);
                AppError::Failed(format!(
                    "{} {} is not right: {why}",
                    job.as_str().unwrap_or_default(),
                    date.as_str().unwrap_or_default()
                ))
            }),
        }
    }
}

/// `verify` of `request.job`: the settlement's month ([`verify`]) when it names none or the
/// settlement, else the job's own proof ([`crate::job_layer::Job::prove`]); a job without one is
/// refused (exit 2), as is a job the registry does not have.
pub async fn verify_job(settings: &Settings, request: &VerifyRequest) -> Result<Verified> {
    let name = request.job.as_deref().unwrap_or(fine_settlement::JOB_NAME);
    if name == fine_settlement::JOB_NAME {
        return Ok(Verified::Settlement(Box::new(
            verify(settings, request).await?,
        )));
    }
    let registry = crate::jobs::build(settings);
    let job = registry.get(name).map_err(AppError::Invalid)?.clone();
    read_month(settings, request, |pool, business_date| async move {
        let mut conn = pool.acquire().await?;
        match job.prove(&mut conn, business_date).await? {
            Some(proof) => Ok(Verified::Job(proof)),
            None => Err(AppError::Invalid(format!(
                "{name} has no proof of its months: `verify --job {name}` cannot say whether one \
                 is right"
            ))),
        }
    })
    .await
}

/// `read` of the month `request` names (over in schedule.timezone), on the pool of a database
/// whose schema was checked; the database is closed after it, whatever it returned.
async fn read_month<T, F, Fut>(settings: &Settings, request: &VerifyRequest, read: F) -> Result<T>
where
    F: FnOnce(PgPool, BusinessDate) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let business_date =
        business_date_or_default(request.business_date.as_deref(), settings, &SystemClock)?;
    ensure_month_is_over(business_date, settings, &SystemClock)?;
    let database = Database::open(settings, request.embedded_db).await?;
    let result = async {
        check_schema(&database.pool, settings).await?;
        read(database.pool.clone(), business_date).await
    }
    .await;
    database.close().await;
    result
}

/// Recomputes every loan returned in the month from its rule. `Ok` whether the month is right or
/// not ([`Verification::is_right`] says which; the command line exits 1 when it is not). Reads
/// the month's journal on two connections at once when `database.max_connections` allows two.
pub async fn verify(settings: &Settings, request: &VerifyRequest) -> Result<Verification> {
    read_month(settings, request, |pool, business_date| async move {
        // database.max_connections is at least 2.
        let (mut conn, mut helper) = tokio::try_join!(pool.acquire(), pool.acquire())?;
        verify::verify(&mut conn, Some(&mut helper), business_date, &settings.fine)
            .await
            .map_err(|e| match e {
                Ok(why) => AppError::Invalid(format!("{business_date}: {why}")),
                Err(e) => AppError::from(e),
            })
    })
    .await
}

/// Why `verify` exits 1, in one line; `None` when the month is right.
pub fn failure(v: &Verification) -> Option<AppError> {
    v.problems()
        .map(|p| AppError::Failed(format!("{} is not right: {p}", v.business_date)))
}

/// The `verify --json` object.
pub fn to_json(v: &Verification) -> serde_json::Value {
    serde_json::json!({
        "job": fine_settlement::JOB_NAME,
        "business_date": v.business_date,
        "right": v.is_right(),
        "rule": rule_params(&v.rule),
        "rule_source": v.rule_source,
        "configured_rule": v.configured.as_ref().map(rule_params),
        "returned": v.returned,
        "totals": v.totals,
        "mismatched": {
            "count": v.mismatched,
            "net_cents": v.mismatch_cents,
            "first": v.mismatches,
        },
        "unsettled": v.unsettled,
        "held": v.held,
        "journal": {
            "off_journal": v.off_journal,
            "stale": v.stale,
            "broken": v.broken,
            "edits_waiting": v.edits_waiting,
            "unjournaled": v.unjournaled,
        },
    })
}

/// What `verify` prints without `--json` (lines end with a newline).
pub fn to_text(v: &Verification) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let verdict = if v.is_right() { "right" } else { "NOT RIGHT" };
    let _ = writeln!(
        out,
        "{} {}: {verdict}",
        fine_settlement::JOB_NAME,
        v.business_date
    );
    let source = match v.rule_source {
        RuleSource::Pinned => "the month's pinned rule",
        RuleSource::Configuration => {
            "the month has no pinned rule: checked against the configuration's"
        }
    };
    let _ = writeln!(out, "rule: {} ({source})", v.rule);
    if let Some(configured) = &v.configured {
        let _ = writeln!(
            out,
            "the configuration gives this month another rule: {configured} (a replica with it is \
             refused; `settlementd correct` would apply it)"
        );
    }
    let _ = writeln!(
        out,
        "returned in the month: {}; settled: rows={} fine_cents_sum={} digest={}",
        v.returned, v.totals.settled_rows, v.totals.fine_cents_sum, v.totals.digest
    );
    let _ = writeln!(
        out,
        "fines that differ from the rule: {} (net {:+} cents)",
        v.mismatched, v.mismatch_cents
    );
    for m in &v.mismatches {
        let stored = m.stored_cents.map_or("NULL".into(), |c| c.to_string());
        let _ = writeln!(
            out,
            "  loan {}: stored {stored} cents, the rule gives {}",
            m.id, m.expected_cents
        );
    }
    let found = |out: &mut String, what: &str, f: &Found| {
        let _ = writeln!(out, "{what}: {}", f.count);
        if !f.ids.is_empty() {
            let _ = writeln!(out, "  ids {:?}", f.ids);
        }
    };
    found(&mut out, "returns not settled", &v.unsettled);
    found(
        &mut out,
        "rows held (bad dates: due_on missing or infinite)",
        &v.held,
    );
    found(
        &mut out,
        "fines that differ from their journal entry (edited outside settlementd)",
        &v.off_journal,
    );
    found(
        &mut out,
        "loans whose dates changed after pricing with no edit queued",
        &v.stale,
    );
    found(&mut out, "loans whose journal chain is broken", &v.broken);
    found(&mut out, "edits waiting to be re-priced", &v.edits_waiting);
    found(
        &mut out,
        "settled loans without a journal entry",
        &v.unjournaled,
    );
    out
}
