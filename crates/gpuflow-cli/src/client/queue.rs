//! `gpuflow queue`: queues, their quotas and budgets.

use super::*;

// Parsed once per run: the size of the `set` variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum QueueCmd {
    /// Queues with their guarantees, borrow limits, use and budgets.
    Ls {
        #[command(flatten)]
        watch: Watch,
    },
    /// Create a queue from a YAML or JSON file.
    Create {
        /// The queue spec, YAML or JSON (`-`: stdin).
        #[arg(short = 'f', long)]
        file: PathBuf,
    },
    /// Change a queue.
    Set {
        name: String,
        /// Its fair-share weight.
        #[arg(long)]
        weight: Option<f64>,
        #[arg(long, value_parser = ["open", "held", "draining"])]
        state: Option<String>,
        /// Guarantees as FLAVOR=GPUS[,...] (admin), e.g. H100=8,*=2; the
        /// queue's other quota settings (borrow and lend limits, caps, other
        /// flavors) stay as they are.
        #[arg(long)]
        quota: Option<String>,
        /// How many GPUs beyond its guarantee it may borrow, as
        /// FLAVOR=GPUS[,...]; `none` for no limit (admin).
        #[arg(long)]
        borrow_limit: Option<String>,
        /// How many of its guaranteed GPUs others may borrow, as
        /// FLAVOR=GPUS[,...]; `none` for no limit (admin).
        #[arg(long)]
        lend_limit: Option<String>,
        /// The most GPUs it may use, as FLAVOR=GPUS[,...]; `none` for no
        /// cap (admin).
        #[arg(long)]
        cap: Option<String>,
        /// The most GPUs one user's jobs may hold at once (`none`: no limit).
        #[arg(long)]
        user_max_gpus: Option<String>,
        /// The most jobs one user may run at once (`none`: no limit).
        #[arg(long)]
        user_max_running: Option<String>,
        /// The longest a notebook may run here, e.g. 8h (admin).
        #[arg(long, value_parser = duration_s)]
        notebook_max_lifetime: Option<u64>,
        /// Notebooks whose GPUs idle this long (e.g. 30m) get the idle
        /// action (admin; with --notebook-idle-action).
        #[arg(long, value_parser = duration_s, requires = "notebook_idle_action")]
        notebook_idle_after: Option<u64>,
        /// What happens to an idle notebook.
        #[arg(long, value_parser = ["notify", "suspend", "requeue", "cancel"], requires = "notebook_idle_after")]
        notebook_idle_action: Option<String>,
        /// A budget of GPU-hours per --budget-period (admin).
        #[arg(long, conflicts_with = "budget_cost")]
        budget_gpu_hours: Option<f64>,
        /// A budget of cost per --budget-period, at the prices (admin).
        #[arg(long)]
        budget_cost: Option<f64>,
        #[arg(long, value_parser = ["day", "week", "month"], default_value = "month")]
        budget_period: String,
        /// When the budget is spent.
        #[arg(long, value_parser = ["stop-borrowing", "stop-admitting"], default_value = "stop-borrowing")]
        when_exhausted: String,
    },
    /// Delete a queue with no unfinished jobs.
    Delete { name: String },
}

