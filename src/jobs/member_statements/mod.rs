//! The member-statements job: each member's settled fines of a month (how many, and their sum), in
//! `member_fine_statements`, sharded by member id, after the fine settlement.
//!
//! It follows the settlement (`after`): a month runs only once the settlement has closed it on
//! every shard. It reads the month's money through the settlement's journal (`fine_journal`) and
//! the loans by primary key, so it costs what the month holds. Each shard keeps a mark per month:
//! the last journal row its statements were computed from and the snapshot they were computed in
//! (`member_statement_marks`). A journal row after it — above its id, or of a transaction that
//! snapshot did not see, since ids are not in commit order ([`AFTER_MARK`]); a late return, a
//! re-pricing of libraryd's edit, a correction — is a late item
//! ([`Job::late_items`]): the job layer re-opens the month's statements, and the run recomputes
//! only the members whose loans those rows touch (all of the shard's members when a row is a
//! deletion, whose loan, and member, are gone).
//!
//! A run plans everything in one read: the members to compute and their statements, as of a mark
//! read first; its batches write them (upsert, or delete the statement of a member left without a
//! fine) and the last one moves the mark, each under the claim's fence. A journal row written
//! after the mark was read is found again as a late item: computing a member twice writes the same
//! statement. A takeover resumes at its predecessor's cursor but plans from a snapshot of its own:
//! its first batch also rewrites the members behind the cursor whose stored statement is not what
//! that snapshot gives, so none is left as an older journal said.
//!
//! `verify --job member-statements` proves a month's statements from the journal alone
//! ([`proof`]).

use crate::calendar::BusinessDate;
use crate::config::Settings;
use crate::job_layer::registry::{Configured, NoSettings};
use crate::job_layer::{
    parse_sum, split, Batch, Claim, Cursor, Fact, Job, JobKey, Metrics, Params, Pending,
    PendingReport, Phrase, Planned, Proof, ProveError, Reopen, Report, Words,
};
use chrono::NaiveDate;
use sqlx::{PgConnection, PgPool};
use std::collections::BTreeMap;

pub mod proof;

pub const JOB_NAME: &str = "member-statements";

/// The job it follows: its months' money.
const FOLLOWS: &str = "fine-settlement";

/// A journal row `j` is after the mark `k` (`journal_id`, `snapshot`) when its id is above the
/// mark's, or when the mark's snapshot did not see its transaction: ids are handed out at insert,
/// not at commit, so a row may commit below a mark that a higher id already moved past. A mark
/// without a snapshot (none yet, or written by the release before) is the id alone. The second
/// test reads only rows of transactions at or after the snapshot's xmin (`fine_journal_by_month_xact`).
const AFTER_MARK: &str = "(j.id > COALESCE(k.journal_id, 0)
     OR (j.xact >= pg_snapshot_xmin(k.snapshot)
         AND NOT pg_visible_in_snapshot(j.xact, k.snapshot)))";

/// How many journal rows of the month `month` (an SQL expression) are after the mark `k`
/// ([`AFTER_MARK`]), as two index ranges — ids above the mark's (`fine_journal_by_month`), and
/// transactions at or after its snapshot's xmin (`fine_journal_by_month_xact`) — so the check
/// never reads the month's rows before the mark (an `OR` would: a filter over every row). The
/// second range's `id + 0` keeps the planner off the primary key, whose range is every row below
/// the mark.
pub fn late_rows(month: &str) -> String {
    format!(
        "((SELECT count(*) FROM fine_journal j
            WHERE j.month = {month} AND j.id > COALESCE(k.journal_id, 0))
        + (SELECT count(*) FROM fine_journal j
            WHERE j.month = {month} AND j.xact >= pg_snapshot_xmin(k.snapshot)
              AND j.id + 0 <= COALESCE(k.journal_id, 0)
              AND NOT pg_visible_in_snapshot(j.xact, k.snapshot)))"
    )
}

/// The member statements in the binary's list of jobs (`JOBS` in src/jobs/mod.rs): no keys of
/// their own; members per batch are `batch.size`.
impl Configured<Settings> for MemberStatements {
    type Settings = NoSettings;
    // 04:00 on the 1st, after the settlement's 02:30; it waits for the settlement in any case.
    const DEFAULT_CRON: &'static str = "0 0 4 1 * *";

