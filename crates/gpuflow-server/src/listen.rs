//! The listener's defences: what a client that connects and then says
//! nothing, or sends half a request, may hold.
//!
//! - At most [`max_connections`] connections at once (a connection past it
//!   is closed at once), with the process's open-file limit raised to its
//!   hard limit at start, so idle connections cannot take every descriptor
//!   (the store's, the agents').
//! - A connection that sends no complete request head within
//!   [`HEADER_TIMEOUT`] is closed (hyper's header-read timeout, and
//!   axum-server's first-request timeout for one that sends nothing).
//! - A connection on which no byte moves either way for [`IDLE_TIMEOUT`]
//!   is closed: an idle keep-alive connection, a half-sent body, a client
//!   that stopped reading. No endpoint streams, so a live exchange always
//!   moves bytes.
//!
//! It does not own: authentication or rate limits per caller (`auth.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The most time a request head may take to arrive.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The most time a connection may move no byte.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Raises the open-file limit to its hard limit; returns the soft limit now.
pub fn raise_nofile() -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write `l` only.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return 1024;
        }
        if l.rlim_cur < l.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: l.rlim_max,
                rlim_max: l.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                l = raised;
            }
        }
    }
    l.rlim_cur
}

/// Connections at once: 10,000, or fewer where the open-file limit
/// would not leave 1,024 descriptors for everything else.
pub fn max_connections(nofile: u64) -> usize {
    nofile.saturating_sub(1024).clamp(64, 10_000) as usize
}

/// An acceptor that bounds connections and closes idle ones, around
/// `inner` (plain, or TLS: the bound covers the handshake).
#[derive(Clone, Debug)]
pub struct Limited<A> {
    inner: A,
    slots: Arc<Semaphore>,
}

impl<A> Limited<A> {
    pub fn new(inner: A, max_connections: usize) -> Limited<A> {
        Limited {
            inner,
            slots: Arc::new(Semaphore::new(max_connections)),
        }
    }
}

impl<A, I, S> axum_server::accept::Accept<I, S> for Limited<A>
where
    A: axum_server::accept::Accept<Idle<I>, S> + Clone + Send + 'static,
    A::Future: Send,
    A::Stream: Send,
    A::Service: Send,
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Send + 'static,
{
    type Stream = A::Stream;
    type Service = A::Service;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<(A::Stream, A::Service)>> + Send>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let Ok(permit) = self.slots.clone().try_acquire_owned() else {
            tracing::warn!("too many connections: one closed at once");
            return Box::pin(std::future::ready(Err(std::io::Error::other(
                "too many connections",
            ))));
        };
        let inner = self.inner.clone();
        Box::pin(async move { inner.accept(Idle::new(stream, permit), service).await })
    }
}

/// A connection that fails once no byte has moved for [`IDLE_TIMEOUT`],
/// holding its slot until it is dropped.
#[derive(Debug)]
pub struct Idle<I> {
    io: I,
    timer: Pin<Box<tokio::time::Sleep>>,
    _slot: OwnedSemaphorePermit,
}

impl<I> Idle<I> {
    fn new(io: I, slot: OwnedSemaphorePermit) -> Idle<I> {
        Idle {
            io,
            timer: Box::pin(tokio::time::sleep(IDLE_TIMEOUT)),
            _slot: slot,
        }
    }

    fn moved(&mut self) {
        self.timer
            .as_mut()
            .reset(tokio::time::Instant::now() + IDLE_TIMEOUT);
    }

    /// On a pending operation: an error once the connection has been idle
    /// too long (the timer wakes the task then).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        self.timer.as_mut().poll(cx).is_ready()
    }
}

fn timed_out<T>() -> Poll<std::io::Result<T>> {
    Poll::Ready(Err(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "connection idle too long",
    )))
}

impl<I: AsyncRead + Unpin> AsyncRead for Idle<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.moved();
                }
                Poll::Ready(r)
            }
            Poll::Pending if self.expired(cx) => timed_out(),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Idle<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.io).poll_write(cx, buf) {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    self.moved();
                }
                Poll::Ready(r)
            }
            Poll::Pending if self.expired(cx) => timed_out(),
            Poll::Pending => Poll::Pending,
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
