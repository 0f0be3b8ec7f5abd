//! Regression tests for the ways a careless or hostile tenant or node got
//! in (issue "nobody gets in"), through the real router in-process: node
//! names taken over with the join token, agent bodies read before their
//! token was checked, queue trees that stopped scheduling, team leads
//! changing what the admins granted, tokens without limit, expiry or
//! revocation, unbounded lists, and readable database files.

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod support;
use support::*;

fn inventory(gpus: u32) -> Value {
    let gpus: Vec<Value> = (0..gpus)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920}))
        .collect();
    json!({"cpu_milli": 64000, "memory_mib": 262144, "gpus": gpus, "emulated": true})
}

async fn register(h: &H, node: &str, node_token: Option<&str>) -> (u16, Value) {
    let mut body = json!({"node": node, "inventory": inventory(2)});
    if let Some(t) = node_token {
        body["node_token"] = json!(t);
    }
    h.json("POST", "/v1/agent/register", &h.join, body).await
}

async fn heartbeat(h: &H, node: &str, token: &str, tasks: Value) -> (u16, Value) {
    h.json(
        "POST",
        "/v1/agent/heartbeat",
        token,
        json!({"node": node, "inventory": inventory(2), "tasks": tasks}),
    )
    .await
}

/// A team with a queue (guaranteed 2 GPUs) and users of every role; returns
/// the tokens by role.
async fn team(h: &H, name: &str) -> std::collections::BTreeMap<&'static str, String> {
    let a = &h.admin;
    assert_eq!(
        h.json("POST", "/v1/teams", a, json!({"name": name}))
            .await
            .0,
        201
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            a,
            json!({"name": format!("{name}-q"), "team": name, "quotas": {"*": {"guaranteed": 2}}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let mut out = std::collections::BTreeMap::new();
    for role in ["team-lead", "member", "viewer"] {
        out.insert(role, user(h, &format!("{name}-{role}"), name, role).await);
    }
    out
}

/// A user `name` of `team` with `role`, made by the admin: its token.
async fn user(h: &H, name: &str, team: &str, role: &str) -> String {
    let (s, v) = h
        .json(
            "POST",
            "/v1/users",
            &h.admin,
            json!({"name": name, "team": team, "role": role}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = h
        .json("POST", "/v1/tokens", &h.admin, json!({"user": name}))
        .await;
    assert_eq!(s, 201, "{v}");
    v["token"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_node_name_belongs_to_the_agent_that_registered_it() {
    let h = harness(None).await;
    let (s, v) = register(&h, "n1", None).await;
    assert_eq!(s, 200, "{v}");
    let first = v["node_token"].as_str().unwrap().to_string();
    // A job on the node, with a secret in its environment.
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            b"name: s\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '60']\n    env: {DB_PASSWORD: hunter2}\n    resources: {gpu: {count: 1}}\n".to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();

    // Anyone with the join token naming the node: refused, and told how.
    let (s, v) = register(&h, "n1", None).await;
    assert_eq!(s, 409, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("gpuflow node replace n1"),
        "{v}"
    );
    let (s, _) = register(&h, "n1", Some("gfn_guessed")).await;
    assert_eq!(s, 409);
    // The real agent is untouched: its token still works and sees its task.
    let (s, v) = heartbeat(&h, "n1", &first, json!([])).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["tasks"].as_array().unwrap().len(), 1);

    // A node token speaks for its own node only.
    let (s, v) = register(&h, "n2", None).await;
    assert_eq!(s, 200, "{v}");
    let other = v["node_token"].as_str().unwrap().to_string();
    let (s, v) = heartbeat(&h, "n1", &other, json!([])).await;
    assert_eq!(s, 403, "{v}");
    // Nor can another node report the job finished.
    let (s, _) = heartbeat(
        &h,
        "n2",
        &other,
        json!([{"job": 1, "attempt": 1, "group": 0, "index": 0, "phase": "exited", "exit_code": 0, "message": ""}]),
    )
    .await;
    assert_eq!(s, 200);
    assert_ne!(h.get("/v1/jobs/1", &h.admin).await.1["state"], "succeeded");

    // The agent itself, restarted, proves it is the node with its token.
    let (s, v) = register(&h, "n1", Some(&first)).await;
    assert_eq!(s, 200, "{v}");
    let second = v["node_token"].as_str().unwrap().to_string();
    assert_eq!(heartbeat(&h, "n1", &first, json!([])).await.0, 401);
    assert_eq!(heartbeat(&h, "n1", &second, json!([])).await.0, 200);

    // An admin releases the name for a new machine: the old token stops
    // working, the node's work is requeued, and a new agent may register.
    let member = team(&h, "alpha").await["team-lead"].clone();
    let (s, _) = h
        .call("POST", "/v1/nodes/n1/replace", Some(&member), "", vec![])
        .await;
    assert_eq!(s, 403, "a team lead may not replace nodes");
    let (s, v) = h
        .call("POST", "/v1/nodes/n1/replace", Some(&h.admin), "", vec![])
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(heartbeat(&h, "n1", &second, json!([])).await.0, 401);
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let (_, j) = h.get("/v1/jobs/1", &h.admin).await;
    assert!(
        j["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["node"] != "n1"),
        "{j}"
    );
    let (_, events) = h.get("/v1/events?job=1", &h.admin).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "requeued" && e["message"].as_str().unwrap().contains("n1 lost")),
        "{events}"
    );
    let (s, v) = register(&h, "n1", None).await;
    assert_eq!(s, 200, "{v}");
}

#[tokio::test]
async fn agent_tokens_are_checked_before_the_body_is_read() {
    let h = harness(None).await;
    // Garbage bodies with bad tokens: refused as unauthenticated, not parsed.
    for path in ["/v1/agent/register", "/v1/agent/heartbeat"] {
        let (s, v) = h
            .call(
                "POST",
                path,
                Some("gfn_not_a_token"),
                "application/json",
                b"{not json".to_vec(),
            )
            .await;
        assert_eq!(s, 401, "{path}: {v}");
        let (s, _) = h
            .call("POST", path, None, "application/json", vec![b'x'; 1 << 20])
            .await;
        assert_eq!(s, 401, "{path} without a token");
    }
}

#[tokio::test]
async fn no_queue_tree_stops_scheduling() {
    let h = harness(None).await;
    let lead = team(&h, "alpha").await["team-lead"].clone();
    // A team lead builds a chain under the team's queue: refused past the
    // deepest tree the server takes.
    let mut parent = "alpha-q".to_string();
    let mut refused = None;
    for i in 0..20 {
        let name = format!("alpha-{i}");
        let (s, v) = h
            .json(
                "POST",
                "/v1/queues",
                &lead,
                json!({"name": name, "team": "alpha", "parent": parent}),
            )
            .await;
        if s != 201 {
            assert_eq!(s, 400, "{v}");
            assert_eq!(v["code"], "too_deep", "{v}");
            refused = Some(i);
            break;
        }
        parent = name;
    }
    assert_eq!(refused, Some(gpuflow_api::MAX_QUEUE_DEPTH - 1));

    // A tree that is broken in the store anyway (an older version, a bug):
    // it is set aside with its reason, and everyone else is scheduled.
    let mut bad = h.shared.world.lock().await.records().queues["alpha-0"].clone();
    bad.name = "orphan".into();
    bad.parent = Some("no-such-parent".into());
    h.shared
        .world
        .lock()
        .await
        .put_record(gpuflow_server::Rec::Queue(bad));
    assert_eq!(register(&h, "n1", None).await.0, 200);
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            b"name: ok\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '60']\n    resources: {gpu: {count: 1}}\n".to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let ok = v["id"].as_u64().unwrap();
    let stuck = {
        // A job already in the broken queue.
        let mut w = h.shared.world.lock().await;
        let mut j = w.jobs()[&ok].clone();
        j.id = ok + 1;
        j.spec.queue = "orphan".into();
        w.put_job(j);
        w.next_job = ok + 1;
        ok + 1
    };
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    assert_eq!(
        h.get(&format!("/v1/jobs/{ok}"), &h.admin).await.1["state"],
        "admitted"
    );
    let (_, why) = h.get(&format!("/v1/jobs/{stuck}/why"), &h.admin).await;
    assert!(
        why["summary"].as_str().unwrap().contains("set aside"),
        "{why}"
    );
}

/// Submits a one-GPU job as the admin.
async fn gpu_job(h: &H, name: &str) -> u64 {
    h.submit_spec(format!(
        "name: {name}\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '60']\n    resources: {{gpu: {{count: 1}}}}\n"
    ))
    .await
}

/// No known input makes the core panic, so the test injects one: the core
/// "fails" whenever a chosen job is among the pending. The cycle that meets
/// it fails (counted), the job is found and held with its reason and an
/// event, the next cycle schedules everyone else, and only an admin's
/// release lets it be tried again.
#[tokio::test]
async fn a_job_that_makes_the_core_panic_is_set_aside_and_scheduling_goes_on() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    let poison = Arc::new(AtomicU64::new(u64::MAX));
    let p = poison.clone();
    let h = harness_with(move |c| {
        c.fault = Some(gpuflow_server::Fault(Arc::new(move |ids: &[u64]| {
            if ids.contains(&p.load(Ordering::SeqCst)) {
                panic!("injected: the core cannot schedule this job");
            }
        })));
    })
    .await;
    assert_eq!(register(&h, "n1", None).await.0, 200);
    let before = gpu_job(&h, "before").await;
    let bad = gpu_job(&h, "bad").await;
    let after = gpu_job(&h, "after").await;
    poison.store(bad, Ordering::SeqCst);

    let first = gpuflow_server::cycle::run_once(&h.shared).await;
    assert!(first.is_err(), "the cycle that met the fault fails");
    let state = |id: u64| {
        let h = &h;
        async move { h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1 }
    };
    let held = state(bad).await;
    assert_eq!(held["state"], "held", "{held}");
    assert!(
        held["reason"].as_str().unwrap().contains("set aside"),
        "{held}"
    );
    let (_, events) = h.get(&format!("/v1/events?job={bad}"), &h.admin).await;
    assert!(
        events
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["kind"] == "held" && e["message"].as_str().unwrap().contains("set aside")),
        "{events}"
    );

    // Everyone else is scheduled on the next cycle.
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    assert_eq!(state(before).await["state"], "admitted");
    assert_eq!(state(after).await["state"], "admitted");

    // Nobody but an admin lets it back in.
    let member = team(&h, "alpha").await["member"].clone();
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/jobs/{bad}/release"),
            &member,
            json!({}),
        )
        .await;
    assert!(s == 403 || s == 404, "{s} {v}");
    // Released while still poison: set aside again after one failed cycle,
    // and the running jobs keep what they have.
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/jobs/{bad}/release"),
            &h.admin,
            json!({}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert!(gpuflow_server::cycle::run_once(&h.shared).await.is_err());
    assert_eq!(state(bad).await["state"], "held");
    assert_eq!(state(before).await["state"], "admitted");
    // Once the bug is gone, a release schedules it.
    poison.store(u64::MAX, Ordering::SeqCst);
    h.json(
        "POST",
        &format!("/v1/jobs/{bad}/release"),
        &h.admin,
        json!({}),
    )
    .await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    // Both GPUs are taken: it waits like any job, no longer set aside.
    let last = state(bad).await;
    assert_eq!(last["state"], "pending", "{last}");
}

/// A node that sets no limits (an agent that is not root, no cgroups)
/// still runs work, but never silently: each job placed there gets an
/// event saying so with the node's reason; a node that enforces them does
/// not.
#[tokio::test]
async fn a_job_placed_where_limits_are_not_enforced_says_so() {
    let h = harness(None).await;
    let mut loose = inventory(1);
    loose["limits"] = json!({"cgroup": "", "controllers": [], "note": "the agent is not root, so it cannot make cgroups"});
    let mut strict = inventory(1);
    strict["limits"] = json!({"cgroup": "v2", "controllers": ["cpu", "memory", "pids"]});
    for (name, inv) in [("loose", loose), ("strict", strict)] {
        let (s, v) = h
            .json(
                "POST",
                "/v1/agent/register",
                &h.join,
                json!({"node": name, "inventory": inv}),
            )
            .await;
        assert_eq!(s, 200, "{v}");
    }
    let a = gpu_job(&h, "a").await;
    let b = gpu_job(&h, "b").await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let mut warned = Vec::new();
    for id in [a, b] {
        let job = h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1;
        assert_eq!(job["state"], "admitted", "{job}");
        let node = job["tasks"][0]["node"].as_str().unwrap().to_string();
        let (_, events) = h.get(&format!("/v1/events?job={id}"), &h.admin).await;
        let said = events
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["kind"] == "no-limits")
            .cloned();
        match node.as_str() {
            "loose" => {
                let e = said.expect("an event on the node without limits");
                assert!(e["message"].as_str().unwrap().contains("not root"), "{e}");
                warned.push(id);
            }
            _ => assert!(said.is_none(), "{events}"),
        }
    }
    assert_eq!(warned.len(), 1);
    let (_, nodes) = h.get("/v1/nodes", &h.admin).await;
    let loose = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "loose")
        .unwrap();
    assert_eq!(loose["inventory"]["limits"]["cgroup"], "", "{loose}");
}

