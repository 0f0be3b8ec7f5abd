//! The FGD paper's fragmentation experiment (Weng et al., USENIX ATC'23, Fig. 9):
//! for each seed, shuffle the pod list, append pods sampled with replacement
//! until the GPU request reaches `inflation` × the cluster's GPU capacity, then
//! place pods one at a time with no departures. A pod that fits nowhere is
//! dropped. At each percent of arrived GPU request, record the share of GPU
//! capacity left unallocated.
//!
//! The placement is gpuflow-core's own pipeline, the same code the server runs.

use gpuflow_core::{Cluster, Job, MixWeighting, Node, Placer, Policy, SplitMix64, WorkloadMix};
use rayon::prelude::*;

use crate::error::SimError;
use crate::openb::Pod;

/// How the experiment runs.
#[derive(Clone, Debug)]
pub struct Config {
    pub seeds: Vec<u64>,
    /// Total GPU request of the arriving pods, as a multiple of GPU capacity.
    pub inflation: f64,
    pub policies: Vec<Policy>,
    /// Share of pods whose shapes enter the fragmentation mix (most common
    /// first), instead of each policy's own ([`Policy::typical`]).
    pub mix_coverage: Option<f64>,
    pub mix_weighting: MixWeighting,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            seeds: (42..=51).collect(),
            inflation: 1.3,
            policies: Policy::NAMES
                .iter()
                .filter_map(|n| Policy::named(n))
                .collect(),
            mix_coverage: None,
            mix_weighting: MixWeighting::Tasks,
        }
    }
}

/// One policy on one seed.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    pub policy: String,
    pub seed: u64,
    /// `unallocated[p]`: unallocated GPU % when p % of capacity had arrived
    /// (index 0 is the empty cluster).
    pub unallocated: Vec<f64>,
    pub pods: u64,
    pub placed: u64,
    pub dropped: u64,
    /// GPU request dropped before arrivals reached 100 % of capacity, in
    /// milli-GPU, per request kind (`frac`, `1`, `2`, `4`, `8`, …): where the
    /// unallocated capacity at 100 % comes from.
    pub dropped_by_kind: std::collections::BTreeMap<String, u64>,
}

/// The mean over seeds of one policy.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub policy: String,
    pub seeds: usize,
    pub unallocated: Vec<f64>,
    pub decisions: u64,
}

/// The arrival order for one seed: the pods shuffled, then pods sampled with
/// replacement appended until their GPU request reaches the target.
pub fn arrivals(pods: &[Pod], capacity_milli: u64, inflation: f64, seed: u64) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    let mut order: Vec<usize> = (0..pods.len()).collect();
    rng.shuffle(&mut order);
    let target = (capacity_milli as f64 * inflation) as u64;
    let mut total: u64 = order.iter().map(|&i| pods[i].gpu_milli()).sum();
    let has_gpu = pods.iter().any(|p| p.gpu_milli() > 0);
    let base = order.clone();
    while has_gpu && total < target {
        let i = base[rng.below(base.len() as u64) as usize];
        total += pods[i].gpu_milli();
        order.push(i);
    }
    order
}

/// The nodes in a seeded random order, numbered in it. The paper's simulator
/// prefixes each node's name with a random rank and, among equal scores, takes
/// the node whose name sorts first; with [`gpuflow_core::TieBreak::First`] the
/// lowest node id plays that part.
pub fn ranked(nodes: &[Node], seed: u64) -> Vec<Node> {
    let mut rng = SplitMix64::new(seed ^ 0x6e6f_6465_7261_6e6b);
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    rng.shuffle(&mut order);
    order
        .into_iter()
        .enumerate()
        .map(|(id, i)| {
            let mut n = nodes[i].clone();
            n.id = gpuflow_core::NodeId(id as u32);
            n
        })
        .collect()
}

