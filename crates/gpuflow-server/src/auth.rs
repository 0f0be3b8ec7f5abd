//! Tokens and roles. Tokens are random, shown once and stored only as their
//! SHA-256. A caller is a user with a role scoped to a team: admins manage
//! everything; team leads their team's queues and users; members submit and
//! act on their team's jobs; viewers read their team's jobs.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use gpuflow_api::{ApiError, Role, Team, User};
use gpuflow_store::{Record, Store, Table};
use sha2::{Digest, Sha256};

use crate::state::{TokenRec, World, team_rec, token_rec, user_rec};
use crate::{Config, Shared, now};

/// A new random token with a recognisable prefix.
pub fn new_token(prefix: &str) -> String {
    let mut bytes = [0u8; 24];
    getrandom::fill(&mut bytes).expect("the OS random source works");
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}_{hex}")
}

pub fn hash(token: &str) -> String {
    Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

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
            uid_block: if world.users.is_empty() {
                u32::from_le_bytes(r) % gpuflow_api::UID_BLOCKS
            } else {
                0
            },
        };
        batch
            .put
            .push(crate::state::installation_rec(&world.installation));
    }
    if world.users.is_empty() {
        let token = new_token("gfa");
        let admin = User {
            name: "admin".into(),
            team: String::new(),
            role: Role::Admin,
            disabled: false,
        };
        let tok = TokenRec {
            hash: hash(&token),
            user: "admin".into(),
            created_at: now(),
            expires_at: None,
        };
        let team = Team {
            name: "default".into(),
            run_as: None,
            uid: 1,
            registries: Vec::new(),
            processes: true,
            default_image: None,
            registry_credentials: Default::default(),
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
        world.users.insert(admin.name.clone(), admin);
        world.tokens.insert(tok.hash.clone(), tok);
        world.teams.insert(team.name.clone(), team);
        world.queues.insert(queue.name.clone(), queue);
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

    /// May act on jobs of `team` (cancel, suspend, resume, submit).
    pub fn acts_on_jobs(&self, team: &str) -> bool {
        self.admin()
            || (self.user.team == team && matches!(self.user.role, Role::TeamLead | Role::Member))
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
        let ip = parts
            .extensions
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |c| c.0.ip());
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
    let h = hash(token);
    let world = shared.world.lock().await;
    match world.principal(&h, now()) {
        Some((u, t)) => {
            shared.rates.token(&h)?;
            Ok(Caller {
                user: u.clone(),
                token_expires_at: t.expires_at,
            })
        }
        None => {
            shared.rates.anonymous(ip)?;
            Err(ApiError::new(
                401,
                "unauthenticated",
                "the token is not valid (unknown, revoked or expired, or its user is disabled)",
            )
            .into())
        }
    }
}
