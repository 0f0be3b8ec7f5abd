//! The agent's GPU work end to end, on `gpuflow up` with the fake NVML
//! library, whose state file the tests rewrite as a GPU would change:
//! samples reaching jobs and nodes, the GPU-memory watchdog, health events
//! taking a GPU out of service until an admin clears it, and idle
//! reclamation of notebooks. Skipped, with the reason printed, without a C
//! compiler.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(60);

struct Up {
    _proc: Proc,
    api: Api,
    admin: String,
    state: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// `gpuflow up` on `gpus` fake NVML GPUs sampled every second; `None`
/// without a C compiler.
fn up_on_fake_nvml(gpus: &str) -> Option<Up> {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = gpuflow_agent::fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return None;
    };
    let state = dir.path().join("nvml-state");
    std::fs::write(&state, "").unwrap();
    let lib = lib.to_str().unwrap().to_string();
    let (proc, api, admin) = up_with(
        &dir.path().join("data"),
        free_port(),
        &["--sample-s", "1", "--nvml-lib", &lib],
        &[
            ("FAKE_NVML_GPUS", gpus),
            ("FAKE_NVML_STATE", state.to_str().unwrap()),
        ],
    );
    Some(Up {
        _proc: proc,
        api,
        admin,
        state,
        _dir: dir,
    })
}

impl Up {
    fn submit(&self, name: &str, kind: &str, gpu: &str) -> u64 {
        let spec = format!(
            "name: {name}\nqueue: default\nkind: {kind}\ncheckpoint: {{grace_s: 1}}\ntasks:\n  - name: main\n    command: [sh, -c, 'echo pid $$; exec sleep 300']\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {gpu}}}\n"
        );
        let (s, v) = self.api.submit_yaml(&self.admin, &spec);
        assert_eq!(s, 201, "{v}");
        v["id"].as_u64().unwrap()
    }

    /// The pid the job's task printed, and the GPU it runs on.
    fn running(&self, id: u64) -> (u32, u64) {
        let j = self.api.wait_state(id, &self.admin, "running", LONG);
        let gpu = j["tasks"][0]["gpus"][0].as_u64().unwrap();
        let pid = poll("the task prints its pid", LONG, || {
            let logs = self.api.get(&format!("/v1/jobs/{id}/logs"), &self.admin);
            let out = logs["tasks"]
                .as_object()?
                .values()
                .next()?
                .as_str()?
                .to_string();
            out.split_whitespace().nth(1)?.parse().ok()
        });
        (pid, gpu)
    }

    fn gpus(&self, state: &str) {
        std::fs::write(&self.state, state).unwrap();
    }

