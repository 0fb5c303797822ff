//! Applying the embedded migrations, and the two ledgers that record them.
//!
//! A migration is a message to the release before it, which keeps running beside the new one
//! during every rolling update and again after a rollback. Releases up to 0.1.0 (commit 0d20be2)
//! apply migrations as sqlx does and refuse a database whose `_sqlx_migrations` holds a version
//! they do not know ("migration … was previously applied but is missing"): a rollback with
//! `database.migrate_on_start = true` would crash-loop on the first migration of a newer release.
//! So `_sqlx_migrations` holds the migrations up to [`SQLX_LEDGER_LAST`], exactly as sqlx records
//! them, and every later one is recorded in `settlementd_migrations`, which older releases never
//! read. This module reads both, and accepts in either a version newer than every migration it
//! embeds: a newer release applied it, and migrations only expand (docs/OPERATIONS.md, "Upgrades"),
//! so this release still reads the schema. A version it does not know that is *older* than its
//! newest is a history it does not share (an edited build, a database of another branch): refused.
//!
//! An advisory lock (sqlx's) is held while migrating, so N replicas starting together is safe;
//! each migration runs in its own transaction with its ledger row.

use super::{DbError, Result};
use sqlx::migrate::{Migrate, MigrateError, Migration, Migrator};
use sqlx::{Connection, Executor, PgConnection, PgPool};

/// The embedded migrations. Private: sqlx's own `Migrator::run` would record every one in
/// `_sqlx_migrations`, where the previous release refuses what it does not know; [`migrate`] and
/// [`migrate_connection`] are the only way in, [`embedded`] the way to list them.
static MIGRATOR: Migrator = sqlx::migrate!();

/// The embedded migrations (up migrations only), oldest first.
pub fn embedded() -> impl Iterator<Item = &'static Migration> {
    up(&MIGRATOR)
}

/// The last migration recorded in sqlx's `_sqlx_migrations`; later ones go to
/// `settlementd_migrations` (see the module header).
pub const SQLX_LEDGER_LAST: i64 = 20261205000001;

/// The migrations that alter `loans`, libraryd's table, which only its owner may alter: the
/// migration role takes the owner's role for these alone ([`migrate`]). A test checks that every
/// migration naming `loans` is listed.
pub const LOANS_MIGRATIONS: &[i64] = &[
    20261130000002,
    20261201000001,
    20261203000002,
    20261208000002,
    20261209000002,
];

/// How long each migration waits for a lock before it gives up, changing nothing
/// ([`DbError::LockWait`]). A migration that alters a table waits for every transaction that uses
/// it, and while it waits every later user of the table queues behind it: without a bound, one
/// long transaction of libraryd's on `loans` (or a run's on settlementd's tables) would stop all
/// of libraryd's writes for as long as it lasts. Migration 20261210000001 sets the same bound in
/// its own file.
pub const LOCK_WAIT_SECS: u64 = 5;

/// The ledger of migrations after [`SQLX_LEDGER_LAST`]. `release` is the version of the binary
/// that applied each one, for an operator reading it after a rollback.
const CREATE_LEDGER: &str = "CREATE TABLE IF NOT EXISTS settlementd_migrations (
    version        bigint      PRIMARY KEY,
    description    text        NOT NULL,
    checksum       bytea       NOT NULL,
    applied_at     timestamptz NOT NULL DEFAULT now(),
    execution_time bigint      NOT NULL,
    release        text        NOT NULL
)";

/// One migration `migrate` applied.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Applied {
    pub version: i64,
    pub description: String,
}

/// What the database's ledgers hold, read in one place for `migrate` and `/readyz`.
#[derive(Debug, Default)]
struct Ledgers {
    /// Every applied version with its checksum, from both ledgers.
    applied: Vec<(i64, Vec<u8>)>,
}

