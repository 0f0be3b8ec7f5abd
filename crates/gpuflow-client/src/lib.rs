//! A client of the gpuflow API, shared by the CLI, the node agent and the
//! Kubernetes reporter: an HTTP agent that trusts a given CA, the servers
//! asked in turn (a leader and its standbys: the next when no connection
//! to one opens or a standby answers), and typed errors (no answer; a plain
//! HTTP server asked over TLS; the API's refusal with its status and
//! `{code, message}`; a reply that is not the type asked for).

#![forbid(unsafe_code)]

use std::cell::Cell;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::Value;

/// The header of a standby server's answers: it does nothing, the next
/// server is asked.
pub const STANDBY_HEADER: &str = "x-gpuflow-standby";

/// What went wrong with a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No answer came (a connection, DNS or a timeout failed), from any
    /// server: a request that carries an idempotency key may be sent again.
    #[error("cannot reach the server at {base}: {text}")]
    Unreachable { base: String, text: String },
    /// The server was asked over TLS and answered in plain HTTP.
    #[error("the server at {base} does not speak TLS: try {plain}")]
    NotTls { base: String, plain: String },
    /// The server answered with an error: its HTTP status and the API's
    /// `{code, message}` (the code is empty when the body was not the API's).
    #[error("{message} (HTTP {status})")]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// The reply is not what was asked for: a server of another version, or
    /// not a gpuflow server.
    #[error("the server's reply to {path} is not what this client reads: {reason}")]
    Unreadable { path: String, reason: String },
}

/// A bad `--server`: what to fix.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadServer(pub String);

/// One server's base URL: `http://` or `https://`, without a trailing `/`.
///
/// # Errors
/// A URL without either scheme.
pub fn server_url(server: &str) -> Result<String, BadServer> {
    let base = server.trim_end_matches('/');
    if base.starts_with("http://") || base.starts_with("https://") {
        return Ok(base.to_string());
    }
    Err(BadServer(format!(
        "--server {server:?} needs a scheme: http://{base} (or https:// for a server with TLS)"
    )))
}

/// Each of a comma-separated list of servers (a leader and its standbys),
/// as [`server_url`].
///
/// # Errors
/// A URL without a scheme, or none at all.
pub fn server_urls(servers: &str) -> Result<Vec<String>, BadServer> {
    let v = servers
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(server_url)
        .collect::<Result<Vec<_>, _>>()?;
    if v.is_empty() {
        return Err(BadServer(format!("--server {servers:?} names no server")));
    }
    Ok(v)
}

/// An HTTP agent for the API: statuses are answers, not errors; with
/// `ca_cert`, servers are trusted by that PEM file's certificates.
///
/// # Errors
/// A CA file that cannot be read or holds no certificate.
pub fn http_client(ca_cert: Option<&Path>, timeout: Duration) -> Result<ureq::Agent, String> {
    let mut b = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false);
    if let Some(path) = ca_cert {
        let pem =
            std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                _ => None,
            })
            .collect();
        if certs.is_empty() {
            return Err(format!("{} holds no PEM certificate", path.display()));
        }
        b = b.tls_config(
            ureq::tls::TlsConfig::builder()
                .root_certs(ureq::tls::RootCerts::new_with_certs(&certs))
                .build(),
        );
    }
    Ok(b.build().into())
}

/// The API's servers and a token: requests go to the server that answered
/// last, and on to the next when no connection opens or a standby answers.
pub struct Client {
    http: ureq::Agent,
    bases: Vec<String>,
    at: Cell<usize>,
    token: String,
}

/// A request's body: its content type and bytes.
pub type Body<'a> = (&'a str, &'a [u8]);

impl Client {
    /// A client of `bases` (at least one, as [`server_urls`] gives them).
    pub fn new(http: ureq::Agent, bases: Vec<String>, token: String) -> Client {
        assert!(!bases.is_empty(), "a client needs a server");
        Client {
            http,
            bases,
            at: Cell::new(0),
            token,
        }
    }

    /// The server asked now: the one that answered last.
    pub fn base(&self) -> &str {
        &self.bases[self.at.get() % self.bases.len()]
    }

    /// The next server is asked from now on.
    pub fn move_on(&self) {
        self.at.set((self.at.get() + 1) % self.bases.len());
    }

