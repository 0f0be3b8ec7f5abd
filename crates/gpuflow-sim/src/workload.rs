//! Inputs of the dynamic simulator: a cluster description (TOML), a job trace
//! (CSV) and a seeded generator of multi-team workloads.
//!
//! Cluster file:
//! ```toml
//! [[nodes]]                # a group of identical nodes
//! count = 64
//! gpus = 8
//! model = "H100"
//! cpu = 128                # cores
//! mem_gib = 1024
//! rack_size = 16           # nodes per rack (optional)
//!
//! [[queues]]               # leaf queues under one organisation queue
//! name = "team-a"
//! weight = 1.0
//! guaranteed = { H100 = 128 }   # GPUs per flavor
//! borrow_limit = { H100 = 256 } # optional, GPUs
//! # optional: a GPU-hour budget that renews every period_h hours; once
//! # taper_from of it is used the fair-share weight falls linearly to
//! # min_weight × weight, and when it is used up the queue stops borrowing
//! # (or, with when_exhausted = "stop-admitting", starts nothing new)
//! budget = { gpu_hours = 2000, period_h = 168, taper_from = 0.8, min_weight = 0.25 }
//! ```
//! Trace CSV columns: `id,submit_s,duration_s,tasks,gpus_per_task,sharing,team,kind,priority,max_runtime_s`,
//! where `sharing` is `whole` or `frac:MILLI`, `kind` one of inference, notebook,
//! training, batch, and `max_runtime_s` may be empty.

use std::collections::BTreeMap;
use std::path::Path;

use gpuflow_core::queue::{Budget, BudgetExhausted, FlavorQuota, Queue, QueueId, Queues};
use gpuflow_core::{
    CpuMilli, Gpu, GpuMilli, GpuRequest, Job, JobId, MemMib, Node, SplitMix64, TaskGroup,
    TaskRequest,
};
use serde::Deserialize;

use crate::error::SimError;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeGroup {
    pub count: u32,
    pub gpus: u32,
    pub model: String,
    pub cpu: u64,
    pub mem_gib: u64,
    #[serde(default)]
    pub rack_size: Option<u32>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSpec {
    pub name: String,
    #[serde(default = "one")]
    pub weight: f64,
    #[serde(default)]
    pub guaranteed: BTreeMap<String, u64>,
    #[serde(default)]
    pub borrow_limit: BTreeMap<String, u64>,
    #[serde(default)]
    pub budget: Option<BudgetSpec>,
}

/// A queue's GPU-hour budget per period.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    pub gpu_hours: f64,
    /// Hours per period: the budget renews at every multiple of it.
    pub period_h: u64,
    #[serde(default = "default_taper")]
    pub taper_from: f64,
    #[serde(default = "default_min_weight")]
    pub min_weight: f64,
    #[serde(default)]
    pub when_exhausted: Exhausted,
}

fn default_taper() -> f64 {
    0.8
}

fn default_min_weight() -> f64 {
    0.25
}

/// What a queue does once its budget is used up.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "kebab-case")]
pub enum Exhausted {
    #[default]
    StopBorrowing,
    StopAdmitting,
}

impl BudgetSpec {
    /// Seconds per period.
    pub fn period_s(&self) -> u64 {
        self.period_h * 3600
    }

    /// The core's budget with `used` GPU-hours of the current period.
    pub fn budget(&self, used: f64) -> Budget {
        Budget {
            gpu_hours: self.gpu_hours,
            used_gpu_hours: used,
            taper_from: self.taper_from,
            min_weight_factor: self.min_weight,
            when_exhausted: match self.when_exhausted {
                Exhausted::StopBorrowing => BudgetExhausted::StopBorrowing,
                Exhausted::StopAdmitting => BudgetExhausted::StopAdmitting,
            },
        }
    }

    fn check(&self, queue: &str) -> Result<(), String> {
        let ok = self.gpu_hours.is_finite()
            && self.gpu_hours >= 0.0
            && self.period_h > 0
            && (0.0..=1.0).contains(&self.taper_from)
            && self.min_weight > 0.0
            && self.min_weight <= 1.0;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "queue {queue}: budget needs gpu_hours >= 0, period_h > 0, taper_from in [0, 1] and min_weight in (0, 1]"
            ))
        }
    }
}

fn one() -> f64 {
    1.0
}

/// A cluster and its queues.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    pub nodes: Vec<NodeGroup>,
    pub queues: Vec<QueueSpec>,
}

