-- The record's own head per loan: where each loan's money chain ends, kept by settlementd and by
-- nothing libraryd can recreate or rewrite. Until now a loan's current journal entry was the one
-- whose seq equals `loans.fine_seq`, a column of libraryd's row: a reload of the table (TRUNCATE
-- and re-insert without settlementd's columns), or a loan deleted and re-created under its id,
-- restarted the chain at seq 1, and both entries matched (status counted the loan twice).
--
-- `fine_heads` holds, per loan the journal knows, its last entry (journal row, seq, month, kind,
-- cents), how many entries it has and whether each continued the chain: an entry continues it
-- when its seq is the head's + 1 and its `before_cents` the head's `after_cents`. The trigger below
-- keeps it in the transaction that appends the entries, for every writer (this release, the
-- release before it during a rolling upgrade, `migrate`), so `verify` reads a loan's chain check
-- by primary key and its cost follows the month.
--
-- Additive: the release before this one never reads it, and its journal rows keep it up to date
-- through the trigger like this release's.
CREATE TABLE IF NOT EXISTS fine_heads (
    loan_id      bigint  PRIMARY KEY,
    -- The journal row (fine_journal.id) holding the loan's last entry, and that entry.
    journal_id   bigint  NOT NULL,
    seq          integer NOT NULL,
    month        date    NOT NULL,
    kind         text    NOT NULL,
    before_cents bigint,
    after_cents  bigint,
    -- The loan's entries on the record.
    entries      integer NOT NULL,
    -- Entries that did not continue the chain, and the journal row of the first of them.
    breaks       integer NOT NULL DEFAULT 0,
    first_break  bigint
);

-- Runs as its owner (settlementd's migration role): the runtime role may only read the heads.
CREATE OR REPLACE FUNCTION settlementd_journal_appended() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO fine_heads AS h (loan_id, journal_id, seq, month, kind, before_cents, after_cents,
                                 entries)
    SELECT DISTINCT ON (e.loan_id) e.loan_id, a.id, e.seq, a.month, a.kind, e.before_cents,
           e.after_cents, 1
      FROM appended a,
           unnest(a.loan_ids, a.seqs, a.before_cents, a.after_cents)
             AS e(loan_id, seq, before_cents, after_cents)
     ORDER BY e.loan_id, a.id DESC
    ON CONFLICT (loan_id) DO UPDATE
       SET journal_id = excluded.journal_id, seq = excluded.seq, month = excluded.month,
           kind = excluded.kind, before_cents = excluded.before_cents,
           after_cents = excluded.after_cents, entries = h.entries + 1,
           breaks = h.breaks + CASE WHEN excluded.seq IS DISTINCT FROM h.seq + 1
                                      OR excluded.before_cents IS DISTINCT FROM h.after_cents
                                    THEN 1 ELSE 0 END,
           first_break = COALESCE(h.first_break,
                                  CASE WHEN excluded.seq IS DISTINCT FROM h.seq + 1
                                         OR excluded.before_cents IS DISTINCT FROM h.after_cents
                                       THEN excluded.journal_id END);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS settlementd_journal_heads ON fine_journal;
CREATE TRIGGER settlementd_journal_heads
    AFTER INSERT ON fine_journal
    REFERENCING NEW TABLE AS appended
    FOR EACH STATEMENT
    EXECUTE FUNCTION settlementd_journal_appended();
-- Also under session_replication_role = replica (a restore tool's setting): the head follows
-- every entry, however it was written.
ALTER TABLE fine_journal ENABLE ALWAYS TRIGGER settlementd_journal_heads;

-- The heads of the journal as it stands (the trigger, created first, waited for every insert in
-- flight; those after it wait for this migration and then keep the heads themselves).
INSERT INTO fine_heads (loan_id, journal_id, seq, month, kind, before_cents, after_cents, entries,
                        breaks, first_break)
SELECT loan_id, (array_agg(journal_id ORDER BY journal_id DESC))[1],
       (array_agg(seq ORDER BY journal_id DESC))[1], (array_agg(month ORDER BY journal_id DESC))[1],
       (array_agg(kind ORDER BY journal_id DESC))[1],
       (array_agg(before_cents ORDER BY journal_id DESC))[1],
       (array_agg(after_cents ORDER BY journal_id DESC))[1], count(*),
       count(*) FILTER (WHERE broke), min(journal_id) FILTER (WHERE broke)
  FROM (SELECT e.loan_id, e.journal_id, e.seq, e.month, e.kind, e.before_cents, e.after_cents,
               lag(e.journal_id) OVER w IS NOT NULL
               AND (e.seq IS DISTINCT FROM lag(e.seq) OVER w + 1
                    OR e.before_cents IS DISTINCT FROM lag(e.after_cents) OVER w) AS broke
          FROM fine_journal_entries e
        WINDOW w AS (PARTITION BY e.loan_id ORDER BY e.journal_id)) x
 GROUP BY loan_id
ON CONFLICT (loan_id) DO NOTHING;

-- A loan renumbered in libraryd (UPDATE of its id) is, to the record, the old id gone and a new
-- loan: the old id's deletion is queued (its fine is taken out by its month's next run), and the
-- row under its new id loses settlementd's marks, so that it is settled as the loan it now is
-- (the trigger on loans is in the next migration, which runs as the owner of loans).
CREATE OR REPLACE FUNCTION settlementd_loan_renumbered() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    was date := OLD.returned_on;
BEGIN
    IF was IS NULL OR NOT isfinite(was) THEN
        was := date_trunc('month', OLD.fine_settled_at AT TIME ZONE 'UTC') - interval '1 day';
    END IF;
    INSERT INTO loan_changes (loan_id, month, deleted, old_fine_cents, old_fine_seq, old_due_on,
                              old_returned_on)
    VALUES (OLD.id, date_trunc('month', was)::date, true, OLD.fine_cents, OLD.fine_seq,
            OLD.due_on, OLD.returned_on);
    NEW.fine_settled_at := NULL;
    NEW.fine_seq := NULL;
    RETURN NEW;
END
$$;
