//! `deploy/sql/roles.sql` on a real server: the migration role migrates, the runtime role settles a
//! month with the real binary and serves ready, and every other write is refused to it.

use crate::helpers::*;
use sqlx::{Connection, PgConnection};

const APP: &str = "settlementd_app";
const MIGRATOR: &str = "settlementd_migrator";

/// `url` logging in as `role` (the test cluster trusts local connections, so no password).
pub fn as_role(url: &str, role: &str) -> String {
    let mut parsed = url::Url::parse(url).unwrap();
    parsed.set_username(role).unwrap();
    parsed.to_string()
}

/// Runs roles.sql as the cluster's superuser, as an operator would with psql.
pub async fn apply_roles_sql(url: &str) {
    let script =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/sql/roles.sql"))
            .unwrap();
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(&script)
        .execute(&mut conn)
        .await
        .expect("roles.sql runs");
    conn.close().await.unwrap();
}

/// The SQLSTATE `sql` fails with as the connection's role, or None when it succeeds.
async fn sqlstate(conn: &mut PgConnection, sql: &str) -> Option<String> {
    match sqlx::raw_sql(sql).execute(&mut *conn).await {
        Ok(_) => None,
        Err(sqlx::Error::Database(e)) => Some(e.code().unwrap_or_default().to_string()),
        Err(e) => panic!("{sql}: {e}"),
    }
}

const DENIED: &str = "42501"; // insufficient_privilege (also "must be owner")

