-- Every cent on the record, libraryd's edits followed, corrections keyed like requests.
-- (The columns, index and triggers this adds to libraryd's loans are in the next migration, which
-- runs as the owner of loans.)

-- The money journal: every change settlementd makes to a fine, appended in the transaction that
-- makes it and never changed. One row per batch and kind, holding the batch's loans as parallel
-- arrays (a row per loan cost a run 1.4 x the bare update in a measurement of both shapes; a row
-- per batch 1.2 x: docs/PERFORMANCE.md); the view fine_journal_entries below reads it one entry per
-- loan. loans.fine_seq is the seq of a loan's last entry: its fine_cents equals that entry's
-- after_cents, and each entry's before_cents is the previous entry's after_cents.
CREATE TABLE IF NOT EXISTS fine_journal (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The first day of the month whose money the entries are: the month the loan was priced in, or
    -- (reversed, deleted) the month its fine is taken out of.
    month          date        NOT NULL,
    -- settled: by the month's run; late: returned after the month closed; repriced: a settled
    -- loan's dates changed in libraryd; reversed: its return undone, moved to another month, or
    -- its due date made unpriceable (unsettled again, fine 0); deleted: deleted in libraryd;
    -- corrected: by `settlementd correct`; opening: a loan settled before the journal existed.
    kind           text        NOT NULL CHECK (kind IN ('settled', 'late', 'repriced', 'reversed',
                                                        'deleted', 'corrected', 'opening')),
    -- The rule's identity that priced the entries: {daily_rate_cents, grace_days, max_cents}.
    -- Null for entries that price nothing (opening, reversed, deleted).
    rule           jsonb,
    -- The run that wrote them: its job_runs key is (fine-settlement, the month's end, shards,
    -- loan_id % shards) and its attempt. Null for opening entries (written by migrate).
    shards         integer,
    attempt        integer,
    -- The correction that wrote them (kind corrected, or reversed by a correction).
    correction_key text,
    at             timestamptz NOT NULL DEFAULT now(),
    loan_ids       bigint[]    NOT NULL,
    -- Each loan's entry number: 1 for its first entry, then one more per entry.
    seqs           integer[]   NOT NULL,
    -- The dates priced (the loan's dates when the entry was written).
    due_on         date[]      NOT NULL,
    returned_on    date[]      NOT NULL,
    -- Null elements: unknown (opening entries).
    before_cents   bigint[]    NOT NULL,
    after_cents    bigint[]    NOT NULL,
    CHECK (cardinality(seqs) = cardinality(loan_ids)
       AND cardinality(due_on) = cardinality(loan_ids)
       AND cardinality(returned_on) = cardinality(loan_ids)
       AND cardinality(before_cents) = cardinality(loan_ids)
       AND cardinality(after_cents) = cardinality(loan_ids))
);
CREATE INDEX IF NOT EXISTS fine_journal_by_month ON fine_journal (month, id);

-- lz4 where the server has it: the arrays compress several times over at a fraction of pglz's
-- cost. A server built without lz4 keeps the default.
DO $$
BEGIN
    ALTER TABLE fine_journal
        ALTER COLUMN loan_ids SET COMPRESSION lz4, ALTER COLUMN seqs SET COMPRESSION lz4,
        ALTER COLUMN due_on SET COMPRESSION lz4, ALTER COLUMN returned_on SET COMPRESSION lz4,
        ALTER COLUMN before_cents SET COMPRESSION lz4, ALTER COLUMN after_cents SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
    RAISE NOTICE 'lz4 is not available on this server: fine_journal keeps the default compression';
END
$$;

-- The journal one entry per loan, for readers (verify, auditors, the fault suite).
CREATE OR REPLACE VIEW fine_journal_entries AS
SELECT j.id AS journal_id, j.month, j.kind, j.rule, j.shards, j.attempt, j.correction_key, j.at,
       e.loan_id, e.seq, e.due_on, e.returned_on, e.before_cents, e.after_cents
  FROM fine_journal j,
       unnest(j.loan_ids, j.seqs, j.due_on, j.returned_on, j.before_cents, j.after_cents)
         AS e(loan_id, seq, due_on, returned_on, before_cents, after_cents);

-- libraryd's edits of settled loans, caught in libraryd's own transaction by the triggers of the
-- next migration, waiting for the next run or sweep of their month to re-price them. A row is
-- deleted in the transaction that re-prices its loan (the journal is the record).
CREATE TABLE IF NOT EXISTS loan_changes (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    loan_id        bigint      NOT NULL,
    -- The first day of the month the loan's settled fine is in: its returned_on before the edit.
    month          date        NOT NULL,
    deleted        boolean     NOT NULL,
    -- The loan as it was before the edit: what a deletion takes out.
    old_fine_cents bigint,
    old_fine_seq   integer,
    old_due_on     date,
    old_returned_on date,
    at             timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS loan_changes_by_month ON loan_changes (month, loan_id);
CREATE INDEX IF NOT EXISTS loan_changes_by_loan ON loan_changes (loan_id, id);

-- Runs as its owner (settlementd's migration role), so libraryd's roles need no grant on
-- loan_changes. The month: the loan's returned_on before the edit; a settled loan that was never
-- returned (a return undone before these triggers existed) is taken to be in the month before the
-- month it was settled in (UTC), the month a run then settles.
CREATE OR REPLACE FUNCTION settlementd_loan_changed() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    was date := OLD.returned_on;
BEGIN
    IF was IS NULL AND TG_OP = 'UPDATE' THEN
        was := NEW.returned_on;
    END IF;
    IF was IS NULL OR NOT isfinite(was) THEN
        was := date_trunc('month', OLD.fine_settled_at AT TIME ZONE 'UTC') - interval '1 day';
    END IF;
    INSERT INTO loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq, old_due_on,
                              old_returned_on)
    VALUES (OLD.id, date_trunc('month', was)::date, TG_OP = 'DELETE', OLD.fine_cents,
            OLD.fine_seq, OLD.due_on, OLD.returned_on);
    RETURN NULL;
END
$$;

-- A month being corrected: claims of the period other than the correction's are refused until it
-- completes (src/jobs/params.rs).
ALTER TABLE job_params ADD COLUMN IF NOT EXISTS correction_key text;
ALTER TABLE job_params ADD COLUMN IF NOT EXISTS correcting_since timestamptz;

-- A rule's identity is what prices a fine: its rate, grace and cap. When it starts applying
-- (`from`) is configuration, not identity: writing the unchanged rule with a `from` must conflict
-- with nothing. Pins and corrections recorded with it are re-expressed without it.
UPDATE job_params SET params = params - 'from'
 WHERE job_name = 'fine-settlement' AND params ? 'from';
UPDATE fine_corrections SET new_rule = new_rule - 'from' WHERE new_rule ? 'from';
UPDATE fine_corrections SET old_rule = old_rule - 'from' WHERE old_rule ? 'from';
CREATE INDEX IF NOT EXISTS fine_corrections_unfinished
    ON fine_corrections (business_date) WHERE completed_at IS NULL;
