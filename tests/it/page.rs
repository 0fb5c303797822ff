//! Issue 35, part B: the status page in every state an operator meets — fresh, running, paused,
//! late, held, a rule conflict, a frozen replica, the database down — opened in headless
//! Chromium as a person does: its document checked, drawn at 1280 and at 420 px (the screenshots
//! in `docs/status/`), and its layout at 420 px measured over the DevTools protocol: nothing may
//! stick out of the window.
//!
//! `SETTLEMENTD_STATUS_SCREENSHOTS=<dir>` keeps the screenshots there (`docs/status` to refresh
//! the committed ones); by default they go to a temporary directory.

use crate::helpers::*;
use crate::journal::{sql, RATE};
use crate::status::{
    chromium, chromium_binary, claim_with_one_batch, owner, settle_as, text_of, Replica,
    CHROMIUM_FLAGS,
};
use chrono::Utc;
use settlementd::calendar::BusinessDate;
use settlementd::config::Settings;
use settlementd::schedule::{self, Slot};
use sqlx::PgPool;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The elements of the page at `url` that stick out of a `width` px wide window (their tag, id
/// and class), and the page's own width when it is wider than the window: empty when the page is
/// usable at that width without scrolling sideways. Measured in headless Chromium over the
/// DevTools protocol (a WebSocket), after the page has loaded.
fn overflowing(url: &str, width: u32) -> Vec<String> {
    let profile = tempfile::tempdir().unwrap();
    let mut browser = std::process::Command::new(chromium_binary())
        .args(CHROMIUM_FLAGS)
        .arg("--remote-debugging-port=0")
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("chromium starts");
    // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID" on stderr.
    let stderr = std::io::BufReader::new(browser.stderr.take().unwrap());
    let endpoint = stderr
        .lines()
        .map_while(Result::ok)
        .find_map(|line| {
            line.split_once("DevTools listening on ")
                .map(|(_, ws)| ws.trim().to_string())
        })
        .expect("chromium names its DevTools endpoint");
    let (mut socket, _) = tungstenite::connect(endpoint.as_str()).expect("DevTools connects");
    let mut next_id = 0;
    let mut call = |session: Option<&str>, method: &str, params: serde_json::Value| {
        next_id += 1;
        let mut message = serde_json::json!({"id": next_id, "method": method, "params": params});
        if let Some(session) = session {
            message["sessionId"] = session.into();
        }
        socket
            .send(tungstenite::Message::text(message.to_string()))
            .unwrap();
        loop {
            let answer = socket.read().unwrap();
            let Ok(text) = answer.to_text() else { continue };
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            if value["id"] == next_id {
                assert!(value["error"].is_null(), "{method}: {value}");
                return value["result"].clone();
            }
        }
    };
    let target = call(
        None,
        "Target.createTarget",
        serde_json::json!({"url": "about:blank"}),
    );
    let attached = call(
        None,
        "Target.attachToTarget",
        serde_json::json!({"targetId": target["targetId"], "flatten": true}),
    );
    let session = attached["sessionId"].as_str().unwrap().to_string();
    let session = Some(session.as_str());
    call(
        session,
        "Emulation.setDeviceMetricsOverride",
        serde_json::json!({"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": false}),
    );
    call(session, "Page.navigate", serde_json::json!({"url": url}));
    let evaluate =
        |call: &mut dyn FnMut(Option<&str>, &str, serde_json::Value) -> serde_json::Value,
         expression: &str| {
            call(
                session,
                "Runtime.evaluate",
                serde_json::json!({"expression": expression, "returnByValue": true}),
            )["result"]["value"]
                .clone()
        };
    let mut loaded = false;
    for _ in 0..200 {
        let state = evaluate(&mut call, "document.readyState + ' ' + location.href");
        if state.as_str() == Some(&format!("complete {url}")) {
            loaded = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(loaded, "{url} loaded in Chromium");
    let found = evaluate(
        &mut call,
        "JSON.stringify(Array.from(document.querySelectorAll('body *'))
             .filter(e => { const r = e.getBoundingClientRect();
                            return r.width > 0 && r.right > window.innerWidth + 1; })
             .slice(0, 12)
             .map(e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '')
                       + (typeof e.className === 'string' && e.className ? '.' + e.className : ''))
             .concat(document.documentElement.scrollWidth > window.innerWidth
                     ? ['the page is ' + document.documentElement.scrollWidth + ' px wide'] : []))",
    );
    browser.kill().ok();
    browser.wait().ok();
    serde_json::from_str(found.as_str().unwrap()).unwrap()
}

/// Where the screenshots go.
fn screenshots() -> (PathBuf, Option<tempfile::TempDir>) {
    match std::env::var_os("SETTLEMENTD_STATUS_SCREENSHOTS") {
        Some(dir) => {
            std::fs::create_dir_all(&dir).unwrap();
            (PathBuf::from(dir), None)
        }
        None => {
            let scratch = tempfile::tempdir().unwrap();
            (scratch.path().to_path_buf(), Some(scratch))
        }
    }
}

/// The page at `path` as Chromium shows it, in state `state`: drawn at 1280 and at 420 px into
/// `dir` (`<state>.png`, `<state>-420.png`), measured at 420 px (nothing sticks out), and its
/// document returned for the caller's checks.
async fn look(base: &str, path: &str, state: &str, dir: &Path) -> String {
    let url = format!("{base}{path}");
    let dom = chromium(&["--dump-dom".into(), url.clone()]).await;
    for (width, file) in [
        (1280, format!("{state}.png")),
        (420, format!("{state}-420.png")),
    ] {
        let shot = dir.join(&file);
        chromium(&[
            format!("--screenshot={}", shot.display()),
            format!(
                "--window-size={width},{}",
                if width < 1000 { 3200 } else { 1400 }
            ),
            url.clone(),
        ])
        .await;
        let png = std::fs::read(&shot).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{file}: a PNG");
        assert_eq!(
            u32::from_be_bytes(png[16..20].try_into().unwrap()),
            width,
            "{file}: the window's width"
        );
    }
    let probe = url.clone();
    let wide = tokio::task::spawn_blocking(move || overflowing(&probe, 420))
        .await
        .unwrap();
    assert!(
        wide.is_empty(),
        "{state}: at 420 px these stick out of the window: {wide:?}"
    );
    dom
}

/// A fleet member as `replicas` records it, seen `seen_secs_ago` on the database clock.
async fn report_replica(pool: &PgPool, shard: u32, seen_secs_ago: i64) {
    sqlx::query(
        "INSERT INTO replicas (owner, version, commit, jobs, shards, shard, started_at, seen_at,
                               ready, reason)
         VALUES ($1, '0.2.0', 'abc1234', ARRAY['fine-settlement', 'member-statements'], 3, $2,
                 now() - interval '1 hour', clock_timestamp() - make_interval(secs => $3),
                 true, NULL)
         ON CONFLICT (owner) DO UPDATE SET seen_at = EXCLUDED.seen_at",
    )
    .bind(owner(shard))
    .bind(shard as i32)
    .bind(seen_secs_ago as f64)
    .execute(pool)
    .await
    .unwrap();
}

