//! Sessions into running tasks: `job exec` runs a command beside a task
//! (its user, cgroup, directory, environment, namespaces and seccomp
//! filter), on a terminal of its own or on pipes; `job attach` follows a
//! task's own output as it is written. Authorised like cancel (the job's
//! team's members and leads, admins; others get 404 as for the job, a
//! viewer 403) and audited with who ran what.
//!
//! The client speaks WebSocket to the server; the server asks the task's
//! agent in its next heartbeat reply to connect to
//! `/v1/agent/exec/{session}` with its node token, and relays messages
//! between the two unchanged (`api::SessionOrder` says what they carry).
//! The agent connects out, as it does for heartbeats: nodes need no
//! listening port.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use tokio::sync::oneshot;

use super::params::{Flag, ParamSet, TermSize};
use super::*;
use crate::Change;
use crate::http::auth::Caller;
use crate::secret::{hash, new_token};

/// How long a session waits for its agent to connect.
const AGENT_WAIT: Duration = Duration::from_secs(20);

/// Sessions opened by clients whose agent has not connected yet.
#[derive(Default)]
pub struct Sessions {
    open: std::sync::Mutex<HashMap<String, Pending>>,
}

struct Pending {
    node: String,
    order: api::SessionOrder,
    /// Given to the agent in a heartbeat reply.
    sent: bool,
    agent: oneshot::Sender<WebSocket>,
    at: Instant,
}

impl Sessions {
    /// The sessions node `node`'s agent has not been told of yet (each
    /// told once); those whose client gave up are forgotten.
    pub fn orders_for(&self, node: &str) -> Vec<api::SessionOrder> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        open.retain(|_, p| p.at.elapsed() < AGENT_WAIT && !p.agent.is_closed());
        open.values_mut()
            .filter(|p| p.node == node && !p.sent)
            .map(|p| {
                p.sent = true;
                p.order.clone()
            })
            .collect()
    }

    fn open(&self, node: &str, order: api::SessionOrder) -> oneshot::Receiver<WebSocket> {
        let (tx, rx) = oneshot::channel();
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(
                order.session.clone(),
                Pending {
                    node: node.into(),
                    order,
                    sent: false,
                    agent: tx,
                    at: Instant::now(),
                },
            );
        rx
    }

    /// The way to hand session `id` its agent's socket, when it is open
    /// and on `node`.
    fn take(&self, id: &str, node: &str) -> Option<oneshot::Sender<WebSocket>> {
        let mut open = self
            .open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if open.get(id).is_none_or(|p| p.node != node) {
            return None;
        }
        open.remove(id).map(|p| p.agent)
    }
}

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/jobs/{id}/exec", get_with(exec, doc("its team's members and leads; admins", "WebSocket: runs `command` (a JSON array) beside a running task (`task=GROUP/INDEX`), on a terminal with `tty=true` (`rows`, `cols`); binary messages carry input and, after a channel byte (1 stdout, 2 stderr), output; text messages carry SessionControl. Audited")))
        .api_route("/v1/jobs/{id}/attach", get_with(attach, doc("its team's members and leads; admins", "WebSocket: a running task's output as it is written (binary messages as for exec). Audited")))
        .api_route("/v1/agent/exec/{session}", get_with(agent_side, |op| {
                doc("node token (the session's node)", "WebSocket: the agent's side of a session the server named in a heartbeat reply")(node_token(op))
            }))
}

/// What `exec` takes: the task, the command and the terminal.
#[derive(Debug, Default, serde::Deserialize, schemars::JsonSchema)]
pub(super) struct SessionQuery {
    /// GROUP/INDEX (default: the job's first running task)
    task: Option<String>,
    /// the command, a JSON array of strings (required)
    command: Option<String>,
    /// run it on a terminal
    tty: Option<Flag>,
    /// the terminal's rows
    rows: Option<TermSize>,
    /// the terminal's columns
    cols: Option<TermSize>,
}
impl ParamSet for SessionQuery {}

/// What `attach` takes: the task.
#[derive(Debug, Default, serde::Deserialize, schemars::JsonSchema)]
pub(super) struct AttachQuery {
    /// GROUP/INDEX (default: the job's first running task)
    task: Option<String>,
}
impl ParamSet for AttachQuery {}

type Upgrade = Result<WebSocketUpgrade, WebSocketUpgradeRejection>;

fn upgrade(ws: Upgrade) -> Result<WebSocketUpgrade, Error> {
    ws.map_err(|e| {
        ApiError::bad_request(
            "websocket_required",
            format!("{e}: this endpoint speaks WebSocket (`gpuflow job exec` and `job attach` do)"),
        )
        .into()
    })
}

async fn exec(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Params(q): Params<SessionQuery>,
    ws: Upgrade,
) -> Result<Response, Error> {
    let bad = |m: &str| Error::from(ApiError::bad_request("bad_command", m.to_string()));
    let command: Vec<String> = match &q.command {
        None => {
            return Err(bad(
                "name the command to run: command=[\"sh\"] (a JSON array)",
            ));
        }
        Some(c) => serde_json::from_str(c)
            .map_err(|e| bad(&format!("command must be a JSON array of strings: {e}")))?,
    };
    if command.first().is_none_or(|c| c.is_empty()) || command.len() > 256 {
        return Err(bad("command must name a program (at most 256 words)"));
    }
    if command.iter().any(|w| w.contains('\0')) {
        return Err(bad("command holds a NUL byte"));
    }
    open_session(&shared, &caller, &id, &q, command, upgrade(ws)?).await
}

