//! `gpuflow reservation`.

use super::*;

#[derive(Subcommand)]
pub(crate) enum ReservationCmd {
    /// Reserve nodes for a window (admins): for teams or users, whose jobs
    /// ask for it with `job submit --reservation NAME`, or for maintenance
    /// (no job runs). Others' jobs run there before it only if they end
    /// before it starts.
    Create {
        name: String,
        /// When it opens (the forms of `event ls --since`; `now`).
        #[arg(long, default_value = "now")]
        start: String,
        /// When it closes (a time), or give --duration.
        #[arg(
            long,
            conflicts_with = "duration",
            required_unless_present = "duration"
        )]
        end: Option<String>,
        /// How long it lasts: 2h, 1d.
        #[arg(long, value_parser = duration_s)]
        duration: Option<u64>,
        /// These nodes, comma separated; or --count with --model.
        #[arg(long, value_delimiter = ',')]
        nodes: Vec<String>,
        /// That many nodes of --model, chosen at creation (fewest jobs first).
        #[arg(long, requires = "model", conflicts_with = "nodes")]
        count: Option<u32>,
        /// The GPU model of --count's nodes.
        #[arg(long, requires = "count")]
        model: Option<String>,
        /// For these teams' jobs.
        #[arg(long, value_delimiter = ',')]
        teams: Vec<String>,
        /// For these users' jobs.
        #[arg(long, value_delimiter = ',')]
        users: Vec<String>,
        /// A maintenance window: no job runs on its nodes.
        #[arg(long, conflicts_with_all = ["teams", "users"])]
        maintenance: bool,
    },
    /// Reservations, with their nodes and windows.
    Ls,
    /// Delete a reservation (admins).
    Rm { name: String },
}

pub(crate) fn reservation(conn: &Conn, cmd: ReservationCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        ReservationCmd::Create {
            name,
            start,
            end,
            duration,
            nodes,
            count,
            model,
            teams,
            users,
            maintenance,
        } => {
            let start = if start == "now" {
                unix_now()
            } else {
                time_arg(&start).map_err(Usage)?
            };
            let end = match (end, duration) {
                (Some(e), _) => time_arg(&e).map_err(Usage)?,
                (None, Some(d)) => start + d as i64,
                (None, None) => return Err(Usage("give --end or --duration".into()).into()),
            };
            let mut body = serde_json::json!({"name": name, "start": start.max(0), "end": end.max(0),
                "teams": teams, "users": users, "maintenance": maintenance});
            if !nodes.is_empty() {
                body["nodes"] = nodes.into();
            }
            if let (Some(n), Some(m)) = (count, model) {
                body["count"] = n.into();
                body["model"] = m.into();
            }
            let v = c.call(
                "POST",
                "/v1/reservations",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(
                conn.output,
                "/v1/reservations",
                v,
                |r: &api::Reservation| {
                    format!(
                        "reservation {} on {}, {} to {}\n",
                        r.name,
                        r.nodes.join(","),
                        local_at(r.start),
                        local_at(r.end)
                    )
                },
            )?;
        }
        ReservationCmd::Ls => {
            let v = c.call("GET", "/v1/reservations", None)?;
            print_as(
                conn.output,
                "/v1/reservations",
                v,
                |v: &Vec<api::Reservation>| {
                    let rows = v
                        .iter()
                        .map(|r| {
                            let state = match (r.start as i64, r.end as i64) {
                                (_, e) if e <= unix_now() => "ended",
                                (st, _) if st > unix_now() => "upcoming",
                                _ => "open",
                            };
                            let who = if r.maintenance {
                                "maintenance".to_string()
                            } else {
                                [r.teams.join(","), r.users.join(",")]
                                    .into_iter()
                                    .filter(|x| !x.is_empty())
                                    .collect::<Vec<_>>()
                                    .join(" ")
                            };
                            vec![
                                r.name.clone(),
                                state.into(),
                                local_at(r.start),
                                local_at(r.end),
                                r.nodes.join(","),
                                who,
                            ]
                        })
                        .collect();
                    table(
                        !conn.no_headers,
                        &["name", "state", "start", "end", "nodes", "for"],
                        rows,
                    )
                },
            )?;
        }
        ReservationCmd::Rm { name } => {
            c.call(
                "DELETE",
                &format!("/v1/reservations/{}", urlencoding_path(&name)),
                None,
            )?;
            if matches!(conn.output, Format::Table | Format::Wide) {
                println!("reservation {name} deleted");
            }
        }
    }
    Ok(())
}
