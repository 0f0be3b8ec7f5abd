//! Tokens and roles. Tokens are random, shown once and stored only as their
//! SHA-256. A caller is a user with a role scoped to a team: admins manage
//! everything; team leads their team's queues and users; members submit and
//! act on their team's jobs; viewers read their team's jobs.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use gpuflow_api::{ApiError, Role, Team, User};
use gpuflow_store::{Record, Store, Table};

use crate::secret::{hash, new_token};
use crate::state::{Refused, TokenRec, World, team_rec, token_rec, user_rec};
use crate::{Config, Shared};

/// On a new installation: the `admin` user and its token, the `default` team
/// and queue, and the join token. Returns the admin token when created and the
/// join token when known.
///
/// # Errors
/// On a store error or a data directory that cannot be written.
pub async fn bootstrap(
    store: &dyn Store,
    world: &mut World,
    cfg: &Config,
) -> anyhow::Result<(Option<String>, Option<String>)> {
    use anyhow::Context;
    let mut batch = gpuflow_store::Batch::default();
    let mut admin_token = None;
    if world.installation.id.is_empty() {
        // A new installation draws its uid block; one made before blocks
        // existed keeps block 0, the uids its teams' files already have.
        let mut r = [0u8; 4];
        getrandom::fill(&mut r).expect("the OS random source works");
        world.installation = crate::state::Installation {
            id: new_token("gfi"),
            uid_block: if world.records().users.is_empty() {
                u32::from_le_bytes(r) % gpuflow_api::UID_BLOCKS
            } else {
                0
            },
        };
        batch
            .put
            .push(crate::state::installation_rec(&world.installation));
    }
    if world.records().users.is_empty() {
        let token = new_token("gfa");
        let admin = User {
            name: "admin".into(),
            team: String::new(),
            role: Role::Admin,
            disabled: false,
            identity: None,
            signed_out_at: None,
        };
        let tok = TokenRec {
            hash: hash(&token),
            user: "admin".into(),
            created_at: cfg.clock.now(),
            expires_at: None,
            revoked: None,
            session: None,
        };
        let team = Team {
            name: "default".into(),
            run_as: None,
            uid: 1,
            registries: Vec::new(),
            processes: true,
            default_image: None,
            registry_credentials: Default::default(),
            shared_control: false,
        };
        let queue = gpuflow_api::QueueSpec {
            name: "default".into(),
            team: "default".into(),
            parent: None,
            weight: 1.0,
            notebook_idle: None,
            notebook_max_lifetime_s: None,
            budget: None,
            state: gpuflow_api::QueueState::Open,
            // The default queue is guaranteed whatever the cluster has.
            quotas: [(
                "*".to_string(),
                gpuflow_api::QuotaSpec {
                    guaranteed: 1e6,
                    ..Default::default()
                },
            )]
            .into(),
            user_limits: Default::default(),
        };
        batch.put.extend([
            user_rec(&admin),
            token_rec(&tok),
            team_rec(&team),
            crate::state::queue_rec(&queue),
        ]);
        // A new installation's first records: committed with the batch
        // below before the server serves anything (it stops if that fails).
        world.put_record(crate::Rec::User(admin));
        world.put_record(crate::Rec::Token(tok));
        world.put_record(crate::Rec::Team(team));
        world.put_record(crate::Rec::Queue(queue));
        let path = cfg.data_dir.join("admin.token");
        write_secret(&path, &token).with_context(|| format!("cannot write {}", path.display()))?;
        admin_token = Some(token);
    }
    let mut join = cfg.join_token.clone();
    let join_path = cfg.data_dir.join("join.token");
    if join.is_none() {
        join = std::fs::read_to_string(&join_path)
            .ok()
            .map(|s| s.trim().to_string());
    }
    if join.is_none() && world.join_hash.is_empty() {
        let t = new_token("gfj");
        write_secret(&join_path, &t)
            .with_context(|| format!("cannot write {}", join_path.display()))?;
        join = Some(t);
    }
    if let Some(j) = &join {
        let h = hash(j);
        if h != world.join_hash {
            batch.put.push(Record {
                table: Table::Meta,
                key: "join_hash".into(),
                team: String::new(),
                state: String::new(),
                doc: h.clone(),
            });
            world.join_hash = h;
        }
    }
    store.commit(&batch).await?;
    Ok((admin_token, join))
}

fn write_secret(path: &std::path::Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    writeln!(f, "{secret}")
}

/// The authenticated caller of a request.
#[derive(Clone, Debug)]
pub struct Caller {
    pub user: User,
    /// The id of the token it signed in with ([`TokenRec::id`]); empty
    /// for a sign-in through an identity provider.
    pub token_id: String,
    /// The identity provider's user it signed in as, if it did.
    pub identity: Option<gpuflow_api::Identity>,
    /// When the token the caller used expires (`None`: never); a token it
    /// makes cannot outlive it.
    pub token_expires_at: Option<u64>,
}

