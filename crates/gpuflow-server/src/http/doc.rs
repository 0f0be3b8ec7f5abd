//! How a route describes itself in the OpenAPI document: `aide` reads each
//! handler's own types (its body, query parameters, whether it needs a
//! token, its reply and the reply's status), so the document cannot drift
//! from the code. What types cannot say is written beside the route: a
//! summary and who may call it ([`doc`]). `crate::openapi` finishes the
//! document (path parameters' patterns, the rate limit's reply).

use std::marker::PhantomData;
use std::sync::Arc;

use aide::generate::GenContext;
use aide::openapi::{MediaType, Operation, Parameter, RequestBody, Response, SchemaObject};
use aide::operation::{OperationInput, OperationOutput, set_body};
use aide::transform::TransformOperation;
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response as HttpResponse};
use indexmap::IndexMap;
use schemars::JsonSchema;

use crate::Shared;
use crate::http::Error;
use crate::http::auth::Caller;
use crate::http::params::{ParamSet, Params, documented};

/// The routers of the API's modules: axum's, with each route's operation.
pub(crate) type ApiRouter = aide::axum::ApiRouter<Arc<Shared>>;

/// A route's summary and who may call it.
pub(crate) fn doc(
    who: &'static str,
    summary: &'static str,
) -> impl FnOnce(TransformOperation<'_>) -> TransformOperation<'_> {
    move |op| op.summary(summary).description(&format!("Allowed: {who}."))
}

/// A route that needs the bearer token of a node rather than a user's
/// ([`Caller`] says so for users' routes).
pub(crate) fn node_token(op: TransformOperation<'_>) -> TransformOperation<'_> {
    op.security_requirement("bearer")
}

/// The documentation of a route no handler type describes (a proxy that
/// passes any method on): secured by a token, failing as any handler can.
pub(crate) fn by_hand(
    method: &'static str,
    who: &'static str,
    summary: &'static str,
) -> aide::axum::routing::ApiMethodDocs {
    let mut op = Operation::default();
    let _ = doc(who, summary)(TransformOperation::new(&mut op)).security_requirement("bearer");
    let replies = aide::generate::in_context(|ctx| error_replies(ctx, &ERRORS.map(|(c, _)| c)));
    let responses = op.responses.get_or_insert_with(Default::default);
    for (code, reply) in replies {
        if let Some(code) = code {
            responses
                .responses
                .insert(code, aide::openapi::ReferenceOr::Item(reply));
        }
    }
    aide::axum::routing::ApiMethodDocs::new(method, op)
}

/// A JSON request body of `T`, read by the handler once it has checked the
/// caller ([`JsonBody::read`]), so that a caller who may not act learns
/// that before anything about the body.
pub(crate) struct JsonBody<T>(Result<Bytes, BytesRejection>, PhantomData<T>);

impl<T: serde::de::DeserializeOwned> JsonBody<T> {
    /// The body parsed strictly, naming the field at fault; 413 above
    /// `limit` bytes.
    pub(crate) fn read(self, limit: usize) -> Result<T, Error> {
        self.read_raw(limit).map(|(body, _)| body)
    }

    /// The body parsed as [`JsonBody::read`] does, and its bytes.
    pub(crate) fn read_raw(self, limit: usize) -> Result<(T, Bytes), Error> {
        let bytes = super::body_or_413(self.0, limit)?;
        Ok((super::parse_json(&bytes)?, bytes))
    }
}

impl<S: Send + Sync, T> FromRequest<S> for JsonBody<T> {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Ok(JsonBody(Bytes::from_request(req, state).await, PhantomData))
    }
}

/// Content of `json_schema`.
pub(super) fn media(json_schema: schemars::Schema) -> MediaType {
    MediaType {
        schema: Some(SchemaObject {
            json_schema,
            example: None,
            external_docs: None,
        }),
        ..Default::default()
    }
}

fn body_of<T: JsonSchema>(ctx: &mut GenContext, operation: &mut Operation, types: &[&str]) {
    let media = media(ctx.schema.subschema_for::<T>());
    let content = types
        .iter()
        .map(|t| ((*t).to_string(), media.clone()))
        .collect::<IndexMap<_, _>>();
    set_body(
        ctx,
        operation,
        RequestBody {
            content,
            required: true,
            ..Default::default()
        },
    );
}

impl<T: JsonSchema> OperationInput for JsonBody<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        body_of::<T>(ctx, operation, &["application/json"]);
    }
}

/// A job's spec as a request body: YAML, or JSON when the request says
/// `Content-Type: application/json`.
pub(crate) struct SpecBody(pub Result<Bytes, BytesRejection>);

impl<S: Send + Sync> FromRequest<S> for SpecBody {
    type Rejection = std::convert::Infallible;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        Ok(SpecBody(Bytes::from_request(req, state).await))
    }
}

