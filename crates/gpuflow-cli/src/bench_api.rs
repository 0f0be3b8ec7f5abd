//! `gpuflow bench submit`: submissions per second and their latency through
//! the real HTTP API (loopback), with SQLite or a throwaway PostgreSQL. No
//! agent runs, so the backlog grows and every cycle explains all of it, as a
//! burst of submissions would meet in production.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};

/// An HTTP client that hands back every status (the benchmarks count them).
fn client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into()
}

pub(crate) fn submit(
    jobs: usize,
    clients: usize,
    store: &str,
    readers: usize,
    read_pause: Duration,
    array: usize,
    backlog: usize,
) -> anyhow::Result<()> {
    if jobs == 0 || clients == 0 || array == 0 {
        bail!("--jobs, --clients and --array must be above 0");
    }
    if array > 1 && !jobs.is_multiple_of(array * clients) {
        bail!(
            "--jobs must be a multiple of --array × --clients, so that each client sends whole arrays"
        );
    }
    let alone = run_submissions(jobs, clients, store, 0, read_pause, array, backlog)?;
    if readers > 0 {
        // The same submissions on a fresh server, while `readers` clients
        // poll `why` of a job the cycle does not reach (a diagnosis each)
        // and list jobs, as dashboards and impatient users do.
        let with = run_submissions(jobs, clients, store, readers, read_pause, array, backlog)?;
        println!(
            "with {readers} readers polling why and listing jobs: {:.0} submissions/s against {alone:.0} alone, ratio {:.2}",
            with,
            with / alone
        );
    }
    Ok(())
}

/// A throwaway PostgreSQL server for a benchmark: its URL, and the server
/// (stopped when dropped).
struct Throwaway {
    url: String,
    _server: Box<dyn std::any::Any>,
}

/// A throwaway PostgreSQL server for the benchmark (fsync on or off).
#[cfg(feature = "bench")]
fn throwaway_postgres(fsync: bool) -> anyhow::Result<Throwaway> {
    let pg = gpuflow_store::pgtest::TempPostgres::start_with(fsync)
        .map_err(|e| anyhow!(e))?
        .ok_or_else(|| anyhow!("PostgreSQL is not installed (apt-get install postgresql)"))?;
    Ok(Throwaway {
        url: pg.url.clone(),
        _server: Box::new(pg),
    })
}

/// This build has no throwaway PostgreSQL: it says how to get one.
#[cfg(not(feature = "bench"))]
fn throwaway_postgres(_: bool) -> anyhow::Result<Throwaway> {
    bail!(crate::sim::WITHOUT_BENCH)
}

/// Sends `jobs` submissions of `spec` (each of `array` jobs) from `clients`
/// threads at once: each request's latency.
fn send_all(
    url: &str,
    token: &str,
    spec: &str,
    jobs: usize,
    clients: usize,
    array: usize,
) -> anyhow::Result<Vec<Duration>> {
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (url, token, lat, spec) = (
                url.to_string(),
                token.to_string(),
                latencies.clone(),
                spec.to_string(),
            );
            let n = (jobs / clients + usize::from(c < jobs % clients)) / array;
            std::thread::spawn(move || -> anyhow::Result<()> {
                let http = client();
                let mut mine = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    let mut resp = http
                        .post(&url)
                        .header("Authorization", format!("Bearer {token}"))
                        .header("Content-Type", "application/yaml")
                        .send(spec.as_str())?;
                    if resp.status().as_u16() != 201 {
                        bail!("submission refused: HTTP {}", resp.status());
                    }
                    // The answer (the job's id) is read, as a client
                    // does: only then is the connection kept for the next.
                    resp.body_mut().read_to_vec()?;
                    mine.push(t.elapsed());
                }
                lat.lock().expect("not poisoned").extend(mine);
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join()
            .map_err(|_| anyhow!("a client thread panicked"))??;
    }
    let l = latencies.lock().expect("not poisoned").clone();
    Ok(l)
}

