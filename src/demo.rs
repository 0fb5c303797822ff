//! `settlementd demo`. (Being built: see issue 4.)

use crate::cli::{AppError, Result};
use crate::config::Settings;

pub async fn run(_settings: Settings) -> Result<()> {
    Err(AppError::Invalid("demo is not implemented yet".into()))
}