impl Caller {
    pub fn admin(&self) -> bool {
        self.user.role == Role::Admin
    }

    /// May read things of `team`.
    pub fn sees(&self, team: &str) -> bool {
        self.admin() || self.user.team == team
    }

    /// May submit jobs to `team`.
    pub fn acts_on_jobs(&self, team: &str) -> bool {
        self.admin()
            || (self.user.team == team && matches!(self.user.role, Role::TeamLead | Role::Member))
    }

    /// May act on a job of `team` that `owner` submitted (cancel, hold,
    /// suspend, release, exec, reach its ports): an admin; the team's
    /// leads; a member on their own jobs, or on any of the team's when the
    /// team shares control. 403 otherwise, saying who may (`what`: the
    /// action).
    ///
    /// # Errors
    /// 403 when the caller may not.
    pub fn acts_on_job(
        &self,
        world: &World,
        team: &str,
        owner: &str,
        what: &str,
    ) -> Result<(), ApiError> {
        if !self.acts_on_jobs(team) {
            return Err(ApiError::forbidden(format!(
                "your role ({}) may not {what} jobs of team {team:?}",
                self.user.role.as_str()
            )));
        }
        let shared = world
            .records()
            .teams
            .get(team)
            .is_some_and(|t| t.shared_control);
        if self.admin() || self.user.role == Role::TeamLead || owner == self.user.name || shared {
            return Ok(());
        }
        Err(ApiError::forbidden(format!(
            "the job is {owner}'s: a member may {what} only their own jobs; a lead of team {team:?} or an admin may, or the team may share control (`gpuflow team set {team} --shared-control true`)"
        )))
    }

    /// May manage queues and users of `team`.
    pub fn leads(&self, team: &str) -> bool {
        self.admin() || (self.user.team == team && self.user.role == Role::TeamLead)
    }

    /// # Errors
    /// 403 unless the caller is an admin.
    pub fn need_admin(&self, what: &str) -> Result<(), ApiError> {
        if self.admin() {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!("{what} needs the admin role")))
        }
    }
}

/// The address a request came from (0.0.0.0 where the connection's is not
/// known, as in requests made in-process).
pub fn client_ip(ext: &axum::http::Extensions) -> std::net::IpAddr {
    ext.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |c| c.0.ip())
}

/// The bearer token of a request, if any.
pub fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

impl FromRequestParts<Arc<Shared>> for Caller {
    type Rejection = crate::http::Error;

    async fn from_request_parts(
        parts: &mut Parts,
        shared: &Arc<Shared>,
    ) -> Result<Caller, Self::Rejection> {
        let ip = client_ip(&parts.extensions);
        caller_of(shared, bearer(&parts.headers), ip).await
    }
}

/// The caller a token names: 401 without one (requests without any token
/// were counted by the router's layer) or with one that is not valid.
pub async fn caller_of(
    shared: &Shared,
    token: Option<&str>,
    ip: std::net::IpAddr,
) -> Result<Caller, crate::http::Error> {
    let Some(token) = token else {
        return Err(ApiError::new(
            401,
            "unauthenticated",
            "missing token: send `Authorization: Bearer <token>` (an admin creates tokens with `gpuflow token create`)",
        )
        .into());
    };
    let at = shared.now();
    if shared.oidc.enabled() && looks_like_jwt(token) {
        return oidc_caller(shared, token, ip, at).await;
    }
    let h = hash(token);
    let world = shared.world.lock().await;
    match world.principal(&h, at) {
        Ok((_, t))
            if t.session
                .as_ref()
                .is_some_and(|l| at >= l.checked_at + shared.oidc.recheck_s(&l.provider)) =>
        {
            shared.rates.token(&h)?;
            let t = t.clone();
            drop(world);
            recheck(shared, t, at).await
        }
        Ok((u, t)) => {
            shared.rates.token(&h)?;
            Ok(Caller {
                user: u.clone(),
                token_id: t.id().to_string(),
                identity: t.session.as_ref().map(|l| gpuflow_api::Identity {
                    provider: l.provider.clone(),
                    subject: l.subject.clone(),
                }),
                token_expires_at: t.expires_at,
            })
        }
        Err(why) => {
            shared.rates.anonymous(ip)?;
            Err(refusal(&why, at).into())
        }
    }
}

