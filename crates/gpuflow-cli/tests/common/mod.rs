//! Helpers for end-to-end tests: the real `gpuflow` binary as server and
//! agent on loopback ports, an HTTP client, and polling with a deadline.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_gpuflow");
pub(crate) const JOIN: &str = "gfj_test_join_token";

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process stopped when dropped: SIGTERM (an agent then stops its
/// tasks), SIGKILL after five seconds.
pub(crate) struct Proc(pub Child);

impl Proc {
    pub(crate) fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.0.id().to_string()])
            .stderr(Stdio::null())
            .status();
    }

    /// SIGKILL now, as a crash.
    pub(crate) fn crash(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal("-CONT");
        self.signal("-TERM");
        let end = Instant::now() + Duration::from_secs(5);
        while Instant::now() < end {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether a process exists (and is not a zombie).
pub(crate) fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
        .unwrap_or(false)
}

pub(crate) struct Server {
    pub proc: Proc,
    pub url: String,
    pub port: u16,
    pub dir: PathBuf,
}

/// Starts `gpuflow server` on `port` with fast timers; waits until it answers.
pub(crate) fn server(dir: &Path, port: u16, extra: &[&str]) -> Server {
    server_nofile(dir, port, extra, None)
}

/// [`server`] started with this soft limit of open files (as systemd's
/// default of 1,024), where given.
pub(crate) fn server_nofile(dir: &Path, port: u16, extra: &[&str], nofile: Option<u64>) -> Server {
    let s = server_spawn(dir, port, extra, nofile);
    let url = s.url.clone();
    poll("the server answers", Duration::from_secs(30), || {
        ureq::get(format!("{url}/v1/openapi.json"))
            .call()
            .ok()
            .map(|_| ())
    });
    s
}

/// [`server_nofile`] without waiting for it to answer (a standby does not
/// until it leads).
pub(crate) fn server_spawn(dir: &Path, port: u16, extra: &[&str], nofile: Option<u64>) -> Server {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("server.log"))
        .unwrap();
    let mut child = Command::new(BIN);
    child
        .args([
            "server",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--data-dir",
        ])
        .arg(dir.join("data"));
    // Fast timers, unless `extra` sets them otherwise.
    for pair in [
        ["--min-runtime", "0"],
        ["--cycle-ms", "200"],
        ["--heartbeat", "1"],
        ["--node-timeout", "6"],
    ] {
        if !extra.contains(&pair[0]) {
            child.args(pair);
        }
    }
    child
        .args(extra)
        .env("RUST_LOG", "info")
        .env("GPUFLOW_JOIN_TOKEN", JOIN)
        .stdout(Stdio::null())
        .stderr(log);
    if let Some(n) = nofile {
        use std::os::unix::process::CommandExt;
        // SAFETY: getrlimit/setrlimit only, between fork and exec.
        unsafe {
            child.pre_exec(move || {
                let mut l = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
                l.rlim_cur = n.min(l.rlim_max);
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
                Ok(())
            });
        }
    }
    let child = child.spawn().unwrap();
    Server {
        proc: Proc(child),
        url: format!("http://127.0.0.1:{port}"),
        port,
        dir: dir.to_path_buf(),
    }
}

/// Checks that no GPU is held twice among `jobs` (a `/v1/jobs` listing):
/// whole GPUs by one task, shares within one GPU (finished jobs, which
/// show their tasks as they ended, hold none).
pub(crate) fn check_no_double_allocation(jobs: &Value) {
    use std::collections::{BTreeMap, BTreeSet};
    let mut whole: BTreeSet<(String, u64)> = BTreeSet::new();
    let mut shared: BTreeMap<(String, u64), u64> = BTreeMap::new();
    for j in jobs.as_array().unwrap().iter().filter(|j| {
        !["succeeded", "failed", "cancelled"].contains(&j["state"].as_str().unwrap_or(""))
    }) {
        for t in j["tasks"].as_array().unwrap() {
            let node = t["node"].as_str().unwrap().to_string();
            for g in t["gpus"].as_array().unwrap() {
                let key = (node.clone(), g.as_u64().unwrap());
                match t.get("milli").and_then(Value::as_u64) {
                    Some(m) => *shared.entry(key).or_default() += m,
                    None => assert!(whole.insert(key.clone()), "GPU {key:?} allocated twice"),
                }
            }
        }
    }
    for (k, m) in &shared {
        assert!(!whole.contains(k), "GPU {k:?} both whole and shared");
        assert!(*m <= 1000, "GPU {k:?} shared beyond its capacity: {m}");
    }
}