    /// The token requests carry.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Sends one request to the server asked now; when no connection to it
    /// opens (nothing was sent) or a standby answers, to the next, each
    /// once. The answer, whatever its status.
    ///
    /// # Errors
    /// [`Error::Unreachable`] or [`Error::NotTls`] when no server answered.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Body<'_>>,
        key: Option<&str>,
    ) -> Result<ureq::http::Response<ureq::Body>, Error> {
        self.send_as(&self.token, method, path, body, key)
    }

    /// [`Client::send`] with another token (an agent's join token, then
    /// its node's).
    ///
    /// # Errors
    /// As [`Client::send`].
    pub fn send_as(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<Body<'_>>,
        key: Option<&str>,
    ) -> Result<ureq::http::Response<ureq::Body>, Error> {
        let mut tries = 0;
        loop {
            let base = self.base().to_string();
            let url = format!("{base}{path}");
            let auth = format!("Bearer {token}");
            let resp = match (method, body) {
                ("GET", _) => self.http.get(&url).header("Authorization", &auth).call(),
                ("DELETE", _) => self.http.delete(&url).header("Authorization", &auth).call(),
                (m, b) => {
                    let mut req = match m {
                        "PATCH" => self.http.patch(&url),
                        "PUT" => self.http.put(&url),
                        _ => self.http.post(&url),
                    }
                    .header("Authorization", &auth);
                    if let Some(k) = key {
                        req = req.header("Idempotency-Key", k);
                    }
                    match b {
                        Some((ct, bytes)) => req.header("Content-Type", ct).send(bytes),
                        None => req.send_empty(),
                    }
                }
            };
            // Nothing was sent, or a standby answered (it does nothing).
            let unopened = match &resp {
                Err(ureq::Error::ConnectionFailed | ureq::Error::HostNotFound) => true,
                Err(ureq::Error::Io(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
                Ok(r) => r.headers().contains_key(STANDBY_HEADER),
                _ => false,
            };
            tries += 1;
            if unopened && tries < self.bases.len() {
                self.move_on();
                continue;
            }
            return resp.map_err(|e| {
                if base.starts_with("https://") && answered_in_plain_http(&e) {
                    Error::NotTls {
                        plain: base.replacen("https://", "http://", 1),
                        base,
                    }
                } else {
                    Error::Unreachable {
                        base,
                        text: e.to_string(),
                    }
                }
            });
        }
    }

    /// A request whose answer is JSON (`Value::Null` when empty), and the
    /// server's warnings (`Warning: 299 gpuflow "..."`).
    ///
    /// # Errors
    /// As [`Client::send`]; [`Error::Refused`] for a status of 400 or more;
    /// [`Error::Unreadable`] for a body that is not JSON.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<Body<'_>>,
        key: Option<&str>,
    ) -> Result<(Value, Vec<String>), Error> {
        let mut resp = self.send(method, path, body, key)?;
        let status = resp.status().as_u16();
        let warnings = resp
            .headers()
            .get_all("warning")
            .iter()
            .filter_map(|w| w.to_str().ok())
            .map(|w| {
                w.splitn(3, ' ')
                    .nth(2)
                    .unwrap_or(w)
                    .trim_matches('"')
                    .to_string()
            })
            .collect();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        if status >= 400 {
            let (code, message) = match serde_json::from_str::<gpuflow_api::ApiError>(&text) {
                Ok(e) => (e.code, e.message),
                Err(_) => (String::new(), text),
            };
            return Err(Error::Refused {
                status,
                code,
                message,
            });
        }
        if text.is_empty() {
            return Ok((Value::Null, warnings));
        }
        let v = serde_json::from_str(&text).map_err(|e| Error::Unreadable {
            path: path.to_string(),
            reason: format!("not JSON: {e}"),
        })?;
        Ok((v, warnings))
    }

    /// `GET path` read as `T`.
    ///
    /// # Errors
    /// As [`Client::call`]; [`Error::Unreadable`] for a reply that is not a `T`.
    pub fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        let (v, _) = self.call("GET", path, None, None)?;
        read(path, v)
    }
}

/// A reply as `T`, naming the field at fault when it is not one.
///
/// # Errors
/// [`Error::Unreadable`] for a reply that is not a `T`.
pub fn read<T: DeserializeOwned>(path: &str, v: Value) -> Result<T, Error> {
    serde_json::from_value(v).map_err(|e| Error::Unreadable {
        path: path.to_string(),
        reason: e.to_string(),
    })
}

/// Whether a TLS client's request failed because the server answered in
/// plain HTTP: rustls reads that answer as a record that is no TLS.
fn answered_in_plain_http(e: &ureq::Error) -> bool {
    let tls = match e {
        ureq::Error::Rustls(t) => Some(t),
        ureq::Error::Io(io) => io.get_ref().and_then(|x| x.downcast_ref::<rustls::Error>()),
        _ => None,
    };
    matches!(tls, Some(rustls::Error::InvalidMessage(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reply that is not the API's type is an error naming the field,
    /// where a string-indexed read would have printed "-".
    #[test]
    fn a_reply_missing_a_field_is_an_error_that_names_it() {
        let renamed =
            serde_json::json!({"id": 7, "state": "pending", "why": "held", "reasons": []});
        let e = read::<gpuflow_api::Why>("/v1/jobs/7/why", renamed).unwrap_err();
        assert!(
            matches!(&e, Error::Unreadable { path, reason } if path == "/v1/jobs/7/why" && reason.contains("summary")),
            "{e}"
        );
        let whole =
            serde_json::json!({"id": 7, "state": "pending", "summary": "held", "reasons": []});
        let w = read::<gpuflow_api::Why>("/v1/jobs/7/why", whole).unwrap();
        assert_eq!((w.id, w.summary.as_str()), (7, "held"));
    }

    #[test]
    fn servers_need_a_scheme_and_at_least_one() {
        assert_eq!(
            server_urls("http://a:1/, https://b:2").unwrap(),
            ["http://a:1", "https://b:2"]
        );
        assert!(
            server_urls("http://a:1,b:2")
                .unwrap_err()
                .0
                .contains("http://b:2")
        );
        assert!(server_urls(" , ").is_err());
    }
}
