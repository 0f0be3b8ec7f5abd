//! `gpuflow up`, the README's first command: server, embedded SQLite and a
//! local agent in one process, with NVML GPUs (the fake library) or emulated
//! ones, running a real job.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

/// What `gpuflow up` wrote to stderr (its log), as it runs.
type Log = std::sync::Arc<std::sync::Mutex<String>>;

/// Starts `gpuflow up`; returns the process, its URL, the admin token (from
/// the file it names: a pipe is not a terminal, so it prints no token) and
/// its log.
fn up(dir: &std::path::Path, extra: &[&str], env: &[(&str, &str)]) -> (Proc, String, String, Log) {
    let port = free_port();
    let mut child = Command::new(BIN)
        .args(["up", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(dir.join("data"))
        .args(["--heartbeat", "1", "--cycle-ms", "200"])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let stderr = child.stderr.take().unwrap();
    let log: Log = Default::default();
    let l = log.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut l = l.lock().unwrap();
            l.push_str(&line);
            l.push('\n');
        }
    });
    let proc = Proc(child);
    let mut lines = BufReader::new(stdout).lines();
    let mut url = None;
    let mut token = None;
    let mut printed = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        printed.push_str(&line);
        printed.push('\n');
        if let Some(u) = line.strip_prefix("gpuflow is up at ") {
            url = Some(u.trim().to_string());
        }
        if let Some(t) = line.trim().strip_prefix("admin token: ") {
            // Not a terminal: the token is not printed, only where it is.
            let file = t.strip_prefix("in ").expect("no token in a log");
            token = Some(std::fs::read_to_string(file).unwrap().trim().to_string());
            break;
        }
    }
    // Keep draining its output so the process never writes to a closed pipe.
    std::thread::spawn(move || for _ in lines {});
    let token = token.expect("up says where the admin token is");
    assert!(
        !printed.contains(&token),
        "the token went to a log: {printed}"
    );
    (proc, url.expect("up prints its address"), token, log)
}

#[test]
fn up_runs_a_job_on_nvml_gpus() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = gpuflow_agent::fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return;
    };
    let lib = lib.to_str().unwrap().to_string();
    let (_proc, url, token, _log) = up(
        dir.path(),
        &["--nvml-lib", &lib],
        &[("FAKE_NVML_GPUS", "2")],
    );
    let api = Api::new(&url);
    let node = poll("the local agent registers", Duration::from_secs(30), || {
        let n = api.get("/v1/nodes", &token);
        n.as_array().unwrap().first().cloned()
    });
    assert_eq!(node["inventory"]["emulated"], false);
    assert_eq!(node["inventory"]["gpus"].as_array().unwrap().len(), 2);
    let spec = "name: on-nvml\nqueue: default\ntasks:\n  - name: main\n    command: [sh, -c, 'echo visible=$CUDA_VISIBLE_DEVICES']\n    resources: {gpu: {count: 2, models: [H100-80GB-HBM3]}}\n";
    let (s, v) = api.submit_yaml(&token, spec);
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &token, "succeeded", Duration::from_secs(60));
    let logs = api.get(&format!("/v1/jobs/{id}/logs"), &token);
    // Real GPUs are made visible by UUID, whatever CUDA's enumeration order.
    assert_eq!(
        logs["tasks"]["main/0"],
        "visible=GPU-fa4e0000-0000-0000-0000-000000000000,GPU-fa4e0000-0000-0000-0000-000000000001\n"
    );
}

#[test]
fn up_runs_mig_jobs_on_the_instances_nvml_reports() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = gpuflow_agent::fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return;
    };
    let lib = lib.to_str().unwrap().to_string();
    let (_proc, url, token, _log) = up(
        dir.path(),
        &["--nvml-lib", &lib],
        &[
            ("FAKE_NVML_GPUS", "1"),
            ("FAKE_NVML_MIG", "3g.40gb,2g.20gb,1g.10gb,1g.10gb"),
        ],
    );
    let api = Api::new(&url);
    let node = poll("the local agent registers", Duration::from_secs(30), || {
        let n = api.get("/v1/nodes", &token);
        n.as_array().unwrap().first().cloned()
    });
    assert_eq!(
        node["inventory"]["gpus"][0]["mig"]
            .as_array()
            .unwrap()
            .len(),
        4,
        "{node}"
    );
    let spec = |p: &str| {
        format!(
            "name: m\nqueue: default\ntasks:\n  - name: main\n    command: [sh, -c, 'echo visible=$CUDA_VISIBLE_DEVICES']\n    resources: {{gpu: {{mode: mig, profile: {p}}}}}\n"
        )
    };
    let (s, v) = api.submit_yaml(&token, &spec("2g.20gb"));
    assert_eq!(s, 201, "{v}");
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, &token, "succeeded", Duration::from_secs(60));
    let logs = api.get(&format!("/v1/jobs/{id}/logs"), &token);
    // The task sees its instance only, by the UUID NVML gave it.
    assert_eq!(
        logs["tasks"]["main/0"],
        "visible=MIG-fa4e0000-0000-0000-0000-000000000001\n"
    );
    // A profile the GPU is not carved into is refused at submit.
    let (s, v) = api.submit_yaml(&token, &spec("7g.80gb"));
    assert_eq!(s, 400, "{v}");
}

