//! End to end: `gpuflow k8s run` (the real binary) schedules pods on a
//! Kubernetes API server (the in-process fake, through a kubeconfig) and
//! reports them to a `gpuflow server` (the real binary): they appear as
//! jobs, in the usage report and in `job why`, only to their own team.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use gpuflow_k8s::fake::FakeApi;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(60);

fn kube_node(name: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.product": "H100"}},
        "spec": {},
        "status": {
            "allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": gpus.to_string()},
            "conditions": [{"type": "Ready", "status": "True"}]
        }
    })
}

fn kube_pod(name: &str, gpus: u32) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "team-a",
            "labels": {"gpuflow.io/user": "ann"}, "annotations": {"gpuflow.io/class": "training"}},
        "spec": {
            "schedulerName": "gpuflow",
            "containers": [{"name": "main", "image": "cuda:12",
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                              "limits": {"nvidia.com/gpu": gpus.to_string()}}}]
        },
        "status": {"phase": "Pending"}
    })
}

/// The k8s jobs a token sees.
fn k8s_jobs(api: &Api, token: &str) -> Vec<Value> {
    api.get("/v1/jobs?limit=100", token)
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["external"]["cluster"] == "kind-1")
        .cloned()
        .collect()
}

#[test]
fn pods_gpuflow_schedules_on_kubernetes_are_accounted_explained_and_kept_to_their_team() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let ann = api.team_with_member(&admin, "ml", "ann", "member");
    let eve = api.team_with_member(&admin, "other", "eve", "member");

    // The cluster: one node of 4 GPUs; team-a's queue is charged to ml.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let kube = FakeApi::default();
    let addr = rt.block_on(kube.serve()).unwrap();
    kube.apply(kube_node("n1", 4));
    kube.apply(json!({
        "apiVersion": "gpuflow.io/v1alpha1", "kind": "GpuQueue",
        "metadata": {"name": "team-a"},
        "spec": {"namespaces": ["team-a"], "quotas": {"*": {"guaranteed": 4}}, "team": "ml"}
    }));
    kube.apply(kube_pod("train", 2));
    kube.apply(kube_pod("big", 8));
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: fake, cluster: {{server: 'http://{addr}'}}}}]\n\
             users: [{{name: fake, user: {{}}}}]\ncontexts: [{{name: fake, context: {{cluster: fake, user: fake}}}}]\n\
             current-context: fake\n"
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("k8s.log")).unwrap();
    let _k8s = Proc(
        Command::new(BIN)
            .args(["k8s", "run", "--interval", "200ms", "--identity", "r1"])
            .args(["--listen", &format!("127.0.0.1:{}", free_port())])
            .args(["--control-plane", &srv.url, "--cluster", "kind-1"])
            .args(["--report-every", "500ms"])
            .env("GPUFLOW_TOKEN", &admin)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );

    // Both pods appear as ml's jobs: one running on 2 GPUs, one waiting.
    let jobs = poll("the pods reported as jobs", LONG, || {
        let jobs = k8s_jobs(&api, &ann);
        (jobs.len() == 2 && jobs.iter().any(|j| j["state"] == "running")).then_some(jobs)
    });
    let by_name = |n: &str| jobs.iter().find(|j| j["name"] == n).unwrap().clone();
    let (train, big) = (by_name("train"), by_name("big"));
    assert_eq!(train["team"], "ml");
    assert_eq!(train["user"], "ann");
    assert_eq!(train["queue"], "team-a");
    assert_eq!(train["external"]["key"], "team-a/pod/train");
    assert_eq!(train["ledger"][0]["gpus"], 2.0);
    assert_eq!(big["state"], "pending");
    // `job why` gives the cluster's explanation, by id and by pod.
    let big_id = big["id"].as_u64().unwrap().to_string();
    let out = Command::new(BIN)
        .args(["job", "why", &big_id, "--server", &srv.url, "--token", &ann])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("position 1 in queue team-a"), "{text}");
    let out = Command::new(BIN)
        .args(["job", "why", "team-a/big"])
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("team-a/big waits") && text.contains("position 1 in queue team-a"),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Another team sees none of it, even by id; a member cannot report.
    assert!(k8s_jobs(&api, &eve).is_empty());
    let (s, _) = api.call("GET", &format!("/v1/jobs/{big_id}"), &eve, None);
    assert_eq!(s, 404);
    let (s, v) = api.call(
        "PUT",
        "/v1/clusters/kind-1/workloads",
        &ann,
        Some(("application/json", br#"{"workloads": []}"#)),
    );
    assert_eq!(s, 403, "{v}");
    // The server does not act on pods it does not run.
    let (s, v) = api.call("POST", &format!("/v1/jobs/{big_id}/cancel"), &ann, None);
    assert_eq!(s, 409, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("Kubernetes cluster kind-1"),
        "{v}"
    );

    // The running pod ends: its job finishes and its GPU-hours are ml's.
    std::thread::sleep(Duration::from_secs(2));
    kube.remove("v1", "Pod", "team-a", "train");
    let train_id = train["id"].as_u64().unwrap();
    poll("the finished pod's job closed", LONG, || {
        let j = api.get(&format!("/v1/jobs/{train_id}"), &ann);
        (j["state"] == "succeeded").then_some(())
    });
    let usage = api.get("/v1/reports/usage?by=team", &admin);
    let ml = usage["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "ml")
        .unwrap_or_else(|| panic!("{usage}"));
    let hours = ml["gpu_hours"].as_f64().unwrap();
    // Two GPUs for about two seconds (more for the reports' latency).
    assert!(
        hours > 2.0 * 1.5 / 3600.0 && hours < 2.0 * 30.0 / 3600.0,
        "{usage}"
    );
    let by_queue = api.get("/v1/reports/usage?by=queue", &ann);
    assert!(
        by_queue["rows"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["key"] == "team-a"),
        "{by_queue}"
    );
    drop(rt);
}
