//! Wire types of gpuflow's `/v1` HTTP API and their validation: the one
//! stability boundary between the server, the agent and the CLI. This crate
//! knows nothing of the scheduling core or the store; it only says what may be
//! sent and what comes back.

#![forbid(unsafe_code)]

pub mod depend;
pub mod error;
pub mod job;
pub mod wire;

pub use depend::{DepKind, DepTarget, DepTerm, Dependency, OnUnmet};
pub use error::{ApiError, FieldError};
pub use job::{
    ArraySpec, GpuMode, GpuSpec, IdleAction, IdleSpec, JobSpec, Kind, MAX_ARRAY, Resources,
    TaskGroupSpec,
};
pub use wire::*;