#[test]
fn up_runs_every_sharing_mode_and_topology_on_nvml_and_charges_each_to_quota() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = gpuflow_agent::fake_nvml::build(dir.path()).unwrap() else {
        eprintln!("skipped: no C compiler to build the fake NVML library");
        return;
    };
    let lib = lib.to_str().unwrap().to_string();
    // Five GPUs: the first in MIG mode, the next three joined by NVLink, the
    // last on its own (fractions and time slices never share one GPU).
    let (_proc, url, token, _log) = up(
        dir.path(),
        &["--nvml-lib", &lib],
        &[
            ("FAKE_NVML_GPUS", "5"),
            ("FAKE_NVML_MIG", "3g.40gb,3g.40gb"),
            ("FAKE_NVML_MIG_GPUS", "1"),
            ("FAKE_NVML_NVLINK", "1-2-3"),
            ("FAKE_NVML_NUMA", "0,0,1,1,1"),
        ],
    );
    let api = Api::new(&url);
    poll("the local agent registers", Duration::from_secs(30), || {
        api.get("/v1/nodes", &token)
            .as_array()
            .unwrap()
            .first()
            .cloned()
    });
    let job = |name: &str, extra: &str, replicas: u32, gpu: &str| {
        format!(
            "name: {name}\nqueue: default\n{extra}tasks:\n  - name: main\n    replicas: {replicas}\n    command: [sh, -c, 'echo visible=$CUDA_VISIBLE_DEVICES; sleep 60']\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {gpu}}}\n"
        )
    };
    let mut ids = vec![];
    for spec in [
        job("mig", "", 1, "{mode: mig, profile: 3g.40gb}"),
        job(
            "nvl",
            "topology: {level: nvlink, required: true}\n",
            2,
            "{count: 1}",
        ),
        job(
            "frac",
            "",
            1,
            "{mode: fraction, fraction: 0.5, memory_mib: 1024}",
        ),
        job("slice", "", 1, "{mode: time-slice}"),
    ] {
        let (s, v) = api.submit_yaml(&token, &spec);
        assert_eq!(s, 201, "{v}");
        ids.push(v["id"].as_u64().unwrap());
    }
    for id in &ids {
        api.wait_state(*id, &token, "running", Duration::from_secs(60));
    }
    let gpus = |id: u64| -> Vec<u64> {
        let j = api.job(id, &token);
        j["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|t| {
                t["gpus"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|g| g.as_u64().unwrap())
            })
            .collect()
    };
    assert_eq!(gpus(ids[0]), [0], "the MIG job is on the GPU in MIG mode");
    let mut nvl = gpus(ids[1]);
    nvl.sort();
    assert!(
        nvl.iter().all(|g| (1..=3).contains(g)) && nvl.len() == 2,
        "{nvl:?} off the NVLink island"
    );
    // Each is charged to the queue: 3/7 + 2 + 1/2 + 1/4 of a GPU.
    let q = api.get("/v1/queues", &token);
    let used = q[0]["used"]["H100-80GB-HBM3"].as_f64().unwrap();
    assert!((used - (0.429 + 2.0 + 0.5 + 0.25)).abs() < 1e-6, "{q}");
    let logs = poll("the MIG task logs", Duration::from_secs(30), || {
        let l = api.get(&format!("/v1/jobs/{}/logs", ids[0]), &token);
        l["tasks"]["main/0"]
            .as_str()
            .filter(|t| !t.is_empty())
            .map(str::to_string)
    });
    assert!(logs.starts_with("visible=MIG-"), "{logs}");
    // `job ls` shows each job's GPUs as its quota counts them (MIG and
    // time slices showed 1), and `job get` the MIG instance, not only its
    // GPU; a MIG job not yet placed shows its profile.
    // Two instances as a gang: one of the two is taken, so it waits.
    let (s, v) = api.submit_yaml(
        &token,
        &job("later", "", 2, "{mode: mig, profile: 3g.40gb}"),
    );
    assert_eq!(s, 201, "{v}");
    let later = v["id"].as_u64().unwrap();
    let ls = Command::new(BIN)
        .args(["job", "ls", "--server", &url, "--token", &token])
        .output()
        .unwrap();
    let ls = String::from_utf8_lossy(&ls.stdout).into_owned();
    let gpus_col = |id: u64| -> String {
        let line = ls
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("{id} in {ls}"));
        line.split_whitespace().nth(6).unwrap().to_string()
    };
    assert_eq!(gpus_col(ids[0]), "0.43", "{ls}");
    assert_eq!(gpus_col(ids[2]), "0.50", "{ls}");
    assert_eq!(gpus_col(ids[3]), "0.25", "{ls}");
    assert_eq!(gpus_col(later), "2x3g.40gb", "{ls}");
    let t = &api.job(ids[0], &token)["tasks"][0];
    assert!(t["mig_instance"].is_u64(), "{t}");
    assert!(t["uuids"][0].as_str().unwrap().starts_with("MIG-"), "{t}");
    let get = Command::new(BIN)
        .args([
            "job",
            "get",
            &ids[0].to_string(),
            "--server",
            &url,
            "--token",
            &token,
        ])
        .output()
        .unwrap();
    let get = String::from_utf8_lossy(&get.stdout).into_owned();
    assert!(get.contains(" MIG "), "{get}");
    // `node ls -o wide` shows the MIG layout.
    let wide = Command::new(BIN)
        .args([
            "node", "ls", "-o", "wide", "--server", &url, "--token", &token,
        ])
        .output()
        .unwrap();
    let wide = String::from_utf8_lossy(&wide.stdout).into_owned();
    assert!(wide.contains("0:3g.40gb+3g.40gb"), "{wide}");
}

