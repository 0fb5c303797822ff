//! What this binary is: its release and the commit it was built from, for `settlementd
//! --version`, the `settlementd_build_info` metric, the replicas' registry (`status`, the page)
//! and the migration ledger. Pure: constants only.

/// The release (Cargo's package version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit the binary was built from (build.rs: `SETTLEMENTD_COMMIT`, else git, else
/// "unknown").
pub const COMMIT: &str = env!("SETTLEMENTD_COMMIT");

/// `0.2.0 (commit 1a2b3c4)`: what `--version` prints after the name.
pub const LONG: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SETTLEMENTD_COMMIT"),
    ")"
);
