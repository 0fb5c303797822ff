-- A settled loan moved to another member in libraryd (a member merge: UPDATE of `member_id`). The
-- member statements are computed from the loans' members at the time of the run, and the move
-- writes nothing to the journal: the old member kept the loan's fine and the new one never got
-- it. Now the move is remembered here and queued as an edit of the loan's month: the settlement
-- re-journals the loan (a `repriced` entry, its fine unchanged), which re-opens the month's
-- statements on every shard, and their plan recomputes the loan's old members as well as its new
-- one (src/statements.rs).
--
-- Additive: the release before this one never reads the table; it takes the queued edit like any
-- other (its statements job, during a rolling upgrade, recomputes only the new member: the old
-- one is recomputed by this release's next statements run of the month, or by `verify --job
-- member-statements` naming it until then).
CREATE TABLE IF NOT EXISTS member_moves (
    id            bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    loan_id       bigint      NOT NULL,
    -- The first day of the month the loan's settled fine is in.
    month         date        NOT NULL,
    old_member_id bigint,
    new_member_id bigint,
    at            timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS member_moves_by_loan ON member_moves (loan_id, month);

-- Runs as its owner (settlementd's migration role): libraryd's roles need no grant. The month is
-- found as for an edit of the dates (settlementd_loan_changed).
CREATE OR REPLACE FUNCTION settlementd_member_moved() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    was date := OLD.returned_on;
BEGIN
    IF was IS NULL OR NOT isfinite(was) THEN
        was := date_trunc('month', OLD.fine_settled_at AT TIME ZONE 'UTC') - interval '1 day';
    END IF;
    INSERT INTO member_moves (loan_id, month, old_member_id, new_member_id)
    VALUES (OLD.id, date_trunc('month', was)::date, OLD.member_id, NEW.member_id);
    INSERT INTO loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq, old_due_on,
                              old_returned_on)
    VALUES (OLD.id, date_trunc('month', was)::date, false, OLD.fine_cents, OLD.fine_seq,
            OLD.due_on, OLD.returned_on);
    RETURN NULL;
END
$$;
