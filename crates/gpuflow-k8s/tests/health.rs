//! The scheduler's own endpoints: readiness waits for every watch cache
//! (and says which RBAC is missing), metrics count what it did.

mod support;

use gpuflow_k8s::scheduler::Scheduler;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Serves the scheduler's endpoints; returns their address.
async fn serve(s: &Scheduler) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = gpuflow_k8s::health::router(s.health());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

/// (status, body) of `GET path`.
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
    c.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    c.read_to_string(&mut out).await.unwrap();
    let status = out[9..12].parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_every_cache_and_names_the_one_the_rbac_forbids() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 4.0));
    api.forbid("jobs");
    let s = Scheduler::new(client.clone(), settings("r1"));
    let addr = serve(&s).await;
    let task = tokio::spawn(s.run(std::future::pending()));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let (code, body) = get(addr, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("jobs") && !body.contains("pods"), "{body}");
    assert_eq!(get(addr, "/healthz").await.0, 200);
    // Nothing is scheduled on a partial view.
    api.apply(pod("ml", "p", 1));
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(api.binds().is_empty());
    // The rule granted, the cache fills and scheduling starts.
    api.allow("jobs");
    let mut ready = false;
    for _ in 0..100 {
        if get(addr, "/readyz").await.0 == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(ready, "ready once the jobs cache lists");
    eventually(10, "the pod bound", || node_of(&api, "ml", "p").is_some()).await;
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_bindings_and_show_each_queue() {
    let (api, client) = server().await;
    api.apply(node("n1", 4));
    api.apply(queue("ml", &["ml"], 4.0));
    api.apply(pod("ml", "a", 2));
    api.apply(pod("ml", "b", 2));
    api.apply(pod("ml", "c", 2));
    let s = Scheduler::new(client.clone(), settings("r1"));
    let addr = serve(&s).await;
    let task = tokio::spawn(s.run(std::future::pending()));
    // Two of the three fit.
    eventually(10, "two pods bound", || {
        ["a", "b", "c"]
            .iter()
            .filter(|p| node_of(&api, "ml", p).is_some())
            .count()
            == 2
    })
    .await;
    let mut body = String::new();
    for _ in 0..50 {
        body = get(addr, "/metrics").await.1;
        if body.contains("gpuflow_k8s_queue_pending_pods{queue=\"ml\"} 1.0") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        body.lines()
            .any(|l| l == "# TYPE gpuflow_k8s_cycles_total counter"),
        "{body}"
    );
    // Each series' value, as a number (whole gauges and counters are
    // written as integers, the others as floats).
    let value = |series: &str| -> Option<f64> {
        body.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    };
    for (series, want) in [
        ("gpuflow_k8s_ready", 1.0),
        ("gpuflow_k8s_leader", 1.0),
        ("gpuflow_k8s_bound_pods_total", 2.0),
        ("gpuflow_k8s_queue_running_pods{queue=\"ml\"}", 2.0),
        ("gpuflow_k8s_queue_pending_pods{queue=\"ml\"}", 1.0),
        (
            "gpuflow_k8s_queue_gpus_in_use{queue=\"ml\",model=\"NVIDIA-H100-80GB-HBM3\"}",
            4.0,
        ),
        ("gpuflow_k8s_cycle_failures_total", 0.0),
    ] {
        assert_eq!(value(series), Some(want), "{series} in\n{body}");
    }
    task.abort();
}
