//! One file per command: each takes typed arguments (never clap types), does the command's work
//! through [`crate::app`] and the layers below it, and returns what the command produced. The
//! output shapes (text line, JSON object) sit beside the command; `cli` only parses, dispatches
//! and prints them.
//!
//! `serve` and `demo` live next to the layers they drive: [`crate::daemon::serve_command`] and
//! [`crate::demo::run`].

pub mod correct;
pub mod jobs;
pub mod migrate;
pub mod pause;
pub mod prune;
pub mod run;
pub mod schedule;
pub mod seed;
pub mod status;
pub mod verify;
