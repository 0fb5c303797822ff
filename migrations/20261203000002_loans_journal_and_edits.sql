-- What the journal and the edit queue need on libraryd's loans. Runs as the owner of loans
-- (src/db.rs, LOANS_MIGRATIONS): plain DDL only.

-- The seq of the loan's last journal entry (NULL: none yet).
ALTER TABLE loans ADD COLUMN IF NOT EXISTS fine_seq integer;

-- Settled loans without a journal entry: those settled before the journal existed (or by an older
-- binary during a rolling upgrade). `settlementd migrate` gives each an opening entry in batches
-- through this index, and replicas do the same for any they find; empty in steady state, so it
-- costs a settlement nothing but the evaluation of its predicate. On a large table build it
-- beforehand without blocking libraryd (docs/OPERATIONS.md, upgrades):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS loans_settled_unjournaled ON loans (id)
--     WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL;
CREATE INDEX IF NOT EXISTS loans_settled_unjournaled ON loans (id)
    WHERE fine_settled_at IS NOT NULL AND fine_seq IS NULL;

-- libraryd's edits of a settled loan's dates, and its deletion, queued in libraryd's own
-- transaction. settlementd's own writes set neither column, so they never fire these.
DROP TRIGGER IF EXISTS settlementd_settled_dates_changed ON loans;
CREATE TRIGGER settlementd_settled_dates_changed
    AFTER UPDATE OF returned_on, due_on ON loans
    FOR EACH ROW
    WHEN (OLD.fine_settled_at IS NOT NULL
          AND (OLD.returned_on IS DISTINCT FROM NEW.returned_on
               OR OLD.due_on IS DISTINCT FROM NEW.due_on))
    EXECUTE FUNCTION settlementd_loan_changed();
DROP TRIGGER IF EXISTS settlementd_settled_deleted ON loans;
CREATE TRIGGER settlementd_settled_deleted
    AFTER DELETE ON loans
    FOR EACH ROW
    WHEN (OLD.fine_settled_at IS NOT NULL)
    EXECUTE FUNCTION settlementd_loan_changed();
