//! `gpuflow node`: nodes, their GPUs and what runs there; admins' actions.

use super::*;

#[derive(Subcommand)]
pub(crate) enum NodeCmd {
    /// Nodes with their state, GPUs, CPU and memory allocated, and
    /// limits (`-o wide`: pool, labels and jobs too).
    Ls {
        #[command(flatten)]
        watch: Watch,
    },
    /// One node: each GPU (model, memory, MIG instances, health, who holds
    /// it, utilisation), CPU and memory allocated, labels, pool, its jobs.
    Get {
        name: String,
        #[command(flatten)]
        watch: Watch,
    },
    /// Let running work finish, start nothing new.
    Drain { name: String },
    /// Start nothing new on a node (running work goes on).
    Cordon { name: String },
    /// Take a cordoned node back into service.
    Uncordon { name: String },
    /// The machine behind NAME is gone: requeue its work and let the next
    /// agent that registers NAME (with the join token) take it.
    Replace { name: String },
    /// Forget the health marks (XID errors, ECC errors) of NAME's GPUs,
    /// after the fault was dealt with: they take work again.
    Clear { name: String },
}

/// A node's CPU (cores) and memory (GiB) allocated of what it has.
pub(super) fn node_alloc(n: &api::NodeView) -> (String, String) {
    let cores = |m: u64| {
        let c = m as f64 / 1000.0;
        if c == c.trunc() {
            format!("{c}")
        } else {
            format!("{c:.1}")
        }
    };
    let gib = |m: u64| format!("{:.1}", m as f64 / 1024.0);
    (
        format!(
            "{}/{}",
            cores(n.cpu_allocated_milli),
            cores(n.inventory.cpu_milli)
        ),
        format!(
            "{}/{}Gi",
            gib(n.memory_allocated_mib),
            gib(n.inventory.memory_mib)
        ),
    )
}

/// A node's state; a draining node with no job left is "drained", as
/// Slurm says (a drain that is not done says how many jobs are left); a
/// node in a reservation says so.
pub(super) fn node_state(n: &api::NodeView) -> String {
    let jobs = n.job_count;
    let state = match n.state {
        api::NodeState::Draining if jobs == 0 => "drained".into(),
        api::NodeState::Draining => format!("draining ({jobs} jobs left)"),
        s => s.as_str().to_string(),
    };
    if n.reservations.is_empty() {
        state
    } else {
        format!("{state}+reserved")
    }
}

/// The MIG layout of a node's GPUs in MIG mode: `0:1g.10gb+3g.40gb`.
pub(super) fn mig_of(n: &api::NodeView) -> String {
    let l: Vec<String> = n
        .inventory
        .gpus
        .iter()
        .filter(|g| !g.mig.is_empty())
        .map(|g| {
            let m: Vec<&str> = g.mig.iter().map(|m| m.profile.as_str()).collect();
            format!("{}:{}", g.index, m.join("+"))
        })
        .collect();
    if l.is_empty() {
        "-".into()
    } else {
        l.join(" ")
    }
}

pub(super) fn pool_of(n: &api::NodeView) -> &str {
    Some(n.inventory.pool.as_str())
        .filter(|p| !p.is_empty())
        .unwrap_or("default")
}

pub(super) fn labels_of(n: &api::NodeView) -> String {
    let l: Vec<String> = n
        .inventory
        .labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    if l.is_empty() {
        "-".into()
    } else {
        l.join(",")
    }
}

/// The jobs on a node the caller may see, and how many others there are.
pub(super) fn node_jobs(n: &api::NodeView) -> String {
    let seen: Vec<String> = n.jobs.iter().map(u64::to_string).collect();
    let others = u64::from(n.job_count).saturating_sub(seen.len() as u64);
    match (seen.is_empty(), others) {
        (true, 0) => "-".into(),
        (_, 0) => seen.join(","),
        (true, k) => format!("{k} of other teams"),
        (false, k) => format!("{} (+{k} of other teams)", seen.join(",")),
    }
}

