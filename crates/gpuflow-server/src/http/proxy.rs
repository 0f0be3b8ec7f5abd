//! The way into a job's web interfaces: HTTP and WebSocket (any HTTP/1.1
//! upgrade) proxied to the ports its tasks declared (`ports:`; a
//! notebook's `http` by default), at `/v1/jobs/{id}/proxy/{port}/...`,
//! for those who may see the job (others get 404, as for the job itself).
//!
//! A browser cannot send a bearer token when it follows a link, so the
//! dashboard first asks `POST /v1/jobs/{id}/proxy-session` (with its
//! token) for a cookie that only this job's proxy path receives
//! (`HttpOnly`, `SameSite=Strict`) and that only the proxy reads: the rest
//! of the API never takes a token from a cookie. The proxy passes neither
//! the caller's `Authorization` header nor that cookie on to the task.
//!
//! The request goes to the task's node with its path unchanged, so an
//! application given its base path (`GPUFLOW_BASE_URL`; JupyterLab's
//! `--ServerApp.base_url`) serves under it.

use super::*;
use axum::extract::Request;
use axum::http::{HeaderValue, Uri, header};
use axum::routing::any;
use hyper_util::rt::TokioIo;

use crate::http::auth::{Caller, bearer, caller_of};

/// The cookie `proxy-session` sets.
const COOKIE: &str = "gpuflow_proxy";

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/jobs/{id}/proxy-session",
            post_with(session, doc("any token (own team)", "A cookie (HttpOnly, for this job's proxy path only, read by nothing else) that lets a browser through the job's proxy")),
        )
        .route("/v1/jobs/{id}/proxy/{port}", any(to_slash))
        .route("/v1/jobs/{id}/proxy/{port}/", any(proxy))
        .route("/v1/jobs/{id}/proxy/{port}/{*rest}", any(proxy))
        .api_route_docs(
            "/v1/jobs/{id}/proxy/{port}/{path}",
            // Any method, passed on as it came: documented as GET, its
            // path as OpenAPI writes a path that may hold slashes.
            by_hand(
                "get",
                "any token or the proxy-session cookie (own team)",
                "HTTP and WebSocket (any method) proxied to a port a running task of the job declared (`ports:`; a notebook's `http`), path and query unchanged; the caller's token is not passed on",
            ),
        )
}

/// `.../proxy/PORT` → `.../proxy/PORT/`: relative links resolve under it.
async fn to_slash(uri: Uri) -> Response {
    let to = match uri.query() {
        Some(q) => format!("{}/?{q}", uri.path()),
        None => format!("{}/", uri.path()),
    };
    (
        StatusCode::PERMANENT_REDIRECT,
        [(header::LOCATION, to)],
        axum::body::Body::empty(),
    )
        .into_response()
}

