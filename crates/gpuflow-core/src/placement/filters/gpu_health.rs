//! `gpu-health`: unhealthy GPUs take no new work. A node whose accepted GPUs
//! would be enough when healthy, but are not enough counting healthy ones only,
//! is rejected here so that the explanation names health rather than capacity.

use super::NodeView;
use crate::model::GpuHealth;
use crate::placement::Reject;
use crate::request::GpuRequest;

pub(crate) fn check(v: &NodeView) -> Result<(), Reject> {
    let need = match &v.req.gpu {
        GpuRequest::None => return Ok(()),
        GpuRequest::Whole { count } => *count as usize,
        _ => 1,
    };
    let eligible = v.node.gpus.iter().filter(|g| v.gpu_eligible(g));
    let (mut all, mut healthy) = (0, 0);
    for g in eligible {
        all += 1;
        healthy += (g.health == GpuHealth::Healthy) as usize;
    }
    if all >= need && healthy < need {
        Err(Reject::GpuHealth)
    } else {
        Ok(())
    }
}
