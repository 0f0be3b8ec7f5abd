//! Accounting through the real router: the jobs' ledger rolled up by the
//! usage report reconciles (per-job GPU-hours sum to the per-team,
//! per-project, per-cost-centre and per-model totals) across suspension,
//! a failure and its retry, a lost node and a server restart, on SQLite and
//! PostgreSQL; prices give cost; members see their own team only; and
//! `/metrics` parses as Prometheus text with names after STYLE.md.

use axum::body::Body;
use axum::http::Request;
use gpuflow_server::Config;
use gpuflow_store::pgtest::TempPostgres;
use serde_json::{Value, json};
use tower::ServiceExt;

struct Server {
    shared: std::sync::Arc<gpuflow_server::Shared>,
    router: axum::Router,
}

async fn open(cfg: &Config) -> (Server, Option<String>, Option<String>) {
    let o = gpuflow_server::open(cfg.clone()).await.unwrap();
    (
        Server {
            router: gpuflow_server::http::router(o.shared.clone()),
            shared: o.shared,
        },
        o.new_admin_token,
        o.join_token,
    )
}

impl Server {
    async fn call(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<Value>,
    ) -> (u16, Value, String) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(Body::from(body.map(|b| b.to_string()).unwrap_or_default()))
            .unwrap();
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
        )
    }

    async fn ok(&self, method: &str, path: &str, token: &str, body: Value) -> Value {
        let (s, v, _) = self.call(method, path, token, Some(body)).await;
        assert!(s < 300, "{method} {path}: {s} {v}");
        v
    }

    /// A user of `team` with `role`, and a token of theirs.
    async fn user_token(&self, admin: &str, name: &str, team: &str, role: &str) -> String {
        self.ok(
            "POST",
            "/v1/users",
            admin,
            json!({"name": name, "team": team, "role": role}),
        )
        .await;
        self.ok("POST", "/v1/tokens", admin, json!({"user": name}))
            .await["token"]
            .as_str()
            .unwrap()
            .to_string()
    }

    /// Registers node `n1` (4 H100s); its node token.
    async fn register(&self, join: &str) -> String {
        self.ok(
            "POST",
            "/v1/agent/register",
            join,
            json!({"node": "n1", "inventory": inventory()}),
        )
        .await["node_token"]
            .as_str()
            .unwrap()
            .to_string()
    }

    async fn cycle(&self) {
        gpuflow_server::cycle::run_once(&self.shared).await.unwrap();
    }

    /// The node's heartbeat with these task phases of the jobs placed on it.
    async fn beat(&self, node: &str, token: &str, tasks: &[(u64, &str)]) {
        let attempts: Vec<u32> = {
            let w = self.shared.world.lock().await;
            tasks
                .iter()
                .map(|(id, _)| w.jobs().get(id).map_or(0, |j| j.attempts))
                .collect()
        };
        let reports: Vec<Value> = tasks
            .iter()
            .zip(attempts)
            .map(|((id, phase), attempt)| {
                let (phase, code) = match *phase {
                    "failed" => ("exited", Some(1)),
                    "done" => ("exited", Some(0)),
                    p => (p, None),
                };
                json!({"job": id, "attempt": attempt, "group": 0, "index": 0, "phase": phase, "exit_code": code})
            })
            .collect();
        self.ok(
            "POST",
            "/v1/agent/heartbeat",
            token,
            json!({"node": node, "inventory": inventory(), "tasks": reports}),
        )
        .await;
    }

    async fn state(&self, id: u64, admin: &str) -> String {
        let (_, v, _) = self
            .call("GET", &format!("/v1/jobs/{id}"), admin, None)
            .await;
        v["state"].as_str().unwrap_or_default().to_string()
    }

    async fn report(&self, token: &str, by: &str) -> Vec<Value> {
        let v = self
            .ok(
                "GET",
                &format!("/v1/reports/usage?by={by}&from=1d"),
                token,
                Value::Null,
            )
            .await;
        v["rows"].as_array().unwrap().clone()
    }
}

fn inventory() -> Value {
    let gpus: Vec<Value> = (0..4)
        .map(|i| json!({"index": i, "uuid": format!("GPU-{i}"), "model": "H100", "memory_mib": 81920}))
        .collect();
    json!({"cpu_milli": 64000, "memory_mib": 262144, "gpus": gpus, "emulated": true})
}

fn sum(rows: &[Value], field: &str) -> f64 {
    rows.iter().map(|r| r[field].as_f64().unwrap()).sum()
}

