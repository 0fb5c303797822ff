//! docs/ADDING-A-JOB.md's worked example, compiled and run: the guide's code blocks are the files
//! of `tests/it/guide/`, which this module compiles (as a new job's module compiles in `src/jobs/`)
//! and runs against a real PostgreSQL.

use crate::helpers::*;
use settlementd::config::Settings;
use settlementd::job_layer::registry::{Registered, Registration, Schedule};
use settlementd::job_layer::{JobError, JobKey};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

#[path = "guide/monthly_totals.rs"]
mod monthly_totals;

/// The fenced block that follows the line `**`title`**` in `doc`, as the file it shows.
fn block_after(doc: &str, title: &str) -> String {
    let heading = format!("**`{title}`**");
    let at = doc
        .find(&heading)
        .unwrap_or_else(|| panic!("the guide shows no {title}"));
    let fence = doc[at..].find("```").unwrap() + at;
    let body = doc[fence..].find('\n').unwrap() + fence + 1;
    let end = doc[body..].find("\n```").unwrap() + body;
    format!("{}\n", &doc[body..end])
}

fn guide() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ADDING-A-JOB.md")).unwrap()
}

#[test]
fn the_guides_code_blocks_are_the_files_this_test_compiles() {
    let doc = guide();
    assert_eq!(
        block_after(&doc, "src/jobs/monthly_totals.rs"),
        include_str!("guide/monthly_totals.rs"),
        "docs/ADDING-A-JOB.md's module is not tests/it/guide/monthly_totals.rs"
    );
    assert_eq!(
        block_after(&doc, "migrations/20270101000001_monthly_totals.sql"),
        include_str!("guide/monthly_totals.sql"),
        "docs/ADDING-A-JOB.md's migration is not tests/it/guide/monthly_totals.sql"
    );
    // The one line in an existing file.
    assert!(
        doc.contains("jobs! {\n    fine_settlement::FineSettlement,\n    member_statements::MemberStatements,\n    monthly_totals::MonthlyTotals,\n}"),
        "the guide's line in JOBS"
    );
}

fn registration() -> Registration<Settings> {
    Registration::of::<monthly_totals::MonthlyTotals>()
}

fn build(settings: &Settings, own: serde_json::Value) -> Result<Arc<dyn Registered>, String> {
    let schedule = Schedule {
        enabled: true,
        cron: settlementd::config::parse_cron(registration().default_cron).unwrap(),
    };
    registration().build(settings, own, schedule)
}

