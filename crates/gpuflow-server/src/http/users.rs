//! Users and their roles.

use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route(
            "/v1/users",
            get_with(list_users, doc("any token (own team)", "Users")).post_with(
                create_user,
                doc("admin; team lead for their team", "Create a user"),
            ),
        )
        .api_route(
            "/v1/users/{name}/disable",
            post_with(
                disable_user,
                doc(
                    "admin; team lead for their team's members and viewers",
                    "Disable a user: all their tokens are refused at once",
                ),
            ),
        )
        .api_route(
            "/v1/users/{name}/enable",
            post_with(
                enable_user,
                doc(
                    "admin; team lead for their team's members and viewers",
                    "Enable a disabled user again",
                ),
            ),
        )
        .api_route(
            "/v1/users/{name}/signout",
            post_with(
                sign_out,
                doc(
                    "the user; admin; team lead for their team's members and viewers",
                    "Refuse every sign-in of the user through an identity provider made until now",
                ),
            ),
        )
}

async fn list_users(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<User>> {
    let world = shared.world.lock().await;
    Ok(Json(
        page.of(&world.records().users)
            .map(|(_, u)| u)
            .filter(|u| caller.admin() || (u.team == caller.user.team && !u.team.is_empty()))
            .take(page.limit.0)
            .cloned()
            .collect(),
    ))
}
async fn create_user(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: JsonBody<User>,
) -> Result<Created<User>, Error> {
    let u: User = body.read(shared.cfg.max_body_bytes)?;
    check_name("name", &u.name, "name")?;
    if u.identity.is_some() || u.signed_out_at.is_some() {
        return Err(ApiError::bad_request(
            "invalid_user",
            "identity and signed_out_at are set by the server (at a sign-in, by `user signout`); leave them out",
        )
        .into());
    }
    let world = shared.write().await;
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
        _ if u.team.is_empty() => {
            return Err(ApiError::bad_request(
                "invalid_user",
                format!(
                    "team: a {} belongs to a team; name it (gpuflow user create {} --role {} --team TEAM)",
                    u.role.as_str(),
                    u.name,
                    u.role.as_str()
                ),
            )
            .into());
        }
        _ if !world.records().teams.contains_key(&u.team) => {
            return Err(ApiError::bad_request(
                "unknown_team",
                format!("team: {:?} does not exist", u.team),
            )
            .into());
        }
        _ => {}
    }
    if world.records().users.contains_key(&u.name) {
        return Err(ApiError::conflict(format!("user {:?} already exists", u.name)).into());
    }
    let mut change = Change::default();
    change.put(Rec::User(u.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        "user.create",
        &format!("user/{}", u.name),
        u.role.as_str(),
    );
    world.commit(change).await?;
    Ok(Created(u))
}

/// `POST /v1/users/{name}/disable`: every token of the user is refused at
/// once (admins; team leads for their team's members and viewers).
async fn disable_user(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Reply<User> {
    set_disabled(&shared, &caller, &name, true).await
}

/// `POST /v1/users/{name}/enable`: the user's live tokens work again.
async fn enable_user(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Reply<User> {
    set_disabled(&shared, &caller, &name, false).await
}

async fn set_disabled(shared: &Shared, caller: &Caller, name: &str, disabled: bool) -> Reply<User> {
    let world = shared.write().await;
    let mut u = seen(&world, caller, name)?;
    let allowed =
        caller.admin() || (caller.leads(&u.team) && matches!(u.role, Role::Member | Role::Viewer));
    if !allowed {
        return Err(ApiError::forbidden(format!(
            "disabling or enabling {name:?} needs the admin role (team leads do so for their team's members and viewers)"
        ))
        .into());
    }
    if disabled && u.name == caller.user.name {
        return Err(ApiError::bad_request(
            "invalid_user",
            "you cannot disable yourself: another admin can",
        )
        .into());
    }
    u.disabled = disabled;
    let mut change = Change::default();
    change.put(Rec::User(u.clone()));
    change.audit(
        shared.now(),
        &caller.user.name,
        if disabled {
            "user.disable"
        } else {
            "user.enable"
        },
        &format!("user/{}", u.name),
        "",
    );
    world.commit(change).await?;
    Ok(Json(u))
}

/// User `name`, when `caller` sees it (admins every user, others their
/// team's and themselves); 404 otherwise.
fn seen(world: &crate::state::World, caller: &Caller, name: &str) -> Result<User, Error> {
    world
        .records()
        .users
        .get(name)
        .filter(|u| {
            caller.admin()
                || (u.team == caller.user.team && !u.team.is_empty())
                || u.name == caller.user.name
        })
        .cloned()
        .ok_or_else(|| {
            ApiError::not_found(format!("user {name:?} not found among the users you see")).into()
        })
}

/// `POST /v1/users/{name}/signout`: every sign-in of the user through an
/// identity provider made until now is refused (the user signs in again);
/// by the user, the team's leads for their members and viewers, admins.
async fn sign_out(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(name): Path<String>,
) -> Reply<User> {
    let world = shared.write().await;
    let mut u = seen(&world, &caller, &name)?;
    let allowed = caller.admin()
        || u.name == caller.user.name
        || (caller.leads(&u.team) && matches!(u.role, Role::Member | Role::Viewer));
    if !allowed {
        return Err(ApiError::forbidden(format!(
            "signing {name:?} out needs the admin role (team leads do so for their team's members and viewers; anyone for themselves)"
        ))
        .into());
    }
    let at = shared.now();
    u.signed_out_at = Some(at);
    let mut change = Change::default();
    change.put(Rec::User(u.clone()));
    // Its sessions end too.
    let ended: Vec<crate::state::TokenRec> = world
        .records()
        .tokens
        .values()
        .filter(|t| t.user == u.name && t.session.is_some() && t.live(at))
        .map(|t| {
            let mut t = t.clone();
            t.revoked = Some(crate::state::Revoked {
                at,
                by: caller.user.name.clone(),
            });
            t
        })
        .collect();
    for t in ended {
        change.put(Rec::Token(t));
    }
    change.audit(
        at,
        &caller.user.name,
        "user.signout",
        &format!("user/{}", u.name),
        "",
    );
    world.commit(change).await?;
    Ok(Json(u))
}