async fn reconcile(store: Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    cfg.store_url = store;
    cfg.min_runtime_s = 0;
    let (s, admin, join) = open(&cfg).await;
    let (admin, join) = (admin.unwrap(), join.unwrap());
    // Two teams, a project with a cost centre, a member of alpha.
    for t in ["alpha", "beta"] {
        s.ok("POST", "/v1/teams", &admin, json!({"name": t})).await;
        s.ok(
            "POST",
            "/v1/queues",
            &admin,
            json!({"name": format!("{t}-q"), "team": t, "quotas": {"*": {"guaranteed": 2}}}),
        )
        .await;
    }
    s.ok(
        "POST",
        "/v1/projects",
        &admin,
        json!({"name": "vision", "team": "alpha", "cost_centre": "CC-42"}),
    )
    .await;
    let ana = s.user_token(&admin, "ana", "alpha", "member").await;
    s.ok(
        "PUT",
        "/v1/prices",
        &admin,
        json!({"currency": "EUR", "gpu_hour": {"H100": 3.0}}),
    )
    .await;
    let nt = s.register(&join).await;
    let submit = |queue: &str, project: Option<&str>, gpu: &str, retry: u32| {
        let mut spec = json!({"name": "j", "queue": queue, "retry": {"limit": retry, "backoff_s": 1},
            "tasks": [{"name": "main", "command": ["sleep", "1000"], "resources": {"gpu": serde_json::from_str::<Value>(gpu).unwrap()}}]});
        if let Some(p) = project {
            spec["project"] = json!(p);
        }
        spec
    };
    // a: alpha, project vision, one GPU: runs, is suspended, resumed, runs.
    let a = s
        .ok(
            "POST",
            "/v1/jobs",
            &admin,
            submit("alpha-q", Some("vision"), r#"{"count": 1}"#, 0),
        )
        .await["id"]
        .as_u64()
        .unwrap();
    // b: beta, half a GPU: fails once, is retried, runs.
    let b = s
        .ok(
            "POST",
            "/v1/jobs",
            &admin,
            submit(
                "beta-q",
                None,
                r#"{"mode": "fraction", "fraction": 0.5}"#,
                1,
            ),
        )
        .await["id"]
        .as_u64()
        .unwrap();
    // c: alpha, two GPUs: its node is lost, it runs again.
    let c = s
        .ok(
            "POST",
            "/v1/jobs",
            &admin,
            submit("alpha-q", None, r#"{"count": 2}"#, 0),
        )
        .await["id"]
        .as_u64()
        .unwrap();
    s.cycle().await;
    s.beat("n1", &nt, &[(a, "running"), (b, "running"), (c, "running")])
        .await;
    assert_eq!(s.state(a, &admin).await, "running");
    s.shared.cfg.clock.advance(3);
    // Suspension and a failure.
    s.ok("POST", &format!("/v1/jobs/{a}/suspend"), &admin, json!({}))
        .await;
    s.beat("n1", &nt, &[(a, "stopped"), (b, "failed"), (c, "running")])
        .await;
    assert_eq!(s.state(a, &admin).await, "suspended");
    s.ok("POST", &format!("/v1/jobs/{a}/resume"), &admin, json!({}))
        .await;
    s.shared.cfg.clock.advance(2);
    s.cycle().await;
    s.beat("n1", &nt, &[(a, "running"), (b, "running"), (c, "running")])
        .await;
    assert_eq!(s.state(b, &admin).await, "running", "b retried");
    // The node is lost (its lease), its work requeued, then it is back.
    {
        let mut w = s.shared.world.lock().await;
        let mut n = w.nodes()["n1"].clone();
        n.last_heartbeat -= 3600;
        w.put_node(n);
    }
    s.cycle().await;
    assert_eq!(s.state(c, &admin).await, "pending");
    s.beat("n1", &nt, &[]).await;
    s.cycle().await;
    s.beat("n1", &nt, &[(a, "running"), (b, "running"), (c, "running")])
        .await;
    s.shared.cfg.clock.advance(2);
    let before = s.report(&admin, "job").await;

    // A restart: the open holds go on counting.
    drop(s);
    let (s, _, _) = open(&cfg).await;
    s.shared.cfg.clock.advance(2);
    let by_job = s.report(&admin, "job").await;
    assert_eq!(by_job.len(), 3, "{by_job:?}");
    assert!(
        sum(&by_job, "gpu_hours") > sum(&before, "gpu_hours"),
        "running jobs keep counting after a restart: {before:?} then {by_job:?}"
    );
    let total = sum(&by_job, "gpu_hours");
    assert!(total > 0.0);
    // /metrics counts each team's GPU-hours from the same ledger, closed
    // holds counted as the restarted server loaded them.
    let (_, _, text) = s.call("GET", "/metrics", &admin, None).await;
    for row in s.report(&admin, "team").await {
        let team = row["key"].as_str().unwrap();
        let counted: f64 = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("gpuflow_team_gpu_hours_total{{team=\"{team}\"}}"))
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no GPU-hours for {team} in {text}"));
        let reported = row["gpu_hours"].as_f64().unwrap();
        assert!(
            (counted - reported).abs() <= 6.0 / 3600.0,
            "{team}: /metrics {counted}, report {reported}"
        );
    }
    for by in ["team", "project", "cost_centre", "model", "user", "queue"] {
        let rows = s.report(&admin, by).await;
        let t = sum(&rows, "gpu_hours");
        // The same instants: all reports read one clock second apart at most,
        // and the running jobs hold 3.5 GPUs.
        assert!(
            (t - total).abs() <= 3.5 * 2.0 / 3600.0 + 1e-9,
            "{by}: {t} against {total}"
        );
        if by == "cost_centre" {
            let cc = rows
                .iter()
                .find(|r| r["key"] == "CC-42")
                .expect("the project's cost centre");
            let job_a = by_job
                .iter()
                .find(|r| r["key"].as_str() == Some(&a.to_string()))
                .unwrap();
            assert!(
                (cc["gpu_hours"].as_f64().unwrap() - job_a["gpu_hours"].as_f64().unwrap()).abs()
                    <= 2.0 / 3600.0
            );
        }
        if by == "model" {
            let cost = rows[0]["cost"].as_f64().unwrap();
            assert!(
                (cost - 3.0 * rows[0]["gpu_hours"].as_f64().unwrap()).abs() < 1e-9,
                "{rows:?}"
            );
        }
    }
    // Each attempt is in the ledger: a suspended, resumed, lost with its
    // node (3 holds); b failed, retried, lost (3); c lost (2); only the
    // last of each is open.
    {
        let w = s.shared.world.lock().await;
        for (id, n) in [(a, 3), (b, 3), (c, 2)] {
            let held = &w.jobs()[&id].held;
            assert_eq!(held.len(), n, "job {id}: {held:?}");
            let open: Vec<bool> = held.iter().map(|h| h.to.is_none()).collect();
            assert_eq!(open.iter().filter(|o| **o).count(), 1, "{held:?}");
            assert!(open[n - 1], "{held:?}");
        }
        assert_eq!(w.jobs()[&b].held[0].gpu_milli, 500, "half a GPU");
        assert_eq!(w.jobs()[&c].held[0].gpu_milli, 2000);
    }
    // The jobs report: a, b, c submitted and started, b failed once (its
    // retry runs), nothing preempted.
    let rows = s
        .ok(
            "GET",
            "/v1/reports/jobs?by=queue&from=1d",
            &admin,
            Value::Null,
        )
        .await;
    let alpha = rows
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["key"] == "alpha-q")
        .unwrap()
        .clone();
    assert_eq!(
        (alpha["submitted"].as_u64(), alpha["started"].as_u64()),
        (Some(2), Some(2)),
        "{rows}"
    );
    assert!(alpha["wait_p95_s"].as_u64().is_some(), "{alpha}");
    let (st, v, _) = s
        .call("GET", "/v1/reports/jobs?by=color", &admin, None)
        .await;
    assert_eq!(st, 400, "{v}");
    // No GPU was sampled here: no advice is made up.
    let advice = s
        .ok("GET", "/v1/reports/advice?from=1d", &admin, Value::Null)
        .await;
    assert_eq!(advice, json!([]), "{advice}");
    // A member sees their own team only.
    let mine = s.report(&ana, "team").await;
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(mine[0]["key"], "alpha");
    let (st, _, _) = s
        .call(
            "PUT",
            "/v1/prices",
            &ana,
            Some(json!({"gpu_hour": {"*": 0}})),
        )
        .await;
    assert_eq!(st, 403);
    let (st, v, _) = s
        .call("GET", "/v1/reports/usage?by=color", &ana, None)
        .await;
    assert_eq!(st, 400, "{v}");
}

