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

/// How far back [`last_closed`] looks for a closed month among the settled ones.
pub const LAST_CLOSED_LOOKS_BACK: i64 = 24;

/// The latest closed month of a job ([`MonthState::Closed`]), and the months after it whose
/// claims are settled but that are held ([`MonthState::Held`]), newest first, with their held
/// items. What `settlementd jobs` shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LastClosed {
    pub closed: Option<NaiveDate>,
    pub held_after: Vec<(NaiveDate, u64)>,
}

/// The latest month of `job` closed under `shards`, one meaning of closed ([`MonthState::of`]):
/// among the latest [`LAST_CLOSED_LOOKS_BACK`] months SUCCESS on every shard and held by no
/// correction, the newest with nothing waiting and nothing held, as the job's
/// [`Registered::pending`] counts them (in a transaction rolled back: a job's count may set plan
/// settings), with the held months newer than it.
pub async fn last_closed(
    db: &mut PgConnection,
    job: &dyn Registered,
    shards: u32,
) -> Result<LastClosed> {
    let settled: Vec<NaiveDate> = sqlx::query_scalar(
        "SELECT r.business_date FROM job_runs r
          WHERE r.job_name = $1 AND r.shards = $2 AND r.status = 'SUCCESS'
            AND NOT EXISTS (SELECT 1 FROM job_params p
                             WHERE p.job_name = $1 AND p.business_date = r.business_date
                               AND p.correction_key IS NOT NULL)
          GROUP BY r.business_date
         HAVING count(*) = $2
          ORDER BY r.business_date DESC
          LIMIT $3",
    )
    .bind(job.name())
    .bind(shards as i32)
    .bind(LAST_CLOSED_LOOKS_BACK)
    .fetch_all(&mut *db)
    .await?;
    if settled.is_empty() {
        return Ok(LastClosed::default());
    }
    let mut tx = sqlx::Connection::begin(&mut *db).await?;
    let pending = job.pending(&mut tx, shards, &settled).await?;
    tx.rollback().await?;
    let mut found = LastClosed::default();
    for date in settled {
        let (waiting, held) = pending
            .by_period
            .iter()
            .filter(|p| p.business_date == date)
            .fold((0, 0), |(w, h), p| (w + p.late + p.upkeep, h + p.held));
        match MonthState::of(true, Some((waiting, held))) {
            MonthState::Closed => {
                found.closed = Some(date);
                break;
            }
            MonthState::Held => found.held_after.push((date, held)),
            MonthState::Open | MonthState::Unknown => {}
        }
    }
    Ok(found)
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

/// A month's state: the one meaning of closed that `status`, `jobs`, the page (headline and
/// rows), the gauges and every follower show. [`MonthState::of`] decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MonthState {
    /// Every shard SUCCESS, no correction or refusal, nothing waiting, nothing held.
    Closed,
    /// As closed, but for items the job leaves for an operator (the fine settlement's rows with
    /// bad dates): no run changes them, a follower runs the month, and fixing them in libraryd
    /// makes them items waiting, which the next run takes.
    Held,
    /// A shard not SUCCESS, a correction holding it, a replica refused, or items waiting for a
    /// run (late items, upkeep): its replicas (or an operator's command) close it.
    Open,
    /// Every shard SUCCESS, but what waits could not be counted (the view's database time ran
    /// out): no verdict.
    Unknown,
}

impl MonthState {
    /// The state of a month whose claims are `settled` (every shard of the count SUCCESS, no
    /// correction holding it, no replica refused) with `counts` = (items waiting for a run,
    /// items held) on every shard, `None` when they were not counted.
    pub fn of(settled: bool, counts: Option<(u64, u64)>) -> Self {
        match (settled, counts) {
            (false, _) => Self::Open,
            (true, None) => Self::Unknown,
            (true, Some((waiting, _))) if waiting > 0 => Self::Open,
            (true, Some((_, held))) if held > 0 => Self::Held,
            (true, Some(_)) => Self::Closed,
        }
    }

