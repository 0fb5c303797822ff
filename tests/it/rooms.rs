//! A job is one room: the docs name no job the registry does not have (and list every job only
//! through `settlementd jobs`, so adding one edits none of them), the jobs' modules use no other
//! job's, and a job that does not settle shows none of the settlement's words anywhere.

use crate::helpers::*;
use settlementd::config::Settings;
use settlementd::job_layer::registry::section_of;
use std::path::Path;

fn every_job() -> Vec<&'static str> {
    settlementd::jobs::build(&Settings::load_from(None, []).unwrap()).names()
}

/// The files that name jobs: every document, the default configuration and the deploy files.
fn naming_files() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md"), root.join("config/default.toml")];
    let mut dirs = vec![root.join("docs"), root.join("deploy")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e != "png") {
                files.push(path);
            }
        }
    }
    files
}

/// The jobs `text` names where only a job's name goes: `--job X`, `[jobs.X]`, `jobs.X.`,
/// `job_name="X"`, `SETTLEMENTD__JOBS__X__`, `"job": "X"`.
fn named_jobs(text: &str) -> Vec<String> {
    let name = |rest: &str| -> String {
        rest.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    for prefix in [
        "--job ",
        "[jobs.",
        "jobs.",
        "job_name=\"",
        "\"job\": \"",
        "\"job\":\"",
    ] {
        for (at, _) in text.match_indices(prefix) {
            let n = name(&text[at + prefix.len()..]);
            if !n.is_empty() && n.chars().next().unwrap().is_ascii_lowercase() {
                found.push(n);
            }
        }
    }
    for (at, _) in text.match_indices("SETTLEMENTD__JOBS__") {
        let rest = &text[at + "SETTLEMENTD__JOBS__".len()..];
        if let Some((section, _)) = rest.split_once("__") {
            found.push(section.to_lowercase());
        }
    }
    found
}

#[test]
fn every_job_the_docs_config_and_deploy_files_name_is_a_job_of_the_registry() {
    let jobs = every_job();
    let known = |n: &str| {
        jobs.iter().any(|j| *j == n || section_of(j) == n)
            // Placeholders, and what `jobs.` begins that is not a section.
            || ["name", "NAME", "section", "job", "X", "enabled", "cron", "rs"].contains(&n)
    };
    let mut stale = Vec::new();
    let mut named = 0;
    for file in naming_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        // The guide's examples are jobs a reader adds.
        let examples: &[&str] = if file.ends_with("ADDING-A-JOB.md") {
            &["monthly-totals", "monthly_totals"]
        } else {
            &[]
        };
        for n in named_jobs(&text) {
            named += 1;
            if !known(&n) && !examples.contains(&n.as_str()) && !n.starts_with("<") {
                stale.push(format!("{}: {n}", file.display()));
            }
        }
    }
    assert!(
        named > 50,
        "only {named} names of jobs found: the check reads nothing"
    );
    stale.sort();
    stale.dedup();
    assert!(
        stale.is_empty(),
        "jobs named that this binary does not have:\n{}",
        stale.join("\n")
    );
}

#[test]
fn a_job_named_in_a_doc_is_found_wherever_only_a_job_name_goes() {
    let text = "run --job overdue-notices; [jobs.overdue_notices]; jobs.x_y.cron; \
                job_name=\"a-b\"; SETTLEMENTD__JOBS__C_D__CRON; {\"job\": \"e-f\"}";
    assert_eq!(
        named_jobs(text),
        [
            "overdue-notices",
            "overdue_notices",
            "overdue_notices",
            "x_y",
            "a-b",
            "e-f",
            "c_d"
        ]
    );
}

