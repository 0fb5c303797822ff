//! A TCP proxy in front of PostgreSQL's Unix socket, one per settlementd process, so the campaign
//! can hurt one process's connections and see what each of them is doing.
//!
//! Faults ([`Net`]): `Blackhole` holds every byte in both directions, on every connection, without
//! closing anything (a partition: what was sent arrives when it heals, as TCP would retransmit
//! it); `Reset` closes every open connection at once with an RST; `Delay` holds each chunk for a
//! while before passing it on. New connections meet the fault in force as existing ones do.
//!
//! The proxy also reads the server's `ReadyForQuery` messages (the protocol's last word after
//! every query, with the session's transaction status), so
//! [`Proxy::catch_between_transactions`] can hold the answer that leaves none of the process's
//! sessions with a transaction open or a statement in flight (a batch's COMMIT) until the process
//! is stopped: a would-be zombie that the fence, not the server's
//! `idle_in_transaction_session_timeout`, must stop when it wakes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio_util::sync::CancellationToken;

/// A network fault a proxy plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Net {
    Pass,
    Blackhole,
    Delay(Duration),
}

/// What the proxy knows of one connection.
#[derive(Debug, Default)]
struct Conn {
    /// The transaction status of the last `ReadyForQuery` ('I', 'T', 'E'; 0 before the first).
    status: AtomicU8,
    /// The client sent something after the last `ReadyForQuery`.
    busy: AtomicBool,
    closed: AtomicBool,
    /// Cancelled to reset the connection.
    reset: CancellationToken,
}

/// An armed catch: told when the process comes between transactions, then waits to be released.
type Catch = (
    tokio::sync::oneshot::Sender<()>,
    tokio::sync::oneshot::Receiver<()>,
);

#[derive(Debug)]
struct Shared {
    socket: PathBuf,
    net: Mutex<Net>,
    conns: Mutex<Vec<Arc<Conn>>>,
    catch: Mutex<Option<Catch>>,
}

impl Shared {
    fn net(&self) -> Net {
        *self.net.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One proxy: a loopback port that leads to the server's socket.
#[derive(Debug, Clone)]
pub struct Proxy {
    pub port: u16,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl Proxy {
    /// A proxy to the server socket file `socket` (`…/.s.PGSQL.<port>`).
    pub async fn start(socket: PathBuf) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            socket,
            net: Mutex::new(Net::Pass),
            conns: Mutex::new(Vec::new()),
            catch: Mutex::new(None),
        });
        let stop = CancellationToken::new();
        let (accepting, halt) = (shared.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    _ = halt.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                };
                let conn = Arc::new(Conn::default());
                {
                    let mut conns = accepting.conns.lock().unwrap_or_else(|p| p.into_inner());
                    conns.retain(|c| !c.closed.load(Ordering::SeqCst));
                    conns.push(conn.clone());
                }
                tokio::spawn(serve(client, accepting.clone(), conn));
            }
        });
        Ok(Self { port, shared, stop })
    }

    /// Puts `net` in force for every connection, open or to come.
    pub fn set(&self, net: Net) {
        *self.shared.net.lock().unwrap_or_else(|p| p.into_inner()) = net;
    }

    /// Closes every open connection with an RST.
    pub fn reset(&self) {
        for conn in self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            conn.reset.cancel();
        }
    }

    /// Waits up to `within` for the moment a server answer brings the process between
    /// transactions (that connection's `ReadyForQuery` says idle, and every other connection is
    /// idle with nothing in flight), holds that answer, runs `then` (a SIGSTOP), and only then
    /// passes the answer on. True when it was caught.
    pub async fn catch_between_transactions(&self, within: Duration, then: impl FnOnce()) -> bool {
        let (caught_tx, caught_rx) = tokio::sync::oneshot::channel();
        let (release_tx, release_rx) = tokio::sync::oneshot::channel();
        *self.shared.catch.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((caught_tx, release_rx));
        let caught = tokio::time::timeout(within, caught_rx).await;
        self.shared
            .catch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match caught {
            Ok(Ok(())) => {
                then();
                let _ = release_tx.send(());
                true
            }
            _ => false,
        }
    }

    /// Stops accepting (open connections end with their process).
    pub fn shut(&self) {
        self.stop.cancel();
        self.reset();
    }
}

async fn serve(client: TcpStream, shared: Arc<Shared>, conn: Arc<Conn>) {
    // A partitioned network does not let a new connection through either.
    while shared.net() == Net::Blackhole && !conn.reset.is_cancelled() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let Ok(server) = UnixStream::connect(&shared.socket).await else {
        conn.closed.store(true, Ordering::SeqCst);
        return;
    };
    let _ = client.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pipe(client_read, server_write, &shared, &conn, Direction::Up);
    let down = pipe(server_read, client_write, &shared, &conn, Direction::Down);
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = conn.reset.cancelled() => {}
    }
    conn.closed.store(true, Ordering::SeqCst);
    // Dropping the halves here closes both sockets; the client's with an RST when it was reset.
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// Client to server.
    Up,
    /// Server to client.
    Down,
}

