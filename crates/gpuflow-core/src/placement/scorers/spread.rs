//! `spread` (context): replicas of a service apart: a node that already has a
//! replica scores lowest, one in the same rack next, anything else best.

use super::{GangContext, closeness};
use crate::model::Node;

pub(crate) fn score(ctx: &GangContext, node: &Node) -> f64 {
    closeness(ctx, node, [-1.0, -0.5, 0.0, 0.0])
}
