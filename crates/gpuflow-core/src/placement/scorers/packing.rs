//! `packing`: put work where work already is. A fractional task goes to an
//! already shared GPU first; otherwise nodes with GPUs in use beat idle nodes,
//! the fuller the better.

use super::ScoreInput;
use crate::cluster::{GpuMode, GpuPick};

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let used = i
        .usage
        .gpus
        .iter()
        .filter(|u| u.mode != GpuMode::Idle)
        .count() as f64;
    let total = i.node.gpus.len().max(1) as f64;
    if let GpuPick::Shared(g) = i.pick {
        let u = &i.usage.gpus[g as usize];
        if u.mode != GpuMode::Idle {
            return 2.0 + u.milli as f64 / 1000.0;
        }
    }
    if used > 0.0 {
        1.0 + used / total
    } else {
        i.usage.cpu as f64 / i.node.cpu.0.max(1) as f64 * 0.5
    }
}