/// A column of `table` that an UPDATE may set (not an identity or generated one).
async fn settable_column(conn: &mut PgConnection, table: &str) -> String {
    sqlx::query_scalar(
        "SELECT attname::text FROM pg_attribute
          WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped
            AND attidentity = '' AND attgenerated = ''
          ORDER BY attnum LIMIT 1",
    )
    .bind(table)
    .fetch_one(conn)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_role_settles_a_month_serves_ready_and_may_write_nothing_else() {
    let (_name, admin) = empty_db().await;
    apply_roles_sql(&admin).await;

    // The migration role creates and owns the schema objects.
    run_ok(settlementd(Some(&as_role(&admin, MIGRATOR))).arg("migrate"));
    apply_roles_sql(&admin).await; // after a migration that adds tables, as documented
    apply_roles_sql(&admin).await; // and it is idempotent

    let pool = sqlx::PgPool::connect(&admin).await.unwrap();
    let month = bd("2026-10-31");
    seed_month(&pool, month, 400, 1).await;

    // The real binary, as the runtime role, settles both shards of the month.
    let app_url = as_role(&admin, APP);
    for shard in ["0", "1"] {
        run_ok(settlementd(Some(&app_url)).args([
            "run",
            "--business-date",
            "2026-10-31",
            "--shards",
            "2",
            "--shard",
            shard,
        ]));
    }
    let totals = settlementd::jobs::fine_settlement::month_totals(&pool, month)
        .await
        .unwrap();
    assert_eq!(totals.settled_rows, eligible(&pool, month).await);
    let status = run_ok(settlementd(Some(&app_url)).args([
        "status",
        "--business-date",
        "2026-10-31",
        "--shards",
        "2",
        "--json",
    ]));
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["runs"][1]["status"], "SUCCESS");
    // verify and correct, as the runtime role: a correction under another rate re-pins the month
    // and records its changes, and the month then verifies under it.
    run_ok(settlementd(Some(&app_url)).args(["verify", "--business-date", "2026-10-31"]));
    let corrected = run_ok(
        settlementd(Some(&app_url))
            .env("SETTLEMENTD__FINE__DAILY_RATE_CENTS", "60")
            .args(["correct", "--business-date", "2026-10-31", "--json"])
            .args(["--reason", "the 2026 rate", "--key", "roles-test"]),
    );
    let corrected: serde_json::Value = serde_json::from_slice(&corrected.stdout).unwrap();
    assert!(corrected["changed"].as_i64().unwrap() > 0, "{corrected}");
    run_ok(
        settlementd(Some(&app_url))
            .env("SETTLEMENTD__FINE__DAILY_RATE_CENTS", "60")
            .args(["verify", "--business-date", "2026-10-31"]),
    );

    // serve as the runtime role: ready (it reads both migration ledgers and the month's pin),
    // with migrations left to the migration role, on the rule the correction pinned (under the
    // old one it would not be ready: tests/it/rules.rs).
    let replica = ServeProcess::start(
        &app_url,
        &[
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false"),
            ("SETTLEMENTD__FINE__DAILY_RATE_CENTS", "60"),
        ],
    );
    replica.wait_for("/readyz", 200).await;
    drop(replica);

    let mut app = PgConnection::connect(&app_url).await.unwrap();
    assert_eq!(
        sqlstate(&mut app, "UPDATE loans SET fine_cents = fine_cents, fine_settled_at = fine_settled_at, fine_seq = fine_seq WHERE id = 1").await,
        None,
        "the three settlement columns are writable"
    );
    // The edit queue: read and emptied by the runtime role, filled only by the triggers; pauses:
    // set and lifted. The audit trail, requests and claims: deleted only through retention's
    // function (the_runtime_role_deletes_audit_rows_only_through_retention).
    for table in ["loan_changes", "job_pauses"] {
        let delete = format!("DELETE FROM {table} WHERE false");
        assert_eq!(sqlstate(&mut app, &delete).await, None, "{delete}");
    }
    let denied = [
        "UPDATE loans SET returned_on = returned_on WHERE id = 1",
        "UPDATE loans SET due_on = due_on WHERE id = 1",
        "UPDATE loans SET member_id = member_id WHERE id = 1",
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on) VALUES (-7, 1, 1, '2026-01-01', '2026-01-02')",
        "DELETE FROM loans WHERE id = 1",
        "TRUNCATE loans",
        "ALTER TABLE loans ADD COLUMN note text",
        "CREATE INDEX ON loans (member_id)",
        "TRUNCATE job_runs",
        "DROP TABLE job_runs",
        "ALTER TABLE job_runs ADD COLUMN note text",
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (1, 'x', true, '\\x00', 0)",
        "UPDATE _sqlx_migrations SET success = success",
        "DELETE FROM _sqlx_migrations",
        "CREATE TABLE mine (id int)",
        "DELETE FROM job_params",
        "DELETE FROM fine_corrections",
        "DELETE FROM fine_adjustments",
        "TRUNCATE fine_adjustments",
        "DELETE FROM fine_journal",
        "UPDATE fine_journal SET kind = kind",
        "TRUNCATE fine_journal",
        "UPDATE fine_heads SET breaks = 0",
        "DELETE FROM fine_heads",
        "TRUNCATE fine_heads",
        "INSERT INTO loan_changes (loan_id, month, deleted) VALUES (1, '2026-10-01', false)",
        "UPDATE loan_changes SET deleted = deleted",
        "UPDATE job_pauses SET reason = reason",
        "DELETE FROM job_runs WHERE false",
        "DELETE FROM job_events WHERE false",
        "DELETE FROM run_requests WHERE false",
        "DELETE FROM run_request_shards WHERE false",
    ];
    for sql in denied {
        assert_eq!(
            sqlstate(&mut app, sql).await.as_deref(),
            Some(DENIED),
            "{sql}"
        );
    }
    // job_events and fine_adjustments are append-only for the runtime role; run_requests is
    // read and updated.
    for table in ["job_events", "fine_adjustments"] {
        let column = settable_column(&mut app, table).await;
        let update = format!("UPDATE {table} SET {column} = {column} WHERE false");
        assert_eq!(
            sqlstate(&mut app, &update).await.as_deref(),
            Some(DENIED),
            "{update}"
        );
    }
    for table in ["job_params", "fine_corrections"] {
        let column = settable_column(&mut app, table).await;
        let update = format!("UPDATE {table} SET {column} = {column} WHERE false");
        assert_eq!(sqlstate(&mut app, &update).await, None, "{update}");
    }
    let requests = settable_column(&mut app, "run_requests").await;
    let update_requests = format!("UPDATE run_requests SET {requests} = {requests} WHERE false");
    assert_eq!(sqlstate(&mut app, &update_requests).await, None);
    let shards = settable_column(&mut app, "run_request_shards").await;
    let update_shards = format!("UPDATE run_request_shards SET {shards} = {shards} WHERE false");
    assert_eq!(sqlstate(&mut app, &update_shards).await, None);
    for table in [
        "job_events",
        "run_requests",
        "run_request_shards",
        "job_params",
        "fine_corrections",
        "fine_adjustments",
        "fine_journal",
    ] {
        // Inserting is permitted, including the id sequence; a real table's NOT NULL columns
        // may still refuse an empty row, which is not a privilege error.
        let insert = format!("INSERT INTO {table} DEFAULT VALUES");
        assert_ne!(
            sqlstate(&mut app, &insert).await.as_deref(),
            Some(DENIED),
            "{insert}"
        );
    }
    app.close().await.unwrap();
}

