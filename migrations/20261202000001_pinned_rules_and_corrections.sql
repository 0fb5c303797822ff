-- One rule per month, and corrections on the record.

-- The identifying parameters of a period (for the fine settlement: the month's fine rule), pinned by
-- the first claim of the period whatever its shard or shard count; every later claim compares its
-- own against them and claims nothing when they differ. Only a correction (settlementd correct)
-- changes a pin.
CREATE TABLE IF NOT EXISTS job_params (
    job_name      text        NOT NULL,
    business_date date        NOT NULL,
    params        jsonb       NOT NULL,
    pinned_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The process (replica, or the command) that pinned them.
    pinned_by     text        NOT NULL,
    PRIMARY KEY (job_name, business_date)
);

-- A correction of a settled month, under the operator's key: the same key again changes nothing
-- and reports the first result.
CREATE TABLE IF NOT EXISTS fine_corrections (
    correction_key text        PRIMARY KEY,
    business_date  date        NOT NULL,
    shards         integer     NOT NULL CHECK (shards >= 1),
    reason         text        NOT NULL,
    -- The month's pinned rule before the correction (null: none was pinned) and after it.
    old_rule       jsonb,
    new_rule       jsonb       NOT NULL,
    requested_by   text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- Set when every shard is corrected and its `corrected` event written, with what each shard's
    -- correction did (replayed for the same key).
    completed_at   timestamptz,
    result         jsonb
);

-- One row per loan whose settled fine a correction changed, written in the transaction that changes
-- it. Append-only: deploy/sql/roles.sql grants the runtime role SELECT and INSERT, nothing else.
CREATE TABLE IF NOT EXISTS fine_adjustments (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    correction_key text        NOT NULL REFERENCES fine_corrections (correction_key),
    loan_id        bigint      NOT NULL,
    business_date  date        NOT NULL,
    old_cents      bigint      NOT NULL,
    new_cents      bigint      NOT NULL,
    at             timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS fine_adjustments_by_key ON fine_adjustments (correction_key, loan_id);
CREATE INDEX IF NOT EXISTS fine_adjustments_by_loan ON fine_adjustments (loan_id);
