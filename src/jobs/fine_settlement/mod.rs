//! The fine-settlement job: the loans SQL, one batch per transaction.
//!
//! Shard `s` of `S` settles loans returned in the business date's month, still unsettled
//! (`fine_settled_at IS NULL`), with `id mod S = s`, written `(id % S + S) % S` so a negative id
//! (SQL's `%` keeps the dividend's sign) still belongs to exactly one shard.
//! The update is conditional (`AND fine_settled_at IS NULL`): a row settled meanwhile by anyone
//! counts as scanned, not updated. `fine_settled_at` is the done-marker, never `fine_cents`.
//!
//! Cost follows the month's unsettled rows of the shard, never the table: every statement reads
//! the partial index `loans_unsettled_by_month` on `(date_trunc('month', returned_on), id)`, whose
//! entries for one month are exactly that month's unsettled loans, in id order, wherever their ids
//! lie in the table (late returns, sparse ids, years of history). Batches walk it in id order, so
//! the cursor committed with each batch means "every row of this shard's month up to here is
//! done", and a settled month has no entries at all.
//!
//! Even shards walk up (cursor `last_id`), odd shards walk down (cursor `last_id_desc`): the
//! shards of one month interleave on the same heap pages (`id % S`), and two walks that start at
//! opposite ends meet only in the middle instead of contending for every page together
//! (docs/PERFORMANCE.md: two shards at once on an append-only table went from 1.0 to 1.25 × the
//! single `UPDATE`). A run always stays inside both cursors ([`Cursor::remaining`]), whichever
//! direction committed them.
//!
//! Each month is settled under one fine rule: the configuration's rule for the month
//! ([`FineSchedule::rule_for`]) is the job's identifying parameter ([`Job::params`]), pinned by the
//! month's first claim; a claim whose rule differs settles nothing.
//!
//! A loan the rule cannot price — its due date missing or infinite ([`HELD_ROW`]) — is *held*: left
//! unsettled, never priced at a guess, never stopping the batch; the run reports it, and the first
//! run after it is fixed settles it. Loans returned into a month after it was closed (late returns)
//! are found by [`Job::late_items`] and settled by a new attempt of the month's shard.
//!
//! When the month has one shard, the page of the next batch is read on a spare connection of the
//! pool while a batch settles ([`Lookahead`]): the index read that finds where a batch ends runs
//! on another core instead of in front of every batch (docs/PERFORMANCE.md). It is only a read;
//! every write stays in the fenced batch transaction, and a batch whose page was not read ahead
//! reads it itself.

pub mod correction;
pub mod journal;
pub mod preview;
pub mod verify;

use crate::calendar::BusinessDate;
use crate::config::{SessionGuards, Settings, ShardSpec};
use crate::fine::{DatedRule, FineRule, FineSchedule};
use crate::job_layer::registry::Configured;
use crate::job_layer::{
    parse_sum, Batch, Claim, Cursor, Fact, Job, JobKey, Metric, Metrics, Noted, Notes, Params,
    Pending, PendingReport, Phrase, Preview, Proof, ProveError, Reopen, Report, Words, HELD_IDS,
};
use chrono::{NaiveDate, NaiveDateTime, NaiveTime};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgExecutor, PgPool, Postgres};
use std::borrow::Cow;
use std::sync::{Mutex, OnceLock};

pub const JOB_NAME: &str = "fine-settlement";

/// The fine settlement in the binary's list of jobs (`JOBS` in src/jobs/mod.rs). Its settings
/// are the shared ones (`[fine]`, `[batch]`, `[lease]`): its section takes no keys of its own.
impl Configured<Settings> for FineSettlement {
    type Settings = crate::job_layer::registry::NoSettings;
    const DEFAULT_CRON: &'static str = "0 30 2 1 * *";

    fn build(settings: &Settings, _own: Self::Settings) -> Result<Self, String> {
        Ok(FineSettlement::of(settings))
    }
}

/// The job key of one shard's settlement of one month.
pub fn key(business_date: BusinessDate, shard: ShardSpec) -> JobKey {
    JobKey {
        job_name: JOB_NAME.to_string(),
        business_date: business_date.date(),
        shards: shard.count,
        shard: shard.index,
    }
}

#[derive(Debug, Clone)]
pub struct FineSettlement {
    /// The rules over the months; a month is settled under its own ([`FineSchedule::rule_for`]).
    pub rules: FineSchedule,
    pub batch_size: u32,
    /// Server-side limits of every batch transaction, derived from the lease
    /// ([`crate::config::LeaseSettings::guards`]).
    pub guards: SessionGuards,
}

/// One run: its bounds and rule, fixed after the claim, what its journal entries say, and the page
/// read ahead for its next batch.
#[derive(Debug)]
pub struct MonthPlan {
    bounds: Bounds,
    rule: FineRule,
    /// The journal's words for this run's entries.
    entries: Entries,
    /// Re-prices the month's queued edits once the month index is walked.
    edits: journal::Repricer,
    ahead: Lookahead,
}

/// What a run's journal entries say besides each loan's: kind, rule, the run's attempt.
#[derive(Debug, Clone)]
struct Entries {
    kind: journal::Kind,
    rule: serde_json::Value,
    attempt: i32,
}
impl MonthPlan {
    /// How many batches of this run found their page already read ([`Lookahead`]).
    pub fn pages_read_ahead(&self) -> u64 {
        self.ahead.state().used
    }
}

/// Which index entries a run reads: one shard's share of one month.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    /// The month's first day at midnight: the key of its entries in `loans_unsettled_by_month`.
    month: NaiveDateTime,
    shards: i64,
    shard: i64,
    walk: Walk,
}

impl Bounds {
    fn for_key(key: &JobKey) -> Self {
        Self {
            month: BusinessDate::month_start(key.business_date).and_time(NaiveTime::MIN),
            shards: key.shards.into(),
            shard: key.shard.into(),
            walk: Walk::of_shard(key.shard),
        }
    }

    /// The next `limit` entries of the shard's month inside `(low, high)`, in the walk's order.
    async fn page(
        &self,
        db: &mut PgConnection,
        (low, high): (i64, i64),
        limit: i64,
    ) -> sqlx::Result<Page> {
        let (scanned, last, known): (i64, Option<i64>, bool) =
            sqlx::query_as(&BatchSql::of(self.walk).page)
            .bind(self.month)
            .bind(low)
            .bind(high)
            .bind(self.shards)
            .bind(self.shard)
            .bind(limit)
            .fetch_one(db)
            .await?;
        Ok(Page {
            scanned,
            last,
            known,
        })
    }
}

