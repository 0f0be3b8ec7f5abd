//! gpuflow's scheduling core: the domain model, the placement of gangs on
//! shared, heterogeneous GPUs, and the scheduling cycle (queues, quotas,
//! fair share, preemption, backfill, explanations).
//!
//! This crate is pure and deterministic: it does no I/O, runs no async code,
//! reads no clock and uses no global randomness (random choices come from a
//! generator seeded by the caller). Equal inputs give equal outputs. A job that
//! cannot be placed is data ([`Unplaced`]), never an error; [`CoreError`] is for
//! inputs that do not describe a valid cluster.
//!
//! Time is an input (the cycle's `now`), never read. It does not know about
//! HTTP, storage, agents or Kubernetes; those are edges around it.

#![forbid(unsafe_code)]
// `Unplaced` is the explanation of a job that waits: ordinary data returned in
// `Err`, not a rare failure, so it is not boxed.
#![allow(clippy::result_large_err)]

pub mod cluster;
mod error;
pub mod ids;
pub mod mix;
pub mod model;
pub mod placement;
pub mod policy;
pub mod queue;
pub mod request;
pub mod rng;
pub mod schedule;
mod total;

pub use cluster::{Allocation, Cluster, GpuMode, GpuPick, GpuUsage, NodeUsage};
pub use error::CoreError;
pub use ids::{CpuMilli, GpuMilli, JobId, MemMib, NodeId, TaskId};
pub use mix::{MixWeighting, WorkloadMix};
pub use model::{Gpu, GpuHealth, MigInstance, Node, NodeState, Taint};
pub use placement::{Placement, Placer, Reject, Unplaced};
pub use policy::{PickChoice, Policy, TieBreak};
pub use request::{Constraints, GpuRequest, Job, TaskGroup, TaskRequest, Topology, TopologyLevel};
pub use rng::SplitMix64;
