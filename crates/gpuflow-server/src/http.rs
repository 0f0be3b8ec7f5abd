//! The `/v1` HTTP API. Every handler checks the caller's role and team before
//! it reads or changes anything; every change is committed (with an event or
//! an audit line) before the reply. Bad input gets a 4xx with `{code,
//! message}` naming the problem; a store failure gets a bare 500 and one log
//! line.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch, post};
use gpuflow_api::{
    self as api, ApiError, JobSpec, JobState, NodeState, QueuePatch, QueueSpec, Role, Team,
    TokenCreated, TokenRequest, User,
};
use serde::Serialize;

use crate::auth::{Caller, hash, new_token};
use crate::state::{
    JobRec, TokenRec, World, project_rec, queue_rec, team_rec, token_rec, user_rec,
};
use crate::{Change, Shared, commit, now};

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
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let at = if path == "." {
            String::new()
        } else {
            format!("{path}: ")
        };
        ApiError::bad_request("invalid_body", format!("{at}{}", e.inner())).into()
    })
}

pub fn router(shared: Arc<Shared>) -> Router {
    let limit = shared.cfg.max_body_bytes;
    Router::new()
        .route("/v1/openapi.json", get(openapi))
        .route("/v1/whoami", get(whoami))
        .route("/v1/jobs", post(submit).get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/why", get(why))
        .route("/v1/jobs/{id}/logs", get(logs))
        .route("/v1/jobs/{id}/{action}", post(job_action))
        .route("/v1/events", get(events))
        .route("/v1/audit", get(audit))
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/nodes/{name}/{action}", post(node_action))
        .route("/v1/pools", get(pools))
        .route("/v1/queues", get(list_queues).post(create_queue))
        .route("/v1/queues/{name}", patch(patch_queue).delete(delete_queue))
        .route("/v1/teams", get(list_teams).post(create_team))
        .route("/v1/teams/{name}", patch(patch_team))
        .route("/v1/projects", get(list_projects).post(create_project))
        .route("/v1/users", get(list_users).post(create_user))
        .route("/v1/tokens", post(create_token).get(list_tokens))
        .route("/v1/tokens/{id}", axum::routing::delete(revoke_token))
        // A heartbeat carries every task of a node: it may be larger.
        .route(
            "/v1/agent/register",
            post(crate::agent::register).layer(DefaultBodyLimit::max(limit.max(16 << 20))),
        )
        .route(
            "/v1/agent/heartbeat",
            post(crate::agent::heartbeat).layer(DefaultBodyLimit::max(limit.max(16 << 20))),
        )
        .fallback(|| async {
            Error(ApiError::not_found(
                "no such endpoint; the API is described at /v1/openapi.json",
            ))
        })
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(detached))
        .with_state(shared)
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

async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi::document())
}

async fn whoami(caller: Caller) -> Json<api::WhoAmI> {
    Json(api::WhoAmI {
        user: caller.user.name,
        team: caller.user.team,
        role: caller.user.role,
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

/// The body of a JSON request, parsed strictly.
fn json_body<T: for<'de> serde::Deserialize<'de>>(
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
    limit: usize,
) -> Result<T, Error> {
    parse_json(&body_or_413(body, limit)?)
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

/// A page of a list ordered by name (or id): `limit` items after `after`.
struct NamePage {
    limit: usize,
    after: Option<String>,
}

impl NamePage {
    /// # Errors
    /// A 400 for an unknown parameter or a bad page size.
    fn parse(q: &BTreeMap<String, String>) -> Result<NamePage, Error> {
        if let Some(k) = q.keys().find(|k| !["limit", "after"].contains(&k.as_str())) {
            return Err(ApiError::bad_request(
                "bad_query",
                format!("unknown parameter {k:?}; allowed: limit, after (the last name seen)"),
            )
            .into());
        }
        Ok(NamePage {
            limit: page_limit(q.get("limit"))?,
            after: q.get("after").cloned(),
        })
    }

    /// The page of a map ordered by its keys.
    fn of<'m, V>(
        &self,
        map: &'m BTreeMap<String, V>,
    ) -> impl Iterator<Item = (&'m String, &'m V)> + use<'m, V> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = match &self.after {
            Some(a) => Excluded(a.clone()),
            None => Unbounded,
        };
        map.range((from, Unbounded))
    }
}

/// A page size from the `limit` parameter: 1 to [`MAX_PAGE`], default the most.
fn page_limit(v: Option<&String>) -> Result<usize, Error> {
    match v {
        None => Ok(MAX_PAGE),
        Some(l) => match l.parse::<usize>() {
            Ok(n @ 1..=MAX_PAGE) => Ok(n),
            _ => Err(ApiError::bad_request(
                "bad_query",
                format!(
                    "limit: {l:?} is not a page size: 1 to {MAX_PAGE}; page on with `before` (jobs, the last id seen) or `after` (events, audit: the last seq seen)"
                ),
            )
            .into()),
        },
    }
}

fn job_id(s: &str) -> Result<u64, Error> {
    s.parse().map_err(|_| {
        ApiError::bad_request(
            "bad_id",
            format!("{s:?} is not a job id (a positive number)"),
        )
        .into()
    })
}

/// A job as the API shows it: a pending job's reason is the one the last
/// cycle gave it, not the one it was left with.
fn view_of(world: &World, j: &JobRec) -> api::Job {
    let mut v = j.view();
    if j.state == JobState::Pending
        && let Some(w) = world.why.get(&j.id)
    {
        v.reason = w.summary.clone();
    }
    v
}

/// A job the caller may see, or 404 (also for other teams' jobs: their ids are not disclosed).
fn visible<'w>(world: &'w World, caller: &Caller, id: u64) -> Result<&'w JobRec, Error> {
    match world.jobs.get(&id) {
        Some(j) if caller.sees(&j.team) => Ok(j),
        _ => Err(ApiError::not_found(format!("job {id} not found")).into()),
    }
}

