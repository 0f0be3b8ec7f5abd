//! Jobs: submit (and test-only), list, get, why, logs, and the owners' and admins' actions.

use super::params::{Flag, JobId, PageLimit, ParamSet, States, UnixTime, Whole, name_schema};
use super::*;
use crate::event::EventKind;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/jobs", post_with(submit, |op| {
                    doc("member, team lead, admin", "Submit a job (YAML, or JSON with Content-Type application/json); ?test_only=true answers where it would start or why it would wait, storing nothing; a job no node could ever hold is refused")(op)
                        .response::<201, Json<api::Submitted>>()
                        .with(retries_and_tests)
                }).get_with(list_jobs, doc("any token (own team)", "List jobs, newest first; filters: team, queue, state, user, project; pages of at most 1000 (limit), the next page with before=<last id>")))
        .api_route("/v1/jobs/{id}", get_with(get_job, doc("any token (own team)", "One job with its tasks and their placement")))
        .api_route("/v1/jobs/{id}/why", get_with(why, doc("any token (own team)", "Why a job waits: every reason, its position, an estimated start")))
        .api_route("/v1/jobs/{id}/logs", get_with(logs, doc("any token (own team)", "Each task's stdout and stderr by attempt and name/index: all of it up to the job log limit, then each stream's last 16 KiB")))
        .api_route("/v1/jobs/{id}/{action}", post_with(job_action, doc("cancel/suspend/resume: member, team lead, admin; hold/release: admin", "Act on a job: cancel, suspend, resume, hold or release")))
        .api_route("/v1/arrays/{id}/cancel", post_with(cancel_array, doc("the job's team (not viewers); admins", "Cancel every unfinished element of an array in one change")))
        .api_route("/v1/jobs/batch", post_with(submit_batch, doc("members and team leads of the queues' teams; admins", "Submit many jobs in one transaction: all stored, with consecutive ids, or none (the first wrong one named by its place)")))
}

/// What submission's types cannot say: the `Idempotency-Key` header, and
/// the 200 that answers a retried submission (the stored job) or a
/// test-only one.
fn retries_and_tests(
    mut op: aide::transform::TransformOperation<'_>,
) -> aide::transform::TransformOperation<'_> {
    use aide::openapi::{
        HeaderStyle, Parameter, ParameterData, ParameterSchemaOrContent, ReferenceOr, Response,
        SchemaObject, StatusCode,
    };
    let (submitted, test_only) = aide::generate::in_context(|ctx| {
        (
            ctx.schema.subschema_for::<api::Submitted>(),
            ctx.schema.subschema_for::<api::TestOnly>(),
        )
    });
    let key = Parameter::Header {
        parameter_data: ParameterData {
            name: "Idempotency-Key".into(),
            description: Some(
                "A retry with the same key (same user) returns the job already stored, with 200"
                    .into(),
            ),
            required: false,
            deprecated: None,
            format: ParameterSchemaOrContent::Schema(SchemaObject {
                json_schema: schemars::json_schema!({"type": "string", "minLength": 1, "maxLength": 128}),
                example: None,
                external_docs: None,
            }),
            example: None,
            examples: Default::default(),
            explode: None,
            extensions: Default::default(),
        },
        style: HeaderStyle::Simple,
    };
    let retried = Response {
        description:
            "a retried submission (same Idempotency-Key): the stored job; or the TestOnly answer"
                .into(),
        content: [(
            "application/json".to_string(),
            super::doc::media(schemars::json_schema!({"oneOf": [submitted, test_only]})),
        )]
        .into(),
        ..Default::default()
    };
    let o = op.inner_mut();
    o.parameters.push(ReferenceOr::Item(key));
    o.responses
        .get_or_insert_with(Default::default)
        .responses
        .insert(StatusCode::Code(200), ReferenceOr::Item(retried));
    op
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
/// cycle gave it (`why`), not the one it was left with.
fn view_of(j: &JobRec, why: Option<&api::Why>, at: u64) -> api::Job {
    let mut v = j.view(at);
    if j.state == JobState::Pending
        && let Some(w) = why
    {
        v.reason = w.summary.clone();
        v.eta = w.eta;
    }
    v
}
/// Checks that the caller may see job `id`: 404 otherwise (also for other
/// teams' jobs: their ids are not disclosed).
pub(super) fn visible(world: &World, caller: &Caller, id: u64) -> Result<(), Error> {
    match world.summaries().get(&id) {
        Some(s) if caller.sees(&s.team) => Ok(()),
        // Another team's job is not told apart from one that does not
        // exist; the message says which jobs the caller may see.
        _ if caller.admin() => Err(ApiError::not_found(format!("job {id} not found")).into()),
        _ => Err(ApiError::not_found(format!(
            "job {id} not found among team {:?}'s jobs, the ones you may see",
            caller.user.team
        ))
        .into()),
    }
}

