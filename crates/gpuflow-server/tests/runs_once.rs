//! Every job runs once, on GPUs nobody else holds, through the real router
//! and agent protocol in-process: nodes that shrink or lose a GPU evict the
//! work that no longer fits instead of booking its GPUs again, GPUs are
//! followed by UUID, time-sliced work counts in quota, and a
//! property test drives random submissions, cancels, node changes, losses
//! and cycles, checking after every step that no GPU is held twice.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{Value, json};
use tower::ServiceExt;

mod support;
use support::*;

fn gpu(uuid: &str, i: usize) -> Value {
    json!({"index": i, "uuid": uuid, "model": "H100", "memory_mib": 81920})
}

/// A node whose GPUs are in MIG mode with these instances each.
fn mig_inventory(gpus: usize, profiles: &[&str]) -> Value {
    let gpus: Vec<Value> = (0..gpus)
        .map(|i| {
            let mig: Vec<Value> = profiles
                .iter()
                .enumerate()
                .map(|(k, p)| json!({"uuid": format!("MIG-{i}-{k}"), "profile": p, "memory_mib": 10240}))
                .collect();
            json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920, "mig": mig})
        })
        .collect();
    json!({"cpu_milli": 64000, "memory_mib": 65536, "gpus": gpus, "emulated": false})
}

fn inventory(uuids: &[&str], memory_mib: u64) -> Value {
    let gpus: Vec<Value> = uuids.iter().enumerate().map(|(i, u)| gpu(u, i)).collect();
    json!({"cpu_milli": 64000, "memory_mib": memory_mib, "gpus": gpus, "emulated": false})
}

