//! The `settlementd` binary: parse the command line, load and validate the configuration, call the
//! library, map the outcome to an exit code (0 done or skipped, 1 failed, 2 invalid input/config).

use settlementd::cli::{self, Command};
use settlementd::config::Settings;
use std::process::ExitCode;

/// The campaign mutant (a planted bug, `Cargo.toml`'s `mutant-*` features) this binary was built
/// with, if any: such a binary exists only for the fault campaign (docs/CAMPAIGN.md).
const MUTANT: Option<&str> = if cfg!(feature = "mutant-fence-off") {
    Some("mutant-fence-off")
} else if cfg!(feature = "mutant-claim-ignores-conflict") {
    Some("mutant-claim-ignores-conflict")
} else if cfg!(feature = "mutant-lease-local-clock") {
    Some("mutant-lease-local-clock")
} else if cfg!(feature = "mutant-skip-journal") {
    Some("mutant-skip-journal")
} else if cfg!(feature = "mutant-late-under-config-rule") {
    Some("mutant-late-under-config-rule")
} else {
    None
};

fn main() -> ExitCode {
    if let Some(mutant) = MUTANT {
        if std::env::var("SETTLEMENTD_CAMPAIGN_MUTANT").as_deref() != Ok("1") {
            eprintln!(
                "settlementd: this binary was built with the campaign mutant {mutant}, a planted \
                 bug; it runs only under the fault campaign (SETTLEMENTD_CAMPAIGN_MUTANT=1)"
            );
            return ExitCode::from(2);
        }
    }
    let cli = match cli::parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("settlementd: {e}");
            return ExitCode::from(2);
        }
    };
    let level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("settlementd: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    runtime.block_on(async {
        settlementd::app::init_logging(settings.log.format, level);
        for warning in settings.secret_file_warnings() {
            tracing::warn!("{warning}");
        }
        match cli::execute(cli, settings).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("settlementd: {e}");
                e.exit_code()
            }
        }
    })
}
