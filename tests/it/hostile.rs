//! libraryd as an adversary of settlementd's record.
//!
//! libraryd owns its database, so on PostgreSQL 15+ the schema `public` (through
//! `pg_database_owner`), and `loans`, which it created before settlementd came; settlementd's
//! record lives in the schema `settlementd`, owned by `settlementd_migrator`, where nobody else
//! creates (migrations/20261210000001_a_schema_of_its_own.sql; docs/OPERATIONS.md, "A schema of
//! its own"). Each test sets that database up as an operator does (libraryd's table, then
//! deploy/sql/roles.sql, `settlementd migrate` as the migrator, roles.sql again, a month settled by
//! the runtime role with the real binary), then acts as libraryd: it plants functions and
//! operators in `public`, tries to drop or change what is settlementd's, changes the type of a
//! column the triggers read, and disables, drops or changes settlementd's triggers on `loans`;
//! and checks what settlementd prevents, and what it sees (`/readyz`, `/metrics`, `verify`).
//!
//! Each test has a cluster of its own: roles are cluster-wide, and libraryd tries to make itself
//! a superuser here. The database's own `search_path` setting, which the harness gives the
//! databases it makes, is reset: libraryd's database has none, and the binary sets its own.

use crate::helpers::*;
use crate::roles::{apply_roles_sql, as_role};
use sqlx::{Connection, PgConnection, PgPool};

const APP: &str = "settlementd_app";
const MIGRATOR: &str = "settlementd_migrator";
const LIBRARYD: &str = "libraryd";
/// The month settled before libraryd acts.
const MONTH: &str = "2026-10-31";
const LOANS: i64 = 120;
const DENIED: &str = "42501"; // insufficient_privilege, "must be owner of …" too
const DATATYPE_MISMATCH: &str = "42804";

/// libraryd's database, with the URLs of the cluster's superuser and of each role on it.
struct Library {
    _cluster: PrivateCluster,
    admin: String,
    libraryd: String,
    migrator: String,
    app: String,
}

impl Library {
    /// libraryd's database before settlementd: the role libraryd owns the database (so `public`)
    /// and `loans`, without settlementd's columns, and a table of its own.
    async fn before_settlementd() -> Self {
        let cluster = PrivateCluster::start().await;
        let admin = cluster.database("libraryd").await;
        let mut su = superuser(&admin).await;
        sqlx::raw_sql(
            "CREATE ROLE libraryd LOGIN;
             ALTER DATABASE libraryd OWNER TO libraryd;
             ALTER DATABASE libraryd RESET search_path;",
        )
        .execute(&mut su)
        .await
        .unwrap();
        let libraryd = as_role(&admin, LIBRARYD);
        let mut own = PgConnection::connect(&libraryd).await.unwrap();
        sqlx::raw_sql(
            "CREATE TABLE loans (id bigint PRIMARY KEY, member_id bigint NOT NULL,
                                 book_id bigint NOT NULL, borrowed_on date NOT NULL,
                                 due_on date NOT NULL, returned_on date);
             CREATE TABLE members (id bigint PRIMARY KEY, name text NOT NULL);",
        )
        .execute(&mut own)
        .await
        .unwrap();
        // What makes it libraryd's: it may create in public, and nobody else but the superuser.
        let (public_owner, creates): (String, bool) = sqlx::query_as(
            "SELECT n.nspowner::regrole::text, has_schema_privilege('libraryd', n.oid, 'CREATE')
               FROM pg_namespace n WHERE n.nspname = 'public'",
        )
        .fetch_one(&mut su)
        .await
        .unwrap();
        assert!(creates, "libraryd may create in public");
        assert_eq!(public_owner, "pg_database_owner", "PostgreSQL 15+");
        Self {
            migrator: as_role(&admin, MIGRATOR),
            app: as_role(&admin, APP),
            _cluster: cluster,
            admin,
            libraryd,
        }
    }

    /// [`Library::before_settlementd`], then settlementd installed as documented: roles.sql,
    /// `settlementd migrate` as the migrator, roles.sql again; then libraryd's loans of [`MONTH`],
    /// settled by the runtime role (the real binary).
    async fn settled() -> Self {
        let library = Self::before_settlementd().await;
        apply_roles_sql(&library.admin).await;
        run_ok(settlementd(Some(&library.migrator)).arg("migrate"));
        apply_roles_sql(&library.admin).await;
        library.seed(MONTH, 1).await;
        library.settle(MONTH);
        library
    }

    /// libraryd's loans returned in `month` (and some still out), ids from `first_id`.
    async fn seed(&self, month: &str, first_id: i64) {
        let pool = PgPool::connect(&self.libraryd).await.unwrap();
        seed_month_alone(&pool, bd(month), LOANS, first_id).await;
        pool.close().await;
    }

    /// `settlementd run` of `month` as the runtime role, which must succeed.
    fn settle(&self, month: &str) {
        run_ok(settlementd(Some(&self.app)).args(["run", "--business-date", month]));
    }

    /// A replica of this release as the runtime role, ready.
    async fn replica(&self) -> ServeProcess {
        let replica = ServeProcess::start(
            &self.app,
            &[("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false")],
        );
        replica.wait_for("/readyz", 200).await;
        replica
    }

    async fn superuser(&self) -> PgConnection {
        superuser(&self.admin).await
    }

    async fn as_libraryd(&self) -> PgConnection {
        PgConnection::connect(&self.libraryd).await.unwrap()
    }
}

/// The cluster's superuser on `url`, finding names in pg_catalog alone: libraryd's functions and
/// operators in public must not run with its rights while a test looks at what they did.
async fn superuser(url: &str) -> PgConnection {
    let mut conn = PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql("SET search_path = pg_catalog, pg_temp")
        .execute(&mut conn)
        .await
        .unwrap();
    conn
}

/// What `sql` did on `conn`: nothing to say, or its SQLSTATE and message.
async fn outcome(conn: &mut PgConnection, sql: &str) -> Result<(), (String, String)> {
    match sqlx::raw_sql(sql).execute(&mut *conn).await {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(e)) => Err((
            e.code().unwrap_or_default().to_string(),
            e.message().to_string(),
        )),
        Err(e) => panic!("{sql}: {e}"),
    }
}

/// `sql` as libraryd, which must succeed.
async fn libraryd_does(conn: &mut PgConnection, sql: &str) {
    if let Err((code, message)) = outcome(conn, sql).await {
        panic!("libraryd: {sql}: {code} {message}");
    }
}

/// The money journal as the superuser reads it, row by row: (id, kind, loans, fines after).
type JournalRows = Vec<(i64, String, Vec<i64>, Vec<i64>)>;

async fn journal_rows(su: &mut PgConnection) -> JournalRows {
    sqlx::query_as(
        "SELECT id, kind, loan_ids, after_cents FROM settlementd.fine_journal ORDER BY id",
    )
    .fetch_all(su)
    .await
    .unwrap()
}

/// Every row `before` held is still in `after`, as it was.
fn journal_kept(before: &JournalRows, after: &JournalRows) {
    assert!(!before.is_empty());
    assert!(
        after.len() >= before.len() && after[..before.len()] == before[..],
        "the journal lost or changed rows: {} before, {} now",
        before.len(),
        after.len()
    );
}

/// Whether libraryd became a superuser, or a member of the migrator, or of the runtime role.
async fn libraryd_escalated(su: &mut PgConnection) -> (bool, bool, bool) {
    sqlx::query_as(
        "SELECT rolsuper, pg_has_role('libraryd', 'settlementd_migrator', 'MEMBER'),
                pg_has_role('libraryd', 'settlementd_app', 'MEMBER')
           FROM pg_roles WHERE rolname = 'libraryd'",
    )
    .fetch_one(su)
    .await
    .unwrap()
}

