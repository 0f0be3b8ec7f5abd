//! `node-selector`: every selected label must be on the node with the same value.

use super::NodeView;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    let ok = v
        .cons
        .node_selector
        .iter()
        .all(|(k, val)| v.node.labels.get(k) == Some(val));
    if ok {
        Ok(())
    } else {
        Err(Reject::NodeSelector)
    }
}