/// The 401 for a refused token, saying what happened and what to do.
pub fn refusal(why: &Refused, now: u64) -> ApiError {
    let ago = |t: u64| {
        humantime::format_duration(std::time::Duration::from_secs(now.saturating_sub(t)))
            .to_string()
    };
    let (code, msg) = match why {
        Refused::Unknown => (
            "token_unknown",
            "the token is not one this server made (or it was revoked or expired over 30 days ago): check that it is this server's, or ask for a new one".to_string(),
        ),
        Refused::Expired { at } => (
            "token_expired",
            format!(
                "the token expired at {} ({} ago): ask for a new one (`gpuflow token create USER`, by you with another token, your team's lead or an admin)",
                crate::when(*at),
                ago(*at)
            ),
        ),
        Refused::Revoked(r) => (
            "token_revoked",
            format!(
                "the token was revoked by {} at {} ({} ago)",
                r.by,
                crate::when(r.at),
                ago(r.at)
            ),
        ),
        Refused::Disabled { user } => (
            "user_disabled",
            format!(
                "user {user} is disabled: your team's lead or an admin enables it again (`gpuflow user enable {user}`)"
            ),
        ),
    };
    ApiError::new(401, code, msg)
}

/// Whether a bearer token is a JWT (three base64url parts), not one of
/// gpuflow's own.
fn looks_like_jwt(token: &str) -> bool {
    token.starts_with("ey") && token.split('.').count() == 3
}

/// Checks an ID token off the async threads (its provider's keys may be
/// fetched); a refusal counts against the caller's address.
///
/// # Errors
/// Why the token is refused (401), or 503 when its provider's keys
/// cannot be read.
pub async fn verified_id_token(
    shared: &Shared,
    token: &str,
    ip: std::net::IpAddr,
    at: u64,
) -> Result<crate::oidc::Identity, crate::http::Error> {
    let oidc = shared.oidc.clone();
    let t = token.to_string();
    let id = tokio::task::spawn_blocking(move || oidc.verify(&t, at))
        .await
        .map_err(|e| ApiError::new(500, "internal", format!("the sign-in check failed: {e}")))?;
    match id {
        Ok(id) => Ok(id),
        Err(e) => {
            shared.rates.anonymous(ip)?;
            Err(e.into())
        }
    }
}

/// The user an identity provider's `identity` is here, named `username`
/// with `team` and `role` from its groups: made on first sign-in, changed
/// when its groups give another team or role (audited, with the subject).
///
/// # Errors
/// 403 when the name is another user's (a token user's, or another
/// subject's), or the team does not exist; 401 when the user is disabled.
pub fn sign_in(
    world: &World,
    identity: &gpuflow_api::Identity,
    username: &str,
    (team, role): (String, Role),
    at: u64,
) -> Result<(User, crate::Change), crate::http::Error> {
    let known = world.records().users.get(username).cloned();
    if let Some(u) = &known {
        if u.identity.as_ref() != Some(identity) {
            return Err(ApiError::forbidden(format!(
                "signed in as {username} through {}, but user {} here is another ({}): an admin renames one of them",
                identity.provider,
                u.name,
                match &u.identity {
                    Some(i) => format!("{}'s subject {}", i.provider, i.subject),
                    None => "a user with API tokens".to_string(),
                }
            ))
            .into());
        }
        if u.disabled {
            return Err(refusal(
                &Refused::Disabled {
                    user: u.name.clone(),
                },
                at,
            )
            .into());
        }
    }
    if role != Role::Admin && !world.records().teams.contains_key(&team) {
        return Err(ApiError::forbidden(format!(
            "your groups give you team {team:?}, which does not exist here: ask an admin to create it"
        ))
        .into());
    }
    let user = User {
        name: username.to_string(),
        team,
        role,
        disabled: false,
        identity: Some(identity.clone()),
        signed_out_at: known.as_ref().and_then(|u| u.signed_out_at),
    };
    let mut change = crate::Change::default();
    if known.as_ref() != Some(&user) {
        change.put(crate::Rec::User(user.clone()));
        change.audit(
            at,
            &user.name,
            if known.is_none() {
                "user.signin"
            } else {
                "user.role"
            },
            &format!("user/{}", user.name),
            format!(
                "{} subject {}: {} {}",
                identity.provider,
                identity.subject,
                user.role.as_str(),
                if user.team.is_empty() {
                    "-"
                } else {
                    user.team.as_str()
                }
            ),
        );
    }
    Ok((user, change))
}