/// The sample of `series` (its name and labels exactly as exported) on the replica's /metrics.
async fn sample(replica: &ServeProcess, series: &str) -> Option<f64> {
    let body = replica.wait_for("/metrics", 200).await;
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

// --- a: functions and operators planted in public -----------------------------------------------

/// What a planted object records when it runs, and what it then tries with the rights it runs
/// with. Sequences count the calls (a sequence is not rolled back: a call inside a statement that
/// fails still counts): by context — inside a function running as another role than the
/// session's (a SECURITY DEFINER function: `current_user <> session_user`), as a superuser, as
/// the migrator — and by planted object, so a failure names what ran. What runs with libraryd's
/// own rights counts nowhere; the runtime role's own statements (not a definer function's) are
/// counted apart, by object, and try nothing: they run with the rights a trigger libraryd adds to
/// `loans` has anyway (docs/OPERATIONS.md, "A schema of its own").
const PLANT_RECORDER: &str = r#"
CREATE TABLE public.planted (k serial PRIMARY KEY, what text NOT NULL);
CREATE SEQUENCE public.ran_in_definer;
CREATE SEQUENCE public.ran_as_superuser;
CREATE SEQUENCE public.ran_as_migrator;
GRANT SELECT ON public.planted TO PUBLIC;
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO PUBLIC;
CREATE FUNCTION public.libraryd_was_here(k integer) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    own_statement boolean := current_user = session_user;
BEGIN
    IF current_user = 'libraryd' THEN
        RETURN;
    END IF;
    IF own_statement AND current_user = 'settlementd_app' THEN
        BEGIN
            PERFORM nextval(format('public.planted_app_%s', k));
        EXCEPTION WHEN read_only_sql_transaction THEN
            NULL; -- verify's snapshot
        END;
        RETURN;
    END IF;
    -- Anywhere else a read-only transaction makes this fail, and the caller with it: seen too.
    PERFORM nextval(format('public.planted_%s', k));
    IF NOT own_statement THEN
        PERFORM nextval('public.ran_in_definer');
    END IF;
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
        PERFORM nextval('public.ran_as_superuser');
    END IF;
    IF current_user = 'settlementd_migrator' THEN
        PERFORM nextval('public.ran_as_migrator');
    END IF;
    -- Whatever these rights allow, silently: the caller goes on with the genuine result.
    BEGIN EXECUTE 'ALTER ROLE libraryd SUPERUSER'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN EXECUTE 'GRANT settlementd_migrator TO libraryd'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN EXECUTE 'DELETE FROM settlementd.fine_journal'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN EXECUTE 'DELETE FROM settlementd.fine_heads'; EXCEPTION WHEN OTHERS THEN NULL; END;
    BEGIN EXECUTE 'DELETE FROM settlementd.job_params'; EXCEPTION WHEN OTHERS THEN NULL; END;
END
$$;
"#;

/// Functions planted in public, each an exact-type overload of one the definer and trigger
/// functions (or settlementd's own catalog reads) call: (name, arguments, result, the genuine
/// result). Set-returning when the result starts with SETOF.
const PLANTED_FUNCTIONS: &[(&str, &str, &str, &str)] = &[
    (
        "date_trunc",
        "text, date",
        "timestamptz",
        "pg_catalog.date_trunc($1, $2::timestamptz)",
    ),
    (
        "date_trunc",
        "text, timestamp",
        "timestamp",
        "pg_catalog.date_trunc($1, $2)",
    ),
    (
        "date_trunc",
        "text, timestamptz",
        "timestamptz",
        "pg_catalog.date_trunc($1, $2)",
    ),
    (
        "timezone",
        "text, timestamptz",
        "timestamp",
        "pg_catalog.timezone($1, $2)",
    ),
    (
        "timezone",
        "text, timestamp",
        "timestamptz",
        "pg_catalog.timezone($1, $2)",
    ),
    ("isfinite", "date", "boolean", "pg_catalog.isfinite($1)"),
    (
        "isfinite",
        "timestamp",
        "boolean",
        "pg_catalog.isfinite($1)",
    ),
    (
        "isfinite",
        "timestamptz",
        "boolean",
        "pg_catalog.isfinite($1)",
    ),
    ("now", "", "timestamptz", "pg_catalog.now()"),
    (
        "clock_timestamp",
        "",
        "timestamptz",
        "pg_catalog.clock_timestamp()",
    ),
    (
        "make_interval",
        "years integer, months integer, weeks integer, days integer, hours integer, \
         mins integer, secs double precision",
        "interval",
        "pg_catalog.make_interval($1, $2, $3, $4, $5, $6, $7)",
    ),
    ("pg_typeof", "bigint", "regtype", "pg_catalog.pg_typeof($1)"),
    (
        "pg_typeof",
        "integer",
        "regtype",
        "pg_catalog.pg_typeof($1)",
    ),
    (
        "pg_typeof",
        "smallint",
        "regtype",
        "pg_catalog.pg_typeof($1)",
    ),
    ("pg_typeof", "date", "regtype", "pg_catalog.pg_typeof($1)"),
    (
        "pg_typeof",
        "timestamptz",
        "regtype",
        "pg_catalog.pg_typeof($1)",
    ),
    (
        "pg_get_triggerdef",
        "oid",
        "text",
        "pg_catalog.pg_get_triggerdef($1)",
    ),
    (
        "pg_get_userbyid",
        "oid",
        "name",
        "pg_catalog.pg_get_userbyid($1)",
    ),
    (
        "to_regclass",
        "text",
        "regclass",
        "pg_catalog.to_regclass($1)",
    ),
    (
        "to_regnamespace",
        "text",
        "regnamespace",
        "pg_catalog.to_regnamespace($1)",
    ),
    ("format", "text, name", "text", "pg_catalog.format($1, $2)"),
    (
        "format",
        "text, regprocedure, name",
        "text",
        "pg_catalog.format($1, $2, $3)",
    ),
    (
        "format_type",
        "oid, integer",
        "text",
        "pg_catalog.format_type($1, $2)",
    ),
    (
        "cardinality",
        "bigint[]",
        "integer",
        "pg_catalog.cardinality($1)",
    ),
    (
        "unnest",
        "bigint[]",
        "SETOF bigint",
        "pg_catalog.unnest($1)",
    ),
    (
        "unnest",
        "integer[]",
        "SETOF integer",
        "pg_catalog.unnest($1)",
    ),
    ("unnest", "date[]", "SETOF date", "pg_catalog.unnest($1)"),
];

/// Aggregates planted in public (an aggregate is a window function too, so `lag` and
/// `row_number` are planted as aggregates): (name, argument, state type, the state after one
/// more value `$2` on state `$1`, initial state).
const PLANTED_AGGREGATES: &[(&str, &str, &str, &str, Option<&str>)] = &[
    ("count", "*", "bigint", "$1 + 1", Some("0")),
    ("row_number", "*", "bigint", "$1 + 1", Some("0")),
    (
        "max",
        "bigint",
        "bigint",
        "CASE WHEN $1 IS NULL OR $2 > $1 THEN $2 ELSE $1 END",
        None,
    ),
    (
        "max",
        "integer",
        "integer",
        "CASE WHEN $1 IS NULL OR $2 > $1 THEN $2 ELSE $1 END",
        None,
    ),
    (
        "max",
        "date",
        "date",
        "CASE WHEN $1 IS NULL OR $2 > $1 THEN $2 ELSE $1 END",
        None,
    ),
    (
        "max",
        "text",
        "text",
        "CASE WHEN $1 IS NULL OR $2 > $1 THEN $2 ELSE $1 END",
        None,
    ),
    (
        "min",
        "bigint",
        "bigint",
        "CASE WHEN $1 IS NULL OR $2 < $1 THEN $2 ELSE $1 END",
        None,
    ),
    (
        "min",
        "integer",
        "integer",
        "CASE WHEN $1 IS NULL OR $2 < $1 THEN $2 ELSE $1 END",
        None,
    ),
    (
        "array_agg",
        "bigint",
        "bigint[]",
        "pg_catalog.array_append($1, $2)",
        None,
    ),
    (
        "array_agg",
        "uuid",
        "uuid[]",
        "pg_catalog.array_append($1, $2)",
        None,
    ),
    (
        "array_agg",
        "integer",
        "integer[]",
        "pg_catalog.array_append($1, $2)",
        None,
    ),
    ("lag", "bigint", "bigint", "$2", None),
    ("lag", "integer", "integer", "$2", None),
];

/// Operators planted in public: (operator, left, right, result, the genuine result).
const PLANTED_OPERATORS: &[(&str, &str, &str, &str, &str)] = &[
    ("=", "bigint", "integer", "boolean", "$1 = $2"),
    ("=", "bigint", "bigint", "boolean", "$1 = $2"),
    ("=", "integer", "integer", "boolean", "$1 = $2"),
    (">=", "bigint", "integer", "boolean", "$1 >= $2"),
    ("+", "integer", "integer", "integer", "$1 + $2"),
    ("=", "oid", "integer", "boolean", "$1 = $2::oid"),
    ("<>", "oid", "integer", "boolean", "$1 <> $2::oid"),
    ("=", "oid", "regclass", "boolean", "$1 = $2::oid"),
    ("=", "oid", "regnamespace", "boolean", "$1 = $2::oid"),
    ("=", "oid", "regtype", "boolean", "$1 = $2::oid"),
    ("=", "text", "text", "boolean", "$1 = $2"),
    ("<>", "text", "text", "boolean", "$1 <> $2"),
    ("=", "date", "date", "boolean", "$1 = $2"),
    ("=", "uuid", "uuid", "boolean", "$1 = $2"),
    ("<", "timestamptz", "timestamptz", "boolean", "$1 < $2"),
    (">=", "timestamptz", "timestamptz", "boolean", "$1 >= $2"),
    ("-", "timestamptz", "interval", "timestamptz", "$1 - $2"),
    ("-", "timestamp", "interval", "timestamp", "$1 - $2"),
];

/// The SQL that plants everything above in public, as libraryd: [`PLANT_RECORDER`], then each
/// object recording its call (`libraryd_was_here(k)`) before it gives the genuine result.
fn plants() -> String {
    let mut sql = PLANT_RECORDER.to_string();
    let mut k = 0;
    let mut record = |sql: &mut String, what: String| {
        k += 1;
        sql.push_str(&format!(
            "CREATE SEQUENCE public.planted_{k}; CREATE SEQUENCE public.planted_app_{k};
             GRANT USAGE ON SEQUENCE public.planted_{k}, public.planted_app_{k} TO PUBLIC;
             INSERT INTO public.planted (k, what) VALUES ({k}, {});\n",
            quote(&what)
        ));
        k
    };
    for (name, args, result, genuine) in PLANTED_FUNCTIONS {
        let k = record(&mut sql, format!("function {name}({args})"));
        let body = match result.strip_prefix("SETOF ") {
            Some(_) => format!("RETURN QUERY SELECT {genuine};"),
            None => format!("RETURN {genuine};"),
        };
        sql.push_str(&format!(
            "CREATE FUNCTION public.{name}({args}) RETURNS {result}
             LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
             BEGIN PERFORM public.libraryd_was_here({k}); {body} END $$;\n"
        ));
    }
    for (i, (name, arg, state, step, init)) in PLANTED_AGGREGATES.iter().enumerate() {
        let k = record(&mut sql, format!("aggregate {name}({arg})"));
        let params = if *arg == "*" {
            state.to_string()
        } else {
            format!("{state}, {arg}")
        };
        sql.push_str(&format!(
            "CREATE FUNCTION public.planted_step_{i}({params}) RETURNS {state}
             LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
             BEGIN PERFORM public.libraryd_was_here({k}); RETURN {step}; END $$;
             CREATE AGGREGATE public.{name}({arg}) (SFUNC = public.planted_step_{i}, STYPE = {state}{});\n",
            init.map(|i| format!(", INITCOND = '{i}'")).unwrap_or_default()
        ));
    }
    for (i, (op, left, right, result, genuine)) in PLANTED_OPERATORS.iter().enumerate() {
        let k = record(&mut sql, format!("operator {op}({left}, {right})"));
        sql.push_str(&format!(
            "CREATE FUNCTION public.planted_op_{i}({left}, {right}) RETURNS {result}
             LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
             BEGIN PERFORM public.libraryd_was_here({k}); RETURN {genuine}; END $$;
             CREATE OPERATOR public.{op} (LEFTARG = {left}, RIGHTARG = {right},
                                          FUNCTION = public.planted_op_{i});\n"
        ));
    }
    sql
}

fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// What planted objects did: how often they ran in a definer function, as a superuser and as the
/// migrator, which ran in any of those, and which ran in the runtime role's own statements.
struct PlantedRuns {
    in_definer: i64,
    as_superuser: i64,
    as_migrator: i64,
    with_settlementds_rights: Vec<String>,
    in_runtime_statements: Vec<String>,
}

async fn planted_runs(su: &mut PgConnection) -> PlantedRuns {
    let mut counts = [0i64; 3];
    for (i, seq) in ["ran_in_definer", "ran_as_superuser", "ran_as_migrator"]
        .iter()
        .enumerate()
    {
        counts[i] = sqlx::query_scalar(&format!(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.{seq}"
        ))
        .fetch_one(&mut *su)
        .await
        .unwrap();
    }
    let planted: Vec<(i32, String)> =
        sqlx::query_as("SELECT k, what FROM public.planted ORDER BY k")
            .fetch_all(&mut *su)
            .await
            .unwrap();
    let (mut rights, mut runtime) = (Vec::new(), Vec::new());
    for (k, what) in planted {
        let (settlementds, apps): (bool, bool) = sqlx::query_as(&format!(
            "SELECT (SELECT is_called FROM public.planted_{k}),
                    (SELECT is_called FROM public.planted_app_{k})"
        ))
        .fetch_one(&mut *su)
        .await
        .unwrap();
        if settlementds {
            rights.push(what.clone());
        }
        if apps {
            runtime.push(what);
        }
    }
    PlantedRuns {
        in_definer: counts[0],
        as_superuser: counts[1],
        as_migrator: counts[2],
        with_settlementds_rights: rights,
        in_runtime_statements: runtime,
    }
}

/// Ages the claims and audit events of `month` by 400 days, as if it had closed long ago.
async fn age_month(su: &mut PgConnection, month: &str) {
    for sql in [
        "UPDATE settlementd.job_runs
            SET started_at = started_at - interval '400 days',
                heartbeat_at = heartbeat_at - interval '400 days',
                finished_at = finished_at - interval '400 days'
          WHERE business_date = $1::date",
        "UPDATE settlementd.job_events SET at = at - interval '400 days'
          WHERE business_date = $1::date",
        "UPDATE settlementd.run_requests SET created_at = created_at - interval '400 days'
          WHERE business_date = $1::date",
    ] {
        sqlx::query(sql)
            .bind(month)
            .execute(&mut *su)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_libraryd_plants_in_public_never_runs_with_settlementds_rights() {
    let library = Library::settled().await;
    let mut su = library.superuser().await;
    let mut libraryd = library.as_libraryd().await;
    let journal = journal_rows(&mut su).await;

    // Every function PostgreSQL gives that settlementd's own functions call (read from their
    // bodies, so a new call is caught here) has a planted namesake.
    let called: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT m[1] FROM pg_proc p,
                regexp_matches(p.prosrc, 'pg_catalog\\.([a-z_0-9]+)\\s*\\(', 'g') AS m
          WHERE p.pronamespace = 'settlementd'::regnamespace ORDER BY 1",
    )
    .fetch_all(&mut su)
    .await
    .unwrap();
    assert!(called.len() >= 10, "{called:?}");
    for name in &called {
        assert!(
            PLANTED_FUNCTIONS.iter().any(|f| f.0 == name)
                || PLANTED_AGGREGATES.iter().any(|a| a.0 == name),
            "settlementd's functions call pg_catalog.{name}, which this test plants no overload of"
        );
    }
    libraryd_does(&mut libraryd, &plants()).await;
    // And functions of libraryd's that look like settlementd's, for roles.sql to find: one under
    // settlementd's names, one run by a trigger on loans under settlementd's names; both SECURITY
    // DEFINER, so given to the migrator they would run as the migrator.
    libraryd_does(
        &mut libraryd,
        "CREATE FUNCTION public.settlementd_gift() RETURNS void LANGUAGE plpgsql SECURITY DEFINER
             SET search_path = pg_catalog, pg_temp AS
             $$ BEGIN PERFORM public.libraryd_was_here(1); END $$;
         CREATE FUNCTION public.gift_on_loans() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
             SET search_path = pg_catalog, pg_temp AS
             $$ BEGIN PERFORM public.libraryd_was_here(1); RETURN NULL; END $$;
         CREATE TRIGGER settlementd_gift AFTER UPDATE ON loans
             FOR EACH STATEMENT EXECUTE FUNCTION public.gift_on_loans();",
    )
    .await;
    // The superuser's own look, with public on its path, would find them: they are there.
    let planted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_proc WHERE pronamespace = 'public'::regnamespace
            AND proowner = 'libraryd'::regrole",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert!(planted > 50, "{planted} functions planted");

    // libraryd's ordinary edits of settled loans, each firing one of settlementd's triggers.
    let settled: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM loans WHERE fine_settled_at IS NOT NULL AND fine_cents > 0
          ORDER BY id LIMIT 5",
    )
    .fetch_all(&mut libraryd)
    .await
    .unwrap();
    let [moved_due, moved_return, moved_member, renumbered, deleted] = settled[..] else {
        panic!("five settled loans with a fine: {settled:?}")
    };
    for sql in [
        format!("UPDATE loans SET due_on = due_on - 3 WHERE id = {moved_due}"),
        format!("UPDATE loans SET returned_on = DATE '2026-10-20' WHERE id = {moved_return}"),
        format!("UPDATE loans SET member_id = 424242 WHERE id = {moved_member}"),
        format!("UPDATE loans SET id = 900000 WHERE id = {renumbered}"),
        format!("DELETE FROM loans WHERE id = {deleted}"),
    ] {
        libraryd_does(&mut libraryd, &sql).await;
    }
    let queued: Vec<(i64, bool)> =
        sqlx::query_as("SELECT loan_id, deleted FROM settlementd.loan_changes ORDER BY loan_id")
            .fetch_all(&mut su)
            .await
            .unwrap();
    let mut expected = vec![
        (moved_due, false),
        (moved_return, false),
        (moved_member, false),
        (renumbered, true),
        (deleted, true),
    ];
    expected.sort();
    assert_eq!(queued, expected, "every edit of a settled loan is queued");
    let moves: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM settlementd.member_moves WHERE loan_id = $1 AND new_member_id = 424242",
    )
    .bind(moved_member)
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert_eq!(moves, 1);

    // settlementd re-prices them (the runtime role), proves the month, and an operator does the
    // routine: migrate as the migrator, roles.sql, a migrate by the superuser.
    library.settle(MONTH);
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM settlementd.loan_changes")
        .fetch_one(&mut su)
        .await
        .unwrap();
    assert_eq!(waiting, 0, "the edits were priced");
    let kinds: Vec<(i64, String)> = sqlx::query_as(
        "SELECT loan_id, kind FROM settlementd.fine_journal_entries
          WHERE loan_id IN ($1, $2, $3, $4, $5, 900000) AND kind <> 'settled'
          ORDER BY loan_id, seq",
    )
    .bind(moved_due)
    .bind(moved_return)
    .bind(moved_member)
    .bind(renumbered)
    .bind(deleted)
    .fetch_all(&mut su)
    .await
    .unwrap();
    for (loan, kind) in [
        (moved_due, "repriced"),
        (moved_return, "repriced"),
        (moved_member, "repriced"),
        (renumbered, "deleted"),
        (deleted, "deleted"),
        (900000, "late"),
    ] {
        assert!(
            kinds.contains(&(loan, kind.to_string())),
            "loan {loan}: no {kind} entry in {kinds:?}"
        );
    }
    assert_verified(&library.app, &[], MONTH);
    run_ok(settlementd(Some(&library.migrator)).arg("migrate"));
    apply_roles_sql(&library.admin).await;
    run_ok(settlementd(Some(&library.admin)).arg("migrate"));
    let replica = library.replica().await;
    assert_eq!(
        sample(&replica, "settlementd_loans_triggers_tampered").await,
        Some(0.0)
    );
    drop(replica);
    let gifts: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_userbyid(proowner)::text FROM pg_proc
          WHERE oid IN ('public.settlementd_gift()'::regprocedure,
                        'public.gift_on_loans()'::regprocedure)",
    )
    .fetch_all(&mut su)
    .await
    .unwrap();
    assert_eq!(
        gifts,
        [LIBRARYD, LIBRARYD],
        "roles.sql took libraryd's functions"
    );
    libraryd_does(
        &mut libraryd,
        &format!(
            "SELECT public.settlementd_gift();
             UPDATE loans SET returned_on = returned_on WHERE id = {moved_due}"
        ),
    )
    .await;

    // Retention, through its definer function: `settlementd prune`, and the name 0.2.0 calls.
    age_month(&mut su, MONTH).await;
    // (A month inside a job's lookback is kept whatever its age: none is watched here.)
    let pruned = run_ok(
        settlementd(Some(&library.app))
            .env("SETTLEMENTD__SETTLE__LOOKBACK_MONTHS", "0")
            .args(["prune", "--older-than", "30", "--json"]),
    );
    let pruned = json_of(&pruned);
    assert!(pruned["deleted"].as_i64().unwrap() > 0, "{pruned}");
    let mut app = PgConnection::connect(&library.app).await.unwrap();
    let state: String = sqlx::query_scalar(
        "SELECT state FROM public.settlementd_prune_period('fine-settlement', $1::date, 30, 100)",
    )
    .bind(MONTH)
    .fetch_one(&mut app)
    .await
    .unwrap();
    assert!(["kept", "done"].contains(&state.as_str()), "{state}");

    // Nothing planted ran with settlementd's rights: not inside a definer function (the
    // triggers, retention), not as the migrator, not as a superuser.
    // (What the runtime role's own statements ran, with its own rights, is
    // `runs.in_runtime_statements`: the rights any trigger libraryd adds to loans has.)
    let runs = planted_runs(&mut su).await;
    assert_eq!(
        (runs.in_definer, runs.as_superuser, runs.as_migrator),
        (0, 0, 0),
        "libraryd's planted objects ran with settlementd's rights: {:?} (and in the runtime \
         role's own statements: {:?})",
        runs.with_settlementds_rights,
        runs.in_runtime_statements
    );
    assert_eq!(
        libraryd_escalated(&mut su).await,
        (false, false, false),
        "libraryd gained a role"
    );
    journal_kept(&journal, &journal_rows(&mut su).await);
    let heads: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM settlementd.fine_heads),
                (SELECT count(DISTINCT loan_id) FROM settlementd.fine_journal_entries)",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert_eq!(heads.0, heads.1, "a head for every loan of the journal");

    // From the catalog: every function of settlementd's has its path pinned, public never on it,
    // and every SECURITY DEFINER one is the migrator's.
    let functions: Vec<(String, bool, String, Option<String>)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text, p.prosecdef, pg_get_userbyid(p.proowner)::text,
                (SELECT c FROM unnest(p.proconfig) AS c WHERE c LIKE 'search\\_path=%')
           FROM pg_proc p
          WHERE p.pronamespace = 'settlementd'::regnamespace
             OR (p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'settlementd\\_%'
                 AND p.proowner <> 'libraryd'::regrole)
          ORDER BY 1",
    )
    .fetch_all(&mut su)
    .await
    .unwrap();
    assert!(functions.len() >= 10, "{functions:?}");
    for (function, definer, owner, path) in &functions {
        let path = path.as_deref().unwrap_or("not pinned");
        let own_schema = !function.starts_with("public.");
        // The one exception: trigger_definition, an invoker function, prints every name outside
        // pg_catalog with its schema, so pg_catalog alone is its path.
        let pinned = path == "search_path=pg_catalog, settlementd, pg_temp"
            || (path == "search_path=pg_catalog" && !definer)
            || (!own_schema && path == "search_path=pg_catalog, pg_temp" && !definer);
        assert!(pinned, "{function}: {path}");
        assert_eq!(owner, MIGRATOR, "{function} is owned by {owner}");
    }
    assert!(
        functions.iter().filter(|f| f.1).count() >= 5,
        "the definer functions: {functions:?}"
    );
}

