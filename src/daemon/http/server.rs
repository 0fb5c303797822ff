//! The HTTP port's accept loop, and what bounds what a client can hold on it.
//!
//! - **Header-read timeout** (`http.header_read_timeout_secs`, hyper's own `header_read_timeout`):
//!   a connection must send a whole request header within it, counted from when the server starts
//!   waiting for one (the connection opened, or its last answer was sent on a kept-alive
//!   connection); else hyper closes it. A client sending half a header and trickling the rest
//!   holds its connection no longer than this.
//! - **Request timeout** (`http.request_timeout_secs`, tower-http's `TimeoutLayer`): a request not
//!   answered within it gets `503` and its handler is dropped.
//! - **Connection cap** (`http.max_connections`): at most that many connections are held. At the
//!   cap, a new connection is admitted in place of the one that has waited longest for a request
//!   header, which is closed; when every held connection is inside a request, the new one is
//!   closed at once. Why not make it wait (in the kernel's backlog)? A probe would then queue
//!   behind every flooding connection, each held up to the header timeout, and Kubernetes
//!   restarts a healthy replica whose `/healthz` times out. A probe sends its header at once, so
//!   a flood cannot keep it out: flooding connections replace each other, not requests.
//!
//! Each connection is one task; on shutdown the loop stops accepting, asks every connection to
//! finish the request in flight (hyper's graceful shutdown) and waits for them.

use axum::http::StatusCode;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;
use tower_http::timeout::TimeoutLayer;

/// The limits of [`serve`], from `http.*`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub request_timeout: Duration,
    pub max_connections: usize,
}

impl Limits {
    pub fn of(http: &crate::config::HttpSettings) -> Self {
        Self {
            header_read_timeout: Duration::from_secs(http.header_read_timeout_secs),
            request_timeout: Duration::from_secs(http.request_timeout_secs),
            max_connections: usize::try_from(http.max_connections).unwrap_or(usize::MAX),
        }
    }
}

/// Serves `app` on `listener` within `limits` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = app.layer(TimeoutLayer::with_status_code(
        StatusCode::SERVICE_UNAVAILABLE,
        limits.request_timeout,
    ));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let slots = Arc::new(Slots::new(limits.max_connections));
    let stop = CancellationToken::new();
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, mostly: what is held frees within the timeouts.
                    tracing::warn!(error = %e, "HTTP: cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        while connections.try_join_next().is_some() {}
        let Some(slot) = slots.admit() else {
            tracing::debug!("HTTP: every connection is inside a request; closing a new one");
            continue;
        };
        connections.spawn(connection(
            stream,
            app.clone(),
            http.clone(),
            slot,
            stop.clone(),
        ));
    }
    stop.cancel();
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// One connection, until it closes, is evicted (closed at once) or the server stops (the request
/// in flight is finished first).
async fn connection(
    stream: TcpStream,
    app: Router,
    http: http1::Builder,
    slot: Slot,
    stop: CancellationToken,
) {
    let slot = Arc::new(slot);
    let evicted = slot.evict.clone();
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let busy = slot.clone().busy();
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await;
            drop(busy);
            response
        }
    });
    let conn = http.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = evicted.cancelled() => {}
        _ = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// The connections held, and which of them wait for a request header (the ones that may be
/// evicted), oldest first.
struct Slots {
    max: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    open: usize,
    next: u64,
    /// Connections waiting for a request header, by when they started waiting.
    waiting: BTreeMap<u64, CancellationToken>,
}

impl Slots {
    fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            inner: Mutex::new(Inner {
                open: 0,
                next: 0,
                waiting: BTreeMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a new connection: free, or taken from the connection that has waited longest
    /// for a request header (its token is cancelled, which closes it). `None` when every held
    /// connection is inside a request.
    fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut inner = self.lock();
        if inner.open >= self.max {
            let (_, oldest) = inner.waiting.pop_first()?;
            oldest.cancel();
            inner.open -= 1;
        }
        inner.open += 1;
        let evict = CancellationToken::new();
        let seq = inner.wait(evict.clone());
        Some(Slot {
            slots: self.clone(),
            evict,
            waiting: Mutex::new(Some(seq)),
        })
    }
}

impl Inner {
    fn wait(&mut self, evict: CancellationToken) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.waiting.insert(seq, evict);
        seq
    }
}

/// A held connection's place in [`Slots`]; released when the connection ends.
struct Slot {
    slots: Arc<Slots>,
    /// Cancelled when a new connection takes this one's place.
    evict: CancellationToken,
    /// Its key in `waiting` while it waits for a request header.
    waiting: Mutex<Option<u64>>,
}

impl Slot {
    /// Marks the connection as inside a request (not evictable) until the guard drops.
    fn busy(self: Arc<Self>) -> Busy {
        let mut inner = self.slots.lock();
        if let Some(seq) = self
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            inner.waiting.remove(&seq);
        }
        drop(inner);
        Busy(self)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut inner = self.slots.lock();
        if self.evict.is_cancelled() {
            return; // its place was taken and counted by `admit`
        }
        if let Some(seq) = self
            .waiting
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            inner.waiting.remove(&seq);
        }
        inner.open -= 1;
    }
}

/// A request in flight on a connection; when it is answered, the connection waits again.
struct Busy(Arc<Slot>);

impl Drop for Busy {
    fn drop(&mut self) {
        let slot = &self.0;
        let mut inner = slot.slots.lock();
        if !slot.evict.is_cancelled() {
            let seq = inner.wait(slot.evict.clone());
            *slot.waiting.lock().unwrap_or_else(|e| e.into_inner()) = Some(seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_cap_the_longest_waiting_connection_makes_room_and_busy_ones_are_kept() {
        let slots = Arc::new(Slots::new(2));
        let first = Arc::new(slots.admit().unwrap());
        let second = slots.admit().unwrap();
        let busy = first.clone().busy();
        // The cap is reached: the second (waiting for a header) makes room, the first (in a
        // request) is kept.
        let third = slots.admit().unwrap();
        assert!(second.evict.is_cancelled());
        assert!(!first.evict.is_cancelled());
        drop(second);
        assert_eq!(slots.lock().open, 2);
        // The first, answered, waits again; now it is the third that waited longest.
        drop(busy);
        let fourth = Arc::new(slots.admit().unwrap());
        assert!(third.evict.is_cancelled());
        assert!(!first.evict.is_cancelled());
        drop(third);
        // Every held connection inside a request: a new one gets no slot.
        let _first_busy = first.clone().busy();
        let _fourth_busy = fourth.clone().busy();
        assert!(slots.admit().is_none());
        assert_eq!(slots.lock().open, 2);
        drop(_first_busy);
        drop(first);
        assert_eq!(slots.lock().open, 1, "a closed connection frees its slot");
    }
}
