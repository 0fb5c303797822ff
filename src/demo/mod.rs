//! `settlementd demo`: the seed chapter's experiment in one command, on a private temporary
//! PostgreSQL that is stopped and removed afterwards (also on Ctrl-C and on error).
//!
//! The story, printed so a person can follow it:
//! 1. the job layer — two owners claim one key: `first acquire=1`, `second acquire=0`;
//! 2. the seed's trap — `fine_cents = 0` as the "not settled" marker, run twice inside a transaction
//!    that is rolled back: the second run settles every zero-fine loan again;
//! 3. the real thing — three replicas (shards 0..2 of 3) at once, then two duplicates of every shard,
//!    then a forced re-run, with the month's settled digest after each round: identical every time;
//!    then two returns keyed into the closed month, settled by the next run of their shards under
//!    the month's pinned rule, and a replica on a stale fine rule, refused (exit 3);
//! 4. the second job, member statements: each member's fines of the month, computed after the
//!    settlement closed it and changed for the one member a late return concerns; a return date
//!    libraryd corrects after settlement, re-priced by the next run; the money journal that
//!    records every cent, and `verify` proving the month from it.
//!
//! Everything but the `ms` column is reproducible: the month, the seed and the data are fixed.

pub mod zero_fine_marker;

use crate::app::{self, AppError, Result};
use crate::calendar::BusinessDate;
use crate::config::{Settings, ShardSpec};
use crate::db;
use crate::embedded_pg::{EmbeddedOptions, EmbeddedPg};
use crate::fine::FineSchedule;
use crate::job_layer::{
    self, claim, ClaimOutcome, JobError, JobKey, Owner, ProveError, Report, RunReport, SkipReason,
};
use crate::jobs::fine_settlement::{self, FineSettlement, MonthTotals};
use crate::jobs::member_statements::MemberStatements;
use crate::seed::{self, SeedSpec};
use sqlx::PgPool;
use std::io::Write;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// The month the demo settles (business date 2026-10-31).
pub const MONTH: &str = "2026-10";
/// Loans seeded, as in the seed chapter.
pub const LOANS: u64 = 6000;
/// The generator's seed: fixed, so the output is the same on every machine.
pub const SEED: u64 = 42;
/// Replicas in the demo's deployment.
pub const SHARDS: u32 = 3;
/// The claim demonstration uses its own job name so it never touches the settlement's claims.
const CLAIM_DEMO_JOB: &str = "demo-claim";

/// Runs the demo on stdout until done or until SIGINT/SIGTERM.
pub async fn run(settings: Settings) -> Result<()> {
    let shutdown = app::shutdown_on_signals();
    run_until(&settings, &mut std::io::stdout(), shutdown).await
}

/// Runs the demo, writing the story to `out`. Cancelling `shutdown` stops it, stops the cluster and
/// returns `AppError::Failed("interrupted")`.
pub async fn run_until(
    settings: &Settings,
    out: &mut (dyn Write + Send),
    shutdown: CancellationToken,
) -> Result<()> {
    let started = Instant::now();
    // Blocking (initdb, then waiting for the server): off the async workers. A signal during start-up
    // is noticed right after it.
    let pg = tokio::task::spawn_blocking(|| EmbeddedPg::start(EmbeddedOptions::default()))
        .await
        .map_err(|e| AppError::Failed(format!("embedded PostgreSQL: {e}")))??;
    let outcome = if shutdown.is_cancelled() {
        Err(interrupted())
    } else {
        tokio::select! {
            result = story(settings, &pg, out, &shutdown) => result,
            _ = shutdown.cancelled() => Err(interrupted()),
        }
    };
    // The story's pool is gone here (closed, or dropped with the cancelled future).
    tokio::task::spawn_blocking(move || pg.stop())
        .await
        .map_err(|e| AppError::Failed(format!("stopping embedded PostgreSQL: {e}")))?;
    outcome?;
    say(
        out,
        format_args!(
            "\ndemo finished in {:.1} s; the temporary cluster is stopped and its directory removed.",
            started.elapsed().as_secs_f64()
        ),
    )
}

fn interrupted() -> AppError {
    AppError::Failed("interrupted".into())
}

