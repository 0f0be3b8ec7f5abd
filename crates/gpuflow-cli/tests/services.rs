//! Inference services on `gpuflow up` with emulated GPUs, each replica a
//! real HTTP server (Python's) on the port its agent picked: readiness gates
//! the endpoint list, a replica killed is replaced alone while the other
//! keeps serving, scaling stays within the service's bounds, and a rolling
//! replacement never leaves fewer ready replicas than asked for.
//! Skipped, with the reason printed, without python3.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(90);

/// A replica: answers 503 for `READY_AFTER` seconds, then 200 with its
/// `VERSION`.
const SERVER: &str = r#"
import http.server, os, time
start = time.time()
delay = float(os.environ.get("READY_AFTER", "0"))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = time.time() - start >= delay
        self.send_response(200 if ok else 503)
        self.end_headers()
        self.wfile.write(os.environ.get("VERSION", "v1").encode())
    def log_message(self, *a):
        pass
print("pid", os.getpid(), flush=True)
http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
"#;

fn task(version: &str) -> Value {
    json!({"name": "main", "command": ["python3", "-c", SERVER],
        "env": {"READY_AFTER": "2", "VERSION": version},
        "resources": {"cpu": 0.1, "memory_mib": 128, "gpu": {"count": 1}}})
}

fn fetch(endpoint: &str) -> Option<String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    agent
        .get(&format!("http://{endpoint}/"))
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()
}

#[test]
fn a_service_serves_replaces_scales_and_rolls_out_within_its_bounds() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: python3 is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "4xemu-gpu", &[]);
    // Its queue guarantees 3 GPUs and lends nothing more.
    let (s, v) = api.post_json(
        "/v1/queues",
        &admin,
        &json!({"name": "serve", "team": "default", "quotas": {"emu-gpu": {"guaranteed": 3, "borrow_limit": 0}}}),
    );
    assert_eq!(s, 201, "{v}");
    let spec = json!({"name": "web", "queue": "serve", "replicas": 2, "max_replicas": 4,
        "task": task("v1"), "readiness": {"http_path": "/", "period_s": 1},
        "rollout": {"max_surge": 1, "max_unavailable": 0}});
    let (s, v) = api.post_json("/v1/services", &admin, &spec);
    assert_eq!(s, 201, "{v}");
    let get = || api.get("/v1/services/web", &admin);
    let ready_ids = |v: &Value| -> Vec<u64> {
        v["members"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["ready"] == true)
            .map(|m| m["job"].as_u64().unwrap())
            .collect()
    };

    // Readiness gates the endpoints: a running replica that answers 503 is
    // not listed; once both answer, both are, and they serve.
    let mut saw_running_unready = false;
    let v = poll("two replicas ready", LONG, || {
        let v = get();
        let members = v["members"].as_array().unwrap();
        let ready = ready_ids(&v).len();
        assert_eq!(v["endpoints"].as_array().unwrap().len(), ready, "{v}");
        saw_running_unready |= members
            .iter()
            .any(|m| m["state"] == "running" && m["ready"] == false);
        (ready == 2).then_some(v)
    });
    assert!(
        saw_running_unready,
        "readiness never gated a running replica"
    );
    for e in v["endpoints"].as_array().unwrap() {
        assert_eq!(fetch(e.as_str().unwrap()).as_deref(), Some("v1"), "{e}");
    }

    // A replica killed is replaced alone: the other keeps its job and runs on.
    let ids = ready_ids(&v);
    let (victim, other) = (ids[0], ids[1]);
    let pid: i32 = poll("the victim prints its pid", LONG, || {
        let l = api.get(&format!("/v1/jobs/{victim}/logs"), &admin);
        l["tasks"]["main/0"]
            .as_str()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    });
    // SAFETY: kill has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let v = poll("a new replica replaces the killed one", LONG, || {
        let v = get();
        let ready = ready_ids(&v);
        (ready.len() == 2 && !ready.contains(&victim)).then_some(v)
    });
    assert!(ready_ids(&v).contains(&other), "{v}");
    let o = api.job(other, &admin);
    assert_eq!(
        (o["state"].as_str(), o["attempts"].as_u64()),
        (Some("running"), Some(1)),
        "{o}"
    );
    assert_eq!(api.job(victim, &admin)["state"], "failed");

    // Scaling within the bounds; beyond them, refused with the bounds.
    let cli = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .args(["--server", &api.url, "--token", &admin])
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = cli(&["service", "scale", "web", "5"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("max_replicas (4)"), "{err}");
    // Four within the bounds, but the quota holds three: the fourth waits,
    // and says why.
    let (code, _, err) = cli(&["service", "scale", "web", "4"]);
    assert_eq!(code, Some(0), "{err}");
    let waiting = poll("three ready, one waiting on the quota", LONG, || {
        let v = get();
        let pending: Vec<u64> = v["members"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["state"] == "pending")
            .map(|m| m["job"].as_u64().unwrap())
            .collect();
        (ready_ids(&v).len() == 3 && pending.len() == 1).then(|| pending[0])
    });
    let why = api.get(&format!("/v1/jobs/{waiting}/why"), &admin);
    assert!(why.to_string().contains("guarantee"), "{why}");
    assert_eq!(get()["endpoints"].as_array().unwrap().len(), 3);
    let (code, _, err) = cli(&["service", "scale", "web", "2"]);
    assert_eq!(code, Some(0), "{err}");
    poll("back to two", LONG, || {
        let v = get();
        (v["members"].as_array().unwrap().len() == 2 && ready_ids(&v).len() == 2).then_some(())
    });

    // A rolling replacement: never fewer than 2 ready, never more than 3
    // replicas, until every replica runs version 2 and serves "v2".
    let (s, v) = api.call(
        "PATCH",
        "/v1/services/web",
        &admin,
        Some((
            "application/json",
            json!({"task": task("v2")}).to_string().as_bytes(),
        )),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["version"], 2);
    let end = Instant::now() + LONG;
    let v = loop {
        let v = get();
        let members = v["members"].as_array().unwrap();
        let ready = ready_ids(&v).len();
        assert!(ready >= 2, "fell below the bound during the rollout: {v}");
        let alive = members.iter().filter(|m| m["state"] != "stopping").count();
        assert!(alive <= 3, "more than replicas + max_surge: {v}");
        if members.len() == 2 && members.iter().all(|m| m["version"] == 2) && ready == 2 {
            break v;
        }
        assert!(Instant::now() < end, "the rollout did not finish: {v}");
        std::thread::sleep(Duration::from_millis(150));
    };
    for e in v["endpoints"].as_array().unwrap() {
        assert_eq!(fetch(e.as_str().unwrap()).as_deref(), Some("v2"), "{e}");
    }
    // Deleted: its replicas stop.
    let (code, _, err) = cli(&["service", "delete", "web"]);
    assert_eq!(code, Some(0), "{err}");
    for m in v["members"].as_array().unwrap() {
        let id = m["job"].as_u64().unwrap();
        poll("the replica ends", LONG, || {
            api.job(id, &admin)["state"]
                .as_str()
                .filter(|s| *s == "cancelled")
                .map(|_| ())
        });
    }
}