#[tokio::test]
async fn usage_reconciles_across_suspension_retry_a_lost_node_and_a_restart_sqlite() {
    reconcile(None).await;
}

#[tokio::test]
async fn usage_reconciles_across_suspension_retry_a_lost_node_and_a_restart_postgres() {
    match TempPostgres::start() {
        Ok(Some(pg)) => reconcile(Some(pg.url.clone())).await,
        Ok(None) => eprintln!("skipped: PostgreSQL is not installed (apt-get install postgresql)"),
        Err(e) => panic!("{e}"),
    }
}

/// A node that lies about its GPUs' model and UUID (quotes, backslashes,
/// new lines, a forged sample) cannot add or change a metric: every label
/// value is escaped, and the scrape still parses, with the node's text as
/// the label's value.
#[tokio::test]
async fn a_lying_node_cannot_forge_a_metric() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    let (s, admin, join) = open(&cfg).await;
    let (admin, join) = (admin.unwrap(), join.unwrap());
    let model = "H100\"} 1\ngpuflow_forged_total 1\n# TYPE x counter\\";
    let uuid = "GPU-\\\"\n";
    let inv = json!({"cpu_milli": 64000, "memory_mib": 262144, "emulated": true,
        "gpus": [{"index": 0, "uuid": uuid, "model": model, "memory_mib": 81920}]});
    let nt = s
        .ok(
            "POST",
            "/v1/agent/register",
            &join,
            json!({"node": "n1", "inventory": inv}),
        )
        .await["node_token"]
        .as_str()
        .unwrap()
        .to_string();
    let sample = json!([{"uuid": uuid, "util_pct": 5, "memory_util_pct": 1, "memory_used_mib": 1}]);
    s.ok(
        "POST",
        "/v1/agent/heartbeat",
        &nt,
        json!({"node": "n1", "inventory": inv, "gpus": sample, "tasks": []}),
    )
    .await;
    let (st, _, text) = s.call("GET", "/metrics", &admin, None).await;
    assert_eq!(st, 200);
    // The text format's escaping of a label value (prometheus-parse reads
    // no escaped quote, so it is checked here line by line).
    let esc = |v: &str| {
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    };
    for line in text.lines() {
        assert!(!line.starts_with("gpuflow_forged"), "{text}");
        assert!(
            line.starts_with('#')
                || line
                    .rsplit_once(' ')
                    .is_some_and(|(_, v)| v.parse::<f64>().is_ok()),
            "not a sample: {line:?}"
        );
    }
    // The sample of `series` (its name and labels, escaped), as a number.
    let value = |series: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    };
    let total = format!(
        "gpuflow_cluster_total_gpus{{model=\"{}\",pool=\"default\"}}",
        esc(model)
    );
    assert_eq!(value(&total), Some(1.0), "{total}\n{text}");
    let util = format!(
        "DCGM_FI_DEV_GPU_UTIL{{gpu=\"0\",UUID=\"{}\",device=\"nvidia0\",modelName=\"{}\",Hostname=\"n1\"}}",
        esc(uuid),
        esc(model)
    );
    assert_eq!(value(&util), Some(5.0), "{util}\n{text}");
}

