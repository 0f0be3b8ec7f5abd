//! API tokens: made, listed, revoked, expiring, capped per user.

use super::*;

pub(super) fn router() -> ApiRouter {
    ApiRouter::new()
        .api_route("/v1/tokens", post_with(create_token, doc("admin; team lead for their team; anyone for themselves", "Create an API token (shown once), optionally expiring; at most 20 live tokens per user")).get_with(list_tokens, doc("admin: all; team lead: their team's; anyone: their own", "List live tokens (ids, never the tokens)")))
        .api_route("/v1/tokens/{id}", delete_with(revoke_token, doc("admin: all; team lead: their team's; anyone: their own", "Revoke a token")))
        .api_route("/v1/auth/sessions", post_with(create_session, doc("anyone with an ID token of a configured identity provider", "Sign in: the provider's ID token (and refresh token) becomes a session token, listed and revoked as tokens are; the user's groups are read again from the provider as it goes on")))
        .api_route("/v1/auth/code", post_with(code_session, doc("anyone back from a configured identity provider", "The dashboard's sign-in (authorization code flow with PKCE): the server exchanges the code at the provider, once, checks the ID token and its nonce, and answers a session token")))
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
    body: JsonBody<TokenRequest>,
) -> Result<Created<TokenCreated>, Error> {
    let r: TokenRequest = body.read(shared.cfg.max_body_bytes)?;
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
    let at = shared.now();
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
    let world = shared.write().await;
    let Some(u) = world.records().users.get(&r.user).cloned() else {
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
        .records()
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
        revoked: None,
        session: None,
    };
    let mut change = Change::default();
    change.put(Rec::Token(rec.clone()));
    change.audit(
        at,
        &caller.user.name,
        "token.create",
        &format!("user/{}", r.user),
        rec.id(),
    );
    world.commit(change).await?;
    let created = TokenCreated {
        user: r.user,
        token,
        id: rec.id().to_string(),
        expires_at: rec.expires_at,
    };
    Ok(Created(created))
}
/// `GET /v1/tokens`: the tokens the caller manages (never the tokens
/// themselves), live ones only.
async fn list_tokens(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Params(page): Params<NamePage>,
) -> Reply<Vec<api::TokenView>> {
    let world = shared.world.lock().await;
    let at = shared.now();
    let mut out: Vec<api::TokenView> = world
        .records()
        .tokens
        .values()
        .filter(|t| t.live(at))
        .filter(|t| {
            world
                .records()
                .users
                .get(&t.user)
                .is_some_and(|u| manages_tokens_of(&caller, u))
        })
        .map(TokenRec::view)
        .filter(|t| page.after.as_ref().is_none_or(|a| &t.id > a))
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out.truncate(page.limit.0);
    Ok(Json(out))
}
/// `DELETE /v1/tokens/{id}`: revokes a token the caller manages.
async fn revoke_token(
    State(shared): State<Arc<Shared>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::response::NoContent, Error> {
    let world = shared.write().await;
    let at = shared.now();
    let found = world
        .records()
        .tokens
        .values()
        .find(|t| t.id() == id && t.revoked.is_none())
        .filter(|t| {
            world
                .records()
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
    // Kept, revoked, so that it is refused as such; the user's tokens dead
    // for long go.
    let mut revoked = t.clone();
    revoked.revoked = Some(crate::state::Revoked {
        at,
        by: caller.user.name.clone(),
    });
    let forgotten: Vec<String> = world
        .records()
        .tokens
        .values()
        .filter(|x| x.user == t.user && x.forgotten(at))
        .map(|x| x.hash.clone())
        .collect();
    let mut change = Change::default();
    change.put(Rec::Token(revoked));
    for h in forgotten {
        change.remove(Gone::Token(h));
    }
    change.audit(
        at,
        &caller.user.name,
        "token.revoke",
        &format!("user/{}", t.user),
        t.id(),
    );
    world.commit(change).await?;
    Ok(axum::response::NoContent)
}

/// How long a session may last at most, renewed or not: 30 days.
const SESSION_MAX_S: u64 = 30 * 86_400;

/// The caller's address, once a sign-in may go on: the server has an
/// identity provider. (Requests without a token are within the address's
/// rate already: the router's layer counts them.)
fn sign_in_gate(shared: &Shared, ext: &axum::http::Extensions) -> Result<std::net::IpAddr, Error> {
    let ip = crate::http::auth::client_ip(ext);
    if !shared.oidc.enabled() {
        return Err(ApiError::not_found(
            "this server has no identity provider (gpuflow server --oidc-config): sign in with an API token",
        )
        .into());
    }
    Ok(ip)
}

/// `POST /v1/auth/sessions` (no token): a sign-in through an identity
/// provider (its ID token, checked, and its refresh token) becomes a
/// session token (`gfs_…`), listed and revoked as the user's tokens are.
/// The user is made on first sign-in; a user at the limit of live tokens
/// loses its oldest session.
async fn create_session(
    State(shared): State<Arc<Shared>>,
    Ext(ext): Ext,
    body: JsonBody<api::SessionRequest>,
) -> Result<Created<TokenCreated>, Error> {
    let ip = sign_in_gate(&shared, &ext)?;
    let r: api::SessionRequest = body.read(shared.cfg.max_body_bytes)?;
    let at = shared.now();
    let id = crate::http::auth::verified_id_token(&shared, &r.id_token, ip, at).await?;
    open_session(&shared, id, r.refresh_token, at).await
}

/// `POST /v1/auth/code` (no token): the dashboard's sign-in. The browser
/// went to the provider with a PKCE challenge and a nonce and came back
/// with a code; the server exchanges it there (once), checks the ID token
/// and its nonce, and answers a session token.
async fn code_session(
    State(shared): State<Arc<Shared>>,
    Ext(ext): Ext,
    body: JsonBody<api::CodeRequest>,
) -> Result<Created<TokenCreated>, Error> {
    sign_in_gate(&shared, &ext)?;
    let r: api::CodeRequest = body.read(shared.cfg.max_body_bytes)?;
    let at = shared.now();
    let oidc = shared.oidc.clone();
    let (id, refresh) = tokio::task::spawn_blocking(move || oidc.exchange(&r, at))
        .await
        .map_err(|e| ApiError::new(500, "internal", format!("the sign-in failed: {e}")))??;
    open_session(&shared, id, refresh, at).await
}

/// A session for a checked sign-in: the user made or updated from its
/// groups, a `gfs_` token answered.
async fn open_session(
    shared: &Shared,
    id: crate::oidc::Identity,
    refresh_token: Option<String>,
    at: u64,
) -> Result<Created<TokenCreated>, Error> {
    let granted = shared.oidc.role_of(&id)?;
    let identity = api::Identity {
        provider: id.provider.clone(),
        subject: id.subject.clone(),
    };
    let mut world = shared.write().await;
    let (user, signed) = crate::http::auth::sign_in(&world, &identity, &id.username, granted, at)?;
    world = world.commit(signed).await?;
    let token = new_token("gfs");
    let rec = TokenRec {
        hash: hash(&token),
        user: user.name.clone(),
        created_at: at,
        expires_at: Some(at + SESSION_MAX_S),
        revoked: None,
        session: Some(crate::state::SessionLink {
            provider: id.provider.clone(),
            subject: id.subject.clone(),
            refresh_token: refresh_token.filter(|t| !t.is_empty()),
            checked_at: at,
        }),
    };
    let mut change = Change::default();
    // At the limit: the oldest session goes.
    let live: Vec<&TokenRec> = world
        .records()
        .tokens
        .values()
        .filter(|t| t.user == user.name && t.live(at))
        .collect();
    if live.len() >= api::MAX_TOKENS_PER_USER {
        let Some(oldest) = live
            .iter()
            .filter(|t| t.session.is_some())
            .min_by_key(|t| t.created_at)
        else {
            return Err(ApiError::conflict(format!(
                "user {:?} has {} live tokens, the most allowed; revoke one first (`gpuflow token ls`)",
                user.name,
                live.len()
            ))
            .into());
        };
        let mut old = (*oldest).clone();
        old.revoked = Some(crate::state::Revoked {
            at,
            by: format!("{} (a newer sign-in)", user.name),
        });
        change.put(Rec::Token(old));
    }
    change.put(Rec::Token(rec.clone()));
    change.audit(
        at,
        &user.name,
        "session.create",
        &format!("user/{}", user.name),
        format!("{} subject {} ({})", id.provider, id.subject, rec.id()),
    );
    world.commit(change).await?;
    let created = TokenCreated {
        user: user.name.clone(),
        token,
        id: rec.id().to_string(),
        expires_at: rec.expires_at,
    };
    Ok(Created(created))
}