/// What a page found: how many entries, the last id in the walk's order (`None`: none left), and
/// whether any of its loans is known to the journal (has a head: [`BatchSql`]'s `settle` rather
/// than `settle_fresh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Page {
    scanned: i64,
    last: Option<i64>,
    known: bool,
}

/// The next batch's page, read on a spare pooled connection while the current batch settles
/// (runs of a month's only shard).
///
/// A page is only a read, in a transaction of its own opened like a batch (the same pinned
/// plans and guards), so reading it early changes nothing a batch does: the batch still settles,
/// under its own fence, every unsettled row of its range as the settle statement finds it (a row
/// returned after the page was read is settled with its batch; one settled meanwhile by someone
/// else is left alone). A page is used only by the batch whose remaining ids it was read for;
/// any other cursor (a test, a retry) reads its own.
///
/// The connection is taken only when the pool can give it without waiting and still has one
/// for the heartbeat (`database.max_connections` ≥ 3; the default is 5), and kept for the run.
/// If reading ahead fails, the run logs it once and reads each page inside its batch from then
/// on: a read-ahead can make a run slower, never fail it.
#[derive(Debug)]
struct Lookahead {
    /// `None`: no reading ahead for this plan.
    pool: Option<PgPool>,
    begin: String,
    state: Mutex<AheadState>,
}

#[derive(Debug, Default)]
struct AheadState {
    conn: Option<PoolConnection<Postgres>>,
    /// The page read for the batch whose remaining ids are the key.
    page: Option<((i64, i64), Page)>,
    /// Reading ahead failed once: stop trying.
    off: bool,
    /// Batches that found their page read.
    used: u64,
}

impl Lookahead {
    fn state(&self) -> std::sync::MutexGuard<'_, AheadState> {
        // A panic while the lock was held cannot leave the state inconsistent (plain fields).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The page read ahead for `remaining`, if that is the one that was read.
    fn take(&self, remaining: (i64, i64)) -> Option<Page> {
        let mut state = self.state();
        match state.page.take() {
            Some((read_for, page)) if read_for == remaining => {
                state.used += 1;
                Some(page)
            }
            _ => None,
        }
    }

    /// Reads the page of `remaining` on the spare connection and keeps it for the next batch.
    async fn read(&self, bounds: &Bounds, remaining: Option<(i64, i64)>, limit: i64) {
        let (Some(pool), Some(remaining)) = (&self.pool, remaining) else {
            return;
        };
        let conn = {
            let mut state = self.state();
            if state.off {
                return;
            }
            state.conn.take()
        };
        let mut conn = match conn {
            Some(conn) => conn,
            None => match spare_connection(pool).await {
                Some(conn) => conn,
                None => return,
            },
        };
        let read = async {
            let mut tx = conn.begin_with(self.begin.clone()).await?;
            let page = bounds.page(&mut tx, remaining, limit).await?;
            tx.rollback().await?;
            Ok::<_, sqlx::Error>(page)
        }
        .await;
        let mut state = self.state();
        match read {
            Ok(page) => {
                state.conn = Some(conn);
                state.page = Some((remaining, page));
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the next batch ahead failed; each batch reads its own page from now on");
                state.off = true;
            }
        }
    }
}

/// A connection of `pool` for reading ahead, if one can be had without waiting while another
/// stays free for the heartbeat.
async fn spare_connection(pool: &PgPool) -> Option<PoolConnection<Postgres>> {
    let max = pool.options().get_max_connections();
    let free = max.saturating_sub(pool.size()) as usize + pool.num_idle();
    if free < 2 {
        return None;
    }
    match pool.try_acquire() {
        Some(conn) => Some(conn),
        None => pool.acquire().await.ok(),
    }
}

/// The order a shard reads its month in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Walk {
    /// Ascending ids, committing `last_id` (even shards).
    Up,
    /// Descending ids, committing `last_id_desc` (odd shards).
    Down,
}

impl Walk {
    pub fn of_shard(shard: u32) -> Self {
        if shard % 2 == 0 {
            Walk::Up
        } else {
            Walk::Down
        }
    }
}

/// The month's key in `loans_unsettled_by_month`, as the index expression computes it.
const MONTH_KEY: &str = "date_trunc('month', returned_on::timestamp)";

/// Opens a batch transaction (one round trip; `SET LOCAL`, so every setting ends with the
/// transaction):
///
/// - **plans pinned to what one batch costs.** With sequential scans, bitmap scans and sorts
///   disabled, the only way left to read "this month's unsettled rows from this id on, in id order"
///   is an ordered scan of `loans_unsettled_by_month`: the statements compare `id + 0`, an
///   expression only that index holds, so not even the primary key can serve them. Stale or missing
///   statistics can therefore change nothing. JIT is off because a disabled path, if one were ever
///   taken, is priced high enough to trigger it at every batch.
/// - **joins as nested loops.** A join inside a batch (a correction's rows, found again by id)
///   probes an index once per row it has, rather than hashing a scan of the whole table.
/// - **a plan per batch.** `plan_cache_mode = force_custom_plan`: the batch statements are
///   prepared once per connection, and without this PostgreSQL would switch them to a generic
///   plan after five executions (one that knows neither the cursor nor the shard count).
/// - **no wait for the WAL flush at commit.** A batch lost in a server crash is lost together with
///   its fenced progress (same transaction), so the next attempt resumes before it and settles
///   those rows again; the SUCCESS write commits synchronously and flushes every batch before it.
///
/// The job layer opens every batch with `BEGIN`, the lease's guards and these settings
/// ([`Job::batch_settings`]); [`begin_batch_sql`] opens the settlement's own reads the same way.
pub const BEGIN_BATCH: &str = "BEGIN;
    SET LOCAL enable_seqscan = off;
    SET LOCAL enable_bitmapscan = off;
    SET LOCAL enable_sort = off;
    SET LOCAL enable_hashjoin = off;
    SET LOCAL enable_mergejoin = off;
    SET LOCAL jit = off;
    SET LOCAL plan_cache_mode = force_custom_plan;
    SET LOCAL synchronous_commit = off";

