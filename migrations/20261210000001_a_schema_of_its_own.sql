-- settlementd's record in a schema of its own (issue 47).
--
-- Until now every table, view and function of settlementd lived in `public`, which libraryd's
-- database owner owns (PostgreSQL 15+ gives `public` to `pg_database_owner`): the owner of a schema
-- may drop whatever it holds, so libraryd could drop the journal; and the SECURITY DEFINER trigger
-- functions on `loans` ran with `search_path = public`, so a function libraryd planted there (an
-- exact-type `public.date_trunc(text, date)`) ran with the rights of settlementd's migrator.
--
-- This migration moves everything of settlementd's into the schema `settlementd`, owned by the
-- role that migrates (deploy/sql/roles.sql: settlementd_migrator), where nobody else may create:
-- the tables with their indexes, sequences, constraints and triggers (ALTER ... SET SCHEMA keeps
-- every object's identity, so the triggers on `loans` keep calling the same functions, now
-- settlementd's, and nothing on `loans` is touched: libraryd's writes wait for no lock on it),
-- the view, both migration ledgers and every function. Every function gets `search_path` pinned to
-- `pg_catalog, settlementd, pg_temp` and names what it uses with its schema; the trigger functions
-- check the types of the loan row they read before using a value (a column of a type libraryd
-- made, with a cast of its own, would run libraryd's function with settlementd's rights).
--
-- The journal gains what the statements need to follow a loan: the member each entry's money is
-- priced for (`member_ids`, parallel to `loan_ids`; NULL in rows written before, read as the
-- loan's member), the heads the member (`fine_heads.member_id`), and the edit queue the member a
-- loan had before its edit (`loan_changes.old_member_id`). `heads_kept` marks the journal rows
-- whose writer keeps their heads itself (the settlement's batches of loans the journal never
-- knew): the heads trigger passes over them.
--
-- The release before this one (0.2.0, 453d645) keeps running beside this one during the rolling
-- upgrade and after a rollback. It names every object without a schema and finds it through the
-- default search path (`public`): so `public` keeps, for it alone, a view under each table's old
-- name (simple views: PostgreSQL writes through them, ON CONFLICT and FOR UPDATE included, and the
-- tables' triggers fire as before) and `settlementd_prune_period` as a function that calls this
-- schema's. They hold nothing: libraryd may drop them (0.2.0 then fails, and the record is whole);
-- the release after this one drops them. Each role keeps on a view the privileges it had on the
-- table, and USAGE on the schema. docs/DESIGN.md, "A schema of its own".
--
-- Locks: ACCESS EXCLUSIVE on each of settlementd's tables, sequences, views and functions it
-- moves, held until the migration commits (catalog updates only: no table is rewritten or
-- scanned; 50–113 ms on 2 M loans, docs/OPERATIONS.md), nothing on `loans`. A lock that waits
-- more than 5 s (a long transaction of the release before on one of them) makes the migration
-- fail and change nothing: run `settlementd migrate` again.
SET LOCAL lock_timeout = '5s';

CREATE SCHEMA IF NOT EXISTS settlementd;
REVOKE ALL ON SCHEMA settlementd FROM PUBLIC;

ALTER TABLE public.job_runs SET SCHEMA settlementd;
ALTER TABLE public.job_events SET SCHEMA settlementd;
ALTER TABLE public.run_requests SET SCHEMA settlementd;
ALTER TABLE public.run_request_shards SET SCHEMA settlementd;
ALTER TABLE public.job_params SET SCHEMA settlementd;
ALTER TABLE public.fine_corrections SET SCHEMA settlementd;
ALTER TABLE public.fine_adjustments SET SCHEMA settlementd;
ALTER TABLE public.fine_journal SET SCHEMA settlementd;
ALTER VIEW public.fine_journal_entries SET SCHEMA settlementd;
ALTER TABLE public.fine_heads SET SCHEMA settlementd;
ALTER TABLE public.loan_changes SET SCHEMA settlementd;
ALTER TABLE public.member_moves SET SCHEMA settlementd;
ALTER TABLE public.job_pauses SET SCHEMA settlementd;
ALTER TABLE public.member_fine_statements SET SCHEMA settlementd;
ALTER TABLE public.member_statement_marks SET SCHEMA settlementd;
ALTER TABLE public.replicas SET SCHEMA settlementd;
ALTER TABLE public._sqlx_migrations SET SCHEMA settlementd;
ALTER TABLE public.settlementd_migrations SET SCHEMA settlementd;

ALTER FUNCTION public.job_runs_rerun_forgets_descending_cursor() SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_claim_version() SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_loan_changed() SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_loan_renumbered() SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_member_moved() SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_journal_appended() SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_prune_period(text, date, integer, integer) SET SCHEMA settlementd;
ALTER FUNCTION public.settlementd_retention_untouched(text, date, timestamptz, timestamptz)
    SET SCHEMA settlementd;

-- What the statements need to follow a loan (nullable, no default: no table is rewritten).
ALTER TABLE settlementd.fine_journal ADD COLUMN member_ids bigint[];
ALTER TABLE settlementd.fine_journal ADD COLUMN heads_kept boolean;
ALTER TABLE settlementd.fine_journal ADD CONSTRAINT fine_journal_member_ids_parallel
    CHECK (member_ids IS NULL OR cardinality(member_ids) = cardinality(loan_ids)) NOT VALID;
-- lz4 where the server has it, as the other arrays (20261203000001): pglz compressing each batch's
-- members was 18 % of a run's batch statements (1 M loans, 225 k in the month).
DO $$
BEGIN
    ALTER TABLE settlementd.fine_journal ALTER COLUMN member_ids SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available on this server: member_ids keeps the default compression';
END
$$;
ALTER TABLE settlementd.fine_heads ADD COLUMN member_id bigint;
ALTER TABLE settlementd.loan_changes ADD COLUMN old_member_id bigint;

-- The journal one entry per loan, with the member each entry's money is priced for.
CREATE OR REPLACE VIEW settlementd.fine_journal_entries AS
SELECT j.id AS journal_id, j.month, j.kind, j.rule, j.shards, j.attempt, j.correction_key, j.at,
       e.loan_id, e.seq, e.due_on, e.returned_on, e.before_cents, e.after_cents, e.member_id
  FROM settlementd.fine_journal j,
       unnest(j.loan_ids, j.seqs, j.due_on, j.returned_on, j.before_cents, j.after_cents,
              j.member_ids)
         AS e(loan_id, seq, due_on, returned_on, before_cents, after_cents, member_id);

-- settlementd's triggers on libraryd's loans, as this migration leaves them: what `/readyz`,
-- `verify` and the `settlementd_loans_triggers_tampered` gauge compare the catalog with (a trigger
-- missing, disabled, or replaced by one of the same name that does something else).
CREATE TABLE settlementd.loans_triggers (
    name       text PRIMARY KEY,
    definition text NOT NULL
);

-- A loan row settlementd's trigger functions can read: each column they use of a type of
-- PostgreSQL's own (or a domain over one). Anything else is refused before a value is used, so
-- that no cast or operator of libraryd's runs with the definer's rights.
CREATE FUNCTION settlementd.loans_fit_or_refuse(rel pg_catalog.regclass) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, settlementd, pg_temp AS $$
DECLARE
    col record;
    base pg_catalog.oid;
BEGIN
    FOR col IN
        SELECT a.attname::pg_catalog.text AS name, a.atttypid AS typ
          FROM pg_catalog.pg_attribute a
         WHERE a.attrelid = rel AND a.attnum > 0 AND NOT a.attisdropped
           AND a.attname IN ('id', 'member_id', 'due_on', 'returned_on', 'fine_cents', 'fine_seq',
                             'fine_settled_at')
    LOOP
        base := col.typ;
        -- A domain over a domain over …: its base type.
        WHILE (SELECT t.typtype FROM pg_catalog.pg_type t WHERE t.oid = base) = 'd' LOOP
            base := (SELECT t.typbasetype FROM pg_catalog.pg_type t WHERE t.oid = base);
        END LOOP;
        IF NOT (CASE col.name
                    WHEN 'due_on' THEN base = 'pg_catalog.date'::pg_catalog.regtype
                    WHEN 'returned_on' THEN base = 'pg_catalog.date'::pg_catalog.regtype
                    WHEN 'fine_settled_at' THEN base = 'pg_catalog.timestamptz'::pg_catalog.regtype
                    WHEN 'fine_seq' THEN base = 'pg_catalog.int4'::pg_catalog.regtype
                    ELSE base IN ('pg_catalog.int2'::pg_catalog.regtype,
                                  'pg_catalog.int4'::pg_catalog.regtype,
                                  'pg_catalog.int8'::pg_catalog.regtype)
                END) THEN
            RAISE EXCEPTION 'settlementd: column %.% is of type %, which settlementd''s triggers do not read',
                rel, col.name, col.typ::pg_catalog.regtype
                USING ERRCODE = 'datatype_mismatch';
        END IF;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION settlementd.loans_fit_or_refuse(pg_catalog.regclass) FROM PUBLIC;

-- Where a settled loan's money is: its head's month (where the record holds it), or, for a loan
-- the journal does not know, the month of its return before the edit; a loan settled but never
-- returned (a return undone before these triggers existed) in the month before the month it was
-- settled in (UTC), the month a run then settles.
CREATE FUNCTION settlementd.settled_month(p_loan pg_catalog.int8, p_returned pg_catalog.date,
                                          p_settled pg_catalog.timestamptz)
RETURNS pg_catalog.date
LANGUAGE sql STABLE SET search_path = pg_catalog, settlementd, pg_temp AS $$
    SELECT COALESCE(
        (SELECT h.month FROM settlementd.fine_heads h WHERE h.loan_id = p_loan),
        CASE WHEN p_returned IS NOT NULL AND pg_catalog.isfinite(p_returned)
             THEN pg_catalog.date_trunc('month'::pg_catalog.text,
                                        p_returned::pg_catalog.timestamp)::pg_catalog.date
             ELSE (pg_catalog.date_trunc('month'::pg_catalog.text,
                                         pg_catalog.timezone('UTC'::pg_catalog.text, p_settled))
                   - '1 month'::pg_catalog.interval)::pg_catalog.date
        END)
$$;
REVOKE ALL ON FUNCTION settlementd.settled_month(pg_catalog.int8, pg_catalog.date, pg_catalog.timestamptz)
    FROM PUBLIC;

-- libraryd's edit of a settled loan's dates, or its deletion, queued under the month whose money
-- the loan is (settlementd.settled_month), with the loan as it was. The built-in type check first
-- (a few comparisons of type oids); only a row of other types asks the catalog.
CREATE OR REPLACE FUNCTION settlementd.settlementd_loan_changed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, settlementd, pg_temp AS $$
DECLARE
    was pg_catalog.date;
BEGIN
    IF pg_catalog.pg_typeof(OLD.id)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.member_id)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.fine_cents)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.due_on)::pg_catalog.oid <> 1082
       OR pg_catalog.pg_typeof(OLD.returned_on)::pg_catalog.oid <> 1082
       OR pg_catalog.pg_typeof(OLD.fine_seq)::pg_catalog.oid <> 23
       OR pg_catalog.pg_typeof(OLD.fine_settled_at)::pg_catalog.oid <> 1184 THEN
        PERFORM settlementd.loans_fit_or_refuse(TG_RELID);
    END IF;
    was := OLD.returned_on;
    IF was IS NULL AND TG_OP = 'UPDATE' THEN
        was := NEW.returned_on;
    END IF;
    INSERT INTO settlementd.loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq,
                                          old_due_on, old_returned_on, old_member_id)
    VALUES (OLD.id, settlementd.settled_month(OLD.id, was, OLD.fine_settled_at), TG_OP = 'DELETE',
            OLD.fine_cents, OLD.fine_seq, OLD.due_on, OLD.returned_on, OLD.member_id);
    RETURN NULL;
