//! Projects of a team, with their cost centres and budgets.

use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/projects",
            get_with(
                list_projects,
                doc(
                    "any token (own team)",
                    "Projects (what jobs are accounted to) with what is left of their budgets",
                ),
            )
            .post_with(
                create_project,
                doc(
                    "admin; team lead for their team (a budget: admin)",
                    "Create a project",
                ),
            ),
        )
        .api_route(
            "/v1/projects/{name}",
            patch_with(
                patch_project,
                doc(
                    "admin",
                    "Change a project's cost centre or budget (`null` removes it)",
                ),
            ),
        )
}

fn view(world: &World, p: &api::Project, at: u64) -> api::ProjectView {
    api::ProjectView {
        project: p.clone(),
        budget_use: p
            .budget
            .as_ref()
            .map(|b| crate::accounting::budget_use(b, world.project_budget_used.get(&p.name), at)),
    }
}

async fn list_projects(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<api::ProjectView>> {
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.records().projects)
            .map(|(_, p)| p)
            .filter(|p| caller.sees(&p.team))
            .take(page.limit.0)
            .map(|p| view(&world, p, shared.now()))
            .collect(),
    ))
}
async fn create_project(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<api::Project>,
) -> Result<Created<api::Project>, Error> {
    let p: api::Project = body.read(shared.cfg.max_body_bytes)?;
    check_name("name", &p.name, "name")?;
    p.validate()?;
    if p.budget.is_some() {
        caller.need_admin("setting a project's budget")?;
    }
    let world = shared.write().await;
    if !caller.leads(&p.team) {
        return Err(ApiError::forbidden(format!(
            "creating a project of team {:?} needs the admin role or that team's lead",
            p.team
        ))
        .into());
    }
    if !world.records().teams.contains_key(&p.team) {
        return Err(ApiError::bad_request(
            "unknown_team",
            format!("team: {:?} does not exist", p.team),
        )
        .into());
    }
    if world.records().projects.contains_key(&p.name) {
        return Err(ApiError::conflict(format!("project {:?} already exists", p.name)).into());
    }
    let mut change = Change::default();
    change.put(Rec::Project(p.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "project.create",
        &format!("project/{}", p.name),
        p.cost_centre.clone(),
    );
    world.commit(change).await?;
    Ok(Created(p))
}

/// An admin changes a project's cost centre or budget.
async fn patch_project(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
    body: JsonBody<api::ProjectPatch>,
) -> Reply<api::ProjectView> {
    let patch: api::ProjectPatch = body.read(shared.cfg.max_body_bytes)?;
    caller.need_admin("changing a project")?;
    let mut world = shared.write().await;
    let Some(p) = world.records().projects.get(&name) else {
        return Err(ApiError::not_found(format!("project {name:?} not found")).into());
    };
    let mut p = p.clone();
    if let Some(cc) = patch.cost_centre {
        p.cost_centre = cc;
    }
    if let Some(b) = patch.budget {
        p.budget = b;
    }
    p.validate()?;
    let mut change = Change::default();
    change.put(Rec::Project(p.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "project.update",
        &format!("project/{name}"),
        serde_json::to_string(&p.budget).unwrap_or_default(),
    );
    world = world.commit(change).await?;
    drop(world);
    // The new budget is counted now, not at the next 30 s count.
    if let Err(e) = crate::accounting::refresh_budgets(&shared, shared.now()).await {
        tracing::error!(error = %e, "counting the budgets failed; retrying");
    }
    let world = shared.world.lock().await;
    Ok(Json(view(&world, &p, shared.now())))
}
