//! Issue 28 with real `settlementd` processes and replicas ticked one at a time: the data decides
//! what is due (a month its peers claimed, a month resharded, a late return beyond the lookback),
//! libraryd's edits of settled loans follow the money (re-priced, reversed, deleted), corrections
//! are keyed and hold their month until they finish, and every cent is on the record
//! (`fine_journal`, `verify`, opening entries).
//!
//! Each test's doc comment says what the code before issue 28 (commit 4b79e14) did instead.
//! [`assert_journal_whole`] is the journal's invariant, for any suite to check after its history.

use crate::helpers::*;
use chrono::NaiveDate;
use settlementd::calendar::BusinessDate;
use settlementd::clock::ManualClock;
use settlementd::config::Settings;
use settlementd::daemon::replica::{Replica, TickOutcome};
use settlementd::fine::FineRule;
use settlementd::job_layer::due::{self, Due, Why};
use settlementd::job_layer::{Job, Pending};
use settlementd::jobs::fine_settlement;
use sqlx::{Connection, PgPool};
use std::process::{Output, Stdio};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) const RATE: &str = "SETTLEMENTD__FINE__DAILY_RATE_CENTS";

/// The journal's invariant over the whole database, every violation named:
/// - each loan's entries are numbered 1..n, without gaps or repeats, an opening entry only first;
/// - each entry's `before_cents` is the previous entry's `after_cents`; a first entry's is 0 (the
///   loan was unsettled), or NULL for an opening entry (unknown);
/// - a settled loan has entries, its `fine_seq` is its last entry's seq and its `fine_cents` that
///   entry's `after_cents`, which prices (is not a reversal or a deletion);
/// - an unsettled loan with entries was reversed: its last entry is `reversed`, to 0, fine 0;
///   one without entries has no `fine_seq`;
/// - a loan gone from `loans` ends with its `deleted` entry, to 0, unless its deletion still waits
///   in `loan_changes` for its month's next run (libraryd deleted it since);
/// - each loan's head (`fine_heads`) is its last entry, counts its entries and records no break.
pub(crate) async fn assert_journal_whole(pool: &PgPool) {
    let broken = journal_breaks(pool).await;
    assert!(
        broken.is_empty(),
        "the journal is not whole:\n{}",
        broken.join("\n")
    );
}

/// What breaks [`assert_journal_whole`]'s invariant: one line per kind of break, naming up to ten
/// loans.
pub(crate) async fn journal_breaks(pool: &PgPool) -> Vec<String> {
    let checks = [
        (
            "seqs are not 1..n",
            "SELECT format('loan %s: seqs %s', loan_id, array_agg(seq ORDER BY seq))
               FROM fine_journal_entries GROUP BY loan_id
             HAVING min(seq) <> 1 OR max(seq) <> count(*) OR count(DISTINCT seq) <> count(*)
                 OR bool_or(kind = 'opening' AND seq <> 1)",
        ),
        (
            "an entry's before is not the previous entry's after",
            "SELECT format('loan %s seq %s (%s): before %s, previous after %s', loan_id, seq, kind,
                           COALESCE(before_cents::text, 'NULL'), COALESCE(prev::text, '-'))
               FROM (SELECT loan_id, seq, kind, before_cents,
                            lag(after_cents) OVER w AS prev, lag(seq) OVER w AS prev_seq
                       FROM fine_journal_entries
                     WINDOW w AS (PARTITION BY loan_id ORDER BY seq)) e
              WHERE CASE WHEN prev_seq IS NULL
                         THEN NOT COALESCE(before_cents = 0, kind = 'opening')
                         ELSE before_cents IS DISTINCT FROM prev END",
        ),
        (
            "a loan is not what its last entry says",
            "WITH last AS (
                 SELECT DISTINCT ON (loan_id) loan_id, seq, kind, after_cents
                   FROM fine_journal_entries ORDER BY loan_id, seq DESC
             )
             SELECT format('loan %s: %s, fine %s, fine_seq %s; last entry %s %s to %s',
                           l.id,
                           CASE WHEN l.fine_settled_at IS NULL THEN 'unsettled' ELSE 'settled' END,
                           COALESCE(l.fine_cents::text, 'NULL'),
                           COALESCE(l.fine_seq::text, 'NULL'), COALESCE(e.seq::text, 'none'),
                           e.kind, e.after_cents)
               FROM loans l LEFT JOIN last e ON e.loan_id = l.id
              WHERE CASE
                      WHEN l.fine_settled_at IS NOT NULL
                        THEN e.seq IS NULL OR l.fine_seq IS DISTINCT FROM e.seq
                             OR l.fine_cents IS DISTINCT FROM e.after_cents
                             OR e.kind IN ('reversed', 'deleted')
                      WHEN e.seq IS NOT NULL
                        THEN l.fine_seq IS DISTINCT FROM e.seq OR e.kind <> 'reversed'
                             OR e.after_cents IS DISTINCT FROM 0
                             OR l.fine_cents IS DISTINCT FROM 0
                      ELSE l.fine_seq IS NOT NULL
                    END",
        ),
        (
            "a loan gone from loans neither ends with its deletion nor has it queued (nor was \
             unsettled by its last entry)",
            "WITH last AS (
                 SELECT DISTINCT ON (loan_id) loan_id, seq, kind, after_cents
                   FROM fine_journal_entries ORDER BY loan_id, seq DESC
             )
             SELECT format('loan %s: last entry %s %s to %s', loan_id, seq, kind, after_cents)
               FROM last e
              WHERE NOT EXISTS (SELECT 1 FROM loans l WHERE l.id = e.loan_id)
                AND NOT (e.kind IN ('deleted', 'reversed') AND e.after_cents = 0)
                AND NOT EXISTS (SELECT 1 FROM loan_changes c
                                 WHERE c.loan_id = e.loan_id AND c.deleted)",
        ),
        (
            "a loan's head (fine_heads) is not its last entry, or records a break",
            "WITH last AS (
                 SELECT DISTINCT ON (loan_id) loan_id, journal_id, seq, kind, after_cents
                   FROM fine_journal_entries ORDER BY loan_id, journal_id DESC
             ), counted AS (
                 SELECT loan_id, count(*) AS n FROM fine_journal_entries GROUP BY loan_id
             )
             SELECT format('loan %s: head %s, last entry %s', COALESCE(h.loan_id, e.loan_id),
                           COALESCE(format('%s seq %s %s to %s, %s entries, %s breaks',
                                           h.journal_id, h.seq, h.kind, h.after_cents, h.entries,
                                           h.breaks), 'none'),
                           COALESCE(format('%s seq %s %s to %s, %s entries', e.journal_id, e.seq,
                                           e.kind, e.after_cents, c.n), 'none'))
               FROM fine_heads h
               FULL JOIN last e ON e.loan_id = h.loan_id
               LEFT JOIN counted c ON c.loan_id = e.loan_id
              WHERE h.loan_id IS NULL OR e.loan_id IS NULL OR h.breaks <> 0
                 OR (h.journal_id, h.seq, h.kind, h.after_cents, h.entries)
                    IS DISTINCT FROM (e.journal_id, e.seq, e.kind, e.after_cents, c.n::int)",
        ),
    ];
    let mut broken = Vec::new();
    for (what, sql) in checks {
        let found: Vec<String> = sqlx::query_scalar(sql).fetch_all(pool).await.unwrap();
        if !found.is_empty() {
            broken.push(format!(
                "{what} ({}): {}",
                found.len(),
                found[..found.len().min(10)].join("; ")
            ));
        }
    }
    broken
}

fn day(text: &str) -> NaiveDate {
    NaiveDate::parse_from_str(text, "%Y-%m-%d").unwrap()
}

/// A loan borrowed two weeks before it is due; `returned` `None`: still out.
pub(crate) async fn insert_loan(pool: &PgPool, id: i64, due: &str, returned: Option<&str>) {
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES ($1, 7, 7, $2::date - 14, $2::date, $3::date)",
    )
    .bind(id)
    .bind(day(due))
    .bind(returned.map(day))
    .execute(pool)
    .await
    .unwrap();
}

pub(crate) async fn sql(pool: &PgPool, statement: &str) {
    sqlx::query(statement).execute(pool).await.unwrap();
}

