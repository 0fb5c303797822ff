//! The database URL read as libpq reads it, TLS included: `sslmode` (`disable`, `allow`, `prefer`,
//! the default, `require`, `verify-ca`, `verify-full`), `sslrootcert`, `sslcert` and `sslkey`, in
//! the URL or in `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`.
//!
//! sqlx parses these itself (TLS is rustls); what it does differently from libpq is corrected here,
//! before any connection, so every connection of the process (pool, LISTEN, status page) gets it:
//! - `require` with a root certificate verifies the server's chain, as `verify-ca` (libpq's rule);
//! - `verify-ca` and `verify-full` without `sslrootcert` read `~/.postgresql/root.crt`, and without
//!   that file they are refused, as libpq refuses them; `sslrootcert=system` trusts the roots built
//!   into the binary (Mozilla's) and implies `verify-full` (libpq 16's spelling);
//! - `sslcert` and `sslkey` default to `~/.postgresql/postgresql.crt` and `.key` when both exist;
//! - a Unix-socket connection never uses TLS (libpq ignores `sslmode` there; the server refuses TLS
//!   on a socket);
//! - every file named is read once here, so a wrong path is a configuration error (exit 2) naming
//!   the parameter and the file, not a connection error.
//!
//! What is left different, all in sqlx 0.8.6: `sslrootcert` is added to the built-in roots instead
//! of being trusted alone, so a certificate from a public CA for the same host name verifies too;
//! `verify-ca` checks the host name as `verify-full` does (sqlx issue #3793, with rustls 0.23.24
//! and later): stricter than libpq, never weaker; `allow` connects without TLS, like `disable`.

use sqlx::postgres::{PgConnectOptions, PgSslMode};
use std::path::PathBuf;
use std::str::FromStr;

/// Connect options for `url` with libpq's TLS rules applied (module header); `Err` is a
/// configuration mistake, in one line that never repeats the URL.
pub fn connect_options(url: &str) -> Result<PgConnectOptions, String> {
    let params = Params::of(url)?;
    let mut text = url.to_string();
    let mut root_cert = params.get("sslrootcert", &["ssl-root-cert", "ssl-ca"], "PGSSLROOTCERT");
    let mut mode = match params.get("sslmode", &["ssl-mode"], "PGSSLMODE") {
        Some(mode) => Some(
            PgSslMode::from_str(&mode)
                .map_err(|_| format!("sslmode '{mode}' is not one of disable, allow, prefer, require, verify-ca, verify-full"))?,
        ),
        None => None,
    };
    let system_roots = root_cert.as_deref() == Some("system");
    if system_roots {
        if mode.is_some_and(|m| !matches!(m, PgSslMode::VerifyFull)) {
            return Err(
                "sslrootcert=system trusts every public CA, so it needs sslmode=verify-full".into(),
            );
        }
        mode = Some(PgSslMode::VerifyFull);
        root_cert = None;
        text = params.without(url, &["sslrootcert", "ssl-root-cert", "ssl-ca"])?;
    }
    let mut options = PgConnectOptions::from_str(&text).map_err(|e| e.to_string())?;
    if options.get_socket().is_some() {
        // Over a Unix socket: no TLS, whatever sslmode says (libpq).
        return Ok(options.ssl_mode(PgSslMode::Disable));
    }
    let mode = mode.unwrap_or(PgSslMode::Prefer);
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".postgresql"));
    let verifies = matches!(mode, PgSslMode::VerifyCa | PgSslMode::VerifyFull);
    let root_cert = match root_cert {
        Some(path) => Some(readable("sslrootcert", &path)?),
        None if system_roots => None,
        None if verifies || matches!(mode, PgSslMode::Require) => {
            let default = home.as_ref().map(|h| h.join("root.crt"));
            match default.filter(|f| f.is_file()) {
                Some(file) => Some(readable("sslrootcert", &file.to_string_lossy())?),
                None if verifies => {
                    return Err(format!(
                        "sslmode={} needs the CA that signed the server's certificate: set \
                         sslrootcert=/path/to/ca.pem in the URL (libpq's default, \
                         ~/.postgresql/root.crt, does not exist), or sslrootcert=system for a \
                         server whose certificate comes from a public CA",
                        mode_name(mode)
                    ));
                }
                None => None,
            }
        }
        None => None,
    };
    if let Some(file) = &root_cert {
        options = options.ssl_root_cert(file);
    }
    // libpq: a root certificate turns `require` into `verify-ca`.
    let mode = match (mode, &root_cert) {
        (PgSslMode::Require, Some(_)) => PgSslMode::VerifyCa,
        _ => mode,
    };
    options = options.ssl_mode(mode);
    let cert = params.get("sslcert", &["ssl-cert"], "PGSSLCERT");
    let key = params.get("sslkey", &["ssl-key"], "PGSSLKEY");
    match (cert, key) {
        (Some(cert), Some(key)) => {
            options = options
                .ssl_client_cert(readable("sslcert", &cert)?)
                .ssl_client_key(readable("sslkey", &key)?);
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err("sslcert and sslkey go together: set both, or neither".into())
        }
        (None, None) => {
            let pair = home.map(|h| (h.join("postgresql.crt"), h.join("postgresql.key")));
            if let Some((cert, key)) = pair.filter(|(c, k)| c.is_file() && k.is_file()) {
                options = options
                    .ssl_client_cert(readable("sslcert", &cert.to_string_lossy())?)
                    .ssl_client_key(readable("sslkey", &key.to_string_lossy())?);
            }
        }
    }
    Ok(options)
}