impl ClusterSpec {
    /// Reads a cluster file.
    ///
    /// # Errors
    /// When the file cannot be read or is not a valid description.
    pub fn load(path: &Path) -> Result<ClusterSpec, SimError> {
        let text = std::fs::read_to_string(path).map_err(|e| SimError::Read {
            path: path.to_path_buf(),
            source: e,
        })?;
        let spec: ClusterSpec = toml::from_str(&text).map_err(|e| SimError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message: e.to_string(),
        })?;
        spec.check().map_err(|m| SimError::Parse {
            path: path.to_path_buf(),
            line: 0,
            message: m,
        })?;
        Ok(spec)
    }

    fn check(&self) -> Result<(), String> {
        if self.nodes.is_empty() || self.queues.is_empty() {
            return Err(
                "a cluster needs at least one [[nodes]] group and one [[queues]] entry".into(),
            );
        }
        for q in &self.queues {
            if let Some(b) = &q.budget {
                b.check(&q.name)?;
            }
        }
        for g in &self.nodes {
            if g.count == 0 || g.gpus > 64 || g.cpu == 0 {
                return Err(format!(
                    "node group {}: count and cpu must be above 0 and gpus at most 64",
                    g.model
                ));
            }
        }
        Ok(())
    }

    pub fn build_nodes(&self) -> Vec<Node> {
        let mut nodes = Vec::new();
        for g in &self.nodes {
            for _ in 0..g.count {
                let id = nodes.len() as u32;
                let mut n = Node::new(
                    id,
                    &format!("node-{id:04}"),
                    CpuMilli(g.cpu * 1000),
                    MemMib(g.mem_gib * 1024),
                    (0..g.gpus)
                        .map(|_| Gpu::plain(&g.model, MemMib(81_920)))
                        .collect(),
                );
                if let Some(r) = g.rack_size.filter(|r| *r > 0) {
                    n.rack = Some(format!("rack-{:03}", id / r));
                }
                nodes.push(n);
            }
        }
        nodes
    }

    /// An organisation queue with one leaf per team.
    ///
    /// # Errors
    /// When the queue list is invalid (repeated names, bad weights).
    pub fn build_queues(&self, nodes: &[Node]) -> Result<Queues, SimError> {
        let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
        for g in nodes.iter().flat_map(|n| &n.gpus) {
            *capacity.entry(g.model.clone()).or_default() += 1000;
        }
        let mut org = Queue::new("org", None);
        for (f, c) in &capacity {
            org.quotas.insert(f.clone(), FlavorQuota::guaranteed(*c));
        }
        let mut list = vec![org];
        for q in &self.queues {
            let mut leaf = Queue::new(&q.name, Some(QueueId(0)));
            leaf.weight = q.weight;
            leaf.budget = q.budget.as_ref().map(|b| b.budget(0.0));
            for (f, g) in &q.guaranteed {
                let borrow = q.borrow_limit.get(f).map(|b| b * 1000);
                leaf.quotas.insert(
                    f.clone(),
                    FlavorQuota {
                        guaranteed: g * 1000,
                        borrow_limit: borrow,
                        ..FlavorQuota::default()
                    },
                );
            }
            list.push(leaf);
        }
        Queues::new(list, capacity).map_err(|e| SimError::Invalid(e.to_string()))
    }
}

/// A cluster of `gpus` GPUs on 8-GPU H100 nodes in racks of 16, with a
/// queue per team `(name, weight, guaranteed H100s)`, free to borrow.
pub fn h100_cluster(gpus: u64, teams: impl Iterator<Item = (String, f64, u64)>) -> ClusterSpec {
    ClusterSpec {
        nodes: vec![NodeGroup {
            count: gpus.div_ceil(8) as u32,
            gpus: 8,
            model: "H100".into(),
            cpu: 128,
            mem_gib: 1024,
            rack_size: Some(16),
        }],
        queues: teams
            .map(|(name, weight, guaranteed)| QueueSpec {
                name,
                weight,
                guaranteed: BTreeMap::from([("H100".to_string(), guaranteed)]),
                borrow_limit: BTreeMap::new(),
                budget: None,
            })
            .collect(),
    }
}

/// Kinds of work, in the order of the default priority classes.
pub const KINDS: &[&str] = &["inference", "notebook", "training", "batch"];

/// One job of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceJob {
    pub id: u64,
    pub submit: u64,
    pub duration: u64,
    pub tasks: u32,
    pub gpu: GpuRequest,
    pub team: String,
    /// Index into [`KINDS`].
    pub kind: usize,
    pub priority: i32,
    pub max_runtime: Option<u64>,
    /// The GPU model it must run on; `None`: any.
    pub model: Option<String>,
}

impl TraceJob {
    pub fn gpu_milli(&self) -> u64 {
        self.gpu.milli() * self.tasks as u64
    }

