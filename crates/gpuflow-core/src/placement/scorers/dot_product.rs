//! `dot-product`: Tetris-style alignment: the dot product of the task's request
//! and the node's free resources, both as shares of the node's capacity.

use super::ScoreInput;

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let cpu_cap = i.node.cpu.0.max(1) as f64;
    let gpu_cap = (i.node.gpus.len().max(1) * 1000) as f64;
    let free_cpu = i.node.cpu.0.saturating_sub(i.usage.cpu) as f64 / cpu_cap;
    let free_gpu: u64 = i.free_before.iter().map(|&m| m as u64).sum();
    let req_cpu = i.req.cpu.0 as f64 / cpu_cap;
    let req_gpu = i.req.gpu.milli() as f64 / gpu_cap;
    req_cpu * free_cpu + req_gpu * (free_gpu as f64 / gpu_cap)
}