/// `settlementd run` of one shard of `month`, `--json`.
fn run_shard(url: &str, env: &[(&str, &str)], month: &str, shard: u32, shards: u32) -> Output {
    let (shard, shards) = (shard.to_string(), shards.to_string());
    cli(
        url,
        env,
        &[
            "run",
            "--business-date",
            month,
            "--shard",
            &shard,
            "--shards",
            &shards,
            "--json",
        ],
    )
}

/// [`run_shard`], which must exit 0; its report.
pub(crate) fn run_ok_json(
    url: &str,
    env: &[(&str, &str)],
    month: &str,
    shard: u32,
    shards: u32,
) -> serde_json::Value {
    let out = run_shard(url, env, month, shard, shards);
    assert_eq!(
        out.status.code(),
        Some(0),
        "run {month} {shard}/{shards}: {}",
        stderr_of(&out)
    );
    json_of(&out)
}

/// `settlementd correct` of `month` under `key`.
pub(crate) fn correct(
    url: &str,
    env: &[(&str, &str)],
    month: &str,
    key: &str,
    reason: &str,
) -> Output {
    cli(
        url,
        env,
        &[
            "correct",
            "--business-date",
            month,
            "--key",
            key,
            "--reason",
            reason,
            "--json",
        ],
    )
}

/// One loan's journal entries in order: (seq, kind, month's first day, before, after).
type Entry = (i32, String, NaiveDate, Option<i64>, i64);

pub(crate) async fn entries(pool: &PgPool, loan: i64) -> Vec<Entry> {
    sqlx::query_as(
        "SELECT seq, kind, month, before_cents, after_cents FROM fine_journal_entries
          WHERE loan_id = $1 ORDER BY seq",
    )
    .bind(loan)
    .fetch_all(pool)
    .await
    .unwrap()
}

pub(crate) fn entry(seq: i32, kind: &str, month: &str, before: i64, after: i64) -> Entry {
    (seq, kind.to_string(), day(month), Some(before), after)
}

/// A loan's (fine_cents, settled, fine_seq).
pub(crate) async fn loan(pool: &PgPool, id: i64) -> (i64, bool, Option<i32>) {
    sqlx::query_as(
        "SELECT fine_cents, fine_settled_at IS NOT NULL, fine_seq FROM loans WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The status of each shard of `shards` of `month` that has a row, by shard.
async fn statuses(pool: &PgPool, month: BusinessDate, shards: i32) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT status FROM job_runs WHERE job_name = $1 AND business_date = $2 AND shards = $3
          ORDER BY shard",
    )
    .bind(fine_settlement::JOB_NAME)
    .bind(month.date())
    .bind(shards)
    .fetch_all(pool)
    .await
    .unwrap()
}

pub(crate) async fn count(pool: &PgPool, query: &str) -> i64 {
    sqlx::query_scalar(query).fetch_one(pool).await.unwrap()
}