/// Ages every claim and audit event of `month` (any job) by 400 days, as the superuser: as if
/// the month had closed long ago.
async fn age_month(admin: &sqlx::PgPool, month: &str) {
    for sql in [
        "UPDATE job_runs SET started_at = started_at - interval '400 days',
                             heartbeat_at = heartbeat_at - interval '400 days',
                             finished_at = finished_at - interval '400 days'
          WHERE business_date = $1::date",
        "UPDATE job_events SET at = at - interval '400 days' WHERE business_date = $1::date",
    ] {
        sqlx::query(sql).bind(month).execute(admin).await.unwrap();
    }
}

/// The runtime role cannot delete a row of the audit trail, the requests or the claims itself:
/// it deletes through `settlementd_prune_period` alone, which refuses to go below a day and keeps
/// what happened recently; and retention works through it, by hand (`settlementd prune`) and in
/// `serve`'s daily run, both as the runtime role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runtime_role_deletes_audit_rows_only_through_retention() {
    let cluster = PrivateCluster::start().await;
    let admin = cluster.database("libraryd").await;
    apply_roles_sql(&admin).await;
    run_ok(settlementd(Some(&as_role(&admin, MIGRATOR))).arg("migrate"));
    apply_roles_sql(&admin).await;
    let pool = sqlx::PgPool::connect(&admin).await.unwrap();
    let app_url = as_role(&admin, APP);

    // Two months closed long ago (before the lookback), and a recent one, settled by the runtime
    // role.
    let due = due_month();
    let [old, older, recent] = [30, 31, 2].map(|n| due.months_before(n).unwrap());
    for (k, month) in [old, older, recent].iter().enumerate() {
        seed_month_alone(&pool, *month, 40, 1 + 1000 * k as i64).await;
        run_ok(settlementd(Some(&app_url)).args(["run", "--business-date", &month.to_string()]));
    }
    for month in [old, older] {
        age_month(&pool, &month.to_string()).await;
    }
    let audit = "SELECT (SELECT count(*) FROM job_events) + (SELECT count(*) FROM job_runs)
                      + (SELECT count(*) FROM run_requests)";
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let journal = count("SELECT count(*) FROM fine_journal").await;

    // Directly: every delete of an audit row is refused, old or new; the function refuses an age
    // below a day, and the check it calls is not the runtime role's.
    let mut app = PgConnection::connect(&app_url).await.unwrap();
    let event = format!(
        "DELETE FROM job_events WHERE business_date = '{old}';
         DELETE FROM job_runs WHERE business_date = '{old}'"
    );
    assert_eq!(sqlstate(&mut app, &event).await.as_deref(), Some(DENIED));
    let before = count(audit).await;
    for sql in [
        format!("SELECT * FROM settlementd_prune_period('fine-settlement', '{old}', 0, 100)"),
        format!("SELECT * FROM settlementd_prune_period('fine-settlement', '{old}', -5, 100)"),
    ] {
        assert_eq!(
            sqlstate(&mut app, &sql).await.as_deref(),
            Some("22023"),
            "{sql}"
        );
    }
    let check =
        format!("SELECT settlementd_retention_untouched('fine-settlement', '{old}', now(), now())");
    assert_eq!(sqlstate(&mut app, &check).await.as_deref(), Some(DENIED));
    // A month settled minutes ago is kept, whatever the caller asks.
    let (deleted, state): (i64, String) = sqlx::query_as(
        "SELECT events + requests + runs, state FROM settlementd_prune_period($1, $2, 1, 1000)",
    )
    .bind("fine-settlement")
    .bind(recent.date())
    .fetch_one(&mut app)
    .await
    .unwrap();
    assert_eq!((deleted, state.as_str()), (0, "kept"));
    assert_eq!(count(audit).await, before, "nothing was deleted");
    app.close().await.unwrap();

    // `settlementd prune` as the runtime role: its dry run counts what it then deletes.
    let dry = run_ok(settlementd(Some(&app_url)).args([
        "prune",
        "--older-than",
        "30",
        "--dry-run",
        "--json",
    ]));
    let dry: serde_json::Value = serde_json::from_slice(&dry.stdout).unwrap();
    let periods = dry["periods"].as_array().unwrap();
    assert!(
        periods
            .iter()
            .all(|p| p["business_date"] != recent.to_string()),
        "{dry}"
    );
    let counted: i64 = periods
        .iter()
        .filter(|p| p["business_date"] == old.to_string())
        .map(|p| {
            p["events"].as_i64().unwrap()
                + p["requests"].as_i64().unwrap()
                + p["runs"].as_i64().unwrap()
        })
        .sum();
    assert!(counted > 0, "{dry}");
    // Only `old` this time: `older` is run again first, so it is not closed long enough.
    run_ok(settlementd(Some(&app_url)).args([
        "run",
        "--business-date",
        &older.to_string(),
        "--force",
    ]));
    let pruned =
        run_ok(settlementd(Some(&app_url)).args(["prune", "--older-than", "30", "--json"]));
    let pruned: serde_json::Value = serde_json::from_slice(&pruned.stdout).unwrap();
    assert_eq!(pruned["deleted"].as_i64(), Some(counted), "{pruned}");
    let runs_of = |month: chrono::NaiveDate| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM job_runs WHERE business_date = $1")
                .bind(month)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(runs_of(old.date()).await, 0);
    assert!(runs_of(older.date()).await > 0);
    assert!(runs_of(recent.date()).await > 0);
    assert_eq!(count("SELECT count(*) FROM fine_journal").await, journal);

    // serve's daily retention, as the runtime role, prunes `older` once it is old (on another
    // day: today's retention key, done by `prune`, is removed as the next day would find none).
    age_month(&pool, &older.to_string()).await;
    sqlx::query("DELETE FROM job_runs WHERE job_name = 'retention'")
        .execute(&pool)
        .await
        .unwrap();
    let replica = ServeProcess::start(
        &app_url,
        &[
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false"),
            ("SETTLEMENTD__RETENTION__ENABLED", "true"),
            ("SETTLEMENTD__RETENTION__OLDER_THAN_DAYS", "30"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "1"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "3"),
        ],
    );
    replica.wait_for("/readyz", 200).await;
    assert!(
        eventually(20, || async { runs_of(older.date()).await == 0 }).await,
        "serve's retention did not prune {older}"
    );
    // The counter moves when the whole retention pass has returned, a moment after its deletes.
    assert!(
        eventually(10, || async {
            replica.metric("settlementd_retention_deleted_total").await > 0.0
        })
        .await,
        "serve's retention pruned {older} but its counter did not move"
    );
    assert!(runs_of(recent.date()).await > 0);
    drop(replica);
    assert!(count(audit).await > 0);
}

