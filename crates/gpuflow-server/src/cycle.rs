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
use gpuflow_core::schedule::{self, Config};

use crate::convert::{config, milli, quota_milli};
use crate::event::EventKind;
use crate::lifecycle;
use crate::snapshot::{Snapshot, snapshot};
use crate::state::{Alloc, JobRec, World};
use crate::{Change, Shared};

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
    // One cycle at a time, with what the last one built for reuse.
    let mut reuse = shared.applier.lock().await;
    let t = shared.now();
    let started = Instant::now();
    // Phase 1.
    let taken = {
        let mut world = shared.write().await;
        let change = timers(&world, &shared.cfg, t);
        world = world.commit(change).await?;
        world.prune_finished(t, shared.cfg.keep_finished_s);
        Taken::take(&world, t, &shared.cfg, &mut reuse)?.map(|mut taken| {
            taken.snap.fault = shared.cfg.fault.clone();
            taken
        })
    };
    let Some(taken) = taken else {
        return Ok(());
    };
    let took = started.elapsed();
    // What was not reused is stale: freed now, off the state lock, rather
    // than kept beside this cycle's snapshot until the next.
    // Their room is kept for the next snapshot to build in.
    let (spare, stale) = std::mem::take(&mut *reuse).split_spare();
    tokio::task::spawn_blocking(move || drop(stale));
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
    let mut world = shared.write().await;
    let out = computed.apply(&world, t);
    // What the cycle read is not needed to commit its change: kept for the
    // next cycle where it may reuse it, the rest freed now, off the lock,
    // rather than held beside the change while the store writes it (the
    // peak of a cycle that admits thousands).
    let mut spent = out.spent;
    *reuse = crate::snapshot::Reuse::keep(&mut spent.0.snap);
    reuse.set_spare(spare);
    tokio::task::spawn_blocking(move || drop(spent));
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
    world = world.commit(out.change).await?;
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
    // They are read only while the job is pending, and a job put since
    // the snapshot lost its own (`Change::publish`), so this cycle's
    // replace the last one's whole; those are freed off the lock.
    let old_whys = std::mem::replace(&mut world.why, out.whys);
    world.unreached = out.unreached;
    world.diagnosed.clear();
    drop(world);
    drop(reuse);
    tokio::task::spawn_blocking(move || drop(old_whys));
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
        .jobs()
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
            .records()
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
        let mut snap = snapshot(&world, t)?;
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
    let world = shared.write().await;
    let Some(mut j) = world.jobs().get(&id).cloned() else {
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
    world.commit(change).await.map(drop)
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

/// Phase 1's output: the snapshot and what the applier will re-check.
struct Taken {
    snap: Snapshot,
    history: schedule::History,
    cfg: Config,
    t: u64,
    pending: usize,
    /// Each node's shape revision ([`crate::state::NodeRevs`]) by the
    /// core's node id (the snapshot's `node_names` order).
    shape_revs: Vec<u64>,
    /// (job, state, attempt) at the snapshot, for pending and allocated
    /// jobs, in id order.
    versions: Vec<(u64, JobState, u32)>,
    history_saved_at: u64,
}

impl Taken {
    /// `None` when nothing waits and nothing runs.
    fn take(
        world: &World,
        t: u64,
        server: &crate::Config,
        reuse: &mut crate::snapshot::Reuse,
    ) -> Result<Option<Taken>, crate::ServerError> {
        // Fair share charges what runs whether or not anything waits;
        // nothing to do only when nothing runs either.
        if !world
            .jobs()
            .values()
            .any(|j| j.state == JobState::Pending || j.state.allocated())
        {
            return Ok(None);
        }
        let mut snap = crate::snapshot::snapshot_reusing(world, t, reuse)?;
        let history = world.history.to_core(&snap.queues);
        // Every pending job is either the core's or held back.
        let pending = snap.pending.len() + snap.blocked.len();
        debug_assert_eq!(
            pending,
            world
                .jobs()
                .values()
                .filter(|j| j.state == JobState::Pending)
                .count()
        );
        let versions = std::mem::take(&mut snap.versions);
        Ok(Some(Taken {
            snap,
            history,
            cfg: config(server),
            t,
            pending,
            shape_revs: world.all_node_revs().map(|r| r.shape).collect(),
            versions,
            history_saved_at: world.history_saved_at,
        }))
    }

    /// Phase 2: the core's cycle. CPU work: run it off the async runtime.
    fn compute(mut self) -> Computed {
        let t = self.t;
        // The placer as taken, for the next snapshot to start from: copied
        // here, off the state lock, before the core changes it.
        if self.snap.base_ok {
            self.snap.base = Some(Box::new(crate::snapshot::Base::of(&self.snap)));
        }
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
        let described = plan.as_ref().map_or_else(Vec::new, |plan| {
            plan.pending
                .iter()
                .map(|p| p.reasons.iter().map(|r| r.describe(t)).collect())
                .collect()
        });
        Computed {
            plan,
            described,
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
    /// Each pending job's reasons of the plan, in words: written here, off
    /// the state lock, for the applier's explanations.
    described: Vec<Vec<String>>,
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
    /// Every job pending at the snapshot, by id: why it waits.
    whys: BTreeMap<u64, api::Why>,
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
    /// The snapshot and the plan, spent: freed on a blocking thread once
    /// the state lock is let go, as freeing a large backlog's records
    /// takes a while.
    spent: (Taken, Option<schedule::Plan>),
}

impl Computed {
    /// Phase 3: the decisions that still hold, as a change.
    fn apply(self, world: &World, t: u64) -> Applied {
        let Computed {
            plan,
            described,
            history,
            idle_waiting_milli,
            mut taken,
        } = self;
        let mut change = Change::default();
        let mut stale = 0;
        // The job as it was at the snapshot, if it still is.
        let same = |id: u64| -> Option<JobRec> {
            let j = world.jobs().get(&id)?;
            let at = taken.versions.binary_search_by_key(&id, |v| v.0).ok()?;
            (taken.versions[at] == (id, j.state, j.attempts)).then(|| JobRec::clone(j))
        };
        let names = &taken.snap.node_names;
        let unchanged = |node: &str| {
            let at = names.binary_search_by(|n| n.as_str().cmp(node));
            match (world.nodes().contains_key(node), at) {
                (true, Ok(i)) => world.node_revs(node).shape == taken.shape_revs[i],
                (false, Err(_)) => true,
                _ => false,
            }
        };
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
                whys: std::mem::take(&mut taken.snap.blocked)
                    .into_iter()
                    .collect(),
                unreached: Default::default(),
                pending: 0,
                admitted: 0,
                preempted: 0,
                lost_gpu_hours: 0.0,
                stale,
                running: taken.snap.running.len(),
                idle_waiting_milli,
                spent: (taken, None),
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
                        .nodes()
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
                        .nodes()
                        .get(*n)
                        .is_some_and(|n| !n.inventory.limits.enforced())
                })
                .collect();
            unlimited.dedup();
            for n in unlimited {
                let note = &world.nodes()[n].inventory.limits.note;
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
            .zip(described)
            .map(|(p, mut reasons)| {
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
                    for r in world.records().reservations.values().filter(|r| r.end > t) {
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
            .chain(std::mem::take(&mut taken.snap.blocked))
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
            spent: (taken, Some(plan)),
        }
    }
}

/// Node and job timers.
fn timers(world: &World, cfg: &crate::Config, t: u64) -> Change {
    let mut change = Change::default();
    for n in world.nodes().values() {
        if crate::nodes::overdue(n, cfg.node_timeout_s, t) {
            let mut n = n.clone();
            let (kind, said) = crate::nodes::lost(&mut n, t);
            change.event(t, None, "", kind, said);
            change.nodes.insert(n.name.clone(), n);
        }
    }
    // A job on a node that is lost (or that no record names) lost its node:
    // the nodes that are not, hashed once (jobs are many, nodes fewer).
    let alive: rustc_hash::FxHashSet<&str> = world
        .nodes()
        .values()
        .map(|n| change.nodes.get(&n.name).unwrap_or(n))
        .filter(|n| n.state != NodeState::Lost)
        .map(|n| n.name.as_str())
        .collect();
    let lost = |name: &str| !alive.contains(name);
    let mut jobs = Vec::new();
    let mut idle = Vec::new();
    for j in world.jobs().values().filter(|j| j.state.allocated()) {
        // Most jobs have nothing due: they are read, not copied.
        let on_lost = j.allocs.iter().map(|a| a.node.as_str()).find(|n| lost(n));
        let overrun = j
            .spec
            .max_runtime_s
            .zip(j.started_at)
            .is_some_and(|(max, start)| start.saturating_add(max) <= t);
        if on_lost.is_none() && !overrun && j.spec.idle.is_none() {
            continue;
        }
        let mut next = j.clone();
        let kind = match on_lost {
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
