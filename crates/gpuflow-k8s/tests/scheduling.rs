//! gpuflow scheduling pods through the real kube-rs client against the fake
//! API server: gangs, explanations, preemption, borrowing, tenancy.

mod support;

use serde_json::json;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_is_bound_all_or_nothing() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(node("n2", 4));
    api.apply(queue("ml", &["ml"], 16.0));
    // Three pods of four GPUs each: twelve GPUs on a cluster of eight.
    for i in 0..3 {
        api.apply(member("ml", &format!("w-{i}"), 4, "big", 3));
    }
    let _s = start(&client, "r1");
    eventually(10, "every pod of the gang explained", || {
        (0..3).all(|i| why(&api, "ml", &format!("w-{i}")).is_some())
    })
    .await;
    assert!(
        api.binds().is_empty(),
        "no pod of a gang that does not fit is bound: {:?}",
        api.binds()
    );
    // A third node: the whole gang starts, one pod a node.
    api.apply(node("n3", 4));
    eventually(10, "the gang bound", || {
        (0..3).all(|i| node_of(&api, "ml", &format!("w-{i}")).is_some())
    })
    .await;
    let mut nodes: Vec<String> = (0..3)
        .map(|i| node_of(&api, "ml", &format!("w-{i}")).unwrap())
        .collect();
    nodes.sort();
    assert_eq!(nodes, ["n1", "n2", "n3"]);
    assert!(binds_per_pod(&api).values().all(|n| *n == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_waits_for_all_its_pods_to_exist() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    // Kueue's plain pod group convention: two of three pods created.
    for i in 0..2 {
        let mut p = pod("ml", &format!("p-{i}"), 1);
        p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] = json!("grp");
        p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] = json!("3");
        api.apply(p);
    }
    let _s = start(&client, "r1");
    eventually(10, "the incomplete gang explained", || {
        why(&api, "ml", "p-0").is_some_and(|w| w.contains("2 of its 3 pods exist"))
    })
    .await;
    assert!(api.binds().is_empty());
    let mut p = pod("ml", "p-2", 1);
    p["metadata"]["labels"]["kueue.x-k8s.io/pod-group-name"] = json!("grp");
    p["metadata"]["annotations"]["kueue.x-k8s.io/pod-group-total-count"] = json!("3");
    api.apply(p);
    eventually(10, "the gang bound", || {
        (0..3).all(|i| node_of(&api, "ml", &format!("p-{i}")).is_some())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_does_not_fit_gets_the_explanation_as_condition_and_event() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    api.apply(pod("ml", "huge", 16));
    let _s = start(&client, "r1");
    eventually(10, "the condition", || why(&api, "ml", "huge").is_some()).await;
    let msg = why(&api, "ml", "huge").unwrap();
    assert!(msg.starts_with("gpuflow: "), "{msg}");
    assert!(msg.contains("position 1 in queue ml"), "{msg}");
    let p = get_pod(&api, "ml", "huge").unwrap();
    let cond = p["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "PodScheduled")
        .unwrap()
        .clone();
    assert_eq!(cond["reason"], "Unschedulable");
    let events = api.list("v1", "Event");
    let ev = events
        .iter()
        .find(|e| e["involvedObject"]["name"] == "huge" && e["reason"] == "FailedScheduling")
        .unwrap_or_else(|| panic!("no FailedScheduling event in {events:?}"));
    assert_eq!(ev["message"], msg);
    assert_eq!(ev["type"], "Warning");
    // `gpuflow k8s why` reads it back.
    let told = gpuflow_k8s::why(client.clone(), "ml", "huge", "gpuflow")
        .await
        .unwrap();
    assert!(told.starts_with("ml/huge waits: needs 16"), "{told}");
    let mut theirs = pod("ml", "theirs", 1);
    theirs["spec"]["schedulerName"] = json!("default-scheduler");
    api.apply(theirs);
    let told = gpuflow_k8s::why(client.clone(), "ml", "theirs", "gpuflow")
        .await
        .unwrap();
    assert!(
        told.contains("its schedulerName is default-scheduler"),
        "{told}"
    );
    assert!(
        gpuflow_k8s::why(client, "ml", "nope", "gpuflow")
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_priority_pod_preempts_a_lower_one_with_its_grace_period() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 4.0));
    api.apply(with_class(pod("ml", "low", 4), "batch"));
    let _s = start(&client, "r1");
    eventually(10, "the batch pod bound", || {
        node_of(&api, "ml", "low").is_some()
    })
    .await;
    api.apply(with_class(pod("ml", "high", 4), "inference"));
    // The victim is deleted with its grace period: terminating first.
    eventually(10, "the victim terminating", || {
        get_pod(&api, "ml", "low").is_some_and(|p| !p["metadata"]["deletionTimestamp"].is_null())
    })
    .await;
    let low = get_pod(&api, "ml", "low").unwrap();
    assert_eq!(low["metadata"]["deletionGracePeriodSeconds"], 1);
    assert!(
        node_of(&api, "ml", "high").is_none(),
        "the preemptor waits until its victim is gone"
    );
    eventually(10, "the preemptor bound", || {
        node_of(&api, "ml", "high").as_deref() == Some("n1")
    })
    .await;
    assert!(get_pod(&api, "ml", "low").is_none());
    let events = api.list("v1", "Event");
    assert!(
        events
            .iter()
            .any(|e| e["involvedObject"]["name"] == "low" && e["reason"] == "Preempted"),
        "{events:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_borrows_idle_gpus_and_is_reclaimed_when_their_owner_needs_them() {
    let (api, client) = server().await;
    borrower_of_idle_gpus(&api);
    let _s = start(&client, "r1");
    eventually(10, "team-b borrowing team-a's idle GPUs", || {
        node_of(&api, "b", "b-0").is_some() && node_of(&api, "b", "b-1").is_some()
    })
    .await;
    // The queues report what they hold.
    let status =
        |q: &str| api.get("gpuflow.io/v1alpha1", "GpuQueue", "", q).unwrap()["status"].clone();
    eventually(10, "team-b's status", || {
        let s = status("team-b");
        s["runningPods"] == 2 && s["gpusInUse"]["NVIDIA-H100-80GB-HBM3"] == 8.0
    })
    .await;
    api.apply(pod("a", "a-0", 4));
    eventually(15, "team-a's pod bound after reclaiming", || {
        node_of(&api, "a", "a-0").is_some()
    })
    .await;
    eventually(10, "both queues' status after the reclaim", || {
        let (a, b) = (status("team-a"), status("team-b"));
        a["runningPods"] == 1
            && a["gpusInUse"]["NVIDIA-H100-80GB-HBM3"] == 4.0
            && b["runningPods"] == 1
            && b["pendingPods"] == 0
            && b["gpusInUse"]["NVIDIA-H100-80GB-HBM3"] == 4.0
    })
    .await;
    let left: Vec<bool> = ["b-0", "b-1"]
        .iter()
        .map(|n| get_pod(&api, "b", n).is_some())
        .collect();
    assert_eq!(
        left.iter().filter(|l| **l).count(),
        1,
        "exactly one borrower was reclaimed: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_use_another_teams_queue_or_an_image_its_queue_does_not_allow() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("team-a", &["a"], 8.0));
    let mut strict = queue("team-c", &["c"], 8.0);
    strict["spec"]["images"] = json!(["registry.example.com/approved/"]);
    api.apply(strict);
    // A pod of namespace b naming team-a's queue.
    let mut p = pod("b", "sneaky", 1);
    p["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = json!("team-a");
    api.apply(p);
    // A pod of a namespace no queue takes.
    api.apply(pod("nobody", "orphan", 1));
    // An image team-c does not allow.
    api.apply(pod("c", "unapproved", 1));
    let _s = start(&client, "r1");
    eventually(10, "all three explained", || {
        why(&api, "b", "sneaky").is_some()
            && why(&api, "nobody", "orphan").is_some()
            && why(&api, "c", "unapproved").is_some()
    })
    .await;
    assert!(
        why(&api, "b", "sneaky")
            .unwrap()
            .contains("GpuQueue team-a does not take pods from namespace b")
    );
    assert!(
        why(&api, "nobody", "orphan")
            .unwrap()
            .contains("no GpuQueue takes namespace nobody")
    );
    assert!(
        why(&api, "c", "unapproved")
            .unwrap()
            .contains("image registry.example.com/ml/train:1 is not allowed in GpuQueue team-c")
    );
    assert!(api.binds().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_requests_are_refused_with_the_reason_not_ignored() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    let mut frac = pod("ml", "frac", 1);
    frac["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = json!("4000");
    api.apply(frac);
    api.apply(pod("ml", "too-big", 100));
    let mut aff = pod("ml", "aff", 1);
    aff["spec"]["affinity"] = json!({"nodeAffinity": {}});
    api.apply(aff);
    let _s = start(&client, "r1");
    eventually(10, "all explained", || {
        ["frac", "aff", "too-big"]
            .iter()
            .all(|p| why(&api, "ml", p).is_some())
    })
    .await;
    // Not quietly cut down to what a node has.
    let w = why(&api, "ml", "too-big").unwrap();
    assert!(
        w.contains("nvidia.com/gpu 100: one pod runs on one node"),
        "{w}"
    );
    // A share with a memory limit needs HAMi, which no node has.
    let w = why(&api, "ml", "frac").unwrap();
    assert!(
        w.contains("no node has HAMi's registration (hami.io/node-nvidia-register)"),
        "{w}"
    );
    assert!(
        why(&api, "ml", "aff")
            .unwrap()
            .contains("does not evaluate affinity yet")
    );
    assert!(api.binds().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_bound_by_another_scheduler_count_as_usage() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 8.0));
    let mut other = pod("ml", "theirs", 3);
    other["spec"]["schedulerName"] = json!("default-scheduler");
    other["spec"]["nodeName"] = json!("n1");
    other["status"]["phase"] = json!("Running");
    api.apply(other);
    api.apply(pod("ml", "two", 2));
    api.apply(pod("ml", "one", 1));
    let _s = start(&client, "r1");
    eventually(10, "the one-GPU pod bound", || {
        node_of(&api, "ml", "one").is_some()
    })
    .await;
    eventually(10, "the two-GPU pod explained", || {
        why(&api, "ml", "two").is_some()
    })
    .await;
    assert!(
        node_of(&api, "ml", "two").is_none(),
        "only one GPU was free"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mig_pods_take_instances_and_cordoned_tainted_or_unready_nodes_take_nothing_new() {
    let (api, client) = server().await;
    let mut mig = node("mig", 0);
    mig["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = json!("2");
    api.apply(mig);
    let mut cordoned = node("cordoned", 8);
    cordoned["spec"]["unschedulable"] = json!(true);
    api.apply(cordoned);
    let mut unready = node("unready", 8);
    unready["status"]["conditions"] = json!([{"type": "Ready", "status": "False"}]);
    api.apply(unready);
    let mut tainted = node("tainted", 8);
    tainted["spec"]["taints"] =
        json!([{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}]);
    api.apply(tainted);
    api.apply(queue("ml", &["ml"], 16.0));
    let mig_pod = |name: &str| {
        let mut p = pod("ml", name, 0);
        p["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/mig-1g.10gb": "1"});
        p
    };
    for n in ["nb-0", "nb-1", "nb-2"] {
        api.apply(mig_pod(n));
    }
    api.apply(pod("ml", "whole", 1));
    let mut tolerant = pod("ml", "tolerant", 1);
    tolerant["spec"]["tolerations"] = json!([{"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"}]);
    api.apply(tolerant);
    let _s = start(&client, "r1");
    eventually(10, "two MIG pods bound", || {
        ["nb-0", "nb-1", "nb-2"]
            .iter()
            .filter(|n| node_of(&api, "ml", n).is_some())
            .count()
            == 2
    })
    .await;
    eventually(10, "the tolerant pod bound", || {
        node_of(&api, "ml", "tolerant").as_deref() == Some("tainted")
    })
    .await;
    eventually(
        10,
        "the third MIG pod and the whole-GPU pod explained",
        || {
            ["nb-0", "nb-1", "nb-2"]
                .iter()
                .any(|n| why(&api, "ml", n).is_some())
                && why(&api, "ml", "whole").is_some()
        },
    )
    .await;
    assert!(
        ["nb-0", "nb-1", "nb-2"]
            .iter()
            .filter_map(|n| node_of(&api, "ml", n))
            .all(|n| n == "mig")
    );
    assert_eq!(
        node_of(&api, "ml", "whole"),
        None,
        "only the cordoned, unready and tainted nodes have whole GPUs"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_reports_fewer_gpus_than_its_pods_hold_gets_no_new_pods() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 8.0));
    let mut other = pod("ml", "theirs", 4);
    other["spec"]["schedulerName"] = json!("default-scheduler");
    other["spec"]["nodeName"] = json!("n1");
    other["status"]["phase"] = json!("Running");
    api.apply(other);
    // Its device plugin restarted and now reports two GPUs.
    api.apply(node("n1", 2));
    api.apply(pod("ml", "new", 1));
    let _s = start(&client, "r1");
    eventually(10, "the new pod explained", || {
        why(&api, "ml", "new").is_some()
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(node_of(&api, "ml", "new"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobs_pods_wait_for_its_parallelism_and_start_together() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    api.apply(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {"parallelism": 3, "completions": 3, "template": {"spec": {"containers": []}}}
    }));
    let uid = api.get("batch/v1", "Job", "ml", "train").unwrap()["metadata"]["uid"].clone();
    let owned = |name: &str| {
        let mut p = pod("ml", name, 2);
        p["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": uid, "controller": true}]);
        p
    };
    api.apply(owned("train-a"));
    api.apply(owned("train-b"));
    let _s = start(&client, "r1");
    eventually(10, "the Job's pods wait for the third", || {
        why(&api, "ml", "train-a").is_some_and(|w| w.contains("2 of its 3 pods exist"))
    })
    .await;
    assert!(api.binds().is_empty());
    api.apply(owned("train-c"));
    eventually(10, "the Job's three pods bound", || {
        ["train-a", "train-b", "train-c"]
            .iter()
            .all(|p| node_of(&api, "ml", p).is_some())
    })
    .await;
}

/// A JobSet's gang is all its Jobs' pods, not the first Job's: with two
/// Jobs of two pods, the first Job's pods wait for the second's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jobsets_pods_wait_for_all_its_jobs_and_start_together() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    let job = |name: &str| {
        json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "ml", "labels": {
                "jobset.sigs.k8s.io/jobset-name": "llm", "jobset.sigs.k8s.io/global-replicas": "2"}},
            "spec": {"parallelism": 2, "completions": 2, "template": {"spec": {"containers": []}}}
        })
    };
    let member = |job_name: &str, name: &str| {
        let uid = api.get("batch/v1", "Job", "ml", job_name).unwrap()["metadata"]["uid"].clone();
        let mut p = pod("ml", name, 2);
        p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] = json!("llm");
        p["metadata"]["labels"]["jobset.sigs.k8s.io/global-replicas"] = json!("2");
        p["metadata"]["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": uid, "controller": true}]);
        p
    };
    api.apply(job("llm-workers-0"));
    api.apply(member("llm-workers-0", "w-0-0"));
    api.apply(member("llm-workers-0", "w-0-1"));
    let _s = start(&client, "r1");
    eventually(
        10,
        "the first Job's pods wait for the JobSet's other Job",
        || why(&api, "ml", "w-0-0").is_some_and(|w| w.contains("1 of its 2 Jobs exist")),
    )
    .await;
    api.apply(job("llm-workers-1"));
    api.apply(member("llm-workers-1", "w-1-0"));
    eventually(10, "three of the four pods wait for the fourth", || {
        why(&api, "ml", "w-0-0").is_some_and(|w| w.contains("3 of its 4 pods exist"))
    })
    .await;
    assert!(api.binds().is_empty(), "part of a JobSet was bound");
    api.apply(member("llm-workers-1", "w-1-1"));
    eventually(10, "the JobSet's four pods bound", || {
        ["w-0-0", "w-0-1", "w-1-0", "w-1-1"]
            .iter()
            .all(|p| node_of(&api, "ml", p).is_some())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_sliced_gpus_take_slices_only_and_whole_gpu_pods_keep_off_them() {
    let (api, client) = server().await;
    // NVIDIA's device plugin with time-slicing (renameByDefault): one GPU
    // advertised as four replicas of nvidia.com/gpu.shared.
    let mut sliced = node("sliced", 0);
    sliced["status"]["allocatable"]["nvidia.com/gpu.shared"] = json!("4");
    sliced["metadata"]["labels"]["nvidia.com/gpu.replicas"] = json!("4");
    api.apply(sliced);
    api.apply(node("whole", 1));
    api.apply(queue("ml", &["ml"], 8.0));
    let slice = |name: &str| {
        let mut p = pod("ml", name, 0);
        p["spec"]["containers"][0]["resources"]["limits"] = json!({"nvidia.com/gpu.shared": "1"});
        with_class(p, "notebook")
    };
    for i in 0..5 {
        api.apply(slice(&format!("nb-{i}")));
    }
    api.apply(pod("ml", "train", 1));
    api.apply(pod("ml", "train-2", 1));
    let _s = start(&client, "r1");
    eventually(10, "four slices bound on the time-sliced node", || {
        (0..5)
            .filter(|i| node_of(&api, "ml", &format!("nb-{i}")).as_deref() == Some("sliced"))
            .count()
            == 4
    })
    .await;
    eventually(10, "one whole-GPU pod bound on the whole node", || {
        ["train", "train-2"]
            .iter()
            .filter(|p| node_of(&api, "ml", p).as_deref() == Some("whole"))
            .count()
            == 1
    })
    .await;
    eventually(
        10,
        "the fifth slice and the second whole-GPU pod explained",
        || {
            (0..5).any(|i| why(&api, "ml", &format!("nb-{i}")).is_some())
                && ["train", "train-2"]
                    .iter()
                    .any(|p| why(&api, "ml", p).is_some())
        },
    )
    .await;
    // Neither kind landed on the other's node.
    assert!(
        (0..5)
            .filter_map(|i| node_of(&api, "ml", &format!("nb-{i}")))
            .all(|n| n == "sliced")
    );
    assert!(
        ["train", "train-2"]
            .iter()
            .filter_map(|p| node_of(&api, "ml", p))
            .all(|n| n == "whole")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_that_used_its_budget_starts_nothing_new_until_the_next_period() {
    use gpuflow_k8s::scheduler::Scheduler;
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    let mut q = queue("ml", &["ml"], 4.0);
    // 3.6 GPU-seconds a day.
    q["spec"]["budget"] =
        json!({"gpuHours": 0.001, "period": "Day", "whenExhausted": "StopAdmitting"});
    api.apply(q);
    api.apply(pod("ml", "busy", 4));
    let mut s = Scheduler::new(client.clone(), settings("r1"));
    s.ready().await;
    assert!(s.try_lead().await.unwrap());
    s.tick().await.unwrap();
    eventually(10, "the first pod bound", || {
        node_of(&api, "ml", "busy").is_some()
    })
    .await;
    // Four GPUs for 1.5 s: 6 GPU-seconds, over the budget.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    s.tick().await.unwrap();
    api.remove("v1", "Pod", "ml", "busy");
    api.apply(pod("ml", "next", 1));
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    s.tick().await.unwrap();
    let w = why(&api, "ml", "next").expect("the pod is explained");
    assert!(
        w.contains("queue ml's GPU-hour budget is used up: it starts no new work"),
        "{w}"
    );
    assert_eq!(node_of(&api, "ml", "next"), None);
    let status = api
        .get("gpuflow.io/v1alpha1", "GpuQueue", "", "ml")
        .unwrap()["status"]
        .clone();
    assert!(
        status["budgetUsedGpuHours"].as_f64().unwrap() >= 0.001,
        "{status}"
    );
    // A budget that is not used up does not hold anything back.
    let mut q = queue("ml", &["ml"], 4.0);
    q["spec"]["budget"] =
        json!({"gpuHours": 100, "period": "Day", "whenExhausted": "StopAdmitting"});
    api.apply(q);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    s.tick().await.unwrap();
    eventually(10, "the pod bound under the larger budget", || {
        node_of(&api, "ml", "next").is_some()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_claims_absurd_gpu_counts_does_not_stop_scheduling() {
    let (api, client) = server().await;
    let mut liar = node("liar", 100_000);
    liar["status"]["allocatable"]["nvidia.com/mig-1g.10gb"] = json!("5000");
    liar["status"]["allocatable"]["nvidia.com/gpu.shared"] = json!("100000");
    liar["metadata"]["labels"]["nvidia.com/gpu.replicas"] = json!("1");
    api.apply(liar);
    api.apply(node("honest", 2));
    api.apply(queue("ml", &["ml"], 1000.0));
    api.apply(pod("ml", "a", 2));
    let _s = start(&client, "r1");
    eventually(10, "a pod bound despite the liar", || {
        node_of(&api, "ml", "a").is_some()
    })
    .await;
    // The scheduler is still cycling: the next pod is explained (the
    // honest node is full; the liar is time-sliced, so no whole GPUs there).
    api.apply(pod("ml", "b", 1));
    eventually(10, "the next pod explained", || {
        why(&api, "ml", "b").is_some()
    })
    .await;
    // A CPU-only pod may use the liar.
    api.apply(pod("ml", "c", 0));
    eventually(10, "a CPU-only pod bound", || {
        node_of(&api, "ml", "c").is_some()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_fields_gpuflow_does_not_evaluate_are_refused_and_the_rest_enforced() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    let mut spread = pod("ml", "spread", 1);
    spread["spec"]["topologySpreadConstraints"] = json!([{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}]);
    api.apply(spread);
    let mut port = pod("ml", "port", 1);
    port["spec"]["containers"][0]["ports"] = json!([{"containerPort": 80, "hostPort": 8080}]);
    api.apply(port);
    let mut huge = pod("ml", "hugepages", 1);
    huge["spec"]["containers"][0]["resources"]["limits"]["hugepages-2Mi"] = json!("1Gi");
    api.apply(huge);
    let mut claim = pod("ml", "claim", 0);
    claim["spec"]["resourceClaims"] = json!([{"name": "gpu", "resourceClaimName": "a-claim"}]);
    api.apply(claim);
    // The runtime class's overhead counts: 60 CPUs and 8 of overhead do
    // not fit a node of 64.
    let mut heavy = pod("ml", "overhead", 0);
    heavy["spec"]["containers"][0]["resources"]["requests"]["cpu"] = json!("60");
    heavy["spec"]["overhead"] = json!({"cpu": "8"});
    api.apply(heavy);
    // A gated pod waits for its gates.
    let mut gated = pod("ml", "gated", 1);
    gated["spec"]["schedulingGates"] = json!([{"name": "kueue.x-k8s.io/admission"}]);
    api.apply(gated.clone());
    let _s = start(&client, "r1");
    let names = ["spread", "port", "hugepages", "claim", "overhead", "gated"];
    eventually(10, "all explained", || {
        names.iter().all(|p| why(&api, "ml", p).is_some())
    })
    .await;
    for (p, says) in [
        ("spread", "topologySpreadConstraints"),
        ("port", "hostPort 8080"),
        ("hugepages", "does not account for hugepages-2Mi"),
        ("claim", "DRA resource claims"),
        ("overhead", "68 CPU"),
        (
            "gated",
            "waits for its scheduling gates: kueue.x-k8s.io/admission",
        ),
    ] {
        let told = why(&api, "ml", p).unwrap();
        assert!(told.contains(says), "{p}: {told}");
    }
    assert!(api.binds().is_empty(), "{:?}", api.binds());
    // Its gates removed, the pod is scheduled.
    gated["spec"]["schedulingGates"] = json!([]);
    api.apply(gated);
    eventually(10, "the ungated pod bound", || {
        node_of(&api, "ml", "gated").is_some()
    })
    .await;
}

/// Consolidation: two 2-GPU nodes each run a one-GPU training pod, and a
/// two-GPU training pod of the same queue fits on neither (no priority to
/// preempt by, no guarantee to reclaim). One one-GPU pod is deleted with its
/// grace period and told why (its controller makes it again; it fits on the
/// other node), and the two-GPU pod binds to the node it left. It is off by
/// default on Kubernetes (a deleted bare pod does not come back): without
/// it nothing moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_fits_elsewhere_is_moved_so_that_a_pod_no_node_takes_binds() {
    let (api, client) = server().await;
    api.apply(node("n1", 2));
    api.apply(node("n2", 2));
    api.apply(queue("ml", &["ml"], 4.0));
    for (name, on) in [("a", "n1"), ("b", "n2")] {
        let mut p = with_class(pod("ml", name, 1), "training");
        p["spec"]["nodeName"] = json!(on);
        p["status"]["phase"] = json!("Running");
        api.apply(p);
    }
    api.apply(with_class(pod("ml", "big", 2), "training"));
    let off = start(&client, "r0");
    eventually(10, "the two-GPU pod explained", || {
        why(&api, "ml", "big").is_some()
    })
    .await;
    assert!(
        get_pod(&api, "ml", "a").is_some() && get_pod(&api, "ml", "b").is_some(),
        "nothing moves by default"
    );
    off.abort();
    let mut on = settings("r1");
    on.config.consolidate_max_unsaved = Some(900);
    let s = gpuflow_k8s::scheduler::Scheduler::new(client.clone(), on);
    let _s = tokio::spawn(async move {
        let _ = s.run(std::future::pending()).await;
    });
    eventually(10, "the two-GPU pod bound", || {
        node_of(&api, "ml", "big").is_some()
    })
    .await;
    let gone: Vec<&str> = ["a", "b"]
        .into_iter()
        .filter(|n| get_pod(&api, "ml", n).is_none())
        .collect();
    assert_eq!(gone.len(), 1, "one one-GPU pod moved");
    let left = if gone[0] == "a" { "n1" } else { "n2" };
    assert_eq!(node_of(&api, "ml", "big").as_deref(), Some(left));
    let events = api.list("v1", "Event");
    assert!(
        events.iter().any(|e| e["involvedObject"]["name"] == gone[0]
            && e["reason"] == "Preempted"
            && e["message"]
                .as_str()
                .is_some_and(|m| m.contains("moved to make room"))),
        "{events:?}"
    );
}