    fn build(settings: &Settings, _own: NoSettings) -> Result<Self, String> {
        Ok(MemberStatements {
            batch_size: settings.batch.size,
        })
    }
}

pub struct MemberStatements {
    /// Members written per batch transaction.
    pub batch_size: u32,
}

/// A member's statement of a month: fines (loans settled with a fine above 0) and their sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Statement {
    pub fines: i64,
    pub fine_cents: i128,
}

/// A run: its month, the mark it moves to, and the statements it writes, by member id (a member
/// without a statement is one whose row is deleted).
pub struct StatementsPlan {
    month: BusinessDate,
    shards: i64,
    shard: i64,
    mark: i64,
    /// The snapshot the plan read in (`pg_snapshot` as text), kept with the mark.
    snapshot: String,
    /// The members after the cursor the run resumes at, in order: its batches.
    members: Planned<Option<Statement>>,
    /// The cursor the run resumes at (an earlier attempt's committed progress), if any.
    resume: Option<i64>,
    /// Members at or below `resume` whose stored statement is not what this plan's snapshot
    /// gives: the journal changed them after the earlier attempt wrote them. The attempt's first
    /// batch writes them, so a takeover leaves no member stale behind its cursor.
    behind: Vec<(i64, Option<Statement>)>,
}

impl Job for MemberStatements {
    type Plan = StatementsPlan;

    const NAME: &'static str = JOB_NAME;

