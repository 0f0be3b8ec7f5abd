//! The scheduler on Kubernetes: watch caches of nodes, pods, `GpuQueue`s and
//! disruption budgets (kube-runtime reflectors: list, then watch with
//! bookmarks, listing again after `410 Gone`); while this replica holds the
//! lease, a cycle every `interval` and whenever something changes:
//! 1. [`snapshot::build`] turns the caches into the core's inputs;
//! 2. `gpuflow_core::schedule::schedule` plans (1 and 2 off the async
//!    runtime);
//! 3. the plan is written (each queue's status too): a gang's pods are first annotated with their
//!    planned nodes ([`snapshot::PLANNED`]), then each is bound through the
//!    binding subresource, so a scheduler that stops half-way through a gang
//!    is finished by the next one; victims are deleted with their grace
//!    period (their containers get SIGTERM: the checkpoint signal), within
//!    their disruption budgets; a pod that waits gets `PodScheduled=False`
//!    with gpuflow's reasons, position and ETA, and an event when that
//!    changes.
//!
//! Pods it bound are remembered until the cache shows them bound
//! (kube-scheduler's "assumed" pods), so a cycle never places a pod twice or
//! counts a node's GPUs as free before the cache catches up.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use gpuflow_core::schedule::{self, Config, History, NamedHistory};
use k8s_openapi::api::batch::v1::Job as BatchJob;
use k8s_openapi::api::core::v1::{
    Binding, Event, EventSource, Node, ObjectReference, Pod, PodCondition,
};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::crd::{GpuQueue, GpuQueueStatus};
use crate::error::Error;
use crate::health::Health;
use crate::lease::Elector;
use crate::snapshot::{self, Inputs, PLANNED, PodRef, TopologyLabels};
use crate::{hami, report};

type Result<T, E = Error> = std::result::Result<T, E>;

/// How the scheduler runs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Pods with this `schedulerName` are gpuflow's.
    pub scheduler_name: String,
    /// This replica's name in the lease.
    pub identity: String,
    /// The namespace of the lease.
    pub namespace: String,
    pub lease_name: String,
    pub lease_duration: Duration,
    /// Cycles run at least this often, and when something changes.
    pub interval: Duration,
    pub topology: TopologyLabels,
    pub config: Config,
    /// Bindings in flight at once.
    pub bind_concurrency: usize,
    /// A waiting pod's condition is rewritten at most this often unless its
    /// reasons change.
    pub explain_every: Duration,
    /// Whether each cycle's workloads are kept for a gpuflow control plane
    /// ([`Scheduler::workloads`]).
    pub report_workloads: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            scheduler_name: "gpuflow".into(),
            identity: std::env::var("HOSTNAME").unwrap_or_else(|_| "gpuflow".into()),
            namespace: "gpuflow-system".into(),
            lease_name: "gpuflow-scheduler".into(),
            lease_duration: Duration::from_secs(15),
            interval: Duration::from_secs(1),
            topology: TopologyLabels::default(),
            // No consolidation by default: a deleted pod comes back only if a
            // controller makes it again.
            config: Config {
                consolidate_max_unsaved: None,
                ..Config::default()
            },
            bind_concurrency: 64,
            explain_every: Duration::from_secs(30),
            report_workloads: false,
        }
    }
}

/// Fair-share usage (decayed GPU-hours) per queue name, as of `at`: kept
/// across cycles and, on the lease, across leaders.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Usage {
    pub at: u64,
    pub gpu_hours: BTreeMap<String, f64>,
    /// GPU-hours used per budgeted queue in its current period: (period
    /// start, hours); not decayed.
    #[serde(default)]
    pub budget_used: BTreeMap<String, (u64, f64)>,
    /// The reclaims counted against each queue's disruption budget within
    /// its window: (time, GPU-hours of work lost), by queue name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disruptions: BTreeMap<String, Vec<(u64, f64)>>,
    /// Preemptors waiting for their victims to stop, by gang id (the same
    /// in every replica): a new leader waits for them too instead of
    /// choosing more victims.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub waiting_for: BTreeMap<u64, Vec<u64>>,
    /// When the last consolidation started, so that a new leader keeps
    /// the interval between them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consolidated_at: Option<u64>,
    /// Gangs within their guarantee holding nodes from new borrowing, and
    /// the flavor: they hold them again first in the next cycle.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub holding: BTreeMap<u64, String>,
    /// Gangs reclaimed from, and the running gangs that reclaimed from
    /// them: consolidation does not move those for them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reclaimed_by: BTreeMap<u64, Vec<u64>>,
}

/// What one cycle did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cycle {
    pub bound: usize,
    pub preempted: usize,
    pub explained: usize,
    pub pending: usize,
}

struct Caches {
    nodes: Store<Node>,
    pods: Store<Pod>,
    queues: Store<GpuQueue>,
    budgets: Store<PodDisruptionBudget>,
    jobs: Store<BatchJob>,
}