impl Ledgers {
    async fn read(conn: &mut PgConnection) -> Result<Self> {
        let mut applied: Vec<(i64, Vec<u8>)> = Vec::new();
        for table in ["_sqlx_migrations", "settlementd_migrations"] {
            let sql = format!(
                "SELECT version, checksum FROM {table} WHERE {} ORDER BY version",
                if table == "_sqlx_migrations" {
                    "success"
                } else {
                    "true"
                }
            );
            match sqlx::query_as::<_, (i64, Vec<u8>)>(&sql)
                .fetch_all(&mut *conn)
                .await
            {
                Ok(rows) => applied.extend(rows),
                // Not created yet: nothing applied there.
                Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42P01") => {}
                Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42501") => {
                    return Err(DbError::Privilege(format!(
                        "this role may not read {table} ({}): run deploy/sql/roles.sql again \
                         after `settlementd migrate`, which grants it",
                        db.message()
                    )))
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(Self { applied })
    }

    fn get(&self, version: i64) -> Option<&[u8]> {
        self.applied
            .iter()
            .find(|(v, _)| *v == version)
            .map(|(_, c)| c.as_slice())
    }

    /// An applied version this binary does not embed and that is not newer than all it embeds.
    fn unknown_older(&self, migrator: &Migrator) -> Option<i64> {
        let newest = newest(migrator);
        self.applied
            .iter()
            .map(|(v, _)| *v)
            .find(|v| *v < newest && !migrator.iter().any(|m| m.version == *v))
    }

    /// Applied versions newer than every migration this binary embeds: a newer release's.
    fn newer(&self, migrator: &Migrator) -> Vec<i64> {
        let newest = newest(migrator);
        self.applied
            .iter()
            .map(|(v, _)| *v)
            .filter(|v| *v > newest)
            .collect()
    }
}

fn newest(migrator: &Migrator) -> i64 {
    migrator.iter().map(|m| m.version).max().unwrap_or(0)
}

fn up(migrator: &'static Migrator) -> impl Iterator<Item = &'static Migration> {
    migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
}

/// Applies the embedded migrations that are missing and returns them, oldest first. Refuses a
/// database with a dirty sqlx migration, a checksum that differs from the embedded file's, or an
/// unknown version older than this binary's newest. A migration of [`LOANS_MIGRATIONS`] runs
/// under the role that owns `loans` (`SET LOCAL ROLE`, for that transaction only) when the
/// migrating role is a member of it without inheriting its rights (deploy/sql/roles.sql); every
/// other statement runs with the migrating role's own rights.
pub async fn migrate(pool: &PgPool) -> Result<Vec<Applied>> {
    let mut pooled = pool.acquire().await?;
    migrate_connection(&mut pooled).await
}

/// [`migrate`] on one connection (its search path set first, as every session of settlementd's:
/// [`super::SEARCH_PATH_SQL`]).
///
/// Every function of settlementd's is owned by the migration role, whoever migrates: a superuser
/// that migrates (the embedded database, a first `migrate` run by hand) gives what it created to
/// `settlementd_migrator` afterwards ([`hand_over`]), and a role that is not one refuses, before
/// it applies anything, a database where a `SECURITY DEFINER` function of settlementd's is owned
/// by a superuser (it would run as that superuser), naming it ([`DbError::Privilege`]).
pub async fn migrate_connection(conn: &mut PgConnection) -> Result<Vec<Applied>> {
    conn.execute(super::SEARCH_PATH_SQL).await?;
    let superuser: bool =
        sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(&mut *conn)
            .await?;
    if !superuser {
        if let Some(refusal) = superuser_definers(&mut *conn).await?.first() {
            return Err(DbError::Privilege(format!(
                "{refusal}: it runs with a superuser's rights. Run deploy/sql/roles.sql as a \
                 superuser (it gives every function of settlementd's to settlementd_migrator), \
                 then `settlementd migrate` again"
            )));
        }
    }
    if MIGRATOR.locking {
        conn.lock().await?;
    }
    let mut result = apply_missing(conn).await;
    if superuser && result.is_ok() {
        if let Err(e) = hand_over(conn).await {
            result = Err(e);
        }
    }
    if MIGRATOR.locking {
        // Released with the session too, should this fail.
        let _ = conn.unlock().await;
    }
    result
        .map_err(refused_for_rights)
        .map_err(waited_for_a_lock)
}

/// A migration that waited [`LOCK_WAIT_SECS`] for a lock (SQLSTATE 55P03) was rolled back whole:
/// say so, and that running `migrate` again is the remedy (exit 1: it may pass). The hand-over
/// says so of itself ([`hand_over`]).
fn waited_for_a_lock(e: DbError) -> DbError {
    match &e {
        DbError::Migrate(MigrateError::ExecuteMigration(sqlx::Error::Database(db), version))
            if db.code().as_deref() == Some("55P03") =>
        {
            DbError::LockWait {
                step: format!("migration {version} was not applied"),
                reason: db.message().to_string(),
            }
        }
        _ => e,
    }
}

/// A migration this role has no right to apply (SQLSTATE 42501: "permission denied for schema
/// public" when the runtime role migrates on start) is a configuration error, exit 2, that says
/// what to change: no restart fixes it.
fn refused_for_rights(e: DbError) -> DbError {
    let db = match &e {
        DbError::Query(sqlx::Error::Database(db))
        | DbError::Migrate(MigrateError::Execute(sqlx::Error::Database(db)))
        | DbError::Migrate(MigrateError::ExecuteMigration(sqlx::Error::Database(db), _)) => db,
        _ => return e,
    };
    if db.code().as_deref() != Some("42501") {
        return e;
    }
    // The migration that makes settlementd's schema needs CREATE on the database, which
    // roles.sql gives the migration role: a migration role without it ran the old roles.sql.
    if db.message().contains("permission denied for database") {
        return DbError::Privilege(format!(
            "this role may not create settlementd's schema ({}): run the new \
             deploy/sql/roles.sql as a superuser first (it grants the migration role CREATE on \
             the database), then `settlementd migrate` again",
            db.message()
        ));
    }
    DbError::Privilege(format!(
        "this role may not apply settlementd's migrations ({}): apply them as the migration role \
         with `settlementd migrate` (deploy/sql/roles.sql), and set \
         database.migrate_on_start = false for the runtime role",
        db.message()
    ))
}

async fn apply_missing(conn: &mut PgConnection) -> Result<Vec<Applied>> {
    conn.ensure_migrations_table().await?;
    conn.execute(CREATE_LEDGER).await?;
    if let Some(version) = conn.dirty_version().await? {
        return Err(MigrateError::Dirty(version).into());
    }
    let ledgers = Ledgers::read(conn).await?;
    if let Some(unknown) = ledgers.unknown_older(&MIGRATOR) {
        return Err(MigrateError::VersionMissing(unknown).into());
    }
    let newer = ledgers.newer(&MIGRATOR);
    if !newer.is_empty() {
        tracing::info!(
            versions = %newer.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            "the database holds migrations of a newer release; this one reads their schema"
        );
    }
    let mut applied = Vec::new();
    for migration in up(&MIGRATOR) {
        match ledgers.get(migration.version) {
            Some(checksum) if checksum != &*migration.checksum => {
                return Err(MigrateError::VersionMismatch(migration.version).into())
            }
            Some(_) => continue,
            None => past_deadlocks(conn, Step::Apply(migration)).await?,
        }
        tracing::info!(
            version = migration.version,
            description = %migration.description,
            "migration applied"
        );
        applied.push(Applied {
            version: migration.version,
            description: migration.description.to_string(),
        });
    }
    Ok(applied)
}

/// How many times [`past_deadlocks`] tries a step of `migrate`.
const DEADLOCK_TRIES: u32 = 3;

/// A step of `migrate` that runs in one transaction.
enum Step<'a> {
    Apply(&'a Migration),
    HandOver,
}

impl Step<'_> {
    async fn run(&self, conn: &mut PgConnection) -> Result<()> {
        match self {
            Step::Apply(migration) => apply(conn, migration).await,
            Step::HandOver => hand_over_once(conn).await,
        }
    }
}

impl std::fmt::Display for Step<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Apply(migration) => write!(f, "migration {}", migration.version),
            Step::HandOver => f.write_str("hand-over"),
        }
    }
}