/// How many `corrected` events each shard of the month's trail has, by shard.
async fn corrected_events(pool: &PgPool) -> Vec<(i32, i64)> {
    sqlx::query_as(
        "SELECT shard, count(*) FROM job_events WHERE event = 'corrected'
          GROUP BY shard ORDER BY shard",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

fn replica(pool: &PgPool, s: &Settings, clock: &ManualClock) -> Replica {
    Replica::new(
        pool.clone(),
        s,
        Arc::new(clock.clone()),
        CancellationToken::new(),
    )
}

/// The month a tick settled, and how many loans its run wrote.
fn settled_by(outcome: TickOutcome) -> (BusinessDate, u64) {
    match outcome {
        TickOutcome::Settled { slot, report } => (slot.business_date, report.updated),
        other => panic!("expected the tick to settle a month, got {other:?}"),
    }
}

fn rate(cents: i64) -> FineRule {
    FineRule {
        daily_rate_cents: cents,
        ..FineRule::default()
    }
}

/// A gauge with a `job_name` label on a replica's `/metrics` (`None`: not published).
async fn job_gauge(serve: &ServeProcess, name: &str) -> Option<f64> {
    let (_, body) = get(serve.addr, "/metrics").await.ok()?;
    let labelled = format!("{name}{{job_name=\"{}\"}} ", fine_settlement::JOB_NAME);
    body.lines()
        .find_map(|l| l.strip_prefix(&labelled))
        .and_then(|v| v.trim().parse().ok())
}

/// Before, a replica looked for unfinished months among its own shard's `job_runs` rows only:
/// shard 1 of 3, which never claimed September, found none, ran the schedule's month and left a
/// third of September unsettled for ever while its peers' rows said SUCCESS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_catches_up_a_month_its_peers_claimed() {
    let db = test_db().await;
    let (sep, oct, nov) = (bd("2026-09-30"), bd("2026-10-31"), bd("2026-11-30"));
    seed_month_alone(&db.pool, sep, 300, 1).await;
    seed_month_alone(&db.pool, oct, 90, 10_000).await;
    for shard in [0, 2] {
        run_ok_json(&db.url, &[], "2026-09-30", shard, 3);
    }
    let mine = |month: BusinessDate| {
        format!(
            "SELECT count(*) FROM loans WHERE returned_on BETWEEN '{}' AND '{}' AND id % 3 = 1",
            month.first_day(),
            month.date()
        )
    };
    let september_mine = count(&db.pool, &mine(sep)).await;
    let october_mine = count(&db.pool, &mine(oct)).await;
    assert!(september_mine > 0 && october_mine > 0);

    // Shard 1's replica comes up in December: the schedule's month is November.
    let s = settings(&[("SHARD__INDEX", "1"), ("SHARD__COUNT", "3")]);
    let clock = ManualClock::new(shanghai(2026, 12, 5, 10, 0, 0));
    let mut r = replica(&db.pool, &s, &clock);
    // Oldest first: September (its peers claimed it), October (its returns wait), November.
    assert_eq!(settled_by(r.tick().await), (sep, september_mine as u64));
    assert_eq!(settled_by(r.tick().await), (oct, october_mine as u64));
    assert_eq!(settled_by(r.tick().await), (nov, 0));
    assert!(matches!(r.tick().await, TickOutcome::AlreadyDone { .. }));

    assert_eq!(statuses(&db.pool, sep, 3).await, ["SUCCESS"; 3]);
    assert_verified(&db.url, &[], "2026-09-30");
    // Only shard 1 runs here: October's other shards wait for their replicas.
    let october_left = count(
        &db.pool,
        "SELECT count(*) FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND fine_settled_at IS NULL AND id % 3 <> 1",
    )
    .await;
    assert_eq!(october_left, eligible(&db.pool, oct).await - october_mine);
    assert_journal_whole(&db.pool).await;
}

/// Before, a month closed under 2 shards belonged to nobody once the deployment had 3: each
/// replica swept only the months its own key (under 3) had closed, and no key of October under 3
/// existed, so a return keyed into October after the reshard stayed unsettled for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_return_after_a_reshard_is_settled_within_a_tick_under_the_new_shard_count() {
    let db = test_db().await;
    let (oct, nov) = (bd("2026-10-31"), bd("2026-11-30"));
    seed_month_alone(&db.pool, oct, 200, 1).await;
    for shard in 0..2 {
        run_ok_json(&db.url, &[], "2026-10-31", shard, 2);
    }
    // Keyed in after the reshard to 3 replicas; 100 000 is shard 1's of 3.
    insert_loan(&db.pool, 100_000, "2026-10-01", Some("2026-10-20")).await;

    // What shard 1 of 3 sees before it ticks: October is not closed, its return waits for
    // shard 1, and the month is due for a shard that never claimed it under 3.
    let s1 = settings(&[("SHARD__INDEX", "1"), ("SHARD__COUNT", "3")]);
    let window: Vec<NaiveDate> = (0..12)
        .rev()
        .map(|n| nov.months_before(n).unwrap().date())
        .collect();
    let periods = due::periods(
        &db.pool,
        fine_settlement::JOB_NAME,
        3,
        1,
        window[0],
        nov.date(),
    )
    .await
    .unwrap();
    let pending = settlementd::app::settlement_job(&s1)
        .pending(&mut db.pool.acquire().await.unwrap(), 3, &window)
        .await
        .unwrap();
    let waiting = Pending {
        business_date: oct.date(),
        shard: 1,
        late: 1,
        held: 0,
        upkeep: 0,
    };
    assert!(pending.by_period.contains(&waiting), "{pending:?}");
    let open = due::not_closed(&periods, &pending, 3, &window);
    assert_eq!(open.len(), 1, "{open:?}");
    assert_eq!(
        (
            open[0].business_date,
            open[0].unsettled_shards,
            open[0].waiting
        ),
        (oct.date(), 3, 1)
    );
    let ask = due::Ask {
        shard: 1,
        scheduled: None,
        start_waiting: true,
    };
    assert_eq!(
        due::due(&periods, &pending, ask),
        [Due {
            business_date: oct.date(),
            why: Why::Unfinished(None)
        }]
    );

    // Three replicas in December (the schedule's month is November): each one's first tick runs
    // October under 3; shard 1's settles the late return.
    let clock = ManualClock::new(shanghai(2026, 12, 5, 10, 0, 0));
    for shard in 0..3u32 {
        let index = shard.to_string();
        let s = settings(&[("SHARD__INDEX", &index), ("SHARD__COUNT", "3")]);
        let mut r = replica(&db.pool, &s, &clock);
        let expected = if shard == 1 { 1 } else { 0 };
        assert_eq!(settled_by(r.tick().await), (oct, expected), "shard {shard}");
    }
    let fine = FineRule::default().fine_cents(day("2026-10-01"), day("2026-10-20"));
    assert_eq!(loan(&db.pool, 100_000).await, (fine, true, Some(1)));
    assert_eq!(
        entries(&db.pool, 100_000).await,
        [entry(1, "late", "2026-10-01", 0, fine)]
    );
    let shards: i32 =
        sqlx::query_scalar("SELECT shards FROM fine_journal_entries WHERE loan_id = 100000")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(shards, 3);
    assert_eq!(statuses(&db.pool, oct, 3).await, ["SUCCESS"; 3]);
    assert_eq!(statuses(&db.pool, oct, 2).await, ["SUCCESS"; 2]);
    assert_verified(&db.url, &[], "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, nothing counted returns keyed into months older than the lookback: no gauge, no
/// alert, and the replica never looked there. (Nor did it start a month inside the lookback that
/// nobody had claimed: the October return below stayed unsettled too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_beyond_the_lookback_is_left_unsettled_and_counted_on_metrics() {
    let db = test_db().await;
    let latest = due_month();
    let inside = latest.months_before(1).unwrap();
    let beyond = latest.months_before(5).unwrap();
    let due_and_back = |month: BusinessDate| {
        let due = month.first_day() + chrono::Days::new(3);
        (due.to_string(), (due + chrono::Days::new(9)).to_string())
    };
    let (due, back) = due_and_back(beyond);
    insert_loan(&db.pool, 1, &due, Some(&back)).await;
    let (due, back) = due_and_back(inside);
    insert_loan(&db.pool, 2, &due, Some(&back)).await;

    let serve = ServeProcess::start(
        &db.url,
        &[
            ("SETTLEMENTD__SETTLE__LOOKBACK_MONTHS", "2"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
        ],
    );
    serve.wait_for("/healthz", 200).await;
    assert!(
        eventually(20, || async { loan(&db.pool, 2).await.1 }).await,
        "the return inside the lookback is settled"
    );
    assert!(
        eventually(10, || async {
            job_gauge(&serve, "settlementd_unsettled_beyond_lookback").await == Some(1.0)
        })
        .await,
        "{:?}",
        get(serve.addr, "/metrics").await.map(|(_, body)| body)
    );
    assert_eq!(loan(&db.pool, 1).await, (0, false, None));
    assert!(statuses(&db.pool, beyond, 1).await.is_empty());
    drop(serve);
}

/// Before, libraryd's edits of a settled loan were invisible: the month was SUCCESS with nothing
/// unsettled, so the next run skipped it; the old fine stayed, and a deleted loan's fine simply
/// vanished from the month without a trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_due_date_libraryd_changes_is_repriced_and_a_deleted_loan_has_its_fine_taken_out() {
    let db = test_db().await;
    let month = "2026-10-31";
    insert_loan(&db.pool, 1, "2026-10-05", Some("2026-10-10")).await;
    insert_loan(&db.pool, 4, "2026-10-02", Some("2026-10-12")).await;
    insert_loan(&db.pool, 5, "2026-10-10", Some("2026-10-20")).await;
    run_ok_json(&db.url, &[], month, 0, 1);
    assert_eq!(loan(&db.pool, 1).await, (250, true, Some(1)));

    // libraryd, in its own transactions: a due date corrected, a loan deleted.
    sql(
        &db.pool,
        "UPDATE loans SET due_on = '2026-10-01' WHERE id = 1",
    )
    .await;
    sql(&db.pool, "DELETE FROM loans WHERE id = 4").await;
    let (code, report) = verify(&db.url, &[], month);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["edits_waiting"],
        serde_json::json!({"count": 2, "ids": [1, 4]}),
        "{report}"
    );

    let report = run_ok_json(&db.url, &[], month, 0, 1);
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(2), Some(2)),
        "{report}"
    );
    assert_eq!(
        entries(&db.pool, 1).await,
        [
            entry(1, "settled", "2026-10-01", 0, 250),
            entry(2, "repriced", "2026-10-01", 250, 450),
        ]
    );
    assert_eq!(loan(&db.pool, 1).await, (450, true, Some(2)));
    assert_eq!(
        entries(&db.pool, 4).await,
        [
            entry(1, "settled", "2026-10-01", 0, 500),
            entry(2, "deleted", "2026-10-01", 500, 0),
        ]
    );
    assert_eq!(entries(&db.pool, 5).await.len(), 1, "an untouched loan");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM loan_changes").await,
        0
    );
    let (code, report) = verify(&db.url, &[], month);
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["totals"]["fine_cents_sum"], 450 + 500);
    // Nothing waits any more: the next run is skipped.
    assert_eq!(run_ok_json(&db.url, &[], month, 0, 1)["skipped"], true);
    assert_journal_whole(&db.pool).await;
}

/// Before, a settled return moved into another month stayed settled at its old fine in no month
/// at all: the old month's totals no longer held it, the new month's run never saw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_return_moved_to_another_closed_month_is_reversed_in_the_old_and_settled_late_in_the_new()
{
    let db = test_db().await;
    insert_loan(&db.pool, 2, "2026-09-15", Some("2026-10-05")).await;
    insert_loan(&db.pool, 6, "2026-09-01", Some("2026-09-11")).await;
    insert_loan(&db.pool, 7, "2026-10-01", Some("2026-10-03")).await;
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    assert_eq!(loan(&db.pool, 2).await, (1000, true, Some(1)));

    sql(
        &db.pool,
        "UPDATE loans SET returned_on = '2026-09-25' WHERE id = 2",
    )
    .await;
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1));
    assert_eq!(
        report["journal"]["edits_waiting"]["ids"],
        serde_json::json!([2])
    );
    // September sees it coming: returned in it now, its edit not re-priced yet.
    let (code, report) = verify(&db.url, &[], "2026-09-30");
    assert_eq!(code, Some(1));
    assert_eq!(
        report["journal"]["edits_waiting"]["ids"],
        serde_json::json!([2])
    );

    // October's run takes its fine out; then it is an unsettled return of September.
    let report = run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    assert_eq!(report["updated"], 1, "{report}");
    assert_eq!(loan(&db.pool, 2).await, (0, false, Some(2)));
    let report = run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(
        entries(&db.pool, 2).await,
        [
            entry(1, "settled", "2026-10-01", 0, 1000),
            entry(2, "reversed", "2026-10-01", 1000, 0),
            entry(3, "late", "2026-09-01", 0, 500),
        ]
    );
    assert_eq!(loan(&db.pool, 2).await, (500, true, Some(3)));
    for month in ["2026-09-30", "2026-10-31"] {
        assert_verified(&db.url, &[], month);
    }
    let (_, september) = verify(&db.url, &[], "2026-09-30");
    assert_eq!(september["totals"]["fine_cents_sum"], 500 + 500);
    let (_, october) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(october["totals"]["fine_cents_sum"], 100);
    assert_journal_whole(&db.pool).await;
}

