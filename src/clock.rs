//! Time as the scheduler sees it. Domain code asks a [`Clock`]; tests hand it a [`ManualClock`]
//! and walk a year of schedule in milliseconds. Leases never use this clock: they use the
//! database's `clock_timestamp()`, so replicas with skewed clocks agree.

use chrono::{DateTime, Utc};
use std::sync::{Arc, Mutex};

/// Where "now" comes from when deciding which period to work on.
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> DateTime<Utc>;
}

/// The machine's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that only moves when told to. Cheap to clone; clones share the time.
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    pub fn new(now: DateTime<Utc>) -> Self {
        Self(Arc::new(Mutex::new(now)))
    }

    pub fn set(&self, now: DateTime<Utc>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = now;
    }

    pub fn advance(&self, by: chrono::TimeDelta) {
        let mut now = self.0.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}
