//! Contexts, as kubectl has them: named servers with their credentials in
//! a file only the user can read (`$GPUFLOW_CONFIG`, else
//! `$XDG_CONFIG_HOME/gpuflow/config`, else `~/.config/gpuflow/config`),
//! one of them current; and where a command's server and token come from.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Subcommand;
use serde::{Deserialize, Serialize};

use crate::client::{Conn, Usage};

/// The file's contents.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct File {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_context: Option<String>,
    #[serde(default)]
    pub contexts: Vec<Context>,
}

/// One named server and the credentials for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub(crate) struct Context {
    pub name: String,
    pub server: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<PathBuf>,
    /// When the token is a sign-in session (`gpuflow login`): the
    /// identity provider it came through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
}

/// The file's path.
pub(crate) fn path() -> PathBuf {
    if let Some(p) = std::env::var_os("GPUFLOW_CONFIG") {
        return PathBuf::from(p);
    }
    let base = std::env::var_os("XDG_CONFIG_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))
        .unwrap_or_else(|| PathBuf::from(".config"));
    base.join("gpuflow").join("config")
}

impl File {
    /// The file at `path`; empty when there is none.
    ///
    /// # Errors
    /// A file that cannot be read or parsed, or that others may read.
    pub(crate) fn load(path: &Path) -> anyhow::Result<File> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(File::default()),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let mode = std::fs::metadata(path)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(Usage(format!(
                "{} holds tokens and others may read it (mode {:o}): `chmod 600 {}`",
                path.display(),
                mode & 0o777,
                path.display()
            ))
            .into());
        }
        if text.trim().is_empty() {
            return Ok(File::default());
        }
        let f: File = serde_norway::from_str(&text).map_err(|e| {
            Usage(format!(
                "{} is not a gpuflow config: {e} (its keys: current-context, contexts: [{{name, server, token, ca-cert}}])",
                path.display()
            ))
        })?;
        Ok(f)
    }

    /// Writes it to `path`, readable by the user alone, atomically.
    ///
    /// # Errors
    /// A directory or file that cannot be written.
    pub(crate) fn save(&self, path: &Path) -> anyhow::Result<()> {
        let dir = path.parent().unwrap_or(Path::new("."));
        if !dir.as_os_str().is_empty() && !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let tmp = path.with_extension("tmp");
        let text = serde_norway::to_string(self)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
        Ok(())
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Context> {
        self.contexts.iter().find(|c| c.name == name)
    }

    /// Context `name`, or a usage error listing the others.
    fn named(&self, name: &str, path: &Path) -> anyhow::Result<&Context> {
        self.get(name).ok_or_else(|| {
            let names: Vec<&str> = self.contexts.iter().map(|c| c.name.as_str()).collect();
            Usage(format!(
                "no context {name:?} in {}; {}",
                path.display(),
                if names.is_empty() {
                    "make one with `gpuflow config set-context NAME --server URL`".to_string()
                } else {
                    format!("its contexts: {}", names.join(", "))
                }
            ))
            .into()
        })
    }
}

/// A command's server, token and CA, and where each came from.
pub(crate) struct Resolved {
    pub server: String,
    pub token: Option<String>,
    /// Where the token came from, said when the server refuses it.
    pub token_from: String,
    pub ca_cert: Option<PathBuf>,
    /// The context used, if any.
    pub context: Option<String>,
}

