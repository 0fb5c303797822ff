//! What a run or a correction of a month would write, read and never written (`run --dry-run`,
//! `correct --dry-run`, `POST /v1/runs/dry-run`).
//!
//! One statement per month over the shards asked for, on the caller's read-only snapshot, made of
//! the batches' own parts: the month index's unsettled returns with [`super::HELD_ROW`],
//! [`super::ODD_ROW`] and the rule's SQL expression, the same head on the record
//! ([`super::journal::HEAD_AFTER`]) a batch's entry continues, and for edits of settled loans and
//! for corrections the same pricing CTEs as [`super::journal::reprice`] ([`Pricing`]), read
//! without their lock. What it reports for each loan is what the batch would write as its journal
//! entry (before, after), so the totals, the kinds and each member's change are those of the run:
//! `tests/it/preview.rs` runs both on the benchmark's history shape and compares them.
//!
//! Its cost is one pass over the month's unsettled returns and the month's queued edits (for a
//! correction, its journal's loans), the run's own reads without its writes: `cargo bench --bench
//! settle`, case `D`, measures it against `L`.

use super::correction::loans_of_month;
use super::journal::{self, queue_targets, rule_identity, Pricing};
use super::{parse_sum, HELD_ROW, MONTH_KEY_L, ODD_ROW};
use crate::calendar::BusinessDate;
use crate::fine::FineRule;
use crate::job_layer::{Preview, ShardPreview};
use crate::numbers::{count, money, things};
use serde_json::{json, Map, Value};
use sqlx::PgConnection;
use std::collections::BTreeMap;

/// How many members a preview lists (the largest changes first), and how many held loans.
pub const TOP_MEMBERS: i64 = 20;
pub const HELD_LISTED: i64 = 20;

/// Which writer is previewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    /// The month's run: its unsettled returns settled, its queued edits re-priced.
    Run,
    /// `settlementd correct`: its queued edits and every loan of its journal re-priced, its
    /// unsettled returns settled, each only where the fine changes.
    Correction,
}

/// What one kind of write would do in one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Kind {
    pub loans: u64,
    /// Of them, those whose money changes (after ≠ before).
    pub changed: u64,
    /// The money on the record of those loans now, and after the write.
    pub before_cents: i128,
    pub after_cents: i128,
}

impl Kind {
    pub fn net_cents(&self) -> i128 {
        self.after_cents - self.before_cents
    }

    fn json(&self) -> Value {
        json!({
            "loans": self.loans,
            "changed": self.changed,
            "cents": number(self.after_cents),
            "net_cents": number(self.net_cents()),
        })
    }
}

/// A loan the rule cannot price, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Held {
    pub shard: u32,
    pub id: i64,
    pub why: String,
}

/// One member's change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberChange {
    /// `None`: loans deleted in libraryd, whose member the record does not keep.
    pub member_id: Option<i64>,
    pub loans: u64,
    pub before_cents: i128,
    pub after_cents: i128,
}

/// What a month's writer would do: by shard and kind (`settle`, `reprice`, `correct`, `reverse`,
/// `delete`, `hold`), the odd rows it settles, the first held loans, and the members whose money
/// changes.
#[derive(Debug, Clone, Default)]
pub struct MonthPreview {
    pub by_shard: BTreeMap<u32, BTreeMap<String, Kind>>,
    /// Loans written per shard, each once: a loan whose money leaves another month or member as
    /// it is settled has two entries (`reverse` there, `settle` here) and is one write.
    pub writes_by_shard: BTreeMap<u32, u64>,
    pub odd_rows: BTreeMap<u32, u64>,
    pub held: Vec<Held>,
    pub members_changed: u64,
    pub members: Vec<MemberChange>,
}

/// The kinds a writer reports, in the order they are shown.
fn kinds(writer: Writer) -> &'static [&'static str] {
    match writer {
        Writer::Run => &["settle", "reprice", "reverse", "delete", "hold"],
        Writer::Correction => &["correct", "reverse", "delete", "hold"],
    }
}

impl MonthPreview {
    /// Loans it would write, over every shard, each once (held ones are left as they are).
    pub fn writes(&self) -> u64 {
        self.writes_by_shard.values().sum()
    }