/// A waiting pod's condition to write, and whether its reasons are new
/// (an event is recorded then).
struct Explanation {
    pod: PodRef,
    msg: String,
    gist: String,
    conditions: Vec<PodCondition>,
    event: bool,
}

/// A scheduler replica.
pub struct Scheduler {
    client: Client,
    settings: Settings,
    caches: Caches,
    changed: Arc<tokio::sync::Notify>,
    elector: Elector,
    usage: Usage,
    /// Pods bound and not yet shown bound by the cache: uid → (node, HAMi
    /// devices).
    assumed: BTreeMap<String, (String, Vec<String>)>,
    /// HAMi's devices for the pods of the cycle being written (uid → UUIDs).
    decided: BTreeMap<String, Vec<String>>,
    /// Per waiting pod: the reasons last written and when.
    explained: BTreeMap<String, (String, Instant)>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    health: Arc<Health>,
    /// The last cycle's workloads, for a gpuflow control plane.
    report: Arc<std::sync::Mutex<Option<gpuflow_api::WorkloadReport>>>,
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn reflect<K>(
    api: Api<K>,
    changed: Arc<tokio::sync::Notify>,
    health: &Arc<Health>,
    name: &'static str,
) -> (Store<K>, Vec<tokio::task::JoinHandle<()>>)
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = reflector(writer, watcher(api, watcher::Config::default())).default_backoff();
    health.watching(name);
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(_) => changed.notify_one(),
                Err(e) => {
                    // A forbidden watch never fills its cache, and the
                    // scheduler waits for every cache: say what to fix.
                    if crate::error::forbidden(&e) {
                        tracing::error!(
                            error = %e,
                            "gpuflow's service account may not list or watch this resource; \
                             apply the RBAC of `gpuflow k8s manifests`; retrying"
                        );
                    } else {
                        tracing::warn!(error = %e, "watch failed; retrying");
                    }
                }
            }
        }
    });
    let (r, h) = (reader.clone(), health.clone());
    let synced = tokio::spawn(async move {
        if r.wait_until_ready().await.is_ok() {
            h.synced(name);
        }
    });
    (reader, vec![task, synced])
}

fn reflector<K, W>(
    writer: reflector::store::Writer<K>,
    stream: W,
) -> impl futures::Stream<Item = W::Item>
where
    K: kube::runtime::reflector::Lookup + Clone,
    K::DynamicType: Eq + std::hash::Hash + Clone,
    W: futures::Stream<Item = watcher::Result<watcher::Event<K>>>,
{
    kube::runtime::reflector::reflector(writer, stream)
}

fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

impl Scheduler {
    /// Starts the watches; [`Scheduler::run`] or [`Scheduler::tick`] then
    /// schedule.
    pub fn new(client: Client, settings: Settings) -> Scheduler {
        let changed = Arc::new(tokio::sync::Notify::new());
        let mut tasks = Vec::new();
        let health = Arc::new(Health::default());
        let (nodes, t) = reflect(
            Api::<Node>::all(client.clone()),
            changed.clone(),
            &health,
            "nodes",
        );
        tasks.extend(t);
        let (pods, t) = reflect(
            Api::<Pod>::all(client.clone()),
            changed.clone(),
            &health,
            "pods",
        );
        tasks.extend(t);
        let (queues, t) = reflect(
            Api::<GpuQueue>::all(client.clone()),
            changed.clone(),
            &health,
            "gpuqueues",
        );
        tasks.extend(t);
        let (budgets, t) = reflect(
            Api::<PodDisruptionBudget>::all(client.clone()),
            changed.clone(),
            &health,
            "poddisruptionbudgets",
        );
        tasks.extend(t);
        let (jobs, t) = reflect(
            Api::<BatchJob>::all(client.clone()),
            changed.clone(),
            &health,
            "jobs",
        );
        tasks.extend(t);
        let elector = Elector::new(
            Api::namespaced(client.clone(), &settings.namespace),
            &settings.lease_name,
            &settings.identity,
            settings.lease_duration,
        );
        Scheduler {
            client,
            settings,
            caches: Caches {
                nodes,
                pods,
                queues,
                budgets,
                jobs,
            },
            changed,
            elector,
            usage: Usage::default(),
            assumed: BTreeMap::new(),
            decided: BTreeMap::new(),
            report: Arc::default(),
            explained: BTreeMap::new(),
            tasks,
            health,
        }
    }

    /// The workloads of the last cycle this replica ran, for a gpuflow
    /// control plane's accounting (see [`report`]), kept when
    /// [`Settings::report_workloads`] is set; report them only while
    /// [`Health::leading`] says this replica leads.
    pub fn workloads(&self) -> Arc<std::sync::Mutex<Option<gpuflow_api::WorkloadReport>>> {
        self.report.clone()
    }

    /// Readiness and metrics, for [`crate::health::router`].
    pub fn health(&self) -> Arc<Health> {
        self.health.clone()
    }

