//! Scenario fixtures: a cluster and a sequence of jobs as small text, the
//! placement rendered as text, so a reader sees the behaviour at a glance.
//!
//! ```text
//! policy best-fit                      # any named policy or scorer spec; ties go to the lowest node id
//! node n1 gpus=8*H100 cpu=64 mem=512 rack=r1 block=b1 pool=train labels=zone:a
//!         taints=dedicated state=cordoned nvlink=2 unhealthy=3 mig=1g.10gb*7 slices=4 gpumem=80
//! job 1 group=worker*4 gpu=whole:8 cpu=8 mem=64 models=H100 topology=rack! pool=train
//!       select=zone:a tolerate=dedicated spread
//! release 1
//! health n1 3 bad | state n1 cordoned
//! ```
//! `gpu=` takes `none`, `whole:N`, `frac:MILLI[:MEM]`, `mig:PROFILE`, `slice[:MEM]`;
//! `topology=LEVEL` is preferred and `LEVEL!` required; cpu in cores, memory in GiB.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;

use gpuflow_core::*;

/// The fixture's lines as tokens, comments and blank lines dropped.
pub(crate) fn token_lines(fixture: &str) -> Vec<Vec<&str>> {
    fixture
        .lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect()
}

/// A node state by its fixture name (anything else: ready).
pub(crate) fn parse_node_state(v: &str) -> NodeState {
    match v {
        "cordoned" => NodeState::Cordoned,
        "draining" => NodeState::Draining,
        "lost" => NodeState::Lost,
        _ => NodeState::Ready,
    }
}

/// A GPU's health by its fixture name: `bad`, or healthy.
pub(crate) fn parse_health(v: &str) -> GpuHealth {
    if v == "bad" {
        GpuHealth::Unhealthy
    } else {
        GpuHealth::Healthy
    }
}

/// A `key=value` token split in two (the value empty when there is no `=`).
pub(crate) fn kv(tok: &str) -> (&str, &str) {
    tok.split_once('=').unwrap_or((tok, ""))
}

fn parse_gpu(v: &str) -> GpuRequest {
    let parts: Vec<&str> = v.split(':').collect();
    match parts[0] {
        "none" => GpuRequest::None,
        "whole" => GpuRequest::Whole {
            count: parts[1].parse().unwrap(),
        },
        "frac" => GpuRequest::Fraction {
            milli: GpuMilli(parts[1].parse().unwrap()),
            mem: MemMib(
                parts
                    .get(2)
                    .map(|m| m.parse::<u64>().unwrap() * 1024)
                    .unwrap_or(0),
            ),
        },
        "mig" => GpuRequest::Mig {
            profile: parts[1].to_string(),
        },
        "slice" => GpuRequest::TimeSlice {
            mem: MemMib(
                parts
                    .get(1)
                    .map(|m| m.parse::<u64>().unwrap() * 1024)
                    .unwrap_or(0),
            ),
        },
        other => panic!("unknown gpu request {other}"),
    }
}

