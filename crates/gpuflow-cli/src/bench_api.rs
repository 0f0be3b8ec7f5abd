//! `gpuflow bench submit`: submissions per second and their latency through
//! the real HTTP API (loopback), with SQLite or a throwaway PostgreSQL. No
//! agent runs, so the backlog grows and every cycle explains all of it, as a
//! burst of submissions would meet in production.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};

pub fn submit(jobs: usize, clients: usize, store: &str) -> anyhow::Result<()> {
    if jobs == 0 || clients == 0 {
        bail!("--jobs and --clients must be above 0");
    }
    let dir = tempfile::tempdir().context("cannot make a temporary directory")?;
    let pg = match store {
        "sqlite" => None,
        "postgres" => Some(
            gpuflow_store::pgtest::TempPostgres::start()
                .map_err(|e| anyhow!(e))?
                .ok_or_else(|| anyhow!("PostgreSQL is not installed (apt-get install postgresql)"))?,
        ),
        other => bail!("--store {other:?}: use sqlite or postgres"),
    };
    let mut cfg = gpuflow_server::Config::new("127.0.0.1:0".parse()?, dir.path().join("data"));
    cfg.store_url = pg.as_ref().map(|p| p.url.clone());
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let running = rt.block_on(gpuflow_server::start(cfg))?;
    let token = running.new_admin_token.clone().context("a new installation has an admin token")?;
    let url = format!("http://{}/v1/jobs", running.addr);
    let spec = "name: bench\nqueue: default\nkind: batch\ntasks:\n  - name: main\n    replicas: 2\n    command: [python, train.py]\n    resources: {cpu: 4, memory_mib: 16384, gpu: {count: 1}}\n";
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    eprintln!("submitting {jobs} jobs from {clients} clients to {} ({store})", running.addr);
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (url, token, lat) = (url.clone(), token.clone(), latencies.clone());
            let n = jobs / clients + usize::from(c < jobs % clients);
            std::thread::spawn(move || -> anyhow::Result<()> {
                let http: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
                let mut mine = Vec::with_capacity(n);
                for _ in 0..n {
                    let t = Instant::now();
                    let resp = http
                        .post(&url)
                        .header("Authorization", format!("Bearer {token}"))
                        .header("Content-Type", "application/yaml")
                        .send(spec)?;
                    if resp.status().as_u16() != 201 {
                        bail!("submission refused: HTTP {}", resp.status());
                    }
                    mine.push(t.elapsed());
                }
                lat.lock().expect("not poisoned").extend(mine);
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().map_err(|_| anyhow!("a client thread panicked"))??;
    }
    let wall = start.elapsed();
    let mut l = latencies.lock().expect("not poisoned").clone();
    l.sort();
    let pct = |p: f64| l[((l.len() as f64 * p).ceil() as usize).clamp(1, l.len()) - 1];
    println!(
        "store {store}: {jobs} submissions, {clients} clients: {:.0} submissions/s; latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        jobs as f64 / wall.as_secs_f64(),
        pct(0.50).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        l.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    drop(running);
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(pg);
    Ok(())
}
