//! What is due, decided by the data: the periods a shard must run, and the periods not closed.
//!
//! `job_runs` says what ran, not what is owed. A period is **due** for shard `s` of the current
//! shard count when
//! - it was started (pinned by some claim, under any shard count) and `s`'s key is not SUCCESS:
//!   a month its peers claimed and it never did, one left FAILED, one settled under another
//!   shard count before a reshard;
//! - its data has items waiting for `s` ([`super::Job::pending`]): returns not settled yet, edits
//!   of settled loans — whatever its claims say;
//! - or it is the schedule's latest period and `s`'s key is not SUCCESS;
//!
//! and no correction holds it. A period is **not closed** when it was started or has items waiting
//! and some shard of the count is not SUCCESS, or items wait on any shard, or a correction holds
//! it. [`periods`] reads what `job_runs` and `job_params` say in one statement; [`due`] and
//! [`not_closed`] are pure.

use super::registry::Registered;
use super::{PendingReport, Result};
use chrono::{DateTime, NaiveDate, Utc};
use sqlx::{PgConnection, PgExecutor};

/// One started period under one shard count, as `job_runs` and `job_params` tell it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Period {
    pub business_date: NaiveDate,
    /// Shards of the count whose key is SUCCESS.
    pub success: i64,
    /// The status of the asking shard's key (`None`: no row).
    pub mine: Option<String>,
    /// The unfinished correction holding the period, and since when.
    pub correction_key: Option<String>,
    pub correcting_since: Option<DateTime<Utc>>,
}

/// The periods of `job_name` from `from` to `to` that some claim started (pinned, or with a
/// `job_runs` row under any shard count), oldest first, each with what `shards` and its shard
/// `shard` have of it.
pub async fn periods(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
    shard: u32,
    from: NaiveDate,
    to: NaiveDate,
) -> Result<Vec<Period>> {
    Ok(sqlx::query_as(
        "WITH started AS (
             SELECT business_date FROM job_params
              WHERE job_name = $1 AND business_date BETWEEN $4 AND $5
             UNION
             SELECT business_date FROM job_runs
              WHERE job_name = $1 AND business_date BETWEEN $4 AND $5
         )
         SELECT s.business_date,
                (SELECT count(*) FROM job_runs r
                  WHERE r.job_name = $1 AND r.business_date = s.business_date AND r.shards = $2
                    AND r.status = 'SUCCESS') AS success,
                (SELECT r.status FROM job_runs r
                  WHERE r.job_name = $1 AND r.business_date = s.business_date AND r.shards = $2
                    AND r.shard = $3) AS mine,
                p.correction_key, p.correcting_since
           FROM started s
           LEFT JOIN job_params p ON p.job_name = $1 AND p.business_date = s.business_date
          ORDER BY s.business_date",
    )
    .bind(job_name)
    .bind(shards as i32)
    .bind(shard as i32)
    .bind(from)
    .bind(to)
    .fetch_all(db)
    .await?)
}

/// Whether `job_name`'s period of `business_date` is closed under `shards`: SUCCESS on every shard
/// and held by no correction. `None` when it is; else why not, in words: how many of its shards
/// are RUNNING, FAILED or never claimed under the count, and what closes it. What a job that
/// follows it waits for ([`super::Job::after`]).
pub async fn closed(
    db: impl PgExecutor<'_>,
    job_name: &str,
    business_date: NaiveDate,
    shards: u32,
) -> Result<Option<String>> {
    let (success, running, failed, correction): (i64, i64, i64, Option<String>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE r.status = 'SUCCESS'),
                    count(*) FILTER (WHERE r.status = 'RUNNING'),
                    count(*) FILTER (WHERE r.status = 'FAILED'),
                    (SELECT correction_key FROM job_params
                      WHERE job_name = $1 AND business_date = $2)
               FROM job_runs r
              WHERE r.job_name = $1 AND r.business_date = $2 AND r.shards = $3",
    )
    .bind(job_name)
    .bind(business_date)
    .bind(shards as i32)
    .fetch_one(db)
    .await?;
    Ok(if let Some(key) = correction {
        Some(format!(
            "{job_name} {business_date} is being corrected under key {key:?}"
        ))
    } else if success >= i64::from(shards) {
        None
    } else {
        Some(why_not_closed(
            job_name,
            business_date,
            shards,
            [success, running, failed],
        ))
    })
}