/// Before, a return undone in libraryd left the loan settled, with its fine, as if returned; when
/// it came back in another month its new month's run skipped it (already settled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undone_return_is_reversed_and_settled_again_under_the_pin_of_the_month_it_comes_back_in(
) {
    let db = test_db().await;
    let november_rule = [(RATE, "60")];
    insert_loan(&db.pool, 3, "2026-10-01", Some("2026-10-21")).await;
    insert_loan(&db.pool, 8, "2026-11-01", Some("2026-11-05")).await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    // November is pinned to another rule: 60 cents a day.
    run_ok_json(&db.url, &november_rule, "2026-11-30", 0, 1);
    assert_eq!(loan(&db.pool, 3).await, (1000, true, Some(1)));
    assert_eq!(loan(&db.pool, 8).await.0, 240);

    sql(&db.pool, "UPDATE loans SET returned_on = NULL WHERE id = 3").await;
    let report = run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    assert_eq!(report["updated"], 1, "{report}");
    assert_eq!(loan(&db.pool, 3).await, (0, false, Some(2)));
    assert_verified(&db.url, &[], "2026-10-31");

    // It comes back in November: November's run settles it under November's pin.
    sql(
        &db.pool,
        "UPDATE loans SET returned_on = '2026-11-10' WHERE id = 3",
    )
    .await;
    let report = run_ok_json(&db.url, &november_rule, "2026-11-30", 0, 1);
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(
        entries(&db.pool, 3).await,
        [
            entry(1, "settled", "2026-10-01", 0, 1000),
            entry(2, "reversed", "2026-10-01", 1000, 0),
            entry(3, "late", "2026-11-01", 0, 40 * 60),
        ]
    );
    let rule: serde_json::Value =
        sqlx::query_scalar("SELECT rule FROM fine_journal_entries WHERE loan_id = 3 AND seq = 3")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(rule["daily_rate_cents"], 60);
    assert_eq!(loan(&db.pool, 3).await, (2400, true, Some(3)));
    assert_verified(&db.url, &november_rule, "2026-11-30");
    assert_journal_whole(&db.pool).await;
}

/// Before, a finished key replayed whatever was asked with it: another rule or another reason
/// under the same key exited 0 "replayed", so an operator believed the month corrected to a rule
/// it never was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_key_reused_with_another_rule_or_reason_is_refused_and_changes_nothing() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 120, 1).await;
    run_ok_json(&db.url, &[(RATE, "40")], "2026-10-31", 0, 1);
    let reason = "the rate is 50";
    let out = correct(&db.url, &[], "2026-10-31", "RATE-50", reason);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let first = json_of(&out);
    assert!(first["changed"].as_i64().unwrap() > 0, "{first}");
    assert_priced_under(&db.pool, month, rate(50)).await;

    let state = |pool: PgPool| async move {
        let journal = count(&pool, "SELECT count(*) FROM fine_journal").await;
        let adjustments = count(&pool, "SELECT count(*) FROM fine_adjustments").await;
        let pin: (serde_json::Value, Option<String>) =
            sqlx::query_as("SELECT params, correction_key FROM job_params")
                .fetch_one(&pool)
                .await
                .unwrap();
        let corrections: Vec<(String, String, serde_json::Value)> = sqlx::query_as(
            "SELECT correction_key, reason, new_rule FROM fine_corrections ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        (
            loans_snapshot(&pool).await,
            journal,
            adjustments,
            pin,
            corrections,
        )
    };
    let before = state(db.pool.clone()).await;

    let out = correct(&db.url, &[(RATE, "60")], "2026-10-31", "RATE-50", reason);
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    let line = stderr_of(&out);
    assert_eq!(line.trim_end().lines().count(), 1, "{line}");
    assert!(
        line.contains(
            "rule 50 cents a day after 0 grace days, at most 10000 cents (this configuration: \
             60 cents a day after 0 grace days, at most 10000 cents)"
        ),
        "{line}"
    );
    assert!(out.stdout.is_empty());

    let out = correct(&db.url, &[], "2026-10-31", "RATE-50", "another reason");
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    let line = stderr_of(&out);
    assert!(
        line.contains(r#"reason "the rate is 50" (this request: "another reason")"#),
        "{line}"
    );
    // Everything different at once: one line naming each difference.
    let out = cli(
        &db.url,
        &[(RATE, "60")],
        &[
            "correct",
            "--business-date",
            "2026-09-30",
            "--key",
            "RATE-50",
            "--reason",
            "another reason",
            "--shards",
            "3",
        ],
    );
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    let line = stderr_of(&out);
    assert_eq!(line.trim_end().lines().count(), 1, "{line}");
    for needle in [
        "month 2026-10-31 (this request: 2026-09-30)",
        "rule 50 cents a day",
        "(this configuration: 60 cents a day",
        r#"reason "the rate is 50" (this request: "another reason")"#,
        "1 shard (this request: 3)",
    ] {
        assert!(line.contains(needle), "{needle}: {line}");
    }
    assert_eq!(state(db.pool.clone()).await, before, "nothing changed");

    // The same request again is replayed.
    let out = correct(&db.url, &[], "2026-10-31", "RATE-50", reason);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let replay = json_of(&out);
    assert_eq!(replay["replayed"], true);
    assert_eq!(replay["changed"], first["changed"]);
    assert_eq!(state(db.pool.clone()).await, before);
}

