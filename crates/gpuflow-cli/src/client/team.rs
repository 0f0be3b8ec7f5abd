//! `gpuflow team`.

use super::*;

#[derive(Subcommand)]
pub(crate) enum TeamCmd {
    /// Teams and who their tasks run as.
    Ls,
    /// Create a team (admins).
    Create {
        name: String,
        /// The system user the team's tasks run as on agents running as
        /// root (never root); default: the agent's --run-as.
        #[arg(long)]
        run_as: Option<String>,
    },
    /// Change a team (admins): who its tasks run as from now on, where
    /// its images come from, whether it may run processes without one.
    Set {
        name: String,
        /// The system user; "" for the agents' default.
        #[arg(long)]
        run_as: Option<String>,
        /// Where its images may come from (an image prefix, repeatable;
        /// replaces the list; "" for anywhere).
        #[arg(long)]
        registry: Vec<String>,
        /// Whether its tasks may run without an image (true or false).
        #[arg(long)]
        processes: Option<bool>,
        /// The image its tasks without one run in ("" for none).
        #[arg(long)]
        default_image: Option<String>,
        /// A registry login, HOST=USER, its password read from the first
        /// line of stdin (never from the command line); HOST= removes it.
        #[arg(long)]
        registry_login: Option<String>,
        /// Whether its members act on each other's jobs (true or false;
        /// its leads may set this): by default each member cancels, holds
        /// or enters only their own.
        #[arg(long)]
        shared_control: Option<bool>,
    },
}

pub(crate) fn team(conn: &Conn, cmd: TeamCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        TeamCmd::Ls => {
            let v = c.call("GET", "/v1/teams", None)?;
            print_as(conn.output, "/v1/teams", v, |v: &Vec<api::Team>| {
                table(
                    !conn.no_headers,
                    &["name"],
                    v.iter().map(|t| vec![t.name.clone()]).collect(),
                )
            })?;
        }
        TeamCmd::Create { name, run_as } => {
            let mut body = serde_json::json!({ "name": name });
            if let Some(u) = run_as {
                body["run_as"] = u.into();
            }
            let v = c.call(
                "POST",
                "/v1/teams",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/teams", v, |t: &api::Team| {
                format!("team {} created\n", t.name)
            })?;
        }
        TeamCmd::Set {
            name,
            run_as,
            registry,
            processes,
            default_image,
            registry_login,
            shared_control,
        } => {
            let mut body = serde_json::json!({});
            if let Some(b) = shared_control {
                body["shared_control"] = Value::Bool(b);
            }
            if let Some(r) = run_as {
                body["run_as"] = Value::String(r);
            }
            if !registry.is_empty() {
                let list: Vec<String> = registry.into_iter().filter(|r| !r.is_empty()).collect();
                body["registries"] = serde_json::json!(list);
            }
            if let Some(p) = processes {
                body["processes"] = Value::Bool(p);
            }
            if let Some(i) = default_image {
                body["default_image"] = Value::String(i);
            }
            if let Some(login) = registry_login {
                let (host, user) = login.split_once('=').ok_or_else(|| {
                    Usage(format!(
                        "--registry-login {login:?}: give HOST=USER (HOST= removes the login)"
                    ))
                })?;
                let mut password = String::new();
                if !user.is_empty() {
                    std::io::stdin().read_line(&mut password)?;
                }
                body["registry_credentials"] = serde_json::json!({
                    host: {"username": user, "password": password.trim_end_matches(['\n', '\r'])}
                });
            }
            if body.as_object().is_some_and(serde_json::Map::is_empty) {
                return Err(Usage(
                    "nothing to change: give --run-as, --registry, --processes, --default-image, --registry-login or --shared-control".into(),
                )
                .into());
            }
            let v = c.call(
                "PATCH",
                &format!("/v1/teams/{name}"),
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/teams", v, |t: &api::Team| {
                format!(
                    "team {}: tasks run as {}; {}\n",
                    t.name,
                    t.run_as.as_deref().unwrap_or("the agents' default"),
                    if t.shared_control {
                        "members act on each other's jobs"
                    } else {
                        "members act on their own jobs only"
                    }
                )
            })?;
        }
    }
    Ok(())
}
