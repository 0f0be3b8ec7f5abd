//! What a running scheduler reports about itself: readiness (every watch
//! cache has listed), liveness, and Prometheus metrics (cycles, bindings,
//! preemptions, explanations, and per queue its pods, GPUs, budget and
//! fair-share usage). `gpuflow k8s run --listen` serves [`router`]; the
//! Deployment probes `/readyz` and `/healthz`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;

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

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
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

    /// The metrics in Prometheus' text format.
    pub fn prometheus(&self) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        metric(
            "gpuflow_k8s_ready",
            "gauge",
            "Whether every watch cache has listed.",
            one(f64::from(u8::from(self.ready().is_ok()))),
        );
        metric(
            "gpuflow_k8s_leader",
            "gauge",
            "Whether this replica holds the lease.",
            one(f64::from(u8::from(self.leading.load(Ordering::Relaxed)))),
        );
        metric(
            "gpuflow_k8s_cycles_total",
            "counter",
            "Scheduling cycles run.",
            one(load(&self.cycles)),
        );
        metric(
            "gpuflow_k8s_bound_pods_total",
            "counter",
            "Pods bound to nodes.",
            one(load(&self.bound)),
        );
        metric(
            "gpuflow_k8s_preempted_gangs_total",
            "counter",
            "Gangs preempted.",
            one(load(&self.preempted)),
        );
        metric(
            "gpuflow_k8s_explanations_total",
            "counter",
            "PodScheduled conditions written on waiting pods.",
            one(load(&self.explained)),
        );
        metric(
            "gpuflow_k8s_cycle_failures_total",
            "counter",
            "Cycles that failed or panicked (each is logged; the next one runs).",
            one(load(&self.failures)),
        );
        metric(
            "gpuflow_k8s_cycle_seconds",
            "gauge",
            "The last cycle's duration, writes included.",
            one(load(&self.last_cycle_us) / 1e6),
        );
        let queues = self.queues.lock().expect("health").clone();
        let q = |f: &dyn Fn(&GpuQueueStatus) -> Option<f64>| -> Vec<(String, f64)> {
            queues
                .iter()
                .filter_map(|(name, s)| Some((format!("{{queue=\"{}\"}}", escape(name)), f(s)?)))
                .collect()
        };
        metric(
            "gpuflow_k8s_queue_running_pods",
            "gauge",
            "Pods of the queue bound to nodes.",
            q(&|s| Some(f64::from(s.running_pods))),
        );
        metric(
            "gpuflow_k8s_queue_pending_pods",
            "gauge",
            "Pods waiting in the queue.",
            q(&|s| Some(f64::from(s.pending_pods))),
        );
        metric(
            "gpuflow_k8s_queue_budget_used_gpu_hours",
            "gauge",
            "GPU-hours used of the queue's budget in its period.",
            q(&|s| s.budget_used_gpu_hours),
        );
        let gpus = queues
            .iter()
            .flat_map(|(name, s)| {
                s.gpus_in_use.iter().map(move |(model, v)| {
                    (
                        format!("{{queue=\"{}\",model=\"{}\"}}", escape(name), escape(model)),
                        *v,
                    )
                })
            })
            .collect();
        metric(
            "gpuflow_k8s_queue_gpus_in_use",
            "gauge",
            "GPUs the queue holds, per model.",
            gpus,
        );
        let fair = self
            .fair_share
            .lock()
            .expect("health")
            .iter()
            .map(|(name, h)| (format!("{{queue=\"{}\"}}", escape(name)), *h))
            .collect();
        metric(
            "gpuflow_k8s_queue_fair_share_gpu_hours",
            "gauge",
            "The queue's decayed GPU-hours, which fair share compares.",
            fair,
        );
        out
    }
}

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
                    [("content-type", "text/plain; version=0.0.4")],
                    h.prometheus(),
                )
                    .into_response()
            }),
        )
        .with_state(health)
}