/// A job the caller may see, from memory or, once it has left memory, from
/// the store (read without the state lock).
async fn job_of(
    shared: &Shared,
    caller: &Caller,
    id: u64,
) -> Result<(JobRec, Option<api::Why>), Error> {
    {
        let world = shared.world.lock().await;
        visible(&world, caller, id)?;
        if let Some(j) = world.jobs().get(&id) {
            return Ok((JobRec::clone(j), world.why.get(&id).cloned()));
        }
    }
    Ok((
        stored_jobs(shared, &[id])
            .await?
            .pop()
            .ok_or_else(|| Error(ApiError::not_found(format!("job {id} not found"))))?,
        None,
    ))
}

/// The indices of each array a dependency names by element, read from the
/// store (an array's spec never changes), before the state lock is taken.
async fn dependency_arrays(
    shared: &Shared,
    specs: &[&JobSpec],
) -> Result<BTreeMap<u64, Vec<u32>>, Error> {
    let mut ids: Vec<u64> = specs
        .iter()
        .filter_map(|s| api::Dependency::parse(s.dependency.as_deref()?).ok())
        .flat_map(|d| crate::depend::arrays_by_element(&d))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    Ok(stored_jobs(shared, &ids)
        .await?
        .iter()
        .filter_map(|j| Some((j.id, crate::depend::indices_of(j)?)))
        .collect())
}

/// The waits of a job of `team` (an array element with `index`s, each
/// element's own list) on what its spec's dependency names.
fn dependency_waits(
    world: &World,
    team: &str,
    spec: &JobSpec,
    index: &[Option<u32>],
    arrays: &BTreeMap<u64, Vec<u32>>,
) -> Result<Vec<Vec<crate::depend::Wait>>, Error> {
    let Some(d) = spec.dependency.as_deref() else {
        return Ok(vec![Vec::new(); index.len()]);
    };
    let bad = |e: String| -> Error {
        ApiError::bad_request("invalid_dependency", format!("dependency: {e}")).into()
    };
    let d = api::Dependency::parse(d).map_err(bad)?;
    // Terms the same for every element once, aftercorr element by element.
    let (corr, same): (Vec<_>, Vec<_>) = d
        .terms
        .into_iter()
        .partition(|t| t.kind == api::DepKind::AfterCorr);
    let same = api::Dependency {
        terms: same,
        singleton: false,
    };
    let base = crate::depend::resolve(world, team, &same, None, arrays).map_err(bad)?;
    let corr = api::Dependency {
        terms: corr,
        singleton: false,
    };
    index
        .iter()
        .map(|&i| {
            let mut waits = base.clone();
            if !corr.terms.is_empty() {
                waits.extend(crate::depend::resolve(world, team, &corr, i, arrays).map_err(bad)?);
            }
            Ok(waits)
        })
        .collect()
}

/// Jobs read from the store, in id order.
async fn stored_jobs(shared: &Shared, ids: &[u64]) -> Result<Vec<JobRec>, Error> {
    let keys: Vec<String> = ids.iter().map(|&id| crate::state::job_key(id)).collect();
    let records = shared
        .store
        .get_many(gpuflow_store::Table::Jobs, &keys)
        .await
        .map_err(crate::ServerError::from)?;
    records
        .iter()
        .map(|r| {
            serde_json::from_str::<JobRec>(&r.doc).map_err(|e| {
                Error::from(crate::ServerError::Corrupt {
                    what: format!("job {}", r.key),
                    message: e.to_string(),
                })
            })
        })
        .collect()
}
/// The first setting `get` finds going up from `queue` to the root, with
/// the queue it was found on.
fn nearest<T>(
    world: &World,
    queue: &str,
    get: impl Fn(&api::QueueSpec) -> Option<T>,
) -> Option<(String, T)> {
    let mut at = Some(queue);
    while let Some(name) = at {
        let q = world.records().queues.get(name)?;
        if let Some(v) = get(q) {
            return Some((name.to_string(), v));
        }
        at = q.parent.as_deref();
    }
    None
}