/// The server, token and CA of a command. In order: `--server`,
/// `--token`, `--ca-cert`; then the context `--context` (or
/// `GPUFLOW_CONTEXT`) names; then `GPUFLOW_SERVER`, `GPUFLOW_TOKEN`,
/// `GPUFLOW_CA_CERT`; then the current context, unless the server chosen so
/// far is another; then the local server of `gpuflow up`. A context's token
/// goes only to its own server.
///
/// # Errors
/// A context that does not exist, or a config file that cannot be read.
pub(crate) fn resolve(conn: &Conn) -> anyhow::Result<Resolved> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let path = path();
    let file = File::load(&path)?;
    let explicit = conn.context.clone().or_else(|| env("GPUFLOW_CONTEXT"));
    let named = match &explicit {
        Some(n) => Some(file.named(n, &path)?),
        None => None,
    };
    let mut server = conn.server.clone();
    let mut token = conn.token.clone().map(|t| (t, "--token".to_string()));
    let mut ca = conn.ca_cert.clone();
    let from_ctx = |c: &Context| format!("context {:?} in {}", c.name, path.display());
    let mut used: Option<String> = None;
    // A context: its server unless one was given, its token when the
    // server is its own.
    let mut apply = |c: &Context,
                     server: &mut Option<String>,
                     token: &mut Option<(String, String)>,
                     ca: &mut Option<PathBuf>| {
        let same = server
            .as_deref()
            .is_none_or(|s| s.trim_end_matches('/') == c.server.trim_end_matches('/'));
        if !same {
            return;
        }
        server.get_or_insert_with(|| c.server.clone());
        if token.is_none()
            && let Some(t) = &c.token
        {
            let from = match &c.provider {
                Some(p) => format!("the sign-in through {p} kept in {}", from_ctx(c)),
                None => from_ctx(c),
            };
            *token = Some((t.clone(), from));
        }
        if ca.is_none() {
            ca.clone_from(&c.ca_cert);
        }
        used = Some(c.name.clone());
    };
    if let Some(c) = named {
        apply(c, &mut server, &mut token, &mut ca);
    }
    if server.is_none() {
        server = env("GPUFLOW_SERVER");
    }
    if token.is_none() {
        token = env("GPUFLOW_TOKEN").map(|t| (t, "GPUFLOW_TOKEN".to_string()));
    }
    if ca.is_none() {
        ca = env("GPUFLOW_CA_CERT").map(PathBuf::from);
    }
    if named.is_none()
        && let Some(c) = file.current_context.as_deref().and_then(|n| file.get(n))
    {
        apply(c, &mut server, &mut token, &mut ca);
    }
    let (token, token_from) = match token {
        Some((t, from)) => (Some(t), from),
        None => (None, String::new()),
    };
    Ok(Resolved {
        server: server.unwrap_or_else(|| crate::client::LOCAL_SERVER.to_string()),
        token,
        token_from,
        ca_cert: ca,
        context: used,
    })
}

#[derive(Subcommand)]
pub(crate) enum ConfigCmd {
    /// Make or change a context: a server and the token for it (read from
    /// the first line of stdin with --token-stdin, never from the command
    /// line).
    SetContext {
        name: String,
        /// The server's URL (needed for a new context).
        #[arg(long)]
        server: Option<String>,
        /// Read the context's token from the first line of stdin.
        #[arg(long)]
        token_stdin: bool,
        /// PEM certificate to trust for the server.
        #[arg(long)]
        ca_cert: Option<PathBuf>,
    },
    /// Make a context the current one.
    UseContext { name: String },
    /// The contexts, the current one marked with `*`.
    GetContexts,
    /// The current context's name.
    CurrentContext,
    /// Forget a context and its token.
    DeleteContext { name: String },
}

fn valid_name(name: &str) -> anyhow::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@'));
    if ok {
        Ok(())
    } else {
        Err(Usage(format!(
            "{name:?} is not a context name: letters, digits, '-', '_', '.', '@', at most 64"
        ))
        .into())
    }
}

/// `gpuflow config …`.
///
/// # Errors
/// Bad names or URLs, a context that does not exist, a file that cannot be
/// read or written.
pub(crate) fn run(cmd: ConfigCmd) -> anyhow::Result<()> {
    let path = path();
    let mut file = File::load(&path)?;
    match cmd {
        ConfigCmd::SetContext {
            name,
            server,
            token_stdin,
            ca_cert,
        } => {
            valid_name(&name)?;
            if let Some(s) = &server {
                crate::client::server_urls(s)?;
            }
            let token = if token_stdin {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line)?;
                let t = line.trim().to_string();
                if t.is_empty() {
                    return Err(Usage("--token-stdin: stdin's first line is empty".into()).into());
                }
                Some(t)
            } else {
                None
            };
            let made = match file.contexts.iter_mut().find(|c| c.name == name) {
                Some(c) => {
                    if let Some(s) = server {
                        c.server = s;
                    }
                    if token.is_some() {
                        c.token = token;
                        c.provider = None;
                    }
                    if ca_cert.is_some() {
                        c.ca_cert = ca_cert;
                    }
                    false
                }
                None => {
                    let Some(server) = server else {
                        return Err(Usage(format!(
                            "context {name:?} is new: give its --server URL"
                        ))
                        .into());
                    };
                    file.contexts.push(Context {
                        name: name.clone(),
                        server,
                        token,
                        ca_cert,
                        provider: None,
                    });
                    true
                }
            };
            // As kubectl's: making a context does not change the current
            // one (`use-context` does), so commands that follow go where
            // they went before.
            file.save(&path)?;
            println!(
                "context {name} {} in {}",
                if made { "made" } else { "changed" },
                path.display()
            );
        }
        ConfigCmd::UseContext { name } => {
            file.named(&name, &path)?;
            file.current_context = Some(name.clone());
            file.save(&path)?;
            println!("now using context {name}");
        }
        ConfigCmd::GetContexts => {
            let current = file.current_context.as_deref();
            let rows = file
                .contexts
                .iter()
                .map(|c| {
                    vec![
                        if Some(c.name.as_str()) == current {
                            "*"
                        } else {
                            ""
                        }
                        .to_string(),
                        c.name.clone(),
                        c.server.clone(),
                        if c.token.is_some() { "yes" } else { "no" }.to_string(),
                    ]
                })
                .collect();
            print!(
                "{}",
                crate::client::columns(&["current", "name", "server", "token"], rows)
            );
        }
        ConfigCmd::CurrentContext => match &file.current_context {
            Some(c) => println!("{c}"),
            None => {
                return Err(Usage(format!(
                    "no current context in {} (`gpuflow config use-context NAME`)",
                    path.display()
                ))
                .into());
            }
        },
        ConfigCmd::DeleteContext { name } => {
            file.named(&name, &path)?;
            file.contexts.retain(|c| c.name != name);
            if file.current_context.as_deref() == Some(name.as_str()) {
                file.current_context = None;
            }
            file.save(&path)?;
            println!("context {name} deleted");
        }
    }
    Ok(())
}

