-- One row per (job, business date, shard count, shard): the claim that makes runs idempotent.
-- The shard count is in the key so a move from 3 to 4 replicas opens fresh claims.
CREATE TABLE IF NOT EXISTS job_runs (
    job_name      text        NOT NULL,
    business_date date        NOT NULL,
    shards        integer     NOT NULL CHECK (shards >= 1),
    shard         integer     NOT NULL CHECK (shard >= 0 AND shard < shards),
    status        text        NOT NULL CHECK (status IN ('RUNNING', 'SUCCESS', 'FAILED')),
    -- Fences every write of a run: bumped by each takeover, checked by each batch.
    attempt       integer     NOT NULL CHECK (attempt >= 1),
    owner         text        NOT NULL,
    started_at    timestamptz NOT NULL,
    heartbeat_at  timestamptz NOT NULL,
    finished_at   timestamptz,
    -- Progress, committed in the same transaction as each batch.
    last_id       bigint,
    scanned       bigint      NOT NULL DEFAULT 0,
    updated       bigint      NOT NULL DEFAULT 0,
    last_error    text,
    PRIMARY KEY (job_name, business_date, shards, shard)
);