/// Checks a spec against the state: its queue exists, is a leaf and the
/// caller may use it, its idle policy, its project and that some node could
/// hold it; fills in the queue's notebook defaults. Returns its team.
/// A job may ask for a reservation that exists, is not over, is not for
/// maintenance, and is for its team or its user.
fn check_reservation(
    world: &World,
    caller: &Caller,
    (team, at): (&str, u64),
    spec: &JobSpec,
) -> Result<(), Error> {
    let Some(name) = &spec.reservation else {
        return Ok(());
    };
    let bad = |m: String| -> Error {
        ApiError::bad_request("invalid_spec", format!("reservation: {m}")).into()
    };
    let Some(r) = world.records().reservations.get(name) else {
        let names: Vec<&str> = world
            .records()
            .reservations
            .keys()
            .map(String::as_str)
            .collect();
        return Err(bad(format!(
            "{name:?} does not exist; reservations: {}",
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        )));
    };
    if r.maintenance {
        return Err(bad(format!(
            "{name:?} is a maintenance window: no job runs in it"
        )));
    }
    if r.end <= at {
        return Err(bad(format!("{name:?} ended at {}", crate::when(r.end))));
    }
    if !r.teams.iter().any(|t| t == team) && !r.users.contains(&caller.user.name) {
        return Err(ApiError::forbidden(format!(
            "reservation {name:?} is the {}'s; a job of team {team} by {} may not use it",
            r.purpose(),
            caller.user.name
        ))
        .into());
    }
    Ok(())
}

