//! Connections and their limits. Serving is hyper-util's `auto::Builder` (HTTP/1.1 and
//! HTTP/2) on tokio's timer, with these bounds, each a named default and a `dev`/`serve` flag:
//!
//! - at most [`CONNECTIONS_MAX`] open connections (a semaphore: the accept loop waits for a free
//!   slot, so a flood queues in the kernel's backlog instead of exhausting file descriptors);
//! - a request's head must arrive within [`HEADER_READ_TIMEOUT_S`]: counted for the first request
//!   from the accept (before hyper knows the protocol, by [`GuardedIo`]), then by hyper's own
//!   header timer, which also closes an HTTP/1.1 keep-alive connection waiting that long for its
//!   next request;
//! - a connection on which nothing is read or written for [`IDLE_TIMEOUT_S`] is closed (an idle
//!   HTTP/2 connection; a watch stream writes a heartbeat every 15 s, so it is never idle), and
//!   HTTP/2 peers are pinged every [`HTTP2_KEEP_ALIVE_S`] and dropped when they do not answer;
//! - a request body must arrive within [`BODY_READ_TIMEOUT_S`] of the handler asking for it
//!   (`rpc.rs`), so a slow body never holds a request slot longer than that;
//! - a request's head may hold at most [`HEAD_BYTES_MAX`] bytes (HTTP/1.1: `431 Request Header
//!   Fields Too Large` and the connection closed; HTTP/2: the header list bound), so the bytes an
//!   unauthenticated request makes the server read, parse and route are bounded before any of the
//!   gateway's code runs;
//! - a write that makes no progress for [`WRITE_STALL_S`] fails: a peer that stops reading fills
//!   its socket, and a watch stream would otherwise keep its watcher slot and its buffers as long
//!   as the peer keeps the connection open.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How long a write may wait on a peer that does not read, by default.
pub const WRITE_STALL_S: u64 = 30;
/// How long a request's head (request line and headers) may take to arrive, by default.
pub const HEADER_READ_TIMEOUT_S: u64 = 20;
/// How long a connection may carry nothing either way, by default.
pub const IDLE_TIMEOUT_S: u64 = 120;
/// How long a request body may take to arrive once the handler reads it, by default.
pub const BODY_READ_TIMEOUT_S: u64 = 30;
/// Connections open at once, by default: room for `watch::WATCHERS_MAX` watchers (one connection
/// each over HTTP/1.1) and as many again for requests. That is over the usual soft limit of 1,024
/// open files, so `dev` and `serve` raise their soft limit to the hard one at start, and warn when
/// even that is short of this plus the database's and the webhooks' own files.
pub const CONNECTIONS_MAX: usize = 2048;
/// HTTP/2 keep-alive: a ping this often, and the connection dropped if one is not answered
/// within as long again.
pub const HTTP2_KEEP_ALIVE_S: u64 = 20;
/// The largest request head (request line and headers) read, in bytes: 16 KiB, as Node's
/// default and twice one of nginx's large header buffers. A method name is at most
/// `api::METHOD_NAME_BYTES_MAX`, a token well under 200 bytes; hyper's floor for the HTTP/1.1 read
/// buffer is 8 KiB.
pub const HEAD_BYTES_MAX: usize = 16 * 1024;
const _: () = assert!(HEAD_BYTES_MAX >= 8192);
/// Streams one HTTP/2 connection may open at once.
pub const HTTP2_STREAMS_MAX: u32 = 64;
const _: () = assert!(HEADER_READ_TIMEOUT_S > 0 && HEADER_READ_TIMEOUT_S <= IDLE_TIMEOUT_S);

