//! `gpuflow project`.

use super::*;

#[derive(Subcommand)]
pub(crate) enum ProjectCmd {
    /// Projects with their cost centres and what is left of their budgets.
    Ls,
    /// Create a project of a team (admins; team leads for their team).
    Create {
        name: String,
        /// The team it belongs to.
        #[arg(long)]
        team: String,
        /// The finance cost centre its usage is reported under.
        #[arg(long, default_value = "")]
        cost_centre: String,
    },
    /// Give a project a budget per period, in GPU-hours or cost (admins):
    /// when spent, its jobs stop borrowing (or start no new work) in
    /// whichever queues they run, until the period renews.
    Budget {
        name: String,
        /// GPU-hours per period.
        #[arg(long, conflicts_with_all = ["cost", "clear"], required_unless_present_any = ["cost", "clear"])]
        gpu_hours: Option<f64>,
        /// Cost per period, at the prices (`gpuflow price ls`).
        #[arg(long, conflicts_with = "clear")]
        cost: Option<f64>,
        #[arg(long, value_parser = ["day", "week", "month"], default_value = "month")]
        period: String,
        #[arg(long, value_parser = ["stop-borrowing", "stop-admitting"], default_value = "stop-borrowing")]
        when_exhausted: String,
        /// Remove the project's budget.
        #[arg(long)]
        clear: bool,
    },
}

pub(crate) fn project(conn: &Conn, cmd: ProjectCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        ProjectCmd::Ls => {
            let v = c.call("GET", "/v1/projects", None)?;
            print_as(
                conn.output,
                "/v1/projects",
                v,
                |v: &Vec<api::ProjectView>| {
                    table(
                        !conn.no_headers,
                        &["name", "team", "cost centre", "budget left"],
                        v.iter()
                            .map(|p| {
                                let cc = &p.project.cost_centre;
                                vec![
                                    p.project.name.clone(),
                                    p.project.team.clone(),
                                    if cc.is_empty() {
                                        "-".into()
                                    } else {
                                        cc.clone()
                                    },
                                    budget_left(p.project.budget.as_ref(), p.budget_use.as_ref()),
                                ]
                            })
                            .collect(),
                    )
                },
            )?;
        }
        ProjectCmd::Create {
            name,
            team,
            cost_centre,
        } => {
            let body = serde_json::json!({"name": name, "team": team, "cost_centre": cost_centre});
            let v = c.call(
                "POST",
                "/v1/projects",
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/projects", v, |p: &api::ProjectView| {
                format!(
                    "project {} of team {} created\n",
                    p.project.name, p.project.team
                )
            })?;
        }
        ProjectCmd::Budget {
            name,
            gpu_hours,
            cost,
            period,
            when_exhausted,
            clear,
        } => {
            let budget = if clear {
                Value::Null
            } else {
                serde_json::json!({
                    "gpu_hours": gpu_hours, "cost": cost, "period": period,
                    "taper_from": 1.0, "when_exhausted": when_exhausted,
                })
            };
            let body = serde_json::json!({ "budget": budget });
            let v = c.call(
                "PATCH",
                &format!("/v1/projects/{name}"),
                Some(("application/json", serde_json::to_vec(&body)?)),
            )?;
            print_as(conn.output, "/v1/projects", v, |p: &api::ProjectView| {
                format!(
                    "project {}: budget {}\n",
                    p.project.name,
                    budget_left(p.project.budget.as_ref(), p.budget_use.as_ref())
                )
            })?;
        }
    }
    Ok(())
}