pub(crate) fn parse_node(id: u32, toks: &[&str]) -> Node {
    let name = toks[0];
    let mut node = Node::new(id, name, CpuMilli(64_000), MemMib(512 * 1024), Vec::new());
    let (mut count, mut model, mut gpumem) = (0usize, "H100".to_string(), 80u64);
    let (mut nvlink, mut unhealthy, mut mig, mut slices) = (0usize, Vec::new(), None, 4u16);
    for t in &toks[1..] {
        let (k, v) = kv(t);
        match k {
            "gpus" => {
                let (n, m) = v.split_once('*').unwrap();
                count = n.parse().unwrap();
                model = m.to_string();
            }
            "cpu" => node.cpu = CpuMilli(v.parse::<u64>().unwrap() * 1000),
            "mem" => node.mem = MemMib(v.parse::<u64>().unwrap() * 1024),
            "gpumem" => gpumem = v.parse().unwrap(),
            "rack" => node.rack = Some(v.to_string()),
            "block" => node.block = Some(v.to_string()),
            "pool" => node.pool = v.to_string(),
            "labels" => {
                for l in v.split(',') {
                    let (a, b) = l.split_once(':').unwrap();
                    node.labels.insert(a.to_string(), b.to_string());
                }
            }
            "taints" => {
                node.taints = v
                    .split(',')
                    .map(|k| Taint {
                        key: k.to_string(),
                        value: String::new(),
                    })
                    .collect()
            }
            "state" => node.state = parse_node_state(v),
            "nvlink" => nvlink = v.parse().unwrap(),
            "unhealthy" => unhealthy = v.split(',').map(|x| x.parse::<usize>().unwrap()).collect(),
            "mig" => {
                let (p, n) = v.split_once('*').unwrap();
                mig = Some((p.to_string(), n.parse::<usize>().unwrap()));
            }
            "slices" => slices = v.parse().unwrap(),
            other => panic!("unknown node key {other}"),
        }
    }
    node.gpus = (0..count)
        .map(|i| {
            let mut g = Gpu::plain(&model, MemMib(gpumem * 1024));
            g.numa = (i * 2 / count.max(1)) as u8;
            if let Some(per) = count.checked_div(nvlink).filter(|p| *p > 0) {
                g.nvlink = Some(format!("{name}/nvl{}", i / per));
            }
            if unhealthy.contains(&i) {
                g.health = GpuHealth::Unhealthy;
            }
            if let Some((p, n)) = &mig {
                g.mig = (0..*n)
                    .map(|_| MigInstance {
                        profile: p.clone(),
                        mem: MemMib(10 * 1024),
                    })
                    .collect();
            }
            g.time_slices = slices;
            g
        })
        .collect();
    node
}

pub(crate) fn parse_job(toks: &[&str]) -> Job {
    let id: u64 = toks[0].parse().unwrap();
    let mut job = Job {
        id: JobId(id),
        groups: Vec::new(),
        constraints: Constraints::default(),
    };
    for t in &toks[1..] {
        let (k, v) = kv(t);
        if k == "group" {
            let (name, n) = v.split_once('*').unwrap_or((v, "1"));
            job.groups.push(TaskGroup {
                name: name.to_string(),
                replicas: n.parse().unwrap(),
                request: TaskRequest::default(),
            });
            continue;
        }
        if job.groups.is_empty() && matches!(k, "gpu" | "cpu" | "mem" | "models") {
            job.groups.push(TaskGroup {
                name: "main".to_string(),
                replicas: 1,
                request: TaskRequest::default(),
            });
        }
        let c = &mut job.constraints;
        match k {
            "gpu" => job.groups.last_mut().unwrap().request.gpu = parse_gpu(v),
            "cpu" => {
                job.groups.last_mut().unwrap().request.cpu =
                    CpuMilli((v.parse::<f64>().unwrap() * 1000.0) as u64)
            }
            "mem" => {
                job.groups.last_mut().unwrap().request.mem =
                    MemMib(v.parse::<u64>().unwrap() * 1024)
            }
            "models" => {
                job.groups.last_mut().unwrap().request.models =
                    v.split('|').map(str::to_string).collect()
            }
            "topology" => {
                let required = v.ends_with('!');
                let level = match v.trim_end_matches('!') {
                    "node" => TopologyLevel::Node,
                    "nvlink" => TopologyLevel::NvLink,
                    "rack" => TopologyLevel::Rack,
                    "block" => TopologyLevel::Block,
                    other => panic!("unknown topology {other}"),
                };
                c.topology = Some(Topology { level, required });
            }
            "pool" => c.pool = Some(v.to_string()),
            "select" => {
                for l in v.split(',') {
                    let (a, b) = l.split_once(':').unwrap();
                    c.node_selector.insert(a.to_string(), b.to_string());
                }
            }
            "tolerate" => c.tolerations = v.split(',').map(str::to_string).collect(),
            "spread" => c.spread = true,
            other => panic!("unknown job key {other}"),
        }
    }
    job
}