END
$$;

-- A settled loan renumbered in libraryd: the old id's deletion is queued and the row under its new
-- id is unsettled again, before the update is written.
CREATE OR REPLACE FUNCTION settlementd.settlementd_loan_renumbered() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, settlementd, pg_temp AS $$
BEGIN
    IF pg_catalog.pg_typeof(OLD.id)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.member_id)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.fine_cents)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.due_on)::pg_catalog.oid <> 1082
       OR pg_catalog.pg_typeof(OLD.returned_on)::pg_catalog.oid <> 1082
       OR pg_catalog.pg_typeof(OLD.fine_seq)::pg_catalog.oid <> 23
       OR pg_catalog.pg_typeof(OLD.fine_settled_at)::pg_catalog.oid <> 1184 THEN
        PERFORM settlementd.loans_fit_or_refuse(TG_RELID);
    END IF;
    INSERT INTO settlementd.loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq,
                                          old_due_on, old_returned_on, old_member_id)
    VALUES (OLD.id, settlementd.settled_month(OLD.id, OLD.returned_on, OLD.fine_settled_at), true,
            OLD.fine_cents, OLD.fine_seq, OLD.due_on, OLD.returned_on, OLD.member_id);
    NEW.fine_settled_at := NULL;
    NEW.fine_seq := NULL;
    RETURN NEW;
