//! A fake API server, objects to put in it and a scheduler against it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use gpuflow_k8s::fake::FakeApi;
use gpuflow_k8s::scheduler::{Scheduler, Settings};
use serde_json::{Value, json};

pub async fn server() -> (FakeApi, kube::Client) {
    let api = FakeApi::default();
    let addr = api.serve().await.expect("the fake serves");
    (api.clone(), client(addr))
}

pub fn client(addr: std::net::SocketAddr) -> kube::Client {
    let cfg = kube::Config::new(format!("http://{addr}").parse().expect("a url"));
    kube::Client::try_from(cfg).expect("a client")
}

/// Fast cycles, a short lease, no minimum runtime before preemption.
pub fn settings(identity: &str) -> Settings {
    let mut s = Settings {
        identity: identity.into(),
        interval: Duration::from_millis(100),
        lease_duration: Duration::from_secs(2),
        explain_every: Duration::ZERO,
        ..Settings::default()
    };
    s.config.min_runtime = 0;
    s
}

/// Runs a scheduler replica until the returned handle is aborted.
pub fn start(client: &kube::Client, identity: &str) -> tokio::task::JoinHandle<()> {
    let s = Scheduler::new(client.clone(), settings(identity));
    tokio::spawn(async move {
        let _ = s.run(std::future::pending()).await;
    })
}

pub fn node(name: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"}},
        "spec": {},
        "status": {
            "allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": gpus.to_string(), "pods": "110"},
            "capacity": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": gpus.to_string(), "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}]
        }
    })
}

pub fn queue(name: &str, namespaces: &[&str], guaranteed: f64) -> Value {
    json!({
        "apiVersion": "gpuflow.io/v1alpha1", "kind": "GpuQueue",
        "metadata": {"name": name},
        "spec": {"namespaces": namespaces, "quotas": {"*": {"guaranteed": guaranteed}}}
    })
}

/// A pod of gpuflow's asking for `gpus` whole GPUs.
pub fn pod(ns: &str, name: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {}, "annotations": {}},
        "spec": {
            "schedulerName": "gpuflow",
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": "registry.example.com/ml/train:1",
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                              "limits": {"nvidia.com/gpu": gpus.to_string()}}}]
        },
        "status": {"phase": "Pending"}
    })
}

/// `pod` in gang `gang` of `size` pods.
pub fn member(ns: &str, name: &str, gpus: u32, gang: &str, size: usize) -> Value {
    let mut p = pod(ns, name, gpus);
    p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = json!(gang);
    p["metadata"]["annotations"]["gpuflow.io/gang-size"] = json!(size.to_string());
    p
}

pub fn with_class(mut p: Value, class: &str) -> Value {
    p["metadata"]["annotations"]["gpuflow.io/class"] = json!(class);
    p
}

pub fn get_pod(api: &FakeApi, ns: &str, name: &str) -> Option<Value> {
    api.get("v1", "Pod", ns, name)
}

/// The node a pod is bound to.
pub fn node_of(api: &FakeApi, ns: &str, name: &str) -> Option<String> {
    get_pod(api, ns, name)?["spec"]["nodeName"]
        .as_str()
        .map(str::to_string)
}

/// The message of a pod's `PodScheduled` condition.
pub fn why(api: &FakeApi, ns: &str, name: &str) -> Option<String> {
    let p = get_pod(api, ns, name)?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")?["message"]
        .as_str()
        .map(str::to_string)
}

/// Waits up to `secs` for `cond`; panics with `what` otherwise.
pub async fn eventually(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for: {what}");
}

/// Successful bindings per pod.
pub fn binds_per_pod(api: &FakeApi) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for b in api.binds().into_iter().filter(|b| b.status == 201) {
        *out.entry(b.pod).or_default() += 1;
    }
    out
}