/// Why `business_date`'s period is not ready for a job that follows `before` under `shards`: not
/// [`closed`] by it, or, with the job itself (`leader`, as the registry links it), something of it
/// still waits there — items its next run does on any shard, or its upkeep ([`Registered::pending`]
/// for the one period). Items the leader holds for an operator do not wait for a run, and do not
/// stop the follower. `None`: ready. On `db`, in whatever transaction it is in.
pub async fn not_ready(
    db: &mut PgConnection,
    before: &str,
    leader: Option<&dyn Registered>,
    business_date: NaiveDate,
    shards: u32,
) -> Result<Option<String>> {
    if let Some(why) = closed(&mut *db, before, business_date, shards).await? {
        return Ok(Some(why));
    }
    let Some(leader) = leader.filter(|l| l.name() == before) else {
        return Ok(None);
    };
    let pending = leader
        .pending(db, shards, std::slice::from_ref(&business_date))
        .await?;
    let (mut late, mut upkeep) = (0u64, 0u64);
    for p in pending
        .by_period
        .iter()
        .filter(|p| p.business_date == business_date)
    {
        late += p.late;
        upkeep += p.upkeep;
    }
    let words = leader.words();
    let waiting: Vec<String> = [(late, words.waiting), (upkeep, words.upkeep)]
        .into_iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, phrase)| phrase.count(n))
        .collect();
    Ok((!waiting.is_empty()).then(|| {
        format!(
            "{before} {business_date} has {}: it is closed once its replicas have done them",
            waiting.join(" and ")
        )
    }))
}

/// Why a period whose shards under `shards` are `[success, running, failed]` (the others never
/// claimed under the count) is not closed, and what closes it.
fn why_not_closed(
    job_name: &str,
    business_date: NaiveDate,
    shards: u32,
    [success, running, failed]: [i64; 3],
) -> String {
    let missing = (i64::from(shards) - success - running - failed).max(0);
    let of = |n: i64| match n {
        1 => "1 shard".to_string(),
        n => format!("{n} shards"),
    };
    let mut found = vec![format!("SUCCESS on {success} of its {}", of(shards.into()))];
    if running > 0 {
        found.push(format!("{} RUNNING", of(running)));
    }
    if failed > 0 {
        found.push(format!("{} FAILED", of(failed)));
    }
    if missing > 0 {
        // Never run under this count, or its claims were pruned (retention): running it is safe
        // (it settles only what is due) and closes it.
        found.push(format!(
            "{} never claimed under this shard count (or pruned by retention)",
            of(missing)
        ));
    }
    let month = business_date.format("%Y-%m");
    let next = if missing > 0 && running == 0 && failed == 0 {
        format!(
            "run it, `settlementd run --job {job_name} --from {month} --to {month} --all-shards \
             --shards {shards}`"
        )
    } else if running > 0 && missing == 0 && failed == 0 {
        "it closes when they finish".to_string()
    } else {
        "its replicas run what is not SUCCESS (a FAILED shard is retried, a stale one taken over)"
            .to_string()
    };
    format!(
        "{job_name} {business_date} is not closed: {}; {next}",
        found.join(", ")
    )
}

/// The latest period of `job_name` that is SUCCESS on every shard of `shards` and held by no
/// correction.
pub async fn last_closed(
    db: impl PgExecutor<'_>,
    job_name: &str,
    shards: u32,
) -> Result<Option<NaiveDate>> {
    Ok(sqlx::query_scalar(
        "SELECT r.business_date FROM job_runs r
          WHERE r.job_name = $1 AND r.shards = $2 AND r.status = 'SUCCESS'
            AND NOT EXISTS (SELECT 1 FROM job_params p
                             WHERE p.job_name = $1 AND p.business_date = r.business_date
                               AND p.correction_key IS NOT NULL)
          GROUP BY r.business_date
         HAVING count(*) = $2
          ORDER BY r.business_date DESC
          LIMIT 1",
    )
    .bind(job_name)
    .bind(shards as i32)
    .fetch_optional(db)
    .await?)
}