/// `/metrics` through a real Prometheus text parser: admins only, every
/// name after STYLE.md (`gpuflow_<subsystem>_<name>_<unit>`) or
/// dcgm-exporter's, and the figures the state implies.
#[tokio::test]
async fn metrics_parse_as_prometheus_text_with_names_after_the_style() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    let (s, admin, join) = open(&cfg).await;
    let (admin, join) = (admin.unwrap(), join.unwrap());
    let nt = s.register(&join).await;
    let spec = json!({"name": "j", "queue": "default", "kind": "training",
        "tasks": [{"name": "main", "command": ["sleep", "1000"], "resources": {"gpu": {"count": 2}}}]});
    let id = s.ok("POST", "/v1/jobs", &admin, spec).await["id"]
        .as_u64()
        .unwrap();
    let half = json!({"name": "h", "queue": "default", "kind": "inference",
        "tasks": [{"name": "main", "command": ["sleep", "1000"], "resources": {"gpu": {"mode": "fraction", "fraction": 0.5}}}]});
    s.ok("POST", "/v1/jobs", &admin, half).await;
    s.cycle().await;
    // The first job has held its GPUs for an hour.
    backdate(&s, id, 3600).await;
    let sample = json!([{"uuid": "GPU-1", "util_pct": 77, "memory_util_pct": 30, "memory_used_mib": 4096, "power_w": 250.5, "temperature_c": 60}]);
    let attempt = s.shared.world.lock().await.jobs()[&id].attempts;
    s.ok("POST", "/v1/agent/heartbeat", &nt, json!({"node": "n1", "inventory": inventory(), "gpus": sample,
        "tasks": [{"job": id, "attempt": attempt, "group": 0, "index": 0, "phase": "running", "started_at": 1}]})).await;
    let (st, _, _) = s.call("GET", "/metrics", &join, None).await;
    assert_eq!(st, 401, "the join token is no API token");
    let (st, _, text) = s.call("GET", "/metrics", &admin, None).await;
    assert_eq!(st, 200);
    let lines = text.lines().map(|l| Ok(l.to_string()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("Prometheus text format");
    let name_ok = |n: &str| {
        n.starts_with("DCGM_FI_DEV_")
            || (n.starts_with("gpuflow_")
                && n.split('_').count() >= 4
                && [
                    "jobs",
                    "gpus",
                    "seconds",
                    "total",
                    "bytes",
                    "ratio",
                    "gpu_hours",
                    // Prometheus's suffix of a metric that carries labels.
                    "info",
                ]
                .iter()
                .any(|u| n.ends_with(u) || n.contains(&format!("_{u}_")))
                && n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
    };
    for smp in &scrape.samples {
        assert!(
            name_ok(&smp.metric),
            "metric name {:?} does not follow STYLE.md",
            smp.metric
        );
    }
    let value = |name: &str, label: (&str, &str)| -> Option<f64> {
        scrape.samples.iter().find_map(|smp| {
            let v = match smp.value {
                prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => f64::NAN,
            };
            (smp.metric == name && smp.labels.get(label.0) == Some(label.1)).then_some(v)
        })
    };
    assert_eq!(
        value("gpuflow_queue_used_gpus", ("queue", "default")),
        Some(2.5)
    );
    // Used and guaranteed per flavor, with the same labels; a guarantee of
    // "all" is the GPUs there are, not a sentinel (it was 1000000).
    assert_eq!(
        value("gpuflow_queue_used_gpus", ("flavor", "H100")),
        Some(2.5)
    );
    assert_eq!(
        value("gpuflow_queue_guaranteed_gpus", ("flavor", "H100")),
        Some(4.0),
        "{text}"
    );
    assert!(
        scrape
            .samples
            .iter()
            .filter(|smp| smp.metric == "gpuflow_queue_guaranteed_gpus")
            .all(|smp| matches!(smp.value, prometheus_parse::Value::Gauge(v) if v < 1e6)),
        "{text}"
    );
    assert_eq!(
        value("gpuflow_queue_admissions_total", ("queue", "default")),
        Some(2.0)
    );
    assert_eq!(
        value("gpuflow_node_state_info", ("state", "ready")),
        Some(1.0)
    );
    assert!(
        text.contains("gpuflow_server_build_info{version="),
        "{text}"
    );
    assert_eq!(
        value("gpuflow_cluster_total_gpus", ("model", "H100")),
        Some(4.0)
    );
    assert_eq!(
        value("gpuflow_cluster_allocated_gpus", ("model", "H100")),
        Some(3.0)
    );
    assert_eq!(
        value("gpuflow_queue_unfinished_jobs", ("state", "running")),
        Some(1.0)
    );
    // Half a GPU is held on a GPU no whole-GPU job can use now: 2.5 of 4
    // GPUs held, 0.5 GPU fragmented.
    assert_eq!(
        value("gpuflow_cluster_allocation_ratio", ("model", "H100")),
        Some(2.5 / 4.0)
    );
    assert_eq!(
        value("gpuflow_cluster_fragmented_gpus", ("model", "H100")),
        Some(0.5)
    );
    let team = s.shared.world.lock().await.jobs()[&id].team.clone();
    assert_eq!(
        value("gpuflow_team_allocated_gpus", ("team", &team)),
        Some(2.5)
    );
    let hours = value("gpuflow_team_gpu_hours_total", ("team", &team)).unwrap();
    assert!((2.0..2.01).contains(&hours), "{hours}");
    assert_eq!(value("DCGM_FI_DEV_GPU_UTIL", ("UUID", "GPU-1")), Some(77.0));
    assert_eq!(
        value("DCGM_FI_DEV_POWER_USAGE", ("Hostname", "n1")),
        Some(250.5)
    );
    // The cycle's phases, the commits and the admissions are counted.
    let count = |line: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {line} in {text}"))
    };
    for phase in ["take", "compute", "apply"] {
        assert!(
            count(&format!(
                "gpuflow_scheduler_cycle_phase_seconds_count{{phase=\"{phase}\"}}"
            )) >= 1.0
        );
    }
    assert!(count("gpuflow_store_commit_seconds_count{store=\"all\"}") >= 1.0);
    assert_eq!(count("gpuflow_scheduler_admissions_total"), 2.0);
    assert!(
        scrape
            .samples
            .iter()
            .any(|smp| smp.metric == "gpuflow_job_wait_seconds"),
        "the wait histogram: {text}"
    );
    // The shipped Grafana dashboard reads only metrics the server exports.
    let dash = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/gpuflow.json"),
    )
    .unwrap();
    let dash: Value = serde_json::from_str(&dash).expect("the dashboard is JSON");
    let exported: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    let mut used = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("gpuflow_") || word.starts_with("DCGM_") {
                    let family = word.strip_suffix("_bucket").unwrap_or(word);
                    assert!(
                        exported.contains(&family),
                        "the dashboard reads {word}, not exported"
                    );
                    used += 1;
                }
            }
        }
    }
    assert!(used >= 20, "{used}");
    // Its hold closes when it ends: the team's GPU-hours stay counted.
    s.ok(
        "POST",
        &format!("/v1/jobs/{id}/cancel"),
        &admin,
        Value::Null,
    )
    .await;
    s.ok(
        "POST",
        "/v1/agent/heartbeat",
        &nt,
        json!({"node": "n1", "inventory": inventory(), "tasks": []}),
    )
    .await;
    s.cycle().await;
    let held = s.shared.world.lock().await.jobs()[&id].held.clone();
    assert!(held[0].to.is_some(), "{held:?}");
    // The wait histogram counts since the server started: finished jobs
    // that leave memory stay counted (it counted the jobs in memory, so
    // its buckets went down and rate() broke).
    let waits = |text: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with("gpuflow_job_wait_seconds_count"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let (_, _, text) = s.call("GET", "/metrics", &admin, None).await;
    assert_eq!(waits(&text), 2.0, "{text}");
    s.shared.world.lock().await.prune_finished(u64::MAX, 0);
    let (_, _, text) = s.call("GET", "/metrics", &admin, None).await;
    assert_eq!(waits(&text), 2.0, "{text}");
    let (_, _, text) = s.call("GET", "/metrics", &admin, None).await;
    let after: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("gpuflow_team_gpu_hours_total{{team=\"{team}\"}}")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    assert!(after >= hours && after < 2.02, "{after} after {hours}");
}

