-- A settled loan renumbered in libraryd (UPDATE of its id): the old id's deletion is queued and the
-- row under its new id is unsettled again, before the update is written (the function is in the
-- previous migration). Runs as the owner of loans (src/db/migrations.rs, LOANS_MIGRATIONS): plain
-- DDL only.
DROP TRIGGER IF EXISTS settlementd_settled_renumbered ON loans;
CREATE TRIGGER settlementd_settled_renumbered
    BEFORE UPDATE OF id ON loans
    FOR EACH ROW
    WHEN (OLD.fine_settled_at IS NOT NULL AND OLD.id IS DISTINCT FROM NEW.id)
    EXECUTE FUNCTION settlementd_loan_renumbered();
-- Also under session_replication_role = replica.
ALTER TABLE loans ENABLE ALWAYS TRIGGER settlementd_settled_renumbered;
