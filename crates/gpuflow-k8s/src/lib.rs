//! gpuflow above Kubernetes: the same scheduling core decides admission,
//! order, placement and preemption for the pods that set
//! `schedulerName: gpuflow`; Kubernetes keeps containers, nodes and device
//! plugins. See `docs/kubernetes.md`.
//!
//! - [`snapshot`]: nodes, pods, `GpuQueue`s and disruption budgets as the
//!   core's inputs (pure);
//! - [`scheduler`]: watch caches, the lease, the cycle and the writes
//!   (bindings, explanations, preemptions);
//! - [`hami`]: HAMi's protocol for shares of a GPU with memory and compute
//!   limits (node registration, pod decision, node lock);
//! - [`lease`]: leader election through a `coordination.k8s.io` Lease;
//! - [`health`]: readiness, liveness and Prometheus metrics;
//! - [`crd`]: the `GpuQueue` custom resource;
//! - [`manifests`]: the CRD, RBAC and Deployment gpuflow installs with;
//! - [`fake`]: an in-process API server speaking the wire protocol, for
//!   tests and the binding benchmark ([`bench`]).

#![forbid(unsafe_code)]

#[cfg(feature = "testing")]
pub mod bench;

pub use error::Error;
pub mod crd;
pub mod error;
#[cfg(feature = "testing")]
pub mod fake;
pub mod hami;
pub mod health;
pub mod lease;
pub mod manifests;
pub mod quantity;
pub mod report;
pub mod scheduler;
pub mod snapshot;

/// A client from the kubeconfig (`KUBECONFIG`, `~/.kube/config`) or the
/// pod's service account, with TLS through ring (the one provider the
/// workspace builds).
///
/// # Errors
/// When neither is found or usable.
pub async fn connect() -> Result<kube::Client, Error> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    kube::Client::try_default().await.map_err(Error::Config)
}

/// Why a pod waits, as gpuflow last explained it (`gpuflow k8s why`): its
/// node when bound, else its `PodScheduled` condition, or what keeps
/// gpuflow from looking at it.
///
/// # Errors
/// When the pod cannot be read.
pub async fn why(
    client: kube::Client,
    namespace: &str,
    name: &str,
    scheduler_name: &str,
) -> Result<String, Error> {
    use k8s_openapi::api::core::v1::Pod;
    let api: kube::Api<Pod> = kube::Api::namespaced(client, namespace);
    let pod = api
        .get_opt(name)
        .await?
        .ok_or_else(|| Error::NoPod(format!("{namespace}/{name}")))?;
    let spec = pod.spec.clone().unwrap_or_default();
    if let Some(node) = spec.node_name.filter(|n| !n.is_empty()) {
        return Ok(format!("{namespace}/{name} is bound to node {node}"));
    }
    let theirs = spec
        .scheduler_name
        .unwrap_or_else(|| "default-scheduler".into());
    if theirs != scheduler_name {
        return Ok(format!(
            "{namespace}/{name} is not gpuflow's: its schedulerName is {theirs}; set spec.schedulerName: {scheduler_name}"
        ));
    }
    let condition = pod
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False");
    Ok(match condition.and_then(|c| c.message) {
        Some(m) => format!(
            "{namespace}/{name} waits: {}",
            m.trim_start_matches("gpuflow: ")
        ),
        None => format!(
            "{namespace}/{name} waits: gpuflow has not explained it yet (is a gpuflow scheduler running and leading?)"
        ),
    })
}
