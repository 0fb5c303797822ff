-- The member statements follow the journal in commit order, not id order. A journal row's id is
-- handed out when it is inserted, and its transaction may commit after a row with a higher id was
-- read: a mark that is only "the highest id seen" never states it. Each row now records the
-- transaction that wrote it, and each mark the snapshot its statements were computed in; a row is
-- after a mark when its id is above the mark's or when that snapshot did not see its transaction.
--
-- Additive: the release before this one neither reads nor writes these columns. Its journal rows
-- get the column's default; its marks leave the snapshot as it was (at worst an old snapshot,
-- which re-opens the members of rows it did not see once more: never fewer). Rows written before
-- this migration have no transaction (NULL): they committed before any snapshot taken after it.
-- The column is added without a default (no table rewrite), then given it.
ALTER TABLE fine_journal ADD COLUMN IF NOT EXISTS xact xid8;
ALTER TABLE fine_journal ALTER COLUMN xact SET DEFAULT pg_current_xact_id();
-- The rows a snapshot may not have seen are those of transactions at or after its xmin: a range of
-- this index per month, whatever the month's size.
CREATE INDEX IF NOT EXISTS fine_journal_by_month_xact ON fine_journal (month, xact);

ALTER TABLE member_statement_marks ADD COLUMN IF NOT EXISTS snapshot pg_snapshot;
