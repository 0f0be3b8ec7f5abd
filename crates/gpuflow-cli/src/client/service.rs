//! `gpuflow service`: inference services.

use super::*;

#[derive(Subcommand)]
pub(crate) enum ServiceCmd {
    /// Services with their size, ready replicas and version.
    Ls,
    /// Create a service from a YAML or JSON file.
    Create {
        /// The service spec, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// A service's replicas (node, port, ready) and endpoints.
    Get { name: String },
    /// Set a service's number of replicas (within its bounds).
    Scale { name: String, replicas: u32 },
    /// Roll out a new task from a YAML or JSON file (a task group spec),
    /// replacing replicas within the service's rollout bounds.
    Update {
        name: String,
        /// The new task, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Delete a service and stop its replicas.
    Delete { name: String },
}

pub(crate) fn service(conn: &Conn, cmd: ServiceCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let show = |v: &api::ServiceView| {
        let mut out = format!(
            "service {} of team {} in queue {}: {} of {} replicas ready, version {}\n",
            v.spec.name, v.team, v.spec.queue, v.ready, v.spec.replicas, v.version
        );
        let rows = v
            .members
            .iter()
            .map(|m| {
                vec![
                    m.job.to_string(),
                    m.version.to_string(),
                    m.state.as_str().to_string(),
                    m.node.clone().unwrap_or_else(|| "-".into()),
                    m.port.map_or_else(|| "-".into(), |p| p.to_string()),
                    if m.ready { "yes".into() } else { "no".into() },
                ]
            })
            .collect();
        out += &columns(&["job", "version", "state", "node", "port", "ready"], rows);
        out += &format!(
            "endpoints: {}\n",
            if v.endpoints.is_empty() {
                "none yet".into()
            } else {
                v.endpoints.join(" ")
            }
        );
        out
    };
    let patch = |name: &str, body: Value| -> anyhow::Result<Value> {
        c.call(
            "PATCH",
            &format!("/v1/services/{name}"),
            Some(("application/json", serde_json::to_vec(&body)?)),
        )
    };
    match cmd {
        ServiceCmd::Ls => {
            let v = c.call("GET", "/v1/services", None)?;
            print_as(
                conn.output,
                "/v1/services",
                v,
                |v: &Vec<api::ServiceView>| {
                    table(
                        !conn.no_headers,
                        &[
                            "name",
                            "team",
                            "queue",
                            "replicas",
                            "ready",
                            "version",
                            "endpoints",
                        ],
                        v.iter()
                            .map(|x| {
                                vec![
                                    x.spec.name.clone(),
                                    x.team.clone(),
                                    x.spec.queue.clone(),
                                    x.spec.replicas.to_string(),
                                    x.ready.to_string(),
                                    x.version.to_string(),
                                    if x.endpoints.is_empty() {
                                        "-".into()
                                    } else {
                                        x.endpoints.join(",")
                                    },
                                ]
                            })
                            .collect(),
                    )
                },
            )?;
        }
        ServiceCmd::Create { file } => {
            let v = c.call(
                "POST",
                "/v1/services",
                Some(("application/json", as_json(&file)?)),
            )?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Get { name } => {
            let v = c.call("GET", &format!("/v1/services/{name}"), None)?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Scale { name, replicas } => {
            let v = patch(&name, serde_json::json!({ "replicas": replicas }))?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Update { name, file } => {
            let task: Value = serde_json::from_slice(&as_json(&file)?)?;
            let v = patch(&name, serde_json::json!({ "task": task }))?;
            print_as(conn.output, "/v1/services", v, show)?;
        }
        ServiceCmd::Delete { name } => {
            c.call("DELETE", &format!("/v1/services/{name}"), None)?;
            if matches!(conn.output, Format::Table | Format::Wide) {
                println!("service {name} deleted; its replicas are stopping");
            }
        }
    }
    Ok(())
}
