//! `--self-test`: the checker shown to catch what it claims to. A finished campaign's database is
//! cloned eight times: one clone is left as it is and must pass; each of the others is corrupted in
//! one way and must fail the check named for it.

use crate::checker::{self, Violation};
use crate::world::World;
use anyhow::{anyhow, Result};
use sqlx::{Connection, PgConnection};

/// One corruption: its name, the check that must catch it, and the SQL that makes it (run as
/// `who`, so the campaign's logs record it as that writer's): one transaction per element, each
/// sent on its own (a transaction's `now()` is when the message that began it arrived).
struct Corruption {
    name: &'static str,
    caught_by: &'static str,
    who: &'static str,
    sql: &'static [&'static str],
}

const CORRUPTIONS: &[Corruption] = &[
    Corruption {
        name: "a loan re-settled (settled again, with a journal entry of its own)",
        caught_by: "transitions",
        who: "settlementd",
        sql: &["WITH l AS (
                  SELECT id, fine_seq, fine_cents, due_on, returned_on FROM loans
                   WHERE fine_settled_at IS NOT NULL AND fine_seq IS NOT NULL
                   ORDER BY id LIMIT 1
              ), j AS (
                  INSERT INTO fine_journal (month, kind, shards, attempt, loan_ids, seqs, due_on,
                                            returned_on, before_cents, after_cents)
                  SELECT date_trunc('month', returned_on)::date, 'settled', 1, 1, ARRAY[id],
                         ARRAY[fine_seq + 1], ARRAY[due_on], ARRAY[returned_on], ARRAY[0::bigint],
                         ARRAY[fine_cents::bigint]
                    FROM l
              )
              UPDATE loans SET fine_settled_at = clock_timestamp(), fine_seq = l.fine_seq + 1
                FROM l WHERE loans.id = l.id"],
    },
    Corruption {
        name: "a fine changed",
        caught_by: "fines",
        who: "libraryd",
        sql: &["UPDATE loans SET fine_cents = fine_cents + 7
               WHERE id = (SELECT id FROM loans WHERE fine_settled_at IS NOT NULL
                            ORDER BY id DESC LIMIT 1)"],
    },
    Corruption {
        name: "a journal row dropped",
        caught_by: "journal",
        who: "settlementd",
        sql: &["DELETE FROM fine_journal
               WHERE id = (SELECT max(id) FROM fine_journal WHERE kind IN ('settled', 'late'))"],
    },
    Corruption {
        name: "a run left RUNNING",
        caught_by: "open",
        who: "settlementd",
        sql: &["UPDATE job_runs SET status = 'RUNNING', finished_at = NULL
               WHERE (job_name, business_date, shards, shard) =
                     (SELECT job_name, business_date, shards, shard FROM job_runs
                       WHERE status = 'SUCCESS' ORDER BY business_date, shards, shard LIMIT 1)"],
    },
    Corruption {
        name: "a held row settled",
        caught_by: "fines",
        who: "settlementd",
        sql: &[
            "UPDATE loans SET fine_settled_at = clock_timestamp(), fine_cents = 0
               WHERE id = (SELECT id FROM loans
                            WHERE (due_on IS NULL OR NOT isfinite(due_on))
                              AND returned_on IS NOT NULL AND fine_settled_at IS NULL
                            ORDER BY id LIMIT 1)",
        ],
    },
    Corruption {
        // As the operator, the campaign and a replica would commit them: the pause, the campaign
        // seeing it, a claim taken (and finished) anyway, the resume.
        name: "a claim won while its job was paused",
        caught_by: "pauses",
        who: "settlementd",
        sql: &[
            "INSERT INTO job_pauses (job_name, paused_by, reason)
             VALUES ('fine-settlement', 'self-test', 'a claim must not pass')",
            "UPDATE campaign_pause_log SET seen_at = clock_timestamp()
              WHERE op = 'I' AND seen_at IS NULL",
            "BEGIN;
             UPDATE job_runs SET status = 'RUNNING', attempt = attempt + 1, owner = 'self-test'
              WHERE (job_name, business_date, shards, shard) =
                    (SELECT job_name, business_date, shards, shard FROM job_runs
                      WHERE job_name = 'fine-settlement' AND status = 'SUCCESS'
                      ORDER BY business_date, shards, shard LIMIT 1);
             UPDATE job_runs SET status = 'SUCCESS' WHERE owner = 'self-test';
             COMMIT",
            "DELETE FROM job_pauses WHERE job_name = 'fine-settlement'",
        ],
    },
    Corruption {
        name: "a member statement left stale",
        caught_by: "statements",
        who: "settlementd",
        sql: &[
            "UPDATE member_fine_statements SET fine_cents = fine_cents + 5
               WHERE (business_date, member_id) =
                     (SELECT business_date, member_id FROM member_fine_statements
                       ORDER BY business_date, member_id LIMIT 1)",
        ],
    },
];

/// Runs the corruptions on clones of `world`'s database (its processes all ended). Returns the
/// lines of the report and whether every corruption was caught and the clean clone passed.
pub async fn run(world: &World) -> Result<(Vec<String>, bool)> {
    let mut lines = Vec::new();
    let mut all = true;
    let clean = checked_clone(world, "clean", None).await?;
    let clean_db = clean.iter().filter(|v| v.check != "exits").count();
    lines.push(format!(
        "self-test: uncorrupted clone: {}",
        if clean_db == 0 {
            "passes".to_string()
        } else {
            all = false;
            format!("FAILED with {clean_db} violations: {:?}", clean.first())
        }
    ));
    for (n, c) in CORRUPTIONS.iter().enumerate() {
        let found = checked_clone(world, &format!("c{n}"), Some(c)).await?;
        let caught: Vec<&Violation> = found.iter().filter(|v| v.check == c.caught_by).collect();
        if caught.is_empty() {
            all = false;
            lines.push(format!(
                "self-test: {}: NOT caught by [{}] (found {:?})",
                c.name, c.caught_by, found
            ));
        } else {
            lines.push(format!(
                "self-test: {}: caught by [{}] {}",
                c.name,
                c.caught_by,
                checker::one_line(&caught[0].facts, 160)
            ));
        }
    }
    Ok((lines, all))
}

/// Clones the world's database as `<db>_<suffix>`, applies `corruption`, reads and checks it, and
/// drops the clone.
async fn checked_clone(
    world: &World,
    suffix: &str,
    corruption: Option<&Corruption>,
) -> Result<Vec<Violation>> {
    let clone = format!("{}_{suffix}", world.database);
    let mut admin = PgConnection::connect(&world.cluster.url("postgres")).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {clone}"))
        .execute(&mut admin)
        .await?;
    sqlx::query(&format!(
        "CREATE DATABASE {clone} TEMPLATE {}",
        world.database
    ))
    .execute(&mut admin)
    .await?;
    let url = world.cluster.url(&clone);
    let result = async {
        if let Some(c) = corruption {
            let options: sqlx::postgres::PgConnectOptions = url.parse()?;
            let mut conn = PgConnection::connect_with(&options.application_name(c.who)).await?;
            let mut changed = 0;
            for sql in c.sql {
                changed += sqlx::raw_sql(sql).execute(&mut conn).await?.rows_affected();
            }
            if changed == 0 {
                return Err(anyhow!(
                    "the corruption {:?} found nothing to corrupt",
                    c.name
                ));
            }
            conn.close().await?;
        }
        let mut conn = PgConnection::connect(&url).await?;
        let months = world.plan.months.clone();
        let facts = checker::read(
            &mut conn,
            &months,
            world.plan.ttl_secs as f64,
            world.shards.load(std::sync::atomic::Ordering::SeqCst) as i32,
        )
        .await?;
        conn.close().await?;
        Ok(checker::check(&facts))
    }
    .await;
    sqlx::query(&format!("DROP DATABASE IF EXISTS {clone}"))
        .execute(&mut admin)
        .await?;
    admin.close().await?;
    result
}
