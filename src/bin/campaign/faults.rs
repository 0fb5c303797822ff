//! Playing a schedule: the fleet, each action, the orchestrator that replaces lost replicas, and
//! the quiescing that ends it.
//!
//! Faults that last (a stopped process, a partition, a delay) run as background tasks, so the
//! schedule goes on while they hold; every one of them is over before quiescing starts. Each fault
//! that may make a process end badly is recorded with its target and its time
//! ([`World::fault`]), and the checker accounts for every exit with them.

use crate::proxy::Net;
use crate::schedule::{Action, NetFault, Step};
use crate::world::{month_end, Role, Rules, World};
use anyhow::Result;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

/// How long quiescing may take, from the moment the faults stop, before it is a violation.
pub const QUIESCE_BOUND: Duration = Duration::from_secs(60);

/// How long a rule change waits, in the background, for its shard to close a month before it keys
/// late returns into it.
const RULE_CHANGE_WAITS: Duration = Duration::from_secs(8);

/// What the scheduler-side play left for the checker.
pub struct Played {
    /// Time from the end of the faults until every month was settled and nothing was left open;
    /// `None`: not within [`QUIESCE_BOUND`] (with what was still open).
    pub quiesced: std::result::Result<Duration, String>,
    /// `verify --json` of each month: (month end, exit code, stdout, stderr).
    pub verified: Vec<(chrono::NaiveDate, i32, String, String)>,
}

/// Starts the fleet: `replicas` serve replicas per shard of the plan's shard count.
pub async fn start_fleet(world: &World) -> Result<()> {
    let shards = world.shards.load(Ordering::SeqCst);
    for shard in 0..shards {
        for _ in 0..world.plan.replicas {
            world
                .spawn(Role::Serve { shard, shards }, Rules::Fleet, false, None)
                .await?;
        }
    }
    if let (Some(secs), true) = (world.plan.skewed_at_start, world.faketime) {
        let shard = (world.plan.seed % u64::from(shards)) as u32;
        world
            .spawn(
                Role::Serve { shard, shards },
                Rules::Fleet,
                false,
                Some(secs),
            )
            .await?;
    }
    Ok(())
}

/// The orchestrator: every shard of the fleet's count has a replica (the first one that died is
/// replaced, as a StatefulSet would).
pub async fn orchestrate(world: &World) -> Result<()> {
    let shards = world.shards.load(Ordering::SeqCst);
    for shard in 0..shards {
        let serving = world.running(|p| {
            !p.clean
                && p.rules == Rules::Fleet
                && p.skew_secs.is_none()
                && p.role == Role::Serve { shard, shards }
        });
        if serving.is_empty() {
            world
                .spawn(Role::Serve { shard, shards }, Rules::Fleet, false, None)
                .await?;
        }
    }
    Ok(())
}