async fn queue_view(s: &Server, token: &str) -> Value {
    let (_, v, _) = s.call("GET", "/v1/queues", token, None).await;
    v.as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == "alpha-q")
        .cloned()
        .unwrap()
}

/// A queue's GPU-hour budget through the API: admins set it (a lead may
/// not), everyone who sees the queue sees what is used and left; the
/// queue's weight tapers as it is used, then it stops borrowing when it is
/// spent (`why` says so), and it renews with the period.
#[tokio::test]
async fn a_budget_tapers_then_stops_borrowing_and_renews_with_its_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    cfg.min_runtime_s = 0;
    let (s, admin, join) = open(&cfg).await;
    let (admin, join) = (admin.unwrap(), join.unwrap());
    s.ok("POST", "/v1/teams", &admin, json!({"name": "alpha"}))
        .await;
    s.ok(
        "POST",
        "/v1/queues",
        &admin,
        json!({"name": "alpha-q", "team": "alpha", "quotas": {"*": {"guaranteed": 1}}}),
    )
    .await;
    let lea = s.user_token(&admin, "lea", "alpha", "team-lead").await;
    // 0.002 GPU-hours a day: 7.2 GPU-seconds.
    let budget = json!({"budget": {"gpu_hours": 0.002, "period": "day", "taper_from": 0.3, "min_weight_factor": 0.2}});
    let (st, v, _) = s
        .call("PATCH", "/v1/queues/alpha-q", &lea, Some(budget.clone()))
        .await;
    assert_eq!(st, 403, "{v}");
    s.ok("PATCH", "/v1/queues/alpha-q", &admin, budget).await;
    let nt = s.register(&join).await;
    let job = |gpus: u32| {
        json!({"name": "j", "queue": "alpha-q",
        "tasks": [{"name": "main", "command": ["sleep", "1000"], "resources": {"gpu": {"count": gpus}}}]})
    };
    // Three GPUs: one guaranteed, two borrowed.
    let big = s.ok("POST", "/v1/jobs", &admin, job(3)).await["id"]
        .as_u64()
        .unwrap();
    s.cycle().await;
    s.beat("n1", &nt, &[(big, "running")]).await;
    s.shared.cfg.clock.advance(2);
    let t = s.shared.now();
    gpuflow_server::accounting::refresh_budgets(&s.shared, t)
        .await
        .unwrap();
    let q = queue_view(&s, &lea).await;
    let used = &q["budget_use"];
    assert!(used["used"].as_f64().unwrap() > 0.0, "{q}");
    assert_eq!(used["unit"], "gpu-hours", "{q}");
    assert!(
        used["weight_factor"].as_f64().unwrap() < 1.0,
        "the weight tapers: {q}"
    );
    assert_eq!(used["exhausted"], false, "{q}");
    s.shared.cfg.clock.advance(3);
    gpuflow_server::accounting::refresh_budgets(&s.shared, s.shared.now())
        .await
        .unwrap();
    let q = queue_view(&s, &lea).await;
    assert_eq!(q["budget_use"]["exhausted"], true, "{q}");
    assert_eq!(q["budget_use"]["left"], 0.0, "{q}");
    assert!(
        (q["budget_use"]["weight_factor"].as_f64().unwrap() - 0.2).abs() < 1e-9,
        "{q}"
    );
    // Spent: another GPU would be borrowed, so it waits, and `why` says so.
    let more = s.ok("POST", "/v1/jobs", &admin, job(1)).await["id"]
        .as_u64()
        .unwrap();
    s.cycle().await;
    assert_eq!(s.state(more, &admin).await, "pending");
    let (_, why, _) = s
        .call("GET", &format!("/v1/jobs/{more}/why"), &admin, None)
        .await;
    assert!(why.to_string().contains("budget"), "{why}");
    // The big job ends: work within the guarantee still starts.
    s.ok("POST", &format!("/v1/jobs/{big}/cancel"), &admin, json!({}))
        .await;
    s.beat("n1", &nt, &[(big, "stopped")]).await;
    s.cycle().await;
    assert_eq!(
        s.state(more, &admin).await,
        "admitted",
        "within the guarantee"
    );
    // Two GPUs would borrow again: they wait while the budget is spent.
    let borrow = s.ok("POST", "/v1/jobs", &admin, job(2)).await["id"]
        .as_u64()
        .unwrap();
    s.ok(
        "POST",
        &format!("/v1/jobs/{more}/cancel"),
        &admin,
        json!({}),
    )
    .await;
    s.beat("n1", &nt, &[(more, "stopped")]).await;
    s.cycle().await;
    assert_eq!(s.state(borrow, &admin).await, "pending");
    // The next period: nothing held in it yet, the budget is whole again.
    gpuflow_server::accounting::refresh_budgets(&s.shared, s.shared.now() + 86_400)
        .await
        .unwrap();
    let used = s.shared.world.lock().await.budget_used["alpha-q"];
    assert_eq!(used.1, 0.0, "{used:?}");
    s.cycle().await;
    assert_eq!(
        s.state(borrow, &admin).await,
        "admitted",
        "the renewed budget lets it borrow"
    );
}

