//! `settlementd verify`: is a month of a job (`--job`, by default the first of the list: the fine
//! settlement) what its ground truth says? The job's own proof ([`crate::job_layer::Job::prove`]),
//! read-only; this command names no job.

use crate::app::{
    business_date_or_default, check_schema, ensure_month_is_over, AppError, Database, Result,
};
use crate::clock::SystemClock;
use crate::config::Settings;
use crate::job_layer::{Proof, ProveError};

#[derive(Debug, Clone, Default)]
pub struct VerifyRequest {
    /// The month as its last day (default: last month's end in schedule.timezone).
    pub business_date: Option<String>,
    /// The job whose month to prove (default: the list's first, [`crate::jobs::default_job`]).
    pub job: Option<String>,
    pub embedded_db: bool,
}

/// The proof of `request.job`'s month (over in schedule.timezone), on a database whose schema
/// was checked; the database is closed after it. `Ok` whether the month is right or not
/// ([`failure`] says why not); a job the registry does not have, a job without a proof, and a
/// month its job cannot prove as asked are refused (exit 2).
pub async fn verify(settings: &Settings, request: &VerifyRequest) -> Result<Proof> {
    let name = request
        .job
        .clone()
        .unwrap_or_else(|| crate::jobs::default_job().to_string());
    let registry = crate::jobs::build(settings);
    let job = registry.get(&name).map_err(AppError::Invalid)?.clone();
    let business_date =
        business_date_or_default(request.business_date.as_deref(), settings, &SystemClock)?;
    ensure_month_is_over(business_date, settings, &SystemClock)?;
    let database = Database::open_to_read(settings, request.embedded_db).await?;
    let proved = async {
        check_schema(&database.pool, settings).await?;
        match job.prove(&database.pool, business_date).await {
            Ok(Some(proof)) => Ok(proof),
            Ok(None) => Err(AppError::Invalid(format!(
                "{name} has no proof of its months: `verify --job {name}` cannot say whether one \
                 is right"
            ))),
            Err(ProveError::Cannot(why)) => {
                Err(AppError::Invalid(format!("{business_date}: {why}")))
            }
            Err(ProveError::Db(e)) => Err(AppError::from(e)),
        }
    }
    .await;
    database.close().await;
    proved
}

/// Why `verify` does not exit 0, in one line; `None` when the month is right. Exit 1 when it is
/// not right; exit 6 when its money is right and it is not right only because of items its job
/// holds ([`Proof::held_only`]: the settlement's rows the rule cannot price), so a nightly check
/// tells data to fix from wrong money.
pub fn failure(proof: &Proof) -> Option<AppError> {
    proof.problems.as_ref().map(|why| {
        let (job, date) = (&proof.json["job"], &proof.json["business_date"]);
        let (job, date) = (
            job.as_str().unwrap_or_default(),
            date.as_str().unwrap_or_default(),
        );
        if proof.held_only {
            AppError::RowsHeld(format!(
                "{job} {date}: the money is right; the month is not right only for what is \
                 held: {why}"
            ))
        } else {
            AppError::Failed(format!("{job} {date} is not right: {why}"))
        }
    })
}