/// `step` on `conn`, tried again when PostgreSQL broke a deadlock by rolling it back (SQLSTATE
/// 40P01): the locks a migration or the hand-over takes one table after another crossed those of
/// a transaction of the release before, which uses the same tables during a rolling upgrade. The
/// step runs in one transaction, so the whole of it was undone and its next try starts from
/// nothing. The error stands after [`DEADLOCK_TRIES`].
async fn past_deadlocks(conn: &mut PgConnection, step: Step<'_>) -> Result<()> {
    let mut tries = 1;
    loop {
        match step.run(conn).await {
            Err(e) if tries < DEADLOCK_TRIES && is_deadlock(&e) => {
                tracing::warn!(step = %step, tries, error = %e, "a deadlock with another session rolled this step of migrate back; trying it again");
                tokio::time::sleep(std::time::Duration::from_millis(200 * u64::from(tries))).await;
                tries += 1;
            }
            done => return done,
        }
    }
}

/// PostgreSQL rolled the statement's transaction back to break a deadlock.
fn is_deadlock(e: &DbError) -> bool {
    let db = match e {
        DbError::Query(sqlx::Error::Database(db))
        | DbError::Migrate(MigrateError::ExecuteMigration(sqlx::Error::Database(db), _)) => db,
        _ => return false,
    };
    db.code().as_deref() == Some("40P01")
}

