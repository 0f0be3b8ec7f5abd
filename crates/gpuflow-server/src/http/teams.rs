//! Teams (admins) and who their tasks run as.

use super::*;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/teams", get(list_teams).post(create_team))
        .route("/v1/teams/{name}", patch(patch_team))
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
    let mut t: Team = json_body(body, shared.cfg.max_body_bytes)?;
    check_name("name", &t.name, "name")?;
    if t.uid != 0 {
        return Err(ApiError::bad_request(
            "invalid_team",
            "uid: assigned by the server; leave it out",
        )
        .into());
    }
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
    t.uid = world.teams.values().map(|t| t.uid).max().unwrap_or(0) + 1;
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
