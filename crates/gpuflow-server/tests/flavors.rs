//! Quotas named by GPU model family (#38): the README's `H100` quota
//! examples matched nothing on a node whose model is `H100-80GB-HBM3`
//! (accepted with a warning, then ignored).

mod support;

use serde_json::json;
use support::harness;

#[tokio::test]
async fn a_quota_named_by_model_family_applies_to_each_model_of_it() {
    let h = harness(None).await;
    let a = &h.admin;
    let gpus: Vec<_> = (0..2)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100-80GB-HBM3", "memory_mib": 81920}))
        .collect();
    let (s, v) = h
        .json(
            "POST",
            "/v1/agent/register",
            &h.join,
            json!({"node": "n1", "inventory": {"cpu_milli": 64000, "memory_mib": 262144, "gpus": gpus, "emulated": true}}),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = h.json("POST", "/v1/teams", a, json!({"name": "ml"})).await;
    assert_eq!(s, 201, "{v}");
    // One H100 guaranteed, none to borrow: the second job waits.
    let (s, v) = h
        .json(
            "POST",
            "/v1/queues",
            a,
            json!({"name": "ml-q", "team": "ml", "quotas": {"H100": {"guaranteed": 1, "borrow_limit": 0}}}),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let spec = "name: j\nqueue: ml-q\nkind: batch\ntasks:\n  - name: main\n    command: [sleep, '100']\n    resources: {cpu: 1, memory_mib: 1024, gpu: {count: 1}}\n";
    let first = h.submit_spec(spec.to_string()).await;
    let second = h.submit_spec(spec.to_string()).await;
    gpuflow_server::cycle::run_once(&h.shared).await.unwrap();
    let state = async |id: u64| {
        let (_, v) = h.get(&format!("/v1/jobs/{id}"), a).await;
        v["state"].as_str().unwrap().to_string()
    };
    assert_eq!(state(first).await, "admitted");
    assert_eq!(state(second).await, "pending");
    let (_, why) = h.get(&format!("/v1/jobs/{second}/why"), a).await;
    assert!(
        why.to_string()
            .contains("above its guarantee plus borrowing limit of 1"),
        "{why}"
    );
    // Metrics: the guarantee per model, from the family's entry.
    let req = axum::http::Request::builder()
        .uri("/metrics")
        .header("authorization", format!("Bearer {a}"))
        .body(axum::body::Body::empty())
        .unwrap();
    let resp = tower::ServiceExt::oneshot(h.router.clone(), req)
        .await
        .unwrap();
    let text = String::from_utf8(
        axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(
        text.contains("gpuflow_queue_guaranteed_gpus{queue=\"ml-q\",flavor=\"H100-80GB-HBM3\"} 1"),
        "{text}"
    );
}