async fn submit(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    headers: HeaderMap,
    Query(q): Query<BTreeMap<String, String>>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Response, Error> {
    let test_only = match q.get("test_only").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(_) => {
            return Err(ApiError::bad_request("bad_query", "test_only: true or false").into());
        }
    };
    if let Some(k) = q.keys().find(|k| *k != "test_only") {
        return Err(ApiError::bad_request(
            "bad_query",
            format!("unknown parameter {k:?}; allowed: test_only"),
        )
        .into());
    }
    let body = body_or_413(body, shared.cfg.max_body_bytes)?;
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    let spec = JobSpec::parse(&body, json)?;
    let key = match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(k)) if !k.is_empty() && k.len() <= 128 => Some(k.to_string()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "bad_header",
                "Idempotency-Key: 1 to 128 visible ASCII characters",
            )
            .into());
        }
    };
    let mut world = shared.world.lock().await;
    if let Some(k) = &key
        && let Some(&id) = world
            .idempotency
            .get(&(caller.user.name.clone(), k.clone()))
    {
        // A retry of a submission that was stored: the same job, not a second one.
        let state = world.jobs.get(&id).map_or(JobState::Pending, |j| j.state);
        return Ok((StatusCode::OK, Json(api::Submitted { id, state })).into_response());
    }
    let Some(queue) = world.queues.get(&spec.queue) else {
        let mine: Vec<&str> = world
            .queues
            .values()
            .filter(|q| caller.sees(&q.team))
            .map(|q| q.name.as_str())
            .collect();
        return Err(ApiError::bad_request(
            "unknown_queue",
            format!(
                "queue: {:?} does not exist; queues you may use: {}",
                spec.queue,
                mine.join(", ")
            ),
        )
        .into());
    };
    if !caller.acts_on_jobs(&queue.team) {
        return Err(ApiError::forbidden(format!(
            "you may not submit to queue {:?}: it belongs to team {:?} and your role is {} of team {:?}",
            spec.queue,
            queue.team,
            caller.user.role.as_str(),
            caller.user.team
        ))
        .into());
    }
    if world
        .queues
        .values()
        .any(|q| q.parent.as_deref() == Some(spec.queue.as_str()))
    {
        return Err(ApiError::bad_request(
            "not_a_leaf",
            format!(
                "queue: {:?} has child queues; submit to one of them",
                spec.queue
            ),
        )
        .into());
    }
    if spec.idle.is_some() {
        return Err(ApiError::bad_request(
            "not_supported",
            "idle: not supported yet (idle reclamation needs the agent's GPU utilisation, which is still to come); leave it out",
        )
        .into());
    }
    if let Some(why) = crate::feasible::never_fits(&world, &spec) {
        return Err(ApiError::bad_request("never_fits", why).into());
    }
    let team = queue.team.clone();
    if let Some(p) = &spec.project {
        match world.projects.get(p) {
            Some(pr) if pr.team == team => {}
            _ => {
                let mine: Vec<&str> = world
                    .projects
                    .values()
                    .filter(|p| p.team == team)
                    .map(|p| p.name.as_str())
                    .collect();
                return Err(ApiError::bad_request(
                    "unknown_project",
                    format!(
                        "project: {p:?} is not a project of team {team:?}; its projects: {}",
                        if mine.is_empty() {
                            "none".into()
                        } else {
                            mine.join(", ")
                        }
                    ),
                )
                .into());
            }
        }
    }
    let at = now();
    let id = world.next_job + 1;
    let j = crate::lifecycle::submitted(id, spec, &team, &caller.user.name, key.clone(), at);
    if test_only {
        // The cycle the server would run now, with this job in it, on a
        // snapshot; nothing is stored and no id is used up.
        let trial = crate::cycle::Trial::take(&world, at, shared.cfg.min_runtime_s);
        drop(world);
        let _turn = shared.diagnoses.acquire().await;
        let answer = tokio::task::spawn_blocking(move || trial.test_only(&j))
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "test-only run failed");
                Error(ApiError::new(
                    500,
                    "internal",
                    "internal error; the server log has the details",
                ))
            })?;
        return Ok((StatusCode::OK, Json(answer)).into_response());
    }
    let mut change = Change::default();
    change.event(
        at,
        Some(id),
        &team,
        "submitted",
        format!("submitted by {} to queue {}", j.user, j.spec.queue),
    );
    change.audit(
        at,
        &caller.user.name,
        "job.submit",
        &format!("job/{id}"),
        j.spec.name.clone(),
    );
    change.job(j);
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.next_job = id;
    if let Some(k) = key {
        world.idempotency.insert((caller.user.name.clone(), k), id);
    }
    drop(world);
    shared.wake.notify_one();
    Ok((
        StatusCode::CREATED,
        Json(api::Submitted {
            id,
            state: JobState::Pending,
        }),
    )
        .into_response())
}