END
$$;

-- A settled loan moved to another member: queued as an edit of its month, with the member it
-- had (the settlement writes the money out of the old member's statement and into the new one's),
-- and kept in member_moves, which the release before this one reads.
CREATE OR REPLACE FUNCTION settlementd.settlementd_member_moved() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, settlementd, pg_temp AS $$
DECLARE
    month pg_catalog.date;
BEGIN
    IF pg_catalog.pg_typeof(OLD.id)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.member_id)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.fine_cents)::pg_catalog.oid NOT IN (20, 23, 21)
       OR pg_catalog.pg_typeof(OLD.due_on)::pg_catalog.oid <> 1082
       OR pg_catalog.pg_typeof(OLD.returned_on)::pg_catalog.oid <> 1082
       OR pg_catalog.pg_typeof(OLD.fine_seq)::pg_catalog.oid <> 23
       OR pg_catalog.pg_typeof(OLD.fine_settled_at)::pg_catalog.oid <> 1184 THEN
        PERFORM settlementd.loans_fit_or_refuse(TG_RELID);
    END IF;
    month := settlementd.settled_month(OLD.id, OLD.returned_on, OLD.fine_settled_at);
    INSERT INTO settlementd.member_moves (loan_id, month, old_member_id, new_member_id)
    VALUES (OLD.id, month, OLD.member_id, NEW.member_id);
    INSERT INTO settlementd.loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq,
                                          old_due_on, old_returned_on, old_member_id)
    VALUES (OLD.id, month, false, OLD.fine_cents, OLD.fine_seq, OLD.due_on, OLD.returned_on,
            OLD.member_id);
    RETURN NULL;