// --- b: what libraryd can drop ------------------------------------------------------------------

/// Every statement libraryd might try against what is settlementd's, enumerated from the catalog:
/// the schema; each relation in it (drop, truncate, rename, move, take, alter, write, read,
/// grant, revoke, a trigger of libraryd's on it); each function (drop, rename, take, re-path,
/// replace, grant, revoke); each trigger on its tables; and, in public, each view and function
/// settlementd keeps there for the release before, which libraryd may drop but not change.
async fn attempts_on_settlementds(su: &mut PgConnection) -> Vec<String> {
    let mut tries: Vec<String> = [
        "DROP SCHEMA settlementd CASCADE",
        "DROP SCHEMA settlementd",
        "ALTER SCHEMA settlementd RENAME TO libraryds",
        "ALTER SCHEMA settlementd OWNER TO libraryd",
        "COMMENT ON SCHEMA settlementd IS 'libraryd''s'",
        "GRANT USAGE, CREATE ON SCHEMA settlementd TO libraryd",
        "REVOKE USAGE ON SCHEMA settlementd FROM settlementd_app",
        "CREATE TABLE settlementd.libraryds (id int)",
        "CREATE VIEW settlementd.libraryds AS SELECT 1 AS x",
        "CREATE TYPE settlementd.libraryds AS (id int)",
        "CREATE FUNCTION settlementd.date_trunc(text, date) RETURNS date LANGUAGE sql AS 'SELECT $2'",
        "CREATE OPERATOR settlementd.= (LEFTARG = oid, RIGHTARG = regclass, FUNCTION = public.libraryds_eq)",
        "ALTER DEFAULT PRIVILEGES FOR ROLE settlementd_migrator IN SCHEMA settlementd
             GRANT ALL ON TABLES TO libraryd",
    ]
    .map(String::from)
    .to_vec();
    let relations: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.relkind::text, format('%I.%I', n.nspname, c.relname)
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = 'settlementd' AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'i')
          ORDER BY 2",
    )
    .fetch_all(&mut *su)
    .await
    .unwrap();
    assert!(
        relations.iter().filter(|r| r.0 == "r").count() >= 18,
        "{relations:?}"
    );
    for (kind, rel) in &relations {
        let statements: &[&str] = match kind.as_str() {
            "r" | "p" => &[
                "DROP TABLE {} CASCADE",
                "TRUNCATE {} CASCADE",
                "ALTER TABLE {} RENAME TO libraryds",
                "ALTER TABLE {} SET SCHEMA public",
                "ALTER TABLE {} OWNER TO libraryd",
                "ALTER TABLE {} ADD COLUMN libraryds int",
                "ALTER TABLE {} DISABLE TRIGGER ALL",
                "DELETE FROM {}",
                "INSERT INTO {} DEFAULT VALUES",
                "SELECT * FROM {}",
                "BEGIN; LOCK TABLE {}; COMMIT",
                "GRANT ALL ON {} TO libraryd",
                "REVOKE ALL ON {} FROM settlementd_app",
                "CREATE TRIGGER libraryds BEFORE INSERT OR UPDATE OR DELETE ON {}
                     FOR EACH ROW EXECUTE FUNCTION public.libraryds_trigger()",
            ],
            "v" | "m" => &[
                "DROP VIEW {} CASCADE",
                "ALTER VIEW {} RENAME TO libraryds",
                "ALTER VIEW {} OWNER TO libraryd",
                "CREATE OR REPLACE VIEW {} AS SELECT 1 AS x",
                "SELECT * FROM {}",
                "GRANT SELECT ON {} TO libraryd",
            ],
            "S" => &[
                "DROP SEQUENCE {} CASCADE",
                "ALTER SEQUENCE {} RESTART",
                "ALTER SEQUENCE {} OWNER TO libraryd",
                "SELECT setval('{}', 1)",
                "SELECT nextval('{}')",
            ],
            _ => &[
                "DROP INDEX {} CASCADE",
                "ALTER INDEX {} RENAME TO libraryds",
                "REINDEX INDEX {}",
            ],
        };
        tries.extend(statements.iter().map(|s| s.replace("{}", rel)));
    }
    let functions: Vec<(String, String)> = sqlx::query_as(
        "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
           FROM pg_proc p WHERE p.pronamespace = 'settlementd'::regnamespace ORDER BY 1",
    )
    .fetch_all(&mut *su)
    .await
    .unwrap();
    assert!(functions.len() >= 10, "{functions:?}");
    for (function, definition) in &functions {
        for statement in [
            "DROP FUNCTION {} CASCADE",
            "ALTER FUNCTION {} RENAME TO libraryds",
            "ALTER FUNCTION {} OWNER TO libraryd",
            "ALTER FUNCTION {} SET search_path = public",
            "ALTER FUNCTION {} SECURITY INVOKER",
            "GRANT EXECUTE ON FUNCTION {} TO libraryd",
            "REVOKE EXECUTE ON FUNCTION {} FROM PUBLIC",
        ] {
            tries.push(statement.replace("{}", function));
        }
        // Its own definition again, as CREATE OR REPLACE: what replacing its body would take.
        tries.push(definition.clone());
    }
    let triggers: Vec<(String, String)> = sqlx::query_as(
        "SELECT quote_ident(t.tgname), t.tgrelid::regclass::text FROM pg_trigger t
          WHERE t.tgrelid IN (SELECT oid FROM pg_class
                               WHERE relnamespace = 'settlementd'::regnamespace)
            AND NOT t.tgisinternal ORDER BY 2, 1",
    )
    .fetch_all(&mut *su)
    .await
    .unwrap();
    assert!(triggers.len() >= 3, "{triggers:?}");
    for (trigger, table) in &triggers {
        tries.push(format!("DROP TRIGGER {trigger} ON {table}"));
        tries.push(format!("ALTER TABLE {table} DISABLE TRIGGER {trigger}"));
        tries.push(format!(
            "ALTER TRIGGER {trigger} ON {table} RENAME TO libraryds"
        ));
    }
    // In public, settlementd's own for the release before: libraryd owns the schema, not them.
    let compat: Vec<(String, String)> = compat_objects(su).await;
    assert!(compat.len() >= 19, "{compat:?}");
    for (kind, name) in &compat {
        match kind.as_str() {
            "view" => {
                tries.push(format!("ALTER VIEW {name} RENAME TO libraryds"));
                tries.push(format!("ALTER VIEW {name} OWNER TO libraryd"));
                tries.push(format!("CREATE OR REPLACE VIEW {name} AS SELECT 1 AS x"));
            }
            _ => {
                tries.push(format!("ALTER FUNCTION {name} RENAME TO libraryds"));
                tries.push(format!("ALTER FUNCTION {name} OWNER TO libraryd"));
                tries.push(format!("ALTER FUNCTION {name} SET search_path = public"));
            }
        }
    }
    tries
}