#[test]
fn up_without_a_gpu_emulates_four_and_stops_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    // A library path that does not exist: NVML does not load, as on a machine without GPUs.
    let (proc, url, token, log) = up(dir.path(), &[], &[("LD_LIBRARY_PATH", "/nonexistent")]);
    let api = Api::new(&url);
    let node = poll("the local agent registers", Duration::from_secs(30), || {
        api.get("/v1/nodes", &token)
            .as_array()
            .unwrap()
            .first()
            .cloned()
    });
    if node["inventory"]["emulated"] == false {
        eprintln!("note: this machine has NVML; the emulated default is not exercised");
    } else {
        assert_eq!(node["inventory"]["gpus"].as_array().unwrap().len(), 4);
    }
    // A second `up` on the same address fails with a message and status 1.
    let port = url.rsplit(':').next().unwrap();
    let out = Command::new(BIN)
        .args(["up", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
        .arg(dir.path().join("other"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("cannot listen"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The CLI finds the admin token through GPUFLOW_DATA, or says where it
    // looked; a server address needs its scheme; https to a plain HTTP
    // server is named as such. Usage errors exit 2, failed requests 1.
    let cli = |args: &[&str], env: &[(&str, &str)]| {
        let out = Command::new(BIN)
            .args(args)
            .env_remove("GPUFLOW_TOKEN")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    let (code, out, err) = cli(&["node", "ls", "--server", &url], &[("GPUFLOW_DATA", data)]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("READY") || out.contains("ready"), "{out}");
    let (code, _, err) = cli(
        &["node", "ls", "--server", &url],
        &[("GPUFLOW_DATA", "/nonexistent")],
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("/nonexistent/admin.token"), "{err}");
    let bare = url.trim_start_matches("http://");
    let (code, _, err) = cli(&["node", "ls", "--server", bare, "--token", &token], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("needs a scheme: http://{bare}")),
        "{err}"
    );
    let tls = url.replace("http://", "https://");
    let (code, _, err) = cli(&["node", "ls", "--server", &tls, "--token", &token], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("does not speak TLS: try http://"), "{err}");
    // SIGTERM stops it with status 0.
    let mut proc = proc;
    proc.signal("-TERM");
    let status = poll("up exits", Duration::from_secs(20), || {
        proc.0.try_wait().unwrap()
    });
    assert!(status.success(), "{status}");
    // Its log, written to a pipe: no colours, no token.
    let log = log.lock().unwrap().clone();
    assert!(log.contains("INFO"), "{log}");
    assert!(!log.contains('\x1b'), "ANSI colours in a log: {log}");
    assert!(!log.contains(&token), "the token in the log");
}
