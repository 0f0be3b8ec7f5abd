//! The client commands: `gpuflow job|queue|node|team|user|token|event …`.
//! They talk to the server's `/v1` API with a token from `--token`,
//! `GPUFLOW_TOKEN` or the admin token `gpuflow up` left in its data directory.

use std::path::PathBuf;

use anyhow::{Context, anyhow};
use clap::{Args, Subcommand, ValueEnum};
use gpuflow_api as api;
use serde_json::Value;

mod event;
mod job;
mod node;
mod project;
mod queue;
mod report;
mod reservation;
mod service;
mod team;
mod user;
mod webhook;

pub(crate) use {
    event::*, job::*, node::*, project::*, queue::*, report::*, reservation::*, service::*,
    team::*, user::*, webhook::*,
};

#[derive(Clone, Copy, Default, PartialEq, ValueEnum)]
pub(crate) enum Format {
    /// Columns for a person (times as local times and ages).
    #[default]
    Table,
    /// Columns with more of them (nodes, exact times).
    Wide,
    /// The API's JSON, exact (Unix seconds).
    Json,
    /// The API's answer as YAML.
    Yaml,
}

/// The server of `gpuflow up`, when nothing names another.
pub(crate) const LOCAL_SERVER: &str = "http://127.0.0.1:7070";

#[derive(Args, Clone)]
pub(crate) struct Conn {
    /// The server [default: the context's, else $GPUFLOW_SERVER, else
    /// http://127.0.0.1:7070]; a leader and its standbys separated by
    /// commas (the next is tried when no connection to one opens).
    #[arg(long, global = true)]
    pub server: Option<String>,
    /// API token [default: the context's, else $GPUFLOW_TOKEN, else the
    /// admin token in the data directory of `gpuflow up` ($GPUFLOW_DATA,
    /// else ~/.gpuflow)].
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// A context of the config file (`gpuflow config get-contexts`)
    /// instead of the current one [env: GPUFLOW_CONTEXT].
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// How answers are shown.
    #[arg(short = 'o', long, global = true, value_enum, default_value = "table")]
    pub output: Format,
    /// Tables without their heading line (for scripts).
    #[arg(long, global = true)]
    pub no_headers: bool,
    /// PEM certificate to trust for an https server (e.g. its self-signed
    /// one) [env: GPUFLOW_CA_CERT].
    #[arg(long, global = true)]
    pub ca_cert: Option<PathBuf>,
}

/// `--watch`: show it again every `--interval` seconds.
#[derive(Args, Clone, Copy)]
pub(crate) struct Watch {
    /// Show it again every --interval seconds, until interrupted.
    #[arg(short = 'w', long)]
    watch: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 2, requires = "watch")]
    interval: u64,
    /// Stop after this many refreshes.
    #[arg(long, requires = "watch")]
    count: Option<u64>,
}

impl Watch {
    /// Runs `look` once, or again every interval while watching, without
    /// a banner: for commands that print only what is new.
    fn follow(self, mut look: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut n = 0;
        loop {
            look()?;
            n += 1;
            if !self.watch || self.count.is_some_and(|c| n >= c) {
                return Ok(());
            }
            std::io::Write::flush(&mut std::io::stdout())?;
            std::thread::sleep(std::time::Duration::from_secs(self.interval.max(1)));
        }
    }

