//! `balance`: keep CPU where the GPUs are. Under the workload mix, each GPU
//! needs on average some CPU; free GPU capacity beyond what a node's free CPU
//! can serve at that ratio is likely to be stranded. The score is minus the
//! growth of that stranded capacity caused by the pick, in GPUs.

use super::ScoreInput;

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let ratio = i.mix.gpu_milli_per_cpu_milli();
    if ratio <= 0.0 {
        return 0.0;
    }
    let cpu_before = i.node.cpu.0.saturating_sub(i.usage.cpu) as f64;
    let cpu_after = i.node.cpu.0.saturating_sub(i.usage.cpu + i.req.cpu.0) as f64;
    let gpu_before: f64 = i.free_before.iter().map(|&m| m as f64).sum();
    let gpu_after: f64 = i.free_after.iter().map(|&m| m as f64).sum();
    let stranded = |gpu: f64, cpu: f64| (gpu - cpu * ratio).max(0.0);
    -(stranded(gpu_after, cpu_after) - stranded(gpu_before, cpu_before)) / 1000.0
}
