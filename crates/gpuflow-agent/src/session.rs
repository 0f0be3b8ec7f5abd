//! Sessions into running tasks (`job exec`, `job attach`), the agent's
//! side: the server names one in a heartbeat reply, the agent connects out
//! to it over WebSocket with its node token and runs it on a thread of its
//! own. An exec runs its command as the task runs ([`Task::identity`]: its
//! user, cgroup, directory, environment, namespaces, seccomp filter) on a
//! terminal or on pipes, relays input and output, and reports its exit
//! status; the command is killed when the client goes away. An attach
//! follows the task's own output files from their end.
//!
//! [`connect`] is also the CLI's client (plain or TLS WebSocket to the
//! server).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use gpuflow_api::{SessionControl, SessionOrder};
use tungstenite::{Message, WebSocket};

use crate::task::Task;

/// A connection to the server, plain or TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl Stream {
    /// The socket under it (for timeouts).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

/// The roots a TLS connection trusts: `ca_cert`'s certificates, or the
/// web's public roots.
fn roots(ca_cert: Option<&Path>) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    match ca_cert {
        Some(path) => {
            let pem =
                std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            for item in ureq::tls::parse_pem(&pem) {
                if let Ok(ureq::tls::PemItem::Certificate(c)) = item {
                    roots
                        .add(rustls::pki_types::CertificateDer::from(c.der().to_vec()))
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                }
            }
            if roots.is_empty() {
                return Err(format!("{} holds no PEM certificate", path.display()));
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(roots)
}

/// Opens a WebSocket to `path` (with its query) on the server at `base`
/// (`http://host:port` or `https://…`), sending `token` as its bearer.
///
/// # Errors
/// When the server cannot be reached or refuses; a refusal's message is
/// the server's.
pub fn connect(
    base: &str,
    path: &str,
    token: &str,
    ca_cert: Option<&Path>,
) -> Result<WebSocket<Stream>, String> {
    let base = base.trim_end_matches('/');
    let (tls, rest) = if let Some(r) = base.strip_prefix("https://") {
        (true, r)
    } else if let Some(r) = base.strip_prefix("http://") {
        (false, r)
    } else {
        return Err(format!(
            "{base:?}: the server's address starts with http:// or https://"
        ));
    };
    let host_port = rest.split('/').next().unwrap_or(rest);
    let addr = if host_port
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !host_port.ends_with(']')
    {
        host_port.to_string()
    } else {
        format!("{host_port}:{}", if tls { 443 } else { 80 })
    };
    let tcp = TcpStream::connect(&addr).map_err(|e| format!("cannot reach {addr}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let stream = if tls {
        let host = addr
            .rsplit_once(':')
            .map_or(addr.as_str(), |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca_cert)?)
        .with_no_client_auth();
        let name =
            rustls::pki_types::ServerName::try_from(host).map_err(|e| format!("{addr}: {e}"))?;
        let conn = rustls::ClientConnection::new(Arc::new(config), name)
            .map_err(|e| format!("{addr}: {e}"))?;
        Stream::Tls(Box::new(rustls::StreamOwned::new(conn, tcp)))
    } else {
        Stream::Plain(tcp)
    };
    let url = format!("{}://{host_port}{path}", if tls { "wss" } else { "ws" });
    let mut req = tungstenite::client::IntoClientRequest::into_client_request(url.as_str())
        .map_err(|e| format!("{url}: {e}"))?;
    req.headers_mut().insert(
        "Authorization",
        format!("Bearer {token}")
            .parse()
            .map_err(|_| "the token holds characters a header cannot".to_string())?,
    );
    match tungstenite::client(req, stream) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(resp))) => {
            let status = resp.status().as_u16();
            let body = resp
                .body()
                .as_deref()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(b).ok())
                .and_then(|v| v["message"].as_str().map(str::to_string))
                .unwrap_or_default();
            Err(format!("refused ({status}): {body}"))
        }
        Err(e) => Err(format!("cannot open the session: {e}")),
    }
}

/// What the agent needs to connect a session.
#[derive(Clone)]
pub struct Context {
    pub base: String,
    pub token: String,
    pub ca_cert: Option<PathBuf>,
}

/// Puts terminal `fd` in raw mode (bytes pass as they are: no echo, no
/// line editing, no signals); its settings before, to restore.
pub fn raw_mode(fd: i32) -> Option<libc::termios> {
    // SAFETY: termios calls on a descriptor with a struct they fill.
    unsafe {
        let mut t: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(fd, &mut t) != 0 {
            return None;
        }
        let before = t;
        libc::cfmakeraw(&mut t);
        (libc::tcsetattr(fd, libc::TCSANOW, &t) == 0).then_some(before)
    }
}

fn control(c: &SessionControl) -> Message {
    Message::text(serde_json::to_string(c).unwrap_or_default())
}