pub(crate) fn admin_token(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("data/admin.token"))
        .unwrap()
        .trim()
        .to_string()
}

/// Starts `gpuflow agent` with emulated GPUs.
pub(crate) fn agent(dir: &Path, url: &str, node: &str, gpus: &str) -> Proc {
    agent_env(dir, url, node, gpus, &[])
}

/// [`agent`] with more environment variables.
pub(crate) fn agent_env(
    dir: &Path,
    url: &str,
    node: &str,
    gpus: &str,
    env: &[(&str, &str)],
) -> Proc {
    agent_with(dir, url, node, gpus, env, &[])
}

/// [`agent`] with more environment variables and arguments.
pub(crate) fn agent_with(
    dir: &Path,
    url: &str,
    node: &str,
    gpus: &str,
    env: &[(&str, &str)],
    args: &[&str],
) -> Proc {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("agent-{node}.log")))
        .unwrap();
    Proc(
        Command::new(BIN)
            .args([
                "agent",
                "--server",
                url,
                "--node",
                node,
                "--emulate",
                gpus,
                "--work-dir",
            ])
            .arg(dir.join(format!("work-{node}")))
            .args(args)
            .env("RUST_LOG", "info")
            .env("GPUFLOW_JOIN_TOKEN", JOIN)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    )
}

/// Starts `gpuflow up` on `data` with `--emulate gpus` and fast timers;
/// waits until its API answers and its node has joined. Returns the process,
/// a client and the admin token.
pub(crate) fn up(data: &Path, port: u16, gpus: &str, env: &[(&str, &str)]) -> (Proc, Api, String) {
    up_with(data, port, &["--emulate", gpus], env)
}

