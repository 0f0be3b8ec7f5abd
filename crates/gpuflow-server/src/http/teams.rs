//! Teams (admins) and who their tasks run as.

use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/teams",
            get_with(list_teams, doc("any token (own team)", "Teams"))
                .post_with(create_team, doc("admin", "Create a team")),
        )
        .api_route(
            "/v1/teams/{name}",
            patch_with(
                patch_team,
                doc(
                    "admin",
                    "Change who a team's tasks run as (run_as; empty for the agents' default)",
                ),
            ),
        )
}

async fn list_teams(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<Team>> {
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.records().teams)
            .map(|(_, t)| t)
            .filter(|t| caller.sees(&t.name))
            .take(page.limit.0)
            .map(api::Team::redacted)
            .collect(),
    ))
}
async fn create_team(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<Team>,
) -> Result<Created<Team>, Error> {
    caller.need_admin("creating a team")?;
    let mut t: Team = body.read(shared.cfg.max_body_bytes)?;
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
    check_images(&t)?;
    let world = shared.write().await;
    if world.records().teams.contains_key(&t.name) {
        return Err(ApiError::conflict(format!("team {:?} already exists", t.name)).into());
    }
    t.uid = world
        .records()
        .teams
        .values()
        .map(|t| t.uid)
        .max()
        .unwrap_or(0)
        + 1;
    let mut change = Change::default();
    change.put(Rec::Team(t.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "team.create",
        &format!("team/{}", t.name),
        "",
    );
    world.commit(change).await?;
    Ok(Created(t.redacted()))
}

/// A team's image settings, each checked.
fn check_images(t: &Team) -> Result<(), Error> {
    let bad = |m: String| Error::from(ApiError::bad_request("invalid_team", m));
    for r in &t.registries {
        if r.is_empty() || r.len() > 512 || r.chars().any(|c| c.is_whitespace()) {
            return Err(bad(format!(
                "registries: {r:?} is not an image prefix (e.g. 127.0.0.1:5000/team/)"
            )));
        }
    }
    if let Some(i) = &t.default_image {
        if !api::job::valid_image(i) {
            return Err(bad(format!(
                "default_image: {i:?} is not an image reference"
            )));
        }
        if let Some(why) = t.refuses_image(i) {
            return Err(bad(format!("default_image: {why}")));
        }
    }
    for (host, c) in &t.registry_credentials {
        if host.is_empty() || host.contains('/') || host.chars().any(char::is_whitespace) {
            return Err(bad(format!(
                "registry_credentials: {host:?} is not a registry host (host or host:port)"
            )));
        }
        if c.username.is_empty() || c.password.is_empty() || c.username.contains(':') {
            return Err(bad(format!(
                "registry_credentials.{host}: a user name (without ':') and a password are both needed"
            )));
        }
    }
    Ok(())
}
/// `PATCH /v1/teams/{name}`: who the team's tasks run as (admins only).
async fn patch_team(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
    body: JsonBody<api::TeamPatch>,
) -> Reply<Team> {
    let p: api::TeamPatch = body.read(shared.cfg.max_body_bytes)?;
    // A team's leads may share control of its jobs; the rest is an admin's.
    let only_sharing = api::TeamPatch {
        shared_control: None,
        ..p.clone()
    } == api::TeamPatch::default();
    if !(only_sharing && caller.leads(&name)) {
        caller.need_admin("changing a team (other than its leads sharing control of its jobs)")?;
    }
    let world = shared.write().await;
    let Some(t) = world.records().teams.get(&name) else {
        return Err(ApiError::not_found(format!("team {name:?} not found")).into());
    };
    let mut t = t.clone();
    if let Some(b) = p.shared_control {
        t.shared_control = b;
    }
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
    if let Some(r) = p.registries {
        t.registries = r;
    }
    if let Some(b) = p.processes {
        t.processes = b;
    }
    if let Some(i) = p.default_image {
        t.default_image = (!i.is_empty()).then_some(i);
    }
    let mut logins = Vec::new();
    for (host, c) in p.registry_credentials.unwrap_or_default() {
        logins.push(host.clone());
        if c.username.is_empty() {
            t.registry_credentials.remove(&host);
        } else {
            t.registry_credentials.insert(host, c);
        }
    }
    check_images(&t)?;
    let mut change = Change::default();
    change.put(Rec::Team(t.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "team.update",
        &format!("team/{name}"),
        // Which logins changed, never what they are.
        if let Some(b) = p.shared_control {
            format!("shared control {}", if b { "on" } else { "off" })
        } else if logins.is_empty() {
            t.run_as.clone().unwrap_or_default()
        } else {
            format!("registry logins for {}", logins.join(", "))
        },
    );
    world.commit(change).await?;
    Ok(Json(t.redacted()))
}
