//! One seed, one schedule: the world's shape and the list of actions, all drawn up front from a
//! ChaCha stream seeded with the schedule's seed, before anything runs.
//!
//! What the seed fixes is *what* is done and in which order, with which parameters. *Which*
//! process an action lands on is chosen when it is played, from the processes that qualify then
//! (those holding a RUNNING claim, say), by a number also drawn here; and where in a run a signal
//! lands depends on timing. So a replay repeats the schedule exactly, and the interleaving as
//! closely as two runs of real processes on one machine can.
//!
//! **Adding an action.** An action is one variant of [`Action`] with its weight in [`CATALOG`] and
//! its parameters drawn in [`draw`]; `faults::play` plays it, and when it may make a process end
//! badly, it records the fault (`World::fault`) so the exit is accounted for. `Pause` and
//! `Resume` came in that way: they call the product's command or its endpoint (drawn per step),
//! the campaign's log records each pause and resume (`campaign_pause_log`), and the checker's
//! `pauses` rule judges the claims and batches around them.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;

/// Steps per schedule unless `--steps` says otherwise.
pub const DEFAULT_STEPS: u32 = 10;

/// A fine rule as the campaign draws it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub daily_rate_cents: i64,
    pub grace_days: i64,
    pub max_cents: i64,
}

/// What a proxy does to a replica's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetFault {
    /// Nothing passes, nothing is closed, for a while.
    Blackhole,
    /// Every open connection is closed with an RST.
    Reset,
    /// Every chunk waits this long, for a while.
    Delay(Duration),
}

/// One thing the campaign does to the fleet, the database or the data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// SIGKILL a process that holds a RUNNING claim; the orchestrator starts another replica of
    /// its shard.
    KillHolder,
    /// SIGSTOP a process that holds a RUNNING claim for the lease plus `extra`, then SIGCONT;
    /// `between_batches`: stopped only when none of its sessions has a transaction open (so the
    /// fence is what must stop it when it wakes).
    StopHolder {
        extra: Duration,
        between_batches: bool,
    },
    /// SIGTERM a replica; the orchestrator starts another.
    Terminate,
    /// `pg_ctl stop -m immediate`, down for a while, then started again (crash recovery).
    RestartPostgres { down: Duration },
    /// A network fault on one replica's connections, for `lasting`.
    Network { fault: NetFault, lasting: Duration },
    /// One more replica whose clock is off by `secs` (libfaketime).
    SkewedReplica { secs: i64 },
    /// The fleet moves to another shard count mid-month.
    Reshard,
    /// libraryd keys `n` returns of loans still out into the campaign's months.
    LateReturns { n: u32 },
    /// libraryd edits `n` settled loans (dates moved inside or out of their month, a return
    /// undone, a due date made unpriceable, a deletion).
    EditSettled { n: u32 },
    /// A replica configured with the other rule starts (and is refused for months pinned to the
    /// first), and a one-shot `run` with it is tried.
    RuleChange,
    /// `settlementd correct` re-pins one month to the other rule, under a key.
    Correct,
    /// `settlementd run --force` of one month and shard.
    ForceRun,
    /// `settlementd run` of one month and shard.
    Run,
    /// `POST /v1/runs` to one replica, and the same request (same key) to another.
    DuplicatePost { force: bool },
    /// The operator pauses the fine settlement (`all`: every job), with `settlementd pause` or, with
    /// `http`, `POST /v1/pause` to a replica.
    Pause { all: bool, http: bool },
    /// The operator resumes the fine settlement (`all`: every job), with `settlementd resume` or,
    /// with `http`, `POST /v1/resume` to a replica.
    Resume { all: bool, http: bool },
}

/// The kinds of action and how often each is drawn (weights).
pub const CATALOG: &[(&str, u32)] = &[
    ("kill_holder", 12),
    ("stop_holder", 8),
    ("stop_holder_between_batches", 10),
    ("terminate", 5),
    ("restart_postgres", 4),
    ("network", 7),
    ("skewed_replica", 5),
    ("reshard", 3),
    ("late_returns", 10),
    ("edit_settled", 9),
    ("rule_change", 5),
    ("correct", 3),
    ("force_run", 5),
    ("run", 4),
    ("duplicate_post", 6),
    ("pause", 6),
    ("resume", 4),
];

/// One step: wait, then act. `pick` chooses among the candidates the action finds when played.
#[derive(Debug, Clone)]
pub struct Step {
    pub wait: Duration,
    pub action: Action,
    pub pick: u64,
}

/// Everything a seed decides.
#[derive(Debug, Clone)]
pub struct Plan {
    pub seed: u64,
    /// The months of loans (first days), oldest first.
    pub months: Vec<chrono::NaiveDate>,
    pub loans_per_month: u32,
    /// Shard count at the start, and the one a reshard moves to.
    pub shards: u32,
    pub reshard_to: u32,
    /// Replicas per shard at the start.
    pub replicas: u32,
    /// One more replica at the start whose clock is off by this many seconds (libfaketime).
    pub skewed_at_start: Option<i64>,
    pub batch_size: u32,
    /// Each `UPDATE` of `loans` sleeps this long (statement-level trigger).
    pub slow: Duration,
    pub ttl_secs: u64,
    pub heartbeat_secs: u64,
    /// The fleet's rule, and the other one (a rule change).
    pub rule: Rule,
    pub other_rule: Rule,
    /// Seeds for the data.
    pub data_seed: u64,
    pub steps: Vec<Step>,
}