    /// "closed", "held", "not closed", "unknown": the words every surface uses.
    pub fn word(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Held => "held",
            Self::Open => "not closed",
            Self::Unknown => "unknown",
        }
    }

    /// `closed`, `held`, `open`, `unknown`: the JSON and CSS name.
    pub fn key(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Held => "held",
            Self::Open => "open",
            Self::Unknown => "unknown",
        }
    }
}

/// Why a period is not closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotClosed {
    pub business_date: NaiveDate,
    /// Shards of the count that are not SUCCESS.
    pub unsettled_shards: i64,
    /// Items waiting on any shard.
    pub waiting: u64,
    /// Items held for an operator on any shard.
    pub held: u64,
    /// The correction holding it.
    pub correction: Option<String>,
    /// The job this one follows ([`super::Job::after`]), when its month is not closed either:
    /// whatever this job did of the month is done again once that one closes.
    pub upstream: Option<&'static str>,
    /// Whether `waiting` and `held` were counted: a view does not count a month a shard runs
    /// (`crate::overview`), whose run reads them as it goes.
    pub counted: bool,
}

impl NotClosed {
    /// [`MonthState::Open`], or [`MonthState::Held`] when only held items keep it from closed.
    pub fn state(&self) -> MonthState {
        MonthState::of(
            self.unsettled_shards == 0 && self.correction.is_none() && self.upstream.is_none(),
            Some((self.waiting, self.held)),
        )
    }
}

/// The periods of the window that are not closed under `shards` ([`MonthState`]): started, or
/// with items waiting or held, and not SUCCESS on every shard, or with items waiting or held, or
/// held by a correction. Oldest first; [`NotClosed::state`] tells open from held.
pub fn not_closed(
    periods: &[Period],
    pending: &PendingReport,
    shards: u32,
    window: &[NaiveDate],
) -> Vec<NotClosed> {
    let mut out = Vec::new();
    for &date in window {
        let started = periods.iter().find(|p| p.business_date == date);
        let (waiting, held) = pending
            .by_period
            .iter()
            .filter(|w| w.business_date == date)
            .fold((0, 0), |(w, h), p| (w + p.late + p.upkeep, h + p.held));
        if started.is_none() && waiting == 0 && held == 0 {
            continue;
        }
        let success = started.map_or(0, |p| p.success);
        let correction = started.and_then(|p| p.correction_key.clone());
        let unsettled_shards = i64::from(shards) - success.min(i64::from(shards));
        if unsettled_shards > 0 || waiting > 0 || held > 0 || correction.is_some() {
            out.push(NotClosed {
                business_date: date,
                unsettled_shards,
                waiting,
                held,
                correction,
                upstream: None,
                counted: true,
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

    #[test]
    fn a_month_with_only_held_items_is_held_and_anything_else_open_keeps_it_open() {
        let periods = [
            period(8, 3, Some("SUCCESS")),
            period(9, 3, Some("SUCCESS")),
            period(10, 2, Some("SUCCESS")),
        ];
        let mut held = waiting(8, 1, 0);
        held.held = 3;
        let mut held_and_waiting = waiting(9, 0, 1);
        held_and_waiting.held = 2;
        let mut held_unsettled = waiting(10, 2, 0);
        held_unsettled.held = 1;
        let pending = PendingReport {
            by_period: vec![held, held_and_waiting, held_unsettled],
            before: 0,
        };
        let window: Vec<NaiveDate> = (7..=10).map(day).collect();
        let states: Vec<(NaiveDate, MonthState, u64)> = not_closed(&periods, &pending, 3, &window)
            .into_iter()
            .map(|n| (n.business_date, n.state(), n.held))
            .collect();
        assert_eq!(
            states,
            vec![
                (day(8), MonthState::Held, 3),
                (day(9), MonthState::Open, 2),
                (day(10), MonthState::Open, 1),
            ],
            "held alone is its own state; waiting items or a shard not SUCCESS keep it open"
        );
        assert_eq!(MonthState::of(true, None), MonthState::Unknown);
        assert_eq!(MonthState::of(true, Some((0, 0))), MonthState::Closed);
        assert_eq!(MonthState::of(false, Some((0, 0))), MonthState::Open);
        assert_eq!(MonthState::of(false, None), MonthState::Open);
    }
}
