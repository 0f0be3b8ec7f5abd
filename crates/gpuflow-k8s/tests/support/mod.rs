//! A fake API server, objects to put in it and a scheduler against it.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use gpuflow_k8s::fake::FakeApi;
use gpuflow_k8s::scheduler::{Scheduler, Settings};
use serde_json::{Value, json};

pub(crate) async fn server() -> (FakeApi, kube::Client) {
    let api = FakeApi::default();
    let addr = api.serve().await.expect("the fake serves");
    (api.clone(), client(addr))
}

pub(crate) fn client(addr: std::net::SocketAddr) -> kube::Client {
    let cfg = kube::Config::new(format!("http://{addr}").parse().expect("a url"));
    kube::Client::try_from(cfg).expect("a client")
}

/// Fast cycles, a short lease, no minimum runtime before preemption.
pub(crate) fn settings(identity: &str) -> Settings {
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
pub(crate) fn start(client: &kube::Client, identity: &str) -> tokio::task::JoinHandle<()> {
    let s = Scheduler::new(client.clone(), settings(identity));
    tokio::spawn(async move {
        let _ = s.run(std::future::pending()).await;
    })
}

pub(crate) fn node(name: &str, gpus: u32) -> Value {
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

pub(crate) fn queue(name: &str, namespaces: &[&str], guaranteed: f64) -> Value {
    json!({
        "apiVersion": "gpuflow.io/v1alpha1", "kind": "GpuQueue",
        "metadata": {"name": name},
        "spec": {"namespaces": namespaces, "quotas": {"*": {"guaranteed": guaranteed}}}
    })
}

/// Two nodes of 4 GPUs, queues `team-a` (namespace `a`) and `team-b`
/// (namespace `b`) guaranteed 4 each, and team-b's pods `b-0` and `b-1` of
/// 4 GPUs each: once both are bound, team-b borrows team-a's GPUs.
pub(crate) fn borrower_of_idle_gpus(api: &FakeApi) {
    api.apply(node("n1", 4));
    api.apply(node("n2", 4));
    api.apply(queue("team-a", &["a"], 4.0));
    api.apply(queue("team-b", &["b"], 4.0));
    api.apply(pod("b", "b-0", 4));
    api.apply(pod("b", "b-1", 4));
}

/// A pod of gpuflow's asking for `gpus` whole GPUs.
pub(crate) fn pod(ns: &str, name: &str, gpus: u32) -> Value {
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
pub(crate) fn member(ns: &str, name: &str, gpus: u32, gang: &str, size: usize) -> Value {
    let mut p = pod(ns, name, gpus);
    p["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = json!(gang);
    p["metadata"]["annotations"]["gpuflow.io/gang-size"] = json!(size.to_string());
    p
}

pub(crate) fn with_class(mut p: Value, class: &str) -> Value {
    p["metadata"]["annotations"]["gpuflow.io/class"] = json!(class);
    p
}

pub(crate) fn get_pod(api: &FakeApi, ns: &str, name: &str) -> Option<Value> {
    api.get("v1", "Pod", ns, name)
}

/// The node a pod is bound to.
pub(crate) fn node_of(api: &FakeApi, ns: &str, name: &str) -> Option<String> {
    get_pod(api, ns, name)?["spec"]["nodeName"]
        .as_str()
        .map(str::to_string)
}

/// The message of a pod's `PodScheduled` condition.
pub(crate) fn why(api: &FakeApi, ns: &str, name: &str) -> Option<String> {
    let p = get_pod(api, ns, name)?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "PodScheduled" && c["status"] == "False")?["message"]
        .as_str()
        .map(str::to_string)
}

/// Waits up to `secs` for `cond`; panics with `what` otherwise.
pub(crate) async fn eventually(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
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
pub(crate) fn binds_per_pod(api: &FakeApi) -> std::collections::BTreeMap<String, usize> {
    let mut out = std::collections::BTreeMap::new();
    for b in api.binds().into_iter().filter(|b| b.status == 201) {
        *out.entry(b.pod).or_default() += 1;
    }
    out
}

/// A node whose GPUs HAMi's device plugin shares: its registration lists
/// `gpus` (UUID, memory in MiB), each split into 10 shares, and the node
/// advertises the shares as `nvidia.com/gpu`.
pub(crate) fn hami_node(name: &str, gpus: &[(&str, u64)]) -> Value {
    let mut n = node(name, 10 * gpus.len() as u32);
    let register: String = gpus
        .iter()
        .enumerate()
        .map(|(i, (uuid, mem))| {
            format!("{uuid},10,{mem},100,NVIDIA-H100-80GB-HBM3,0,true,{i},hami-core:")
        })
        .collect();
    n["metadata"]["annotations"] = json!({"hami.io/node-nvidia-register": register});
    n
}

/// A pod of gpuflow's asking for a share of one GPU: `mem` MiB of its
/// memory and `cores` percent of its compute (HAMi's resources).
pub(crate) fn share_pod(ns: &str, name: &str, mem: u64, cores: u32) -> Value {
    let mut p = with_class(pod(ns, name, 1), "notebook");
    p["spec"]["containers"][0]["resources"]["limits"] = json!({
        "nvidia.com/gpu": "1", "nvidia.com/gpumem": mem.to_string(),
        "nvidia.com/gpucores": cores.to_string()});
    p
}

/// What a HAMi device plugin double saw: each allocation (pod, UUID, MiB,
/// cores) and each breach of the protocol.
#[derive(Default)]
pub(crate) struct PluginLog {
    pub allocations: Vec<(String, String, u64, u32)>,
    pub breaches: Vec<String>,
}

/// HAMi's device plugin on `node`, as far as the scheduler's side of the
/// protocol goes: for a pod bound there and marked `allocating`, it checks
/// that the node lock names the pod, takes the devices of the pod's
/// decision, marks the pod `success` and unlocks the node.
pub(crate) fn hami_plugin(
    api: &FakeApi,
    node: &str,
) -> (
    tokio::task::JoinHandle<()>,
    std::sync::Arc<std::sync::Mutex<PluginLog>>,
) {
    let log = std::sync::Arc::new(std::sync::Mutex::new(PluginLog::default()));
    let (api, node, out) = (api.clone(), node.to_string(), log.clone());
    let task = tokio::spawn(async move {
        loop {
            for mut p in api.list("v1", "Pod") {
                let ann = &p["metadata"]["annotations"];
                if p["spec"]["nodeName"] != json!(node)
                    || ann["hami.io/bind-phase"] != json!("allocating")
                {
                    continue;
                }
                let name = p["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let ns = p["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let mut log = out.lock().unwrap();
                if ann["hami.io/vgpu-node"] != json!(node) {
                    log.breaches
                        .push(format!("{name}: hami.io/vgpu-node is not {node}"));
                }
                let mut n = api.get("v1", "Node", "", &node).unwrap();
                let lock = n["metadata"]["annotations"]["hami.io/mutex.lock"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                if !lock.ends_with(&format!(",{ns},{name}")) {
                    log.breaches
                        .push(format!("{name}: the node lock is {lock:?}"));
                }
                let decision = ann["hami.io/vgpu-devices-to-allocate"]
                    .as_str()
                    .unwrap_or_default();
                let devices = gpuflow_k8s::hami::decode(decision);
                if devices.is_empty() {
                    log.breaches.push(format!("{name}: no devices to allocate"));
                }
                for d in devices {
                    log.allocations
                        .push((name.clone(), d.uuid, d.mem_mib, d.cores));
                }
                drop(log);
                p["metadata"]["annotations"]["hami.io/bind-phase"] = json!("success");
                api.apply(p);
                n["metadata"]["annotations"]
                    .as_object_mut()
                    .unwrap()
                    .remove("hami.io/mutex.lock");
                api.apply(n);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    (task, log)
}