    /// As the job layer shows it ([`crate::job_layer::dry`]).
    pub fn to_preview(&self, writer: Writer, shards: &[u32]) -> Preview {
        Preview {
            shards: shards
                .iter()
                .map(|&shard| {
                    let json = self.shard_json(writer, shard);
                    let writes = json.get("writes").and_then(Value::as_u64).unwrap_or(0);
                    let text = self.shard_text(writer, shard);
                    let held = self
                        .held
                        .iter()
                        .filter(|h| h.shard == shard)
                        .map(|h| (h.id, h.why.clone()))
                        .collect();
                    (
                        shard,
                        ShardPreview {
                            writes,
                            held,
                            json,
                            text,
                        },
                    )
                })
                .collect(),
            json: self.month_json(),
            text: self.month_text(),
        }
    }

    /// The shard's object of `run --dry-run --json`: each kind the writer has, at zero when it
    /// would do none, the odd rows, the held loans listed, and the fines it would write.
    pub fn shard_json(&self, writer: Writer, shard: u32) -> Map<String, Value> {
        let none = BTreeMap::new();
        let kinds_of = self.by_shard.get(&shard).unwrap_or(&none);
        let mut out = Map::new();
        let mut written = Kind::default();
        for kind in kinds(writer) {
            let k = kinds_of.get(*kind).cloned().unwrap_or_default();
            if *kind != "hold" {
                written.loans += k.loans;
                written.changed += k.changed;
                written.before_cents += k.before_cents;
                written.after_cents += k.after_cents;
            }
            out.insert((*kind).to_string(), k.json());
        }
        let held: Vec<Value> = self
            .held
            .iter()
            .filter(|h| h.shard == shard)
            .map(|h| json!({"id": h.id, "why": h.why}))
            .collect();
        if let Some(Value::Object(hold)) = out.get_mut("hold") {
            hold.insert("first".into(), Value::Array(held));
        }
        out.insert(
            "odd_rows".into(),
            self.odd_rows.get(&shard).copied().unwrap_or(0).into(),
        );
        out.insert(
            "writes".into(),
            self.writes_by_shard.get(&shard).copied().unwrap_or(0).into(),
        );
        out.insert("fine_cents".into(), number(written.after_cents));
        out.insert("net_cents".into(), number(written.net_cents()));
        out
    }

    /// The month's part of `run --dry-run --json`: the members whose money changes, the largest
    /// changes first.
    pub fn month_json(&self) -> Map<String, Value> {
        let members: Vec<Value> = self
            .members
            .iter()
            .map(|m| {
                json!({
                    "member_id": m.member_id,
                    "loans": m.loans,
                    "now_cents": number(m.before_cents),
                    "after_cents": number(m.after_cents),
                    "change_cents": number(m.after_cents - m.before_cents),
                })
            })
            .collect();
        let mut out = Map::new();
        out.insert("members_changed".into(), self.members_changed.into());
        out.insert("members".into(), Value::Array(members));
        out
    }

    /// The shard in words: one line per kind it would do.
    pub fn shard_text(&self, writer: Writer, shard: u32) -> String {
        let none = BTreeMap::new();
        let kinds_of = self.by_shard.get(&shard).unwrap_or(&none);
        let mut out = String::new();
        for kind in kinds(writer) {
            let Some(k) = kinds_of.get(*kind).filter(|k| k.loans > 0) else {
                continue;
            };
            let line = match *kind {
                "settle" => format!(
                    "settle {}: fines {}",
                    things(k.loans, "loan", "loans"),
                    cents(k.after_cents)
                ),
                "hold" => format!(
                    "hold {} the rule cannot price (left unsettled)",
                    things(k.loans, "loan", "loans")
                ),
                _ => format!(
                    "{kind} {} ({} changed): {} → {}, net {}",
                    things(k.loans, "loan", "loans"),
                    count(k.changed),
                    cents(k.before_cents),
                    cents(k.after_cents),
                    signed(k.net_cents())
                ),
            };
            out.push_str(&format!("    {line}\n"));
        }
        if let Some(odd) = self.odd_rows.get(&shard).filter(|n| **n > 0) {
            out.push_str(&format!(
                "    of them {} with dates that contradict each other (settled, counted)\n",
                things(*odd, "odd row", "odd rows")
            ));
        }
        for h in self.held.iter().filter(|h| h.shard == shard) {
            out.push_str(&format!("      held loan {}: {}\n", h.id, h.why));
        }
        if out.is_empty() {
            out.push_str("    nothing to write\n");
        }
        out
    }

