//! Leadership of a store that several servers share (a standby that takes
//! over): one server leads by a lease in the store, timed by the database's
//! clock, and stamps every commit with its fencing token, so that a
//! deposed leader's writes are refused by the database itself. The others
//! wait, before loading any state, until the lease lapses; then one takes
//! it with the next token and starts from what the store holds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpuflow_store::Store;
use tokio::sync::Notify;

/// This server's lease: its token, and whether it has lost it.
#[derive(Debug)]
pub struct Lease {
    /// The fencing token every commit carries.
    pub token: u64,
    /// Seconds the lease lasts unless renewed.
    pub ttl_s: u64,
    lost: AtomicBool,
    /// Woken when the lease is lost ([`Lease::lost`]).
    pub lost_notify: Notify,
}

impl Lease {
    /// Whether another server took the lease over, or this one could not
    /// renew it in time: the server must stop.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    fn lose(&self) {
        self.lost.store(true, Ordering::Release);
        self.lost_notify.notify_waiters();
    }
}

/// A name for this server process in the lease: unique among servers.
pub fn holder_name() -> String {
    let mut b = [0u8; 6];
    let _ = getrandom::fill(&mut b);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!(
        "{}:{}:{}",
        host.trim(),
        std::process::id(),
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

/// Waits until this server holds the lease (at once when no one does, or
/// when its holder let it lapse), then fences the store with its token.
/// A busy lease or a database that does not answer is waited out.
pub async fn acquire(
    store: &dyn Store,
    holder: &str,
    addr: &str,
    ttl_s: u64,
    standby: impl Fn(&gpuflow_store::Leader),
) -> Lease {
    let mut told = None;
    loop {
        match store.acquire_lease(holder, addr, ttl_s).await {
            Ok(Ok(token)) => {
                store.fence(token);
                tracing::info!(token, holder, "leading: this server holds the lease");
                return Lease {
                    token,
                    ttl_s,
                    lost: AtomicBool::new(false),
                    lost_notify: Notify::new(),
                };
            }
            Ok(Err(leader)) => {
                standby(&leader);
                if told.as_ref() != Some(&leader.token) {
                    tracing::info!(
                        leader = %leader.holder,
                        addr = %leader.addr,
                        lapses_in_s = leader.expires_in.max(0),
                        "standby: another server leads; taking over when its lease lapses"
                    );
                    told = Some(leader.token);
                }
            }
            Err(e) => tracing::warn!(error = %e, "standby: cannot read the lease; trying again"),
        }
        tokio::time::sleep(poll(ttl_s)).await;
    }
}

/// How often a standby looks at the lease, and a leader renews it.
fn poll(ttl_s: u64) -> Duration {
    Duration::from_millis((ttl_s * 1000 / 3).clamp(200, 1000))
}

/// Renews `lease` until it is lost: taken over by another server, or not
/// renewed for its whole term (a database cut off from this server); then
/// marks it lost ([`Lease::lost`]) and ends. Its writes are refused by then
/// in any case: the store checks the token of every commit.
pub async fn keep(store: Arc<dyn Store>, lease: Arc<Lease>) {
    let term = Duration::from_secs(lease.ttl_s);
    // When the last renewal that held was sent: the lease lasts at least
    // its term from then.
    let mut renewed = Instant::now();
    loop {
        tokio::time::sleep(poll(lease.ttl_s)).await;
        let sent = Instant::now();
        // A database that does not answer is given until the term ends.
        let left = term
            .saturating_sub(renewed.elapsed())
            .max(Duration::from_millis(200));
        let answer = tokio::time::timeout(left, store.renew_lease(lease.token, lease.ttl_s))
            .await
            .unwrap_or_else(|_| {
                Err(gpuflow_store::StoreError::Unanswered {
                    waited_ms: left.as_millis() as u64,
                })
            });
        match answer {
            Ok(true) => renewed = sent,
            Ok(false) => {
                tracing::error!(
                    token = lease.token,
                    "deposed: another server took the lease over; stopping"
                );
                lease.lose();
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot renew the lease");
                if renewed.elapsed() >= term {
                    tracing::error!(
                        ttl_s = lease.ttl_s,
                        "the lease was not renewed for its whole term; stopping"
                    );
                    lease.lose();
                    return;
                }
            }
        }
    }
}

/// The header a standby's answers carry: clients given several servers
/// move on to the next.
pub const STANDBY_HEADER: &str = "x-gpuflow-standby";

/// What a standby answers while it waits: 503 with code `standby`, the
/// leader's address in the message and in `X-Gpuflow-Leader`,
/// [`STANDBY_HEADER`] and `Retry-After`. A browser's page request (a GET
/// that accepts HTML) is sent on to the same page of a leader whose lease
/// holds (307): the dashboard follows the leader. `tls`: whether a leader
/// advertised as a bare address is reached by HTTPS (as this server is).
pub fn standby_router(
    leader: tokio::sync::watch::Receiver<Option<gpuflow_store::Leader>>,
    tls: bool,
) -> axum::Router {
    use axum::response::IntoResponse;
    axum::Router::new().fallback(move |req: axum::extract::Request| {
        let leader = leader.borrow().clone();
        async move {
            if let Some(to) = leader
                .as_ref()
                .filter(|l| l.expires_in >= 0 && !l.addr.is_empty())
                .and_then(|l| page_on_leader(&req, &l.addr, tls))
            {
                return (
                    axum::http::StatusCode::TEMPORARY_REDIRECT,
                    [(axum::http::header::LOCATION, to)],
                )
                    .into_response();
            }
            let (message, addr) = match leader {
                Some(l) if l.expires_in >= 0 => (
                    format!(
                        "this server is a standby: the leader is {} (its lease runs {} s more unless renewed); ask it, or wait for this one to take over",
                        l.addr, l.expires_in
                    ),
                    l.addr,
                ),
                Some(l) => (
                    format!(
                        "this server is a standby, taking over from {} whose lease lapsed; retry in a moment",
                        l.addr
                    ),
                    l.addr,
                ),
                None => (
                    "this server is a standby, waiting for the leadership lease; retry in a moment"
                        .to_string(),
                    String::new(),
                ),
            };
            let mut r = (
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                axum::Json(gpuflow_api::ApiError::new(503, "standby", message)),
            )
                .into_response();
            let h = r.headers_mut();
            h.insert("retry-after", axum::http::HeaderValue::from_static("1"));
            h.insert(STANDBY_HEADER, axum::http::HeaderValue::from_static("1"));
            if let Ok(v) = axum::http::HeaderValue::from_str(&addr) {
                h.insert("x-gpuflow-leader", v);
            }
            r
        }
    })
}

/// Where a browser's page request `req` goes on the leader at `addr` (a
/// URL, or an address reached by this server's scheme): `None` for
/// anything but a GET that accepts HTML.
fn page_on_leader(
    req: &axum::extract::Request,
    addr: &str,
    tls: bool,
) -> Option<axum::http::HeaderValue> {
    let html = req
        .headers()
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"));
    if req.method() != axum::http::Method::GET || !html {
        return None;
    }
    let base = addr.trim_end_matches('/');
    let base = if base.starts_with("http://") || base.starts_with("https://") {
        base.to_string()
    } else {
        format!("{}://{base}", if tls { "https" } else { "http" })
    };
    let path = req
        .uri()
        .path_and_query()
        .map_or("/", axum::http::uri::PathAndQuery::as_str);
    axum::http::HeaderValue::from_str(&format!("{base}{path}")).ok()
}
