//! `build.rs`: the commit in `settlementd --version`, and a build that does nothing when nothing
//! changed. A build script that watches a file which does not exist is rerun by every build, and
//! its rerun recompiles the crate (3 to 4 minutes on 2 cores): `packed-refs` of a repository made
//! by `git init` (or a worktree of one) did that to every `cargo build` and `cargo test`.
//!
//! Checked on a crate of its own, this repository's `build.rs` and a `main` that prints the
//! commit, in every shape of repository a checkout can have: refs loose (`git init`), the branch
//! only packed (after `git gc`), HEAD detached, a worktree, a reftable repository. In each, a
//! second build compiles nothing, and a new commit is in the next build.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A crate made of this repository's build.rs, in a git repository at `dir`.
struct Probe {
    dir: PathBuf,
    target: PathBuf,
}

fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .args([
            "-c",
            "user.name=settlementd tests",
            "-c",
            "user.email=tests@settlementd.invalid",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "advice.detachedHead=false",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run git");
    assert!(
        out.status.success(),
        "git {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

impl Probe {
    /// A new repository at `dir` (`git init` with `init` as extra arguments) holding the crate,
    /// committed once; built into `target`.
    fn new(dir: &Path, target: &Path, init: &[&str]) -> Self {
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::create_dir_all(dir.join("migrations")).unwrap();
        std::fs::write(
            dir.join("Cargo.toml"),
            "[package]\nname = \"commit-probe\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\
             build = \"build.rs\"\n\n[workspace]\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("src/main.rs"),
            "fn main() {\n    println!(\"{}\", env!(\"SETTLEMENTD_COMMIT\"));\n}\n",
        )
        .unwrap();
        std::fs::write(dir.join("migrations/README"), "a migration folder\n").unwrap();
        std::fs::copy(
            concat!(env!("CARGO_MANIFEST_DIR"), "/build.rs"),
            dir.join("build.rs"),
        )
        .unwrap();
        let mut args = vec!["init", "-q"];
        args.extend_from_slice(init);
        git(dir, &args);
        git(dir, &["add", "-A"]);
        git(dir, &["commit", "-q", "-m", "the crate"]);
        Self::at(dir, target)
    }

    fn at(dir: &Path, target: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            target: target.to_path_buf(),
        }
    }

    /// `cargo build`: whether it compiled anything, and the commit the binary prints.
    fn build(&self) -> (bool, String) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args(["build", "--offline"])
            .current_dir(&self.dir)
            .env("CARGO_TARGET_DIR", &self.target)
            .env_remove("SETTLEMENTD_COMMIT")
            .env_remove("RUSTFLAGS")
            .output()
            .expect("run cargo");
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "cargo build: {stderr}");
        let printed = Command::new(self.target.join("debug/commit-probe"))
            .output()
            .unwrap();
        let commit = String::from_utf8_lossy(&printed.stdout).trim().to_string();
        (stderr.contains("Compiling"), commit)
    }

    fn head(&self) -> String {
        git(&self.dir, &["rev-parse", "--short=7", "HEAD"])
    }

    fn commit(&self, message: &str) {
        git(&self.dir, &["commit", "-q", "--allow-empty", "-m", message]);
    }

    /// A build after a change: it compiles, and prints HEAD; then one with nothing changed
    /// compiles nothing and prints the same. `shape` names the repository in the messages.
    fn builds_head_then_nothing(&self, shape: &str) {
        let (_, commit) = self.build();
        assert_eq!(commit, self.head(), "{shape}: the binary's commit");
        for again in 1..=2 {
            let (compiled, commit) = self.build();
            assert!(
                !compiled,
                "{shape}: build {again} with nothing changed compiled the crate again"
            );
            assert_eq!(commit, self.head(), "{shape}");
        }
        self.commit(&format!("{shape}: a new commit"));
        let (compiled, commit) = self.build();
        assert!(compiled, "{shape}: a new commit must rebuild");
        assert_eq!(
            commit,
            self.head(),
            "{shape}: the new commit is in the binary"
        );
        let (compiled, _) = self.build();
        assert!(
            !compiled,
            "{shape}: nothing changed after the new commit's build"
        );
    }
}

#[test]
fn a_second_build_compiles_nothing_and_a_new_commit_is_in_the_next_in_every_shape_of_repository() {
    let tmp = tempfile::tempdir().unwrap();
    let target = tmp.path().join("target");

    // `git init`: loose refs, no packed-refs (as this repository's own .git).
    let repo = tmp.path().join("repo");
    let probe = Probe::new(&repo, &target, &[]);
    assert!(!repo.join(".git/packed-refs").exists());
    probe.builds_head_then_nothing("loose refs, no packed-refs");

    // `git gc`: the branch only in packed-refs, its loose file gone until the next commit.
    git(&repo, &["pack-refs", "--all"]);
    assert!(!repo.join(".git/refs/heads/main").exists());
    probe.builds_head_then_nothing("the branch only packed");

    // HEAD detached at a commit.
    git(&repo, &["checkout", "-q", "--detach"]);
    probe.builds_head_then_nothing("HEAD detached");
    git(&repo, &["checkout", "-q", "main"]);

    // A worktree of the repository (its HEAD in the common .git, no packed-refs of its own).
    let tree = tmp.path().join("tree");
    git(
        &repo,
        &[
            "worktree",
            "add",
            "-q",
            "-b",
            "other",
            tree.to_str().unwrap(),
        ],
    );
    let in_tree = Probe::at(&tree, &tmp.path().join("tree-target"));
    in_tree.builds_head_then_nothing("a worktree");

    // A reftable repository (git 2.45 and later): no loose refs, no packed-refs.
    let reftable = tmp.path().join("reftable");
    std::fs::create_dir_all(&reftable).unwrap();
    let supported = Command::new("git")
        .args(["init", "-q", "--ref-format=reftable"])
        .current_dir(&reftable)
        .status()
        .is_ok_and(|s| s.success());
    if supported {
        std::fs::remove_dir_all(&reftable).unwrap();
        let probe = Probe::new(
            &reftable,
            &tmp.path().join("reftable-target"),
            &["--ref-format=reftable"],
        );
        probe.builds_head_then_nothing("reftable");
    } else {
        eprintln!("this git has no reftable format: that shape is not checked");
    }
}