/// `node get`: a node and each of its GPUs.
pub(super) fn node_text(n: &api::NodeView) -> String {
    let inv = &n.inventory;
    let (cpu, mem) = node_alloc(n);
    let pool = pool_of(n);
    let heartbeat = Value::from(n.last_heartbeat);
    let mut out = format!(
        "node {}: {}\n  cpu {cpu} cores allocated, memory {mem}\n  pool {pool}, labels {}\n  jobs {}\n  last heartbeat {} ({} ago){}\n",
        n.name,
        node_state(n),
        labels_of(n),
        node_jobs(n),
        local(&heartbeat),
        ago(&heartbeat),
        if inv.emulated {
            "\n  GPUs emulated (no NVML)"
        } else {
            ""
        },
    );
    for r in &n.reservations {
        out += &format!("  reservation {r}\n");
    }
    // Samples name their GPU by UUID.
    let util: std::collections::BTreeMap<&str, String> = n
        .gpus_now
        .iter()
        .map(|g| (g.uuid.as_str(), format!("{}%", g.util_pct)))
        .collect();
    let rows = inv
        .gpus
        .iter()
        .map(|g| {
            let mig: Vec<&str> = g.mig.iter().map(|m| m.profile.as_str()).collect();
            let held: Vec<String> = n
                .holders
                .iter()
                .filter(|h| h.gpu == g.index)
                .map(|h| {
                    let who = match h.job {
                        Some(j) => format!("job {j}"),
                        None => "other team".into(),
                    };
                    match h.mode.as_str() {
                        "whole" => who,
                        "mig" => format!("{who} ({})", h.profile.as_deref().unwrap_or("-")),
                        mode => format!("{who} ({mode} {:.2})", f64::from(h.milli) / 1000.0),
                    }
                })
                .collect();
            vec![
                g.index.to_string(),
                g.model.clone(),
                format!("{}Gi", g.memory_mib / 1024),
                if mig.is_empty() {
                    "-".into()
                } else {
                    mig.join(",")
                },
                g.unhealthy
                    .as_ref()
                    .map_or("ok".into(), |u| format!("UNHEALTHY: {u}")),
                if held.is_empty() {
                    "free".into()
                } else {
                    held.join(", ")
                },
                util.get(g.uuid.as_str())
                    .cloned()
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    out += &columns(
        &["gpu", "model", "memory", "mig", "health", "held by", "util"],
        rows,
    );
    out
}

pub(crate) fn node(conn: &Conn, cmd: NodeCmd) -> anyhow::Result<()> {
    let c = Client::new(conn)?;
    let (action, name) = match cmd {
        NodeCmd::Get { name, watch } => {
            let path = format!("/v1/nodes/{}", urlencoding_path(&name));
            watch.run(|| {
                let v = c.call("GET", &path, None)?;
                print_as(conn.output, &path, v, node_text)
            })?;
            return Ok(());
        }
        NodeCmd::Ls { watch } => {
            let wide = conn.output == Format::Wide;
            watch.run(|| {
                let v = c.call("GET", "/v1/nodes", None)?;
                print_as(conn.output, "/v1/nodes", v, |nodes: &Vec<api::NodeView>| {
                    let rows = nodes
                        .iter()
                        .map(|n| {
                            let gpus = n.inventory.gpus.len();
                            let model = n.inventory.gpus.first().map_or("-", |g| g.model.as_str());
                            let emu = if n.inventory.emulated {
                                " (emulated)"
                            } else {
                                ""
                            };
                            let sick = n
                                .inventory
                                .gpus
                                .iter()
                                .filter(|g| g.unhealthy.is_some())
                                .count();
                            let sick = if sick > 0 {
                                format!(", {sick} UNHEALTHY")
                            } else {
                                String::new()
                            };
                            let busy = if n.gpus_now.is_empty() {
                                "-".to_string()
                            } else {
                                let sum: u64 =
                                    n.gpus_now.iter().map(|x| u64::from(x.util_pct)).sum();
                                format!("{}%", sum / n.gpus_now.len() as u64)
                            };
                            let used = n.gpus_in_use.len();
                            let (cpu, mem) = node_alloc(n);
                            let l = &n.inventory.limits;
                            let limits = if l.cgroup.is_empty() {
                                format!("NONE ({})", if l.note.is_empty() { "-" } else { &l.note })
                            } else {
                                format!("cgroup {}: {}", l.cgroup, l.controllers.join(","))
                            };
                            let mut row = vec![
                                n.name.clone(),
                                node_state(n),
                                format!("{gpus} × {model}{emu}{sick}"),
                                format!("{used}/{gpus}"),
                                cpu,
                                mem,
                                busy,
                                limits,
                            ];
                            if wide {
                                row.extend([
                                    pool_of(n).to_string(),
                                    labels_of(n),
                                    mig_of(n),
                                    node_jobs(n),
                                ]);
                            }
                            row
                        })
                        .collect();
                    let mut head = vec![
                        "name", "state", "gpus", "in use", "cpu", "memory", "gpu util", "limits",
                    ];
                    if wide {
                        head.extend(["pool", "labels", "mig", "jobs"]);
                    }
                    table(!conn.no_headers, &head, rows)
                })
            })?;
            return Ok(());
        }
        NodeCmd::Drain { name } => ("drain", name),
        NodeCmd::Cordon { name } => ("cordon", name),
        NodeCmd::Uncordon { name } => ("uncordon", name),
        NodeCmd::Replace { name } => ("replace", name),
        NodeCmd::Clear { name } => ("clear", name),
    };
    let path = format!("/v1/nodes/{name}/{action}");
    let v = c.call("POST", &path, None)?;
    print_as(conn.output, &path, v, |n: &api::NodeView| {
        format!("node {} is {}\n", n.name, node_state(n))
    })
}
