-- The member-statements job: each member's settled fines of a month, after the fine settlement.

-- A member's statement of a month: how many of their loans settled in the month carry a fine, and
-- the sum. A member with no fine in the month has no row.
CREATE TABLE IF NOT EXISTS member_fine_statements (
    business_date date        NOT NULL,
    member_id     bigint      NOT NULL,
    fines         bigint      NOT NULL CHECK (fines > 0),
    fine_cents    numeric     NOT NULL,
    computed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_date, member_id)
);

-- How far a shard's statements of a month follow the money journal: the last journal row of the
-- month they were computed from. A journal row after it (a late return, a re-pricing, a
-- correction) re-opens the month's statements for the members concerned.
CREATE TABLE IF NOT EXISTS member_statement_marks (
    business_date date    NOT NULL,
    shards        integer NOT NULL,
    shard         integer NOT NULL,
    journal_id    bigint  NOT NULL,
    PRIMARY KEY (business_date, shards, shard)
);
