//! `gpu-locality`: a multi-GPU pick inside one NVLink island (or, without
//! NVLink, one NUMA node) scores 1; spread over k groups, 1/k.

use super::ScoreInput;
use crate::cluster::GpuPick;

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let GpuPick::Whole(mask) = i.pick else {
        return 1.0;
    };
    let mut groups: Vec<u16> = Vec::new();
    for (g, gpu) in i.node.gpus.iter().enumerate() {
        if mask & (1 << g) != 0 {
            let key = match i.islands.get(g).copied().flatten() {
                Some(island) => island as u16,
                None => 256 + gpu.numa as u16,
            };
            if !groups.contains(&key) {
                groups.push(key);
            }
        }
    }
    1.0 / groups.len().max(1) as f64
}