/// The plan of seed `seed` with `steps` steps, for the months ending with `last_month` (first day).
pub fn plan(seed: u64, steps: u32, last_month: chrono::NaiveDate) -> Plan {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let months: Vec<chrono::NaiveDate> = (0..4)
        .rev()
        .map(|back| months_before(last_month, back))
        .collect();
    let shards = rng.random_range(2..=3);
    let reshard_to = if shards == 2 { 3 } else { 2 };
    let rule = Rule {
        daily_rate_cents: [25, 40, 50][rng.random_range(0..3)],
        grace_days: rng.random_range(0..=2),
        max_cents: [1_000, 1_500, 2_500][rng.random_range(0..3)],
    };
    let other_rule = Rule {
        daily_rate_cents: rule.daily_rate_cents + 15,
        grace_days: rule.grace_days,
        max_cents: rule.max_cents + 500,
    };
    let mut plan = Plan {
        seed,
        months,
        loans_per_month: rng.random_range(350..=550),
        shards,
        reshard_to,
        replicas: 2,
        skewed_at_start: None,
        batch_size: rng.random_range(15..=30),
        slow: Duration::from_millis(rng.random_range(150..=250)),
        ttl_secs: 3,
        heartbeat_secs: 1,
        rule,
        other_rule,
        data_seed: rng.random(),
        steps: Vec::new(),
    };
    plan.skewed_at_start = rng.random_bool(0.5).then(|| skew(&mut rng));
    let mut resharded = false;
    for _ in 0..steps {
        let mut action = draw(&mut rng);
        // One reshard per schedule; the rest of its weight goes to killing.
        if action == Action::Reshard {
            if resharded {
                action = Action::KillHolder;
            }
            resharded = true;
        }
        plan.steps.push(Step {
            wait: Duration::from_millis(rng.random_range(250..=1_200)),
            action,
            pick: rng.random(),
        });
    }
    plan
}

/// One action drawn by weight, with its parameters.
pub fn draw(rng: &mut ChaCha8Rng) -> Action {
    let total: u32 = CATALOG.iter().map(|(_, w)| w).sum();
    let mut at = rng.random_range(0..total);
    let kind = CATALOG
        .iter()
        .find(|(_, w)| {
            if at < *w {
                return true;
            }
            at -= w;
            false
        })
        .map_or("kill_holder", |(k, _)| k);
    let ms =
        |rng: &mut ChaCha8Rng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..=hi));
    match kind {
        "kill_holder" => Action::KillHolder,
        "stop_holder" => Action::StopHolder {
            extra: ms(rng, 500, 2_500),
            between_batches: false,
        },
        "stop_holder_between_batches" => Action::StopHolder {
            extra: ms(rng, 500, 2_500),
            between_batches: true,
        },
        "terminate" => Action::Terminate,
        "restart_postgres" => Action::RestartPostgres {
            down: ms(rng, 300, 2_000),
        },
        "network" => {
            let fault = match rng.random_range(0..3) {
                0 => NetFault::Blackhole,
                1 => NetFault::Reset,
                _ => NetFault::Delay(ms(rng, 50, 400)),
            };
            Action::Network {
                fault,
                lasting: ms(rng, 1_000, 5_000),
            }
        }
        "skewed_replica" => Action::SkewedReplica { secs: skew(rng) },
        "reshard" => Action::Reshard,
        "late_returns" => Action::LateReturns {
            n: rng.random_range(1..=12),
        },
        "edit_settled" => Action::EditSettled {
            n: rng.random_range(1..=8),
        },
        "rule_change" => Action::RuleChange,
        "correct" => Action::Correct,
        "force_run" => Action::ForceRun,
        "run" => Action::Run,
        "pause" => Action::Pause {
            all: rng.random_bool(0.25),
            http: rng.random_bool(0.5),
        },
        "resume" => Action::Resume {
            all: rng.random_bool(0.25),
            http: rng.random_bool(0.5),
        },
        _ => Action::DuplicatePost {
            force: rng.random_bool(0.5),
        },
    }
}

/// A clock skew in seconds: 10 s to 2 h, ahead more often than behind (ahead is what tempts a
/// replica to take over a live lease).
fn skew(rng: &mut ChaCha8Rng) -> i64 {
    let secs = rng.random_range(10..=7_200);
    if rng.random_bool(0.7) {
        secs
    } else {
        -secs
    }
}

/// The first day of the month `back` months before `month` (a first day).
pub fn months_before(month: chrono::NaiveDate, back: u32) -> chrono::NaiveDate {
    month
        .checked_sub_months(chrono::Months::new(back))
        .unwrap_or(month)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_draws_one_schedule() {
        let last = chrono::NaiveDate::from_ymd_opt(2026, 10, 1).unwrap();
        let a = plan(7, 30, last);
        let b = plan(7, 30, last);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        assert_ne!(format!("{a:?}"), format!("{:?}", plan(8, 30, last)));
        assert_eq!(a.months.len(), 4);
        assert_eq!(a.months[3], last);
    }
}
