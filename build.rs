// sqlx embeds migrations at compile time; a new migration file must trigger a rebuild. The commit
// the binary is built from goes into `settlementd --version` and settlementd_build_info: from
// SETTLEMENTD_COMMIT when set (the container build has no .git), else from git, else "unknown".
//
// Which of git's files say what HEAD is depends on the repository: `HEAD` itself (a checkout, a
// detached commit), the branch's loose ref (rewritten by every commit), `packed-refs` while the
// branch is only packed (a `git gc`), or the reftable directory. Cargo reruns a build script at
// every build while a path it watches does not exist, and the rerun recompiles the crate (3 to 4
// minutes on 2 cores): a repository made by `git init`, or a worktree of one, has no
// `packed-refs`, and watching it made every `cargo build` and `cargo test` rebuild everything. So
// only paths that exist are watched, and a loose ref that a commit will create is watched through
// the nearest directory that exists.
use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

/// Where git keeps `name` (relative to this directory, or absolute in a worktree), if it exists.
fn git_file(name: &str) -> Option<PathBuf> {
    git(&["rev-parse", "--git-path", name])
        .map(PathBuf::from)
        .filter(|path| path.exists())
}

fn watch(path: &Path) {
    println!("cargo:rerun-if-changed={}", path.display());
}

/// Watches what a new commit, a checkout or a reset changes, and nothing that does not exist.
fn watch_head() {
    let Some(head) = git_file("HEAD") else {
        return; // not a git checkout (the container build): SETTLEMENTD_COMMIT or "unknown"
    };
    watch(&head);
    if let Some(reftable) = git_file("reftable") {
        watch(&reftable); // every ref update of a reftable repository lands there
        return;
    }
    let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) else {
        return; // detached: HEAD holds the commit
    };
    let Some(loose) = git(&["rev-parse", "--git-path", &branch]).map(PathBuf::from) else {
        return;
    };
    if loose.exists() {
        watch(&loose);
        return;
    }
    // The branch is packed (or has no commit yet): a commit writes its loose ref, which appears in
    // a directory that exists now (refs/heads, or the ref's own folder).
    if let Some(packed) = git_file("packed-refs") {
        watch(&packed);
    }
    if let Some(dir) = loose.ancestors().skip(1).find(|dir| dir.is_dir()) {
        watch(dir);
    }
}

fn main() {
    println!("cargo:rerun-if-changed=migrations");
    println!("cargo:rerun-if-env-changed=SETTLEMENTD_COMMIT");
    watch_head();
    let commit = std::env::var("SETTLEMENTD_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short=7", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=SETTLEMENTD_COMMIT={commit}");
}
