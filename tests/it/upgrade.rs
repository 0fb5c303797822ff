//! Upgrades and rollbacks: this release beside the previous one, against one database.
//!
//! A migration is a message to the release before it, which keeps running beside the new one
//! during every rolling update and again after a rollback. The mixed-fleet test runs the previous
//! release's real binary (built from this repository's history by `.ci/previous-release`, or
//! named by `SETTLEMENTD_PREVIOUS_BIN`) and this one's as a fleet of three shards: the old fleet
//! settles, this release's `migrate` runs under it, replicas are replaced one by one while months
//! become due and libraryd keys late returns and edits a settled loan, replicas of either release
//! are killed mid-run and taken over by the other, then the fleet rolls back and upgrades again.
//! Every loan is then checked against an oracle written here (the fine's formula, applied to the
//! loan's dates), the money journal's chain of every loan, the member statements, and `verify` of
//! every month.
//!
//! The other tests here are the migration ledger's and the pin's, which need no other binary.

use crate::helpers::*;
use chrono::NaiveDate;
use sqlx::{Connection, PgPool};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

const SHARDS: u32 = 3;
/// This release, as it records itself with its claims and in `replicas`.
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The previous release (`.ci/previous-release`), as it records itself with its claims.
const PREVIOUS_VERSION: &str = "0.2.0";
/// The default rule of both releases: 50 cents a day late, no grace, at most 10,000 cents.
const RATE: i64 = 50;
const CAP: i64 = 10_000;

fn date(text: &str) -> NaiveDate {
    NaiveDate::parse_from_str(text, "%Y-%m-%d").unwrap()
}

/// The oracle: a loan's fine from its dates under the default rule, written without settlementd.
fn oracle_fine(due_on: NaiveDate, returned_on: NaiveDate) -> i64 {
    ((returned_on - due_on).num_days().max(0) * RATE).min(CAP)
}

// --- the migration ledger ---------------------------------------------------------------------