/// `crate::jobs::<module>` uses in the files of `src/jobs/<job>/` or `src/jobs/<job>.rs`.
fn uses_of_other_jobs() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/jobs");
    let rooms: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap() != "mod.rs")
        .map(|p| p.file_stem().unwrap().to_string_lossy().to_string())
        .collect();
    let mut found = Vec::new();
    for room in &rooms {
        let mut files = vec![dir.join(format!("{room}.rs"))];
        if let Ok(entries) = std::fs::read_dir(dir.join(room)) {
            files.extend(entries.flatten().map(|e| e.path()));
        }
        for file in files.iter().filter(|f| f.is_file()) {
            let text = std::fs::read_to_string(file).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for other in rooms.iter().filter(|o| *o != room) {
                    if line.contains(&format!("jobs::{other}")) {
                        found.push(format!("{}: {}", file.display(), line.trim()));
                    }
                }
                if line.contains("crate::jobs::JOBS") || line.contains("super::super::") {
                    found.push(format!("{}: {}", file.display(), line.trim()));
                }
            }
        }
    }
    assert!(rooms.len() >= 2, "{rooms:?}");
    found
}

#[test]
fn a_jobs_module_uses_no_other_jobs_module_nor_the_list() {
    let found = uses_of_other_jobs();
    assert!(
        found.is_empty(),
        "arrows between rooms:\n{}",
        found.join("\n")
    );
}

/// What the settlement says that a job that does not settle must not: its verbs, its rule, its
/// late returns and loans, its held rows and their reason, its metric families and outcome.
const SETTLEMENT_WORDS: &[&str] = &[
    "settles",
    "unsettled",
    "month settled",
    "rule",
    "late_return",
    "late return",
    "loan id",
    "after loan",
    "held_rows",
    "bad dates",
    "rows updated",
    "row updated",
    "outcome=\"settled\"",
    "odd_rows",
];

/// The settlement's words in `text`, once the settlement's own name (which a follower names as
/// the job it follows) and the binary's name are taken out. "Loans" alone is libraryd's table, which
/// any job may read and name; the settlement's are its verbs, its rule, its late returns and held
/// rows, its loan ids as a cursor, its counts and its metric families.
fn settlement_words(text: &str) -> Vec<String> {
    let lower = text
        .to_lowercase()
        .replace("fine-settlement", "")
        .replace("fine_settlement", "")
        .replace("settlementd", "");
    let mut found = Vec::new();
    for word in SETTLEMENT_WORDS {
        for (at, _) in lower.match_indices(word) {
            let before: String = lower[..at].chars().rev().take(80).collect();
            let after: String = lower[at..].chars().take(word.len() + 80).collect();
            let context = format!("{}{after}", before.chars().rev().collect::<String>());
            found.push(format!("{word:?} in …{}…", context.replace('\n', " ")));
        }
    }
    found
}

#[test]
fn the_settlement_words_check_finds_them() {
    assert_eq!(
        settlement_words("a\n2027-01-01  settles 2026-12-31\nafter fine-settlement\n").len(),
        1
    );
    assert!(settlement_words("{\"late_returns\":0}").len() == 1);
    assert!(settlement_words("settlementd: member-statements after fine-settlement").is_empty());
    // A member id shown as a loan cursor is the settlement's; loans as such are anybody's.
    assert_eq!(
        settlement_words("read 31 · resumes after loan id 400").len(),
        2
    );
    assert!(settlement_words("3 loans out").is_empty());
}