    /// Waits until every cache has listed once. (Each cache's readiness
    /// has one waiter, the task that reports it to [`Health`]: a store's
    /// readiness wakes only the last of several waiters.)
    pub async fn ready(&self) {
        while self.health.ready().is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs until `stop` resolves: renews or takes the lease, and schedules
    /// while it holds it. Gives the lease up on the way out.
    ///
    /// # Errors
    /// None so far: API failures are logged and retried.
    pub async fn run(mut self, stop: impl std::future::Future<Output = ()>) -> Result<()> {
        self.ready().await;
        let mut stop = std::pin::pin!(stop);
        let renew_every = self.settings.lease_duration / 3;
        let mut renewed: Option<Instant> = None;
        loop {
            let leading = match renewed {
                Some(at) if at.elapsed() < renew_every => true,
                _ => match self.elector.try_lead().await {
                    Ok(true) => {
                        if renewed.is_none() {
                            self.take_over();
                        }
                        renewed = Some(Instant::now());
                        true
                    }
                    Ok(false) => {
                        if renewed.take().is_some() {
                            tracing::warn!(
                                identity = self.elector.identity(),
                                "lost the lease; following"
                            );
                        }
                        false
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the lease could not be read or renewed; not scheduling");
                        renewed = None;
                        false
                    }
                },
            };
            if leading {
                // A cycle that panics (a bug met by some input) is logged
                // and the next one runs: nothing in the cluster stops
                // scheduling.
                let started = Instant::now();
                let cycle =
                    futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(self.tick()));
                let done = cycle.await;
                self.health.last_cycle_us.store(
                    started.elapsed().as_micros() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                match done {
                    Ok(Ok(c)) if c.bound + c.preempted > 0 => tracing::info!(
                        bound = c.bound,
                        preempted = c.preempted,
                        pending = c.pending,
                        "cycle"
                    ),
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        self.health
                            .failures
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(error = %e, "cycle failed; retrying");
                    }
                    Err(_) => {
                        self.health
                            .failures
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::error!("the scheduling cycle panicked; retrying next cycle");
                    }
                }
            }
            self.health
                .leading
                .store(leading, std::sync::atomic::Ordering::Relaxed);
            let wait = if leading {
                self.settings.interval
            } else {
                renew_every.max(Duration::from_millis(100))
            };
            tokio::select! {
                () = &mut stop => break,
                () = tokio::time::sleep(wait) => {}
                () = self.changed.notified(), if leading => {
                    // Let a burst of changes settle into one cycle.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        if renewed.is_some() {
            let _ = self.elector.release().await;
        }
        Ok(())
    }

    /// Starts leading: the fair-share usage the last leader left on the
    /// lease, unless this replica's own is newer.
    fn take_over(&mut self) {
        let Some(state) = self.elector.found_state() else {
            return;
        };
        match serde_json::from_str::<Usage>(&state) {
            Ok(u) if u.at > self.usage.at => self.usage = u,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the usage on the lease does not read; fair share starts afresh")
            }
        }
    }

    /// Fair-share usage by queue, as of the last cycle.
    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    /// One cycle on the caches as they are. The caller must hold the lease.
    ///
    /// # Errors
    /// On an API failure other than a pod gone or already bound.
    pub async fn tick(&mut self) -> Result<Cycle> {
        let objects = Objects {
            nodes: self.caches.nodes.state(),
            pods: self.caches.pods.state(),
            queues: self.caches.queues.state(),
            budgets: self.caches.budgets.state(),
            jobs: self.caches.jobs.state(),
        };
        let (pods, queues) = (objects.pods.clone(), objects.queues.clone());
        // Assumed pods the cache now shows bound, or gone, are forgotten.
        let by_uid: BTreeMap<&str, &Pod> = pods
            .iter()
            .filter_map(|p| Some((p.metadata.uid.as_deref()?, p.as_ref())))
            .collect();
        self.assumed.retain(|uid, _| {
            by_uid.get(uid.as_str()).is_some_and(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .is_none_or(str::is_empty)
            })
        });
        // The CPU part runs off the async runtime, on copies: a cycle that
        // panics leaves the scheduler's memory as it was.
        let (assumed, settings) = (self.assumed.clone(), self.settings.clone());
        let usage = self.usage.clone();
        let now = Timestamp::now().as_second().max(0) as u64;
        let computed =
            tokio::task::spawn_blocking(move || compute(&objects, &assumed, &settings, usage, now))
                .await;
        let Computed {
            snap,
            plan,
            usage,
            report,
        } = match computed {
            Ok(c) => c,
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        };
        self.usage = usage;
        if let Some(r) = report {
            *self.report.lock().expect("the report") = Some(r);
        }
        self.elector.set_state(serde_json::to_string(&self.usage)?);
        let mut out = Cycle {
            pending: plan.pending.len() + snap.held.len(),
            ..Cycle::default()
        };
        let by_name: BTreeMap<(String, String), Arc<Pod>> = pods
            .iter()
            .map(|p| {
                (
                    (
                        p.metadata.namespace.clone().unwrap_or_default(),
                        p.metadata.name.clone().unwrap_or_default(),
                    ),
                    p.clone(),
                )
            })
            .collect();
        let hami_nodes: BTreeSet<String> = snap.hami.keys().cloned().collect();
        self.decided.clear();
        // 1. Gangs an earlier cycle planned and did not finish binding.
        out.bound += self.bind_all(snap.planned.clone(), &hami_nodes).await?;
        // 2. Admissions: the annotations first (every pod of a gang gets
        // its planned node; a pod on a HAMi node its devices), then the
        // bindings.
        let mut binds = Vec::new();
        let mut annotations = Vec::new();
        let stamp = Timestamp::now().as_second().to_string();
        for (id, _flavor, placement) in &plan.admitted {
            let gang = &snap.gangs[id];
            for a in placement {
                let pod = gang.pods[a.task.group as usize][a.task.index as usize].clone();
                let node = snap.node_names[a.node.0 as usize].clone();
                let mut write = serde_json::Map::new();
                if gang.all().count() > 1 {
                    write.insert(PLANNED.into(), json!(node));
                }
                let decision = snap.hami.get(&node).and_then(|gpus| {
                    let current = by_name.get(&(pod.namespace.clone(), pod.name.clone()))?;
                    snapshot::hami_decision(current, gpus, a.pick)
                });
                if let Some(containers) = decision {
                    let devices = containers.iter().flatten().map(|s| s.uuid.clone());
                    self.decided.insert(pod.uid.clone(), devices.collect());
                    let d = hami::encode(&containers);
                    write.insert(hami::TO_ALLOCATE.into(), json!(d));
                    write.insert(hami::ALLOCATED.into(), json!(d));
                    write.insert(hami::ASSIGNED_NODE.into(), json!(node));
                    write.insert(hami::ASSIGNED_TIME.into(), json!(stamp));
                }
                if !write.is_empty() {
                    annotations.push((pod.clone(), write));
                }
                binds.push((pod, node));
            }
        }
        self.annotate(annotations).await?;
        out.bound += self.bind_all(binds, &hami_nodes).await?;
        // 3. Preemptions, within the victims' disruption budgets. The state
        // that records them (who waits for which victims, what counts
        // against the budgets) goes onto the lease first, so a leader that
        // dies right after telling a victim leaves it to the next; a
        // replica that cannot renew the lease preempts nothing.
        let fenced = if plan.preempted.is_empty() {
            false
        } else {
            match self.elector.try_lead().await {
                Ok(true) => false,
                Ok(false) => {
                    tracing::warn!("lost the lease: no preemption this cycle");
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the lease could not be renewed: no preemption this cycle");
                    true
                }
            }
        };
        let preempted = if fenced { &[][..] } else { &plan.preempted[..] };
        let mut allowed = snap.budgets.clone();
        let mut victims = BTreeSet::new();
        for p in preempted {
            if !victims.insert(p.victim) {
                continue;
            }
            let Some(gang) = snap.gangs.get(&p.victim) else {
                continue;
            };
            let n = gang.all().count() as i32;
            if gang
                .budgets
                .iter()
                .any(|b| allowed.get(b).copied().unwrap_or(0) < n)
            {
                tracing::info!(gang = %gang.key, "preemption held back by a disruption budget");
                continue;
            }
            for b in &gang.budgets {
                *allowed.entry(b.clone()).or_default() -= n;
            }
            for pod in gang.all() {
                let api: Api<Pod> = Api::namespaced(self.client.clone(), &pod.namespace);
                let dp = DeleteParams {
                    grace_period_seconds: Some(gang.grace.min(u32::MAX as u64) as u32),
                    ..DeleteParams::default()
                };
                match api.delete(&pod.name, &dp).await {
                    Ok(_) => {}
                    Err(e) if status_code(&e) == Some(404) => {}
                    Err(e) => return Err(e.into()),
                }
                let by = snap
                    .gangs
                    .get(&p.by)
                    .map(|g| g.key.clone())
                    .unwrap_or_default();
                self.event(
                    pod,
                    "Preempted",
                    &format!("gpuflow: preempted for {by} ({})", gang_reason(p.reason)),
                )
                .await;
            }
            out.preempted += 1;
        }
        // 4. Queues' status.
        self.report_queues(&queues, &snap, &plan).await;
        // 5. Explanations.
        let mut waiting: Vec<(PodRef, String)> = snap.held.clone();
        for p in &plan.pending {
            let Some(gang) = snap.gangs.get(&p.job) else {
                continue;
            };
            let msg = report::pending_message(p, &gang.queue);
            for pod in gang.all() {
                waiting.push((pod.clone(), msg.clone()));
            }
        }
        let still: BTreeSet<String> = waiting.iter().map(|(p, _)| p.uid.clone()).collect();
        self.explained.retain(|uid, _| still.contains(uid));
        let writes: Vec<Explanation> = waiting
            .into_iter()
            .filter_map(|(pod, msg)| {
                let current = by_name.get(&(pod.namespace.clone(), pod.name.clone()))?;
                self.explanation(current, pod, msg)
            })
            .collect();
        out.explained = self.explain_all(writes).await?;
        let h = &self.health;
        let add = |a: &std::sync::atomic::AtomicU64, n: usize| {
            a.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        };
        add(&h.cycles, 1);
        add(&h.bound, out.bound);
        add(&h.preempted, out.preempted);
        add(&h.explained, out.explained);
        Ok(out)
    }