/// `migration` in one transaction with its ledger row. When the migration alters `loans` and the
/// migrating role is a member of the role owning `loans` but not its owner, the statements that
/// alter `loans` ([`alters_loans`]) run under the owner's role (`SET LOCAL ROLE`, reset after
/// each), the others (a `CREATE TABLE IF NOT EXISTS loans`, which needs the right to create in the
/// schema, not the table's ownership) under the migrating role; otherwise the file runs whole, as
/// sqlx runs it.
async fn apply(conn: &mut PgConnection, migration: &Migration) -> Result<()> {
    let started = std::time::Instant::now();
    let mut tx = Connection::begin(&mut *conn).await?;
    (&mut *tx)
        .execute(format!("SET LOCAL lock_timeout = '{LOCK_WAIT_SECS}s'").as_str())
        .await?;
    let owner: Option<String> = if LOANS_MIGRATIONS.contains(&migration.version) {
        loans_owner(&mut tx).await?
    } else {
        None
    };
    let failed = |e| DbError::from(MigrateError::ExecuteMigration(e, migration.version));
    match &owner {
        None => {
            (&mut *tx).execute(&*migration.sql).await.map_err(failed)?;
        }
        Some(owner) => {
            tracing::info!(version = migration.version, role = %owner, "migrating loans as its owner");
            for statement in statements(&migration.sql) {
                let as_owner = alters_loans(&statement);
                if as_owner {
                    // SET LOCAL ROLE, with the name as a parameter.
                    sqlx::query("SELECT set_config('role', $1, true)")
                        .bind(owner)
                        .execute(&mut *tx)
                        .await?;
                }
                (&mut *tx)
                    .execute(statement.as_str())
                    .await
                    .map_err(failed)?;
                if as_owner {
                    (&mut *tx).execute("RESET ROLE").await?;
                }
            }
        }
    }
    let took = started.elapsed().as_nanos() as i64;
    if migration.version <= SQLX_LEDGER_LAST {
        // Recorded as sqlx's `apply` records it, so databases migrated either way stay
        // interchangeable with the releases that read only this ledger.
        sqlx::query(
            "INSERT INTO _sqlx_migrations ( version, description, success, checksum, execution_time )
             VALUES ( $1, $2, TRUE, $3, $4 )",
        )
        .bind(migration.version)
        .bind(&*migration.description)
        .bind(&*migration.checksum)
        .bind(took)
        .execute(&mut *tx)
        .await?;
    } else {
        sqlx::query(
            "INSERT INTO settlementd_migrations (version, description, checksum, execution_time, release)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(migration.version)
        .bind(&*migration.description)
        .bind(&*migration.checksum)
        .bind(took)
        .bind(crate::version::VERSION)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// The role owning `loans` when the migrating role is a member of it and not that role itself,
/// read with PostgreSQL's names alone on the path ([`super::catalog_only`]).
async fn loans_owner(conn: &mut PgConnection) -> Result<Option<String>> {
    let mut read = super::catalog_only(conn).await?;
    let owner = sqlx::query_scalar(
        "SELECT r.rolname::text FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
          WHERE c.oid = to_regclass('public.loans') AND r.rolname <> current_user
            AND pg_has_role(current_user, r.oid, 'MEMBER')",
    )
    .fetch_optional(&mut *read)
    .await?;
    read.rollback().await?;
    Ok(owner)
}

/// The statements of a migration of [`LOANS_MIGRATIONS`], without comments: those files hold
/// plain DDL (no dollar quotes, no `;` or `--` inside literals), which a test checks.
pub fn statements(sql: &str) -> Vec<String> {
    let code: String = sql
        .lines()
        .map(|l| l.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    code.split(';')
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
        .collect()
}

/// A statement only the owner of `loans` may run: `ALTER TABLE loans`, an index or a trigger on
/// `loans`, and dropping one of its indexes or triggers.
pub fn alters_loans(statement: &str) -> bool {
    let s = statement.to_lowercase();
    s.starts_with("alter table loans ")
        || s.starts_with("drop index ")
        || (s.starts_with("drop trigger ") && s.ends_with(" on loans"))
        || (s.starts_with("create ") && (s.contains(" on loans ") || s.contains(" on loans(")))
}

/// settlementd's `SECURITY DEFINER` functions owned by a superuser, each as "function f() of
/// settlementd's is owned by superuser s": in its schema, and under its old names in `public`
/// (a database not moved yet). Empty when there are none (and before the schema exists). Read
/// with PostgreSQL's names alone on the path ([`super::catalog_only`]): the migrator runs this
/// before every migration, and a function or operator of libraryd's must not answer it with the
/// migrator's rights.
pub async fn superuser_definers(conn: &mut PgConnection) -> Result<Vec<String>> {
    let mut read = super::catalog_only(conn).await?;
    let found = sqlx::query_scalar(SUPERUSER_DEFINERS)
        .fetch_all(&mut *read)
        .await?;
    read.rollback().await?;
    Ok(found)
}

/// See [`superuser_definers`]: `pg_proc` and `pg_roles` are readable by every role. Run it with
/// [`super::CATALOG_PATH_SQL`]'s path.
pub const SUPERUSER_DEFINERS: &str =
    "SELECT format('function %s of settlementd''s is owned by superuser %s',
                   p.oid::regprocedure, pg_get_userbyid(p.proowner))
       FROM pg_proc p JOIN pg_roles r ON r.oid = p.proowner
      WHERE p.prosecdef AND r.rolsuper
        AND (p.pronamespace = to_regnamespace('settlementd')
             OR (p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'settlementd\\_%'))
      ORDER BY 1";

/// After a superuser migrated: gives the schema and everything of settlementd's that a superuser
/// owns (in the schema, and what `public` keeps for the release before) to `settlementd_migrator`,
/// created without a login if it does not exist yet (deploy/sql/roles.sql gives it one). The
/// functions then run as a role that owns settlementd's tables and nothing else.
/// It takes ACCESS EXCLUSIVE on each object it gives, in the order of their names, waiting at
/// most [`LOCK_WAIT_SECS`] for each, and is tried again after a deadlock ([`past_deadlocks`]).
async fn hand_over(conn: &mut PgConnection) -> Result<()> {
    past_deadlocks(conn, Step::HandOver)
        .await
        .map_err(|e| match &e {
            DbError::Query(sqlx::Error::Database(db)) if db.code().as_deref() == Some("55P03") => {
                DbError::LockWait {
                    step: "settlementd's objects were not given to settlementd_migrator"
                        .to_string(),
                    reason: db.message().to_string(),
                }
            }
            _ => e,
        })
}

async fn hand_over_once(conn: &mut PgConnection) -> Result<()> {
    let mut tx = Connection::begin(&mut *conn).await?;
    tx.execute(format!("SET LOCAL lock_timeout = '{LOCK_WAIT_SECS}s'").as_str())
        .await?;
    // A superuser runs this: with `public` on its path, a function or operator libraryd created
    // there (`format(text, name, name)`, `"="(oid, regnamespace)`) would run as that superuser.
    tx.execute(super::CATALOG_PATH_SQL).await?;
    tx.execute(HAND_OVER).await?;
    tx.commit().await?;
    Ok(())
}

const HAND_OVER: &str = "DO $$
DECLARE
    obj record;
BEGIN
    IF to_regnamespace('settlementd') IS NULL THEN
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'settlementd_migrator') THEN
        BEGIN
            CREATE ROLE settlementd_migrator NOLOGIN NOINHERIT;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- created meanwhile by another migrate on this server
        END;
    END IF;
    IF (SELECT rolsuper FROM pg_roles WHERE rolname = 'settlementd_migrator') THEN
        RAISE EXCEPTION 'settlementd_migrator is a superuser: make it NOSUPERUSER (deploy/sql/roles.sql)'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF (SELECT r.rolsuper FROM pg_namespace n JOIN pg_roles r ON r.oid = n.nspowner
         WHERE n.nspname = 'settlementd') THEN
        ALTER SCHEMA settlementd OWNER TO settlementd_migrator;
    END IF;
    FOR obj IN
        SELECT CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind,
               format('%I.%I', n.nspname, c.relname) AS name
          FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace
          JOIN pg_roles r ON r.oid = c.relowner
         WHERE r.rolsuper AND c.relkind IN ('r', 'p', 'v', 'S')
           AND (n.nspname = 'settlementd'
                OR (n.nspname = 'public' AND c.relkind = 'v'
                    AND c.relname IN ('job_runs', 'job_events', 'run_requests', 'run_request_shards',
                                      'job_params', 'fine_corrections', 'fine_adjustments',
                                      'fine_journal', 'fine_journal_entries', 'fine_heads',
                                      'loan_changes', 'member_moves', 'job_pauses',
                                      'member_fine_statements', 'member_statement_marks',
                                      'replicas', '_sqlx_migrations', 'settlementd_migrations')))
           -- A sequence owned by a table goes with it.
           AND NOT (c.relkind = 'S' AND EXISTS (SELECT FROM pg_depend d
                                                 WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')
                                                   AND d.classid = 'pg_class'::regclass))
         ORDER BY 2
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO settlementd_migrator', obj.kind, obj.name);
    END LOOP;
    FOR obj IN
        SELECT format('%I.%I(%s)', n.nspname, p.proname,
                      pg_get_function_identity_arguments(p.oid)) AS name
          FROM pg_proc p
          JOIN pg_roles r ON r.oid = p.proowner
          JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE r.rolsuper
           AND (p.pronamespace = 'settlementd'::regnamespace
                OR (p.pronamespace = 'public'::regnamespace AND p.proname LIKE 'settlementd\\_%'))
         ORDER BY 1
    LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO settlementd_migrator', obj.name);
    END LOOP;
END
$$";

/// True when every embedded migration is applied, in either ledger (what `/readyz` checks).
/// Migrations a newer release applied as well do not count against it: migrations stay
/// compatible with the release before them, so an old replica keeps serving during a rolling
/// upgrade and after a rollback (docs/OPERATIONS.md).
pub async fn schema_is_current(pool: &PgPool) -> Result<bool> {
    let mut conn = pool.acquire().await?;
    let ledgers = Ledgers::read(&mut conn).await?;
    Ok(up(&MIGRATOR).all(|m| ledgers.get(m.version).is_some()))
}
