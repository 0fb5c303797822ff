//! `deploy/sql/roles.sql` on a real server: the migration role migrates, the runtime role settles a
//! month with the real binary and serves ready, and every other write is refused to it.

use crate::helpers::*;
use sqlx::{Connection, PgConnection};

const APP: &str = "settlementd_app";
const MIGRATOR: &str = "settlementd_migrator";

/// `url` logging in as `role` (the test cluster trusts local connections, so no password).
fn as_role(url: &str, role: &str) -> String {
    let mut parsed = url::Url::parse(url).unwrap();
    parsed.set_username(role).unwrap();
    parsed.to_string()
}

/// Runs roles.sql as the cluster's superuser, as an operator would with psql.
async fn apply_roles_sql(url: &str) {
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
    let totals = settlementd::settlement::month_totals(&pool, month)
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

    // serve as the runtime role: ready (it reads _sqlx_migrations), with migrations left to the
    // migration role.
    let replica = ServeProcess::start(
        &app_url,
        &[("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false")],
    );
    replica.wait_for("/readyz", 200).await;
    drop(replica);

    let mut app = PgConnection::connect(&app_url).await.unwrap();
    assert_eq!(
        sqlstate(&mut app, "UPDATE loans SET fine_cents = fine_cents, fine_settled_at = fine_settled_at WHERE id = 1").await,
        None,
        "the two settlement columns are writable"
    );
    let denied = [
        "UPDATE loans SET returned_on = returned_on WHERE id = 1",
        "UPDATE loans SET due_on = due_on WHERE id = 1",
        "UPDATE loans SET member_id = member_id WHERE id = 1",
        "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on) VALUES (-7, 1, 1, '2026-01-01', '2026-01-02')",
        "DELETE FROM loans WHERE id = 1",
        "TRUNCATE loans",
        "ALTER TABLE loans ADD COLUMN note text",
        "CREATE INDEX ON loans (member_id)",
        "DELETE FROM job_runs",
        "TRUNCATE job_runs",
        "DROP TABLE job_runs",
        "ALTER TABLE job_runs ADD COLUMN note text",
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (1, 'x', true, '\\x00', 0)",
        "UPDATE _sqlx_migrations SET success = success",
        "DELETE FROM _sqlx_migrations",
        "CREATE TABLE mine (id int)",
        "DELETE FROM job_events",
        "DELETE FROM run_requests",
        "DELETE FROM run_request_shards",
        "DELETE FROM job_params",
        "DELETE FROM fine_corrections",
        "DELETE FROM fine_adjustments",
        "TRUNCATE fine_adjustments",
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