/// [`BEGIN_BATCH`] plus the lease's [`SessionGuards`] as `SET LOCAL`: transaction-scoped, so they
/// hold for exactly the transactions that take row locks on `loans`, also through a pooler. A
/// writer frozen inside a batch has its session ended by the server after
/// `idle_in_transaction_session_timeout` (its batch rolls back, its locks go), before any peer can
/// take its claim over; a batch waits at most `lock_timeout` for a row lock and runs at most
/// `statement_timeout`.
pub fn begin_batch_sql(guards: &SessionGuards) -> String {
    format!(
        "{BEGIN_BATCH};
    SET LOCAL idle_in_transaction_session_timeout = {};
    SET LOCAL lock_timeout = {};
    SET LOCAL statement_timeout = {}",
        guards.idle_in_transaction.as_millis(),
        guards.lock_timeout.as_millis(),
        guards.statement_timeout.as_millis()
    )
}

impl FineSettlement {
    /// The settlement `settings` configure.
    pub fn of(settings: &Settings) -> Self {
        FineSettlement {
            rules: settings.fine.clone(),
            batch_size: settings.batch.size,
            guards: settings.lease.guards(),
        }
    }

    /// The rule of `key`'s month, or why there is none.
    pub fn rule_of(&self, business_date: NaiveDate) -> Result<DatedRule, String> {
        rule_of(&self.rules, business_date)
    }

    /// What opens a batch transaction of this job, the lease's guards included: the job layer's
    /// `BEGIN` for its runs, and the settlement's own reads of the month index.
    pub fn begin_batch(&self) -> String {
        begin_batch_sql(&self.guards)
    }
}

/// The rule `rules` give the month of `business_date`, or why there is none.
pub fn rule_of(rules: &FineSchedule, business_date: NaiveDate) -> Result<DatedRule, String> {
    let month = BusinessDate::new(business_date).map_err(|e| e.to_string())?;
    rules.rule_for(month.first_day()).copied().ok_or_else(|| {
        let first = rules.rules().first().map(DatedRule::from_month);
        format!(
            "no fine rule covers {}: the earliest of fine.rules is from {}",
            month.first_day().format("%Y-%m"),
            first.unwrap_or_default()
        )
    })
}

/// A month's rule as the job's identifying parameters: its identity,
/// `{"daily_rate_cents": …, "grace_days": …, "max_cents": …}` — what prices a fine. When the rule
/// starts to apply (`from`) is not part of it: the same rule written again with another `from`
/// is the same rule.
pub fn rule_params(rule: &FineRule) -> Params {
    Params(journal::rule_identity(rule))
}

/// The rule a month's pinned parameters describe (a pin of an earlier release may also carry
/// `from`, which is ignored); `None` for parameters this version does not read (then they are
/// shown as they are).
pub fn rule_from_params(params: &Params) -> Option<FineRule> {
    let p = &params.0;
    let int = |name: &str| p.get(name).and_then(serde_json::Value::as_i64);
    Some(FineRule {
        daily_rate_cents: int("daily_rate_cents")?,
        grace_days: int("grace_days")?,
        max_cents: int("max_cents")?,
    })
}

/// Pinned parameters in words: the rule, or the JSON when it is not one.
pub fn describe_params(params: &Params) -> String {
    match rule_from_params(params) {
        Some(rule) => rule.to_string(),
        None => params.0.to_string(),
    }
}

impl Job for FineSettlement {
    type Plan = MonthPlan;

    const NAME: &'static str = JOB_NAME;

    fn params(&self, key: &JobKey) -> Result<Params, String> {
        Ok(rule_params(&self.rule_of(key.business_date)?.rule))
    }

    fn describe(&self, params: &Params) -> String {
        describe_params(params)
    }

    /// The shard's unsettled returns of the month that the rule can price, and its loans whose
    /// earliest queued edit is in the month.
    async fn late_items(&self, pool: &PgPool, key: &JobKey) -> sqlx::Result<u64> {
        let bounds = Bounds::for_key(key);
        let mut tx = pool.begin_with(begin_batch_sql(&self.guards)).await?;
        let counts =
            unsettled_by_month(&mut tx, &[bounds.month], bounds.shards, bounds.shard).await?;
        let edits =
            journal::edits_waiting(&mut tx, bounds.month.date(), bounds.shards, bounds.shard)
                .await?;
        tx.rollback().await?;
        Ok(counts.first().map_or(0, |c| c.late) + edits)
    }

    fn reopen(&self, late: u64) -> Reopen {
        Reopen {
            event: "late_returns",
            message: format!(
                "{late} late returns or edits of settled loans: loans returned into the month \
                 after it closed, or settled loans whose dates libraryd changed"
            ),
        }
    }

    /// Per month and shard: the unsettled returns of each month asked for (one index probe per
    /// month; `late` those the rule can price, `held` the others), plus the loans with edits
    /// queued, under the month of their earliest edit (any month: the queue is small and says
    /// where they are); and the unsettled returns the rule can price in months before the first.
    async fn pending(
        &self,
        db: &mut PgConnection,
        shards: u32,
        periods: &[NaiveDate],
    ) -> sqlx::Result<PendingReport> {
        let months: Vec<NaiveDateTime> = BusinessDate::first_days(periods)
            .into_iter()
            .map(|d| d.and_time(NaiveTime::MIN))
            .collect();
        let shards = i64::from(shards.max(1));
        // A transaction, or a savepoint inside the caller's: the plan settings end with it.
        let mut tx = db.begin().await?;
        sqlx::query(PIN_MONTH_INDEX).execute(&mut *tx).await?;
        let mut by_period: Vec<Pending> = unsettled_by_month_and_shard(&mut tx, &months, shards)
            .await?
            .into_iter()
            .filter_map(|(month, shard, late, held)| {
                Some(Pending {
                    business_date: BusinessDate::of_month_of(month.date())?.date(),
                    shard: shard as u32,
                    late: late as u64,
                    held: held as u64,
                    upkeep: 0,
                })
            })
            .collect();
        let edits = journal::edits_by_month(&mut tx, shards).await?;
        let unjournaled = journal::unjournaled_by_month(&mut tx, shards).await?;
        let counted = edits
            .into_iter()
            .map(|(month, shard, n)| (month, shard, n as u64, 0))
            .chain(
                unjournaled
                    .into_iter()
                    .map(|(month, shard, n)| (month, shard, 0, n as u64)),
            );
        for (month, shard, late, upkeep) in counted {
            let Some(business_date) = BusinessDate::of_month_of(month) else {
                continue;
            };
            let business_date = business_date.date();
            match by_period
                .iter_mut()
                .find(|p| p.business_date == business_date && i64::from(p.shard) == shard)
            {
                Some(p) => {
                    p.late += late;
                    p.upkeep += upkeep;
                }
                None => by_period.push(Pending {
                    business_date,
                    shard: shard as u32,
                    late,
                    held: 0,
                    upkeep,
                }),
            }
        }
        let before = match months.first() {
            Some(first) => unsettled_before(&mut tx, *first).await?,
            None => 0,
        };
        tx.rollback().await?;
        by_period.sort_by_key(|p| (p.business_date, p.shard));
        Ok(PendingReport { by_period, before })
    }

