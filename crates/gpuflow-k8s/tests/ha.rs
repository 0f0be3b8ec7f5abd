//! Two replicas and restarts: one leader through the Lease, a takeover
//! without double binding, a gang finished after its scheduler died
//! half-way, watches that start over after `410 Gone`, disruption budgets.

mod support;

use std::time::Duration;

use gpuflow_k8s::scheduler::Scheduler;
use serde_json::json;
use support::*;

/// The scheduler's Lease object.
fn lease(api: &gpuflow_k8s::fake::FakeApi) -> Option<serde_json::Value> {
    api.get(
        "coordination.k8s.io/v1",
        "Lease",
        "gpuflow-system",
        "gpuflow-scheduler",
    )
}

fn holder(api: &gpuflow_k8s::fake::FakeApi) -> Option<(String, i64, String)> {
    let l = lease(api)?;
    Some((
        l["spec"]["holderIdentity"].as_str()?.to_string(),
        l["spec"]["leaseTransitions"].as_i64().unwrap_or(0),
        l["spec"]["renewTime"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    ))
}

/// The state the lease holder keeps on the lease (its annotation, as written).
fn lease_state(api: &gpuflow_k8s::fake::FakeApi) -> Option<String> {
    let l = lease(api)?;
    Some(
        l["metadata"]["annotations"]["gpuflow.io/state"]
            .as_str()?
            .to_string(),
    )
}

/// Tries the lease until it is `s`'s (the last holder's expires in 2 s).
async fn lead_once_expired(s: &mut Scheduler) {
    for _ in 0..60 {
        if s.try_lead().await.unwrap() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the lease was not taken over once it expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_have_one_leader_and_the_other_takes_over_without_double_binding() {
    let (api, client) = server().await;
    for i in 0..4 {
        api.apply(node(&format!("n{i}"), 2));
    }
    api.apply(queue("ml", &["ml"], 8.0));
    let r1 = start(&client, "r1");
    eventually(10, "r1 holds the lease", || {
        holder(&api).is_some_and(|h| h.0 == "r1")
    })
    .await;
    let r2 = start(&client, "r2");
    for i in 0..3 {
        api.apply(pod("ml", &format!("a-{i}"), 2));
    }
    eventually(10, "the leader binds", || {
        (0..3).all(|i| node_of(&api, "ml", &format!("a-{i}")).is_some())
    })
    .await;
    // The follower keeps off while the leader renews.
    let before = holder(&api).unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let after = holder(&api).unwrap();
    assert_eq!(
        (after.0.as_str(), after.1),
        ("r1", 0),
        "the leader kept its lease"
    );
    assert_ne!(before.2, after.2, "and renewed it");
    // The leader dies without giving the lease up.
    r1.abort();
    let _ = r1.await;
    api.apply(pod("ml", "b-0", 2));
    api.apply(pod("ml", "b-1", 2));
    eventually(15, "r2 takes over", || {
        holder(&api).is_some_and(|h| h.0 == "r2" && h.1 == 1)
    })
    .await;
    eventually(10, "r2 binds what fits", || {
        node_of(&api, "ml", "b-0").is_some() || node_of(&api, "ml", "b-1").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Eight GPUs: four pods of two fit, the fifth waits.
    let bound: Vec<String> = ["a-0", "a-1", "a-2", "b-0", "b-1"]
        .iter()
        .filter_map(|p| node_of(&api, "ml", p))
        .collect();
    assert_eq!(bound.len(), 4, "{bound:?}");
    let mut per_node = std::collections::BTreeMap::new();
    for n in &bound {
        *per_node.entry(n.clone()).or_insert(0) += 1;
    }
    assert!(
        per_node.values().all(|c| *c == 1),
        "each node holds one pod of two GPUs: {per_node:?}"
    );
    assert!(
        binds_per_pod(&api).values().all(|n| *n == 1),
        "{:?}",
        api.binds()
    );
    assert!(
        api.binds().iter().all(|b| b.status == 201),
        "no binding was tried twice: {:?}",
        api.binds()
    );
    r2.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_the_middle_of_binding_a_gang_finishes_the_gang_as_planned() {
    let (api, client) = server().await;
    for i in 0..4 {
        api.apply(node(&format!("n{i}"), 1));
    }
    api.apply(queue("ml", &["ml"], 8.0));
    for i in 0..4 {
        api.apply(member("ml", &format!("w-{i}"), 1, "train", 4));
    }
    api.stall_binds_after(2);
    let mut a = Scheduler::new(client.clone(), settings("a"));
    a.ready().await;
    assert!(a.try_lead().await.unwrap());
    let cycle = tokio::spawn(async move {
        let _ = a.tick().await;
    });
    eventually(10, "two of the gang bound", || {
        binds_per_pod(&api).len() == 2
    })
    .await;
    // The scheduler dies with two bindings in flight.
    cycle.abort();
    let _ = cycle.await;
    // Meanwhile a more urgent single pod arrives that would take one of
    // the two free nodes if the gang's plan were forgotten.
    api.apply(with_class(pod("ml", "urgent", 1), "inference"));
    api.release_binds();
    let planned: Vec<String> = (0..4)
        .map(|i| {
            get_pod(&api, "ml", &format!("w-{i}")).unwrap()["metadata"]["annotations"]["gpuflow.io/node"]
                .as_str()
                .expect("every pod of the gang was planned before any was bound")
                .to_string()
        })
        .collect();
    let mut b = Scheduler::new(client.clone(), settings("b"));
    b.ready().await;
    // The lease is a's until it expires.
    assert!(
        !b.try_lead().await.unwrap(),
        "a's lease has not expired yet"
    );
    lead_once_expired(&mut b).await;
    b.tick().await.unwrap();
    for (i, plan) in planned.iter().enumerate() {
        let on = node_of(&api, "ml", &format!("w-{i}"));
        assert_eq!(
            on.as_deref(),
            Some(plan.as_str()),
            "w-{i} bound where it was planned"
        );
    }
    assert_eq!(
        node_of(&api, "ml", "urgent"),
        None,
        "the gang's nodes were not given away"
    );
    assert!(
        binds_per_pod(&api).values().all(|n| *n == 1),
        "{:?}",
        api.binds()
    );
    assert_eq!(binds_per_pod(&api).len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_list_again_after_410_gone_and_miss_nothing() {
    let (api, client) = server().await;
    api.apply(node("n1", 8));
    api.apply(queue("ml", &["ml"], 8.0));
    let _s = start(&client, "r1");
    api.apply(pod("ml", "before", 1));
    eventually(10, "the first pod bound", || {
        node_of(&api, "ml", "before").is_some()
    })
    .await;
    let lists = |api: &gpuflow_k8s::fake::FakeApi| {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("GET /api/v1/pods?") && !r.contains("watch=true"))
            .count()
    };
    let listed = lists(&api);
    // The caches watch from a version, with bookmarks.
    let watches: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.starts_with("GET /api/v1/pods?") && r.contains("watch=true"))
        .collect();
    assert!(
        watches
            .iter()
            .all(|w| w.contains("allowWatchBookmarks=true") && w.contains("resourceVersion=")),
        "{watches:?}"
    );
    api.compact();
    api.apply(pod("ml", "after", 1));
    eventually(10, "the pod created after the compaction bound", || {
        node_of(&api, "ml", "after").is_some()
    })
    .await;
    assert!(
        lists(&api) > listed,
        "the pods were listed again after 410 Gone: {:?}",
        api.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disruption_budget_keeps_its_pods_from_preemption_until_it_allows_one() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 4.0));
    let mut low = with_class(pod("ml", "low", 4), "batch");
    low["metadata"]["labels"]["app"] = json!("serve");
    api.apply(low);
    let pdb = |allowed: i32| {
        json!({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "serve", "namespace": "ml"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "serve"}}},
            "status": {"disruptionsAllowed": allowed, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1}})
    };
    api.apply(pdb(0));
    let _s = start(&client, "r1");
    eventually(10, "the low pod bound", || {
        node_of(&api, "ml", "low").is_some()
    })
    .await;
    api.apply(with_class(pod("ml", "high", 4), "inference"));
    eventually(10, "the preemptor explained", || {
        why(&api, "ml", "high").is_some()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let low = get_pod(&api, "ml", "low").unwrap();
    assert!(
        low["metadata"]["deletionTimestamp"].is_null(),
        "the budget allows no disruption"
    );
    api.apply(pdb(1));
    eventually(10, "the victim terminating once the budget allows", || {
        get_pod(&api, "ml", "low").is_none_or(|p| !p["metadata"]["deletionTimestamp"].is_null())
    })
    .await;
    eventually(10, "the preemptor bound", || {
        node_of(&api, "ml", "high").is_some()
    })
    .await;
}

/// The verb, API group, resource (with subresource) and namespace of a
/// request the fake logged, as RBAC sees it.
fn rbac_of(request: &str) -> (String, String, String, String) {
    let (method, uri) = request.split_once(' ').unwrap();
    let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest.to_vec()),
        ["apis", g, _, rest @ ..] => (*g, rest.to_vec()),
        _ => panic!("{request}"),
    };
    let (ns, rest) = match rest.as_slice() {
        ["namespaces", ns, r @ ..] if !r.is_empty() => (ns.to_string(), r.to_vec()),
        r => (String::new(), r.to_vec()),
    };
    let named = rest.len() > 1;
    let resource = match rest.as_slice() {
        [r, _, sub] => format!("{r}/{sub}"),
        [r, ..] => r.to_string(),
        _ => panic!("{request}"),
    };
    let verb = match (method, named) {
        ("GET", false) if query.contains("watch=true") => "watch",
        ("GET", false) => "list",
        ("GET", true) => "get",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        _ => panic!("{request}"),
    };
    (verb.into(), group.into(), resource, ns)
}

fn allows(
    rules: &[k8s_openapi::api::rbac::v1::PolicyRule],
    verb: &str,
    group: &str,
    resource: &str,
) -> bool {
    rules.iter().any(|r| {
        r.verbs.iter().any(|v| v == verb)
            && r.api_groups.iter().flatten().any(|g| g == group)
            && r.resources.iter().flatten().any(|x| x == resource)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_the_scheduler_makes_is_allowed_by_the_rbac_it_installs_with() {
    use gpuflow_k8s::manifests;
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 5.0));
    // Binding (a gang: annotations too), explanation, preemption, events, the lease.
    api.apply(with_class(member("ml", "low-0", 2, "low", 2), "batch"));
    api.apply(with_class(member("ml", "low-1", 2, "low", 2), "batch"));
    api.apply(pod("ml", "huge", 16));
    // A share on a HAMi node: the node lock.
    api.apply(hami_node("h1", &[("GPU-a", 81559)]));
    api.apply(share_pod("ml", "nb", 1000, 10));
    let s = start(&client, "r1");
    eventually(10, "the gang bound", || {
        node_of(&api, "ml", "low-0").is_some()
    })
    .await;
    eventually(10, "the share bound", || {
        node_of(&api, "ml", "nb").is_some()
    })
    .await;
    api.apply(with_class(pod("ml", "high", 4), "inference"));
    eventually(15, "the preemptor bound", || {
        node_of(&api, "ml", "high").is_some()
    })
    .await;
    s.abort();
    let mut cluster = manifests::cluster_role().rules.unwrap();
    cluster.extend(manifests::hami_role().rules.unwrap());
    let lease = manifests::lease_role("gpuflow-system");
    let mut seen = std::collections::BTreeSet::new();
    for r in api.requests() {
        let (verb, group, resource, ns) = rbac_of(&r);
        let ok = allows(&cluster, &verb, &group, &resource)
            || (ns == "gpuflow-system"
                && allows(lease.rules.as_ref().unwrap(), &verb, &group, &resource));
        assert!(
            ok,
            "{r}: {verb} {group}/{resource} in {ns:?} is not granted"
        );
        seen.insert(format!("{verb} {group}/{resource}"));
    }
    // The scenario used what the roles grant for writing.
    for needed in [
        "create /pods/binding",
        "patch /pods",
        "patch /pods/status",
        "delete /pods",
        "create /events",
        "watch batch/jobs",
        "patch gpuflow.io/gpuqueues/status",
        "patch /nodes",
    ] {
        assert!(seen.contains(needed), "{needed} not exercised: {seen:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fair_share_usage_survives_a_change_of_leader_through_the_lease() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 4.0));
    api.apply(pod("ml", "busy", 4));
    let mut a = Scheduler::new(client.clone(), settings("a"));
    a.ready().await;
    assert!(a.try_lead().await.unwrap());
    a.tick().await.unwrap();
    eventually(10, "the pod bound", || {
        node_of(&api, "ml", "busy").is_some()
    })
    .await;
    // Let the bound pod run a while: a's cycles charge its queue.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    a.tick().await.unwrap();
    let used = a.usage().gpu_hours.get("ml").copied().unwrap_or(0.0);
    assert!(
        used > 0.0,
        "four GPUs for two seconds are charged: {:?}",
        a.usage()
    );
    // The renewal carries it to the lease.
    assert!(a.try_lead().await.unwrap());
    let state = lease_state(&api).unwrap();
    assert!(state.contains("\"ml\""), "{state}");
    drop(a);
    let mut b = Scheduler::new(client.clone(), settings("b"));
    b.ready().await;
    lead_once_expired(&mut b).await;
    assert_eq!(
        b.usage().gpu_hours.get("ml").copied(),
        Some(used),
        "b starts from a's usage"
    );
    b.tick().await.unwrap();
    assert!(
        b.usage().gpu_hours["ml"] > used,
        "and goes on charging: {:?}",
        b.usage()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_loses_the_race_for_an_expired_lease_stays_a_follower() {
    let (api, client) = server().await;
    // A lease whose holder stopped renewing a minute ago.
    let old = k8s_openapi::jiff::Timestamp::now()
        .checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(60))
        .unwrap()
        .to_string();
    api.apply(json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "gpuflow-scheduler", "namespace": "gpuflow-system"},
        "spec": {"holderIdentity": "gone", "leaseDurationSeconds": 2, "renewTime": old, "acquireTime": old, "leaseTransitions": 3}}));
    let mut s = Scheduler::new(client.clone(), settings("r1"));
    s.ready().await;
    // Another replica writes the lease between r1's read and its write.
    api.race_next_replace("Lease");
    assert!(
        !s.try_lead().await.unwrap(),
        "a write on a stale version loses"
    );
    assert_eq!(holder(&api).unwrap().0, "gone", "and changes nothing");
    assert!(
        s.try_lead().await.unwrap(),
        "the next try, on the current version, wins"
    );
    assert_eq!(
        holder(&api).unwrap(),
        ("r1".to_string(), 4, holder(&api).unwrap().2)
    );
}

/// Runs `s`'s cycles, 100 ms apart, until `done` holds of it (at most 50
/// cycles); whether it did.
async fn tick_until(s: &mut Scheduler, mut done: impl FnMut(&Scheduler) -> bool) -> bool {
    for _ in 0..50 {
        s.tick().await.unwrap();
        if done(s) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// The reclaims counted against queue `q`'s disruption budget, as the
/// scheduler keeps them (and writes them on the lease).
fn disruptions(s: &Scheduler, q: &str) -> serde_json::Value {
    serde_json::to_value(s.usage()).unwrap()["disruptions"][q].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reclaims_counted_against_a_disruption_budget_survive_a_change_of_leader() {
    let (api, client) = server().await;
    borrower_of_idle_gpus(&api);
    let mut a = Scheduler::new(client.clone(), settings("a"));
    a.ready().await;
    assert!(a.try_lead().await.unwrap());
    let borrowing = tick_until(&mut a, |_| {
        node_of(&api, "b", "b-0").is_some() && node_of(&api, "b", "b-1").is_some()
    })
    .await;
    assert!(borrowing, "team-b borrows team-a's idle GPUs");
    // team-a takes its guarantee back: a reclaim, which counts against
    // team-b's disruption budget for the window.
    api.apply(pod("a", "a-0", 4));
    tick_until(&mut a, |a| {
        disruptions(a, "team-b")
            .as_array()
            .is_some_and(|v| !v.is_empty())
    })
    .await;
    let counted = disruptions(&a, "team-b");
    assert!(
        counted.as_array().is_some_and(|v| v.len() == 1),
        "one reclaim counted against team-b: {:?}",
        a.usage()
    );
    assert!(
        disruptions(&a, "team-a").is_null(),
        "nothing against team-a"
    );
    // The renewal carries the record to the lease, and the next leader
    // goes on counting from it: its first cycle keeps it (the window is
    // an hour), so a second reclaim would be paced as under the first.
    assert!(a.try_lead().await.unwrap());
    drop(a);
    let mut b = Scheduler::new(client.clone(), settings("b"));
    b.ready().await;
    lead_once_expired(&mut b).await;
    assert_eq!(
        disruptions(&b, "team-b"),
        counted,
        "b starts from a's record"
    );
    b.tick().await.unwrap();
    assert_eq!(
        disruptions(&b, "team-b"),
        counted,
        "b's cycle keeps it: {:?}",
        b.usage()
    );
    // A queue that sorts first moves every queue's id: the record stays
    // with team-b's name.
    api.apply(queue("team-0", &["z"], 0.0));
    let seen = tick_until(&mut b, |_| {
        api.get("gpuflow.io/v1alpha1", "GpuQueue", "", "team-0")
            .is_some_and(|q| q["status"].is_object())
    })
    .await;
    assert!(seen, "b schedules with team-0 (it writes its status)");
    assert_eq!(disruptions(&b, "team-b"), counted, "{:?}", b.usage());
    assert!(
        disruptions(&b, "team-0").is_null() && disruptions(&b, "team-a").is_null(),
        "{:?}",
        b.usage()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_does_not_preempt_again_for_a_preemptor_whose_victim_is_still_stopping() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 4.0));
    // Batch pods that take 30 s to stop once told to.
    let slow = |name: &str| {
        let mut p = with_class(pod("ml", name, 2), "batch");
        p["spec"]["terminationGracePeriodSeconds"] = json!(30);
        p
    };
    api.apply(slow("low-0"));
    api.apply(slow("low-1"));
    let mut a = Scheduler::new(client.clone(), settings("a"));
    a.ready().await;
    assert!(a.try_lead().await.unwrap());
    let terminating = |api: &gpuflow_k8s::fake::FakeApi| -> Vec<&'static str> {
        ["low-0", "low-1"]
            .into_iter()
            .filter(|n| {
                get_pod(api, "ml", n).is_some_and(|p| !p["metadata"]["deletionTimestamp"].is_null())
            })
            .collect()
    };
    let bound = tick_until(&mut a, |_| {
        node_of(&api, "ml", "low-0").is_some() && node_of(&api, "ml", "low-1").is_some()
    })
    .await;
    assert!(bound, "both batch pods run");
    // A service needs two of the four GPUs: one batch pod is preempted.
    api.apply(with_class(pod("ml", "high", 2), "inference"));
    tick_until(&mut a, |_| !terminating(&api).is_empty()).await;
    let first = terminating(&api);
    assert_eq!(first.len(), 1, "one victim is enough: {first:?}");
    // The leader wrote who waits for whom on the lease before it told the
    // victim, not only at its next renewal.
    let state: serde_json::Value =
        serde_json::from_str(&lease_state(&api).expect("state on the lease")).unwrap();
    assert!(
        state["waiting_for"]
            .as_object()
            .is_some_and(|w| w.len() == 1),
        "{state}"
    );
    // A replica that does not hold the lease (it never took it) would
    // plan the other batch pod as a victim, but preempts nothing.
    let mut c = Scheduler::new(client.clone(), settings("c"));
    c.ready().await;
    c.tick().await.unwrap();
    assert_eq!(terminating(&api), first, "a follower preempted nothing");
    // The leader dies there, while its victim is still stopping; the next
    // one must wait for that victim too, not take the other batch pod.
    drop(a);
    let mut b = Scheduler::new(client.clone(), settings("b"));
    b.ready().await;
    lead_once_expired(&mut b).await;
    for _ in 0..5 {
        b.tick().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        terminating(&api),
        first,
        "the new leader preempted nothing more"
    );
    assert!(
        node_of(&api, "ml", "high").is_none(),
        "the service waits for its victim"
    );
}