END
$$;

-- Each loan's head, kept for every journal row whose writer does not keep it itself
-- (`heads_kept`): the loan's last entry (by seq) of the statement's rows, how many entries they
-- hold, and every entry that did not continue the chain (seq one more than the one before it,
-- before the previous after), the first against the head as it was.
CREATE OR REPLACE FUNCTION settlementd.settlementd_journal_appended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, settlementd, pg_temp AS $$
BEGIN
    WITH e AS (
        SELECT x.loan_id, a.id AS journal_id, x.seq, a.month, a.kind, x.before_cents,
               x.after_cents, x.member_id
          FROM appended a,
               ROWS FROM (pg_catalog.unnest(a.loan_ids), pg_catalog.unnest(a.seqs),
                          pg_catalog.unnest(a.before_cents), pg_catalog.unnest(a.after_cents),
                          pg_catalog.unnest(a.member_ids))
                 AS x(loan_id, seq, before_cents, after_cents, member_id)
         WHERE a.heads_kept IS NOT TRUE
    ), o AS (
        SELECT e.*, pg_catalog.row_number() OVER w AS rn,
               pg_catalog.count(*) OVER (PARTITION BY e.loan_id) AS n,
               pg_catalog.lag(e.seq) OVER w AS prev_seq,
               pg_catalog.lag(e.after_cents) OVER w AS prev_after
          FROM e
        WINDOW w AS (PARTITION BY e.loan_id ORDER BY e.seq, e.journal_id)
    ), g AS (
        SELECT o.loan_id,
               pg_catalog.max(o.journal_id) FILTER (WHERE o.rn = o.n) AS journal_id,
               pg_catalog.max(o.seq) FILTER (WHERE o.rn = o.n) AS seq,
               pg_catalog.max(o.month) FILTER (WHERE o.rn = o.n) AS month,
               pg_catalog.max(o.kind) FILTER (WHERE o.rn = o.n) AS kind,
               pg_catalog.max(o.before_cents) FILTER (WHERE o.rn = o.n) AS before_cents,
               pg_catalog.max(o.after_cents) FILTER (WHERE o.rn = o.n) AS after_cents,
               pg_catalog.max(o.member_id) FILTER (WHERE o.rn = o.n) AS member_id,
               pg_catalog.max(o.journal_id) FILTER (WHERE o.rn = 1) AS first_journal,
               pg_catalog.max(o.seq) FILTER (WHERE o.rn = 1) AS first_seq,
               pg_catalog.max(o.before_cents) FILTER (WHERE o.rn = 1) AS first_before,
               pg_catalog.count(*)::pg_catalog.int4 AS n,
               pg_catalog.count(*) FILTER (
                   WHERE o.rn > 1 AND (o.seq IS DISTINCT FROM o.prev_seq + 1
                                       OR o.before_cents IS DISTINCT FROM o.prev_after)
               )::pg_catalog.int4 AS inner_breaks,
               pg_catalog.min(o.journal_id) FILTER (
                   WHERE o.rn > 1 AND (o.seq IS DISTINCT FROM o.prev_seq + 1
                                       OR o.before_cents IS DISTINCT FROM o.prev_after)
               ) AS first_inner_break
          FROM o
         GROUP BY o.loan_id
    ), updated AS (
        UPDATE settlementd.fine_heads h
           SET journal_id = g.journal_id, seq = g.seq, month = g.month, kind = g.kind,
               before_cents = g.before_cents, after_cents = g.after_cents,
               member_id = g.member_id, entries = h.entries + g.n,
               breaks = h.breaks + g.inner_breaks
                        + CASE WHEN g.first_seq IS DISTINCT FROM h.seq + 1
                                 OR g.first_before IS DISTINCT FROM h.after_cents
                               THEN 1 ELSE 0 END,
               first_break = COALESCE(h.first_break,
                                      CASE WHEN g.first_seq IS DISTINCT FROM h.seq + 1
                                             OR g.first_before IS DISTINCT FROM h.after_cents
                                           THEN g.first_journal END,
                                      g.first_inner_break)
          FROM g
         WHERE h.loan_id = g.loan_id
    )
    -- The heads the UPDATE above did not find, found by the primary key in the statement's
    -- snapshot (the heads it updates are the ones there): an anti join against the CTE's
    -- RETURNING was planned as a nested loop over both (estimated 10 rows each), 25 M comparisons
    -- and 3 s for a correction's batch of 7,144 loans.
    INSERT INTO settlementd.fine_heads (loan_id, journal_id, seq, month, kind, before_cents,
                                        after_cents, member_id, entries, breaks, first_break)
    SELECT g.loan_id, g.journal_id, g.seq, g.month, g.kind, g.before_cents, g.after_cents,
           g.member_id, g.n, g.inner_breaks, g.first_inner_break
      FROM g
     WHERE NOT EXISTS (SELECT 1 FROM settlementd.fine_heads h WHERE h.loan_id = g.loan_id);
    RETURN NULL;
