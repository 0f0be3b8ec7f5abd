//! Reservations through the real router and cycle (#38): a maintenance
//! window keeps jobs off its nodes and `why` and the estimate say so; a
//! team's reservation is used by that team only; before it opens, other
//! work runs on its nodes only if it ends in time.

mod support;

use serde_json::{Value, json};
use support::{H, harness};

/// Teams `ml` (member `ana`) and `other` (member `oz`), a queue each
/// guaranteeing 2 GPUs; nodes `n1` and `n2` with one GPU each.
async fn setup(h: &H) -> (String, String) {
    let a = &h.admin;
    let mut tokens = Vec::new();
    for (team, user) in [("ml", "ana"), ("other", "oz")] {
        let (s, v) = h.json("POST", "/v1/teams", a, json!({"name": team})).await;
        assert_eq!(s, 201, "{v}");
        let (s, v) = h
            .json(
                "POST",
                "/v1/queues",
                a,
                json!({"name": format!("{team}-q"), "team": team, "quotas": {"*": {"guaranteed": 2}}}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        let (s, v) = h
            .json(
                "POST",
                "/v1/users",
                a,
                json!({"name": user, "team": team, "role": "member"}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        let (s, v) = h.json("POST", "/v1/tokens", a, json!({"user": user})).await;
        assert_eq!(s, 201, "{v}");
        tokens.push(v["token"].as_str().unwrap().to_string());
    }
    for node in ["n1", "n2"] {
        let inv = json!({"cpu_milli": 64000, "memory_mib": 262144, "emulated": true,
            "gpus": [{"index": 0, "uuid": format!("GPU-{node}"), "model": "H100", "memory_mib": 81920}]});
        let (s, v) = h
            .json(
                "POST",
                "/v1/agent/register",
                &h.join,
                json!({"node": node, "inventory": inv}),
            )
            .await;
        assert_eq!(s, 200, "{v}");
    }
    (tokens.remove(0), tokens.remove(0))
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

async fn submit(h: &H, token: &str, queue: &str, extra: &str) -> (u16, Value) {
    let spec = format!(
        "name: j\nqueue: {queue}\nkind: batch\n{extra}tasks:\n  - name: main\n    command: [sleep, '100']\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: 1}}}}\n"
    );
    h.call(
        "POST",
        "/v1/jobs",
        Some(token),
        "application/yaml",
        spec.into_bytes(),
    )
    .await
}

async fn id(h: &H, token: &str, queue: &str, extra: &str) -> u64 {
    let (s, v) = submit(h, token, queue, extra).await;
    assert_eq!(s, 201, "{v}");
    v["id"].as_u64().unwrap()
}

async fn cycle(h: &H) {
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
}

async fn job(h: &H, id: u64) -> Value {
    h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1
}

#[tokio::test]
async fn a_maintenance_window_keeps_jobs_off_its_nodes_and_says_until_when() {
    let h = harness(None).await;
    let (ana, _) = setup(&h).await;
    let t = now();
    let (s, v) = h
        .json(
            "POST",
            "/v1/reservations",
            &h.admin,
            json!({"name": "upgrade", "start": t - 60, "end": t + 3600, "nodes": ["n1"], "maintenance": true}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let first = id(&h, &ana, "ml-q", "").await;
    let second = id(&h, &ana, "ml-q", "").await;
    cycle(&h).await;
    let j = job(&h, first).await;
    assert_eq!(j["state"], "admitted", "{j}");
    assert_eq!(
        j["tasks"][0]["node"], "n2",
        "never on the node in maintenance"
    );
    let (_, why) = h.get(&format!("/v1/jobs/{second}/why"), &h.admin).await;
    assert_eq!(why["state"], "pending", "{why}");
    assert!(
        why.to_string()
            .contains("maintenance \\\"upgrade\\\" holds n1"),
        "{why}"
    );
    assert_eq!(
        why["eta"],
        t + 3600,
        "it may start when the window ends: {why}"
    );
    // Nobody's job asks for a maintenance window.
    let (s, v) = submit(&h, &ana, "ml-q", "reservation: upgrade\n").await;
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("maintenance window"),
        "{v}"
    );
    // `node ls` data: the node says it is reserved.
    let (_, nodes) = h.get("/v1/nodes", &h.admin).await;
    let n1 = nodes
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["name"] == "n1")
        .unwrap();
    assert!(
        n1["reservations"][0]
            .as_str()
            .unwrap()
            .starts_with("upgrade (maintenance"),
        "{n1}"
    );
    // A node already held by the window cannot be reserved again then.
    let (s, v) = h
        .json(
            "POST",
            "/v1/reservations",
            &h.admin,
            json!({"name": "demo", "start": t, "end": t + 600, "nodes": ["n1"], "teams": ["ml"]}),
        )
        .await;
    assert_eq!(s, 409, "{v}");
}

#[tokio::test]
async fn a_teams_reservation_is_used_by_that_team_only() {
    let h = harness(None).await;
    let (ana, oz) = setup(&h).await;
    let t = now();
    // Made by an admin only.
    let spec = json!({"name": "demo-day", "start": t - 10, "end": t + 7200, "count": 1, "model": "H100", "teams": ["ml"]});
    let (s, _) = h.json("POST", "/v1/reservations", &ana, spec.clone()).await;
    assert_eq!(s, 403);
    let (s, r) = h.json("POST", "/v1/reservations", &h.admin, spec).await;
    assert_eq!(s, 201, "{r}");
    let node = r["nodes"][0].as_str().unwrap().to_string();
    // Another team's member may not ask for it.
    let (s, v) = submit(&h, &oz, "other-q", "reservation: demo-day\n").await;
    assert_eq!(s, 403, "{v}");
    // Ana's job in it runs on its node; oz's two jobs share the other node
    // (one runs, one waits): the reserved node stays ml's.
    let mine = id(&h, &ana, "ml-q", "reservation: demo-day\n").await;
    let theirs = id(&h, &oz, "other-q", "").await;
    let more = id(&h, &oz, "other-q", "").await;
    cycle(&h).await;
    let j = job(&h, mine).await;
    assert_eq!(j["state"], "admitted", "{j}");
    assert_eq!(j["tasks"][0]["node"], node, "{j}");
    let j = job(&h, theirs).await;
    assert_ne!(j["tasks"][0]["node"], node, "{j}");
    assert_eq!(job(&h, more).await["state"], "pending");
}

#[tokio::test]
async fn before_a_reservation_opens_only_work_that_ends_in_time_runs_on_its_nodes() {
    let h = harness(None).await;
    let (ana, oz) = setup(&h).await;
    let t = now();
    let (s, v) = h
        .json(
            "POST",
            "/v1/reservations",
            &h.admin,
            json!({"name": "later", "start": t + 1800, "end": t + 7200, "nodes": ["n1", "n2"], "users": ["ana"]}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    // Ten minutes fits before the window; no declared end does not.
    let short = id(&h, &oz, "other-q", "max_runtime_s: 600\n").await;
    let open_ended = id(&h, &oz, "other-q", "").await;
    let waiting = id(&h, &ana, "ml-q", "reservation: later\n").await;
    cycle(&h).await;
    assert_eq!(job(&h, short).await["state"], "admitted");
    assert_eq!(job(&h, open_ended).await["state"], "pending");
    let (_, why) = h.get(&format!("/v1/jobs/{waiting}/why"), &h.admin).await;
    assert!(
        why["summary"].as_str().unwrap().contains("to open at"),
        "{why}"
    );
    assert_eq!(why["eta"], t + 1800, "{why}");
}
