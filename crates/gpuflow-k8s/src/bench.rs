//! Binding throughput against the fake API server: pods bound per second
//! through the real client path (watch caches, the core's cycle, planned
//! annotations for gangs, the binding subresource), for comparison with
//! kube-scheduler's scheduling throughput.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::Error;
use crate::fake::FakeApi;
use crate::scheduler::{Scheduler, Settings};

/// What one run measured.
#[derive(Clone, Debug)]
pub struct BindBench {
    pub nodes: usize,
    pub pods: usize,
    pub gang: usize,
    pub bound: usize,
    pub cycles: usize,
    /// From the first cycle to the last binding.
    pub seconds: f64,
    /// The slowest cycle, binding included.
    pub longest_cycle_s: f64,
}

impl BindBench {
    pub fn per_second(&self) -> f64 {
        self.bound as f64 / self.seconds.max(1e-9)
    }
}

/// `nodes` nodes of 8 GPUs, 64 CPUs and 512 GiB in 10 racks, 10 team
/// queues sharing them, and `pods` pending pods spread over the teams: four
/// in five ask for one GPU, the fifth for CPU only; every pod fits. With
/// `gang` > 1, consecutive pods of a team form gangs of that many (each
/// annotated with its planned nodes before it is bound). Runs cycles until
/// all are bound or `limit` passes.
///
/// # Errors
/// When the fake server cannot start or a cycle fails.
pub async fn bind_throughput(
    nodes: usize,
    pods: usize,
    gang: usize,
    limit: Duration,
) -> Result<BindBench, Error> {
    let teams = 10;
    if !(gang <= 1 || pods.is_multiple_of(teams * gang)) {
        return Err(Error::Bench(format!(
            "with gangs of {gang}, the pods must be a multiple of {} (10 teams of whole gangs)",
            teams * gang
        )));
    }
    let api = FakeApi::default();
    let addr = api
        .serve()
        .await
        .map_err(|e| Error::Bench(format!("the fake API server: {e}")))?;
    for i in 0..nodes {
        api.apply(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": format!("node-{i:05}"), "labels": {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559",
                "gpuflow.io/rack": format!("rack-{}", i % 10)}},
            "spec": {},
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]}
        }));
    }
    let share = (nodes * 8) as f64 / teams as f64;
    for t in 0..teams {
        api.apply(json!({
            "apiVersion": "gpuflow.io/v1alpha1", "kind": "GpuQueue",
            "metadata": {"name": format!("team-{t}")},
            "spec": {"namespaces": [format!("team-{t}")], "quotas": {"*": {"guaranteed": share}}}
        }));
    }
    for p in 0..pods {
        let gpu = if p % 5 == 4 {
            json!({})
        } else {
            json!({"nvidia.com/gpu": "1"})
        };
        let (labels, annotations) = if gang > 1 {
            let g = p / teams / gang;
            (
                json!({"gpuflow.io/gang": format!("g{g}")}),
                json!({"gpuflow.io/gang-size": gang.to_string()}),
            )
        } else {
            (json!({}), json!({}))
        };
        api.apply(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("pod-{p:06}"), "namespace": format!("team-{}", p % teams),
                "labels": labels, "annotations": annotations},
            "spec": {"schedulerName": "gpuflow", "containers": [{"name": "main", "image": "busybox",
                "resources": {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": gpu}}]},
            "status": {"phase": "Pending"}
        }));
    }
    let url = format!("http://{addr}")
        .parse()
        .map_err(|e| Error::Bench(format!("the fake API server's address: {e}")))?;
    let cfg = kube::Config::new(url);
    let client = kube::Client::try_from(cfg)?;
    let settings = Settings {
        identity: "bench".into(),
        explain_every: Duration::from_secs(3600),
        ..Settings::default()
    };
    let mut s = Scheduler::new(client, settings);
    s.ready().await;
    if !s.try_lead().await? {
        return Err(Error::Bench(
            "the bench scheduler could not take the lease".into(),
        ));
    }
    let start = Instant::now();
    let mut bound = 0;
    let mut cycles = 0;
    let mut longest = 0.0f64;
    let mut last_bind = start;
    while bound < pods && start.elapsed() < limit {
        let t = Instant::now();
        let c = s.tick().await?;
        longest = longest.max(t.elapsed().as_secs_f64());
        cycles += 1;
        if c.bound > 0 {
            bound += c.bound;
            last_bind = Instant::now();
        } else {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    Ok(BindBench {
        nodes,
        pods,
        gang,
        bound,
        cycles,
        seconds: (last_bind - start).as_secs_f64(),
        longest_cycle_s: longest,
    })
}
