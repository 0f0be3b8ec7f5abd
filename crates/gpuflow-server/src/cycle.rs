//! The scheduling loop. Each cycle:
//! 1. timers: lost nodes, jobs over their max runtime, stops whose nodes are gone;
//! 2. snapshot: the committed state as the core's nodes, queues, running and
//!    pending jobs;
//! 3. `gpuflow_core::schedule::schedule`;
//! 4. commit the plan (admissions with their allocations, preemption orders,
//!    explanations) in one transaction; agents learn it on their next heartbeat.
//!
//! The loop runs every `cycle_interval` and whenever something changes, and
//! logs one line per cycle that did something.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use gpuflow_api::{self as api, JobState, NodeState};
use gpuflow_core::cluster::{Allocation, Cluster};
use gpuflow_core::ids::{CpuMilli, GpuMilli, JobId, MemMib, NodeId, TaskId};
use gpuflow_core::mix::{MixWeighting, WorkloadMix};
use gpuflow_core::model::{self, Gpu, Node};
use gpuflow_core::placement::Placer;
use gpuflow_core::policy::Policy;
use gpuflow_core::queue::{FlavorQuota, Queue, QueueId, Queues, UserLimits};
use gpuflow_core::request::{self, Constraints, GpuRequest, Job, TaskGroup, TaskRequest};
use gpuflow_core::schedule::{self, Config, Running, Workload};

use crate::event::EventKind;
use crate::lifecycle;
use crate::state::{Alloc, JobRec, World};
use crate::{Change, Shared, commit, now};

/// Runs cycles until the process ends.
///
/// Changes wake it, but cycles are spaced: after a cycle that took `d`, the
/// next starts no sooner than `max(d, 100 ms)` later, so a burst of
/// submissions is scheduled in batches and the state lock is free at least
/// half the time.
pub async fn run_loop(shared: Arc<Shared>) {
    let min_gap = shared
        .cfg
        .cycle_interval
        .min(std::time::Duration::from_millis(100));
    loop {
        let _ = tokio::time::timeout(shared.cfg.cycle_interval, shared.wake.notified()).await;
        let started = Instant::now();
        // Each cycle runs as its own task, so that a panic in it (a bug, or
        // input the edge should have refused) is caught, logged and counted,
        // and the next cycle runs: nothing a caller sends stops scheduling.
        let s = shared.clone();
        let failed = match tokio::spawn(async move { run_once(&s).await }).await {
            Ok(Ok(())) => false,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "scheduling cycle failed; retrying next cycle");
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "scheduling cycle panicked; retrying next cycle");
                true
            }
        };
        if failed {
            shared
                .cycle_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        tokio::time::sleep(started.elapsed().max(min_gap)).await;
    }
}

/// One cycle, in three phases:
/// 1. under the state lock: timers (committed), then a snapshot of the
///    committed state;
/// 2. without the lock, off the async runtime: the core's `schedule()` on
///    the snapshot, while submissions, heartbeats and reads go on;
/// 3. under the lock again, the applier: each decision is re-checked against
///    what changed since the snapshot (an admitted job must still be pending
///    in the same attempt and its nodes unchanged; a victim or an evicted job
///    still in the attempt it was in), committed, then published.
///
/// One cycle runs at a time (`Shared::applier`), so the applier is the only
/// writer of allocations.
///
/// # Errors
/// On a store error; nothing of the cycle's plan is applied then.
pub async fn run_once(shared: &Shared) -> Result<(), crate::ServerError> {
    run_once_with(shared, async || {}).await
}

/// [`run_once`], running `meanwhile` between the computation and the
/// applier, as requests and heartbeats may: tests use it to change what the
/// plan was made on.
///
/// # Errors
/// As [`run_once`].
pub async fn run_once_with(
    shared: &Shared,
    meanwhile: impl AsyncFnOnce(),
) -> Result<(), crate::ServerError> {
    let _one_at_a_time = shared.applier.lock().await;
    let t = now();
    let started = Instant::now();
    // Phase 1.
    let taken = {
        let mut world = shared.world.lock().await;
        let change = timers(&world, &shared.cfg, t);
        commit(shared.store.as_ref(), &mut world, change).await?;
        world.prune_finished(t, shared.cfg.keep_finished_s);
        Taken::take(&world, t, &shared.cfg).map(|mut taken| {
            taken.snap.fault = shared.cfg.fault.clone();
            taken
        })
    };
    let Some(taken) = taken else {
        return Ok(());
    };
    let took = started.elapsed();
    // Phase 2.
    let computed = match tokio::task::spawn_blocking(move || taken.compute()).await {
        Ok(c) => c,
        Err(e) if e.is_panic() => {
            // A bug in the core, met by some input: find the pending job that
            // makes it fail and set it aside, so the next cycle goes on.
            set_aside_culprit(shared, t).await?;
            return Err(crate::ServerError::Cycle(
                "the scheduling core panicked".into(),
            ));
        }
        Err(e) => return Err(crate::ServerError::Cycle(e.to_string())),
    };
    let computing = started.elapsed() - took;
    meanwhile().await;
    // Phase 3.
    let applying = Instant::now();
    let mut world = shared.world.lock().await;
    let out = computed.apply(&world, t);
    // Admissions and preemptions by queue, and waits to a first start, as
    // counters (read before the change is committed).
    let mut counted = Vec::new();
    for e in &out.change.batch.events {
        let Some(j) = e.job.and_then(|id| out.change.jobs.get(&id)) else {
            continue;
        };
        match EventKind::from_name(&e.kind) {
            Some(EventKind::Admitted) => counted.push((
                true,
                j.spec.queue.clone(),
                (j.attempts == 1).then(|| (j.spec.kind.as_str(), t.saturating_sub(j.submitted_at))),
            )),
            Some(EventKind::Preempted) => counted.push((false, j.spec.queue.clone(), None)),
            _ => {}
        }
    }
    commit(shared.store.as_ref(), &mut world, out.change).await?;
    let stats = &mut world.stats;
    for (admitted, queue, wait) in counted {
        let by = if admitted {
            &mut stats.admissions_by_queue
        } else {
            &mut stats.preemptions_by_queue
        };
        *by.entry(queue).or_default() += 1;
        if let Some((kind, secs)) = wait {
            stats.waits.entry(kind).or_default().observe(secs);
        }
    }
    stats.cycle_take.observe(took.as_secs_f64());
    stats.cycle_compute.observe(computing.as_secs_f64());
    stats.cycle_apply.observe(applying.elapsed().as_secs_f64());
    stats.admissions += out.admitted as u64;
    stats.preemptions += out.preempted as u64;
    stats.lost_gpu_hours += out.lost_gpu_hours;
    // What stood idle since the last cycle, as that cycle measured it.
    if stats.idle_waiting_at > 0 {
        stats.idle_waiting_gpu_hours +=
            stats.idle_waiting_gpus * t.saturating_sub(stats.idle_waiting_at) as f64 / 3600.0;
    }
    stats.idle_waiting_gpus = out.idle_waiting_milli as f64 / 1000.0;
    stats.idle_waiting_at = t;
    world.history = out.history;
    if out.history_saved {
        world.history_saved_at = t;
    }
    // Explanations are recomputed every cycle: kept in memory, not stored.
    for (id, why) in out.whys {
        if let Some(state) = world.jobs.get(&id).map(|j| j.state) {
            world.why.insert(id, api::Why { state, ..why });
        }
    }
    world.unreached = out.unreached;
    world.diagnosed.clear();
    drop(world);
    let ms = started.elapsed().as_millis() as u64;
    // One line per cycle that decided something; quiet cycles at debug.
    if out.admitted + out.preempted > 0 || out.stale > 0 {
        tracing::info!(
            pending = out.pending,
            admitted = out.admitted,
            preempted = out.preempted,
            stale = out.stale,
            running = out.running,
            ms,
            "cycle"
        );
    } else {
        tracing::debug!(pending = out.pending, running = out.running, ms, "cycle");
    }
    if out.admitted > 0 || out.stale > 0 {
        shared.wake.notify_one();
    }
    Ok(())
}