/// Before, nothing held a month whose correction had died half-way: `run`, a replica's takeover
/// of the dead correction's stale claim and a new key all went ahead, and the takeover marked the
/// month SUCCESS under the new rule with half its fines still at the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_killed_mid_way_holds_its_month_until_the_same_key_finishes_it() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 120, 1).await;
    for shard in 0..2 {
        run_ok_json(&db.url, &[], "2026-10-31", shard, 2);
    }
    let new_rule = [(RATE, "60")];
    let reason = "the rate is 60 since October";

    // The correction's batches are slowed down, and it is killed once its first one committed.
    slow_updates(&db.pool, 0.2).await;
    let mut killed = settlementd(Some(&db.url))
        .envs(new_rule)
        .env("SETTLEMENTD__BATCH__SIZE", "5")
        .args([
            "correct",
            "--business-date",
            "2026-10-31",
            "--key",
            "FIX-60",
            "--reason",
            reason,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let first_batch = eventually(20, || async {
        count(&db.pool, "SELECT count(*) FROM fine_adjustments").await > 0
    })
    .await;
    killed.kill().unwrap();
    killed.wait().unwrap();
    assert!(first_batch, "the correction committed a batch");
    no_slow_updates(&db.pool).await;

    // Half-corrected, and held: the correction is unfinished and the month re-pinned to it.
    let (pinned, held): (serde_json::Value, Option<String>) =
        sqlx::query_as("SELECT params, correction_key FROM job_params")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (pinned["daily_rate_cents"].as_i64(), held.as_deref()),
        (Some(60), Some("FIX-60"))
    );
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM fine_corrections WHERE completed_at IS NULL"
        )
        .await,
        1
    );
    let still_old = count(
        &db.pool,
        "SELECT count(*) FROM loans WHERE fine_settled_at IS NOT NULL
            AND fine_cents <> LEAST(GREATEST(returned_on - due_on, 0) * 60, 10000)",
    )
    .await;
    assert!(still_old > 0, "the kill left fines at the old rule");

    // `run` of the month is refused, whatever its rule and shard.
    age_heartbeat(&db.pool, month, 2, 0, 120).await;
    for (env, shard) in [(&new_rule[..], 0), (&new_rule[..], 1), (&[][..], 1)] {
        let out = run_shard(&db.url, env, "2026-10-31", shard, 2);
        assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
        assert!(
            stderr_of(&out).contains(r#"being corrected under key "FIX-60""#),
            "{}",
            stderr_of(&out)
        );
    }
    // A new key is refused, naming the unfinished one and the command that finishes it.
    let out = correct(&db.url, &new_rule, "2026-10-31", "FIX-61", "another try");
    assert_eq!(out.status.code(), Some(3), "{}", stderr_of(&out));
    let line = stderr_of(&out);
    for needle in [
        r#"under key "FIX-60""#,
        "`settlementd correct --business-date 2026-10-31 --key FIX-60 --reason 'the rate is 60 \
         since October' --shards 2`",
    ] {
        assert!(line.contains(needle), "{needle}: {line}");
    }
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM fine_corrections WHERE correction_key = 'FIX-61'"
        )
        .await,
        0
    );
    // A replica of the dead correction's shard, on the new rule, with its claim stale: the month
    // is held, so it takes nothing over and marks nothing SUCCESS.
    let runs = || async {
        sqlx::query_as::<_, (i32, String, i32)>(
            "SELECT shard, status, attempt FROM job_runs
              WHERE business_date = '2026-10-31' AND shards = 2 ORDER BY shard",
        )
        .fetch_all(&db.pool)
        .await
        .unwrap()
    };
    let before = runs().await;
    assert_eq!(before[0].1, "RUNNING", "{before:?}");
    let s = settings(&[
        ("SHARD__INDEX", "0"),
        ("SHARD__COUNT", "2"),
        ("FINE__DAILY_RATE_CENTS", "60"),
    ]);
    let clock = ManualClock::new(shanghai(2026, 11, 5, 10, 0, 0));
    let mut r = replica(&db.pool, &s, &clock);
    for _ in 0..2 {
        let outcome = r.tick().await;
        assert!(
            !matches!(outcome, TickOutcome::Settled { .. }),
            "{outcome:?}"
        );
    }
    assert_eq!(runs().await, before);
    // A `serve` replica of that shard says a correction is unfinished, and runs nothing of it.
    let serve = ServeProcess::start(
        &db.url,
        &[
            ("SETTLEMENTD__SHARD__INDEX", "0"),
            ("SETTLEMENTD__SHARD__COUNT", "2"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
            (RATE, "60"),
        ],
    );
    assert!(
        eventually(20, || async {
            serve.metric("settlementd_corrections_unfinished").await == 1.0
        })
        .await
    );
    // A tick at least after the one that published it (one heartbeat): nothing claimed either.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    drop(serve);
    assert_eq!(runs().await, before);

    // The same key again finishes it, and records the rule the month really had before.
    let out = correct(&db.url, &new_rule, "2026-10-31", "FIX-60", reason);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let done = json_of(&out);
    assert_eq!(done["replayed"], false, "{done}");
    assert_eq!(done["old_rule"]["daily_rate_cents"], 50, "{done}");
    assert_eq!(done["new_rule"]["daily_rate_cents"], 60, "{done}");
    assert_priced_under(&db.pool, month, rate(60)).await;
    let held: Option<String> = sqlx::query_scalar("SELECT correction_key FROM job_params")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(held, None, "released");
    assert_eq!(statuses(&db.pool, month, 2).await, ["SUCCESS"; 2]);
    assert_eq!(corrected_events(&db.pool).await, [(0, 1), (1, 1)]);
    // Every changed loan once, over both invocations; the reply counts both.
    let (adjusted, loans): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT loan_id) FROM fine_adjustments")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(adjusted, loans);
    assert_eq!(done["changed"].as_i64(), Some(adjusted));
    assert_verified(&db.url, &new_rule, "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, nothing kept two processes off one key: both re-opened every shard, both completed,
/// and the month's trail had its `corrected` events twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_correct_processes_with_one_key_correct_once_and_the_second_replays() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 120, 1).await;
    for shard in 0..2 {
        run_ok_json(&db.url, &[(RATE, "40")], "2026-10-31", shard, 2);
    }
    slow_updates(&db.pool, 0.05).await;
    let spawn = || {
        settlementd(Some(&db.url))
            .env("SETTLEMENTD__BATCH__SIZE", "10")
            .args([
                "correct",
                "--business-date",
                "2026-10-31",
                "--key",
                "RATE-50",
                "--reason",
                "the rate is 50",
                "--json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let wait =
        |child: std::process::Child| tokio::task::spawn_blocking(move || child.wait_with_output());
    let (a, b) = (wait(a), wait(b));
    let outs = [a.await.unwrap().unwrap(), b.await.unwrap().unwrap()];
    no_slow_updates(&db.pool).await;
    for out in &outs {
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(out));
    }
    let replies: Vec<serde_json::Value> = outs.iter().map(json_of).collect();
    let mut replayed: Vec<bool> = replies
        .iter()
        .map(|r| r["replayed"].as_bool().unwrap())
        .collect();
    replayed.sort();
    assert_eq!(replayed, [false, true], "{replies:?}");
    assert_eq!(replies[0]["changed"], replies[1]["changed"]);
    assert!(
        outs.iter()
            .any(|o| stderr_of(o).contains("another process is running correction \"RATE-50\"")),
        "one of them waited for the other"
    );
    assert_eq!(
        corrected_events(&db.pool).await,
        [(0, 1), (1, 1)],
        "one corrected event per shard"
    );
    let (adjusted, loans): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT loan_id) FROM fine_adjustments")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        (adjusted, replies[0]["changed"].as_i64()),
        (loans, Some(loans))
    );
    assert_priced_under(&db.pool, month, rate(50)).await;
    assert_verified(&db.url, &[], "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, a correction settled the month's unsettled returns but wrote `fine_adjustments` only
/// for fines it changed on loans already settled: money it charged for the first time was on no
/// record of the correction. A return settled at 0 charges nothing: its entry records the
/// settlement, and no adjustment says 0 → 0 (issue 34).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_a_correction_settles_for_the_first_time_get_an_adjustment_and_a_corrected_entry() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 60, 1).await;
    run_ok_json(&db.url, &[(RATE, "40")], "2026-10-31", 0, 1);
    insert_loan(&db.pool, 100_000, "2026-10-02", Some("2026-10-12")).await;
    insert_loan(&db.pool, 100_001, "2026-10-20", Some("2026-10-18")).await;
    let out = correct(&db.url, &[], "2026-10-31", "RATE-50", "the rate is 50");
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let reply = json_of(&out);

    for (id, fine) in [(100_000, 500), (100_001, 0)] {
        let adjustment: Option<(String, i64, i64)> = sqlx::query_as(
            "SELECT correction_key, old_cents, new_cents FROM fine_adjustments WHERE loan_id = $1",
        )
        .bind(id)
        .fetch_optional(&db.pool)
        .await
        .unwrap();
        let charged = (fine != 0).then(|| ("RATE-50".to_string(), 0, fine));
        assert_eq!(adjustment, charged, "loan {id}");
        assert_eq!(
            entries(&db.pool, id).await,
            [entry(1, "corrected", "2026-10-01", 0, fine)],
            "loan {id}"
        );
        let key: Option<String> = sqlx::query_scalar(
            "SELECT correction_key FROM fine_journal_entries WHERE loan_id = $1",
        )
        .bind(id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(key.as_deref(), Some("RATE-50"));
        assert_eq!(loan(&db.pool, id).await, (fine, true, Some(1)));
    }
    let adjusted = count(&db.pool, "SELECT count(*) FROM fine_adjustments").await;
    assert_eq!(reply["changed"].as_i64(), Some(adjusted), "{reply}");
    assert_priced_under(&db.pool, month, rate(50)).await;
    assert_verified(&db.url, &[], "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, a month's pin carried the rule's `from`: the unchanged rule written as
/// `[[fine.rules]]` from 2020-01 "differed" from the single rule's pin (from 0001-01), and the
/// month's late return was refused with exit 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writing_the_unchanged_rule_as_dated_rules_conflicts_with_nothing() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 50, 1).await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("settlementd.toml");
    std::fs::write(
        &config,
        "[[fine.rules]]\nfrom = \"2020-01\"\ndaily_rate_cents = 50\ngrace_days = 0\nmax_cents = 10000\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    insert_loan(&db.pool, 100_000, "2026-10-02", Some("2026-10-12")).await;

    let out = cli(
        &db.url,
        &[],
        &[
            "--config",
            config,
            "run",
            "--business-date",
            "2026-10-31",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let report = json_of(&out);
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    assert_eq!(
        report["rule"],
        serde_json::json!({"daily_rate_cents": 50, "grace_days": 0, "max_cents": 10000})
    );
    assert_eq!(
        entries(&db.pool, 100_000).await,
        [entry(1, "late", "2026-10-01", 0, 500)]
    );
    let out = cli(
        &db.url,
        &[],
        &[
            "--config",
            config,
            "verify",
            "--business-date",
            "2026-10-31",
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let report = json_of(&out);
    assert_eq!(
        report["configured_rule"],
        serde_json::Value::Null,
        "{report}"
    );
    // A correction's key binds the rule's identity too: recorded under the single rule, the
    // same request under the dated rules is the same request.
    let reason = "nothing to change";
    let out = correct(&db.url, &[], "2026-10-31", "SAME-RULE", reason);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let out = cli(
        &db.url,
        &[],
        &[
            "--config",
            config,
            "correct",
            "--business-date",
            "2026-10-31",
            "--key",
            "SAME-RULE",
            "--reason",
            reason,
            "--json",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(json_of(&out)["replayed"], true);
    assert_journal_whole(&db.pool).await;
}

/// A month of 60 loans settled by one run, and the id of its first settled loan whose fine is
/// neither 0 nor the cap, with that fine.
async fn settled_month(db: &TestDb) -> (i64, i64) {
    seed_month_alone(&db.pool, bd("2026-10-31"), 60, 1).await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    sqlx::query_as(
        "SELECT id, fine_cents FROM loans WHERE fine_settled_at IS NOT NULL
            AND fine_cents BETWEEN 1 AND 9000 ORDER BY id LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap()
}

/// Before, `verify` only recomputed fines from the rule: it had no journal to hold them against,
/// so it could not say a fine was edited outside settlementd (only that it differed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_a_fine_edited_by_hand_off_its_journal_entry() {
    let db = test_db().await;
    let (id, fine) = settled_month(&db).await;
    sqlx::query("UPDATE loans SET fine_cents = fine_cents + 123 WHERE id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["off_journal"],
        serde_json::json!({"count": 1, "ids": [id]}),
        "{report}"
    );
    assert_eq!(
        report["mismatched"],
        serde_json::json!({
            "count": 1,
            "net_cents": 123,
            "first": [{"id": id, "stored_cents": fine + 123, "expected_cents": fine}],
        }),
        "{report}"
    );
    // The journal's own invariant names it too (the fault suite relies on it).
    let breaks = journal_breaks(&db.pool).await;
    assert_eq!(breaks.len(), 1, "{breaks:?}");
    assert!(
        breaks[0].starts_with("a loan is not what its last entry says (1)")
            && breaks[0].contains(&format!(
                "loan {id}: settled, fine {}, fine_seq 1",
                fine + 123
            )),
        "{breaks:?}"
    );
}

/// Before, a loan moved out of its month behind settlementd's back simply dropped out of the
/// month's totals, and a due date changed that way showed only as a mismatch: nothing said the
/// edit was never queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_loans_changed_with_the_edit_triggers_off_stale() {
    let db = test_db().await;
    let (moved, _) = settled_month(&db).await;
    let redated: i64 = sqlx::query_scalar(
        "SELECT id FROM loans WHERE fine_settled_at IS NOT NULL AND id > $1
            AND fine_cents BETWEEN 1 AND 9000 ORDER BY id LIMIT 1",
    )
    .bind(moved)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    sql(
        &db.pool,
        "ALTER TABLE loans DISABLE TRIGGER settlementd_settled_dates_changed",
    )
    .await;
    sqlx::query("UPDATE loans SET returned_on = '2026-09-15' WHERE id = $1")
        .bind(moved)
        .execute(&db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE loans SET due_on = due_on - 3 WHERE id = $1")
        .bind(redated)
        .execute(&db.pool)
        .await
        .unwrap();
    sql(
        &db.pool,
        "ALTER TABLE loans ENABLE TRIGGER settlementd_settled_dates_changed",
    )
    .await;
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM loan_changes").await,
        0
    );

    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["stale"],
        serde_json::json!({"count": 2, "ids": [moved, redated]}),
        "{report}"
    );
    assert_eq!(report["journal"]["edits_waiting"]["count"], 0, "{report}");
}

/// Before, `verify` compared `fine_cents <> expected`, which is NULL, not true, for a NULL fine:
/// a settled loan whose money is unknown passed as right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reports_a_null_fine_off_journal_and_mismatched_with_stored_null() {
    let db = test_db().await;
    let (id, fine) = settled_month(&db).await;
    sql(
        &db.pool,
        "ALTER TABLE loans ALTER COLUMN fine_cents DROP NOT NULL",
    )
    .await;
    sqlx::query("UPDATE loans SET fine_cents = NULL WHERE id = $1")
        .bind(id)
        .execute(&db.pool)
        .await
        .unwrap();
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["off_journal"],
        serde_json::json!({"count": 1, "ids": [id]}),
        "{report}"
    );
    assert_eq!(report["mismatched"]["count"], 1, "{report}");
    assert_eq!(
        report["mismatched"]["first"],
        serde_json::json!([{"id": id, "stored_cents": null, "expected_cents": fine}]),
        "{report}"
    );
}

/// Before, `verify` checked against the pin without a word about the configuration: an operator
/// whose configuration had moved on learned it only from a replica's rule conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_names_a_configured_rule_that_differs_from_the_pin_and_stays_right() {
    let db = test_db().await;
    settled_month(&db).await;
    let (code, report) = verify(&db.url, &[(RATE, "60")], "2026-10-31");
    assert_eq!(code, Some(0), "the money is right by the pin: {report}");
    assert_eq!(report["right"], true);
    let keys = |v: &serde_json::Value| {
        let mut keys: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    };
    for key in [
        "right",
        "rule",
        "rule_source",
        "configured_rule",
        "returned",
        "totals",
        "mismatched",
        "unsettled",
        "held",
        "journal",
    ] {
        assert!(report.get(key).is_some(), "{key}: {report}");
    }
    assert_eq!(
        keys(&report["journal"]),
        [
            "balanced",
            "broken",
            "edits_waiting",
            "net_cents",
            "off_journal",
            "record_cents",
            "stale",
            "unjournaled"
        ]
    );
    assert_eq!(report["journal"]["balanced"], true, "{report}");
    assert_eq!(
        report["journal"]["stale"],
        serde_json::json!({"count": 0, "ids": []})
    );
    assert_eq!(report["rule_source"], "pinned");
    assert_eq!(report["rule"]["daily_rate_cents"], 50);
    assert_eq!(
        report["configured_rule"],
        serde_json::json!({"daily_rate_cents": 60, "grace_days": 0, "max_cents": 10000}),
        "{report}"
    );
    let (_, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(
        report["configured_rule"],
        serde_json::Value::Null,
        "{report}"
    );
}

/// Before, there was no journal: no history to check a loan's fine against, for any of the
/// kinds a month's money goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_journal_is_whole_after_settlements_late_returns_edits_a_reshard_and_a_correction() {
    let db = test_db().await;
    let (sep, oct) = (bd("2026-09-30"), bd("2026-10-31"));
    seed_month_alone(&db.pool, sep, 150, 1).await;
    seed_month(&db.pool, oct, 300, 1000).await;
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    for shard in 0..2 {
        run_ok_json(&db.url, &[], "2026-10-31", shard, 2);
    }
    assert_journal_whole(&db.pool).await;

    // Late returns: two keyed into October, a September loan still out comes back.
    insert_loan(&db.pool, 100_000, "2026-10-01", Some("2026-10-11")).await;
    insert_loan(&db.pool, 100_001, "2026-10-01", Some("2026-10-11")).await;
    sql(
        &db.pool,
        "UPDATE loans SET returned_on = '2026-09-20' WHERE id = 10",
    )
    .await;
    // libraryd's edits of settled loans: a due date, a return moved to September, a return
    // undone, a deletion.
    let settled_october: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM loans WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND fine_cents BETWEEN 1 AND 9000 ORDER BY id LIMIT 3",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let undone: i64 = sqlx::query_scalar(
        "SELECT min(id) FROM loans WHERE returned_on BETWEEN '2026-09-01' AND '2026-09-30'
            AND fine_cents > 0",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    for (statement, id) in [
        (
            "UPDATE loans SET due_on = due_on - 4 WHERE id = $1",
            settled_october[0],
        ),
        (
            "UPDATE loans SET returned_on = '2026-09-12' WHERE id = $1",
            settled_october[1],
        ),
        ("DELETE FROM loans WHERE id = $1", settled_october[2]),
        ("UPDATE loans SET returned_on = NULL WHERE id = $1", undone),
    ] {
        sqlx::query(statement)
            .bind(id)
            .execute(&db.pool)
            .await
            .unwrap();
    }
    assert_journal_whole(&db.pool).await;

    // October now runs under 3 shards; then September; then October is corrected to 60 cents.
    for shard in 0..3 {
        run_ok_json(&db.url, &[], "2026-10-31", shard, 3);
    }
    run_ok_json(&db.url, &[], "2026-09-30", 0, 1);
    assert_journal_whole(&db.pool).await;
    let out = correct(
        &db.url,
        &[(RATE, "60")],
        "2026-10-31",
        "MIX-60",
        "the rate is 60",
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(json_of(&out)["shards"], 3);

    assert_journal_whole(&db.pool).await;
    let kinds: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT kind FROM fine_journal ORDER BY kind")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(
        kinds,
        [
            "corrected",
            "deleted",
            "late",
            "repriced",
            "reversed",
            "settled"
        ]
    );
    assert_eq!(loan(&db.pool, undone).await, (0, false, Some(2)));
    assert_priced_under(&db.pool, sep, FineRule::default()).await;
    assert_priced_under(&db.pool, oct, rate(60)).await;
    assert_verified(&db.url, &[], "2026-09-30");
    assert_verified(&db.url, &[(RATE, "60")], "2026-10-31");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM loan_changes").await,
        0
    );
}

/// Before, there was no journal to open: loans settled by an earlier release had no record at all
/// (and `migrate` said nothing about them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_gives_loans_settled_before_the_journal_an_opening_entry_once() {
    let db = test_db().await;
    // 25 loans settled by an earlier release (no journal entry), one still out.
    sql(
        &db.pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents,
                            fine_settled_at)
         SELECT i, 1, 1, '2026-09-20', '2026-10-01'::date + i % 7, '2026-10-02'::date + i % 23,
                LEAST(GREATEST(i % 23 + 1 - i % 7, 0) * 50, 10000), now() - interval '20 days'
           FROM generate_series(1, 25) i",
    )
    .await;
    insert_loan(&db.pool, 26, "2026-10-01", None).await;
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1));
    assert_eq!(report["journal"]["unjournaled"]["count"], 25, "{report}");

    let migrate = || cli(&db.url, &[("SETTLEMENTD__BATCH__SIZE", "10")], &["migrate"]);
    let out = migrate();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        printed.contains("25 settled loans given an opening journal entry"),
        "{printed}"
    );
    let opening: Vec<(i64, i32, Option<i64>, i64, i64)> = sqlx::query_as(
        "SELECT e.loan_id, e.seq, e.before_cents, e.after_cents, l.fine_cents
           FROM fine_journal_entries e JOIN loans l ON l.id = e.loan_id
          WHERE e.kind = 'opening' ORDER BY e.loan_id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(opening.len(), 25);
    assert!(
        opening
            .iter()
            .all(|(_, seq, before, after, fine)| *seq == 1 && before.is_none() && after == fine),
        "{opening:?}"
    );
    let journal_rows = count(&db.pool, "SELECT count(*) FROM fine_journal").await;
    assert_eq!(journal_rows, 3, "batches of 10");
    assert_eq!(loan(&db.pool, 26).await, (0, false, None));
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["totals"]["settled_rows"], 25);

    let out = migrate();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!printed.contains("opening journal entry"), "{printed}");
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM fine_journal").await,
        journal_rows
    );
    assert_journal_whole(&db.pool).await;
}

