//! The core's one error type. Scheduling itself never fails: a job that cannot be
//! placed is data (see [`crate::placement::Unplaced`]); these errors are for
//! inputs that do not describe a valid cluster.

/// What is wrong with a cluster or workload description given to the core.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CoreError {
    #[error("node {name} has id {id}, expected {expected}: node ids must be 0..n in list order")]
    NodeIdOrder {
        name: String,
        id: u32,
        expected: u32,
    },
    #[error("node name {0} appears twice: node names must be unique")]
    DuplicateNode(String),
    #[error("node {name} has {count} GPUs: at most 64 GPUs per node are supported")]
    TooManyGpus { name: String, count: usize },
    #[error("node {name} has a GPU with {count} MIG instances: at most 32 are supported")]
    TooManyMigInstances { name: String, count: usize },
    #[error("invalid policy {spec:?}: {why}")]
    BadPolicy { spec: String, why: String },
}
