-- fine_adjustments without its foreign key to fine_corrections. A correction writes one row per
-- loan whose fine it changes, and PostgreSQL checks a foreign key row by row (a trigger and a
-- lookup each): on the benchmark's month (40,000 fines changed) the check was 107 of the insert's
-- 233 ms, a third of `correct`'s statement time. Every row is written under a key that the same
-- correction recorded first (settlement/correction.rs, `begin`), corrections are never deleted
-- (retention keeps both tables), and the fault campaign checks each row against the journal
-- entry under its key; docs/DESIGN.md, "Proving and correcting a month".
ALTER TABLE fine_adjustments DROP CONSTRAINT IF EXISTS fine_adjustments_correction_key_fkey;
