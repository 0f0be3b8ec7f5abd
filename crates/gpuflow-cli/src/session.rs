//! `job exec` and `job attach`: a WebSocket session through the server to
//! the task's agent (`gpuflow_agent::session`). On a terminal, `exec -t`
//! puts the local one in raw mode (restored on every way out) and passes
//! its size, and each change of it, to the command's.

use std::io::{IsTerminal, Read, Write};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::anyhow;
use gpuflow_api::SessionControl;
use tungstenite::Message;

use crate::client::Client;

/// The local terminal in raw mode until dropped.
struct Raw(libc::termios);

impl Raw {
    fn enter() -> Option<Raw> {
        gpuflow_agent::session::raw_mode(0).map(Raw)
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `enter`.
        unsafe { libc::tcsetattr(0, libc::TCSANOW, &self.0) };
    }
}

/// The local terminal's size, when stdout is one.
fn size() -> Option<(u16, u16)> {
    // SAFETY: an ioctl filling a winsize struct.
    unsafe {
        let mut w: libc::winsize = std::mem::zeroed();
        (libc::ioctl(1, libc::TIOCGWINSZ, &mut w) == 0 && w.ws_row > 0)
            .then_some((w.ws_row, w.ws_col))
    }
}

fn path(id: u64, what: &str, task: Option<&str>, extra: &[(&str, String)]) -> String {
    let mut q = form_urlencoded::Serializer::new(String::new());
    if let Some(t) = task {
        q.append_pair("task", t);
    }
    for (k, v) in extra {
        q.append_pair(k, v);
    }
    let q = q.finish();
    if q.is_empty() {
        format!("/v1/jobs/{id}/{what}")
    } else {
        format!("/v1/jobs/{id}/{what}?{q}")
    }
}

/// Runs `command` beside job `id`'s task; its exit status.
pub(crate) fn exec(
    c: &Client,
    id: u64,
    task: Option<String>,
    tty: bool,
    no_tty: bool,
    command: &[String],
) -> anyhow::Result<i32> {
    let terminal = std::io::stdin().is_terminal();
    let tty = tty || (terminal && !no_tty);
    let (rows, cols) = size().unwrap_or((24, 80));
    let p = path(
        id,
        "exec",
        task.as_deref(),
        &[
            ("command", serde_json::to_string(command)?),
            ("tty", tty.to_string()),
            ("rows", rows.to_string()),
            ("cols", cols.to_string()),
        ],
    );
    let raw = (tty && terminal).then(Raw::enter).flatten();
    let result = relay(c, &p, true, tty && terminal);
    drop(raw);
    result
}

/// Follows job `id`'s task's output until the task ends or Ctrl-C.
pub(crate) fn attach(c: &Client, id: u64, task: Option<String>) -> anyhow::Result<()> {
    let p = path(id, "attach", task.as_deref(), &[]);
    relay(c, &p, false, false).map(|_| ())
}

/// The session's loop: output to stdout and stderr, input (when `input`)
/// from stdin, size changes (when `resize`); the command's exit status.
fn relay(c: &Client, path: &str, input: bool, resize: bool) -> anyhow::Result<i32> {
    let mut ws = gpuflow_agent::session::connect(c.base(), path, &c.token, c.ca_cert.as_deref())
        .map_err(|e| anyhow!("{e}"))?;
    ws.get_ref()
        .tcp()
        .set_read_timeout(Some(Duration::from_millis(50)))?;
    let (tx, rx) = mpsc::channel::<Option<Vec<u8>>>();
    if input {
        std::thread::spawn(move || {
            let mut stdin = std::io::stdin();
            let mut buf = vec![0u8; 16 << 10];
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(None);
                        return;
                    }
                    Ok(n) => {
                        if tx.send(Some(buf[..n].to_vec())).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }
    let mut last_size = size();
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    loop {
        match ws.read() {
            Ok(Message::Binary(b)) if !b.is_empty() => {
                let (to, bytes): (&mut dyn Write, _) = if b[0] == 2 {
                    (&mut err, &b[1..])
                } else {
                    (&mut out, &b[1..])
                };
                to.write_all(bytes)?;
                to.flush()?;
            }
            Ok(Message::Text(t)) => match serde_json::from_str::<SessionControl>(&t) {
                Ok(SessionControl::Exit { code }) => return Ok(code),
                Ok(SessionControl::Error { message }) => return Err(anyhow!("{message}")),
                _ => {}
            },
            Ok(Message::Close(_)) => {
                return Err(anyhow!("the session ended without an exit status"));
            }
            Ok(_) => {}
            Err(tungstenite::Error::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(anyhow!("the session was cut: {e}")),
        }
        while let Ok(m) = rx.try_recv() {
            let msg = match m {
                Some(bytes) => Message::binary(bytes),
                None => Message::text(serde_json::to_string(&SessionControl::Eof)?),
            };
            ws.send(msg)?;
        }
        if resize && size() != last_size {
            last_size = size();
            if let Some((rows, cols)) = last_size {
                ws.send(Message::text(serde_json::to_string(
                    &SessionControl::Resize { rows, cols },
                )?))?;
            }
        }
    }
}