/// The queues running more `flavor` GPUs than they are guaranteed, with
/// how much, and when the first of their jobs may be reclaimed: once past
/// the minimum runtime (unsaved work does not protect borrowed GPUs);
/// `None` when no queue borrows.
fn borrowers(world: &World, flavor: &str, t: u64, cfg: &Config) -> Option<String> {
    let mut used: BTreeMap<&str, u64> = BTreeMap::new();
    // Per queue: the earliest time one of its jobs may be reclaimed.
    let mut first_preemptible: BTreeMap<&str, u64> = BTreeMap::new();
    for j in world
        .jobs
        .values()
        .filter(|j| j.state.allocated() && j.flavor == flavor)
    {
        *used.entry(j.spec.queue.as_str()).or_default() += quota_milli(&j.spec);
        let from = j.started_at.unwrap_or(t) + cfg.min_runtime;
        let e = first_preemptible
            .entry(j.spec.queue.as_str())
            .or_insert(from);
        *e = (*e).min(from);
    }
    let mut over = Vec::new();
    let mut from = u64::MAX;
    for (q, in_use) in used {
        let guaranteed = world
            .queues
            .get(q)
            .and_then(|s| gpuflow_core::queue::quota_entry(&s.quotas, flavor))
            .map_or(0, |qs| milli(qs.guaranteed));
        if in_use > guaranteed {
            over.push(format!(
                "{q} ({:.2} GPUs, {:.2} guaranteed)",
                in_use as f64 / 1000.0,
                guaranteed as f64 / 1000.0
            ));
            from = from.min(first_preemptible[q]);
        }
    }
    if over.is_empty() {
        return None;
    }
    let when = if from <= t {
        "their jobs are past the minimum runtime".to_string()
    } else {
        format!(
            "their first job passes the minimum runtime in {}",
            schedule::span(from - t)
        )
    };
    Some(format!(
        "borrowing {flavor} beyond their guarantee: {}; {when}",
        over.join(", ")
    ))
}

/// After the core panicked: bisects the pending jobs on copies of a fresh
/// snapshot for the one whose presence makes it fail, and holds that job
/// with the reason, so that one job cannot stop scheduling for everyone.
/// Nothing is held when no single pending job explains the failure.
async fn set_aside_culprit(shared: &Shared, t: u64) -> Result<(), crate::ServerError> {
    let (snap, history) = {
        let world = shared.world.lock().await;
        let mut snap = snapshot(&world, t);
        snap.fault = shared.cfg.fault.clone();
        let history = world.history.to_core(&snap.queues);
        (snap, history)
    };
    let cfg = config(&shared.cfg);
    let culprit = tokio::task::spawn_blocking(move || {
        let ids: Vec<usize> = (0..snap.pending.len()).collect();
        let mut fails = |subset: &[usize]| {
            let mut s = snap.clone();
            s.pending = subset.iter().map(|&i| snap.pending[i].clone()).collect();
            let mut h = history.clone();
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                s.schedule(t, &mut h, &cfg);
            }))
            .is_err()
        };
        find_culprit(&ids, &mut fails).map(|i| snap.pending[i].job.id.0)
    })
    .await
    .map_err(|e| crate::ServerError::Cycle(e.to_string()))?;
    let Some(id) = culprit else {
        tracing::error!("the scheduling core panicked and no single pending job explains it");
        return Ok(());
    };
    let mut world = shared.world.lock().await;
    let Some(mut j) = world.jobs.get(&id).cloned() else {
        return Ok(());
    };
    let kind = lifecycle::set_aside(
        &mut j,
        "set aside: scheduling it made the scheduler fail (a bug, in the server log); an admin releases it with `gpuflow job release`",
    );
    tracing::error!(
        job = id,
        "the scheduling core panicked on this job; it is held"
    );
    let mut change = Change::default();
    change.event(t, Some(id), &j.team, kind, j.reason.clone());
    change.job(j);
    commit(shared.store.as_ref(), &mut world, change).await
}

/// The one item whose presence makes `fails` true, by halving: `None`
/// when all of them together do not fail, or when no single item explains
/// it (the failure needs items from both halves).
fn find_culprit(items: &[usize], fails: &mut impl FnMut(&[usize]) -> bool) -> Option<usize> {
    if items.is_empty() || !fails(items) {
        return None;
    }
    let mut suspects = items.to_vec();
    while suspects.len() > 1 {
        let (a, b) = suspects.split_at(suspects.len() / 2);
        suspects = if fails(a) {
            a.to_vec()
        } else if fails(b) {
            b.to_vec()
        } else {
            return None;
        };
    }
    suspects.first().copied()
}

/// What a node is, for the applier's re-check: its state and what it has
/// (not its heartbeat time or utilisation).
#[derive(Clone, Debug, PartialEq)]
struct Shape {
    state: NodeState,
    cpu_milli: u64,
    memory_mib: u64,
    gpus: Vec<(String, String, u64)>,
    labels: BTreeMap<String, String>,
    pool: String,
}

fn shape(n: &crate::state::NodeRec) -> Shape {
    Shape {
        state: n.state,
        cpu_milli: n.inventory.cpu_milli,
        memory_mib: n.inventory.memory_mib,
        gpus: n
            .inventory
            .gpus
            .iter()
            .map(|g| (g.uuid.clone(), g.model.clone(), g.memory_mib))
            .collect(),
        labels: n.inventory.labels.clone(),
        pool: n.inventory.pool.clone(),
    }
}

/// Phase 1's output: the snapshot and what the applier will re-check.
struct Taken {
    snap: Snapshot,
    history: schedule::History,
    cfg: Config,
    t: u64,
    pending: usize,
    shapes: BTreeMap<String, Shape>,
    /// Job → (state, attempt) at the snapshot, for pending and allocated jobs.
    versions: BTreeMap<u64, (JobState, u32)>,
    history_saved_at: u64,
}

