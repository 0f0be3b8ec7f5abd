//! gpuflow above Kubernetes: the same scheduling core decides admission,
//! order, placement and preemption for the pods that set
//! `schedulerName: gpuflow`; Kubernetes keeps containers, nodes and device
//! plugins. See `docs/kubernetes.md`.
//!
//! - [`snapshot`]: nodes, pods, `GpuQueue`s and disruption budgets as the
//!   core's inputs (pure);
//! - [`scheduler`]: watch caches, the lease, the cycle and the writes
//!   (bindings, explanations, preemptions);
//! - [`lease`]: leader election through a `coordination.k8s.io` Lease;
//! - [`crd`]: the `GpuQueue` custom resource;
//! - [`manifests`]: the CRD, RBAC and Deployment gpuflow installs with;
//! - [`fake`]: an in-process API server speaking the wire protocol, for
//!   tests and the binding benchmark.

pub mod crd;
pub mod fake;
pub mod lease;
pub mod quantity;
pub mod scheduler;
pub mod snapshot;