impl OperationInput for SpecBody {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        body_of::<gpuflow_api::JobSpec>(ctx, operation, &["application/json", "application/yaml"]);
    }
}

/// The request's extensions (the connection's address among them), for
/// the handlers that read them.
pub(crate) struct Ext(pub axum::http::Extensions);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for Ext {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Self::Rejection> {
        Ok(Ext(parts.extensions.clone()))
    }
}

impl OperationInput for Ext {}

/// A reply with 201 Created.
pub(crate) struct Created<T>(pub T);

impl<T: serde::Serialize> IntoResponse for Created<T> {
    fn into_response(self) -> HttpResponse {
        (StatusCode::CREATED, Json(self.0)).into_response()
    }
}

impl<T: JsonSchema> OperationOutput for Created<T> {
    type Inner = T;

    fn operation_response(ctx: &mut GenContext, operation: &mut Operation) -> Option<Response> {
        Json::<T>::operation_response(ctx, operation)
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<aide::openapi::StatusCode>, Response)> {
        Self::operation_response(ctx, operation)
            .map(|r| (Some(aide::openapi::StatusCode::Code(201)), r))
            .into_iter()
            .collect()
    }
}

/// A reply with warnings, each a `Warning: 299` header (as Kubernetes
/// does); the CLI prints them.
pub(crate) struct Warned<R>(pub R, pub Vec<String>);

impl<R: IntoResponse> IntoResponse for Warned<R> {
    fn into_response(self) -> HttpResponse {
        let mut r = self.0.into_response();
        for w in &self.1 {
            let text = format!("299 gpuflow {w:?}");
            if let Ok(v) = axum::http::HeaderValue::from_str(&text) {
                r.headers_mut().append(axum::http::header::WARNING, v);
            }
        }
        r
    }
}

impl<R: OperationOutput> OperationOutput for Warned<R> {
    type Inner = R::Inner;

    fn operation_response(ctx: &mut GenContext, operation: &mut Operation) -> Option<Response> {
        R::operation_response(ctx, operation)
    }

    fn inferred_responses(
        ctx: &mut GenContext,
        operation: &mut Operation,
    ) -> Vec<(Option<aide::openapi::StatusCode>, Response)> {
        R::inferred_responses(ctx, operation)
    }
}

/// The error replies a request can get, each `{code, message}`.
const ERRORS: [(u16, &str); 6] = [
    (400, "bad input: the message says what to fix"),
    (401, "no token, or not a valid one"),
    (403, "the caller's role does not allow it"),
    (404, "no such thing (or another team's)"),
    (409, "conflicts with the current state"),
    (413, "the body is too large"),
];

fn error_replies(
    ctx: &mut GenContext,
    codes: &[u16],
) -> Vec<(Option<aide::openapi::StatusCode>, Response)> {
    let json_schema = ctx.schema.subschema_for::<gpuflow_api::ApiError>();
    ERRORS
        .iter()
        .filter(|(code, _)| codes.contains(code))
        .map(|(code, what)| {
            let reply = Response {
                description: (*what).to_string(),
                content: IndexMap::from([(
                    "application/json".to_string(),
                    media(json_schema.clone()),
                )]),
                ..Default::default()
            };
            (Some(aide::openapi::StatusCode::Code(*code)), reply)
        })
        .collect()
}

/// A user's bearer token: the route is secured, and a request without a
/// valid one is refused (401), as is a disabled user's (403).
impl OperationInput for Caller {
    fn operation_input(_: &mut GenContext, operation: &mut Operation) {
        operation
            .security
            .push(IndexMap::from([("bearer".to_string(), Vec::new())]));
    }

    fn inferred_early_responses(
        ctx: &mut GenContext,
        _: &mut Operation,
    ) -> Vec<(Option<aide::openapi::StatusCode>, Response)> {
        error_replies(ctx, &[401, 403])
    }
}

/// Query parameters: the handler's struct of them, each field's doc
/// comment its description.
impl<T: ParamSet + JsonSchema> OperationInput for Params<T> {
    fn operation_input(ctx: &mut GenContext, operation: &mut Operation) {
        let params = documented::<T>().into_iter().filter_map(|p| {
            serde_json::from_value::<Parameter>(p)
                .inspect_err(|e| tracing::error!(error = %e, "a query parameter left out of the OpenAPI document"))
                .ok()
        });
        aide::operation::add_parameters(ctx, operation, params);
    }
}

/// A handler that can fail: every error reply.
impl OperationOutput for Error {
    type Inner = gpuflow_api::ApiError;

    fn inferred_responses(
        ctx: &mut GenContext,
        _: &mut Operation,
    ) -> Vec<(Option<aide::openapi::StatusCode>, Response)> {
        error_replies(ctx, &ERRORS.map(|(code, _)| code))
    }
}
