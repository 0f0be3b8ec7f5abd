//! `node-state`: only ready nodes take new work.

use super::NodeView;
use crate::model::NodeState;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    match v.node.state {
        NodeState::Ready => Ok(()),
        s => Err(Reject::NodeState(s)),
    }
}
