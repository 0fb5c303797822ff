//! A TCP proxy in front of PostgreSQL's Unix socket, one per settlementd process, so the campaign
//! can hurt one process's connections and see what each of them is doing.
//!
//! Faults ([`Net`]): `Blackhole` holds every byte in both directions, on every connection, without
//! closing anything (a partition: what was sent arrives when it heals, as TCP would retransmit
//! it); `Reset` closes every open connection at once with an RST; `Delay` holds each chunk for a
//! while before passing it on. New connections meet the fault in force as existing ones do.
//!
//! The proxy also reads the server's `ReadyForQuery` messages (the protocol's last word after
//! every query, with the session's transaction status), so [`Proxy::between_transactions`] can
//! tell that none of the process's sessions has a transaction open or a statement in flight: the
//! moment at which a stopped process is a would-be zombie that the fence, not the server's
//! `idle_in_transaction_session_timeout`, must stop.

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

#[derive(Debug)]
struct Shared {
    socket: PathBuf,
    net: Mutex<Net>,
    conns: Mutex<Vec<Arc<Conn>>>,
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

    /// True when every open connection is idle outside a transaction with nothing in flight.
    pub fn between_transactions(&self) -> bool {
        self.shared
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|c| !c.closed.load(Ordering::SeqCst))
            .all(|c| c.status.load(Ordering::SeqCst) == b'I' && !c.busy.load(Ordering::SeqCst))
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
                for status in reader.feed(&buf[..read]) {
                    conn.status.store(status, Ordering::SeqCst);
                    conn.busy.store(false, Ordering::SeqCst);
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
