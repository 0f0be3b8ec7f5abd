//! `scarcity`: keep scarce GPU models for the work that can run nowhere else.
//! Each model has a *pressure*: the GPU demand of mix shapes restricted to a
//! set of models that includes it (shared among the set), divided by the
//! model's share of the cluster's GPUs. A pick costs the pressure of the models
//! it takes, per GPU taken. Work that accepts only one model pays the same
//! everywhere it can go, so the rule only steers work that has a choice.

use super::ScoreInput;
use crate::cluster::GpuPick;

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let taken = |g: usize| (i.free_before[g] - i.free_after[g]) as f64 / 1000.0;
    let pressure = |g: usize| {
        let model = &i.node.gpus[g].model;
        i.pressure
            .iter()
            .find(|(m, _)| m == model)
            .map_or(0.0, |(_, p)| *p)
    };
    let cost: f64 = match i.pick {
        GpuPick::Whole(mask) => (0..i.node.gpus.len())
            .filter(|g| mask & (1 << g) != 0)
            .map(|g| pressure(g) * taken(g))
            .sum(),
        GpuPick::Shared(g) | GpuPick::Mig { gpu: g, .. } => {
            pressure(g as usize) * taken(g as usize)
        }
        GpuPick::None => 0.0,
    };
    -cost
}
