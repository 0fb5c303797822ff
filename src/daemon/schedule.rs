//! Fire times and their business dates.

use crate::cli::{AppError, Result};
use crate::clock::Clock;
use crate::config::Settings;

pub fn print_next(_settings: &Settings, _clock: &dyn Clock, _n: usize, _json: bool) -> Result<()> {
    Err(AppError::Invalid("schedule is not implemented yet".into()))
}
