//! What the submit path refuses because no node of the registered cluster
//! could ever hold it, whatever else runs (as `sbatch` refuses a job no
//! partition can hold): a task bigger than every node, a GPU model the
//! cluster lacks, a gang larger than the cluster, a required topology
//! domain no node reports, a MIG profile no node offers. Only the static
//! shape of nodes is read (all nodes, in any state); whether a job fits
//! *now* is the scheduler's question. With no node registered yet, every
//! job is accepted: nodes may still join.
//!
//! Nodes alike in what this reads are read once ([`NodeShape`], counted by
//! `World` as nodes are put): a submission costs the same whether the
//! cluster has ten nodes or ten thousand of a few kinds.

use gpuflow_api::{self as api, JobSpec, job::TopologyLevel};
use gpuflow_core::request::GpuRequest;

use crate::convert::task_request;
use crate::state::World;

/// What [`never_fits`] reads of a node's inventory; nodes with the same
/// shape answer alike.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeShape {
    gpus: Vec<GpuShape>,
    memory_mib: u64,
    cpu_milli: u64,
    /// Labelled as able to run images.
    images: bool,
    rack: bool,
    block: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct GpuShape {
    model: String,
    memory_mib: u64,
    /// Its MIG instances' profiles.
    mig: Vec<String>,
    nvlink: bool,
}

impl NodeShape {
    pub fn of(inv: &api::Inventory) -> NodeShape {
        NodeShape {
            gpus: inv
                .gpus
                .iter()
                .map(|g| GpuShape {
                    model: g.model.clone(),
                    memory_mib: g.memory_mib,
                    mig: g.mig.iter().map(|m| m.profile.clone()).collect(),
                    nvlink: !g.nvlink.is_empty(),
                })
                .collect(),
            memory_mib: inv.memory_mib,
            cpu_milli: inv.cpu_milli,
            images: inv.labels.get(api::OCI_LABEL).is_some_and(|v| v == "true"),
            rack: inv.labels.contains_key("rack"),
            block: inv.labels.contains_key("block"),
        }
    }
}