impl Taken {
    /// `None` when nothing waits and nothing runs.
    fn take(world: &World, t: u64, server: &crate::Config) -> Option<Taken> {
        let pending = world
            .jobs
            .values()
            .filter(|j| j.state == JobState::Pending)
            .count();
        // Fair share charges what runs whether or not anything waits;
        // nothing to do only when nothing runs either.
        if pending == 0 && !world.jobs.values().any(|j| j.state.allocated()) {
            return None;
        }
        let snap = snapshot(world, t);
        let history = world.history.to_core(&snap.queues);
        Some(Taken {
            snap,
            history,
            cfg: config(server),
            t,
            pending,
            shapes: world
                .nodes
                .iter()
                .map(|(name, n)| (name.clone(), shape(n)))
                .collect(),
            versions: world
                .jobs
                .values()
                .filter(|j| j.state == JobState::Pending || j.state.allocated())
                .map(|j| (j.id, (j.state, j.attempts)))
                .collect(),
            history_saved_at: world.history_saved_at,
        })
    }

    /// Phase 2: the core's cycle. CPU work: run it off the async runtime.
    fn compute(mut self) -> Computed {
        let t = self.t;
        self.history.account(
            t,
            self.cfg.usage_half_life,
            &self.snap.running,
            &self.snap.queues,
        );
        let plan = (self.pending > 0).then(|| self.snap.schedule(t, &mut self.history, &self.cfg));
        // GPUs left free after this cycle's admissions that waiting work
        // could hold, quota aside: the first rule of the product, measured.
        let idle_waiting_milli = plan.as_ref().map_or(0, |plan| {
            let admitted: std::collections::BTreeSet<_> =
                plan.admitted.iter().map(|(id, ..)| *id).collect();
            let waiting = self
                .snap
                .pending
                .iter()
                .filter(|w| !admitted.contains(&w.job.id));
            schedule::could_hold(&mut self.snap.placer, waiting, IDLE_WAITING_SHAPES)
                .iter()
                .map(|(_, m)| m)
                .sum()
        });
        let history = crate::state::SavedHistory::from_core(&self.history, &self.snap.queues);
        Computed {
            plan,
            history,
            idle_waiting_milli,
            taken: self,
        }
    }
}

/// Failed job shapes after which the idle-while-waiting measure stops
/// trying (it is then a lower bound), so that it stays cheap on a long
/// backlog of many shapes.
const IDLE_WAITING_SHAPES: usize = 256;

/// Phase 2's output.
struct Computed {
    plan: Option<schedule::Plan>,
    history: crate::state::SavedHistory,
    /// Milli-GPUs free after the cycle that waiting work could hold, quota aside.
    idle_waiting_milli: u64,
    taken: Taken,
}

/// What a cycle decided and the applier kept, ready to commit.
struct Applied {
    change: Change,
    history: crate::state::SavedHistory,
    history_saved: bool,
    whys: Vec<(u64, api::Why)>,
    unreached: std::collections::BTreeSet<u64>,
    pending: usize,
    admitted: usize,
    preempted: usize,
    /// GPU-hours the preemptions lose (since the victims' checkpoints).
    lost_gpu_hours: f64,
    /// Decisions dropped because what they were made on changed meanwhile.
    stale: usize,
    running: usize,
    idle_waiting_milli: u64,
}

impl Computed {
    /// Phase 3: the decisions that still hold, as a change.
    fn apply(self, world: &World, t: u64) -> Applied {
        let Computed {
            plan,
            history,
            idle_waiting_milli,
            taken,
        } = self;
        let mut change = Change::default();
        let mut stale = 0;
        // The job as it was at the snapshot, if it still is.
        let same = |id: u64| -> Option<JobRec> {
            let j = world.jobs.get(&id)?;
            (taken.versions.get(&id) == Some(&(j.state, j.attempts))).then(|| j.clone())
        };
        let unchanged =
            |node: &str| world.nodes.get(node).map(shape).as_ref() == taken.shapes.get(node);
        for (id, _, reason) in &taken.snap.evicted {
            let Some(mut j) = same(*id) else {
                continue;
            };
            if let Some(kind) = lifecycle::evict(&mut j, t, reason) {
                change.event(t, Some(j.id), &j.team, kind, j.reason.clone());
                change.job(j);
            }
        }
        let preempting = plan.as_ref().is_some_and(|p| !p.preempted.is_empty());
        // Decayed usage is written now and then (and with every preemption,
        // which disruption budgets count), so a restart keeps fair share.
        let history_saved = preempting || t >= taken.history_saved_at + 60;
        if history_saved {
            change.batch.put.push(history.record());
        }
        let Some(plan) = plan else {
            return Applied {
                change,
                history,
                history_saved,
                whys: taken.snap.blocked,
                unreached: Default::default(),
                pending: 0,
                admitted: 0,
                preempted: 0,
                lost_gpu_hours: 0.0,
                stale,
                running: taken.snap.running.len(),
                idle_waiting_milli,
            };
        };
        let snap = &taken.snap;
        let mut admitted = 0;
        for (id, flavor, placement) in &plan.admitted {
            let nodes_unchanged = placement
                .iter()
                .all(|a| unchanged(&snap.node_names[a.node.0 as usize]));
            let Some(mut j) =
                same(id.0).filter(|j| j.state == JobState::Pending && nodes_unchanged)
            else {
                stale += 1;
                continue;
            };
            let allocs = placement
                .iter()
                .map(|a| {
                    let node = snap.node_names[a.node.0 as usize].clone();
                    let pick: crate::state::Pick = a.pick.into();
                    let gpu_uuids = world
                        .nodes
                        .get(&node)
                        .map(|n| Alloc::uuids_of(&pick, &n.inventory))
                        .unwrap_or_default();
                    Alloc {
                        group: a.task.group,
                        index: a.task.index,
                        node,
                        cpu_milli: a.cpu.0,
                        mem_mib: a.mem.0,
                        pick,
                        gpu_uuids,
                    }
                })
                .collect();
            let kind = lifecycle::admit(&mut j, flavor, allocs, t);
            change.event(t, Some(j.id), &j.team, kind, j.reason.clone());
            // Placed where its CPU and memory are not held to its spec: said,
            // not silent.
            let mut unlimited: Vec<&str> = j
                .allocs
                .iter()
                .map(|a| a.node.as_str())
                .filter(|n| {
                    world
                        .nodes
                        .get(*n)
                        .is_some_and(|n| !n.inventory.limits.enforced())
                })
                .collect();
            unlimited.dedup();
            for n in unlimited {
                let note = &world.nodes[n].inventory.limits.note;
                change.event(
                    t,
                    Some(j.id),
                    &j.team,
                    EventKind::NoLimits,
                    format!("runs on node {n} without CPU and memory limits: {note}"),
                );
            }
            change.job(j);
            admitted += 1;
        }
        let mut preempted = 0;
        let mut lost_gpu_hours = 0.0;
        for p in &plan.preempted {
            let Some(mut j) = same(p.victim.0).filter(|j| j.state != JobState::Stopping) else {
                stale += 1;
                continue;
            };
            let why = match p.reason {
                schedule::PreemptReason::Reclaim => "its queue's guarantee is reclaimed",
                schedule::PreemptReason::Priority => {
                    "a higher-priority job of its queue needs the GPUs"
                }
                schedule::PreemptReason::Consolidation => {
                    "moved to make room for a job no node could take (it fits on another node)"
                }
            };
            let kind = lifecycle::preempt(&mut j, p.by.0, why, p.kill_at, p.lost_gpu_hours);
            change.event(t, Some(j.id), &j.team, kind, j.reason.clone());
            change.job(j);
            preempted += 1;
            lost_gpu_hours += p.lost_gpu_hours;
        }
        let unreached = plan
            .pending
            .iter()
            .filter(|p| {
                p.reasons
                    .iter()
                    .all(|r| matches!(r, schedule::PendingReason::NotReached { .. }))
            })
            .map(|p| p.job.0)
            .collect();
        let mut lenders = BTreeMap::new();
        let whys = plan
            .pending
            .iter()
            .map(|p| {
                let mut reasons: Vec<String> = p.reasons.iter().map(|r| r.describe(t)).collect();
                // Waiting on quota, or for a guarantee lent to others: who
                // holds the capacity over their guarantee, and from when
                // their work may be reclaimed.
                for r in &p.reasons {
                    if let schedule::PendingReason::Quota { flavor, .. }
                    | schedule::PendingReason::GuaranteeLent { flavor, .. } = r
                    {
                        let line = lenders
                            .entry(flavor.to_string())
                            .or_insert_with(|| borrowers(world, flavor, t, &taken.cfg));
                        if let Some(line) = line {
                            reasons.push(line.clone());
                        }
                    }
                }
                // Nodes kept by reservations it is not in: which, until when.
                // The core's estimate counts their GPUs as free (a taint is
                // the job's, not the cluster's): an estimate of "now" is
                // not, and the first window to end is when it may start.
                let mut eta = p.eta;
                let tainted = p.reasons.iter().any(|r| {
                    matches!(r, schedule::PendingReason::Placement { unplaced, .. }
                        if unplaced.rejections.iter().any(|(x, _)| *x == gpuflow_core::placement::Reject::Taint))
                });
                if tainted {
                    let mut ends = None;
                    for r in world.reservations.values().filter(|r| r.end > t) {
                        reasons.push(format!(
                            "{} holds {} from {} until {}",
                            r.purpose(),
                            r.nodes.join(", "),
                            crate::when(r.start),
                            crate::when(r.end)
                        ));
                        if r.open(t) {
                            ends = Some(ends.map_or(r.end, |e: u64| e.min(r.end)));
                        }
                    }
                    if let Some(end) = ends
                        && eta.is_none_or(|e| e <= t)
                    {
                        eta = Some(end);
                    }
                }
                let summary = reasons
                    .first()
                    .cloned()
                    .unwrap_or_else(|| "waiting for the next cycle".into());
                (
                    p.job.0,
                    api::Why {
                        id: p.job.0,
                        state: JobState::Pending,
                        summary,
                        reasons,
                        position: Some(p.position),
                        eta,
                    },
                )
            })
            .chain(taken.snap.blocked.iter().cloned())
            .collect();
        Applied {
            change,
            history,
            history_saved,
            whys,
            unreached,
            pending: taken.pending,
            admitted,
            preempted,
            lost_gpu_hours,
            stale,
            running: taken.snap.running.len(),
            idle_waiting_milli,
        }
    }
}