/// Every job of the registry but the settlement, whatever the list holds: a job added to it is
/// checked here without a line of this test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_does_not_settle_shows_none_of_the_settlements_words_on_any_surface() {
    let db = test_db().await;
    seed_month(&db.pool, bd("2026-10-31"), 400, 1).await;
    let registry = settlementd::jobs::build(&settings(&[]));
    let others: Vec<_> = registry
        .iter()
        .filter(|j| j.name() != "fine-settlement")
        .collect();
    assert!(!others.is_empty(), "{:?}", registry.names());
    // The settlement's month; each other job then runs it itself, in the list's order (a job
    // follows one listed before it).
    run_ok(settlementd(Some(&db.url)).args(["run", "--business-date", "2026-10-31"]));
    let out = |args: &[&str]| {
        let o = cli(&db.url, &[("SETTLEMENTD__LOG__FORMAT", "text")], args);
        format!(
            "$ {}\n{}{}",
            args.join(" "),
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    let mut seen: Vec<Vec<String>> = Vec::new();
    for job in others.iter().map(|j| j.name()) {
        let mut mine = vec![out(&["jobs", "--json"])
            .lines()
            .filter(|l| l.contains(job))
            .collect::<Vec<_>>()
            .join("\n")];
        let month = ["--job", job, "--business-date", "2026-10-31"];
        for args in [
            &["schedule", "--job", job][..],
            &["run", "--dry-run", "--json"][..],
            &["run", "--dry-run"],
            &["run"],
            &["run", "--json"],
            &["run", "--force", "--json"],
            &["run", "--force"],
            &["status"],
            &["status", "--json"],
            &["verify"],
            &["verify", "--json"],
        ] {
            let mut args = args.to_vec();
            if args[0] != "schedule" {
                args.extend(month);
            }
            mine.push(out(&args));
        }
        mine.push(out(&["run", "--job", job, "--business-date", "2026-08-31"]));
        seen.push(mine);
    }
    let log = tempfile::NamedTempFile::new().unwrap();
    let replica =
        ServeProcess::start_logged(&db.url, &[("SETTLEMENTD__LOG__FORMAT", "text")], log.path());
    replica.wait_for("/readyz", 200).await;
    let metrics = replica.wait_for("/metrics", 200).await;
    for (mine, job) in seen.iter_mut().zip(others.iter().map(|j| j.name())) {
        for path in [
            format!("/status?job={job}"),
            format!("/status?job={job}&business_date=2026-10-31"),
        ] {
            mine.push(format!(
                "GET {path}\n{}",
                replica.wait_for(&path, 200).await
            ));
        }
        mine.push(
            metrics
                .lines()
                .filter(|l| l.contains(&format!("job_name=\"{job}\"")))
                .collect::<Vec<_>>()
                .join("\n"),
        );
    }
    drop(replica);
    let logged = std::fs::read_to_string(log.path()).unwrap();
    for (mine, job) in seen.iter().zip(&others) {
        let name = job.name();
        let all = format!(
            "{}\n{}",
            mine.join("\n"),
            logged
                .lines()
                .filter(|l| l.contains(name))
                .collect::<Vec<_>>()
                .join("\n")
        );
        // The surfaces were read: the job's own words are there.
        let words = job.words();
        for own in [
            format!("{} 2026-", words.run_does),
            format!("\"{}\"", words.waiting_key),
        ] {
            assert!(all.contains(&own), "{name}: no {own:?} in:\n{all}");
        }
        let written = [words.written.one, words.written.many];
        assert!(
            written
                .iter()
                .any(|w| all.contains(&format!(" {w} by attempt"))),
            "{name}: no {written:?} in:\n{all}"
        );
        let leaks = settlement_words(&all);
        assert!(
            leaks.is_empty(),
            "the settlement's words shown for {name}:\n{}",
            leaks.join("\n")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_whose_date_is_not_a_month_end_is_refused_by_the_job_layer_before_any_claim() {
    let db = test_db().await;
    let settings = settings(&[]);
    let registry = settlementd::jobs::build(&settings);
    for job in registry.iter() {
        let key = settlementd::job_layer::JobKey {
            job_name: job.name().into(),
            business_date: chrono::NaiveDate::from_ymd_opt(2026, 10, 15).unwrap(),
            shards: 1,
            shard: 0,
        };
        let shutdown = tokio_util::sync::CancellationToken::new();
        let opts = run_options(false, false);
        let refused = job.run(&db.pool, key, &opts, &shutdown, &|_| {}).await;
        match refused {
            Err(settlementd::job_layer::JobError::NotAPeriod { why, .. }) => {
                assert!(why.contains("2026-10-31"), "{}: {why}", job.name())
            }
            other => panic!("{}: {other:?}", job.name()),
        }
    }
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM job_runs")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(claims, 0);
}