/// What `public` keeps of settlementd's for the release before ("view" or "function", name).
async fn compat_objects(su: &mut PgConnection) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT 'view', format('public.%I', c.relname) FROM pg_class c
          WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'v'
            AND c.relowner = 'settlementd_migrator'::regrole
         UNION ALL
         SELECT 'function', p.oid::regprocedure::text FROM pg_proc p
          WHERE p.pronamespace = 'public'::regnamespace
            AND p.proowner = 'settlementd_migrator'::regrole
         ORDER BY 1, 2",
    )
    .fetch_all(su)
    .await
    .unwrap()
}

/// Rows in each of settlementd's tables, by table.
async fn record_rows(su: &mut PgConnection) -> Vec<(String, i64)> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT format('settlementd.%I', relname) FROM pg_class
          WHERE relnamespace = 'settlementd'::regnamespace AND relkind = 'r' ORDER BY 1",
    )
    .fetch_all(&mut *su)
    .await
    .unwrap();
    let mut rows = Vec::new();
    for table in tables {
        let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
            .fetch_one(&mut *su)
            .await
            .unwrap();
        rows.push((table, n));
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_of_loans_and_public_can_drop_nothing_of_settlementds() {
    let library = Library::settled().await;
    let mut su = library.superuser().await;
    let mut libraryd = library.as_libraryd().await;
    // What libraryd would attach: a trigger function, an operator's function.
    libraryd_does(
        &mut libraryd,
        "CREATE FUNCTION public.libraryds_trigger() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN RETURN NULL; END $$;
         CREATE FUNCTION public.libraryds_eq(oid, regclass) RETURNS boolean LANGUAGE sql AS
             'SELECT $1 = $2::oid';",
    )
    .await;
    let rows = record_rows(&mut su).await;
    let journal = journal_rows(&mut su).await;

    let tries = attempts_on_settlementds(&mut su).await;
    let mut not_refused = Vec::new();
    for sql in &tries {
        match outcome(&mut libraryd, sql).await {
            Err((code, _)) if code == DENIED => {}
            other => not_refused.push(format!("{sql}: {other:?}")),
        }
        // A refused statement inside BEGIN leaves the transaction to end.
        libraryd_does(&mut libraryd, "ROLLBACK").await;
    }
    assert!(
        not_refused.is_empty(),
        "libraryd was not refused ({} of {} statements):\n{}",
        not_refused.len(),
        tries.len(),
        not_refused.join("\n")
    );
    assert_eq!(record_rows(&mut su).await, rows, "the record is as it was");
    assert_eq!(libraryd_escalated(&mut su).await, (false, false, false));

    // What libraryd can do, as the owner of public and of the database: drop what public keeps
    // for the release before (they hold nothing), and give the database a path of its own.
    for (kind, name) in compat_objects(&mut su).await {
        libraryd_does(&mut libraryd, &format!("DROP {kind} {name}")).await;
    }
    libraryd_does(
        &mut libraryd,
        "ALTER DATABASE libraryd SET search_path = public",
    )
    .await;
    assert!(compat_objects(&mut su).await.is_empty());
    assert_eq!(
        record_rows(&mut su).await,
        rows,
        "no row of the record was lost"
    );
    journal_kept(&journal, &journal_rows(&mut su).await);
    // In their place, a table of its own under an old name: roles.sql, run again, leaves it
    // libraryd's.
    libraryd_does(
        &mut libraryd,
        "CREATE TABLE public.job_runs (id int); GRANT ALL ON public.job_runs TO PUBLIC;",
    )
    .await;
    apply_roles_sql(&library.admin).await;
    let owner: String = sqlx::query_scalar(
        "SELECT pg_get_userbyid(relowner)::text FROM pg_class WHERE oid = 'public.job_runs'::regclass",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert_eq!(owner, LIBRARYD);

    // This release still settles (a new month), proves both months, and serves.
    library.seed("2026-09-30", 10_000).await;
    library.settle("2026-09-30");
    assert_verified(&library.app, &[], "2026-09-30");
    assert_verified(&library.app, &[], MONTH);
    let replica = library.replica().await;
    assert_eq!(
        sample(&replica, "settlementd_ready").await,
        Some(1.0),
        "ready without public's views"
    );
}

// --- c: a column of a type libraryd made --------------------------------------------------------

/// A composite type of libraryd's, `public.{name}` holding one bigint, with an assignment cast to
/// bigint implemented by a function that counts its calls (`public.cast_ran`, not rolled back)
/// and tries to escalate with whatever rights it runs with, then returns the number.
fn type_with_a_cast(name: &str) -> String {
    format!(
        "CREATE TYPE public.{name} AS (v bigint);
         CREATE FUNCTION public.{name}_to_bigint(x public.{name}) RETURNS bigint
         LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
         BEGIN
             PERFORM nextval('public.cast_ran');
             BEGIN EXECUTE 'ALTER ROLE libraryd SUPERUSER'; EXCEPTION WHEN OTHERS THEN NULL; END;
             BEGIN EXECUTE 'DELETE FROM settlementd.fine_journal'; EXCEPTION WHEN OTHERS THEN NULL; END;
             RETURN x.v;
         END $$;
         CREATE CAST (public.{name} AS bigint) WITH FUNCTION public.{name}_to_bigint(public.{name})
             AS ASSIGNMENT;"
    )
}

/// How often libraryd's casts ran, whoever ran them.
async fn casts_ran(su: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM public.cast_ran")
        .fetch_one(su)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loans_column_of_a_type_libraryd_made_is_refused_before_its_cast_runs_with_settlementds_rights(
) {
    let library = Library::settled().await;
    let mut su = library.superuser().await;
    let mut libraryd = library.as_libraryd().await;
    let journal = journal_rows(&mut su).await;
    let (settled, unsettled): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT min(id) FROM loans WHERE fine_settled_at IS NOT NULL AND fine_cents > 0),
                (SELECT min(id) FROM loans WHERE fine_settled_at IS NULL AND returned_on IS NULL)",
    )
    .fetch_one(&mut libraryd)
    .await
    .unwrap();
    // The settled loan as settlementd's columns and libraryd's hold it, its fine as a number
    // whatever the column's type.
    let row = |fine: &str| {
        format!(
            "SELECT row_to_json(l)::jsonb - 'fine_cents', {fine}::text FROM loans l WHERE id = {settled}"
        )
    };
    let before: (serde_json::Value, String) = sqlx::query_as(&row("fine_cents"))
        .fetch_one(&mut libraryd)
        .await
        .unwrap();

    // fine_cents (the triggers read it and queue it as a bigint; no trigger names it, so its
    // owner may change its type) becomes a type of libraryd's.
    libraryd_does(
        &mut libraryd,
        &format!(
            "CREATE SEQUENCE public.cast_ran; GRANT USAGE ON SEQUENCE public.cast_ran TO PUBLIC;
             {}
             ALTER TABLE loans ALTER COLUMN fine_cents DROP DEFAULT;
             ALTER TABLE loans ALTER COLUMN fine_cents TYPE public.cents
                 USING ROW(fine_cents)::public.cents;",
            type_with_a_cast("cents")
        ),
    )
    .await;
    // Every edit of a settled loan is refused, saying why, before a value is used.
    for sql in [
        format!("UPDATE loans SET due_on = due_on + 1 WHERE id = {settled}"),
        format!("UPDATE loans SET returned_on = returned_on - 1 WHERE id = {settled}"),
        format!("UPDATE loans SET member_id = 424242 WHERE id = {settled}"),
        format!("UPDATE loans SET id = 900000 WHERE id = {settled}"),
        format!("DELETE FROM loans WHERE id = {settled}"),
    ] {
        let (code, message) = outcome(&mut libraryd, &sql)
            .await
            .expect_err(&format!("{sql} was not refused"));
        assert_eq!(code, DATATYPE_MISMATCH, "{sql}: {message}");
        assert!(
            message.contains("fine_cents") && message.contains("public.cents"),
            "{sql}: {message}"
        );
    }
    // libraryd's other work goes on: an unsettled loan's return fires nothing of settlementd's.
    libraryd_does(
        &mut libraryd,
        &format!("UPDATE loans SET returned_on = DATE '2026-11-03' WHERE id = {unsettled}"),
    )
    .await;
    let after: (serde_json::Value, String) = sqlx::query_as(&row("(fine_cents).v"))
        .fetch_one(&mut libraryd)
        .await
        .unwrap();
    assert_eq!(after, before, "the settled loan is as it was");
    // settlementd refuses the table itself, in one line, before anything is written.
    let out = cli(&library.app, &[], &["run", "--business-date", MONTH]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("fine_cents"),
        "{}",
        stderr_of(&out)
    );
    assert_eq!(casts_ran(&mut su).await, 0, "libraryd's cast ran");

    // member_id, which the triggers name: libraryd cannot change its type under them, but can
    // rename it and add a column of that name and a type of its own.
    libraryd_does(
        &mut libraryd,
        &format!(
            "ALTER TABLE loans ALTER COLUMN fine_cents TYPE bigint USING (fine_cents).v;
             ALTER TABLE loans ALTER COLUMN fine_cents SET DEFAULT 0;
             {}",
            type_with_a_cast("member_ref")
        ),
    )
    .await;
    let (code, message) = outcome(
        &mut libraryd,
        "ALTER TABLE loans ALTER COLUMN member_id TYPE public.member_ref
             USING ROW(member_id)::public.member_ref",
    )
    .await
    .expect_err("a column the triggers name keeps its type");
    assert_eq!(code, "0A000", "{message}");
    libraryd_does(
        &mut libraryd,
        "ALTER TABLE loans RENAME COLUMN member_id TO member_no;
         ALTER TABLE loans ADD COLUMN member_id public.member_ref;
         UPDATE loans SET member_id = ROW(member_no)::public.member_ref;",
    )
    .await;
    // (A session that ran the trigger functions before keeps their plans, made for the old row:
    // it is refused as well, by plpgsql, with a message of its own. A new session reads the row
    // afresh.)
    let (code, message) = outcome(
        &mut library.as_libraryd().await,
        &format!("UPDATE loans SET due_on = due_on + 1 WHERE id = {settled}"),
    )
    .await
    .expect_err("an edit of a settled loan is refused");
    assert_eq!(code, DATATYPE_MISMATCH, "{message}");
    assert!(
        message.contains("member_id") && message.contains("public.member_ref"),
        "{message}"
    );
    // And the trigger that named member_id now names member_no: not the one settlementd made.
    let guards = settlementd::db::guards(&mut su).await.unwrap();
    assert!(
        guards
            .loans_triggers
            .iter()
            .any(|t| t.starts_with("settlementd_settled_member_moved is not the trigger")),
        "{guards:?}"
    );

    assert_eq!(casts_ran(&mut su).await, 0, "libraryd's cast ran");
    assert_eq!(libraryd_escalated(&mut su).await, (false, false, false));
    journal_kept(&journal, &journal_rows(&mut su).await);
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM settlementd.loan_changes")
        .fetch_one(&mut su)
        .await
        .unwrap();
    assert_eq!(queued, 0, "nothing refused was queued");
}

// --- d: a first migrate by a superuser ----------------------------------------------------------

/// Everything of settlementd's that is not the migrator's: the schema, each relation in it, each
/// function in it, what public keeps for the release before, and each function a trigger of
/// settlementd's (on its tables, or on loans) runs.
async fn not_the_migrators(su: &mut PgConnection) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT 'schema settlementd: ' || pg_get_userbyid(nspowner) FROM pg_namespace
          WHERE nspname = 'settlementd' AND nspowner <> 'settlementd_migrator'::regrole
         UNION ALL
         SELECT format('%s: %s', c.oid::regclass, pg_get_userbyid(c.relowner)) FROM pg_class c
          WHERE (c.relnamespace = 'settlementd'::regnamespace
                 OR (c.relnamespace = 'public'::regnamespace AND c.relkind = 'v'))
            AND c.relowner <> 'settlementd_migrator'::regrole
         UNION ALL
         SELECT format('%s: %s', p.oid::regprocedure, pg_get_userbyid(p.proowner)) FROM pg_proc p
          WHERE (p.pronamespace = 'settlementd'::regnamespace
                 OR (p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'settlementd\\_%')
                 OR p.oid IN (SELECT t.tgfoid FROM pg_trigger t
                               WHERE NOT t.tgisinternal
                                 AND (t.tgrelid = 'public.loans'::regclass
                                      OR t.tgrelid IN (SELECT oid FROM pg_class WHERE relnamespace
                                                         = 'settlementd'::regnamespace))))
            AND p.proowner <> 'settlementd_migrator'::regrole
          ORDER BY 1",
    )
    .fetch_all(su)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_migrate_by_a_superuser_then_roles_sql_leaves_every_function_with_the_migrator() {
    let library = Library::before_settlementd().await;
    let mut su = library.superuser().await;
    let superuser: String = sqlx::query_scalar("SELECT current_user::text")
        .fetch_one(&mut su)
        .await
        .unwrap();
    // roles.sql never ran: no runtime role, no migrator that logs in (the cluster's other
    // database, migrated by the harness as the superuser, made one without a login). The
    // superuser migrates by hand, then runs roles.sql.
    let logins: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_roles WHERE rolname LIKE 'settlementd\\_%' AND rolcanlogin",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert_eq!(logins, 0);
    run_ok(settlementd(Some(&library.admin)).arg("migrate"));
    apply_roles_sql(&library.admin).await;
    assert_eq!(not_the_migrators(&mut su).await, Vec::<String>::new());
    let loans_owner: String = sqlx::query_scalar(
        "SELECT pg_get_userbyid(relowner)::text FROM pg_class WHERE oid = 'public.loans'::regclass",
    )
    .fetch_one(&mut su)
    .await
    .unwrap();
    assert_eq!(loans_owner, LIBRARYD);
    library.seed(MONTH, 1).await;
    library.settle(MONTH);
    assert_verified(&library.app, &[], MONTH);
    let replica = library.replica().await;

    // A definer function given to the superuser (by hand, a restore, an old release's migrate).
    let function = "settlementd.settlementd_loan_changed()";
    sqlx::raw_sql(&format!("ALTER FUNCTION {function} OWNER TO {superuser}"))
        .execute(&mut su)
        .await
        .unwrap();
    let out = cli(&library.migrator, &[], &["migrate"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains(function) && stderr_of(&out).contains("roles.sql"),
        "{}",
        stderr_of(&out)
    );
    let said = replica.wait_for("/readyz", 503).await;
    assert!(
        said.contains(function) && said.contains(&format!("superuser {superuser}")),
        "{said}"
    );
    assert_eq!(
        sample(&replica, "settlementd_not_ready{reason=\"definer_owner\"}").await,
        Some(1.0)
    );

    // roles.sql gives it back: migrate runs, the replica is ready.
    apply_roles_sql(&library.admin).await;
    assert_eq!(not_the_migrators(&mut su).await, Vec::<String>::new());
    run_ok(settlementd(Some(&library.migrator)).arg("migrate"));
    replica.wait_for("/readyz", 200).await;
    assert_eq!(
        sample(&replica, "settlementd_not_ready{reason=\"definer_owner\"}").await,
        Some(0.0)
    );

    // roles.sql again, as after every migration, while a runtime transaction reads every table of
    // settlementd's: it takes no lock on what the migrator owns already, so it does not wait
    // (one ALTER … OWNER per table, each an ACCESS EXCLUSIVE lock, deadlocked with replicas).
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT format('settlementd.%I', relname) FROM pg_class
          WHERE relnamespace = 'settlementd'::regnamespace AND relkind = 'r'
            AND has_table_privilege('settlementd_app', oid, 'SELECT')",
    )
    .fetch_all(&mut su)
    .await
    .unwrap();
    assert!(tables.len() >= 15, "{tables:?}");
    let mut reader = PgConnection::connect(&library.app).await.unwrap();
    let reads: Vec<String> = tables
        .iter()
        .map(|t| format!("SELECT count(*) FROM {t};"))
        .collect();
    sqlx::raw_sql(&format!("BEGIN; {}", reads.join(" ")))
        .execute(&mut reader)
        .await
        .unwrap();
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        apply_roles_sql(&library.admin),
    )
    .await
    .expect("roles.sql waited for the runtime role's reads");
    sqlx::raw_sql("ROLLBACK")
        .execute(&mut reader)
        .await
        .unwrap();
}