fn say(out: &mut (dyn Write + Send), line: std::fmt::Arguments<'_>) -> Result<()> {
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| AppError::Failed(format!("cannot write the demo's output: {e}")))
}

macro_rules! say {
    ($out:expr, $($arg:tt)*) => { say($out, format_args!($($arg)*))? };
}

async fn story(
    settings: &Settings,
    pg: &EmbeddedPg,
    out: &mut (dyn Write + Send),
    shutdown: &CancellationToken,
) -> Result<()> {
    let month = BusinessDate::from_month(MONTH)?;
    let mut database = settings.database.clone();
    // Round 2 runs six replicas at once, each with a batch transaction and a heartbeat.
    database.max_connections = database.max_connections.max(16);
    let pool = db::connect(
        &pg.url("postgres"),
        &database,
        settings.lease.guards(),
        crate::app::heartbeat(settings),
    )
    .await?;
    let result = chapters(settings, &pool, pg.version(), month, out, shutdown).await;
    db::close(&pool).await;
    result
}

async fn chapters(
    settings: &Settings,
    pool: &PgPool,
    pg_version: &str,
    month: BusinessDate,
    out: &mut (dyn Write + Send),
    shutdown: &CancellationToken,
) -> Result<()> {
    db::migrate(pool).await?;
    let seeded = seed::seed_loans(pool, &SeedSpec::new(LOANS, month, SEED), |_| {}).await?;
    say!(
        out,
        "settlementd demo on a private PostgreSQL {pg_version} (temporary data directory, Unix \
         socket only)"
    );
    say!(
        out,
        "seeded {} loans for {MONTH} (seed {SEED}): {} returned in the month, {} of them on time \
         (fine 0), {} still out",
        seeded.loans,
        seeded.returned,
        seeded.on_time,
        seeded.loans - seeded.returned
    );

    say!(out, "\n== 1. The job layer: one key, two claimers ==");
    say!(
        out,
        "A run owns the row (job, business date, shard count, shard) in job_runs, inserted with\n\
         INSERT ... ON CONFLICT DO NOTHING. Two owners claim the same key:"
    );
    claim_twice(settings, pool, month, out).await?;

    say!(
        out,
        "\n== 2. The seed's trap: fine_cents = 0 as the \"not settled\" marker =="
    );
    say!(
        out,
        "UPDATE loans SET fine_cents = <fine> WHERE returned_on in {MONTH} AND fine_cents = 0,\n\
         run twice in a transaction that is then rolled back:"
    );
    let (first, second) = naive_marker_twice(settings, pool, month).await?;
    say!(out, "naive marker first={first} second={second}");
    say!(
        out,
        "The second run settled {second} loans again: a zero fine is a result, not a marker.\n\
         With \"fine_cents = fine_cents + <fine>\" they would have been billed twice."
    );

    say!(
        out,
        "\n== 3. The real thing: fine_settled_at is the marker, every write is fenced =="
    );
    say!(
        out,
        "Each batch: UPDATE ... WHERE id IN (batch) AND fine_settled_at IS NULL, committed with\n\
         job_runs progress WHERE attempt = <this run's attempt>."
    );
    let job = app::settlement_job(settings);
    let all: Vec<u32> = (0..SHARDS).collect();
    let twice: Vec<u32> = all.iter().flat_map(|&s| [s, s]).collect();

    say!(
        out,
        "\nround 1: three replicas at once (shards 0, 1, 2 of {SHARDS})"
    );
    let round1 = round(settings, pool, &job, month, &all, false, shutdown).await?;
    print_table(out, &round1)?;
    let totals1 = fine_settlement::month_totals(pool, month).await?;
    print_totals(out, month, &totals1, None)?;

    say!(
        out,
        "\nround 2: every replica twice more, at once ({} runs): the claims are SUCCESS",
        twice.len()
    );
    let round2 = round(settings, pool, &job, month, &twice, false, shutdown).await?;
    print_table(out, &round2)?;
    let totals2 = fine_settlement::month_totals(pool, month).await?;
    print_totals(out, month, &totals2, Some(&totals1))?;

    say!(
        out,
        "\nround 3: a forced re-run of every shard (run --force): new attempts, nothing left to do"
    );
    let round3 = round(settings, pool, &job, month, &all, true, shutdown).await?;
    print_table(out, &round3)?;
    let totals3 = fine_settlement::month_totals(pool, month).await?;
    print_totals(out, month, &totals3, Some(&totals1))?;

    let updated_first: u64 = round1.iter().map(|r| r.updated).sum();
    let updated_forced: u64 = round3.iter().map(|r| r.updated).sum();
    say!(
        out,
        "\nforced rerun first={updated_first} second={updated_forced} totalFirst={} totalSecond={}",
        totals1.fine_cents_sum,
        totals3.fine_cents_sum
    );
    if updated_forced != 0 || totals1 != totals2 || totals1 != totals3 {
        return Err(AppError::Failed(
            "the re-runs changed the month: settlement is not idempotent".into(),
        ));
    }
    late_returns_and_a_stale_rule(settings, pool, &job, month, out, shutdown).await?;
    statements_and_the_journal(settings, pool, &job, month, out, shutdown).await
}

