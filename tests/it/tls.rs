//! TLS to PostgreSQL (issue 25), against real servers the tests start on loopback TCP with
//! `ssl = on` and a CA made here (rcgen): `verify-full` with the right host connects and every
//! session of the process is encrypted; a wrong host name, an unknown CA, and `require` against a
//! server without TLS are refused with one line naming the cause and exit 2; a `hostssl`-only
//! server's refusal of a plaintext connection says so, not "check the password".

use crate::helpers::*;
use sqlx::{Connection, PgConnection, PgPool};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Two loopback addresses of a private /24 the cluster listens on (port 5432 is taken on neither):
/// the server's certificate names only `addr`.
fn free_addresses() -> (Ipv4Addr, Ipv4Addr) {
    for _ in 0..100 {
        let net: [u8; 2] = [
            rand::random::<u8>() % 100 + 100,
            rand::random::<u8>() % 250 + 1,
        ];
        let addr = Ipv4Addr::new(127, net[0], net[1], 1);
        let other = Ipv4Addr::new(127, net[0], net[1], 2);
        let free = |a: Ipv4Addr| std::net::TcpListener::bind((a, 5432)).is_ok();
        if free(addr) && free(other) {
            return (addr, other);
        }
    }
    panic!("no free loopback address for a TCP cluster");
}

/// A CA, the server's certificate for `addr` signed by it, and an unrelated CA, as PEM files.
pub struct Certs {
    pub ca: PathBuf,
    pub other_ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

fn make_certs(dir: &Path, addr: Ipv4Addr) -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
    let ca_for = |name: &str| {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.self_signed(&key).unwrap();
        (cert, key)
    };
    let (ca, ca_key) = ca_for("settlementd test CA");
    let (other, _) = ca_for("someone else's CA");
    let server_key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names = vec![SanType::IpAddress(addr.into())];
    params
        .distinguished_name
        .push(DnType::CommonName, addr.to_string());
    let server = params.signed_by(&server_key, &ca, &ca_key).unwrap();
    let certs = Certs {
        ca: dir.join("ca.pem"),
        other_ca: dir.join("other-ca.pem"),
        server_cert: dir.join("server.crt"),
        server_key: dir.join("server.key"),
    };
    std::fs::write(&certs.ca, ca.pem()).unwrap();
    std::fs::write(&certs.other_ca, other.pem()).unwrap();
    std::fs::write(&certs.server_cert, server.pem()).unwrap();
    std::fs::write(&certs.server_key, server_key.serialize_pem()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&certs.server_key, std::fs::Permissions::from_mode(0o600)).unwrap();
    certs
}

/// A private cluster listening on loopback TCP too, with database `settle` migrated.
pub struct TcpCluster {
    pub cluster: PrivateCluster,
    pub addr: Ipv4Addr,
    pub other_addr: Ipv4Addr,
    pub certs: Certs,
    /// The superuser on `settle`, over the Unix socket (no TLS).
    pub admin: String,
    _certs_dir: tempfile::TempDir,
}