    pub fn job(&self) -> Job {
        let cpu = match &self.gpu {
            GpuRequest::Whole { count } => *count as u64 * 8_000,
            _ => 4_000,
        };
        let request = TaskRequest {
            cpu: CpuMilli(cpu),
            mem: MemMib(cpu / 1000 * 8192),
            gpu: self.gpu.clone(),
            models: self.model.iter().cloned().collect(),
        };
        Job {
            id: JobId(self.id),
            groups: vec![TaskGroup {
                name: "task".into(),
                replicas: self.tasks,
                request,
            }],
            constraints: gpuflow_core::Constraints {
                spread: self.kind == 0 && self.tasks > 1,
                ..Default::default()
            },
        }
    }
}

#[derive(Deserialize)]
struct TraceRow {
    id: u64,
    submit_s: u64,
    duration_s: u64,
    tasks: u32,
    gpus_per_task: u32,
    sharing: String,
    team: String,
    kind: String,
    priority: i32,
    max_runtime_s: Option<u64>,
}

/// Reads a trace CSV.
///
/// # Errors
/// When the file cannot be read or a row is invalid.
pub fn load_trace(path: &Path) -> Result<Vec<TraceJob>, SimError> {
    let file = std::fs::File::open(path).map_err(|e| SimError::Read {
        path: path.to_path_buf(),
        source: e,
    })?;
    let mut out = Vec::new();
    for (i, row) in csv::Reader::from_reader(file)
        .deserialize::<TraceRow>()
        .enumerate()
    {
        let line = i as u64 + 2;
        let bad = |m: String| SimError::Parse {
            path: path.to_path_buf(),
            line,
            message: m,
        };
        let r = row.map_err(|e| bad(e.to_string()))?;
        let kind = KINDS.iter().position(|k| *k == r.kind).ok_or_else(|| {
            bad(format!(
                "kind {:?}: expected one of {}",
                r.kind,
                KINDS.join(", ")
            ))
        })?;
        let gpu = match r.sharing.as_str() {
            "whole" if r.gpus_per_task == 0 => GpuRequest::None,
            "whole" if r.gpus_per_task <= 64 => GpuRequest::Whole {
                count: r.gpus_per_task as u8,
            },
            s if s.starts_with("frac:") => {
                let m: u32 = s[5..]
                    .parse()
                    .map_err(|_| bad(format!("sharing {s:?}: frac:MILLI takes a number")))?;
                if !(1..1000).contains(&m) || r.gpus_per_task != 1 {
                    return Err(bad(format!(
                        "sharing {s:?}: a fraction is 1..999 milli of one GPU"
                    )));
                }
                GpuRequest::Fraction {
                    milli: GpuMilli(m),
                    mem: MemMib(0),
                }
            }
            s => {
                return Err(bad(format!(
                    "sharing {s:?}: expected whole or frac:MILLI, and at most 64 GPUs per task"
                )));
            }
        };
        if r.tasks == 0 || r.duration_s == 0 {
            return Err(bad("tasks and duration_s must be above 0".into()));
        }
        out.push(TraceJob {
            id: r.id,
            submit: r.submit_s,
            duration: r.duration_s,
            tasks: r.tasks,
            gpu,
            team: r.team,
            kind,
            priority: r.priority,
            max_runtime: r.max_runtime_s,
            model: None,
        });
    }
    out.sort_by_key(|j| (j.submit, j.id));
    Ok(out)
}

/// Writes a trace CSV.
pub fn trace_csv(jobs: &[TraceJob]) -> String {
    let mut out = String::from(
        "id,submit_s,duration_s,tasks,gpus_per_task,sharing,team,kind,priority,max_runtime_s\n",
    );
    for j in jobs {
        let (per, sharing) = match &j.gpu {
            GpuRequest::Whole { count } => (*count as u32, "whole".to_string()),
            GpuRequest::Fraction { milli, .. } => (1, format!("frac:{}", milli.0)),
            _ => (0, "whole".to_string()),
        };
        out.push_str(&format!(
            "{},{},{},{},{},{},{},{},{},{}\n",
            j.id,
            j.submit,
            j.duration,
            j.tasks,
            per,
            sharing,
            j.team,
            KINDS[j.kind],
            j.priority,
            j.max_runtime.map(|m| m.to_string()).unwrap_or_default()
        ));
    }
    out
}

/// The synthetic workload: teams share a cluster; each kind arrives as a
/// Poisson process sized so that the offered GPU load is `load` × capacity.
#[derive(Clone, Debug)]
pub struct Synthetic {
    pub teams: Vec<(String, f64)>,
    /// Relative GPU demand per team; empty: demand follows the weights.
    pub demand: Vec<f64>,
    pub gpus: u64,
    pub load: f64,
    pub hours: u64,
    pub seed: u64,
}

