//! `settlementd pause` and `settlementd resume`: stop a job (or every job) everywhere now, without
//! undeploying, and let it go on ([`crate::job_layer::pause`]).

use crate::app::{AppError, Database, Result};
use crate::config::Settings;
use crate::job_layer::pause::{self, Pause};

/// The jobs a `--job` names: that one, or every job of the registry.
pub fn targets(settings: &Settings, job: Option<&str>) -> Result<Vec<&'static str>> {
    let registry = crate::jobs::build(settings);
    match job {
        Some(name) => Ok(vec![registry
            .get(name)
            .map_err(|why| AppError::Invalid(format!("--job: {why}")))?
            .name()]),
        None => Ok(registry.names()),
    }
}

/// Checks a pause's reason: it is what the next operator reads.
pub fn check_reason(reason: &str) -> Result<&str> {
    pause::check_reason(reason).map_err(|why| AppError::Invalid(format!("--{why}")))
}

/// Pauses `jobs`, as `by`; returns each pause in force (one already in place is kept).
pub async fn pause_jobs(
    database: &Database,
    jobs: &[&str],
    by: &str,
    reason: &str,
) -> Result<Vec<Pause>> {
    let mut paused = Vec::new();
    for job in jobs {
        paused.push(pause::pause(&database.pool, job, by, reason).await?);
    }
    Ok(paused)
}

/// Resumes `jobs`, as `by`; returns, per job, the pause it ended (`None`: it was not paused).
pub async fn resume_jobs(
    database: &Database,
    jobs: &[&'static str],
    by: &str,
) -> Result<Vec<(&'static str, Option<Pause>)>> {
    let mut resumed = Vec::new();
    for job in jobs {
        resumed.push((*job, pause::resume(&database.pool, job, by).await?));
    }
    Ok(resumed)
}

/// Who pauses or resumes from the command line (`command`: `pause`, `resume`): the OS user at the
/// host.
pub fn operator(command: &str) -> String {
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| "unknown".into());
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".into());
    format!("{user}@{host} (settlementd {command})")
}

/// `settlementd pause` (with `wait`: returns once no run of the jobs is running).
pub async fn pause_command(
    settings: &Settings,
    job: Option<&str>,
    reason: &str,
    wait: bool,
    embedded_db: bool,
) -> Result<Vec<Pause>> {
    let jobs = targets(settings, job)?;
    let reason = check_reason(reason)?;
    let database = Database::open(settings, embedded_db).await?;
    let result = async {
        let paused = pause_jobs(&database, &jobs, &operator("pause"), reason).await?;
        if wait {
            wait_until_stopped(&database, &jobs, settings.lease.ttl_secs).await?;
        }
        Ok(paused)
    }
    .await;
    database.close().await;
    result
}

/// Waits until no claim of `jobs` is RUNNING with a live lease (heartbeat younger than
/// `ttl_secs`): each run stops at its next batch and marks itself FAILED; one whose holder died
/// is not running. Says once what it waits for.
async fn wait_until_stopped(database: &Database, jobs: &[&str], ttl_secs: u64) -> Result<()> {
    let mut said = false;
    loop {
        let running: Vec<(String, chrono::NaiveDate, i32, i32)> = sqlx::query_as(
            "SELECT job_name, business_date, shards, shard FROM job_runs
              WHERE job_name = ANY($1) AND status = 'RUNNING'
                AND heartbeat_at > clock_timestamp() - make_interval(secs => $2)
              ORDER BY 1, 2, 4",
        )
        .bind(jobs)
        .bind(ttl_secs as f64)
        .fetch_all(&database.pool)
        .await?;
        if running.is_empty() {
            return Ok(());
        }
        if !said {
            let list: Vec<String> = running
                .iter()
                .map(|(job, date, shards, shard)| format!("{job} {date} shard {shard} of {shards}"))
                .collect();
            eprintln!(
                "waiting for {} running run(s) to stop at their next batch: {}",
                running.len(),
                list.join(", ")
            );
            said = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// `settlementd resume`.
pub async fn resume_command(
    settings: &Settings,
    job: Option<&str>,
    embedded_db: bool,
) -> Result<Vec<(&'static str, Option<Pause>)>> {
    let jobs = targets(settings, job)?;
    let database = Database::open(settings, embedded_db).await?;
    let result = resume_jobs(&database, &jobs, &operator("resume")).await;
    database.close().await;
    result
}

/// A pause in one line.
pub fn pause_line(p: &Pause) -> String {
    format!(
        "{} paused since {} by {}: {}",
        p.job_name,
        crate::schedule::shown(p.paused_at),
        p.paused_by,
        p.reason
    )
}
