//! settlementd settles library-loan fines once a month, idempotently: however many times the job
//! runs — double scheduler fires, restarts, retries, duplicate replicas, a manual re-run colliding
//! with the cron — the database ends exactly as after one run.
//!
//! Three layers:
//! - **job layer** ([`jobs`]): a `job_runs` row per (job, business date, shard count, shard) is
//!   claimed with `INSERT … ON CONFLICT DO NOTHING`; FAILED rows and RUNNING rows whose heartbeat
//!   lease expired (database clock) are taken over with `attempt + 1`; SUCCESS blocks re-runs.
//!   Every write of a run is fenced by its attempt.
//! - **data layer** ([`settlement`]): keyset batches, each one transaction that settles with
//!   `… AND fine_settled_at IS NULL` and records fenced progress. A zero fine is a result, not a
//!   marker ([`fine`]).
//! - **scheduling** ([`daemon`]): a cron trigger in the configured zone; the business date is last
//!   month's end relative to the *scheduled fire time* ([`calendar`]), read from an injected
//!   [`clock::Clock`]; missed slots are caught up and failures retried.
//!
//! Arrows point inward: `cli`, `daemon` and `demo` use `jobs` and `settlement`; `jobs` knows nothing
//! of loans; `calendar` and `fine` are pure.

pub mod app;
pub mod calendar;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod config;
pub mod daemon;
pub mod db;
pub mod demo;
pub mod embedded_pg;
pub mod fine;
pub mod jobs;
pub mod schedule;
pub mod seed;
pub mod settlement;