async fn register(h: &H, node: &str, inv: Value) -> String {
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/register",
            &h.join,
            json!({"node": node, "inventory": inv}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    v["node_token"].as_str().unwrap().to_string()
}

/// A heartbeat reporting `tasks` (job, attempt, phase); returns the reply.
async fn heartbeat(
    h: &H,
    node: &str,
    token: &str,
    inv: Value,
    tasks: &[(u64, u64, &str)],
) -> Value {
    let tasks: Vec<Value> = tasks
        .iter()
        .map(|(j, a, p)| json!({"job": j, "attempt": a, "group": 0, "index": 0, "phase": p, "exit_code": if *p == "exited" { Some(0) } else { None }}))
        .collect();
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            token,
            json!({"node": node, "inventory": inv, "tasks": tasks}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    v
}

async fn submit(h: &H, queue: &str, gpu: &str, memory_mib: u64) -> u64 {
    h.submit_spec(format!(
        "name: j\nqueue: {queue}\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '600']\n    resources: {{cpu: 1, memory_mib: {memory_mib}, gpu: {gpu}}}\n"
    ))
    .await
}

/// A team with a queue of its name guaranteed `guaranteed` H100s.
async fn team_with_queue(h: &H, team: &str, guaranteed: f64) {
    let a = &h.admin;
    assert_eq!(
        h.json("POST", "/v1/teams", a, json!({"name": team}))
            .await
            .0,
        201
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            a,
            json!({"name": team, "team": team, "quotas": {"H100": {"guaranteed": guaranteed}}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
}

async fn cycle(h: &H) {
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
}

/// Every allocated job's GPUs, by UUID: whole GPUs held once, shares within
/// one GPU, never both, never two sharing modes. Panics with the culprit.
async fn check_no_gpu_held_twice(h: &H) {
    let w = h.shared.world.lock().await;
    let mut whole: BTreeMap<String, u64> = BTreeMap::new();
    let mut shared: BTreeMap<String, (u64, String)> = BTreeMap::new();
    for j in w.jobs().values().filter(|j| j.state.allocated()) {
        for a in &j.allocs {
            let uuids = if a.gpu_uuids.is_empty() {
                a.pick
                    .gpus()
                    .iter()
                    .map(|i| format!("{}#{i}", a.node))
                    .collect()
            } else {
                a.gpu_uuids.clone()
            };
            let spec = j.spec.tasks[a.group as usize].resources.gpu.clone();
            for u in uuids {
                match &a.pick {
                    // A whole GPU, or a MIG instance: one holder at most.
                    gpuflow_server::state::Pick::Whole(_)
                    | gpuflow_server::state::Pick::Mig { .. } => {
                        if let Some(other) = whole.insert(u.clone(), j.id) {
                            panic!("GPU {u} held whole by jobs {other} and {}", j.id);
                        }
                    }
                    _ => {
                        let s = spec.as_ref().unwrap();
                        let mode = format!("{:?}", s.mode);
                        let e = shared.entry(u.clone()).or_insert((0, mode.clone()));
                        assert_eq!(e.1, mode, "GPU {u} shared in two modes");
                        e.0 += s.milli();
                        assert!(e.0 <= 1000, "GPU {u} shared beyond its capacity");
                    }
                }
            }
        }
    }
    for u in shared.keys() {
        assert!(!whole.contains_key(u), "GPU {u} both whole and shared");
    }
    // The index heartbeats read agrees with the jobs.
    let mut recount: BTreeMap<String, std::collections::BTreeSet<u64>> = BTreeMap::new();
    for j in w.jobs().values().filter(|j| j.state.allocated()) {
        for a in &j.allocs {
            recount.entry(a.node.clone()).or_default().insert(j.id);
        }
    }
    let mut index = w.on_node().clone();
    index.retain(|_, ids| !ids.is_empty());
    assert_eq!(index, recount, "the jobs-by-node index drifted");
}

fn job_state(v: &Value) -> String {
    v["state"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_node_that_shrinks_evicts_its_work_instead_of_booking_its_gpus_twice() {
    let h = harness(None).await;
    let uuids = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"];
    let tok = register(&h, "n1", inventory(&uuids, 65536)).await;
    let mut ids = vec![];
    for _ in 0..3 {
        ids.push(submit(&h, "default", "{count: 1}", 16384).await);
    }
    cycle(&h).await;
    for id in &ids {
        assert_eq!(
            job_state(&h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1),
            "admitted"
        );
    }
    // The node now reports less memory than its jobs hold.
    heartbeat(&h, "n1", &tok, inventory(&uuids, 20000), &[]).await;
    cycle(&h).await;
    let mut evicted = 0;
    for id in &ids {
        let (_, j) = h.get(&format!("/v1/jobs/{id}"), &h.admin).await;
        if j["reason"]
            .as_str()
            .unwrap()
            .starts_with("evicted: node n1 no longer holds")
        {
            evicted += 1;
            assert_eq!(job_state(&j), "stopping", "{j}");
        }
    }
    assert_eq!(evicted, 2, "the allocations that no longer fit are evicted");
    // New work does not get the GPUs the evicted jobs still hold.
    for _ in 0..3 {
        submit(&h, "default", "{count: 1}", 1024).await;
    }
    cycle(&h).await;
    check_no_gpu_held_twice(&h).await;
    let (_, events) = h.get("/v1/events?limit=1000", &h.admin).await;
    assert_eq!(
        events
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["kind"] == "evicted")
            .count(),
        2
    );
}

#[tokio::test]
async fn gpus_are_followed_by_uuid_and_a_vanished_one_evicts_its_job() {
    let h = harness(None).await;
    let tok = register(&h, "n1", inventory(&["GPU-a", "GPU-b", "GPU-c"], 65536)).await;
    let ids = [
        submit(&h, "default", "{count: 1}", 1024).await,
        submit(&h, "default", "{count: 1}", 1024).await,
        submit(&h, "default", "{count: 1}", 1024).await,
    ];
    cycle(&h).await;
    let holder = |uuid: &'static str| {
        let h = &h;
        async move {
            let w = h.shared.world.lock().await;
            w.jobs()
                .values()
                .find(|j| j.allocs.iter().any(|a| a.gpu_uuids == [uuid]))
                .map(|j| j.id)
                .unwrap()
        }
    };
    let (on_b, on_c) = (holder("GPU-b").await, holder("GPU-c").await);
    let running: Vec<(u64, u64, &str)> = ids.iter().map(|&id| (id, 1, "running")).collect();
    // GPU-b falls off the bus: GPU-c is now second in the inventory.
    let shrunk = inventory(&["GPU-a", "GPU-c"], 65536);
    let reply = heartbeat(&h, "n1", &tok, shrunk.clone(), &running).await;
    let task_of = |reply: &Value, id: u64| {
        reply["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["job"] == id)
            .cloned()
    };
    // The job on GPU-c is told its GPU by UUID and by its new position.
    let t = task_of(&reply, on_c).unwrap();
    assert_eq!(t["gpus"], json!([1]), "{t}");
    assert_eq!(t["env"]["CUDA_VISIBLE_DEVICES"], "GPU-c", "{t}");
    assert_eq!(t["env"]["CUDA_DEVICE_ORDER"], "PCI_BUS_ID", "{t}");
    cycle(&h).await;
    let (_, j) = h.get(&format!("/v1/jobs/{on_b}"), &h.admin).await;
    assert!(
        j["reason"]
            .as_str()
            .unwrap()
            .contains("GPU-b is gone from node n1"),
        "{j}"
    );
    // Its task stops; a new job finds no free GPU (both are held).
    let mut reports = running.clone();
    reports.retain(|r| r.0 != on_b);
    reports.push((on_b, 1, "stopped"));
    heartbeat(&h, "n1", &tok, shrunk, &reports).await;
    let late = submit(&h, "default", "{count: 1}", 1024).await;
    cycle(&h).await;
    check_no_gpu_held_twice(&h).await;
    assert_eq!(
        job_state(&h.get(&format!("/v1/jobs/{late}"), &h.admin).await.1),
        "pending"
    );
}

#[tokio::test]
async fn time_sliced_work_counts_in_quota_and_is_reclaimed() {
    let h = harness_with(|c| c.min_runtime_s = 0).await;
    let a = &h.admin;
    for (team, guaranteed) in [("free", 0.0), ("owner", 2.0)] {
        team_with_queue(&h, team, guaranteed).await;
    }
    register(&h, "n1", inventory(&["GPU-a", "GPU-b"], 65536)).await;
    // A queue with no guarantee fills every GPU with time slices...
    let mut slices = vec![];
    for _ in 0..8 {
        slices.push(submit(&h, "free", "{mode: time-slice}", 1024).await);
    }
    cycle(&h).await;
    let (_, q) = h.get("/v1/queues", a).await;
    let used = q
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "free")
        .unwrap()["used"]["H100"]
        .clone();
    assert_eq!(used, json!(2.0), "8 time slices count 2 GPUs: {q}");
    // ...which it borrowed: the queue guaranteed 2 GPUs reclaims them.
    let whole = submit(&h, "owner", "{count: 1}", 1024).await;
    cycle(&h).await;
    let (_, events) = h.get("/v1/events?limit=1000", a).await;
    let preempted = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["kind"] == "preempted")
        .count();
    assert!(preempted >= 1, "no borrower was reclaimed: {events}");
    let _ = whole;
}

// ------------------------------------------------------------ the property

#[derive(Clone, Debug)]
enum Op {
    Submit {
        gpu: u8,
        queue: u8,
    },
    Cancel(u8),
    /// Node `n` reports `gpus` GPUs (drops or adds at the end) and memory.
    Inventory {
        node: u8,
        drop_first: bool,
        gpus: u8,
        memory_gib: u8,
    },
    /// Node `n` reports its tasks running, or stopped.
    Report {
        node: u8,
        stopped: bool,
    },
    Lose(u8),
    Cycle,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..5, 0u8..2).prop_map(|(gpu, queue)| Op::Submit { gpu, queue }),
        any::<u8>().prop_map(Op::Cancel),
        (0u8..2, any::<bool>(), 0u8..5, 1u8..64).prop_map(
            |(node, drop_first, gpus, memory_gib)| {
                Op::Inventory {
                    node,
                    drop_first,
                    gpus,
                    memory_gib,
                }
            }
        ),
        (0u8..2, any::<bool>()).prop_map(|(node, stopped)| Op::Report { node, stopped }),
        (0u8..2).prop_map(Op::Lose),
        Just(Op::Cycle),
        Just(Op::Cycle),
    ]
}

const GPU_SPECS: [&str; 5] = [
    "{count: 1}",
    "{count: 2}",
    "{mode: fraction, fraction: 0.5}",
    "{mode: time-slice}",
    "{mode: fraction, fraction: 0.25}",
];

async fn run_ops(ops: Vec<Op>) {
    let h = harness_with(|c| c.min_runtime_s = 0).await;
    let a = h.admin.clone();
    assert_eq!(
        h.json("POST", "/v1/teams", &a, json!({"name": "t"}))
            .await
            .0,
        201
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &a,
            json!({"name": "t", "team": "t", "quotas": {"H100": {"guaranteed": 1, "cap": 2}}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let queues = ["default", "t"];
    let mut nodes: Vec<(String, String, Vec<String>, u64)> = vec![];
    for n in 0..2 {
        let name = format!("n{n}");
        let uuids: Vec<String> = (0..4).map(|i| format!("GPU-{n}-{i}")).collect();
        let refs: Vec<&str> = uuids.iter().map(String::as_str).collect();
        let tok = register(&h, &name, inventory(&refs, 65536)).await;
        nodes.push((name, tok, uuids, 65536));
    }
    let mut next_uuid = 100;
    let mut ids: Vec<u64> = vec![];
    for op in ops {
        match op {
            Op::Submit { gpu, queue } => {
                let spec = format!(
                    "name: j\nqueue: {}\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '600']\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {}}}\n",
                    queues[queue as usize], GPU_SPECS[gpu as usize]
                );
                let (s, v) = h
                    .call(
                        "POST",
                        "/v1/jobs",
                        Some(&a),
                        "application/yaml",
                        spec.into_bytes(),
                    )
                    .await;
                // Refused only when no node, as nodes are now, could ever hold it.
                match s {
                    201 => ids.push(v["id"].as_u64().unwrap()),
                    400 if v["code"] == "never_fits" => {}
                    _ => panic!("submit: {s} {v}"),
                }
            }
            Op::Cancel(i) => {
                if !ids.is_empty() {
                    let id = ids[i as usize % ids.len()];
                    let _ = h
                        .call(
                            "POST",
                            &format!("/v1/jobs/{id}/cancel"),
                            Some(&a),
                            "",
                            vec![],
                        )
                        .await;
                }
            }
            Op::Inventory {
                node,
                drop_first,
                gpus,
                memory_gib,
            } => {
                let (name, tok, uuids, mem) = &mut nodes[node as usize];
                if drop_first && !uuids.is_empty() {
                    uuids.remove(0);
                }
                while uuids.len() > gpus as usize {
                    uuids.pop();
                }
                while uuids.len() < gpus as usize {
                    next_uuid += 1;
                    uuids.push(format!("GPU-new-{next_uuid}"));
                }
                *mem = memory_gib as u64 * 1024;
                let refs: Vec<&str> = uuids.iter().map(String::as_str).collect();
                heartbeat(&h, name, tok, inventory(&refs, *mem), &[]).await;
            }
            Op::Report { node, stopped } => {
                let (name, tok, uuids, mem) = &nodes[node as usize];
                let reports: Vec<(u64, u64, &str)> = {
                    let w = h.shared.world.lock().await;
                    w.jobs()
                        .values()
                        .filter(|j| {
                            j.state.allocated() && j.allocs.iter().any(|al| &al.node == name)
                        })
                        .map(|j| {
                            (
                                j.id,
                                j.attempts as u64,
                                if stopped || j.state == gpuflow_api::JobState::Stopping {
                                    "stopped"
                                } else {
                                    "running"
                                },
                            )
                        })
                        .collect()
                };
                let refs: Vec<&str> = uuids.iter().map(String::as_str).collect();
                heartbeat(&h, name, tok, inventory(&refs, *mem), &reports).await;
            }
            Op::Lose(n) => {
                let name = nodes[n as usize].0.clone();
                let mut w = h.shared.world.lock().await;
                if let Some(node) = w.nodes().get(&name) {
                    let mut node = node.clone();
                    node.last_heartbeat = 0;
                    w.put_node(node);
                }
            }
            Op::Cycle => cycle(&h).await,
        }
        check_no_gpu_held_twice(&h).await;
        assert_eq!(
            h.shared
                .cycle_failures
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        // Quotas hold, time slices included: queue t never holds more than its cap.
        let w = h.shared.world.lock().await;
        let held: u64 = w
            .jobs()
            .values()
            .filter(|j| j.state.allocated() && j.spec.queue == "t")
            .map(|j| gpuflow_server::convert::quota_milli(&j.spec))
            .sum();
        assert!(
            held <= 2000,
            "queue t holds {held} milli-GPU over its cap of 2 GPUs"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]
    #[test]
    fn no_gpu_is_ever_held_twice_whatever_nodes_report(ops in proptest::collection::vec(op(), 1..40)) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run_ops(ops));
    }
}

#[tokio::test]
async fn the_submit_path_refuses_what_no_node_could_ever_hold() {
    let h = harness(None).await;
    // No node yet: nothing is refused for its size (nodes may still join).
    let early = submit(&h, "default", "{count: 16}", 1024).await;
    register(
        &h,
        "n1",
        inventory(&["GPU-a", "GPU-b", "GPU-c", "GPU-d"], 65536),
    )
    .await;
    let try_submit = async |resources: &str, extra: &str| {
        h.post_spec(format!(
            "name: j\nqueue: default\n{extra}tasks:\n  - name: main\n    replicas: 1\n    command: [sleep, '1']\n    resources: {resources}\n"
        ))
        .await
    };
    for (resources, extra, says) in [
        (
            "{gpu: {count: 16}}",
            "",
            "the largest node has 4 GPUs (H100)",
        ),
        (
            "{gpu: {count: 1, models: [A10]}}",
            "",
            "no node has GPU model A10; the cluster has H100",
        ),
        (
            "{gpu: {mode: mig, profile: 1g.10gb}}",
            "",
            "no node offers MIG profile 1g.10gb",
        ),
        ("{memory_mib: 100000}", "", "65536 MiB"),
        (
            "{gpu: {count: 1}}",
            "topology: {level: rack, required: true}\n",
            "no node reports a rack",
        ),
        (
            "{gpu: {count: 1}}",
            "topology: {level: nvlink, required: true}\n",
            "NVLink",
        ),
        (
            "{cpu: 1}",
            "idle: {after_s: 600, action: suspend}\n",
            "idle: measured by GPU utilisation",
        ),
        // The node does not label itself as one that runs images.
        (
            "{cpu: 1}\n    image: 127.0.0.1:5000/team/busybox:1",
            "",
            "image: no node can run images",
        ),
    ] {
        let (s, v) = try_submit(resources, extra).await;
        assert_eq!(s, 400, "{resources} {extra}: {v}");
        assert!(
            v["message"].as_str().unwrap().contains(says),
            "{resources}: {v}"
        );
    }
    // A gang larger than the cluster.
    let spec = "name: g\nqueue: default\ntasks:\n  - name: w\n    replicas: 5\n    command: [sleep, '1']\n    resources: {gpu: {count: 1}}\n";
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            spec.as_bytes().to_vec(),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("4 of its 5 replicas"),
        "{v}"
    );
    // What fits is accepted; the early job waits with the cycle's reason.
    let (s, v) = try_submit("{gpu: {count: 4}}", "").await;
    assert_eq!(s, 201, "{v}");
    cycle(&h).await;
    let (_, j) = h.get(&format!("/v1/jobs/{early}"), &h.admin).await;
    assert_ne!(
        j["reason"], "submitted; waiting for the next scheduling cycle",
        "{j}"
    );
}

/// The submit path reads nodes by shape, counted: nodes alike count
/// together, and a node that changes leaves its old shape.
#[tokio::test]
async fn the_submit_path_counts_nodes_alike_and_follows_a_node_that_changes() {
    let h = harness(None).await;
    let four = |node: &str| {
        let uuids: Vec<String> = (0..4).map(|i| format!("GPU-{node}-{i}")).collect();
        inventory(&uuids.iter().map(String::as_str).collect::<Vec<_>>(), 65536)
    };
    let t1 = register(&h, "n1", four("n1")).await;
    let t2 = register(&h, "n2", four("n2")).await;
    let gang = |replicas: u32, gpus: u32| {
        format!(
            "name: g\nqueue: default\ntasks:\n  - name: w\n    replicas: {replicas}\n    command: [sleep, '1']\n    resources: {{gpu: {{count: {gpus}}}}}\n"
        )
    };
    // Two nodes of one shape hold eight one-GPU replicas, not four.
    let (s, v) = h.post_spec(gang(8, 1)).await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = h.post_spec(gang(9, 1)).await;
    assert_eq!(s, 400, "{v}");
    let said = v["message"].as_str().unwrap();
    assert!(
        said.contains("8 of its 9 replicas at most (2 nodes)"),
        "{v}"
    );
    // n1 now reports two GPUs: the cluster holds six replicas, and a
    // four-GPU task still fits n2.
    let two = inventory(&["GPU-n1-0", "GPU-n1-1"], 65536);
    heartbeat(&h, "n1", &t1, two, &[]).await;
    let (s, v) = h.post_spec(gang(7, 1)).await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("6 of its 7 replicas"),
        "{v}"
    );
    let (s, v) = h.post_spec(gang(1, 4)).await;
    assert_eq!(s, 201, "{v}");
    // n2 shrinks too: no node is left of the four-GPU shape.
    heartbeat(
        &h,
        "n2",
        &t2,
        inventory(&["GPU-n2-0", "GPU-n2-1"], 65536),
        &[],
    )
    .await;
    let (s, v) = h.post_spec(gang(1, 4)).await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("the largest node has 2 GPUs"),
        "{v}"
    );
}

#[tokio::test]
async fn test_only_says_where_a_job_would_start_and_stores_nothing() {
    let h = harness(None).await;
    register(
        &h,
        "n1",
        inventory(&["GPU-a", "GPU-b", "GPU-c", "GPU-d"], 65536),
    )
    .await;
    let busy = submit(&h, "default", "{count: 3}", 1024).await;
    cycle(&h).await;
    let ask = async |gpus: u32| {
        let spec = format!(
            "name: t\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '1']\n    resources: {{gpu: {{count: {gpus}}}}}\n"
        );
        h.call(
            "POST",
            "/v1/jobs?test_only=true",
            Some(&h.admin),
            "application/yaml",
            spec.into_bytes(),
        )
        .await
    };
    let (s, v) = ask(1).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        (v["would_start"].as_bool(), v["nodes"].clone()),
        (Some(true), json!(["n1"])),
        "{v}"
    );
    let (s, v) = ask(2).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["would_start"], false, "{v}");
    assert!(!v["reasons"].as_array().unwrap().is_empty(), "{v}");
    // Nothing was stored, no id used up.
    let (_, jobs) = h.get("/v1/jobs", &h.admin).await;
    assert_eq!(jobs.as_array().unwrap().len(), 1);
    let next = submit(&h, "default", "{count: 1}", 1024).await;
    assert_eq!(next, busy + 1);
}