/// How many periods of any job an unfinished correction holds.
pub async fn corrections_unfinished(db: impl PgExecutor<'_>) -> Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM job_params WHERE correction_key IS NOT NULL")
            .fetch_one(db)
            .await?,
    )
}

/// Why a period is due for a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Why {
    /// The schedule's latest period, not SUCCESS for this shard.
    Scheduled,
    /// Started by some claim, not SUCCESS for this shard (its status, `None`: never claimed).
    Unfinished(Option<String>),
    /// Items wait for this shard ([`super::Pending::late`]).
    Waiting(u64),
}

/// A period a shard must run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Due {
    pub business_date: NaiveDate,
    pub why: Why,
}

/// What the scheduler asks [`due`] about.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    pub shard: u32,
    /// The schedule's latest period, when it is this shard's to run (catch-up on, or it fired
    /// since the process started).
    pub scheduled: Option<NaiveDate>,
    /// Whether periods nobody started may be started because their data has items waiting
    /// (`schedule.catch_up`): with catch-up off, only the schedule starts a period.
    pub start_waiting: bool,
}

/// The periods due for `ask.shard`, oldest first, from the periods started in the window
/// (`periods`, under the current shard count) and what the job reports waiting (`pending`).
pub fn due(periods: &[Period], pending: &PendingReport, ask: Ask) -> Vec<Due> {
    let started = |date: NaiveDate| periods.iter().find(|p| p.business_date == date);
    let held = |date: NaiveDate| started(date).is_some_and(|p| p.correction_key.is_some());
    let success =
        |date: NaiveDate| started(date).is_some_and(|p| p.mine.as_deref() == Some("SUCCESS"));
    let mut due: Vec<Due> = Vec::new();
    let mut add = |business_date: NaiveDate, why: Why| {
        if held(business_date) || due.iter().any(|d| d.business_date == business_date) {
            return;
        }
        due.push(Due { business_date, why });
    };
    // The first reason found is the one reported: the schedule's, then a claim's, then the data's.
    if let Some(date) = ask.scheduled {
        if !success(date) {
            add(date, Why::Scheduled);
        }
    }
    for p in periods {
        if p.mine.as_deref() != Some("SUCCESS") {
            add(p.business_date, Why::Unfinished(p.mine.clone()));
        }
    }
    for w in &pending.by_period {
        if w.shard == ask.shard
            && w.late > 0
            && (ask.start_waiting || started(w.business_date).is_some())
        {
            add(w.business_date, Why::Waiting(w.late));
        }
    }
    due.sort_by_key(|d| d.business_date);
    due
}

/// Why a period is not closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotClosed {
    pub business_date: NaiveDate,
    /// Shards of the count that are not SUCCESS.
    pub unsettled_shards: i64,
    /// Items waiting on any shard.
    pub waiting: u64,
    /// The correction holding it.
    pub correction: Option<String>,
    /// The job this one follows ([`super::Job::after`]), when its month is not closed either:
    /// whatever this job did of the month is done again once that one closes.
    pub upstream: Option<&'static str>,
}