    fn empty_notes(&self) -> Notes {
        notes(0, 0, Vec::new())
    }

    fn note_events(&self, notes: &Notes) -> Vec<(&'static str, String)> {
        notes
            .get(HELD)
            .filter(|held| held.count > 0)
            .map(|held| {
                vec![(
                    "held_rows",
                    format!(
                        "{} rows held (bad dates: due_on missing or infinite, which the rule \
                         cannot price), left as they were: ids {:?}",
                        held.count,
                        held.ids.as_deref().unwrap_or_default()
                    ),
                )]
            })
            .unwrap_or_default()
    }

    fn explain(&self, name: &str, noted: &Noted) -> String {
        match name {
            ODD_ROWS => format!(
                "{} with contradictory dates, settled all the same",
                noted.count
            ),
            HELD => format!(
                "{} rows held (bad dates), left unsettled: ids {:?}",
                noted.count,
                noted.ids.as_deref().unwrap_or_default()
            ),
            _ => format!("{} {name}", noted.count),
        }
    }

    fn batch_settings(&self) -> Cow<'static, str> {
        Cow::Borrowed(BEGIN_BATCH.trim_start_matches("BEGIN;"))
    }

    /// Opening journal entries for settled loans that have none ([`journal::open_unjournaled`]):
    /// loans settled by an older binary during a rolling upgrade, or not reached yet by
    /// `settlementd migrate`. Batches until `until`.
    async fn upkeep(&self, pool: &PgPool, until: std::time::Instant) -> sqlx::Result<u64> {
        let mut conn = pool.acquire().await?;
        if !journal::any_unjournaled(&mut conn).await? {
            return Ok(0);
        }
        let batch = i64::from(self.batch_size.max(1));
        let mut opened = 0;
        loop {
            let n = journal::open_unjournaled(&mut conn, batch).await?;
            opened += n;
            if (n as i64) < batch || std::time::Instant::now() >= until {
                return Ok(opened);
            }
        }
    }

    async fn remaining(
        &self,
        db: &mut PgConnection,
        key: &JobKey,
        cursor: Cursor,
    ) -> sqlx::Result<Option<u64>> {
        Ok(Some(unsettled_after(db, key, cursor).await?))
    }

    fn describe_metrics(&self) {
        metrics::describe_counter!(
            "settlementd_odd_rows_total",
            "Loans settled whose dates contradict each other (returned or due before borrowed)"
        );
        metrics::counter!("settlementd_odd_rows_total", "job_name" => JOB_NAME).increment(0);
    }

    fn metrics(&self) -> Metrics {
        Metrics {
            items: "loans",
            succeeded: "settled",
            conflicts: Some((
                Metric {
                    name: "settlementd_rule_conflicts_total",
                    help: "Claims refused because the month's pinned fine rule differs from this replica's",
                },
                "rule_conflict",
            )),
            late_done: Some(Metric {
                name: "settlementd_late_returns_settled_total",
                help: "Late returns and edits (loans returned into or edited in a closed month) settled by this replica",
            }),
            waiting: Some(Metric {
                name: "settlementd_unsettled_in_closed_months",
                help: "Late returns waiting in this shard's closed months inside settle.lookback_months",
            }),
            held: Some(Metric {
                name: "settlementd_held_rows",
                help: "Rows of this shard's closed months that the fine rule cannot price (bad dates), left unsettled",
            }),
            beyond_lookback: Some(Metric {
                name: "settlementd_unsettled_beyond_lookback",
                help: "Unsettled returns the rule can price in months before settle.lookback_months, every shard: no replica settles them by itself",
            }),
            amount: Some(Metric {
                name: "settlementd_fine_cents_settled_total",
                help: "Fine cents written by this replica's runs as they settled loans (not re-pricings), by month (business_date)",
            }),
            old_unsettled_shards: true,
        }
    }

    fn words(&self) -> Words {
        Words {
            waiting: Phrase::new(
                "late return or edit waiting",
                "late returns or edits waiting",
            ),
            waiting_key: "late_returns",
            held: Phrase::new("row held (bad dates)", "rows held (bad dates)"),
            upkeep: Phrase::new(
                "settled loan without a journal entry",
                "settled loans without a journal entry",
            ),
            written: Phrase::new("row updated", "rows updated"),
            facts_are: "settled",
            run_does: "settles",
            pinned: Some("rule"),
        }
    }

    /// The month from its journal and the loans by primary key, against its pinned rule
    /// ([`verify`]): on two connections of `pool` at once (`database.max_connections` is at least
    /// 2), which read the month's journal in two halves in one exported snapshot.
    async fn prove(
        &self,
        pool: &PgPool,
        month: BusinessDate,
    ) -> Result<Option<Proof>, ProveError> {
        let (mut conn, mut helper) = tokio::try_join!(pool.acquire(), pool.acquire())?;
        let verification = verify::verify(&mut conn, Some(&mut helper), month, &self.rules).await?;
        Ok(Some(verification.into_proof_holding(|v| verify::Verification { held: Default::default(), ..v.clone() })))
    }

    /// The month's settled rows, fine sum and digest on the record, from its journal and the
    /// loans by primary key ([`journal::totals`]).
    async fn facts(
        &self,
        db: &mut PgConnection,
        month: BusinessDate,
    ) -> sqlx::Result<Vec<Fact>> {
        let totals = journal::totals(db, month).await?;
        Ok(vec![
            Fact::count("settled_rows", "rows", totals.settled_rows),
            Fact::cents("fine_cents_sum", "fines", totals.fine_cents_sum),
            Fact::digest("digest", "digest", totals.digest),
        ])
    }

    /// The month's last journal row: every change of the month's money is journalled, by this
    /// release's runs and corrections and by the release before it (libraryd's edits and
    /// deletions of settled loans wait in the edit queue, and the run that takes them journals
    /// them). One probe of `fine_journal_by_month`.
    async fn facts_mark(
        &self,
        db: &mut PgConnection,
        month: BusinessDate,
    ) -> sqlx::Result<Option<i64>> {
        sqlx::query_scalar("SELECT max(id) FROM fine_journal WHERE month = $1")
            .bind(month.first_day())
            .fetch_one(db)
            .await
    }

    /// The month's unsettled returns and queued edits priced as its batches would price them
    /// ([`preview`]), under the rule the configuration gives the month.
    async fn preview(
        &self,
        db: &mut PgConnection,
        month: BusinessDate,
        count: u32,
        shards: &[u32],
    ) -> sqlx::Result<Option<Preview>> {
        let Ok(rule) = self.rule_of(month.date()) else {
            return Ok(None);
        };
        let found =
            preview::preview(db, preview::Writer::Run, month, count, shards, &rule.rule).await?;
        Ok(Some(found.to_preview(preview::Writer::Run, shards)))
    }

    async fn plan(
        &self,
        pool: &PgPool,
        claim: &Claim,
        estimate: bool,
    ) -> sqlx::Result<(MonthPlan, Option<u64>)> {
        let key = &claim.key;
        let bounds = Bounds::for_key(key);
        // The claim compared this rule with the month's pinned one: they are the same.
        let rule = self
            .rule_of(key.business_date)
            .map_err(sqlx::Error::Protocol)?
            .rule;
        let remaining = match estimate {
            true => Some(unsettled(pool, &bounds, claim.resume).await?),
            false => None,
        };
        let kind = match closed_before(pool, key).await? {
            true => journal::Kind::Late,
            false => journal::Kind::Settled,
        };
        let entries = Entries {
            kind,
            rule: journal::rule_identity(&rule),
            attempt: claim.attempt,
        };
        let edits = journal::Repricer {
            month: bounds.month.date(),
            business_date: key.business_date,
            shards: bounds.shards,
            shard: bounds.shard,
            rule,
            attempt: claim.attempt,
            correction_key: None,
        };
        // Only the month's one shard reads ahead: with more shards, the server's cores are busy
        // with the other shards' batches, and a read alongside each competes with them (two
        // shards on two cores: 0.08 × L slower on `append`; docs/PERFORMANCE.md).
        let read_ahead = key.shards == 1 && pool.options().get_max_connections() >= 3;
        let ahead = Lookahead {
            pool: read_ahead.then(|| pool.clone()),
            begin: begin_batch_sql(&self.guards),
            state: Mutex::default(),
        };
        Ok((
            MonthPlan {
                bounds,
                rule,
                entries,
                edits,
                ahead,
            },
            remaining,
        ))
    }

    /// One batch: the next `batch_size` unsettled loans of this shard's month inside `cursor`, in
    /// the shard's [`Walk`] order, settled by conditional UPDATEs ([`BatchSql`]):
    ///
    /// 1. `page` reads where the batch ends: an index-only range scan of `loans_unsettled_by_month`
    ///    that starts at the cursor's end of the remaining ids and stops after `batch_size` rows
    ///    of this shard. Read ahead while the batch before settled ([`Lookahead`]), or here.
    /// 2. `odd` finds the range's held rows ([`HELD_ROW`], rare: counted and named, left alone) and
    ///    settles and counts its odd rows ([`ODD_ROW`], rare).
    /// 3. `settle` updates the same index range, up to the page's last id, with the same filters:
    ///    every row the odd statement did not settle, but the held ones. Its row count is the rest
    ///    of `updated`.
    ///
    /// While 2 and 3 run, the next batch's page is read on the spare connection.
    ///
    /// Both updates are conditional (`fine_settled_at IS NULL`, re-checked on the newest row
    /// version): a row settled meanwhile by someone else counts as scanned (it is in the page) but
    /// not updated, and a row that left the month meanwhile is left alone. The range holds only
    /// this month's unsettled rows (the index has nothing else). Counting the main update by its
    /// row count instead of carrying every updated row through a `RETURNING` is what the split
    /// buys: 0.80 → 0.87 × the single `UPDATE` (docs/PERFORMANCE.md).
    ///
    /// The statements are prepared once per connection (sqlx's statement cache), so a batch sends
    /// each in one round trip; [`BEGIN_BATCH`]'s `plan_cache_mode = force_custom_plan` still
    /// plans every execution for its own cursor and shard count.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let limit = i64::from(self.batch_size.max(1));
        let walked = self.index_batch(tx, plan, cursor, limit).await?;
        if !walked.done {
            return Ok(walked);
        }
        // The month index is walked: the edits of settled loans queued for this month and shard,
        // in the same transaction (a batch of them at a time; each batch dequeues what it did).
        let edits = journal::reprice(tx, &plan.edits, journal::Source::Queue { limit }).await?;
        Ok(Batch {
            scanned: walked.scanned + edits.loans,
            updated: walked.updated + edits.written(),
            done: (edits.loans as i64) < limit,
            ..walked
        })
    }
}

