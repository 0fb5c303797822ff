-- A month's unsettled loans in id order, wherever their ids lie: the settlement reads this index
-- and nothing else, so a run costs what its month holds, not what the table holds. It replaces
-- loans_unsettled_by_return (returned_on, id), whose id order held only within one day.
--
-- The second column is `id + 0`, not `id`: the settlement's statements compare `id + 0`, which
-- only this index holds, so no plan can serve them from the primary key (whose range between two
-- ids of a month may hold years of other months' rows). `id` and `returned_on` are included so
-- that finding a batch (and skipping other shards' rows) is an index-only scan. Partial on
-- "unsettled and returned": a settled month has no entries, so a re-run reads nothing.
--
-- On a large existing table, build it beforehand without blocking libraryd's writes, and this
-- migration finds it in place (docs/OPERATIONS.md, upgrades):
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS loans_unsettled_by_month ON loans
--     (date_trunc('month', returned_on::timestamp), (id + 0)) INCLUDE (id, returned_on)
--     WHERE fine_settled_at IS NULL AND returned_on IS NOT NULL;
CREATE INDEX IF NOT EXISTS loans_unsettled_by_month
    ON loans (date_trunc('month', returned_on::timestamp), (id + 0)) INCLUDE (id, returned_on)
    WHERE fine_settled_at IS NULL AND returned_on IS NOT NULL;

DROP INDEX IF EXISTS loans_unsettled_by_return;
