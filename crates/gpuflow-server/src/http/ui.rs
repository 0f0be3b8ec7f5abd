//! The web dashboard: three static files compiled into the server, served
//! at `/ui/`. The page holds no data of its own: it signs in with a token
//! the user pastes, keeps it in the tab's session storage, and reads the
//! `/v1` API with it, so it shows exactly what that token's role may see.
//! A strict content security policy allows only these files' own script
//! and style, and the script writes text, never markup, from the API.

use axum::http::header;
use axum::response::Redirect;

use super::*;

const INDEX: &str = include_str!("../../ui/index.html");
const SCRIPT: &str = include_str!("../../ui/app.js");
const STYLE: &str = include_str!("../../ui/app.css");

/// What the page may load and where it may connect: itself only.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; form-action 'none'; \
    frame-ancestors 'none'; base-uri 'none'";

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .route("/", get(|| async { Redirect::to("/ui/") }))
        .route("/ui", get(|| async { Redirect::to("/ui/") }))
        .route(
            "/ui/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