pub(crate) fn render_pick(a: &Allocation) -> String {
    match a.pick {
        GpuPick::None => String::new(),
        GpuPick::Whole(_) => {
            let idx = a.gpu_indices();
            format!(
                "[{}]",
                idx.iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        }
        GpuPick::Shared(g) => format!("[{g}]"),
        GpuPick::Mig { gpu, instance } => format!("[{gpu}.mig{instance}]"),
    }
}

/// Renders a node's usage: `.` idle GPU, `X` exclusive, `f<milli>` fractional,
/// `t<n>` time-sliced tasks, `m<n>` MIG instances in use, `!` unhealthy.
fn render_usage(c: &Cluster) -> String {
    let mut out = String::new();
    for n in c.nodes() {
        let u = c.usage(n.id);
        let gpus: Vec<String> = n
            .gpus
            .iter()
            .zip(&u.gpus)
            .map(|(g, gu)| {
                let s = match gu.mode {
                    GpuMode::Idle => ".".to_string(),
                    GpuMode::Exclusive => "X".to_string(),
                    GpuMode::Fractional => format!("f{}", gu.milli),
                    GpuMode::TimeSliced => format!("t{}", gu.tasks),
                    GpuMode::Mig => format!("m{}", gu.mig_used.count_ones()),
                };
                if g.health == GpuHealth::Unhealthy {
                    format!("{s}!")
                } else {
                    s
                }
            })
            .collect();
        let _ = writeln!(
            out,
            "  {:<6} cpu {:>2}/{:<2} gpus {}",
            n.name,
            u.cpu / 1000,
            n.cpu.0 / 1000,
            gpus.join(" ")
        );
    }
    out
}

/// Runs a fixture and renders what happened.
pub(crate) fn run(fixture: &str) -> String {
    let mut nodes = Vec::new();
    let mut steps: Vec<Vec<&str>> = Vec::new();
    let mut policy = Policy::gpuflow();
    for toks in token_lines(fixture) {
        match toks[0] {
            "node" => nodes.push(parse_node(nodes.len() as u32, &toks[1..])),
            "policy" => policy = Policy::parse(toks[1]).unwrap(),
            _ => steps.push(toks),
        }
    }
    policy.tie_break = TieBreak::First;
    let cluster = Cluster::new(nodes).unwrap();
    let mut placer = Placer::new(cluster, policy, WorkloadMix::default(), 7);
    let mut placed: BTreeMap<u64, Vec<Allocation>> = BTreeMap::new();
    let mut out = String::new();
    for toks in steps {
        match toks[0] {
            "job" => {
                let job = parse_job(&toks[1..]);
                match placer.place_job(&job) {
                    Ok(p) => {
                        let parts: Vec<String> = p
                            .iter()
                            .map(|a| {
                                let g = &job.groups[a.task.group as usize].name;
                                format!(
                                    "{g}/{}→{}{}",
                                    a.task.index,
                                    placer.cluster().node(a.node).name,
                                    render_pick(a)
                                )
                            })
                            .collect();
                        let _ = writeln!(out, "job {}: {}", job.id.0, parts.join(" "));
                        placed.insert(job.id.0, p);
                    }
                    Err(u) => {
                        let _ = writeln!(out, "job {}: pending: {u}", job.id.0);
                    }
                }
            }
            "release" => {
                let id: u64 = toks[1].parse().unwrap();
                let p = placed.remove(&id).expect("released job was placed");
                placer.release(&p);
                let _ = writeln!(out, "release {id}");
            }
            "health" => {
                let node = placer.cluster().node_by_name(toks[1]).unwrap();
                placer.set_gpu_health(node, toks[2].parse().unwrap(), parse_health(toks[3]));
                let _ = writeln!(out, "gpu {} of {} is {}", toks[2], toks[1], toks[3]);
            }
            "state" => {
                let node = placer.cluster().node_by_name(toks[1]).unwrap();
                placer.set_node_state(node, parse_node_state(toks[2]));
                let _ = writeln!(out, "{} is {}", toks[1], toks[2]);
            }
            other => panic!("unknown step {other}"),
        }
    }
    out.push_str("usage:\n");
    out.push_str(&render_usage(placer.cluster()));
    out
}
pub(crate) mod sched;