/// Rounds 4 and 5: what "settled" guarantees besides "ran once" — returns keyed into a closed month
/// are settled by the next run of their shard, and a replica whose fine rule is not the month's
/// pinned one settles nothing.
async fn late_returns_and_a_stale_rule(
    settings: &Settings,
    pool: &PgPool,
    job: &FineSettlement,
    month: BusinessDate,
    out: &mut (dyn Write + Send),
    shutdown: &CancellationToken,
) -> Result<()> {
    let all: Vec<u32> = (0..SHARDS).collect();
    say!(
        out,
        "\nround 4: two returns keyed into {MONTH} after it closed (a drop box emptied late); the next\n\
         run of their shards settles them under the month's pinned rule instead of skipping"
    );
    let late_ids = [LOANS as i64 + 1, LOANS as i64 + 2];
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT id, 1, 1, $1::date - 20, $1::date - 6, $1::date FROM unnest($2::bigint[]) id",
    )
    .bind(month.date())
    .bind(&late_ids[..])
    .execute(pool)
    .await?;
    let round4 = round(settings, pool, job, month, &all, false, shutdown).await?;
    print_table(out, &round4)?;
    let totals4 = fine_settlement::month_totals(pool, month).await?;
    print_totals(out, month, &totals4, None)?;
    let settled_late: u64 = round4.iter().map(|r| r.late).sum();
    let left = unsettled(pool, month).await?;
    say!(
        out,
        "late returns keyed={} settled={settled_late} left={left}",
        late_ids.len()
    );

    let rule = fine_settlement::rule_of(&settings.fine, month.date()).map_err(AppError::Invalid)?;
    let mut stale = rule.rule;
    stale.daily_rate_cents += 49;
    say!(
        out,
        "\nround 5: a replica on a stale configuration ({} cents a day) asks for shard 0 of the month",
        stale.daily_rate_cents
    );
    let stale_job = FineSettlement {
        rules: FineSchedule::single(stale),
        ..job.clone()
    };
    let key = fine_settlement::key(month, ShardSpec::new(0, SHARDS)?);
    let opts = app::run_options(settings, false, false);
    let refused = job_layer::run_once(pool, &stale_job, key, &opts, shutdown, &|_| {}).await;
    let exit = match refused {
        Err(e @ JobError::ParamsConflict { .. }) => {
            say!(out, "  refused: {e}");
            3
        }
        other => {
            return Err(AppError::Failed(format!(
                "a replica with another rule was not refused: {other:?}"
            )))
        }
    };
    let totals5 = fine_settlement::month_totals(pool, month).await?;
    print_totals(out, month, &totals5, None)?;
    say!(
        out,
        "rule conflict exit={exit} unchanged={} (the month stays under the rule its first claim pinned)",
        totals5 == totals4
    );
    if settled_late != late_ids.len() as u64 || left != 0 || totals5 != totals4 {
        return Err(AppError::Failed(
            "late returns were left, or a stale rule changed the month".into(),
        ));
    }
    Ok(())
}