/// The periods of the window that are not closed under `shards`: started, or with items waiting,
/// and not SUCCESS on every shard, or with items waiting, or held by a correction. Oldest first.
pub fn not_closed(
    periods: &[Period],
    pending: &PendingReport,
    shards: u32,
    window: &[NaiveDate],
) -> Vec<NotClosed> {
    let mut out = Vec::new();
    for &date in window {
        let started = periods.iter().find(|p| p.business_date == date);
        let waiting: u64 = pending
            .by_period
            .iter()
            .filter(|w| w.business_date == date)
            .map(|w| w.late + w.upkeep)
            .sum();
        if started.is_none() && waiting == 0 {
            continue;
        }
        let success = started.map_or(0, |p| p.success);
        let correction = started.and_then(|p| p.correction_key.clone());
        let unsettled_shards = i64::from(shards) - success.min(i64::from(shards));
        if unsettled_shards > 0 || waiting > 0 || correction.is_some() {
            out.push(NotClosed {
                business_date: date,
                unsettled_shards,
                waiting,
                correction,
                upstream: None,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::Pending;
    use super::*;

    fn day(month: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(2026, month + 1, 1)
            .unwrap()
            .pred_opt()
            .unwrap()
    }

    fn period(month: u32, success: i64, mine: Option<&str>) -> Period {
        Period {
            business_date: day(month),
            success,
            mine: mine.map(str::to_string),
            correction_key: None,
            correcting_since: None,
        }
    }

    fn waiting(month: u32, shard: u32, late: u64) -> Pending {
        Pending {
            business_date: day(month),
            shard,
            late,
            held: 0,
            upkeep: 0,
        }
    }

    fn ask(shard: u32, scheduled: Option<u32>) -> Ask {
        Ask {
            shard,
            scheduled: scheduled.map(day),
            start_waiting: true,
        }
    }

    #[test]
    fn a_month_its_peers_started_is_due_for_a_shard_that_never_claimed_it() {
        let periods = [period(9, 2, None), period(10, 3, Some("SUCCESS"))];
        let due = due(&periods, &PendingReport::default(), ask(1, Some(10)));
        assert_eq!(
            due,
            vec![Due {
                business_date: day(9),
                why: Why::Unfinished(None)
            }]
        );
    }

    #[test]
    fn items_waiting_make_a_month_due_whatever_its_claims_say() {
        let periods = [period(9, 2, Some("SUCCESS"))];
        let pending = PendingReport {
            by_period: vec![waiting(9, 1, 3), waiting(7, 1, 1), waiting(8, 0, 5)],
            before: 0,
        };
        let dates: Vec<NaiveDate> = due(&periods, &pending, ask(1, None))
            .into_iter()
            .map(|d| d.business_date)
            .collect();
        assert_eq!(dates, vec![day(7), day(9)], "oldest first, only shard 1's");
    }

    #[test]
    fn with_catch_up_off_waiting_items_do_not_start_a_month_nobody_started() {
        let periods = [period(9, 1, Some("SUCCESS"))];
        let pending = PendingReport {
            by_period: vec![waiting(9, 0, 3), waiting(7, 0, 1)],
            before: 0,
        };
        let off = Ask {
            start_waiting: false,
            ..ask(0, None)
        };
        let dates: Vec<NaiveDate> = due(&periods, &pending, off)
            .into_iter()
            .map(|d| d.business_date)
            .collect();
        assert_eq!(dates, vec![day(9)]);
    }

    #[test]
    fn a_month_held_by_a_correction_is_never_due() {
        let mut held = period(9, 0, Some("FAILED"));
        held.correction_key = Some("T-1".into());
        let pending = PendingReport {
            by_period: vec![waiting(9, 0, 3)],
            before: 0,
        };
        assert!(due(&[held], &pending, ask(0, Some(9))).is_empty());
    }

    #[test]
    fn a_month_is_not_closed_while_a_shard_is_not_success_items_wait_or_a_correction_holds_it() {
        let mut corrected = period(8, 3, Some("SUCCESS"));
        corrected.correction_key = Some("T-1".into());
        let periods = [
            period(7, 3, Some("SUCCESS")),
            corrected,
            period(9, 2, Some("SUCCESS")),
            period(10, 3, Some("SUCCESS")),
        ];
        let pending = PendingReport {
            by_period: vec![waiting(10, 2, 1), waiting(6, 0, 4)],
            before: 0,
        };
        let window: Vec<NaiveDate> = (5..=11).map(day).collect();
        let open: Vec<(NaiveDate, i64, u64, bool)> = not_closed(&periods, &pending, 3, &window)
            .into_iter()
            .map(|n| {
                (
                    n.business_date,
                    n.unsettled_shards,
                    n.waiting,
                    n.correction.is_some(),
                )
            })
            .collect();
        assert_eq!(
            open,
            vec![
                (day(6), 3, 4, false),
                (day(8), 0, 0, true),
                (day(9), 1, 0, false),
                (day(10), 0, 1, false),
            ]
        );
    }
}