/// The core's configuration for the server's cycles.
fn config(server: &crate::Config) -> Config {
    Config {
        min_runtime: server.min_runtime_s,
        max_unsaved: server.max_unsaved_s,
        consolidate_max_unsaved: server.consolidate_max_unsaved_s,
        lease_horizon: server.lease_horizon_s,
        disruption_budget: server.disruption_budget,
        disruption_max_jobs: server.disruption_max_jobs,
        budget_patience: server.budget_patience_s,
        tries_per_cycle: server.tries_per_cycle,
        classes: classes(),
        ..Config::default()
    }
}

/// The core's priority classes: the four gpuflow ships with, then each
/// again for the jobs of a project whose budget is spent and stops
/// borrowing (same rank, but held to its queue's guarantee).
fn classes() -> Vec<schedule::PriorityClass> {
    let base = schedule::default_classes();
    let spent = base.iter().map(|c| schedule::PriorityClass {
        name: format!("{} (project budget spent)", c.name),
        may_borrow: false,
        may_lease: false,
        ..c.clone()
    });
    base.clone().into_iter().chain(spent).collect()
}

/// Projects whose budget is spent: what happens to their pending jobs,
/// and why in words.
type Spent = BTreeMap<String, (api::WhenExhausted, String)>;

fn spent_projects(world: &World, t: u64) -> Spent {
    world
        .projects
        .values()
        .filter_map(|p| {
            let b = p.budget.as_ref()?;
            let u = crate::accounting::budget_use(b, world.project_budget_used.get(&p.name), t);
            if !u.exhausted {
                return None;
            }
            let next = crate::accounting::period_start(b.period, u.period_start + 31 * 86_400);
            let renews = crate::when(next);
            let amount = match b.cost {
                Some(c) => format!("{c} {}", world.prices.currency).trim_end().to_string(),
                None => format!("{} GPU-hours", b.limit()),
            };
            let period = match b.period {
                api::BudgetPeriod::Day => "day",
                api::BudgetPeriod::Week => "week",
                api::BudgetPeriod::Month => "month",
            };
            let effect = match b.when_exhausted {
                api::WhenExhausted::StopAdmitting => "its jobs start no new work",
                api::WhenExhausted::StopBorrowing => {
                    "its jobs may not borrow beyond their queue's guarantee"
                }
            };
            Some((
                p.name.clone(),
                (
                    b.when_exhausted,
                    format!(
                        "project {}'s budget of {amount} a {period} is used up ({effect}); it renews at {renews}",
                        p.name
                    ),
                ),
            ))
        })
        .collect()
}

/// Holds a job to its project's spent budget: `Some(reason)` when it may
/// not start at all; a job of a project that may not borrow (pending or
/// running: together they are held to the queue's guarantee) gets its
/// class's twin that may not.
fn budget_gate(j: &JobRec, work: &mut Workload, spent: &Spent) -> Option<String> {
    let (when, reason) = spent.get(j.spec.project.as_deref()?)?;
    match when {
        api::WhenExhausted::StopAdmitting => Some(reason.clone()),
        api::WhenExhausted::StopBorrowing => {
            let base = schedule::default_classes().len();
            if work.class < base {
                work.class += base;
            }
            None
        }
    }
}

/// A snapshot of the committed state to examine without changing anything:
/// taken under the lock, examined without it (off the async runtime), by
/// `why`'s diagnosis and by test-only submissions.
pub struct Trial {
    snap: Snapshot,
    history: schedule::History,
    cfg: Config,
    t: u64,
}

impl Trial {
    /// Takes the snapshot (the only part that needs the state lock).
    pub fn take(world: &World, t: u64, server: &crate::Config) -> Trial {
        let snap = snapshot(world, t);
        let history = world.history.to_core(&snap.queues);
        Trial {
            snap,
            history,
            cfg: config(server),
            t,
        }
    }