/// [`up`] with other agent arguments than `--emulate` (e.g. `--nvml-lib`).
pub(crate) fn up_with(
    data: &Path,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Proc, Api, String) {
    let proc = Proc(
        Command::new(BIN)
            .args(["up", "--listen", &format!("127.0.0.1:{port}"), "--data-dir"])
            .arg(data)
            .args([
                "--heartbeat",
                "1",
                "--cycle-ms",
                "200",
                "--node-timeout",
                "6",
            ])
            .args(["--min-runtime", "0"])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let api = Api::new(&format!("http://127.0.0.1:{port}"));
    let admin = poll("gpuflow up answers", Duration::from_secs(60), || {
        let t = std::fs::read_to_string(data.join("admin.token")).ok()?;
        let t = t.trim().to_string();
        (api.call("GET", "/v1/nodes", &t, None).1.as_array()?.len() == 1).then_some(t)
    });
    (proc, api, admin)
}

/// Calls `f` until it returns `Some`, failing the test after `limit`.
pub(crate) fn poll<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let end = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub(crate) struct Api {
    pub url: String,
    http: ureq::Agent,
}

impl Api {
    pub(crate) fn new(url: &str) -> Api {
        Api {
            url: url.to_string(),
            http: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(20)))
                .build()
                .into(),
        }
    }

    /// `(status, body)`; an unreachable server is status 0.
    pub(crate) fn call(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<(&str, &[u8])>,
    ) -> (u16, Value) {
        self.call_with(method, path, token, body, None)
    }

    pub(crate) fn call_with(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<(&str, &[u8])>,
        key: Option<&str>,
    ) -> (u16, Value) {
        let url = format!("{}{path}", self.url);
        let auth = format!("Bearer {token}");
        let r = match method {
            "GET" => self.http.get(&url).header("Authorization", &auth).call(),
            "DELETE" => self.http.delete(&url).header("Authorization", &auth).call(),
            m => {
                let mut req = match m {
                    "PATCH" => self.http.patch(&url),
                    "PUT" => self.http.put(&url),
                    _ => self.http.post(&url),
                }
                .header("Authorization", &auth);
                if let Some(k) = key {
                    req = req.header("Idempotency-Key", k);
                }
                match body {
                    Some((ct, b)) => req.header("Content-Type", ct).send(b),
                    None => req.send_empty(),
                }
            }
        };
        match r {
            Ok(mut resp) => {
                let status = resp.status().as_u16();
                let text = resp.body_mut().read_to_string().unwrap_or_default();
                (
                    status,
                    serde_json::from_str(&text).unwrap_or(Value::String(text)),
                )
            }
            Err(_) => (0, Value::Null),
        }
    }

    pub(crate) fn get(&self, path: &str, token: &str) -> Value {
        let (s, v) = self.call("GET", path, token, None);
        assert_eq!(s, 200, "GET {path}: {v}");
        v
    }

    pub(crate) fn post_json(&self, path: &str, token: &str, body: &Value) -> (u16, Value) {
        self.call(
            "POST",
            path,
            token,
            Some(("application/json", body.to_string().as_bytes())),
        )
    }

    pub(crate) fn submit_yaml(&self, token: &str, yaml: &str) -> (u16, Value) {
        self.call(
            "POST",
            "/v1/jobs",
            token,
            Some(("application/yaml", yaml.as_bytes())),
        )
    }

    /// The first node's limits, once its agent has registered (a minute at
    /// most).
    pub(crate) fn node_limits(&self, token: &str) -> Value {
        poll("the agent registers", Duration::from_secs(60), || {
            let nodes = self.get("/v1/nodes", token);
            nodes
                .as_array()?
                .first()
                .map(|n| n["inventory"]["limits"].clone())
        })
    }

    pub(crate) fn job(&self, id: u64, token: &str) -> Value {
        self.get(&format!("/v1/jobs/{id}"), token)
    }

    /// Polls until the job is in `state`.
    pub(crate) fn wait_state(&self, id: u64, token: &str, state: &str, limit: Duration) -> Value {
        poll(&format!("job {id} to be {state}"), limit, || {
            let j = self.job(id, token);
            (j["state"] == state).then_some(j)
        })
    }

    /// Creates a team with a member and returns the member's token.
    /// Teams alpha and beta, each with a queue guaranteed one GPU and no
    /// `run_as` (each team's tasks run under a uid of its own); returns the
    /// member tokens of mallory (alpha) and victor (beta).
    pub(crate) fn alpha_and_beta(&self, admin: &str) -> (String, String) {
        for team in ["alpha", "beta"] {
            let (s, v) = self.post_json("/v1/teams", admin, &serde_json::json!({"name": team}));
            assert_eq!(s, 201, "{v}");
            let (s, v) = self.post_json(
                "/v1/queues",
                admin,
                &serde_json::json!({"name": format!("{team}-q"), "team": team, "quotas": {"*": {"guaranteed": 1}}}),
            );
            assert_eq!(s, 201, "{v}");
        }
        (
            self.user_token(admin, "alpha", "mallory", "member"),
            self.user_token(admin, "beta", "victor", "member"),
        )
    }

    pub(crate) fn team_with_member(
        &self,
        admin: &str,
        team: &str,
        user: &str,
        role: &str,
    ) -> String {
        let (s, v) = self.post_json("/v1/teams", admin, &serde_json::json!({"name": team}));
        assert!(s == 201 || s == 409, "{v}");
        self.user_token(admin, team, user, role)
    }

    pub(crate) fn user_token(&self, admin: &str, team: &str, user: &str, role: &str) -> String {
        let (s, v) = self.post_json(
            "/v1/users",
            admin,
            &serde_json::json!({"name": user, "team": team, "role": role}),
        );
        assert_eq!(s, 201, "{v}");
        let (s, v) = self.post_json("/v1/tokens", admin, &serde_json::json!({"user": user}));
        assert_eq!(s, 201, "{v}");
        v["token"].as_str().unwrap().to_string()
    }
}