/// Round 6: the second job. Member statements of the month, computed after the settlement closed
/// it; a late return for one member, and that member's statement alone changes; a return date
/// libraryd corrects after settlement, re-priced by the next run; the journal's entries by kind,
/// and `verify` proving the month from them.
async fn statements_and_the_journal(
    settings: &Settings,
    pool: &PgPool,
    job: &FineSettlement,
    month: BusinessDate,
    out: &mut (dyn Write + Send),
    shutdown: &CancellationToken,
) -> Result<()> {
    let statements = MemberStatements {
        batch_size: settings.batch.size,
    };
    let all: Vec<u32> = (0..SHARDS).collect();
    say!(
        out,
        "\nround 6: the second job, member statements (it follows the settlement: a month runs once\n\
         the settlement has closed it), then a late return for member {MEMBER}"
    );
    statements_round(settings, pool, &statements, month, &all, shutdown).await?;
    let (members, cents) = statement_totals(pool, month).await?;
    let before = member_statement(pool, month, MEMBER).await?;
    say!(
        out,
        "  statements of {MONTH}: members={members} fine_cents_sum={cents}; member {MEMBER}: {}",
        before.as_ref().map_or("no fine".into(), |(f, c)| format!(
            "fines={f} fine_cents={c}"
        ))
    );
    let late_id = LOANS as i64 + 3;
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES ($1, $2, 1, $3::date - 30, $3::date - 10, $3::date)",
    )
    .bind(late_id)
    .bind(MEMBER)
    .bind(month.date())
    .execute(pool)
    .await?;
    round(settings, pool, job, month, &all, false, shutdown).await?;
    let stamps = computed_at(pool, month).await?;
    let rerun = statements_round(settings, pool, &statements, month, &all, shutdown).await?;
    let after = member_statement(pool, month, MEMBER).await?;
    let changed = computed_at(pool, month)
        .await?
        .iter()
        .filter(|(m, at)| stamps.iter().any(|(m2, at2)| m == m2 && at != at2))
        .count();
    say!(
        out,
        "  a late return for member {MEMBER} settled; statements re-opened for {} shard(s): member \
         {MEMBER}: {}; other statements rewritten={changed}",
        rerun.iter().filter(|r| r.late > 0).count(),
        after.as_ref().map_or("no fine".into(), |(f, c)| format!("fines={f} fine_cents={c}"))
    );

    say!(
        out,
        "\nround 7: libraryd corrects the return date of a settled loan (3 days later); the next run\n\
         of its shard re-prices it under the month's pinned rule, on the record"
    );
    let edited: i64 = sqlx::query_scalar(
        "UPDATE loans SET returned_on = returned_on + 3
          WHERE id = (SELECT id FROM loans
                       WHERE returned_on BETWEEN $1 AND $2 - 3 AND fine_settled_at IS NOT NULL
                         AND due_on < returned_on
                       ORDER BY id LIMIT 1)
         RETURNING id",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(pool)
    .await?;
    round(settings, pool, job, month, &all, false, shutdown).await?;
    let (kinds, before_cents, after_cents): (Vec<String>, Vec<i64>, Vec<i64>) = sqlx::query_as(
        "SELECT array_agg(kind ORDER BY seq), array_agg(COALESCE(before_cents, 0) ORDER BY seq),
                array_agg(after_cents ORDER BY seq)
           FROM fine_journal_entries WHERE loan_id = $1",
    )
    .bind(edited)
    .fetch_one(pool)
    .await?;
    say!(
        out,
        "  loan {edited}: journal {} (cents {} -> {} -> {})",
        kinds.join(", "),
        before_cents.first().copied().unwrap_or_default(),
        after_cents.first().copied().unwrap_or_default(),
        after_cents.last().copied().unwrap_or_default()
    );
    let by_kind: Vec<(String, i64)> = sqlx::query_as(
        "SELECT kind, count(*) FROM fine_journal_entries WHERE month = $1 GROUP BY kind ORDER BY kind",
    )
    .bind(month.first_day())
    .fetch_all(pool)
    .await?;
    say!(
        out,
        "  journal of {MONTH}: {}",
        by_kind
            .iter()
            .map(|(k, n)| format!("{k}={n}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut conn = pool.acquire().await?;
    let proved = fine_settlement::verify::verify(&mut conn, None, month, &settings.fine)
        .await
        .map_err(|e| match e {
            ProveError::Cannot(why) => AppError::Invalid(why),
            ProveError::Db(e) => AppError::from(e),
        })?;
    say!(
        out,
        "verify {MONTH}: {} (every settled fine is its journal entry's and the pinned rule's)",
        if proved.is_right() {
            "right"
        } else {
            "NOT RIGHT"
        }
    );
    if !proved.is_right() || after == before {
        return Err(AppError::Failed(format!(
            "the month is not right, or the late return left the member's statement as it was: {:?}",
            proved.problems()
        )));
    }
    Ok(())
}

/// The member whose statement round 6 follows.
const MEMBER: i64 = 7;

/// Runs the member statements of `month` for `shards` (of [`SHARDS`]) concurrently.
async fn statements_round(
    settings: &Settings,
    pool: &PgPool,
    statements: &MemberStatements,
    month: BusinessDate,
    shards: &[u32],
    shutdown: &CancellationToken,
) -> Result<Vec<RunReport>> {
    let mut reports = Vec::new();
    for &shard in shards {
        let key = JobKey {
            job_name: crate::jobs::member_statements::JOB_NAME.into(),
            business_date: month.date(),
            shards: SHARDS,
            shard,
        };
        let opts = app::run_options(settings, false, false);
        reports.push(job_layer::run_once(pool, statements, key, &opts, shutdown, &|_| {}).await?);
    }
    Ok(reports)
}

/// Members with a statement of `month`, and their fines' sum.
async fn statement_totals(pool: &PgPool, month: BusinessDate) -> Result<(i64, String)> {
    Ok(sqlx::query_as(
        "SELECT count(*), COALESCE(sum(fine_cents), 0)::text FROM member_fine_statements
          WHERE business_date = $1",
    )
    .bind(month.date())
    .fetch_one(pool)
    .await?)
}

/// One member's statement of `month`: (fines, cents).
async fn member_statement(
    pool: &PgPool,
    month: BusinessDate,
    member: i64,
) -> Result<Option<(i64, String)>> {
    Ok(sqlx::query_as(
        "SELECT fines, fine_cents::text FROM member_fine_statements
          WHERE business_date = $1 AND member_id = $2",
    )
    .bind(month.date())
    .bind(member)
    .fetch_optional(pool)
    .await?)
}

/// When each statement of `month` was written.
async fn computed_at(
    pool: &PgPool,
    month: BusinessDate,
) -> Result<Vec<(i64, chrono::DateTime<chrono::Utc>)>> {
    Ok(sqlx::query_as(
        "SELECT member_id, computed_at FROM member_fine_statements WHERE business_date = $1",
    )
    .bind(month.date())
    .fetch_all(pool)
    .await?)
}

/// Returns of `month` not settled.
async fn unsettled(pool: &PgPool, month: BusinessDate) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM loans
          WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NULL",
    )
    .bind(month.first_day())
    .bind(month.date())
    .fetch_one(pool)
    .await?)
}