async fn why(s: &Server, id: u64, token: &str) -> String {
    let (_, v, _) = s
        .call("GET", &format!("/v1/jobs/{id}/why"), token, None)
        .await;
    v.to_string()
}

/// A project's budget, in GPU-hours, through the API: admins set it (a
/// lead may not; a taper, or two amounts, are refused), its team sees what
/// is left; once spent its jobs start no new work (`why` and test-only
/// submissions say so) while the queue's other jobs do; switched to stop
/// borrowing, its jobs start within the guarantee only. A queue's budget
/// in cost at the admins' prices stops the queue the same way.
#[tokio::test]
async fn project_budgets_stop_their_jobs_and_cost_budgets_count_at_the_prices() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    cfg.min_runtime_s = 0;
    let (s, admin, join) = open(&cfg).await;
    let (admin, join) = (admin.unwrap(), join.unwrap());
    for team in ["alpha", "beta"] {
        s.ok("POST", "/v1/teams", &admin, json!({"name": team}))
            .await;
    }
    s.ok(
        "POST",
        "/v1/queues",
        &admin,
        json!({"name": "alpha-q", "team": "alpha", "quotas": {"*": {"guaranteed": 2}}}),
    )
    .await;
    let lea = s.user_token(&admin, "lea", "alpha", "team-lead").await;
    let bo = s.user_token(&admin, "bo", "beta", "member").await;
    s.ok(
        "POST",
        "/v1/projects",
        &lea,
        json!({"name": "p1", "team": "alpha"}),
    )
    .await;
    let budget = |b: Value| json!({ "budget": b });
    // A job backdated two hours must fall inside the budget's current
    // period: a day, unless the day began less than two hours ago (then a
    // week or a month).
    let now = s.shared.now();
    let (_, per) = [
        (gpuflow_api::BudgetPeriod::Day, "day"),
        (gpuflow_api::BudgetPeriod::Week, "week"),
        (gpuflow_api::BudgetPeriod::Month, "month"),
    ]
    .into_iter()
    .find(|(p, _)| now - gpuflow_server::accounting::period_start(*p, now) >= 7300)
    .expect("within two hours of a day, a week and a month that began together");
    let one_gpu_hour = json!({"gpu_hours": 1.0, "period": per, "taper_from": 1.0, "when_exhausted": "stop-admitting"});
    let (st, v, _) = s
        .call(
            "PATCH",
            "/v1/projects/p1",
            &lea,
            Some(budget(one_gpu_hour.clone())),
        )
        .await;
    assert_eq!(st, 403, "{v}");
    let (st, v, _) = s
        .call(
            "PATCH",
            "/v1/projects/p1",
            &admin,
            Some(budget(json!({"gpu_hours": 1.0, "period": "day"}))),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("taper_from"), "{v}");
    let (st, v, _) = s
        .call(
            "PATCH",
            "/v1/projects/p1",
            &admin,
            Some(budget(
                json!({"gpu_hours": 1.0, "cost": 5.0, "period": "day", "taper_from": 1.0}),
            )),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v.to_string().contains("exactly one of gpu_hours and cost"),
        "{v}"
    );
    s.ok("PATCH", "/v1/projects/p1", &admin, budget(one_gpu_hour))
        .await;
    let nt = s.register(&join).await;
    let job = |project: Option<&str>, gpus: u32| {
        let mut j = json!({"name": "j", "queue": "alpha-q",
            "tasks": [{"name": "main", "command": ["sleep", "1000"], "resources": {"gpu": {"count": gpus}}}]});
        if let Some(p) = project {
            j["project"] = json!(p);
        }
        j
    };
    // The project's first job runs; it has held a GPU for two hours.
    let a = s.ok("POST", "/v1/jobs", &admin, job(Some("p1"), 1)).await["id"]
        .as_u64()
        .unwrap();
    s.cycle().await;
    s.beat("n1", &nt, &[(a, "running")]).await;
    backdate(&s, a, 7200).await;
    gpuflow_server::accounting::refresh_budgets(&s.shared, s.shared.now())
        .await
        .unwrap();
    // Its team sees the budget spent; another team does not see the project.
    let (_, ps, _) = s.call("GET", "/v1/projects", &lea, None).await;
    let p1 = &ps[0];
    assert_eq!(p1["budget_use"]["exhausted"], true, "{ps}");
    assert_eq!(p1["budget_use"]["left"], 0.0, "{ps}");
    assert!(p1["budget_use"]["used"].as_f64().unwrap() >= 2.0, "{ps}");
    let (_, ps, _) = s.call("GET", "/v1/projects", &bo, None).await;
    assert_eq!(ps, json!([]));
    // Spent, stop admitting: its next job waits and says why; a job of the
    // same queue outside the project starts.
    let b = s.ok("POST", "/v1/jobs", &admin, job(Some("p1"), 2)).await["id"]
        .as_u64()
        .unwrap();
    let c = s.ok("POST", "/v1/jobs", &admin, job(None, 1)).await["id"]
        .as_u64()
        .unwrap();
    s.cycle().await;
    assert_eq!(s.state(b, &admin).await, "pending");
    assert_eq!(s.state(c, &admin).await, "admitted");
    let w = why(&s, b, &admin).await;
    assert!(
        w.contains(&format!(
            "project p1's budget of 1 GPU-hours a {per} is used up"
        )) && w.contains("start no new work"),
        "{w}"
    );
    let (_, t, _) = s
        .call(
            "POST",
            "/v1/jobs?test_only=true",
            &admin,
            Some(job(Some("p1"), 1)),
        )
        .await;
    assert_eq!(t["would_start"], false, "{t}");
    assert!(t.to_string().contains("project p1's budget"), "{t}");
    // Stop borrowing instead: the project's jobs together are held to the
    // queue's guarantee (2 GPUs); a holds one, b asks for two and waits,
    // whoever else borrows; once a ends, b starts within it.
    s.ok(
        "PATCH",
        "/v1/projects/p1",
        &admin,
        budget(json!({"gpu_hours": 1.0, "period": per, "taper_from": 1.0, "when_exhausted": "stop-borrowing"})),
    )
    .await;
    s.beat("n1", &nt, &[(a, "running"), (c, "running")]).await;
    s.cycle().await;
    assert_eq!(s.state(b, &admin).await, "pending");
    let w = why(&s, b, &admin).await;
    assert!(w.contains("project budget spent"), "{w}");
    s.ok("POST", &format!("/v1/jobs/{a}/cancel"), &admin, json!({}))
        .await;
    s.beat("n1", &nt, &[(a, "stopped"), (c, "running")]).await;
    s.cycle().await;
    assert_eq!(s.state(b, &admin).await, "admitted", "within the guarantee");

    // A queue budget in cost: 3 EUR a GPU-hour, 5 EUR a period; a's two hours
    // cost 6: spent, the queue starts no new work.
    s.ok(
        "PUT",
        "/v1/prices",
        &admin,
        json!({"currency": "EUR", "gpu_hour": {"*": 3.0}}),
    )
    .await;
    s.ok(
        "PATCH",
        "/v1/queues/alpha-q",
        &admin,
        json!({"budget": {"cost": 5.0, "period": per, "when_exhausted": "stop-admitting"}}),
    )
    .await;
    gpuflow_server::accounting::refresh_budgets(&s.shared, s.shared.now())
        .await
        .unwrap();
    let q = queue_view(&s, &lea).await;
    assert_eq!(q["budget_use"]["unit"], "cost", "{q}");
    assert!(q["budget_use"]["used"].as_f64().unwrap() >= 6.0, "{q}");
    assert_eq!(q["budget_use"]["exhausted"], true, "{q}");
    let d = s.ok("POST", "/v1/jobs", &admin, job(None, 1)).await["id"]
        .as_u64()
        .unwrap();
    s.cycle().await;
    assert_eq!(s.state(d, &admin).await, "pending");
    let w = why(&s, d, &admin).await;
    assert!(w.contains("budget is used up"), "{w}");
}

