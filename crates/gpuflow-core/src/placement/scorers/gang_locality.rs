//! `gang-locality` (context): a gang's tasks close together: on a node that
//! already has one of its tasks, else in the same rack, else in the same block.

use super::{GangContext, closeness};
use crate::model::Node;

pub(crate) fn score(ctx: &GangContext, node: &Node) -> f64 {
    closeness(ctx, node, [1.0, 0.5, 0.25, 0.0])
}
