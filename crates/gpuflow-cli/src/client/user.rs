//! `gpuflow user`, `gpuflow token` and `gpuflow whoami`.

use super::*;

#[derive(Subcommand)]
pub(crate) enum UserCmd {
    /// Users you may see, with their teams and roles.
    Ls,
    /// Create a user (admins; team leads for their team); then give them a
    /// token with `gpuflow token create`.
    Create {
        name: String,
        #[arg(long, default_value = "")]
        team: String,
        #[arg(long, value_parser = ["admin", "team-lead", "member", "viewer"])]
        role: String,
    },
    /// Disable a user: every token of theirs is refused at once, until
    /// `gpuflow user enable` (admins; team leads for their team's members
    /// and viewers).
    Disable { name: String },
    /// Enable a disabled user again.
    Enable { name: String },
    /// End the user's sign-ins through identity providers: each made until
    /// now is refused, and they sign in again (yourself; admins; team
    /// leads for their team's members and viewers).
    Signout { name: String },
}

#[derive(Subcommand)]
pub(crate) enum TokenCmd {
    /// Create a token for a user; it is printed once.
    Create {
        user: String,
        /// The token stops working after this long (e.g. 90d, 12h, 3600s).
        #[arg(long, value_parser = humantime::parse_duration)]
        expires_in: Option<std::time::Duration>,
    },
    /// The live tokens you manage: ids, users, when made and when they expire.
    Ls,
    /// Revoke a token by its id (from `token ls`).
    Revoke { id: String },
}

pub(crate) fn user(conn: &Conn, cmd: UserCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let cmd_kind = match &cmd {
        UserCmd::Disable { .. } => "disable",
        _ => "other",
    };
    match cmd {
        UserCmd::Ls => {
            let v = c.call("GET", "/v1/users", None)?;
            print_as(conn.output, "/v1/users", v, |v: &Vec<api::User>| {
                table(
                    !conn.no_headers,
                    &["name", "team", "role", "state"],
                    v.iter()
                        .map(|u| {
                            let state = if u.disabled { "disabled" } else { "enabled" };
                            vec![
                                u.name.clone(),
                                u.team.clone(),
                                u.role.as_str().to_string(),
                                state.into(),
                            ]
                        })
                        .collect(),
                )
            })?;
        }
        UserCmd::Create { name, team, role } => {
            let body = serde_json::json!({"name": name, "team": team, "role": role});
            let v = c.call(
                "POST",
                "/v1/users",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/users", v, |u: &api::User| {
                format!("user {} ({}) created\n", u.name, u.role.as_str())
            })?;
        }
        UserCmd::Disable { name } | UserCmd::Enable { name } => {
            let verb = if matches!(cmd_kind, "disable") {
                "disable"
            } else {
                "enable"
            };
            let v = c.call("POST", &format!("/v1/users/{name}/{verb}"), None)?;
            print_as(conn.output, "/v1/users", v, |u: &api::User| {
                format!("user {} {verb}d\n", u.name)
            })?;
        }
        UserCmd::Signout { name } => {
            let v = c.call("POST", &format!("/v1/users/{name}/signout"), None)?;
            print_as(conn.output, "/v1/users", v, |u: &api::User| {
                format!(
                    "user {}: sign-ins until now are refused; they sign in again\n",
                    u.name
                )
            })?;
        }
    }
    Ok(())
}

pub(crate) fn token(conn: &Conn, cmd: TokenCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        TokenCmd::Create { user, expires_in } => {
            let mut body = serde_json::json!({ "user": user });
            if let Some(d) = expires_in {
                body["expires_in_s"] = d.as_secs().max(1).into();
            }
            let v = c.call(
                "POST",
                "/v1/tokens",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/tokens", v, |t: &api::TokenCreated| {
                format!("{}\n", t.token)
            })?;
        }
        TokenCmd::Ls => {
            let v = c.call("GET", "/v1/tokens", None)?;
            print_as(conn.output, "/v1/tokens", v, |v: &Vec<api::TokenView>| {
                table(
                    !conn.no_headers,
                    &["id", "user", "created", "expires"],
                    v.iter()
                        .map(|t| {
                            vec![
                                t.id.clone(),
                                t.user.clone(),
                                local_at(t.created_at),
                                t.expires_at.map_or_else(|| "never".into(), local_at),
                            ]
                        })
                        .collect(),
                )
            })?;
        }
        TokenCmd::Revoke { id } => {
            c.call("DELETE", &format!("/v1/tokens/{id}"), None)?;
            if matches!(conn.output, Format::Table) {
                println!("token {id} revoked");
            }
        }
    }
    Ok(())
}

/// `gpuflow whoami`.
///
/// # Errors
/// A server that cannot be reached, or refuses the token.
pub(crate) fn whoami(conn: &Conn) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let v = c.call("GET", "/v1/whoami", None)?;
    let w: api::WhoAmI = serde_json::from_value(v.clone())
        .context("the server's whoami is not one this client reads")?;
    print(conn.output, &v, |_| {
        let expires = match w.expires_at {
            Some(t) => format!(
                "{} (in {})",
                local(&Value::from(t)),
                age_of(t as i64 - unix_now())
            ),
            None => "never (until revoked)".into(),
        };
        let team = if w.team.is_empty() {
            "-"
        } else {
            w.team.as_str()
        };
        let how = match &w.identity {
            Some(i) => format!(
                "through {} (OpenID Connect), subject {}",
                i.provider, i.subject
            ),
            None => format!("with token {}", w.token_id),
        };
        let mut out = format!(
            "user:        {}\nteam:        {team}\nrole:        {}\nsigned in:   {how}\nexpires:     {expires}\nserver:      {}\ncredentials: {}\n",
            w.user,
            w.role.as_str(),
            c.base(),
            c.token_from,
        );
        if let Some(ctx) = &c.context {
            out.push_str(&format!("context:     {ctx}\n"));
        }
        out
    });
    Ok(())
}
