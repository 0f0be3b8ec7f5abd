//! Filters: yes-or-no rules, each in its own module, run in the order of
//! [`FILTERS`] (cheap static checks first). The first "no" is the node's reason.
//! GPU capacity is the last filter and also yields the candidate GPU picks.

mod cpu_memory;
mod gpu_capacity;
mod gpu_health;
mod gpu_model;
mod node_selector;
mod node_state;
mod pool;
mod reservation;
mod taints;

pub(crate) use gpu_capacity::picks;

use crate::cluster::NodeUsage;
use crate::model::{Gpu, Node};
use crate::placement::Reject;
use crate::request::{Constraints, TaskRequest};

/// What a filter sees: one node, its usage, one task and the job's constraints.
pub(crate) struct NodeView<'a> {
    pub node: &'a Node,
    pub usage: &'a NodeUsage,
    pub islands: &'a [Option<u8>],
    pub req: &'a TaskRequest,
    pub cons: &'a Constraints,
    /// When set, only GPUs in this NVLink domain may be used.
    pub nvlink_scope: Option<&'a str>,
    /// The node's reservation slot (0: none).
    pub reserved: u8,
}

impl NodeView<'_> {
    /// Whether a GPU is of a model the task accepts and inside the NVLink scope.
    pub(crate) fn gpu_eligible(&self, g: &Gpu) -> bool {
        (self.req.models.is_empty() || self.req.models.contains(&g.model))
            && self
                .nvlink_scope
                .is_none_or(|s| g.nvlink.as_deref() == Some(s))
    }
}

type Filter = fn(&NodeView) -> Result<(), Reject>;

/// The filter pipeline, in order: first the filters that read only the
/// node's static shape (its state, reservation slot, pool, labels, taints
/// and GPUs), then the one that reads its usage.
pub(crate) const FILTERS: &[Filter] = &[
    node_state::check,
    reservation::check,
    pool::check,
    node_selector::check,
    taints::check,
    gpu_model::check,
    gpu_health::check,
    cpu_memory::check,
];

/// How many of [`FILTERS`] read only the node's static shape (and, through
/// the NVLink scope, the domain being tried).
const STATIC_FILTERS: usize = 7;

/// Runs every filter; `Ok` when the node passes them all.
pub(crate) fn run(view: &NodeView) -> Result<(), Reject> {
    FILTERS.iter().try_for_each(|f| f(view))
}

/// The filters that read only the node's static shape: nodes of one static
/// shape get the same answer for one request, constraints and NVLink scope.
pub(crate) fn run_static(view: &NodeView) -> Result<(), Reject> {
    FILTERS[..STATIC_FILTERS].iter().try_for_each(|f| f(view))
}

/// The filters that read the node's usage, after [`run_static`].
pub(crate) fn run_usage(view: &NodeView) -> Result<(), Reject> {
    FILTERS[STATIC_FILTERS..].iter().try_for_each(|f| f(view))
}
