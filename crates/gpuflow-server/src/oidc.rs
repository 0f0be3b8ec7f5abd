//! Sign-in through the organisation's identity providers (OpenID Connect).
//! The server is a relying party: the CLI (device flow) and the dashboard
//! get ID tokens from a provider and send them as bearer tokens, as
//! Kubernetes' API server takes them. Each is checked against the
//! provider's discovery document and published keys (fetched again when a
//! token names a key it has not seen: key rotation): its signature by an
//! asymmetric algorithm, issuer, audience (the client id), expiry, not
//! before, and issue time (clock skew). Its groups map to a team and role
//! by the provider's rules, at every request, so a user removed from a
//! group loses the role at the next sign-in or refresh.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpuflow_api::{ApiError, Role};
use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::{Deserialize, Serialize};

/// Seconds a token's times may be off the server's clock.
pub const LEEWAY_S: u64 = 60;
/// The shortest time between two fetches of a provider's keys.
const REFETCH: Duration = Duration::from_secs(10);

/// The providers' settings (`gpuflow server --oidc-config FILE`, YAML).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    pub providers: Vec<ProviderSettings>,
}

/// One identity provider.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSettings {
    /// Its name here (users' `identity.provider`).
    pub name: String,
    /// Its issuer URL, exactly as its tokens say it.
    pub issuer: String,
    /// The client id gpuflow is registered under (a public client): the
    /// audience its ID tokens must name.
    pub client_id: String,
    /// The scopes clients ask for (default `openid`).
    #[serde(default = "default_scopes")]
    pub scopes: String,
    /// The claim that names the user (default `preferred_username`).
    #[serde(default = "default_username_claim")]
    pub username_claim: String,
    /// The claim that lists the user's groups (default `groups`).
    #[serde(default = "default_groups_claim")]
    pub groups_claim: String,
    /// Seconds a session goes before the user's groups are read again
    /// from the provider (renewing its sign-in there; default 300).
    #[serde(default = "default_recheck")]
    pub recheck_s: u64,
    /// Groups to teams and roles: a user gets the highest role any of
    /// their groups is given (the first such rule names the team).
    #[serde(default)]
    pub rules: Vec<Rule>,
}

fn default_scopes() -> String {
    "openid".into()
}

fn default_username_claim() -> String {
    "preferred_username".into()
}

fn default_recheck() -> u64 {
    300
}

fn default_groups_claim() -> String {
    "groups".into()
}

/// A group's members get `role` in `team` (none for admins).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub group: String,
    #[serde(default)]
    pub team: String,
    pub role: Role,
}

impl Settings {
    /// The settings in `text`, checked.
    ///
    /// # Errors
    /// What is wrong, naming the provider and field.
    pub fn parse(text: &str) -> Result<Settings, String> {
        let s: Settings = serde_norway::from_str(text).map_err(|e| e.to_string())?;
        for p in &s.providers {
            if !gpuflow_api::valid_name(&p.name) {
                return Err(format!(
                    "provider {:?}: name: lowercase letters, digits, '.', '_', '-'",
                    p.name
                ));
            }
            if !(p.issuer.starts_with("https://") || p.issuer.starts_with("http://")) {
                return Err(format!(
                    "provider {}: issuer {:?} is not a URL",
                    p.name, p.issuer
                ));
            }
            if p.client_id.is_empty() {
                return Err(format!("provider {}: client_id is empty", p.name));
            }
            for r in &p.rules {
                match r.role {
                    Role::Admin if !r.team.is_empty() => {
                        return Err(format!(
                            "provider {}: the rule for group {:?} makes admins, who belong to no team: leave team out",
                            p.name, r.group
                        ));
                    }
                    Role::Admin => {}
                    _ if r.team.is_empty() => {
                        return Err(format!(
                            "provider {}: the rule for group {:?} names no team",
                            p.name, r.group
                        ));
                    }
                    _ => {}
                }
            }
        }
        let mut names: Vec<&str> = s.providers.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        if names.windows(2).any(|w| w[0] == w[1]) {
            return Err("two providers share a name".into());
        }
        Ok(s)
    }
}