    fn events(&self, id: Option<u64>) -> Vec<Value> {
        let path = match id {
            Some(id) => format!("/v1/events?job={id}&limit=1000"),
            None => "/v1/events?limit=1000".into(),
        };
        self.api
            .get(&path, &self.admin)
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    fn event(&self, id: Option<u64>, kind: &str) -> Option<Value> {
        self.events(id).into_iter().find(|e| e["kind"] == kind)
    }
}

#[test]
fn samples_reach_jobs_and_nodes_and_the_watchdog_stops_a_task_past_its_gpu_memory() {
    let Some(up) = up_on_fake_nvml("2") else {
        return;
    };
    let whole = up.submit("whole", "training", "{count: 1}");
    let (whole_pid, whole_gpu) = up.running(whole);
    let half = up.submit(
        "half",
        "inference",
        "{mode: fraction, fraction: 0.5, memory_mib: 10240}",
    );
    let (half_pid, half_gpu) = up.running(half);
    assert_ne!(whole_gpu, half_gpu);
    up.gpus(&format!(
        "gpu {whole_gpu} util 90 memutil 50 used_mib 40000 power_mw 300000 temp 70\n\
         proc {whole_gpu} {whole_pid} 40000 90\n\
         proc {half_gpu} {half_pid} 8000 40\n"
    ));
    // The whole-GPU task's use reaches its job, for accounting.
    let usage = poll("the task's GPU use reaches the server", LONG, || {
        let j = up.api.job(whole, &up.admin);
        let u = j["tasks"][0]["usage"].clone();
        (u["gpu_util_pct"] == 90 && u["gpu_memory_mib"] == 40000).then_some(u)
    });
    assert!(usage["samples"].as_u64().unwrap() >= 1, "{usage}");
    assert_eq!(usage["gpu_memory_peak_mib"], 40000);
    let half_usage = poll("the shared task's use", LONG, || {
        let u = up.api.job(half, &up.admin)["tasks"][0]["usage"].clone();
        (u["gpu_memory_mib"] == 8000).then_some(u)
    });
    assert_eq!(half_usage["gpu_util_pct"], 40, "its own process's SM share");
    // The node shows its GPUs as sampled.
    let node = poll("the node shows its GPUs now", LONG, || {
        let nodes = up.api.get("/v1/nodes", &up.admin);
        let n = nodes[0].clone();
        n["gpus_now"]
            .as_array()?
            .iter()
            .any(|g| g["util_pct"] == 90 && g["power_w"] == 300.0 && g["temperature_c"] == 70)
            .then_some(n)
    });
    assert_eq!(node["gpus_now"].as_array().unwrap().len(), 2, "{node}");
    // The low-utilisation report lists the shared task at 40%, not the
    // whole GPU at 90%; `job stats` shows the job's hold and its task.
    let low = poll("the low-utilisation report", LONG, || {
        let v = up
            .api
            .get("/v1/reports/low-utilization?below_pct=50&for=0s", &up.admin);
        (v.as_array()?.len() == 1).then_some(v)
    });
    assert_eq!(low[0]["id"], half, "{low}");
    let out = std::process::Command::new(BIN)
        .args(["job", "stats", &whole.to_string()])
        .env("GPUFLOW_SERVER", &up.api.url)
        .env("GPUFLOW_TOKEN", &up.admin)
        .output()
        .unwrap();
    let stats = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stats}");
    assert!(stats.contains("GPU-hours held"), "{stats}");
    assert!(stats.contains("40000 MiB"), "{stats}");
    assert!(stats.contains("90%"), "{stats}");

    // The shared task grows past the 10 GiB it claimed: stopped, with the figures.
    up.gpus(&format!(
        "gpu {whole_gpu} util 90 memutil 50 used_mib 40000 power_mw 300000 temp 70\n\
         proc {whole_gpu} {whole_pid} 40000 90\n\
         proc {half_gpu} {half_pid} 21811 40\n"
    ));
    let failed = up.api.wait_state(half, &up.admin, "failed", LONG);
    let reason = failed["reason"].as_str().unwrap();
    assert!(
        reason.contains("used 21.3 GiB of its 10.0 GiB GPU-memory limit"),
        "{failed}"
    );
    let e = up
        .event(Some(half), "gpu-memory")
        .expect("a gpu-memory event");
    assert!(e["message"].as_str().unwrap().contains("21.3 GiB"), "{e}");
    assert!(!alive(half_pid), "the task's process is gone");
    // The whole-GPU task, within nothing it claimed, runs on.
    assert_eq!(up.api.job(whole, &up.admin)["state"], "running");
}

