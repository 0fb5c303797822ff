//! Deterministic synthetic loans. (Being built: see issue 4.)

use crate::cli::{AppError, Result, SeedArgs};
use crate::config::Settings;

pub async fn seed_command(_args: SeedArgs, _settings: Settings) -> Result<()> {
    Err(AppError::Invalid("seed is not implemented yet".into()))
}
