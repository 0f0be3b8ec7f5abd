//! Jobs: submit (and test-only), list, get, why, logs, and the owners' and admins' actions.

use super::*;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/jobs", post(submit).get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job))
        .route("/v1/jobs/{id}/why", get(why))
        .route("/v1/jobs/{id}/logs", get(logs))
        .route("/v1/jobs/{id}/{action}", post(job_action))
}

pub(super) fn job_id(s: &str) -> Result<u64, Error> {
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
pub(super) fn visible<'w>(world: &'w World, caller: &Caller, id: u64) -> Result<&'w JobRec, Error> {
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