pub(crate) fn queue(conn: &Conn, cmd: QueueCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    match cmd {
        QueueCmd::Ls { watch } => {
            watch.run(|| {
                let v = c.call("GET", "/v1/queues", None)?;
                print_as(
                    conn.output,
                    "/v1/queues",
                    v,
                    |queues: &Vec<api::QueueView>| {
                        let rows = queues
                            .iter()
                            .map(|q| {
                                let quotas = q
                                    .spec
                                    .quotas
                                    .iter()
                                    .map(|(f, x)| quota_text(f, x))
                                    .collect::<Vec<_>>()
                                    .join(" ");
                                let used = q
                                    .used
                                    .iter()
                                    .map(|(f, x)| format!("{f}:{}", Value::from(*x)))
                                    .collect::<Vec<_>>()
                                    .join(",");
                                let borrowers = q
                                    .borrowers
                                    .iter()
                                    .map(|b| {
                                        format!("{}:{}:{}", b.queue, b.flavor, Value::from(b.gpus))
                                    })
                                    .collect::<Vec<_>>()
                                    .join(" ");
                                vec![
                                    q.spec.name.clone(),
                                    q.spec.team.clone(),
                                    q.spec.parent.clone().unwrap_or_else(|| "-".into()),
                                    Value::from(q.spec.weight).to_string(),
                                    text_of(&q.spec.state),
                                    quotas,
                                    used,
                                    q.running.to_string(),
                                    q.pending.to_string(),
                                    budget_left(q.spec.budget.as_ref(), q.budget_use.as_ref()),
                                    if borrowers.is_empty() {
                                        "-".into()
                                    } else {
                                        borrowers
                                    },
                                ]
                            })
                            .collect();
                        table(
                            !conn.no_headers,
                            &[
                                "name",
                                "team",
                                "parent",
                                "weight",
                                "state",
                                "guaranteed",
                                "used",
                                "running",
                                "pending",
                                "budget left",
                                "borrowing its gpus",
                            ],
                            rows,
                        )
                    },
                )
            })?;
        }
        QueueCmd::Create { file } => {
            let v = c.call(
                "POST",
                "/v1/queues",
                Some(("application/json", as_json(&file)?)),
            )?;
            print_as(conn.output, "/v1/queues", v, |q: &api::QueueSpec| {
                format!("queue {} created\n", q.name)
            })?;
        }
        QueueCmd::Set {
            name,
            weight,
            state,
            quota,
            borrow_limit,
            lend_limit,
            cap,
            user_max_gpus,
            user_max_running,
            notebook_max_lifetime,
            notebook_idle_after,
            notebook_idle_action,
            budget_gpu_hours,
            budget_cost,
            budget_period,
            when_exhausted,
        } => {
            let mut patch = serde_json::Map::new();
            // The queue as it is: the API replaces quotas and user limits
            // as wholes, so what is not named stays.
            let current = || -> anyhow::Result<api::QueueView> {
                let queues: Vec<api::QueueView> =
                    gpuflow_client::read("/v1/queues", c.call("GET", "/v1/queues", None)?)?;
                queues
                    .into_iter()
                    .find(|x| x.spec.name == name)
                    .ok_or_else(|| anyhow!("queue {name:?} not found"))
            };
            let limit = |flag: &str, v: &str| -> anyhow::Result<Value> {
                if v == "none" {
                    return Ok(Value::Null);
                }
                let n: f64 = v
                    .parse()
                    .ok()
                    .filter(|n: &f64| *n >= 0.0)
                    .ok_or_else(|| Usage(format!("{flag}: {v:?} is not a number or none")))?;
                Ok(n.into())
            };
            let limits = [
                ("--borrow-limit", "borrow_limit", borrow_limit),
                ("--lend-limit", "lend_limit", lend_limit),
                ("--cap", "cap", cap),
            ];
            if user_max_gpus.is_some() || user_max_running.is_some() {
                let mut l = serde_json::to_value(current()?.spec.user_limits)?;
                if let Some(v) = user_max_gpus {
                    l["max_gpus"] = limit("--user-max-gpus", &v)?;
                }
                if let Some(v) = user_max_running {
                    l["max_running"] = match limit("--user-max-running", &v)? {
                        Value::Null => Value::Null,
                        n => (n.as_f64().unwrap_or(0.0) as u64).into(),
                    };
                }
                patch.insert("user_limits".into(), l);
            }
            if let Some(s) = notebook_max_lifetime {
                patch.insert("notebook_max_lifetime_s".into(), s.into());
            }
            if let (Some(after), Some(action)) = (notebook_idle_after, notebook_idle_action) {
                patch.insert(
                    "notebook_idle".into(),
                    serde_json::json!({"after_s": after, "action": action}),
                );
            }
            if budget_gpu_hours.is_some() || budget_cost.is_some() {
                let mut b = serde_json::json!({
                    "period": budget_period,
                    "when_exhausted": when_exhausted,
                });
                if let Some(h) = budget_gpu_hours {
                    b["gpu_hours"] = h.into();
                }
                if let Some(c) = budget_cost {
                    b["cost"] = c.into();
                }
                patch.insert("budget".into(), b);
            }
            if let Some(w) = weight {
                patch.insert("weight".into(), w.into());
            }
            if let Some(st) = state {
                patch.insert("state".into(), st.into());
            }
            if quota.is_some() || limits.iter().any(|(_, _, v)| v.is_some()) {
                // The API replaces a queue's quotas as a whole: start from
                // the queue's own, so that the guarantees and limits named
                // change and everything else (the other settings, the other
                // flavors) stays.
                let mut m = match serde_json::to_value(current()?.spec.quotas)? {
                    Value::Object(m) => m,
                    _ => serde_json::Map::new(),
                };
                for part in quota.iter().flat_map(|q| q.split(',')) {
                    let (f, g) = part
                        .split_once('=')
                        .ok_or_else(|| Usage(format!("--quota: {part:?} is not FLAVOR=GPUS")))?;
                    let g: f64 = g
                        .parse()
                        .map_err(|_| Usage(format!("--quota: {g:?} is not a number of GPUs")))?;
                    let e = m
                        .entry(f.to_string())
                        .or_insert_with(|| serde_json::json!({}));
                    e["guaranteed"] = g.into();
                }
                for (flag, field, v) in &limits {
                    let Some(v) = v else { continue };
                    for part in v.split(',') {
                        let (f, g) = part.split_once('=').ok_or_else(|| {
                            Usage(format!(
                                "{flag}: {part:?} is not FLAVOR=GPUS (or FLAVOR=none)"
                            ))
                        })?;
                        let e = m
                            .entry(f.to_string())
                            .or_insert_with(|| serde_json::json!({}));
                        e[*field] = limit(flag, g)?;
                    }
                }
                patch.insert("quotas".into(), Value::Object(m));
            }
            if patch.is_empty() {
                return Err(Usage(format!(
                    "nothing to change on queue {name}: give --weight, --state, --quota, --borrow-limit, --lend-limit, --cap, --user-max-gpus, --user-max-running, --notebook-max-lifetime, --notebook-idle-after/--notebook-idle-action or --budget-gpu-hours/--budget-cost"
                ))
                .into());
            }
            let v = c.call(
                "PATCH",
                &format!("/v1/queues/{name}"),
                Some(("application/json", serde_json::to_vec(&patch)?)),
            )?;
            print_as(conn.output, "/v1/queues", v, |q: &api::QueueSpec| {
                format!("queue {} updated\n", q.name)
            })?;
        }
        QueueCmd::Delete { name } => {
            c.call("DELETE", &format!("/v1/queues/{name}"), None)?;
            if matches!(conn.output, Format::Table) {
                println!("queue {name} deleted");
            }
        }
    }
    Ok(())
}

