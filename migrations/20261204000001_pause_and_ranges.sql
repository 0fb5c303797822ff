-- Jobs, not a job: a pause per job that every replica sees.

-- A paused job claims nothing; a run in flight stops after its batch (src/jobs/pause.rs). The row
-- says who paused it, when and why; resuming deletes it.
CREATE TABLE IF NOT EXISTS job_pauses (
    job_name  text        PRIMARY KEY,
    paused_by text        NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    reason    text        NOT NULL
);

-- A run request over a range of months: one request for the range (its key, its answer), and one
-- child request per month (a request like any other, served by the replicas in month order),
-- pointing at it.
ALTER TABLE run_requests ADD COLUMN IF NOT EXISTS range_to date;
ALTER TABLE run_requests ADD COLUMN IF NOT EXISTS parent_id uuid REFERENCES run_requests (request_id);
CREATE INDEX IF NOT EXISTS run_requests_by_parent ON run_requests (parent_id) WHERE parent_id IS NOT NULL;