/// Why no node could ever hold `spec`, naming what the cluster has; `None`
/// when some could.
pub fn never_fits(world: &World, spec: &JobSpec) -> Option<String> {
    // Each shape with how many nodes have it.
    let nodes: Vec<(&NodeShape, usize)> =
        world.node_shapes().iter().map(|(s, &n)| (s, n)).collect();
    if nodes.is_empty() {
        return None;
    }
    if spec.tasks.iter().any(|g| g.image.is_some()) && !nodes.iter().any(|(n, _)| n.images) {
        return Some(format!(
            "image: no node can run images (a node needs runc, skopeo and umoci, and then labels itself {}=true); drop `image:` to run as a process on the node",
            api::OCI_LABEL
        ));
    }
    if let Some(t) = &spec.topology
        && t.required
    {
        match t.level {
            TopologyLevel::Node => {}
            TopologyLevel::Nvlink => {
                if !nodes.iter().any(|(n, _)| n.gpus.iter().any(|g| g.nvlink)) {
                    return Some(
                        "topology: no node reports GPUs joined by NVLink; a required nvlink topology cannot be met (use node, or required: false)".into(),
                    );
                }
            }
            TopologyLevel::Rack | TopologyLevel::Block => {
                let (key, has): (_, fn(&NodeShape) -> bool) = if t.level == TopologyLevel::Rack {
                    ("rack", |n| n.rack)
                } else {
                    ("block", |n| n.block)
                };
                if !nodes.iter().any(|(n, _)| has(n)) {
                    return Some(format!(
                        "topology: no node reports a {key} (agents label it with --label {key}=NAME); a required {key} topology cannot be met"
                    ));
                }
            }
        }
    }
    for (gi, g) in spec.tasks.iter().enumerate() {
        let at = format!("tasks[{gi}] ({})", g.name);
        let req = task_request(g);
        let models = &req.models;
        let model_ok = |m: &str| models.is_empty() || models.iter().any(|x| x == m);
        if let GpuRequest::Mig { profile } = &req.gpu {
            let offered = nodes.iter().any(|(n, _)| {
                n.gpus
                    .iter()
                    .any(|g| model_ok(&g.model) && g.mig.iter().any(|m| m == profile))
            });
            if !offered {
                let mut have: Vec<&str> = nodes
                    .iter()
                    .flat_map(|(n, _)| n.gpus.iter().flat_map(|g| g.mig.iter().map(String::as_str)))
                    .collect();
                have.sort_unstable();
                have.dedup();
                return Some(format!(
                    "{at}: no node offers MIG profile {profile}; the cluster's MIG profiles: {}",
                    if have.is_empty() {
                        "none (no GPU is in MIG mode)".to_string()
                    } else {
                        have.join(", ")
                    }
                ));
            }
        }
        if !models.is_empty()
            && !nodes
                .iter()
                .any(|(n, _)| n.gpus.iter().any(|gpu| model_ok(&gpu.model)))
        {
            return Some(format!(
                "{at}: no node has GPU model {}; the cluster has {}",
                models.join(" or "),
                list_models(&nodes)
            ));
        }
        // How many replicas of this task each node could hold on its own.
        let holds = |n: &NodeShape| -> u64 {
            if req.cpu.0 > n.cpu_milli || req.mem.0 > n.memory_mib {
                return 0;
            }
            let by_cpu = n.cpu_milli / req.cpu.0.max(1);
            let by_mem = n.memory_mib / req.mem.0.max(1);
            let gpus = n.gpus.iter().filter(|gpu| model_ok(&gpu.model));
            let by_gpu = match &req.gpu {
                GpuRequest::None => u64::MAX,
                GpuRequest::Whole { count } => gpus.count() as u64 / (*count).max(1) as u64,
                GpuRequest::Fraction { milli, mem } => {
                    gpus.filter(|gpu| gpu.memory_mib >= mem.0).count() as u64
                        * (1000 / milli.0.max(1) as u64)
                }
                // The core's default slices per GPU (`Gpu::time_slices`).
                GpuRequest::TimeSlice { mem } => {
                    gpus.filter(|gpu| gpu.memory_mib >= mem.0).count() as u64 * 4
                }
                GpuRequest::Mig { profile } => gpus
                    .map(|gpu| gpu.mig.iter().filter(|m| *m == profile).count() as u64)
                    .sum(),
            };
            by_cpu.min(by_mem).min(by_gpu)
        };
        let per_node: Vec<(u64, usize)> = nodes.iter().map(|&(n, k)| (holds(n), k)).collect();
        if per_node.iter().all(|&(h, _)| h == 0) {
            return Some(format!(
                "{at}: no node could ever hold one task of {} CPU, {} MiB and {}; the largest node has {}",
                g.resources.cpu,
                g.resources.memory_mib,
                req.gpu,
                largest(&nodes)
            ));
        }
        let total: u64 = per_node.iter().fold(0u64, |a, &(h, k)| {
            a.saturating_add(h.saturating_mul(k as u64))
        });
        if total < g.replicas as u64 {
            return Some(format!(
                "{at}: the whole cluster could hold {total} of its {} replicas at most ({} nodes)",
                g.replicas,
                nodes.iter().map(|&(_, k)| k).sum::<usize>()
            ));
        }
    }
    // A gang that must share one node: all of it on the biggest.
    if let Some(t) = &spec.topology
        && t.required
        && t.level == TopologyLevel::Node
    {
        // The whole job's demand, once.
        let (mut gpus, mut cpu, mut mem) = (0u64, 0u64, 0u64);
        for g in &spec.tasks {
            let r = task_request(g);
            gpus += r.gpu.milli() * g.replicas as u64;
            cpu += r.cpu.0 * g.replicas as u64;
            mem += g.resources.memory_mib * g.replicas as u64;
        }
        let need = |n: &NodeShape| {
            gpus <= n.gpus.len() as u64 * 1000 && cpu <= n.cpu_milli && mem <= n.memory_mib
        };
        if !nodes.iter().any(|(n, _)| need(n)) {
            return Some(format!(
                "topology: the job must fit on one node and no node is large enough; the largest node has {}",
                largest(&nodes)
            ));
        }
    }
    None
}

fn list_models(nodes: &[(&NodeShape, usize)]) -> String {
    let mut models: Vec<&str> = nodes
        .iter()
        .flat_map(|(n, _)| n.gpus.iter().map(|g| g.model.as_str()))
        .collect();
    models.sort_unstable();
    models.dedup();
    if models.is_empty() {
        "no GPUs".into()
    } else {
        models.join(", ")
    }
}

fn largest(nodes: &[(&NodeShape, usize)]) -> String {
    let Some(&(n, _)) = nodes
        .iter()
        .max_by_key(|(n, _)| (n.gpus.len(), n.memory_mib, n.cpu_milli))
    else {
        return "no node".into();
    };
    format!(
        "{} GPUs ({}), {} CPU and {} MiB",
        n.gpus.len(),
        list_models(&[(n, 1)]),
        n.cpu_milli as f64 / 1000.0,
        n.memory_mib
    )
}