impl FineSettlement {
    /// One batch along the month index (see [`Job::run_batch`]); `done` once it is walked.
    async fn index_batch(
        &self,
        tx: &mut PgConnection,
        plan: &MonthPlan,
        cursor: Cursor,
        limit: i64,
    ) -> sqlx::Result<Batch> {
        let Some((low, high)) = cursor.remaining() else {
            return Ok(Batch::nothing_left(cursor));
        };
        let bounds = &plan.bounds;
        let page = match plan.ahead.take((low, high)) {
            Some(page) => page,
            None => bounds.page(&mut *tx, (low, high), limit).await?,
        };
        let Some(last) = page.last else {
            return Ok(Batch::nothing_left(cursor));
        };
        let (from, to, cursor) = match bounds.walk {
            Walk::Up => (
                low,
                last,
                Cursor {
                    last_id: Some(last),
                    ..cursor
                },
            ),
            Walk::Down => (
                last,
                high,
                Cursor {
                    last_id_desc: Some(last),
                    ..cursor
                },
            ),
        };
        // A short page read every remaining row of the shard's month.
        let done = page.scanned < limit;
        let sql = BatchSql::of(bounds.walk);
        let rule = &plan.rule;
        // Both statements take the same parameters: the range, the shard, the rule, and what
        // their journal entries say.
        let numbers = [
            from,
            to,
            bounds.shards,
            bounds.shard,
            rule.grace_days,
            rule.daily_rate_cents,
            rule.max_cents,
        ];
        let entries = &plan.entries;
        let settle = async {
            let odd = numbers
                .iter()
                .fold(sqlx::query_as(&sql.odd).bind(bounds.month), |q, n| {
                    q.bind(*n)
                })
                .bind(entries.kind.as_str())
                .bind(&entries.rule)
                .bind(entries.attempt);
            let (odd, odd_cents, held, held_ids): (i64, i64, i64, Vec<i64>) =
                odd.fetch_one(&mut *tx).await?;
            let rest = |statement| {
                numbers
                    .iter()
                    .fold(sqlx::query_as(statement).bind(bounds.month), |q, n| {
                        q.bind(*n)
                    })
                    .bind(entries.kind.as_str())
                    .bind(&entries.rule)
                    .bind(entries.attempt)
            };
            let (rest, rest_cents): (i64, i64) = if page.known {
                rest(&sql.settle).fetch_one(&mut *tx).await?
            } else {
                // The page was read before this transaction began (ahead, while the last batch
                // settled): a loan of it may have become known to the journal since (re-created
                // by libraryd under a settled loan's id, un-settled by hand). Its head then stops
                // the fresh statement at the heads' key, and the page is settled as a known one,
                // in the same transaction, rather than failing the run.
                sqlx::query(FRESH_PAGE).execute(&mut *tx).await?;
                match rest(&sql.settle_fresh).fetch_one(&mut *tx).await {
                    Err(sqlx::Error::Database(e)) if e.constraint() == Some(HEADS_KEY) => {
                        tracing::debug!("a loan of a fresh page is known meanwhile: settled as known");
                        sqlx::query(FRESH_PAGE_UNDONE).execute(&mut *tx).await?;
                        rest(&sql.settle).fetch_one(&mut *tx).await?
                    }
                    settled => settled?,
                }
            };
            let cents = odd_cents.saturating_add(rest_cents) as u64;
            Ok::<_, sqlx::Error>((odd as u64, rest as u64, cents, held as u64, held_ids))
        };
        let next = if done { None } else { cursor.remaining() };
        let (settled, ()) = tokio::join!(settle, plan.ahead.read(bounds, next, limit));
        let (odd, rest, cents, held, held_ids) = settled?;
        metrics::counter!("settlementd_odd_rows_total", "job_name" => JOB_NAME).increment(odd);
        Ok(Batch {
            cursor,
            scanned: page.scanned as u64,
            updated: odd + rest,
            amount: cents,
            notes: notes(odd, held, held_ids),
            done,
        })
    }
}

