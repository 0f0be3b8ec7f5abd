//! Inference services: create, list, get (replicas, readiness, endpoints),
//! change (scale within bounds, a new task rolled out), delete. Their
//! replicas are jobs the cycle's `services::reconcile` keeps in step.

use super::*;
use crate::event::EventKind;
use crate::state::ServiceRec;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/services",
            get_with(
                list_services,
                doc(
                    "any token (own team)",
                    "Inference services with their replicas, readiness and endpoints",
                ),
            )
            .post_with(
                create_service,
                doc(
                    "the queue's team (not viewers); admins",
                    "Create an inference service: replicas of one task, each its own job",
                ),
            ),
        )
        .api_route(
            "/v1/services/{name}",
            get_with(
                get_service,
                doc(
                    "any token (own team)",
                    "A service: its replicas, which are ready, its endpoints",
                ),
            )
            .patch_with(
                patch_service,
                doc(
                    "its team (not viewers); admins",
                    "Scale a service (within its bounds) or roll out a new task",
                ),
            )
            .delete_with(
                delete_service,
                doc(
                    "its team (not viewers); admins",
                    "Delete a service and cancel its replicas",
                ),
            ),
        )
}

fn not_found(name: &str) -> Error {
    ApiError::not_found(format!("service {name:?} not found")).into()
}

/// The service `name` if the caller may `what` it (its team's members and
/// leads, admins): a 404 when they may not see it, a 403 when they may
/// only look.
fn owned<'w>(
    world: &'w World,
    caller: &Caller,
    name: &str,
    what: &str,
) -> Result<&'w ServiceRec, Error> {
    let Some(svc) = world
        .records()
        .services
        .get(name)
        .filter(|s| caller.sees(&s.team))
    else {
        return Err(not_found(name));
    };
    if !caller.acts_on_jobs(&svc.team) {
        return Err(ApiError::forbidden(format!(
            "your role ({}) may not {what} services of team {:?}",
            caller.user.role.as_str(),
            svc.team
        ))
        .into());
    }
    Ok(svc)
}

async fn list_services(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<api::ServiceView>> {
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.records().services)
            .map(|(_, s)| s)
            .filter(|s| caller.sees(&s.team))
            .take(page.limit.0)
            .map(|s| crate::services::view(&world, s))
            .collect(),
    ))
}

async fn get_service(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Reply<api::ServiceView> {
    let world = shared.world.lock().await;
    match world.records().services.get(&name) {
        Some(s) if caller.sees(&s.team) => Ok(Json(crate::services::view(&world, s))),
        _ => Err(not_found(&name)),
    }
}

async fn create_service(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<api::ServiceSpec>,
) -> Result<Created<api::ServiceView>, Error> {
    let spec: api::ServiceSpec = body.read(shared.cfg.max_body_bytes)?;
    spec.validate()?;
    let mut world = shared.write().await;
    let Some(queue) = world.records().queues.get(&spec.queue) else {
        return Err(ApiError::bad_request(
            "unknown_queue",
            format!("queue: {:?} does not exist", spec.queue),
        )
        .into());
    };
    let team = queue.team.clone();
    if !caller.acts_on_jobs(&team) {
        return Err(ApiError::forbidden(format!(
            "you may not run services in queue {:?} of team {team:?}",
            spec.queue
        ))
        .into());
    }
    if let Some(why) = crate::feasible::never_fits(&world, &spec.job_spec(1)) {
        return Err(ApiError::bad_request("never_fits", why).into());
    }
    if world.records().services.contains_key(&spec.name) {
        return Err(ApiError::conflict(format!("service {:?} already exists", spec.name)).into());
    }
    let svc = ServiceRec {
        spec,
        version: 1,
        team: team.clone(),
        user: caller.user.name.clone(),
        deleted: false,
    };
    let at = shared.now();
    let mut change = Change::default();
    change.put(Rec::Service(Box::new(svc.clone())));
    change.event(
        at,
        None,
        &team,
        EventKind::ServiceCreated,
        format!(
            "service {} created by {} with {} replicas",
            svc.spec.name, caller.user.name, svc.spec.replicas
        ),
    );
    change.audit(
        at,
        &caller.user.name,
        "service.create",
        &format!("service/{}", svc.spec.name),
        "",
    );
    world = world.commit(change).await?;
    let view = crate::services::view(&world, &svc);
    drop(world);
    shared.wake.notify_one();
    Ok(Created(view))
}

async fn patch_service(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
    body: JsonBody<api::ServicePatch>,
) -> Reply<api::ServiceView> {
    let patch: api::ServicePatch = body.read(shared.cfg.max_body_bytes)?;
    let mut world = shared.write().await;
    let mut next = owned(&world, &caller, &name, "change")?.clone();
    if let Some(r) = patch.replicas {
        next.spec.replicas = r;
    }
    if let Some(r) = patch.rollout {
        next.spec.rollout = r;
    }
    // A new task or readiness check is a new version: rolled out.
    let mut rolled = false;
    if let Some(task) = patch.task {
        rolled |= task != next.spec.task;
        next.spec.task = task;
    }
    if let Some(r) = patch.readiness {
        rolled |= Some(&r) != next.spec.readiness.as_ref();
        next.spec.readiness = Some(r);
    }
    if rolled {
        next.version += 1;
    }
    next.spec.validate()?;
    let at = shared.now();
    let mut change = Change::default();
    change.put(Rec::Service(Box::new(next.clone())));
    change.event(
        at,
        None,
        &next.team,
        EventKind::ServiceChanged,
        format!(
            "service {name} changed by {}: {} replicas, version {}",
            caller.user.name, next.spec.replicas, next.version
        ),
    );
    change.audit(
        at,
        &caller.user.name,
        "service.update",
        &format!("service/{name}"),
        "",
    );
    world = world.commit(change).await?;
    let view = crate::services::view(&world, &next);
    drop(world);
    shared.wake.notify_one();
    Ok(Json(view))
}

/// Deletes a service: its record goes, its replicas are cancelled.
async fn delete_service(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::response::NoContent, Error> {
    let mut world = shared.write().await;
    let team = owned(&world, &caller, &name, "delete")?.team.clone();
    let at = shared.now();
    let mut change = Change::default();
    let who = caller.user.name.clone();
    let replicas: Vec<Box<JobRec>> = world
        .jobs()
        .values()
        .filter(|j| !j.state.finished())
        .filter(|j| j.service.as_ref().is_some_and(|s| s.name == name))
        .cloned()
        .collect();
    for mut j in replicas {
        if let Ok(kind) = crate::lifecycle::act(&mut j, crate::lifecycle::Action::Cancel, &who, at)
        {
            change.event(at, Some(j.id), &team, kind, j.reason.clone());
            change.job(j);
        }
    }
    change.remove(Gone::Service(name.clone()));
    change.event(
        at,
        None,
        &team,
        EventKind::ServiceDeleted,
        format!("service {name} deleted by {who}"),
    );
    change.audit(at, &who, "service.delete", &format!("service/{name}"), "");
    world = world.commit(change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(axum::response::NoContent)
}