/// A readiness command runs beside its replica as the replica does (same
/// user, directory and environment, not the agent's root): the replica is
/// listed once the command succeeds. A command that hangs is killed at its
/// timeout and keeps its replica unready, without holding up the agent.
#[test]
fn a_readiness_command_runs_as_its_replica_and_a_hanging_one_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let (_up, api, admin) = up(&dir.path().join("data"), free_port(), "2xemu-gpu", &[]);
    let replica = |script: &str| {
        json!({"name": "main", "command": ["sh", "-c", script],
            "resources": {"cpu": 0.1, "memory_mib": 64, "gpu": {"count": 1}}})
    };
    let probe = "id -u > probe-uid; test -f ready";
    let spec = json!({"name": "cmd", "queue": "default", "replicas": 1,
        "task": replica("echo task $(id -u); sleep 3; touch ready; sleep 3; echo probe $(cat probe-uid); sleep 600"),
        "readiness": {"command": ["sh", "-c", probe], "period_s": 1}});
    let (s, v) = api.post_json("/v1/services", &admin, &spec);
    assert_eq!(s, 201, "{v}");
    let spec = json!({"name": "hang", "queue": "default", "replicas": 1,
        "task": replica("sleep 600"),
        "readiness": {"command": ["sleep", "100"], "period_s": 1, "timeout_s": 1}});
    let (s, v) = api.post_json("/v1/services", &admin, &spec);
    assert_eq!(s, 201, "{v}");
    let (s, v) = api.post_json(
        "/v1/services",
        &admin,
        &json!({"name": "bad", "queue": "default", "replicas": 1, "task": replica("true"),
            "readiness": {"command": [], "http_path": "/"}}),
    );
    assert_eq!(s, 400, "{v}");
    assert!(
        v["message"].as_str().unwrap().contains("give one check"),
        "{v}"
    );

    let mut saw_unready = false;
    let v = poll("the command's replica becomes ready", LONG, || {
        let v = api.get("/v1/services/cmd", &admin);
        let m = &v["members"][0];
        saw_unready |= m["state"] == "running" && m["ready"] == false;
        (v["endpoints"].as_array()?.len() == 1).then_some(v)
    });
    assert!(saw_unready, "listed before its command succeeded: {v}");
    let job = v["members"][0]["job"].as_u64().unwrap();
    let out = poll("the replica reports who its probe ran as", LONG, || {
        let l = api.get(&format!("/v1/jobs/{job}/logs"), &admin);
        let out = l["tasks"]["main/0"].as_str()?.to_string();
        out.contains("probe ").then_some(out)
    });
    let uid = |what: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(what))
            .map(|u| u.trim().to_string())
    };
    assert_eq!(uid("task "), uid("probe "), "{out}");
    assert!(uid("probe ").is_some_and(|u| !u.is_empty()), "{out}");

    // The hanging one: running, never ready, nothing listed.
    let h = api.get("/v1/services/hang", &admin);
    let m = &h["members"][0];
    assert_eq!(
        (m["state"].as_str(), m["ready"].as_bool()),
        (Some("running"), Some(false)),
        "{h}"
    );
    assert_eq!(h["endpoints"].as_array().unwrap().len(), 0, "{h}");
}