/// Whether `text` appears in `dom` as words of its own: not the tail of a larger number ("21
/// rows" does not say "1 rows").
fn says(dom: &str, text: &str) -> bool {
    dom.match_indices(text).any(|(at, _)| {
        !dom[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_digit() || c == ',')
    })
}

fn months_back(from: BusinessDate, n: usize) -> BusinessDate {
    (0..n).fold(from, |m, _| BusinessDate::month_before(m.first_day()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs headless Chromium (apt-get install chromium); .ci/run runs it"]
async fn the_page_in_a_browser_shows_every_state_an_operator_meets_and_is_usable_at_420_px() {
    chromium_binary();
    let (dir, _scratch) = screenshots();
    let mut cluster = PrivateCluster::start().await;
    let pool = cluster.pool().await;
    let url = cluster.url.clone();
    let settings = Settings::load_from(None, []).unwrap();
    let tz = settings.schedule.timezone;
    let latest = Slot::new(
        schedule::latest_slot_at_or_before(&settlement_cron(&settings), tz, Utc::now()).unwrap(),
    );
    // m0: the latest fire's month; m1, m2, m3 before it; m4..m7 with nothing to settle.
    let m: Vec<BusinessDate> = (0..8)
        .map(|i| months_back(latest.business_date, i))
        .collect();
    let replica = Replica::start(&pool, &[("SETTLEMENTD__SHARD__COUNT", "3")], Utc::now()).await;
    let base = format!("http://{}", replica.addr);

    // Fresh: nothing claimed yet, the replica itself in the fleet.
    let dom = look(&base, "/status", "fresh", &dir).await;
    assert!(dom.contains("No claims under 3 shards yet."), "{dom}");
    assert!(dom.contains("id=\"fleet-table\""), "the fleet: {dom}");

    // Running: three months settled around a shard of the latest month one batch in, its owner
    // in the fleet; four empty months before them.
    for (i, month) in m[..4].iter().enumerate() {
        seed_month(&pool, *month, 1200, 1 + 10_000 * i as i64).await;
    }
    sql(&pool, "ALTER TABLE loans ALTER COLUMN due_on DROP NOT NULL").await;
    sql(
        &pool,
        &format!(
            "UPDATE loans SET due_on = NULL WHERE id IN (20003, 20006)
              AND returned_on BETWEEN '{}' AND '{}'",
            m[2].first_day(),
            m[2].date()
        ),
    )
    .await;
    for month in m[1..].iter().rev() {
        for shard in 0..3 {
            settle_as(&pool, *month, 3, shard, &owner(shard)).await;
        }
    }
    for shard in [0, 2] {
        settle_as(&pool, m[0], 3, shard, &owner(shard)).await;
    }
    claim_with_one_batch(&pool, m[0], 3, 1, &owner(1), 150).await;
    for shard in 0..3 {
        report_replica(&pool, shard, 2).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let dom = look(&base, "/status", "running", &dir).await;
    let cell = text_of(&dom, &format!("cell-{}-1", m[0]));
    assert!(cell.starts_with("RUNNING attempt 1"), "{cell}");
    assert!(
        cell.contains(" a second · about "),
        "rate and time left: {cell}"
    );
    assert!(
        dom.contains(&format!("running fine-settlement {} shard 1 of 3 (", m[0])),
        "the fleet says what the replica does: {dom}"
    );
    assert!(dom.contains("idle: no claim held"), "{dom}");
    let done = text_of(&dom, &format!("cell-{}-0", m[1]));
    assert!(
        done.contains("finished 20") && done.contains(" +08:00 · took "),
        "{done}"
    );
    // m4 holds one loan (m3's boundary row, returned the day before m3): m5..m7 are empty.
    assert!(
        dom.contains(&format!("id=\"fine-settlement-empty-{}-{}\"", m[7], m[5])),
        "the three empty months are one row: {dom}"
    );
    assert!(dom.contains("3 months closed with nothing to do"), "{dom}");
    assert!(dom.contains(&format!("id=\"fine-settlement-month-{}\"", m[4])));
    let totals = text_of(&dom, &format!("totals-{}", m[1]));
    assert!(totals.contains(" cents)"), "money with its unit: {totals}");
    for wrong in ["1 rows", "1 months", "1 loans", "1 shards"] {
        assert!(!says(&dom, wrong), "{wrong:?} in the page: {dom}");
    }
    assert!(!dom.contains(" UTC"), "one time zone: {dom}");

    // Paused.
    let out = cli(&url, &[], &["pause", "--reason", "auditors at work"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));
    let dom = look(&base, "/status", "paused", &dir).await;
    let paused = text_of(&dom, "paused");
    assert!(paused.starts_with("PAUSED since 20"), "{paused}");
    assert!(paused.contains(" +08:00 by "), "one time zone: {paused}");
    assert!(paused.contains("auditors at work"), "{paused}");
    let out = cli(&url, &[], &["resume"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_of(&out));

    // Late: a return of m1 arrives after the month closed.
    sql(
        &pool,
        &format!(
            "INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
             VALUES (90001, 5, 5, '{0}'::date - 30, '{0}'::date - 10, '{0}'::date + 3)",
            m[1].first_day()
        ),
    )
    .await;
    let dom = look(&base, "/status", "late", &dir).await;
    let verdict = text_of(&dom, &format!("verdict-{}", m[1]));
    assert!(
        verdict.contains("not closed: 1 late return or edit waiting"),
        "{verdict}"
    );

    // Held: m2's two loans without a due date, named with why on the month's page.
    let detail = format!("/status?business_date={}&shards=3", m[2]);
    let dom = look(&base, &detail, "held", &dir).await;
    let held = text_of(&dom, "held");
    for id in ["20003", "20006"] {
        assert!(held.contains(id), "{id} in {held}");
    }
    assert!(held.contains("no due date"), "{held}");
    let would = text_of(&dom, "would");
    assert!(would.contains("settlementd run --dry-run"), "{would}");

    // A rule conflict: a run of m3 under another rate is refused, and its shard says so.
    let out = cli(
        &url,
        &[(RATE, "70")],
        &[
            "run",
            "--business-date",
            &m[3].to_string(),
            "--shards",
            "3",
            "--shard",
            "2",
            "--force",
        ],
    );
    assert_ne!(out.status.code(), Some(0), "refused");
    let dom = look(&base, "/status", "rule-conflict", &dir).await;
    let cell = text_of(&dom, &format!("cell-{}-2", m[3]));
    assert!(cell.contains("rule conflict: "), "{cell}");

    // Frozen: the running shard's holder stops (SIGSTOP: no heartbeat, no report): its lease
    // expires, and the fleet says it is gone.
    age_heartbeat(&pool, m[0], 3, 1, 3600).await;
    report_replica(&pool, 1, 3600).await;
    let dom = look(&base, "/status", "frozen", &dir).await;
    let cell = text_of(&dom, &format!("cell-{}-1", m[0]));
    assert!(cell.contains("lease expired"), "{cell}");
    assert!(dom.contains("gone?"), "{dom}");
    assert!(
        dom.contains(&format!(
            "held, when last seen: fine-settlement {} shard 1",
            m[0]
        )),
        "{dom}"
    );

    // The database down: the page says so, and reloads itself.
    pool.close().await;
    cluster.pg.stop_immediately();
    let dom = look(&base, "/status", "database-down", &dir).await;
    assert!(dom.contains("Database unavailable"), "{dom}");
    assert!(dom.contains("http-equiv=\"refresh\""), "{dom}");
    replica.stop().await;
}
