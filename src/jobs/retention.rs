//! Retention: the audit trail, run requests and claims of periods closed long ago, deleted in
//! batches, so these tables do not grow for ever.
//!
//! A period of a job is **prunable** when every `job_runs` row of it (any shard count) is SUCCESS
//! and finished more than `older_than_days` ago, no correction holds it, it lies before the job's
//! lookback (so no replica will run it again by itself), and nothing waits in it
//! ([`super::Job::pending`]). Then its `job_events`, its `run_requests` whose every shard
//! succeeded, and its `job_runs` rows go, a batch per transaction. Never deleted: a period that is
//! not closed, the pinned parameters (`job_params`: the rule a month was settled under), and the
//! jobs' own records (for the fine settlement: the money journal and `fine_adjustments`).
//!
//! It runs as a job of its own ([`Retention`], name [`NAME`]): `serve` claims the day's key
//! `(retention, <today>, 1, 0)` like any run, so one replica a day does it (`retention.enabled`);
//! `settlementd prune` runs it by hand (forced), or only counts (`--dry-run`).

use super::registry::Registry;
use super::{Batch, Claim, Cursor, Job, JobKey, Params};
use chrono::NaiveDate;
use sqlx::{PgConnection, PgPool};

/// The retention job's name in `job_runs` (not a job of the registry: it serves them all).
pub const NAME: &str = "retention";

/// One prunable period, and what deleting it removes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Prunable {
    pub job_name: String,
    pub business_date: NaiveDate,
    pub events: i64,
    pub requests: i64,
    pub runs: i64,
}

/// The retention job.
pub struct Retention {
    /// The jobs whose periods it prunes (and itself).
    pub registry: Registry,
    /// The shard count their replicas run under: what waits is asked for under it.
    pub shards: u32,
    pub older_than_days: u32,
    /// For each job, the first period of its lookback (periods from there on are watched by the
    /// replicas and never pruned).
    pub lookback_starts: Vec<(&'static str, NaiveDate)>,
    /// Rows deleted per batch transaction.
    pub batch: i64,
}

impl Retention {
    /// The prunable periods, oldest first, with the rows each would free.
    pub async fn prunable(&self, pool: &PgPool) -> sqlx::Result<Vec<Prunable>> {
        let candidates: Vec<(String, NaiveDate)> = sqlx::query_as(
            "SELECT r.job_name, r.business_date FROM job_runs r
              GROUP BY r.job_name, r.business_date
             HAVING bool_and(r.status = 'SUCCESS')
                AND max(r.finished_at) < clock_timestamp() - make_interval(days => $1)
                AND NOT EXISTS (SELECT 1 FROM job_params p
                                 WHERE p.job_name = r.job_name
                                   AND p.business_date = r.business_date
                                   AND p.correction_key IS NOT NULL)
              ORDER BY r.business_date, r.job_name",
        )
        .bind(self.older_than_days as i32)
        .fetch_all(pool)
        .await?;
        let mut prunable = Vec::new();
        for (job_name, business_date) in candidates {
            if job_name != NAME {
                let Ok(job) = self.registry.get(&job_name) else {
                    // A job this binary does not know: its periods are not judged here.
                    continue;
                };
                let watched = self
                    .lookback_starts
                    .iter()
                    .find(|(name, _)| *name == job.name())
                    .is_some_and(|(_, start)| business_date >= *start);
                if watched {
                    continue;
                }
                let mut conn = pool.acquire().await?;
                let waiting = job
                    .pending(&mut conn, self.shards, std::slice::from_ref(&business_date))
                    .await?;
                if waiting
                    .by_period
                    .iter()
                    .any(|p| p.business_date == business_date && p.late > 0)
                {
                    continue;
                }
            }
            let (events, requests, runs): (i64, i64, i64) = sqlx::query_as(
                "SELECT (SELECT count(*) FROM job_events
                          WHERE job_name = $1 AND business_date = $2),
                        (SELECT count(*) FROM run_requests q
                          WHERE q.job_name = $1 AND q.business_date = $2
                            AND NOT EXISTS (SELECT 1 FROM run_request_shards s
                                             WHERE s.request_id = q.request_id
                                               AND s.state <> 'succeeded')
                            AND NOT EXISTS (SELECT 1 FROM run_requests c
                                             WHERE c.parent_id = q.request_id)),
                        (SELECT count(*) FROM job_runs
                          WHERE job_name = $1 AND business_date = $2)",
            )
            .bind(&job_name)
            .bind(business_date)
            .fetch_one(pool)
            .await?;
            prunable.push(Prunable {
                job_name,
                business_date,
                events,
                requests,
                runs,
            });
        }
        Ok(prunable)
    }
}

/// A retention run's periods, fixed after its claim, and where its cursor counts them from (a
/// takeover plans again: the periods an earlier attempt deleted are gone from its list).
pub struct RetentionPlan {
    periods: Vec<Prunable>,
    first: i64,
}

impl Job for Retention {
    type Plan = RetentionPlan;