/// Draining a node moves a service's replica to another node (a new one
/// first, the old one stopped once the new one is ready), so the drain
/// finishes: it said "drained" at once and never finished while a replica
/// ran there. `node ls` says "draining (N jobs left)", then "drained".
#[test]
fn draining_a_node_moves_its_service_replica_and_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dir.path(), free_port(), &[]);
    let api = Api::new(&srv.url);
    let admin = admin_token(dir.path());
    let _n1 = agent(dir.path(), &srv.url, "n1", "1");
    poll("n1 registers", LONG, || {
        (api.get("/v1/nodes", &admin).as_array()?.len() == 1).then_some(())
    });
    let spec = json!({"name": "web", "queue": "default", "replicas": 1,
        "task": {"name": "main", "command": ["sleep", "600"],
            "resources": {"cpu": 0.1, "memory_mib": 64, "gpu": {"count": 1}}},
        "readiness": {"command": ["true"], "period_s": 1},
        "rollout": {"max_surge": 1, "max_unavailable": 0}});
    let (s, v) = api.post_json("/v1/services", &admin, &spec);
    assert_eq!(s, 201, "{v}");
    let ready_on = |node: &str| {
        let v = api.get("/v1/services/web", &admin);
        v["members"].as_array()?.iter().find_map(|m| {
            let id = m["job"].as_u64()?;
            let j = api.job(id, &admin);
            (m["ready"] == true && j["tasks"][0]["node"] == node).then_some(id)
        })
    };
    let first = poll("a ready replica on n1", LONG, || ready_on("n1"));
    let _n2 = agent(dir.path(), &srv.url, "n2", "1");
    poll("n2 registers", LONG, || {
        (api.get("/v1/nodes", &admin).as_array()?.len() == 2).then_some(())
    });
    let cli = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .args(["--server", &srv.url, "--token", &admin])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let out = cli(&["node", "drain", "n1"]);
    assert!(out.contains("draining (1 jobs left)"), "{out}");
    let second = poll("a ready replica on n2", LONG, || ready_on("n2"));
    assert_ne!(first, second);
    let j = api.wait_state(first, &admin, "cancelled", LONG);
    assert!(
        j["reason"]
            .as_str()
            .unwrap()
            .contains("moved off a draining node")
            || api
                .get(&format!("/v1/events?job={first}"), &admin)
                .to_string()
                .contains("moved off a draining node"),
        "{j}"
    );
    let ls = poll("n1 drained", LONG, || {
        let ls = cli(&["node", "ls"]);
        ls.lines()
            .any(|l| l.starts_with("n1 ") && l.contains("drained"))
            .then_some(ls)
    });
    assert!(
        ls.lines()
            .any(|l| l.starts_with("n2 ") && l.contains("ready")),
        "{ls}"
    );
}