#[tokio::test]
async fn a_migration_recorded_by_a_newer_release_is_accepted_and_an_unknown_older_one_refused() {
    let db = test_db().await;
    // What a newer release leaves behind: migrations after every one this binary knows, in both
    // ledgers (the newer release records its own in settlementd_migrations).
    sqlx::query(
        "INSERT INTO settlementd_migrations (version, description, checksum, execution_time, release)
         VALUES (99991231000001, 'a newer release''s table', '\\x00', 0, '99.0.0')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = cli(&db.url, &[], &["migrate"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        said.contains("the schema is current: all"),
        "migrate says it applied nothing: {said}"
    );
    assert!(settlementd::db::schema_is_current(&db.pool).await.unwrap());

    // A version this binary does not know, older than its newest: a history it does not share.
    sqlx::query(
        "INSERT INTO settlementd_migrations (version, description, checksum, execution_time, release)
         VALUES (20261130000000, 'not in this history', '\\x00', 0, '0.0.0')",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let out = cli(&db.url, &[], &["migrate"]);
    assert!(!out.status.success());
    assert!(
        stderr_of(&out).contains("20261130000000"),
        "the refusal names the version: {}",
        stderr_of(&out)
    );
}

#[tokio::test]
async fn migrations_after_the_sqlx_ledger_are_recorded_where_the_previous_release_never_reads() {
    let (_name, url) = empty_db().await;
    let out = cli(&url, &[], &["migrate"]);
    assert!(out.status.success(), "{}", stderr_of(&out));
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    let embedded: Vec<i64> = settlementd::db::embedded().map(|m| m.version).collect();
    assert!(
        said.starts_with(&format!("applied {} migrations:", embedded.len())),
        "migrate lists what it applied: {said}"
    );
    for version in &embedded {
        assert!(said.contains(&version.to_string()), "{version} in {said}");
    }
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let in_sqlx: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    let in_ours: Vec<i64> =
        sqlx::query_scalar("SELECT version FROM settlementd_migrations ORDER BY version")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    let last = settlementd::db::migrations::SQLX_LEDGER_LAST;
    assert!(in_sqlx.iter().all(|v| *v <= last), "{in_sqlx:?}");
    assert!(in_ours.iter().all(|v| *v > last), "{in_ours:?}");
    let mut all: Vec<i64> = in_sqlx.iter().chain(&in_ours).copied().collect();
    all.sort();
    assert_eq!(all, embedded, "every migration in exactly one ledger");
    conn.close().await.unwrap();
}

// --- pins -------------------------------------------------------------------------------------

#[tokio::test]
async fn a_pin_recorded_with_its_from_by_an_older_release_is_the_same_rule_and_another_rate_is_not()
{
    let db = test_db().await;
    seed_month_alone(&db.pool, bd("2026-06-30"), 30, 1).await;
    seed_month_alone(&db.pool, bd("2026-07-31"), 30, 1001).await;
    // As releases up to 4b79e14 pinned a month: the rule with when it starts.
    let pin = |month: &str, rate: i64| {
        sqlx::query(
            "INSERT INTO job_params (job_name, business_date, params, pinned_by)
             VALUES ('fine-settlement', $1, $2, 'host/1-4b79e14')",
        )
        .bind(date(month))
        .bind(serde_json::json!({
            "from": "0001-01", "daily_rate_cents": rate, "grace_days": 0, "max_cents": CAP
        }))
    };
    pin("2026-06-30", RATE).execute(&db.pool).await.unwrap();
    pin("2026-07-31", RATE + 10)
        .execute(&db.pool)
        .await
        .unwrap();

    let june = cli(&db.url, &[], &["run", "--business-date", "2026-06-30"]);
    assert!(june.status.success(), "{}", stderr_of(&june));
    assert_verified(&db.url, &[], "2026-06-30");

    let july = cli(&db.url, &[], &["run", "--business-date", "2026-07-31"]);
    assert_eq!(july.status.code(), Some(3), "{}", stderr_of(&july));
    let refusal = stderr_of(&july);
    assert!(
        refusal.contains("pinned to 60 cents a day") && refusal.contains("is 50 cents a day"),
        "the refusal names both rules: {refusal}"
    );
}

// --- the mixed fleet --------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// The previous release (`.ci/previous-release`).
    Previous,
    /// This one.
    This,
}

fn previous_release() -> PathBuf {
    let bin = std::env::var_os("SETTLEMENTD_PREVIOUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/previous-release/settlementd")
        });
    assert!(
        bin.is_file(),
        "the previous release's binary is not at {} (build it with .ci/previous-release, or name \
         one with SETTLEMENTD_PREVIOUS_BIN)",
        bin.display()
    );
    bin
}

fn binary(release: Release) -> PathBuf {
    match release {
        Release::Previous => previous_release(),
        Release::This => PathBuf::from(env!("CARGO_BIN_EXE_settlementd")),
    }
}

