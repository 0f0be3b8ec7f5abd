//! Shares of GPUs with memory and compute limits through HAMi's protocol,
//! against the fake API server and a double of HAMi's device plugin.

mod support;

use serde_json::json;
use support::*;

const MEM: u64 = 81559;

/// Per GPU UUID, the MiB every pod on it was given.
fn memory_per_gpu(
    log: &PluginLog,
    others: &[(&str, u64)],
) -> std::collections::BTreeMap<String, u64> {
    let mut out = std::collections::BTreeMap::new();
    for (_, uuid, mem, _) in &log.allocations {
        *out.entry(uuid.clone()).or_default() += mem;
    }
    for (uuid, mem) in others {
        *out.entry(uuid.to_string()).or_default() += mem;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_of_a_gpu_get_hamis_annotations_and_never_overfill_its_memory() {
    let (api, client) = server().await;
    api.apply(hami_node("h1", &[("GPU-a", MEM), ("GPU-b", MEM)]));
    // A node without HAMi: shares with limits never go there.
    api.apply(node("plain", 1));
    // A node whose registration does not parse: its ten advertised shares
    // are not ten GPUs, and nothing GPU-bound goes there.
    let mut bad = hami_node("bad", &[("GPU-x", MEM)]);
    bad["metadata"]["annotations"]["hami.io/node-nvidia-register"] = json!("GPU-x,10,lots:");
    api.apply(bad);
    api.apply(queue("ml", &["ml"], 4.0));
    // HAMi's own scheduler placed a pod on GPU-b with 50,000 MiB.
    let mut theirs = pod("ml", "theirs", 1);
    theirs["spec"]["schedulerName"] = json!("hami-scheduler");
    theirs["spec"]["nodeName"] = json!("h1");
    theirs["status"]["phase"] = json!("Running");
    theirs["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = json!("50000");
    let d = "GPU-b,NVIDIA,50000,0:;";
    theirs["metadata"]["annotations"] = json!({
        "hami.io/vgpu-node": "h1", "hami.io/vgpu-devices-allocated": d,
        "hami.io/bind-phase": "success"});
    api.apply(theirs);
    for i in 0..4 {
        api.apply(share_pod("ml", &format!("nb-{i}"), 30000, 30));
    }
    api.apply(pod("ml", "train", 1));
    api.apply(pod("ml", "train-2", 1));
    let (_plugin, log) = hami_plugin(&api, "h1");
    let _s = start(&client, "r1");
    // GPU-a takes two shares (60,000 MiB), GPU-b one (50,000 + 30,000).
    eventually(15, "three shares bound and allocated on h1", || {
        log.lock().unwrap().allocations.len() == 3
    })
    .await;
    eventually(10, "the fourth share explained", || {
        (0..4).any(|i| why(&api, "ml", &format!("nb-{i}")).is_some())
    })
    .await;
    eventually(10, "one whole-GPU pod on the plain node", || {
        ["train", "train-2"]
            .iter()
            .any(|p| node_of(&api, "ml", p).as_deref() == Some("plain"))
    })
    .await;
    {
        let log = log.lock().unwrap();
        assert!(log.breaches.is_empty(), "{:?}", log.breaches);
        for (uuid, used) in memory_per_gpu(&log, &[("GPU-b", 50000)]) {
            assert!(used <= MEM, "{uuid} holds {used} MiB of {MEM}");
        }
        for (pod, uuid, mem, cores) in &log.allocations {
            assert!(pod.starts_with("nb-"), "{pod}");
            assert!(uuid == "GPU-a" || uuid == "GPU-b", "{uuid}");
            assert_eq!((*mem, *cores), (30000, 30));
        }
    }
    let on = |n: &str| {
        (0..4)
            .filter(|i| node_of(&api, "ml", &format!("nb-{i}")).as_deref() == Some(n))
            .count()
    };
    assert_eq!((on("h1"), on("plain"), on("bad")), (3, 0, 0));
    // Whole GPUs: one on the plain node; h1's GPUs are shared, and "bad"
    // has none.
    assert!(
        ["train", "train-2"]
            .iter()
            .all(|p| node_of(&api, "ml", p).is_none_or(|n| n == "plain"))
    );
    // The device plugin unlocks the node after the last allocation (the
    // double logs an allocation before it unlocks, so wait for it: a
    // check right after the third allocation raced it under load).
    eventually(10, "h1 unlocked after the last allocation", || {
        let h1 = api.get("v1", "Node", "", "h1").unwrap();
        h1["metadata"]["annotations"]["hami.io/mutex.lock"].is_null()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_gpu_on_a_hami_node_gets_all_its_memory_and_compute() {
    let (api, client) = server().await;
    api.apply(hami_node("h1", &[("GPU-a", MEM), ("GPU-b", MEM)]));
    api.apply(queue("ml", &["ml"], 4.0));
    api.apply(pod("ml", "train", 2));
    let (_plugin, log) = hami_plugin(&api, "h1");
    let _s = start(&client, "r1");
    eventually(10, "the pod allocated", || {
        log.lock().unwrap().allocations.len() == 2
    })
    .await;
    let log = log.lock().unwrap();
    assert!(log.breaches.is_empty(), "{:?}", log.breaches);
    let mut got: Vec<_> = log
        .allocations
        .iter()
        .map(|(_, u, m, c)| (u.clone(), *m, *c))
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![("GPU-a".into(), MEM, 100), ("GPU-b".into(), MEM, 100)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_node_lock_makes_the_pod_wait_and_a_stale_one_is_broken() {
    let (api, client) = server().await;
    let mut h1 = hami_node("h1", &[("GPU-a", MEM)]);
    // Another scheduler's pod holds the lock now; it exists.
    let now =
        k8s_openapi::jiff::Timestamp::from_second(k8s_openapi::jiff::Timestamp::now().as_second())
            .unwrap();
    h1["metadata"]["annotations"]["hami.io/mutex.lock"] = json!(format!("{now},other,holder"));
    api.apply(h1.clone());
    let mut holder = pod("other", "holder", 0);
    holder["spec"]["schedulerName"] = json!("hami-scheduler");
    api.apply(holder);
    api.apply(queue("ml", &["ml"], 4.0));
    api.apply(share_pod("ml", "nb", 10000, 0));
    let _s = start(&client, "r1");
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert_eq!(
        node_of(&api, "ml", "nb"),
        None,
        "bound under another pod's lock"
    );
    // The lock's pod goes away: the lock is dangling and broken.
    api.remove("v1", "Pod", "other", "holder");
    let (_plugin, log) = hami_plugin(&api, "h1");
    eventually(10, "bound once the lock's pod is gone", || {
        node_of(&api, "ml", "nb").as_deref() == Some("h1")
    })
    .await;
    eventually(10, "allocated", || {
        log.lock().unwrap().allocations.len() == 1
    })
    .await;
    let log = log.lock().unwrap();
    assert!(log.breaches.is_empty(), "{:?}", log.breaches);
    // A share without a compute limit is given none (cores 0).
    assert_eq!(log.allocations[0].2, 10000);
    assert_eq!(log.allocations[0].3, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_shares_are_refused_with_what_to_change() {
    let (api, client) = server().await;
    api.apply(hami_node("h1", &[("GPU-a", MEM)]));
    api.apply(queue("ml", &["ml"], 4.0));
    let mut two = share_pod("ml", "two", 1000, 10);
    two["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = json!("2");
    api.apply(two);
    let mut pct = share_pod("ml", "pct", 1000, 10);
    pct["spec"]["containers"][0]["resources"]["limits"] =
        json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"});
    api.apply(pct);
    let mut cores_only = share_pod("ml", "cores-only", 1000, 10);
    cores_only["spec"]["containers"][0]["resources"]["limits"] =
        json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "50"});
    api.apply(cores_only);
    let mut no_gpu = share_pod("ml", "no-gpu", 1000, 10);
    no_gpu["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/gpumem": "1000"});
    api.apply(no_gpu);
    let _s = start(&client, "r1");
    for (pod, says) in [
        ("two", "of one GPU (nvidia.com/gpu: 1), not 2"),
        ("pct", "in MiB, not nvidia.com/gpumem-percentage"),
        ("cores-only", "give the share's GPU memory"),
        ("no-gpu", "ask for it with nvidia.com/gpu: 1"),
    ] {
        eventually(10, pod, || {
            why(&api, "ml", pod).is_some_and(|w| w.contains(says))
        })
        .await;
        assert_eq!(node_of(&api, "ml", pod), None);
    }
}

/// The objects of a YAML file of several documents.
fn yaml_docs(path: &str) -> Vec<serde_json::Value> {
    use serde::Deserialize;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = std::fs::read_to_string(root.join(path)).unwrap();
    serde_norway::Deserializer::from_str(&text)
        .map(|d| serde_json::Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// What `deploy/kubernetes/try-on-kind.sh` runs, on the nodes it fakes:
/// every example pod is bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_the_kind_script_runs_are_all_bound() {
    let (api, client) = server().await;
    let mut w1 = node("worker", 4);
    w1["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = json!("7");
    api.apply(w1);
    let mut w2 = node("worker2", 0);
    w2["status"]["allocatable"]["nvidia.com/gpu.shared"] = json!("8");
    w2["metadata"]["labels"]["nvidia.com/gpu.replicas"] = json!("4");
    api.apply(w2);
    api.apply(hami_node(
        "worker3",
        &[("GPU-kind-0", MEM), ("GPU-kind-1", MEM)],
    ));
    let (_plugin, log) = hami_plugin(&api, "worker3");
    for q in yaml_docs("deploy/kubernetes/examples/queues.yaml") {
        api.apply(q);
    }
    let mut pods = Vec::new();
    for f in ["gang", "mig", "time-slice", "share"] {
        for p in yaml_docs(&format!("deploy/kubernetes/examples/{f}.yaml")) {
            pods.push(p["metadata"]["name"].as_str().unwrap().to_string());
            api.apply(p);
        }
    }
    assert_eq!(pods.len(), 5, "{pods:?}");
    let _s = start(&client, "r1");
    eventually(15, "every example pod bound", || {
        pods.iter().all(|p| node_of(&api, "team-a", p).is_some())
    })
    .await;
    assert_eq!(
        node_of(&api, "team-a", "notebook-share").as_deref(),
        Some("worker3")
    );
    assert_eq!(
        node_of(&api, "team-a", "notebook-slice").as_deref(),
        Some("worker2")
    );
    eventually(10, "the share allocated", || {
        log.lock().unwrap().allocations.len() == 1
    })
    .await;
}