fn check_spec(
    world: &World,
    caller: &Caller,
    spec: &mut JobSpec,
    at: u64,
) -> Result<String, Error> {
    let Some(queue) = world.records().queues.get(&spec.queue) else {
        let mine: Vec<&str> = world
            .records()
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
        .records()
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
    // The team's rules for images: a default one, processes refused,
    // registries allowed.
    if let Some(team) = world.records().teams.get(&queue.team) {
        for (i, g) in spec.tasks.iter_mut().enumerate() {
            if g.image.is_none() {
                g.image.clone_from(&team.default_image);
            }
            match &g.image {
                None if !team.processes => {
                    return Err(ApiError::bad_request(
                        "image_required",
                        format!(
                            "tasks[{i}].image: team {:?} runs its tasks in images only; add `image:` (e.g. {})",
                            team.name,
                            team.registries.first().map_or("127.0.0.1:5000/team/pytorch:2.4", String::as_str)
                        ),
                    )
                    .into());
                }
                Some(image) => {
                    if let Some(why) = team.refuses_image(image) {
                        return Err(ApiError::bad_request(
                            "image_refused",
                            format!("tasks[{i}].image: {why}"),
                        )
                        .into());
                    }
                }
                None => {}
            }
        }
    }
    let uses_gpus = spec.tasks.iter().any(|g| g.resources.gpu.is_some());
    if spec.idle.is_some() && !uses_gpus {
        return Err(ApiError::bad_request(
            "not_supported",
            "idle: measured by GPU utilisation, and this job asks for no GPU; leave it out",
        )
        .into());
    }
    // A notebook with GPUs and without an idle policy takes its queue's (or
    // the nearest ancestor's) default, set by an admin.
    if spec.kind == api::Kind::Notebook
        && spec.idle.is_none()
        && uses_gpus
        && let Some((_, idle)) = nearest(world, &spec.queue, |q| q.notebook_idle.clone())
    {
        spec.idle = Some(idle);
    }
    // A notebook lives at most its queue's (or the nearest ancestor's)
    // lifetime: without a max runtime it takes it, beyond it it is refused.
    if spec.kind == api::Kind::Notebook
        && let Some((name, life)) = nearest(world, &spec.queue, |q| q.notebook_max_lifetime_s)
    {
        match spec.max_runtime_s {
            None => spec.max_runtime_s = Some(life),
            Some(m) if m > life => {
                return Err(ApiError::bad_request(
                    "invalid_spec",
                    format!(
                        "max_runtime_s: {m} s is beyond the {life} s notebooks of queue {name} may live; ask for at most that"
                    ),
                )
                .into());
            }
            Some(_) => {}
        }
    }
    if let Some(why) = crate::feasible::never_fits(world, spec) {
        return Err(ApiError::bad_request("never_fits", why).into());
    }
    // More GPUs than one user may hold in the queue: it could never start,
    // so it is refused now rather than left pending for good.
    if let Some(most) = queue.user_limits.max_gpus {
        let milli: u64 = spec
            .tasks
            .iter()
            .map(|g| crate::convert::gpu_request(g).quota_milli() * u64::from(g.replicas))
            .sum();
        if milli as f64 > most * 1000.0 {
            return Err(ApiError::bad_request(
                "never_starts",
                format!(
                    "the job needs {} GPUs and a user of queue {} may hold at most {most} at once (user_limits.max_gpus): it could never start; ask for at most {most}, or use another queue",
                    milli as f64 / 1000.0,
                    queue.name
                ),
            )
            .into());
        }
    }
    let team = queue.team.clone();
    if let Some(p) = &spec.project {
        match world.records().projects.get(p) {
            Some(pr) if pr.team == team => {}
            _ => {
                let mine: Vec<&str> = world
                    .records()
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
    check_reservation(world, caller, (&team, at), spec)?;
    Ok(team)
}
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct SubmitParams {
    /// store nothing; answer where it would start or why it would wait (TestOnly)
    #[serde(default)]
    test_only: Flag,
}
impl ParamSet for SubmitParams {}

async fn submit(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    headers: HeaderMap,
    Params(q): Params<SubmitParams>,
    SpecBody(body): SpecBody,
) -> Result<Response, Error> {
    let body = body_or_413(body, shared.cfg.max_body_bytes)?;
    let json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"));
    let mut spec = JobSpec::parse(&body, json)?;
    let arrays = dependency_arrays(&shared, &[&spec]).await?;
    let key = idempotency_key(&headers)?;
    let mut world = shared.world.lock().await;
    if let Some(k) = &key
        && let Some(done) = submitted_before(&world, &caller.user.name, k)
    {
        return done;
    }
    let at = shared.now();
    let team = check_spec(&world, &caller, &mut spec, at)?;
    let id = world.next_job + 1;
    let array = match &spec.array {
        Some(a) => Some(
            api::ArraySpec::parse(a)
                .map_err(|e| Error(ApiError::bad_request("invalid_spec", format!("array: {e}"))))?,
        ),
        None => None,
    };
    let indices: Vec<Option<u32>> = match &array {
        Some(a) => a.indices.iter().map(|&i| Some(i)).collect(),
        None => vec![None],
    };
    let mut waits = dependency_waits(&world, &team, &spec, &indices, &arrays)?;
    let mut j = crate::lifecycle::submitted(id, spec, &team, &caller.user.name, key.clone(), at);
    j.waits_on = waits[0].clone();
    if q.test_only.0 {
        return test_only(&shared, world, j, at).await;
    }
    // An array is one job per index, with consecutive ids, stored in one
    // transaction.
    let elements: Vec<JobRec> = match &array {
        None => vec![j],
        Some(a) => a
            .indices
            .iter()
            .enumerate()
            .map(|(k, &index)| {
                let mut e = j.clone();
                e.id = id + k as u64;
                e.array = Some(api::ArrayRef { id, index });
                e.waits_on = std::mem::take(&mut waits[k]);
                if k > 0 {
                    e.idempotency_key = None;
                }
                e
            })
            .collect(),
    };
    let last = id + elements.len() as u64 - 1;
    let count = elements.len() as u32;
    let change = submission(elements, (&team, &caller.user.name), at);
    // The ids are taken now; the records are stored with the submissions
    // beside them, off the lock, and published once durable.
    world.next_job = last;
    world.storing.extend(id..=last);
    if let Some(k) = key {
        world.idempotency.insert((caller.user.name.clone(), k), id);
    }
    drop(world);
    crate::groupcommit::store(&shared, change).await?;
    Ok((
        StatusCode::CREATED,
        Json(api::Submitted {
            id,
            state: JobState::Pending,
            array: array.map(|_| api::ArrayRef { id, index: count }),
        }),
    )
        .into_response())
}

/// The `Idempotency-Key` header, if sent: 1 to 128 visible ASCII characters.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Error> {
    match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => Ok(None),
        Some(Ok(k)) if !k.is_empty() && k.len() <= 128 => Ok(Some(k.to_string())),
        Some(_) => Err(ApiError::bad_request(
            "bad_header",
            "Idempotency-Key: 1 to 128 visible ASCII characters",
        )
        .into()),
    }
}

/// The answer to a retry of a submission `user` made with idempotency key
/// `key`: the same job, not a second one (or a 409 while it is being
/// stored). `None` for a key not seen.
fn submitted_before(world: &World, user: &str, key: &str) -> Option<Result<Response, Error>> {
    let &id = world
        .idempotency
        .get(&(user.to_string(), key.to_string()))?;
    if world.storing.contains(&id) {
        return Some(Err(ApiError::new(
            409,
            "in_progress",
            format!(
                "job {id}, submitted with this Idempotency-Key, is being stored; retry in a moment"
            ),
        )
        .into()));
    }
    let state = world
        .summaries()
        .get(&id)
        .map_or(JobState::Pending, |j| j.state);
    let array = world.jobs().get(&id).and_then(|j| {
        let a = j.array.as_ref()?;
        let n = api::ArraySpec::parse(j.spec.array.as_deref()?)
            .ok()?
            .indices
            .len();
        Some(api::ArrayRef {
            id: a.id,
            index: n as u32,
        })
    });
    Some(Ok((
        StatusCode::OK,
        Json(api::Submitted { id, state, array }),
    )
        .into_response()))
}

/// `?test_only=true`: where job `j` would start now or why it would wait,
/// from the cycle the server would run now with it in it, on a snapshot;
/// nothing is stored and no id is used up.
async fn test_only(
    shared: &Arc<Shared>,
    world: tokio::sync::MutexGuard<'_, World>,
    j: JobRec,
    at: u64,
) -> Result<Response, Error> {
    // A job that waits for others would not start now, whatever the
    // cluster holds.
    let singles = crate::depend::Singles::of(&world);
    if let Some(reason) = crate::depend::reason(&world, &j, &singles) {
        return Ok((
            StatusCode::OK,
            Json(api::TestOnly {
                would_start: false,
                nodes: vec![],
                reasons: vec![reason],
                eta: None,
            }),
        )
            .into_response());
    }
    let trial = crate::snapshot::Trial::take(&world, at, &shared.cfg)?;
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
    Ok((StatusCode::OK, Json(answer)).into_response())
}

/// The change that stores a submission's jobs (an array's elements, or
/// one job) of `team` by `user`: each with its event, and one audit line.
fn submission(elements: Vec<JobRec>, (team, user): (&str, &str), at: u64) -> Change {
    let mut change = Change::default();
    let (id, last) = (elements[0].id, elements[elements.len() - 1].id);
    for e in &elements {
        let what = match &e.array {
            Some(a) => format!(
                "submitted by {} to queue {} (array {id}, index {})",
                e.user, e.spec.queue, a.index
            ),
            None => format!("submitted by {} to queue {}", e.user, e.spec.queue),
        };
        change.event(at, Some(e.id), team, EventKind::Submitted, what);
    }
    change.audit(
        at,
        user,
        "job.submit",
        &if last > id {
            format!("job/{id}-{last}")
        } else {
            format!("job/{id}")
        },
        elements[0].spec.name.clone(),
    );
    for e in elements {
        change.job(e);
    }
    change
}
/// The job list's filters. `since` and `until` select the jobs that were
/// in the system during [since, until): submitted before `until`, not
/// finished before `since` (as `sacct -S/-E` selects).
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct ListParams {
    /// only this team's
    #[schemars(schema_with = "name_schema")]
    team: Option<String>,
    /// only this queue's
    #[schemars(schema_with = "name_schema")]
    queue: Option<String>,
    /// only jobs in these states, comma separated (`running,pending`)
    state: Option<States>,
    /// only this user's
    #[schemars(schema_with = "name_schema")]
    user: Option<String>,
    /// only this project's
    #[schemars(schema_with = "name_schema")]
    project: Option<String>,
    /// only this array's elements (its id: the first element's)
    array: Option<JobId>,
    /// page size (at most 1000)
    #[serde(default)]
    limit: PageLimit,
    /// jobs with smaller ids (the next page: the last id seen)
    before: Option<JobId>,
    /// jobs not finished before this Unix time
    since: Option<UnixTime>,
    /// jobs submitted before this Unix time
    until: Option<UnixTime>,
}
impl ParamSet for ListParams {
    const WORD: &'static str = "filter";
}

async fn list_jobs(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(q): Params<ListParams>,
) -> Reply<Vec<api::Job>> {
    let (since, until) = (q.since.map(|t| t.0), q.until.map(|t| t.0));
    let array = q.array.map(|a| a.0);
    let states = q.state.map(|s| s.0);
    let limit = q.limit.0;
    let before = q.before.map_or(u64::MAX, |b| b.0);
    // The page from the summaries; jobs still in memory shown from there,
    // the others read from the store after the lock is let go.
    let (mut views, missing) = {
        let world = shared.world.lock().await;
        let ids: Vec<u64> = world
            .summaries()
            .range(..before)
            .rev()
            .filter(|(_, j)| caller.sees(&j.team))
            .filter(|(_, j)| q.team.as_ref().is_none_or(|t| &j.team == t))
            .filter(|(_, j)| q.queue.as_ref().is_none_or(|t| &j.queue == t))
            .filter(|(_, j)| q.user.as_ref().is_none_or(|t| &j.user == t))
            .filter(|(_, j)| {
                q.project
                    .as_ref()
                    .is_none_or(|t| j.project.as_ref() == Some(t))
            })
            .filter(|(_, j)| states.as_ref().is_none_or(|s| s.contains(&j.state)))
            .filter(|(_, j)| array.is_none_or(|a| j.array == Some(a)))
            .filter(|(_, j)| until.is_none_or(|u| j.submitted_at < u))
            .filter(|(_, j)| since.is_none_or(|s| j.finished_at.is_none_or(|f| f >= s)))
            .take(limit)
            .map(|(id, _)| *id)
            .collect();
        let mut views = BTreeMap::new();
        let mut missing = Vec::new();
        for id in ids {
            match world.jobs().get(&id) {
                Some(j) => {
                    views.insert(id, view_of(j, world.why.get(&id), shared.now()));
                }
                None => missing.push(id),
            }
        }
        (views, missing)
    };
    for j in stored_jobs(&shared, &missing).await? {
        views.insert(j.id, j.view(shared.now()));
    }
    Ok(Json(views.into_values().rev().collect()))
}
async fn get_job(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Reply<api::Job> {
    let id = job_id(&id)?;
    let (j, why) = job_of(&shared, &caller, id).await?;
    Ok(Json(view_of(&j, why.as_ref(), shared.now())))
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
    let finished = {
        let world = shared.world.lock().await;
        visible(&world, &caller, id)?;
        !world.jobs().contains_key(&id)
    };
    if finished {
        // Out of memory: long finished; its reason says how it ended.
        let (j, _) = job_of(&shared, &caller, id).await?;
        return Ok(Json(api::Why {
            id,
            state: j.state,
            summary: j.reason.clone(),
            reasons: vec![j.reason],
            position: None,
            eta: None,
        }));
    }
    let (mut w, diagnosis) = {
        let world = shared.world.lock().await;
        let Some(j) = world.jobs().get(&id) else {
            return Err(ApiError::not_found(format!("job {id} not found")).into());
        };
        match world.why.get(&id) {
            Some(w) if j.state == JobState::Pending => {
                let w = w.clone();
                // Not reached by the last cycle: what its turn would find now,
                // worked out once per cycle.
                let d = match world.diagnosed.get(&id) {
                    Some(found) => Err(found.clone()),
                    None if world.unreached.contains(&id) => Ok(crate::snapshot::Trial::take(
                        &world,
                        shared.now(),
                        &shared.cfg,
                    )?),
                    None => Err(None),
                };
                (w, Some(d))
            }
            _ => {
                let summary = match j.state {
                    JobState::Pending => "waiting for the next scheduling cycle".to_string(),
                    // The reason says who held it ("held by ana").
                    JobState::Held => format!(
                        "{}; releasing it (gpuflow job release {id}) queues it again",
                        j.reason
                    ),
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

/// A job's output, each task's stdout and stderr per attempt: all of it the
/// server keeps (up to the job log limit, then each stream's last 16 KiB),
/// or one attempt's, or the end of each.
#[derive(serde::Deserialize, schemars::JsonSchema)]
pub(super) struct LogParams {
    /// only this attempt's output
    attempt: Option<Whole>,
    /// only the last this many bytes of each text
    tail_bytes: Option<Whole>,
}
impl ParamSet for LogParams {}

async fn logs(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
    Params(q): Params<LogParams>,
) -> Reply<api::JobLogs> {
    let id = job_id(&id)?;
    let attempt = q.attempt.map(|a| u32::try_from(a.0).unwrap_or(u32::MAX));
    let tail_bytes = q
        .tail_bytes
        .map(|n| usize::try_from(n.0).unwrap_or(usize::MAX));
    let (j, _) = job_of(&shared, &caller, id).await?;
    let pieces = shared
        .store
        .logs(id, attempt)
        .await
        .map_err(crate::ServerError::from)?;
    let limit = shared.cfg.job_log_bytes;
    let read = |stream: &str| {
        let mut all = crate::output::by_name(&j, crate::output::texts(&j, &pieces, stream, limit));
        if let Some(a) = attempt {
            all.retain(|k, _| *k == a);
        }
        if let Some(n) = tail_bytes {
            for text in all.values_mut().flat_map(BTreeMap::values_mut) {
                let from = crate::output::ceil_boundary(text, text.len().saturating_sub(n));
                text.drain(..from);
            }
        }
        all
    };
    let attempts = read("out");
    let stderr_attempts = read("err");
    let tasks = attempts.values().next_back().cloned().unwrap_or_default();
    let stderr = stderr_attempts
        .values()
        .next_back()
        .cloned()
        .unwrap_or_default();
    Ok(Json(api::JobLogs {
        id,
        tasks,
        attempts,
        stderr,
        stderr_attempts,
    }))
}
async fn job_action(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path((id, action)): Path<(String, String)>,
) -> Reply<api::Job> {
    let id = job_id(&id)?;
    let mut world = shared.write().await;
    visible(&world, &caller, id)?;
    if let Some(e) = world.external().get(&id).and_then(|j| j.external.as_ref()) {
        return Err(ApiError::conflict(format!(
            "job {id} runs on Kubernetes cluster {}, not here: act on its pods there ({}; kubectl delete pod for a cancel)",
            e.cluster, e.key
        ))
        .into());
    }
    let Some(j) = world.jobs().get(&id).cloned() else {
        // Out of memory: it finished long ago.
        return Err(ApiError::conflict(format!("job {id} has finished")).into());
    };
    let at = shared.now();
    let mut next = j.clone();
    let who = &caller.user.name;
    let conflict = |what: &str| -> Error {
        if j.state.finished() {
            ApiError::conflict(format!(
                "job {id} has finished ({}): there is nothing to {action}",
                j.state.as_str()
            ))
            .into()
        } else {
            ApiError::conflict(format!("job {id} is {}: {what}", j.state.as_str())).into()
        }
    };
    let Some(act) = crate::lifecycle::Action::parse(&action) else {
        return Err(ApiError::not_found(format!(
            "no job action {action:?}; actions: cancel, suspend, resume, hold, release"
        ))
        .into());
    };
    if act.admins_only() {
        caller.need_admin(&format!("{action} of a job"))?;
    } else {
        caller.acts_on_job(&world, &j.team, &j.user, &action)?;
    }
    let kind = crate::lifecycle::act(&mut next, act, who, at).map_err(|what| conflict(&what))?;
    let mut change = Change::default();
    change.event(at, Some(id), &next.team, kind, next.reason.clone());
    change.audit(at, who, &format!("job.{action}"), &format!("job/{id}"), "");
    let view = next.view(at);
    change.job(next);
    world = world.commit(change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(Json(view))
}

/// Cancels every unfinished element of an array in one commit.
async fn cancel_array(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Reply<api::ArrayCancelled> {
    let id = job_id(&id)?;
    let mut world = shared.write().await;
    visible(&world, &caller, id)?;
    let Some(team) = world
        .summaries()
        .get(&id)
        .filter(|s| s.array == Some(id))
        .map(|s| s.team.clone())
    else {
        return Err(ApiError::not_found(format!(
            "array {id} not found: an array's id is its first element's"
        ))
        .into());
    };
    if !caller.acts_on_jobs(&team) {
        return Err(ApiError::forbidden(format!(
            "your role ({}) may not cancel jobs of team {team:?}",
            caller.user.role.as_str()
        ))
        .into());
    }
    let at = shared.now();
    let who = caller.user.name.clone();
    let mut change = Change::default();
    let (mut cancelled, mut stopping) = (0, 0);
    let elements: Vec<Box<JobRec>> = world
        .jobs()
        .values()
        .filter(|j| !j.state.finished() && j.array.as_ref().is_some_and(|a| a.id == id))
        .cloned()
        .collect();
    for mut j in elements {
        if let Ok(kind) = crate::lifecycle::act(&mut j, crate::lifecycle::Action::Cancel, &who, at)
        {
            if j.state.finished() {
                cancelled += 1;
            } else {
                stopping += 1;
            }
            change.event(at, Some(j.id), &team, kind, j.reason.clone());
            change.job(j);
        }
    }
    change.audit(at, &who, "array.cancel", &format!("array/{id}"), "");
    world = world.commit(change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(Json(api::ArrayCancelled {
        id,
        cancelled,
        stopping,
    }))
}

/// Many jobs in one request and one transaction: all stored, with
/// consecutive ids, or none (the first wrong one named by its place).
async fn submit_batch(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<api::BatchSubmit>,
) -> Result<Created<api::BatchSubmitted>, Error> {
    let batch: api::BatchSubmit = body.read(shared.cfg.max_body_bytes)?;
    if batch.jobs.is_empty() || batch.jobs.len() > api::MAX_ARRAY {
        return Err(ApiError::bad_request(
            "invalid_batch",
            format!("jobs: 1 to {} specs", api::MAX_ARRAY),
        )
        .into());
    }
    let mut specs = Vec::with_capacity(batch.jobs.len());
    for (i, v) in batch.jobs.iter().enumerate() {
        let at = |e: ApiError| -> Error {
            ApiError::bad_request("invalid_spec", format!("jobs[{i}]: {}", e.message)).into()
        };
        let spec = JobSpec::parse(v.to_string().as_bytes(), true).map_err(at)?;
        if spec.array.is_some() {
            return Err(ApiError::bad_request(
                "invalid_spec",
                format!("jobs[{i}].array: submit an array on its own (POST /v1/jobs)"),
            )
            .into());
        }
        specs.push(spec);
    }
    let arrays = dependency_arrays(&shared, &specs.iter().collect::<Vec<_>>()).await?;
    let mut world = shared.write().await;
    let mut jobs = Vec::with_capacity(specs.len());
    let t = shared.now();
    for (i, mut spec) in specs.into_iter().enumerate() {
        let team = check_spec(&world, &caller, &mut spec, t).map_err(|Error(e)| {
            Error(ApiError::new(
                e.status,
                &e.code,
                format!("jobs[{i}]: {}", e.message),
            ))
        })?;
        let id = world.next_job + 1 + i as u64;
        let waits =
            dependency_waits(&world, &team, &spec, &[None], &arrays).map_err(|Error(e)| {
                Error(ApiError::new(
                    e.status,
                    &e.code,
                    format!("jobs[{i}].{}", e.message),
                ))
            })?;
        let mut j = crate::lifecycle::submitted(id, spec, &team, &caller.user.name, None, t);
        j.waits_on = waits.into_iter().next().unwrap_or_default();
        jobs.push(j);
    }
    let mut change = Change::default();
    for j in &jobs {
        change.event(
            t,
            Some(j.id),
            &j.team,
            EventKind::Submitted,
            format!(
                "submitted by {} to queue {} (in a batch)",
                j.user, j.spec.queue
            ),
        );
    }
    let ids: Vec<u64> = jobs.iter().map(|j| j.id).collect();
    change.audit(
        t,
        &caller.user.name,
        "job.submit",
        &format!("job/{}-{}", ids[0], ids[ids.len() - 1]),
        format!("{} jobs in a batch", ids.len()),
    );
    for j in jobs {
        change.job(j);
    }
    world = world.commit(change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(Created(api::BatchSubmitted { ids }))
}