/// The savepoint a fresh page's statement runs under, and its undoing when a loan of the page has
/// a head by then (the heads' primary key, [`HEADS_KEY`], refused it).
const FRESH_PAGE: &str = "SAVEPOINT fresh_page";
const FRESH_PAGE_UNDONE: &str = "ROLLBACK TO SAVEPOINT fresh_page";
const HEADS_KEY: &str = "fine_heads_pkey";

/// What a run reports besides rows read and written: `odd_rows`, loans settled whose dates
/// contradict each other ([`ODD_ROW`]); `held`, loans left unsettled because the rule cannot price
/// them ([`HELD_ROW`]), named by id.
pub const ODD_ROWS: &str = "odd_rows";
pub const HELD: &str = "held";

/// A batch's notes.
pub fn notes(odd: u64, held: u64, held_ids: Vec<i64>) -> Notes {
    Notes::from([
        (
            ODD_ROWS,
            Noted {
                count: odd,
                ids: None,
            },
        ),
        (
            HELD,
            Noted {
                count: held,
                ids: Some(held_ids),
            },
        ),
    ])
}

/// Whether the month of `key` was closed before this run: its shard's key was SUCCESS before, or
/// the month was closed under another shard count. What such a run settles are late returns.
async fn closed_before(pool: &PgPool, key: &JobKey) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (
             SELECT 1 FROM job_events
              WHERE job_name = $1 AND business_date = $2 AND event = 'succeeded'
                AND (shards <> $3 OR shard = $4))",
    )
    .bind(&key.job_name)
    .bind(key.business_date)
    .bind(key.shards as i32)
    .bind(key.shard as i32)
    .fetch_one(pool)
    .await
}

/// How many loans the run of `key` still has to read inside `cursor` (its committed progress):
/// what its progress is measured against. One pass over the shard's month in
/// `loans_unsettled_by_month` (all of the month's unsettled entries: the shard is a filter), so
/// callers that show it often should keep it per attempt and bound it with a statement timeout.
pub async fn unsettled_after(
    db: impl PgExecutor<'_>,
    key: &JobKey,
    cursor: Cursor,
) -> sqlx::Result<u64> {
    unsettled(db, &Bounds::for_key(key), cursor).await
}

async fn unsettled(db: impl PgExecutor<'_>, plan: &Bounds, cursor: Cursor) -> sqlx::Result<u64> {
    let Some((low, high)) = cursor.remaining() else {
        return Ok(0);
    };
    let remaining: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM loans
          WHERE {MONTH_KEY} = $1 AND fine_settled_at IS NULL AND returned_on IS NOT NULL
            AND id + 0 BETWEEN $2 AND $3 AND (id % $4 + $4) % $4 = $5"
    ))
    .bind(plan.month)
    .bind(low)
    .bind(high)
    .bind(plan.shards)
    .bind(plan.shard)
    .fetch_one(db)
    .await?;
    Ok(remaining as u64)
}

/// Loans whose dates contradict each other: returned, or due, before they were borrowed. They are
/// settled by the same rule as every other loan (the rule only reads `due_on` and `returned_on`:
/// any two finite dates give a fine between 0 and the cap), and counted: `odd` in the run's
/// report, `settlementd_odd_rows_total`, a warning in the log. A loan returned decades late, or
/// due decades after it came back, is consistent, not odd: it gets the cap, or 0.
pub const ODD_ROW: &str = "(l.returned_on < l.borrowed_on OR l.due_on < l.borrowed_on)";

/// Loans the rule cannot price: no due date (a nullable `due_on` of a table that predates
/// settlementd), or an infinite one (`-infinity` from an import meaning "none"). Their fine would be
/// a guess or an error ("cannot subtract infinite dates"), so they are *held*: left unsettled,
/// counted and named by id (`held` in the run's report, a `held_rows` event, the
/// `settlementd_held_rows` gauge), and settled by the first run after their due date is fixed. A
/// returned loan's `returned_on` is always finite here: the month index has no entries for
/// `±infinity`.
pub const HELD_ROW: &str = "(l.due_on IS NULL OR NOT isfinite(l.due_on))";