/// A node that lies about GPU use: samples of GPUs it does not have are
/// dropped (at most one per GPU it reports), and usage reported for a task
/// placed on another node changes nothing; its own task's usage is kept.
#[tokio::test]
async fn a_node_reports_samples_and_usage_of_its_own_gpus_and_tasks_only() {
    let h = harness(None).await;
    let (_, a) = register(&h, "n1", None).await;
    let (_, b) = register(&h, "n2", None).await;
    let (t1, t2) = (
        a["node_token"].as_str().unwrap().to_string(),
        b["node_token"].as_str().unwrap().to_string(),
    );
    let id = gpu_job(&h, "j").await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let job = h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1;
    let on = job["tasks"][0]["node"].as_str().unwrap().to_string();
    let (mine, other) = if on == "n1" {
        (("n1", &t1), ("n2", &t2))
    } else {
        (("n2", &t2), ("n1", &t1))
    };
    let usage = json!({"samples": 3, "gpu_util_avg_pct": 50.0, "gpu_util_pct": 60, "gpu_memory_mib": 1000, "gpu_memory_peak_mib": 1200});
    let report = json!([{"job": id, "attempt": 1, "group": 0, "index": 0, "phase": "running", "usage": usage}]);
    let samples: Vec<Value> = (0..50)
        .map(|i| json!({"uuid": format!("GPU-{}", i % 3), "util_pct": 99, "memory_util_pct": 1, "memory_used_mib": 1}))
        .chain((0..50).map(|i| json!({"uuid": format!("FAKE-{i}"), "util_pct": 1, "memory_util_pct": 1, "memory_used_mib": 1})))
        .collect();
    let beat = |node: &str, tasks: &Value| json!({"node": node, "inventory": inventory(2), "tasks": tasks, "gpus": samples});
    // The other node claims the task's usage: nothing changes.
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/heartbeat",
            other.1,
            beat(other.0, &report),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let job = h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1;
    assert!(job["tasks"][0]["usage"].is_null(), "{job}");
    // Its own node's report is kept; samples are bounded by its GPUs.
    let (s, v) = h
        .json("POST", "/v1/agent/heartbeat", mine.1, beat(mine.0, &report))
        .await;
    assert_eq!(s, 200, "{v}");
    let job = h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1;
    assert_eq!(job["tasks"][0]["usage"]["gpu_util_pct"], 60, "{job}");
    let (_, nodes) = h.get("/v1/nodes", &h.admin).await;
    for n in nodes.as_array().unwrap() {
        let now = n["gpus_now"].as_array().map_or(0, Vec::len);
        assert!(now <= 2, "{n}");
        assert!(
            n["gpus_now"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|g| g["uuid"].as_str().unwrap().starts_with("GPU-"))
        );
    }
}