/// The caller an ID token sent as a bearer token names (as Kubernetes'
/// API server takes them): its user made on first sign-in and its team and
/// role set from its groups at every request.
async fn oidc_caller(
    shared: &Shared,
    token: &str,
    ip: std::net::IpAddr,
    at: u64,
) -> Result<Caller, crate::http::Error> {
    let id = verified_id_token(shared, token, ip, at).await?;
    shared
        .rates
        .token(&format!("oidc:{}:{}", id.provider, id.subject))?;
    let granted = shared.oidc.role_of(&id)?;
    let identity = gpuflow_api::Identity {
        provider: id.provider.clone(),
        subject: id.subject.clone(),
    };
    let world = shared.write().await;
    if let Some(out) = world
        .records()
        .users
        .get(&id.username)
        .and_then(|u| u.signed_out_at)
        && id.auth_time <= out
    {
        return Err(ApiError::new(
            401,
            "session_revoked",
            format!(
                "this sign-in (at {}) was ended at {}: sign in again (`gpuflow login`)",
                crate::when(id.auth_time),
                crate::when(out)
            ),
        )
        .into());
    }
    let (user, change) = sign_in(&world, &identity, &id.username, granted, at)?;
    world.commit(change).await?;
    Ok(Caller {
        user,
        token_id: String::new(),
        identity: Some(identity),
        token_expires_at: Some(id.expires_at),
    })
}

/// A session whose groups were read from its provider longer ago than the
/// provider's `recheck_s`: renewed there (off the lock), the user's team
/// and role set again from the groups now. A provider that no longer
/// renews it ends it (revoked "by provider NAME"); one that cannot be
/// reached leaves it as it was, to be tried again at the next request.
async fn recheck(shared: &Shared, t: TokenRec, at: u64) -> Result<Caller, crate::http::Error> {
    // Only sessions are rechecked; a token without one is unknown here.
    let Some(link) = t.session.clone() else {
        return Err(refusal(&Refused::Unknown, at).into());
    };
    let oidc = shared.oidc.clone();
    let rt = link.refresh_token.clone().unwrap_or_default();
    let (provider, subject) = (link.provider.clone(), link.subject.clone());
    let renewed = tokio::task::spawn_blocking(move || {
        if rt.is_empty() {
            return Err(crate::oidc::RenewError::Refused(
                "the sign-in gave no refresh token: sign in again".to_string(),
            ));
        }
        oidc.renew(&provider, &subject, &rt, at)
    })
    .await
    .map_err(|e| ApiError::new(500, "internal", format!("the session check failed: {e}")))?;
    let identity = gpuflow_api::Identity {
        provider: link.provider.clone(),
        subject: link.subject.clone(),
    };
    let mut world = shared.write().await;
    // Revoked while it was renewed: as revoked.
    let Some(now_rec) = world.records().tokens.get(&t.hash).cloned() else {
        return Err(refusal(&Refused::Unknown, at).into());
    };
    if let Some(r) = &now_rec.revoked {
        return Err(refusal(&Refused::Revoked(r.clone()), at).into());
    }
    match renewed {
        Err(crate::oidc::RenewError::Unreachable(e)) => {
            tracing::warn!(provider = %link.provider, error = %e, "a session could not be renewed; it goes on as it was");
            let user = world
                .records()
                .users
                .get(&t.user)
                .cloned()
                .ok_or_else(|| refusal(&Refused::Unknown, at))?;
            Ok(Caller {
                user,
                token_id: t.id().to_string(),
                identity: Some(identity),
                token_expires_at: t.expires_at,
            })
        }
        Err(e) => {
            let by = format!("provider {}", link.provider);
            let mut ended = now_rec.clone();
            let revoked = crate::state::Revoked { at, by };
            ended.revoked = Some(revoked.clone());
            let mut change = crate::Change::default();
            change.put(crate::Rec::Token(ended));
            change.audit(
                at,
                &t.user,
                "session.end",
                &format!("user/{}", t.user),
                e.to_string(),
            );
            world.commit(change).await?;
            let mut err = refusal(&Refused::Revoked(revoked), at);
            err.message = format!("{} ({e})", err.message);
            Err(err.into())
        }
        Ok(r) => {
            let id = crate::oidc::Identity {
                provider: link.provider.clone(),
                subject: link.subject.clone(),
                username: r.username.clone(),
                groups: r.groups.clone(),
                auth_time: 0,
                expires_at: 0,
                nonce: None,
            };
            if r.username != t.user {
                return Err(ApiError::forbidden(format!(
                    "the provider now names this user {}, not {}: sign in again",
                    r.username, t.user
                ))
                .into());
            }
            let granted = shared.oidc.role_of(&id)?;
            let (user, signed) = sign_in(&world, &identity, &r.username, granted, at)?;
            world = world.commit(signed).await?;
            let mut next = now_rec.clone();
            next.session = Some(crate::state::SessionLink {
                checked_at: at,
                refresh_token: r.refresh_token.or(link.refresh_token),
                ..link
            });
            let mut change = crate::Change::default();
            change.put(crate::Rec::Token(next));
            world.commit(change).await?;
            Ok(Caller {
                user,
                token_id: t.id().to_string(),
                identity: Some(identity),
                token_expires_at: t.expires_at,
            })
        }
    }
}
