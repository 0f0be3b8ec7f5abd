//! `pool`: a job that names a pool runs only on that pool's nodes.

use super::NodeView;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    match &v.cons.pool {
        Some(p) if *p != v.node.pool => Err(Reject::Pool),
        _ => Ok(()),
    }
}
