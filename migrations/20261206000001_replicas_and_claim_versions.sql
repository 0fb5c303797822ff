-- Which release holds each claim, and which replicas run: what `status` and the page show so an
-- operator sees a rolling update's mixed fleet as one (docs/OPERATIONS.md, "Upgrades").
--
-- Additive only, so the release before this one (0d20be2, 0.1.0) keeps working beside it and
-- after a rollback: it never names these columns or this table. Its claims and take-overs leave
-- `job_runs.version` alone, so the trigger below clears the column whenever a row's attempt
-- changes without it: a claim's version is either the one that made the attempt, or NULL
-- ("a release before 0.2.0").
ALTER TABLE job_runs ADD COLUMN IF NOT EXISTS version text;

CREATE OR REPLACE FUNCTION settlementd_claim_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.attempt IS DISTINCT FROM OLD.attempt AND NEW.version IS NOT DISTINCT FROM OLD.version THEN
        NEW.version := NULL;
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS job_runs_claim_version ON job_runs;
CREATE TRIGGER job_runs_claim_version BEFORE UPDATE OF attempt ON job_runs
    FOR EACH ROW EXECUTE FUNCTION settlementd_claim_version();

-- One row per `serve` process, upserted every heartbeat: its release, what it schedules, and
-- whether it is ready (and why not). Rows not seen for a day are deleted by the next replica
-- that reports.
CREATE TABLE IF NOT EXISTS replicas (
    owner      text PRIMARY KEY,
    version    text NOT NULL,
    commit     text NOT NULL,
    jobs       text[] NOT NULL,
    shards     int NOT NULL CHECK (shards >= 1),
    shard      int NOT NULL CHECK (shard >= 0 AND shard < shards),
    started_at timestamptz NOT NULL,
    seen_at    timestamptz NOT NULL,
    ready      boolean NOT NULL,
    reason     text
);
