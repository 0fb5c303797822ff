-- A month's unsettled loans in id order, wherever their ids lie: the settlement walks this index
-- and nothing else, so a run costs what its month holds, not what the table holds. It replaces
-- loans_unsettled_by_return (returned_on, id), whose id order holds only within one day.
--
-- Partial on "unsettled and returned": a settled month has no entries, so a re-run reads nothing.
-- On a large existing table, build it beforehand without blocking libraryd's writes:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS loans_unsettled_by_month ON loans
--     (date_trunc('month', returned_on::timestamp), id)
--     WHERE fine_settled_at IS NULL AND returned_on IS NOT NULL;
-- and this migration finds it in place (docs/OPERATIONS.md, upgrades).
CREATE INDEX IF NOT EXISTS loans_unsettled_by_month
    ON loans (date_trunc('month', returned_on::timestamp), id)
    WHERE fine_settled_at IS NULL AND returned_on IS NOT NULL;

DROP INDEX IF EXISTS loans_unsettled_by_return;
