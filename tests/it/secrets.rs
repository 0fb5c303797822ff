//! Secrets are never printed (issue 25): every error path a user can reach, with a canary
//! password and a canary token, in JSON and in text logs at debug level; neither canary may
//! appear on stdout, stderr, `/metrics`, `/status`, `/readyz`, the runs API or `status --json`.

use crate::helpers::*;
use crate::tls::TcpCluster;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const PASSWORD: &str = "Canary-Pw-5ecret";
const TOKEN: &str = "Canary-T0ken-0123456789abcdef";
const FORMATS: [&str; 2] = ["json", "text"];

fn assert_clean(what: &str, text: &str) {
    for canary in [PASSWORD, TOKEN] {
        assert!(!text.contains(canary), "{what} printed a secret: {text}");
    }
}

/// A file holding `content` in `dir`.
fn file(dir: &Path, name: &str, content: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    path
}

/// One way of starting settlementd wrongly: environment and config file.
struct Case {
    what: String,
    env: Vec<(String, String)>,
    config: Option<PathBuf>,
    /// The exit code it must end with.
    code: i32,
}

fn case(what: &str, env: &[(&str, &str)], config: Option<PathBuf>, code: i32) -> Case {
    Case {
        what: what.into(),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        config,
        code,
    }
}

/// Runs `args` for `case` in each log format, at debug level, and checks the exit code and that
/// stdout and stderr hold no canary.
fn check_cli(case: &Case, args: &[&str]) {
    for format in FORMATS {
        let mut cmd = settlementd(None);
        if let Some(config) = &case.config {
            cmd.arg("--config").arg(config);
        }
        let out = cmd
            .args(args)
            .envs(case.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("SETTLEMENTD__LOG__FORMAT", format)
            .env("RUST_LOG", "debug")
            .env("SETTLEMENTD__DATABASE__ACQUIRE_TIMEOUT_SECS", "2")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let what = format!("{} ({format}, {args:?})", case.what);
        assert_eq!(out.status.code(), Some(case.code), "{what}: {stderr}");
        assert!(!stderr.trim().is_empty(), "{what}: nothing said");
        assert_clean(&what, &stdout);
        assert_clean(&what, &stderr);
    }
}

/// A `serve` process with `env` (log format given), its stderr in a file; it must stay up.
struct Replica {
    process: ServeProcess,
    log: PathBuf,
}

fn start_serve(url: &str, env: &[(&str, &str)], format: &str, dir: &Path) -> Replica {
    let log = dir.join(format!("serve-{format}-{}.log", rand::random::<u32>()));
    let mut all: Vec<(&str, &str)> =
        vec![("SETTLEMENTD__LOG__FORMAT", format), ("RUST_LOG", "debug")];
    all.extend_from_slice(env);
    let process = ServeProcess::start_logged(url, &all, &log);
    Replica { process, log }
}

/// Everything a replica shows over HTTP, with the canary token sent both right and wrong.
async fn everything_served(replica: &ServeProcess) -> String {
    let mut seen = String::new();
    for path in ["/metrics", "/status", "/readyz", "/healthz"] {
        let answer = http(replica.addr, "GET", path, &[], "").await.unwrap();
        seen.push_str(&format!(
            "{path}: {} {:?} {}\n",
            answer.status, answer.headers, answer.body
        ));
    }
    let wrong = format!("Bearer {TOKEN}-wrong");
    let right = format!("Bearer {TOKEN}");
    for auth in [wrong.as_str(), right.as_str()] {
        let answer = http(
            replica.addr,
            "POST",
            "/v1/runs",
            &[("Authorization", auth), ("Idempotency-Key", "canary-1")],
            r#"{"business_date": "2026-10-31"}"#,
        )
        .await
        .unwrap();
        seen.push_str(&format!(
            "POST /v1/runs: {} {:?} {}\n",
            answer.status, answer.headers, answer.body
        ));
    }
    seen
}

/// Stops the replica (SIGTERM) and returns its log.
fn stop(replica: Replica) -> String {
    drop(replica.process);
    std::fs::read_to_string(&replica.log).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_error_path_prints_the_password_or_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A server that asks for passwords (scram-sha-256) over TCP, with TLS, and a role whose
    // password is not the canary.
    let cluster = TcpCluster::start(true, &[]).await;
    let admin = cluster.admin_pool().await;
    sqlx::raw_sql("CREATE ROLE app LOGIN PASSWORD 'the-right-one'")
        .execute(&admin)
        .await
        .unwrap();
    cluster.hba("host all all 127.0.0.0/8 scram-sha-256").await;
    let addr = cluster.addr;
    let ca = cluster.certs.ca.display().to_string();
    let other_ca = cluster.certs.other_ca.display().to_string();

    let url =
        |auth: &str, host: &str, query: &str| format!("postgres://{auth}@{host}/settle?{query}");
    let userinfo = format!("app:{PASSWORD}");
    let in_query = format!("sslmode=disable&password={PASSWORD}");
    let unreachable = "127.0.0.1:1";
    let server = format!("{addr}:5432");
    let pw_file = file(d, "password", &format!("{PASSWORD}\n"));
    let pw_file = pw_file.to_str().unwrap();
    let token_file = file(d, "token", &format!("{TOKEN}\n"));
    let token_file = token_file.to_str().unwrap();
    let token_file_spaced = file(d, "token-spaced", &format!("{TOKEN} and more\n"));
    let url_file_mysql = file(d, "url-mysql", &format!("mysql://{userinfo}@h/db\n"));
    let url_file_port = file(d, "url-port", &format!("postgres://{userinfo}@h:port/db\n"));
    let with_token = ("SETTLEMENTD__HTTP__ADMIN_TOKEN", TOKEN);

    let mut cases = Vec::new();
    // The server unreachable, the password in each place a URL can carry it.
    for (what, u) in [
        ("unreachable, userinfo", url(&userinfo, unreachable, "")),
        ("unreachable, query", url("app", unreachable, &in_query)),
    ] {
        cases.push(case(
            what,
            &[("SETTLEMENTD__DATABASE__URL", &u), with_token],
            None,
            1,
        ));
        cases.push(case(what, &[("DATABASE_URL", &u)], None, 1));
    }
    cases.push(case(
        "unreachable, password_file",
        &[
            ("SETTLEMENTD__DATABASE__URL", &url("app", unreachable, "")),
            ("SETTLEMENTD__DATABASE__PASSWORD_FILE", pw_file),
            ("SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE", token_file),
        ],
        None,
        1,
    ));
    // The wrong password, in each place.
    for (what, env) in [
        (
            "wrong password, userinfo",
            vec![(
                "SETTLEMENTD__DATABASE__URL",
                url(&userinfo, &server, "sslmode=disable"),
            )],
        ),
        (
            "wrong password, query",
            vec![("SETTLEMENTD__DATABASE__URL", url("app", &server, &in_query))],
        ),
        (
            "wrong password, password_file",
            vec![
                (
                    "SETTLEMENTD__DATABASE__URL",
                    url("app", &server, "sslmode=disable"),
                ),
                ("SETTLEMENTD__DATABASE__PASSWORD_FILE", pw_file.to_string()),
            ],
        ),
    ] {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        cases.push(case(what, &env, None, 2));
    }
    // TLS refused (a CA that did not sign the server's certificate; a wrong host), with the
    // password in the URL.
    let other = url(
        &userinfo,
        &server,
        &format!("sslmode=verify-full&sslrootcert={other_ca}"),
    );
    let wrong_host = url(
        &userinfo,
        &format!("{}:5432", cluster.other_addr),
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    for (what, u) in [
        ("TLS: unknown CA", &other),
        ("TLS: wrong host", &wrong_host),
    ] {
        cases.push(case(what, &[("SETTLEMENTD__DATABASE__URL", u)], None, 2));
    }
    // Malformed URLs and bad values of every secret-bearing key, from the environment.
    for (what, key, value) in [
        (
            "malformed port",
            "SETTLEMENTD__DATABASE__URL",
            format!("postgres://{userinfo}@h:port/db"),
        ),
        (
            "malformed host",
            "SETTLEMENTD__DATABASE__URL",
            format!("postgres://{userinfo}@[::1/db"),
        ),
        (
            "no scheme",
            "SETTLEMENTD__DATABASE__URL",
            format!("{userinfo}@h/db"),
        ),
        (
            "wrong scheme",
            "SETTLEMENTD__DATABASE__URL",
            format!("mysql://{userinfo}@h/db"),
        ),
        (
            "wrong scheme, DATABASE_URL",
            "DATABASE_URL",
            format!("mysql://{userinfo}@h/db"),
        ),
        (
            "bad sslmode",
            "SETTLEMENTD__DATABASE__URL",
            format!("postgres://{userinfo}@h/db?sslmode=always"),
        ),
        (
            "token with a space",
            "SETTLEMENTD__HTTP__ADMIN_TOKEN",
            format!("{TOKEN} x"),
        ),
        (
            "token with a newline",
            "SETTLEMENTD__HTTP__ADMIN_TOKEN",
            format!("{TOKEN}\nx"),
        ),
    ] {
        cases.push(case(what, &[(key, value.as_str())], None, 2));
    }
    for (what, env) in [
        (
            "url_file: wrong scheme",
            vec![(
                "SETTLEMENTD__DATABASE__URL_FILE",
                url_file_mysql.to_str().unwrap(),
            )],
        ),
        (
            "url_file: bad port",
            vec![(
                "SETTLEMENTD__DATABASE__URL_FILE",
                url_file_port.to_str().unwrap(),
            )],
        ),
        (
            "password_file: no user",
            vec![
                ("SETTLEMENTD__DATABASE__URL", "postgres://h/db"),
                ("SETTLEMENTD__DATABASE__PASSWORD_FILE", pw_file),
            ],
        ),
        (
            "admin_token_file: a space",
            vec![(
                "SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE",
                token_file_spaced.to_str().unwrap(),
            )],
        ),
        (
            "admin_token and its file",
            vec![
                with_token,
                ("SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE", token_file),
            ],
        ),
    ] {
        cases.push(case(what, &env, None, 2));
    }
    // Config files: syntax errors on a secret's line, duplicate keys, wrong types.
    let pg = format!("postgres://{userinfo}@h/db");
    for (what, content) in [
        (
            "unclosed quote on url",
            format!("[database]\nurl = \"{pg}\n"),
        ),
        ("unquoted url", format!("[database]\nurl = {pg}\n")),
        (
            "unclosed quote on the token",
            format!("[http]\nadmin_token = \"{TOKEN}\n"),
        ),
        ("unquoted token", format!("[http]\nadmin_token = {TOKEN}\n")),
        (
            "a line that is only the token",
            format!("[http]\n{TOKEN}\n"),
        ),
        (
            "duplicate token",
            format!("[http]\nadmin_token = \"{TOKEN}\"\nadmin_token = \"{TOKEN}\"\n"),
        ),
        (
            "duplicate url",
            format!("[database]\nurl = \"{pg}\"\nurl = \"{pg}\"\n"),
        ),
        (
            "duplicate table",
            format!("[database]\nurl = \"{pg}\"\n[database]\nurl = \"{pg}\"\n"),
        ),
        ("url as an array", format!("[database]\nurl = [\"{pg}\"]\n")),
        (
            "url as a table",
            format!("[database]\nurl = {{ value = \"{pg}\" }}\n"),
        ),
        (
            "token as an array",
            format!("[http]\nadmin_token = [\"{TOKEN}\"]\n"),
        ),
        (
            "token with a space",
            format!("[http]\nadmin_token = \"{TOKEN} x\"\n"),
        ),
        (
            "url with a wrong scheme",
            format!("[database]\nurl = \"mysql://{userinfo}@h/db\"\n"),
        ),
        (
            "url with a bad port",
            format!("[database]\nurl = \"postgres://{userinfo}@h:port/db\"\n"),
        ),
        (
            "unknown key beside the url",
            format!("[database]\nurl = \"{pg}\"\nurll = \"{pg}\"\n"),
        ),
        (
            "a number out of range beside the token",
            format!("[http]\nadmin_token = \"{TOKEN}\"\n[batch]\nsize = 0\n"),
        ),
    ] {
        let name = format!("config-{}.toml", cases.len());
        cases.push(case(
            &format!("config: {what}"),
            &[],
            Some(file(d, &name, &content)),
            2,
        ));
    }
    for case in &cases {
        check_cli(case, &["status", "--json"]);
    }
    for case in cases.iter().filter(|c| c.what.starts_with("unreachable")) {
        check_cli(case, &["run", "--json", "--business-date", "2026-10-31"]);
    }

    // serve against a server it cannot reach, and against one it can: it stays up, and nothing
    // it serves or logs holds a canary.
    for format in FORMATS {
        let mut replica = start_serve(&url(&userinfo, unreachable, ""), &[with_token], format, d);
        replica.process.wait_for("/healthz", 200).await;
        // Until it has logged a failed attempt to connect.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !std::fs::read_to_string(&replica.log)
            .unwrap()
            .contains("127.0.0.1:1")
        {
            assert!(
                Instant::now() < deadline,
                "serve said nothing about the database"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let served = everything_served(&replica.process).await;
        assert!(
            replica.process.child.try_wait().unwrap().is_none(),
            "serve exited because the database is unreachable"
        );
        let log = stop(replica);
        assert_clean(&format!("unreachable serve's answers ({format})"), &served);
        assert_clean(&format!("unreachable serve's log ({format})"), &log);
    }
    // The canary becomes the right password (of a role that may do everything, migrations too).
    sqlx::raw_sql("ALTER ROLE app SUPERUSER PASSWORD 'Canary-Pw-5ecret'")
        .execute(&admin)
        .await
        .unwrap();
    let good = url(
        &userinfo,
        &server,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    for format in FORMATS {
        let replica = start_serve(&good, &[with_token], format, d);
        replica.process.wait_for("/readyz", 200).await;
        let served = everything_served(&replica.process).await;
        assert!(served.contains("POST /v1/runs: 202"), "{served}");
        let log = stop(replica);
        assert_clean(&format!("serve's answers ({format})"), &served);
        assert_clean(&format!("serve's log ({format})"), &log);
    }
    check_cli(
        &case(
            "healthy",
            &[("SETTLEMENTD__DATABASE__URL", &good), with_token],
            None,
            0,
        ),
        &["status", "--json", "--history", "20"],
    );
}

#[test]
fn a_secret_file_every_user_may_read_is_one_warning_and_not_an_error() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let token = file(dir.path(), "token", &format!("{TOKEN}\n"));
    let schedule = || {
        settlementd(None)
            .args(["schedule", "--next", "1"])
            .env("SETTLEMENTD__HTTP__ADMIN_TOKEN_FILE", &token)
            .env("SETTLEMENTD__LOG__FORMAT", "text")
            .output()
            .unwrap()
    };
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = schedule();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("can be read by every user"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("http.admin_token_file"), "{stderr}");
    assert_clean("the warning", &stderr);
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = schedule();
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("can be read by every user"));
}
