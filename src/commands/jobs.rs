//! `settlementd jobs`: the jobs this binary has, as configured, with their next fire and the last
//! month each closed.

use crate::app::{Database, Result};
use crate::clock::Clock;
use crate::config::Settings;
use crate::job_layer::{due, pause};
use crate::schedule::{next_slot_after, Slot};
use chrono::SecondsFormat;

/// One job as `settlementd jobs` lists it.
#[derive(Debug, Clone)]
pub struct JobLine {
    pub name: &'static str,
    pub enabled: bool,
    pub cron: String,
    pub timezone: String,
    /// The same zone, in which the text shows times.
    pub tz: chrono_tz::Tz,
    /// The job it follows.
    pub after: Option<&'static str>,
    pub next: Option<Slot>,
    /// The latest month closed under `shard.count` ([`due::MonthState::Closed`]), and the held
    /// months after it.
    pub last_closed: due::LastClosed,
    pub paused: Option<pause::Pause>,
}

/// Every job of the registry, in its order.
pub async fn jobs(
    settings: &Settings,
    clock: &dyn Clock,
    embedded_db: bool,
) -> Result<Vec<JobLine>> {
    let registry = crate::jobs::build(settings);
    let database = Database::open_to_read(settings, embedded_db).await?;
    let result = async {
        let mut conn = database.pool.acquire().await?;
        let mut lines = Vec::new();
        for job in registry.iter() {
            let tz = settings.schedule.timezone;
            lines.push(JobLine {
                name: job.name(),
                enabled: job.schedule().enabled,
                cron: job.schedule().cron.pattern.to_string(),
                timezone: tz.to_string(),
                tz,
                after: job.after(),
                next: next_slot_after(&job.schedule().cron, tz, clock.now()).map(Slot::new),
                last_closed: due::last_closed(&mut conn, job.as_ref(), settings.shard.count)
                    .await?,
                paused: pause::of(&database.pool, job.name()).await?,
            });
        }
        Ok(lines)
    }
    .await;
    database.close().await;
    result
}

impl JobLine {
    /// One JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "enabled": self.enabled,
            "cron": self.cron,
            "timezone": self.timezone,
            "after": self.after,
            "next_fire": self.next.map(|s| s.fire_at.to_rfc3339_opts(SecondsFormat::Secs, false)),
            "next_business_date": self.next.map(|s| s.business_date.to_string()),
            "last_closed": self.last_closed.closed.map(|d| d.to_string()),
            "held_after_last_closed": self.last_closed.held_after.iter().map(|(d, held)| serde_json::json!({
                "business_date": d.to_string(), "state": due::MonthState::Held, "held": held,
            })).collect::<Vec<_>>(),
            "paused": self.paused,
        })
    }

    /// One line of text.
    pub fn to_text(&self) -> String {
        format!(
            "{:<20} {:<8} {:<16} {:<16} next {} (month {})  last closed {}{}{}{}",
            self.name,
            if self.enabled { "enabled" } else { "disabled" },
            self.cron,
            self.timezone,
            self.next.map_or("-".into(), |s| s
                .fire_at
                .to_rfc3339_opts(SecondsFormat::Secs, false)),
            self.next
                .map_or("-".into(), |s| s.business_date.to_string()),
            self.last_closed
                .closed
                .map_or("none".into(), |d| d.to_string()),
            self.last_closed
                .held_after
                .iter()
                .map(|(d, held)| format!("  {d} held ({held})"))
                .collect::<String>(),
            self.after
                .map(|a| format!("  after {a}"))
                .unwrap_or_default(),
            self.paused
                .as_ref()
                .map(|p| format!(
                    "  PAUSED since {} by {}: {}",
                    crate::schedule::local_time(p.paused_at, self.tz),
                    p.paused_by,
                    p.reason
                ))
                .unwrap_or_default(),
        )
    }
}