    /// Every reason pending job `id` would wait for if its turn came now
    /// (`gpuflow_core::schedule::diagnose`), in words; empty when it would
    /// start. `None` when the core is not asked about it (not pending, or
    /// blocked before scheduling).
    pub fn diagnose(mut self, id: u64) -> Option<Vec<String>> {
        let reasons = schedule::diagnose(
            gpuflow_core::schedule::Snapshot {
                now: self.t,
                placer: &mut self.snap.placer,
                queues: &mut self.snap.queues,
                running: &self.snap.running,
                pending: &self.snap.pending,
                cfg: &self.cfg,
            },
            &self.history,
            JobId(id),
        )?;
        Some(reasons.iter().map(|r| r.describe(self.t)).collect())
    }

    /// The cycle the server would run now with `candidate` (not stored)
    /// among the pending jobs: where it would start, or why it would wait.
    pub fn test_only(mut self, candidate: &JobRec) -> api::TestOnly {
        let classes = classes();
        if let Some(mut w) = workload(candidate, &self.snap.queues, &classes) {
            if let Some(reason) = budget_gate(candidate, &mut w, &self.snap.spent) {
                return api::TestOnly {
                    would_start: false,
                    nodes: vec![],
                    reasons: vec![reason],
                    eta: None,
                };
            }
            self.snap.pending.push(w);
        }
        let plan = self.snap.schedule(self.t, &mut self.history, &self.cfg);
        let job = JobId(candidate.id);
        if let Some((_, _, placement)) = plan.admitted.iter().find(|(id, _, _)| *id == job) {
            let mut nodes: Vec<String> = placement
                .iter()
                .map(|a| self.snap.node_names[a.node.0 as usize].clone())
                .collect();
            nodes.dedup();
            return api::TestOnly {
                would_start: true,
                nodes,
                reasons: vec![],
                eta: Some(self.t),
            };
        }
        let pending = plan.pending.iter().find(|p| p.job == job);
        api::TestOnly {
            would_start: false,
            nodes: vec![],
            reasons: pending.map_or_else(Vec::new, |p| {
                p.reasons.iter().map(|r| r.describe(self.t)).collect()
            }),
            eta: pending.and_then(|p| p.eta),
        }
    }
}

/// Node and job timers.
fn timers(world: &World, cfg: &crate::Config, t: u64) -> Change {
    let mut change = Change::default();
    for n in world.nodes.values() {
        if n.state != NodeState::Lost && n.last_heartbeat + cfg.node_timeout_s < t {
            let mut n = n.clone();
            n.state = NodeState::Lost;
            change.event(
                t,
                None,
                "",
                EventKind::NodeLost,
                format!(
                    "node {} lost: no heartbeat for {} s",
                    n.name,
                    t - n.last_heartbeat
                ),
            );
            change.nodes.insert(n.name.clone(), n);
        }
    }
    let lost = |name: &str| {
        change
            .nodes
            .get(name)
            .or_else(|| world.nodes.get(name))
            .is_none_or(|n| n.state == NodeState::Lost)
    };
    let mut jobs = Vec::new();
    let mut idle = Vec::new();
    for j in world.jobs.values().filter(|j| j.state.allocated()) {
        let mut next = j.clone();
        let kind = match j.allocs.iter().map(|a| a.node.as_str()).find(|n| lost(n)) {
            Some(node) => Some(lifecycle::node_lost(&mut next, node, t)),
            None => lifecycle::max_runtime(&mut next, t),
        };
        if let Some(kind) = kind {
            jobs.push((next, kind));
            continue;
        }
        // Idle GPUs: a warning, then the job's idle action.
        if let Some((kind, message)) = lifecycle::idle(&mut next, t) {
            idle.push((next, Some((kind, message))));
        } else if next.idle_warned_at != j.idle_warned_at {
            idle.push((next, None));
        }
    }
    for (j, kind) in jobs {
        if kind == EventKind::LifetimeReached {
            tracing::info!(job = j.id, team = %j.team, reason = %j.reason, "notebook reclaimed");
        }
        change.event(t, Some(j.id), &j.team, kind, j.reason.clone());
        change.job(j);
    }
    // Services: replicas made and stopped to match their size and version;
    // a replica the timers changed above waits for the next cycle.
    let services = crate::services::reconcile(world, t);
    let events: Vec<_> = services
        .batch
        .events
        .into_iter()
        .filter(|e| e.job.is_none_or(|id| !change.jobs.contains_key(&id)))
        .collect();
    change.batch.events.extend(events);
    for (id, j) in services.jobs {
        change.jobs.entry(id).or_insert(j);
    }
    // Dependencies met, or never to be met.
    for (j, event) in crate::depend::settle(world, t) {
        if change.jobs.contains_key(&j.id) {
            continue;
        }
        if let Some((kind, message)) = event {
            change.event(t, Some(j.id), &j.team, kind, message);
        }
        change.job(j);
    }
    for (j, event) in idle {
        if let Some((kind, message)) = event {
            if kind == EventKind::IdleStop {
                tracing::info!(job = j.id, team = %j.team, %message, "idle GPUs reclaimed");
            }
            change.event(t, Some(j.id), &j.team, kind, message);
        }
        change.job(j);
    }
    change
}

/// The committed state as the core sees it.
#[derive(Clone)]
pub struct Snapshot {
    pub placer: Placer,
    pub queues: Queues,
    pub running: Vec<Running>,
    pub pending: Vec<Workload>,
    pub node_names: Vec<String>,
    /// Pending jobs the core is not asked about, with the reason.
    pub blocked: Vec<(u64, api::Why)>,
    /// Allocated jobs whose allocation no longer fits their node: (job,
    /// node, reason).
    pub evicted: Vec<(u64, String, String)>,
    /// Tests only: a fault injected before the core runs.
    pub fault: Option<crate::Fault>,
    /// Projects whose budget is spent.
    pub spent: Spent,
}

impl Snapshot {
    /// The core's cycle on this snapshot.
    fn schedule(
        &mut self,
        t: u64,
        history: &mut schedule::History,
        cfg: &Config,
    ) -> schedule::Plan {
        if let Some(fault) = &self.fault {
            let ids: Vec<u64> = self.pending.iter().map(|w| w.job.id.0).collect();
            (fault.0)(&ids);
        }
        schedule::schedule(
            gpuflow_core::schedule::Snapshot {
                now: t,
                placer: &mut self.placer,
                queues: &mut self.queues,
                running: &self.running,
                pending: &self.pending,
                cfg,
            },
            history,
        )
    }
}

/// Each GPU's NVLink island on its node, as the smallest index of the GPUs
/// it reaches over NVLink directly or through others (connected
/// components of the peer lists, taken both ways); `None` for a GPU with no
/// NVLink peer.
fn nvlink_islands(inv: &api::Inventory) -> Vec<Option<usize>> {
    let n = inv.gpus.len();
    let mut root: Vec<usize> = (0..n).collect();
    fn find(root: &mut [usize], mut i: usize) -> usize {
        while root[i] != i {
            root[i] = root[root[i]];
            i = root[i];
        }
        i
    }
    let mut linked = vec![false; n];
    for (i, g) in inv.gpus.iter().enumerate() {
        for &j in &g.nvlink {
            let j = j as usize;
            if j < n && j != i {
                linked[i] = true;
                linked[j] = true;
                let (a, b) = (find(&mut root, i), find(&mut root, j));
                root[a.max(b)] = a.min(b);
            }
        }
    }
    (0..n)
        .map(|i| linked[i].then(|| find(&mut root, i)))
        .collect()
}