/// The settings both releases run with (the same names in both), for shard `shard`.
fn replica_env(shard: u32) -> Vec<(String, String)> {
    [
        ("SETTLEMENTD__SHARD__INDEX", shard.to_string()),
        ("SETTLEMENTD__SHARD__COUNT", SHARDS.to_string()),
        ("SETTLEMENTD__LEASE__TTL_SECS", "3".into()),
        ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1".into()),
        ("SETTLEMENTD__RETRY__INITIAL_SECS", "1".into()),
        ("SETTLEMENTD__RETRY__MAX_SECS", "2".into()),
        ("SETTLEMENTD__BATCH__SIZE", "40".into()),
        ("SETTLEMENTD__DATABASE__MAX_CONNECTIONS", "4".into()),
        // What deploy/ ships: replicas never migrate; `settlementd migrate` does, first.
        ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

struct Replica {
    process: ServeProcess,
    release: Release,
}

/// Three shards, each served by a replica of one release or the other.
struct Fleet {
    url: String,
    logs: tempfile::TempDir,
    replicas: BTreeMap<u32, Replica>,
}

impl Fleet {
    fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            logs: tempfile::Builder::new()
                .prefix("settlementd-upgrade-")
                .tempdir()
                .unwrap(),
            replicas: BTreeMap::new(),
        }
    }

    fn log(&self, shard: u32) -> PathBuf {
        self.logs.path().join(format!("shard-{shard}.log"))
    }

    /// Starts a replica of `release` for `shard`, and waits until it is ready.
    async fn start(&mut self, shard: u32, release: Release, extra: &[(&str, &str)]) {
        assert!(!self.replicas.contains_key(&shard), "shard {shard} runs");
        let mut env = replica_env(shard);
        env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let process =
            ServeProcess::start_binary(&binary(release), &self.url, &env, &self.log(shard));
        let replica = Replica { process, release };
        self.replicas.insert(shard, replica);
        self.assert_ready(shard).await;
    }

    async fn assert_ready(&self, shard: u32) {
        let replica = &self.replicas[&shard];
        let mut last = (0, String::new());
        for _ in 0..300 {
            if let Ok(answer) = get(replica.process.addr, "/readyz").await {
                if answer.0 == 200 {
                    return;
                }
                last = answer;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "the {:?} release's replica of shard {shard} is not ready: {last:?}\n{}",
            replica.release,
            self.tail(shard)
        );
    }

    async fn assert_all_ready(&self) {
        for shard in self.replicas.keys() {
            self.assert_ready(*shard).await;
        }
    }

    /// The last lines of `shard`'s log, for a failure's message.
    fn tail(&self, shard: u32) -> String {
        let text = std::fs::read_to_string(self.log(shard)).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Stops `shard`'s replica as an orchestrator does (SIGTERM, then waits for it).
    fn stop(&mut self, shard: u32) {
        let replica = self
            .replicas
            .remove(&shard)
            .expect("a replica of the shard");
        drop(replica.process);
    }

    /// SIGKILLs `shard`'s replica.
    fn kill(&mut self, shard: u32) {
        let mut replica = self
            .replicas
            .remove(&shard)
            .expect("a replica of the shard");
        replica.process.child.kill().unwrap();
        replica.process.child.wait().unwrap();
        std::mem::forget(replica.process);
    }

    /// Replaces `shard`'s replica by one of `release`.
    async fn replace(&mut self, shard: u32, release: Release, extra: &[(&str, &str)]) {
        self.stop(shard);
        self.start(shard, release, extra).await;
    }
}

/// Loans numbered from `*next`, `per_shard` of each of `shards`, returned over `month` (its first
/// day, as text): late from -10 to 40 days, members 1–40. Returns their ids.
async fn key_loans(
    pool: &PgPool,
    next: &mut i64,
    month: &str,
    shards: &[u32],
    per_shard: i64,
) -> Vec<i64> {
    let first = *next;
    let mut ids = Vec::new();
    let mut id = first;
    while ids.len() < (per_shard * shards.len() as i64) as usize {
        if shards.contains(&((id % i64::from(SHARDS)) as u32)) {
            ids.push(id);
        }
        id += 1;
    }
    *next = id;
    sqlx::query(
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
         SELECT i, 1 + i % 40, i % 97, r - 30 - ((i * 7) % 51 - 10)::int, r - ((i * 7) % 51 - 10)::int, r
           FROM (SELECT i, $1::date + ((i * 13) % 28)::int AS r FROM unnest($2::bigint[]) AS i) s",
    )
    .bind(date(month))
    .bind(&ids)
    .execute(pool)
    .await
    .unwrap();
    ids
}

/// Nothing waits: every return settled, no edit queued, every claim SUCCESS, and every member's
/// statement what the loans say.
async fn at_rest(pool: &PgPool) -> Result<(), String> {
    let (unsettled, queued, open): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM loans WHERE returned_on IS NOT NULL AND fine_settled_at IS NULL),
                (SELECT count(*) FROM loan_changes),
                (SELECT count(*) FROM job_runs WHERE status <> 'SUCCESS')",
    )
    .fetch_one(pool)
    .await
    .map_err(|e| e.to_string())?;
    if unsettled + queued + open > 0 {
        return Err(format!(
            "{unsettled} returns unsettled, {queued} edits queued, {open} claims not SUCCESS"
        ));
    }
    statements_match(pool).await
}