#[tokio::test]
async fn a_team_lead_changes_only_what_is_the_teams_own() {
    let h = harness(None).await;
    let lead = team(&h, "alpha").await["team-lead"].clone();
    // The team's top-level queue is what the admins granted.
    let (s, v) = h
        .json(
            "PATCH",
            "/v1/queues/alpha-q",
            &lead,
            json!({"weight": 1000000}),
        )
        .await;
    assert_eq!(s, 403, "{v}");
    assert_eq!(
        h.shared.world.lock().await.records().queues["alpha-q"].weight,
        1.0
    );
    // Nor may a lead make a top-level queue of its own.
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &lead,
            json!({"name": "alpha-top", "team": "alpha", "weight": 1000000}),
        )
        .await;
    assert_eq!(s, 403, "{v}");
    // Below it, the team's queues are the lead's.
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &lead,
            json!({"name": "alpha-sub", "team": "alpha", "parent": "alpha-q"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = h
        .json("PATCH", "/v1/queues/alpha-sub", &lead, json!({"weight": 5}))
        .await;
    assert_eq!(s, 200, "{v}");
    // Only admins say which system user a team's tasks run as, never root.
    let (s, v) = h
        .json(
            "POST",
            "/v1/teams",
            &h.admin,
            json!({"name": "beta", "run_as": "root"}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = h
        .json(
            "POST",
            "/v1/teams",
            &lead,
            json!({"name": "gamma", "run_as": "daemon"}),
        )
        .await;
    assert_eq!(s, 403, "{v}");
    let (s, v) = h
        .json(
            "PATCH",
            "/v1/teams/alpha",
            &lead,
            json!({"run_as": "daemon"}),
        )
        .await;
    assert_eq!(s, 403, "{v}");
    let (s, v) = h
        .json(
            "PATCH",
            "/v1/teams/alpha",
            &h.admin,
            json!({"run_as": "root"}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = h
        .json(
            "PATCH",
            "/v1/teams/alpha",
            &h.admin,
            json!({"run_as": "daemon"}),
        )
        .await;
    assert_eq!((s, v["run_as"].as_str()), (200, Some("daemon")), "{v}");
    // The team's tasks are sent with their user.
    let (s, v) = register(&h, "n1", None).await;
    assert_eq!(s, 200, "{v}");
    let node = v["node_token"].as_str().unwrap().to_string();
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            b"name: r\nqueue: alpha-sub\ntasks:\n  - name: main\n    command: [sleep, '60']\n    resources: {gpu: {count: 1}}\n".to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let (_, reply) = heartbeat(&h, "n1", &node, json!([])).await;
    assert_eq!(reply["tasks"][0]["run_as"], "daemon", "{reply}");
    // Team numbers are the server's: distinct, and never taken from a client.
    let (s, v) = h
        .json(
            "POST",
            "/v1/teams",
            &h.admin,
            json!({"name": "delta", "uid": 1}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    let (_, teams) = h.get("/v1/teams", &h.admin).await;
    let mut uids: Vec<u64> = teams
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["uid"].as_u64().unwrap())
        .collect();
    let n = uids.len();
    uids.sort();
    uids.dedup();
    assert_eq!(uids.len(), n, "two teams share a number: {teams}");
    assert!(uids.iter().all(|&u| u > 0), "{teams}");
    assert_eq!(
        reply["tasks"][0]["team_uid"].as_u64(),
        teams
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == "alpha")
            .unwrap()["uid"]
            .as_u64(),
        "{reply}"
    );
}

#[tokio::test]
async fn tokens_are_limited_listed_revoked_and_expire() {
    let h = harness(None).await;
    let alpha = team(&h, "alpha").await;
    let beta = team(&h, "beta").await;
    let viewer = &alpha["viewer"];
    // A viewer makes tokens for itself, up to the limit.
    let mut made = vec![];
    loop {
        let (s, v) = h
            .json(
                "POST",
                "/v1/tokens",
                viewer,
                json!({"user": "alpha-viewer"}),
            )
            .await;
        if s != 201 {
            assert_eq!(s, 409, "{v}");
            break;
        }
        made.push((
            v["id"].as_str().unwrap().to_string(),
            v["token"].as_str().unwrap().to_string(),
        ));
        assert!(made.len() <= gpuflow_api::MAX_TOKENS_PER_USER, "no limit");
    }
    // One was made by the admin in `team`: the limit counts every live token.
    assert_eq!(made.len(), gpuflow_api::MAX_TOKENS_PER_USER - 1);
    // Listed without the secrets, own tokens only.
    let (s, list) = h.get("/v1/tokens", viewer).await;
    assert_eq!(s, 200);
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), gpuflow_api::MAX_TOKENS_PER_USER);
    assert!(
        list.iter()
            .all(|t| t["user"] == "alpha-viewer" && t.get("token").is_none())
    );
    // The team's lead sees its team's tokens, not beta's; beta's lead cannot
    // revoke alpha's.
    let (_, lead_list) = h.get("/v1/tokens", &alpha["team-lead"]).await;
    assert!(
        lead_list
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["user"].as_str().unwrap().starts_with("alpha-"))
    );
    let (id, token) = made[0].clone();
    let (s, _) = h
        .call(
            "DELETE",
            &format!("/v1/tokens/{id}"),
            Some(&beta["team-lead"]),
            "",
            vec![],
        )
        .await;
    assert_eq!(s, 404);
    assert_eq!(h.get("/v1/whoami", &token).await.0, 200);
    // Revoked: it stops working at once.
    let (s, _) = h
        .call(
            "DELETE",
            &format!("/v1/tokens/{id}"),
            Some(viewer),
            "",
            vec![],
        )
        .await;
    assert_eq!(s, 204);
    assert_eq!(h.get("/v1/whoami", &token).await.0, 401);
    // An expiring token works, then stops.
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            viewer,
            // Two seconds: at least one whole second live, whatever the clock's phase.
            json!({"user": "alpha-viewer", "expires_in_s": 2}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let short = v["token"].as_str().unwrap().to_string();
    assert_eq!(h.get("/v1/whoami", &short).await.0, 200);
    let end = Instant::now() + Duration::from_secs(10);
    while h.get("/v1/whoami", &short).await.0 != 401 {
        assert!(Instant::now() < end, "the token never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (s, _) = h
        .json(
            "POST",
            "/v1/tokens",
            viewer,
            json!({"user": "alpha-viewer", "expires_in_s": 0}),
        )
        .await;
    assert_eq!(s, 400);
}

#[tokio::test]
async fn lists_come_in_bounded_pages() {
    let h = harness(None).await;
    for _ in 0..5 {
        h.job("default").await;
    }
    let (s, v) = h.get("/v1/jobs?limit=100000", &h.admin).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = h.get("/v1/events?limit=100000", &h.admin).await;
    assert_eq!(s, 400, "{v}");
    let (s, v) = h.get("/v1/audit?limit=100000", &h.admin).await;
    assert_eq!(s, 400, "{v}");
    let ids = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_u64().unwrap())
            .collect()
    };
    let (_, first) = h.get("/v1/jobs?limit=2", &h.admin).await;
    assert_eq!(ids(&first), vec![5, 4]);
    let (_, next) = h.get("/v1/jobs?limit=2&before=4", &h.admin).await;
    assert_eq!(ids(&next), vec![3, 2]);
    // Every other list pages by name.
    team(&h, "alpha").await;
    team(&h, "beta").await;
    for path in [
        "/v1/users",
        "/v1/teams",
        "/v1/queues",
        "/v1/projects",
        "/v1/nodes",
        "/v1/tokens",
    ] {
        let (s, v) = h.get(&format!("{path}?limit=100000"), &h.admin).await;
        assert_eq!(s, 400, "{path}: {v}");
        let (s, v) = h.get(&format!("{path}?bogus=1"), &h.admin).await;
        assert_eq!(s, 400, "{path}: {v}");
    }
    let names = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, first) = h.get("/v1/teams?limit=2", &h.admin).await;
    assert_eq!(names(&first), ["alpha", "beta"]);
    let (_, next) = h.get("/v1/teams?limit=2&after=beta", &h.admin).await;
    assert_eq!(names(&next), ["default"]);
}

#[tokio::test]
async fn the_database_and_tokens_are_the_servers_alone() {
    let h = harness(None).await;
    h.job("default").await;
    let data = h.dir.path().join("data");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data), 0o700);
    for f in ["gpuflow.db", "gpuflow.db-wal", "admin.token", "join.token"] {
        let p = data.join(f);
        if p.exists() {
            assert_eq!(mode(&p), 0o600, "{f}");
        } else {
            assert_ne!(f, "gpuflow.db", "the database exists");
        }
    }
}