impl Synthetic {
    /// The default study: 4 teams (weights 1, 1, 2, 1) on 512 H100s at 90 % load for 3 days.
    pub fn four_teams(seed: u64) -> Synthetic {
        Synthetic {
            teams: vec![
                ("team-a".into(), 1.0),
                ("team-b".into(), 1.0),
                ("team-c".into(), 2.0),
                ("team-d".into(), 1.0),
            ],
            demand: Vec::new(),
            gpus: 512,
            load: 0.9,
            hours: 72,
            seed,
        }
    }

    /// The matching cluster: 8-GPU H100 nodes, racks of 16, each team
    /// guaranteed its weighted share and free to borrow.
    pub fn cluster(&self) -> ClusterSpec {
        let total: f64 = self.teams.iter().map(|(_, w)| w).sum();
        h100_cluster(
            self.gpus,
            self.teams
                .iter()
                .map(|(n, w)| (n.clone(), *w, (self.gpus as f64 * w / total).floor() as u64)),
        )
    }

    /// Generates the jobs. Shares of GPU demand: inference 15 %, notebooks 10 %,
    /// training 50 %, batch 25 %; each team's demand follows its weight.
    /// Notebooks and batch arrive mostly in working hours (the rate swings ±80 %
    /// over a day), training ±40 %, inference evenly.
    pub fn jobs(&self) -> Vec<TraceJob> {
        let mut rng = SplitMix64::new(self.seed);
        let horizon = self.hours * 3600;
        let shares: Vec<f64> = if self.demand.len() == self.teams.len() {
            self.demand.clone()
        } else {
            self.teams.iter().map(|(_, w)| *w).collect()
        };
        let total_w: f64 = shares.iter().sum();
        let mut jobs = Vec::new();
        // (kind, share of demand, tasks, GPUs per task or milli, mean duration s, max runtime factor)
        let kinds: [(usize, f64); 4] = [(0, 0.15), (1, 0.10), (2, 0.50), (3, 0.25)];
        for ((team, _), w) in self.teams.iter().zip(&shares) {
            for &(kind, share) in &kinds {
                let demand = self.gpus as f64 * self.load * horizon as f64 * share * w / total_w; // GPU-seconds
                let mut made = 0.0;
                while made < demand {
                    let u =
                        |rng: &mut SplitMix64| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                    let (tasks, gpu, duration, declared) = match kind {
                        0 => (
                            1 + rng.below(2) as u32,
                            GpuRequest::Whole { count: 1 },
                            4 * 3600 + rng.below(8 * 3600),
                            None,
                        ),
                        1 => {
                            let gpu = if rng.below(2) == 0 {
                                GpuRequest::Whole { count: 1 }
                            } else {
                                GpuRequest::Fraction {
                                    milli: GpuMilli(500),
                                    mem: MemMib(0),
                                }
                            };
                            (1, gpu, 1800 + rng.below(5400), Some(4 * 3600))
                        }
                        2 => {
                            let t = [1u32, 2, 4][rng.below(3) as usize];
                            (
                                t,
                                GpuRequest::Whole { count: 8 },
                                2 * 3600 + rng.below(10 * 3600),
                                Some(1),
                            )
                        }
                        _ => (
                            1,
                            GpuRequest::Whole {
                                count: [1u8, 2, 4][rng.below(3) as usize],
                            },
                            600 + rng.below(3000),
                            Some(1),
                        ),
                    };
                    // Declared max runtime: 1.5× the real duration, rounded up to 10 minutes.
                    let max_runtime = declared.map(|d| {
                        if d == 1 {
                            (duration * 3 / 2).div_ceil(600) * 600
                        } else {
                            d
                        }
                    });
                    // Working hours are busier: a day-long cycle of arrivals,
                    // strongest for notebooks and batch (peak mid-afternoon).
                    let swing = match kind {
                        1 | 3 => 0.8,
                        2 => 0.4,
                        _ => 0.0,
                    };
                    let submit = loop {
                        let t = u(&mut rng) * horizon as f64;
                        let phase = (t / 86_400.0 - 14.0 / 24.0) * std::f64::consts::TAU;
                        if u(&mut rng) * (1.0 + swing) <= 1.0 + swing * phase.cos() {
                            break t as u64;
                        }
                    };
                    let job = TraceJob {
                        id: 0,
                        submit,
                        duration,
                        tasks,
                        gpu,
                        team: team.clone(),
                        kind,
                        priority: 0,
                        max_runtime,
                        model: None,
                    };
                    made += job.gpu_milli() as f64 / 1000.0 * duration as f64;
                    jobs.push(job);
                }
            }
        }
        jobs.sort_by_key(|j| (j.submit, j.team.clone(), j.kind, j.duration));
        for (i, j) in jobs.iter_mut().enumerate() {
            j.id = i as u64;
        }
        jobs
    }
}