    /// The members in words: a table, the largest changes first.
    pub fn month_text(&self) -> String {
        if self.members.is_empty() {
            return "  no member's fines change\n".to_string();
        }
        let mut out = format!(
            "  {} whose fines change; the largest changes:\n  {:>12}  {:>6}  {:>16}  {:>16}  {:>16}\n",
            things(self.members_changed, "member", "members"),
            "member",
            "loans",
            "now",
            "after",
            "change"
        );
        for m in &self.members {
            let member = m
                .member_id
                .map_or_else(|| "(deleted)".to_string(), |id| id.to_string());
            out.push_str(&format!(
                "  {member:>12}  {:>6}  {:>16}  {:>16}  {:>16}\n",
                count(m.loans as i128),
                money(m.before_cents),
                money(m.after_cents),
                signed_money(m.after_cents - m.before_cents)
            ));
        }
        out.push_str("  (money in the fine rule's units: cents / 100)\n");
        out
    }
}

/// A sum of cents as a JSON number, however large (serde_json's arbitrary precision is off, so
/// an i128 goes through its text).
fn number(n: i128) -> Value {
    n.to_string().parse::<Value>().unwrap_or(Value::Null)
}

/// "52,176.50 (5,217,650 cents)".
fn cents(n: i128) -> String {
    format!("{} ({} cents)", money(n), count(n))
}

fn signed(n: i128) -> String {
    match n {
        n if n > 0 => format!("+{}", cents(n)),
        n => cents(n),
    }
}

fn signed_money(n: i128) -> String {
    match n {
        n if n > 0 => format!("+{}", money(n)),
        n => money(n),
    }
}

/// The filter of a loan id to the shards of the array `$3` (of the count `$2`).
fn any_shard(id: &str) -> String {
    format!("(({id} % $2 + $2) % $2) = ANY($3::int[])")
}