#[tokio::test]
async fn serve_as_the_runtime_role_told_to_migrate_exits_2_saying_what_to_change() {
    let (_name, admin) = empty_db().await;
    apply_roles_sql(&admin).await;
    // The runtime role with the default migrate_on_start = true, on a database nobody migrated:
    // no restart can fix it, so it is exit 2 (the systemd unit does not restart on it), once.
    let out = output_within(
        settlementd(Some(&as_role(&admin, APP)))
            .env("SETTLEMENTD__HTTP__LISTEN", "127.0.0.1:0")
            .arg("serve"),
        std::time::Duration::from_secs(60),
    );
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("this role may not apply settlementd's migrations")
            && err.contains("database.migrate_on_start = false")
            && err.contains("settlementd migrate"),
        "{err}"
    );
}

/// psql from the server's bin directory (or PATH), as an operator runs roles.sql.
fn psql() -> std::path::PathBuf {
    let bindir = settlementd::embedded_pg::find_bindir().expect("server binaries");
    let beside = bindir.join("psql");
    if beside.exists() {
        beside
    } else {
        "psql".into()
    }
}

/// Runs roles.sql with psql, statement by statement as psql sends a file.
fn psql_roles_sql(url: &str) {
    let out = std::process::Command::new(psql())
        .args(["-v", "ON_ERROR_STOP=1", "-q", "-X", "-f"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/sql/roles.sql"))
        .arg(url)
        .output()
        .expect("run psql");
    assert!(
        out.status.success(),
        "psql roles.sql: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_running_roles_sql_never_shows_the_runtime_role_a_permission_denied() {
    // A cluster of its own: roles are cluster-wide, and roles.sql run by two tests at once on one
    // server would fight over the same role rows.
    let cluster = PrivateCluster::start().await;
    let admin = cluster.database("libraryd").await;
    apply_roles_sql(&admin).await;
    run_ok(settlementd(Some(&as_role(&admin, MIGRATOR))).arg("migrate"));
    apply_roles_sql(&admin).await;

    // A reader working as the runtime role on every table it is granted, while roles.sql is run
    // again and again with psql.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app_url = as_role(&admin, APP);
    let reader = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut conn = PgConnection::connect(&app_url).await.unwrap();
            let (mut reads, mut denied) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                for table in [
                    "loans",
                    "job_runs",
                    "job_events",
                    "run_requests",
                    "run_request_shards",
                    "_sqlx_migrations",
                ] {
                    match sqlx::query(&format!("SELECT count(*) FROM {table}"))
                        .execute(&mut conn)
                        .await
                    {
                        Ok(_) => reads += 1,
                        Err(e) => denied.push(format!("{table}: {e}")),
                    }
                }
            }
            (reads, denied)
        }
    });
    for _ in 0..10 {
        psql_roles_sql(&admin);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (reads, denied) = reader.await.unwrap();
    assert!(denied.is_empty(), "{} refused: {denied:?}", denied.len());
    assert!(reads > 60, "the reader hardly read: {reads}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migrator_migrates_libraryds_loans_as_their_owner_and_cannot_read_or_drop_its_other_tables(
) {
    let cluster = PrivateCluster::start().await;
    let admin = cluster.database("libraryd").await;
    // libraryd's database before settlementd: its own role owns loans (without the settlement
    // columns) and members.
    let mut owner = PgConnection::connect(&admin).await.unwrap();
    sqlx::raw_sql(
        "CREATE ROLE libraryd NOLOGIN;
         GRANT USAGE, CREATE ON SCHEMA public TO libraryd;
         SET ROLE libraryd;
         CREATE TABLE loans (id bigint PRIMARY KEY, member_id bigint NOT NULL,
                             book_id bigint NOT NULL, borrowed_on date NOT NULL,
                             due_on date NOT NULL, returned_on date);
         CREATE TABLE members (id bigint PRIMARY KEY, name text NOT NULL);
         INSERT INTO members VALUES (1, 'Ada');
         RESET ROLE;",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    apply_roles_sql(&admin).await;

    let migrator_url = as_role(&admin, MIGRATOR);
    run_ok(settlementd(Some(&migrator_url)).arg("migrate"));
    run_ok(settlementd(Some(&migrator_url)).arg("migrate")); // a no-op the second time

    // loans gained the settlement column and index, and still belongs to libraryd.
    let (loans_owner, column, index): (String, bool, bool) = sqlx::query_as(
        "SELECT (SELECT r.rolname::text FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
                  WHERE c.oid = 'loans'::regclass),
                EXISTS (SELECT FROM pg_attribute WHERE attrelid = 'loans'::regclass
                         AND attname = 'fine_settled_at'),
                to_regclass('loans_unsettled_by_month') IS NOT NULL",
    )
    .fetch_one(&mut owner)
    .await
    .unwrap();
    assert_eq!(
        (loans_owner.as_str(), column, index),
        ("libraryd", true, true)
    );
    // Recorded exactly as sqlx records its migrations: the test template, migrated by sqlx's own
    // Migrator, has the same rows.
    let recorded =
        "SELECT version, description, success, checksum FROM _sqlx_migrations ORDER BY version";
    let ours: Vec<(i64, String, bool, Vec<u8>)> = sqlx::query_as(recorded)
        .fetch_all(&mut owner)
        .await
        .unwrap();
    let db = test_db().await;
    let sqlx_own: Vec<(i64, String, bool, Vec<u8>)> =
        sqlx::query_as(recorded).fetch_all(&db.pool).await.unwrap();
    assert_eq!(ours, sqlx_own);

    // The migrator holds no right of libraryd's: it cannot read its tables or drop them.
    let mut migrator = PgConnection::connect(&migrator_url).await.unwrap();
    for sql in [
        "SELECT name FROM members",
        "DROP TABLE members",
        "SELECT id FROM loans",
        "DELETE FROM members",
        "ALTER TABLE loans ADD COLUMN note text",
    ] {
        assert_eq!(
            sqlstate(&mut migrator, sql).await.as_deref(),
            Some(DENIED),
            "{sql}"
        );
    }
    let members: i64 = sqlx::query_scalar("SELECT count(*) FROM members")
        .fetch_one(&mut owner)
        .await
        .unwrap();
    assert_eq!(members, 1);

    // libraryd's own role, granted nothing of settlementd's, edits a settled loan's return date
    // and deletes another: settlementd's triggers queue both in libraryd's transaction.
    sqlx::raw_sql(
        "SET ROLE libraryd;
         INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on, fine_cents,
                            fine_settled_at, fine_seq)
         VALUES (1, 1, 1, '2026-09-01', '2026-09-15', '2026-09-20', 250, now(), 1),
                (2, 1, 1, '2026-09-01', '2026-09-15', '2026-09-20', 250, now(), 1);
         UPDATE loans SET returned_on = '2026-10-02' WHERE id = 1;
         DELETE FROM loans WHERE id = 2;
         RESET ROLE;",
    )
    .execute(&mut owner)
    .await
    .unwrap();
    let queued: Vec<(i64, bool, chrono::NaiveDate)> =
        sqlx::query_as("SELECT loan_id, deleted, month FROM loan_changes ORDER BY loan_id")
            .fetch_all(&mut owner)
            .await
            .unwrap();
    let september = chrono::NaiveDate::from_ymd_opt(2026, 9, 1).unwrap();
    assert_eq!(queued, vec![(1, false, september), (2, true, september)]);
}