/// A provider's discovered endpoints and keys.
#[derive(Default)]
struct Keys {
    disco: Option<Disco>,
    set: Option<JwkSet>,
    fetched: Option<Instant>,
}

/// What a provider's discovery document says, of what the server uses.
#[derive(Clone, Debug, Default)]
struct Disco {
    jwks_uri: String,
    authorization_endpoint: Option<String>,
    token_endpoint: String,
    userinfo_endpoint: Option<String>,
}

/// Why a session was not renewed at its provider.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenewError {
    /// The provider could not be asked (not reached, or its discovery
    /// document could not be read): the session goes on as it was and is
    /// tried again later.
    #[error("cannot reach the provider: {0}")]
    Unreachable(String),
    /// The provider no longer renews it, or renewed it with what cannot be
    /// used: the session ends.
    #[error("{0}")]
    Refused(String),
}

/// A session renewed at its provider: the user's claims now.
#[derive(Clone, Debug, PartialEq)]
pub struct Renewed {
    pub username: String,
    pub groups: Vec<String>,
    /// The provider's new refresh token, when it rolls them.
    pub refresh_token: Option<String>,
}

/// One blocking HTTP agent for a provider's endpoints.
fn http() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .new_agent()
}

struct Provider {
    cfg: ProviderSettings,
    keys: Mutex<Keys>,
}

/// The providers the server trusts.
#[derive(Default)]
pub struct Oidc {
    providers: Vec<Provider>,
    /// Authorization codes taken, by SHA-256, with when: each is taken
    /// once (kept [`CODE_KEPT`]).
    codes: Mutex<BTreeMap<String, Instant>>,
}

/// How long a taken authorization code is remembered (codes live minutes).
const CODE_KEPT: Duration = Duration::from_secs(3600);

/// A checked ID token: who, by which provider, and until when.
#[derive(Clone, Debug, PartialEq)]
pub struct Identity {
    pub provider: String,
    pub subject: String,
    pub username: String,
    pub groups: Vec<String>,
    /// When the user authenticated (`auth_time`, else `iat`).
    pub auth_time: u64,
    pub expires_at: u64,
    /// The nonce of the sign-in it answers, if any.
    pub nonce: Option<String>,
}

/// A refusal: 401 with what happened.
fn refused(code: &str, msg: String) -> ApiError {
    ApiError::new(401, code, msg)
}

impl Oidc {
    pub fn new(s: &Settings) -> Oidc {
        Oidc {
            providers: s
                .providers
                .iter()
                .map(|p| Provider {
                    cfg: p.clone(),
                    keys: Mutex::new(Keys::default()),
                })
                .collect(),
            codes: Mutex::default(),
        }
    }

    /// How often `provider`'s sessions are checked again, seconds.
    pub fn recheck_s(&self, provider: &str) -> u64 {
        self.providers
            .iter()
            .find(|p| p.cfg.name == provider)
            .map_or(0, |p| p.cfg.recheck_s)
    }

    pub fn enabled(&self) -> bool {
        !self.providers.is_empty()
    }

    /// The providers, as clients see them. Blocking (reads their
    /// discovery documents once).
    pub fn public(&self) -> Vec<gpuflow_api::OidcProvider> {
        self.providers
            .iter()
            .map(|p| gpuflow_api::OidcProvider {
                name: p.cfg.name.clone(),
                issuer: p.cfg.issuer.clone(),
                client_id: p.cfg.client_id.clone(),
                scopes: p.cfg.scopes.clone(),
                authorization_endpoint: p.disco().ok().and_then(|d| d.authorization_endpoint),
            })
            .collect()
    }

