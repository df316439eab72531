//! Connections with a write deadline. A peer that stops reading fills its socket, and a write
//! then waits for ever: a watch stream would keep its watcher slot and its buffers as long as
//! the peer keeps the connection open. Every accepted connection is wrapped so that a write
//! that makes no progress for [`WRITE_STALL_S`] (`dev`/`serve --write-stall`) fails, and the
//! server drops the connection.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// How long a write may wait on a peer that does not read, by default.
pub const WRITE_STALL_S: u64 = 30;

/// A listener whose connections fail a write stalled for longer than `stall`.
pub struct DeadlineListener {
    pub inner: TcpListener,
    pub stall: Duration,
}

impl axum::serve::Listener for DeadlineListener {
    type Io = StallGuard<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.inner.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    return (StallGuard::new(stream, self.stall), addr);
                }
                // A connection that died before it was accepted: take the next one.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
                    ) => {}
                // Out of file descriptors and the like: wait rather than spin.
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// An I/O object whose writes fail after `limit` without progress.
pub struct StallGuard<T> {
    inner: T,
    limit: Duration,
    /// Started when a write first waits; cleared when one makes progress.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> StallGuard<T> {
    pub fn new(inner: T, limit: Duration) -> Self {
        Self { inner, limit, stalled: None }
    }

    fn check<R>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        match polled {
            Poll::Ready(r) => {
                self.stalled = None;
                Poll::Ready(r)
            }
            Poll::Pending => {
                let limit = self.limit;
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

impl<T: AsyncRead + Unpin> AsyncRead for StallGuard<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallGuard<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.check(cx, polled)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.check(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.check(cx, polled)
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
        let mut guarded = StallGuard::new(ours, Duration::from_millis(200));
        let started = std::time::Instant::now();
        let err = guarded.write_all(&[7u8; 4096]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));
        // A peer that reads keeps the connection going, however long the whole write takes.
        let (ours, theirs2) = tokio::io::duplex(64);
        let mut guarded = StallGuard::new(ours, Duration::from_millis(200));
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
}
