//! `settlementd serve`: the long-running replica. (Being built: see issue 3.)

pub mod schedule;

use crate::cli::{AppError, Result};
use crate::config::Settings;

pub async fn serve_command(_settings: Settings, _embedded: bool) -> Result<()> {
    Err(AppError::Invalid("serve is not implemented yet".into()))
}
