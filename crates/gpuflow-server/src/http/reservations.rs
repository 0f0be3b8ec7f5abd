//! Reservations: windows of time on named nodes (or a count of a model's),
//! for teams and users or for maintenance; admins make and delete them,
//! everyone sees them.

use super::*;
use crate::event::EventKind;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/reservations", post_with(create, doc("admin", "A window on named nodes (or a count of a GPU model's) for teams and users (their jobs ask for it with `reservation`), or for maintenance (no job runs); jobs of others run there before it only if they end before it starts")).get_with(list, doc("any token", "Every reservation")))
        .api_route("/v1/reservations/{name}", delete_with(remove, doc("admin", "Delete a reservation; its waiting jobs are told it is gone")))
}

/// The longest reservation, seconds.
const MAX_LENGTH_S: u64 = 366 * 86_400;

async fn create(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<api::ReservationSpec>,
) -> Result<Created<api::Reservation>, Error> {
    caller.need_admin("making a reservation")?;
    let s: api::ReservationSpec = body.read(shared.cfg.max_body_bytes)?;
    let bad = |m: String| -> Error { ApiError::bad_request("invalid_reservation", m).into() };
    if !api::valid_name(&s.name) {
        return Err(bad(format!(
            "name: {:?} is not a valid name (lowercase letters, digits, '-', '_', '.')",
            s.name
        )));
    }
    let t = shared.now();
    if s.end <= s.start || s.end <= t || s.end - s.start > MAX_LENGTH_S {
        return Err(bad(
            "start and end: Unix seconds, end after start and after now, at most a year apart"
                .into(),
        ));
    }
    if s.maintenance != (s.teams.is_empty() && s.users.is_empty()) {
        return Err(bad(
            "name the teams or users it is for, or make it a maintenance window (no job runs): one of the two"
                .into(),
        ));
    }
    let mut world = shared.write().await;
    if world.records().reservations.contains_key(&s.name) {
        return Err(ApiError::conflict(format!("reservation {:?} exists", s.name)).into());
    }
    for team in &s.teams {
        if !world.records().teams.contains_key(team) {
            return Err(bad(format!("teams: {team:?} does not exist")));
        }
    }
    for user in &s.users {
        if !world.records().users.contains_key(user) {
            return Err(bad(format!("users: {user:?} does not exist")));
        }
    }
    // Nodes another reservation holds at some moment of this window.
    let overlaps = |node: &str| -> Option<&api::Reservation> {
        world.records().reservations.values().find(|r| {
            r.end > t && r.start < s.end && s.start < r.end && r.nodes.iter().any(|n| n == node)
        })
    };
    let nodes: Vec<String> = match (&s.nodes[..], s.count, &s.model) {
        (names, None, None) if !names.is_empty() => {
            for n in names {
                if !world.nodes().contains_key(n) {
                    return Err(bad(format!("nodes: {n:?} does not exist")));
                }
                if let Some(r) = overlaps(n) {
                    return Err(ApiError::conflict(format!(
                        "node {n} is in reservation {:?} then ({} to {})",
                        r.name,
                        crate::when(r.start),
                        crate::when(r.end)
                    ))
                    .into());
                }
            }
            let mut v = names.to_vec();
            v.sort();
            v.dedup();
            v
        }
        ([], Some(count), Some(model)) if count > 0 => {
            // The nodes of that model with the fewest jobs now, free of
            // other reservations then.
            let mut have: Vec<(usize, &String)> = world
                .nodes()
                .values()
                .filter(|n| n.state != api::NodeState::Lost)
                .filter(|n| n.inventory.gpus.iter().any(|g| g.model == *model))
                .filter(|n| overlaps(&n.name).is_none())
                .map(|n| (world.jobs_on(&n.name).count(), &n.name))
                .collect();
            have.sort();
            if have.len() < count as usize {
                return Err(ApiError::conflict(format!(
                    "{count} nodes of {model} asked for; {} are free of other reservations then",
                    have.len()
                ))
                .into());
            }
            let mut v: Vec<String> = have[..count as usize]
                .iter()
                .map(|(_, n)| (*n).clone())
                .collect();
            v.sort();
            v
        }
        _ => {
            return Err(bad(
                "give `nodes` (names), or `count` and `model` (that many nodes of a GPU model)"
                    .into(),
            ));
        }
    };
    let r = api::Reservation {
        name: s.name.clone(),
        start: s.start,
        end: s.end,
        nodes,
        teams: s.teams.clone(),
        users: s.users.clone(),
        maintenance: s.maintenance,
        created_by: caller.user.name.clone(),
    };
    let mut change = Change::default();
    change.put(Rec::Reservation(r.clone()));
    change.event(
        t,
        None,
        "",
        EventKind::ReservationCreated,
        format!(
            "{} on {} from {} to {}",
            r.purpose(),
            r.nodes.join(", "),
            crate::when(r.start),
            crate::when(r.end)
        ),
    );
    change.audit(
        t,
        &caller.user.name,
        "reservation.create",
        &format!("reservation/{}", r.name),
        "",
    );
    world = world.commit(change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(Created(r))
}

async fn list(State(shared): State<Arc<Shared>>, _caller: Caller) -> Reply<Vec<api::Reservation>> {
    let world = shared.world.lock().await;
    Ok(Json(
        world.records().reservations.values().cloned().collect(),
    ))
}

async fn remove(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<axum::response::NoContent, Error> {
    caller.need_admin("deleting a reservation")?;
    let mut world = shared.write().await;
    if !world.records().reservations.contains_key(&name) {
        return Err(ApiError::not_found(format!("reservation {name:?} not found")).into());
    }
    let mut change = Change::default();
    change.remove(Gone::Reservation(name.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "reservation.delete",
        &format!("reservation/{name}"),
        "",
    );
    world = world.commit(change).await?;
    drop(world);
    shared.wake.notify_one();
    Ok(axum::response::NoContent)
}
