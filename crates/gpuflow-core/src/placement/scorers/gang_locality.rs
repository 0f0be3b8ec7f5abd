//! `gang-locality` (context): a gang's tasks close together: on a node that
//! already has one of its tasks, else in the same rack, else in the same block.

use super::GangContext;
use crate::model::Node;

pub(crate) fn score(ctx: &GangContext, node: &Node) -> f64 {
    if ctx.placed.is_empty() {
        return 0.0;
    }
    let mut s = 0.0;
    for p in ctx.placed {
        let other = &ctx.nodes[p.0 as usize];
        s += if other.id == node.id {
            1.0
        } else if other.rack.is_some() && other.rack == node.rack {
            0.5
        } else if other.block.is_some() && other.block == node.block {
            0.25
        } else {
            0.0
        };
    }
    s / ctx.placed.len() as f64
}