/// Found by the benchmark on 2 M loans: statistics taken while the loans were still unsettled say
/// the index of settled loans without an entry is empty, and the planner joined a batch's ids to
/// that index in a nested loop: each of a batch's loans compared with each of the others, one
/// `migrate` batch of 100,000 ran for minutes. The batch's ids are now one array, the loans found
/// by id, with the plan pinned: no join whatever the statistics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_entries_find_each_loan_by_id_even_with_statistics_from_before_the_loans_were_settled(
) {
    let db = test_db().await;
    sql(
        &db.pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i, 1, 1, '2026-09-20', '2026-10-01', '2026-10-02'::date + i % 20
           FROM generate_series(1, 20000) i",
    )
    .await;
    sql(&db.pool, "ANALYZE loans").await;
    // Settled by an earlier release (no journal entry); the statistics still say unsettled.
    sql(
        &db.pool,
        "UPDATE loans SET fine_cents = (returned_on - due_on) * 10, fine_settled_at = now()",
    )
    .await;

    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query(fine_settlement::journal::PIN_OPENING)
        .execute(&mut *tx)
        .await
        .unwrap();
    let plan: Vec<String> = sqlx::query_scalar(&format!(
        "EXPLAIN {}",
        fine_settlement::journal::opening_statement()
    ))
    .bind(10_000_i64)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    let plan = plan.join("\n");
    assert!(
        !plan.contains("Nested Loop") && !plan.contains("Join"),
        "the batch's loans are joined, not looked up by id:\n{plan}"
    );
    assert!(plan.contains("Index Cond: (id = ANY"), "{plan}");

    let mut opened = 0;
    loop {
        let n = fine_settlement::journal::open_unjournaled(&mut conn, 10_000)
            .await
            .unwrap();
        opened += n;
        if n < 10_000 {
            break;
        }
    }
    assert_eq!(opened, 20_000);
    assert_eq!(
        count(
            &db.pool,
            "SELECT count(*) FROM fine_journal_entries WHERE kind = 'opening'"
        )
        .await,
        20_000
    );
    assert_journal_whole(&db.pool).await;
}