#[tokio::test]
async fn the_applier_drops_decisions_whose_ground_changed_while_the_cycle_ran() {
    let h = harness(None).await;
    let uuids = ["GPU-a", "GPU-b"];
    let tok = register(&h, "n1", inventory(&uuids, 65536)).await;
    let cancelled = submit(&h, "default", "{count: 1}", 1024).await;
    let other = submit(&h, "default", "{count: 1}", 1024).await;
    // While the cycle computes, the first job is cancelled: it stays cancelled.
    gpuflow_server::cycle::run_once_with(&h.shared, async || {
        let (s, v) = h
            .call(
                "POST",
                &format!("/v1/jobs/{cancelled}/cancel"),
                Some(&h.admin),
                "",
                vec![],
            )
            .await;
        assert_eq!(s, 200, "{v}");
    })
    .await
    .unwrap();
    let state = |id: u64| {
        let h = &h;
        async move { job_state(&h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1) }
    };
    assert_eq!(state(cancelled).await, "cancelled");
    assert_eq!(state(other).await, "admitted");
    // While the cycle computes, the node loses a GPU: nothing is admitted
    // onto what it was before; the next cycle places the job on what is left.
    let late = submit(&h, "default", "{count: 1}", 1024).await;
    gpuflow_server::cycle::run_once_with(&h.shared, async || {
        heartbeat(&h, "n1", &tok, inventory(&uuids[..1], 65536), &[]).await;
    })
    .await
    .unwrap();
    assert_eq!(state(late).await, "pending");
    // On a second node (the first cordoned): a heartbeat that changes
    // nothing the scheduler reads leaves the decision standing.
    let node_action = async |node: &str, action: &str| {
        let path = format!("/v1/nodes/{node}/{action}");
        let (s, v) = h.call("POST", &path, Some(&h.admin), "", vec![]).await;
        assert_eq!(s, 200, "{v}");
    };
    node_action("n1", "cordon").await;
    // Four GPUs: the job still pending from above and the next take two.
    let four = ["GPU-c", "GPU-d", "GPU-e", "GPU-f"];
    let tok2 = register(&h, "n2", inventory(&four, 65536)).await;
    let steady = submit(&h, "default", "{count: 1}", 1024).await;
    gpuflow_server::cycle::run_once_with(&h.shared, async || {
        // A new address: the node's record changes, not its shape.
        let mut moved = inventory(&four, 65536);
        moved["address"] = json!("10.0.0.9");
        heartbeat(&h, "n2", &tok2, moved, &[]).await;
    })
    .await
    .unwrap();
    assert_eq!(state(steady).await, "admitted");
    // A node cordoned while the cycle computes takes nothing from it.
    let held_off = submit(&h, "default", "{count: 1}", 1024).await;
    gpuflow_server::cycle::run_once_with(&h.shared, async || node_action("n2", "cordon").await)
        .await
        .unwrap();
    assert_eq!(state(held_off).await, "pending");
    node_action("n2", "uncordon").await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    assert_eq!(state(held_off).await, "admitted");
    check_no_gpu_held_twice(&h).await;
}

