//! API tokens: made, listed, revoked, expiring, capped per user.

use super::*;

pub(super) fn router() -> Router<Arc<Shared>> {
    Router::new()
        .route("/v1/tokens", post(create_token).get(list_tokens))
        .route("/v1/tokens/{id}", axum::routing::delete(revoke_token))
}

/// Whether `caller` may make, list and revoke tokens of user `u`: their own,
/// a team lead those of their team's non-admin users, an admin anyone's.
fn manages_tokens_of(caller: &Caller, u: &User) -> bool {
    caller.admin()
        || u.name == caller.user.name
        || (caller.leads(&u.team) && u.role != Role::Admin && !u.team.is_empty())
}
async fn create_token(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<(StatusCode, Json<TokenCreated>), Error> {
    let r: TokenRequest = json_body(body, shared.cfg.max_body_bytes)?;
    let expires_in = match r.expires_in_s {
        Some(0) | Some(315_360_001..) => {
            return Err(ApiError::bad_request(
                "invalid_token_request",
                "expires_in_s: 1 to 315360000 seconds (ten years); leave it out for a token that lasts until revoked",
            )
            .into());
        }
        e => e,
    };
    let at = now();
    // A token never outlives the token that made it: one asked for without
    // an expiry takes the maker's; a later one is refused.
    let expires_at = match (expires_in.map(|e| at + e), caller.token_expires_at) {
        (None, mine) => mine,
        (Some(asked), Some(mine)) if asked > mine => {
            return Err(ApiError::bad_request(
                "invalid_token_request",
                format!(
                    "expires_in_s: the token you use expires in {} s, and a token it makes cannot outlive it; ask for at most that, or leave it out",
                    mine.saturating_sub(at)
                ),
            )
            .into());
        }
        (asked, _) => asked,
    };
    let mut world = shared.world.lock().await;
    let Some(u) = world.users.get(&r.user).cloned() else {
        return Err(ApiError::bad_request(
            "unknown_user",
            format!("user: {:?} does not exist", r.user),
        )
        .into());
    };
    if !manages_tokens_of(&caller, &u) {
        return Err(
            ApiError::forbidden(format!("you may not create tokens for {:?}", r.user)).into(),
        );
    }
    let live = world
        .tokens
        .values()
        .filter(|t| t.user == r.user && t.live(at))
        .count();
    if live >= api::MAX_TOKENS_PER_USER {
        return Err(ApiError::conflict(format!(
            "user {:?} has {live} live tokens, the most allowed; revoke one first (`gpuflow token ls`, `gpuflow token revoke ID`)",
            r.user
        ))
        .into());
    }
    let token = new_token("gft");
    let rec = TokenRec {
        hash: hash(&token),
        user: r.user.clone(),
        created_at: at,
        expires_at,
    };
    let mut change = Change::default();
    change.batch.put.push(token_rec(&rec));
    change.audit(
        at,
        &caller.user.name,
        "token.create",
        &format!("user/{}", r.user),
        rec.id(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    let created = TokenCreated {
        user: r.user,
        token,
        id: rec.id().to_string(),
        expires_at: rec.expires_at,
    };
    world.tokens.insert(rec.hash.clone(), rec);
    Ok((StatusCode::CREATED, Json(created)))
}
/// `GET /v1/tokens`: the tokens the caller manages (never the tokens
/// themselves), live ones only.
async fn list_tokens(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Query(q): Query<BTreeMap<String, String>>,
) -> Reply<Vec<api::TokenView>> {
    let page = NamePage::parse(&q)?;
    let world = shared.world.lock().await;
    let at = now();
    let mut out: Vec<api::TokenView> = world
        .tokens
        .values()
        .filter(|t| t.live(at))
        .filter(|t| {
            world
                .users
                .get(&t.user)
                .is_some_and(|u| manages_tokens_of(&caller, u))
        })
        .map(TokenRec::view)
        .filter(|t| page.after.as_ref().is_none_or(|a| &t.id > a))
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out.truncate(page.limit);
    Ok(Json(out))
}
/// `DELETE /v1/tokens/{id}`: revokes a token the caller manages.
async fn revoke_token(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, Error> {
    let mut world = shared.world.lock().await;
    let found = world
        .tokens
        .values()
        .find(|t| t.id() == id)
        .filter(|t| {
            world
                .users
                .get(&t.user)
                .is_some_and(|u| manages_tokens_of(&caller, u))
        })
        .cloned();
    let Some(t) = found else {
        return Err(ApiError::not_found(format!(
            "token {id:?} not found among the tokens you manage (`gpuflow token ls`)"
        ))
        .into());
    };
    let mut change = Change::default();
    change
        .batch
        .delete
        .push((gpuflow_store::Table::Tokens, t.hash.clone()));
    change.audit(
        now(),
        &caller.user.name,
        "token.revoke",
        &format!("user/{}", t.user),
        t.id(),
    );
    commit(shared.store.as_ref(), &mut world, change).await?;
    world.tokens.remove(&t.hash);
    Ok(StatusCode::NO_CONTENT)
}
