//! The HTTP API in-process (the router, no sockets), against SQLite and
//! against a throwaway PostgreSQL (skipped with a printed reason when
//! PostgreSQL is not installed): bad input, tenant isolation for every
//! endpoint × role × own or other team, and the OpenAPI route table.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::http::Request;
use gpuflow_store::Table;
use serde_json::{Value, json};
use tower::ServiceExt;

mod support;
use support::*;

// ---------------------------------------------------------------- bad input

async fn bad_input(store: Option<String>) {
    let h = harness(store).await;
    let a = h.admin.clone();
    let good = "name: ok\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '1']\n    resources: {cpu: 1, gpu: {count: 1}}\n";
    let cases: Vec<(&str, String, &str, u16, &str)> = vec![
        (
            "malformed YAML",
            "name: [unclosed\n".into(),
            "application/yaml",
            400,
            "invalid_spec",
        ),
        (
            "malformed JSON",
            "{\"name\": ".into(),
            "application/json",
            400,
            "invalid_spec",
        ),
        (
            "empty body",
            String::new(),
            "application/yaml",
            400,
            "invalid_spec",
        ),
        (
            "unknown field",
            good.replace("queue:", "colour: red\nqueue:"),
            "application/yaml",
            400,
            "colour",
        ),
        (
            "unknown nested field",
            good.replace("cpu: 1", "cpus: 1"),
            "application/yaml",
            400,
            "tasks[0].resources",
        ),
        (
            "wrong type",
            good.replace("count: 1", "count: two"),
            "application/yaml",
            400,
            "tasks[0].resources.gpu.count",
        ),
        (
            "negative cpu",
            good.replace("cpu: 1", "cpu: -4"),
            "application/yaml",
            400,
            "tasks[0].resources.cpu",
        ),
        (
            "absurd gpus",
            good.replace("count: 1", "count: 100000"),
            "application/yaml",
            400,
            "tasks[0].resources.gpu.count",
        ),
        (
            "negative gpus",
            good.replace("count: 1", "count: -1"),
            "application/yaml",
            400,
            "tasks[0].resources.gpu.count",
        ),
        (
            "absurd memory",
            good.replace("cpu: 1", "cpu: 1, memory_mib: 99999999999"),
            "application/yaml",
            400,
            "memory_mib",
        ),
        (
            "no command",
            good.replace("command: [sleep, '1']", "command: []"),
            "application/yaml",
            400,
            "tasks[0].command",
        ),
        (
            "bad name",
            good.replace("name: ok", "name: 'Robert; DROP TABLE jobs'"),
            "application/yaml",
            400,
            "name",
        ),
        (
            "unknown queue",
            good.replace("queue: default", "queue: nope"),
            "application/yaml",
            400,
            "does not exist",
        ),
        (
            "unknown project",
            good.replace("queue: default", "queue: default\nproject: moonshot"),
            "application/yaml",
            400,
            "project",
        ),
        (
            "unknown class",
            good.replace("queue: default", "queue: default\npriority_class: urgent"),
            "application/yaml",
            400,
            "priority_class",
        ),
        (
            "oversize body",
            format!("name: ok\n# {}\n", "x".repeat(2 << 20)),
            "application/yaml",
            413,
            "larger than",
        ),
    ];
    for (what, body, ct, status, needle) in &cases {
        let (s, v) = h
            .call("POST", "/v1/jobs", Some(&a), ct, body.clone().into_bytes())
            .await;
        assert_eq!(s, *status, "{what}: {v}");
        let msg = format!(
            "{} {}",
            v["code"].as_str().unwrap_or(""),
            v["message"].as_str().unwrap_or("")
        );
        assert!(msg.contains(needle), "{what}: {needle:?} not in {msg:?}");
    }
    // Not UTF-8.
    let (s, _) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&a),
            "application/yaml",
            vec![0xff, 0xfe, 0x00],
        )
        .await;
    assert_eq!(s, 400);
    // Invalid or missing tokens.
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some("gft_forged"),
            "application/yaml",
            good.into(),
        )
        .await;
    assert_eq!((s, v["code"].as_str()), (401, Some("token_unknown")), "{v}");
    let (s, v) = h
        .call("POST", "/v1/jobs", None, "application/yaml", good.into())
        .await;
    assert_eq!(s, 401, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("Authorization: Bearer"),
        "{v}"
    );
    // Other resources: bad ids, filters, queue specs, users.
    assert_eq!(h.get("/v1/jobs/abc", &a).await.0, 400);
    assert_eq!(h.get("/v1/jobs/999", &a).await.0, 404);
    let (s, v) = h.get("/v1/jobs?state=bogus", &a).await;
    assert!(
        s == 400 && v["message"].as_str().unwrap().contains("pending"),
        "{v}"
    );
    assert_eq!(h.get("/v1/jobs?colour=red", &a).await.0, 400);
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &a,
            json!({"name": "q", "team": "default", "weight": -1}),
        )
        .await;
    assert!(
        s == 400 && v["message"].as_str().unwrap().contains("weight"),
        "{v}"
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &a,
            json!({"name": "q", "team": "default", "quotas": {"H100": {"guaranteed": -2}}}),
        )
        .await;
    assert!(
        s == 400
            && v["message"]
                .as_str()
                .unwrap()
                .contains("quotas.H100.guaranteed"),
        "{v}"
    );
    let (s, _) = h
        .json(
            "POST",
            "/v1/queues",
            &a,
            json!({"name": "q", "team": "default", "wieght": 2}),
        )
        .await;
    assert_eq!(s, 400);
    let (s, _) = h
        .json(
            "POST",
            "/v1/queues",
            &a,
            json!({"name": "q", "team": "nobody"}),
        )
        .await;
    assert_eq!(s, 400);
    let (s, _) = h
        .json(
            "POST",
            "/v1/users",
            &a,
            json!({"name": "u", "team": "default", "role": "emperor"}),
        )
        .await;
    assert_eq!(s, 400);
    let (s, _) = h.json("POST", "/v1/agent/register", &h.join, json!({"node": "BAD NAME", "inventory": {"cpu_milli": 1, "memory_mib": 1, "gpus": [], "emulated": true}})).await;
    assert_eq!(s, 400);
    assert_eq!(h.get("/v1/nothing", &a).await.0, 404);
    // Nothing was stored by any of it.
    assert_eq!(h.stored_jobs().await, 0);
    assert_eq!(h.stored_events().await, 0);
    assert!(
        h.shared
            .store
            .load(Table::Queues)
            .await
            .unwrap()
            .iter()
            .all(|r| r.key == "default")
    );
    // A bad idempotency key is refused too.
    let long = "k".repeat(200);
    let req = Request::builder()
        .method("POST")
        .uri("/v1/jobs")
        .header("authorization", format!("Bearer {a}"))
        .header("idempotency-key", long)
        .body(Body::from(good))
        .unwrap();
    assert_eq!(
        h.router
            .clone()
            .oneshot(req)
            .await
            .unwrap()
            .status()
            .as_u16(),
        400
    );
    assert_eq!(h.stored_jobs().await, 0);
    // And a good spec still goes in.
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&a),
            "application/yaml",
            good.into(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(h.stored_jobs().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_sqlite() {
    bad_input(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_postgres() {
    with_postgres(bad_input).await;
}

// ---------------------------------------------------------- tenant isolation

const ROLES: [&str; 4] = ["admin", "team-lead", "member", "viewer"];

async fn setup_tenants(h: &H) -> BTreeMap<&'static str, String> {
    let a = &h.admin;
    let mut tokens = BTreeMap::new();
    tokens.insert("admin", a.clone());
    for team in ["alpha", "beta"] {
        assert_eq!(
            h.json("POST", "/v1/teams", a, json!({"name": team}))
                .await
                .0,
            201
        );
        for q in [format!("{team}-q"), format!("{team}-parent")] {
            let (s, v) = h
                .json(
                    "POST",
                    "/v1/queues",
                    a,
                    json!({"name": q, "team": team, "quotas": {"*": {"guaranteed": 1}}}),
                )
                .await;
            assert_eq!(s, 201, "{v}");
        }
        let (s, v) = h
            .json(
                "POST",
                "/v1/projects",
                a,
                json!({"name": format!("{team}-p"), "team": team, "cost_centre": "cc-1"}),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        for role in &ROLES[1..] {
            let user = format!("{team}-{role}");
            assert_eq!(
                h.json(
                    "POST",
                    "/v1/users",
                    a,
                    json!({"name": user, "team": team, "role": role})
                )
                .await
                .0,
                201
            );
            let (s, v) = h.json("POST", "/v1/tokens", a, json!({"user": user})).await;
            assert_eq!(s, 201);
            if team == "alpha" {
                tokens.insert(*role, v["token"].as_str().unwrap().to_string());
            }
        }
    }
    // A node, so node endpoints have something to act on.
    let (s, v) = h
        .json("POST", "/v1/agent/register", &h.join, json!({"node": "n1", "inventory": {"cpu_milli": 8000, "memory_mib": 8192, "gpus": [], "emulated": true}}))
        .await;
    assert_eq!(s, 200, "{v}");
    tokens
}

async fn isolation(store: Option<String>) {
    let h = harness(store).await;
    let tokens = setup_tenants(&h).await;
    // A job accounted to a project of its team; a project of another team is refused.
    let spec = |p: &str| {
        format!(
            "name: pj\nqueue: alpha-q\nproject: {p}\ntasks:\n  - name: main\n    command: [sleep, '1']\n"
        )
    };
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            spec("alpha-p").into_bytes(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            spec("beta-p").into_bytes(),
        )
        .await;
    assert!(
        s == 400 && v["message"].as_str().unwrap().contains("alpha-p"),
        "{v}"
    );
    let (_, listed) = h.get("/v1/jobs?project=alpha-p", &h.admin).await;
    assert_eq!(listed.as_array().unwrap().len(), 1);
    let mut checked = 0;
    for role in ROLES {
        let tok = tokens[role].as_str();
        let admin = role == "admin";
        let lead = role == "team-lead";
        let acts = matches!(role, "admin" | "team-lead" | "member");
        for own in [true, false] {
            let team = if own { "alpha" } else { "beta" };
            let q = format!("{team}-q");
            let ctx = format!("{role} on {team}'s");
            // Reads of one job: own team or admin, else 404 (ids not disclosed).
            let read = if admin || own { 200 } else { 404 };
            let id = h.job(&q).await;
            for path in [
                format!("/v1/jobs/{id}"),
                format!("/v1/jobs/{id}/why"),
                format!("/v1/jobs/{id}/logs"),
                format!("/v1/events?job={id}"),
            ] {
                assert_eq!(h.get(&path, tok).await.0, read, "{ctx} GET {path}");
                checked += 1;
            }
            // Submit.
            let (s, _) = h.submit(tok, &q).await;
            assert_eq!(
                s,
                if admin || (own && acts) { 201 } else { 403 },
                "{ctx} submit"
            );
            // Owner actions on the admin's jobs (a member acts on their own
            // only: security.rs); a refused one leaves the job as it was.
            for action in ["cancel", "suspend"] {
                let id = h.job(&q).await;
                let (s, _) = h
                    .call(
                        "POST",
                        &format!("/v1/jobs/{id}/{action}"),
                        Some(tok),
                        "",
                        vec![],
                    )
                    .await;
                let want = if admin || (own && lead) {
                    200
                } else if own {
                    403
                } else {
                    404
                };
                assert_eq!(s, want, "{ctx} {action}");
                if want != 200 {
                    assert_eq!(
                        h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1["state"],
                        "pending"
                    );
                }
                checked += 1;
            }
            // Resume a suspended job (the owner's action).
            let id = h.job(&q).await;
            assert_eq!(
                h.call(
                    "POST",
                    &format!("/v1/jobs/{id}/suspend"),
                    Some(&h.admin),
                    "",
                    vec![]
                )
                .await
                .0,
                200
            );
            let (s, _) = h
                .call(
                    "POST",
                    &format!("/v1/jobs/{id}/resume"),
                    Some(tok),
                    "",
                    vec![],
                )
                .await;
            assert_eq!(
                s,
                if admin || (own && lead) {
                    200
                } else if own {
                    403
                } else {
                    404
                },
                "{ctx} resume"
            );
            // Admin actions: hold, and release of a held job.
            let id = h.job(&q).await;
            let (s, _) = h
                .call(
                    "POST",
                    &format!("/v1/jobs/{id}/hold"),
                    Some(tok),
                    "",
                    vec![],
                )
                .await;
            assert_eq!(
                s,
                if admin {
                    200
                } else if own {
                    403
                } else {
                    404
                },
                "{ctx} hold"
            );
            let id = h.job(&q).await;
            assert_eq!(
                h.call(
                    "POST",
                    &format!("/v1/jobs/{id}/hold"),
                    Some(&h.admin),
                    "",
                    vec![]
                )
                .await
                .0,
                200
            );
            let (s, _) = h
                .call(
                    "POST",
                    &format!("/v1/jobs/{id}/release"),
                    Some(tok),
                    "",
                    vec![],
                )
                .await;
            assert_eq!(
                s,
                if admin {
                    200
                } else if own {
                    403
                } else {
                    404
                },
                "{ctx} release"
            );
            assert_eq!(
                h.get(&format!("/v1/jobs/{id}"), &h.admin).await.1["state"],
                if admin { "pending" } else { "held" }
            );
            // Queues: the weight of a top-level queue is the admin's (a team
            // lead raising it would take from every other team).
            let (s, _) = h
                .json(
                    "PATCH",
                    &format!("/v1/queues/{q}"),
                    tok,
                    json!({"weight": 2}),
                )
                .await;
            assert_eq!(
                s,
                if admin {
                    200
                } else if own {
                    403
                } else {
                    404
                },
                "{ctx} top-level queue patch"
            );
            // Top-level quotas are the admin's.
            let (s, _) = h
                .json(
                    "PATCH",
                    &format!("/v1/queues/{q}"),
                    tok,
                    json!({"quotas": {"*": {"guaranteed": 3}}}),
                )
                .await;
            assert_eq!(
                s,
                if admin {
                    200
                } else if own {
                    403
                } else {
                    404
                },
                "{ctx} quota patch"
            );
            // A child queue within the parent's guarantee.
            let child = format!("{team}-child-{role}");
            let (s, _) = h
                .json("POST", "/v1/queues", tok, json!({"name": child, "team": team, "parent": format!("{team}-parent"), "quotas": {"*": {"guaranteed": 0.1}}}))
                .await;
            assert_eq!(
                s,
                if admin || (own && lead) { 201 } else { 403 },
                "{ctx} queue create"
            );
            // The weight of a queue below the team's (team lead, or admin).
            if s == 201 {
                let (s, _) = h
                    .json(
                        "PATCH",
                        &format!("/v1/queues/{child}"),
                        tok,
                        json!({"weight": 2}),
                    )
                    .await;
                assert_eq!(s, 200, "{ctx} child queue patch");
            }
            let scratch = format!("{team}-scratch-{role}");
            assert_eq!(
                h.json(
                    "POST",
                    "/v1/queues",
                    &h.admin,
                    json!({"name": scratch, "team": team})
                )
                .await
                .0,
                201
            );
            let (s, _) = h
                .call(
                    "DELETE",
                    &format!("/v1/queues/{scratch}"),
                    Some(tok),
                    "",
                    vec![],
                )
                .await;
            assert_eq!(s, if admin { 204 } else { 403 }, "{ctx} queue delete");
            // Projects of the team.
            let (s, _) = h
                .json(
                    "POST",
                    "/v1/projects",
                    tok,
                    json!({"name": format!("{team}-proj-{role}"), "team": team}),
                )
                .await;
            assert_eq!(
                s,
                if admin || (own && lead) { 201 } else { 403 },
                "{ctx} project create"
            );
            // Users and tokens of the team.
            let user = format!("{team}-new-{role}");
            let (s, _) = h
                .json(
                    "POST",
                    "/v1/users",
                    tok,
                    json!({"name": user, "team": team, "role": "member"}),
                )
                .await;
            assert_eq!(
                s,
                if admin || (own && lead) { 201 } else { 403 },
                "{ctx} user create"
            );
            let (s, _) = h
                .json(
                    "POST",
                    "/v1/tokens",
                    tok,
                    json!({"user": format!("{team}-member")}),
                )
                .await;
            assert_eq!(
                s,
                if admin || (own && lead) || (own && role == "member") {
                    201
                } else {
                    403
                },
                "{ctx} token create"
            );
            checked += 9;
        }
        // Admin-only endpoints.
        let admin_want = |ok: u16| if admin { ok } else { 403 };
        assert_eq!(
            h.get("/v1/audit", tok).await.0,
            admin_want(200),
            "{role} audit"
        );
        assert_eq!(
            h.call("POST", "/v1/nodes/n1/cordon", Some(tok), "", vec![])
                .await
                .0,
            admin_want(200),
            "{role} cordon"
        );
        let (s, _) = h
            .json(
                "POST",
                "/v1/teams",
                tok,
                json!({"name": format!("t-{role}")}),
            )
            .await;
        assert_eq!(s, admin_want(201), "{role} team create");
        // Lists show the own team only.
        for path in [
            "/v1/jobs",
            "/v1/queues",
            "/v1/projects",
            "/v1/users",
            "/v1/teams",
            "/v1/events",
        ] {
            let (s, v) = h.get(path, tok).await;
            assert_eq!(s, 200, "{role} {path}");
            let teams: std::collections::BTreeSet<String> = v
                .as_array()
                .unwrap()
                .iter()
                .map(|x| {
                    x.get("team")
                        .or(x.get("name"))
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string()
                })
                .collect();
            if admin {
                assert!(
                    teams.contains("beta"),
                    "admin sees all on {path}: {teams:?}"
                );
            } else {
                assert!(
                    !teams.is_empty() && teams.iter().all(|t| t == "alpha"),
                    "{role} on {path} sees {teams:?}"
                );
            }
            checked += 1;
        }
        // Node and pool reads are open to every role; agent endpoints are not for users.
        assert_eq!(h.get("/v1/nodes", tok).await.0, 200);
        assert_eq!(h.get("/v1/pools", tok).await.0, 200);
        let (s, me) = h.get("/v1/whoami", tok).await;
        assert_eq!((s, me["role"].as_str()), (200, Some(role)));
        let (s, _) = h.json("POST", "/v1/agent/heartbeat", tok, json!({"node": "n1", "inventory": {"cpu_milli": 1, "memory_mib": 1, "gpus": [], "emulated": true}, "tasks": []})).await;
        assert_eq!(s, 401, "{role} posing as an agent");
        checked += 5;
    }
    // Without a token nothing but the OpenAPI document and the list of
    // identity providers answers.
    let (_, doc) = h.call("GET", "/v1/openapi.json", None, "", vec![]).await;
    for (method, _, path) in documented_routes(&doc) {
        let (s, _) = h
            .call(
                &method.to_uppercase(),
                &path,
                None,
                "application/json",
                b"{}".to_vec(),
            )
            .await;
        let want = match path.as_str() {
            "/v1/openapi.json" | "/v1/auth/providers" => 200,
            // No identity provider here to sign in through.
            "/v1/auth/sessions" | "/v1/auth/code" => 404,
            _ => 401,
        };
        assert_eq!(s, want, "{method} {path} without a token");
        checked += 1;
    }
    assert!(checked > 150, "{checked} checks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_isolation_sqlite() {
    isolation(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_isolation_postgres() {
    with_postgres(isolation).await;
}

// ------------------------------------------------------------- idempotency

#[tokio::test]
async fn a_retried_submission_is_stored_once() {
    let h = harness(None).await;
    let spec = "name: once\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '1']\n";
    let send = |key: &'static str| {
        let req = Request::builder()
            .method("POST")
            .uri("/v1/jobs")
            .header("authorization", format!("Bearer {}", h.admin))
            .header("idempotency-key", key)
            .body(Body::from(spec))
            .unwrap();
        let router = h.router.clone();
        async move {
            let resp = router.oneshot(req).await.unwrap();
            let status = resp.status().as_u16();
            let body: Value = serde_json::from_slice(
                &axum::body::to_bytes(resp.into_body(), 1 << 20)
                    .await
                    .unwrap(),
            )
            .unwrap();
            (status, body["id"].as_u64().unwrap())
        }
    };
    let (s1, id1) = send("abc").await;
    let (s2, id2) = send("abc").await;
    let (s3, id3) = send("other").await;
    assert_eq!((s1, s2, s3), (201, 200, 201));
    assert_eq!(id1, id2);
    assert_ne!(id1, id3);
    assert_eq!(h.stored_jobs().await, 2);
    // The key survives a restart: a reload of the state knows it.
    let world = gpuflow_server::state::World::load(h.shared.store.as_ref())
        .await
        .unwrap();
    assert_eq!(
        world
            .idempotency
            .get(&("admin".to_string(), "abc".to_string())),
        Some(&id1)
    );
}

/// A submission request to the router with idempotency key `key`.
fn keyed_submission(h: &H, key: &str) -> Request<Body> {
    let spec = "name: g\nqueue: default\ntasks:\n  - name: main\n    command: [sleep, '1']\n";
    Request::builder()
        .method("POST")
        .uri("/v1/jobs")
        .header("authorization", format!("Bearer {}", h.admin))
        .header("idempotency-key", key)
        .body(Body::from(spec))
        .unwrap()
}

async fn status_and_id(resp: axum::response::Response) -> (u16, Value) {
    let status = resp.status().as_u16();
    let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, serde_json::from_slice(&body).unwrap())
}

/// Submissions that arrive together are stored together (fewer
/// transactions than submissions), each once, with its own id, and each
/// is acknowledged only once the store has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submissions_that_arrive_together_are_stored_together() {
    let h = harness(None).await;
    let before = h.shared.world.lock().await.stats.commit.count;
    let mut tasks = Vec::new();
    for i in 0..64 {
        let req = keyed_submission(&h, &format!("k{i}"));
        let router = h.router.clone();
        tasks.push(tokio::spawn(async move {
            status_and_id(router.oneshot(req).await.unwrap()).await
        }));
    }
    let mut ids = std::collections::BTreeSet::new();
    for t in tasks {
        let (status, v) = t.await.unwrap();
        assert_eq!(status, 201, "{v}");
        let id = v["id"].as_u64().unwrap();
        // Acknowledged: the store has it, and so does the state.
        assert!(h.shared.world.lock().await.jobs().contains_key(&id));
        ids.insert(id);
    }
    assert_eq!(ids.len(), 64, "every submission has its own id");
    assert_eq!(h.stored_jobs().await, 64);
    let commits = h.shared.world.lock().await.stats.commit.count - before;
    assert!(commits < 64, "{commits} transactions for 64 submissions");
    assert!(h.shared.world.lock().await.storing.is_empty());
}

/// A client that goes away while its submission is being stored: the job
/// is stored once or not at all, and a retry with the same key finds it
/// (told to wait while it is still being stored, never given a second job).
#[tokio::test]
async fn a_submission_whose_client_leaves_mid_request_is_stored_once() {
    let h = harness(None).await;
    let router = h.router.clone();
    let mut first = Box::pin(router.oneshot(keyed_submission(&h, "gone")));
    // Run it until it waits for the store, then drop it: the client left.
    let polled = tokio::time::timeout(std::time::Duration::ZERO, &mut first).await;
    assert!(polled.is_err(), "answered before the store could have it");
    drop(first);
    let mut answers = Vec::new();
    let id = loop {
        let (status, v) = status_and_id(
            h.router
                .clone()
                .oneshot(keyed_submission(&h, "gone"))
                .await
                .unwrap(),
        )
        .await;
        answers.push(status);
        match status {
            // 201: the first never reached the store; 200: it did.
            200 | 201 => break v["id"].as_u64().unwrap(),
            409 => {
                assert_eq!(v["code"], "in_progress", "{v}");
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            _ => panic!("{status}: {v}"),
        }
    };
    assert_eq!(h.stored_jobs().await, 1, "answers {answers:?}");
    assert!(h.shared.world.lock().await.jobs().contains_key(&id));
}

// ------------------------------------------------------------------ OpenAPI

/// The (method, path, a path to call it on) of every operation the served
/// document lists: job 1, the default queue or team, the cancel action.
fn documented_routes(doc: &Value) -> Vec<(String, String, String)> {
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        let concrete = path
            .replace("{id}", "1")
            .replace("{name}", "default")
            .replace("{action}", "cancel");
        for method in item.as_object().expect("a path item").keys() {
            routes.push((method.clone(), path.clone(), concrete.clone()));
        }
    }
    routes
}

/// Whether the document lists `status` among the replies of `method path`.
fn documents(doc: &Value, method: &str, path: &str, status: u16) -> bool {
    doc["paths"][path][method.to_lowercase()]["responses"][status.to_string()].is_object()
}

/// The replies the document lists are the ones the routes give: a route
/// that refuses a request without a token says it needs one, one that
/// does not says it does not, and each create answers the status the
/// document gives it. (The hand-written route table had two creates at
/// 200 that answer 201, and the sign-in routes needing a token.)
#[tokio::test]
async fn the_documented_replies_are_the_answers() {
    let h = harness_with(|c| c.webhook_private = true).await;
    let (_, doc) = h.call("GET", "/v1/openapi.json", None, "", vec![]).await;
    for (method, path, p) in documented_routes(&doc) {
        let (s, _) = h
            .call(
                &method.to_uppercase(),
                &p,
                None,
                "application/json",
                b"{}".to_vec(),
            )
            .await;
        let secured = doc["paths"][&path][&method]["security"]
            .as_array()
            .is_some_and(|s| !s.is_empty());
        assert_eq!(
            s == 401,
            secured,
            "{method} {path} answers {s} without a token; the document says it needs one: {secured}"
        );
        assert!(
            documents(&doc, &method, &path, s),
            "{method} {path}: {s} is not documented"
        );
    }
    let a = &h.admin;
    let gpu = json!({"index": 0, "uuid": "GPU-0", "model": "H100", "memory_mib": 81920});
    let (s, v) = h
        .json("POST", "/v1/agent/register", &h.join, json!({"node": "n1", "inventory": {"cpu_milli": 64000, "memory_mib": 262144, "gpus": [gpu], "emulated": true}}))
        .await;
    assert_eq!(s, 200, "{v}");
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let writes = [
        ("POST", "/v1/teams", json!({"name": "t"})),
        (
            "POST",
            "/v1/queues",
            json!({"name": "q", "team": "t", "quotas": {"*": {"guaranteed": 1}}}),
        ),
        ("PATCH", "/v1/queues/q", json!({"weight": 2})),
        ("POST", "/v1/projects", json!({"name": "p", "team": "t"})),
        (
            "POST",
            "/v1/users",
            json!({"name": "u", "team": "t", "role": "member"}),
        ),
        ("POST", "/v1/tokens", json!({"user": "u"})),
        (
            "POST",
            "/v1/reservations",
            json!({"name": "r", "start": t + 3600, "end": t + 7200, "nodes": ["n1"], "teams": ["t"]}),
        ),
        (
            "POST",
            "/v1/webhooks",
            json!({"url": "http://127.0.0.1:9/hook", "team": "t", "events": ["end"]}),
        ),
        ("PUT", "/v1/prices", json!({"gpu_hour": {"H100": 2.5}})),
    ];
    for (method, path, body) in writes {
        let (s, v) = h.json(method, path, a, body).await;
        assert!((200..300).contains(&s), "{method} {path}: {s} {v}");
        let route = path
            .strip_suffix("/q")
            .map_or(path.to_string(), |p| format!("{p}/{{name}}"));
        assert!(
            documents(&doc, method, &route, s),
            "{method} {path} answers {s}, which the document does not list"
        );
    }
}

#[tokio::test]
async fn every_documented_route_is_served() {
    let h = harness(None).await;
    let (s, doc) = h.call("GET", "/v1/openapi.json", None, "", vec![]).await;
    assert_eq!(s, 200);
    assert_eq!(doc["openapi"], "3.1.0");
    // Every schema a route names is in the document, and refs resolve.
    let text = doc.to_string();
    for part in text.split("#/components/schemas/").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        assert!(
            doc["components"]["schemas"][&name].is_object(),
            "dangling $ref to {name}"
        );
    }
    assert!(doc["components"]["schemas"]["JobSpec"]["properties"]["tasks"].is_object());
    let routes = documented_routes(&doc);
    assert!(routes.len() > 60, "{} routes documented", routes.len());
    for (method, path, p) in routes {
        let (s, v) = h
            .call(
                &method.to_uppercase(),
                &p,
                Some(&h.admin),
                "application/json",
                b"{}".to_vec(),
            )
            .await;
        assert_ne!(s, 405, "{method} {path} not routed");
        assert_ne!(
            v["message"]
                .as_str()
                .map(|m| m.starts_with("no such endpoint")),
            Some(true),
            "{method} {path} not routed"
        );
    }
}

#[tokio::test]
async fn why_diagnoses_a_job_the_cycle_did_not_reach() {
    // No cycle-wide tries: a queue gives up after its own 8.
    let h = harness_with(|c| c.tries_per_cycle = 0).await;
    let a = &h.admin;
    assert_eq!(
        h.json("POST", "/v1/teams", a, json!({"name": "t"})).await.0,
        201
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            a,
            json!({"name": "q", "team": "t", "quotas": {"*": {"guaranteed": 8}}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let gpu = |i: u32| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920});
    let (s, v) = h
        .json("POST", "/v1/agent/register", &h.join, json!({"node": "n1", "inventory": {"cpu_milli": 64000, "memory_mib": 262144, "gpus": [gpu(0), gpu(1), gpu(2), gpu(3)], "emulated": true}}))
        .await;
    assert_eq!(s, 200, "{v}");
    let submit = async |gpus: u32| {
        let spec = format!(
            "name: j\nqueue: q\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '1']\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: {gpus}}}}}\n"
        );
        let (s, v) = h
            .call(
                "POST",
                "/v1/jobs",
                Some(a),
                "application/yaml",
                spec.into_bytes(),
            )
            .await;
        assert_eq!(s, 201, "{v}");
        v["id"].as_u64().unwrap()
    };
    // Three of the four GPUs taken; then nine jobs too big for what is
    // left, and one that fits: a cycle gives up on a queue after 8 failed
    // tries, so the last two are not reached.
    submit(3).await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let mut big = Vec::new();
    for _ in 0..9 {
        big.push(submit(2).await);
    }
    let small = submit(1).await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let reasons = |v: &Value| -> Vec<String> {
        v["reasons"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_str().unwrap().to_string())
            .collect()
    };
    // A job that was tried: the cycle's reasons, nothing diagnosed.
    let (s, v) = h.get(&format!("/v1/jobs/{}/why", big[0]), a).await;
    assert_eq!(s, 200, "{v}");
    let r = reasons(&v);
    assert!(r.iter().any(|r| r.contains("too few free GPUs")), "{r:?}");
    assert!(
        !r.iter().any(|r| r.starts_with("if its turn came now")),
        "{r:?}"
    );
    // Not reached: its position, and what its turn would find now.
    let (_, v) = h.get(&format!("/v1/jobs/{}/why", big[8]), a).await;
    let r = reasons(&v);
    assert!(
        r[0].starts_with("not reached this cycle: 8 job(s) ahead"),
        "{r:?}"
    );
    assert!(
        r.iter()
            .any(|r| r.starts_with("if its turn came now: on H100:")
                && r.contains("too few free GPUs")),
        "{r:?}"
    );
    let (_, v) = h.get(&format!("/v1/jobs/{small}/why"), a).await;
    let r = reasons(&v);
    assert!(r[0].starts_with("not reached this cycle"), "{r:?}");
    assert_eq!(r[1], "if its turn came now: it would start", "{r:?}");
}

/// Messages a new user met, each said once and plainly: a wrong method
/// answers JSON that names it; a member without a team is told to name
/// one; acting on a finished job says it has finished; a held job's `why`
/// does not repeat itself.
#[tokio::test]
async fn messages_name_the_problem_once() {
    let h = harness(None).await;
    let (s, v) = h
        .call(
            "DELETE",
            "/v1/jobs",
            Some(&h.admin),
            "application/json",
            vec![],
        )
        .await;
    assert_eq!(s, 405);
    assert_eq!(v["code"], "method_not_allowed", "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("DELETE is not allowed on /v1/jobs"),
        "{v}"
    );
    let (s, v) = h
        .json(
            "POST",
            "/v1/users",
            &h.admin,
            json!({"name": "zed", "role": "member"}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    let m = v["message"].as_str().unwrap();
    assert!(
        m.contains("a member belongs to a team") && m.contains("--team"),
        "{m}"
    );
    // Held: the reason says who held it, once.
    let id = h.job("default").await;
    let (s, v) = h
        .json("POST", &format!("/v1/jobs/{id}/hold"), &h.admin, json!({}))
        .await;
    assert_eq!(s, 200, "{v}");
    let (_, why) = h.get(&format!("/v1/jobs/{id}/why"), &h.admin).await;
    let summary = why["summary"].as_str().unwrap();
    assert_eq!(summary.matches("held").count(), 1, "{summary}");
    // Finished: acting on it says so.
    h.json(
        "POST",
        &format!("/v1/jobs/{id}/cancel"),
        &h.admin,
        json!({}),
    )
    .await;
    let (s, v) = h
        .json("POST", &format!("/v1/jobs/{id}/hold"), &h.admin, json!({}))
        .await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(
        v["message"],
        format!("job {id} has finished (cancelled): there is nothing to hold")
    );
}

/// A batch of jobs in one request: all stored with consecutive ids, or
/// none, with the wrong one named by its place; another team's queue is
/// refused for the whole batch.
#[tokio::test]
async fn a_batch_is_stored_whole_or_not_at_all() {
    let h = harness(None).await;
    let spec = |name: &str| {
        json!({"name": name, "queue": "default", "kind": "batch",
            "tasks": [{"name": "main", "command": ["sleep", "1"]}]})
    };
    let before = h.stored_jobs().await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/jobs/batch",
            &h.admin,
            json!({"jobs": [spec("a"), {"name": "b", "queue": "default", "tasks": []}, spec("c")]}),
        )
        .await;
    assert_eq!(s, 400, "{v}");
    assert!(v["message"].as_str().unwrap().starts_with("jobs[1]"), "{v}");
    assert_eq!(h.stored_jobs().await, before, "nothing stored");
    let (s, v) = h
        .json(
            "POST",
            "/v1/jobs/batch",
            &h.admin,
            json!({"jobs": [spec("a"), spec("b"), spec("c")]}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let ids: Vec<u64> = v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect();
    assert_eq!(ids.len(), 3);
    assert_eq!((ids[1], ids[2]), (ids[0] + 1, ids[0] + 2));
    assert_eq!(h.stored_jobs().await, before + 3);
    let (s, j) = h.get(&format!("/v1/jobs/{}", ids[2]), &h.admin).await;
    assert_eq!((s, j["name"].as_str()), (200, Some("c")), "{j}");
    // A member of a team without the default queue: the whole batch is refused.
    let (s, _) = h
        .json("POST", "/v1/teams", &h.admin, json!({"name": "other"}))
        .await;
    assert_eq!(s, 201);
    let (s, _) = h
        .json(
            "POST",
            "/v1/users",
            &h.admin,
            json!({"name": "oz", "team": "other", "role": "member"}),
        )
        .await;
    assert_eq!(s, 201);
    let (_, t) = h
        .json("POST", "/v1/tokens", &h.admin, json!({"user": "oz"}))
        .await;
    let oz = t["token"].as_str().unwrap();
    let (s, v) = h
        .json("POST", "/v1/jobs/batch", oz, json!({"jobs": [spec("x")]}))
        .await;
    assert_eq!(s, 403, "{v}");
    assert!(v["message"].as_str().unwrap().starts_with("jobs[0]"), "{v}");
    assert_eq!(h.stored_jobs().await, before + 3);
}

/// A job above its queue's per-user GPU limit (8 GPUs against 6) was
/// accepted and left pending for good, "estimated start: unknown". It is
/// refused at submit, saying why and what to ask for.
#[tokio::test]
async fn a_job_above_the_per_user_gpu_limit_is_refused_at_submit() {
    let h = harness(None).await;
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            &h.admin,
            serde_json::json!({"name": "capped", "team": "default", "quotas": {"*": {"guaranteed": 16}}, "user_limits": {"max_gpus": 6}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let spec = |gpus: u32, replicas: u32| {
        format!(
            "name: big\nqueue: capped\nkind: training\ntasks:\n  - name: main\n    replicas: {replicas}\n    command: [train]\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: {gpus}}}}}\n"
        )
    };
    for (gpus, replicas) in [(8, 1), (2, 4)] {
        let (s, v) = h
            .call(
                "POST",
                "/v1/jobs",
                Some(&h.admin),
                "application/yaml",
                spec(gpus, replicas).into_bytes(),
            )
            .await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(v["code"], "never_starts", "{v}");
        let m = v["message"].as_str().unwrap();
        assert!(m.contains("needs 8 GPUs") && m.contains("at most 6"), "{m}");
    }
    let (s, v) = h
        .call(
            "POST",
            "/v1/jobs",
            Some(&h.admin),
            "application/yaml",
            spec(3, 2).into_bytes(),
        )
        .await;
    assert_eq!(s, 201, "{v}");
}

/// Every endpoint that reads query parameters refuses an unknown one and
/// a value it cannot use with a 400 `bad_query` that names the parameter
/// and what it takes; the last of a repeated parameter counts.
#[tokio::test]
async fn every_query_parameter_is_checked() {
    let h = harness(None).await;
    let a = h.admin.clone();
    let id = h.job("default").await;
    let page = "is not a page size: 1 to 1000; page on with `before` (jobs, the last id seen) or `after` (events, audit: the last seq seen)";
    let mut cases: Vec<(&str, String, String)> = Vec::new();
    for list in [
        "teams", "nodes", "services", "queues", "users", "tokens", "projects",
    ] {
        cases.push((
            "GET",
            format!("/v1/{list}?colour=red"),
            "unknown parameter \"colour\"; allowed: limit, after (the last name seen)".into(),
        ));
        cases.push((
            "GET",
            format!("/v1/{list}?limit=0"),
            format!("limit: \"0\" {page}"),
        ));
    }
    let time =
        "is not a time: use Unix seconds, 2026-12-01, 2026-12-01T08:00:00Z or an age such as 7d";
    let logs = format!("/v1/jobs/{id}/logs");
    let exec = format!("/v1/jobs/{id}/exec");
    let attach = format!("/v1/jobs/{id}/attach");
    for (method, path, says) in [
        ("GET", "/v1/teams?limit=5&limit=1001", format!("limit: \"1001\" {page}")),
        ("GET", "/v1/jobs?colour=red", "unknown filter \"colour\"; allowed: team, queue, state, user, project, array, limit, before, since, until".into()),
        ("GET", "/v1/jobs?since=yesterday", "since: Unix seconds, not \"yesterday\"".into()),
        ("GET", "/v1/jobs?until=-1", "until: Unix seconds, not \"-1\"".into()),
        ("GET", "/v1/jobs?limit=x", format!("limit: \"x\" {page}")),
        ("GET", "/v1/jobs?array=abc", "array: \"abc\" is not a job id (a positive number)".into()),
        ("GET", "/v1/jobs?before=-2", "before: \"-2\" is not a job id (a positive number)".into()),
        ("POST", "/v1/jobs?test_only=maybe", "test_only: \"maybe\" is neither true nor false".into()),
        ("POST", "/v1/jobs?dry=1", "unknown parameter \"dry\"; allowed: test_only".into()),
        ("GET", &format!("{logs}?tail_bytes=ten"), "tail_bytes: \"ten\" is not a whole number".into()),
        ("GET", &format!("{logs}?attempt=-1"), "attempt: \"-1\" is not a whole number".into()),
        ("GET", &format!("{logs}?lines=3"), "unknown parameter \"lines\"; allowed: attempt, tail_bytes".into()),
        ("GET", "/v1/events?colour=red", "unknown filter \"colour\"; allowed: job, after, limit, since, until (Unix seconds), newest".into()),
        ("GET", "/v1/events?after=x", "after: \"x\" is not a number (the last seq seen)".into()),
        ("GET", "/v1/events?job=x", "job: \"x\" is not a whole number".into()),
        ("GET", "/v1/events?since=-5", "since: Unix seconds, not \"-5\"".into()),
        ("GET", "/v1/events?newest=yes", "newest: \"yes\" is neither true nor false".into()),
        ("GET", "/v1/events?limit=5000", format!("limit: \"5000\" {page}")),
        ("GET", "/v1/audit?colour=red", "unknown filter \"colour\"; allowed: after, limit".into()),
        ("GET", "/v1/audit?after=x", "after: \"x\" is not a number (the last seq seen)".into()),
        ("GET", "/v1/audit?limit=0", format!("limit: \"0\" {page}")),
        ("GET", "/v1/reports/jobs?colour=red", "unknown parameter \"colour\"; allowed: by, from, to".into()),
        ("GET", "/v1/reports/jobs?by=team", "by: \"team\"; allowed: queue, kind".into()),
        ("GET", "/v1/reports/jobs?from=soon", format!("from: \"soon\" {time}")),
        ("GET", "/v1/reports/jobs?from=2026-12-02&to=2026-12-01", "from: must be before to".into()),
        ("GET", "/v1/reports/usage?colour=red", "unknown parameter \"colour\"; allowed: by, period, from, to".into()),
        ("GET", "/v1/reports/usage?by=planet", "by: \"planet\"; allowed: team, project, user, queue, model, cost_centre, job".into()),
        ("GET", "/v1/reports/usage?period=week", "period: \"week\"; allowed: hour, day, month, all".into()),
        ("GET", "/v1/reports/usage?to=later", format!("to: \"later\" {time}")),
        ("GET", "/v1/reports/low-utilization?colour=red", "unknown parameter \"colour\"; allowed: below_pct, for".into()),
        ("GET", "/v1/reports/low-utilization?below_pct=200", "below_pct: a percentage from 0 to 100".into()),
        ("GET", "/v1/reports/low-utilization?below_pct=lots", "below_pct: a percentage from 0 to 100".into()),
        ("GET", "/v1/reports/low-utilization?for=ever", "for: \"ever\" is not a duration such as 30m or 2h".into()),
        ("GET", "/v1/reports/advice?colour=red", "unknown parameter \"colour\"; allowed: from, to".into()),
        ("GET", "/v1/reports/advice?from=7d&to=8d", "from: must be before to".into()),
        ("GET", "/v1/reports/workload?colour=red", "unknown parameter \"colour\"; allowed: from, to".into()),
        ("GET", "/v1/reports/workload?to=never", format!("to: \"never\" {time}")),
        ("GET", &format!("{exec}?colour=red"), "unknown parameter \"colour\"; allowed: task, command, tty, rows, cols".into()),
        ("GET", &format!("{exec}?rows=0"), "rows: \"0\" is not a number from 1 to 65535".into()),
        ("GET", &format!("{exec}?cols=70000"), "cols: \"70000\" is not a number from 1 to 65535".into()),
        ("GET", &format!("{exec}?tty=maybe"), "tty: \"maybe\" is neither true nor false".into()),
        ("GET", &format!("{attach}?command=sh"), "unknown parameter \"command\"; allowed: task".into()),
    ] {
        cases.push((method, path.to_string(), says));
    }
    for (method, path, says) in &cases {
        let (s, v) = h
            .call(method, path, Some(&a), "application/json", b"{}".to_vec())
            .await;
        assert_eq!(
            (s, &v["code"]),
            (400, &json!("bad_query")),
            "{method} {path}: {v}"
        );
        assert_eq!(v["message"], json!(says), "{method} {path}");
    }
    // The same parameters, given well, are taken.
    for path in [
        "/v1/teams?limit=1&after=a",
        "/v1/jobs?state=pending,running&limit=5&since=0&until=99999999999&team=default",
        "/v1/events?job=1&after=0&limit=3&since=0&until=99999999999&newest=true",
        "/v1/audit?after=0&limit=2",
        "/v1/reports/jobs?by=kind&from=30d",
        "/v1/reports/usage?by=queue&period=day&from=2026-01-01T00:00:00Z",
        "/v1/reports/low-utilization?below_pct=50&for=30m",
        "/v1/reports/advice?from=7d",
        "/v1/reports/workload?from=7d",
    ] {
        let (s, v) = h.get(path, &a).await;
        assert_eq!(s, 200, "{path}: {v}");
    }
    let (s, v) = h.get(&format!("{logs}?tail_bytes=10&attempt=1"), &a).await;
    assert_eq!(s, 200, "{v}");
    // Past its parameters, exec asks for a WebSocket.
    let (s, v) = h
        .get(
            &format!("{exec}?command=%5B%22sh%22%5D&tty=true&rows=24&cols=80"),
            &a,
        )
        .await;
    assert_eq!((s, &v["code"]), (400, &json!("websocket_required")), "{v}");
}

// ------------------------------------------------- no state lock across I/O

/// `psql` on `url`, reading statements from its standard input.
fn psql(url: &str) -> std::process::Child {
    let bin = gpuflow_store::pgtest::find_binaries().expect("PostgreSQL is installed");
    std::process::Command::new(bin.join("psql"))
        .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("psql runs")
}

/// Reads are answered while a write waits for the store: a writer lets go
/// of the state lock while its change is committed, and publishes it after
/// (issue #39). Another session holds PostgreSQL's jobs table against
/// writes, so a cancellation's commit waits on it; a read of the job
/// meanwhile answers with the state as stored, and the cancellation
/// completes once the table is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_answered_while_a_write_waits_for_the_store() {
    use std::io::{BufRead, Write};
    with_postgres(async |url| {
        let url = url.expect("a PostgreSQL URL");
        let h = std::sync::Arc::new(harness(Some(url.clone())).await);
        let id = h.job("default").await;
        // The other session: the table is held once it says so.
        let mut holder = psql(&url);
        let mut said = std::io::BufReader::new(holder.stdout.take().unwrap());
        let mut to_holder = holder.stdin.take().unwrap();
        writeln!(
            to_holder,
            "BEGIN;\nLOCK TABLE jobs IN EXCLUSIVE MODE;\n\\echo locked"
        )
        .unwrap();
        let mut line = String::new();
        said.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "locked");
        let writer = h.clone();
        let cancel = tokio::spawn(async move {
            writer
                .json(
                    "POST",
                    &format!("/v1/jobs/{id}/cancel"),
                    &writer.admin,
                    json!({}),
                )
                .await
        });
        // Until PostgreSQL shows the cancellation waiting for the table.
        let mut waiting = false;
        for _ in 0..600 {
            let mut ask = psql(&url);
            writeln!(
                ask.stdin.take().unwrap(),
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock';"
            )
            .unwrap();
            let out = ask.wait_with_output().unwrap();
            if String::from_utf8_lossy(&out.stdout).trim() != "0" {
                waiting = true;
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        assert!(waiting, "the cancellation never waited for the table");
        // Before the change the read waited behind the commit for as long
        // as the table was held (for good here).
        let (s, v) = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            h.get(&format!("/v1/jobs/{id}"), &h.admin),
        )
        .await
        .expect("a read waited for a write's commit");
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["state"], "pending", "{v}");
        assert!(
            !cancel.is_finished(),
            "the write did not wait for the store"
        );
        writeln!(to_holder, "COMMIT;").unwrap();
        drop(to_holder);
        holder.wait().unwrap();
        let (s, v) = cancel.await.unwrap();
        assert_eq!(s, 200, "{v}");
        let (_, v) = h.get(&format!("/v1/jobs/{id}"), &h.admin).await;
        assert_eq!(v["state"], "cancelled", "{v}");
    })
    .await;
}