/// Builds the core's view. Rebuilt each cycle: cheap at the sizes a single
/// server runs, and never out of step with the committed state.
///
/// Committed allocations are never treated as free: one that no longer fits
/// its node (the node reports less memory, a GPU vanished) keeps what it
/// could claim, its node takes no new work in this snapshot, and the job is
/// listed in `evicted` so the cycle stops and requeues it with the reason.
pub fn snapshot(world: &World, t: u64) -> Snapshot {
    let mut shrunk = std::collections::BTreeSet::new();
    loop {
        let snap = snapshot_with(world, t, &shrunk);
        let before = shrunk.len();
        shrunk.extend(snap.evicted.iter().map(|(_, node, _)| node.clone()));
        if shrunk.len() == before {
            return snap;
        }
    }
}

fn snapshot_with(world: &World, t: u64, shrunk: &std::collections::BTreeSet<String>) -> Snapshot {
    // Nodes, in name order; the core's node id is the index.
    let node_names: Vec<String> = world.nodes.keys().cloned().collect();
    let node_id: BTreeMap<&str, NodeId> = node_names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), NodeId(i as u32)))
        .collect();
    let mut nodes = Vec::new();
    let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
    for (i, n) in world.nodes.values().enumerate() {
        let inv = &n.inventory;
        let islands = nvlink_islands(inv);
        let gpus: Vec<Gpu> = inv
            .gpus
            .iter()
            .enumerate()
            .map(|(gi, g)| {
                let mut gpu = Gpu::plain(&g.model, MemMib(g.memory_mib));
                // An unhealthy GPU takes no new work.
                if g.unhealthy.is_some() {
                    gpu.health = model::GpuHealth::Unhealthy;
                }
                gpu.numa = g.numa.map_or(0, |n| n.min(u8::MAX as u32) as u8);
                gpu.nvlink = islands[gi].map(|k| format!("{}/nvl{k}", n.name));
                // A GPU in MIG mode is allocated by instance, whole.
                gpu.mig = g
                    .mig
                    .iter()
                    .map(|m| model::MigInstance {
                        profile: m.profile.clone(),
                        mem: MemMib(m.memory_mib),
                    })
                    .collect();
                gpu
            })
            .collect();
        let mut node = Node::new(
            i as u32,
            &n.name,
            CpuMilli(inv.cpu_milli),
            MemMib(inv.memory_mib),
            gpus,
        );
        node.pool = if inv.pool.is_empty() {
            "default".into()
        } else {
            inv.pool.clone()
        };
        node.labels = inv.labels.clone();
        // A reservation not over keeps its nodes: only its jobs (while it
        // is open) and jobs that end before it starts tolerate it.
        for r in world.reservations.values().filter(|r| r.end > t) {
            if r.nodes.contains(&n.name) {
                let key = reservation_key(&r.name);
                node.taints.push(model::Taint {
                    key: key.clone(),
                    value: String::new(),
                });
                node.labels.insert(key, "1".into());
            }
        }
        // Topology from the agent's labels (`--label rack=r1 --label block=b1`).
        node.rack = inv.labels.get("rack").cloned();
        node.block = inv.labels.get("block").cloned();
        node.state = match n.state {
            _ if shrunk.contains(&n.name) => model::NodeState::Cordoned,
            NodeState::Ready => model::NodeState::Ready,
            NodeState::Cordoned => model::NodeState::Cordoned,
            NodeState::Draining => model::NodeState::Draining,
            NodeState::Lost => model::NodeState::Lost,
        };
        if n.state != NodeState::Lost {
            for g in &inv.gpus {
                *capacity.entry(g.model.clone()).or_default() += 1000;
            }
        }
        nodes.push(node);
    }
    let aside = set_aside_queues(world);
    let queues = build_queues(world, &capacity, &aside, t);
    let cluster = Cluster::new(nodes).expect("node ids are their indices");
    // The placement keeps room for the shapes of the work that waits
    // (docs/benchmarks.md, "The placement's mix is what waits"); each
    // replica of a task group counts, as the pods of a gang would.
    let requests: Vec<(TaskRequest, u32)> = world
        .jobs
        .values()
        .filter(|j| j.state == JobState::Pending)
        .flat_map(|j| j.spec.tasks.iter().map(|g| (task_request(g), g.replicas)))
        .collect();
    let mix = WorkloadMix::from_counted(
        requests.iter().map(|(r, n)| (r, *n)),
        MixWeighting::Tasks,
        1.0,
    );
    let mut placer = Placer::new(cluster, Policy::gpuflow(), mix, 0);
    let mut queues = queues;
    let classes = classes();
    let spent = spent_projects(world, t);
    let singles = crate::depend::Singles::of(world);
    // Arrays with a limit: how many elements hold resources now; pending
    // elements go to the core, in id order, only up to the limit.
    let mut array_slots: BTreeMap<u64, u32> = BTreeMap::new();
    for j in world.jobs.values().filter(|j| j.state.allocated()) {
        if let Some(a) = &j.array {
            *array_slots.entry(a.id).or_default() += 1;
        }
    }
    let mut running = Vec::new();
    let mut pending = Vec::new();
    let mut blocked = Vec::new();
    let mut evicted = Vec::new();
    for j in world.jobs.values() {
        let work = workload(j, &queues, &classes).map(|mut w| {
            w.expected_runtime = world.runtimes.expect(&j.user, &j.spec.kind);
            w
        });
        if j.state.allocated() {
            // GPUs are found by UUID: one the node no longer reports evicts
            // the job; one that moved in the inventory is followed.
            let mut gone = None;
            let allocations: Vec<Allocation> = j
                .allocs
                .iter()
                .filter_map(|a| {
                    let node = *node_id.get(a.node.as_str())?;
                    let inv = &world.nodes[&a.node].inventory;
                    let pick = match a.current_pick(inv) {
                        Ok(p) => p,
                        Err(e) => {
                            gone.get_or_insert((a.node.clone(), e));
                            return None;
                        }
                    };
                    // Work on a GPU that turned unhealthy is stopped and
                    // requeued; the GPU stays held until it is gone.
                    if let Some(why) = a.unhealthy_gpu(inv) {
                        gone.get_or_insert((a.node.clone(), why));
                    }
                    Some(Allocation {
                        task: TaskId {
                            job: JobId(j.id),
                            group: a.group,
                            index: a.index,
                        },
                        node,
                        cpu: CpuMilli(a.cpu_milli),
                        mem: MemMib(a.mem_mib),
                        gpu: task_request(&j.spec.tasks[a.group as usize]).gpu,
                        pick: pick.into(),
                    })
                })
                .collect();
            // An evicted job counts in its queue's quota until it is gone,
            // as a stopping one does: its GPUs are not free yet.
            let charge = |queues: &mut Queues| {
                if let Some(work) = &work
                    && !j.flavor.is_empty()
                {
                    queues.charge(work.queue, &j.flavor, work.gpu_milli() as i64);
                }
            };
            if let Some((node, reason)) = gone {
                // What it still holds elsewhere stays held until it stops.
                let _ = placer.apply(&allocations);
                tracing::warn!(job = j.id, %reason, "evicting");
                charge(&mut queues);
                evicted.push((j.id, node, reason));
                continue;
            }
            if let Err(a) = placer.apply(&allocations) {
                let node = node_names[a.node.0 as usize].clone();
                let inv = &world.nodes[&node].inventory;
                let reason = format!(
                    "node {node} no longer holds its allocation: it reports {} GPUs, {} milli-CPU and {} MiB",
                    inv.gpus.len(),
                    inv.cpu_milli,
                    inv.memory_mib
                );
                tracing::warn!(job = j.id, task = %a.task, %reason, "evicting");
                charge(&mut queues);
                evicted.push((j.id, node, reason));
                continue;
            }
            // A running job whose queue is gone still holds its GPUs (applied
            // above); it is just not the core's to preempt.
            let Some(mut work) = work else {
                continue;
            };
            // Running work goes on whatever its project's budget says; it
            // only counts as the project's.
            let _ = budget_gate(j, &mut work, &spent);
            if !j.flavor.is_empty() {
                queues.charge(work.queue, &j.flavor, work.gpu_milli() as i64);
            }
            running.push(Running {
                work,
                flavor: j.flavor.clone(),
                allocations,
                started: j.started_at.unwrap_or(t),
                last_checkpoint: j.last_checkpoint,
                stopping_at: (j.state == JobState::Stopping).then(|| j.kill_at.unwrap_or(t)),
            });
        } else if j.state == JobState::Pending {
            let Some(mut work) = work else {
                let reason = match aside.get(&j.spec.queue) {
                    Some(r) => format!("queue {:?} is set aside: {r}", j.spec.queue),
                    None => format!("queue {:?} does not exist (any more)", j.spec.queue),
                };
                blocked.push((j.id, why(j, reason)));
                continue;
            };
            if let Some(nb) = j.not_before.filter(|&nb| nb > t) {
                blocked.push((
                    j.id,
                    why(
                        j,
                        format!("retrying after a failure; not before {}", crate::when(nb)),
                    ),
                ));
                continue;
            }
            if let Some(reason) = crate::depend::reason(world, j, &singles) {
                blocked.push((j.id, why(j, reason)));
                continue;
            }
            if let Err(w) = reservations(world, j, &mut work, t) {
                blocked.push((j.id, w));
                continue;
            }
            // A task in an image runs only where the node can run images.
            if j.spec.tasks.iter().any(|g| g.image.is_some()) {
                work.job
                    .constraints
                    .node_selector
                    .insert(api::OCI_LABEL.into(), "true".into());
            }
            if let Some(reason) = budget_gate(j, &mut work, &spent) {
                blocked.push((j.id, why(j, reason)));
                continue;
            }
            if let (Some(a), Some(limit)) = (
                &j.array,
                j.spec.array.as_deref().and_then(api::ArraySpec::limit_of),
            ) {
                let taken = array_slots.entry(a.id).or_default();
                if *taken >= limit {
                    blocked.push((
                        j.id,
                        why(
                            j,
                            format!(
                                "array {} runs at most {limit} elements at once (%{limit}); the next starts when one ends",
                                a.id
                            ),
                        ),
                    ));
                    continue;
                }
                *taken += 1;
            }
            pending.push(work);
        }
    }
    Snapshot {
        placer,
        queues,
        running,
        pending,
        node_names,
        blocked,
        evicted,
        fault: None,
        spent,
    }
}

