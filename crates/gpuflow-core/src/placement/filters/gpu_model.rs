//! `gpu-model`: a task that needs a GPU needs a node with a GPU of an accepted
//! model (and, under an NVLink constraint, inside the domain being tried).

use super::NodeView;
use crate::placement::Reject;
use crate::request::GpuRequest;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    if v.req.gpu == GpuRequest::None || v.node.gpus.iter().any(|g| v.gpu_eligible(g)) {
        Ok(())
    } else {
        Err(Reject::GpuModel)
    }
}