/// Starts session `order` into `task` (described by the server as `d`) on
/// a thread of its own.
pub fn start(
    order: SessionOrder,
    task: Option<&Task>,
    d: Option<&gpuflow_api::DesiredTask>,
    dir: &Path,
    launch: &crate::task::Launch,
    ctx: &Context,
) {
    // What the thread needs, prepared here (the task is the main loop's).
    let how: Result<How, String> = match (task, d) {
        (Some(t), Some(d)) if t.running() => {
            if order.command.is_empty() {
                Ok(How::Attach(t.logs(), t.pgid()))
            } else if let Some(status) = &t.image_status {
                // In an image: runc enters its container.
                let spec = status.with_extension("").with_extension("oci.json");
                std::fs::read(&spec)
                    .map_err(|e| format!("{}: {e}", spec.display()))
                    .and_then(|b| {
                        serde_json::from_slice::<crate::oci::Spec>(&b).map_err(|e| e.to_string())
                    })
                    .map(|spec| {
                        let cmd = order.command.clone();
                        How::Exec(Box::new(move |tty| crate::oci::exec(&spec, &cmd, tty)))
                    })
            } else {
                t.identity(d, dir, launch).map(|who| {
                    let (cmd, group) = (order.command.clone(), t.cgroup().cloned());
                    How::Exec(Box::new(move |tty| {
                        crate::task::spawn_session(&who, &cmd, group.as_ref(), tty)
                    }))
                })
            }
        }
        _ => Err("the task is not running on this node".into()),
    };
    let ctx = ctx.clone();
    std::thread::spawn(move || {
        let path = format!("/v1/agent/exec/{}", order.session);
        let mut ws = match connect(&ctx.base, &path, &ctx.token, ctx.ca_cert.as_deref()) {
            Ok(ws) => ws,
            Err(e) => {
                tracing::warn!(session = %order.session, error = %e, "cannot connect a session");
                return;
            }
        };
        tracing::info!(job = order.job, session = %order.session, exec = !order.command.is_empty(), "session opened");
        let result = match how {
            Err(e) => Err(e),
            Ok(How::Attach(logs, pgid)) => attach(&mut ws, &logs, pgid),
            Ok(How::Exec(spawn)) => exec(&mut ws, &order, spawn),
        };
        let end = match result {
            Ok(code) => SessionControl::Exit { code },
            Err(message) => SessionControl::Error { message },
        };
        let _ = ws.send(control(&end));
        let _ = ws.close(None);
        let _ = ws.flush();
        tracing::info!(job = order.job, session = %order.session, "session closed");
    });
}

/// Starts a session's command, on the terminal whose other side it is
/// given, or on pipes.
type Spawn =
    Box<dyn FnOnce(Option<std::os::fd::OwnedFd>) -> Result<std::process::Child, String> + Send>;

enum How {
    Attach([PathBuf; 2], i32),
    Exec(Spawn),
}

/// What the client sent, read for at most a tick.
enum Input {
    Bytes(Vec<u8>),
    Control(SessionControl),
    Nothing,
    Gone,
}

fn read_input(ws: &mut WebSocket<Stream>) -> Input {
    match ws.read() {
        Ok(Message::Binary(b)) => Input::Bytes(b.to_vec()),
        Ok(Message::Text(t)) => serde_json::from_str(&t).map_or(Input::Nothing, Input::Control),
        Ok(Message::Close(_)) => Input::Gone,
        Ok(_) => Input::Nothing,
        Err(tungstenite::Error::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            Input::Nothing
        }
        Err(_) => Input::Gone,
    }
}

/// Output for the client: its channel (1 stdout, 2 stderr) and bytes;
/// `None` when the stream ended.
type Chunk = (u8, Option<Vec<u8>>);

/// Reads `from` into `tx` on a thread until it ends.
fn pump(mut from: impl Read + Send + 'static, channel: u8, tx: mpsc::Sender<Chunk>) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 16 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((channel, Some(buf[..n].to_vec()))).is_err() {
                        return;
                    }
                }
            }
        }
        let _ = tx.send((channel, None));
    });
}

fn send_chunk(ws: &mut WebSocket<Stream>, channel: u8, bytes: &[u8]) -> Result<(), String> {
    let mut m = Vec::with_capacity(bytes.len() + 1);
    m.push(channel);
    m.extend_from_slice(bytes);
    ws.send(Message::binary(m))
        .map_err(|e| format!("the client went away: {e}"))
}

fn set_size(fd: i32, rows: u16, cols: u16) {
    let ws = libc::winsize {
        ws_row: rows.max(1),
        ws_col: cols.max(1),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: an ioctl on a terminal descriptor we own with a valid struct.
    unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) };
}

