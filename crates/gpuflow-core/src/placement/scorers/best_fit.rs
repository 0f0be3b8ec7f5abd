//! `best-fit`: the node left with the least CPU and GPU after placement wins;
//! on it, the tightest GPU. CPU and GPU leftovers are normalised by the largest
//! node's capacity and weighted equally, as in the FGD paper's baseline.

use super::ScoreInput;

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let cpu_left = i.node.cpu.0.saturating_sub(i.usage.cpu + i.req.cpu.0) as f64 / i.norm.cpu;
    let gpu_left: u64 = i.free_after.iter().map(|&m| m as u64).sum();
    let node_term = (cpu_left + gpu_left as f64 / i.norm.gpu_milli) / 2.0;
    // Tightest GPU: the picked GPU's leftover, as a much smaller term.
    let pick_left = match i.pick {
        crate::cluster::GpuPick::Shared(g) => i.free_after[g as usize] as f64 / 1000.0,
        _ => 0.0,
    };
    -(node_term + pick_left * 1e-3)
}