    fn after(&self) -> Option<&'static str> {
        Some(FOLLOWS)
    }

    fn describe(&self, _params: &Params) -> String {
        "each member's settled fines of the month".into()
    }

    /// Journal rows of the month after the shard's mark ([`AFTER_MARK`]).
    async fn late_items(&self, pool: &PgPool, key: &JobKey) -> sqlx::Result<u64> {
        let n: i64 = sqlx::query_scalar(&format!(
            "SELECT {}::bigint
               FROM (SELECT 1) one
               LEFT JOIN member_statement_marks k
                 ON k.business_date = $2 AND k.shards = $3 AND k.shard = $4",
            late_rows("$1")
        ))
        .bind(BusinessDate::month_start(key.business_date))
        .bind(key.business_date)
        .bind(key.shards as i32)
        .bind(key.shard as i32)
        .fetch_one(pool)
        .await?;
        Ok(n as u64)
    }

    fn reopen(&self, late: u64) -> Reopen {
        Reopen {
            event: "month_changed",
            message: format!(
                "{late} journal rows of the month after the statements' mark: late returns, \
                 re-pricings or corrections"
            ),
        }
    }

    /// Per month and shard: the journal rows after the shard's mark (all of the month's, when
    /// the shard has never computed it). Besides the months asked for, every month a shard has
    /// stated before: the settlement re-prices libraryd's edits of any month, also before its
    /// lookback, and the statements of such a month follow it (a month never stated there has
    /// nothing to go stale).
    async fn pending(
        &self,
        db: &mut PgConnection,
        shards: u32,
        periods: &[NaiveDate],
    ) -> sqlx::Result<PendingReport> {
        let months = BusinessDate::first_days(periods);
        let rows: Vec<(NaiveDate, i32, i64)> = sqlx::query_as(&format!(
            "SELECT m.first_day, s.shard,
                    {}::bigint
               FROM (SELECT unnest($1::date[])
                     UNION
                     SELECT date_trunc('month', business_date)::date
                       FROM member_statement_marks WHERE shards = $2) AS m(first_day)
              CROSS JOIN generate_series(0, $2 - 1) AS s(shard)
               LEFT JOIN member_statement_marks k
                 ON k.business_date = (m.first_day + interval '1 month' - interval '1 day')::date
                AND k.shards = $2 AND k.shard = s.shard
              WHERE m.first_day = ANY ($1) OR k.business_date IS NOT NULL",
            late_rows("m.first_day")
        ))
        .bind(&months)
        .bind(shards as i32)
        .fetch_all(db)
        .await?;
        let by_period = rows
            .into_iter()
            .filter(|(_, _, late)| *late > 0)
            .filter_map(|(first, shard, late)| {
                Some(Pending {
                    business_date: BusinessDate::of_month_of(first)?.date(),
                    shard: shard as u32,
                    late: late as u64,
                    held: 0,
                    upkeep: 0,
                })
            })
            .collect();
        Ok(PendingReport {
            by_period,
            before: 0,
        })
    }

    fn metrics(&self) -> Metrics {
        Metrics {
            items: "members",
            ..Metrics::default()
        }
    }

    fn words(&self) -> Words {
        Words {
            waiting: Phrase::new("journal row waiting", "journal rows waiting"),
            waiting_key: "journal_rows_waiting",
            held: Phrase::new("member held", "members held"),
            upkeep: Phrase::new("item of upkeep waiting", "items of upkeep waiting"),
            written: Phrase::new("statement written", "statements written"),
            facts_are: "statements",
            run_does: "states",
            pinned: None,
        }
    }

    async fn facts(
        &self,
        db: &mut PgConnection,
        month: BusinessDate,
    ) -> sqlx::Result<Vec<Fact>> {
        let (members, fines, cents): (i64, i64, String) = sqlx::query_as(
            "SELECT count(*), COALESCE(sum(fines), 0)::bigint, COALESCE(sum(fine_cents), 0)::text
               FROM member_fine_statements WHERE business_date = $1",
        )
        .bind(month.date())
        .fetch_one(db)
        .await?;
        Ok(vec![
            Fact::count("members", "members with fines", members),
            Fact::count("fines", "fines", fines),
            Fact::cents("fine_cents", "total", parse_sum(&cents)?),
        ])
    }

    /// Every member's statement of the month against what the journal gives ([`proof`]).
    async fn prove(
        &self,
        pool: &PgPool,
        month: BusinessDate,
    ) -> Result<Option<Proof>, ProveError> {
        let mut conn = pool.acquire().await?;
        Ok(Some(proof::prove(&mut conn, month).await?.into_proof()))
    }

    /// Reads the mark to move to (the month's last journal row), then the members to compute —
    /// every member of the shard with a fine or a statement in the month for a first run or a
    /// takeover; for a re-opened month, the members of the loans that journal rows after the
    /// shard's mark touch (all of them when one is a deletion) — and their statements, in one
    /// read of the month's journal and loans.
    async fn plan(
        &self,
        pool: &PgPool,
        claim: &Claim,
        _estimate: bool,
    ) -> sqlx::Result<(StatementsPlan, Option<u64>)> {
        let key = &claim.key;
        let month = claim.month;
        let (shards, shard) = (i64::from(key.shards), i64::from(key.shard));
        let mut tx = pool
            .begin_with(
                "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY;
                 SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off;
                 SET LOCAL enable_hashjoin = off; SET LOCAL enable_mergejoin = off;
                 SET LOCAL jit = off",
            )
            .await?;
        // The snapshot the whole plan reads in (repeatable read: the first statement's), kept with
        // the mark so that rows it did not see are found after it.
        #[allow(clippy::type_complexity)]
        let (mark, snapshot, old_mark, old_snapshot): (
            i64,
            String,
            Option<i64>,
            Option<String>,
        ) = sqlx::query_as(
            "SELECT COALESCE((SELECT max(id) FROM fine_journal WHERE month = $1), 0),
                        pg_current_snapshot()::text, k.journal_id, k.snapshot::text
                   FROM (SELECT 1) one
                   LEFT JOIN member_statement_marks k
                     ON k.business_date = $2 AND k.shards = $3 AND k.shard = $4",
        )
        .bind(month.first_day())
        .bind(month.date())
        .bind(shards as i32)
        .bind(shard as i32)
        .fetch_one(&mut *tx)
        .await?;
        // Only the members concerned when re-opened for rows after a mark (a takeover of such a
        // run recomputes all: it does not know what its predecessor wrote).
        let only: Option<Vec<i64>> = match (claim.reopened, old_mark) {
            (true, Some(old)) => {
                // The members the rows after the mark priced money for or took it from (each
                // entry names its member: a move writes the old member's entry and the new
                // one's). A row of a release before 0.3.0 names none: its loan's member now, and
                // those a loan of the month was moved away from (`member_moves`); a deletion
                // without a member recomputes every member of the shard.
                let (members, deletion): (Vec<i64>, bool) = sqlx::query_as(&format!(
                    "WITH e AS MATERIALIZED (
                         SELECT j.kind, x.loan_id, x.member_id
                           FROM (SELECT $2::bigint AS journal_id,
                                        $3::text::pg_snapshot AS snapshot) k,
                                fine_journal j,
                                unnest(j.loan_ids, j.member_ids) AS x(loan_id, member_id)
                          WHERE j.month = $1 AND {AFTER_MARK}
                     )
                     SELECT COALESCE(array_agg(DISTINCT m.member) FILTER (WHERE m.member IS NOT NULL),
                                     '{{}}'),
                            COALESCE(bool_or(m.unknown), false)
                       FROM (SELECT COALESCE(e.member_id, l.member_id)::bigint AS member,
                                    e.member_id IS NULL AND e.kind = 'deleted' AS unknown
                               FROM e
                               LEFT JOIN LATERAL (SELECT member_id FROM loans
                                                   WHERE id = e.loan_id AND e.member_id IS NULL) l
                                 ON true
                             UNION ALL
                             SELECT v.old_member_id, false
                               FROM e JOIN member_moves v
                                 ON v.loan_id = e.loan_id AND v.month = $1
                              WHERE e.member_id IS NULL) m"
                ))
                .bind(month.first_day())
                .bind(old)
                .bind(old_snapshot.as_deref())
                .fetch_one(&mut *tx)
                .await?;
                if crate::mutant::planted(crate::mutant::Mutant::StatementsReopenSkips) {
                    Some(Vec::new())
                } else {
                    (!deletion).then_some(members)
                }
            }
            _ => None,
        };
        // The statements of the month as its journal and loans say now, for the shard's members
        // (or those concerned).
        // Each loan whose head is in the month and prices money, for the member its entry
        // names (one before 0.3.0 names none: the loan's), as `proof` proves them.
        let computed: Vec<(i64, i64, String)> = sqlx::query_as(
            "SELECT m.member, count(*) FILTER (WHERE m.after_cents > 0),
                    COALESCE(sum(m.after_cents), 0)::text
               FROM (SELECT COALESCE(h.member_id, l.member_id)::bigint AS member, e.after_cents
                       FROM (SELECT j.id AS jid, j.kind, x.loan_id, x.after_cents
                               FROM fine_journal j,
                                    unnest(j.loan_ids, j.after_cents) AS x(loan_id, after_cents)
                              WHERE j.month = $1) e
                       JOIN fine_heads h ON h.loan_id = e.loan_id AND h.journal_id = e.jid
                       LEFT JOIN LATERAL (SELECT member_id FROM loans
                                           WHERE id = e.loan_id AND h.member_id IS NULL) l ON true
                      WHERE e.kind NOT IN ('reversed', 'deleted')) m
              WHERE m.member IS NOT NULL
                AND ($3 = 1 OR (m.member % $3 + $3) % $3 = $4)
                AND ($5::bigint[] IS NULL OR m.member = ANY ($5))
              GROUP BY m.member",
        )
        .bind(month.first_day())
        .bind(month.date())
        .bind(shards)
        .bind(shard)
        .bind(only.as_deref())
        .fetch_all(&mut *tx)
        .await?;
        // Members with a statement already, and what it says: those left without a fine lose it,
        // and those behind a resumed cursor are rewritten where it differs.
        let stated: Vec<(i64, i64, String)> = sqlx::query_as(
            "SELECT member_id, fines, fine_cents::text FROM member_fine_statements
              WHERE business_date = $1 AND ($2 = 1 OR (member_id % $2 + $2) % $2 = $3)
                AND ($4::bigint[] IS NULL OR member_id = ANY ($4))",
        )
        .bind(month.date())
        .bind(shards)
        .bind(shard)
        .bind(only.as_deref())
        .fetch_all(&mut *tx)
        .await?;
        tx.rollback().await?;
        let stored: BTreeMap<i64, Statement> = stated
            .into_iter()
            .map(|(m, fines, cents)| {
                Ok((
                    m,
                    Statement {
                        fines,
                        fine_cents: parse_sum(&cents)?,
                    },
                ))
            })
            .collect::<sqlx::Result<_>>()?;
        let mut members: BTreeMap<i64, Option<Statement>> =
            stored.keys().map(|m| (*m, None)).collect();
        for (member, fines, cents) in computed {
            let fine_cents = parse_sum(&cents)?;
            let statement = (fines > 0).then_some(Statement { fines, fine_cents });
            members.insert(member, statement);
        }
        // A member concerned whose statement the month no longer has (its only fine reversed):
        // deleted, if it is this shard's.
        let ours = |member: i64| shards == 1 || (member % shards + shards) % shards == shard;
        for member in only.iter().flatten().filter(|m| ours(**m)) {
            members.entry(*member).or_insert(None);
        }
        let after = claim.resume.last_id.unwrap_or(i64::MIN);
        let (members, behind): (Vec<_>, Vec<_>) =
            members.into_iter().partition(|(m, _)| *m > after);
        let behind: Vec<(i64, Option<Statement>)> = behind
            .into_iter()
            .filter(|(m, s)| stored.get(m).copied() != *s)
            .collect();
        let members = Planned::new(members);
        let total = (members.len() + behind.len()) as u64;
        Ok((
            StatementsPlan {
                month,
                shards,
                shard,
                mark,
                snapshot,
                members,
                resume: claim.resume.last_id,
                behind,
            },
            Some(total),
        ))
    }

    /// The next `batch.size` members after the cursor: their statements written, or deleted for a
    /// member left without a fine; the last batch moves the shard's mark.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &StatementsPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let page = plan.members.page(cursor, self.batch_size);
        // The attempt's first batch also rewrites the members behind its resumed cursor.
        let behind: &[(i64, Option<Statement>)] = if cursor.last_id == plan.resume {
            &plan.behind
        } else {
            &[]
        };
        let (stated, dropped) = split(behind.iter().chain(page.items));
        let ids: Vec<i64> = stated.iter().map(|(m, _)| *m).collect();
        let fines: Vec<i64> = stated.iter().map(|(_, s)| s.fines).collect();
        let cents: Vec<String> = stated
            .iter()
            .map(|(_, s)| s.fine_cents.to_string())
            .collect();
        let written: i64 = sqlx::query_scalar(
            "WITH upserted AS (
                 INSERT INTO member_fine_statements (business_date, member_id, fines, fine_cents)
                 SELECT $1, m, f, c::numeric
                   FROM unnest($2::bigint[], $3::bigint[], $4::text[]) AS s(m, f, c)
                 ON CONFLICT (business_date, member_id) DO UPDATE
                    SET fines = EXCLUDED.fines, fine_cents = EXCLUDED.fine_cents,
                        computed_at = now()
                  WHERE (member_fine_statements.fines, member_fine_statements.fine_cents)
                        IS DISTINCT FROM (EXCLUDED.fines, EXCLUDED.fine_cents)
                 RETURNING 1
             ), deleted AS (
                 DELETE FROM member_fine_statements
                  WHERE business_date = $1 AND member_id = ANY ($5)
                 RETURNING 1
             )
             SELECT (SELECT count(*) FROM upserted) + (SELECT count(*) FROM deleted)",
        )
        .bind(plan.month.date())
        .bind(&ids)
        .bind(&fines)
        .bind(&cents)
        .bind(&dropped)
        .fetch_one(&mut *tx)
        .await?;
        if page.done {
            sqlx::query(
                "INSERT INTO member_statement_marks
                        (business_date, shards, shard, journal_id, snapshot)
                 VALUES ($1, $2, $3, $4, $5::text::pg_snapshot)
                 ON CONFLICT (business_date, shards, shard) DO UPDATE
                    SET journal_id = GREATEST(member_statement_marks.journal_id,
                                              EXCLUDED.journal_id),
                        snapshot = EXCLUDED.snapshot",
            )
            .bind(plan.month.date())
            .bind(plan.shards as i32)
            .bind(plan.shard as i32)
            .bind(plan.mark)
            .bind(&plan.snapshot)
            .execute(&mut *tx)
            .await?;
        }
        Ok(Batch {
            scanned: (behind.len() + page.items.len()) as u64,
            ..page.batch(cursor, written as u64)
        })
    }
}