// ------------------------------------------------------------ the property

use proptest::prelude::*;

const PRINCIPALS: [(&str, &str); 7] = [
    ("admin", ""),
    ("alpha-team-lead", "alpha"),
    ("alpha-member", "alpha"),
    ("alpha-viewer", "alpha"),
    ("beta-team-lead", "beta"),
    ("beta-member", "beta"),
    ("beta-viewer", "beta"),
];

#[derive(Clone, Debug)]
enum Call {
    CreateQueue {
        team: u8,
        parent: u8,
        weight: u32,
    },
    PatchQueue {
        queue: u8,
        weight: u32,
        guaranteed: Option<u8>,
    },
    CreateToken {
        user: u8,
    },
    RevokeToken {
        pick: u8,
    },
    Submit {
        queue: u8,
    },
    Cancel {
        pick: u8,
    },
    Node {
        action: u8,
    },
}

fn call() -> impl Strategy<Value = (u8, Call)> {
    let c = prop_oneof![
        (0u8..2, any::<u8>(), 1u32..2_000_000).prop_map(|(team, parent, weight)| {
            Call::CreateQueue {
                team,
                parent,
                weight,
            }
        }),
        (any::<u8>(), 1u32..2_000_000, proptest::option::of(0u8..20)).prop_map(
            |(queue, weight, guaranteed)| Call::PatchQueue {
                queue,
                weight,
                guaranteed
            }
        ),
        (0u8..7).prop_map(|user| Call::CreateToken { user }),
        any::<u8>().prop_map(|pick| Call::RevokeToken { pick }),
        any::<u8>().prop_map(|queue| Call::Submit { queue }),
        any::<u8>().prop_map(|pick| Call::Cancel { pick }),
        (0u8..3).prop_map(|action| Call::Node { action }),
    ];
    (0u8..7, c)
}

/// What a change may touch, as one comparable value.
async fn digest(h: &H) -> String {
    let w = h.shared.world.lock().await;
    format!(
        "{:?}|{:?}|{:?}|{:?}",
        w.records().queues,
        w.nodes()
            .values()
            .map(|n| (&n.name, n.admin_state))
            .collect::<Vec<_>>(),
        w.jobs()
            .values()
            .map(|j| (j.id, j.state))
            .collect::<Vec<_>>(),
        w.records().tokens.keys().collect::<Vec<_>>()
    )
}