/// An agent for an identity provider's endpoints.
fn idp_http(ca: Option<&Path>) -> anyhow::Result<ureq::Agent> {
    gpuflow_client::http_client(ca, std::time::Duration::from_secs(30))
        .map_err(|e| anyhow::anyhow!(e))
}

/// POSTs a form to an OAuth endpoint: (status, JSON answer).
fn post_form(
    http: &ureq::Agent,
    url: &str,
    form: &[(&str, &str)],
) -> anyhow::Result<(u16, serde_json::Value)> {
    let mut resp = http
        .post(url)
        .send_form(form.iter().copied())
        .map_err(|e| anyhow::anyhow!("cannot reach {url}: {e}"))?;
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    Ok((status, v))
}

/// The device flow (RFC 8628) at `p`: a code the user enters in any
/// browser; the ID token and refresh token it yields become a session of
/// the server's. The session token.
fn device_flow(
    http: &ureq::Agent,
    server: &str,
    p: &gpuflow_api::OidcProvider,
) -> anyhow::Result<String> {
    let disco_url = format!(
        "{}/.well-known/openid-configuration",
        p.issuer.trim_end_matches('/')
    );
    let disco: Discovery = http
        .get(&disco_url)
        .call()
        .map_err(|e| anyhow::anyhow!("cannot reach {}: {e}", p.name))?
        .body_mut()
        .read_json()
        .with_context(|| format!("{disco_url} is not a discovery document"))?;
    let (Some(device_ep), Some(token_ep)) = (
        disco.device_authorization_endpoint.as_deref(),
        disco.token_endpoint.as_deref(),
    ) else {
        anyhow::bail!(
            "{} offers no device authorization endpoint (RFC 8628) in {disco_url}: the CLI signs in by the device flow",
            p.name
        );
    };
    let (status, d) = post_form(
        http,
        device_ep,
        &[("client_id", &p.client_id), ("scope", &p.scopes)],
    )?;
    let device: DeviceAuthorization = serde_json::from_value(d.clone()).unwrap_or_default();
    let (Some(device_code), Some(user_code)) = (device.device_code, device.user_code) else {
        anyhow::bail!("{} refused the sign-in (HTTP {status}): {d}", p.name);
    };
    let verify = device.verification_uri.unwrap_or_default();
    eprintln!(
        "To sign in through {}, open {verify} and enter the code {user_code}",
        p.name
    );
    if let Some(full) = device.verification_uri_complete {
        eprintln!("(or open {full})");
    }
    let mut interval = device.interval.unwrap_or(5).max(1);
    let deadline = std::time::Instant::now()
        + std::time::Duration::from_secs(device.expires_in.unwrap_or(600));
    let tokens = loop {
        if std::time::Instant::now() >= deadline {
            anyhow::bail!(
                "the code {user_code} expired before the sign-in was completed: run `gpuflow login` again"
            );
        }
        std::thread::sleep(std::time::Duration::from_secs(interval));
        let (status, t) = post_form(
            http,
            token_ep,
            &[
                ("grant_type", "urn:ietf:params:oauth:grant-type:device_code"),
                ("device_code", &device_code),
                ("client_id", &p.client_id),
            ],
        )?;
        let reply: TokenReply = serde_json::from_value(t.clone()).unwrap_or_default();
        if status == 200 {
            break reply;
        }
        match reply.error.as_deref() {
            Some("authorization_pending") => {}
            Some("slow_down") => interval += 5,
            Some("access_denied") => anyhow::bail!("the sign-in was refused at {}", p.name),
            Some("expired_token") => {
                anyhow::bail!("the code {user_code} expired: run `gpuflow login` again")
            }
            _ => anyhow::bail!("{} answered the sign-in with HTTP {status}: {t}", p.name),
        }
    };
    let Some(id_token) = tokens.id_token else {
        anyhow::bail!(
            "{} gave no ID token: its client {:?} must allow the openid scope",
            p.name,
            p.client_id
        );
    };
    // The server checks the ID token and keeps the refresh token, to read
    // the user's groups again as the session goes on; the CLI keeps only
    // the session token it answers.
    session_of(
        http,
        &format!("{server}/v1/auth/sessions"),
        serde_json::json!({
            "id_token": id_token,
            "refresh_token": tokens.refresh_token,
        }),
    )
}