/// Before, there was no journal: a loan settled by an older binary during a rolling upgrade was
/// like every other, and nothing could tell it had no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_gives_a_loan_an_older_binary_settled_its_opening_entry() {
    let db = test_db().await;
    settled_month(&db).await;
    // An older replica, mid-upgrade, settles a late return its way: no entry, no fine_seq.
    sql(
        &db.pool,
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents,
                            fine_settled_at)
         VALUES (100000, 1, 1, '2026-09-20', '2026-10-02', '2026-10-12', 500, now())",
    )
    .await;
    let (_, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(
        report["journal"]["unjournaled"],
        serde_json::json!({"count": 1, "ids": [100000]}),
        "{report}"
    );
    let clock = ManualClock::new(shanghai(2026, 11, 5, 10, 0, 0));
    let mut r = replica(&db.pool, &settings(&[]), &clock);
    r.tick().await;
    assert_eq!(
        entries(&db.pool, 100_000).await,
        [(1, "opening".to_string(), day("2026-10-01"), None, 500)]
    );
    assert_eq!(loan(&db.pool, 100_000).await, (500, true, Some(1)));
    assert_verified(&db.url, &[], "2026-10-31");
    assert_journal_whole(&db.pool).await;
}

/// Before, a settled loan whose due date libraryd made unpriceable kept the fine of a due date it
/// no longer had, and its fix went unnoticed as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_due_date_made_infinite_is_reversed_held_and_settled_once_fixed() {
    let db = test_db().await;
    let month = "2026-10-31";
    insert_loan(&db.pool, 1, "2026-10-05", Some("2026-10-10")).await;
    insert_loan(&db.pool, 2, "2026-10-01", Some("2026-10-03")).await;
    run_ok_json(&db.url, &[], month, 0, 1);
    sql(
        &db.pool,
        "UPDATE loans SET due_on = 'infinity' WHERE id = 1",
    )
    .await;

    let report = run_ok_json(&db.url, &[], month, 0, 1);
    assert_eq!(report["updated"], 1, "{report}");
    assert_eq!(loan(&db.pool, 1).await, (0, false, Some(2)));
    let (code, report) = verify(&db.url, &[], month);
    assert_eq!(code, Some(6), "the money right, a row held: {report}");
    assert_eq!(report["held"], serde_json::json!({"count": 1, "ids": [1]}));
    // Held, it does not re-open the month at every run.
    assert_eq!(run_ok_json(&db.url, &[], month, 0, 1)["skipped"], true);

    // libraryd fixes it: the next run settles it as a late return.
    sql(
        &db.pool,
        "UPDATE loans SET due_on = '2026-10-04' WHERE id = 1",
    )
    .await;
    let report = run_ok_json(&db.url, &[], month, 0, 1);
    assert_eq!(
        (report["late_returns"].as_u64(), report["updated"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    assert_eq!(
        entries(&db.pool, 1).await,
        [
            entry(1, "settled", "2026-10-01", 0, 250),
            entry(2, "reversed", "2026-10-01", 250, 0),
            entry(3, "late", "2026-10-01", 0, 300),
        ]
    );
    assert_verified(&db.url, &[], month);
    assert_journal_whole(&db.pool).await;
}

/// Fault campaign seed 1018 (`cargo run --release --bin campaign -- --seed 1018 --schedules 1`):
/// libraryd moved a settled loan's due date without changing its fine (returned before either
/// date), then a correction of the month took the edit from the queue. A correction writes only
/// the fines it changes, and this edit was dequeued without an entry: the journal kept the old
/// dates, and verify called the month wrong for good. An edit is now always written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_that_leaves_the_fine_as_it_was_is_journaled_by_the_correction_that_takes_it() {
    let db = test_db().await;
    let month = "2026-10-31";
    insert_loan(&db.pool, 1, "2026-10-20", Some("2026-10-10")).await;
    insert_loan(&db.pool, 2, "2026-10-05", Some("2026-10-10")).await;
    run_ok_json(&db.url, &[(RATE, "40")], month, 0, 1);
    assert_eq!(loan(&db.pool, 1).await, (0, true, Some(1)));
    sql(
        &db.pool,
        "UPDATE loans SET due_on = '2026-10-25' WHERE id = 1",
    )
    .await;

    let out = correct(&db.url, &[], month, "RATE-50", "the rate is 50");
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let dates: (NaiveDate, i64) = sqlx::query_as(
        "SELECT due_on, after_cents FROM fine_journal_entries WHERE loan_id = 1
          ORDER BY seq DESC LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        dates,
        (day("2026-10-25"), 0),
        "the journal follows the new due date"
    );
    assert_eq!(loan(&db.pool, 1).await, (0, true, Some(2)));
    assert_eq!(
        loan(&db.pool, 2).await,
        (250, true, Some(2)),
        "re-priced at 50"
    );
    assert_eq!(
        count(&db.pool, "SELECT count(*) FROM loan_changes").await,
        0
    );
    assert_verified(&db.url, &[], month);
    assert_journal_whole(&db.pool).await;
}

/// Found by the fault suite (`fault_a_correction_killed_at_random_moments_…`, with 19 000 edits
/// queued: its correction went from 3 s to 97 s): a batch of queued edits found its loans by
/// joining the month's queued loans to every edit of theirs, which the batch's pinned plans (no
/// hash or merge join) ran as a nested loop over the whole month's queue for every batch: the
/// queue's cost grew with its square, and a large enough edit of libraryd's would have run every
/// batch into its statement timeout, for ever. A batch now reads the queue's indexes for about as
/// many entries as it takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_queued_edits_reads_about_what_it_takes_not_the_whole_queue() {
    let db = test_db().await;
    let month = bd("2026-10-31");
    seed_month_alone(&db.pool, month, 6_000, 1).await;
    for shard in 0..3 {
        run_ok_json(&db.url, &[], "2026-10-31", shard, 3);
    }
    sql(
        &db.pool,
        "UPDATE loans SET due_on = due_on - 1 WHERE fine_settled_at IS NOT NULL",
    )
    .await;
    // With statistics, as in production (autovacuum analyzes a queue this size).
    sql(&db.pool, "ANALYZE loan_changes").await;
    let waiting = count(&db.pool, "SELECT count(*) FROM loan_changes").await;
    assert!(waiting > 5_000, "{waiting}");

    let by = fine_settlement::journal::Repricer {
        month: month.first_day(),
        business_date: month.date(),
        shards: 3,
        shard: 0,
        rule: FineRule::default(),
        attempt: 1,
        correction_key: None,
    };
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn
        .begin_with(fine_settlement::BEGIN_BATCH.to_string())
        .await
        .unwrap();
    let batch = fine_settlement::journal::reprice(
        &mut tx,
        &by,
        fine_settlement::journal::Source::Queue { limit: 10 },
    )
    .await
    .unwrap();
    assert_eq!((batch.loans, batch.priced), (10, 10));
    // Index entries of loan_changes this transaction's scans returned.
    let read: i64 = sqlx::query_scalar(
        "SELECT sum(pg_stat_get_xact_tuples_returned(indexrelid))::bigint
           FROM pg_index WHERE indrelid = 'loan_changes'::regclass",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert!(
        read < 200,
        "a batch of 10 read {read} index entries of a queue of {waiting}"
    );
}

