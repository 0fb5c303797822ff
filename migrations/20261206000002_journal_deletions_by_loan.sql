-- `verify` proves that a loan gone from `loans` had its deletion recorded by looking for the
-- deletion entry holding its id. Without an index that was a scan of every deletion entry per
-- vanished loan (2.07 s for 100 loans on a 200,000-row journal); this partial index holds only
-- deletion entries, so it stays small and the look-up follows the month. Additive: the release
-- before this one never reads it.
CREATE INDEX IF NOT EXISTS fine_journal_deletions_by_loan
    ON fine_journal USING gin (loan_ids) WHERE kind = 'deleted';