#[test]
fn a_gpu_with_a_critical_xid_error_takes_no_work_and_its_job_is_requeued_until_cleared() {
    let Some(up) = up_on_fake_nvml("1") else {
        return;
    };
    let job = up.submit("train", "training", "{count: 1}");
    let (pid, _) = up.running(job);
    up.gpus("xid 0 79\n");
    let node = poll("the GPU is unhealthy", LONG, || {
        let n = up.api.get("/v1/nodes", &up.admin)[0].clone();
        n["inventory"]["gpus"][0]["unhealthy"]
            .is_string()
            .then_some(n)
    });
    assert!(
        node["inventory"]["gpus"][0]["unhealthy"]
            .as_str()
            .unwrap()
            .contains("XID 79"),
        "{node}"
    );
    let e = poll("a gpu-unhealthy event", LONG, || {
        up.event(None, "gpu-unhealthy")
    });
    assert!(e["message"].as_str().unwrap().contains("XID 79"), "{e}");
    // Its job is stopped and waits: the only GPU takes no work.
    poll("the job is requeued", LONG, || {
        let j = up.api.job(job, &up.admin);
        (j["state"] == "pending").then_some(())
    });
    let evicted = poll("the eviction says why", LONG, || {
        up.event(Some(job), "evicted")
    });
    assert!(
        evicted["message"].as_str().unwrap().contains("unhealthy"),
        "{evicted}"
    );
    poll("its process is gone", LONG, || (!alive(pid)).then_some(()));
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(up.api.job(job, &up.admin)["state"], "pending");
    // Nobody but an admin clears it; then the job runs again.
    let name = node["name"].as_str().unwrap().to_string();
    let viewer = up.api.user_token(&up.admin, "default", "vic", "viewer");
    let (s, _) = up
        .api
        .post_json(&format!("/v1/nodes/{name}/clear"), &viewer, &json!({}));
    assert_eq!(s, 403);
    let (s, v) = up
        .api
        .post_json(&format!("/v1/nodes/{name}/clear"), &up.admin, &json!({}));
    assert_eq!(s, 200, "{v}");
    let j = up.api.wait_state(job, &up.admin, "running", LONG);
    assert_eq!(j["attempts"], 2, "{j}");
    assert!(up.event(None, "gpu-healthy").is_some());
}

#[test]
fn an_idle_notebook_is_stopped_after_its_window_and_a_busy_one_is_left_alone() {
    let Some(up) = up_on_fake_nvml("2") else {
        return;
    };
    // The admin's default for notebooks of the default queue; a member
    // cannot change it.
    let (s, v) = up.api.call(
        "PATCH",
        "/v1/queues/default",
        &up.admin,
        Some((
            "application/json",
            br#"{"notebook_idle": {"after_s": 10, "warn_s": 3, "below_pct": 5, "action": "suspend"}}"#,
        )),
    );
    assert_eq!(s, 200, "{v}");
    let idle = up.submit("idle-nb", "notebook", "{count: 1}");
    let busy = up.submit("busy-nb", "notebook", "{count: 1}");
    assert_eq!(
        up.api.job(idle, &up.admin)["spec"]["idle"]["after_s"],
        10,
        "a notebook takes its queue's idle policy"
    );
    let (_, idle_gpu) = up.running(idle);
    let (_, busy_gpu) = up.running(busy);
    up.gpus(&format!(
        "gpu {idle_gpu} util 1 memutil 0 used_mib 600 power_mw 60000 temp 35\n\
         gpu {busy_gpu} util 85 memutil 40 used_mib 20000 power_mw 280000 temp 66\n"
    ));
    let warning = poll("the idle notebook is warned", LONG, || {
        up.event(Some(idle), "idle-warning")
    });
    assert!(
        warning["message"]
            .as_str()
            .unwrap()
            .contains("GPU utilisation below 5%"),
        "{warning}"
    );
    let j = up.api.wait_state(idle, &up.admin, "suspended", LONG);
    assert!(j["reason"].as_str().unwrap().contains("idle"), "{j}");
    let stop = up
        .event(Some(idle), "idle-stop")
        .expect("an idle-stop event");
    assert!(
        stop["message"].as_str().unwrap().contains("now 1%"),
        "{stop}"
    );
    // The busy one runs on, never warned.
    assert_eq!(up.api.job(busy, &up.admin)["state"], "running");
    assert!(up.event(Some(busy), "idle-warning").is_none());
}