#[test]
fn the_guides_job_takes_its_own_setting_from_its_section_and_refuses_a_bad_one() {
    let reg = registration();
    assert_eq!(
        (reg.name, reg.section(), reg.default_cron),
        ("monthly-totals", "monthly_totals".into(), "0 0 5 1 * *")
    );
    // From the environment, as from a file: its section's own keys reach the job.
    let s = Settings::load_from(
        None,
        [(
            "SETTLEMENTD__JOBS__MONTHLY_TOTALS__MIN_FINE_CENTS".to_string(),
            "250".to_string(),
        )],
    )
    .unwrap();
    let own = serde_json::Value::from(s.jobs["monthly_totals"].own.clone());
    assert_eq!(own, serde_json::json!({ "min_fine_cents": 250 }));
    assert!(build(&s, own).is_ok());
    for (own, says) in [
        (
            serde_json::json!({ "min_fine_cent": 1 }),
            "unknown key `min_fine_cent`",
        ),
        (serde_json::json!({ "min_fine_cents": -1 }), "invalid"),
        (
            serde_json::json!({ "min_fine_cents": "many" }),
            "invalid type: string",
        ),
        (
            serde_json::json!({ "min_fine_cents": 200000 }),
            "at most 100000",
        ),
    ] {
        let e = build(&s, own.clone())
            .err()
            .unwrap_or_else(|| panic!("{own} accepted"));
        assert!(e.contains(says), "{own}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guides_job_runs_after_the_settlement_and_totals_the_fines_at_or_above_its_setting() {
    let db = test_db().await;
    sqlx::raw_sql(include_str!("guide/monthly_totals.sql"))
        .execute(&db.pool)
        .await
        .unwrap();
    let month = bd("2026-10-31");
    seed_month(&db.pool, month, 500, 1).await;
    let job = build(&settings(&[]), serde_json::json!({ "min_fine_cents": 100 })).unwrap();
    let key = JobKey {
        job_name: "monthly-totals".into(),
        business_date: month.date(),
        shards: 1,
        shard: 0,
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let opts = run_options(false, false);
    let run = || job.run(&db.pool, key.clone(), &opts, &shutdown, &|_| {});
    assert!(
        matches!(run().await, Err(JobError::NotReady { .. })),
        "not ready before the settlement"
    );
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-10-31"]));
    let report = run().await.unwrap();
    assert_eq!(report.updated, 1);
    let totals: (i64, i64) = sqlx::query_as(
        "SELECT loans, fine_cents::bigint FROM monthly_fine_totals WHERE business_date = $1",
    )
    .bind(month.date())
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let expected: (i64, i64) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum(fine_cents), 0)::bigint FROM loans
          WHERE returned_on BETWEEN '2026-10-01' AND '2026-10-31'
            AND fine_settled_at IS NOT NULL AND fine_cents >= 100",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(expected.0 > 0, "the month has fines of 1.00 and more");
    assert_eq!(totals, expected);

    // Its proof: right as run, and not right — naming the shard — once a total is edited.
    let proof = job.prove(&db.pool, month).await.unwrap().unwrap();
    assert!(proof.right, "{}", proof.text);
    assert_eq!(proof.json["differ"]["count"], 0);
    sqlx::query("UPDATE monthly_fine_totals SET loans = loans + 1")
        .execute(&db.pool)
        .await
        .unwrap();
    let proof = job.prove(&db.pool, month).await.unwrap().unwrap();
    assert_eq!(
        proof.problems.as_deref(),
        Some("1 shard whose totals differ from the loans, ids [0]"),
        "{}",
        proof.text
    );
    let never_run = job
        .prove(&db.pool, bd("2026-09-30"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(never_run.json["never_run"]["count"], 1);
}

/// The repository's tracked files, as they are in the working tree, copied under `to`.
fn copy_tracked(root: &Path, to: &Path) {
    let listed = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["ls-files", "-z"])
        .output()
        .expect("git ls-files");
    assert!(listed.status.success(), "git ls-files: {listed:?}");
    let mut copied = 0;
    for file in String::from_utf8(listed.stdout).unwrap().split('\0') {
        let from = root.join(file);
        if file.is_empty() || !from.is_file() {
            continue;
        }
        let dest = to.join(file);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        std::fs::copy(&from, &dest).unwrap();
        copied += 1;
    }
    assert!(copied > 100, "only {copied} files tracked");
}

/// `cargo <args>` in the copy `dir`, into its own target directory (never this build's, whose
/// binary the running suite uses); panics with its output unless it succeeds.
fn cargo_in(dir: &Path, target: &Path, args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(args)
        .current_dir(dir)
        .env("CARGO_TARGET_DIR", target)
        .output()
        .expect("run cargo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "cargo {}:\n{text}", args.join(" "));
    text
}

/// docs/ADDING-A-JOB.md followed to the letter on a copy of this repository: its module, its
/// migration and its test written where it says, its one line put in `jobs!`, nothing else. The
/// copy is formatted as `cargo fmt` leaves it, the guide's own test passes against the binary that
/// now lists the job, and so do the suite's tests that take every job from the list (`rooms`:
/// the docs, the rooms' arrows and none of the settlement's words on any surface of a job that
/// does not settle; `jobs`: every command, page and endpoint of every job).
#[test]
#[ignore = "builds a copy of the crate with the guide's job added (minutes): run with --ignored"]
fn following_the_guide_to_the_letter_adds_a_job_every_surface_and_test_takes_in() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let work = root.join("target/guide-followed");
    let copy = work.join("crate");
    if copy.exists() {
        std::fs::remove_dir_all(&copy).unwrap();
    }
    copy_tracked(root, &copy);
    let doc = guide();
    for file in [
        "src/jobs/monthly_totals.rs",
        "migrations/20270101000001_monthly_totals.sql",
        "tests/monthly_totals.rs",
    ] {
        assert!(!copy.join(file).exists(), "{file} is already there");
        std::fs::write(copy.join(file), block_after(&doc, file)).unwrap();
    }
    // The one line in an existing file: the guide's `jobs!`, in place of the list's.
    let list = copy.join("src/jobs/mod.rs");
    let before = std::fs::read_to_string(&list).unwrap();
    let at = before.find("\njobs! {\n").expect("the list's jobs!") + 1;
    let end = before[at..].find("\n}\n").unwrap() + at + 3;
    let after = format!(
        "{}{}{}",
        &before[..at],
        block_after(&doc, "src/jobs/mod.rs"),
        &before[end..]
    );
    let (old, new): (Vec<&str>, Vec<&str>) = (before.lines().collect(), after.lines().collect());
    let added: Vec<&&str> = new.iter().filter(|l| !old.contains(l)).collect();
    assert!(
        new.len() == old.len() + 1 && added.len() == 1 && old.iter().all(|l| new.contains(l)),
        "the guide's jobs! is not the list plus one line: {added:?}"
    );
    std::fs::write(&list, after).unwrap();

    let target = work.join("target");
    cargo_in(&copy, &target, &["fmt", "--all", "--", "--check"]);
    cargo_in(&copy, &target, &["test", "--test", "monthly_totals"]);
    let suite = cargo_in(
        &copy,
        &target,
        &["test", "--test", "it", "--", "rooms::", "jobs::"],
    );
    assert!(suite.contains(" passed; 0 failed"), "{suite}");
}