    /// Runs `show` once, or again every interval while watching.
    fn run(self, mut show: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<()> {
        let mut n = 0;
        loop {
            if self.watch {
                use chrono::Local;
                println!("--- {} ---", Local::now().format("%Y-%m-%d %H:%M:%S"));
            }
            show()?;
            n += 1;
            if !self.watch || self.count.is_some_and(|c| n >= c) {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_secs(self.interval.max(1)));
        }
    }
}

/// The states `job ls` shows by default.
const ACTIVE: &str = "pending,held,suspended,admitted,starting,running,stopping";

/// A duration on the command line (`8h`, `30m`, `90s`, or seconds), in
/// seconds.
fn duration_s(s: &str) -> Result<u64, String> {
    if let Ok(n) = s.parse::<u64>() {
        return Ok(n);
    }
    humantime::parse_duration(s)
        .map(|d| d.as_secs())
        .map_err(|_| format!("{s:?} is not a duration: write 8h, 30m, 90s or seconds"))
}

/// A time on the command line, as Unix seconds: a local date and time
/// (`2026-12-05 14:00`, `2026-12-05T14:00:30`, `2026-12-05`), RFC 3339
/// with its offset, Unix seconds, or how long ago (`30m`, `2h`, `1d`).
fn time_arg(s: &str) -> Result<i64, String> {
    use chrono::TimeZone;
    let s = s.trim();
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(s) {
        return Ok(t.timestamp());
    }
    for f in [
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%d %H:%M",
        "%Y-%m-%dT%H:%M",
    ] {
        if let Ok(t) = chrono::NaiveDateTime::parse_from_str(s, f) {
            return chrono::Local
                .from_local_datetime(&t)
                .earliest()
                .map(|t| t.timestamp())
                .ok_or_else(|| format!("{s:?} does not exist in the local time zone"));
        }
    }
    if let Ok(d) = chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        let t = d.and_hms_opt(0, 0, 0).expect("midnight");
        return chrono::Local
            .from_local_datetime(&t)
            .earliest()
            .map(|t| t.timestamp())
            .ok_or_else(|| format!("{s:?} does not exist in the local time zone"));
    }
    if let Ok(t) = s.parse::<i64>() {
        return Ok(t);
    }
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(unix_now() - d.as_secs() as i64);
    }
    Err(format!(
        "{s:?} is not a time: write a local time (2026-12-05 14:00, 2026-12-05), RFC 3339 (2026-12-05T14:00:00Z), Unix seconds, or how long ago (30m, 2h, 1d)"
    ))
}

