//! The crate's errors.

/// What failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused a request or could not be reached.
    #[error("the Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    /// No kubeconfig or in-cluster service account was found or usable.
    #[error("no cluster to connect to: {0}")]
    Config(#[source] kube::Error),
    /// The state kept on the lease could not be written.
    #[error("the lease's state: {0}")]
    State(#[from] serde_json::Error),
    /// A pod asked about does not exist.
    #[error("pod {0} not found")]
    NoPod(String),
    /// A benchmark's inputs or its fake server.
    #[error("{0}")]
    Bench(String),
}

/// Whether a watch failed because the service account may not list or
/// watch the resource.
pub fn forbidden(e: &kube::runtime::watcher::Error) -> bool {
    use kube::runtime::watcher::Error as W;
    match e {
        W::InitialListFailed(kube::Error::Api(s))
        | W::WatchStartFailed(kube::Error::Api(s))
        | W::WatchFailed(kube::Error::Api(s)) => s.code == 403,
        W::WatchError(s) => s.code == 403,
        _ => false,
    }
}
