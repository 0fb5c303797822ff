//! One integration-test binary. Every test runs against a real PostgreSQL: a private cluster the
//! harness starts itself (server binaries from $SETTLEMENTD_PG_BINDIR or the machine's install), or
//! the server named by $TEST_DATABASE_URL. Each test gets a fresh, migrated database.

mod helpers;

// The paths a job's module uses in `src/jobs/`, for the guide's worked example (`guide`).
use settlementd::{config, job_layer};

mod build_script;
mod claim;
mod cli;
mod corrections;
mod daemon;
mod demo;
mod deploy;
mod edges;
mod failover;
mod fault;
mod fleet;
mod follow;
mod guide;
mod hostile;
mod http_limits;
mod jobs;
mod journal;
mod layers;
mod liveness;
mod load;
mod page;
mod pgbouncer;
mod preview;
mod record;
mod reliability;
mod roles;
mod rooms;
mod rules;
mod runs;
mod schema;
mod secrets;
mod server_fetch;
mod settle;
mod standby;
mod statements;
mod status;
mod tls;
mod upgrade;
