CREATE TABLE IF NOT EXISTS monthly_fine_totals (
    business_date date    NOT NULL,
    shards        integer NOT NULL,
    shard         integer NOT NULL,
    loans         bigint  NOT NULL,
    fine_cents    numeric NOT NULL,
    PRIMARY KEY (business_date, shards, shard)
);