/// Two owners claim one key on the job layer; the winner then marks it SUCCESS.
async fn claim_twice(
    settings: &Settings,
    pool: &PgPool,
    month: BusinessDate,
    out: &mut (dyn Write + Send),
) -> Result<()> {
    let key = JobKey {
        job_name: CLAIM_DEMO_JOB.into(),
        business_date: month.date(),
        shards: 1,
        shard: 0,
    };
    let ttl = Duration::from_secs(settings.lease.ttl_secs);
    let mut conn = pool.acquire().await?;
    let first = claim::claim(&mut conn, &key, &Owner::for_process(), ttl, false).await?;
    let second = claim::claim(&mut conn, &key, &Owner::for_process(), ttl, false).await?;
    let acquired = |o: &ClaimOutcome| u8::from(matches!(o, ClaimOutcome::Won(_)));
    say!(out, "first acquire={}", acquired(&first));
    say!(out, "second acquire={}", acquired(&second));
    if let ClaimOutcome::Won(won) = &first {
        say!(
            out,
            "The loser skips: the row is RUNNING with a live heartbeat (attempt {}).",
            won.attempt
        );
        // Release the demo key the normal way: a fenced SUCCESS, which also blocks re-runs.
        claim::mark_success(&mut conn, won, &[]).await?;
        let third = claim::claim(&mut conn, &key, &Owner::for_process(), ttl, false).await?;
        say!(
            out,
            "After the winner marks SUCCESS, a third claim also gets acquire={}: a done month \
             stays done.",
            acquired(&third)
        );
    }
    Ok(())
}

