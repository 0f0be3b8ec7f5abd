//! Users and their roles.

use super::*;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new().route("/v1/users", get(list_users).post(create_user))
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
