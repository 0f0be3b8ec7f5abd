//! The `/v1` HTTP API: one module per resource, each with its `router()`,
//! merged in [`router`] with the agent protocol's routes, the body limits and
//! the `detached` layer. Every handler checks the caller's role and team
//! before it reads or changes anything; every change is committed (with an
//! event or an audit line) before the reply. Bad input gets a 4xx with
//! `{code, message}` naming the problem; a store failure gets a bare 500 and
//! one log line. Job transitions are the lifecycle's (`lifecycle.rs`).

pub mod agent;
pub mod auth;
mod clusters;
mod doc;
mod events;
pub mod exec;
mod jobs;
pub mod metrics;
mod nodes;
mod params;
mod projects;
mod proxy;
mod queues;
mod reports;
mod reservations;
mod services;
mod teams;
mod tokens;
mod ui;
mod users;
mod webhooks;

use std::collections::BTreeMap;
use std::sync::Arc;

use aide::axum::routing::{delete_with, get_with, patch_with, post_with, put_with};
use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use doc::{ApiRouter, Created, Ext, JsonBody, SpecBody, Warned, by_hand, doc, node_token};
use gpuflow_api::{
    self as api, ApiError, JobSpec, JobState, NodeState, QueuePatch, QueueSpec, Role, Team,
    TokenCreated, TokenRequest, User,
};
use serde::Serialize;

use crate::http::auth::Caller;
use crate::http::params::{NamePage, Params};
use crate::secret::{hash, new_token};
use crate::state::{JobRec, TokenRec, World};
use crate::{Change, Gone, Rec, Shared};

/// An error reply.
#[derive(Debug)]
pub struct Error(pub ApiError);
impl From<ApiError> for Error {
    fn from(e: ApiError) -> Error {
        Error(e)
    }
}
impl From<crate::ServerError> for Error {
    fn from(e: crate::ServerError) -> Error {
        tracing::error!(error = ?e, "request failed inside the server");
        Error(ApiError::new(
            500,
            "internal",
            "internal error; the server log has the details",
        ))
    }
}
impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.0)).into_response()
    }
}
type Reply<T> = Result<Json<T>, Error>;
/// Parses a JSON body strictly, naming the field at fault.
///
/// # Errors
/// A 400 with the field's path.
pub fn parse_json<T: for<'de> serde::Deserialize<'de>>(body: &[u8]) -> Result<T, Error> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." {
            String::new()
        } else {
            format!("{path}: ")
        };
        Error::from(ApiError::bad_request(
            "invalid_body",
            format!("{at}{}", e.inner()),
        ))
    })?;
    // One JSON document and nothing after it but white space.
    de.end().map_err(|e| {
        ApiError::bad_request(
            "invalid_body",
            format!("{e}: the body must be one JSON document with nothing after it"),
        )
    })?;
    Ok(value)
}
pub fn router(shared: Arc<Shared>) -> Router {
    let limit = shared.cfg.max_body_bytes;
    // The document's schemas as JSON Schema 2020-12; the error reply's
    // schema is every route's.
    aide::generate::in_context(|ctx| {
        ctx.schema = crate::openapi::schema_generator();
        ctx.schema.subschema_for::<ApiError>();
    });
    // Two bodies or two parameters of one name on a route: a mistake in
    // the routes, shown where tests see it.
    aide::generate::on_error(|e| tracing::error!(error = %e, "the OpenAPI document"));
    let mut api = aide::openapi::OpenApi::default();
    let routes = ApiRouter::new()
        .api_route(
            "/v1/openapi.json",
            get_with(openapi, doc("anyone", "This document")),
        )
        .api_route(
            "/v1/whoami",
            get_with(whoami, doc("any token", "The caller's user, team and role")),
        )
        .api_route(
            "/v1/auth/providers",
            get_with(
                providers,
                doc(
                    "anyone",
                    "The identity providers users sign in through (OpenID Connect): issuer, public client id, scopes",
                ),
            ),
        )
        .merge(jobs::router())
        .merge(events::router())
        .merge(nodes::router())
        .merge(queues::router())
        .merge(teams::router())
        .merge(projects::router())
        .merge(users::router())
        .merge(tokens::router())
        .merge(reports::router())
        .merge(clusters::router())
        .merge(services::router())
        .merge(proxy::router())
        .merge(exec::router())
        .merge(webhooks::router())
        .merge(reservations::router())
        .merge(metrics::router())
        .merge(ui::router())
        // A heartbeat carries every task of a node: it may be larger.
        .api_route(
            "/v1/agent/register",
            post_with(crate::http::agent::register, |op| {
                doc("join token", "A node agent joins and gets its node token")(
                    node_token(op),
                )
                .input::<JsonBody<api::Register>>()
            })
            .layer(DefaultBodyLimit::max(limit.max(16 << 20))),
        )
        .api_route(
            "/v1/agent/heartbeat",
            post_with(crate::http::agent::heartbeat, |op| {
                doc("node token", "Inventory and task reports in, desired tasks out")(node_token(
                    op,
                ))
                .input::<JsonBody<api::Heartbeat>>()
            })
            .layer(DefaultBodyLimit::max(limit.max(16 << 20))),
        );
    let router = routes.finish_api(&mut api);
    let document = Bytes::from(crate::openapi::finish(&api).to_string());
    router
        .layer(axum::Extension(Document(document)))
        .fallback(|| async {
            Error(ApiError::not_found(
                "no such endpoint; the API is described at /v1/openapi.json",
            ))
        })
        .method_not_allowed_fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                Error(ApiError::new(
                    405,
                    "method_not_allowed",
                    format!(
                        "{method} is not allowed on {}; the API is described at /v1/openapi.json",
                        uri.path()
                    ),
                ))
            },
        )
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(detached))
        .layer(axum::middleware::from_fn_with_state(
            shared.clone(),
            anonymous_rate,
        ))
        // Every request is traced under its request id (`RUST_LOG=
        // tower_http=debug` shows each; failures are logged at error), and
        // the id is answered in `x-request-id`: the client's own, when it is
        // one, else a new one. The last layer runs first.
        .layer(
            tower_http::trace::TraceLayer::new_for_http().make_span_with(
                |req: &axum::extract::Request| {
                    let id = req
                        .headers()
                        .get(REQUEST_ID)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-");
                    tracing::info_span!("request", id = %id, method = %req.method(), path = %req.uri().path())
                },
            ),
        )
        .layer(tower_http::request_id::PropagateRequestIdLayer::x_request_id())
        .layer(tower_http::request_id::SetRequestIdLayer::x_request_id(
            RequestIds,
        ))
        .layer(axum::middleware::from_fn(sane_request_id))
        .with_state(shared)
}