/// The statement of `writer`'s preview. Parameters: `$1` month (first day), `$2` shard count,
/// `$3` the shards (int[]), `$4` how many held loans to list, `$5`..`$7` the rule, `$8` its
/// identity, `$9` how many members to list, `$10` the correction's key (NULL for a run), `$11`
/// the kind of the entries it prices.
///
/// A run's loans are what its batches write, entry by entry (each one's money on the record
/// before and after): its unsettled returns as a batch settles them (continuing a head that was
/// in the month for the loan's member, else from 0, with the head's money taken out of where it
/// was), then its queued edits as [`Pricing`] prices them — except those of loans the walk
/// settles, whose edits the walk supersedes. A correction's are what it writes per loan: the
/// fine in `loans` before (`was`, which a fine edited by hand makes differ from the record) and
/// after, as its `fine_adjustments` rows record them.
fn statement(writer: Writer) -> String {
    let fine = FineRule::sql_params(5);
    let shard_of = |id: &str| format!("(({id} % $2 + $2) % $2)::int");
    let queue = Pricing {
        prefix: "q_",
        shard: &any_shard,
        settles_returns: false,
        lock: "",
    };
    let kind_of = "CASE e.kind WHEN 'repriced' THEN 'reprice' WHEN 'corrected' THEN 'correct'
                        WHEN 'reversed' THEN 'reverse' ELSE 'delete' END";
    // A correction's loans, once each: as its fine_adjustments rows see them.
    let per_loan = |p: &str| {
        format!(
            "SELECT {shard}, CASE WHEN w.stays THEN 'correct' ELSE 'reverse' END, w.id, w.member_id,
                    w.was, CASE WHEN w.stays THEN w.new ELSE 0 END, false, NULL::date
               FROM {p}written w
             UNION ALL
             SELECT {gone}, 'delete', g.id, g.member, g.before, 0::bigint, false, NULL::date
               FROM {p}gone g",
            shard = shard_of("w.id"),
            gone = shard_of("g.id"),
        )
    };
    let (ctes, moves) = match writer {
        Writer::Run => (
            format!(
                "returns AS MATERIALIZED (
                     SELECT {shard} AS shard, l.id::bigint AS id, l.member_id::bigint AS member_id,
                            {HELD_ROW} AS held, {ODD_ROW} AS odd, l.due_on,
                            CASE WHEN {HELD_ROW} THEN NULL ELSE {fine} END AS after,
                            COALESCE(h.after_cents, 0) AS head_after, h.month AS head_month,
                            COALESCE(h.member_id, l.member_id)::bigint AS head_member,
                            COALESCE({leaves}, false) AS moves,
                            COALESCE(h.month = $1::date
                                     AND COALESCE(h.member_id, l.member_id) = l.member_id, false)
                              AS same_place
                       FROM loans l LEFT JOIN fine_heads h ON h.loan_id = l.id
                      WHERE {MONTH_KEY_L} = $1::date::timestamp
                        AND l.fine_settled_at IS NULL AND l.returned_on IS NOT NULL
                        AND {any}
                 ), {targets},
                 q_targets AS MATERIALIZED (
                     SELECT t.* FROM q0_targets t
                      WHERE NOT EXISTS (SELECT 1 FROM returns r WHERE r.id = t.loan_id AND NOT r.held)
                 ), {pricing}",
                targets = queue_targets("q0_", &any_shard, "ALL"),
                pricing = queue.ctes(),
                shard = shard_of("l.id"),
                any = any_shard("l.id"),
                leaves = journal::leaves("h", "l.member_id"),
            ),
            format!(
                "SELECT shard, CASE WHEN held THEN 'hold' ELSE 'settle' END, id, member_id,
                        CASE WHEN same_place AND NOT held THEN head_after ELSE 0 END,
                        COALESCE(after, 0), odd AND NOT held, CASE WHEN held THEN due_on END
                   FROM returns
                 UNION ALL
                 SELECT shard, 'reverse', id, head_member, head_after, 0::bigint, false, NULL::date
                   FROM returns WHERE moves AND NOT held
                 UNION ALL
                 SELECT {shard}, {kind_of}, e.id, e.member, e.before, e.after, false, NULL::date
                   FROM q_entries e",
                shard = shard_of("e.id"),
            ),
        ),
        Writer::Correction => {
            let loans = Pricing {
                prefix: "p_",
                shard: &any_shard,
                settles_returns: true,
                lock: "",
            };
            (
                format!(
                    "{targets}, {queue_pricing},
                     p_targets AS MATERIALIZED (
                         SELECT id AS loan_id, seq FROM ({month_loans}) m
                          WHERE NOT EXISTS (SELECT 1 FROM q_targets q WHERE q.loan_id = m.id)
                     ), {pricing}",
                    targets = queue_targets("q_", &any_shard, "ALL"),
                    queue_pricing = queue.ctes(),
                    month_loans = loans_of_month("NULL::bigint", &any_shard),
                    pricing = loans.ctes(),
                ),
                format!(
                    "{queued}
                     UNION ALL
                     {loans}
                     UNION ALL
                     SELECT {shard}, 'hold', c.id, c.member_id, 0::bigint, 0::bigint, false, c.due_on
                       FROM p_cur c WHERE c.held AND NOT c.settled",
                    queued = per_loan("q_"),
                    loans = per_loan("p_"),
                    shard = shard_of("c.id"),
                ),
            )
        }
    };
    let name = match writer {
        Writer::Run => "preview.run",
        Writer::Correction => "preview.correct",
    };
    format!(
        "/* {name} */ WITH {ctes},
         moves (shard, kind, id, member_id, before, after, odd, due_on) AS MATERIALIZED ({moves}),
         members AS (
             SELECT member_id, count(DISTINCT id) AS loans, sum(before) AS before,
                    sum(after) AS after
               FROM moves WHERE kind <> 'hold' GROUP BY member_id
             HAVING sum(after) <> sum(before)
         )
         SELECT (SELECT COALESCE(json_agg(k), '[]') FROM (
                     SELECT shard, kind, count(*) AS loans,
                            count(*) FILTER (WHERE after <> before) AS changed,
                            sum(before)::text AS before, sum(after)::text AS after,
                            count(*) FILTER (WHERE odd) AS odd
                       FROM moves GROUP BY shard, kind) k)::text,
                (SELECT COALESCE(json_agg(w), '[]') FROM (
                     SELECT shard, count(DISTINCT id) AS loans
                       FROM moves WHERE kind <> 'hold' GROUP BY shard) w)::text,
                (SELECT COALESCE(json_agg(h), '[]') FROM (
                     SELECT shard, id,
                            CASE WHEN due_on IS NULL THEN 'no due date'
                                 ELSE 'due date ' || due_on::text || ' is not a date the rule can count from'
                            END AS why
                       FROM moves WHERE kind = 'hold' ORDER BY id LIMIT $4) h)::text,
                (SELECT count(*) FROM members),
                (SELECT COALESCE(json_agg(m), '[]') FROM (
                     SELECT member_id, loans, before::text, after::text FROM members
                      ORDER BY abs(after - before) DESC, member_id NULLS LAST LIMIT $9) m)::text"
    )
}

