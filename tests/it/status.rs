//! The status page (`GET /status`) as a person sees it: a replica over a database holding a month
//! in each state, its page checked as served over HTTP and, in the ignored suite, as rendered by
//! headless Chromium; and at the HTTP level: escaping, the setting that turns it off, bad queries,
//! kept and live totals, and a slow database.

use crate::helpers::*;
use chrono::{DateTime, Utc};
use settlementd::calendar::BusinessDate;
use settlementd::clock::ManualClock;
use settlementd::config::{Settings, ShardSpec};
use settlementd::daemon;
use settlementd::job_layer::claim::{self, Claim, ClaimOutcome};
use settlementd::job_layer::requests::{self, NewRequest};
use settlementd::job_layer::{events, Cursor, Job, Owner};
use settlementd::jobs::fine_settlement::{self, FineSettlement};
use settlementd::schedule::{self, Slot};
use sqlx::{Connection, PgPool};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A replica (`daemon::serve`: HTTP and the schedule loop) on `pool`, in process, with the default
/// schedule and `catch_up = false` on a clock stopped at `now`: its schedule never fires during a
/// test, so it changes nothing the test did not.
pub(crate) struct Replica {
    pub(crate) addr: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<settlementd::app::Result<()>>,
}

impl Replica {
    pub(crate) async fn start(
        pool: &PgPool,
        overrides: &[(&str, &str)],
        now: DateTime<Utc>,
    ) -> Self {
        // The page of a replica that schedules nothing: the months stay as each test leaves them.
        let mut env = vec![
            ("SETTLEMENTD__SCHEDULE__CATCH_UP", "false"),
            ("SETTLEMENTD__DATABASE__MIGRATE_ON_START", "false"),
            ("SETTLEMENTD__JOBS__FINE_SETTLEMENT__ENABLED", "false"),
        ];
        env.extend_from_slice(overrides);
        let env: Vec<(String, String)> = env
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let settings = Settings::load_from(None, env).expect("valid test settings");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(daemon::serve(
            settings,
            pool.clone(),
            listener,
            Arc::new(ManualClock::new(now)),
            stop.clone(),
        ));
        for _ in 0..200 {
            if matches!(get(addr, "/healthz").await, Ok((200, _))) {
                return Self { addr, stop, task };
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("the replica's HTTP endpoints never came up");
    }

    pub(crate) async fn get(&self, path: &str) -> Answer {
        http(self.addr, "GET", path, &[], "").await.unwrap()
    }

    async fn page(&self, path: &str) -> String {
        let answer = self.get(path).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
        answer.body
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap().unwrap();
    }
}

fn job(batch_size: u32) -> FineSettlement {
    FineSettlement {
        rules: Default::default(),
        batch_size,
        guards: Default::default(),
    }
}

fn key(month: BusinessDate, shards: u32, shard: u32) -> settlementd::job_layer::JobKey {
    fine_settlement::key(month, ShardSpec::new(shard, shards).unwrap())
}

/// Settles one shard of `month` to SUCCESS as `owner`, as a replica would.
pub(crate) async fn settle_as(
    pool: &PgPool,
    month: BusinessDate,
    shards: u32,
    shard: u32,
    owner: &str,
) {
    let options = settlementd::job_layer::RunOptions {
        owner: Owner(owner.into()),
        ..run_options(false, false)
    };
    let report = settlementd::job_layer::run_once(
        pool,
        &job(500),
        key(month, shards, shard),
        &options,
        &CancellationToken::new(),
        &|_| {},
    )
    .await
    .unwrap();
    assert!(report.skipped.is_none(), "{report:?}");
}

/// Claims one shard of `month` as `owner` and commits one batch of `batch` loans, as a replica
/// that is still working on it: the row is RUNNING with a fresh heartbeat.
pub(crate) async fn claim_with_one_batch(
    pool: &PgPool,
    month: BusinessDate,
    shards: u32,
    shard: u32,
    owner: &str,
    batch: u32,
) -> Claim {
    let key = key(month, shards, shard);
    let mut conn = pool.acquire().await.unwrap();
    let outcome = claim::claim(
        &mut conn,
        &key,
        &Owner(owner.into()),
        Duration::from_secs(60),
        false,
    )
    .await
    .unwrap();
    let ClaimOutcome::Won(claim) = outcome else {
        panic!("expected to win {key}: {outcome:?}");
    };
    let job = job(batch);
    let (plan, _) = job.plan(pool, &claim, false).await.unwrap();
    let mut tx = conn.begin_with(job.begin_batch()).await.unwrap();
    let done = job
        .run_batch(&mut tx, &plan, Cursor::default())
        .await
        .unwrap();
    assert_eq!(
        claim::record_batch(&mut tx, &claim, &done).await.unwrap(),
        claim::Recorded::Written
    );
    tx.commit().await.unwrap();
    claim
}

/// Elements that flow within a line: no space between their text and what surrounds it.
const INLINE: &[&str] = &["a", "span", "code", "strong", "b", "em", "small"];

/// The text a person reads in the element with `id`: tags dropped (a line break between blocks),
/// entities decoded, white space folded.
pub(crate) fn text_of(html: &str, id: &str) -> String {
    let at = html
        .find(&format!("id=\"fine-settlement-{id}\""))
        .unwrap_or_else(|| panic!("no element #{id} in the page:\n{html}"));
    let open = html[..at].rfind('<').unwrap();
    let tag: String = html[open + 1..]
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    let content_start = open + html[open..].find('>').unwrap() + 1;
    // The element ends at its closing tag, counting nested elements of the same name.
    let (mut depth, mut pos) = (0usize, open);
    let end = loop {
        let lt = pos + html[pos..].find('<').expect("the element is closed");
        let gt = lt + html[lt..].find('>').unwrap();
        let inner = &html[lt + 1..gt];
        let (closing, name) = match inner.strip_prefix('/') {
            Some(name) => (true, name),
            None => (false, inner),
        };
        let name: String = name
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        if name == tag {
            if closing {
                depth -= 1;
                if depth == 0 {
                    break lt;
                }
            } else {
                depth += 1;
            }
        }
        pos = gt + 1;
    };
    let mut text = String::new();
    let mut rest = &html[content_start..end];
    while let Some(lt) = rest.find('<') {
        text.push_str(&rest[..lt]);
        let gt = lt + rest[lt..].find('>').unwrap();
        let name: String = rest[lt + 1..gt]
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        if !INLINE.contains(&name.as_str()) {
            text.push('\n');
        }
        rest = &rest[gt + 1..];
    }
    text.push_str(rest);
    let text = text
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&nbsp;", " ")
        .replace("&amp;", "&");
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Headless Chromium as `.ci/run` installs it (Debian's `chromium`); `SETTLEMENTD_CHROMIUM` names
/// another binary. Missing, the test fails: it must not pass without looking at the page.
pub(crate) fn chromium_binary() -> PathBuf {
    let found = match std::env::var_os("SETTLEMENTD_CHROMIUM") {
        Some(path) => Some(PathBuf::from(path)).filter(|p| p.is_file()),
        None => std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .flat_map(|dir| ["chromium", "chromium-browser"].map(|name| dir.join(name)))
            .find(|p| p.is_file()),
    };
    found.unwrap_or_else(|| {
        panic!(
            "this test opens the status page in headless Chromium, which was not found: \
             `apt-get install chromium` (Debian; .ci/run installs it), or set \
             SETTLEMENTD_CHROMIUM to a Chromium binary"
        )
    })
}

/// How every test starts headless Chromium: no sandbox (the tests run as root), nothing fetched
/// from elsewhere, no scrollbars in screenshots.
pub(crate) const CHROMIUM_FLAGS: [&str; 10] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
];

/// Runs headless Chromium with `args` in a fresh profile; returns its stdout. (JavaScript stays
/// on: `--dump-dom` needs it. The page has no script for it to run, which the test checks.)
pub(crate) async fn chromium(args: &[String]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let mut command = tokio::process::Command::new(chromium_binary());
    command
        .args(CHROMIUM_FLAGS)
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), command.output())
        .await
        .expect("chromium finished within 90 s")
        .expect("chromium starts");
    assert!(
        out.status.success(),
        "chromium failed ({:?}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn totals_of(pool: &PgPool, month: BusinessDate) -> fine_settlement::MonthTotals {
    fine_settlement::month_totals(pool, month).await.unwrap()
}

/// "15,722.50" for 1572250 cents; "5,379" for 5379.
fn grouped(n: i64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn money(cents: i128) -> String {
    format!("{}.{:02}", grouped((cents / 100) as i64), cents % 100)
}

const SEP: &str = "2026-09-30";
const OCT: &str = "2026-10-31";
const FAILURE: &str = "database error: canceling statement due to statement timeout";

pub(crate) fn owner(shard: u32) -> String {
    format!("settlementd-{shard}/7-{:08x}", 0x3f2a_9c10 + shard)
}

/// A database holding the latest fire's month and the three before it, one in each state a person
/// must tell apart, and what the page must show of them.
struct FourMonths {
    now: DateTime<Utc>,
    latest: Slot,
    next: Slot,
    /// Every shard SUCCESS.
    closed: BusinessDate,
    /// Shard 2 never claimed.
    missing: BusinessDate,
    /// Shard 1 FAILED after one batch, and a manual request for it that no replica served yet.
    failed: BusinessDate,
    /// The month the latest fire settles: shard 1 RUNNING, one batch in.
    running: BusinessDate,
    /// The RUNNING claim of `running`'s shard 1.
    claim: Claim,
    rerun_key: String,
    /// What the running shard has to read in all: its month's returned loans with id % 3 = 1.
    shard_total: i64,
}

impl FourMonths {
    async fn seed(pool: &PgPool) -> Self {
        // The month the latest fire settles and the three before it, whenever the test runs.
        let now = Utc::now();
        let settings = Settings::load_from(None, []).unwrap();
        let cron = &settlement_cron(&settings);
        let tz = settings.schedule.timezone;
        let latest = Slot::new(schedule::latest_slot_at_or_before(cron, tz, now).unwrap());
        let next = Slot::new(schedule::next_slot_after(cron, tz, now).unwrap());
        let running = latest.business_date;
        let failed = BusinessDate::month_before(running.first_day());
        let missing = BusinessDate::month_before(failed.first_day());
        let closed = BusinessDate::month_before(missing.first_day());
        for (i, month) in [closed, missing, failed, running].into_iter().enumerate() {
            seed_month(pool, month, 1200, 1 + 10_000 * i as i64).await;
        }
        for shard in 0..3 {
            settle_as(pool, closed, 3, shard, &owner(shard)).await;
        }
        for shard in [0, 1] {
            settle_as(pool, missing, 3, shard, &owner(shard)).await;
        }
        for shard in [0, 2] {
            settle_as(pool, failed, 3, shard, &owner(shard)).await;
            settle_as(pool, running, 3, shard, &owner(shard)).await;
        }
        let claim = claim_with_one_batch(pool, failed, 3, 1, &owner(1), 100).await;
        assert!(
            claim::mark_failed(&mut pool.acquire().await.unwrap(), &claim, FAILURE)
                .await
                .unwrap()
        );
        let rerun_key = format!("rerun-{failed}-shard-1");
        let request = NewRequest {
            to: None,
            idempotency_key: rerun_key.clone(),
            job_name: fine_settlement::JOB_NAME.into(),
            business_date: failed.date(),
            shards: 3,
            shard: Some(1),
            force: false,
        };
        let mut conn = pool.acquire().await.unwrap();
        requests::store(&mut conn, &request, &owner(0), |_| "{}".into())
            .await
            .unwrap();
        drop(conn);
        let claim = claim_with_one_batch(pool, running, 3, 1, &owner(1), 150).await;
        let shard_total: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM loans WHERE returned_on BETWEEN $1 AND $2 AND id % 3 = 1",
        )
        .bind(running.first_day())
        .bind(running.date())
        .fetch_one(pool)
        .await
        .unwrap();
        Self {
            now,
            latest,
            next,
            closed,
            missing,
            failed,
            running,
            claim,
            rerun_key,
            shard_total,
        }
    }

    /// A replica of shard 0 of 3 over `pool`, its clock at the moment the months were seeded.
    async fn replica(&self, pool: &PgPool) -> Replica {
        Replica::start(
            pool,
            &[
                ("SETTLEMENTD__SHARD__COUNT", "3"),
                ("SETTLEMENTD__SHARD__INDEX", "0"),
            ],
            self.now,
        )
        .await
    }

    /// What a person reads on the overview (`/status`), given its document: each month's verdict,
    /// every cell, the totals, the schedule and the history; no script, nothing from elsewhere.
    async fn check_overview(&self, pool: &PgPool, dom: &str) {
        let Self {
            closed,
            missing,
            failed,
            running,
            ..
        } = *self;
        // Each month, newest first, with its verdict.
        let rows: Vec<usize> = [running, failed, missing, closed]
            .iter()
            .map(|m| {
                dom.find(&format!("id=\"fine-settlement-month-{m}\""))
                    .unwrap_or_else(|| panic!("no row for {m} in the page:\n{dom}"))
            })
            .collect();
        assert!(rows.windows(2).all(|w| w[0] < w[1]), "newest month first");
        assert_eq!(text_of(dom, &format!("verdict-{closed}")), "closed");
        // Only shard 0 has a replica here: a shard that waits with none is said to wait for one,
        // as its cell says; a RUNNING claim within its lease is its holder's.
        let nobody = |shard: u32, month: BusinessDate| {
            format!(
                "no live replica runs shard {shard}: start one, or `settlementd run --business-date \
                 {month} --shard N --shards 3 --wait` runs it by hand"
            )
        };
        let next = "a replica of each shard runs what waits within a heartbeat";
        assert_eq!(
            text_of(dom, &format!("verdict-{missing}")),
            format!("not closed: shard 2 missing {}", nobody(2, missing))
        );
        assert_eq!(
            text_of(dom, &format!("verdict-{failed}")),
            format!("not closed: shard 1 FAILED {}", nobody(1, failed))
        );
        assert_eq!(
            text_of(dom, &format!("verdict-{running}")),
            format!("not closed: shard 1 RUNNING {next}")
        );

        // The cells: status in words, attempt, owner, heartbeat age, progress, error.
        for shard in 0..3 {
            let cell = text_of(dom, &format!("cell-{closed}-{shard}"));
            assert!(
                cell.starts_with(&format!("SUCCESS attempt 1 owner {}", owner(shard))),
                "{cell}"
            );
            assert!(cell.contains("rows updated by attempt 1"), "{cell}");
            // A closed shard says when it finished and how long it took, not a heartbeat.
            assert!(cell.contains("finished 20"), "{cell}");
            assert!(cell.contains(" +08:00 · took "), "one time zone: {cell}");
            assert!(!cell.contains("heartbeat"), "{cell}");
        }
        let cell = text_of(dom, &format!("cell-{missing}-2"));
        assert!(cell.starts_with("missing no claim"), "{cell}");
        let cell = text_of(dom, &format!("cell-{failed}-1"));
        assert!(
            cell.starts_with(&format!("FAILED attempt 1 owner {}", owner(1))),
            "{cell}"
        );
        assert!(cell.contains("100 rows updated"), "{cell}");
        assert!(cell.ends_with(FAILURE), "{cell}");
        let cell = text_of(dom, &format!("cell-{running}-1"));
        assert!(
            cell.starts_with(&format!(
                "RUNNING attempt {} owner {} heartbeat",
                self.claim.attempt,
                owner(1)
            )),
            "{cell}"
        );
        let age: u64 = cell
            .split("heartbeat ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("a heartbeat age in seconds: {cell}"));
        assert!(age < 60, "{cell}");
        assert!(!cell.contains("lease expired"), "{cell}");
        assert!(
            cell.contains(&format!(
                "150 rows updated by attempt 1 read 150 of {} ({} %)",
                grouped(self.shard_total),
                150 * 100 / self.shard_total
            )),
            "{cell}"
        );
        assert!(dom.contains("<progress"), "a bar for the running shard");

        // Totals: a closed month's settled totals, an open month's so far.
        let closed_totals = totals_of(pool, closed).await;
        assert_eq!(
            text_of(dom, &format!("totals-{closed}")),
            format!(
                "settled {} rows fines {} ({} cents) digest {}…",
                grouped(closed_totals.settled_rows),
                money(closed_totals.fine_cents_sum),
                grouped(closed_totals.fine_cents_sum as i64),
                &closed_totals.digest[..12]
            )
        );
        let so_far = totals_of(pool, running).await;
        let shown = text_of(dom, &format!("totals-{running}"));
        assert!(
            shown.starts_with(&format!(
                "settled so far {} rows fines {}",
                grouped(so_far.settled_rows),
                money(so_far.fine_cents_sum)
            )),
            "{shown}"
        );

        // The schedule in the configured zone (the default: 02:30 on the 1st, Asia/Shanghai),
        // and the month the latest fire should have closed.
        let first_of = |slot: &Slot| slot.fire_at.format("%Y-%m-01 02:30:00 +08:00").to_string();
        assert_eq!(
            text_of(dom, "next-fire"),
            format!(
                "{} (Asia/Shanghai), settles {}",
                first_of(&self.next),
                self.next.business_date
            )
        );
        assert_eq!(
            text_of(dom, "latest-fire"),
            format!(
                "{}, settles {running}: not closed: shard 1 RUNNING a replica of each shard runs \
                 what waits within a heartbeat",
                first_of(&self.latest)
            )
        );

        // History: shard 1's trail across months, the manual request and where it stands.
        let history = text_of(dom, "history-1");
        for expected in [
            "claimed",
            "failed",
            FAILURE,
            "requested",
            &self.rerun_key,
            "now pending",
        ] {
            assert!(history.contains(expected), "{expected:?} in {history}");
        }
        assert!(
            history.find("claimed").unwrap() < history.find("requested").unwrap(),
            "newest first: the running month's claim before the request: {history}"
        );

        // A page showing a RUNNING shard refreshes itself; nothing is loaded from elsewhere, and
        // no script runs: the page reads the same without JavaScript.
        assert!(
            dom.contains(r#"<meta http-equiv="refresh" content="10">"#),
            "{dom}"
        );
        for external in [
            "<script", "http://", "https://", "<link", "<img", "@import", "url(",
        ] {
            assert!(!dom.contains(external), "{external:?} in the page");
        }
    }

    /// One month in detail (`/status?business_date=…&shards=3`), given the documents of the
    /// closed and the running month: the closed one does not refresh and shows its whole digest;
    /// the running one refreshes and shows where its run resumes.
    async fn check_details(&self, pool: &PgPool, closed_page: &str, running_page: &str) {
        let (closed, running) = (self.closed, self.running);
        let closed_totals = totals_of(pool, closed).await;
        assert!(!closed_page.contains("http-equiv=\"refresh\""));
        assert!(text_of(closed_page, &format!("totals-{closed}")).contains(&closed_totals.digest));
        assert!(!closed_page.contains(&format!("id=\"fine-settlement-month-{}\"", self.missing)));
        assert!(running_page.contains(r#"<meta http-equiv="refresh" content="10">"#));
        assert!(text_of(running_page, &format!("cell-{running}-1"))
            .contains("read 150 · resumes before id"));
    }

    fn detail_path(month: BusinessDate) -> String {
        format!("/status?business_date={month}&shards=3")
    }
}

/// The page's content, as served over plain HTTP: what the browser test below checks in the
/// rendered document, here in the HTML the replica sends (`cargo test` runs this one; the
/// browser one is in the ignored suite, which `.ci/run` runs after installing Chromium).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_over_http_shows_which_months_are_closed_and_which_shard_runs_failed_or_is_missing()
{
    let db = test_db().await;
    let pool = &db.pool;
    let months = FourMonths::seed(pool).await;
    let replica = months.replica(pool).await;
    let html = replica.page("/status").await;
    months.check_overview(pool, &html).await;
    let closed = replica.page(&FourMonths::detail_path(months.closed)).await;
    let running = replica.page(&FourMonths::detail_path(months.running)).await;
    months.check_details(pool, &closed, &running).await;
    replica.stop().await;
}

/// The same page opened in headless Chromium, as a person does, and drawn (the screenshot in the
/// README). Ignored by default: it needs Chromium (`apt-get install chromium`), which a machine
/// with only Rust and PostgreSQL lacks; `.ci/run` installs it and runs the ignored suite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs headless Chromium (apt-get install chromium); .ci/run runs it"]
async fn a_person_opening_status_in_a_browser_sees_which_months_are_closed_and_which_shard_runs_failed_or_is_missing(
) {
    // Before any work: without a browser this test cannot look at the page, and says so.
    chromium_binary();
    let db = test_db().await;
    let pool = &db.pool;
    let months = FourMonths::seed(pool).await;
    let replica = months.replica(pool).await;
    let url = format!("http://{}", replica.addr);
    let dom = chromium(&["--dump-dom".into(), format!("{url}/status")]).await;
    months.check_overview(pool, &dom).await;
    let closed = chromium(&[
        "--dump-dom".into(),
        format!("{url}{}", FourMonths::detail_path(months.closed)),
    ])
    .await;
    let running = chromium(&[
        "--dump-dom".into(),
        format!("{url}{}", FourMonths::detail_path(months.running)),
    ])
    .await;
    months.check_details(pool, &closed, &running).await;

    // The page as a browser draws it, at 1280 px (`docs/status/` holds the every-state test's).
    let scratch = tempfile::tempdir().unwrap();
    let screenshot = std::env::var_os("SETTLEMENTD_STATUS_SCREENSHOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| scratch.path().join("status.png"));
    chromium(&[
        format!("--screenshot={}", screenshot.display()),
        "--window-size=1280,1800".into(),
        format!("{url}/status"),
    ])
    .await;
    let png = std::fs::read(&screenshot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    assert_eq!(
        u32::from_be_bytes(png[16..20].try_into().unwrap()),
        1280,
        "the window's width"
    );
    replica.stop().await;
}

#[tokio::test]
async fn status_shows_owner_names_and_error_texts_from_the_database_as_text_without_a_token() {
    let db = test_db().await;
    sqlx::query(
        "INSERT INTO job_runs (job_name, business_date, shards, shard, status, attempt, owner,
                               started_at, heartbeat_at, finished_at, last_error)
         VALUES ($1, $2, 1, 0, 'FAILED', 2, $3, now(), now(), now(), $4)",
    )
    .bind(fine_settlement::JOB_NAME)
    .bind(bd(OCT).date())
    .bind("<script>alert('owner')</script>")
    .bind("<script>alert(\"last_error\")</script> & <b>bold</b>")
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO job_events (job_name, business_date, shards, shard, event, attempt, owner, message)
         VALUES ($1, $2, 1, 0, 'failed', 2, $3, $4)",
    )
    .bind(fine_settlement::JOB_NAME)
    .bind(bd(OCT).date())
    .bind("<script>alert('owner')</script>")
    .bind("<script>alert('message')</script>")
    .execute(&db.pool)
    .await
    .unwrap();
    let replica = Replica::start(&db.pool, &[], Utc::now()).await;
    for path in ["/status", "/status?business_date=2026-10-31&shards=1"] {
        let answer = replica.get(path).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.body);
        assert_eq!(
            answer.header("content-type"),
            Some("text/html; charset=utf-8")
        );
        assert!(answer
            .header("content-security-policy")
            .is_some_and(|csp| csp.starts_with("default-src 'none'")));
        let body = &answer.body;
        assert!(!body.contains("<script"), "{path}: {body}");
        assert!(!body.contains("<b>"), "{path}: {body}");
        for shown in [
            "&lt;script&gt;alert('owner')&lt;/script&gt;",
            "&lt;script&gt;alert(&quot;last_error&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;",
            "&lt;script&gt;alert('message')&lt;/script&gt;",
        ] {
            assert!(body.contains(shown), "{path}: {shown} in {body}");
        }
        let cell = text_of(body, &format!("cell-{OCT}-0"));
        assert!(
            cell.starts_with("FAILED attempt 2 owner <script>alert('owner')</script> heartbeat"),
            "{cell}"
        );
        assert!(
            cell.ends_with("<script>alert(\"last_error\")</script> & <b>bold</b>"),
            "{cell}"
        );
    }
    replica.stop().await;
}

#[tokio::test]
async fn status_page_false_answers_404() {
    let db = test_db().await;
    let replica = Replica::start(
        &db.pool,
        &[("SETTLEMENTD__HTTP__STATUS_PAGE", "false")],
        Utc::now(),
    )
    .await;
    for path in ["/status", "/status?business_date=2026-10-31"] {
        let answer = replica.get(path).await;
        assert_eq!(answer.status, 404, "{path}");
        assert!(
            answer.body.contains("http.status_page = false"),
            "{answer:?}"
        );
    }
    assert_eq!(replica.get("/healthz").await.status, 200);
    replica.stop().await;
}

#[tokio::test]
async fn a_bad_status_query_is_a_400_page_that_names_the_problem() {
    let db = test_db().await;
    let replica = Replica::start(&db.pool, &[], Utc::now()).await;
    for (query, expected) in [
        (
            "business_date=2026-10-30",
            "must be the last day of a month (e.g. 2026-10-31)",
        ),
        ("business_date=yesterday", "expected YYYY-MM-DD"),
        ("shards=0", "shards must be a whole number from 1 to 1024"),
        (
            "shards=99999999999",
            "shards must be a whole number from 1 to 1024",
        ),
        ("month=2026-10", "unknown parameter &quot;month&quot;"),
        ("shards=1&shards=2", "more than once"),
        (
            "business_date=%3Cscript%3E",
            "invalid date '&lt;script&gt;'",
        ),
    ] {
        let answer = replica.get(&format!("/status?{query}")).await;
        assert_eq!(answer.status, 400, "{query}: {}", answer.body);
        assert_eq!(
            answer.header("content-type"),
            Some("text/html; charset=utf-8")
        );
        assert!(answer.body.contains(expected), "{query}: {}", answer.body);
        assert!(!answer.body.contains("<script"), "{query}: {}", answer.body);
    }
    replica.stop().await;
}

/// Changes one settled loan's fine behind settlement's back: the month's totals change although
/// no run happened.
/// Moves the first settled fine of `month` on the record itself (its head's `after_cents`), as
/// nothing but a run under a new claim does: the change a kept closed month's totals miss until a
/// run of the month starts, and an open month's show at once.
async fn nudge_the_record(pool: &PgPool, month: BusinessDate) {
    sqlx::query(
        "UPDATE fine_heads SET after_cents = after_cents + 1
          WHERE loan_id = (SELECT min(id) FROM loans
                            WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NOT NULL)",
    )
    .bind(month.first_day())
    .bind(month.date())
    .execute(pool)
    .await
    .unwrap();
}

/// 600 loans returned in September, settled by both shards of 2.
async fn settle_september_under_two_shards(pool: &PgPool) {
    seed_month(pool, bd(SEP), 600, 1).await;
    for shard in [0, 1] {
        settle_as(pool, bd(SEP), 2, shard, &owner(shard)).await;
    }
}

/// A forced re-run of September's shard 1 of 2: a new attempt of the month.
async fn rerun_september_shard_1(pool: &PgPool) {
    let options = settlementd::job_layer::RunOptions {
        owner: Owner(owner(1)),
        ..run_options(true, false)
    };
    settlementd::job_layer::run_once(
        pool,
        &job(500),
        key(bd(SEP), 2, 1),
        &options,
        &CancellationToken::new(),
        &|_| {},
    )
    .await
    .unwrap();
}

/// The fines of `month`'s totals cell on a page.
fn fines(page: &str, month: &str) -> String {
    let totals = text_of(page, &format!("totals-{month}"));
    totals
        .split("fines ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("fines in {totals}"))
        .to_string()
}

#[tokio::test]
async fn a_closed_months_totals_are_computed_once_until_a_run_of_it_starts_an_open_months_at_every_view(
) {
    let db = test_db().await;
    let pool = &db.pool;
    seed_month(pool, bd(SEP), 600, 1).await;
    seed_month(pool, bd(OCT), 600, 10_001).await;
    for shard in [0, 1] {
        settle_as(pool, bd(SEP), 2, shard, &owner(shard)).await;
    }
    settle_as(pool, bd(OCT), 2, 0, &owner(0)).await;
    let replica = Replica::start(pool, &[("SETTLEMENTD__SHARD__COUNT", "2")], Utc::now()).await;
    let sep = totals_of(pool, bd(SEP)).await;
    let oct = totals_of(pool, bd(OCT)).await;
    let page = replica.page("/status").await;
    assert_eq!(fines(&page, SEP), money(sep.fine_cents_sum));
    assert_eq!(fines(&page, OCT), money(oct.fine_cents_sum));

    nudge_the_record(pool, bd(SEP)).await;
    nudge_the_record(pool, bd(OCT)).await;
    let page = replica.page("/status").await;
    assert_eq!(
        fines(&page, SEP),
        money(sep.fine_cents_sum),
        "closed: kept from the first view"
    );
    assert_eq!(
        fines(&page, OCT),
        money(oct.fine_cents_sum + 1),
        "open: computed at each view"
    );

    // A forced re-run of a September shard is a new attempt: the kept totals are computed again.
    rerun_september_shard_1(pool).await;
    let page = replica.page("/status").await;
    assert_eq!(fines(&page, SEP), money(sep.fine_cents_sum + 1));
    replica.stop().await;
}

/// The kept row of `month` in `month_facts`: its fine sum, attempts and mark.
async fn kept_row(pool: &PgPool, month: BusinessDate) -> Option<(String, i64, Option<i64>)> {
    sqlx::query_as(
        "SELECT facts::text, month_attempts, mark FROM settlementd.month_facts
          WHERE job_name = 'fine-settlement' AND business_date = $1",
    )
    .bind(month.date())
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// Writes `cents` as the kept fine sum of `month`, marker untouched: a reader that shows it took
/// the kept row instead of counting.
async fn tamper_kept_sum(pool: &PgPool, month: BusinessDate, cents: i64) {
    let n = sqlx::query(
        "UPDATE settlementd.month_facts
            SET facts = (SELECT jsonb_agg(CASE WHEN f->>'name' = 'fine_cents_sum'
                                               THEN jsonb_set(f, '{value}', to_jsonb($2::bigint))
                                               ELSE f END)
                           FROM jsonb_array_elements(facts) f)
          WHERE job_name = 'fine-settlement' AND business_date = $1",
    )
    .bind(month.date())
    .bind(cents)
    .execute(pool)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1);
}

fn status_sum(url: &str, env: &[(&str, &str)]) -> Option<i64> {
    let out = cli(url, env, &["status", "--business-date", SEP, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    json_of(&out)["totals"]["fine_cents_sum"].as_i64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_months_facts_are_kept_for_every_process_until_its_attempts_or_its_journal_move() {
    let db = test_db().await;
    let pool = &db.pool;
    settle_september_under_two_shards(pool).await;
    let env = [("SETTLEMENTD__SHARD__COUNT", "2")];
    let settled = totals_of(pool, bd(SEP)).await;
    let cents = i64::try_from(settled.fine_cents_sum).unwrap();

    // `status` counts what is not kept, and writes nothing: it is a read-only command.
    assert_eq!(status_sum(&db.url, &env), Some(cents));
    assert_eq!(
        kept_row(pool, bd(SEP)).await,
        None,
        "status wrote a kept row"
    );

    // A replica's page counts the closed month once and keeps it for every process.
    let replica = Replica::start(pool, &env, Utc::now()).await;
    assert_eq!(
        fines(&replica.page("/status").await, SEP),
        money(settled.fine_cents_sum)
    );
    let mut kept = None;
    for _ in 0..100 {
        kept = kept_row(pool, bd(SEP)).await;
        if kept.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (facts, attempts, mark) = kept.expect("the page kept the month's facts");
    assert!(facts.contains(&settled.digest), "{facts}");
    assert_eq!(attempts, 2, "the two shards' first attempts");
    let last_journal_row: Option<i64> =
        sqlx::query_scalar("SELECT max(id) FROM settlementd.fine_journal WHERE month = $1")
            .bind(bd(SEP).first_day())
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(mark, last_journal_row);
    replica.stop().await;

    // Another process (a fresh `status`, a replica started later) reads the kept row: what was
    // kept is what it shows, not a count of its own.
    tamper_kept_sum(pool, bd(SEP), 12_345).await;
    assert_eq!(
        status_sum(&db.url, &env),
        Some(12_345),
        "status took the kept row"
    );
    let replica = Replica::start(pool, &env, Utc::now()).await;
    assert_eq!(fines(&replica.page("/status").await, SEP), money(12_345));
    replica.stop().await;

    // A journal row of the month that no attempt of this release wrote (the release before it,
    // during a rolling upgrade, opens entries for what it settled; here an empty one, which
    // changes no fact) moves the mark: the month is counted again, by `status` and by the page.
    sqlx::query(
        "INSERT INTO settlementd.fine_journal (month, kind, loan_ids, seqs, due_on, returned_on,
                                               before_cents, after_cents)
         VALUES ($1, 'opening', '{}', '{}', '{}', '{}', '{}', '{}')",
    )
    .bind(bd(SEP).first_day())
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(status_sum(&db.url, &env), Some(cents), "the journal moved");
    let replica = Replica::start(pool, &env, Utc::now()).await;
    assert_eq!(
        fines(&replica.page("/status").await, SEP),
        money(settled.fine_cents_sum)
    );

    // A new attempt of the month (a forced re-run of one shard) moves its attempts: a kept row
    // under the old attempts is counted again, even where the journal did not move.
    let mut moved = None;
    for _ in 0..100 {
        moved = kept_row(pool, bd(SEP)).await.filter(|(_, _, m)| *m != mark);
        if moved.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        moved.is_some(),
        "the page kept the recount under the new mark"
    );
    tamper_kept_sum(pool, bd(SEP), 777).await;
    assert_eq!(status_sum(&db.url, &env), Some(777));
    rerun_september_shard_1(pool).await;
    assert_eq!(status_sum(&db.url, &env), Some(cents), "a new attempt");
    assert_eq!(
        fines(&replica.page("/status").await, SEP),
        money(settled.fine_cents_sum)
    );
    replica.stop().await;
}

/// Before, `status` counted a month's facts (and priced a preview it never printed) for as long as
/// it took: 50–68 s for a month being run on 12 M loans, in the incident an operator runs it in.
/// Now it spends at most 2 s counting and says what it did not count, and `--count` counts.
/// Here the month's heads are locked, so no count can finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_within_two_seconds_says_what_it_did_not_count_and_count_counts() {
    let db = test_db().await;
    let pool = &db.pool;
    settle_september_under_two_shards(pool).await;
    let env = [("SETTLEMENTD__SHARD__COUNT", "2")];
    let cents = i64::try_from(totals_of(pool, bd(SEP)).await.fine_cents_sum).unwrap();
    let mut holder = sqlx::PgConnection::connect(&db.url).await.unwrap();
    for sql in [
        "BEGIN",
        "LOCK TABLE settlementd.fine_heads IN ACCESS EXCLUSIVE MODE",
    ] {
        sqlx::query(sql).execute(&mut holder).await.unwrap();
    }
    let out = tokio::task::spawn_blocking({
        let url = db.url.clone();
        move || cli(&url, &env, &["status", "--business-date", SEP])
    })
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert!(
        text.contains(
            "totals unavailable: not counted in this view: counting it takes more than 2000 ms \
             of database time (`settlementd status --count` counts it)"
        ),
        "{text}"
    );
    assert!(
        text.contains("fine-settlement 2026-09-30 with 2 shard(s): closed"),
        "the claims and the verdict are read all the same: {text}"
    );
    // (A `status` that waited for the count would wait here for its 10-minute budget.)

    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let out = cli(
        &db.url,
        &env,
        &["status", "--business-date", SEP, "--count", "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    assert_eq!(
        json_of(&out)["totals"]["fine_cents_sum"].as_i64(),
        Some(cents)
    );
}

/// Before, every view counted what waits in a month a shard runs: at a 12 M-loan library's month
/// end, 1.5 M late returns, 4 s of one statement, which spent the page's budget and left every
/// other month "unknown". A view now leaves that count to the run (its bar says what is left):
/// the month is not closed with its items "not counted while a shard runs" (`waiting` null in
/// JSON), and counted again once its shard is SUCCESS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_a_shard_runs_is_not_closed_and_its_waiting_items_are_left_to_its_run() {
    let db = test_db().await;
    let pool = &db.pool;
    let month = BusinessDate::month_before(chrono::Utc::now().date_naive());
    let earlier = BusinessDate::month_before(month.first_day());
    seed_month(pool, earlier, 40, 1).await;
    settle_as(pool, earlier, 1, 0, &owner(0)).await;
    seed_month(pool, month, 300, 1_000).await;
    claim_with_one_batch(pool, month, 1, 0, &owner(0), 20).await;
    let watched = |month: BusinessDate| {
        let out = cli(
            &db.url,
            &[],
            &["status", "--business-date", &month.to_string(), "--json"],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
        let json = json_of(&out);
        let found = json["watch"]["months_not_closed"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["business_date"] == month.to_string())
            .cloned();
        (json, found)
    };
    let (json, found) = watched(month);
    let found = found.unwrap_or_else(|| panic!("{json}"));
    assert_eq!(found["shards_not_success"], 1, "{json}");
    assert!(found["waiting"].is_null(), "{json}");
    assert_eq!(json["state"], "open", "{json}");

    let replica = Replica::start(pool, &[], Utc::now()).await;
    let page = replica.page("/status").await;
    let headline = text_of(&page, "not-closed");
    assert!(
        headline.contains(
            "1 shard not SUCCESS, late returns or edits waiting not counted while a shard runs"
        ),
        "{headline}"
    );
    replica.stop().await;

    // Its shard SUCCESS, then late returns (seeded around the month): counted again.
    settle_as(pool, month, 1, 0, &owner(0)).await;
    seed_month(pool, month, 2, 5_000).await;
    let (json, found) = watched(month);
    let found = found.unwrap_or_else(|| panic!("{json}"));
    assert!(
        found["waiting"].as_u64().is_some_and(|n| n >= 1),
        "counted: {json}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_fine_edited_by_hand_moves_neither_the_page_nor_status_and_verify_names_the_loan()
{
    let db = test_db().await;
    let pool = &db.pool;
    settle_september_under_two_shards(pool).await;
    let env = [("SETTLEMENTD__SHARD__COUNT", "2")];
    let replica = Replica::start(pool, &env, Utc::now()).await;
    let settled = totals_of(pool, bd(SEP)).await;
    let page = replica.page("/status").await;
    assert_eq!(fines(&page, SEP), money(settled.fine_cents_sum), "kept");

    let id: i64 = sqlx::query_scalar(
        "UPDATE loans SET fine_cents = fine_cents + 100
          WHERE id = (SELECT min(id) FROM loans
                       WHERE returned_on BETWEEN $1 AND $2 AND fine_settled_at IS NOT NULL)
         RETURNING id",
    )
    .bind(bd(SEP).first_day())
    .bind(bd(SEP).date())
    .fetch_one(pool)
    .await
    .unwrap();
    // The page's kept totals and a fresh `status` read say the same: what was settled.
    let page = replica.page("/status").await;
    assert_eq!(fines(&page, SEP), money(settled.fine_cents_sum), "the page");
    let out = cli(&db.url, &env, &["status", "--business-date", SEP, "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let status = json_of(&out);
    assert_eq!(
        (
            status["totals"]["fine_cents_sum"].as_i64(),
            status["totals"]["settled_rows"].as_i64(),
            status["totals"]["digest"].as_str(),
        ),
        (
            i64::try_from(settled.fine_cents_sum).ok(),
            Some(settled.settled_rows),
            Some(settled.digest.as_str()),
        ),
        "{status}"
    );
    // And `verify` names the loan the record does not hold, exit 1.
    let (code, report) = verify(&db.url, &env, SEP);
    assert_eq!(code, Some(1), "{report}");
    assert_eq!(
        report["journal"]["off_journal"],
        serde_json::json!({"count": 1, "ids": [id]}),
        "{report}"
    );
    replica.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_database_makes_the_page_show_totals_unavailable_within_its_budget_instead_of_hanging(
) {
    let db = test_db().await;
    let pool = &db.pool;
    seed_month(pool, bd(SEP), 300, 1).await;
    seed_month(pool, bd(OCT), 300, 10_001).await;
    settle_as(pool, bd(SEP), 1, 0, &owner(0)).await;
    claim_with_one_batch(pool, bd(OCT), 1, 0, &owner(0), 50).await;
    let replica = Replica::start(pool, &[], Utc::now()).await;

    // Someone holds a lock on loans: every read of it waits.
    let mut locker = sqlx::PgConnection::connect(&db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut locker).await.unwrap();
    sqlx::query("LOCK TABLE loans IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    let started = Instant::now();
    let page = tokio::time::timeout(Duration::from_secs(10), replica.page("/status"))
        .await
        .expect("the page answers while loans is locked");
    let took = started.elapsed();
    assert!(
        took < settlementd::overview::VIEW_BUDGET + Duration::from_secs(2),
        "took {took:?}"
    );
    let oct = text_of(&page, &format!("totals-{OCT}"));
    assert!(
        oct.starts_with("totals unavailable: did not fit in this view's 2 s"),
        "{oct}"
    );
    let sep = text_of(&page, &format!("totals-{SEP}"));
    assert!(sep.contains("being computed in the background"), "{sep}");
    // The claims still show, without a progress bar (it needs the loans too).
    let cell = text_of(&page, &format!("cell-{OCT}-0"));
    assert!(cell.starts_with("RUNNING attempt 1"), "{cell}");
    assert!(!page.contains("<progress"));

    // Once the lock is gone the background computation finishes, and the next views show it.
    sqlx::query("ROLLBACK").execute(&mut locker).await.unwrap();
    let expected = totals_of(pool, bd(SEP)).await;
    let mut shown = String::new();
    for _ in 0..100 {
        shown = text_of(&replica.page("/status").await, &format!("totals-{SEP}"));
        if shown.starts_with("settled ") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        shown,
        format!(
            "settled {} rows fines {} ({} cents) digest {}…",
            grouped(expected.settled_rows),
            money(expected.fine_cents_sum),
            grouped(expected.fine_cents_sum as i64),
            &expected.digest[..12]
        )
    );
    replica.stop().await;
}

#[tokio::test]
async fn the_overview_reads_the_twelve_newest_months_with_any_claim_under_the_count() {
    let db = test_db().await;
    let mut conn = db.pool.acquire().await.unwrap();
    // 2025-01 … 2026-02: fourteen months, oldest first.
    let months: Vec<BusinessDate> = (0..14)
        .map(|i| BusinessDate::from_month(&format!("{}-{:02}", 2025 + i / 12, i % 12 + 1)))
        .map(Result::unwrap)
        .collect();
    for (i, month) in months.iter().enumerate() {
        // Shard 1 only in every other month; shard 0 always.
        for shard in 0..2 {
            if shard == 1 && i % 2 == 1 {
                continue;
            }
            let outcome = claim::claim(
                &mut conn,
                &key(*month, 2, shard),
                &Owner(owner(shard)),
                Duration::from_secs(60),
                false,
            )
            .await
            .unwrap();
            assert!(matches!(outcome, ClaimOutcome::Won(_)));
        }
    }
    // The newest month also under three shards, one of them taken over once: not in the grid of
    // two shards, but part of the month's attempts.
    let newest = *months.last().unwrap();
    for _ in 0..2 {
        let outcome = claim::claim(
            &mut conn,
            &key(newest, 3, 0),
            &Owner("elsewhere".into()),
            Duration::ZERO,
            false,
        )
        .await
        .unwrap();
        assert!(matches!(outcome, ClaimOutcome::Won(_)));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rows = claim::latest_months(&mut *conn, fine_settlement::JOB_NAME, 2, None, 12)
        .await
        .unwrap();
    let dates: Vec<_> = rows.iter().map(|r| r.business_date).collect();
    let mut expected: Vec<_> = Vec::new();
    for (i, month) in months.iter().enumerate().rev().take(12) {
        expected.push(month.date());
        if i % 2 == 0 {
            expected.push(month.date());
        }
    }
    assert_eq!(dates, expected, "newest first, by shard, twelve months");
    assert_eq!(rows[0].run.shard, 0);
    assert_eq!(
        rows[0].month_attempts,
        1 + 2,
        "the attempts under every shard count"
    );
    let one = claim::latest_months(
        &mut *conn,
        fine_settlement::JOB_NAME,
        2,
        Some(months[0].date()),
        12,
    )
    .await
    .unwrap();
    assert_eq!(one.len(), 2);
    assert!(one.iter().all(|r| r.business_date == months[0].date()));

    let history = events::latest_per_shard(&mut *conn, fine_settlement::JOB_NAME, 2, None, 3)
        .await
        .unwrap();
    let shard0: Vec<_> = history.iter().filter(|e| e.event.shard == 0).collect();
    assert_eq!(shard0.len(), 3, "at most three per shard");
    assert_eq!(
        shard0.iter().map(|e| e.business_date).collect::<Vec<_>>(),
        months
            .iter()
            .rev()
            .take(3)
            .map(|m| m.date())
            .collect::<Vec<_>>(),
        "across months, newest first"
    );
}

/// Issue 48 item 5: with the database read-only every `/readyz` was 503 while the Fleet showed each
/// replica "ready" in green, from its last report. The page now says the serving replica's
/// readiness first, as `/readyz` says it at that moment, and uses it in that replica's own row;
/// the other rows stay their last reports. Here a trigger of settlementd's on `loans` is disabled
/// between two full reports: the row still says ready, the page does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_says_the_serving_replicas_own_readiness_first_and_in_its_fleet_row() {
    let db = test_db().await;
    let replica = ready_minute_replica(&db.url).await;
    // Its first report may come a moment after it is ready.
    let row = || async {
        sqlx::query_scalar::<_, String>("SELECT owner FROM replicas")
            .fetch_optional(&db.pool)
            .await
            .unwrap()
    };
    assert!(
        eventually(30, || async { row().await.is_some() }).await,
        "the replica reported"
    );
    let owner = row().await.unwrap();
    // Its last report, as if made while it was ready.
    sqlx::query("UPDATE replicas SET ready = true, reason = NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    let page = get(replica.addr, "/status").await.unwrap().1;
    assert!(!page.contains("own-readiness"), "{page}");
    assert!(own_row(&page, &owner).contains(">ready<"), "{page}");

    sqlx::query("ALTER TABLE loans DISABLE TRIGGER settlementd_settled_deleted")
        .execute(&db.pool)
        .await
        .unwrap();
    let said = replica.wait_for("/readyz", 503).await;
    assert!(
        said.contains("settlementd_settled_deleted is disabled"),
        "{said}"
    );
    let page = get(replica.addr, "/status").await.unwrap().1;
    let first = page
        .split_once("id=\"own-readiness\">")
        .map(|(_, rest)| rest.split('<').next().unwrap_or_default())
        .unwrap_or_else(|| panic!("no readiness line first on the page:\n{page}"));
    assert!(
        first.starts_with("This replica is NOT READY: ")
            && first.contains("settlementd_settled_deleted is disabled"),
        "{first}"
    );
    let row = own_row(&page, &owner);
    assert!(
        row.contains("NOT READY: ") && row.contains("settlementd_settled_deleted is disabled"),
        "{row}"
    );
    assert!(page.contains("id=\"fleet-as-reported\""), "{page}");
    let stored: bool = sqlx::query_scalar("SELECT ready FROM replicas WHERE owner = $1")
        .bind(&owner)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(
        stored,
        "the row itself still says ready: the page says what is true now"
    );
}

/// Before, a replica gone quiet (no report for three heartbeats: killed, frozen, cut off) showed
/// "ready" in green beside "gone?", as it last said. Its readiness is not known now: grey
/// "unknown" with what it last said, on the page and in `status`. And the replica serving the page
/// is never "gone?": with the database read-only its reports stop, and its own row said so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_gone_quiet_has_readiness_unknown_never_ready_in_green() {
    let db = test_db().await;
    let replica = ready_minute_replica(&db.url).await;
    sqlx::query(
        "INSERT INTO replicas (owner, version, commit, jobs, shards, shard, started_at, seen_at,
                               ready, reason)
         VALUES ('quiet-ready', '0.3.0', 'abc1234', ARRAY['fine-settlement'], 1, 0,
                 now() - interval '2 hours', now() - interval '1 hour', true, NULL),
                ('quiet-not-ready', '0.3.0', 'abc1234', ARRAY['fine-settlement'], 1, 0,
                 now() - interval '2 hours', now() - interval '1 hour', false, 'read_only'),
                ('live-ready', '0.3.0', 'abc1234', ARRAY['fine-settlement'], 1, 0,
                 now() - interval '2 hours', now(), true, NULL)",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let page = get(replica.addr, "/status").await.unwrap().1;
    let row = own_row(&page, "quiet-ready");
    assert!(
        row.contains(">unknown<") && row.contains("(last said ready)") && row.contains("gone?"),
        "{row}"
    );
    assert!(
        !row.contains("class=\"closed\""),
        "green for a replica gone quiet: {row}"
    );
    let row = own_row(&page, "quiet-not-ready");
    assert!(
        row.contains(">unknown<") && row.contains("(last said NOT READY: read_only)"),
        "{row}"
    );
    assert!(own_row(&page, "live-ready").contains(">ready<"), "{page}");

    // The serving replica's own row, its last report an hour old (a read-only database stops its
    // reports): it answers this page, so it is not "gone?".
    let own = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT owner FROM replicas WHERE owner NOT IN ('quiet-ready', 'quiet-not-ready', 'live-ready')",
        )
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    };
    assert!(eventually(30, || async { own().await.is_some() }).await);
    let own = own().await.unwrap();
    sqlx::query("UPDATE replicas SET seen_at = now() - interval '1 hour' WHERE owner = $1")
        .bind(&own)
        .execute(&db.pool)
        .await
        .unwrap();
    let page = get(replica.addr, "/status").await.unwrap().1;
    let row = own_row(&page, &own);
    assert!(
        !row.contains("gone?") && row.contains("serves this page") && row.contains(">ready<"),
        "{row}"
    );

    let out = cli(&db.url, &[], &["status"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = |owner: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(owner))
            .unwrap_or_else(|| panic!("no line of {owner}:\n{text}"))
            .to_string()
    };
    assert!(
        line("quiet-ready").ends_with("readiness unknown (last said ready)"),
        "{text}"
    );
    assert!(
        line("quiet-not-ready").ends_with("readiness unknown (last said NOT READY: read_only)"),
        "{text}"
    );
    assert!(line("live-ready").ends_with(" ready"), "{text}");
    drop(replica);
}

/// A `serve` replica on `url`, ready, with a heartbeat of a minute: a full report (readiness) every
/// three heartbeats, so none in a test's time once it is ready.
async fn ready_minute_replica(url: &str) -> ServeProcess {
    let replica = ServeProcess::start(
        url,
        &[
            ("SETTLEMENTD__LEASE__HEARTBEAT_SECS", "60"),
            ("SETTLEMENTD__LEASE__TTL_SECS", "600"),
        ],
    );
    replica.wait_for("/readyz", 200).await;
    replica
}

/// The Fleet's row of `owner` in `page`.
fn own_row<'a>(page: &'a str, owner: &str) -> &'a str {
    page.split("<tr data-owner=")
        .skip(1)
        .find(|row| row.starts_with(&format!("\"{owner}\"")))
        .unwrap_or_else(|| panic!("no fleet row of {owner}:\n{page}"))
}

/// Before, a RUNNING claim whose lease had expired said "a replica of this shard may take it over"
/// whether or not one was alive: a frozen shard with no replica left looked as if it would heal by
/// itself, and its progress bar went on with a rate and a time left. Now the cell says who takes it
/// over: a live replica of the shard, or nobody until one starts (and what to run), and where the
/// claim stopped, with no rate; a correction's attempt, that only its correction takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_says_whether_a_live_replica_of_its_shard_will_take_it_over() {
    let db = test_db().await;
    let pool = &db.pool;
    let month = BusinessDate::month_before(chrono::Utc::now().date_naive());
    seed_month(pool, month, 300, 1).await;
    claim_with_one_batch(pool, month, 3, 1, &owner(1), 20).await;
    sqlx::query("UPDATE job_runs SET heartbeat_at = now() - interval '10 minutes'")
        .execute(pool)
        .await
        .unwrap();
    let replica = Replica::start(
        pool,
        &[
            ("SETTLEMENTD__SHARD__COUNT", "3"),
            ("SETTLEMENTD__SHARD__INDEX", "0"),
        ],
        Utc::now(),
    )
    .await;
    let page = || async {
        let html = replica
            .page(&format!("/status?business_date={month}&shards=3"))
            .await;
        (
            text_of(&html, &format!("cell-{month}-1")),
            text_of(&html, &format!("verdict-{month}")),
        )
    };
    // The verdict and `status` say what the cells say (issue 48 item 5: "a replica of each shard
    // runs what waits within a heartbeat" above a cell saying no live replica runs it).
    let status_next = || {
        let out = cli(
            &db.url,
            &[("SETTLEMENTD__SHARD__COUNT", "3")],
            &["status", "--business-date", &month.to_string(), "--json"],
        );
        assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
        json_of(&out)["next"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    // Shards 1 and 2 wait with no live replica (shard 0's may or may not be counted yet, as its
    // own cell says: this harness's replica reports on its own schedule).
    let (cell, verdict) = page().await;
    for said in [verdict, status_next()] {
        assert!(
            said.contains("no live replica runs shards ")
                && said.contains("1, 2: start one")
                && !said.contains("within a heartbeat"),
            "{said}"
        );
    }
    assert!(
        cell.contains("lease expired: no live replica runs this shard: start one"),
        "{cell}"
    );
    // Where it stopped, and no rate or time left: nothing runs it (issue 48 item 5, "25 a second
    // · about 5 h 1 min left" for a lease expired 40 s before).
    assert!(
        cell.contains("stopped there: nothing runs it while its lease is expired"),
        "{cell}"
    );
    assert!(
        !cell.contains(" a second") && !cell.contains(" left"),
        "a rate or time left for a claim nobody runs: {cell}"
    );

    // A replica of shard 1 reports in: it is the one that takes the claim over.
    sqlx::query(
        "INSERT INTO replicas (owner, version, commit, jobs, shards, shard, started_at, seen_at,
                               ready)
         VALUES ('replica-1', '0.2.0', 'abc', ARRAY['fine-settlement'], 3, 1, now(), now(), true)",
    )
    .execute(pool)
    .await
    .unwrap();
    let (cell, verdict) = page().await;
    assert!(
        cell.contains("lease expired: a live replica of this shard takes it over"),
        "{cell}"
    );
    for said in [verdict, status_next()] {
        assert!(
            said.contains("no live replica runs shard")
                && said.contains("2: start one")
                && !said.contains("1, 2"),
            "{said}"
        );
    }

    // The month held by a correction: no replica takes its attempt over, only that correction
    // (before, this cell said a live replica would, an hour after its lease expired, under a
    // verdict saying `settlementd correct` finishes it).
    sqlx::query(
        "INSERT INTO job_params (job_name, business_date, params, pinned_by, correction_key,
                                 correcting_since)
         VALUES ('fine-settlement', $1, $2, 'test', 'fix-1', now())
         ON CONFLICT (job_name, business_date)
         DO UPDATE SET correction_key = 'fix-1', correcting_since = now()",
    )
    .bind(month.date())
    .bind(serde_json::json!({
        "from": "0001-01", "daily_rate_cents": 50, "grace_days": 0, "max_cents": 10000
    }))
    .execute(pool)
    .await
    .unwrap();
    let (cell, verdict) = page().await;
    assert!(
        cell.contains(
            "lease expired: no replica takes over a correction's attempt: `settlementd correct` \
             with the same key (\"fix-1\") finishes it"
        ) && !cell.contains("within a heartbeat"),
        "{cell}"
    );
    assert!(
        verdict.contains("`settlementd correct` with the same key finishes it"),
        "{verdict}"
    );
    replica.stop().await;
}

/// A job that follows another is not closed before its input is: on a database whose returns are
/// not settled yet, the member statements have nothing waiting of their own, yet their months
/// are not closed while the settlement's are not. And a job without a rule shows no rule column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_following_jobs_months_are_not_closed_while_the_job_it_follows_has_not_closed_them() {
    let db = test_db().await;
    let pool = &db.pool;
    let month = BusinessDate::month_before(chrono::Utc::now().date_naive());
    seed_month(pool, month, 50, 1).await;
    let replica = Replica::start(pool, &[], Utc::now()).await;
    let html = replica.page("/status").await;
    let section = |job: &str| {
        let at = html
            .find(&format!("id=\"{job}-not-closed\""))
            .unwrap_or_else(|| panic!("no #{job}-not-closed in the page:\n{html}"));
        let end = at + html[at..].find("</p>").unwrap();
        html[at..end].to_string()
    };
    let settlement = section("fine-settlement");
    assert!(settlement.contains("not closed"), "{settlement}");
    let statements = section("member-statements");
    assert!(
        statements.contains("not closed")
            && statements.contains("fine-settlement has not closed it"),
        "{statements}"
    );
    assert!(!statements.contains("is closed"), "{statements}");
    assert!(!html.contains("id=\"member-statements-rule-"), "{html}");
    replica.stop().await;
}