/// The taint and label key of reservation `name` on its nodes.
fn reservation_key(name: &str) -> String {
    format!("gpuflow.io/reservation-{name}")
}

/// What reservations let pending job `j` do: its own, once open, keeps it
/// on that reservation's nodes; others' nodes take it only if it ends
/// before they start. A job waiting for its reservation to open, or whose
/// reservation is gone, is held back with the reason.
fn reservations(world: &World, j: &JobRec, work: &mut Workload, t: u64) -> Result<(), api::Why> {
    let c = &mut work.job.constraints;
    for r in world.reservations.values().filter(|r| r.end > t) {
        let mine = j.spec.reservation.as_deref() == Some(r.name.as_str());
        let ends_before = j
            .spec
            .max_runtime_s
            .is_some_and(|m| !r.open(t) && t.saturating_add(m) <= r.start);
        if (mine && r.open(t)) || (!mine && ends_before) {
            c.tolerations.push(reservation_key(&r.name));
        }
        if mine && r.open(t) {
            c.node_selector.insert(reservation_key(&r.name), "1".into());
        }
    }
    let Some(name) = &j.spec.reservation else {
        return Ok(());
    };
    let reason = match world.reservations.get(name) {
        None => format!(
            "its reservation {name:?} no longer exists: cancel it, or submit it again without one"
        ),
        Some(r) if r.end <= t => format!(
            "its reservation {name:?} ended at {}: cancel it, or submit it again without one",
            crate::when(r.end)
        ),
        Some(r) if r.start > t => {
            let mut w = why(
                j,
                format!(
                    "waits for its reservation {name:?} to open at {} (on {})",
                    crate::when(r.start),
                    r.nodes.join(", ")
                ),
            );
            w.eta = Some(r.start);
            return Err(w);
        }
        Some(_) => return Ok(()),
    };
    Err(why(j, reason))
}

fn why(j: &JobRec, reason: String) -> api::Why {
    api::Why {
        id: j.id,
        state: j.state,
        summary: reason.clone(),
        reasons: vec![reason],
        position: None,
        eta: None,
    }
}

fn milli(gpus: f64) -> u64 {
    (gpus * 1000.0).round() as u64
}

/// Why each queue that cannot be scheduled is set aside (a broken parent
/// chain, a tree deeper than [`api::MAX_QUEUE_DEPTH`], a spec that no longer
/// validates), by name. The edge refuses such queues; this guards the cycle
/// against stored state from older versions or bugs, so one bad queue never
/// stops scheduling for everyone else.
pub fn set_aside_queues(world: &World) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for q in world.queues.values() {
        if let Err(e) = q.validate() {
            out.insert(
                q.name.clone(),
                format!("its spec is invalid ({})", e.message),
            );
            continue;
        }
        let mut name = q.name.as_str();
        let mut depth = 1;
        while let Some(p) = world.queues.get(name).and_then(|q| q.parent.as_deref()) {
            depth += 1;
            if !world.queues.contains_key(p) {
                out.insert(
                    q.name.clone(),
                    format!("its parent queue {p:?} does not exist"),
                );
                break;
            }
            if depth > api::MAX_QUEUE_DEPTH {
                out.insert(
                    q.name.clone(),
                    format!(
                        "the queue tree above it is deeper than {} levels (or loops)",
                        api::MAX_QUEUE_DEPTH
                    ),
                );
                break;
            }
            name = p;
        }
    }
    // Below a set-aside queue, everything is set aside too (the walks above
    // ended within MAX_QUEUE_DEPTH for every queue not yet in `out`).
    let mut below = BTreeMap::new();
    for q in world.queues.values().filter(|q| !out.contains_key(&q.name)) {
        let mut p = q.parent.as_deref();
        while let Some(name) = p {
            if out.contains_key(name) {
                below.insert(
                    q.name.clone(),
                    format!("its ancestor queue {name:?} is set aside"),
                );
                break;
            }
            p = world.queues.get(name).and_then(|q| q.parent.as_deref());
        }
    }
    out.extend(below);
    out
}