    /// Writes each queue's status (pods running and pending, GPUs in use)
    /// where it changed; a failure is logged, not fatal.
    async fn report_queues(
        &self,
        queues: &[Arc<GpuQueue>],
        snap: &snapshot::Snapshot,
        plan: &schedule::Plan,
    ) {
        let mut status: BTreeMap<&str, GpuQueueStatus> = BTreeMap::new();
        let mut count = |id: &gpuflow_core::ids::JobId, running: bool| {
            if let Some(g) = snap.gangs.get(id) {
                let s = status.entry(g.queue.as_str()).or_default();
                let n = g.all().count() as u32;
                if running {
                    s.running_pods += n;
                } else {
                    s.pending_pods += n;
                }
            }
        };
        for r in &snap.running {
            count(&r.work.job.id, true);
        }
        for (id, _, _) in &plan.admitted {
            count(id, true);
        }
        for p in &plan.pending {
            count(&p.job, false);
        }
        let mut reported = BTreeMap::new();
        for q in queues {
            let Some(name) = q.metadata.name.as_deref() else {
                continue;
            };
            let mut want = status.remove(name).unwrap_or_default();
            if let Some(id) = snap.queues.by_name(name) {
                for flavor in snap.queues.flavors() {
                    let used = snap.queues.usage(id, flavor);
                    if used > 0 {
                        want.gpus_in_use
                            .insert(flavor.clone(), used as f64 / 1000.0);
                    }
                }
            }
            // Rounded (to 0.36 GPU-seconds) so that a busy queue's status is
            // not rewritten every cycle.
            want.budget_used_gpu_hours = self
                .usage
                .budget_used
                .get(name)
                .map(|(_, h)| (h * 10_000.0).round() / 10_000.0);
            reported.insert(name.to_string(), want.clone());
            if q.status.as_ref() == Some(&want) {
                continue;
            }
            let api: Api<GpuQueue> = Api::all(self.client.clone());
            let mut patch = json!({"status": want});
            // A merge patch keeps map keys it does not name: models no
            // longer in use are removed by name.
            for model in q.status.iter().flat_map(|s| s.gpus_in_use.keys()) {
                if !want.gpus_in_use.contains_key(model) {
                    patch["status"]["gpusInUse"][model] = serde_json::Value::Null;
                }
            }
            if let Err(e) = api
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                tracing::warn!(queue = name, error = %e, "could not report the queue's status");
            }
        }
        self.health
            .set_queues(reported, self.usage.gpu_hours.clone());
    }

    /// Writes annotations on pods before any is bound: `gpuflow.io/node`
    /// on each pod of a gang, HAMi's decision on a pod bound to a HAMi node.
    async fn annotate(
        &self,
        writes: Vec<(PodRef, serde_json::Map<String, serde_json::Value>)>,
    ) -> Result<()> {
        let client = &self.client;
        let results: Vec<Result<(), kube::Error>> = futures::stream::iter(writes)
            .map(|(pod, annotations)| async move {
                let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
                let patch = json!({"metadata": {"annotations": annotations}});
                match api
                    .patch(&pod.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(e) if status_code(&e) == Some(404) => Ok(()),
                    Err(e) => Err(e),
                }
            })
            .buffer_unordered(self.settings.bind_concurrency.max(1))
            .collect()
            .await;
        results.into_iter().collect::<Result<(), _>>()?;
        Ok(())
    }

    /// Binds pods to nodes; returns how many it bound. A pod already bound
    /// (`409`) or gone (`404`) is skipped. On a node whose GPUs HAMi shares
    /// one pod at a time is bound, under HAMi's node lock
    /// ([`hami_bind`]); the others wait for a later cycle.
    async fn bind_all(
        &mut self,
        binds: Vec<(PodRef, String)>,
        hami_nodes: &BTreeSet<String>,
    ) -> Result<usize> {
        let client = &self.client;
        let mut locking = BTreeSet::new();
        let binds: Vec<(PodRef, String, bool)> = binds
            .into_iter()
            .filter_map(|(pod, node)| {
                let hami = hami_nodes.contains(&node);
                (!hami || locking.insert(node.clone())).then_some((pod, node, hami))
            })
            .collect();
        let results: Vec<(PodRef, String, Result<bool, kube::Error>)> =
            futures::stream::iter(binds)
                .map(|(pod, node, hami)| async move {
                    let r = if hami {
                        hami_bind(client, &pod, &node).await
                    } else {
                        bind(client, &pod, &node).await
                    };
                    (pod, node, r)
                })
                .buffer_unordered(self.settings.bind_concurrency.max(1))
                .collect()
                .await;
        let mut bound = 0;
        let mut first_err = None;
        for (pod, node, r) in results {
            match r {
                Ok(true) => {
                    let devices = self.decided.remove(&pod.uid).unwrap_or_default();
                    self.assumed.insert(pod.uid, (node, devices));
                    bound += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(pod = %pod, node, error = %e, "binding failed");
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) if bound == 0 => Err(e.into()),
            _ => Ok(bound),
        }
    }

    /// The explanation to write on a waiting pod, if any: when its
    /// condition says something else and either the reasons changed or the
    /// last write is older than `explain_every`.
    fn explanation(&self, current: &Pod, pod: PodRef, msg: String) -> Option<Explanation> {
        let conditions = current
            .status
            .as_ref()
            .and_then(|s| s.conditions.clone())
            .unwrap_or_default();
        let old = conditions.iter().find(|c| c.type_ == "PodScheduled");
        if old.is_some_and(|c| c.message.as_deref() == Some(msg.as_str())) {
            return None;
        }
        // The reasons without position and ETA decide whether this is news.
        let gist = msg.split("; position").next().unwrap_or(&msg).to_string();
        let new_reasons = self.explained.get(&pod.uid).is_none_or(|(g, _)| *g != gist);
        let stale = self
            .explained
            .get(&pod.uid)
            .is_some_and(|(_, at)| at.elapsed() >= self.settings.explain_every);
        if !new_reasons && !stale {
            return None;
        }
        let mut conditions: Vec<PodCondition> = conditions
            .into_iter()
            .filter(|c| c.type_ != "PodScheduled")
            .collect();
        conditions.push(PodCondition {
            type_: "PodScheduled".into(),
            status: "False".into(),
            reason: Some("Unschedulable".into()),
            message: Some(msg.clone()),
            last_transition_time: Some(Time(Timestamp::now())),
            ..PodCondition::default()
        });
        Some(Explanation {
            pod,
            msg,
            gist,
            conditions,
            event: new_reasons,
        })
    }

    /// Writes explanations, many at a time: the condition, then an event
    /// when the reasons are new. Returns how many it wrote.
    async fn explain_all(&mut self, writes: Vec<Explanation>) -> Result<usize> {
        let me = &*self;
        let results: Vec<(Explanation, Result<bool, kube::Error>)> = futures::stream::iter(writes)
            .map(|w| async move {
                let api: Api<Pod> = Api::namespaced(me.client.clone(), &w.pod.namespace);
                let patch = json!({"status": {"conditions": w.conditions}});
                let r = match api
                    .patch_status(&w.pod.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => {
                        if w.event {
                            me.event(&w.pod, "FailedScheduling", &w.msg).await;
                        }
                        Ok(true)
                    }
                    Err(e) if status_code(&e) == Some(404) => Ok(false),
                    Err(e) => Err(e),
                };
                (w, r)
            })
            .buffer_unordered(self.settings.bind_concurrency.max(1))
            .collect()
            .await;
        let mut wrote = 0;
        let mut first_err = None;
        for (w, r) in results {
            match r {
                Ok(true) => {
                    self.explained.insert(w.pod.uid, (w.gist, Instant::now()));
                    wrote += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(wrote),
        }
    }

    /// Records an event on a pod; a failure is logged, not fatal.
    async fn event(&self, pod: &PodRef, reason: &str, msg: &str) {
        let now = Timestamp::now();
        let ev = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", pod.name)),
                namespace: Some(pod.namespace.clone()),
                ..ObjectMeta::default()
            },
            involved_object: ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: Some(pod.name.clone()),
                namespace: Some(pod.namespace.clone()),
                uid: Some(pod.uid.clone()),
                ..ObjectReference::default()
            },
            reason: Some(reason.into()),
            message: Some(msg.into()),
            type_: Some(
                if reason == "FailedScheduling" {
                    "Warning"
                } else {
                    "Normal"
                }
                .into(),
            ),
            source: Some(EventSource {
                component: Some(self.settings.scheduler_name.clone()),
                host: None,
            }),
            reporting_component: Some(self.settings.scheduler_name.clone()),
            reporting_instance: Some(self.settings.identity.clone()),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            count: Some(1),
            ..Event::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &pod.namespace);
        if let Err(e) = api.create(&PostParams::default(), &ev).await {
            tracing::warn!(pod = %pod, error = %e, "could not record an event");
        }
    }

    /// Holds or renews the lease once; true while this replica leads.
    ///
    /// # Errors
    /// When the API fails.
    pub async fn try_lead(&mut self) -> Result<bool, kube::Error> {
        let was = self.elector.leading();
        let now = self.elector.try_lead().await?;
        if now && !was {
            self.take_over();
        }
        Ok(now)
    }
}