/// Sets the cookie that lets a browser through this job's proxy path.
async fn session(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, Error> {
    let id = super::jobs::job_id(&id)?;
    {
        let world = shared.world.lock().await;
        super::jobs::visible(&world, &caller, id)?;
        reaches(&world, &caller, id)?;
    }
    let token = bearer(&headers).unwrap_or_default();
    let cookie = format!(
        "{COOKIE}={token}; Path=/v1/jobs/{id}/proxy/; HttpOnly; SameSite=Strict{}",
        if shared.cfg.tls.is_some() {
            "; Secure"
        } else {
            ""
        }
    );
    let cookie = HeaderValue::from_str(&cookie).map_err(|_| {
        ApiError::bad_request("bad_token", "the token holds characters a cookie cannot")
    })?;
    Ok((
        StatusCode::NO_CONTENT,
        [(header::SET_COOKIE, cookie)],
        axum::body::Body::empty(),
    )
        .into_response())
}

/// The request's cookies, `name=value` each.
fn cookies(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .map(str::trim)
        .filter(|c| !c.is_empty())
}

/// The proxy's token: the bearer header, else this path's cookie.
fn token_of(headers: &HeaderMap) -> Option<String> {
    if let Some(t) = bearer(headers) {
        return Some(t.to_string());
    }
    cookies(headers).find_map(|c| {
        let (k, v) = c.split_once('=')?;
        (k == COOKIE).then(|| v.to_string())
    })
}

/// The request's cookies less the proxy's own, as one header (none left:
/// `None`).
fn cookies_for_task(headers: &HeaderMap) -> Option<HeaderValue> {
    let kept: Vec<&str> = cookies(headers)
        .filter(|c| c.split_once('=').is_none_or(|(k, _)| k != COOKIE))
        .collect();
    (!kept.is_empty())
        .then(|| HeaderValue::from_str(&kept.join("; ")).ok())
        .flatten()
}

/// Where job `id`'s task serving on `port` runs: `address:port`. 404 when
/// no running task of it declared that port.
/// Whether `caller` may reach job `id`'s ports: who may act on it (a
/// notebook's port runs code as the job).
fn reaches(world: &World, caller: &Caller, id: u64) -> Result<(), Error> {
    match world.jobs().get(&id) {
        Some(j) => Ok(caller.acts_on_job(world, &j.team, &j.user, "reach the ports of")?),
        None => Ok(()),
    }
}

fn target(world: &World, id: u64, port: u16) -> Result<String, Error> {
    let j = world.jobs().get(&id).ok_or_else(|| {
        ApiError::not_found(format!("job {id} is not running: nothing to proxy to"))
    })?;
    let task = j.tasks.iter().find(|t| {
        t.phase == gpuflow_api::TaskPhase::Running
            && (t.ports.values().any(|&p| p == port) || t.port == Some(port))
    });
    let Some(task) = task else {
        let open: Vec<String> = j
            .task_views()
            .iter()
            .flat_map(|t| t.ports.iter().map(|p| format!("{} ({})", p.port, p.name)))
            .collect();
        return Err(ApiError::not_found(if open.is_empty() {
            format!(
                "job {id} has no running task that serves on a port (declare `ports:` on its task)"
            )
        } else {
            format!(
                "no running task of job {id} serves on port {port}; its ports: {}",
                open.join(", ")
            )
        })
        .into());
    };
    let node = j
        .allocs
        .iter()
        .find(|a| a.group == task.group && a.index == task.index)
        .map(|a| a.node.clone())
        .unwrap_or_default();
    let host = world.node_address(&node);
    Ok(if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    })
}

fn bad_gateway(msg: String) -> Error {
    ApiError::new(502, "bad_gateway", msg).into()
}

async fn proxy(
    State(shared): State<Arc<Shared>>,
    Path(params): Path<BTreeMap<String, String>>,
    mut req: Request,
) -> Result<Response, Error> {
    let ip = crate::http::auth::client_ip(req.extensions());
    let token = token_of(req.headers());
    let caller = caller_of(&shared, token.as_deref(), ip).await?;
    let id = super::jobs::job_id(params.get("id").map_or("", String::as_str))?;
    let port: u16 = params
        .get("port")
        .and_then(|p| p.parse().ok())
        .filter(|&p| p > 0)
        .ok_or_else(|| {
            ApiError::bad_request("bad_port", "the port must be a number from 1 to 65535")
        })?;
    let addr = {
        let world = shared.world.lock().await;
        super::jobs::visible(&world, &caller, id)?;
        reaches(&world, &caller, id)?;
        target(&world, id, port)?
    };
    let stream = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::TcpStream::connect(&addr),
    )
    .await
    .map_err(|_| {
        bad_gateway(format!(
            "job {id}'s port {port} ({addr}) did not answer within 10 s"
        ))
    })?
    .map_err(|e| bad_gateway(format!("job {id}'s port {port} ({addr}) refused: {e}")))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| bad_gateway(format!("job {id}'s port {port}: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "a proxied connection ended");
        }
    });
    // What the task must not see: the caller's credentials.
    let upgrading = req.headers().contains_key(header::UPGRADE);
    let client_upgrade = upgrading.then(|| hyper::upgrade::on(&mut req));
    let headers = req.headers_mut();
    headers.remove(header::AUTHORIZATION);
    match cookies_for_task(headers) {
        Some(c) => {
            headers.insert(header::COOKIE, c);
        }
        None => {
            headers.remove(header::COOKIE);
        }
    }
    headers.insert(
        "x-forwarded-for",
        HeaderValue::from_str(&ip.to_string()).expect("an address is a header value"),
    );
    let mut resp = send
        .send_request(req)
        .await
        .map_err(|e| bad_gateway(format!("job {id}'s port {port}: {e}")))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client) = client_upgrade
    {
        let task = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            match tokio::try_join!(client, task) {
                Ok((c, t)) => {
                    let (mut c, mut t) = (TokioIo::new(c), TokioIo::new(t));
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut t).await;
                }
                Err(e) => tracing::debug!(error = %e, "a proxied upgrade failed"),
            }
        });
    }
    Ok(resp.map(axum::body::Body::new))
}