END
$$;

-- The invoker trigger functions on job_runs: their path pinned as well.
ALTER FUNCTION settlementd.job_runs_rerun_forgets_descending_cursor()
    SET search_path = pg_catalog, settlementd, pg_temp;

-- The release on every claim. A claim's `version` is the release that made its current attempt.
-- The trigger below cleared it whenever the attempt changed and `version` did not (a release
-- that records no version took the claim over), which also cleared it when a release re-wrote its
-- own version on a re-open or a correction: those claims showed as "a release before 0.2.0". Now
-- a writer says which attempt its version is for (`version_attempt`, new: the release before this
-- one never sets it); the version is cleared only when the attempt changed and neither did.
ALTER TABLE settlementd.job_runs ADD COLUMN version_attempt integer;
CREATE OR REPLACE FUNCTION settlementd.settlementd_claim_version() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, settlementd, pg_temp AS $$
BEGIN
    IF NEW.attempt IS DISTINCT FROM OLD.attempt AND NEW.version IS NOT DISTINCT FROM OLD.version
       AND NEW.version_attempt IS DISTINCT FROM NEW.attempt THEN
        NEW.version := NULL;
    END IF;
    RETURN NEW;
END
$$;

-- Retention's check and its one door, every object named with its schema.
CREATE OR REPLACE FUNCTION settlementd.settlementd_retention_untouched(
    p_job text, p_date date, cutoff timestamptz, key_cutoff timestamptz) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, settlementd, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM settlementd.job_runs r
                        WHERE r.job_name = p_job AND r.business_date = p_date
                          AND (r.status <> 'SUCCESS' OR r.finished_at IS NULL
                               OR r.finished_at >= cutoff))
       AND NOT EXISTS (SELECT 1 FROM settlementd.job_events e
                        WHERE e.job_name = p_job AND e.business_date = p_date
                          AND e.at >= cutoff)
       AND NOT EXISTS (SELECT 1 FROM settlementd.job_params p
                        WHERE p.job_name = p_job AND p.business_date = p_date
                          AND p.correction_key IS NOT NULL)
       AND NOT EXISTS (SELECT 1 FROM settlementd.run_requests q
                        WHERE q.job_name = p_job AND q.business_date = p_date
                          AND q.created_at >= key_cutoff)