impl TcpCluster {
    /// `ssl`: serve TLS with the test CA's certificate; `settings`: more server settings.
    pub async fn start(ssl: bool, settings: &[(&str, &str)]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("settlementd-certs-")
            .tempdir()
            .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let (addr, other_addr) = free_addresses();
        let certs = make_certs(dir.path(), addr);
        // The server reads its key as the `postgres` OS user when the tests run as root.
        if let Some((uid, gid)) = server_owner() {
            for path in [&certs.server_cert, &certs.server_key] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
            }
        }
        let listen = format!("{addr},{other_addr}");
        let (cert, key) = (
            certs.server_cert.display().to_string(),
            certs.server_key.display().to_string(),
        );
        let mut all = vec![("listen_addresses", listen.as_str())];
        if ssl {
            all.extend([
                ("ssl", "on"),
                ("ssl_cert_file", cert.as_str()),
                ("ssl_key_file", key.as_str()),
            ]);
        }
        all.extend_from_slice(settings);
        let cluster = PrivateCluster::start_with(&all).await;
        let admin = cluster.url.clone();
        Self {
            cluster,
            addr,
            other_addr,
            certs,
            admin,
            _certs_dir: dir,
        }
    }

    /// `settle` over TCP at `host` as the superuser, with `query` (`sslmode=…&…`).
    pub fn url(&self, host: Ipv4Addr, query: &str) -> String {
        format!("postgres://settlementd@{host}:5432/settle?{query}")
    }

    pub async fn admin_pool(&self) -> PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&self.admin)
            .await
            .unwrap()
    }

    /// Replaces pg_hba.conf (the Unix socket stays trusted) and reloads it.
    pub async fn hba(&self, tcp_lines: &str) {
        std::fs::write(
            self.cluster.pg.data_dir().join("pg_hba.conf"),
            format!("local all all trust\n{tcp_lines}\n"),
        )
        .unwrap();
        let mut conn = PgConnection::connect(&self.admin).await.unwrap();
        sqlx::query("SELECT pg_reload_conf()")
            .execute(&mut conn)
            .await
            .unwrap();
        // The postmaster reloads on SIGHUP, asynchronously: give it a moment.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `settlementd status --json` on `url`: (exit code, stdout, stderr).
fn status(url: &str) -> (i32, String, String) {
    let out = settlementd(Some(url))
        .args(["status", "--json", "--shards", "1"])
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Asserts `settlementd status` on `url` exits 2 with one line on stderr containing `cause`.
fn refused(url: &str, cause: &str) -> String {
    let (code, _, stderr) = status(url);
    assert_eq!(code, 2, "{url}: {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(cause), "{url}: {stderr}");
    stderr
}

/// Every session of settlementd's processes (its pools, its LISTEN, its status page), with
/// whether it is encrypted.
async fn sessions(admin: &PgPool) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT a.application_name, coalesce(s.ssl, false)
           FROM pg_stat_activity a LEFT JOIN pg_stat_ssl s ON s.pid = a.pid
          WHERE a.application_name LIKE 'settlementd%' AND a.backend_type = 'client backend'",
    )
    .fetch_all(admin)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_right_host_connects_and_every_session_of_the_process_uses_tls() {
    let cluster = TcpCluster::start(true, &[]).await;
    let admin = cluster.admin_pool().await;
    let month = due_month();
    seed_month_alone(&admin, month, 3000, 1).await;
    let ca = cluster.certs.ca.display().to_string();
    let url = cluster.url(
        cluster.addr,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );

    let (code, stdout, stderr) = status(&url);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("\"runs\""), "{stdout}");

    // A replica settles the due month over TLS (small batches: many transactions, a heartbeat),
    // serves its status page, and listens for run requests: every one of its sessions, sampled
    // until the month is settled and after, is encrypted.
    let replica = ServeProcess::start(
        &url,
        &[
            ("SETTLEMENTD__BATCH__SIZE", "50"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "6"),
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "2"),
        ],
    );
    replica.wait_for("/readyz", 200).await;
    replica.wait_for("/status", 200).await;
    let mut most = 0;
    let mut names = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        // The status page's own pool connects for each view.
        let (page, _) = get(replica.addr, "/status").await.unwrap();
        assert_eq!(page, 200);
        let seen = sessions(&admin).await;
        for (name, ssl) in &seen {
            assert!(
                ssl,
                "a session of the replica ({name}) is not encrypted: {seen:?}"
            );
            names.insert(name.clone());
        }
        most = most.max(seen.len());
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM job_runs WHERE business_date = $1")
                .bind(month.date())
                .fetch_optional(&admin)
                .await
                .unwrap();
        if status.as_deref() == Some("SUCCESS") && names.len() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "not settled over TLS: {names:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(most >= 2, "the replica's sessions were never seen: {most}");
    assert_eq!(settled_count(&admin).await, eligible(&admin, month).await);
    drop(replica);

    // Without sslmode (libpq's default, prefer), a server that offers TLS gets TLS.
    let plain_url = cluster.url(cluster.addr, "");
    let replica = ServeProcess::start(&plain_url, &[]);
    replica.wait_for("/readyz", 200).await;
    let seen = sessions(&admin).await;
    assert!(!seen.is_empty());
    assert!(seen.iter().all(|(_, ssl)| *ssl), "{seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_host_name_or_an_unknown_ca_is_refused_in_one_line_with_exit_2() {
    let cluster = TcpCluster::start(true, &[]).await;
    let ca = cluster.certs.ca.display().to_string();
    let other = cluster.certs.other_ca.display().to_string();

    // The certificate names the first address only.
    refused(
        &cluster.url(
            cluster.other_addr,
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        "not valid for this host name",
    );
    // libpq's verify-ca would not check the name; sqlx 0.8.6 with this rustls does (sqlx issue
    // #3793), so it is refused too: stricter, never weaker, and documented (docs/OPERATIONS.md).
    refused(
        &cluster.url(
            cluster.other_addr,
            &format!("sslmode=verify-ca&sslrootcert={ca}"),
        ),
        "not valid for this host name",
    );
    // A CA that did not sign the server's certificate, under verify-full, verify-ca, and require
    // with a root certificate (which libpq reads as verify-ca).
    for mode in ["verify-full", "verify-ca", "require"] {
        refused(
            &cluster.url(cluster.addr, &format!("sslmode={mode}&sslrootcert={other}")),
            "not signed by a trusted CA",
        );
    }
    // verify-full without any root certificate: refused before connecting, as libpq refuses it.
    refused(
        &cluster.url(cluster.addr, "sslmode=verify-full"),
        "needs the CA",
    );

    // serve stops at start with the same line and exit 2: no retry makes a certificate verify.
    let child = settlementd(Some(&cluster.url(
        cluster.addr,
        &format!("sslmode=verify-full&sslrootcert={other}"),
    )))
    .arg("serve")
    .env("SETTLEMENTD__HTTP__LISTEN", "127.0.0.1:0")
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::task::spawn_blocking(move || child.wait_with_output()),
    )
    .await
    .expect("serve kept running with a CA that does not verify")
    .unwrap()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("not signed by a trusted CA"), "{stderr}");

    // A server that takes this user only over TLS: a plaintext attempt is told to use TLS, not
    // to check its password; TLS still connects.
    cluster.hba("hostssl all all 127.0.0.0/8 trust").await;
    let told = refused(
        &cluster.url(cluster.addr, "sslmode=disable"),
        "only over TLS",
    );
    assert!(!told.contains("password"), "{told}");
    let (code, _, stderr) = status(&cluster.url(
        cluster.addr,
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ));
    assert_eq!(code, 0, "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_against_a_server_without_tls_is_refused_in_one_line_with_exit_2() {
    let cluster = TcpCluster::start(false, &[]).await;
    refused(
        &cluster.url(cluster.addr, "sslmode=require"),
        "does not offer TLS",
    );
    let ca = cluster.certs.ca.display().to_string();
    refused(
        &cluster.url(
            cluster.addr,
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        "does not offer TLS",
    );
    // prefer (the default) falls back to plaintext, as libpq does.
    let (code, _, stderr) = status(&cluster.url(cluster.addr, "sslmode=prefer"));
    assert_eq!(code, 0, "{stderr}");
}