/// The statements of a batch of one walk.
///
/// `page`: `$1` month key, `$2`..`$3` the ids still to walk (inclusive), `$4`/`$5` shard count and
/// index, `$6` batch size. Returns (rows read, last id read, whether any of them is a loan the
/// journal knows — has a head in `fine_heads`); the last id read is the largest of the page walking
/// up, the smallest walking down. Read-only.
///
/// `odd`, `settle` and `settle_fresh`: `$1` month key, `$2`..`$3` the batch's ids (from the
/// remaining range's start to the page's last id, or from the page's last id to the range's end),
/// `$4`/`$5` shard count and index, `$6`..`$8` the fine rule, `$9`..`$11` the journal's kind, rule
/// identity and attempt. `odd` settles the range's [`ODD_ROW`]s, `settle` every row left, each
/// writing the journal entries of what it settled in the same statement ([`journal`]) and
/// returning how many it settled and their cents. `settle_fresh` is `settle` for a page of loans
/// the journal never knew (what almost every page of a month's first run is): each one's entry is
/// its first (seq 1, before 0) and its head is written by the statement itself, a plain insert,
/// with no probe of `fine_heads` per loan; a loan known meanwhile stops it at the heads' primary
/// key, under a savepoint, and the batch settles the page with `settle` instead. `settle` (a page with a loan the journal knows:
/// a loan re-created, reloaded or unsettled by hand) probes each loan's head, continues it when
/// the loan's money was in this month for its member, and otherwise takes that money out of where
/// it was in the same statement; the heads trigger on the journal keeps its heads.
#[derive(Debug)]
pub struct BatchSql {
    pub page: String,
    pub odd: String,
    pub settle: String,
    pub settle_fresh: String,
}

impl BatchSql {
    pub fn of(walk: Walk) -> &'static BatchSql {
        static UP: OnceLock<BatchSql> = OnceLock::new();
        static DOWN: OnceLock<BatchSql> = OnceLock::new();
        match walk {
            Walk::Up => UP.get_or_init(|| BatchSql::new("", "max")),
            Walk::Down => DOWN.get_or_init(|| BatchSql::new(" DESC", "min")),
        }
    }

    fn new(order: &str, last: &str) -> BatchSql {
        let page = format!(
            "/* settle.page */ WITH page AS MATERIALIZED (
                 SELECT id::bigint AS id FROM loans
                  WHERE {MONTH_KEY} = $1 AND fine_settled_at IS NULL AND returned_on IS NOT NULL
                    AND id + 0 BETWEEN $2 AND $3 AND ($4 = 1 OR (id % $4 + $4) % $4 = $5)
                  ORDER BY id + 0{order}
                  LIMIT $6
             )
             SELECT count(*), {last}(id)::bigint,
                    EXISTS (SELECT 1 FROM fine_heads h
                             WHERE h.loan_id = ANY (ARRAY(SELECT id FROM page)))
               FROM page"
        );
        let range = "date_trunc('month', l.returned_on::timestamp) = $1
                AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                AND l.id + 0 BETWEEN $2 AND $3
                AND ($4 = 1 OR (l.id % $4 + $4) % $4 = $5)";
        let fine = FineRule::sql_params(6);
        let seq = journal::walk_seq();
        let head = journal::HEAD_ROW;
        let settled = format!(
            "RETURNING l.id::bigint AS id, l.member_id::bigint AS member_id, l.due_on,
                       l.returned_on, l.fine_cents::bigint AS after, l.fine_seq AS seq,
                       {head} AS head"
        );
        // One pass over the range finds the rare rows that need more than the plain update: held
        // ones (named, left alone) and odd ones (settled here, so that they are counted by what
        // was really written). The odd ones are updated where that pass found them, by their
        // rows' addresses (a Tid Scan), every condition checked again on the row as it is then
        // (written so that no index can serve it instead); `settle` updates the rest.
        let odd = format!(
            "/* settle.odd */ WITH flagged AS MATERIALIZED (
                 SELECT l.id, l.ctid, {HELD_ROW} AS held FROM loans l
                  WHERE {range} AND ({HELD_ROW} OR {ODD_ROW})
             ), odd AS (
                 UPDATE loans l
                    SET fine_cents = {fine}, fine_settled_at = now(), fine_seq = {seq}
                  WHERE l.ctid = ANY (ARRAY(SELECT ctid FROM flagged WHERE NOT held))
                    AND l.returned_on >= $1::date
                    AND l.returned_on < ($1 + interval '1 month')::date
                    AND l.fine_settled_at IS NULL
                    AND ($4 = 1 OR (l.id % $4 + $4) % $4 = $5)
                    AND NOT {HELD_ROW} AND {ODD_ROW}
                 {settled}
             ), {entries}
             SELECT (SELECT count(*) FROM odd), (SELECT {CENTS} FROM odd),
                    (SELECT count(*) FROM flagged WHERE held),
                    ARRAY(SELECT id::bigint FROM flagged WHERE held ORDER BY id LIMIT {HELD_IDS})",
            entries = journal::walked_entries("odd_", "odd"),
        );
        let settle = format!(
            "/* settle.batch */ WITH settled AS (
                 UPDATE loans l
                    SET fine_cents = {fine}, fine_settled_at = now(), fine_seq = {seq}
                  WHERE {range}
                    AND NOT {HELD_ROW}
                 {settled}
             ), {entries}
             SELECT count(*), {CENTS} FROM settled",
            entries = journal::walked_entries("", "settled"),
        );
        let at_least = if crate::mutant::planted(crate::mutant::Mutant::SkipJournal) {
            2
        } else {
            1
        };
        let settle_fresh = format!(
            "/* settle.batch */ WITH settled AS (
                 UPDATE loans l
                    SET fine_cents = {fine}, fine_settled_at = now(), fine_seq = 1
                  WHERE {range}
                    AND NOT {HELD_ROW}
                 RETURNING l.id::bigint AS id, l.member_id::bigint AS member_id, l.due_on,
                           l.returned_on, l.fine_cents::bigint AS after
             ), journal AS (
                 INSERT INTO fine_journal (month, kind, rule, shards, attempt, loan_ids, seqs,
                                           due_on, returned_on, before_cents, after_cents,
                                           member_ids, heads_kept)
                 SELECT $1::date, $9::text, $10::jsonb, $4::int, $11::int, array_agg(id),
                        array_agg(1), array_agg(due_on), array_agg(returned_on),
                        array_agg(0::bigint), array_agg(after), array_agg(member_id), true
                   FROM settled
                 HAVING count(*) >= {at_least}
                 RETURNING id
             ), heads AS (
                 INSERT INTO fine_heads (loan_id, journal_id, seq, month, kind, before_cents,
                                         after_cents, member_id, entries)
                 SELECT s.id, j.id, 1, $1::date, $9::text, 0, s.after, s.member_id, 1
                   FROM settled s, journal j
             )
             SELECT count(*), {CENTS} FROM settled"
        );
        #[cfg(feature = "bench-unjournaled")]
        let (settle, settle_fresh) = (unjournaled(&settle), unjournaled(&settle_fresh));
        BatchSql {
            page,
            odd,
            settle,
            settle_fresh,
        }
    }
}