async fn attach(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Params(q): Params<AttachQuery>,
    ws: Upgrade,
) -> Result<Response, Error> {
    let q = SessionQuery {
        task: q.task,
        ..SessionQuery::default()
    };
    open_session(&shared, &caller, &id, &q, Vec::new(), upgrade(ws)?).await
}

/// Checks the caller may open a session into job `id`'s task, audits it,
/// asks its agent for it and relays once the agent connects.
async fn open_session(
    shared: &Arc<Shared>,
    caller: &Caller,
    id: &str,
    q: &SessionQuery,
    command: Vec<String>,
    ws: WebSocketUpgrade,
) -> Result<Response, Error> {
    let id = super::jobs::job_id(id)?;
    let what = if command.is_empty() { "attach" } else { "exec" };
    let (node, order) = {
        let world = shared.write().await;
        super::jobs::visible(&world, caller, id)?;
        let j = world.jobs().get(&id).ok_or_else(|| {
            ApiError::conflict(format!("job {id} is not running: nothing to {what} into"))
        })?;
        if j.state.finished() {
            return Err(ApiError::conflict(format!(
                "job {id} has ended ({}): nothing to {what} into",
                j.state.as_str()
            ))
            .into());
        }
        caller.acts_on_job(&world, &j.team, &j.user, what)?;
        let running: Vec<_> = j
            .tasks
            .iter()
            .filter(|t| t.phase == api::TaskPhase::Running)
            .filter_map(|t| {
                let a = j
                    .allocs
                    .iter()
                    .find(|a| a.group == t.group && a.index == t.index)?;
                let name = j.spec.tasks.get(t.group as usize)?.name.clone();
                Some((format!("{name}/{}", t.index), t, a.node.clone()))
            })
            .collect();
        let pick = match &q.task {
            None => running.first(),
            Some(want) => running.iter().find(|(name, ..)| name == want),
        };
        let Some((name, t, node)) = pick else {
            let names: Vec<&str> = running.iter().map(|(n, ..)| n.as_str()).collect();
            return Err(ApiError::conflict(match (&q.task, names.is_empty()) {
                (_, true) => format!("job {id} has no running task to {what} into"),
                (Some(want), false) => format!(
                    "job {id} has no running task {want:?}; its running tasks: {}",
                    names.join(", ")
                ),
                (None, false) => unreachable!("a first running task exists"),
            })
            .into());
        };
        let order = api::SessionOrder {
            session: new_token("gfs_"),
            job: id,
            attempt: j.attempts,
            group: t.group,
            index: t.index,
            command: command.clone(),
            tty: q.tty.is_some_and(|t| t.0),
            rows: q.rows.map_or(24, |r| r.0),
            cols: q.cols.map_or(80, |c| c.0),
        };
        let node = node.clone();
        let detail = if command.is_empty() {
            format!("task {name} on node {node}")
        } else {
            format!(
                "task {name} on node {node}{}: {}",
                if order.tty { " (terminal)" } else { "" },
                serde_json::to_string(&command).unwrap_or_default()
            )
        };
        let mut change = Change::default();
        change.audit(
            shared.now(),
            &caller.user.name,
            &format!("job.{what}"),
            &format!("job/{id}"),
            detail,
        );
        world.commit(change).await?;
        (node, order)
    };
    let session = order.session.clone();
    let agent = shared.sessions.open(&node, order);
    Ok(ws.on_upgrade(move |client| relay(client, agent, session)))
}

fn control(c: &api::SessionControl) -> Message {
    Message::Text(serde_json::to_string(c).unwrap_or_default().into())
}

/// Relays session `session`'s messages between its client and its agent
/// until either closes.
async fn relay(mut client: WebSocket, agent: oneshot::Receiver<WebSocket>, session: String) {
    let Ok(Ok(mut agent)) = tokio::time::timeout(AGENT_WAIT, agent).await else {
        tracing::warn!(session, "a session's agent did not connect");
        let _ = client
            .send(control(&api::SessionControl::Error {
                message: format!(
                    "the task's agent did not connect within {} s (is its node up?)",
                    AGENT_WAIT.as_secs()
                ),
            }))
            .await;
        let _ = client.send(Message::Close(None)).await;
        return;
    };
    let pass = |m: &Message| matches!(m, Message::Text(_) | Message::Binary(_));
    loop {
        tokio::select! {
            m = client.recv() => match m {
                Some(Ok(m)) if pass(&m) => if agent.send(m).await.is_err() { break },
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                Some(Ok(_)) => {}
            },
            m = agent.recv() => match m {
                Some(Ok(m)) if pass(&m) => if client.send(m).await.is_err() { break },
                Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                Some(Ok(_)) => {}
            },
        }
    }
    let _ = agent.send(Message::Close(None)).await;
    let _ = client.send(Message::Close(None)).await;
}

/// The agent's side of a session: its node token must name the session's
/// node.
async fn agent_side(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(session): Path<String>,
    ws: Upgrade,
) -> Result<Response, Error> {
    let unauthenticated = || {
        Error::from(ApiError::new(
            401,
            "unauthenticated",
            "the node token is not valid: register again",
        ))
    };
    let token = crate::http::auth::bearer(&headers).ok_or_else(unauthenticated)?;
    let node = {
        let world = shared.world.lock().await;
        world.node_of_token(&hash(token)).map(str::to_string)
    }
    .ok_or_else(unauthenticated)?;
    let ws = upgrade(ws)?;
    let tx = shared.sessions.take(&session, &node).ok_or_else(|| {
        ApiError::not_found(format!("no session {session} waits for node {node}"))
    })?;
    Ok(ws.on_upgrade(move |socket| async move {
        let _ = tx.send(socket);
    }))
}