/// Submissions per second on a fresh in-process server, with `readers`
/// clients reading meanwhile, after `backlog` jobs were queued and a cycle
/// ran over them.
fn run_submissions(
    jobs: usize,
    clients: usize,
    store: &str,
    readers: usize,
    read_pause: Duration,
    array: usize,
    backlog: usize,
) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir().context("cannot make a temporary directory")?;
    let pg = match store {
        "sqlite" => None,
        "postgres" | "postgres-fsync" => Some(throwaway_postgres(store == "postgres-fsync")?),
        other => bail!("--store {other:?}: use sqlite, postgres or postgres-fsync"),
    };
    let mut cfg = gpuflow_server::Config::new("127.0.0.1:0".parse()?, dir.path().join("data"));
    cfg.store_url = pg.as_ref().map(|p| p.url.clone());
    // Throughput, not the per-token rate limit, is measured.
    cfg.rate_per_token = 0;
    let interval = cfg.cycle_interval;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let running = rt.block_on(gpuflow_server::start(cfg))?;
    let token = running
        .new_admin_token
        .clone()
        .context("a new installation has an admin token")?;
    let base = format!("http://{}/v1", running.addr);
    let url = format!("{base}/jobs");
    // With --array N, each submission is an array of N such jobs.
    let spec = format!(
        "name: bench\nqueue: default\nkind: batch\n{}tasks:\n  - name: main\n    replicas: 2\n    command: [python, train.py]\n    resources: {{cpu: 4, memory_mib: 16384, gpu: {{count: 1}}}}\n",
        if array > 1 {
            format!("array: 0-{}\n", array - 1)
        } else {
            String::new()
        }
    );
    let http = client;
    if backlog > 0 {
        // Queued first, untimed; every cycle from then on runs over at
        // least this many pending jobs (no node takes any). Two cycle
        // intervals let one run over the whole backlog before the clock
        // starts.
        eprintln!("queueing a backlog of {backlog} jobs first");
        send_all(&url, &token, &spec, backlog, clients, array)?;
        std::thread::sleep(2 * interval);
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let reader_threads: Vec<_> = (0..readers)
        .map(|r| {
            let (base, token, done, reads) =
                (base.clone(), token.clone(), done.clone(), reads.clone());
            std::thread::spawn(move || {
                let http = http();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let path = if r % 2 == 0 {
                        format!("{base}/jobs/20/why")
                    } else {
                        format!("{base}/jobs?limit=100")
                    };
                    let _ = http
                        .get(&path)
                        .header("Authorization", format!("Bearer {token}"))
                        .call()
                        .and_then(|mut r| r.body_mut().read_to_vec());
                    reads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::thread::sleep(read_pause);
                }
            })
        })
        .collect();
    eprintln!(
        "submitting {jobs} jobs from {clients} clients to {} ({store}){}",
        running.addr,
        if readers > 0 {
            format!(", {readers} readers")
        } else {
            String::new()
        }
    );
    let start = Instant::now();
    let mut l = send_all(&url, &token, &spec, jobs, clients, array)?;
    let wall = start.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in reader_threads {
        let _ = t.join();
    }
    l.sort();
    let pct = |p: f64| l[((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1];
    let rate = jobs as f64 / wall.as_secs_f64();
    let what = if array > 1 {
        format!("{jobs} jobs in arrays of {array}")
    } else {
        format!("{jobs} submissions")
    };
    let over = if backlog > 0 {
        format!(" over a backlog of {backlog}")
    } else {
        String::new()
    };
    println!(
        "store {store}: {what}{over}, {clients} clients, {readers} readers ({} reads): {rate:.0} jobs/s; latency (per request) p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        reads.load(std::sync::atomic::Ordering::Relaxed),
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        l.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    drop(running);
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(pg);
    Ok(rate)
}

/// An in-process server on a temporary SQLite store for the benchmarks,
/// reached through its router.
struct Bench {
    _dir: tempfile::TempDir,
    rt: tokio::runtime::Runtime,
    shared: std::sync::Arc<gpuflow_server::Shared>,
    admin: String,
    router: axum::Router,
}

impl Bench {
    fn open() -> anyhow::Result<Bench> {
        let dir = tempfile::tempdir().context("cannot make a temporary directory")?;
        let mut cfg = gpuflow_server::Config::new("127.0.0.1:0".parse()?, dir.path().join("data"));
        cfg.join_token = Some("bench".into());
        cfg.rate_per_token = 0;
        // Long timeouts: nodes registered once must not be lost while the
        // benchmark runs.
        cfg.node_timeout_s = 3600;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let opened = rt.block_on(gpuflow_server::open(cfg))?;
        let shared = opened.shared.clone();
        let admin = opened
            .new_admin_token
            .context("a new installation has an admin token")?;
        let router = gpuflow_server::http::router(shared.clone());
        Ok(Bench {
            _dir: dir,
            rt,
            shared,
            admin,
            router,
        })
    }

    fn call(&self, method: &str, path: &str, token: &str, body: String) -> (u16, String) {
        self.rt.block_on(tower_service_call::call(
            self.router.clone(),
            method,
            path,
            token,
            body,
        ))
    }

    /// Registers `nodes` nodes of 8 H100s (`node-00000`, …): their tokens.
    fn register(&self, nodes: usize) -> anyhow::Result<Vec<String>> {
        let mut tokens = Vec::with_capacity(nodes);
        for n in 0..nodes {
            let body = serde_json::to_string(&gpuflow_api::Register {
                node: format!("node-{n:05}"),
                inventory: h100_node(n),
                node_token: None,
            })?;
            let (s, v) = self.call("POST", "/v1/agent/register", "bench", body);
            if s != 200 {
                bail!("register failed: {s} {v}");
            }
            let r: gpuflow_api::Registered = serde_json::from_str(&v)?;
            tokens.push(r.node_token);
        }
        Ok(tokens)
    }
}

/// Node `n`'s inventory: 8 H100s, 128 CPUs, 1 TiB.
fn h100_node(n: usize) -> gpuflow_api::Inventory {
    gpuflow_api::Inventory {
        cpu_milli: 128_000,
        memory_mib: 1 << 20,
        gpus: (0..8)
            .map(|i| gpuflow_api::GpuInfo {
                index: i,
                uuid: format!("GPU-{n}-{i}"),
                model: "H100".into(),
                memory_mib: 81920,
                unhealthy: None,
                mig: vec![],
                numa: None,
                nvlink: vec![],
            })
            .collect(),
        emulated: true,
        address: String::new(),
        labels: Default::default(),
        pool: String::new(),
        limits: Default::default(),
    }
}

/// `gpuflow bench server-cycle`: nodes registered through the agent protocol,
/// jobs submitted through the API (in-process), then timed cycles.
pub(crate) fn server_cycle(nodes: usize, pending: usize, cycles: usize) -> anyhow::Result<()> {
    if nodes == 0 || pending == 0 || cycles == 0 {
        bail!("--nodes, --pending and --cycles must be above 0");
    }
    let bench = Bench::open()?;
    let (rt, shared, admin) = (&bench.rt, bench.shared.clone(), bench.admin.clone());
    let call =
        |method: &str, path: &str, token: &str, body: String| bench.call(method, path, token, body);
    eprintln!("registering {nodes} nodes (8 GPUs each) and submitting {pending} jobs…");
    bench.register(nodes)?;
    let spec = |i: usize| {
        let gpus = [1, 1, 2, 4, 8][i % 5];
        let kind = ["batch", "training", "inference", "batch"][i % 4];
        format!(
            "{{\"name\":\"j{i}\",\"queue\":\"default\",\"kind\":\"{kind}\",\"tasks\":[{{\"name\":\"main\",\"command\":[\"true\"],\"resources\":{{\"cpu\":1,\"gpu\":{{\"count\":{gpus}}}}}}}]}}"
        )
    };
    let submitting = Instant::now();
    for i in 0..pending {
        let (s, v) = call("POST", "/v1/jobs", &admin, spec(i));
        if s != 201 {
            bail!("submit failed: {s} {v}");
        }
    }
    let submitted = submitting.elapsed().as_secs_f64();
    let time = |label: &str| -> anyhow::Result<f64> {
        let t = Instant::now();
        rt.block_on(gpuflow_server::cycle::run_once(&shared))?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let counts = rt.block_on(async {
            let w = shared.world.lock().await;
            let mut by = std::collections::BTreeMap::<&str, usize>::new();
            for j in w.jobs().values() {
                *by.entry(j.state.as_str()).or_default() += 1;
            }
            format!("{by:?}")
        });
        println!("  {label}: {ms:.1} ms  {counts}");
        Ok(ms)
    };
    println!("server cycle, {nodes} nodes × 8 GPUs, {pending} jobs submitted (SQLite):");
    println!(
        "  submitting them one after another: {submitted:.1} s, {:.0} a second",
        pending as f64 / submitted
    );
    // Each phase's seconds so far: taking the snapshot and applying the
    // plan hold the state lock; computing it does not.
    let phases = || {
        rt.block_on(async {
            let w = shared.world.lock().await;
            let s = &w.stats;
            [s.cycle_take.sum, s.cycle_compute.sum, s.cycle_apply.sum]
        })
    };
    let before = phases();
    time("cold cycle")?;
    let after = phases();
    println!(
        "  its phases: take {:.1} ms, compute {:.1} ms, apply {:.1} ms",
        (after[0] - before[0]) * 1e3,
        (after[1] - before[1]) * 1e3,
        (after[2] - before[2]) * 1e3
    );
    let before = phases();
    let mut times = Vec::new();
    for c in 0..cycles {
        for k in 0..5 {
            call("POST", "/v1/jobs", &admin, spec(pending + c * 5 + k));
        }
        times.push(time("cycle after 5 submissions")?);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "  median cycle after a small change: {:.1} ms",
        times[times.len() / 2]
    );
    let after = phases();
    let mean = |i: usize| (after[i] - before[i]) * 1e3 / cycles as f64;
    println!(
        "  mean phases of those cycles: take {:.1} ms, compute {:.1} ms, apply {:.1} ms (take holds the state lock; apply too, but not while the store writes)",
        mean(0),
        mean(1),
        mean(2)
    );
    // A scrape: how long it takes, and the longest a request waits for
    // the state lock while it runs (a probe takes the lock every 0.2 ms).
    let mut scrapes = Vec::new();
    for _ in 0..5 {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = {
            let (shared, stop) = (shared.clone(), stop.clone());
            rt.spawn(async move {
                let mut worst = std::time::Duration::ZERO;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let t = Instant::now();
                    drop(shared.world.lock().await);
                    worst = worst.max(t.elapsed());
                    tokio::time::sleep(std::time::Duration::from_micros(200)).await;
                }
                worst
            })
        };
        let t = Instant::now();
        let (s, text) = call("GET", "/metrics", &admin, String::new());
        let ms = t.elapsed().as_secs_f64() * 1e3;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let waited = rt.block_on(probe)?.as_secs_f64() * 1e3;
        if s != 200 {
            bail!("/metrics failed: {s} {text}");
        }
        scrapes.push((ms, waited, text.len()));
    }
    scrapes.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (ms, waited, bytes) = scrapes[scrapes.len() / 2];
    println!(
        "  /metrics: {ms:.1} ms median, {bytes} bytes; the state lock waited for up to {waited:.1} ms meanwhile"
    );
    Ok(())
}

/// `gpuflow bench burst`: see `BenchCommand::Burst`.
pub(crate) fn burst(nodes: usize, jobs: usize, limit_s: u64) -> anyhow::Result<()> {
    use gpuflow_api::Desired;
    if nodes == 0 || jobs == 0 {
        bail!("--nodes and --jobs must be above 0");
    }
    let bench = Bench::open()?;
    let (rt, shared, admin) = (&bench.rt, bench.shared.clone(), bench.admin.clone());
    let call =
        |method: &str, path: &str, token: &str, body: String| bench.call(method, path, token, body);
    eprintln!("registering {nodes} nodes (8 GPUs each), queueing {jobs} jobs on a held queue…");
    let tokens = bench.register(nodes)?;
    let (s, v) = call(
        "PATCH",
        "/v1/queues/default",
        &admin,
        r#"{"state": "held"}"#.into(),
    );
    if s != 200 {
        bail!("cannot hold the queue: {s} {v}");
    }
    let mut asked_gpus = 0u64;
    for i in 0..jobs {
        let gpus = match i % 10 {
            0..=5 => 1,
            6 | 7 => 2,
            8 => 4,
            _ => 8,
        };
        asked_gpus += gpus;
        let spec = format!(
            "{{\"name\":\"b{i}\",\"queue\":\"default\",\"kind\":\"batch\",\"tasks\":[{{\"name\":\"main\",\"command\":[\"true\"],\"resources\":{{\"cpu\":1,\"memory_mib\":1024,\"gpu\":{{\"count\":{gpus}}}}}}}]}}"
        );
        let (s, v) = call("POST", "/v1/jobs", &admin, spec);
        if s != 201 {
            bail!("submit failed: {s} {v}");
        }
    }
    let total = (nodes * 8) as u64;
    let goal = asked_gpus.min(total);
    println!(
        "burst: {nodes} nodes × 8 GPUs ({total}), {jobs} jobs asking {asked_gpus} GPUs (SQLite, in-process, agents answering at once)"
    );
    // What each node's agent was last told to run: reported running.
    let mut desired: Vec<Vec<(u64, u32, u16, u32)>> = vec![Vec::new(); nodes];
    let held = |w: &gpuflow_server::state::World| -> (u64, u64) {
        let (mut alloc, mut run) = (0u64, 0u64);
        for j in w.jobs().values() {
            let g = gpuflow_server::convert::quota_milli(&j.spec) / 1000;
            if j.state.allocated() {
                alloc += g;
            }
            if j.state == gpuflow_api::JobState::Running {
                run += g;
            }
        }
        (alloc, run)
    };
    let start = Instant::now();
    let (s, v) = call(
        "PATCH",
        "/v1/queues/default",
        &admin,
        r#"{"state": "open"}"#.into(),
    );
    if s != 200 {
        bail!("cannot open the queue: {s} {v}");
    }
    let mut marks: [Option<f64>; 4] = [None; 4];
    let (mut cycles, mut rounds) = (0, 0);
    let mut cycle_ms: Vec<f64> = Vec::new();
    let mut beat_ms: Vec<f64> = Vec::new();
    loop {
        let t = Instant::now();
        rt.block_on(gpuflow_server::cycle::run_once(&shared))?;
        cycle_ms.push(t.elapsed().as_secs_f64() * 1e3);
        cycles += 1;
        let mark = |marks: &mut [Option<f64>; 4]| {
            let (alloc, run) = rt.block_on(async { held(&*shared.world.lock().await) });
            let now = start.elapsed().as_secs_f64();
            for (k, (have, part)) in [(alloc, 2), (alloc, 1), (run, 2), (run, 1)]
                .into_iter()
                .enumerate()
            {
                if marks[k].is_none() && have * part >= goal {
                    marks[k] = Some(now);
                }
            }
            now
        };
        mark(&mut marks);
        // Every node's heartbeat at once, as agents send them, each
        // reporting its tasks running as told.
        let t = Instant::now();
        let replies = rt.block_on(async {
            let mut sent = tokio::task::JoinSet::new();
            for (n, tasks) in desired.iter().enumerate() {
                let tasks: Vec<serde_json::Value> = tasks
                    .iter()
                    .map(|&(job, attempt, group, index)| {
                        serde_json::json!({"job": job, "attempt": attempt, "group": group, "index": index,
                            "phase": "running", "started_at": gpuflow_server::now()})
                    })
                    .collect();
                let body = serde_json::json!({"node": format!("node-{n:05}"), "inventory": h100_node(n), "tasks": tasks});
                let (router, token) = (bench.router.clone(), tokens[n].clone());
                sent.spawn(async move {
                    let reply = tower_service_call::call(
                        router,
                        "POST",
                        "/v1/agent/heartbeat",
                        &token,
                        body.to_string(),
                    )
                    .await;
                    (n, reply)
                });
            }
            sent.join_all().await
        });
        for (n, (s, v)) in replies {
            if s != 200 {
                bail!("heartbeat failed: {s} {v}");
            }
            let d: Desired = serde_json::from_str(&v)?;
            desired[n] = d
                .tasks
                .iter()
                .filter(|t| t.stop.is_none())
                .map(|t| (t.job, t.attempt, t.group, t.index))
                .collect();
        }
        beat_ms.push(t.elapsed().as_secs_f64() * 1e3);
        rounds += 1;
        let now = mark(&mut marks);
        if marks[3].is_some() || now > limit_s as f64 {
            break;
        }
    }
    let show = |m: Option<f64>| m.map_or("not reached".into(), |s| format!("{s:.2} s"));
    println!("  50 % of the GPUs asked for allocated: {}", show(marks[0]));
    println!("  100 % allocated:                      {}", show(marks[1]));
    println!("  50 % running:                         {}", show(marks[2]));
    println!("  100 % running:                        {}", show(marks[3]));
    let list = |v: &[f64]| {
        v.iter()
            .map(|ms| format!("{ms:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "  {cycles} cycles ({} ms), {rounds} heartbeat rounds of {nodes} nodes ({} ms), in turn",
        list(&cycle_ms),
        list(&beat_ms)
    );
    Ok(())
}

/// One in-process request to the router.
mod tower_service_call {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    pub(super) async fn call(
        router: axum::Router,
        method: &str,
        path: &str,
        token: &str,
        body: String,
    ) -> (u16, String) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("authorization", format!("Bearer {token}"))
            .header("content-type", "application/json")
            .body(Body::from(body))
            .expect("a valid request");
        let resp = router.oneshot(req).await.expect("the router answers");
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap_or_default();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// `gpuflow bench readers`: what readers cost the server. `jobs` finished
/// jobs are stored (arrays of 1,000, cancelled); then the server's memory
/// (its process's resident set, sampled every 100 ms; the benchmark's
/// client threads are in the same process and small) while 8 and 32
/// clients read the usage, jobs and advice reports for `seconds`, as a
/// viewer of another team and as an admin; then submissions per second
/// alone and with 16 readers of each kind (`why`, `ls` and `/metrics`;
/// reports by another team's viewer; callers without a token).
pub(crate) fn readers(jobs: usize, seconds: u64, submissions: usize) -> anyhow::Result<()> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    if jobs == 0 || seconds == 0 || submissions == 0 {
        bail!("--jobs, --seconds and --submissions must be above 0");
    }
    let dir = tempfile::tempdir().context("cannot make a temporary directory")?;
    let mut cfg = gpuflow_server::Config::new("127.0.0.1:0".parse()?, dir.path().join("data"));
    // Finished jobs leave memory at once: the reports read them from the store.
    cfg.keep_finished_s = 0;
    // The server's own cost is measured, not the per-token rate limit (the
    // limit for callers without a token stays on).
    cfg.rate_per_token = 0;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let running = rt.block_on(gpuflow_server::start(cfg))?;
    let admin = running
        .new_admin_token
        .clone()
        .context("a new installation has an admin token")?;
    let root = format!("http://{}", running.addr);
    let base = format!("{root}/v1");
    let http = client();
    let call = |method: &str, path: &str, token: Option<&str>, body: &str| -> (u16, String) {
        let url = format!("{base}{path}");
        let mut req = ureq::http::Request::builder().method(method).uri(url);
        if let Some(t) = token {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        let req = req
            .header("Content-Type", "application/yaml")
            .body(body.to_string())
            .expect("a valid request");
        match http.run(req) {
            Ok(mut r) => (
                r.status().as_u16(),
                r.body_mut().read_to_string().unwrap_or_default(),
            ),
            Err(e) => (0, e.to_string()),
        }
    };
    eprintln!("storing {jobs} finished jobs…");
    let t = Instant::now();
    let arrays = jobs.div_ceil(1000);
    for a in 0..arrays {
        let n = (jobs - a * 1000).min(1000);
        let spec = format!(
            "name: stored\nqueue: default\nkind: batch\narray: 0-{}\ntasks:\n  - name: main\n    command: [python, train.py]\n    resources: {{cpu: 1, memory_mib: 1024, gpu: {{count: 1}}}}\n",
            n - 1
        );
        let (s, v) = call("POST", "/jobs", Some(&admin), &spec);
        if s != 201 {
            bail!("array refused: {s} {v}");
        }
        let id = serde_json::from_str::<gpuflow_api::Submitted>(&v)
            .context("an array's id")?
            .id;
        let (s, v) = call("POST", &format!("/arrays/{id}/cancel"), Some(&admin), "");
        if s != 200 {
            bail!("cancel refused: {s} {v}");
        }
    }
    eprintln!("stored in {:.1} s", t.elapsed().as_secs_f64());
    // Another team with a viewer; a second admin token for the readers.
    for (path, body) in [
        ("/teams", r#"{"name": "other"}"#),
        (
            "/users",
            r#"{"name": "other-viewer", "team": "other", "role": "viewer"}"#,
        ),
    ] {
        let (s, v) = call("POST", path, Some(&admin), body);
        if s != 201 {
            bail!("{path}: {s} {v}");
        }
    }
    let token_for = |user: &str| -> anyhow::Result<String> {
        let (s, v) = call(
            "POST",
            "/tokens",
            Some(&admin),
            &format!(r#"{{"user": "{user}"}}"#),
        );
        if s != 201 {
            bail!("token: {s} {v}");
        }
        Ok(serde_json::from_str::<gpuflow_api::TokenCreated>(&v)
            .context("a token")?
            .token)
    };
    let viewer = token_for("other-viewer")?;
    let reader_admin = token_for("admin")?;
    // Let a cycle take the finished jobs out of memory.
    std::thread::sleep(Duration::from_secs(3));
    let rss_mib = || -> f64 {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("VmRSS:"))
                    .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
            })
            .map_or(0.0, |kb| kb / 1024.0)
    };
    // Readers of `paths` with `token` (none: without one) until `done`.
    let spawn_readers = |n: usize,
                         token: Option<String>,
                         paths: Vec<&'static str>,
                         done: Arc<AtomicBool>,
                         served: Arc<AtomicUsize>| {
        (0..n)
            .map(|r| {
                let (root, token, paths, done, served) = (
                    root.clone(),
                    token.clone(),
                    paths.clone(),
                    done.clone(),
                    served.clone(),
                );
                std::thread::spawn(move || {
                    let http = client();
                    let mut i = r;
                    while !done.load(Ordering::Relaxed) {
                        let mut req = http.get(format!("{root}{}", paths[i % paths.len()]));
                        if let Some(t) = &token {
                            req = req.header("Authorization", format!("Bearer {t}"));
                        }
                        if let Ok(mut resp) = req.call() {
                            let _ = resp.body_mut().read_to_vec();
                            if resp.status().as_u16() == 200 {
                                served.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        i += 1;
                    }
                })
            })
            .collect::<Vec<_>>()
    };
    const REPORTS: [&str; 3] = [
        "/v1/reports/usage",
        "/v1/reports/jobs",
        "/v1/reports/advice",
    ];
    println!("server memory with concurrent report readers, {jobs} stored jobs (SQLite):");
    let idle = rss_mib();
    println!("  idle: {idle:.0} MiB");
    // The viewers first: memory an admin's reports took is not all given
    // back to the system, and would count in the viewers' peak.
    for (who, token) in [
        ("another team's viewer", &viewer),
        ("an admin (every team)", &reader_admin),
    ] {
        for n in [8, 32] {
            let done = Arc::new(AtomicBool::new(false));
            let served = Arc::new(AtomicUsize::new(0));
            let threads = spawn_readers(
                n,
                Some(token.clone()),
                REPORTS.to_vec(),
                done.clone(),
                served.clone(),
            );
            let end = Instant::now() + Duration::from_secs(seconds);
            let mut peak = 0.0f64;
            while Instant::now() < end {
                peak = peak.max(rss_mib());
                std::thread::sleep(Duration::from_millis(100));
            }
            done.store(true, Ordering::Relaxed);
            for t in threads {
                let _ = t.join();
            }
            println!(
                "  {n} readers, {who}: peak {peak:.0} MiB (+{:.0} over idle), {} reports in {seconds} s",
                peak - idle,
                served.load(Ordering::Relaxed)
            );
        }
    }
    // Submissions per second, alone and with 16 readers of each kind.
    let submit = |label: &str, readers: Option<(Option<String>, Vec<&'static str>)>| {
        let done = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let threads = readers
            .map(|(token, paths)| spawn_readers(16, token, paths, done.clone(), served.clone()))
            .unwrap_or_default();
        let spec = "name: s\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    command: [python, train.py]\n    resources: {cpu: 1, memory_mib: 1024, gpu: {count: 1}}\n";
        let t = Instant::now();
        let clients: Vec<_> = (0..4)
            .map(|_| {
                let (base, admin) = (base.clone(), admin.clone());
                let n = submissions / 4;
                std::thread::spawn(move || {
                    let http = client();
                    let mut ok = 0usize;
                    for _ in 0..n {
                        if http
                            .post(format!("{base}/jobs"))
                            .header("Authorization", format!("Bearer {admin}"))
                            .header("Content-Type", "application/yaml")
                            .send(spec)
                            .is_ok_and(|mut r| {
                                // Read, so that the connection is kept.
                                r.status().as_u16() == 201 && r.body_mut().read_to_vec().is_ok()
                            })
                        {
                            ok += 1;
                        }
                    }
                    ok
                })
            })
            .collect();
        let ok: usize = clients.into_iter().map(|c| c.join().unwrap_or(0)).sum();
        let wall = t.elapsed().as_secs_f64();
        done.store(true, Ordering::Relaxed);
        for t in threads {
            let _ = t.join();
        }
        println!(
            "  {label}: {:.0} submissions/s ({ok} stored), {} reads answered 200",
            ok as f64 / wall,
            served.load(Ordering::Relaxed)
        );
    };
    println!("submissions per second (4 clients, {submissions} submissions each run):");
    submit("alone", None);
    submit(
        "16 readers of why, ls and /metrics",
        Some((
            Some(reader_admin.clone()),
            vec!["/v1/jobs/1/why", "/v1/jobs?limit=100", "/metrics"],
        )),
    );
    submit(
        "16 readers of reports (another team's viewer)",
        Some((Some(viewer.clone()), REPORTS.to_vec())),
    );
    submit(
        "16 callers without a token",
        Some((None, vec!["/v1/jobs", "/v1/reports/usage", "/v1/nodes"])),
    );
    drop(running);
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
