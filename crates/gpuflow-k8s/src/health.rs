//! What a running scheduler reports about itself: readiness (every watch
//! cache has listed), liveness, and Prometheus metrics (cycles, bindings,
//! preemptions, explanations, and per queue its pods, GPUs, budget and
//! fair-share usage). `gpuflow k8s run --listen` serves [`router`]; the
//! Deployment probes `/readyz` and `/healthz`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::crd::GpuQueueStatus;

/// Shared between the scheduler and its HTTP endpoints.
#[derive(Default)]
pub struct Health {
    /// Per watch cache: whether it has listed.
    synced: Mutex<BTreeMap<&'static str, bool>>,
    pub leading: AtomicBool,
    pub cycles: AtomicU64,
    pub bound: AtomicU64,
    pub preempted: AtomicU64,
    pub explained: AtomicU64,
    /// Cycles that failed (an API error) or panicked; the next one runs.
    pub failures: AtomicU64,
    /// The last cycle's duration, in microseconds.
    pub last_cycle_us: AtomicU64,
    queues: Mutex<BTreeMap<String, GpuQueueStatus>>,
    fair_share: Mutex<BTreeMap<String, f64>>,
}

impl Health {
    /// A cache the scheduler waits for.
    pub fn watching(&self, cache: &'static str) {
        self.synced
            .lock()
            .expect("health")
            .entry(cache)
            .or_insert(false);
    }

    pub fn synced(&self, cache: &'static str) {
        self.synced.lock().expect("health").insert(cache, true);
    }

    /// Ready once every cache has listed; else the ones that have not.
    ///
    /// # Errors
    /// Names the caches still waiting.
    pub fn ready(&self) -> Result<(), String> {
        let waiting: Vec<&str> = self
            .synced
            .lock()
            .expect("health")
            .iter()
            .filter(|(_, done)| !**done)
            .map(|(c, _)| *c)
            .collect();
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "waiting for the watch caches of {} to list (is the RBAC of `gpuflow k8s manifests` applied?)",
                waiting.join(", ")
            ))
        }
    }

    /// The queues as the last cycle left them.
    pub fn set_queues(
        &self,
        queues: BTreeMap<String, GpuQueueStatus>,
        fair_share: BTreeMap<String, f64>,
    ) {
        *self.queues.lock().expect("health") = queues;
        *self.fair_share.lock().expect("health") = fair_share;
    }

    /// The metrics in Prometheus' text format (0.0.4), written by
    /// prometheus-client from a registry filled with what they are now.
    pub fn prometheus(&self) -> String {
        let mut r = Registry::default();
        let whole = |r: &mut Registry, name: &str, help: &str, v: i64| {
            let g: Gauge = Gauge::default();
            g.set(v);
            r.register(name, help, g);
        };
        // prometheus-client adds a counter's `_total`.
        let count = |r: &mut Registry, name: &str, help: &str, a: &AtomicU64| {
            let c: Counter = Counter::default();
            c.inc_by(a.load(Ordering::Relaxed));
            r.register(name, help, c);
        };
        whole(
            &mut r,
            "gpuflow_k8s_ready",
            "Whether every watch cache has listed.",
            i64::from(self.ready().is_ok()),
        );
        whole(
            &mut r,
            "gpuflow_k8s_leader",
            "Whether this replica holds the lease.",
            i64::from(self.leading.load(Ordering::Relaxed)),
        );
        count(
            &mut r,
            "gpuflow_k8s_cycles",
            "Scheduling cycles run.",
            &self.cycles,
        );
        count(
            &mut r,
            "gpuflow_k8s_bound_pods",
            "Pods bound to nodes.",
            &self.bound,
        );
        count(
            &mut r,
            "gpuflow_k8s_preempted_gangs",
            "Gangs preempted.",
            &self.preempted,
        );
        count(
            &mut r,
            "gpuflow_k8s_explanations",
            "PodScheduled conditions written on waiting pods.",
            &self.explained,
        );
        count(
            &mut r,
            "gpuflow_k8s_cycle_failures",
            "Cycles that failed or panicked (each is logged; the next one runs).",
            &self.failures,
        );
        let seconds: Gauge<f64, AtomicU64> = Gauge::default();
        seconds.set(self.last_cycle_us.load(Ordering::Relaxed) as f64 / 1e6);
        r.register(
            "gpuflow_k8s_cycle_seconds",
            "The last cycle's duration, writes included.",
            seconds,
        );
        let queues = self.queues.lock().expect("health").clone();
        let per_queue = |r: &mut Registry,
                         name: &str,
                         help: &str,
                         f: &dyn Fn(&GpuQueueStatus) -> Option<f64>| {
            let family = Family::<Labels, Gauge<f64, AtomicU64>>::default();
            for (queue, s) in &queues {
                if let Some(v) = f(s) {
                    family.get_or_create(&vec![("queue", queue.clone())]).set(v);
                }
            }
            r.register(name, help, family);
        };
        per_queue(
            &mut r,
            "gpuflow_k8s_queue_running_pods",
            "Pods of the queue bound to nodes.",
            &|s| Some(f64::from(s.running_pods)),
        );
        per_queue(
            &mut r,
            "gpuflow_k8s_queue_pending_pods",
            "Pods waiting in the queue.",
            &|s| Some(f64::from(s.pending_pods)),
        );
        per_queue(
            &mut r,
            "gpuflow_k8s_queue_budget_used_gpu_hours",
            "GPU-hours used of the queue's budget in its period.",
            &|s| s.budget_used_gpu_hours,
        );
        let gpus = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        for (queue, s) in &queues {
            for (model, v) in &s.gpus_in_use {
                gpus.get_or_create(&vec![("queue", queue.clone()), ("model", model.clone())])
                    .set(*v);
            }
        }
        r.register(
            "gpuflow_k8s_queue_gpus_in_use",
            "GPUs the queue holds, per model.",
            gpus,
        );
        let fair = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        for (queue, h) in self.fair_share.lock().expect("health").iter() {
            fair.get_or_create(&vec![("queue", queue.clone())]).set(*h);
        }
        r.register(
            "gpuflow_k8s_queue_fair_share_gpu_hours",
            "The queue's decayed GPU-hours, which fair share compares.",
            fair,
        );
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &r);
        out
    }
}

/// A family's labels.
type Labels = Vec<(&'static str, String)>;

/// `/healthz` (the process answers), `/readyz` (every cache has listed)
/// and `/metrics`.
pub fn router(health: std::sync::Arc<Health>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(h): State<std::sync::Arc<Health>>| async move {
                match h.ready() {
                    Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(h): State<std::sync::Arc<Health>>| async move {
                (
                    [("content-type", prometheus_text::CONTENT_TYPE)],
                    h.prometheus(),
                )
                    .into_response()
            }),
        )
        .with_state(health)
}
