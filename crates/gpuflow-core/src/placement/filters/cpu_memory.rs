//! `cpu` and `memory`: the node's free CPU and host memory cover the task.

use super::NodeView;
use crate::placement::Reject;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    if v.usage.cpu + v.req.cpu.0 > v.node.cpu.0 {
        Err(Reject::Cpu)
    } else if v.usage.mem + v.req.mem.0 > v.node.mem.0 {
        Err(Reject::Memory)
    } else {
        Ok(())
    }
}