/// Plays `step` number `n`; lasting faults go to `background`.
pub async fn play(
    world: &Arc<World>,
    n: usize,
    step: &Step,
    background: &mut JoinSet<()>,
) -> Result<String> {
    let ttl = Duration::from_secs(world.plan.ttl_secs);
    let mut rng = ChaCha8Rng::seed_from_u64(step.pick);
    let pick = |len: usize| (step.pick % len.max(1) as u64) as usize;
    let shards = world.shards.load(Ordering::SeqCst);
    let months = world.plan.months.clone();
    match &step.action {
        Action::KillHolder => {
            let Some(id) = holder_or_replica(world, pick).await else {
                return Ok("kill: nobody to kill".into());
            };
            world.with_proc(id, |p| p.signal(libc::SIGKILL, "KILL"));
            Ok(format!("SIGKILL p{id}"))
        }
        Action::StopHolder {
            extra,
            between_batches,
        } => {
            let Some(id) = holder_or_replica(world, pick).await else {
                return Ok("stop: nobody to stop".into());
            };
            let world = world.clone();
            let (extra, between) = (*extra, *between_batches);
            background.spawn(async move {
                let from = Instant::now();
                let landed = stop(&world, id, between).await;
                let held = claims_of(&world, id).await;
                let stopped = Instant::now();
                let mut heir = None;
                if landed && !held.is_empty() {
                    // Woken the moment a peer has taken its claim over, with the heir paused for
                    // a moment (it has not written yet): the fence alone must stop its next batch.
                    let deadline = stopped + ttl * 4;
                    while Instant::now() < deadline {
                        if let Some(owner) = taken_over(&world, &held).await {
                            heir = owner;
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    if let Some(heir) = heir {
                        world.with_proc(heir, |p| p.signal(libc::SIGSTOP, "STOP"));
                    }
                } else {
                    tokio::time::sleep(ttl + extra).await;
                }
                world.with_proc(id, |p| p.signal(libc::SIGCONT, "CONT"));
                if let Some(heir) = heir {
                    let paused = Instant::now();
                    tokio::time::sleep(Duration::from_millis(300) + extra / 5).await;
                    world.with_proc(heir, |p| p.signal(libc::SIGCONT, "CONT"));
                    world.fault(
                        "SIGSTOP while the holder it took over from wakes",
                        Some(heir),
                        paused,
                        Instant::now() + ttl * 4,
                    );
                }
                let what = format!(
                    "SIGSTOP {}for {:.1} s",
                    if landed { "between transactions " } else { "" },
                    stopped.elapsed().as_secs_f64()
                );
                world.fault(what, Some(id), from, Instant::now() + ttl * 4);
            });
            Ok(format!(
                "SIGSTOP p{id} past its lease{}",
                if between {
                    ", between transactions"
                } else {
                    ""
                }
            ))
        }
        Action::Terminate => {
            let replicas = world.running(|p| !p.clean && matches!(p.role, Role::Serve { .. }));
            let Some(&id) = replicas.get(pick(replicas.len())) else {
                return Ok("terminate: no replica".into());
            };
            world.with_proc(id, |p| p.signal(libc::SIGTERM, "TERM"));
            Ok(format!("SIGTERM p{id}"))
        }
        Action::RestartPostgres { down } => {
            let from = Instant::now();
            let cluster = world.cluster.clone();
            tokio::task::spawn_blocking(move || cluster.stop_immediately()).await?;
            tokio::time::sleep(*down).await;
            let cluster = world.cluster.clone();
            tokio::task::spawn_blocking(move || cluster.restart()).await??;
            world.fault(
                "PostgreSQL stopped -m immediate and restarted",
                None,
                from,
                Instant::now() + ttl * 4,
            );
            Ok(format!(
                "PostgreSQL stopped (immediate), restarted after {} ms",
                down.as_millis()
            ))
        }
        Action::Network { fault, lasting } => {
            let targets = world.running(|p| !p.clean);
            let Some(&id) = targets.get(pick(targets.len())) else {
                return Ok("network: no process".into());
            };
            let Some(proxy) = world.with_proc(id, |p| p.proxy.clone()) else {
                return Ok("network: no process".into());
            };
            let from = Instant::now();
            match fault {
                NetFault::Reset => {
                    proxy.reset();
                    world.fault("connections reset", Some(id), from, from + ttl * 4);
                    Ok(format!("connections of p{id} reset"))
                }
                NetFault::Blackhole | NetFault::Delay(_) => {
                    let net = match fault {
                        NetFault::Delay(by) => Net::Delay(*by),
                        _ => Net::Blackhole,
                    };
                    proxy.set(net);
                    let (world, lasting) = (world.clone(), *lasting);
                    background.spawn(async move {
                        tokio::time::sleep(lasting).await;
                        proxy.set(Net::Pass);
                        world.fault(format!("{net:?}"), Some(id), from, Instant::now() + ttl * 4);
                    });
                    Ok(format!("{net:?} on p{id} for {} ms", lasting.as_millis()))
                }
            }
        }
        Action::SkewedReplica { secs } => {
            if !world.faketime {
                world
                    .note("libfaketime is not installed (apt-get install faketime): no clock skew");
                return Ok("clock skew skipped (no libfaketime)".into());
            }
            let shard = pick(shards as usize) as u32;
            let id = world
                .spawn(
                    Role::Serve { shard, shards },
                    Rules::Fleet,
                    false,
                    Some(*secs),
                )
                .await?;
            Ok(format!(
                "replica p{id} of shard {shard}/{shards} with its clock {secs:+} s"
            ))
        }
        Action::Reshard => {
            let to = world.plan.reshard_to;
            if shards == to {
                return Ok("reshard: already there".into());
            }
            world.shards.store(to, Ordering::SeqCst);
            let old = world.running(|p| {
                !p.clean && matches!(p.role, Role::Serve { shards: s, .. } if s == shards)
            });
            for id in &old {
                world.with_proc(*id, |p| p.signal(libc::SIGTERM, "TERM"));
            }
            for shard in 0..to {
                for _ in 0..world.plan.replicas {
                    world
                        .spawn(Role::Serve { shard, shards: to }, Rules::Fleet, false, None)
                        .await?;
                }
            }
            Ok(format!(
                "reshard {shards} -> {to} (SIGTERM to {} replicas)",
                old.len()
            ))
        }
        Action::LateReturns { n: returns } => {
            let keyed =
                key_late_returns(world, n, step.pick, *returns, None, &months, &mut rng).await?;
            Ok(format!("{keyed} returns keyed late"))
        }
        Action::EditSettled { n } => edit_settled(world, step.pick, *n, &mut rng).await,
        Action::RuleChange => {
            let shard = pick(shards as usize) as u32;
            let id = world
                .spawn(Role::Serve { shard, shards }, Rules::Other, false, None)
                .await?;
            // Late returns of its shard into months its shard has closed, which only a sweep
            // settles, and under the pin: the replica with the other rule must leave them to it
            // (it is refused; a peer of the fleet settles them), and so must a one-shot run of
            // such a month with the other rule. Before the shard has closed a month, they wait
            // for it (a while, in the background).
            let mut rng = ChaCha8Rng::seed_from_u64(rng.random());
            let closed = closed_months(world, shard, shards).await?;
            if !closed.is_empty() {
                let late = late_for_the_other_rule(
                    world,
                    n,
                    step.pick,
                    (shard, shards),
                    &closed,
                    &mut rng,
                )
                .await?;
                return Ok(format!(
                    "rule change: replica p{id} with the other rule; {late}"
                ));
            }
            let (world, pick) = (world.clone(), step.pick);
            background.spawn(async move {
                let deadline = Instant::now() + RULE_CHANGE_WAITS;
                while Instant::now() < deadline {
                    match closed_months(&world, shard, shards).await {
                        Ok(closed) if !closed.is_empty() => {
                            let late = late_for_the_other_rule(
                                &world,
                                n,
                                pick,
                                (shard, shards),
                                &closed,
                                &mut rng,
                            )
                            .await;
                            world.note(match late {
                                Ok(late) => format!(
                                    "step {n} (rule change), {:.1} s: {late}",
                                    world.started.elapsed().as_secs_f64()
                                ),
                                Err(e) => format!("step {n} (rule change): {e:#}"),
                            });
                            return;
                        }
                        _ => tokio::time::sleep(Duration::from_millis(250)).await,
                    }
                }
                world.note(format!(
                    "step {n} (rule change): shard {shard}/{shards} closed no month within {} s: \
                     no late returns for the other rule",
                    RULE_CHANGE_WAITS.as_secs()
                ));
            });
            Ok(format!(
                "rule change: replica p{id} with the other rule; late returns of shard \
                 {shard}/{shards} and a run with the other rule once it closes a month"
            ))
        }
        Action::Correct => {
            let month = months[pick(months.len())];
            let key = format!("camp-{}-c{n}", world.plan.seed);
            world
                .corrections
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(crate::world::CorrectionAsked {
                    key: key.clone(),
                    month,
                    shards,
                });
            let id = world
                .spawn(
                    Role::Correct {
                        month,
                        key: key.clone(),
                    },
                    Rules::Other,
                    false,
                    None,
                )
                .await?;
            Ok(format!(
                "correct {} to the other rule, key {key} (p{id})",
                month_end(month)
            ))
        }
        Action::ForceRun | Action::Run => {
            let force = step.action == Action::ForceRun;
            let month = months[pick(months.len())];
            let shard = rng.random_range(0..shards);
            let id = world
                .spawn(
                    Role::Run {
                        month,
                        shard,
                        shards,
                        force,
                    },
                    Rules::Fleet,
                    false,
                    None,
                )
                .await?;
            Ok(format!(
                "run{} {} {shard}/{shards} (p{id})",
                if force { " --force" } else { "" },
                month_end(month)
            ))
        }
        Action::DuplicatePost { force } => {
            let replicas = world.running(|p| {
                !p.clean && p.rules == Rules::Fleet && matches!(p.role, Role::Serve { .. })
            });
            if replicas.is_empty() {
                return Ok("post: no replica".into());
            }
            let first = replicas[pick(replicas.len())];
            let second = replicas[rng.random_range(0..replicas.len())];
            let month = months[rng.random_range(0..months.len())];
            let key = format!("camp-{}-r{n}", world.plan.seed);
            let body = if rng.random_bool(0.5) {
                format!(
                    "{{\"business_date\":\"{}\",\"shards\":{shards},\"force\":{force}}}",
                    month_end(month)
                )
            } else {
                format!(
                    "{{\"business_date\":\"{}\",\"shards\":{shards},\"shard\":{},\"force\":{force}}}",
                    month_end(month),
                    rng.random_range(0..shards)
                )
            };
            world.post(first, &key, &body).await;
            world.post(second, &key, &body).await;
            Ok(format!(
                "POST /v1/runs {body} key {key} to p{first} and p{second}"
            ))
        }
        Action::Pause { all, http } => pause_or_resume(world, n, true, *all, *http, pick).await,
        Action::Resume { all, http } => pause_or_resume(world, n, false, *all, *http, pick).await,
    }
}

/// The operator pauses (`pause`) or resumes the fine settlement, or every job (`all`): with the
/// CLI, or with `http` through the endpoint of a replica chosen by `pick` (the CLI when none is
/// up). Pauses the campaign has not seen committed yet are stamped before a resume and after a
/// pause ([`World::mark_pauses_seen`]): the checker's `pauses` rule starts from those stamps.
async fn pause_or_resume(
    world: &World,
    step: usize,
    pause: bool,
    all: bool,
    http: bool,
    pick: impl Fn(usize) -> usize,
) -> Result<String> {
    let (verb, job) = (
        if pause { "pause" } else { "resume" },
        if all { "every job" } else { "fine-settlement" },
    );
    if !pause {
        world.mark_pauses_seen().await?;
    }
    let reason = format!("campaign step {step}");
    let replicas = world.running(|p| !p.clean && matches!(p.role, Role::Serve { .. }));
    let answer = match replicas.get(pick(replicas.len())).filter(|_| http) {
        Some(&id) => {
            let body = match (pause, all) {
                (true, true) => serde_json::json!({ "reason": reason }),
                (true, false) => serde_json::json!({ "job": "fine-settlement", "reason": reason }),
                (false, true) => serde_json::json!({}),
                (false, false) => serde_json::json!({ "job": "fine-settlement" }),
            };
            let path = format!("/v1/{verb}");
            match world.post_admin(id, &path, &body.to_string()).await {
                Ok((status, _)) => format!("POST {path} to p{id}: {status}"),
                Err(e) => format!("POST {path} to p{id}: no answer ({e})"),
            }
        }
        None => {
            let mut args = vec![verb];
            if !all {
                args.extend(["--job", "fine-settlement"]);
            }
            if pause {
                args.extend(["--reason", &reason]);
            }
            let out = world.command_output(&args, Rules::Fleet).await?;
            format!(
                "settlementd {}: exit {}",
                args.join(" "),
                out.status.code().unwrap_or(-1)
            )
        }
    };
    if pause {
        world.mark_pauses_seen().await?;
    }
    Ok(format!("{verb} {job}: {answer}"))
}

/// A process holding a RUNNING claim (chosen by `pick`), else any running process that faults
/// may touch.
async fn holder_or_replica(world: &World, pick: impl Fn(usize) -> usize) -> Option<usize> {
    let holders: Vec<usize> = world
        .holders()
        .await
        .into_iter()
        .filter(|id| {
            world
                .with_proc(*id, |p| !p.clean && !p.stopped)
                .unwrap_or(false)
        })
        .collect();
    if !holders.is_empty() {
        return Some(holders[pick(holders.len())]);
    }
    let any = world.running(|p| !p.clean && !p.stopped && matches!(p.role, Role::Serve { .. }));
    any.get(pick(any.len())).copied()
}

/// The RUNNING claims process `id` holds: (job, business date, shards, shard, attempt).
async fn claims_of(world: &World, id: usize) -> Vec<(String, chrono::NaiveDate, i32, i32, i32)> {
    let Ok(mut conn) = world.connect("campaign").await else {
        return Vec::new();
    };
    let held = sqlx::query_as(
        "SELECT job_name, business_date, shards, shard, attempt FROM job_runs
          WHERE status = 'RUNNING' AND owner LIKE $1",
    )
    .bind(format!("camp-p{id}/%"))
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    let _ = sqlx::Connection::close(conn).await;
    held
}

/// Whether any of `held` has moved past its attempt (taken over, or ended): `Some` with the
/// campaign process that holds it now, if one does.
async fn taken_over(
    world: &World,
    held: &[(String, chrono::NaiveDate, i32, i32, i32)],
) -> Option<Option<usize>> {
    let Ok(mut conn) = world.connect("campaign").await else {
        return None;
    };
    let mut moved = None;
    for (job, date, shards, shard, attempt) in held {
        let now: Option<(i32, String)> = sqlx::query_as(
            "SELECT attempt, owner FROM job_runs
              WHERE job_name = $1 AND business_date = $2 AND shards = $3 AND shard = $4",
        )
        .bind(job)
        .bind(date)
        .bind(shards)
        .bind(shard)
        .fetch_optional(&mut conn)
        .await
        .unwrap_or(None);
        if let Some((now, owner)) = now.filter(|(now, _)| now > attempt) {
            let _ = now;
            let heir = owner
                .strip_prefix("camp-p")
                .and_then(|o| o.split('/').next())
                .and_then(|n| n.parse().ok());
            moved = Some(heir);
        }
    }
    let _ = sqlx::Connection::close(conn).await;
    moved
}

/// SIGSTOPs `id`; with `between`, only at a moment when none of its sessions has a transaction
/// open or a statement in flight (tried up to 200 times, letting it run a little in between).
/// True when it was stopped between transactions.
async fn stop(world: &World, id: usize, between: bool) -> bool {
    let Some(proxy) = world.with_proc(id, |p| p.proxy.clone()) else {
        return false;
    };
    if !between {
        world.with_proc(id, |p| p.signal(libc::SIGSTOP, "STOP"));
        return false;
    }
    // Caught at the answer that ends a transaction (a batch's COMMIT, usually), held until the
    // process is stopped: it wakes with the next batch still to begin.
    let caught = proxy
        .catch_between_transactions(Duration::from_secs(4), || {
            world.with_proc(id, |p| p.signal(libc::SIGSTOP, "STOP"));
        })
        .await;
    if !caught {
        world.with_proc(id, |p| p.signal(libc::SIGSTOP, "STOP"));
    }
    caught
}

/// libraryd keys 3 returns of shard `shard` of `shards` late into `closed` (months that shard has
/// closed), then a one-shot `run` of one of them with the other rule starts; says what was done.
async fn late_for_the_other_rule(
    world: &World,
    step: usize,
    pick: u64,
    (shard, shards): (u32, u32),
    closed: &[chrono::NaiveDate],
    rng: &mut ChaCha8Rng,
) -> Result<String> {
    let keyed = key_late_returns(world, step, pick, 3, Some((shard, shards)), closed, rng).await?;
    let month = closed[rng.random_range(0..closed.len())];
    let run = world
        .spawn(
            Role::Run {
                month,
                shard,
                shards,
                force: false,
            },
            Rules::Other,
            false,
            None,
        )
        .await?;
    Ok(format!(
        "{keyed} returns of shard {shard}/{shards} keyed late into its {} closed months, run p{run} \
         ({}) with the other rule",
        closed.len(),
        month_end(month)
    ))
}

/// The campaign's months (first days) whose fine settlement is SUCCESS on shard `shard` of
/// `shards`.
async fn closed_months(world: &World, shard: u32, shards: u32) -> Result<Vec<chrono::NaiveDate>> {
    let mut conn = world.connect("campaign").await?;
    let ends: Vec<chrono::NaiveDate> = sqlx::query_scalar(
        "SELECT business_date FROM job_runs
          WHERE job_name = 'fine-settlement' AND shards = $1 AND shard = $2 AND status = 'SUCCESS'",
    )
    .bind(shards as i32)
    .bind(shard as i32)
    .fetch_all(&mut conn)
    .await?;
    let _ = sqlx::Connection::close(conn).await;
    Ok(world
        .plan
        .months
        .iter()
        .copied()
        .filter(|m| ends.contains(&month_end(*m)))
        .collect())
}

/// libraryd keys `n` returns of loans still out (of shard `only` when given) on random days of
/// `months`; returns how many it keyed.
async fn key_late_returns(
    world: &World,
    step: usize,
    pick: u64,
    n: u32,
    only: Option<(u32, u32)>,
    months: &[chrono::NaiveDate],
    rng: &mut ChaCha8Rng,
) -> Result<usize> {
    let (shard, shards) = only.unwrap_or((0, 1));
    let mut conn = world.connect("libraryd").await?;
    sqlx::query("SET statement_timeout = '10s'")
        .execute(&mut conn)
        .await?;
    let ids: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM loans WHERE returned_on IS NULL AND id % $3 = $4
          ORDER BY md5(id::text || $1) LIMIT $2",
    )
    .bind(pick.to_string())
    .bind(i64::from(n))
    .bind(i64::from(shards))
    .bind(i64::from(shard))
    .fetch_all(&mut conn)
    .await?;
    for id in &ids {
        let month = months[rng.random_range(0..months.len())];
        let day = month + chrono::Days::new(rng.random_range(0..28));
        if let Err(e) = sqlx::query("UPDATE loans SET returned_on = $2 WHERE id = $1")
            .bind(id)
            .bind(day)
            .execute(&mut conn)
            .await
        {
            world.note(format!("step {step}: a late return was refused: {e}"));
        }
    }
    let _ = sqlx::Connection::close(conn).await;
    Ok(ids.len())
}

/// libraryd edits `n` settled loans, one transaction each.
async fn edit_settled(world: &World, pick: u64, n: u32, rng: &mut ChaCha8Rng) -> Result<String> {
    let months = &world.plan.months;
    let mut conn = world.connect("libraryd").await?;
    sqlx::query("SET statement_timeout = '10s'")
        .execute(&mut conn)
        .await?;
    let loans: Vec<(i64, Option<chrono::NaiveDate>)> = sqlx::query_as(
        "SELECT id, CASE WHEN isfinite(returned_on) THEN returned_on END FROM loans
          WHERE fine_settled_at IS NOT NULL ORDER BY md5(id::text || $1) LIMIT $2",
    )
    .bind(pick.to_string())
    .bind(i64::from(n))
    .fetch_all(&mut conn)
    .await?;
    let mut done = Vec::new();
    for (id, returned) in loans {
        let (sql, what): (String, &str) = match rng.random_range(0..12) {
            0..=3 => {
                // Within its month: the return moves a few days (or the due date does).
                let Some(ret) = returned else { continue };
                let first = chrono::NaiveDate::from_ymd_opt(
                    chrono::Datelike::year(&ret),
                    chrono::Datelike::month(&ret),
                    1,
                )
                .unwrap_or(ret);
                let day = first + chrono::Days::new(rng.random_range(0..28));
                (
                    format!("UPDATE loans SET returned_on = '{day}' WHERE id = {id}"),
                    "repriced",
                )
            }
            4 => (
                format!(
                    "UPDATE loans SET due_on = due_on + {} WHERE id = {id}",
                    rng.random_range(-9..9)
                ),
                "due moved",
            ),
            5 | 6 => {
                let month = months[rng.random_range(0..months.len())];
                let day = month + chrono::Days::new(rng.random_range(0..28));
                (
                    format!("UPDATE loans SET returned_on = '{day}' WHERE id = {id}"),
                    "moved",
                )
            }
            7 => (
                format!("UPDATE loans SET returned_on = NULL WHERE id = {id}"),
                "return undone",
            ),
            8 => (
                format!("UPDATE loans SET due_on = NULL WHERE id = {id}"),
                "due removed",
            ),
            9 => (
                // A member merge: the loan goes to another member.
                format!("UPDATE loans SET member_id = member_id + 1000 WHERE id = {id}"),
                "member moved",
            ),
            10 => {
                // A reload of the loan: deleted and inserted again under its id without
                // settlementd's columns, for another member and returned in another month.
                let month = months[rng.random_range(0..months.len())];
                let day = month + chrono::Days::new(rng.random_range(0..28));
                (
                    format!(
                        "BEGIN;
                         CREATE TEMP TABLE kept ON COMMIT DROP AS
                             SELECT id, member_id, book_id, borrowed_on, due_on FROM loans
                              WHERE id = {id};
                         DELETE FROM loans WHERE id = {id};
                         INSERT INTO loans (id, member_id, book_id, borrowed_on, due_on, returned_on)
                             SELECT id, member_id + 2000, book_id, borrowed_on, due_on, '{day}'
                               FROM kept;
                         COMMIT"
                    ),
                    "re-created",
                )
            }
            _ => (format!("DELETE FROM loans WHERE id = {id}"), "deleted"),
        };
        match sqlx::raw_sql(&sql).execute(&mut conn).await {
            Ok(_) => done.push(format!("{id} {what}")),
            Err(e) => {
                world.note(format!("an edit of loan {id} was refused: {e}"));
                let _ = sqlx::raw_sql("ROLLBACK").execute(&mut conn).await;
            }
        }
    }
    let _ = sqlx::Connection::close(conn).await;
    Ok(format!("libraryd edits: {}", done.join(", ")))
}

/// Stops every fault, then brings the world to rest: the faulted fleet is stopped (SIGTERM), every
/// pause is resumed, corrections are finished with their keys, one clean replica per shard (each
/// month's pinned rule) settles what is left, requests nobody answered are sent again; `verify` of
/// every month.
pub async fn quiesce(world: &Arc<World>, background: &mut JoinSet<()>) -> Result<Played> {
    while background.join_next().await.is_some() {}
    let started = Instant::now();
    for id in world.running(|_| true) {
        world.with_proc(id, |p| {
            p.proxy.set(Net::Pass);
            p.signal(libc::SIGCONT, "CONT");
        });
    }
    let mut conn = world.connect("campaign").await?;
    sqlx::query("UPDATE campaign_config SET slow_ms = 0")
        .execute(&mut conn)
        .await?;
    let _ = sqlx::Connection::close(conn).await;
    for id in world.running(|_| true) {
        world.with_proc(id, |p| p.signal(libc::SIGTERM, "TERM"));
    }
    wait_all_exit(world, Duration::from_secs(20)).await;

    // Every pause left is resumed, as the operator would: nothing is claimed while paused, and
    // the world must come to rest settled.
    world.mark_pauses_seen().await?;
    for attempt in 1..=40 {
        let out = world.command_output(&["resume"], Rules::Fleet).await?;
        if out.status.success() {
            break;
        }
        if attempt == 40 {
            world.note(format!(
                "settlementd resume failed 40 times: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Corrections next: until each completes, its month is held and no replica runs it.
    let asked = world
        .corrections
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    for c in &asked {
        for _ in 0..40 {
            let out = world
                .command_output(
                    &[
                        "correct",
                        "--json",
                        "--business-date",
                        &month_end(c.month).to_string(),
                        "--reason",
                        "campaign: the month moves to the other rule",
                        "--key",
                        &c.key,
                        "--shards",
                        &c.shards.to_string(),
                    ],
                    Rules::Other,
                )
                .await?;
            if out.status.success() {
                break;
            }
            let err = String::from_utf8_lossy(&out.stderr).to_string();
            if out.status.code() == Some(3) && err.contains("with another request") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    world.write_pinned_config().await?;
    let shards = world.shards.load(Ordering::SeqCst);
    for shard in 0..shards {
        world
            .spawn(Role::Serve { shard, shards }, Rules::Pinned, true, None)
            .await?;
    }
    let clean = world.running(|p| p.clean);
    // Up before anything is asked of them (a SIGTERM before its handler is installed kills).
    for id in &clean {
        let port = world.with_proc(*id, |p| p.http).flatten();
        for _ in 0..100 {
            match port {
                Some(port) if crate::world::healthy(port).await => break,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    // Requests that got no answer are sent again, as their client would.
    let unanswered: Vec<(String, String)> = world
        .requests
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|r| r.answers.is_empty())
        .map(|r| (r.key.clone(), r.body.clone()))
        .collect();
    if !unanswered.is_empty() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    for (key, body) in &unanswered {
        for attempt in 0..20 {
            world.post(clean[attempt % clean.len()], key, body).await;
            let answered = world
                .requests
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|r| &r.key == key && !r.answers.is_empty());
            if answered {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    let quiesced = loop {
        match open_work(world, shards).await {
            Ok(None) => break Ok(started.elapsed()),
            Ok(Some(open)) if started.elapsed() > QUIESCE_BOUND => break Err(open),
            Err(e) if started.elapsed() > QUIESCE_BOUND => break Err(e.to_string()),
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    };
    for id in world.running(|_| true) {
        world.with_proc(id, |p| p.signal(libc::SIGTERM, "TERM"));
    }
    wait_all_exit(world, Duration::from_secs(20)).await;

    let mut verified = Vec::new();
    for month in &world.plan.months {
        let out = world
            .command_output(
                &[
                    "verify",
                    "--json",
                    "--business-date",
                    &month_end(*month).to_string(),
                ],
                Rules::Pinned,
            )
            .await?;
        verified.push((
            month_end(*month),
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        ));
    }
    Ok(Played { quiesced, verified })
}

/// Waits up to `within` for every process to exit; SIGKILLs the rest (the checker reports them).
async fn wait_all_exit(world: &World, within: Duration) {
    let deadline = Instant::now() + within;
    while world.reap() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for id in world.running(|_| true) {
        world.note(format!(
            "p{id} did not exit within {} s of SIGTERM",
            within.as_secs()
        ));
        world.with_proc(id, |p| p.signal(libc::SIGKILL, "KILL after TERM"));
    }
    while world.reap() > 0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What is still open, in one line; `None` when the world is at rest: every month SUCCESS on every
/// shard of the count (the settlement's, and the member statements' with no journal row after
/// their mark), no return of the months unsettled that the rule can price, no edit queued,
/// no claim RUNNING, no correction unfinished, no request shard unserved
/// ([`crate::checker::request_shard_at_rest`]), no job paused. Requests of every shard count: the
/// replicas serve those accepted before a reshard too (seed 1009), and one whose claim was just
/// closed as abandoned is still to be served (seed 6: the world was called at rest in the moment
/// between the two, and the `requests` check found it left `running`).
async fn open_work(world: &World, shards: u32) -> Result<Option<String>> {
    let mut conn = world.connect("campaign").await?;
    let ends: Vec<chrono::NaiveDate> = world.plan.months.iter().map(|m| month_end(*m)).collect();
    type Open = (i64, i64, i64, i64, i64, i64, i64);
    let (missing, unsettled, edits, running, corrections, paused, unstated): Open =
        sqlx::query_as(&format!(
            "SELECT
                 (SELECT count(*) FROM unnest($1::date[]) d, generate_series(0, $2 - 1) s
                   WHERE NOT EXISTS (SELECT 1 FROM job_runs r
                                      WHERE r.job_name = 'fine-settlement' AND r.business_date = d
                                        AND r.shards = $2 AND r.shard = s AND r.status = 'SUCCESS')),
                 (SELECT count(*) FROM loans
                   WHERE fine_settled_at IS NULL AND returned_on BETWEEN $3 AND $4
                     AND due_on IS NOT NULL AND isfinite(due_on)),
                 (SELECT count(*) FROM loan_changes),
                 (SELECT count(*) FROM job_runs WHERE status = 'RUNNING'),
                 (SELECT count(*) FROM fine_corrections WHERE completed_at IS NULL),
                 (SELECT count(*) FROM job_pauses),
                 -- The member statements: each month and shard SUCCESS, with no journal row after
                 -- its mark.
                 (SELECT count(*) FROM unnest($1::date[]) AS d(day)
                   CROSS JOIN generate_series(0, $2 - 1) AS s(shard)
                    LEFT JOIN member_statement_marks k
                      ON k.business_date = d.day AND k.shards = $2 AND k.shard = s.shard
                   WHERE NOT EXISTS (SELECT 1 FROM job_runs r
                                      WHERE r.job_name = '{statements}' AND r.business_date = d.day
                                        AND r.shards = $2 AND r.shard = s.shard
                                        AND r.status = 'SUCCESS')
                      OR {late} > 0)",
            statements = settlementd::jobs::member_statements::JOB_NAME,
            late = settlementd::jobs::member_statements::late_rows("date_trunc('month', d.day)::date"),
        ))
        .bind(&ends)
        .bind(shards as i32)
        .bind(world.plan.months[0])
        .bind(ends[ends.len() - 1])
        .fetch_one(&mut conn)
        .await?;
    let shards_of_requests: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT state, detail FROM run_request_shards WHERE state <> 'succeeded'")
            .fetch_all(&mut conn)
            .await?;
    let requests = shards_of_requests
        .iter()
        .filter(|(state, detail)| !crate::checker::request_shard_at_rest(state, detail.as_deref()))
        .count();
    let _ = sqlx::Connection::close(conn).await;
    if missing + unsettled + edits + running + corrections + paused + unstated == 0 && requests == 0
    {
        return Ok(None);
    }
    Ok(Some(format!(
        "{missing} month-shards not SUCCESS, {unsettled} returns unsettled, {edits} edits queued, \
         {running} claims RUNNING, {corrections} corrections unfinished, {requests} requests \
         unserved, {paused} jobs paused, {unstated} month-shards of statements not up to date"
    )))
}