/// The session token the server answers a sign-in posted to `url`.
fn session_of(http: &ureq::Agent, url: &str, body: serde_json::Value) -> anyhow::Result<String> {
    let mut resp = http
        .post(url)
        .send_json(body)
        .map_err(|e| anyhow::anyhow!("cannot reach the server at {url}: {e}"))?;
    let status = resp.status().as_u16();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    if status == 201
        && let Ok(t) = serde_json::from_str::<gpuflow_api::TokenCreated>(&text)
    {
        return Ok(t.token);
    }
    let why = serde_json::from_str::<gpuflow_api::ApiError>(&text)
        .map_or_else(|_| "no reason given".to_string(), |e| e.message);
    anyhow::bail!("the server refused the sign-in: {why} (HTTP {status})")
}

/// What the CLI reads of a provider's discovery document.
#[derive(Debug, Default, serde::Deserialize)]
struct Discovery {
    device_authorization_endpoint: Option<String>,
    token_endpoint: Option<String>,
}

/// A provider's answer to a device authorization request (RFC 8628).
#[derive(Debug, Default, serde::Deserialize)]
struct DeviceAuthorization {
    device_code: Option<String>,
    user_code: Option<String>,
    verification_uri: Option<String>,
    verification_uri_complete: Option<String>,
    interval: Option<u64>,
    expires_in: Option<u64>,
}

/// A provider's token endpoint answer: the tokens, or an OAuth error.
#[derive(Debug, Default, serde::Deserialize)]
struct TokenReply {
    id_token: Option<String>,
    refresh_token: Option<String>,
    error: Option<String>,
}

/// The authorization code flow with PKCE through the user's browser, back
/// to a one-shot listener on loopback (RFC 8252): the server exchanges the
/// code. The session token.
fn browser_flow(
    http: &ureq::Agent,
    server: &str,
    p: &gpuflow_api::OidcProvider,
    port: u16,
) -> anyhow::Result<String> {
    use base64::Engine as _;
    use sha2::Digest as _;
    use std::io::{BufRead, Write};
    let Some(auth) = &p.authorization_endpoint else {
        anyhow::bail!(
            "the server does not know {}'s authorization endpoint (its discovery document could not be read): use the device flow (`gpuflow login` without --browser)",
            p.name
        );
    };
    let listener = std::net::TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("cannot listen on 127.0.0.1:{port} for the browser's return"))?;
    let redirect = format!(
        "http://127.0.0.1:{}/callback",
        listener.local_addr()?.port()
    );
    let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
    let random = || {
        let mut r = [0u8; 32];
        getrandom::fill(&mut r).expect("the OS random source works");
        b64(&r)
    };
    let (verifier, state, nonce) = (random(), random(), random());
    let challenge = b64(&sha2::Sha256::digest(verifier.as_bytes()));
    let query: String = form_urlencoded::Serializer::new(String::new())
        .extend_pairs([
            ("response_type", "code"),
            ("client_id", p.client_id.as_str()),
            ("redirect_uri", redirect.as_str()),
            ("scope", p.scopes.as_str()),
            ("state", state.as_str()),
            ("nonce", nonce.as_str()),
            ("code_challenge", challenge.as_str()),
            ("code_challenge_method", "S256"),
        ])
        .finish();
    let url = format!("{auth}?{query}");
    eprintln!("To sign in through {}, open in your browser: {url}", p.name);
    // A desktop's browser, where there is a desktop.
    if std::env::var_os("DISPLAY").is_some() || std::env::var_os("WAYLAND_DISPLAY").is_some() {
        let _ = std::process::Command::new("xdg-open")
            .arg(&url)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
    }
    // The first request to the callback path: the browser's return.
    listener.set_nonblocking(false)?;
    let (code, got_state) = loop {
        let (conn, _) = listener.accept()?;
        conn.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        let mut line = String::new();
        std::io::BufReader::new(&conn).read_line(&mut line)?;
        let target = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let Some(q) = target.strip_prefix("/callback?") else {
            let _ = (&conn).write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n");
            continue;
        };
        let params: BTreeMap<String, String> =
            form_urlencoded::parse(q.as_bytes()).into_owned().collect();
        let done = params.contains_key("code");
        let body = if done {
            "Signed in to gpuflow: you may close this page."
        } else {
            "The sign-in did not complete: see the terminal."
        };
        let _ = (&conn).write_all(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
        if let Some(e) = params.get("error") {
            anyhow::bail!("{} did not sign you in: {e}", p.name);
        }
        if done {
            break (params["code"].clone(), params.get("state").cloned());
        }
    };
    if got_state.as_deref() != Some(state.as_str()) {
        anyhow::bail!(
            "the browser came back from another sign-in (its state does not match): run `gpuflow login --browser` again"
        );
    }
    session_of(
        http,
        &format!("{server}/v1/auth/code"),
        serde_json::json!({"provider": p.name, "code": code, "code_verifier": verifier,
            "redirect_uri": redirect, "nonce": nonce}),
    )
}