// --- e: settlementd's triggers on loans ---------------------------------------------------------

/// `verify --json` of [`MONTH`] as the runtime role: (right, the trigger findings).
fn verified_triggers(library: &Library) -> (bool, Vec<String>) {
    let (code, report) = verify(&library.app, &[], MONTH);
    let right = report["right"].as_bool().unwrap();
    assert_eq!(code, Some(if right { 0 } else { 1 }), "{report}");
    let found = report["loans_triggers"]
        .as_array()
        .unwrap_or_else(|| panic!("no loans_triggers: {report}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    (right, found)
}

/// settlementd's trigger `name` on loans as migrate left it, recreated by the superuser.
async fn restore_trigger(su: &mut PgConnection, name: &str) {
    let definition: String =
        sqlx::query_scalar("SELECT definition FROM settlementd.loans_triggers WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *su)
            .await
            .unwrap();
    sqlx::raw_sql(&format!(
        "DROP TRIGGER IF EXISTS {name} ON public.loans; {definition};
         ALTER TABLE public.loans ENABLE ALWAYS TRIGGER {name};"
    ))
    .execute(&mut *su)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_dropped_or_changed_trigger_on_loans_is_seen_by_readyz_metrics_and_verify() {
    let library = Library::settled().await;
    let mut su = library.superuser().await;
    let mut libraryd = library.as_libraryd().await;
    let replica = library.replica().await;
    assert_eq!(verified_triggers(&library), (true, vec![]));

    // libraryd cannot make a trigger that runs settlementd's function: it may not name it.
    let (code, message) = outcome(
        &mut libraryd,
        "CREATE TRIGGER settlementd_settled_dates_changed_too AFTER UPDATE ON loans
             FOR EACH ROW EXECUTE FUNCTION settlementd.settlementd_loan_changed()",
    )
    .await
    .expect_err("libraryd names settlementd's function");
    assert_eq!(code, DENIED, "{message}");

    // (trigger, what is done to it, by libraryd or else by the superuser, and what /readyz says)
    let tampers = [
        (
            "settlementd_settled_deleted",
            "ALTER TABLE loans DISABLE TRIGGER settlementd_settled_deleted",
            true,
            "settlementd_settled_deleted is disabled",
        ),
        (
            "settlementd_settled_member_moved",
            "ALTER TABLE loans ENABLE TRIGGER settlementd_settled_member_moved",
            true,
            "settlementd_settled_member_moved fires only in origin sessions",
        ),
        (
            "settlementd_settled_renumbered",
            "DROP TRIGGER settlementd_settled_renumbered ON loans",
            true,
            "settlementd_settled_renumbered is missing on loans",
        ),
        (
            "settlementd_settled_dates_changed",
            "DROP TRIGGER settlementd_settled_dates_changed ON public.loans;
             CREATE TRIGGER settlementd_settled_dates_changed
                 AFTER UPDATE OF returned_on, due_on ON public.loans FOR EACH ROW
                 WHEN (OLD.fine_settled_at IS NOT NULL
                       AND OLD.returned_on IS DISTINCT FROM NEW.returned_on)
                 EXECUTE FUNCTION settlementd.settlementd_loan_changed();
             ALTER TABLE public.loans ENABLE ALWAYS TRIGGER settlementd_settled_dates_changed;",
            false,
            "settlementd_settled_dates_changed is not the trigger settlementd created",
        ),
    ];
    for (trigger, tamper, by_libraryd, says) in tampers {
        if by_libraryd {
            libraryd_does(&mut libraryd, tamper).await;
        } else {
            sqlx::raw_sql(tamper).execute(&mut su).await.unwrap();
        }
        let said = replica.wait_for("/readyz", 503).await;
        assert!(said.contains(says), "{trigger}: {said}");
        assert_eq!(
            sample(&replica, "settlementd_loans_triggers_tampered").await,
            Some(1.0),
            "{trigger}"
        );
        assert_eq!(
            sample(&replica, "settlementd_not_ready{reason=\"loans_triggers\"}").await,
            Some(1.0),
            "{trigger}"
        );
        let (right, found) = verified_triggers(&library);
        assert!(!right, "{trigger}: verify is right");
        assert!(
            found.len() == 1 && found[0].starts_with(says),
            "{trigger}: {found:?}"
        );

        restore_trigger(&mut su, trigger).await;
        replica.wait_for("/readyz", 200).await;
        assert_eq!(
            sample(&replica, "settlementd_loans_triggers_tampered").await,
            Some(0.0),
            "{trigger} restored"
        );
        assert_eq!(
            sample(&replica, "settlementd_not_ready{reason=\"loans_triggers\"}").await,
            Some(0.0),
            "{trigger} restored"
        );
        assert_eq!(
            verified_triggers(&library),
            (true, vec![]),
            "{trigger} restored"
        );
    }
}