/// Every migration that alters `loans` must run as its owner (db::LOANS_MIGRATIONS), and only
/// those: a new one left out would fail on a libraryd database with "must be owner of table loans".
#[test]
fn the_migrations_taking_the_loans_owners_role_are_exactly_those_that_alter_loans() {
    for migration in settlementd::db::embedded() {
        let code: String = migration
            .sql
            .lines()
            .map(|l| l.split("--").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase();
        let words: Vec<&str> = code.split_whitespace().collect();
        let alters_loans = words.windows(2).any(|w| {
            matches!(w[0], "table" | "on" | "exists") && w[1].trim_matches(['(', ';']) == "loans"
        }) || code.contains("loans_unsettled");
        assert_eq!(
            settlementd::db::LOANS_MIGRATIONS.contains(&migration.version),
            alters_loans,
            "migration {} ({})",
            migration.version,
            migration.description
        );
    }
}

/// The migrations run statement by statement as the loans owner are plain DDL that
/// db::statements splits exactly: every statement is either one that alters loans (run as its
/// owner) or a CREATE TABLE (run as the migrator).
#[test]
fn the_loans_migrations_split_into_statements_that_each_alter_loans_or_create_a_table() {
    for migration in settlementd::db::embedded() {
        if !settlementd::db::LOANS_MIGRATIONS.contains(&migration.version) {
            continue;
        }
        assert!(!migration.sql.contains('$'), "{}", migration.version);
        let statements = settlementd::db::statements(&migration.sql);
        assert!(!statements.is_empty());
        for statement in statements {
            assert!(
                settlementd::db::alters_loans(&statement)
                    || statement.starts_with("CREATE TABLE IF NOT EXISTS loans "),
                "{}: {statement}",
                migration.version
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_own_table_is_granted_by_default_with_no_line_in_roles_sql_and_no_rerun() {
    let (_name, admin) = empty_db().await;
    apply_roles_sql(&admin).await;
    run_ok(settlementd(Some(&as_role(&admin, MIGRATOR))).arg("migrate"));
    apply_roles_sql(&admin).await;
    // A new job's migration, run by the migrator after roles.sql; roles.sql names no such table.
    let mut migrator = PgConnection::connect(&as_role(&admin, MIGRATOR))
        .await
        .unwrap();
    sqlx::raw_sql(
        "CREATE TABLE a_new_jobs_output (id bigserial PRIMARY KEY, member_id bigint NOT NULL,
                                       loans integer NOT NULL)",
    )
    .execute(&mut migrator)
    .await
    .unwrap();
    let mut app = PgConnection::connect(&as_role(&admin, APP)).await.unwrap();
    for pass in ["as created", "after roles.sql ran again"] {
        for allowed in [
            "INSERT INTO a_new_jobs_output (member_id, loans) VALUES (1, 2)",
            "SELECT count(*) FROM a_new_jobs_output",
            "UPDATE a_new_jobs_output SET loans = loans + 1",
            "DELETE FROM a_new_jobs_output WHERE member_id = 1",
        ] {
            assert_eq!(sqlstate(&mut app, allowed).await, None, "{pass}: {allowed}");
        }
        for refused in [
            "TRUNCATE a_new_jobs_output",
            "ALTER TABLE a_new_jobs_output ADD COLUMN x int",
            "DROP TABLE a_new_jobs_output",
            // The tables roles.sql names keep exactly their grants: the journal and the audit trail
            // stay append-only.
            "DELETE FROM fine_journal",
            "UPDATE job_events SET message = ''",
            "DELETE FROM loans",
        ] {
            assert_eq!(
                sqlstate(&mut app, refused).await.as_deref(),
                Some(DENIED),
                "{pass}: {refused}"
            );
        }
        apply_roles_sql(&admin).await;
    }
}
