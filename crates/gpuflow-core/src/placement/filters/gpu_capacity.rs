//! `gpu-capacity`: free capacity in the requested sharing mode, and the GPU picks
//! that provide it. The sharing rules live here:
//! - an exclusive GPU carries nothing else; whole-GPU work needs idle GPUs;
//! - fractional tasks share a GPU within its 1000 milli of compute and its memory;
//! - time-sliced tasks share a GPU up to its slice limit (and its memory);
//! - a MIG instance is a unit of its own, and a GPU in MIG mode serves only MIG work;
//! - sharing modes never mix on one GPU, and unhealthy GPUs take nothing.
//!
//! Picks of equivalent GPUs (same usage) are given once, so scorers compare only
//! choices that differ.

use super::NodeView;
use crate::cluster::{GpuMode, GpuPick, GpuUsage};
use crate::model::GpuHealth;
use crate::request::GpuRequest;

/// Fills `out` with the distinct ways the task can get its GPUs on this node,
/// each with how many GPUs it stands for; empty when it cannot.
pub(crate) fn picks(v: &NodeView, out: &mut Vec<(GpuPick, u16)>) {
    out.clear();
    let usable = |i: usize| {
        let g = &v.node.gpus[i];
        g.health == GpuHealth::Healthy && v.gpu_eligible(g)
    };
    match &v.req.gpu {
        GpuRequest::None => out.push((GpuPick::None, 1)),
        GpuRequest::Whole { count } => {
            if let Some(mask) = whole(v, *count as usize, &usable) {
                out.push((GpuPick::Whole(mask), 1));
            }
        }
        GpuRequest::Fraction { milli, mem } => {
            let mut seen: Vec<GpuUsage> = Vec::new();
            for (i, (g, u)) in v.node.gpus.iter().zip(&v.usage.gpus).enumerate() {
                if usable(i)
                    && !g.mig_enabled()
                    && matches!(u.mode, GpuMode::Idle | GpuMode::Fractional)
                    && u.milli + milli.0 <= 1000
                    && u.mem + mem.0 <= g.mem.0
                {
                    add(&mut seen, out, *u, GpuPick::Shared(i as u8));
                }
            }
        }
        GpuRequest::TimeSlice { mem } => {
            let mut seen: Vec<GpuUsage> = Vec::new();
            for (i, (g, u)) in v.node.gpus.iter().zip(&v.usage.gpus).enumerate() {
                if usable(i)
                    && !g.mig_enabled()
                    && matches!(u.mode, GpuMode::Idle | GpuMode::TimeSliced)
                    && u.tasks < g.time_slices
                    && u.mem + mem.0 <= g.mem.0
                {
                    add(&mut seen, out, *u, GpuPick::Shared(i as u8));
                }
            }
        }
        GpuRequest::Mig { profile } => {
            let mut seen: Vec<GpuUsage> = Vec::new();
            for (i, (g, u)) in v.node.gpus.iter().zip(&v.usage.gpus).enumerate() {
                if !usable(i) {
                    continue;
                }
                let free = g
                    .mig
                    .iter()
                    .enumerate()
                    .find(|(k, m)| m.profile == *profile && u.mig_used & (1 << k) == 0);
                if let Some((k, _)) = free {
                    add(
                        &mut seen,
                        out,
                        *u,
                        GpuPick::Mig {
                            gpu: i as u8,
                            instance: k as u8,
                        },
                    );
                }
            }
        }
    }
}

/// Adds a pick, or counts it with an earlier pick of a GPU in the same state.
fn add(seen: &mut Vec<GpuUsage>, out: &mut Vec<(GpuPick, u16)>, usage: GpuUsage, pick: GpuPick) {
    match seen.iter().position(|s| *s == usage) {
        Some(i) => out[i].1 += 1,
        None => {
            seen.push(usage);
            out.push((pick, 1));
        }
    }
}

/// Chooses `count` idle GPUs, keeping them close: inside the tightest local
/// NVLink island that has enough of them, else on as few NUMA nodes as possible.
fn whole(v: &NodeView, count: usize, usable: &dyn Fn(usize) -> bool) -> Option<u64> {
    if count == 0 {
        return Some(0);
    }
    let free: Vec<usize> = (0..v.node.gpus.len())
        .filter(|&i| {
            usable(i) && !v.node.gpus[i].mig_enabled() && v.usage.gpus[i].mode == GpuMode::Idle
        })
        .collect();
    if free.len() < count {
        return None;
    }
    // Group the free GPUs: by NVLink island where there is one, else by NUMA node.
    let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
    for &i in &free {
        let key = match v.islands.get(i).copied().flatten() {
            Some(island) => island as u16,
            None => 256 + v.node.gpus[i].numa as u16,
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    // The tightest single group that fits, else the largest groups first.
    let chosen: Vec<usize> = match groups
        .iter()
        .filter(|(_, g)| g.len() >= count)
        .min_by_key(|(k, g)| (g.len(), *k))
    {
        Some((_, g)) => g[..count].to_vec(),
        None => {
            groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
            groups
                .into_iter()
                .flat_map(|(_, g)| g)
                .take(count)
                .collect()
        }
    };
    Some(chosen.iter().fold(0u64, |m, &i| m | (1 << i)))
}
