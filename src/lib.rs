//! settlementd settles library-loan fines once a month, idempotently: however many times the job
//! runs — double scheduler fires, restarts, retries, duplicate replicas, a manual re-run colliding
//! with the cron — the database ends exactly as after one run.
//!
//! Three layers:
//! - **job layer** ([`job_layer`]): a `job_runs` row per (job, business date, shard count, shard) is
//!   claimed with `INSERT … ON CONFLICT DO NOTHING`; FAILED rows and RUNNING rows whose heartbeat
//!   lease expired (database clock) are taken over with `attempt + 1`; SUCCESS blocks re-runs.
//!   Every write of a run is fenced by its attempt.
//! - **data layer** ([`jobs::fine_settlement`]): batches along the month's entries of one partial index, in id
//!   order (a run costs its month's rows, whatever the table), each one transaction that settles with
//!   `… AND fine_settled_at IS NULL` and records fenced progress. A zero fine is a result, not a
//!   marker ([`fine`]).
//! - **scheduling** ([`daemon`]): a cron trigger in the configured zone; the business date is last
//!   month's end relative to the *scheduled fire time* ([`calendar`]), read from an injected
//!   [`clock::Clock`]; missed slots are caught up and failures retried.
//!
//! Layers, top to bottom; a module may use only the rows below its own (nothing imports `cli`, and
//! no two modules import each other):
//!
//! | layer | modules | owns |
//! |---|---|---|
//! | command line | [`cli`] | clap types, parsing, dispatch, printing |
//! | commands and front ends | [`commands`], [`daemon`], [`demo`] | one file per command; `serve` (a replica per job, the tick loop, HTTP); the demo |
//! | shared by every command | [`app`], [`overview`] | error and exit codes, the database (configured or embedded), logging, shutdown signal, run options, default business date; every job at a glance, read-only and time-bounded (the status page's and `status`'s data) |
//! | the jobs | [`jobs`] | one module per job under its own name — `fine_settlement` (the loans SQL, journal, verify, preview, corrections), `member_statements` — and, in `jobs/mod.rs`, the one list of them with their schedules and settings; a job uses no other job's module |
//! | the jobs' tools | [`seed`], [`db`], [`embedded_pg`] | synthetic loans; connect and migrate; a private PostgreSQL |
//! | generic layers | [`job_layer`], [`config`] | the `Job` trait and registry types, claim, lease, fencing, pins, pause, what is due, requests, retention, whether the server takes writes, `run_once` (knows nothing of loans); typed, validated settings |
//! | pure | [`calendar`], [`fine`], [`clock`], [`schedule`], [`mutant`], [`version`], [`numbers`] | business dates, the fine rule, injected time, cron slots, the fault campaign's planted bugs, the binary's release and commit, counts and money as people write them (`schedule` uses `calendar`; the others use nothing) |
//!
//! `python3 ../shared/tools/modcycles.py src` checks the "no cycles, nothing imports `cli`" part.

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
pub mod job_layer;
pub mod jobs;
pub mod mutant;
pub mod numbers;
pub mod overview;
pub mod schedule;
pub mod seed;
pub mod version;