    fn name(&self) -> &'static str {
        NAME
    }

    /// No identifying parameters: how old is old enough is a run's option, not what it computes.
    fn params(&self, _key: &JobKey) -> Result<Params, String> {
        Ok(Params(serde_json::json!({})))
    }

    async fn plan(
        &self,
        pool: &PgPool,
        claim: &Claim,
        _estimate: bool,
    ) -> sqlx::Result<(RetentionPlan, Option<u64>)> {
        let periods = self.prunable(pool).await?;
        let total = periods
            .iter()
            .map(|p| (p.events + p.requests + p.runs) as u64);
        let total = total.sum();
        let first = claim.resume.last_id.map_or(0, |i| i + 1);
        Ok((RetentionPlan { periods, first }, Some(total)))
    }

    /// The next `batch` rows of the period at the cursor (`last_id`: the index of the period
    /// being deleted): its events first, then its finished requests, then its claims; the cursor
    /// moves on when a period has nothing left. A period that is no longer prunable when its turn
    /// comes (run again meanwhile) is left alone.
    async fn run_batch(
        &self,
        tx: &mut PgConnection,
        plan: &RetentionPlan,
        cursor: Cursor,
    ) -> sqlx::Result<Batch> {
        let next = cursor.last_id.map_or(0, |i| i + 1);
        let at = (next - plan.first).max(0) as usize;
        let Some(period) = plan.periods.get(at) else {
            return Ok(Batch::nothing_left(cursor));
        };
        let deleted: i64 = sqlx::query_scalar(
            "WITH still AS (
                 SELECT 1 FROM job_runs
                  WHERE job_name = $1 AND business_date = $2
                 HAVING bool_and(status = 'SUCCESS')
             ), events AS (
                 DELETE FROM job_events
                  WHERE ctid = ANY (ARRAY(
                          SELECT ctid FROM job_events
                           WHERE job_name = $1 AND business_date = $2
                             AND EXISTS (SELECT 1 FROM still)
                           LIMIT $3))
                 RETURNING 1
             )
             SELECT count(*) FROM events",
        )
        .bind(&period.job_name)
        .bind(period.business_date)
        .bind(self.batch)
        .fetch_one(&mut *tx)
        .await?;
        let left = if deleted < self.batch {
            // The period's events are gone: its finished requests and its claims, at once.
            let (requests, runs): (i64, i64) = sqlx::query_as(
                "WITH still AS (
                     SELECT 1 FROM job_runs
                      WHERE job_name = $1 AND business_date = $2
                     HAVING bool_and(status = 'SUCCESS')
                 ), finished AS (
                     SELECT q.request_id FROM run_requests q
                      WHERE q.job_name = $1 AND q.business_date = $2
                        AND EXISTS (SELECT 1 FROM still)
                        AND NOT EXISTS (SELECT 1 FROM run_request_shards s
                                         WHERE s.request_id = q.request_id
                                           AND s.state <> 'succeeded')
                        AND NOT EXISTS (SELECT 1 FROM run_requests c
                                         WHERE c.parent_id = q.request_id)
                 ), shards AS (
                     DELETE FROM run_request_shards s USING finished f
                      WHERE s.request_id = f.request_id
                 ), requests AS (
                     DELETE FROM run_requests q USING finished f
                      WHERE q.request_id = f.request_id
                     RETURNING 1
                 ), runs AS (
                     DELETE FROM job_runs
                      WHERE job_name = $1 AND business_date = $2
                        AND EXISTS (SELECT 1 FROM still)
                     RETURNING 1
                 )
                 SELECT (SELECT count(*) FROM requests), (SELECT count(*) FROM runs)",
            )
            .bind(&period.job_name)
            .bind(period.business_date)
            .fetch_one(&mut *tx)
            .await?;
            // A range request (its months are child requests; it has no shards of its own) goes
            // once the last of its months has gone, whichever period that was.
            let ranges: i64 = sqlx::query_scalar(
                "WITH ranges AS (
                     DELETE FROM run_requests p
                      WHERE p.job_name = $1 AND p.range_to IS NOT NULL AND p.parent_id IS NULL
                        AND NOT EXISTS (SELECT 1 FROM run_requests c
                                         WHERE c.parent_id = p.request_id)
                        AND NOT EXISTS (SELECT 1 FROM run_request_shards s
                                         WHERE s.request_id = p.request_id)
                     RETURNING 1
                 )
                 SELECT count(*) FROM ranges",
            )
            .bind(&period.job_name)
            .fetch_one(&mut *tx)
            .await?;
            Some(requests + runs + ranges)
        } else {
            None
        };
        let moved_on = left.is_some();
        Ok(Batch {
            cursor: if moved_on {
                Cursor {
                    last_id: Some(next),
                    ..cursor
                }
            } else {
                cursor
            },
            scanned: 1,
            updated: (deleted + left.unwrap_or(0)) as u64,
            notes: Default::default(),
            done: moved_on && at + 1 >= plan.periods.len(),
        })
    }
}