/// A report of a Kubernetes cluster's workloads: `running` ones hold one
/// GPU since `since`, the others wait.
fn k8s_report(workloads: &[(&str, &str, Option<u64>)]) -> Value {
    let list: Vec<Value> = workloads
        .iter()
        .map(|(key, team, since)| {
            json!({
                "key": key, "name": key, "team": team, "user": "ann", "queue": "team-a",
                "kind": "training", "submitted_at": since.unwrap_or(1),
                "tasks": [{"replicas": 1, "resources": {"cpu": 1, "memory_mib": 1024, "gpu": {"count": 1}}}],
                "running": since.map(|s| json!({"since": s, "gpu_milli": 1000, "model": "H100"})),
                "reason": "gpuflow: needs 1 H100 GPU; position 1 in queue team-a",
            })
        })
        .collect();
    json!({ "workloads": list })
}

async fn kubernetes_workloads(store: Option<String>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config::new("127.0.0.1:0".parse().unwrap(), dir.path().join("data"));
    cfg.store_url = store;
    let (s, admin, _) = open(&cfg).await;
    let admin = admin.unwrap();
    s.ok("POST", "/v1/teams", &admin, json!({"name": "ml"}))
        .await;
    let ann = s.user_token(&admin, "ann", "ml", "member").await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let put = |body: Value| {
        let s = &s;
        let admin = admin.clone();
        async move {
            s.call("PUT", "/v1/clusters/kind-1/workloads", &admin, Some(body))
                .await
        }
    };
    let report = k8s_report(&[
        ("team-a/pod/train", "ml", Some(now - 10)),
        ("team-a/pod/wait", "ml", None),
        ("team-x/pod/stray", "nobody", None),
    ]);
    let (st, r, _) = put(report.clone()).await;
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["recorded"], 2);
    assert!(
        r["refused"]["team-x/pod/stray"]
            .as_str()
            .unwrap()
            .contains("does not exist"),
        "{r}"
    );
    // A scheduling cycle leaves them alone: they run elsewhere.
    s.cycle().await;
    let ids = |v: &Value| -> Vec<u64> {
        let mut ids: Vec<u64> = v
            .as_array()
            .unwrap()
            .iter()
            .filter(|j| !j["external"].is_null())
            .map(|j| j["id"].as_u64().unwrap())
            .collect();
        ids.sort_unstable();
        ids
    };
    let (_, jobs, _) = s.call("GET", "/v1/jobs", &ann, None).await;
    let before = ids(&jobs);
    assert_eq!(before.len(), 2, "{jobs}");
    let states: Vec<&str> = jobs
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["state"].as_str().unwrap())
        .collect();
    assert!(
        states.contains(&"running") && states.contains(&"pending"),
        "{states:?}"
    );
    let wait = jobs
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["name"] == "team-a/pod/wait")
        .unwrap()["id"]
        .as_u64()
        .unwrap();
    let (_, why, _) = s
        .call("GET", &format!("/v1/jobs/{wait}/why"), &ann, None)
        .await;
    assert!(
        why["summary"]
            .as_str()
            .unwrap()
            .contains("position 1 in queue team-a"),
        "{why}"
    );

    // After a restart the same report finds the same jobs.
    drop(s);
    let (s, _, _) = open(&cfg).await;
    let (st, r, _) = s
        .call("PUT", "/v1/clusters/kind-1/workloads", &admin, Some(report))
        .await;
    assert_eq!(st, 200, "{r}");
    let (_, jobs, _) = s.call("GET", "/v1/jobs", &ann, None).await;
    assert_eq!(ids(&jobs), before, "no workload recorded twice");
    let (_, _, metrics) = s.call("GET", "/metrics", &admin, None).await;
    assert!(
        metrics.contains("gpuflow_team_allocated_gpus{team=\"ml\"} 1"),
        "{metrics}"
    );
    let hours = |rows: &[Value]| -> f64 {
        rows.iter()
            .find(|r| r["key"] == "ml")
            .and_then(|r| r["gpu_hours"].as_f64())
            .unwrap_or(0.0)
    };
    let used = hours(&s.report(&ann, "team").await);
    assert!(used >= 10.0 / 3600.0, "{used}");

    // Both leave the cluster: finished, the hold closed and counted once.
    let (st, r, _) = s
        .call(
            "PUT",
            "/v1/clusters/kind-1/workloads",
            &admin,
            Some(json!({"workloads": []})),
        )
        .await;
    assert_eq!((st, r["finished"].as_u64()), (200, Some(2)), "{r}");
    let (_, j, _) = s.call("GET", &format!("/v1/jobs/{wait}"), &ann, None).await;
    assert_eq!(j["state"], "cancelled", "{j}");
    let closed = hours(&s.report(&ann, "team").await);
    s.shared.cfg.clock.advance(2);
    assert_eq!(hours(&s.report(&ann, "team").await), closed);

    // Misuse: a member reports, a bad cluster name, an unknown field.
    let (st, _, _) = s
        .call(
            "PUT",
            "/v1/clusters/kind-1/workloads",
            &ann,
            Some(json!({"workloads": []})),
        )
        .await;
    assert_eq!(st, 403);
    let (st, _, _) = s
        .call(
            "PUT",
            "/v1/clusters/Bad_Name/workloads",
            &admin,
            Some(json!({"workloads": []})),
        )
        .await;
    assert_eq!(st, 400);
    let (st, v, _) = s
        .call(
            "PUT",
            "/v1/clusters/kind-1/workloads",
            &admin,
            Some(json!({"workloads": [], "extra": 1})),
        )
        .await;
    assert_eq!(st, 400, "{v}");
}

#[tokio::test]
async fn kubernetes_workloads_are_accounted_kept_across_a_restart_and_closed_sqlite() {
    kubernetes_workloads(None).await;
}

#[tokio::test]
async fn kubernetes_workloads_are_accounted_kept_across_a_restart_and_closed_postgres() {
    match TempPostgres::start() {
        Ok(Some(pg)) => kubernetes_workloads(Some(pg.url.clone())).await,
        Ok(None) => eprintln!("skipped: PostgreSQL is not installed (apt-get install postgresql)"),
        Err(e) => panic!("{e}"),
    }
}

/// Moves the start of job `id`'s first hold `secs` earlier, in memory.
async fn backdate(s: &Server, id: u64, secs: u64) {
    let mut w = s.shared.world.lock().await;
    let mut j = w.jobs()[&id].clone();
    j.held[0].from -= secs;
    w.put_job(j);
}