#[tokio::test]
async fn quotas_for_models_the_cluster_lacks_or_beyond_it_are_warned() {
    let h = harness(None).await;
    register(&h, "n1", inventory(&["GPU-a", "GPU-b"], 65536)).await;
    assert_eq!(
        h.json("POST", "/v1/teams", &h.admin, json!({"name": "t"}))
            .await
            .0,
        201
    );
    let resp = h
        .router
        .clone()
        .oneshot(
            axum::http::Request::builder()
                .method("POST")
                .uri("/v1/queues")
                .header("authorization", format!("Bearer {}", h.admin))
                .header("content-type", "application/json")
                .body(axum::body::Body::from(
                    json!({"name": "q", "team": "t", "quotas": {"A10": {"guaranteed": 1}, "H100": {"guaranteed": 3}}}).to_string(),
                ))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 201);
    let warnings: Vec<String> = resp
        .headers()
        .get_all("warning")
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .collect();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(
        warnings[0].contains("no node has GPU model A10 yet; the cluster has H100"),
        "{warnings:?}"
    );
    assert!(
        warnings[1].contains("guaranteed 3 H100 GPUs and the cluster has 2"),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn mig_jobs_get_an_instance_each_see_it_by_uuid_and_count_in_quota() {
    let h = harness(None).await;
    let tok = register(
        &h,
        "n1",
        mig_inventory(1, &["1g.10gb", "1g.10gb", "3g.40gb"]),
    )
    .await;
    let small = [
        submit(&h, "default", "{mode: mig, profile: 1g.10gb}", 1024).await,
        submit(&h, "default", "{mode: mig, profile: 1g.10gb}", 1024).await,
    ];
    let big = submit(&h, "default", "{mode: mig, profile: 3g.40gb}", 1024).await;
    let third = submit(&h, "default", "{mode: mig, profile: 1g.10gb}", 1024).await;
    cycle(&h).await;
    for id in small.iter().chain([&big]) {
        assert_eq!(
            job_state(&h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1),
            "admitted"
        );
    }
    // Two 1g instances only: the third waits.
    assert_eq!(
        job_state(&h.get(&format!("/v1/jobs/{third}"), &h.admin).await.1),
        "pending"
    );
    check_no_gpu_held_twice(&h).await;
    let reply = heartbeat(
        &h,
        "n1",
        &tok,
        mig_inventory(1, &["1g.10gb", "1g.10gb", "3g.40gb"]),
        &[],
    )
    .await;
    let mut seen: Vec<String> = reply["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            t["env"]["CUDA_VISIBLE_DEVICES"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    seen.sort();
    assert_eq!(seen, ["MIG-0-0", "MIG-0-1", "MIG-0-2"]);
    // In quota: 1/7 + 1/7 + 3/7 of a GPU.
    let (_, q) = h.get("/v1/queues", &h.admin).await;
    let used = q[0]["used"]["H100"].as_f64().unwrap();
    assert!((used - 0.715).abs() < 1e-9, "{q}");
}

#[tokio::test]
async fn a_gang_that_needs_nvlink_lands_on_one_nvlink_island() {
    let h = harness(None).await;
    // Four GPUs in two NVLink pairs: (a, b) and (c, d).
    let peers = [[1], [0], [3], [2]];
    let gpus: Vec<Value> = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
        .iter()
        .enumerate()
        .map(|(i, u)| json!({"index": i, "uuid": u, "model": "H100", "memory_mib": 81920, "nvlink": peers[i], "numa": i / 2}))
        .collect();
    register(
        &h,
        "n1",
        json!({"cpu_milli": 64000, "memory_mib": 65536, "gpus": gpus, "emulated": false}),
    )
    .await;
    // One GPU of the first pair is taken.
    let first = submit(&h, "default", "{count: 1}", 1024).await;
    cycle(&h).await;
    let spec = "name: g\nqueue: default\ntopology: {level: nvlink, required: true}\ntasks:\n  - name: w\n    replicas: 2\n    command: [train]\n    resources: {gpu: {count: 1}}\n";
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            spec.as_bytes().to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let gang = v["id"].as_u64().unwrap();
    cycle(&h).await;
    let w = h.shared.world.lock().await;
    let held = |id: u64| -> Vec<String> {
        let mut u: Vec<String> = w.jobs()[&id]
            .allocs
            .iter()
            .flat_map(|a| a.gpu_uuids.clone())
            .collect();
        u.sort();
        u
    };
    let island = |u: &str| if u <= "GPU-b" { 0 } else { 1 };
    let gang_gpus = held(gang);
    assert_eq!(
        gang_gpus.len(),
        2,
        "the gang was not admitted: {:?}",
        w.jobs()[&gang].reason
    );
    assert_eq!(
        island(&gang_gpus[0]),
        island(&gang_gpus[1]),
        "{gang_gpus:?} span two islands"
    );
    assert!(!gang_gpus.contains(&held(first)[0]), "{gang_gpus:?}");
}

#[tokio::test]
async fn why_names_the_borrowers_a_job_waits_on_and_when_they_may_be_reclaimed() {
    let h = harness_with(|c| c.min_runtime_s = 600).await;
    let a = &h.admin;
    for (team, guaranteed) in [("lender", 2.0), ("borrower", 0.0)] {
        team_with_queue(&h, team, guaranteed).await;
    }
    register(&h, "n1", inventory(&["GPU-a", "GPU-b"], 65536)).await;
    for _ in 0..2 {
        submit(&h, "borrower", "{count: 1}", 1024).await;
    }
    cycle(&h).await;
    let waiting = submit(&h, "lender", "{count: 2}", 1024).await;
    cycle(&h).await;
    let (_, why) = h.get(&format!("/v1/jobs/{waiting}/why"), a).await;
    let reasons: Vec<&str> = why["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains(
            "borrowing H100 beyond their guarantee: borrower (2.00 GPUs, 0.00 guaranteed)"
        ) && r.contains("passes the minimum runtime in 10 min")),
        "{reasons:?}"
    );
}

#[tokio::test]
async fn finished_jobs_leave_memory_and_are_read_from_the_store() {
    let h = harness(None).await;
    let tok = register(&h, "n1", inventory(&["GPU-a"], 65536)).await;
    let done = submit(&h, "default", "{count: 1}", 1024).await;
    let waiting = submit(&h, "default", "{count: 1}", 1024).await;
    cycle(&h).await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            &tok,
            json!({"node": "n1", "inventory": inventory(&["GPU-a"], 65536), "tasks": [{"job": done, "attempt": 1, "group": 0, "index": 0, "phase": "exited", "exit_code": 0, "stdout": {"offset": 0, "len": 9, "text": "all done\n"}}]}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(
        job_state(&h.get(&format!("/v1/jobs/{done}"), &h.admin).await.1),
        "succeeded"
    );
    // Long after: it leaves memory; the unfinished one stays.
    let left = h
        .shared
        .world
        .lock()
        .await
        .prune_finished(u64::MAX / 2, 3600);
    assert_eq!(left, 1);
    {
        let w = h.shared.world.lock().await;
        assert!(!w.jobs().contains_key(&done));
        assert!(w.jobs().contains_key(&waiting));
    }
    // Everything about it is still read, from the store.
    let (s, j) = h.get(&format!("/v1/jobs/{done}"), &h.admin).await;
    assert_eq!((s, j["state"].as_str()), (200, Some("succeeded")), "{j}");
    let (_, list) = h.get("/v1/jobs", &h.admin).await;
    let ids: Vec<u64> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [waiting, done]);
    let (_, list) = h.get("/v1/jobs?state=succeeded", &h.admin).await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    let (_, logs) = h.get(&format!("/v1/jobs/{done}/logs"), &h.admin).await;
    assert_eq!(logs["tasks"]["main/0"], "all done\n", "{logs}");
    let (s, why) = h.get(&format!("/v1/jobs/{done}/why"), &h.admin).await;
    assert_eq!(
        (s, why["state"].as_str()),
        (200, Some("succeeded")),
        "{why}"
    );
    let (s, _) = h
        .call(
            "POST",
            &format!("/v1/jobs/{done}/cancel"),
            Some(&h.admin),
            "",
            vec![],
        )
        .await;
    assert_eq!(s, 409);
    // And it stays out of reach of other teams.
    assert_eq!(
        h.json("POST", "/v1/teams", &h.admin, json!({"name": "other"}))
            .await
            .0,
        201
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/users",
            &h.admin,
            json!({"name": "o", "team": "other", "role": "member"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (_, t) = h
        .json("POST", "/v1/tokens", &h.admin, json!({"user": "o"}))
        .await;
    let other = t["token"].as_str().unwrap();
    assert_eq!(h.get(&format!("/v1/jobs/{done}"), other).await.0, 404);
    assert_eq!(h.get(&format!("/v1/jobs/{done}/logs"), other).await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_hang_up_mid_request_leave_store_and_memory_agreeing() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = gpuflow_server::Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    let running = gpuflow_server::start(cfg).await.unwrap();
    let token = running.new_admin_token.clone().unwrap();
    let addr = running.addr;
    let body = "name: j\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '1']\n";
    let request = format!(
        "POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/yaml\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    // 600 submissions; each client hangs up 0 to 6 ms after sending, most
    // before the answer comes.
    let mut tasks = Vec::new();
    for i in 0..600u64 {
        let request = request.clone();
        tasks.push(tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(request.as_bytes()).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_micros((i * 7919) % 6000)).await;
            drop(s);
        }));
        if tasks.len() >= 32 {
            for t in tasks.drain(..) {
                t.await.unwrap();
            }
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Let the handlers that were still running finish.
    let shared = running.shared.clone();
    let settled = async {
        loop {
            let a = shared
                .store
                .load(gpuflow_store::Table::Jobs)
                .await
                .unwrap()
                .len();
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let b = shared
                .store
                .load(gpuflow_store::Table::Jobs)
                .await
                .unwrap()
                .len();
            if a == b {
                return b;
            }
        }
    };
    let stored = tokio::time::timeout(std::time::Duration::from_secs(30), settled)
        .await
        .unwrap();
    let events = shared
        .store
        .events(&gpuflow_store::EventQuery {
            limit: 100_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let submitted: Vec<u64> = events
        .iter()
        .filter(|e| e.event.kind == "submitted")
        .map(|e| e.event.job.unwrap())
        .collect();
    let distinct: std::collections::BTreeSet<u64> = submitted.iter().copied().collect();
    let w = shared.world.lock().await;
    println!(
        "{stored} stored of 600 sent; {} in memory",
        w.summaries().len()
    );
    // Every stored job is in memory, every submission event names its own
    // job (no id was given out twice), and the next id is past them all.
    assert_eq!(w.summaries().len(), stored);
    assert_eq!(submitted.len(), distinct.len(), "an id was reused");
    assert_eq!(distinct.len(), stored);
    assert_eq!(w.next_job, distinct.iter().copied().max().unwrap_or(0));
}

#[tokio::test]
async fn fair_share_is_charged_while_nothing_waits() {
    let h = harness(None).await;
    register(&h, "n1", inventory(&["GPU-a"], 65536)).await;
    submit(&h, "default", "{count: 1}", 1024).await;
    cycle(&h).await;
    // Nothing pending now; a while passes with the job running.
    let before = {
        let mut w = h.shared.world.lock().await;
        w.history.decayed_at -= 3600;
        w.history.usage.get("default").copied().unwrap_or(0.0)
    };
    cycle(&h).await;
    let after = h
        .shared
        .world
        .lock()
        .await
        .history
        .usage
        .get("default")
        .copied()
        .unwrap_or(0.0);
    assert!(
        after > before + 0.5,
        "usage {before} -> {after}: the running hour was not charged"
    );
}

#[tokio::test]
async fn a_gang_that_needs_one_rack_lands_in_one() {
    let h = harness(None).await;
    for (node, rack) in [("a1", "r1"), ("b1", "r2"), ("a2", "r1")] {
        let mut inv = inventory(&[&format!("GPU-{node}")], 65536);
        inv["labels"] = json!({"rack": rack});
        register(&h, node, inv).await;
    }
    let spec = "name: g\nqueue: default\ntopology: {level: rack, required: true}\ntasks:\n  - name: w\n    replicas: 2\n    command: [train]\n    resources: {gpu: {count: 1}}\n";
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            spec.as_bytes().to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    cycle(&h).await;
    let (_, j) = h.get(&format!("/v1/jobs/{id}"), &h.admin).await;
    let mut nodes: Vec<&str> = j["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["node"].as_str().unwrap())
        .collect();
    nodes.sort();
    assert_eq!(nodes, ["a1", "a2"], "{j}");
}

#[tokio::test]
async fn a_borrowing_gang_is_reclaimed_for_a_queue_within_its_guarantee() {
    let h = harness_with(|c| c.min_runtime_s = 0).await;
    let a = &h.admin;
    for (team, guaranteed) in [("owner", 4.0), ("borrower", 0.0)] {
        team_with_queue(&h, team, guaranteed).await;
    }
    register(
        &h,
        "n1",
        inventory(&["GPU-a", "GPU-b", "GPU-c", "GPU-d"], 65536),
    )
    .await;
    // The borrower's 4-task gang takes every GPU on the owner's guarantee.
    let gang = "name: g\nqueue: borrower\nkind: batch\ntasks:\n  - name: w\n    replicas: 4\n    command: [x]\n    resources: {gpu: {count: 1}}\n";
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(a),
            "application/yaml",
            gang.as_bytes().to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let gang = v["id"].as_u64().unwrap();
    cycle(&h).await;
    assert_eq!(
        job_state(&h.get(&format!("/v1/jobs/{gang}"), a).await.1),
        "admitted"
    );
    // The owner asks for one GPU of its guarantee: the gang goes, whole.
    let mine = submit(&h, "owner", "{count: 1}", 1024).await;
    cycle(&h).await;
    let (_, g) = h.get(&format!("/v1/jobs/{gang}"), a).await;
    assert_eq!(g["state"], "stopping", "{g}");
    assert!(
        g["reason"].as_str().unwrap().contains(&format!(
            "preempted by job {mine}: its queue's guarantee is reclaimed"
        )),
        "{g}"
    );
}

/// Unsaved work does not keep borrowed GPUs from their owner (#35: a
/// borrower that never checkpoints kept a lender's guarantee for good once
/// past `--max-unsaved`): with or without a limit, the borrower whose job
/// holds more work since its last checkpoint than the limit is reclaimed
/// when the owner comes back. The limit still keeps a queue's own work from
/// its own higher-priority jobs, and `why` says so.
#[tokio::test]
async fn unsaved_work_protects_a_queues_own_work_but_not_borrowed_gpus() {
    for limit in [Some(1), None] {
        let (h, tok) = owner_and_borrower(&["GPU-a"], |c| c.max_unsaved_s = limit).await;
        let a = &h.admin;
        let theirs = submit(&h, "borrower", "{count: 1}", 1024).await;
        cycle(&h).await;
        heartbeat(
            &h,
            "n1",
            &tok,
            inventory(&["GPU-a"], 65536),
            &[(theirs, 1, "running")],
        )
        .await;
        // Two seconds of unsaved work: over a limit of one.
        h.shared.cfg.clock.advance(3);
        submit(&h, "owner", "{count: 1}", 1024).await;
        cycle(&h).await;
        let state = job_state(&h.get(&format!("/v1/jobs/{theirs}"), a).await.1);
        assert_eq!(state, "stopping", "reclaimed, limit {limit:?}");
    }
    // The owner's own batch job and, later, its training job.
    let (h, tok) = owner_and_borrower(&["GPU-a"], |c| c.max_unsaved_s = Some(1)).await;
    let a = &h.admin;
    let batch = submit(&h, "owner", "{count: 1}", 1024).await;
    cycle(&h).await;
    heartbeat(
        &h,
        "n1",
        &tok,
        inventory(&["GPU-a"], 65536),
        &[(batch, 1, "running")],
    )
    .await;
    h.shared.cfg.clock.advance(3);
    let training = h
        .submit_spec(
            "name: t\nqueue: owner\nkind: training\ntasks:\n  - name: main\n    command: [sleep, '600']\n    resources: {cpu: 1, memory_mib: 1024, gpu: {count: 1}}\n".into(),
        )
        .await;
    cycle(&h).await;
    assert_eq!(
        job_state(&h.get(&format!("/v1/jobs/{batch}"), a).await.1),
        "running",
        "protected by the limit"
    );
    let (_, why) = h.get(&format!("/v1/jobs/{training}/why"), a).await;
    assert!(
        why["reasons"].to_string().contains(
            "hold more than 1 s of work since their last checkpoint and are not preempted until they checkpoint or end"
        ),
        "{why}"
    );
}

/// A server with no minimum runtime and `configure`'s settings, queues
/// `owner` (guaranteed all of `gpus`) and `borrower` (none), and node n1
/// with `gpus`: the harness and n1's token.
async fn owner_and_borrower(
    gpus: &[&str],
    configure: impl FnOnce(&mut gpuflow_server::Config),
) -> (H, String) {
    let h = harness_with(|c| {
        c.min_runtime_s = 0;
        configure(c);
    })
    .await;
    for (team, guaranteed) in [("owner", gpus.len() as f64), ("borrower", 0.0)] {
        team_with_queue(&h, team, guaranteed).await;
    }
    let tok = register(&h, "n1", inventory(gpus, 65536)).await;
    (h, tok)
}

/// The disruption budget paces reclaims: once the owner has had its share
/// of the usage, its batch job does not take back a GPU whose job would
/// lose more than the budget, or stop more of the queue's jobs than its
/// count allows (none here), and `why` says so; without a budget it does.
#[tokio::test]
async fn a_disruption_budget_paces_a_reclaim_and_why_says_so() {
    for (budget, max_jobs) in [(Some(0.0001), None), (None, Some(0)), (None, None)] {
        let gpus = ["GPU-a", "GPU-b"];
        let (h, tok) = owner_and_borrower(&gpus, |c| {
            c.disruption_budget = budget;
            c.disruption_max_jobs = max_jobs;
        })
        .await;
        let a = &h.admin;
        // One job each, side by side: the borrower's on the owner's
        // guarantee, so both queues use the same share of the GPUs.
        let first = submit(&h, "owner", "{count: 1}", 1024).await;
        let theirs = submit(&h, "borrower", "{count: 1}", 1024).await;
        cycle(&h).await;
        heartbeat(
            &h,
            "n1",
            &tok,
            inventory(&gpus, 65536),
            &[(first, 1, "running"), (theirs, 1, "running")],
        )
        .await;
        // Two seconds of work each (0.0006 GPU-h): over a budget of 0.0001.
        h.shared.cfg.clock.advance(2);
        cycle(&h).await;
        let mine = submit(&h, "owner", "{count: 1}", 1024).await;
        cycle(&h).await;
        let state = job_state(&h.get(&format!("/v1/jobs/{theirs}"), a).await.1);
        if budget.is_none() && max_jobs.is_none() {
            assert_eq!(state, "stopping", "reclaimed without a budget");
            continue;
        }
        assert_eq!(state, "running", "kept by the budget");
        let (_, why) = h.get(&format!("/v1/jobs/{mine}/why"), a).await;
        let said = if budget.is_some() {
            "GPU-hours already lost in the window"
        } else {
            "0 of at most 0 of its jobs already preempted in the window"
        };
        assert!(
            why["reasons"]
                .to_string()
                .contains("preempting would pass queue borrower's disruption budget: ")
                && why["reasons"].to_string().contains(said),
            "{why}"
        );
    }
}

/// A notebook within its queue's guarantee passes disruption budgets, but
/// only once it has waited the patience: until then a borrower whose loss
/// would pass its budget keeps running, and `why` says when the notebook
/// will take it back; with no patience it takes it back at once.
#[tokio::test]
async fn a_notebook_passes_a_disruption_budget_only_after_its_patience() {
    for patience in [3600, 0] {
        let gpus = ["GPU-a", "GPU-b"];
        let (h, tok) = owner_and_borrower(&gpus, |c| {
            c.disruption_budget = Some(0.0001);
            c.budget_patience_s = patience;
        })
        .await;
        let a = &h.admin;
        let theirs = run_one_gpu_each(&h, "borrower", &tok, &gpus).await;
        // Two seconds of work each (0.0006 GPU-h): over a budget of 0.0001.
        h.shared.cfg.clock.advance(2);
        let mine = h
            .submit_spec(
                "name: nb\nqueue: owner\nkind: notebook\ntasks:\n  - name: main\n    command: [sleep, '600']\n    resources: {cpu: 1, memory_mib: 1024, gpu: {count: 1}}\n".to_string(),
            )
            .await;
        cycle(&h).await;
        let mut states = Vec::new();
        for j in theirs {
            states.push(job_state(&h.get(&format!("/v1/jobs/{j}"), a).await.1));
        }
        if patience == 0 {
            assert!(states.contains(&"stopping".to_string()), "{states:?}");
            continue;
        }
        assert_eq!(
            states,
            ["running", "running"],
            "kept until the patience ends"
        );
        let (_, why) = h.get(&format!("/v1/jobs/{mine}/why"), a).await;
        let said = why["reasons"].to_string();
        assert!(
            said.contains("preempting would pass queue borrower's disruption budget")
                && said.contains(
                    "it preempts past disruption budgets once it has waited 60 min: in 60 min"
                ),
            "{why}"
        );
    }
}

/// Two one-GPU jobs of `queue`, started by a cycle and shown running by
/// node n1 (whose GPUs are `gpus`).
async fn run_one_gpu_each(h: &H, queue: &str, tok: &str, gpus: &[&str]) -> [u64; 2] {
    let jobs = [
        submit(h, queue, "{count: 1}", 1024).await,
        submit(h, queue, "{count: 1}", 1024).await,
    ];
    cycle(h).await;
    let running: Vec<_> = jobs.iter().map(|&j| (j, 1, "running")).collect();
    heartbeat(h, "n1", tok, inventory(gpus, 65536), &running).await;
    jobs
}

#[tokio::test]
async fn a_reclaim_never_takes_from_a_queue_that_has_had_less_and_why_says_so() {
    // No disruption budget: the rule holds without one.
    let gpus = ["GPU-a", "GPU-b"];
    let (h, tok) = owner_and_borrower(&gpus, |c| c.disruption_budget = None).await;
    let a = &h.admin;
    // The owner uses both GPUs for two seconds, then they end.
    let done = run_one_gpu_each(&h, "owner", &tok, &gpus).await;
    h.shared.cfg.clock.advance(2);
    cycle(&h).await;
    let exited: Vec<_> = done.iter().map(|&j| (j, 1, "exited")).collect();
    heartbeat(&h, "n1", &tok, inventory(&gpus, 65536), &exited).await;
    // The borrower takes both idle GPUs; the owner's next batch job would
    // reclaim one from a queue that has had less than it.
    let theirs = run_one_gpu_each(&h, "borrower", &tok, &gpus).await;
    let mine = submit(&h, "owner", "{count: 1}", 1024).await;
    cycle(&h).await;
    for j in theirs {
        let state = job_state(&h.get(&format!("/v1/jobs/{j}"), a).await.1);
        assert_eq!(state, "running", "job {j} kept: its queue has had less");
    }
    let (_, why) = h.get(&format!("/v1/jobs/{mine}/why"), a).await;
    assert!(
        why["reasons"]
            .to_string()
            .contains("reclaiming would take GPUs from queue borrower, which has had"),
        "{why}"
    );
}

#[tokio::test]
async fn an_evicted_job_counts_in_its_queues_quota_until_it_is_gone() {
    let h = harness(None).await;
    assert_eq!(
        h.json("POST", "/v1/teams", &h.admin, json!({"name": "t"}))
            .await
            .0,
        201
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &h.admin,
            json!({"name": "t", "team": "t", "quotas": {"H100": {"guaranteed": 1, "cap": 2}}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let tok = register(&h, "n1", inventory(&["GPU-a", "GPU-b"], 65536)).await;
    for _ in 0..2 {
        submit(&h, "t", "{count: 1}", 16384).await;
    }
    cycle(&h).await;
    register(&h, "n2", inventory(&["GPU-c", "GPU-d"], 65536)).await;
    // n1 shrinks: its jobs are evicted, but hold their GPUs until they stop.
    heartbeat(&h, "n1", &tok, inventory(&["GPU-a", "GPU-b"], 1024), &[]).await;
    let late = [
        submit(&h, "t", "{count: 1}", 1024).await,
        submit(&h, "t", "{count: 1}", 1024).await,
    ];
    cycle(&h).await;
    cycle(&h).await;
    for id in late {
        assert_eq!(
            job_state(&h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1),
            "pending",
            "queue t would hold more than its cap of 2 GPUs"
        );
    }
}

/// A heartbeat of `node` reporting job `job`'s task 0/0 in `phase` with
/// pieces of its output, `(stream, offset, text)`.
async fn ship(
    h: &H,
    (node, token): (&str, &str),
    (job, phase): (u64, &str),
    pieces: &[(&str, u64, &str)],
) -> (u16, Value) {
    let mut task = json!({"job": job, "attempt": 1, "group": 0, "index": 0, "phase": phase, "exit_code": if phase == "exited" { Some(0) } else { None }});
    for (stream, offset, text) in pieces {
        task[*stream] = json!({"offset": offset, "len": text.len(), "text": text});
    }
    h.json(
        "POST",
        "/v1/agent/heartbeat",
        token,
        json!({"node": node, "inventory": inventory(&[&format!("GPU-{node}")], 65536), "tasks": [task]}),
    )
    .await
}

/// The whole output of a job's only task, on both stores: kept beyond one
/// report's 16 KiB, each byte once whatever is sent again or overlaps,
/// gaps marked, NUL bytes replaced (PostgreSQL refuses them), the job's log
/// limit held (its last 16 KiB kept past it, with what is missing said),
/// nothing from a node the task does not run on, the last output after the
/// job ended, and all of it read from the store once the job left memory.
async fn output_kept(store: Option<String>) {
    let h = harness_on(store, |c| c.job_log_bytes = 64 << 10).await;
    let t1 = register(&h, "n1", inventory(&["GPU-n1"], 65536)).await;
    let id = submit(&h, "default", "{count: 1}", 1024).await;
    cycle(&h).await;
    let t2 = register(&h, "n2", inventory(&["GPU-n2"], 65536)).await;
    let (n1, n2) = (("n1", t1.as_str()), ("n2", t2.as_str()));
    let logs = |q: &'static str| {
        let h = &h;
        async move {
            let (s, v) = h.get(&format!("/v1/jobs/{id}/logs{q}"), &h.admin).await;
            assert_eq!(s, 200, "{v}");
            (
                v["tasks"]["main/0"].as_str().unwrap_or("").to_string(),
                v["stderr"]["main/0"].as_str().unwrap_or("").to_string(),
            )
        }
    };
    let running = (id, "running");
    let first = [("stdout", 0, "hello\n"), ("stderr", 0, "oops\n")];
    assert_eq!(ship(&h, n1, running, &first).await.0, 200);
    // The same heartbeat again (its reply was lost), then an overlap.
    ship(&h, n1, running, &first).await;
    ship(&h, n1, running, &[("stdout", 3, "lo\nworld\n")]).await;
    assert_eq!(logs("").await, ("hello\nworld\n".into(), "oops\n".into()));
    // A node that lies about a task it does not run adds nothing.
    let (s, _) = ship(&h, n2, running, &[("stdout", 12, "evil\n")]).await;
    assert_eq!(s, 200);
    assert!(!logs("").await.0.contains("evil"));
    // A gap the agent skipped, and a NUL byte.
    ship(&h, n1, running, &[("stdout", 100, "late\0\n")]).await;
    let (out, _) = logs("").await;
    assert!(
        out.starts_with("hello\nworld\n[gpuflow: 88 bytes of output skipped")
            && out.ends_with("late\u{fffd}\n"),
        "{out:?}"
    );
    // Far beyond 16 KiB: 40 KiB in pieces of 10, all kept.
    let line = |i: usize| format!("{i:09}\n");
    let block = |from: usize| (from..from + 1024).map(line).collect::<String>();
    let mut offset = 106;
    for k in 0..4 {
        let b = block(k * 1024);
        ship(&h, n1, running, &[("stdout", offset, &b)]).await;
        offset += b.len() as u64;
    }
    let (out, _) = logs("").await;
    for i in [0, 1023, 2048, 4095] {
        assert_eq!(out.matches(&line(i)).count(), 1, "line {i} once");
    }
    // Over the job's 64 KiB: what follows is not stored, the last 16 KiB
    // stay, and the text says how much is missing in between.
    for k in 4..8 {
        let b = block(k * 1024);
        ship(&h, n1, running, &[("stdout", offset, &b)]).await;
        offset += b.len() as u64;
    }
    let (out, _) = logs("").await;
    assert!(out.contains(&line(6143)), "the part within the limit");
    assert!(!out.contains(&line(6400)), "a part over it");
    assert!(out.ends_with(&line(8191)), "the end");
    assert!(
        out.contains("bytes not kept: the job's output went over its log limit of 64 KiB; the last 16 KiB follow"),
        "{}",
        &out[out.len() - 17000..out.len() - 16300]
    );
    let (tail, _) = logs("?tail_bytes=10").await;
    assert_eq!(tail, line(8191));
    for (q, says) in [
        (
            "?tail_bytes=ten",
            "tail_bytes: \"ten\" is not a whole number",
        ),
        ("?lines=3", "unknown parameter \"lines\""),
    ] {
        let (s, v) = h.get(&format!("/v1/jobs/{id}/logs{q}"), &h.admin).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["message"].as_str().unwrap().contains(says), "{v}");
    }
    // The task ends; its last output, in the report after, still counts.
    let ended = (id, "exited");
    ship(&h, n1, ended, &[("stdout", offset, "bye\n")]).await;
    assert_eq!(
        job_state(&h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1),
        "succeeded"
    );
    ship(&h, n1, ended, &[("stderr", 5, "last words\n")]).await;
    assert_eq!(logs("").await.1, "oops\nlast words\n");
    // Out of memory, from the store.
    h.shared
        .world
        .lock()
        .await
        .prune_finished(u64::MAX / 2, 3600);
    assert!(!h.shared.world.lock().await.jobs().contains_key(&id));
    let (out, err) = logs("?attempt=1").await;
    assert!(out.starts_with("hello\nworld\n") && out.ends_with("bye\n"));
    assert_eq!(err, "oops\nlast words\n");
    let (out, _) = logs("?attempt=2").await;
    assert_eq!(out, "");
}

#[tokio::test]
async fn output_is_kept_whole_once_and_within_the_job_limit_sqlite() {
    output_kept(None).await;
}

#[tokio::test]
async fn output_is_kept_whole_once_and_within_the_job_limit_postgres() {
    match gpuflow_store::pgtest::TempPostgres::start() {
        Ok(Some(pg)) => output_kept(Some(pg.url.clone())).await,
        Ok(None) => eprintln!("skipped: PostgreSQL is not installed (apt-get install postgresql)"),
        Err(e) => panic!("{e}"),
    }
}

/// Registers `nodes`, each with `gpus` GPUs named after it.
async fn register_nodes(h: &H, nodes: &[&str], gpus: usize) {
    for node in nodes {
        let uuids: Vec<String> = (0..gpus).map(|i| format!("GPU-{node}-{i}")).collect();
        let uuids: Vec<&str> = uuids.iter().map(String::as_str).collect();
        register(h, node, inventory(&uuids, 65536)).await;
    }
}

/// A job that no node can take yet, while enough GPUs are free in all, is
/// told through `why` that it starts when a node frees enough, not now.
#[tokio::test]
async fn why_tells_a_job_no_node_can_take_yet_when_a_node_frees_room() {
    let h = harness(None).await;
    register_nodes(&h, &["n1", "n2"], 3).await;
    // Two jobs of two GPUs, limited to one hour and to two: one on each
    // node, which keeps one GPU free (two in all).
    let job = |limit: &str| {
        format!(
            "name: j\nqueue: default\nkind: batch\n{limit}tasks:\n  - name: main\n    command: [train]\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: 2}}}}\n"
        )
    };
    for hours in [1, 2] {
        h.submit_spec(job(&format!("max_runtime_s: {}\n", hours * 3600)))
            .await;
    }
    let waiting = h.submit_spec(job("")).await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    cycle(&h).await;
    let (s, why) = h.get(&format!("/v1/jobs/{waiting}/why"), &h.admin).await;
    assert_eq!(s, 200, "{why}");
    assert_eq!(why["state"], "pending", "{why}");
    let eta = why["eta"].as_u64().expect("an estimated start");
    assert!(
        (now + 3590..=now + 3700).contains(&eta),
        "it starts when the one-hour job ends, {} s from now: {why}",
        eta as i64 - now as i64
    );
}

/// The placement keeps room for the shapes of the work that waits, not of
/// the work that runs: with only a one-GPU job waiting, it takes the
/// tightest node and leaves a whole four-GPU node free, where keeping room
/// for the running two-GPU job's shape left no node with more than three.
#[tokio::test]
async fn placement_keeps_room_for_what_waits_not_for_what_runs() {
    let h = harness(None).await;
    register_nodes(&h, &["n1", "n2"], 4).await;
    let node_of = |j: Value| j["tasks"][0]["node"].as_str().unwrap().to_string();
    let two = submit(&h, "default", "{count: 2}", 1024).await;
    cycle(&h).await;
    let busy = node_of(h.get(&format!("/v1/jobs/{two}"), &h.admin).await.1);
    let one = submit(&h, "default", "{count: 1}", 1024).await;
    cycle(&h).await;
    let (_, j) = h.get(&format!("/v1/jobs/{one}"), &h.admin).await;
    assert_eq!(
        node_of(j.clone()),
        busy,
        "the one-GPU job packs onto {busy}: {j}"
    );
}

/// Consolidation through the API: two 2-GPU nodes each run a one-GPU job,
/// and a two-GPU job fits on neither. One of the one-GPU jobs is told to
/// stop, with the reason; once it has, the two-GPU job starts on the node it
/// left and the moved job starts again on the other. With consolidation off
/// nothing moves.
#[tokio::test]
async fn a_job_that_fits_elsewhere_moves_so_that_a_job_no_node_takes_starts() {
    for on in [true, false] {
        let h = harness_with(|c| {
            c.min_runtime_s = 0;
            if !on {
                c.consolidate_max_unsaved_s = None;
            }
        })
        .await;
        let a = &h.admin;
        team_with_queue(&h, "t", 4.0).await;
        let (inv1, inv2) = (
            inventory(&["GPU-a", "GPU-b"], 65536),
            inventory(&["GPU-c", "GPU-d"], 65536),
        );
        let t1 = register(&h, "n1", inv1.clone()).await;
        let first = submit(&h, "t", "{count: 1}", 1024).await;
        cycle(&h).await;
        // n1 takes no new work while the second starts, so it goes to n2.
        let (s, v) = h
            .call("POST", "/v1/nodes/n1/cordon", Some(a), "", vec![])
            .await;
        assert_eq!(s, 200, "{v}");
        let t2 = register(&h, "n2", inv2.clone()).await;
        let second = submit(&h, "t", "{count: 1}", 1024).await;
        cycle(&h).await;
        let (s, v) = h
            .call("POST", "/v1/nodes/n1/uncordon", Some(a), "", vec![])
            .await;
        assert_eq!(s, 200, "{v}");
        heartbeat(&h, "n1", &t1, inv1.clone(), &[(first, 1, "running")]).await;
        heartbeat(&h, "n2", &t2, inv2.clone(), &[(second, 1, "running")]).await;
        let big = submit(&h, "t", "{count: 2}", 1024).await;
        cycle(&h).await;
        let state = |j: &Value| job_state(j);
        let (_, f) = h.get(&format!("/v1/jobs/{first}"), a).await;
        let (_, s2) = h.get(&format!("/v1/jobs/{second}"), a).await;
        let moved: Vec<&Value> = [&f, &s2]
            .into_iter()
            .filter(|j| state(j) == "stopping")
            .collect();
        if !on {
            assert!(moved.is_empty(), "nothing moves: {f} {s2}");
            let (_, b) = h.get(&format!("/v1/jobs/{big}"), a).await;
            assert_eq!(state(&b), "pending", "{b}");
            continue;
        }
        assert_eq!(moved.len(), 1, "one job moves: {f} {s2}");
        let m = moved[0];
        assert!(
            m["reason"].as_str().unwrap().contains(&format!(
                "preempted by job {big}: moved to make room for a job no node could take"
            )),
            "{m}"
        );
        // The moved job stops; the two-GPU job takes its node, and the
        // moved job starts again on the other.
        let (gone, node, tok, inv, stays) = if m["id"] == first {
            (
                first,
                "n1",
                &t1,
                inv1.clone(),
                (second, "n2", &t2, inv2.clone()),
            )
        } else {
            (
                second,
                "n2",
                &t2,
                inv2.clone(),
                (first, "n1", &t1, inv1.clone()),
            )
        };
        heartbeat(&h, node, tok, inv, &[(gone, 1, "exited")]).await;
        heartbeat(&h, stays.1, stays.2, stays.3, &[(stays.0, 1, "running")]).await;
        cycle(&h).await;
        let (_, b) = h.get(&format!("/v1/jobs/{big}"), a).await;
        assert_eq!(state(&b), "admitted", "{b}");
        assert_eq!(b["tasks"][0]["node"], node, "{b}");
        let (_, g) = h.get(&format!("/v1/jobs/{gone}"), a).await;
        assert_eq!(state(&g), "admitted", "{g}");
        assert_eq!(g["tasks"][0]["node"], stays.1, "{g}");
        check_no_gpu_held_twice(&h).await;
    }
}

/// One node's heartbeat reporting its desired tasks running, as a request.
async fn beat_running(h: &H, node: &str, token: &str, desired: &Value) -> (u16, Value) {
    let tasks: Vec<Value> = desired["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| json!({"job": t["job"], "attempt": t["attempt"], "group": t["group"], "index": t["index"], "phase": "running"}))
        .collect();
    let uuids = [format!("GPU-{node}-0")];
    let inv = inventory(&[uuids[0].as_str()], 65536);
    h.json(
        "POST",
        "/v1/agent/heartbeat",
        token,
        json!({"node": node, "inventory": inv, "tasks": tasks}),
    )
    .await
}

/// Heartbeats are folded in together, many to a transaction. Two nodes of
/// one gang that report at the same moment each count: the second is not
/// made against the job as it was before the first (which would drop the
/// first's report), and an agent that goes away before its answer still
/// has its report kept.
#[tokio::test]
async fn heartbeats_that_arrive_together_each_count() {
    let h = harness(None).await;
    let mut tokens = Vec::new();
    for node in ["n1", "n2"] {
        let uuid = format!("GPU-{node}-0");
        tokens.push(register(&h, node, inventory(&[uuid.as_str()], 65536)).await);
    }
    let spec = "name: g\nqueue: default\ntasks:\n  - name: w\n    replicas: 2\n    command: [train]\n    resources: {gpu: {count: 1}}\n";
    let gang = h.submit_spec(spec.into()).await;
    cycle(&h).await;
    let mut desired = Vec::new();
    for (node, token) in ["n1", "n2"].iter().zip(&tokens) {
        let (s, v) = beat_running(&h, node, token, &json!({"tasks": []})).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["tasks"].as_array().unwrap().len(), 1, "{v}");
        desired.push(v);
    }
    let (a, b) = tokio::join!(
        beat_running(&h, "n1", &tokens[0], &desired[0]),
        beat_running(&h, "n2", &tokens[1], &desired[1]),
    );
    assert_eq!((a.0, b.0), (200, 200), "{a:?} {b:?}");
    let (_, job) = h.get(&format!("/v1/jobs/{gang}"), &h.admin).await;
    assert_eq!(job_state(&job), "running", "{job}");

    // The gang's tasks exit on both nodes; n1's agent hangs up at once.
    let report = |node: &str, token: &str, d: &Value| {
        let tasks: Vec<Value> = d["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| json!({"job": t["job"], "attempt": t["attempt"], "group": t["group"], "index": t["index"], "phase": "exited", "exit_code": 0}))
            .collect();
        let uuid = format!("GPU-{node}-0");
        let body =
            json!({"node": node, "inventory": inventory(&[uuid.as_str()], 65536), "tasks": tasks});
        let req = axum::http::Request::builder()
            .method("POST")
            .uri("/v1/agent/heartbeat")
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(axum::body::Body::from(body.to_string()))
            .unwrap();
        h.router.clone().oneshot(req)
    };
    let gone = report("n1", &tokens[0], &desired[0]);
    // Polled until it waits for its answer, then dropped.
    let _ = tokio::time::timeout(std::time::Duration::from_millis(50), gone).await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            &tokens[1],
            json!({"node": "n2", "inventory": inventory(&["GPU-n2-0"], 65536), "tasks": [
                {"job": gang, "attempt": 1, "group": desired[1]["tasks"][0]["group"], "index": desired[1]["tasks"][0]["index"], "phase": "exited", "exit_code": 0}]}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (_, job) = h.get(&format!("/v1/jobs/{gang}"), &h.admin).await;
    assert_eq!(job_state(&job), "succeeded", "{job}");
    // The agent that hung up is answered on its next heartbeat.
    let (s, v) = beat_running(&h, "n1", &tokens[0], &json!({"tasks": []})).await;
    assert_eq!(s, 200, "{v}");
}