    /// A browser's authorization code exchanged at `provider` (PKCE): its
    /// ID token, checked, with the nonce the browser sent, and its refresh
    /// token. Blocking.
    ///
    /// # Errors
    /// A code taken before (401 `code_replayed`), a provider that refuses
    /// the code, an ID token that fails the checks or carries another nonce.
    pub fn exchange(
        &self,
        r: &gpuflow_api::CodeRequest,
        now: u64,
    ) -> Result<(Identity, Option<String>), ApiError> {
        let key = crate::secret::hash(&r.code);
        {
            let mut codes = self
                .codes
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            codes.retain(|_, t| t.elapsed() < CODE_KEPT);
            if codes.insert(key, Instant::now()).is_some() {
                return Err(refused(
                    "code_replayed",
                    "this authorization code was already used: sign in again".into(),
                ));
            }
        }
        let p = self
            .providers
            .iter()
            .find(|p| p.cfg.name == r.provider)
            .ok_or_else(|| {
                ApiError::bad_request("unknown_provider", format!("no provider {:?}", r.provider))
            })?;
        let d = p
            .disco()
            .map_err(|e| ApiError::new(503, "oidc_unreachable", e))?;
        let mut resp = http()
            .post(&d.token_endpoint)
            .send_form([
                ("grant_type", "authorization_code"),
                ("code", r.code.as_str()),
                ("redirect_uri", r.redirect_uri.as_str()),
                ("code_verifier", r.code_verifier.as_str()),
                ("client_id", p.cfg.client_id.as_str()),
            ])
            .map_err(|e| {
                ApiError::new(
                    503,
                    "oidc_unreachable",
                    format!("cannot reach {}: {e}", d.token_endpoint),
                )
            })?;
        let status = resp.status().as_u16();
        let t: serde_json::Value = resp.body_mut().read_json().unwrap_or_default();
        let Some(id_token) = t["id_token"].as_str().filter(|_| status == 200) else {
            return Err(refused(
                "code_refused",
                format!(
                    "{} refused the authorization code ({}): sign in again",
                    p.cfg.name,
                    t["error"].as_str().unwrap_or("no ID token")
                ),
            ));
        };
        let id = self.verify(id_token, now)?;
        if id.nonce.as_deref() != Some(r.nonce.as_str()) || r.nonce.is_empty() {
            return Err(refused(
                "oidc_nonce",
                "the ID token does not carry the nonce this sign-in sent: it belongs to another sign-in".into(),
            ));
        }
        Ok((id, t["refresh_token"].as_str().map(str::to_string)))
    }

    /// The team and role `id`'s groups give by its provider's rules.
    ///
    /// # Errors
    /// 403 when none of its groups has a rule.
    pub fn role_of(&self, id: &Identity) -> Result<(String, Role), ApiError> {
        let rank = |r: Role| match r {
            Role::Admin => 3,
            Role::TeamLead => 2,
            Role::Member => 1,
            Role::Viewer => 0,
        };
        let p = self
            .providers
            .iter()
            .find(|p| p.cfg.name == id.provider)
            .ok_or_else(|| ApiError::forbidden("the provider is no longer configured"))?;
        let mut best: Option<&Rule> = None;
        for r in p.cfg.rules.iter().filter(|r| id.groups.contains(&r.group)) {
            if best.is_none_or(|b| rank(r.role) > rank(b.role)) {
                best = Some(r);
            }
        }
        best.map(|r| (r.team.clone(), r.role)).ok_or_else(|| {
            ApiError::forbidden(format!(
                "signed in as {} through {}, but none of your groups ({}) is given a team or role here: ask an admin to add a rule to the server's OIDC settings",
                id.username,
                id.provider,
                if id.groups.is_empty() {
                    "none".to_string()
                } else {
                    id.groups.join(", ")
                }
            ))
        })
    }

    /// The claims of `subject`'s session at `provider` now, renewed with
    /// its refresh token. Blocking.
    ///
    /// # Errors
    /// Why the provider no longer renews it, in words.
    pub fn renew(
        &self,
        provider: &str,
        subject: &str,
        refresh_token: &str,
        now: u64,
    ) -> Result<Renewed, RenewError> {
        let p = self
            .providers
            .iter()
            .find(|p| p.cfg.name == provider)
            .ok_or_else(|| {
                RenewError::Refused(format!("provider {provider} is no longer configured"))
            })?;
        p.renew(subject, refresh_token, now, self)
    }