/// The next connection, with `TCP_NODELAY`. Connections that died before they were accepted are
/// skipped; other failures (out of file descriptors) are logged and retried after a pause
/// rather than in a spin.
pub async fn accept(listener: &tokio::net::TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                return stream;
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
                ) => {}
            Err(e) => {
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// An I/O object with the connection's deadlines: a write that makes no progress for
/// `write_stall` fails; a read waits at most `first_read` for the first bytes of the connection
/// and, after that, `idle` since the last byte read or written.
pub struct GuardedIo<T> {
    inner: T,
    write_stall: Duration,
    /// Started when a write first waits; cleared when one makes progress.
    stalled: Option<Pin<Box<Sleep>>>,
    first_read: Duration,
    idle: Duration,
    read_anything: bool,
    /// When a byte last went either way (or the connection was accepted).
    last_progress: Instant,
    /// Armed while a read waits.
    read_deadline: Option<Pin<Box<Sleep>>>,
}

/// The deadlines of one connection.
#[derive(Clone, Copy, Debug)]
pub struct Deadlines {
    pub write_stall: Duration,
    pub first_read: Duration,
    pub idle: Duration,
}

impl<T> GuardedIo<T> {
    pub fn new(inner: T, deadlines: Deadlines) -> Self {
        Self {
            inner,
            write_stall: deadlines.write_stall,
            stalled: None,
            first_read: deadlines.first_read,
            idle: deadlines.idle,
            read_anything: false,
            last_progress: Instant::now(),
            read_deadline: None,
        }
    }

    /// Only a write stall (the other deadlines far away): for tests of the write deadline.
    pub fn with_write_stall(inner: T, limit: Duration) -> Self {
        let far = Duration::from_secs(365 * 24 * 3600);
        Self::new(inner, Deadlines { write_stall: limit, first_read: far, idle: far })
    }

    fn check_write<R>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<R>>, progressed: bool) -> Poll<io::Result<R>> {
        match polled {
            Poll::Ready(r) => {
                self.stalled = None;
                if progressed {
                    self.last_progress = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.write_stall;
                let timer = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the peer read nothing for {} s", limit.as_secs_f64()),
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for GuardedIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.read_anything = true;
                    self.last_progress = Instant::now();
                }
                self.read_deadline = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let (limit, what) = if self.read_anything {
                    (self.idle, "the connection was idle")
                } else {
                    (self.first_read, "no request arrived")
                };
                let deadline = self.last_progress + limit;
                let timer = self.read_deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if timer.deadline() != deadline {
                    timer.as_mut().reset(deadline);
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("{what} for {} s", limit.as_secs_f64()),
                    )));
                }
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for GuardedIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        let progressed = matches!(polled, Poll::Ready(Ok(n)) if n > 0);
        self.check_write(cx, polled, progressed)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        let progressed = matches!(polled, Poll::Ready(Ok(n)) if n > 0);
        self.check_write(cx, polled, progressed)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.check_write(cx, polled, false)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_write_to_a_peer_that_does_not_read_fails_after_the_limit() {
        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut guarded = GuardedIo::with_write_stall(ours, Duration::from_millis(200));
        let started = std::time::Instant::now();
        let err = guarded.write_all(&[7u8; 4096]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
        // A peer that reads keeps the connection going, however long the whole write takes.
        let (ours, theirs2) = tokio::io::duplex(64);
        let mut guarded = GuardedIo::with_write_stall(ours, Duration::from_millis(200));
        let reader = tokio::spawn(async move {
            let mut theirs2 = theirs2;
            let mut got = vec![0u8; 4096];
            for chunk in got.chunks_mut(64) {
                tokio::time::sleep(Duration::from_millis(5)).await;
                theirs2.read_exact(chunk).await.unwrap();
            }
            got
        });
        guarded.write_all(&[9u8; 4096]).await.unwrap();
        assert!(reader.await.unwrap().iter().all(|b| *b == 9));
        let _ = theirs.read(&mut [0u8; 1]).await;
    }

    #[tokio::test]
    async fn a_read_fails_when_nothing_arrives_first_then_when_idle() {
        let deadlines = Deadlines {
            write_stall: Duration::from_secs(60),
            first_read: Duration::from_millis(100),
            idle: Duration::from_millis(300),
        };
        let (ours, _theirs) = tokio::io::duplex(64);
        let mut guarded = GuardedIo::new(ours, deadlines);
        let started = std::time::Instant::now();
        let err = guarded.read(&mut [0u8; 8]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("no request arrived"), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(100) && started.elapsed() < Duration::from_millis(300));

        let (ours, mut theirs) = tokio::io::duplex(64);
        let mut guarded = GuardedIo::new(ours, deadlines);
        theirs.write_all(b"GET").await.unwrap();
        assert_eq!(guarded.read(&mut [0u8; 8]).await.unwrap(), 3);
        let started = std::time::Instant::now();
        let err = guarded.read(&mut [0u8; 8]).await.unwrap_err();
        assert!(err.to_string().contains("idle"), "{err}");
        assert!(started.elapsed() >= Duration::from_millis(250), "{:?}", started.elapsed());
    }
}
