//! `clustering`: keep tasks of one kind together (Gandiva-like affinity), so
//! that small shared tasks do not spread over nodes that big tasks need. Four
//! tiers, best first: nodes hosting only this kind, nodes hosting this kind
//! among others, idle nodes, nodes hosting other kinds; inside a tier, fuller
//! nodes first. Tasks that need no GPU are placed anywhere.

use super::ScoreInput;
use crate::cluster::shape_kind;

pub(crate) fn score(i: &ScoreInput) -> f64 {
    let kind = shape_kind(&i.req.gpu);
    // Tasks without GPUs have no affinity and do not give nodes one.
    if kind == 0 {
        return 0.0;
    }
    let kinds = i.usage.kinds.iter().skip(1).filter(|&&c| c > 0).count();
    let tier = if i.usage.kinds[kind] > 0 {
        if kinds == 1 { 3.0 } else { 2.0 }
    } else if kinds == 0 {
        1.0
    } else {
        0.0
    };
    let free: u64 = i.free_before.iter().map(|&m| m as u64).sum();
    let used = 1.0 - free as f64 / (i.node.gpus.len().max(1) * 1000) as f64;
    tier + used.clamp(0.0, 1.0) * 0.99
}