async fn wait_at_rest(pool: &PgPool, fleet: &Fleet, what: &str) {
    let rested = eventually(120, || async { at_rest(pool).await.is_ok() }).await;
    if !rested {
        let last = at_rest(pool).await.err().unwrap_or_default();
        type Claim = (String, NaiveDate, i32, i32, String, i32, Option<String>);
        let claims: Vec<Claim> = sqlx::query_as(
            "SELECT job_name, business_date, shards, shard, status, attempt, last_error FROM job_runs
                  WHERE status <> 'SUCCESS' ORDER BY 2, 4",
        )
        .fetch_all(pool)
        .await
        .unwrap();
        let logs: Vec<String> = fleet.replicas.keys().map(|s| fleet.tail(*s)).collect();
        panic!(
            "{what}: never at rest: {last}\nopen claims: {claims:#?}\nlogs:\n{}",
            logs.join("\n---\n")
        );
    }
}

/// Each member's statement of each month equals the sum of the member's fines above 0 there.
async fn statements_match(pool: &PgPool) -> Result<(), String> {
    let differ: Vec<(NaiveDate, i64, Option<i64>, Option<i64>)> = sqlx::query_as(
        "WITH truth AS (
             SELECT (date_trunc('month', returned_on) + interval '1 month - 1 day')::date AS month,
                    member_id, count(*) AS fines, sum(fine_cents)::bigint AS cents
               FROM loans WHERE fine_settled_at IS NOT NULL AND fine_cents > 0
              GROUP BY 1, 2)
         SELECT COALESCE(t.month, s.business_date), COALESCE(t.member_id, s.member_id),
                t.cents, s.fine_cents::bigint
           FROM truth t
           FULL JOIN member_fine_statements s
             ON s.business_date = t.month AND s.member_id = t.member_id
          WHERE t.cents IS DISTINCT FROM s.fine_cents::bigint OR t.fines IS DISTINCT FROM s.fines
          LIMIT 5",
    )
    .fetch_all(pool)
    .await
    .map_err(|e| e.to_string())?;
    if differ.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "member statements differ from the loans (month, member, truth, stated): {differ:?}"
        ))
    }
}