async fn list_jobs(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::Job>> {
    for k in q.keys() {
        if ![
            "team", "queue", "state", "user", "project", "limit", "before",
        ]
        .contains(&k.as_str())
        {
            return Err(ApiError::bad_request(
                "bad_query",
                format!("unknown filter {k:?}; allowed: team, queue, state, user, project, limit, before"),
            )
            .into());
        }
    }
    let state = match q.get("state") {
        Some(s) => Some(JobState::parse(s).ok_or_else(|| {
            let all: Vec<&str> = api::ALL_STATES.iter().map(|s| s.as_str()).collect();
            Error(ApiError::bad_request(
                "bad_query",
                format!("state: unknown state {s:?}; allowed: {}", all.join(", ")),
            ))
        })?),
        None => None,
    };
    let limit = page_limit(q.get("limit"))?;
    let before = match q.get("before") {
        Some(b) => job_id(b)?,
        None => u64::MAX,
    };
    let world = shared.world.lock().await;
    let jobs = world
        .jobs
        .range(..before)
        .map(|(_, j)| j)
        .rev()
        .filter(|j| caller.sees(&j.team))
        .filter(|j| q.get("team").is_none_or(|t| &j.team == t))
        .filter(|j| q.get("queue").is_none_or(|t| &j.spec.queue == t))
        .filter(|j| q.get("user").is_none_or(|t| &j.user == t))
        .filter(|j| {
            q.get("project")
                .is_none_or(|t| j.spec.project.as_ref() == Some(t))
        })
        .filter(|j| state.is_none_or(|s| j.state == s))
        .take(limit)
        .map(|j| view_of(&world, j))
        .collect();
    Ok(Json(jobs))
}

async fn get_job(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Reply<api::Job> {
    let id = job_id(&id)?;
    let world = shared.world.lock().await;
    Ok(Json(view_of(&world, visible(&world, &caller, id)?)))
}

async fn why(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Reply<api::Why> {
    let id = job_id(&id)?;
    // Diagnoses take turns: however many callers poll `why`, at most one
    // snapshot is taken and examined at a time, and never under the lock
    // that submissions need.
    let _turn = shared.diagnoses.acquire().await;
    let (mut w, diagnosis) = {
        let world = shared.world.lock().await;
        let j = visible(&world, &caller, id)?;
        match world.why.get(&id) {
            Some(w) if j.state == JobState::Pending => {
                let w = w.clone();
                // Not reached by the last cycle: what its turn would find now,
                // worked out once per cycle.
                let d = match world.diagnosed.get(&id) {
                    Some(found) => Err(found.clone()),
                    None if world.unreached.contains(&id) => Ok(crate::cycle::Trial::take(
                        &world,
                        crate::now(),
                        shared.cfg.min_runtime_s,
                    )),
                    None => Err(None),
                };
                (w, Some(d))
            }
            _ => {
                let summary = match j.state {
                    JobState::Pending => "waiting for the next scheduling cycle".to_string(),
                    JobState::Held => format!("held by an admin: {}", j.reason),
                    JobState::Suspended => {
                        "suspended by its owner: resume it to queue it again".into()
                    }
                    _ => j.reason.clone(),
                };
                return Ok(Json(api::Why {
                    id,
                    state: j.state,
                    summary: summary.clone(),
                    reasons: vec![summary],
                    position: None,
                    eta: None,
                }));
            }
        }
    };
    let found = match diagnosis {
        None | Some(Err(None)) => None,
        Some(Err(Some(found))) => Some(found),
        Some(Ok(d)) => {
            let found = tokio::task::spawn_blocking(move || d.diagnose(id))
                .await
                .map_err(|e| {
                    tracing::error!(error = %e, job = id, "diagnosis failed");
                    Error(ApiError::new(
                        500,
                        "internal",
                        "internal error; the server log has the details",
                    ))
                })?;
            shared
                .world
                .lock()
                .await
                .diagnosed
                .insert(id, found.clone());
            found
        }
    };
    if let Some(found) = found {
        if found.is_empty() {
            w.reasons
                .push("if its turn came now: it would start".to_string());
        }
        w.reasons.extend(
            found
                .into_iter()
                .map(|r| format!("if its turn came now: {r}")),
        );
    }
    Ok(Json(w))
}

#[derive(Serialize)]
struct Logs {
    id: u64,
    /// The latest attempt's tasks: `group/index` → the end of its output.
    tasks: BTreeMap<String, String>,
    /// Every kept attempt (the last five), by attempt number.
    attempts: BTreeMap<u32, BTreeMap<String, String>>,
}

async fn logs(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Reply<Logs> {
    let id = job_id(&id)?;
    let world = shared.world.lock().await;
    let j = visible(&world, &caller, id)?;
    let mut attempts: BTreeMap<u32, BTreeMap<String, String>> = BTreeMap::new();
    for (k, v) in &j.logs {
        let Some((a, g, i)) = crate::state::log_key(k) else {
            continue;
        };
        let a = if a == u32::MAX { j.attempts } else { a };
        let name = j
            .spec
            .tasks
            .get(g as usize)
            .map_or_else(|| g.to_string(), |t| t.name.clone());
        attempts
            .entry(a)
            .or_default()
            .insert(format!("{name}/{i}"), v.clone());
    }
    let tasks = attempts.values().next_back().cloned().unwrap_or_default();
    Ok(Json(Logs {
        id,
        tasks,
        attempts,
    }))
}

async fn job_action(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path((id, action)): Path<(String, String)>,
) -> Reply<api::Job> {
    let id = job_id(&id)?;
    let mut world = shared.world.lock().await;
    let j = visible(&world, &caller, id)?.clone();
    let at = now();
    let mut next = j.clone();
    let who = &caller.user.name;
    let conflict = |what: &str| -> Error {
        ApiError::conflict(format!("job {id} is {}: {what}", j.state.as_str())).into()
    };
    let Some(act) = crate::lifecycle::Action::parse(&action) else {
        return Err(ApiError::not_found(format!(
            "no job action {action:?}; actions: cancel, suspend, resume, hold, release"
        ))
        .into());
    };
    if act.admins_only() {
        caller.need_admin(&format!("{action} of a job"))?;
    } else if !caller.acts_on_jobs(&j.team) {
        return Err(ApiError::forbidden(format!(
            "your role ({}) may not {action} jobs of team {:?}",
            caller.user.role.as_str(),
            j.team
        ))
        .into());
    }
    let kind = crate::lifecycle::act(&mut next, act, who, at).map_err(|what| conflict(&what))?;
    let mut change = Change::default();
    change.event(at, Some(id), &next.team, kind, next.reason.clone());
    change.audit(at, who, &format!("job.{action}"), &format!("job/{id}"), "");
    let view = next.view();
    change.job(next);
    commit(shared.store.as_ref(), &mut world, change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(Json(view))
}

async fn events(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::Event>> {
    let num = |k: &str| -> Result<Option<i64>, Error> {
        q.get(k)
            .map(|v| {
                v.parse::<i64>().map_err(|_| {
                    Error(ApiError::bad_request(
                        "bad_query",
                        format!("{k}: must be a number"),
                    ))
                })
            })
            .transpose()
    };
    for k in q.keys() {
        if !["job", "after", "limit"].contains(&k.as_str()) {
            return Err(ApiError::bad_request(
                "bad_query",
                format!("unknown filter {k:?}; allowed: job, after, limit"),
            )
            .into());
        }
    }
    let job = num("job")?.map(|j| j as u64);
    if let Some(j) = job {
        let world = shared.world.lock().await;
        visible(&world, &caller, j)?;
    }
    let query = gpuflow_store::EventQuery {
        job,
        team: (!caller.admin()).then(|| caller.user.team.clone()),
        after: num("after")?.unwrap_or(0),
        limit: page_limit(q.get("limit"))? as i64,
    };
    let rows = shared
        .store
        .events(&query)
        .await
        .map_err(crate::ServerError::from)?;
    Ok(Json(
        rows.into_iter()
            .map(|e| api::Event {
                seq: e.seq,
                at: e.event.at,
                job: e.event.job,
                team: e.event.team,
                kind: e.event.kind,
                message: e.event.message,
            })
            .collect(),
    ))
}

async fn audit(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::AuditEntry>> {
    caller.need_admin("reading the audit log")?;
    for k in q.keys() {
        if !["after", "limit"].contains(&k.as_str()) {
            return Err(ApiError::bad_request(
                "bad_query",
                format!("unknown filter {k:?}; allowed: after, limit"),
            )
            .into());
        }
    }
    let after = match q.get("after") {
        Some(v) => v.parse::<i64>().map_err(|_| {
            Error(ApiError::bad_request(
                "bad_query",
                "after: must be a number",
            ))
        })?,
        None => 0,
    };
    let limit = page_limit(q.get("limit"))?;
    let rows = shared
        .store
        .audit(after, limit as i64)
        .await
        .map_err(crate::ServerError::from)?;
    Ok(Json(
        rows.into_iter()
            .map(|a| api::AuditEntry {
                seq: a.seq,
                at: a.entry.at,
                actor: a.entry.actor,
                action: a.entry.action,
                target: a.entry.target,
            })
            .collect(),
    ))
}

fn node_view(n: &crate::state::NodeRec, used: &BTreeMap<String, Vec<u32>>) -> api::NodeView {
    api::NodeView {
        name: n.name.clone(),
        state: n.state,
        inventory: n.inventory.clone(),
        gpus_in_use: used.get(&n.name).cloned().unwrap_or_default(),
        last_heartbeat: n.last_heartbeat,
    }
}

async fn list_nodes(
    State(shared): State<Arc<Shared>>,
    _caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::NodeView>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    let used = world.gpus_in_use();
    Ok(Json(
        page.of(&world.nodes)
            .take(page.limit)
            .map(|(_, n)| node_view(n, &used))
            .collect(),
    ))
}

async fn node_action(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path((name, action)): Path<(String, String)>,
) -> Reply<api::NodeView> {
    caller.need_admin("changing a node")?;
    let mut world = shared.world.lock().await;
    let Some(n) = world.nodes.get(&name) else {
        return Err(ApiError::not_found(format!("node {name:?} not found")).into());
    };
    let mut n = n.clone();
    let at = now();
    let mut change = Change::default();
    if action == "replace" {
        // The machine behind the name is gone: its token no longer works,
        // its work is requeued as for a lost node, and the next agent that
        // registers the name with the join token takes it.
        n.token_hash.clear();
        n.state = NodeState::Lost;
        change.event(
            at,
            None,
            "",
            "node-replace",
            format!(
                "node {name} released for replacement by {}; its work is requeued",
                caller.user.name
            ),
        );
    } else {
        let state = match action.as_str() {
            "drain" => NodeState::Draining,
            "cordon" => NodeState::Cordoned,
            "uncordon" => NodeState::Ready,
            other => {
                return Err(ApiError::not_found(format!(
                    "no node action {other:?}; actions: drain, cordon, uncordon, replace"
                ))
                .into());
            }
        };
        n.admin_state = state;
        if n.state != NodeState::Lost {
            n.state = state;
        }
        change.event(
            at,
            None,
            "",
            &format!("node-{action}"),
            format!("node {name} {action}ed by {}", caller.user.name),
        );
    }
    change.audit(
        at,
        &caller.user.name,
        &format!("node.{action}"),
        &format!("node/{name}"),
        "",
    );
    change.nodes.insert(name.clone(), n);
    commit(shared.store.as_ref(), &mut world, change).await?;
    let used = world.gpus_in_use();
    Ok(Json(node_view(&world.nodes[&name], &used)))
}

#[derive(Serialize)]
struct Pool {
    name: String,
    nodes: usize,
    gpus: usize,
}

async fn pools(State(shared): State<Arc<Shared>>, _caller: Caller) -> Reply<Vec<Pool>> {
    let world = shared.world.lock().await;
    let mut pools: BTreeMap<String, Pool> = BTreeMap::new();
    for n in world.nodes.values() {
        let name = if n.inventory.pool.is_empty() {
            "default".to_string()
        } else {
            n.inventory.pool.clone()
        };
        let p = pools.entry(name.clone()).or_insert(Pool {
            name,
            nodes: 0,
            gpus: 0,
        });
        p.nodes += 1;
        p.gpus += n.inventory.gpus.len();
    }
    Ok(Json(pools.into_values().collect()))
}

async fn list_queues(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::QueueView>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    let mut out: BTreeMap<&str, api::QueueView> = page
        .of(&world.queues)
        .filter(|(_, q)| caller.sees(&q.team))
        .take(page.limit)
        .map(|(name, q)| {
            (
                name.as_str(),
                api::QueueView {
                    spec: q.clone(),
                    used: BTreeMap::new(),
                    pending: 0,
                    running: 0,
                },
            )
        })
        .collect();
    // One pass over the jobs for the whole page.
    for j in world.jobs.values() {
        let Some(v) = out.get_mut(j.spec.queue.as_str()) else {
            continue;
        };
        if j.state == JobState::Pending {
            v.pending += 1;
        }
        if j.state.allocated() {
            v.running += 1;
            *v.used.entry(j.flavor.clone()).or_default() +=
                crate::cycle::quota_milli(&j.spec) as f64 / 1000.0;
        }
    }
    Ok(Json(out.into_values().collect()))
}

/// Team leads may shape their team's queues below an admin-made top queue:
/// children's guarantees must fit in their parent's.
fn check_lead_quotas(world: &World, q: &QueueSpec) -> Result<(), Error> {
    let Some(parent) = q.parent.as_deref().and_then(|p| world.queues.get(p)) else {
        return Err(
            ApiError::forbidden("only an admin sets the quotas of a top-level queue").into(),
        );
    };
    for (flavor, quota) in &q.quotas {
        let limit = parent
            .quotas
            .get(flavor)
            .or_else(|| parent.quotas.get("*"))
            .map_or(0.0, |p| p.guaranteed);
        let siblings: f64 = world
            .queues
            .values()
            .filter(|s| s.parent == q.parent && s.name != q.name)
            .filter_map(|s| s.quotas.get(flavor))
            .map(|s| s.guaranteed)
            .sum();
        if quota.guaranteed + siblings > limit + 1e-9 {
            return Err(ApiError::forbidden(format!(
                "quotas.{flavor}.guaranteed: {} plus the siblings' {siblings} exceeds the parent's {limit}; ask an admin",
                quota.guaranteed
            ))
            .into());
        }
    }
    Ok(())
}

async fn create_queue(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<QueueSpec>), Error> {
    let q: QueueSpec = json_body(body, shared.cfg.max_body_bytes)?;
    q.validate()?;
    let mut world = shared.world.lock().await;
    if !caller.leads(&q.team) {
        return Err(ApiError::forbidden(format!(
            "creating a queue of team {:?} needs the admin role or that team's lead",
            q.team
        ))
        .into());
    }
    if !world.teams.contains_key(&q.team) {
        return Err(ApiError::bad_request(
            "unknown_team",
            format!("team: {:?} does not exist", q.team),
        )
        .into());
    }
    if world.queues.contains_key(&q.name) {
        return Err(ApiError::conflict(format!("queue {:?} already exists", q.name)).into());
    }
    if q.parent.is_none() && !caller.admin() {
        return Err(ApiError::forbidden(
            "only an admin creates top-level queues; team leads create queues under their team's queue (set parent)",
        )
        .into());
    }
    if let Some(p) = &q.parent {
        let mut depth = 2;
        let mut up = world.queues.get(p).and_then(|q| q.parent.as_deref());
        while let Some(name) = up {
            depth += 1;
            up = world.queues.get(name).and_then(|q| q.parent.as_deref());
            if depth > api::MAX_QUEUE_DEPTH {
                break;
            }
        }
        if depth > api::MAX_QUEUE_DEPTH {
            return Err(ApiError::bad_request(
                "too_deep",
                format!(
                    "parent: a queue under {p:?} would be more than {} levels deep; attach it higher up",
                    api::MAX_QUEUE_DEPTH
                ),
            )
            .into());
        }
        match world.queues.get(p) {
            None => {
                return Err(ApiError::bad_request(
                    "unknown_queue",
                    format!("parent: queue {p:?} does not exist"),
                )
                .into());
            }
            Some(pq) if pq.team != q.team => {
                return Err(ApiError::bad_request(
                    "wrong_team",
                    format!("parent: queue {p:?} belongs to team {:?}", pq.team),
                )
                .into());
            }
            Some(_) => {}
        }
        if world
            .jobs
            .values()
            .any(|j| &j.spec.queue == p && !j.state.finished())
        {
            return Err(ApiError::conflict(format!(
                "parent: queue {p:?} has unfinished jobs; a queue with jobs cannot get children"
            ))
            .into());
        }
    }
    if !caller.admin() {
        check_lead_quotas(&world, &q)?;
    }
    let at = now();
    let mut change = Change::default();
    change.batch.put.push(queue_rec(&q));
    change.audit(
        at,
        &caller.user.name,
        "queue.create",
        &format!("queue/{}", q.name),
        serde_json::to_string(&q).unwrap_or_default(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.queues.insert(q.name.clone(), q.clone());
    drop(world);
    shared.wake.notify_one();
    Ok((StatusCode::CREATED, Json(q)))
}

async fn patch_queue(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Reply<QueueSpec> {
    let body = body_or_413(body, shared.cfg.max_body_bytes)?;
    let p: QueuePatch = parse_json(&body)?;
    let mut world = shared.world.lock().await;
    let Some(q) = world.queues.get(&name).filter(|q| caller.sees(&q.team)) else {
        return Err(ApiError::not_found(format!("queue {name:?} not found")).into());
    };
    if !caller.leads(&q.team) {
        return Err(ApiError::forbidden(format!(
            "changing queue {name:?} needs the admin role or its team's lead"
        ))
        .into());
    }
    if q.parent.is_none() && !caller.admin() {
        // A team's top-level queue is what the admins granted it.
        return Err(ApiError::forbidden(format!(
            "queue {name:?} is a top-level queue: only an admin changes it; team leads change the queues below it"
        ))
        .into());
    }
    let mut q = q.clone();
    if let Some(w) = p.weight {
        q.weight = w;
    }
    if let Some(s) = p.state {
        q.state = s;
    }
    if let Some(l) = p.user_limits {
        q.user_limits = l;
    }
    if let Some(quotas) = p.quotas {
        q.quotas = quotas;
        if !caller.admin() {
            check_lead_quotas(&world, &q)?;
        }
    }
    q.validate()?;
    let at = now();
    let mut change = Change::default();
    change.batch.put.push(queue_rec(&q));
    change.audit(
        at,
        &caller.user.name,
        "queue.update",
        &format!("queue/{name}"),
        String::from_utf8_lossy(&body),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.queues.insert(name, q.clone());
    drop(world);
    shared.wake.notify_one();
    Ok(Json(q))
}

async fn delete_queue(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<StatusCode, Error> {
    caller.need_admin("deleting a queue")?;
    let mut world = shared.world.lock().await;
    if !world.queues.contains_key(&name) {
        return Err(ApiError::not_found(format!("queue {name:?} not found")).into());
    }
    if world
        .queues
        .values()
        .any(|q| q.parent.as_deref() == Some(name.as_str()))
    {
        return Err(ApiError::conflict(format!(
            "queue {name:?} has child queues; delete them first"
        ))
        .into());
    }
    if world
        .jobs
        .values()
        .any(|j| j.spec.queue == name && !j.state.finished())
    {
        return Err(ApiError::conflict(format!(
            "queue {name:?} has unfinished jobs; cancel them or let them finish first"
        ))
        .into());
    }
    let mut change = Change::default();
    change
        .batch
        .delete
        .push((gpuflow_store::Table::Queues, name.clone()));
    change.audit(
        now(),
        &caller.user.name,
        "queue.delete",
        &format!("queue/{name}"),
        "",
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.queues.remove(&name);
    Ok(StatusCode::NO_CONTENT)
}

async fn list_teams(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<Team>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.teams)
            .map(|(_, t)| t)
            .filter(|t| caller.sees(&t.name))
            .take(page.limit)
            .cloned()
            .collect(),
    ))
}

async fn create_team(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<Team>), Error> {
    caller.need_admin("creating a team")?;
    let t: Team = json_body(body, shared.cfg.max_body_bytes)?;
    check_name("name", &t.name, "name")?;
    if let Some(u) = &t.run_as
        && !api::valid_run_as(u)
    {
        return Err(ApiError::bad_request(
            "invalid_team",
            format!("run_as: {u:?} is not a system user name tasks may run as (lowercase letters, digits, '_', '-'; at most 32; not root)"),
        )
        .into());
    }
    let mut world = shared.world.lock().await;
    if world.teams.contains_key(&t.name) {
        return Err(ApiError::conflict(format!("team {:?} already exists", t.name)).into());
    }
    let mut change = Change::default();
    change.batch.put.push(team_rec(&t));
    change.audit(
        now(),
        &caller.user.name,
        "team.create",
        &format!("team/{}", t.name),
        "",
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.teams.insert(t.name.clone(), t.clone());
    Ok((StatusCode::CREATED, Json(t)))
}

/// `PATCH /v1/teams/{name}`: who the team's tasks run as (admins only).
async fn patch_team(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Reply<Team> {
    caller.need_admin("changing a team")?;
    let p: api::TeamPatch = json_body(body, shared.cfg.max_body_bytes)?;
    let mut world = shared.world.lock().await;
    let Some(t) = world.teams.get(&name) else {
        return Err(ApiError::not_found(format!("team {name:?} not found")).into());
    };
    let mut t = t.clone();
    if let Some(u) = p.run_as {
        if !u.is_empty() && !api::valid_run_as(&u) {
            return Err(ApiError::bad_request(
                "invalid_team",
                format!("run_as: {u:?} is not a system user name tasks may run as (lowercase letters, digits, '_', '-'; at most 32; not root); empty for the agents' default"),
            )
            .into());
        }
        t.run_as = (!u.is_empty()).then_some(u);
    }
    let mut change = Change::default();
    change.batch.put.push(team_rec(&t));
    change.audit(
        now(),
        &caller.user.name,
        "team.update",
        &format!("team/{name}"),
        t.run_as.clone().unwrap_or_default(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.teams.insert(name, t.clone());
    Ok(Json(t))
}

async fn list_projects(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::Project>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.projects)
            .map(|(_, p)| p)
            .filter(|p| caller.sees(&p.team))
            .take(page.limit)
            .cloned()
            .collect(),
    ))
}

async fn create_project(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<api::Project>), Error> {
    let p: api::Project = json_body(body, shared.cfg.max_body_bytes)?;
    check_name("name", &p.name, "name")?;
    if p.cost_centre.len() > 64 {
        return Err(
            ApiError::bad_request("invalid_project", "cost_centre: at most 64 characters").into(),
        );
    }
    let mut world = shared.world.lock().await;
    if !caller.leads(&p.team) {
        return Err(ApiError::forbidden(format!(
            "creating a project of team {:?} needs the admin role or that team's lead",
            p.team
        ))
        .into());
    }
    if !world.teams.contains_key(&p.team) {
        return Err(ApiError::bad_request(
            "unknown_team",
            format!("team: {:?} does not exist", p.team),
        )
        .into());
    }
    if world.projects.contains_key(&p.name) {
        return Err(ApiError::conflict(format!("project {:?} already exists", p.name)).into());
    }
    let mut change = Change::default();
    change.batch.put.push(project_rec(&p));
    change.audit(
        now(),
        &caller.user.name,
        "project.create",
        &format!("project/{}", p.name),
        p.cost_centre.clone(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.projects.insert(p.name.clone(), p.clone());
    Ok((StatusCode::CREATED, Json(p)))
}

async fn list_users(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<User>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.users)
            .map(|(_, u)| u)
            .filter(|u| caller.admin() || (u.team == caller.user.team && !u.team.is_empty()))
            .take(page.limit)
            .cloned()
            .collect(),
    ))
}

async fn create_user(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<User>), Error> {
    let u: User = json_body(body, shared.cfg.max_body_bytes)?;
    check_name("name", &u.name, "name")?;
    let mut world = shared.world.lock().await;
    let allowed = caller.admin()
        || (caller.leads(&u.team)
            && matches!(u.role, Role::Member | Role::Viewer | Role::TeamLead));
    if !allowed {
        return Err(ApiError::forbidden("creating this user needs the admin role (team leads add members, viewers and leads of their own team)").into());
    }
    match u.role {
        Role::Admin if !u.team.is_empty() => {
            return Err(ApiError::bad_request(
                "invalid_user",
                "team: admins belong to no team; leave it empty",
            )
            .into());
        }
        Role::Admin => {}
        _ if !world.teams.contains_key(&u.team) => {
            return Err(ApiError::bad_request(
                "unknown_team",
                format!("team: {:?} does not exist", u.team),
            )
            .into());
        }
        _ => {}
    }
    if world.users.contains_key(&u.name) {
        return Err(ApiError::conflict(format!("user {:?} already exists", u.name)).into());
    }
    let mut change = Change::default();
    change.batch.put.push(user_rec(&u));
    change.audit(
        now(),
        &caller.user.name,
        "user.create",
        &format!("user/{}", u.name),
        u.role.as_str(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.users.insert(u.name.clone(), u.clone());
    Ok((StatusCode::CREATED, Json(u)))
}

/// Whether `caller` may make, list and revoke tokens of user `u`: their own,
/// a team lead those of their team's non-admin users, an admin anyone's.
fn manages_tokens_of(caller: &Caller, u: &User) -> bool {
    caller.admin()
        || u.name == caller.user.name
        || (caller.leads(&u.team) && u.role != Role::Admin && !u.team.is_empty())
}

async fn create_token(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<TokenCreated>), Error> {
    let r: TokenRequest = json_body(body, shared.cfg.max_body_bytes)?;
    let expires_in = match r.expires_in_s {
        Some(0) | Some(315_360_001..) => {
            return Err(ApiError::bad_request(
                "invalid_token_request",
                "expires_in_s: 1 to 315360000 seconds (ten years); leave it out for a token that lasts until revoked",
            )
            .into());
        }
        e => e,
    };
    let mut world = shared.world.lock().await;
    let Some(u) = world.users.get(&r.user).cloned() else {
        return Err(ApiError::bad_request(
            "unknown_user",
            format!("user: {:?} does not exist", r.user),
        )
        .into());
    };
    if !manages_tokens_of(&caller, &u) {
        return Err(
            ApiError::forbidden(format!("you may not create tokens for {:?}", r.user)).into(),
        );
    }
    let at = now();
    let live = world
        .tokens
        .values()
        .filter(|t| t.user == r.user && t.live(at))
        .count();
    if live >= api::MAX_TOKENS_PER_USER {
        return Err(ApiError::conflict(format!(
            "user {:?} has {live} live tokens, the most allowed; revoke one first (`gpuflow token ls`, `gpuflow token revoke ID`)",
            r.user
        ))
        .into());
    }
    let token = new_token("gft");
    let rec = TokenRec {
        hash: hash(&token),
        user: r.user.clone(),
        created_at: at,
        expires_at: expires_in.map(|e| at + e),
    };
    let mut change = Change::default();
    change.batch.put.push(token_rec(&rec));
    change.audit(
        at,
        &caller.user.name,
        "token.create",
        &format!("user/{}", r.user),
        rec.id(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    let created = TokenCreated {
        user: r.user,
        token,
        id: rec.id().to_string(),
        expires_at: rec.expires_at,
    };
    world.tokens.insert(rec.hash.clone(), rec);
    Ok((StatusCode::CREATED, Json(created)))
}

/// `GET /v1/tokens`: the tokens the caller manages (never the tokens
/// themselves), live ones only.
async fn list_tokens(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::TokenView>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    let at = now();
    let mut out: Vec<api::TokenView> = world
        .tokens
        .values()
        .filter(|t| t.live(at))
        .filter(|t| {
            world
                .users
                .get(&t.user)
                .is_some_and(|u| manages_tokens_of(&caller, u))
        })
        .map(TokenRec::view)
        .filter(|t| page.after.as_ref().is_none_or(|a| &t.id > a))
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out.truncate(page.limit);
    Ok(Json(out))
}

/// `DELETE /v1/tokens/{id}`: revokes a token the caller manages.
async fn revoke_token(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, Error> {
    let mut world = shared.world.lock().await;
    let found = world
        .tokens
        .values()
        .find(|t| t.id() == id)
        .filter(|t| {
            world
                .users
                .get(&t.user)
                .is_some_and(|u| manages_tokens_of(&caller, u))
        })
        .cloned();
    let Some(t) = found else {
        return Err(ApiError::not_found(format!(
            "token {id:?} not found among the tokens you manage (`gpuflow token ls`)"
        ))
        .into());
    };
    let mut change = Change::default();
    change
        .batch
        .delete
        .push((gpuflow_store::Table::Tokens, t.hash.clone()));
    change.audit(
        now(),
        &caller.user.name,
        "token.revoke",
        &format!("user/{}", t.user),
        t.id(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.tokens.remove(&t.hash);
    Ok(StatusCode::NO_CONTENT)
}