/// Before, a loan whose return was undone (reversed, unsettled) and which libraryd then deleted
/// kept `verify` at "not right" for ever: an unsettled loan's deletion is not queued, so no
/// deletion entry follows its reversal, and the vanished loan counted as a broken chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_deleted_after_its_return_was_undone_leaves_its_month_right() {
    let db = test_db().await;
    insert_loan(&db.pool, 3, "2026-10-01", Some("2026-10-21")).await;
    insert_loan(&db.pool, 4, "2026-10-01", Some("2026-10-11")).await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    sql(&db.pool, "UPDATE loans SET returned_on = NULL WHERE id = 3").await;
    run_ok_json(&db.url, &[], "2026-10-31", 0, 1);
    assert_eq!(loan(&db.pool, 3).await, (0, false, Some(2)));
    sql(&db.pool, "DELETE FROM loans WHERE id = 3").await;
    assert_verified(&db.url, &[], "2026-10-31");
    assert_journal_whole(&db.pool).await;
    // A settled loan deleted behind settlementd's back (its trigger disabled by the table's owner)
    // is still broken.
    sqlx::raw_sql(
        "ALTER TABLE loans DISABLE TRIGGER settlementd_settled_deleted;
         DELETE FROM loans WHERE id = 4;
         ALTER TABLE loans ENABLE ALWAYS TRIGGER settlementd_settled_deleted",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let (code, report) = verify(&db.url, &[], "2026-10-31");
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["broken"],
        serde_json::json!({"count": 1, "ids": [4]}),
        "{report}"
    );
}

/// After runs under faults on `chaos` of what clean runs settled on `clean`: the journal is whole
/// and holds one `settled` entry per settled loan, entry for entry the clean journal.
pub async fn assert_settled_once(chaos: &PgPool, clean: &PgPool) {
    assert_journal_whole(chaos).await;
    assert_same_journal(chaos, clean).await;
    assert_eq!(
        entries_by_kind(chaos).await,
        [("settled".to_string(), settled_count(clean).await)]
    );
}

/// A loan that becomes known to the journal between the read-ahead of a fresh page (no loan of it
/// had a head) and that page's batch: libraryd re-creates a settled September loan under its id,
/// returned in October, inside the page's id range, while the batch before it settles. The batch
/// settles the page as a known one (the loan's September money reversed, its October fine
/// continuing its head), in the same attempt. Before, the fresh statement met the loan's head at
/// the heads' primary key and the attempt was marked FAILED ("duplicate key value violates unique
/// constraint fine_heads_pkey"), to be retried with backoff (seen in the campaign, seed 9).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_known_after_its_fresh_page_was_read_is_settled_in_the_same_attempt() {
    let db = test_db().await;
    let (sep, oct) = (bd("2026-09-30"), bd("2026-10-31"));
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (75, 10, 1, '2026-08-20', '2026-09-01', '2026-09-20')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    assert_eq!(settle_shards(&db.pool, sep, 1, 50).await, 1);
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i, i % 7, 1, '2026-09-20', '2026-10-01', '2026-10-01'::date + (i % 28)::int
           FROM generate_series(1, 200) AS i WHERE i <> 75",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    // Each batch's two loan statements take 1.5 s each: the first batch's page (ids 1..50) runs
    // 3 s, while the second page (51..100) was read ahead at its start, before the re-creation.
    slow_updates(&db.pool, 1.5).await;
    let pool = db.pool.clone();
    let run = tokio::spawn(async move { settle_shards(&pool, oct, 1, 50).await });
    assert!(
        eventually(20, || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM job_runs WHERE business_date = '2026-10-31'
                   AND status = 'RUNNING'",
            )
            .fetch_one(&db.pool)
            .await
            .unwrap()
                == 1
        })
        .await,
        "October's run claimed"
    );
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query("DELETE FROM loans WHERE id = 75")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         VALUES (75, 99, 1, '2026-09-20', '2026-10-01', '2026-10-12')",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let updated = run.await.expect("October's run, one attempt");
    assert_eq!(
        updated, 200,
        "every October loan settled, the re-created one among them"
    );
    let trail: Vec<(String, Option<i32>)> = sqlx::query_as(
        "SELECT event, attempt FROM job_events WHERE business_date = '2026-10-31' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        trail,
        [
            ("claimed".to_string(), Some(1)),
            ("succeeded".to_string(), Some(1))
        ],
        "one attempt, claimed and succeeded"
    );
    no_slow_updates(&db.pool).await;
    let (settled, fine): (bool, i64) = sqlx::query_as(
        "SELECT fine_settled_at IS NOT NULL, fine_cents::bigint FROM loans WHERE id = 75",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(settled && fine > 0, "loan 75 settled in October: {fine}");
    assert_journal_whole(&db.pool).await;
    for month in ["2026-09-30", "2026-10-31"] {
        assert_verified(&db.url, &[], month);
    }
    drop_db(db).await;
}