async fn pipe<R, W>(mut from: R, mut to: W, shared: &Shared, conn: &Conn, dir: Direction)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin + Linger,
{
    let mut buf = vec![0u8; 16 * 1024];
    let mut reader = MessageReader::default();
    loop {
        let read = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => {
                    let _ = to.shutdown().await;
                    return;
                }
                Ok(read) => read,
            },
            _ = conn.reset.cancelled() => {
                to.linger_zero();
                return;
            }
        };
        match dir {
            Direction::Up => conn.busy.store(true, Ordering::SeqCst),
            Direction::Down => {
                let mut idle_now = false;
                for status in reader.feed(&buf[..read]) {
                    conn.status.store(status, Ordering::SeqCst);
                    conn.busy.store(false, Ordering::SeqCst);
                    idle_now = status == b'I';
                }
                if idle_now && reader.at_boundary() {
                    hold_if_caught(shared, conn).await;
                }
            }
        }
        loop {
            match shared.net() {
                Net::Pass => break,
                Net::Blackhole => {
                    if conn.reset.is_cancelled() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Net::Delay(by) => {
                    tokio::time::sleep(by).await;
                    break;
                }
            }
        }
        if to.write_all(&buf[..read]).await.is_err() {
            return;
        }
    }
}

/// When a catch is armed and every other connection of the process is idle too, tells the
/// catcher and waits (at most a second) for it to release this answer.
async fn hold_if_caught(shared: &Shared, conn: &Conn) {
    let others_idle = shared
        .conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|c| !c.closed.load(Ordering::SeqCst) && !std::ptr::eq(c.as_ref(), conn))
        .all(|c| c.status.load(Ordering::SeqCst) == b'I' && !c.busy.load(Ordering::SeqCst));
    if !others_idle {
        return;
    }
    let armed = shared
        .catch
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some((caught, release)) = armed {
        if caught.send(()).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(1), release).await;
        }
    }
}

/// Closing with an RST where the stream allows it.
trait Linger {
    fn linger_zero(&mut self) {}
}

impl Linger for tokio::net::tcp::OwnedWriteHalf {
    fn linger_zero(&mut self) {
        #[allow(deprecated)]
        let _ = self.as_ref().set_linger(Some(Duration::ZERO));
    }
}

impl Linger for tokio::net::unix::OwnedWriteHalf {}

/// Follows the server's message stream (type byte, 4-byte length, body) and yields the status
/// byte of every `ReadyForQuery` ('Z').
#[derive(Debug, Default)]
struct MessageReader {
    header: [u8; 5],
    header_len: usize,
    /// Body bytes still to skip of the current message.
    body_left: usize,
    /// The current message is a `ReadyForQuery` whose status byte comes next.
    want_status: bool,
}

impl MessageReader {
    /// Whether the bytes fed so far end exactly at a message's end.
    fn at_boundary(&self) -> bool {
        self.header_len == 0 && self.body_left == 0
    }

    fn feed(&mut self, mut bytes: &[u8]) -> Vec<u8> {
        let mut statuses = Vec::new();
        while !bytes.is_empty() {
            if self.body_left > 0 {
                if self.want_status {
                    statuses.push(bytes[0]);
                    self.want_status = false;
                }
                let take = self.body_left.min(bytes.len());
                self.body_left -= take;
                bytes = &bytes[take..];
                continue;
            }
            let take = (5 - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + take].copy_from_slice(&bytes[..take]);
            self.header_len += take;
            bytes = &bytes[take..];
            if self.header_len == 5 {
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]) as usize;
                self.body_left = len.saturating_sub(4);
                self.want_status = self.header[0] == b'Z' && self.body_left > 0;
                self.header_len = 0;
            }
        }
        statuses
    }
}

#[cfg(test)]
mod tests {
    use super::MessageReader;

    #[test]
    fn ready_for_query_is_found_across_chunk_boundaries() {
        // CommandComplete "BEGIN", then ReadyForQuery 'T', then ReadyForQuery 'I'.
        let mut stream = vec![b'C', 0, 0, 0, 10];
        stream.extend_from_slice(b"BEGIN\0");
        stream.extend_from_slice(&[b'Z', 0, 0, 0, 5, b'T', b'Z', 0, 0, 0, 5, b'I']);
        for cut in 0..stream.len() {
            let mut reader = MessageReader::default();
            let mut seen = reader.feed(&stream[..cut]);
            seen.extend(reader.feed(&stream[cut..]));
            assert_eq!(seen, vec![b'T', b'I'], "cut at {cut}");
        }
    }
}
