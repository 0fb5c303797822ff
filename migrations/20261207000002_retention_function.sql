-- Retention through one narrow door: the runtime role no longer deletes audit rows itself
-- (deploy/sql/roles.sql grants it no DELETE on job_runs, job_events, run_requests or
-- run_request_shards); it calls settlementd_prune_period, which runs as its owner (the migration
-- role, which owns those tables) and deletes only what retention may.
--
-- What goes is decided inside the function, at the moment it deletes: a period (a job's business
-- date) goes only while nothing of it happened in the last `older_than_days` days — every claim
-- SUCCESS and finished before that, no event after it, no correction holding it, and no run
-- request of it younger than the key window (greatest(older_than_days, 30) days: an
-- Idempotency-Key replays for at least 30 days, docs/OPERATIONS.md). It checks that again after
-- deleting, in a fresh snapshot, and undoes its deletes when the period changed meanwhile (a late
-- return re-opened it while the delete waited for a lock). `older_than_days` is bounded below
-- (1 day), so no caller can erase what just happened.
--
-- Additive only: the release before this one (0.1.0) never calls it.

-- True when nothing of (job, date) happened since `cutoff` (claims, events, a correction) nor a
-- run request of it was stored since `key_cutoff`. Not granted to anyone: called by the function
-- below as its owner.
CREATE OR REPLACE FUNCTION settlementd_retention_untouched(
    p_job text, p_date date, cutoff timestamptz, key_cutoff timestamptz) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, public, pg_temp
AS $$
    SELECT NOT EXISTS (SELECT 1 FROM public.job_runs r
                        WHERE r.job_name = p_job AND r.business_date = p_date
                          AND (r.status <> 'SUCCESS' OR r.finished_at IS NULL
                               OR r.finished_at >= cutoff))
       AND NOT EXISTS (SELECT 1 FROM public.job_events e
                        WHERE e.job_name = p_job AND e.business_date = p_date
                          AND e.at >= cutoff)
       AND NOT EXISTS (SELECT 1 FROM public.job_params p
                        WHERE p.job_name = p_job AND p.business_date = p_date
                          AND p.correction_key IS NOT NULL)
       AND NOT EXISTS (SELECT 1 FROM public.run_requests q
                        WHERE q.job_name = p_job AND q.business_date = p_date
                          AND q.created_at >= key_cutoff)
$$;
REVOKE ALL ON FUNCTION settlementd_retention_untouched(text, date, timestamptz, timestamptz)
    FROM PUBLIC;

-- Deletes up to `p_limit` audit events of (p_job, p_date) when the period is closed long enough;
-- once its events are gone, in the same call, its finished run requests (with their shards, and a
-- range request with its last month) and its claims. Returns what it deleted and `state`:
-- 'more' (events are left: call again), 'done' (the period is gone) or 'kept' (not closed long
-- enough, or changed while it was being deleted: nothing deleted by this call).
CREATE OR REPLACE FUNCTION settlementd_prune_period(
    p_job text, p_date date, p_older_than_days integer, p_limit integer)
RETURNS TABLE (events bigint, requests bigint, runs bigint, state text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, public, pg_temp
AS $$
DECLARE
    cutoff     timestamptz;
    key_cutoff timestamptz;
    parents    uuid[];
    ranges     bigint;
BEGIN
    IF p_older_than_days IS NULL OR p_older_than_days < 1 OR p_older_than_days > 36500 THEN
        RAISE EXCEPTION 'retention deletes only what closed 1 to 36500 days ago, not % days',
            p_older_than_days USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'a retention batch deletes at least one row, not %', p_limit
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := clock_timestamp() - make_interval(days => p_older_than_days);
    key_cutoff := clock_timestamp() - make_interval(days => greatest(p_older_than_days, 30));
    events := 0; requests := 0; runs := 0; state := 'kept';
    IF NOT EXISTS (SELECT 1 FROM job_runs WHERE job_name = p_job AND business_date = p_date)
       OR NOT settlementd_retention_untouched(p_job, p_date, cutoff, key_cutoff) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    BEGIN
        WITH gone AS (
            DELETE FROM job_events
             WHERE id IN (SELECT id FROM job_events
                           WHERE job_name = p_job AND business_date = p_date AND at < cutoff
                           ORDER BY id LIMIT p_limit)
            RETURNING 1
        )
        SELECT count(*) INTO events FROM gone;
        IF events >= p_limit THEN
            state := 'more';
        ELSE
            -- The claims are locked first: a takeover of one waits for this transaction, and one
            -- that committed before is seen by the check below.
            PERFORM 1 FROM job_runs WHERE job_name = p_job AND business_date = p_date FOR UPDATE;
            WITH finished AS (
                SELECT q.request_id, q.parent_id FROM run_requests q
                 WHERE q.job_name = p_job AND q.business_date = p_date
                   AND q.created_at < key_cutoff
                   AND NOT EXISTS (SELECT 1 FROM run_request_shards s
                                    WHERE s.request_id = q.request_id
                                      AND s.state <> 'succeeded')
                   AND NOT EXISTS (SELECT 1 FROM run_requests c
                                    WHERE c.parent_id = q.request_id)
            ), shards AS (
                DELETE FROM run_request_shards s USING finished f
                 WHERE s.request_id = f.request_id
            ), gone AS (
                DELETE FROM run_requests q USING finished f
                 WHERE q.request_id = f.request_id
                RETURNING f.parent_id
            )
            SELECT count(*), array_agg(parent_id) FILTER (WHERE parent_id IS NOT NULL)
              INTO requests, parents FROM gone;
            -- A range request (its months are child requests; it has no shards of its own) goes
            -- with the last of its months, whichever period that is.
            WITH gone AS (
                DELETE FROM run_requests p
                 WHERE p.request_id = ANY (coalesce(parents, '{}'))
                   AND p.range_to IS NOT NULL AND p.created_at < key_cutoff
                   AND NOT EXISTS (SELECT 1 FROM run_requests c
                                    WHERE c.parent_id = p.request_id)
                   AND NOT EXISTS (SELECT 1 FROM run_request_shards s
                                    WHERE s.request_id = p.request_id)
                RETURNING 1
            )
            SELECT count(*) INTO ranges FROM gone;
            requests := requests + ranges;
            WITH gone AS (
                DELETE FROM job_runs
                 WHERE job_name = p_job AND business_date = p_date
                   AND status = 'SUCCESS' AND finished_at < cutoff
                RETURNING 1
            )
            SELECT count(*) INTO runs FROM gone;
            state := 'done';
        END IF;
        -- Decided again after deleting, in a fresh snapshot: whatever committed while a delete
        -- waited for a lock (a re-open, a request) keeps the period, and this call undoes itself.
        IF NOT settlementd_retention_untouched(p_job, p_date, cutoff, key_cutoff) THEN
            RAISE EXCEPTION 'period changed while it was pruned' USING ERRCODE = 'SP001';
        END IF;
    EXCEPTION WHEN SQLSTATE 'SP001' THEN
        events := 0; requests := 0; runs := 0; state := 'kept';
    END;
    RETURN NEXT;
END
$$;
REVOKE ALL ON FUNCTION settlementd_prune_period(text, date, integer, integer) FROM PUBLIC;