/// Runs the session's command; its exit status.
fn exec(ws: &mut WebSocket<Stream>, order: &SessionOrder, spawn: Spawn) -> Result<i32, String> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let _ = ws
        .get_ref()
        .tcp()
        .set_read_timeout(Some(Duration::from_millis(50)));
    let (tx, rx) = mpsc::channel::<Chunk>();
    let mut streams = 0;
    // The terminal's side we keep (a tty session) or the command's stdin.
    let mut input: Option<Box<dyn Write + Send>>;
    let mut master_fd = -1;
    let mut child = if order.tty {
        let (mut m, mut s) = (-1, -1);
        // SAFETY: openpty writes two descriptors; no name or settings asked.
        let r = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(format!(
                "cannot open a terminal: {}",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: openpty returned these descriptors, now owned here.
        let (master, slave) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        set_size(master.as_raw_fd(), order.rows, order.cols);
        master_fd = master.as_raw_fd();
        let child = spawn(Some(slave))?;
        let reader = std::fs::File::from(master.try_clone().map_err(|e| e.to_string())?);
        pump(reader, 1, tx.clone());
        streams += 1;
        input = Some(Box::new(std::fs::File::from(master)));
        child
    } else {
        let mut child = spawn(None)?;
        input = child
            .stdin
            .take()
            .map(|i| Box::new(i) as Box<dyn Write + Send>);
        if let Some(o) = child.stdout.take() {
            pump(o, 1, tx.clone());
            streams += 1;
        }
        if let Some(e) = child.stderr.take() {
            pump(e, 2, tx.clone());
            streams += 1;
        }
        child
    };
    drop(tx);
    let kill = |child: &mut std::process::Child| {
        let pid = child.id() as i32;
        // SAFETY: signals the session's own process group (its leader,
        // unreaped, keeps the id its own).
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let _ = child.kill();
        let _ = child.wait();
    };
    let mut status = None;
    loop {
        match read_input(ws) {
            Input::Bytes(b) => {
                if let Some(i) = input.as_mut() {
                    let _ = i.write_all(&b).and_then(|()| i.flush());
                }
            }
            Input::Control(SessionControl::Resize { rows, cols }) if master_fd >= 0 => {
                set_size(master_fd, rows, cols);
            }
            Input::Control(SessionControl::Eof) => {
                if order.tty {
                    // The terminal's end-of-file character.
                    if let Some(i) = input.as_mut() {
                        let _ = i.write_all(&[4]).and_then(|()| i.flush());
                    }
                } else {
                    input = None;
                }
            }
            Input::Control(_) | Input::Nothing => {}
            Input::Gone => {
                kill(&mut child);
                return Err("the client went away".into());
            }
        }
        while let Ok((channel, bytes)) = rx.try_recv() {
            match bytes {
                Some(b) => {
                    if let Err(e) = send_chunk(ws, channel, &b) {
                        kill(&mut child);
                        return Err(e);
                    }
                }
                None => streams -= 1,
            }
        }
        if status.is_none() {
            status = child.try_wait().map_err(|e| e.to_string())?;
        }
        // A terminal's output ends only when every holder of it closes:
        // once the command ended, what is left is drained below.
        if let Some(st) = status
            && (streams == 0 || order.tty)
        {
            if order.tty {
                input = None;
                let end = std::time::Instant::now() + Duration::from_millis(500);
                while streams > 0 && std::time::Instant::now() < end {
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok((c, Some(b))) => send_chunk(ws, c, &b)?,
                        Ok((_, None)) => streams -= 1,
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
            }
            drop(input);
            use std::os::unix::process::ExitStatusExt;
            return Ok(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)));
        }
    }
}

/// Follows the task's output files from their end until the client goes
/// away (status 0) or the task's process group `pgid` ends.
fn attach(ws: &mut WebSocket<Stream>, logs: &[PathBuf; 2], pgid: i32) -> Result<i32, String> {
    use std::io::Seek;
    let _ = ws
        .get_ref()
        .tcp()
        .set_read_timeout(Some(Duration::from_millis(100)));
    let mut files: Vec<(u8, std::fs::File)> = Vec::new();
    for (i, p) in logs.iter().enumerate() {
        let mut f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
        f.seek(std::io::SeekFrom::End(0))
            .map_err(|e| e.to_string())?;
        files.push((i as u8 + 1, f));
    }
    let mut buf = vec![0u8; 16 << 10];
    loop {
        if let Input::Gone = read_input(ws) {
            return Ok(0);
        }
        for (channel, f) in &mut files {
            loop {
                match f.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => send_chunk(ws, *channel, &buf[..n])?,
                }
            }
        }
        // SAFETY: signal 0 only asks whether the group exists.
        if pgid <= 0 || unsafe { libc::kill(-pgid, 0) } != 0 {
            return Err("the task ended (`gpuflow job get` has how)".into());
        }
    }
}