/// A job spec in YAML.
pub(crate) fn job_yaml(
    name: &str,
    queue: &str,
    kind: &str,
    gpus: u32,
    script: &str,
    grace: u64,
) -> String {
    format!(
        "name: {name}\nqueue: {queue}\nkind: {kind}\ncheckpoint: {{grace_s: {grace}}}\ntasks:\n  - name: main\n    command: [sh, -c, {script:?}]\n    resources: {{cpu: 0.1, memory_mib: 64, gpu: {{count: {gpus}}}}}\n"
    )
}

/// One of the jobs the crash tests submit: `job-{i}`, a short task on a
/// quarter, one or two GPUs.
pub(crate) fn crash_spec(i: usize) -> String {
    let gpu = match i % 3 {
        0 => "{mode: fraction, fraction: 0.25}",
        1 => "{count: 1}",
        _ => "{count: 2}",
    };
    format!(
        "name: job-{i}\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    command: [sh, -c, 'sleep 0.{}']\n    resources: {{cpu: 0.01, memory_mib: 16, gpu: {gpu}}}\n",
        i % 5
    )
}

/// A long training job that must run through a crash untouched, on node
/// `n1` of an agent working in `dir`: its id and its process's pid once it
/// runs.
pub(crate) fn survivor(api: &Api, admin: &str, dir: &Path) -> (u64, u32) {
    let (_, v) = api.submit_yaml(
        admin,
        &job_yaml(
            "survivor",
            "default",
            "training",
            1,
            "echo $$ > pid; sleep 600",
            1,
        ),
    );
    let id = v["id"].as_u64().unwrap();
    api.wait_state(id, admin, "running", Duration::from_secs(60));
    let pid_file = dir.join(format!("work-n1/job-{id}/a1-g0-i0/pid"));
    let pid = poll(
        "the survivor writes its pid",
        Duration::from_secs(30),
        || std::fs::read_to_string(&pid_file).ok()?.trim().parse().ok(),
    );
    (id, pid)
}

/// Checks that every job of `all` (a `/v1/jobs` listing) is stored once by
/// name, and every acknowledged `(i, id)` is there as `job-{i}` under `id`.
pub(crate) fn check_acknowledged_once(all: &Value, acked: &[(usize, u64)]) {
    let mut by_name: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
    for j in all.as_array().unwrap() {
        by_name
            .entry(j["name"].as_str().unwrap().to_string())
            .or_default()
            .push(j["id"].as_u64().unwrap());
    }
    for (name, ids) in &by_name {
        assert_eq!(ids.len(), 1, "{name} stored {} times", ids.len());
    }
    for (i, id) in acked {
        assert_eq!(
            by_name.get(&format!("job-{i}")),
            Some(&vec![*id]),
            "acknowledged job-{i} (id {id}) lost"
        );
    }
}

/// Submits jobs `range` until each is acknowledged, always with its key, to
/// whichever of `urls` leads (a standby answers 503), as `gpuflow job
/// submit` does: a retry of a stored submission must not store a second
/// job. Paced, so that a crash lands in the middle of the stream. Returns
/// how many sends were not acknowledged.
pub(crate) fn submitter(
    urls: Vec<String>,
    admin: String,
    range: std::ops::Range<usize>,
    acked: std::sync::Arc<std::sync::Mutex<Vec<(usize, u64)>>>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let apis: Vec<Api> = urls.iter().map(|u| Api::new(u)).collect();
        let mut at = 0;
        let mut refused = 0;
        for i in range {
            let key = format!("key-{i}");
            loop {
                let (s, v) = apis[at].call_with(
                    "POST",
                    "/v1/jobs",
                    &admin,
                    Some(("application/yaml", crash_spec(i).as_bytes())),
                    Some(&key),
                );
                std::thread::sleep(Duration::from_millis(5));
                if s == 201 || s == 200 {
                    acked.lock().unwrap().push((i, v["id"].as_u64().unwrap()));
                    break;
                }
                refused += 1;
                if s == 0 || s >= 500 {
                    at = (at + 1) % apis.len();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        refused
    })
}
