//! Projects of a team, with their cost centres.

use super::*;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new().route("/v1/projects", get(list_projects).post(create_project))
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