/// An error in the command line (exit status 2), not in the request.
#[derive(Debug)]
pub(crate) struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// Checks a server address: a URL with its scheme.
/// A `--state` value: a job state's name (a usage error otherwise).
fn job_state(s: &str) -> Result<String, String> {
    match gpuflow_api::JobState::parse(s) {
        Some(_) => Ok(s.to_string()),
        None => Err(format!(
            "unknown state {s:?}; states: {}",
            gpuflow_api::ALL_STATES
                .iter()
                .map(|x| x.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

pub(crate) fn server_url(server: &str) -> anyhow::Result<String> {
    gpuflow_client::server_url(server).map_err(|e| Usage(e.0).into())
}

/// Each of a comma-separated list of servers (a leader and its standbys),
/// as [`server_url`].
pub(crate) fn server_urls(servers: &str) -> anyhow::Result<Vec<String>> {
    gpuflow_client::server_urls(servers).map_err(|e| Usage(e.0).into())
}

pub(crate) struct Client {
    /// The servers (a leader and its standbys) and the token.
    api: gpuflow_client::Client,
    pub(crate) token: String,
    /// Where the token came from, said when the server refuses it.
    pub(crate) token_from: String,
    pub(crate) ca_cert: Option<PathBuf>,
    /// The context used, if any.
    pub(crate) context: Option<String>,
    /// `--no-headers`: lists without their heading line.
    pub(crate) no_headers: bool,
}

impl Client {
    pub(crate) fn new(c: &Conn) -> anyhow::Result<Client> {
        let r = crate::contexts::resolve(c)?;
        let (token, token_from) = match r.token {
            Some(t) => (t, r.token_from),
            None => {
                // `gpuflow up`'s data directory: GPUFLOW_DATA as for `up`.
                let data = std::env::var_os("GPUFLOW_DATA")
                    .map_or_else(crate::platform::default_data_dir, PathBuf::from);
                let path = data.join("admin.token");
                let t = std::fs::read_to_string(&path)
                    .map(|s| s.trim().to_string())
                    .map_err(|_| Usage(format!("no token: pass --token, set GPUFLOW_TOKEN or use a context with one (`gpuflow config set-context`); an admin creates tokens with `gpuflow token create USER`; `gpuflow up`'s admin token was not at {} (after `up --data-dir D`, set GPUFLOW_DATA=D)", path.display())))?;
                (t, format!("the admin token file {}", path.display()))
            }
        };
        let http =
            gpuflow_client::http_client(r.ca_cert.as_deref(), std::time::Duration::from_secs(30))
                .map_err(|e| anyhow!(e))?;
        Ok(Client {
            api: gpuflow_client::Client::new(http, server_urls(&r.server)?, token.clone()),
            token,
            token_from,
            ca_cert: r.ca_cert,
            context: r.context,
            no_headers: c.no_headers,
        })
    }

    /// The server asked now: the one that answered last.
    pub(crate) fn base(&self) -> &str {
        self.api.base()
    }

    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> anyhow::Result<Value> {
        self.call_with(method, path, body, None)
    }

    /// A call with an optional `Idempotency-Key`; the server's warnings go
    /// to stderr.
    fn call_with(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
        key: Option<&str>,
    ) -> anyhow::Result<Value> {
        let body = body.as_ref().map(|(ct, b)| (*ct, b.as_slice()));
        match self.api.call(method, path, body, key) {
            Ok((v, warnings)) => {
                for w in warnings {
                    eprintln!("warning: {w}");
                }
                Ok(v)
            }
            Err(gpuflow_client::Error::Refused {
                status,
                code,
                message,
            }) => {
                let whence =
                    (status == 401).then(|| (self.token_from.clone(), self.base().to_string()));
                Err(Refusal {
                    status,
                    code,
                    message,
                    whence,
                }
                .into())
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// Whether `e` says no server answered: a request that carries an
/// idempotency key may be sent again.
pub(crate) fn unreachable(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<gpuflow_client::Error>(),
        Some(gpuflow_client::Error::Unreachable { .. })
    )
}

/// The server answered with an error: its HTTP status and the API's
/// `{code, message}` (the code is empty when the body was not the API's).
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) status: u16,
    pub(crate) code: String,
    pub(crate) message: String,
    /// For a 401: where the token came from, and the server it went to.
    whence: Option<(String, String)>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.whence {
            Some((from, base)) => write!(
                f,
                "{} (HTTP {}; the token came from {from}, for {base})",
                self.message, self.status
            ),
            None => write!(f, "{} (HTTP {})", self.message, self.status),
        }
    }
}

impl std::error::Error for Refusal {}

/// A random key naming one submission.
fn idempotency_key() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    format!("cli-{:016x}", h.finish())
}

fn read_file(path: &PathBuf) -> anyhow::Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut v)?;
        return Ok(v);
    }
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// YAML or JSON file → JSON bytes.
fn as_json(path: &PathBuf) -> anyhow::Result<Vec<u8>> {
    let raw = read_file(path)?;
    let v: Value = serde_norway::from_slice(&raw)
        .with_context(|| format!("{} is not YAML or JSON", path.display()))?;
    Ok(serde_json::to_vec(&v)?)
}

/// A reply printed as asked: JSON or YAML as the server sent it; a table
/// from the API's type `T` (a reply that is not one is an error naming the
/// field, not a "-").
fn print_as<T: serde::de::DeserializeOwned>(
    format: Format,
    path: &str,
    v: Value,
    table: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    match format {
        Format::Table | Format::Wide => {
            let t: T = gpuflow_client::read(path, v)?;
            print!("{}", table(&t));
        }
        _ => print(format, &v, |_| String::new()),
    }
    Ok(())
}

fn print(format: Format, v: &Value, table: impl FnOnce(&Value) -> String) {
    match format {
        Format::Json => println!("{}", serde_json::to_string_pretty(v).unwrap_or_default()),
        Format::Yaml => print!("{}", serde_norway::to_string(v).unwrap_or_default()),
        Format::Table | Format::Wide => print!("{}", table(v)),
    }
}

/// A Unix time as a person reads it: local date and time.
fn local_at(t: u64) -> String {
    local(&Value::from(t))
}

/// [`local_at`] of a JSON value ("-" when it is not a time).
fn local(v: &Value) -> String {
    use chrono::TimeZone;
    v.as_i64()
        .and_then(|t| chrono::Local.timestamp_opt(t, 0).single())
        .map_or_else(|| "-".into(), |t| t.format("%Y-%m-%d %H:%M:%S").to_string())
}

/// Seconds as a short age: 45s, 12m, 3h, 2d.
fn age_of(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..90 => format!("{s}s"),
        90..5400 => format!("{}m", s / 60),
        5400..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

/// How long ago a Unix time was.
fn ago(v: &Value) -> String {
    v.as_i64()
        .map_or_else(|| "-".into(), |t| age_of(unix_now() - t))
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Aligned columns under an upper-case heading.
pub(crate) fn columns(head: &[&str], rows: Vec<Vec<String>>) -> String {
    table(true, head, rows)
}

/// Aligned columns, under an upper-case heading when `headed` (a list
/// without `--no-headers`).
pub(crate) fn table(headed: bool, head: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = comfy_table::Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    if headed {
        t.set_header(head.iter().map(|h| h.to_uppercase()));
    }
    t.add_rows(rows);
    // Two spaces between columns, none before the first.
    for c in t.column_iter_mut() {
        c.set_padding((0, 2));
    }
    let mut out = String::new();
    for line in t.lines() {
        out += line.trim_end();
        out.push('\n');
    }
    out
}

/// A typed field as its JSON reads in a table (an enum by its name, a
/// float as JSON writes it).
fn text_of<T: serde::Serialize>(x: &T) -> String {
    s(&serde_json::to_value(x).unwrap_or(Value::Null))
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

/// A GPU count: whole, or to two places.
fn gpu_number(n: f64) -> String {
    if n == n.trunc() {
        format!("{n}")
    } else {
        format!("{n:.2}")
    }
}

/// A path segment with what a URL does not take as it is escaped.
fn urlencoding_path(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

fn human(secs: u64) -> String {
    match secs {
        0..=119 => format!("{secs} s"),
        120..=7199 => format!("{} min", secs / 60),
        _ => format!("{:.1} h", secs as f64 / 3600.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Reads one whole request, headers and body, as text. A fake server
    /// that answers after a single `read` may close with the body unread,
    /// and the kernel then resets the connection: the client sees a reset
    /// instead of the answer.
    fn read_request(s: &mut std::net::TcpStream) -> String {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                if buf.len() >= end + 4 + len {
                    return String::from_utf8_lossy(&buf).into_owned();
                }
            }
            match s.read(&mut chunk) {
                Ok(0) | Err(_) => return String::from_utf8_lossy(&buf).into_owned(),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
    }

    fn client(base: &str) -> Client {
        let http = gpuflow_client::http_client(None, std::time::Duration::from_secs(5)).unwrap();
        Client {
            api: gpuflow_client::Client::new(http, server_urls(base).unwrap(), "t".into()),
            token: "t".into(),
            token_from: "a test".into(),
            ca_cert: None,
            context: None,
            no_headers: false,
        }
    }

    /// A server that is not there: typed as unreachable, which a submission
    /// with an idempotency key retries (decided on the type, not the text).
    #[test]
    fn a_server_that_is_not_there_is_unreachable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = client(&format!("http://127.0.0.1:{port}"))
            .call("GET", "/v1/nodes", None)
            .unwrap_err();
        assert!(unreachable(&e), "{e:#}");
        assert!(
            e.to_string()
                .starts_with("cannot reach the server at http://127.0.0.1:")
        );
    }

    /// A refusal carries the API's code (a submission still being stored is
    /// `in_progress`, which the CLI retries with the same key) and reads as
    /// before: the message and the status.
    #[test]
    fn a_refusal_keeps_the_apis_code_and_reads_as_the_message() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let _ = read_request(&mut s);
                let body = r#"{"code":"in_progress","message":"job 7 is being stored; retry in a moment"}"#;
                let _ = write!(
                    s,
                    "HTTP/1.1 409 Conflict\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let e = client(&format!("http://127.0.0.1:{port}"))
            .call(
                "POST",
                "/v1/jobs",
                Some(("application/yaml", b"x".to_vec())),
            )
            .unwrap_err();
        let r = e.downcast_ref::<Refusal>().expect("a refusal");
        assert_eq!((r.status, r.code.as_str()), (409, "in_progress"));
        assert_eq!(
            e.to_string(),
            "job 7 is being stored; retry in a moment (HTTP 409)"
        );
    }

    /// Several servers (a leader and its standbys): a request goes to the
    /// next when no connection to one opens or a standby answers, and later
    /// ones start there. Not after the leader's answer: a refusal is its
    /// word.
    #[test]
    fn a_server_that_does_not_listen_or_stands_by_is_passed_for_the_next() {
        let gone = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for (i, s) in l.incoming().enumerate().take(2) {
                let Ok(mut s) = s else { continue };
                let _ = read_request(&mut s);
                let (status, body) = if i == 0 {
                    ("200 OK", r#"{"nodes":1}"#)
                } else {
                    ("403 Forbidden", r#"{"code":"forbidden","message":"no"}"#)
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        // A standby answers, but does nothing: passed as well.
        let standby = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let standby_port = standby.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = standby.accept() {
                let _ = read_request(&mut s);
                let body = r#"{"code":"standby","message":"this server is a standby"}"#;
                let _ = write!(
                    s,
                    "HTTP/1.1 503 Service Unavailable\r\nx-gpuflow-standby: 1\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let c = client(&format!(
            "http://127.0.0.1:{gone}, http://127.0.0.1:{standby_port},http://127.0.0.1:{port}"
        ));
        let v = c.call("GET", "/v1/nodes", None).unwrap();
        assert_eq!(v["nodes"], 1);
        assert_eq!(c.base(), format!("http://127.0.0.1:{port}"));
        let e = c.call("GET", "/v1/nodes", None).unwrap_err();
        assert_eq!(e.downcast_ref::<Refusal>().map(|r| r.status), Some(403));
        assert_eq!(c.base(), format!("http://127.0.0.1:{port}"));
        assert!(
            server_urls("http://a:1,b:2").is_err(),
            "each needs a scheme"
        );
        assert!(server_urls(" , ").is_err(), "at least one");
    }

    /// `node get` shows each GPU's utilisation as its agent last sampled it.
    /// The samples carry the GPU's UUID, not its index: read by field name,
    /// the column was "-" whatever the agent sent.
    #[test]
    fn node_get_shows_each_gpus_sampled_utilisation() {
        let n = serde_json::json!({
            "name": "n1", "state": "ready", "last_heartbeat": 1, "gpus_in_use": [],
            "inventory": {"cpu_milli": 8000, "memory_mib": 16384, "emulated": false,
                "gpus": [
                    {"index": 0, "uuid": "GPU-a", "model": "H100", "memory_mib": 81920},
                    {"index": 1, "uuid": "GPU-b", "model": "H100", "memory_mib": 81920}
                ]},
            "gpus_now": [{"uuid": "GPU-b", "util_pct": 77, "memory_util_pct": 5, "memory_used_mib": 1024}]
        });
        let text = node_text(&serde_json::from_value(n).unwrap());
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with(['0', '1'])).collect();
        assert_eq!(rows.len(), 2, "{text}");
        assert!(
            rows[0].trim_end().ends_with('-'),
            "GPU 0 has no sample: {text}"
        );
        assert!(
            rows[1].trim_end().ends_with("77%"),
            "GPU 1 was sampled at 77 %: {text}"
        );
    }

    /// A submission still being stored (`409 in_progress`) is sent again
    /// with the same key until it is acknowledged; a refusal of another
    /// kind is not retried.
    #[test]
    fn a_submission_in_progress_is_sent_again_with_its_key() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let keys = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = keys.clone();
        std::thread::spawn(move || {
            for (i, s) in l.incoming().enumerate().take(4) {
                let Ok(mut s) = s else { continue };
                let text = read_request(&mut s).to_lowercase();
                let key = text
                    .lines()
                    .find_map(|l| l.strip_prefix("idempotency-key: "))
                    .unwrap_or("")
                    .trim()
                    .to_string();
                seen.lock().unwrap().push(key);
                let (status, body) = match i {
                    0 | 1 => (
                        "409 Conflict",
                        r#"{"code":"in_progress","message":"job 7 is being stored"}"#,
                    ),
                    2 => ("201 Created", r#"{"id":7,"state":"pending"}"#),
                    _ => (
                        "400 Bad Request",
                        r#"{"code":"invalid_spec","message":"no"}"#,
                    ),
                };
                let _ = write!(
                    s,
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        let c = client(&format!("http://127.0.0.1:{port}"));
        let ms = std::time::Duration::from_millis(10);
        let v = submit_once(&c, "application/yaml", b"x", "k-1", ms).unwrap();
        assert_eq!(v["id"], 7);
        assert_eq!(*keys.lock().unwrap(), ["k-1", "k-1", "k-1"]);
        let e = submit_once(&c, "application/yaml", b"x", "k-2", ms).unwrap_err();
        assert_eq!(e.downcast_ref::<Refusal>().map(|r| r.status), Some(400));
        assert_eq!(
            keys.lock().unwrap().len(),
            4,
            "a plain refusal is not sent again"
        );
    }

    /// Quotas and budgets read from the API's types as the tables wrote
    /// them from JSON: `H100:4+2^8`, "all" for an unbounded guarantee, a
    /// budget's period by its API name.
    #[test]
    fn quotas_and_budgets_read_as_before() {
        let q: api::QuotaSpec = serde_json::from_value(
            serde_json::json!({"guaranteed": 4, "borrow_limit": 2, "cap": 8}),
        )
        .unwrap();
        assert_eq!(quota_text("H100", &q), "H100:4+2^8");
        let all: api::QuotaSpec =
            serde_json::from_value(serde_json::json!({"guaranteed": 1e9})).unwrap();
        assert_eq!(quota_text("A100", &all), "A100:all+any");
        let spec: api::BudgetSpec =
            serde_json::from_value(serde_json::json!({"gpu_hours": 100, "period": "month"}))
                .unwrap();
        let used: api::BudgetUse = serde_json::from_value(serde_json::json!({
            "period_start": 0, "unit": "gpu-hours", "used": 100, "left": 0, "weight_factor": 0.1, "exhausted": true
        }))
        .unwrap();
        assert_eq!(
            budget_left(Some(&spec), Some(&used)),
            "0.0 of 100 GPU-h/month SPENT"
        );
        assert_eq!(budget_left(Some(&spec), None), "-");
    }

    /// A plain HTTP server asked over TLS: said so, with the address to use,
    /// and not taken for an unreachable one.
    #[test]
    fn a_plain_http_server_asked_over_tls_is_said_so() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut hello = [0u8; 512];
                let _ = s.read(&mut hello);
                let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
            }
        });
        let e = client(&format!("https://127.0.0.1:{port}"))
            .call("GET", "/v1/nodes", None)
            .unwrap_err();
        assert!(!unreachable(&e), "{e:#}");
        assert_eq!(
            e.to_string(),
            format!(
                "the server at https://127.0.0.1:{port} does not speak TLS: try http://127.0.0.1:{port}"
            )
        );
    }
}