/// libpq's name of `mode`.
pub fn mode_name(mode: PgSslMode) -> &'static str {
    match mode {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    }
}

/// `path` when it can be read; the error names the parameter and the file.
fn readable(param: &str, path: &str) -> Result<PathBuf, String> {
    std::fs::File::open(path)
        .map(|_| PathBuf::from(path))
        .map_err(|e| format!("{param} {path} cannot be read: {e}"))
}

/// The URL's query parameters.
struct Params(Vec<(String, String)>);

impl Params {
    fn of(url: &str) -> Result<Self, String> {
        let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
        Ok(Self(
            parsed
                .query_pairs()
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        ))
    }

    /// The value of `name` (or one of its sqlx `aliases`), else the environment variable `env`.
    fn get(&self, name: &str, aliases: &[&str], env: &str) -> Option<String> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name || aliases.contains(&k.as_str()))
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(env).ok().filter(|v| !v.is_empty()))
    }

    /// `url` without the query parameters `names`.
    fn without(&self, url: &str, names: &[&str]) -> Result<String, String> {
        let mut parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
        let kept: Vec<&(String, String)> = self
            .0
            .iter()
            .filter(|(k, _)| !names.contains(&k.as_str()))
            .collect();
        parsed.set_query(None);
        if !kept.is_empty() {
            parsed.query_pairs_mut().extend_pairs(kept);
        }
        Ok(parsed.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(url: &str) -> Result<&'static str, String> {
        connect_options(url).map(|o| mode_name(o.get_ssl_mode()))
    }

    #[test]
    fn libpq_rules_are_applied_before_any_connection() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "not checked here").unwrap();
        let ca = ca.display();
        assert_eq!(mode_of("postgres://u@h/db"), Ok("prefer"));
        assert_eq!(mode_of("postgres://u@h/db?sslmode=disable"), Ok("disable"));
        assert_eq!(mode_of("postgres://u@h/db?sslmode=require"), Ok("require"));
        // A root certificate makes require verify the chain.
        assert_eq!(
            mode_of(&format!(
                "postgres://u@h/db?sslmode=require&sslrootcert={ca}"
            )),
            Ok("verify-ca")
        );
        assert_eq!(
            mode_of(&format!(
                "postgres://u@h/db?sslmode=verify-full&sslrootcert={ca}"
            )),
            Ok("verify-full")
        );
        assert_eq!(
            mode_of("postgres://u@h/db?sslrootcert=system"),
            Ok("verify-full")
        );
        // A Unix socket never uses TLS.
        assert_eq!(
            mode_of("postgres://u@localhost/db?host=/run/pg&sslmode=verify-full"),
            Ok("disable")
        );
    }

    #[test]
    fn what_libpq_refuses_is_refused_in_one_line_naming_the_parameter() {
        for (url, needle) in [
            ("postgres://u@h/db?sslmode=sometimes", "sslmode 'sometimes'"),
            ("postgres://u@h/db?sslmode=verify-full", "needs the CA"),
            ("postgres://u@h/db?sslmode=verify-ca", "needs the CA"),
            (
                "postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
                "sslrootcert /nonexistent/ca.pem cannot be read",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslrootcert=system",
                "needs sslmode=verify-full",
            ),
            ("postgres://u@h/db?sslcert=/x.crt", "go together"),
            (
                "postgres://u@h/db?sslcert=/nonexistent/c.crt&sslkey=/nonexistent/c.key",
                "sslcert /nonexistent/c.crt cannot be read",
            ),
        ] {
            let err = connect_options(url).unwrap_err();
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }
}