async fn run_calls(calls: Vec<(u8, Call)>) {
    let h = harness(None).await;
    let mut tokens = std::collections::BTreeMap::new();
    tokens.insert("admin", h.admin.clone());
    for t in ["alpha", "beta"] {
        for (role, tok) in team(&h, t).await {
            let name: &'static str = PRINCIPALS
                .iter()
                .find(|(n, _)| *n == format!("{t}-{role}"))
                .unwrap()
                .0;
            tokens.insert(name, tok);
        }
    }
    assert_eq!(register(&h, "n1", None).await.0, 200);
    let mut created = 0;
    for (who, c) in calls {
        let (name, team_of) = PRINCIPALS[who as usize];
        let tok = tokens[name].clone();
        let admin = name == "admin";
        let role = name.rsplit('-').next().unwrap();
        let lead = role == "lead";
        let acts = lead || role == "member";
        let before = digest(&h).await;
        let (allowed, (s, v)) = match c {
            Call::CreateQueue {
                team,
                parent,
                weight,
            } => {
                let team = ["alpha", "beta"][team as usize];
                let queues: Vec<String> = h
                    .shared
                    .world
                    .lock()
                    .await
                    .records()
                    .queues
                    .values()
                    .filter(|q| q.team == team)
                    .map(|q| q.name.clone())
                    .collect();
                let parent =
                    (parent % 3 != 0).then(|| queues[parent as usize % queues.len()].clone());
                created += 1;
                let body = json!({"name": format!("q{created}"), "team": team, "parent": parent, "weight": weight as f64 / 1000.0});
                let allowed = admin || (lead && team_of == team && parent.is_some());
                (allowed, h.json("POST", "/v1/queues", &tok, body).await)
            }
            Call::PatchQueue {
                queue,
                weight,
                guaranteed,
            } => {
                let qs: Vec<gpuflow_api::QueueSpec> = h
                    .shared
                    .world
                    .lock()
                    .await
                    .records()
                    .queues
                    .values()
                    .cloned()
                    .collect();
                let q = &qs[queue as usize % qs.len()];
                let allowed = admin || (lead && team_of == q.team && q.parent.is_some());
                let mut body = json!({"weight": weight as f64 / 1000.0});
                if let Some(g) = guaranteed {
                    body["quotas"] = json!({"*": {"guaranteed": g}});
                }
                (
                    allowed,
                    h.json("PATCH", &format!("/v1/queues/{}", q.name), &tok, body)
                        .await,
                )
            }
            Call::CreateToken { user } => {
                let (u, ut) = PRINCIPALS[user as usize];
                let allowed = admin || u == name || (lead && ut == team_of && u != "admin");
                (
                    allowed,
                    h.json("POST", "/v1/tokens", &tok, json!({"user": u})).await,
                )
            }
            Call::RevokeToken { pick } => {
                let all: Vec<(String, String)> = h
                    .shared
                    .world
                    .lock()
                    .await
                    .records()
                    .tokens
                    .values()
                    .map(|t| (t.id().to_string(), t.user.clone()))
                    .collect();
                let (id, owner) = all[pick as usize % all.len()].clone();
                // Never the caller's own last means of calling: keep the harness working.
                if tokens
                    .values()
                    .any(|t| gpuflow_server::secret::hash(t).starts_with(&id))
                {
                    continue;
                }
                let ot = PRINCIPALS
                    .iter()
                    .find(|(n, _)| *n == owner)
                    .map_or("", |p| p.1);
                let allowed = admin || owner == name || (lead && ot == team_of && owner != "admin");
                (
                    allowed,
                    h.call(
                        "DELETE",
                        &format!("/v1/tokens/{id}"),
                        Some(&tok),
                        "",
                        vec![],
                    )
                    .await,
                )
            }
            Call::Submit { queue } => {
                let qs: Vec<gpuflow_api::QueueSpec> = h
                    .shared
                    .world
                    .lock()
                    .await
                    .records()
                    .queues
                    .values()
                    .cloned()
                    .collect();
                let q = &qs[queue as usize % qs.len()];
                let allowed = admin || (acts && team_of == q.team);
                (allowed, h.submit(&tok, &q.name).await)
            }
            Call::Cancel { pick } => {
                let jobs: Vec<(u64, String)> = h
                    .shared
                    .world
                    .lock()
                    .await
                    .jobs()
                    .values()
                    .map(|j| (j.id, j.team.clone()))
                    .collect();
                if jobs.is_empty() {
                    continue;
                }
                let (id, team) = &jobs[pick as usize % jobs.len()];
                let allowed = admin || (acts && team_of == team);
                (
                    allowed,
                    h.call(
                        "POST",
                        &format!("/v1/jobs/{id}/cancel"),
                        Some(&tok),
                        "",
                        vec![],
                    )
                    .await,
                )
            }
            Call::Node { action } => {
                let action = ["drain", "cordon", "uncordon"][action as usize];
                (
                    admin,
                    h.call(
                        "POST",
                        &format!("/v1/nodes/n1/{action}"),
                        Some(&tok),
                        "",
                        vec![],
                    )
                    .await,
                )
            }
        };
        assert!(s < 500, "{name}: {s} {v}");
        if !allowed {
            assert!(
                matches!(s, 400 | 403 | 404),
                "{name} was let through ({s}): {v}"
            );
            assert_eq!(before, digest(&h).await, "{name} changed what it may not");
        }
        // Scheduling never stops.
        gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
        assert_eq!(
            h.shared
                .cycle_failures
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
        // Nobody sees another team's data.
        if !admin {
            let (_, jobs) = h.get("/v1/jobs", &tok).await;
            assert!(
                jobs.as_array()
                    .unwrap()
                    .iter()
                    .all(|j| j["team"] == team_of),
                "{name} sees {jobs}"
            );
            let (_, queues) = h.get("/v1/queues", &tok).await;
            assert!(
                queues
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|q| q["team"] == team_of),
                "{name} sees {queues}"
            );
            let (_, toks) = h.get("/v1/tokens", &tok).await;
            assert!(
                toks.as_array()
                    .unwrap()
                    .iter()
                    .all(|t| t["user"].as_str().unwrap().starts_with(team_of)),
                "{name} sees {toks}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn no_role_reaches_past_its_rights_and_scheduling_never_stops(calls in proptest::collection::vec(call(), 1..30)) {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(run_calls(calls));
    }
}

/// A short-lived token cannot mint one that lasts longer (it made a
/// never-expiring one before): one asked for without an expiry inherits
/// its maker's, a later one is refused.
#[tokio::test]
async fn a_token_never_outlives_the_token_that_made_it() {
    let h = harness(None).await;
    let alpha = team(&h, "alpha").await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &alpha["viewer"],
            json!({"user": "alpha-viewer", "expires_in_s": 60}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let short = v["token"].as_str().unwrap().to_string();
    let short_end = v["expires_at"].as_u64().unwrap();
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &short,
            json!({"user": "alpha-viewer"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["expires_at"].as_u64(), Some(short_end), "{v}");
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &short,
            json!({"user": "alpha-viewer", "expires_in_s": 3600}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("cannot outlive"),
        "{v}"
    );
    // Shorter is fine; a never-expiring maker (the admin's) gives what is asked.
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &short,
            json!({"user": "alpha-viewer", "expires_in_s": 10}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &h.admin,
            json!({"user": "alpha-viewer"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert!(v.get("expires_at").is_none_or(Value::is_null), "{v}");
}

/// A disabled user's every token is refused at once, and works again once
/// enabled; only admins and the user's own team lead may do it.
#[tokio::test]
async fn a_disabled_users_tokens_are_all_refused_at_once() {
    let h = harness(None).await;
    let alpha = team(&h, "alpha").await;
    let beta = team(&h, "beta").await;
    let member = &alpha["member"];
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            member,
            json!({"user": "alpha-member"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let second = v["token"].as_str().unwrap().to_string();
    // Not by another team's lead, nor by a member, nor for oneself.
    for (tok, want) in [(&beta["team-lead"], 404), (&alpha["viewer"], 403)] {
        let (s, v) = h
            .json("POST", "/v1/users/alpha-member/disable", tok, json!({}))
            .await;
        assert_eq!(s, want, "{v}");
    }
    let (s, _) = h
        .json("POST", "/v1/users/admin/disable", &h.admin, json!({}))
        .await;
    assert_eq!(s, 400);
    let (s, v) = h
        .json(
            "POST",
            "/v1/users/alpha-member/disable",
            &alpha["team-lead"],
            json!({}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["disabled"], true);
    for t in [member, &second] {
        assert_eq!(h.get("/v1/whoami", t).await.0, 401);
        // Nor can it make new tokens.
        let (s, _) = h
            .json("POST", "/v1/tokens", t, json!({"user": "alpha-member"}))
            .await;
        assert_eq!(s, 401);
    }
    let (_, users) = h.get("/v1/users", &h.admin).await;
    assert!(
        users
            .as_array()
            .unwrap()
            .iter()
            .any(|u| u["name"] == "alpha-member" && u["disabled"] == true),
        "{users}"
    );
    let (s, v) = h
        .json("POST", "/v1/users/alpha-member/enable", &h.admin, json!({}))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(h.get("/v1/whoami", member).await.0, 200);
    assert_eq!(h.get("/v1/whoami", &second).await.0, 200);
}

/// A node joined with the join token registered absurd inventories (2^63
/// MiB of memory, 10,000 labels, a 1 MB model name) and made every list of
/// nodes huge; they are refused, with what to fix.
#[tokio::test]
async fn a_node_cannot_claim_an_absurd_inventory() {
    let h = harness(None).await;
    let mut huge_memory = inventory(2);
    huge_memory["memory_mib"] = json!(1u64 << 63);
    let mut many_labels = inventory(2);
    many_labels["labels"] = (0..10_000)
        .map(|i| (format!("l{i}"), json!("x")))
        .collect::<serde_json::Map<_, _>>()
        .into();
    let mut long_model = inventory(2);
    long_model["gpus"][0]["model"] = json!("H".repeat(1 << 20));
    let mut big_gpu = inventory(2);
    big_gpu["gpus"][1]["memory_mib"] = json!(u64::MAX);
    // More MIG instances than the scheduling core takes (32): accepted
    // before, every cycle then panicked building the cluster (#40).
    let mut many_slices = inventory(2);
    many_slices["gpus"][0]["mig"] = (0..33)
        .map(|k| json!({"uuid": format!("MIG-{k}"), "profile": "1g.10gb", "memory_mib": 10240}))
        .collect::<Vec<_>>()
        .into();
    // Two GPUs under one UUID: allocations follow GPUs by UUID, so both
    // would be found on the first, and the agent would hand one device to
    // two jobs.
    let mut twice = inventory(2);
    twice["gpus"][1]["uuid"] = json!("GPU-0");
    let mut mig_twice = inventory(2);
    mig_twice["gpus"][0]["mig"] = json!([
        {"uuid": "MIG-a", "profile": "1g.10gb", "memory_mib": 10240},
        {"uuid": "MIG-a", "profile": "1g.10gb", "memory_mib": 10240}
    ]);
    let mut mig_as_gpu = inventory(2);
    mig_as_gpu["gpus"][0]["mig"] =
        json!([{"uuid": "GPU-1", "profile": "1g.10gb", "memory_mib": 10240}]);
    for (what, inv) in [
        ("memory", huge_memory),
        ("labels", many_labels),
        ("model", long_model),
        ("GPU memory", big_gpu),
        ("MIG instances", many_slices),
        ("a GPU UUID twice", twice),
        ("a MIG UUID twice", mig_twice),
        ("a MIG UUID that is a GPU's", mig_as_gpu),
    ] {
        let (s, v) = h
            .json(
                "POST",
                "/v1/agent/register",
                &h.join,
                json!({"node": "liar", "inventory": inv}),
            )
            .await;
        assert_eq!(s, 400, "{what}: {v}");
        assert_eq!(v["code"], "invalid_inventory", "{what}: {v}");
    }
    let (s, nodes) = h.get("/v1/nodes", &h.admin).await;
    assert_eq!((s, nodes.as_array().map(Vec::len)), (200, Some(0)));
    assert_eq!(register(&h, "honest", None).await.0, 200);
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
}

/// A node stored before its inventory was checked (by an older server, or
/// a store edited by hand) that the scheduling core refuses: the cycle and
/// the requests that take a snapshot fail with an error and go on failing
/// while it is there; none panics (they did: an `expect` on the core's
/// refusal, reached by every cycle, `why` and `--test-only`).
#[tokio::test]
async fn a_stored_node_the_core_refuses_is_an_error_not_a_panic() {
    let h = harness(None).await;
    assert_eq!(register(&h, "n1", None).await.0, 200);
    let mut inv = inventory(2);
    inv["gpus"][0]["mig"] = (0..33)
        .map(|k| json!({"uuid": format!("MIG-{k}"), "profile": "1g.10gb", "memory_mib": 10240}))
        .collect::<Vec<_>>()
        .into();
    {
        let mut world = h.shared.world.lock().await;
        let mut n = world.nodes()["n1"].clone();
        n.inventory = serde_json::from_value(inv).unwrap();
        world.put_node(n);
    }
    let spec = "name: j\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '1']\n    resources: {gpu: {count: 1}}\n";
    h.submit_spec(spec.to_string()).await;
    let e = gpuflow_server::cycle::run_once(&h.shared)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("MIG"), "{e}");
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs?test_only=true",
            Some(&h.admin),
            "application/yaml",
            spec.as_bytes().to_vec(),
        )
        .await;
    assert_eq!((s, v["code"].as_str()), (500, Some("internal")), "{v}");
}

/// JSON with something after the document was accepted (the rest
/// ignored); it is refused now.
#[tokio::test]
async fn a_body_with_trailing_garbage_is_refused() {
    let h = harness(None).await;
    let (s, v) = h
        .call(
            "POST",
            "/v1/teams",
            Some(&h.admin),
            "application/json",
            br#"{"name": "tail"} {"name": "other"}"#.to_vec(),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("one JSON document"),
        "{v}"
    );
    let (_, teams) = h.get("/v1/teams", &h.admin).await;
    assert!(!teams.to_string().contains("tail"), "{teams}");
    // White space after it is fine.
    let (s, v) = h
        .call(
            "POST",
            "/v1/teams",
            Some(&h.admin),
            "application/json",
            b"{\"name\": \"tail\"}\n  \n".to_vec(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
}

/// One token, or one address without a valid token, cannot send without
/// limit: past its rate it gets 429 with what to do, and other callers are
/// not slowed.
#[tokio::test]
async fn a_caller_past_its_rate_is_refused_and_others_are_not() {
    let h = harness_with(|c| {
        c.rate_per_token = 5;
        c.rate_anonymous = 2;
    })
    .await;
    let alpha = team(&h, "alpha").await;
    let mut limited = None;
    for _ in 0..100 {
        let (s, v) = h.get("/v1/whoami", &alpha["viewer"]).await;
        if s == 429 {
            limited = Some(v);
            break;
        }
        assert_eq!(s, 200, "{v}");
    }
    let v = limited.expect("a token past its rate is refused");
    assert_eq!(v["code"], "rate_limited", "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("at most 5 a second"),
        "{v}"
    );
    // Another token is not slowed.
    assert_eq!(h.get("/v1/whoami", &alpha["member"]).await.0, 200);
    // Without a token, or with a wrong one: 401 until the address's rate,
    // then 429.
    let mut codes = vec![];
    for i in 0..20 {
        let token = if i % 2 == 0 { None } else { Some("gft_wrong") };
        codes.push(h.call("GET", "/v1/whoami", token, "", vec![]).await.0);
    }
    assert!(codes.starts_with(&[401, 401]), "{codes:?}");
    assert!(codes.contains(&429), "{codes:?}");
    assert!(codes.iter().all(|c| *c == 401 || *c == 429), "{codes:?}");
    // The sign-in endpoints, which need no token (and may make the server
    // call its identity providers), count against it too.
    for (method, path, ok) in [
        ("GET", "/v1/auth/providers", 200),
        ("POST", "/v1/auth/code", 404),
    ] {
        let mut codes = vec![];
        for _ in 0..20 {
            codes.push(h.call(method, path, None, "", vec![]).await.0);
        }
        assert!(codes.contains(&429), "{path}: {codes:?}");
        assert!(
            codes.iter().all(|c| *c == ok || *c == 429),
            "{path}: {codes:?}"
        );
    }
}

/// Reports read the store a page at a time: every stored job is counted
/// once, past the first page, a job in memory counts as its newer copy,
/// and a team's reader counts its team's jobs only.
#[tokio::test]
async fn reports_count_every_stored_job_once_and_only_the_callers_team() {
    let h = harness(None).await;
    let tokens = team(&h, "alpha").await;
    let spec = |queue: &str| {
        gpuflow_api::JobSpec::parse(
            format!("name: old\nqueue: {queue}\ntasks:\n  - name: main\n    command: [x]\n")
                .as_bytes(),
            false,
        )
        .unwrap()
    };
    let t = gpuflow_server::now();
    // 1,203 finished jobs in the store only, as after a restart: two of
    // three of team default's, one of three of alpha's.
    let mut batch = gpuflow_store::Batch::default();
    for id in 1_000..2_203u64 {
        let (team, queue) = if id % 3 == 0 {
            ("alpha", "alpha-q")
        } else {
            ("default", "default")
        };
        let mut j =
            gpuflow_server::lifecycle::submitted(id, spec(queue), team, "old", None, t - 7200);
        j.state = gpuflow_api::JobState::Succeeded;
        j.started_at = Some(t - 7100);
        j.finished_at = Some(t - 7000);
        batch.put.push(j.record());
    }
    h.shared.store.commit(&batch).await.unwrap();
    // A job in memory too: its newer copy (running) counts, once.
    let live = h.job("alpha-q").await;
    let submitted = |v: &Value| -> u64 {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r["submitted"].as_u64().unwrap())
            .sum()
    };
    // Up to a minute from now: the live job was submitted this second.
    let path = format!("/v1/reports/jobs?from=1d&to={}", t + 60);
    let (s, v) = h.get(&path, &h.admin).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(submitted(&v), 1_204, "{v}");
    let (s, v) = h.get(&path, &tokens["viewer"]).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(submitted(&v), 401 + 1, "{v}");
    let rows = v.as_array().unwrap();
    assert!(rows.iter().all(|r| r["key"] == "alpha-q"), "{v}");
    assert!(live > 0);
}

/// A member acts on their own jobs only (cancel, suspend, reach a
/// notebook's ports); a team lead on the team's; a team may share control
/// (its leads say so, not its members); the audit log names who acted.
#[tokio::test]
async fn a_member_acts_on_their_own_jobs_and_a_lead_on_the_teams() {
    let h = harness(None).await;
    let alpha = team(&h, "alpha").await;
    let beta = team(&h, "beta").await;
    let other = user(&h, "alpha-other", "alpha", "member").await;
    let mut ids = vec![];
    for _ in 0..3 {
        let (s, v) = h.submit(&alpha["member"], "alpha-q").await;
        assert_eq!(s, 201, "{v}");
        ids.push(v["id"].as_u64().unwrap());
    }
    let act = |tok: String, id: u64, action: &'static str| {
        let h = &h;
        async move {
            h.json("POST", &format!("/v1/jobs/{id}/{action}"), &tok, json!({}))
                .await
        }
    };
    // A teammate: refused, told whose job it is and who may.
    for action in ["cancel", "suspend", "resume"] {
        let (s, v) = act(other.clone(), ids[0], action).await;
        assert_eq!(s, 403, "{action}: {v}");
        let msg = v["message"].as_str().unwrap();
        assert!(
            msg.contains("alpha-member's") && msg.contains("--shared-control"),
            "{msg}"
        );
    }
    let (s, v) = h
        .json(
            "POST",
            &format!("/v1/jobs/{}/proxy-session", ids[0]),
            &other,
            json!({}),
        )
        .await;
    assert_eq!(s, 403, "{v}");
    // A viewer may not; another team does not see it.
    assert_eq!(act(alpha["viewer"].clone(), ids[0], "cancel").await.0, 403);
    assert_eq!(
        act(beta["team-lead"].clone(), ids[0], "cancel").await.0,
        404
    );
    assert_eq!(
        h.get(&format!("/v1/jobs/{}", ids[0]), &h.admin).await.1["state"],
        "pending"
    );
    // The owner and the team's lead may.
    let (s, v) = act(alpha["member"].clone(), ids[0], "cancel").await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = act(alpha["team-lead"].clone(), ids[1], "cancel").await;
    assert_eq!(s, 200, "{v}");
    // A member cannot share control, nor a lead change more than that.
    let share = |tok: &String, body: Value| {
        let (h, tok) = (&h, tok.clone());
        async move { h.json("PATCH", "/v1/teams/alpha", &tok, body).await }
    };
    assert_eq!(
        share(&alpha["member"], json!({"shared_control": true}))
            .await
            .0,
        403
    );
    assert_eq!(
        share(
            &alpha["team-lead"],
            json!({"shared_control": true, "processes": false})
        )
        .await
        .0,
        403
    );
    assert_eq!(
        share(&beta["team-lead"], json!({"shared_control": true}))
            .await
            .0,
        403
    );
    let (s, v) = share(&alpha["team-lead"], json!({"shared_control": true})).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["shared_control"], true);
    // Now the teammate may.
    let (s, v) = act(other.clone(), ids[2], "cancel").await;
    assert_eq!(s, 200, "{v}");
    let (_, audit) = h.get("/v1/audit", &h.admin).await;
    let actor = |action: &str, target: String| {
        audit
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["action"] == action && a["target"] == target.as_str())
            .map(|a| a["actor"].as_str().unwrap().to_string())
    };
    let job = |i: usize| format!("job/{}", ids[i]);
    assert_eq!(actor("job.cancel", job(0)).as_deref(), Some("alpha-member"));
    assert_eq!(
        actor("job.cancel", job(1)).as_deref(),
        Some("alpha-team-lead")
    );
    assert_eq!(actor("job.cancel", job(2)).as_deref(), Some("alpha-other"));
    assert_eq!(
        actor("team.update", "team/alpha".into()).as_deref(),
        Some("alpha-team-lead")
    );
}

/// A refused token is told why: unknown, expired (when), revoked (by whom,
/// when), or its user disabled.
#[tokio::test]
async fn a_refused_token_is_told_why() {
    let h = harness(None).await;
    let alpha = team(&h, "alpha").await;
    let refused = |tok: String| {
        let h = &h;
        async move {
            let (s, v) = h.get("/v1/whoami", &tok).await;
            assert_eq!(s, 401, "{v}");
            (
                v["code"].as_str().unwrap().to_string(),
                v["message"].as_str().unwrap().to_string(),
            )
        }
    };
    let (code, _) = refused("gft_00000000000000000000".into()).await;
    assert_eq!(code, "token_unknown");
    // Revoked by the team's lead: said, with when.
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &h.admin,
            json!({"user": "alpha-viewer"}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (tok, id) = (
        v["token"].as_str().unwrap().to_string(),
        v["id"].as_str().unwrap().to_string(),
    );
    let (s, v) = h.get("/v1/whoami", &tok).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["token_id"], id.as_str());
    assert_eq!(v["signed_in_with"], "token");
    let (s, _) = h
        .call(
            "DELETE",
            &format!("/v1/tokens/{id}"),
            Some(&alpha["team-lead"]),
            "",
            vec![],
        )
        .await;
    assert_eq!(s, 204);
    let (code, msg) = refused(tok.clone()).await;
    assert_eq!(code, "token_revoked");
    assert!(msg.contains("revoked by alpha-team-lead at 20"), "{msg}");
    // Revoked twice: not found, and not listed.
    let (s, _) = h
        .call(
            "DELETE",
            &format!("/v1/tokens/{id}"),
            Some(&h.admin),
            "",
            vec![],
        )
        .await;
    assert_eq!(s, 404);
    let (_, list) = h.get("/v1/tokens", &h.admin).await;
    assert!(!list.to_string().contains(&id), "{list}");
    // Expired: said, with when.
    let (s, v) = h
        .json(
            "POST",
            "/v1/tokens",
            &h.admin,
            json!({"user": "alpha-viewer", "expires_in_s": 1}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let short = v["token"].as_str().unwrap().to_string();
    let end = Instant::now() + Duration::from_secs(10);
    while h.get("/v1/whoami", &short).await.0 != 401 {
        assert!(Instant::now() < end, "the token never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, msg) = refused(short).await;
    assert_eq!(code, "token_expired");
    assert!(
        msg.contains("expired at 20") && msg.contains("ago"),
        "{msg}"
    );
    // A disabled user's token.
    let (s, v) = h
        .json(
            "POST",
            "/v1/users/alpha-member/disable",
            &h.admin,
            json!({}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (code, msg) = refused(alpha["member"].clone()).await;
    assert_eq!(code, "user_disabled");
    assert!(msg.contains("alpha-member is disabled"), "{msg}");
    // The revoked token's record is kept, marked revoked.
    let kept = h
        .shared
        .world
        .lock()
        .await
        .records()
        .tokens
        .values()
        .find(|t| t.id() == id)
        .map(|t| t.revoked.clone());
    assert!(matches!(kept, Some(Some(_))), "{kept:?}");
}

/// Every answer carries a request id (`x-request-id`), under which the
/// server traces the request: the client's own when it is one, else a new
/// one; a client cannot write what it likes into the server's log.
#[tokio::test]
async fn every_answer_carries_a_request_id_and_a_clients_is_kept_only_when_sane() {
    use tower::ServiceExt;
    let h = harness(None).await;
    let id_of = |sent: Vec<&'static str>| {
        let router = h.router.clone();
        async move {
            let mut req = axum::http::Request::builder().uri("/v1/openapi.json");
            for v in sent {
                req = req.header("x-request-id", v);
            }
            let resp = router
                .oneshot(req.body(axum::body::Body::empty()).unwrap())
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let ids: Vec<String> = resp
                .headers()
                .get_all("x-request-id")
                .iter()
                .map(|v| v.to_str().unwrap().to_string())
                .collect();
            assert_eq!(ids.len(), 1, "{ids:?}");
            ids[0].clone()
        }
    };
    let made = |id: &str| id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit());
    let a = id_of(vec![]).await;
    let b = id_of(vec![]).await;
    assert!(made(&a) && made(&b) && a != b, "{a} {b}");
    assert_eq!(id_of(vec!["trace-42.x_y"]).await, "trace-42.x_y");
    let long: &'static str = Box::leak("x".repeat(65).into_boxed_str());
    for bad in [
        vec![long],
        vec!["two words"],
        vec!["a/b?c"],
        vec!["one", "two"],
    ] {
        let id = id_of(bad.clone()).await;
        assert!(made(&id), "{bad:?} kept as {id}");
    }
}
