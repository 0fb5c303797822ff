-- A closed month's facts, kept where every process reads them (issue 48, item 2): the status page
-- of each replica and `settlementd status` answered a month's facts by reading its journal (on
-- 12 M loans, seconds per month), again in every process. A row holds the facts and the marker
-- they were counted at: the sum of the month's attempts and the job's mark (the fine settlement:
-- the month's last fine_journal row). A reader takes a row only while both still hold
-- (src/job_layer/month_facts.rs); a month without a row has not been counted.
--
-- Additive: a new table, nothing else. The release before this one never reads it; the journal
-- rows it writes move the mark, so what it changes is counted again.
-- Locks: none on any existing table (CREATE TABLE). Duration: constant.
SET LOCAL lock_timeout = '5s';

CREATE TABLE IF NOT EXISTS settlementd.month_facts (
    job_name       text        NOT NULL,
    business_date  date        NOT NULL,
    month_attempts bigint      NOT NULL,
    mark           bigint,
    facts          jsonb       NOT NULL,
    counted_at     timestamptz NOT NULL,
    PRIMARY KEY (job_name, business_date)
);