/// Every loan against the oracle, every loan's journal chain, and `verify` of every month.
async fn assert_every_month_right(pool: &PgPool, url: &str) {
    let loans: Vec<(i64, NaiveDate, NaiveDate, i64, Option<i32>)> = sqlx::query_as(
        "SELECT id, due_on, returned_on, fine_cents, fine_seq FROM loans
          WHERE returned_on IS NOT NULL ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let wrong: Vec<_> = loans
        .iter()
        .filter(|(_, due, ret, fine, _)| *fine != oracle_fine(*due, *ret))
        .take(5)
        .collect();
    assert!(
        wrong.is_empty(),
        "fines the oracle disagrees with: {wrong:?}"
    );
    // The journal: each loan's entries numbered 1, 2, 3…, each one's before the previous one's
    // after, the last one's after the loan's fine; settled exactly once.
    let entries: Vec<(i64, i32, String, Option<i64>, i64)> = sqlx::query_as(
        "SELECT loan_id, seq, kind, before_cents, after_cents FROM fine_journal_entries
          ORDER BY loan_id, seq",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    type Entry = (i32, String, Option<i64>, i64);
    let mut chains: BTreeMap<i64, Vec<Entry>> = BTreeMap::new();
    for (loan, seq, kind, before, after) in entries {
        chains
            .entry(loan)
            .or_default()
            .push((seq, kind, before, after));
    }
    for (id, _, _, fine, seq) in &loans {
        let chain = chains
            .get(id)
            .unwrap_or_else(|| panic!("loan {id} has no journal entry"));
        let settled = chain
            .iter()
            .filter(|e| e.1 == "settled" || e.1 == "late")
            .count();
        assert_eq!(settled, 1, "loan {id} settled once: {chain:?}");
        for (n, entry) in chain.iter().enumerate() {
            assert_eq!(entry.0, n as i32 + 1, "loan {id}'s seqs: {chain:?}");
            if n > 0 {
                assert_eq!(
                    entry.2,
                    Some(chain[n - 1].3),
                    "loan {id}'s chain: {chain:?}"
                );
            }
        }
        assert_eq!(chain.last().unwrap().3, *fine, "loan {id}: {chain:?}");
        assert_eq!(*seq, Some(chain.len() as i32), "loan {id}'s fine_seq");
    }
    let months: Vec<NaiveDate> = sqlx::query_scalar(
        "SELECT DISTINCT (date_trunc('month', returned_on) + interval '1 month - 1 day')::date
           FROM loans WHERE returned_on IS NOT NULL ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for month in months {
        assert_verified(url, &[], &month.to_string());
    }
}

/// Makes the batch that settles loan `id` wait, inside its transaction and after its rows are
/// written, while the test holds advisory lock `key` (whatever the release's statements say).
async fn gate_on(pool: &PgPool, id: i64, key: i64) -> sqlx::PgConnection {
    sqlx::query(&format!(
        "CREATE OR REPLACE FUNCTION upgrade_gate() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_advisory_xact_lock({key}); RETURN NULL; END $$"
    ))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(&format!(
        "CREATE TRIGGER upgrade_gate AFTER UPDATE ON loans FOR EACH ROW
         WHEN (NEW.id = {id} AND OLD.fine_settled_at IS NULL AND NEW.fine_settled_at IS NOT NULL)
         EXECUTE FUNCTION upgrade_gate()"
    ))
    .execute(pool)
    .await
    .unwrap();
    let mut holder = pool.acquire().await.unwrap().detach();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut holder)
        .await
        .unwrap();
    holder
}

/// Waits for a batch at the gate, SIGKILLs `shard`'s replica, ends the batch's backend (as the
/// server does on finding the connection gone: it never commits) and opens the gate.
async fn kill_at_the_gate(
    pool: &PgPool,
    fleet: &mut Fleet,
    shard: u32,
    holder: sqlx::PgConnection,
) {
    let waiting = || async {
        sqlx::query_scalar::<_, Option<i32>>(
            "SELECT max(pid) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event = 'advisory'",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    };
    assert!(
        eventually(60, || async { waiting().await.is_some() }).await,
        "no batch of shard {shard} reached the gate\n{}",
        fleet.tail(shard)
    );
    let release = fleet.replicas[&shard].release;
    fleet.kill(shard);
    let backend = waiting().await.unwrap();
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(backend)
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("DROP TRIGGER upgrade_gate ON loans")
        .execute(pool)
        .await
        .unwrap();
    holder.close().await.unwrap();
    let running: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM job_runs WHERE status = 'RUNNING' AND shard = $1
            AND job_name = 'fine-settlement'",
    )
    .bind(shard as i32)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        running, 1,
        "the {release:?} release's killed run left its claim RUNNING"
    );
}

/// The claims' attempts of `month` as (shard, attempt, status).
async fn claims_of(pool: &PgPool, month: &str) -> Vec<(i32, i32, String)> {
    sqlx::query_as(
        "SELECT shard, attempt, status FROM job_runs
          WHERE job_name = 'fine-settlement' AND business_date = $1 ORDER BY shard",
    )
    .bind(date(month))
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The release recorded with the current attempt of `month`'s claim of `shard` (`None`: a release
/// before 0.2.0 made it).
async fn version_of(pool: &PgPool, month: &str, shard: i32) -> Option<String> {
    sqlx::query_scalar(
        "SELECT version FROM job_runs
          WHERE job_name = 'fine-settlement' AND business_date = $1 AND shard = $2",
    )
    .bind(date(month))
    .bind(shard)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// `status --json` of `month` by this release: what an operator reads.
fn status_of(url: &str, month: &str) -> serde_json::Value {
    let out = run_ok(settlementd_at(&binary(Release::This), Some(url)).args([
        "status",
        "--business-date",
        month,
        "--shards",
        "3",
        "--json",
    ]));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Who pinned `month` (the `pinned_by` owner) and the pin.
async fn pin_of(pool: &PgPool, month: &str) -> Option<serde_json::Value> {
    sqlx::query_scalar(
        "SELECT params FROM job_params WHERE job_name = 'fine-settlement' AND business_date = $1",
    )
    .bind(date(month))
    .fetch_optional(pool)
    .await
    .unwrap()
}

async fn settled_of(pool: &PgPool, month: &str, shard: u32) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE fine_settled_at IS NOT NULL), count(*) FROM loans
          WHERE returned_on >= $1::date AND returned_on < $1::date + interval '1 month'
            AND id % 3 = $2",
    )
    .bind(date(month))
    .bind(i64::from(shard))
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
#[ignore = "needs the previous release's binary (.ci/previous-release); run by .ci/run"]
async fn a_rolling_upgrade_from_the_previous_release_and_a_rollback_settle_every_month_once() {
    let previous = previous_release();
    // PostgreSQL's default search path, as a real database has: the previous release finds
    // settlementd's tables in public (then, after this release's migrate, the views it keeps
    // there); this release sets its own path.
    let (_name, url) = bare_db().await;
    // The database as the previous release made it.
    run_ok(settlementd_at(&previous, Some(&url)).arg("migrate"));
    // The test reads settlementd's tables wherever they are: in settlementd's schema once it
    // exists, in public before.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(&mut *conn, settlementd::db::SEARCH_PATH_SQL).await?;
                Ok(())
            })
        })
        .connect(&url)
        .await
        .unwrap();
    let mut next_id = 1;
    let mut fleet = Fleet::new(&url);

    // 1. The old fleet settles three months.
    for month in ["2026-07-01", "2026-08-01", "2026-09-01"] {
        key_loans(&pool, &mut next_id, month, &[0, 1, 2], 60).await;
    }
    for shard in 0..SHARDS {
        fleet.start(shard, Release::Previous, &[]).await;
    }
    wait_at_rest(&pool, &fleet, "the previous release's fleet").await;

    // 2. This release's migrate, under the running old fleet, which stays ready and keeps working.
    run_ok(settlementd_at(&binary(Release::This), Some(&url)).arg("migrate"));
    fleet.assert_all_ready().await;
    // A month pinned by a release before the previous one (4b79e14 pinned the rule with when it
    // starts, `from`), as during its own rolling update after 0d20be2's migrate: the previous
    // release compares pins exactly and refuses it; this one compares the rule's identity.
    key_loans(&pool, &mut next_id, "2026-06-01", &[0, 1, 2], 20).await;
    sqlx::query(
        "INSERT INTO job_params (job_name, business_date, params, pinned_by)
         VALUES ('fine-settlement', '2026-06-30', $1, 'libraryd-7/1-4b79e14')",
    )
    .bind(serde_json::json!({
        "from": "0001-01", "daily_rate_cents": RATE, "grace_days": 0, "max_cents": CAP
    }))
    .execute(&pool)
    .await
    .unwrap();
    // October becomes due on shard 1 alone: the old fleet claims it first, and pins it.
    key_loans(&pool, &mut next_id, "2026-10-01", &[1], 30).await;
    assert!(
        eventually(60, || async {
            settled_of(&pool, "2026-10-01", 1).await.0 == 30
        })
        .await,
        "the old replica of shard 1 settles October past June's refusal\n{}",
        fleet.tail(1)
    );
    assert!(pin_of(&pool, "2026-10-31").await.is_some());

    // 3. The rolling update, one replica at a time.
    fleet.replace(0, Release::This, &[]).await;
    // November becomes due on shard 0 alone: this release claims it first and pins it; then on
    // the old shards, whose claims compare with that pin; October's other shards too.
    key_loans(&pool, &mut next_id, "2026-11-01", &[0], 30).await;
    assert!(
        eventually(60, || async {
            settled_of(&pool, "2026-11-01", 0).await.0 == 30
        })
        .await,
        "this release's replica of shard 0 settles November\n{}",
        fleet.tail(0)
    );
    key_loans(&pool, &mut next_id, "2026-11-01", &[1, 2], 30).await;
    key_loans(&pool, &mut next_id, "2026-10-01", &[0, 2], 30).await;
    for shard in [1, 2] {
        assert!(
            eventually(60, || async {
                settled_of(&pool, "2026-11-01", shard).await.0 == 30
            })
            .await,
            "the old replica of shard {shard} settles November under this release's pin\n{}",
            fleet.tail(shard)
        );
    }
    // Late returns into a month the old fleet closed, and libraryd's edit of a settled loan.
    key_loans(&pool, &mut next_id, "2026-08-01", &[0, 1, 2], 5).await;
    sqlx::query(
        "UPDATE loans SET returned_on = returned_on + 1
          WHERE id IN (SELECT id FROM loans WHERE returned_on BETWEEN '2026-07-01' AND '2026-07-20'
                        ORDER BY id LIMIT 3)",
    )
    .execute(&pool)
    .await
    .unwrap();
    // An old replica killed mid-run: this release's replica of its shard takes the claim over.
    // Shard 2 walks its month up from the lowest id: the gate is in its second batch of 40.
    let may = key_loans(&pool, &mut next_id, "2026-05-01", &[2], 200).await;
    let holder = gate_on(&pool, may[50], 8_331).await;
    kill_at_the_gate(&pool, &mut fleet, 2, holder).await;
    fleet.start(2, Release::This, &[]).await;
    fleet.replace(1, Release::This, &[]).await;
    wait_at_rest(&pool, &fleet, "the upgraded fleet").await;
    let may = claims_of(&pool, "2026-05-31").await;
    assert!(
        may.iter()
            .any(|(shard, attempt, _)| *shard == 2 && *attempt >= 2),
        "May's shard 2 was taken over: {may:?}"
    );
    assert_every_month_right(&pool, &url).await;
    // Who did what, as `status` shows it: the take-over by this release, and the claims the old
    // fleet made (its release recorded), beside the replicas that report.
    assert_eq!(
        version_of(&pool, "2026-05-31", 2).await.as_deref(),
        Some(VERSION)
    );
    let september = status_of(&url, "2026-09-30");
    for run in september["runs"].as_array().unwrap() {
        assert_eq!(run["version"], PREVIOUS_VERSION, "{september}");
    }
    let ready_on = |status: &serde_json::Value| -> Vec<String> {
        status["replicas"]
            .as_array()
            .into_iter()
            .flatten()
            // Live ones: a killed replica's row stays until it is a day old.
            .filter(|r| r["ready"] == true && r["seen_age_secs"].as_f64().unwrap_or(f64::MAX) < 3.0)
            .map(|r| r["version"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert!(
        eventually(20, || async {
            ready_on(&status_of(&url, "2026-09-30")) == [VERSION; SHARDS as usize]
        })
        .await,
        "every replica reports this release, ready: {}",
        status_of(&url, "2026-09-30")
    );

    // 4. A rollback to the previous release, one of its replicas migrating on start (a newer
    // release's migrations must not stop it), and this release's replica killed mid-run taken
    // over by an old one.
    let april = key_loans(&pool, &mut next_id, "2026-04-01", &[0], 200).await;
    let holder = gate_on(&pool, april[50], 8_332).await;
    kill_at_the_gate(&pool, &mut fleet, 0, holder).await;
    fleet
        .start(
            0,
            Release::Previous,
            &[("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "true")],
        )
        .await;
    fleet.replace(1, Release::Previous, &[]).await;
    fleet.replace(2, Release::Previous, &[]).await;
    key_loans(&pool, &mut next_id, "2026-09-01", &[0, 1, 2], 5).await;
    sqlx::query(
        "UPDATE loans SET due_on = due_on - 2
          WHERE id IN (SELECT id FROM loans WHERE returned_on BETWEEN '2026-11-01' AND '2026-11-20'
                        ORDER BY id LIMIT 3)",
    )
    .execute(&pool)
    .await
    .unwrap();
    wait_at_rest(&pool, &fleet, "the rolled-back fleet").await;
    let april = claims_of(&pool, "2026-04-30").await;
    assert!(
        april
            .iter()
            .any(|(shard, attempt, _)| *shard == 0 && *attempt >= 2),
        "April's shard 0 was taken over by the previous release: {april:?}"
    );
    assert_eq!(
        version_of(&pool, "2026-04-30", 0).await.as_deref(),
        Some(PREVIOUS_VERSION)
    );
    fleet.assert_all_ready().await;

    // 5. Upgraded again.
    for shard in 0..SHARDS {
        fleet.replace(shard, Release::This, &[]).await;
    }
    key_loans(&pool, &mut next_id, "2026-10-01", &[0, 1, 2], 5).await;
    wait_at_rest(&pool, &fleet, "the re-upgraded fleet").await;
    assert_every_month_right(&pool, &url).await;
    // June, pinned by 4b79e14, settled under its pin, by this release.
    let june = claims_of(&pool, "2026-06-30").await;
    assert_eq!(june.len(), SHARDS as usize, "{june:?}");
    for shard in 0..SHARDS {
        fleet.stop(shard);
    }
}