/// The watch caches' objects a cycle reads.
struct Objects {
    nodes: Vec<Arc<Node>>,
    pods: Vec<Arc<Pod>>,
    queues: Vec<Arc<GpuQueue>>,
    budgets: Vec<Arc<PodDisruptionBudget>>,
    jobs: Vec<Arc<BatchJob>>,
}

/// What a cycle computes before it writes anything.
struct Computed {
    snap: snapshot::Snapshot,
    plan: schedule::Plan,
    usage: Usage,
    report: Option<gpuflow_api::WorkloadReport>,
}

/// The binding subresource's request for `pod` on `node`: `Ok(false)` when
/// the pod is already bound (`409`) or gone (`404`).
async fn bind(client: &Client, pod: &PodRef, node: &str) -> Result<bool, kube::Error> {
    let api: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let binding = Binding {
        metadata: ObjectMeta {
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            uid: None,
            ..ObjectMeta::default()
        },
        target: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_string()),
            ..ObjectReference::default()
        },
    };
    let r: Result<kube::core::Status, kube::Error> = api
        .create_subresource("binding", &pod.name, &PostParams::default(), &binding)
        .await;
    match r {
        Ok(_) => Ok(true),
        Err(e) if matches!(status_code(&e), Some(404 | 409)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// A node's HAMi lock: `None` when it is not locked, `Some(None)` when the
/// lock does not read (it is broken as an expired one).
fn hami_lock(n: &Node) -> Option<Option<hami::Lock>> {
    let v = n.metadata.annotations.as_ref()?.get(hami::NODE_LOCK)?;
    Some(hami::parse_lock(v))
}

/// Whether a lock names `pod`.
fn locked_by(held: &Option<hami::Lock>, pod: &PodRef) -> bool {
    held.as_ref()
        .and_then(|(_, who)| who.as_ref())
        .is_some_and(|(ns, name)| *ns == pod.namespace && *name == pod.name)
}

/// Binds a pod to a node whose GPUs HAMi shares, as HAMi's device plugin
/// expects: the node locked for this pod (`hami.io/mutex.lock`, written
/// with the node's `resourceVersion`, so of two schedulers one wins), the
/// pod marked `allocating`, then bound. The device plugin allocates the
/// devices the pod's annotation names, marks it `success` and unlocks the
/// node. `Ok(false)`, nothing bound, while another pod holds the lock; a
/// lock older than [`hami::LOCK_EXPIRES_S`] or whose pod is gone is broken.
/// The lock is given back when the binding fails.
async fn hami_bind(client: &Client, pod: &PodRef, node: &str) -> Result<bool, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let current = nodes.get(node).await?;
    let now = Timestamp::now().as_second();
    if let Some(held) = hami_lock(&current) {
        let mine = locked_by(&held, pod);
        let expired = held
            .as_ref()
            .is_none_or(|(at, _)| now - at >= hami::LOCK_EXPIRES_S);
        let orphaned = match held.as_ref().and_then(|(_, who)| who.clone()) {
            Some((ns, name)) => Api::<Pod>::namespaced(client.clone(), &ns)
                .get_opt(&name)
                .await?
                .is_none(),
            None => false,
        };
        if !(mine || expired || orphaned) {
            tracing::debug!(node, pod = %pod, "the node's HAMi lock is held; the pod waits for a later cycle");
            return Ok(false);
        }
    }
    let at = Timestamp::from_second(now)
        .map(|t| t.to_string())
        .unwrap_or_default();
    let lock = |value: serde_json::Value, rv: Option<String>| {
        json!({"metadata": {
            "annotations": {hami::NODE_LOCK: value},
            "resourceVersion": rv,
        }})
    };
    let patch = lock(
        json!(hami::lock_value(&at, &pod.namespace, &pod.name)),
        current.metadata.resource_version.clone(),
    );
    match nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {}
        Err(e) if status_code(&e) == Some(409) => return Ok(false),
        Err(e) => return Err(e),
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let phase = json!({"metadata": {"annotations": {
        hami::BIND_PHASE: "allocating",
        hami::BIND_TIME: now.to_string(),
    }}});
    let bound = match pods
        .patch(&pod.name, &PatchParams::default(), &Patch::Merge(&phase))
        .await
    {
        Ok(_) => bind(client, pod, node).await,
        Err(e) if status_code(&e) == Some(404) => Ok(false),
        Err(e) => Err(e),
    };
    if !matches!(bound, Ok(true)) {
        // Given back only if it is still this pod's.
        let again = nodes.get(node).await?;
        if hami_lock(&again).is_some_and(|held| locked_by(&held, pod)) {
            let unlock = lock(serde_json::Value::Null, again.metadata.resource_version);
            if let Err(e) = nodes
                .patch(node, &PatchParams::default(), &Patch::Merge(&unlock))
                .await
            {
                tracing::warn!(node, error = %e, "could not give back the node's HAMi lock; it expires");
            }
        }
    }
    bound
}

/// The CPU part of a cycle: the snapshot, budgets and fair-share usage
/// charged up to `now`, the core's plan.
fn compute(
    objects: &Objects,
    assumed: &BTreeMap<String, (String, Vec<String>)>,
    settings: &Settings,
    mut usage: Usage,
    now: u64,
) -> Computed {
    fn refs<T>(v: &[Arc<T>]) -> Vec<&T> {
        v.iter().map(AsRef::as_ref).collect()
    }
    let (nodes, pods, queues) = (
        refs(&objects.nodes),
        refs(&objects.pods),
        refs(&objects.queues),
    );
    let (budgets, jobs) = (refs(&objects.budgets), refs(&objects.jobs));
    let mut snap = snapshot::build(&Inputs {
        nodes: &nodes,
        pods: &pods,
        queues: &queues,
        budgets: &budgets,
        jobs: &jobs,
        budget_used: &usage.budget_used,
        now,
        assumed,
        scheduler_name: &settings.scheduler_name,
        topology: &settings.topology,
        classes: &settings.config.classes,
    });
    let mut cfg = settings.config.clone();
    cfg.classes = snap.classes.clone();
    // Budgets count GPU-hours since the last cycle in each budgeted
    // queue's current period.
    charge_budgets(&mut usage, now, &queues, &snap);
    // What the scheduler remembers between cycles is kept by queue name
    // (queue ids change as queues come and go): fair-share usage, charged
    // up to now, the reclaims counted against disruption budgets and the
    // preemptors waiting for their victims, which the cycle reads and adds
    // to.
    let kept = NamedHistory {
        usage: std::mem::take(&mut usage.gpu_hours),
        decayed_at: if usage.at == 0 { now } else { usage.at },
        disruptions: std::mem::take(&mut usage.disruptions),
        waiting_for: std::mem::take(&mut usage.waiting_for),
        consolidated_at: usage.consolidated_at,
        holding: std::mem::take(&mut usage.holding),
        reclaimed_by: std::mem::take(&mut usage.reclaimed_by),
    };
    let mut history = History::from_named(&kept, &snap.queues);
    history.account(now, cfg.usage_half_life, &snap.running, &snap.queues);
    let plan = schedule::schedule(
        gpuflow_core::schedule::Snapshot {
            now,
            placer: &mut snap.placer,
            queues: &mut snap.queues,
            running: &snap.running,
            pending: &snap.pending,
            cfg: &cfg,
        },
        &mut history,
    );
    let kept = history.named(&snap.queues);
    usage.at = kept.decayed_at;
    usage.gpu_hours = kept.usage;
    usage.disruptions = kept.disruptions;
    usage.waiting_for = kept.waiting_for;
    usage.consolidated_at = kept.consolidated_at;
    usage.holding = kept.holding;
    usage.reclaimed_by = kept.reclaimed_by;
    let report = settings
        .report_workloads
        .then(|| report::workloads(&snap, &plan, &queues, now));
    Computed {
        snap,
        plan,
        usage,
        report,
    }
}

/// Adds the GPU-hours the running gangs used since the last cycle to each
/// budgeted queue above them, starting afresh with each period.
fn charge_budgets(usage: &mut Usage, now: u64, queues: &[&GpuQueue], snap: &snapshot::Snapshot) {
    let dt = if usage.at == 0 {
        0
    } else {
        now.saturating_sub(usage.at)
    };
    let mut budgeted = BTreeSet::new();
    for q in queues {
        let (Some(name), Some(b)) = (q.metadata.name.as_deref(), q.spec.budget.as_ref()) else {
            continue;
        };
        budgeted.insert(name.to_string());
        let start = b.period.start(now);
        let entry = usage
            .budget_used
            .entry(name.to_string())
            .or_insert((start, 0.0));
        if entry.0 != start {
            *entry = (start, 0.0);
        }
        let Some(id) = snap.queues.by_name(name) else {
            continue;
        };
        let hours: f64 = snap
            .running
            .iter()
            .filter(|r| snap.queues.path(r.work.queue).contains(&id))
            .map(|r| r.work.gpu_milli() as f64 / 1000.0 * dt as f64 / 3600.0)
            .sum();
        entry.1 += hours;
    }
    usage.budget_used.retain(|name, _| budgeted.contains(name));
}

fn gang_reason(r: schedule::PreemptReason) -> &'static str {
    match r {
        schedule::PreemptReason::Priority => "higher priority",
        schedule::PreemptReason::Reclaim => "its queue reclaims its guarantee",
        schedule::PreemptReason::Consolidation => {
            "moved to make room for a job no node could take; it fits on another node"
        }
    }
}