/// Runs one policy on one seed.
///
/// # Errors
/// When the nodes do not form a valid cluster.
pub fn run(
    nodes: &[Node],
    pods: &[Pod],
    policy: &Policy,
    seed: u64,
    cfg: &Config,
) -> Result<Run, SimError> {
    let capacity: u64 = nodes.iter().map(|n| n.gpus.len() as u64 * 1000).sum();
    if capacity == 0 {
        return Err(SimError::Invalid("the node list has no GPUs".to_string()));
    }
    let cluster =
        Cluster::new(ranked(nodes, seed)).map_err(|e| SimError::Invalid(e.to_string()))?;
    let mut typical = policy.typical;
    if let Some(c) = cfg.mix_coverage {
        typical.coverage = c;
    }
    let mix = WorkloadMix::typical(pods.iter().map(|p| &p.request), cfg.mix_weighting, typical);
    let mut placer = Placer::new(cluster, policy.clone(), mix, seed);
    let order = arrivals(pods, capacity, cfg.inflation, seed);
    let points = (cfg.inflation * 100.0).floor() as usize;
    let mut unallocated = Vec::with_capacity(points + 1);
    unallocated.push(100.0);
    let (mut arrived, mut allocated, mut placed, mut dropped) = (0u64, 0u64, 0u64, 0u64);
    let mut dropped_by_kind = std::collections::BTreeMap::new();
    for (k, &i) in order.iter().enumerate() {
        let pod = &pods[i];
        let job = Job::single(k as u64, pod.request.clone());
        match placer.place_job(&job) {
            Ok(_) => {
                placed += 1;
                allocated += pod.gpu_milli();
            }
            Err(_) => {
                dropped += 1;
                if arrived < capacity {
                    let kind = match &pod.request.gpu {
                        gpuflow_core::GpuRequest::Whole { count } => format!("{count}"),
                        gpuflow_core::GpuRequest::None => "none".to_string(),
                        _ => "frac".to_string(),
                    };
                    *dropped_by_kind.entry(kind).or_default() += pod.gpu_milli();
                }
            }
        }
        arrived += pod.gpu_milli();
        while unallocated.len() <= points && arrived * 100 >= unallocated.len() as u64 * capacity {
            unallocated.push(100.0 - allocated as f64 * 100.0 / capacity as f64);
        }
    }
    // If the pods ran out before a point was reached, later points repeat the last value.
    while unallocated.len() <= points {
        unallocated.push(*unallocated.last().expect("not empty"));
    }
    Ok(Run {
        policy: policy.name.clone(),
        seed,
        unallocated,
        pods: order.len() as u64,
        placed,
        dropped,
        dropped_by_kind,
    })
}

/// Runs every policy on every seed, in parallel, calling `tick` after each run.
///
/// # Errors
/// As [`run`].
pub fn run_all(
    nodes: &[Node],
    pods: &[Pod],
    cfg: &Config,
    tick: &(dyn Fn() + Sync),
) -> Result<Vec<Run>, SimError> {
    let jobs: Vec<(&Policy, u64)> = cfg
        .policies
        .iter()
        .flat_map(|p| cfg.seeds.iter().map(move |&s| (p, s)))
        .collect();
    jobs.par_iter()
        .map(|(p, s)| {
            let r = run(nodes, pods, p, *s, cfg);
            tick();
            r
        })
        .collect()
}

/// Means over seeds, one row per policy in the order of `cfg.policies`.
pub fn summarize(runs: &[Run], cfg: &Config) -> Vec<Summary> {
    cfg.policies
        .iter()
        .map(|p| {
            let mine: Vec<&Run> = runs.iter().filter(|r| r.policy == p.name).collect();
            let len = mine.iter().map(|r| r.unallocated.len()).min().unwrap_or(0);
            let unallocated = (0..len)
                .map(|i| {
                    mine.iter().map(|r| r.unallocated[i]).sum::<f64>() / mine.len().max(1) as f64
                })
                .collect();
            Summary {
                policy: p.name.clone(),
                seeds: mine.len(),
                unallocated,
                decisions: mine.iter().map(|r| r.pods).sum(),
            }
        })
        .collect()
}
