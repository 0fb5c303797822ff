-- A settled loan moved to another member is remembered and queued (the function is in the
-- previous migration). And libraryd's edits are queued whatever the session's
-- `session_replication_role` (a restore or replication tool sets `replica`, under which ordinary
-- triggers do not fire): every trigger settlementd has on loans fires ALWAYS. Runs as the owner of
-- loans (src/db/migrations.rs, LOANS_MIGRATIONS): plain DDL only.
DROP TRIGGER IF EXISTS settlementd_settled_member_moved ON loans;
CREATE TRIGGER settlementd_settled_member_moved
    AFTER UPDATE OF member_id ON loans
    FOR EACH ROW
    WHEN (OLD.fine_settled_at IS NOT NULL AND OLD.member_id IS DISTINCT FROM NEW.member_id)
    EXECUTE FUNCTION settlementd_member_moved();
ALTER TABLE loans ENABLE ALWAYS TRIGGER settlementd_settled_member_moved;
ALTER TABLE loans ENABLE ALWAYS TRIGGER settlementd_settled_dates_changed;
ALTER TABLE loans ENABLE ALWAYS TRIGGER settlementd_settled_deleted;