const REQUEST_ID: &str = "x-request-id";

/// New request ids: 16 random bytes, in hex.
#[derive(Clone, Copy)]
struct RequestIds;

impl tower_http::request_id::MakeRequestId for RequestIds {
    fn make_request_id<B>(
        &mut self,
        _: &axum::http::Request<B>,
    ) -> Option<tower_http::request_id::RequestId> {
        let mut b = [0u8; 16];
        getrandom::fill(&mut b).ok()?;
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        axum::http::HeaderValue::from_str(&hex)
            .ok()
            .map(tower_http::request_id::RequestId::new)
    }
}

/// A client's request id is kept only when it is one (1 to 64 letters,
/// digits, '-', '_', '.'): anything else is dropped for a new one, so no
/// client writes what it likes into the server's log.
async fn sane_request_id(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let one = req.headers().get_all(REQUEST_ID).iter().count() <= 1;
    let ok = one
        && req.headers().get(REQUEST_ID).is_none_or(|v| {
            let b = v.as_bytes();
            (1..=64).contains(&b.len())
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        });
    if !ok {
        req.headers_mut().remove(REQUEST_ID);
    }
    next.run(req).await
}

/// A request without a token counts against its address's rate (one with
/// a token is counted when the token is checked: `auth.rs`).
async fn anonymous_rate(
    State(shared): State<Arc<Shared>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .is_none()
    {
        let ip = crate::http::auth::client_ip(req.extensions());
        if let Err(e) = shared.rates.anonymous(ip) {
            return Error(e).into_response();
        }
    }
    next.run(req).await
}

/// Runs each request's handler as a task of its own, so that a client that
/// disconnects cannot cancel it between the store's commit and the change
/// in memory (commit, then publish, always both), and a handler that
/// panics answers 500 instead of taking its connection down unanswered.
async fn detached(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    match tokio::spawn(next.run(request)).await {
        Ok(response) => response,
        Err(e) => {
            tracing::error!(error = %e, "request handler panicked");
            Error(ApiError::new(
                500,
                "internal",
                "internal error; the server log has the details",
            ))
            .into_response()
        }
    }
}
/// The OpenAPI document, built with the router and serialised once; each
/// request answers the same bytes, uncopied.
#[derive(Clone)]
struct Document(Bytes);

async fn openapi(axum::Extension(Document(doc)): axum::Extension<Document>) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        doc,
    )
        .into_response()
}
/// `GET /v1/auth/providers` (no token): the identity providers users sign
/// in through, for `gpuflow login` and the dashboard.
async fn providers(State(shared): State<Arc<Shared>>) -> Json<Vec<api::OidcProvider>> {
    let oidc = shared.oidc.clone();
    Json(
        tokio::task::spawn_blocking(move || oidc.public())
            .await
            .unwrap_or_default(),
    )
}

async fn whoami(caller: Caller) -> Json<api::WhoAmI> {
    Json(api::WhoAmI {
        user: caller.user.name,
        team: caller.user.team,
        role: caller.user.role,
        signed_in_with: if caller.identity.is_some() {
            "oidc"
        } else {
            "token"
        }
        .into(),
        identity: caller.identity,
        token_id: caller.token_id,
        expires_at: caller.token_expires_at,
    })
}
fn body_or_413(
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
    limit: usize,
) -> Result<Bytes, Error> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                413,
                "too_large",
                format!("the body is larger than {limit} bytes"),
            )
            .into()
        } else {
            ApiError::bad_request("bad_body", e.body_text()).into()
        }
    })
}
/// A 400 unless `name` is a valid name for teams, users, projects and nodes.
pub fn check_name(field: &str, name: &str, what: &str) -> Result<(), Error> {
    if api::valid_name(name) {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "invalid_name",
        format!(
            "{field}: {name:?} is not a valid {what} (lowercase letters, digits, '-', '_', '.')"
        ),
    )
    .into())
}
/// The most items one page of a list holds.
pub const MAX_PAGE: usize = 1000;
