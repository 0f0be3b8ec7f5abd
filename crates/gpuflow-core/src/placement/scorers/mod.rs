//! Scorers: rules that rank the nodes (and GPU picks) that passed the filters.
//! Each has a stable name; a [`crate::Policy`] weights them. Higher is better.
//!
//! Two kinds: *state* scorers read only the node, its usage, the task and the
//! pick, so their result holds for a whole class of identical nodes and is
//! cached; *context* scorers also read where the job's other tasks went
//! (gang locality, spread) and run per node.

mod balance;
mod best_fit;
mod clustering;
mod dot_product;
mod fragmentation;
mod gang_locality;
mod gpu_locality;
mod packing;
mod scarcity;
mod spread;

use crate::cluster::{GpuPick, NodeUsage};
use crate::ids::NodeId;
use crate::mix::WorkloadMix;
use crate::model::Node;
use crate::request::TaskRequest;

/// A scoring rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scorer {
    /// Least CPU and GPU left on the node after placement, tightest GPU (the FGD paper's best-fit).
    BestFit,
    /// Shared GPUs first, then nodes already in use, then idle nodes.
    Packing,
    /// Alignment of the request with the node's free resources (Tetris).
    DotProduct,
    /// Nodes already running tasks of the same kind (Gandiva-like).
    Clustering,
    /// Least growth of expected fragmentation under the workload mix (FGD).
    Fragmentation,
    /// [`Scorer::Fragmentation`] as the FGD paper's simulator scores it: a whole
    /// number from 0 to 100, so near ties are ties.
    FgdKube,
    /// Multi-GPU picks inside one NVLink island or NUMA node.
    GpuLocality,
    /// Least growth of GPU capacity stranded for lack of CPU at the mix's CPU-per-GPU ratio.
    Balance,
    /// Least use of GPU models that restricted work depends on.
    Scarcity,
}

impl Scorer {
    pub const ALL: &'static [Scorer] = &[
        Scorer::BestFit,
        Scorer::Packing,
        Scorer::DotProduct,
        Scorer::Clustering,
        Scorer::Fragmentation,
        Scorer::FgdKube,
        Scorer::GpuLocality,
        Scorer::Balance,
        Scorer::Scarcity,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scorer::BestFit => "best-fit",
            Scorer::Packing => "packing",
            Scorer::DotProduct => "dot-product",
            Scorer::Clustering => "clustering",
            Scorer::Fragmentation => "fragmentation",
            Scorer::FgdKube => "fgd-kube",
            Scorer::GpuLocality => "gpu-locality",
            Scorer::Balance => "balance",
            Scorer::Scarcity => "scarcity",
        }
    }
}

/// Context scorers' names, for explanations and metrics.
pub const GANG_LOCALITY: &str = "gang-locality";
pub const SPREAD: &str = "spread";

/// Cluster-wide scales that make scores comparable between nodes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Norm {
    pub cpu: f64,
    pub gpu_milli: f64,
}

/// What a state scorer sees.
pub(crate) struct ScoreInput<'a> {
    pub node: &'a Node,
    pub usage: &'a NodeUsage,
    pub islands: &'a [Option<u8>],
    pub req: &'a TaskRequest,
    pub pick: GpuPick,
    pub norm: Norm,
    pub mix: &'a WorkloadMix,
    /// Free milli-GPU per GPU before and after the pick.
    pub free_before: &'a [u32],
    pub free_after: &'a [u32],
    /// Fragmentation before the pick (only computed when the policy uses it).
    pub frag_before: f64,
    /// Fragmentation after the pick (likewise).
    pub frag_after: f64,
    /// Pressure per GPU model (see the scarcity scorer).
    pub pressure: &'a [(String, f64)],
}

pub(crate) fn score(s: Scorer, i: &ScoreInput) -> f64 {
    match s {
        Scorer::BestFit => best_fit::score(i),
        Scorer::Packing => packing::score(i),
        Scorer::DotProduct => dot_product::score(i),
        Scorer::Clustering => clustering::score(i),
        Scorer::Fragmentation => fragmentation::score(i),
        Scorer::FgdKube => fragmentation::score_kube(i),
        Scorer::GpuLocality => gpu_locality::score(i),
        Scorer::Balance => balance::score(i),
        Scorer::Scarcity => scarcity::score(i),
    }
}

/// Where the job's tasks placed so far sit.
pub(crate) struct GangContext<'a> {
    pub placed: &'a [NodeId],
    pub nodes: &'a [Node],
}

/// How close `node` is to each of the placed tasks' nodes, averaged: `weight`
/// gives the value for (same node, same rack, same block, elsewhere).
fn closeness(ctx: &GangContext, node: &Node, weight: [f64; 4]) -> f64 {
    if ctx.placed.is_empty() {
        return 0.0;
    }
    let sum: f64 = ctx
        .placed
        .iter()
        .map(|p| {
            let other = &ctx.nodes[p.0 as usize];
            if other.id == node.id {
                weight[0]
            } else if other.rack.is_some() && other.rack == node.rack {
                weight[1]
            } else if other.block.is_some() && other.block == node.block {
                weight[2]
            } else {
                weight[3]
            }
        })
        .sum();
    sum / ctx.placed.len() as f64
}

pub(crate) fn gang_locality(ctx: &GangContext, node: &Node) -> f64 {
    gang_locality::score(ctx, node)
}

pub(crate) fn spread(ctx: &GangContext, node: &Node) -> f64 {
    spread::score(ctx, node)
}