/// What `writer` would write in `month` for `shards` of `count`, under `rule`, read on `db`
/// (the caller's read-only snapshot).
pub async fn preview(
    db: &mut PgConnection,
    writer: Writer,
    month: BusinessDate,
    count: u32,
    shards: &[u32],
    rule: &FineRule,
) -> sqlx::Result<MonthPreview> {
    let shards: Vec<i32> = shards.iter().map(|s| *s as i32).collect();
    let (correction_key, priced) = match writer {
        Writer::Run => (None, journal::Kind::Repriced),
        Writer::Correction => (Some("dry run"), journal::Kind::Corrected),
    };
    let (by_kind, writes, held, members_changed, members): (String, String, String, i64, String) =
        sqlx::query_as(&statement(writer))
            .bind(month.first_day())
            .bind(i64::from(count))
            .bind(&shards)
            .bind(HELD_LISTED)
            .bind(rule.grace_days)
            .bind(rule.daily_rate_cents)
            .bind(rule.max_cents)
            .bind(rule_identity(rule))
            .bind(TOP_MEMBERS)
            .bind(correction_key)
            .bind(priced.as_str())
            .fetch_one(&mut *db)
            .await?;
    let mut out = MonthPreview {
        members_changed: members_changed as u64,
        ..MonthPreview::default()
    };
    #[derive(serde::Deserialize)]
    struct Writes {
        shard: u32,
        loans: u64,
    }
    for w in parse::<Vec<Writes>>(&writes)? {
        out.writes_by_shard.insert(w.shard, w.loans);
    }
    #[derive(serde::Deserialize)]
    struct Row {
        shard: u32,
        kind: String,
        loans: u64,
        changed: u64,
        before: String,
        after: String,
        odd: u64,
    }
    for row in parse::<Vec<Row>>(&by_kind)? {
        *out.odd_rows.entry(row.shard).or_default() += row.odd;
        out.by_shard.entry(row.shard).or_default().insert(
            row.kind,
            Kind {
                loans: row.loans,
                changed: row.changed,
                before_cents: parse_sum(&row.before)?,
                after_cents: parse_sum(&row.after)?,
            },
        );
    }
    out.held = parse(&held)?;
    #[derive(serde::Deserialize)]
    struct Member {
        member_id: Option<i64>,
        loans: u64,
        before: String,
        after: String,
    }
    for m in parse::<Vec<Member>>(&members)? {
        out.members.push(MemberChange {
            member_id: m.member_id,
            loans: m.loans,
            before_cents: parse_sum(&m.before)?,
            after_cents: parse_sum(&m.after)?,
        });
    }
    Ok(out)
}

fn parse<T: serde::de::DeserializeOwned>(text: &str) -> sqlx::Result<T> {
    serde_json::from_str(text).map_err(|e| sqlx::Error::Protocol(format!("a preview's row: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_the_writer_is_in_a_shards_object_at_zero_when_it_would_do_none() {
        let mut found = MonthPreview::default();
        found.by_shard.entry(1).or_default().insert(
            "settle".into(),
            Kind {
                loans: 3,
                changed: 2,
                before_cents: 0,
                after_cents: 150,
            },
        );
        found.writes_by_shard.insert(1, 3);
        found.held.push(Held {
            shard: 1,
            id: 17,
            why: "no due date".into(),
        });
        let run = found.shard_json(Writer::Run, 1);
        for kind in ["settle", "reprice", "reverse", "delete", "hold"] {
            assert!(run.contains_key(kind), "{kind}: {run:?}");
        }
        assert_eq!(run["writes"], 3);
        assert_eq!(run["fine_cents"], 150);
        assert_eq!(run["hold"]["first"][0]["why"], "no due date");
        let other = found.shard_json(Writer::Run, 0);
        assert_eq!(other["writes"], 0);
        assert_eq!(other["hold"]["first"], serde_json::json!([]));
        let correction = found.shard_json(Writer::Correction, 1);
        assert!(correction.contains_key("correct") && !correction.contains_key("settle"));
        assert_eq!(found.shard_text(Writer::Run, 0), "    nothing to write\n");
        assert!(found
            .shard_text(Writer::Run, 1)
            .starts_with("    settle 3 loans: fines 1.50 (150 cents)\n"));
    }
}