/// The fine cents a batch statement wrote (`after` of what it settled), for
/// `settlementd_fine_cents_settled_total`: a counter saturates at `i64::MAX` rather than failing
/// the batch whose fines sum beyond it.
const CENTS: &str = "least(coalesce(sum(after), 0), 9223372036854775807)::bigint";

/// The bench's baseline build (`--features bench-unjournaled`, never a release build): the settle
/// statement as it was before the journal — the same update, no entry written — so that
/// `cargo bench --bench settle` measures what the journal costs a run in one run. The binary
/// refuses to start without `SETTLEMENTD_BENCH_UNJOURNALED=1` (src/main.rs).
#[cfg(feature = "bench-unjournaled")]
fn unjournaled(settle: &str) -> String {
    let update = settle
        .split_once("WITH settled AS (")
        .and_then(|(_, rest)| rest.split_once("RETURNING"))
        .map(|(update, _)| update)
        .unwrap_or(settle);
    format!(
        "WITH settled AS ({update} RETURNING l.fine_cents::bigint AS after)
         SELECT count(*), {CENTS} FROM settled"
    )
}

/// One month's unsettled returns of one shard: `late` the rule can price, `held` it cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unsettled {
    /// The month's first day at midnight (its key in `loans_unsettled_by_month`).
    pub month: NaiveDateTime,
    pub late: u64,
    pub held: u64,
}

/// The unsettled returns of shard `shard` of `shards` in each of `months` (first days at
/// midnight) that has any; a month with none is one index probe that finds nothing. Meant for
/// months whose shard is done, where what is left is few rows (late returns and held ones): it
/// reads each entry's row to tell the two apart. Run it inside a transaction opened with
/// [`begin_batch_sql`], so that only the month index can serve it.
pub async fn unsettled_by_month(
    db: &mut PgConnection,
    months: &[NaiveDateTime],
    shards: i64,
    shard: i64,
) -> sqlx::Result<Vec<Unsettled>> {
    let rows: Vec<(NaiveDateTime, i64, i64)> = sqlx::query_as(&format!(
        "SELECT m.month, count(*) FILTER (WHERE NOT u.held), count(*) FILTER (WHERE u.held)
           FROM unnest($1::timestamp[]) AS m(month)
           JOIN LATERAL (
                SELECT {HELD_ROW} AS held FROM loans l
                 WHERE {MONTH_KEY_L} = m.month
                   AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                   AND ($2 = 1 OR (l.id % $2 + $2) % $2 = $3)
           ) u ON true
          GROUP BY m.month
          ORDER BY m.month"
    ))
    .bind(months)
    .bind(shards)
    .bind(shard)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(month, late, held)| Unsettled {
            month,
            late: late as u64,
            held: held as u64,
        })
        .collect())
}

/// [`unsettled_by_month`] for every shard of `shards` at once: `(month, shard, late, held)` for
/// each month and shard that has unsettled returns.
pub async fn unsettled_by_month_and_shard(
    db: &mut PgConnection,
    months: &[NaiveDateTime],
    shards: i64,
) -> sqlx::Result<Vec<(NaiveDateTime, i64, i64, i64)>> {
    sqlx::query_as(&format!(
        "SELECT m.month, u.shard, count(*) FILTER (WHERE NOT u.held), count(*) FILTER (WHERE u.held)
           FROM unnest($1::timestamp[]) AS m(month)
           JOIN LATERAL (
                SELECT {HELD_ROW} AS held, (l.id % $2 + $2) % $2 AS shard FROM loans l
                 WHERE {MONTH_KEY_L} = m.month
                   AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
           ) u ON true
          GROUP BY 1, 2
          ORDER BY 1, 2"
    ))
    .bind(months)
    .bind(shards)
    .fetch_all(db)
    .await
}

/// Unsettled returns the rule can price in months before `month` (a month's first day at
/// midnight), every shard: what a lookback that ends at `month` leaves behind. Run it inside a
/// transaction opened with [`begin_batch_sql`]: a range of the month index.
pub async fn unsettled_before(db: &mut PgConnection, month: NaiveDateTime) -> sqlx::Result<u64> {
    let n: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM loans l
          WHERE {MONTH_KEY_L} < $1 AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
            AND isfinite(l.returned_on) AND NOT {HELD_ROW}"
    ))
    .bind(month)
    .fetch_one(db)
    .await?;
    Ok(n as u64)
}

/// Plan settings that leave the month index as the only way to read a month's unsettled loans
/// (local: for the rest of the transaction, or until the savepoint they were set in is rolled
/// back), for reads outside a batch transaction. One statement.
pub const PIN_MONTH_INDEX: &str = "SELECT set_config('enable_seqscan', 'off', true),
           set_config('enable_bitmapscan', 'off', true), set_config('jit', 'off', true)";

/// [`MONTH_KEY`] on the alias `l`.
const MONTH_KEY_L: &str = "date_trunc('month', l.returned_on::timestamp)";

/// What a month looks like after settlement, to compare runs byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MonthTotals {
    pub settled_rows: i64,
    /// Summed as `numeric`: a month's fines may exceed a bigint (each is capped at up to 2⁶³ − 1).
    pub fine_cents_sum: i128,
    /// md5 of `id:fine_cents` for every settled row of the month, in id order.
    pub digest: String,
}

/// The SQL of [`MonthTotals`] over the rows of `FROM loans … WHERE`: count, sum (as text: a
/// `numeric`) and digest of the settled ones.
pub const TOTALS_SQL: &str = "count(*) FILTER (WHERE fine_settled_at IS NOT NULL),
       COALESCE(sum(fine_cents) FILTER (WHERE fine_settled_at IS NOT NULL), 0)::text,
       md5(COALESCE(string_agg(id::text || ':' || fine_cents::text, ',' ORDER BY id)
                      FILTER (WHERE fine_settled_at IS NOT NULL), ''))";

pub async fn month_totals(
    db: impl PgExecutor<'_>,
    business_date: BusinessDate,
) -> sqlx::Result<MonthTotals> {
    let (settled_rows, sum, digest): (i64, String, String) = sqlx::query_as(&format!(
        "SELECT {TOTALS_SQL} FROM loans
          WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NOT NULL"
    ))
    .bind(business_date.first_day())
    .bind(business_date.date())
    .fetch_one(db)
    .await?;
    Ok(MonthTotals {
        settled_rows,
        fine_cents_sum: parse_sum(&sum)?,
        digest,
    })
}