/// A flavor's quota: `H100:8+4` (8 guaranteed, 4 more may be borrowed),
/// `+any` when borrowing is unlimited, `^16` a cap; `all` for a guarantee
/// of the whole cluster.
pub(super) fn quota_text(flavor: &str, q: &api::QuotaSpec) -> String {
    let g = q.guaranteed;
    let g = if g >= 1e6 {
        "all".to_string()
    } else {
        format!("{g}")
    };
    let borrow = match q.borrow_limit {
        Some(b) => format!("+{b}"),
        None => "+any".into(),
    };
    let cap = q.cap.map_or(String::new(), |c| format!("^{c}"));
    format!("{flavor}:{g}{borrow}{cap}")
}

/// What is left of a budget: `12.5 of 100 GPU-h/month`, `SPENT` once
/// used up; `-` without one.
pub(super) fn budget_left(spec: Option<&api::BudgetSpec>, used: Option<&api::BudgetUse>) -> String {
    let (Some(spec), Some(b)) = (spec, used) else {
        return "-".into();
    };
    let (limit, unit) = match spec.cost {
        Some(c) => (c, ""),
        None => (spec.gpu_hours.unwrap_or(0.0), " GPU-h"),
    };
    format!(
        "{:.1} of {limit}{unit}/{}{}",
        b.left,
        text_of(&spec.period),
        if b.exhausted { " SPENT" } else { "" }
    )
}