/// `gpuflow login`: signs in through the server's identity provider by the
/// device flow (a code to enter in a browser anywhere) and keeps the
/// refreshable sign-in in a context, made current.
///
/// # Errors
/// A server without providers, a provider that cannot be reached or that
/// refuses, a sign-in not completed in time.
pub(crate) fn login(
    conn: &Conn,
    provider: Option<&str>,
    browser: Option<u16>,
) -> anyhow::Result<()> {
    let path = path();
    let mut file = File::load(&path)?;
    // The context named may not exist yet: login makes it.
    let name = conn.context.as_deref();
    let r = resolve(&Conn {
        token: Some(String::new()),
        context: name.filter(|n| file.get(n).is_some()).map(str::to_string),
        ..conn.clone()
    })?;
    let server = crate::client::server_url(&r.server)?;
    let http = idp_http(r.ca_cert.as_deref())?;
    let url = format!("{server}/v1/auth/providers");
    let mut resp = http
        .get(&url)
        .call()
        .map_err(|e| anyhow::anyhow!("cannot reach the server at {server}: {e}"))?;
    let providers: Vec<gpuflow_api::OidcProvider> = resp
        .body_mut()
        .read_json()
        .with_context(|| format!("{url} did not answer a list of providers"))?;
    let p = match (provider, providers.as_slice()) {
        (_, []) => {
            return Err(Usage(format!(
                "the server at {server} has no identity provider to sign in through: use an API token (`gpuflow config set-context NAME --server {server} --token-stdin`)"
            ))
            .into());
        }
        (None, [one]) => one.clone(),
        (None, many) => {
            return Err(Usage(format!(
                "the server has several identity providers: name one with --provider ({})",
                many.iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .into());
        }
        (Some(n), all) => all.iter().find(|p| p.name == n).cloned().ok_or_else(|| {
            Usage(format!(
                "no provider {n:?}; the server's: {}",
                all.iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?,
    };
    let session = match browser {
        Some(port) => browser_flow(&http, &server, &p, port)?,
        None => device_flow(&http, &server, &p)?,
    };
    // The context: the one named, else the current one when it is this
    // server's, else one named after the server.
    let current = file
        .current_context
        .as_deref()
        .and_then(|n| file.get(n))
        .filter(|c| c.server.trim_end_matches('/') == server)
        .map(|c| c.name.clone());
    let name = match name.map(str::to_string).or(current) {
        Some(n) => n,
        None => server
            .split("://")
            .nth(1)
            .unwrap_or(&server)
            .replace([':', '/'], "-"),
    };
    valid_name(&name)?;
    match file.contexts.iter_mut().find(|c| c.name == name) {
        Some(c) => {
            c.server = server.clone();
            c.token = Some(session.to_string());
            c.provider = Some(p.name.clone());
        }
        None => file.contexts.push(Context {
            name: name.clone(),
            server: server.clone(),
            token: Some(session.to_string()),
            ca_cert: r.ca_cert.clone(),
            provider: Some(p.name.clone()),
        }),
    }
    file.current_context = Some(name.clone());
    file.save(&path)?;
    eprintln!(
        "signed in; context {name} (now current) in {}",
        path.display()
    );
    crate::client::whoami(&Conn {
        context: Some(name),
        server: None,
        token: None,
        ..conn.clone()
    })
}