$$;

CREATE OR REPLACE FUNCTION settlementd.settlementd_prune_period(
    p_job text, p_date date, p_older_than_days integer, p_limit integer)
RETURNS TABLE (events bigint, requests bigint, runs bigint, state text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, settlementd, pg_temp
AS $$
DECLARE
    cutoff     pg_catalog.timestamptz;
    key_cutoff pg_catalog.timestamptz;
    parents    pg_catalog.uuid[];
    ranges     pg_catalog.int8;
BEGIN
    IF p_older_than_days IS NULL OR p_older_than_days < 1 OR p_older_than_days > 36500 THEN
        RAISE EXCEPTION 'retention deletes only what closed 1 to 36500 days ago, not % days',
            p_older_than_days USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'a retention batch deletes at least one row, not %', p_limit
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := pg_catalog.clock_timestamp() - pg_catalog.make_interval(days => p_older_than_days);
    key_cutoff := pg_catalog.clock_timestamp()
                  - pg_catalog.make_interval(days => GREATEST(p_older_than_days, 30));
    events := 0; requests := 0; runs := 0; state := 'kept';
    IF NOT EXISTS (SELECT 1 FROM settlementd.job_runs
                    WHERE job_name = p_job AND business_date = p_date)
       OR NOT settlementd.settlementd_retention_untouched(p_job, p_date, cutoff, key_cutoff) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    BEGIN
        WITH gone AS (
            DELETE FROM settlementd.job_events
             WHERE id IN (SELECT id FROM settlementd.job_events
                           WHERE job_name = p_job AND business_date = p_date AND at < cutoff
                           ORDER BY id LIMIT p_limit)
            RETURNING 1
        )
        SELECT pg_catalog.count(*) INTO events FROM gone;
        IF events >= p_limit THEN
            state := 'more';
        ELSE
            -- The claims are locked first: a takeover of one waits for this transaction, and one
            -- that committed before is seen by the check below.
            PERFORM 1 FROM settlementd.job_runs
              WHERE job_name = p_job AND business_date = p_date FOR UPDATE;
            WITH finished AS (
                SELECT q.request_id, q.parent_id FROM settlementd.run_requests q
                 WHERE q.job_name = p_job AND q.business_date = p_date
                   AND q.created_at < key_cutoff
                   AND NOT EXISTS (SELECT 1 FROM settlementd.run_request_shards s
                                    WHERE s.request_id = q.request_id
                                      AND s.state <> 'succeeded')
                   AND NOT EXISTS (SELECT 1 FROM settlementd.run_requests c
                                    WHERE c.parent_id = q.request_id)
            ), shards AS (
                DELETE FROM settlementd.run_request_shards s USING finished f
                 WHERE s.request_id = f.request_id
            ), gone AS (
                DELETE FROM settlementd.run_requests q USING finished f
                 WHERE q.request_id = f.request_id
                RETURNING f.parent_id
            )
            SELECT pg_catalog.count(*),
                   pg_catalog.array_agg(parent_id) FILTER (WHERE parent_id IS NOT NULL)
              INTO requests, parents FROM gone;
            -- A range request (its months are child requests; it has no shards of its own) goes
            -- with the last of its months, whichever period that is.
            WITH gone AS (
                DELETE FROM settlementd.run_requests p
                 WHERE p.request_id = ANY (COALESCE(parents, '{}'))
                   AND p.range_to IS NOT NULL AND p.created_at < key_cutoff
                   AND NOT EXISTS (SELECT 1 FROM settlementd.run_requests c
                                    WHERE c.parent_id = p.request_id)
                   AND NOT EXISTS (SELECT 1 FROM settlementd.run_request_shards s
                                    WHERE s.request_id = p.request_id)
                RETURNING 1
            )
            SELECT pg_catalog.count(*) INTO ranges FROM gone;
            requests := requests + ranges;
            WITH gone AS (
                DELETE FROM settlementd.job_runs
                 WHERE job_name = p_job AND business_date = p_date
                   AND status = 'SUCCESS' AND finished_at < cutoff
                RETURNING 1
            )
            SELECT pg_catalog.count(*) INTO runs FROM gone;
            state := 'done';
        END IF;
        -- Decided again after deleting, in a fresh snapshot: whatever committed while a delete
        -- waited for a lock (a re-open, a request) keeps the period, and this call undoes itself.
        IF NOT settlementd.settlementd_retention_untouched(p_job, p_date, cutoff, key_cutoff) THEN
            RAISE EXCEPTION 'period changed while it was pruned' USING ERRCODE = 'SP001';
        END IF;
    EXCEPTION WHEN SQLSTATE 'SP001' THEN
        events := 0; requests := 0; runs := 0; state := 'kept';
    END;
    RETURN NEXT;
END
$$;
REVOKE ALL ON FUNCTION settlementd.settlementd_prune_period(text, date, integer, integer) FROM PUBLIC;
REVOKE ALL ON FUNCTION settlementd.settlementd_retention_untouched(text, date, timestamptz, timestamptz)
    FROM PUBLIC;

-- A trigger's definition as PostgreSQL prints it, every name with its schema (whatever the
-- caller's search path): what loans_triggers records and what readiness compares it with.
CREATE FUNCTION settlementd.trigger_definition(p_trigger pg_catalog.oid) RETURNS pg_catalog.text
LANGUAGE sql STABLE SET search_path = pg_catalog AS $$
    SELECT pg_catalog.pg_get_triggerdef(p_trigger)
$$;
REVOKE ALL ON FUNCTION settlementd.trigger_definition(pg_catalog.oid) FROM PUBLIC;

-- settlementd's triggers on loans as they stand now (with their functions, now settlementd's).
INSERT INTO settlementd.loans_triggers (name, definition)
SELECT t.tgname, settlementd.trigger_definition(t.oid)
  FROM pg_catalog.pg_trigger t
 WHERE t.tgrelid = 'public.loans'::pg_catalog.regclass AND NOT t.tgisinternal
   AND t.tgname IN ('settlementd_settled_dates_changed', 'settlementd_settled_deleted',
                    'settlementd_settled_renumbered', 'settlementd_settled_member_moved');

