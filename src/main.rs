//! The `settlementd` binary: parse the command line, load and validate the configuration, call the
//! library, map the outcome to an exit code (0 done or skipped, 1 failed, 2 invalid input/config).

use settlementd::cli::{self, Command};
use std::process::ExitCode;

fn main() -> ExitCode {
    #[cfg(feature = "bench-unjournaled")]
    if std::env::var("SETTLEMENTD_BENCH_UNJOURNALED").as_deref() != Ok("1") {
        eprintln!(
            "settlementd: this build settles without writing the money journal (the benchmark's \
             baseline, feature bench-unjournaled): it refuses to run outside the benchmark"
        );
        return ExitCode::from(2);
    }
    #[cfg(feature = "campaign-mutants")]
    match settlementd::mutant::Mutant::from_env() {
        Ok(Some(_)) => {}
        Ok(None) => {
            eprintln!(
                "settlementd: this build carries the fault campaign's planted bugs (feature \
                 campaign-mutants): it runs only under the campaign, with \
                 SETTLEMENTD_CAMPAIGN_MUTANT naming one"
            );
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!("settlementd: {e}");
            return ExitCode::from(2);
        }
    }
    let cli = match cli::parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    if !matches!(cli.command, Command::Serve(_) | Command::Demo) {
        // A command whose reader went away (`settlementd schedule --next 1000 | head -1`) ends
        // quietly, as Unix tools do, instead of panicking on the closed pipe. Not for `serve` and
        // the demo, which hold sockets: a peer gone is an error to handle there, not an exit.
        // SAFETY: signal(2) with SIG_DFL, before any thread is started.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let settings = match settlementd::jobs::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("settlementd: {e}");
            return ExitCode::from(2);
        }
    };
    settlementd::schedule::show_times_in(settings.schedule.timezone);
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
