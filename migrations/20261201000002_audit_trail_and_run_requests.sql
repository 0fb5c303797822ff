-- The audit trail and the request layer of idempotency.

-- Every claim, takeover, forced re-run, fencing rejection, SUCCESS, FAILED and accepted request,
-- appended by the job layer in the same transaction as the change it records (a fencing rejection
-- just after it). settlementd never updates or deletes a row; deploy/sql/roles.sql grants the
-- runtime role INSERT and SELECT only.
CREATE TABLE IF NOT EXISTS job_events (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    job_name      text        NOT NULL,
    business_date date        NOT NULL,
    shards        integer     NOT NULL,
    shard         integer     NOT NULL,
    -- claimed, took_over, forced, fencing_rejected, succeeded, failed, requested
    event         text        NOT NULL,
    -- The attempt the event belongs to (null for a request not yet served).
    attempt       integer,
    -- The process (replica) that wrote it.
    owner         text        NOT NULL,
    request_id    uuid,
    message       text
);
CREATE INDEX IF NOT EXISTS job_events_by_month ON job_events (job_name, business_date, shards, shard, id);
CREATE INDEX IF NOT EXISTS job_events_by_shard ON job_events (job_name, shards, shard, id);
CREATE INDEX IF NOT EXISTS job_events_by_request ON job_events (request_id) WHERE request_id IS NOT NULL;

-- A manual run asked for over HTTP, stored before it is answered. The idempotency key comes from
-- the client's business request, so a retried request finds its first answer here.
CREATE TABLE IF NOT EXISTS run_requests (
    request_id      uuid        PRIMARY KEY,
    idempotency_key text        NOT NULL UNIQUE,
    -- sha256 of the normalised request: the same key with another request is refused (422).
    fingerprint     text        NOT NULL,
    job_name        text        NOT NULL,
    business_date   date        NOT NULL,
    shards          integer     NOT NULL CHECK (shards >= 1),
    -- null: every shard of `shards`.
    shard           integer     CHECK (shard >= 0 AND shard < shards),
    force           boolean     NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    accepted_by     text        NOT NULL,
    -- The exact body of the first answer, replayed byte for byte.
    response        text        NOT NULL
);

-- Each targeted shard of a request, and the attempt that served it.
CREATE TABLE IF NOT EXISTS run_request_shards (
    request_id uuid        NOT NULL REFERENCES run_requests (request_id),
    shard      integer     NOT NULL,
    state      text        NOT NULL CHECK (state IN ('pending', 'running', 'succeeded', 'failed')),
    attempt    integer,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Why it is in this state when that is not obvious (an error, "already SUCCESS").
    detail     text,
    PRIMARY KEY (request_id, shard)
);
CREATE INDEX IF NOT EXISTS run_request_shards_open
    ON run_request_shards (shard, request_id) WHERE state <> 'succeeded';

-- The request whose run this row's current attempts serve (null: the schedule or the CLI).
ALTER TABLE job_runs ADD COLUMN IF NOT EXISTS request_id uuid;