-- For the release before this one: a view under each table's old name in public, each role's
-- privileges on a table copied to its view, USAGE on the schema for every role holding one (the
-- view checks the table's privileges of whoever uses it, where the server can: PostgreSQL 15+),
-- the migrator's default privileges for a job's own tables carried over to this schema, and the
-- retention function under its old name.
DO $$
DECLARE
    name pg_catalog.text;
    invoker pg_catalog.text := CASE WHEN pg_catalog.current_setting('server_version_num')::pg_catalog.int4 >= 150000
                                    THEN ' WITH (security_invoker = true)' ELSE '' END;
    g record;
BEGIN
    FOREACH name IN ARRAY ARRAY['job_runs', 'job_events', 'run_requests', 'run_request_shards',
                                'job_params', 'fine_corrections', 'fine_adjustments',
                                'fine_journal', 'fine_heads', 'loan_changes', 'member_moves',
                                'job_pauses', 'member_fine_statements', 'member_statement_marks',
                                'replicas', '_sqlx_migrations', 'settlementd_migrations'] LOOP
        EXECUTE pg_catalog.format('CREATE VIEW public.%I%s AS SELECT * FROM settlementd.%I',
                                  name, invoker, name);
    END LOOP;
    -- The view as 0.2.0 reads it: the columns it had.
    EXECUTE pg_catalog.format(
        'CREATE VIEW public.fine_journal_entries%s AS
         SELECT journal_id, month, kind, rule, shards, attempt, correction_key, at, loan_id, seq,
                due_on, returned_on, before_cents, after_cents
           FROM settlementd.fine_journal_entries', invoker);
    FOR g IN
        SELECT c.relname::pg_catalog.text AS rel, a.grantee, a.privilege_type
          FROM pg_catalog.pg_class c,
               pg_catalog.aclexplode(c.relacl) a
         WHERE c.relnamespace = 'settlementd'::pg_catalog.regnamespace
           AND c.relkind IN ('r', 'v') AND a.grantee <> c.relowner
           AND c.relname <> 'loans_triggers'
    LOOP
        IF g.grantee = 0 THEN
            EXECUTE pg_catalog.format('GRANT %s ON public.%I TO PUBLIC', g.privilege_type, g.rel);
        ELSE
            EXECUTE pg_catalog.format('GRANT %s ON public.%I TO %I', g.privilege_type, g.rel,
                                      pg_catalog.pg_get_userbyid(g.grantee));
            EXECUTE pg_catalog.format('GRANT USAGE ON SCHEMA settlementd TO %I',
                                      pg_catalog.pg_get_userbyid(g.grantee));
            -- What readiness compares settlementd's triggers on loans with.
            EXECUTE pg_catalog.format('GRANT SELECT ON settlementd.loans_triggers TO %I',
                                      pg_catalog.pg_get_userbyid(g.grantee));
            EXECUTE pg_catalog.format(
                'GRANT EXECUTE ON FUNCTION settlementd.trigger_definition(pg_catalog.oid) TO %I',
                pg_catalog.pg_get_userbyid(g.grantee));
            -- Whoever may append to the journal may insert the first heads of the loans it
            -- settles (the heads trigger makes a head of any entry appended anyway).
            IF g.rel = 'fine_journal' AND g.privilege_type = 'INSERT' THEN
                EXECUTE pg_catalog.format('GRANT INSERT ON settlementd.fine_heads TO %I',
                                          pg_catalog.pg_get_userbyid(g.grantee));
            END IF;
        END IF;
    END LOOP;
    FOR g IN
        SELECT d.defaclobjtype, a.grantee, a.privilege_type
          FROM pg_catalog.pg_default_acl d,
               pg_catalog.aclexplode(d.defaclacl) a
         WHERE d.defaclrole = (SELECT oid FROM pg_catalog.pg_roles WHERE rolname = current_user)
           AND d.defaclnamespace = 'public'::pg_catalog.regnamespace
           AND d.defaclobjtype IN ('r', 'S') AND a.grantee <> 0
    LOOP
        EXECUTE pg_catalog.format('ALTER DEFAULT PRIVILEGES IN SCHEMA settlementd GRANT %s ON %s TO %I',
                                  g.privilege_type,
                                  CASE g.defaclobjtype WHEN 'r' THEN 'TABLES' ELSE 'SEQUENCES' END,
                                  pg_catalog.pg_get_userbyid(g.grantee));
    END LOOP;
END
$$;

CREATE FUNCTION public.settlementd_prune_period(
    p_job text, p_date date, p_older_than_days integer, p_limit integer)
RETURNS TABLE (events bigint, requests bigint, runs bigint, state text)
LANGUAGE sql VOLATILE SECURITY INVOKER SET search_path = pg_catalog, pg_temp
AS $$
    SELECT * FROM settlementd.settlementd_prune_period(p_job, p_date, p_older_than_days, p_limit)
$$;
REVOKE ALL ON FUNCTION public.settlementd_prune_period(text, date, integer, integer) FROM PUBLIC;
DO $$
DECLARE
    who pg_catalog.text;
BEGIN
    -- Whoever could call it before (the runtime role, after roles.sql) can call both.
    FOR who IN
        SELECT pg_catalog.pg_get_userbyid(a.grantee)::pg_catalog.text
          FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
         WHERE p.oid = 'settlementd.settlementd_prune_period(text, date, integer, integer)'::pg_catalog.regprocedure
           AND a.grantee <> 0 AND a.grantee <> p.proowner
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION public.settlementd_prune_period(text, date, integer, integer) TO %I', who);
    END LOOP;
END
$$;
