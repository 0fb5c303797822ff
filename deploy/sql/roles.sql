-- Least privilege for settlementd, in the libraryd database. Run as a superuser or the database
-- owner, with psql -v ON_ERROR_STOP=1 -d libraryd -f deploy/sql/roles.sql:
--   1. once before the first `settlementd migrate`, to create the roles;
--   2. again after a migration that adds a table settlementd itself names below, to give it its
--      exact grants (it is idempotent, and each run resets settlementd_app to exactly the grants
--      below). A job's own tables need neither a line here nor a re-run: see "A job's own tables".
-- It runs as one transaction: a re-run is atomic, so settlementd_app, working meanwhile, never
-- sees its grants revoked and not yet granted again; an error leaves everything as it was.
-- Set the passwords yourself (psql: \password settlementd_app); none is stored here.
--
-- settlementd_migrator runs `settlementd migrate` and owns what the migrations create: the schema
-- `settlementd` and everything in it (the job tables, the journal, the migration ledgers, every
-- function), where no other role may create and which libraryd (the owner of `public`) cannot
-- drop; and, in `public`, only the views the release before 0.3.0 reads (docs/OPERATIONS.md,
-- "A schema of its own"). It may create the schema (CREATE on the database). It owns every
-- function of settlementd's, whoever migrated first: this file hands each one to it (enumerated
-- from the catalog), so none runs as a superuser. It is a member of the role owning libraryd's loans, without
-- inheriting that role's rights (NOINHERIT; on PostgreSQL 16+ also WITH INHERIT FALSE): it cannot
-- read or drop libraryd's other tables, and `settlementd migrate` takes the owner's role
-- (SET LOCAL ROLE) only for the migrations that alter loans, one transaction each.
-- settlementd_app runs `run`, `serve` and `status` (with database.migrate_on_start = false):
--   loans            SELECT, and UPDATE of fine_cents, fine_settled_at and fine_seq only
--   job_runs         SELECT, INSERT, UPDATE (claims, heartbeats, fenced progress)
--   run_requests     SELECT, INSERT, UPDATE (manual run requests over HTTP)
--   run_request_shards SELECT, INSERT, UPDATE (each requested shard's state)
--   job_events       SELECT, INSERT (the audit trail: never updated)
--   job_pauses       SELECT, INSERT, DELETE (pause and resume)
--   replicas         SELECT, INSERT, UPDATE, DELETE (each serve process's release and readiness,
--                    upserted every heartbeat; rows not seen for a day are deleted)
--   member_fine_statements SELECT, INSERT, UPDATE, DELETE (the member-statements job's output)
--   member_statement_marks SELECT, INSERT, UPDATE (how far each shard's statements follow)
--   job_params       SELECT, INSERT, UPDATE (each month's pinned fine rule; UPDATE for `correct`)
--   fine_corrections SELECT, INSERT, UPDATE (corrections by key; UPDATE marks one complete)
--   fine_adjustments SELECT, INSERT (every fine a correction changed: append-only)
--   fine_journal     SELECT, INSERT (the money journal: every change to a fine, append-only)
--   fine_heads       SELECT, INSERT (each loan's last entry on the record, kept by a trigger on
--                    the journal that runs as its owner; a batch of loans the journal never knew
--                    inserts their first heads itself. INSERT gives nothing INSERT on the journal
--                    does not: the trigger makes a head of any entry inserted. Never UPDATE or
--                    DELETE)
--   loan_changes     SELECT, DELETE (libraryd's edits of settled loans, queued by settlementd's
--                    triggers on loans; a re-pricing deletes what it did)
--   member_moves     SELECT (settled loans moved to another member, kept by a trigger on loans
--                    that runs as its owner; the member statements recompute the old members)
--   _sqlx_migrations, settlementd_migrations SELECT (/readyz compares them with the binary's
--                    migrations: the first holds those up to 20261205000001, the second the later ones)
--   loans_triggers   SELECT, and settlementd.trigger_definition(oid) EXECUTE (/readyz compares
--                    settlementd's triggers on loans with what migrate left)
--   the schema settlementd USAGE; each view `public` keeps for the release before 0.3.0 the grants
--                    of its table
--   settlementd_prune_period(job, date, older_than_days, limit) EXECUTE: retention
--                    (`settlementd prune`, retention.enabled). The function runs as its owner, the
--                    migrator, and deletes only the audit trail, requests and claims of a period
--                    in which nothing happened for older_than_days (at least 1), keeping request
--                    keys at least 30 days; it decides that in the statement that deletes, and
--                    checks it again after (docs/OPERATIONS.md, "Retention").
-- and nothing else: no DELETE but of the edit queue, a pause, a replica not seen for a day and the
-- statements job's own rows; the audit trail, requests and claims only through that function —
-- never the money journal, fine_adjustments, fine_corrections or job_params; no TRUNCATE, no DDL,
-- no other column of loans. (Release 0.1.0 deleted old audit rows itself: beside this grant set its
-- retention fails with 42501, logged, and changes nothing; docs/OPERATIONS.md, "From 0.1.0 to
-- 0.2.0".) libraryd's own roles need nothing: the triggers' function runs as its owner, the
-- migrator (SECURITY DEFINER).
-- A job's own tables: a table the migrator creates that this file does not name (a new job's
-- output, docs/ADDING-A-JOB.md) gets SELECT, INSERT, UPDATE, DELETE, and USAGE on its sequences,
-- through the migrator's default privileges, the moment its migration creates it, and again from
-- every run of this file; no TRUNCATE, REFERENCES, TRIGGER or DDL. A table named below has exactly
-- its grants instead: settlementd's own tables, where append-only matters (the journal, the audit
-- trail), are named, and a later release that adds one names it here. Run `settlementd migrate` as
-- the migrator (as the deploy files do): a table another role creates gets nothing by default.

BEGIN;

-- libraryd owns `public` (PostgreSQL 15+ gives it to the database owner) and may create functions
-- and operators there, which a superuser's session with `public` on its path would run instead of
-- PostgreSQL's own wherever they fit the arguments better (a `public.format(text, name)` is picked
-- over `pg_catalog.format(text, VARIADIC "any")`): this file finds every name in pg_catalog alone,
-- and names libraryd's table with its schema (public.loans).
SET LOCAL search_path = pg_catalog, pg_temp;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'settlementd_migrator') THEN
        CREATE ROLE settlementd_migrator LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'settlementd_app') THEN
        CREATE ROLE settlementd_app LOGIN;
    END IF;
END
$$;
-- LOGIN: a `migrate` run by a superuser creates settlementd_migrator without one when it is
-- missing (it needs a role to give settlementd's functions to).
ALTER ROLE settlementd_migrator LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT;
ALTER ROLE settlementd_app LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS;

DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO settlementd_migrator, settlementd_app',
                   current_database());
    -- The migration that makes settlementd's schema (20261210000001) creates it.
    EXECUTE format('GRANT CREATE ON DATABASE %I TO settlementd_migrator', current_database());
END
$$;
-- PostgreSQL 15 already denies CREATE in public to PUBLIC; older servers allow it.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE, CREATE ON SCHEMA public TO settlementd_migrator;
GRANT USAGE ON SCHEMA public TO settlementd_app;

-- Ownership. Migrations alter what they created, so the migrator owns settlementd's schema and
-- everything in it even when an earlier `settlementd migrate` ran as another role; in a database
-- not moved yet (before 0.3.0's migrate), the same tables in public. Every function of
-- settlementd's, found in the catalog (no list to forget one in): those in its schema, those in
-- public under its names (`settlementd_…`), and any a trigger of its runs — each runs as its
-- owner when it is SECURITY DEFINER, which must be the migrator, never a superuser that happened
-- to migrate. A function is given only from a superuser: one another role owns, that role could
-- have rewritten (libraryd, which owns public, may create `public.settlementd_anything()` SECURITY
-- DEFINER, or a trigger named `settlementd_…` on loans), and given to the migrator it would run
-- as the migrator. Likewise a relation in public once settlementd has its schema (public then
-- holds only views for the release before, which the migrator or a superuser made). Nothing the
-- migrator owns already is given again: ALTER … OWNER takes an ACCESS EXCLUSIVE lock even then,
-- and a re-run taking one on every table in turn deadlocks with the replicas reading them.
DO $$
DECLARE
    name text;
    obj record;
BEGIN
    IF (SELECT nspowner <> 'settlementd_migrator'::regrole FROM pg_namespace
         WHERE nspname = 'settlementd') THEN
        ALTER SCHEMA settlementd OWNER TO settlementd_migrator;
    END IF;
    FOR obj IN
        SELECT CASE c.relkind WHEN 'v' THEN 'VIEW' WHEN 'S' THEN 'SEQUENCE' ELSE 'TABLE' END AS kind,
               format('%I.%I', n.nspname, c.relname) AS name
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'settlementd' AND c.relkind IN ('r', 'p', 'v', 'S')
           AND c.relowner <> 'settlementd_migrator'::regrole
           AND NOT (c.relkind = 'S' AND EXISTS (SELECT FROM pg_depend d
                                                 WHERE d.objid = c.oid AND d.deptype IN ('a', 'i')
                                                   AND d.classid = 'pg_class'::regclass))
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO settlementd_migrator', obj.kind, obj.name);
    END LOOP;
    FOREACH name IN ARRAY ARRAY['job_runs', 'job_events', 'run_requests', 'run_request_shards',
                                'job_params', 'fine_corrections', 'fine_adjustments',
                                'fine_journal', 'fine_journal_entries', 'fine_heads',
                                'loan_changes', 'member_moves', 'job_pauses',
                                'member_fine_statements', 'member_statement_marks',
                                'replicas', '_sqlx_migrations', 'settlementd_migrations'] LOOP
        SELECT c.relkind INTO obj FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
         WHERE c.oid = to_regclass(format('public.%I', name))
           AND c.relowner <> 'settlementd_migrator'::regrole
           AND (r.rolsuper OR to_regnamespace('settlementd') IS NULL);
        IF FOUND THEN
            EXECUTE format('ALTER %s public.%I OWNER TO settlementd_migrator',
                           CASE obj.relkind WHEN 'v' THEN 'VIEW' ELSE 'TABLE' END, name);
        END IF;
    END LOOP;
    FOR obj IN
        SELECT format('%I.%I(%s)', n.nspname, p.proname, pg_get_function_identity_arguments(p.oid))
                 AS name
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
          JOIN pg_roles r ON r.oid = p.proowner
         WHERE (n.nspname = 'settlementd'
                OR (n.nspname = 'public'
                    AND (p.proname LIKE 'settlementd\_%'
                         OR p.oid IN (SELECT t.tgfoid FROM pg_trigger t
                                       WHERE t.tgname LIKE 'settlementd\_%'
                                          OR t.tgrelid IN (SELECT c.oid FROM pg_class c
                                                            WHERE c.relowner = 'settlementd_migrator'::regrole)))))
           AND r.rolsuper
    LOOP
        EXECUTE format('ALTER FUNCTION %s OWNER TO settlementd_migrator', obj.name);
    END LOOP;
END
$$;

-- loans belongs to libraryd. settlementd's migrations add fine_settled_at and an index to it, which
-- PostgreSQL allows only its owner: the migrator becomes a member of that owner role, without its
-- rights unless it sets the role (which `settlementd migrate` does for those migrations alone),
-- unless the owner is a superuser (never hand that out), in which case run the first
-- `settlementd migrate` as the owner. In a new database the migrator creates loans and owns it.
DO $$
DECLARE
    owner name;
    is_super boolean;
BEGIN
    SELECT r.rolname, r.rolsuper INTO owner, is_super
      FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
     WHERE c.oid = to_regclass('public.loans');
    IF owner IS NULL OR owner = 'settlementd_migrator' THEN
        RETURN;
    ELSIF is_super THEN
        RAISE NOTICE 'loans is owned by superuser %: run migrations that alter loans as its owner', owner;
    ELSIF current_setting('server_version_num')::int >= 160000 THEN
        -- Per membership since 16 (the role's NOINHERIT is only the default of new grants).
        EXECUTE format('GRANT %I TO settlementd_migrator WITH INHERIT FALSE, SET TRUE', owner);
    ELSE
        -- Up to 15, the role's NOINHERIT (above) applies to every membership.
        EXECUTE format('GRANT %I TO settlementd_migrator', owner);
    END IF;
END
$$;

-- A job's own tables, from now on: granted when the migrator creates them (in settlementd's
-- schema; in public before it exists).
ALTER DEFAULT PRIVILEGES FOR ROLE settlementd_migrator IN SCHEMA public
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO settlementd_app;
ALTER DEFAULT PRIVILEGES FOR ROLE settlementd_migrator IN SCHEMA public
    GRANT USAGE ON SEQUENCES TO settlementd_app;
DO $$
BEGIN
    IF to_regnamespace('settlementd') IS NOT NULL THEN
        ALTER DEFAULT PRIVILEGES FOR ROLE settlementd_migrator IN SCHEMA settlementd
            GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO settlementd_app;
        ALTER DEFAULT PRIVILEGES FOR ROLE settlementd_migrator IN SCHEMA settlementd
            GRANT USAGE ON SEQUENCES TO settlementd_app;
        GRANT USAGE ON SCHEMA settlementd TO settlementd_app;
        REVOKE ALL ON ALL TABLES IN SCHEMA settlementd FROM settlementd_app;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA settlementd FROM settlementd_app;
    END IF;
END
$$;

-- The runtime role: first revoke everything (table and column privileges), then grant exactly.
REVOKE ALL ON ALL TABLES IN SCHEMA public FROM settlementd_app;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM settlementd_app;
DO $$
DECLARE
    grant_ record;
    seq regclass;
    rel regclass;
    schema_ text;
BEGIN
    IF to_regclass('public.loans') IS NOT NULL THEN
        GRANT SELECT ON public.loans TO settlementd_app;
        IF (SELECT count(*) FROM pg_attribute
             WHERE attrelid = 'public.loans'::regclass AND NOT attisdropped
               AND attname IN ('fine_cents', 'fine_settled_at', 'fine_seq')) = 3 THEN
            GRANT UPDATE (fine_cents, fine_settled_at, fine_seq) ON public.loans TO settlementd_app;
        ELSIF (SELECT count(*) FROM pg_attribute
             WHERE attrelid = 'public.loans'::regclass AND NOT attisdropped
               AND attname IN ('fine_cents', 'fine_settled_at')) = 2 THEN
            GRANT UPDATE (fine_cents, fine_settled_at) ON public.loans TO settlementd_app;
            RAISE NOTICE 'loans has no fine_seq yet: run this again after settlementd migrate';
        ELSE
            RAISE NOTICE 'loans has no fine_settled_at yet: run this again after settlementd migrate';
        END IF;
    END IF;
    CREATE TEMPORARY TABLE settlementd_grants ON COMMIT DROP AS
        SELECT * FROM (VALUES ('loans', NULL),
                              ('job_runs', 'SELECT, INSERT, UPDATE'),
                              ('run_requests', 'SELECT, INSERT, UPDATE'),
                              ('run_request_shards', 'SELECT, INSERT, UPDATE'),
                              ('job_events', 'SELECT, INSERT'),
                              ('job_pauses', 'SELECT, INSERT, DELETE'),
                              ('replicas', 'SELECT, INSERT, UPDATE, DELETE'),
                              ('member_fine_statements', 'SELECT, INSERT, UPDATE, DELETE'),
                              ('member_statement_marks', 'SELECT, INSERT, UPDATE'),
                              ('job_params', 'SELECT, INSERT, UPDATE'),
                              ('fine_corrections', 'SELECT, INSERT, UPDATE'),
                              ('fine_adjustments', 'SELECT, INSERT'),
                              ('fine_journal', 'SELECT, INSERT'),
                              ('fine_heads', 'SELECT, INSERT'),
                              ('loan_changes', 'SELECT, DELETE'),
                              ('member_moves', 'SELECT'),
                              ('loans_triggers', 'SELECT'),
                              ('_sqlx_migrations', 'SELECT'),
                              ('settlementd_migrations', 'SELECT')) AS g(tbl, privileges);
    -- A job's own tables: what the migrator owns in settlementd's schema (or, before it exists,
    -- in public) and the list does not name.
    INSERT INTO settlementd_grants
    SELECT c.relname, 'SELECT, INSERT, UPDATE, DELETE'
      FROM pg_class c JOIN pg_roles r ON r.oid = c.relowner
     WHERE c.relnamespace = COALESCE(to_regnamespace('settlementd'), 'public'::regnamespace)
       AND c.relkind IN ('r', 'p') AND r.rolname = 'settlementd_migrator'
       AND c.relname NOT IN (SELECT tbl FROM settlementd_grants);
    FOR grant_ IN SELECT * FROM settlementd_grants WHERE privileges IS NOT NULL
    LOOP
        -- The table, in settlementd's schema (or, before it exists, in public), and the view the
        -- release before 0.3.0 reads it through in public.
        FOREACH schema_ IN ARRAY ARRAY['settlementd', 'public'] LOOP
            rel := to_regclass(format('%I.%I', schema_, grant_.tbl));
            CONTINUE WHEN rel IS NULL;
            EXECUTE format('GRANT %s ON %s TO settlementd_app', grant_.privileges, rel);
            -- A serial or identity id draws from a sequence owned by the table.
            IF grant_.privileges LIKE '%INSERT%' THEN
                FOR seq IN
                    SELECT d.objid::regclass FROM pg_depend d JOIN pg_class s ON s.oid = d.objid
                     WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
                       AND d.refobjid = rel AND s.relkind = 'S' AND d.deptype IN ('a', 'i')
                LOOP
                    EXECUTE format('GRANT USAGE ON SEQUENCE %s TO settlementd_app', seq);
                END LOOP;
            END IF;
        END LOOP;
    END LOOP;
    IF to_regclass('public.fine_journal_entries') IS NOT NULL THEN
        GRANT SELECT ON public.fine_journal_entries TO settlementd_app;
    END IF;
    IF to_regclass('settlementd.fine_journal_entries') IS NOT NULL THEN
        GRANT SELECT ON settlementd.fine_journal_entries TO settlementd_app;
    END IF;
    IF to_regprocedure('settlementd.trigger_definition(oid)') IS NOT NULL THEN
        REVOKE ALL ON FUNCTION settlementd.trigger_definition(oid) FROM PUBLIC;
        GRANT EXECUTE ON FUNCTION settlementd.trigger_definition(oid) TO settlementd_app;
    END IF;
    -- Retention's one way to delete audit rows (and its old name, for the release before 0.3.0);
    -- the check it calls is granted to nobody.
    FOREACH schema_ IN ARRAY ARRAY['settlementd', 'public'] LOOP
        IF to_regprocedure(format('%I.settlementd_prune_period(text, date, integer, integer)', schema_)) IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON FUNCTION %I.settlementd_prune_period(text, date, integer, integer) FROM PUBLIC, settlementd_app', schema_);
            EXECUTE format('GRANT EXECUTE ON FUNCTION %I.settlementd_prune_period(text, date, integer, integer) TO settlementd_app', schema_);
        END IF;
        IF to_regprocedure(format('%I.settlementd_retention_untouched(text, date, timestamptz, timestamptz)', schema_)) IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON FUNCTION %I.settlementd_retention_untouched(text, date, timestamptz, timestamptz) FROM PUBLIC, settlementd_app', schema_);
        END IF;
    END LOOP;
    IF to_regprocedure('settlementd.settlementd_prune_period(text, date, integer, integer)') IS NULL
       AND to_regprocedure('public.settlementd_prune_period(text, date, integer, integer)') IS NULL THEN
        RAISE NOTICE 'no settlementd_prune_period yet: run this again after settlementd migrate';
    END IF;
END
$$;

COMMIT;
