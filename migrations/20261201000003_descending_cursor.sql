-- Walks from both ends. Odd shards walk their month in descending id order, so two shards of one
-- month start at opposite ends of the table instead of sharing every heap page at the same moment
-- (docs/PERFORMANCE.md). A descending walk commits its progress here, never in last_id: every row
-- of the shard's month with an id from last_id_desc on is done, as every row up to last_id is.
--
-- A binary that predates this column resumes such a run from last_id (NULL: the beginning), which
-- redoes rows, never skips them. Its forced re-run, though, resets last_id only; so a claim that
-- re-runs a SUCCESS row also forgets the descending cursor here, whichever binary makes it.
ALTER TABLE job_runs ADD COLUMN IF NOT EXISTS last_id_desc bigint;

CREATE OR REPLACE FUNCTION job_runs_rerun_forgets_descending_cursor() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    NEW.last_id_desc := NULL;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS job_runs_rerun_forgets_descending_cursor ON job_runs;
CREATE TRIGGER job_runs_rerun_forgets_descending_cursor
    BEFORE UPDATE ON job_runs
    FOR EACH ROW
    WHEN (OLD.status = 'SUCCESS' AND NEW.status = 'RUNNING' AND NEW.last_id_desc IS NOT NULL)
    EXECUTE FUNCTION job_runs_rerun_forgets_descending_cursor();