    /// Checks an ID token. Blocking (it may fetch the provider's keys):
    /// call it off the async threads.
    ///
    /// # Errors
    /// A 401 that says what is wrong: malformed, an issuer not trusted, an
    /// algorithm not allowed, a key the provider does not publish, a bad
    /// signature, another audience, expired (when), not valid yet or
    /// issued in the future (clock skew), no user name.
    pub fn verify(&self, token: &str, now: u64) -> Result<Identity, ApiError> {
        let header = jsonwebtoken::decode_header(token).map_err(|e| {
            refused(
                "oidc_malformed",
                format!("the bearer token is not a signed JWT this server accepts ({e}); `alg: none` and unsigned tokens are refused"),
            )
        })?;
        // The issuer, read before the signature is checked, only to pick
        // the provider whose keys then check it.
        let iss = unverified(token)
            .map_err(|e| {
                refused(
                    "oidc_malformed",
                    format!("the token's claims cannot be read: {e}"),
                )
            })?
            .get("iss")
            .and_then(|i| i.as_str())
            .unwrap_or_default()
            .to_string();
        let p = self
            .providers
            .iter()
            .find(|p| p.cfg.issuer == iss)
            .ok_or_else(|| {
                refused(
                    "oidc_issuer",
                    format!(
                        "the token was issued by {iss:?}, which this server does not trust (it trusts {})",
                        self.providers
                            .iter()
                            .map(|p| p.cfg.issuer.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
            })?;
        if matches!(
            header.alg,
            Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512
        ) {
            return Err(refused(
                "oidc_algorithm",
                format!(
                    "the token is signed with {:?}, a shared-secret algorithm: only the provider's published keys are accepted",
                    header.alg
                ),
            ));
        }
        let key = p.key(header.kid.as_deref(), header.alg)?;
        let mut v = Validation::new(header.alg);
        v.set_issuer(&[p.cfg.issuer.as_str()]);
        v.set_audience(&[p.cfg.client_id.as_str()]);
        // Times are checked below, against the server's clock as given.
        v.validate_exp = false;
        v.validate_nbf = false;
        v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        let data = jsonwebtoken::decode::<BTreeMap<String, serde_json::Value>>(token, &key, &v);
        let claims = match data {
            Ok(d) => d.claims,
            Err(e) => return Err(p.explain(token, &e)),
        };
        let num = |k: &str| claims.get(k).and_then(serde_json::Value::as_u64);
        let exp = num("exp").unwrap_or(0);
        if exp + LEEWAY_S < now {
            return Err(refused(
                "oidc_expired",
                format!(
                    "the ID token expired at {} ({} ago): sign in again (`gpuflow login`)",
                    crate::when(exp),
                    humantime::format_duration(Duration::from_secs(now - exp))
                ),
            ));
        }
        if let Some(nbf) = num("nbf")
            && nbf > now + LEEWAY_S
        {
            return Err(refused(
                "oidc_clock_skew",
                format!(
                    "the token is not valid until {} s from now by this server's clock: the clocks of the server and {} disagree",
                    nbf - now,
                    p.cfg.name
                ),
            ));
        }
        if let Some(iat) = num("iat")
            && iat > now + LEEWAY_S
        {
            return Err(refused(
                "oidc_clock_skew",
                format!(
                    "the token was issued {} s in the future by this server's clock: the clocks of the server and {} disagree",
                    iat - now,
                    p.cfg.name
                ),
            ));
        }
        let subject = claims
            .get("sub")
            .and_then(|s| s.as_str())
            .unwrap_or_default()
            .to_string();
        let (username, groups) = p.user_of(&claims)?;
        Ok(Identity {
            provider: p.cfg.name.clone(),
            subject,
            username,
            groups,
            auth_time: num("auth_time").or(num("iat")).unwrap_or(0),
            expires_at: num("exp").unwrap_or(0),
            nonce: claims
                .get("nonce")
                .and_then(|n| n.as_str())
                .map(str::to_string),
        })
    }
}

impl Provider {
    /// The user name and groups `claims` give.
    fn user_of(
        &self,
        claims: &BTreeMap<String, serde_json::Value>,
    ) -> Result<(String, Vec<String>), ApiError> {
        let username = claims
            .get(&self.cfg.username_claim)
            .and_then(|s| s.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                refused(
                    "oidc_claims",
                    format!(
                        "the token has no {:?} claim to name the user by: configure the provider to send it, or set username_claim",
                        self.cfg.username_claim
                    ),
                )
            })?;
        if !gpuflow_api::valid_name(&username) {
            return Err(refused(
                "oidc_claims",
                format!(
                    "the user name {username:?} from the token is not one gpuflow can use (lowercase letters, digits, '.', '_', '-')"
                ),
            ));
        }
        let groups = match claims.get(&self.cfg.groups_claim) {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|g| g.as_str().map(str::to_string))
                .collect(),
            Some(serde_json::Value::String(s)) => s
                .split([',', ' '])
                .filter(|g| !g.is_empty())
                .map(str::to_string)
                .collect(),
            _ => Vec::new(),
        };
        Ok((username, groups))
    }

    /// The discovery document's endpoints (read once).
    fn disco(&self) -> Result<Disco, String> {
        // Read without the lock held: a slow provider must not stall the
        // checks of tokens whose keys are known.
        if let Some(d) = &self
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .disco
        {
            return Ok(d.clone());
        }
        let url = format!(
            "{}/.well-known/openid-configuration",
            self.cfg.issuer.trim_end_matches('/')
        );
        let d = get_json(&url)?;
        if d["issuer"].as_str() != Some(self.cfg.issuer.as_str()) {
            return Err(format!(
                "{url} names issuer {}, not {}",
                d["issuer"], self.cfg.issuer
            ));
        }
        let s = |k: &str| d[k].as_str().map(str::to_string);
        let disco = Disco {
            jwks_uri: s("jwks_uri").ok_or_else(|| format!("{url} has no jwks_uri"))?,
            authorization_endpoint: s("authorization_endpoint"),
            token_endpoint: s("token_endpoint")
                .ok_or_else(|| format!("{url} has no token_endpoint"))?,
            userinfo_endpoint: s("userinfo_endpoint"),
        };
        self.keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .disco = Some(disco.clone());
        Ok(disco)
    }

    /// The user's claims now: the session's refresh token renewed at the
    /// provider, then its new ID token or, where it gives none, its
    /// user-info endpoint read with the new access token.
    fn renew(
        &self,
        subject: &str,
        refresh_token: &str,
        now: u64,
        oidc: &Oidc,
    ) -> Result<Renewed, RenewError> {
        use RenewError::{Refused, Unreachable};
        let d = self.disco().map_err(Unreachable)?;
        let mut resp = http()
            .post(&d.token_endpoint)
            .send_form([
                ("grant_type", "refresh_token"),
                ("refresh_token", refresh_token),
                ("client_id", self.cfg.client_id.as_str()),
            ])
            .map_err(|e| Unreachable(format!("{}: {e}", d.token_endpoint)))?;
        let status = resp.status().as_u16();
        let t: serde_json::Value = resp.body_mut().read_json().unwrap_or_default();
        if status != 200 {
            return Err(Refused(format!(
                "{} no longer renews the sign-in ({})",
                self.cfg.name,
                t["error"].as_str().unwrap_or("refused")
            )));
        }
        let next = t["refresh_token"].as_str().map(str::to_string);
        if let Some(id) = t["id_token"].as_str() {
            let id = oidc.verify(id, now).map_err(|e| Refused(e.message))?;
            if id.subject != subject {
                return Err(Refused("the renewed ID token names another subject".into()));
            }
            return Ok(Renewed {
                username: id.username,
                groups: id.groups,
                refresh_token: next,
            });
        }
        let (Some(at), Some(ui)) = (t["access_token"].as_str(), d.userinfo_endpoint.as_deref())
        else {
            return Err(Refused(format!(
                "{} renewed the sign-in without an ID token or a user-info endpoint to read the groups from",
                self.cfg.name
            )));
        };
        let mut resp = http()
            .get(ui)
            .header("Authorization", &format!("Bearer {at}"))
            .call()
            .map_err(|e| Unreachable(format!("{ui}: {e}")))?;
        if resp.status().as_u16() != 200 {
            return Err(Refused(format!(
                "{ui} answered HTTP {}",
                resp.status().as_u16()
            )));
        }
        let claims: BTreeMap<String, serde_json::Value> = resp
            .body_mut()
            .read_json()
            .map_err(|e| Refused(format!("{ui}: {e}")))?;
        if claims.get("sub").and_then(|s| s.as_str()) != Some(subject) {
            return Err(Refused(format!("{ui} names another subject")));
        }
        let (username, groups) = self.user_of(&claims).map_err(|e| Refused(e.message))?;
        Ok(Renewed {
            username,
            groups,
            refresh_token: next,
        })
    }

    /// The published key `kid` names, fetching the keys again (at most
    /// every [`REFETCH`]) when it is not among those known.
    fn key(&self, kid: Option<&str>, alg: Algorithm) -> Result<DecodingKey, ApiError> {
        let mut keys = self
            .keys
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let find = |set: &JwkSet| -> Option<DecodingKey> {
            let jwk = match kid {
                Some(k) => set.find(k)?,
                // No kid: the only key, if there is one.
                None if set.keys.len() == 1 => &set.keys[0],
                None => return None,
            };
            DecodingKey::from_jwk(jwk).ok()
        };
        if let Some(k) = keys.set.as_ref().and_then(find) {
            return Ok(k);
        }
        if keys.fetched.is_none_or(|t| t.elapsed() >= REFETCH) {
            keys.fetched = Some(Instant::now());
            drop(keys);
            let fetched = self.fetch();
            keys = self
                .keys
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match fetched {
                Ok(set) => keys.set = Some(set),
                Err(e) => {
                    return Err(ApiError::new(
                        503,
                        "oidc_unreachable",
                        format!("cannot read {}'s keys: {e}", self.cfg.name),
                    ));
                }
            }
        }
        keys.set.as_ref().and_then(find).ok_or_else(|| {
            refused(
                "oidc_key",
                format!(
                    "the token is signed ({alg:?}) with a key {} does not publish (kid {}): sign in again",
                    self.cfg.name,
                    kid.unwrap_or("none")
                ),
            )
        })
    }

    /// The keys at the discovery document's `jwks_uri`.
    fn fetch(&self) -> Result<JwkSet, String> {
        let uri = self.disco()?.jwks_uri;
        serde_json::from_value(get_json(&uri)?).map_err(|e| format!("{uri}: {e}"))
    }

    /// What a token that failed the checks did wrong, in words.
    fn explain(&self, token: &str, e: &jsonwebtoken::errors::Error) -> ApiError {
        use jsonwebtoken::errors::ErrorKind as K;
        // The claims, read again without the checks, for the figures.
        let claims = unverified(token).unwrap_or_default();
        match e.kind() {
            K::InvalidAudience => refused(
                "oidc_audience",
                format!(
                    "the token is for {}, not for this server's client {:?}",
                    claims.get("aud").map_or("nobody".into(), |a| a.to_string()),
                    self.cfg.client_id
                ),
            ),
            K::InvalidIssuer => refused("oidc_issuer", "the token's issuer is not trusted".into()),
            K::InvalidSignature => refused(
                "oidc_signature",
                format!(
                    "the token's signature does not match {}'s key: it was altered or signed by someone else",
                    self.cfg.name
                ),
            ),
            K::MissingRequiredClaim(c) => {
                refused("oidc_claims", format!("the token has no {c:?} claim"))
            }
            _ => refused("oidc_malformed", format!("the token is not valid: {e}")),
        }
    }
}

/// A token's claims, read without any check: only to choose the provider
/// whose keys then check it, or to say what a refused one claimed.
fn unverified(token: &str) -> jsonwebtoken::errors::Result<BTreeMap<String, serde_json::Value>> {
    let mut v = Validation::new(Algorithm::ES256);
    v.insecure_disable_signature_validation();
    v.validate_exp = false;
    v.validate_aud = false;
    v.required_spec_claims.clear();
    jsonwebtoken::decode(token, &DecodingKey::from_secret(&[]), &v).map(|d| d.claims)
}

/// A JSON document by GET.
fn get_json(url: &str) -> Result<serde_json::Value, String> {
    let mut resp = http().get(url).call().map_err(|e| format!("{url}: {e}"))?;
    if resp.status().as_u16() != 200 {
        return Err(format!("{url} answered HTTP {}", resp.status().as_u16()));
    }
    resp.body_mut()
        .read_json()
        .map_err(|e| format!("{url}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;
    use jsonwebtoken::{EncodingKey, Header};

    const ISS: &str = "https://idp.example/realm";
    const NOW: u64 = 1_800_000_000;

    /// A P-256 key: its signer and its public JWK under `kid`.
    fn key(kid: &str) -> (EncodingKey, serde_json::Value) {
        let kp = rcgen::KeyPair::generate().unwrap();
        let raw = kp.public_key_raw();
        let b64 = |b: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b);
        let jwk = serde_json::json!({"kty": "EC", "crv": "P-256", "alg": "ES256", "kid": kid,
            "x": b64(&raw[1..33]), "y": b64(&raw[33..65])});
        (EncodingKey::from_ec_der(&kp.serialize_der()), jwk)
    }

    /// A provider trusting `jwks`, its keys already fetched (no refetch).
    fn oidc(jwks: Vec<serde_json::Value>) -> Oidc {
        let s = Settings::parse(&format!(
            "providers:\n- name: corp\n  issuer: {ISS}\n  client_id: gpuflow\n  rules:\n  - {{group: ml, team: ml, role: member}}\n"
        ))
        .unwrap();
        let o = Oidc::new(&s);
        {
            let mut k = o.providers[0].keys.lock().unwrap();
            k.set = Some(serde_json::from_value(serde_json::json!({"keys": jwks})).unwrap());
            k.fetched = Some(Instant::now());
        }
        o
    }

    /// A provider that cannot be reached, whose discovery document the
    /// server has not read yet (as after a restart): a session's renewal
    /// is "could not ask", which keeps the session, not "refused", which
    /// would end every session due for a recheck during an outage.
    #[test]
    fn a_provider_that_cannot_be_reached_does_not_refuse_a_renewal() {
        let s = Settings::parse(
            "providers:\n- name: corp\n  issuer: http://127.0.0.1:1/realm\n  client_id: gpuflow\n  rules:\n  - {group: ml, team: ml, role: member}\n",
        )
        .unwrap();
        let o = Oidc::new(&s);
        let e = o.renew("corp", "s-1", "rt", NOW).unwrap_err();
        assert!(matches!(e, RenewError::Unreachable(_)), "{e}");
    }

    fn claims(over: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({"iss": ISS, "aud": "gpuflow", "sub": "s-1",
            "preferred_username": "ann", "groups": ["ml"], "iat": NOW, "exp": NOW + 300});
        for (k, v) in over.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    }

    fn sign(k: &EncodingKey, kid: &str, c: &serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = Some(kid.into());
        jsonwebtoken::encode(&h, c, k).unwrap()
    }

    fn code(o: &Oidc, token: &str) -> String {
        o.verify(token, NOW)
            .map(|_| String::new())
            .unwrap_or_else(|e| {
                assert_eq!(e.status, 401, "{e:?}");
                e.code
            })
    }

    #[test]
    fn an_id_token_is_checked_for_everything_it_claims() {
        let (k1, jwk1) = key("k1");
        let o = oidc(vec![jwk1]);
        let id = o
            .verify(&sign(&k1, "k1", &claims(serde_json::json!({}))), NOW)
            .unwrap();
        assert_eq!(
            (id.username.as_str(), id.groups.clone()),
            ("ann", vec!["ml".to_string()])
        );
        assert_eq!(o.role_of(&id).unwrap(), ("ml".to_string(), Role::Member));
        // Another issuer, another audience, expired, not yet valid, issued
        // in the future, no user name.
        let cases = [
            (
                serde_json::json!({"iss": "https://evil.example"}),
                "oidc_issuer",
            ),
            (serde_json::json!({"aud": "someone-else"}), "oidc_audience"),
            (serde_json::json!({"exp": NOW - 61}), "oidc_expired"),
            (serde_json::json!({"nbf": NOW + 120}), "oidc_clock_skew"),
            (serde_json::json!({"iat": NOW + 120}), "oidc_clock_skew"),
            (
                serde_json::json!({"preferred_username": null}),
                "oidc_claims",
            ),
        ];
        for (over, want) in cases {
            assert_eq!(
                code(&o, &sign(&k1, "k1", &claims(over.clone()))),
                want,
                "{over}"
            );
        }
        // Within the leeway: still good.
        assert_eq!(
            code(
                &o,
                &sign(&k1, "k1", &claims(serde_json::json!({"exp": NOW - 30})))
            ),
            ""
        );
        // Expired says when.
        let e = o
            .verify(
                &sign(&k1, "k1", &claims(serde_json::json!({"exp": NOW - 3600}))),
                NOW,
            )
            .unwrap_err();
        assert!(
            e.message.contains("expired at") && e.message.contains("1h ago"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_token_signed_by_anyone_but_the_provider_is_refused() {
        let (k1, jwk1) = key("k1");
        let (rogue, _) = key("rogue");
        let o = oidc(vec![jwk1]);
        let c = claims(serde_json::json!({}));
        // A key the provider does not publish; the provider's kid on
        // another key's signature; a shared secret; no signature at all.
        assert_eq!(code(&o, &sign(&rogue, "rogue", &c)), "oidc_key");
        assert_eq!(code(&o, &sign(&rogue, "k1", &c)), "oidc_signature");
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k1".into());
        let hs = jsonwebtoken::encode(&h, &c, &EncodingKey::from_secret(b"gpuflow")).unwrap();
        assert_eq!(code(&o, &hs), "oidc_algorithm");
        let b64 = |v: &serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
        };
        let none = format!("{}.{}.", b64(&serde_json::json!({"alg": "none"})), b64(&c));
        assert_eq!(code(&o, &none), "oidc_malformed");
        // A valid token, altered after signing.
        let good = sign(&k1, "k1", &c);
        let mut parts: Vec<&str> = good.split('.').collect();
        let evil = b64(&claims(serde_json::json!({"groups": ["admins"]})));
        parts[1] = &evil;
        assert_eq!(code(&o, &parts.join(".")), "oidc_signature");
    }

    #[test]
    fn groups_map_to_the_highest_role_and_no_group_is_refused() {
        let s = Settings::parse(&format!(
            "providers:\n- name: corp\n  issuer: {ISS}\n  client_id: gpuflow\n  rules:\n  - {{group: ml, team: ml, role: member}}\n  - {{group: ml-leads, team: ml, role: team-lead}}\n  - {{group: ops, role: admin}}\n"
        ))
        .unwrap();
        let o = Oidc::new(&s);
        let id = |groups: &[&str]| Identity {
            provider: "corp".into(),
            subject: "s".into(),
            username: "ann".into(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            auth_time: 0,
            expires_at: 0,
            nonce: None,
        };
        assert_eq!(
            o.role_of(&id(&["ml", "ml-leads"])).unwrap().1,
            Role::TeamLead
        );
        assert_eq!(
            o.role_of(&id(&["ml", "ops"])).unwrap(),
            (String::new(), Role::Admin)
        );
        let e = o.role_of(&id(&["sales"])).unwrap_err();
        assert!(e.status == 403 && e.message.contains("sales"), "{e:?}");
        // Settings that cannot work are refused at start.
        for bad in [
            "providers:\n- {name: c, issuer: idp, client_id: g}\n",
            "providers:\n- {name: c, issuer: 'https://i', client_id: ''}\n",
            "providers:\n- {name: c, issuer: 'https://i', client_id: g, rules: [{group: x, team: t, role: admin}]}\n",
            "providers:\n- {name: c, issuer: 'https://i', client_id: g, rules: [{group: x, role: member}]}\n",
            "providers:\n- {name: c, issuer: 'https://i', client_id: g, secret: x}\n",
        ] {
            assert!(Settings::parse(bad).is_err(), "{bad}");
        }
    }
}