/// The queue tree, parents before children, with quotas in milli-GPU.
/// Queues set aside (see [`set_aside_queues`]) are left out, with their
/// subtrees, so their jobs wait with that reason. Budgets stand as they
/// do at `t`.
fn build_queues(
    world: &World,
    capacity: &BTreeMap<String, u64>,
    aside: &BTreeMap<String, String>,
    t: u64,
) -> Queues {
    let depth = |name: &str| {
        let mut name = name;
        let mut d = 0;
        while let Some(p) = world.queues.get(name).and_then(|q| q.parent.as_deref()) {
            d += 1;
            name = p;
        }
        d
    };
    let mut specs: Vec<&api::QueueSpec> = world
        .queues
        .values()
        .filter(|q| !aside.contains_key(&q.name))
        .collect();
    specs.sort_by_key(|q| (depth(&q.name), q.name.clone()));
    let index: BTreeMap<&str, QueueId> = specs
        .iter()
        .enumerate()
        .map(|(i, q)| (q.name.as_str(), QueueId(i as u32)))
        .collect();
    let list = specs
        .iter()
        .map(|s| {
            let mut q = Queue::new(
                &s.name,
                s.parent.as_deref().and_then(|p| index.get(p).copied()),
            );
            q.weight = s.weight;
            q.state = match s.state {
                api::QueueState::Open => gpuflow_core::queue::QueueState::Open,
                api::QueueState::Held => gpuflow_core::queue::QueueState::Held,
                api::QueueState::Draining => gpuflow_core::queue::QueueState::Draining,
            };
            q.set_quotas(capacity.keys(), &s.quotas, |qs| FlavorQuota {
                guaranteed: milli(qs.guaranteed),
                borrow_limit: qs.borrow_limit.map(milli),
                lend_limit: qs.lend_limit.map(milli),
                cap: qs.cap.map(milli),
            });
            q.user_limits = UserLimits {
                max_gpu_milli: s.user_limits.max_gpus.map(milli),
                max_running: s.user_limits.max_running,
            };
            q.budget = s
                .budget
                .as_ref()
                .map(|b| crate::accounting::core_budget(b, world.budget_used.get(&s.name), t));
            q
        })
        .collect();
    // Set-aside queues are gone, so every parent left is built before its
    // children; should that ever not hold, no queue is scheduled this cycle
    // rather than the loop stopping.
    Queues::new(list, capacity.clone()).unwrap_or_else(|e| {
        tracing::error!(error = %e, "the queue tree does not build; no queue is scheduled this cycle");
        Queues::new(Vec::new(), capacity.clone()).expect("an empty tree builds")
    })
}

/// What a job counts in quota and fair share, in milli-GPU (MIG instances
/// and time slices by their equivalents, as the core counts them).
pub fn quota_milli(spec: &api::JobSpec) -> u64 {
    spec.tasks
        .iter()
        .map(|g| task_request(g).gpu.quota_milli() * g.replicas as u64)
        .sum()
}

/// A task group's request as the core sees it.
pub fn task_request(g: &gpuflow_api::TaskGroupSpec) -> TaskRequest {
    let r = &g.resources;
    let gpu = match &r.gpu {
        None => GpuRequest::None,
        Some(s) => match s.mode {
            api::GpuMode::Whole => GpuRequest::Whole {
                count: s.count.unwrap_or(1).min(u8::MAX as u32) as u8,
            },
            api::GpuMode::Mig => GpuRequest::Mig {
                profile: s.profile.clone().unwrap_or_default(),
            },
            api::GpuMode::Fraction => GpuRequest::Fraction {
                milli: GpuMilli(s.milli() as u32),
                mem: MemMib(s.memory_mib.unwrap_or(0)),
            },
            api::GpuMode::TimeSlice => GpuRequest::TimeSlice {
                mem: MemMib(s.memory_mib.unwrap_or(0)),
            },
        },
    };
    TaskRequest {
        cpu: CpuMilli((r.cpu * 1000.0).round() as u64),
        mem: MemMib(r.memory_mib),
        gpu,
        models: r.gpu.as_ref().map(|g| g.models.clone()).unwrap_or_default(),
    }
}

fn workload(j: &JobRec, queues: &Queues, classes: &[schedule::PriorityClass]) -> Option<Workload> {
    let queue = queues.by_name(&j.spec.queue)?;
    let class = classes
        .iter()
        .position(|c| c.name == j.spec.class())
        .unwrap_or(2);
    let constraints = Constraints {
        topology: j.spec.topology.as_ref().map(|t| request::Topology {
            level: match t.level {
                gpuflow_api::job::TopologyLevel::Node => request::TopologyLevel::Node,
                gpuflow_api::job::TopologyLevel::Nvlink => request::TopologyLevel::NvLink,
                gpuflow_api::job::TopologyLevel::Rack => request::TopologyLevel::Rack,
                gpuflow_api::job::TopologyLevel::Block => request::TopologyLevel::Block,
            },
            required: t.required,
        }),
        spread: j.spec.kind == api::Kind::Inference,
        ..Constraints::default()
    };
    Some(Workload {
        job: Job {
            id: JobId(j.id),
            groups: j
                .spec
                .tasks
                .iter()
                .map(|g| TaskGroup {
                    name: g.name.clone(),
                    replicas: g.replicas,
                    request: task_request(g),
                })
                .collect(),
            constraints,
        },
        queue,
        user: j.user.clone(),
        class,
        priority: j.spec.priority,
        submitted: j.submitted_at,
        max_runtime: j.spec.max_runtime_s,
        grace: j.spec.checkpoint.grace_s,
        expected_runtime: None,
    })
}

#[cfg(test)]
mod tests {
    use super::find_culprit;

    #[test]
    fn the_culprit_is_found_by_halving() {
        let items: Vec<usize> = (0..100).collect();
        let mut probes = 0;
        let mut fails = |s: &[usize]| {
            probes += 1;
            s.contains(&37)
        };
        assert_eq!(find_culprit(&items, &mut fails), Some(37));
        assert!(probes <= 16, "{probes} probes for 100 jobs");
        // A failure that needs two jobs together is no single job's fault.
        let mut pair = |s: &[usize]| s.contains(&3) && s.contains(&90);
        assert_eq!(find_culprit(&items, &mut pair), None);
        assert_eq!(find_culprit(&items, &mut |_: &[usize]| false), None);
        assert_eq!(find_culprit(&[], &mut |_: &[usize]| true), None);
    }
}
