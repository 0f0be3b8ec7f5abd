//! `taints`: a tainted node takes only work that tolerates each of its taint keys.

use super::NodeView;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    let ok = v
        .node
        .taints
        .iter()
        .all(|t| v.cons.tolerations.contains(&t.key));
    if ok { Ok(()) } else { Err(Reject::Taint) }
}