/// The seed's broken settlement, twice, on data that is rolled back afterwards so the real
/// settlement starts from unsettled loans. Returns the rows each run processed.
async fn naive_marker_twice(
    settings: &Settings,
    pool: &PgPool,
    month: BusinessDate,
) -> Result<(u64, u64)> {
    let rule = fine_settlement::rule_of(&settings.fine, month.date())
        .map_err(AppError::Invalid)?
        .rule;
    let mut tx = pool.begin().await?;
    let first = zero_fine_marker::settle_with_zero_fine_marker(&mut *tx, month, rule).await?;
    let second = zero_fine_marker::settle_with_zero_fine_marker(&mut *tx, month, rule).await?;
    tx.rollback().await?;
    Ok((first, second))
}

/// Runs one replica per entry of `shards` (of [`SHARDS`]) concurrently, each with its own owner,
/// and returns their reports by shard.
async fn round(
    settings: &Settings,
    pool: &PgPool,
    job: &FineSettlement,
    month: BusinessDate,
    shards: &[u32],
    force: bool,
    shutdown: &CancellationToken,
) -> Result<Vec<RunReport>> {
    let mut replicas = tokio::task::JoinSet::new();
    for &shard in shards {
        let key = fine_settlement::key(month, ShardSpec::new(shard, SHARDS)?);
        let opts = app::run_options(settings, force, false);
        let (pool, job, shutdown) = (pool.clone(), job.clone(), shutdown.clone());
        replicas.spawn(async move {
            job_layer::run_once(&pool, &job, key, &opts, &shutdown, &|_| {}).await
        });
    }
    let mut reports = Vec::with_capacity(shards.len());
    while let Some(joined) = replicas.join_next().await {
        let report = joined.map_err(|e| AppError::Failed(format!("replica task: {e}")))??;
        reports.push(report);
    }
    // By shard, workers before skippers: stable output whatever order they finished in.
    reports.sort_by_key(|r| (r.key.shard, r.skipped.is_some()));
    Ok(reports)
}

fn print_table(out: &mut (dyn Write + Send), reports: &[RunReport]) -> Result<()> {
    say!(
        out,
        "  {:<6} {:>8} {:>8}  {:<16} {:>7} {:>6}",
        "shard",
        "scanned",
        "updated",
        "skipped",
        "attempt",
        "ms"
    );
    for r in reports {
        let skipped = match r.skipped {
            None => "no",
            Some(SkipReason::AlreadyDone) => "already SUCCESS",
            Some(SkipReason::Held) => "held by a peer",
            Some(SkipReason::RequestServed) => "request served",
        };
        let attempt = r
            .attempt
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into());
        say!(
            out,
            "  {:<6} {:>8} {:>8}  {:<16} {:>7} {:>6}",
            format!("{}/{}", r.key.shard, r.key.shards),
            r.scanned,
            r.updated,
            skipped,
            attempt,
            r.elapsed.as_millis()
        );
    }
    Ok(())
}

fn print_totals(
    out: &mut (dyn Write + Send),
    month: BusinessDate,
    totals: &MonthTotals,
    compared_to: Option<&MonthTotals>,
) -> Result<()> {
    let verdict = match compared_to {
        None => "",
        Some(first) if first == totals => "  (identical to round 1)",
        Some(_) => "  (CHANGED since round 1!)",
    };
    say!(
        out,
        "  settled {}: rows={} fine_cents_sum={} digest={}{verdict}",
        month.first_day().format("%Y-%m"),
        totals.settled_rows,
        totals.fine_cents_sum,
        totals.digest
    );
    Ok(())
}
