//! The committed state as the scheduling core's input ([`Snapshot`]), and a
//! [`Trial`] of it for checks that must not change anything. Rebuilt each
//! cycle from the committed state, so it never drifts from the store.

use std::collections::{BTreeMap, VecDeque};

use gpuflow_api::{self as api, JobState, NodeState};
use gpuflow_core::cluster::{Allocation, Cluster};
use gpuflow_core::ids::{CpuMilli, JobId, MemMib, NodeId, TaskId};
use gpuflow_core::mix::{MixWeighting, WorkloadMix};
use gpuflow_core::model::{self, Gpu, Node};
use gpuflow_core::placement::Placer;
use gpuflow_core::policy::Policy;
use gpuflow_core::queue::{FlavorQuota, Queue, QueueId, Queues, UserLimits};
use gpuflow_core::request::{self, Constraints, Job, TaskGroup, TaskRequest};
use gpuflow_core::schedule::{self, Config, Running, Workload};

use crate::convert::{classes, config, milli, task_request};
use crate::state::{JobRec, World};

/// Projects whose budget is spent: what happens to their pending jobs,
/// and why in words.
pub(crate) type Spent = BTreeMap<String, (api::WhenExhausted, String)>;

pub(crate) fn spent_projects(world: &World, t: u64) -> Spent {
    world
        .records().projects
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
                Some(c) => format!("{c} {}", world.records().prices.currency).trim_end().to_string(),
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
pub(crate) fn budget_gate(j: &JobRec, work: &mut Workload, spent: &Spent) -> Option<String> {
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
    ///
    /// # Errors
    /// As [`snapshot`].
    pub fn take(
        world: &World,
        t: u64,
        server: &crate::Config,
    ) -> Result<Trial, crate::ServerError> {
        let snap = snapshot(world, t)?;
        let history = world.history.to_core(&snap.queues);
        Ok(Trial {
            snap,
            history,
            cfg: config(server),
            t,
        })
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
    /// Each pending job's revision ([`World::job_rev`]) as `pending` was
    /// built, and the records' ([`World::records_rev`]).
    pub pending_revs: Vec<u64>,
    /// Each running job's revision as `running` was built.
    pub running_revs: Vec<u64>,
    pub records_rev: u64,
    /// [`World::revision`] as it was built.
    pub revision: u64,
    /// Whether `pending` and `running` hold the jobs' workloads as any
    /// cycle would build them until they or the records change
    /// ([`Reuse`]): no gate that depends on the time changed them (no
    /// reservation is to come or open, no project's budget is spent).
    pub reusable: bool,
    /// How many of `pending` came from the last cycle's [`Reuse`].
    pub reused: usize,
    /// GPUs by model on nodes not lost, in milli-GPU.
    pub capacity: BTreeMap<String, u64>,
    /// Whether `placer` holds exactly the allocations of `running`, so that
    /// the next snapshot may start from it ([`Base`]).
    pub base_ok: bool,
    /// Whether the placer was the last cycle's [`Base`].
    pub placer_reused: bool,
    /// The placer as taken, before the core changed it: set by the
    /// cycle (off the state lock) when `base_ok`, for [`Reuse`].
    pub base: Option<Box<Base>>,
    /// (job, state, attempt) of every pending and allocated job, in id
    /// order: the applier keeps a decision only on a job still so.
    pub versions: Vec<(u64, JobState, u32)>,
}

/// The placer with every running allocation applied, as a snapshot built
/// it, for the next snapshot to start from: it releases the allocations of
/// jobs that changed or left since and applies those of jobs that started,
/// instead of building the cluster from every node and applying every
/// allocation again (most of the snapshot's work at 10,000 nodes). Used
/// while no node changed what the scheduler reads of it since
/// (`revision`), and the nodes are the same.
///
/// Node ids within classes of equal nodes may then be in another order
/// than in a placer built afresh, so ties between equal nodes may break
/// the other way: the cycle's decisions depend on what ran before, as a
/// long-lived scheduler's do, while every node's usage is the same (debug
/// builds check it against a placer built afresh).
#[derive(Clone)]
pub struct Base {
    /// Holding the allocations of the running jobs kept beside it
    /// ([`Reuse::keep`]), and no others.
    placer: Placer,
    node_names: Vec<String>,
    capacity: BTreeMap<String, u64>,
    revision: u64,
}

impl Base {
    /// `snap`'s placer as taken.
    pub fn of(snap: &Snapshot) -> Base {
        Base {
            placer: snap.placer.clone(),
            node_names: snap.node_names.clone(),
            capacity: snap.capacity.clone(),
            revision: snap.revision,
        }
    }

    /// Whether a snapshot of `world` may start from it.
    fn fits(&self, world: &World) -> bool {
        let nodes = world.nodes().len();
        self.node_names.len() == nodes
            && world
                .all_node_revs()
                .all(|r| r.shape <= self.revision && r.inventory <= self.revision)
            // Classes are interned for good: start afresh once the placer
            // has seen many more node states than there are nodes.
            && self.placer.cluster().class_slots() <= 4 * nodes + 4096
    }
}

/// The pending jobs' workloads and the running jobs' workloads and
/// allocations the last cycle built, for the next one to reuse instead of
/// building them again from the jobs' records: building them, and freeing
/// them after the cycle, was most of the snapshot's work at 100,000 jobs.
/// Kept by the cycle ([`crate::Shared::applier`]).
#[derive(Default)]
pub struct Reuse {
    records_rev: u64,
    pending: Kept<Workload>,
    /// Reused while every node they are on has kept its inventory since
    /// `revision` and the nodes are the same (`nodes`: none is ever
    /// removed, so the same count is the same nodes, and the same node ids).
    running: Kept<Running>,
    revision: u64,
    nodes: usize,
    /// The last cycle's placer, if it may be a start for the next.
    base: Option<Box<Base>>,
    /// A base that could not be used: kept to be freed off the lock.
    unused: Option<Box<Base>>,
    /// Room the cycle before last built in, emptied, for the next
    /// snapshot to build in: filling room never touched (or given back to
    /// the system) again each cycle cost a fifth of the snapshot's time
    /// at 100,000 jobs, in page faults.
    spare: Spare,
}

/// Emptied vectors for a snapshot to build its lists in.
#[derive(Default)]
pub struct Spare {
    pending: Vec<Workload>,
    pending_revs: Vec<u64>,
    running: Vec<Running>,
    running_revs: Vec<u64>,
}

impl Spare {
    /// Empty vectors with room for `n` each, from the spare room where it
    /// has it.
    fn take(&mut self, n: usize) -> Spare {
        // Room to spare for jobs submitted meanwhile, so that the room
        // is not grown (doubled) every few cycles.
        fn room<T>(v: &mut Vec<T>, n: usize) {
            if v.capacity() < n {
                *v = Vec::with_capacity(n + n / 16);
            }
        }
        let mut s = std::mem::take(self);
        room(&mut s.pending, n);
        room(&mut s.pending_revs, n);
        room(&mut s.running, n);
        room(&mut s.running_revs, n);
        s
    }
}

/// What a cycle built from jobs, in id order, each with the job's revision
/// then ([`World::job_rev`]); taken as it is reused.
struct Kept<T> {
    items: VecDeque<T>,
    revs: VecDeque<u64>,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept::of(Vec::new(), Vec::new())
    }
}

impl<T> Kept<T> {
    fn of(items: Vec<T>, revs: Vec<u64>) -> Self {
        Kept {
            items: items.into(),
            revs: revs.into(),
        }
    }

    /// Its room, emptied, for the next snapshot to build in.
    fn into_spare(mut self) -> (Vec<T>, Vec<u64>) {
        self.items.clear();
        self.revs.clear();
        (self.items.into(), self.revs.into())
    }

    /// Job `id`'s item, if it was built at revision `rev` and `still`
    /// holds of it; asked in increasing id order (`id_of` reads an item's).
    /// Items of jobs passed over are dropped.
    fn take(
        &mut self,
        id: u64,
        rev: u64,
        id_of: impl Fn(&T) -> u64,
        still: impl Fn(&T) -> bool,
    ) -> Option<T> {
        loop {
            if id_of(self.items.front()?) > id {
                return None;
            }
            let (item, kept) = (self.items.pop_front()?, self.revs.pop_front());
            if id_of(&item) == id {
                return (kept == Some(rev) && still(&item)).then_some(item);
            }
        }
    }
}

impl Reuse {
    /// What `snap` built from jobs, if another cycle may reuse it.
    pub fn keep(snap: &mut Snapshot) -> Reuse {
        if !snap.reusable {
            return Reuse {
                unused: snap.base.take(),
                ..Reuse::default()
            };
        }
        Reuse {
            records_rev: snap.records_rev,
            pending: Kept::of(
                std::mem::take(&mut snap.pending),
                std::mem::take(&mut snap.pending_revs),
            ),
            running: Kept::of(
                std::mem::take(&mut snap.running),
                std::mem::take(&mut snap.running_revs),
            ),
            revision: snap.revision,
            nodes: snap.node_names.len(),
            base: snap.base.take(),
            unused: None,
            spare: Spare::default(),
        }
    }

    /// The room of what the last snapshot took from it, emptied, for the
    /// snapshot after the next ([`Reuse::spare`]), and the rest, stale.
    pub fn split_spare(mut self) -> (Spare, Reuse) {
        let pending = std::mem::take(&mut self.pending).into_spare();
        let running = std::mem::take(&mut self.running).into_spare();
        let spare = Spare {
            pending: pending.0,
            pending_revs: pending.1,
            running: running.0,
            running_revs: running.1,
        };
        (spare, self)
    }

    /// Gives [`Reuse::split_spare`]'s room to the next snapshot.
    pub fn set_spare(&mut self, spare: Spare) {
        self.spare = spare;
    }

    /// Pending job `id`'s workload, if it was built at revision `rev`.
    fn take(&mut self, id: u64, rev: u64) -> Option<Workload> {
        self.pending.take(id, rev, |w| w.job.id.0, |_| true)
    }

    /// Running job `id`'s workload and allocations, if built at revision
    /// `rev` and every node it is on (`inventory_revs` by node id) has
    /// kept its inventory since; `all_kept` when every node has, so that
    /// no allocation's node needs a look.
    fn take_running(
        &mut self,
        id: u64,
        rev: u64,
        inventory_revs: &[u64],
        all_kept: bool,
    ) -> Option<Running> {
        let revision = self.revision;
        self.running.take(
            id,
            rev,
            |r| r.work.job.id.0,
            |r| {
                all_kept
                    || r.allocations.iter().all(|a| {
                        inventory_revs
                            .get(a.node.0 as usize)
                            .is_some_and(|&v| v <= revision)
                    })
            },
        )
    }
}

impl Snapshot {
    /// The core's cycle on this snapshot.
    pub(crate) fn schedule(
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
pub(crate) fn nvlink_islands(inv: &api::Inventory) -> Vec<Option<usize>> {
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
///
/// # Errors
/// When the committed nodes do not make a cluster the core accepts.
pub fn snapshot(world: &World, t: u64) -> Result<Snapshot, crate::ServerError> {
    snapshot_reusing(world, t, &mut Reuse::default())
}

/// [`snapshot`], taking the workloads of pending jobs that have not
/// changed from `reuse`.
///
/// # Errors
/// As [`snapshot`].
pub fn snapshot_reusing(
    world: &World,
    t: u64,
    reuse: &mut Reuse,
) -> Result<Snapshot, crate::ServerError> {
    let mut shrunk = std::collections::BTreeSet::new();
    loop {
        let snap = snapshot_with(world, t, &shrunk, reuse)?;
        let before = shrunk.len();
        shrunk.extend(snap.evicted.iter().map(|(_, node, _)| node.clone()));
        if shrunk.len() == before {
            return Ok(snap);
        }
    }
}

/// A placer over the cluster built from every node, as the core sees
/// them, with nothing applied yet.
fn fresh_base(
    world: &World,
    t: u64,
    shrunk: &std::collections::BTreeSet<String>,
) -> Result<Base, crate::ServerError> {
    // Nodes, in name order; the core's node id is the index.
    let node_names: Vec<String> = world.nodes().keys().cloned().collect();
    let mut nodes = Vec::with_capacity(node_names.len());
    let mut capacity: BTreeMap<String, u64> = BTreeMap::new();
    for (i, n) in world.nodes().values().enumerate() {
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
        for r in world.records().reservations.values().filter(|r| r.end > t) {
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
    // Agents' inventories are checked against the core's limits
    // (`http::agent`), and ids are indices: a refusal here is a defect,
    // answered as an error, never a panic on a request's path.
    let cluster = Cluster::new(nodes).map_err(|e| crate::ServerError::Snapshot(e.to_string()))?;
    // The mix is set once the pending jobs have been read: applying
    // allocations reads none of it.
    Ok(Base {
        placer: Placer::new(cluster, Policy::gpuflow(), WorkloadMix::default(), 0),
        node_names,
        capacity,
        revision: world.revision(),
    })
}

pub(crate) fn snapshot_with(
    world: &World,
    t: u64,
    shrunk: &std::collections::BTreeSet<String>,
    reuse: &mut Reuse,
) -> Result<Snapshot, crate::ServerError> {
    // Gates that change workloads with the time: while none applies, the
    // workloads of pending jobs are what the last cycle built, unless the
    // job or the records changed since.
    let spent = spent_projects(world, t);
    let reusable = spent.is_empty() && !world.records().reservations.values().any(|r| r.end > t);
    // What the last cycle built from jobs, unless it depends on what changed.
    let records_rev = world.records_rev();
    if !reusable || reuse.records_rev != records_rev || reuse.nodes != world.nodes().len() {
        *reuse = Reuse {
            unused: reuse.base.take().or(reuse.unused.take()),
            spare: std::mem::take(&mut reuse.spare),
            ..Reuse::default()
        };
    }
    // The last cycle's placer, while the nodes are as they were then.
    let base = match reuse.base.take() {
        Some(b) if shrunk.is_empty() && b.fits(world) => Some(b),
        b => {
            reuse.unused = b;
            None
        }
    };
    let placer_reused = base.is_some();
    let Base {
        mut placer,
        node_names,
        capacity,
        ..
    } = match base {
        Some(b) => *b,
        None => fresh_base(world, t, shrunk)?,
    };
    if placer_reused {
        // The placer holds the allocations of the running jobs the last
        // cycle kept. What ended or changed since gives its resources back
        // first: what started since may be on them.
        // Both in id order: the jobs' revisions are walked beside them
        // rather than looked up one by one.
        let kept = &reuse.running;
        let mut revs = world.job_revs().peekable();
        for (r, &rev) in kept.items.iter().zip(&kept.revs) {
            let id = r.work.job.id.0;
            let now = loop {
                match revs.peek() {
                    Some(&(i, _)) if i < id => {
                        revs.next();
                    }
                    Some(&(i, now)) if i == id => break now,
                    _ => break 0,
                }
            };
            if now != rev {
                placer.release(&r.allocations);
            }
        }
    }
    // Each allocation finds its node's id and record in one lookup, built
    // only if some job's allocations are not in the placer yet.
    let node_at = std::cell::OnceCell::new();
    let node_at = || -> &rustc_hash::FxHashMap<&str, (NodeId, &crate::state::NodeRec)> {
        node_at.get_or_init(|| {
            world
                .nodes()
                .iter()
                .enumerate()
                .map(|(i, (name, n))| (name.as_str(), (NodeId(i as u32), n)))
                .collect()
        })
    };
    let aside = set_aside_queues(world);
    let queues = build_queues(world, &capacity, &aside, t);
    // The placement keeps room for the shapes of the work that waits
    // (docs/benchmarks.md, "The placement's mix is what waits"); each
    // replica of a task group counts, as the pods of a gang would. Every
    // pending job's, whether it goes to the core or not: those that go are
    // read from `pending` at the end, those held back from their specs.
    let mut requests: Vec<(TaskRequest, u32)> = Vec::new();
    let mut queues = queues;
    let classes = classes();
    let singles = crate::depend::Singles::of(world);
    // Arrays with a limit: how many elements hold resources now, counted
    // as the jobs are read; pending elements go to the core, in id order,
    // only up to the limit, held back once all are counted (`limited`:
    // their places in `pending`, with the array and its limit).
    let mut array_slots: BTreeMap<u64, u32> = BTreeMap::new();
    let mut limited: Vec<(usize, u64, u32)> = Vec::new();
    // Sized once: growing vectors this long costs more than filling them.
    let live = world.jobs().len();
    let Spare {
        mut pending,
        mut pending_revs,
        mut running,
        mut running_revs,
    } = reuse.spare.take(live);
    let mut reused_count = 0;
    let mut blocked = Vec::new();
    let mut evicted = Vec::new();
    // Jobs whose allocations the placer holds.
    let mut allocated = 0;
    let inventory_revs: Vec<u64> = world.all_node_revs().map(|r| r.inventory).collect();
    let all_kept = inventory_revs.iter().all(|&v| v <= reuse.revision);
    let mut versions = Vec::with_capacity(live);
    for (j, rev) in world.jobs_and_revs() {
        if j.state == JobState::Pending || j.state.allocated() {
            versions.push((j.id, j.state, j.attempts));
        }
        let (reused, reused_allocations) = if j.state == JobState::Pending {
            (reuse.take(j.id, rev), None)
        } else if j.state.allocated() {
            reuse
                .take_running(j.id, rev, &inventory_revs, all_kept)
                .map_or((None, None), |r| (Some(r.work), Some(r.allocations)))
        } else {
            (None, None)
        };
        #[cfg(debug_assertions)]
        if let Some(w) = &reused {
            let mut fresh = workload(j, &queues, &classes);
            if let Some(f) = &mut fresh {
                if j.state == JobState::Pending {
                    with_image_label(j, f);
                }
                f.expected_runtime = w.expected_runtime;
            }
            debug_assert_eq!(fresh.as_ref(), Some(w), "a reused workload is stale");
        }
        let was_reused = reused.is_some();
        reused_count += usize::from(was_reused);
        let work = reused
            .or_else(|| workload(j, &queues, &classes))
            .map(|mut w| {
                w.expected_runtime = world.runtimes.expect(&j.user, &j.spec.kind);
                w
            });
        if j.state.allocated() {
            allocated += 1;
            if let Some(a) = &j.array {
                *array_slots.entry(a.id).or_default() += 1;
            }
            // Whether the placer holds its allocations already: the last
            // cycle's placer, with the job kept unchanged since.
            let in_placer = placer_reused && reused_allocations.is_some();
            // GPUs are found by UUID: one the node no longer reports evicts
            // the job; one that moved in the inventory is followed.
            let mut gone = None;
            let fresh = |gone: &mut Option<(String, String)>| -> Vec<Allocation> {
                j.allocs
                    .iter()
                    .filter_map(|a| {
                        let &(node, rec) = node_at().get(a.node.as_str())?;
                        let inv = &rec.inventory;
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
                            gpu: crate::convert::gpu_request(&j.spec.tasks[a.group as usize]),
                            pick: pick.into(),
                        })
                    })
                    .collect()
            };
            let allocations = match reused_allocations {
                Some(a) => {
                    #[cfg(debug_assertions)]
                    {
                        let mut none = None;
                        debug_assert_eq!(fresh(&mut none), a, "reused allocations are stale");
                        debug_assert!(none.is_none(), "reused allocations lost their GPUs");
                    }
                    a
                }
                None => fresh(&mut gone),
            };
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
                if !in_placer {
                    let _ = placer.apply(&allocations);
                }
                tracing::warn!(job = j.id, %reason, "evicting");
                charge(&mut queues);
                evicted.push((j.id, node, reason));
                continue;
            }
            let held = if in_placer {
                Ok(())
            } else {
                placer.apply(&allocations)
            };
            if let Err(a) = held {
                let node = node_names[a.node.0 as usize].clone();
                let inv = &world.nodes()[&node].inventory;
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
            running_revs.push(rev);
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
            // A reused workload has its label already.
            if !was_reused {
                with_image_label(j, &mut work);
            }
            if let Some(reason) = budget_gate(j, &mut work, &spent) {
                blocked.push((j.id, why(j, reason)));
                continue;
            }
            if let (Some(a), Some(limit)) = (
                &j.array,
                j.spec.array.as_deref().and_then(api::ArraySpec::limit_of),
            ) {
                limited.push((pending.len(), a.id, limit));
            }
            pending.push(work);
            pending_revs.push(rev);
        }
    }
    if !limited.is_empty() {
        let mut held = vec![false; pending.len()];
        for &(at, array, limit) in &limited {
            let taken = array_slots.entry(array).or_default();
            if *taken < limit {
                *taken += 1;
                continue;
            }
            held[at] = true;
            if let Some(j) = world.jobs().get(&pending[at].job.id.0) {
                let reason = format!(
                    "array {array} runs at most {limit} elements at once (%{limit}); the next starts when one ends"
                );
                blocked.push((j.id, why(j, reason)));
            }
        }
        without_held(&mut pending, &held);
        without_held(&mut pending_revs, &held);
    }
    for (id, _) in &blocked {
        if let Some(j) = world.jobs().get(id) {
            requests.extend(j.spec.tasks.iter().map(|g| (task_request(g), g.replicas)));
        }
    }
    // The tally is by shape, so the order it is read in does not matter.
    placer.set_mix(WorkloadMix::from_counted(
        pending
            .iter()
            .flat_map(|w: &Workload| w.job.groups.iter().map(|g| (&g.request, g.replicas)))
            .chain(requests.iter().map(|(r, n)| (r, *n))),
        MixWeighting::Tasks,
        1.0,
    ));
    // The placer holds exactly the running jobs' allocations: a base for
    // the next snapshot.
    let base_ok = reusable && shrunk.is_empty() && evicted.is_empty() && allocated == running.len();
    #[cfg(debug_assertions)]
    if placer_reused {
        // The same usage on every node as a placer built afresh.
        let mut fresh = snapshot_with(world, t, shrunk, &mut Reuse::default())?;
        let (a, b) = (placer.cluster(), fresh.placer.cluster());
        for (i, name) in node_names.iter().enumerate() {
            let id = NodeId(i as u32);
            debug_assert_eq!(
                a.usage(id),
                b.usage(id),
                "the reused placer is stale on {name}"
            );
            debug_assert_eq!(
                a.node(id),
                b.node(id),
                "the reused placer is stale on {name}"
            );
        }
        debug_assert_eq!(evicted, std::mem::take(&mut fresh.evicted));
    }
    Ok(Snapshot {
        placer,
        queues,
        running,
        pending,
        node_names,
        blocked,
        evicted,
        fault: None,
        spent,
        pending_revs,
        running_revs,
        records_rev,
        revision: world.revision(),
        reusable,
        reused: reused_count,
        capacity,
        base_ok,
        placer_reused,
        base: None,
        versions,
    })
}

/// `items` without those whose place is marked in `held`.
fn without_held<T>(items: &mut Vec<T>, held: &[bool]) {
    let mut at = held.iter();
    items.retain(|_| !at.next().copied().unwrap_or(false));
}

/// A task in an image runs only where the node can run images (set on
/// pending jobs' workloads; setting it again changes nothing).
fn with_image_label(j: &JobRec, work: &mut Workload) {
    if j.spec.tasks.iter().any(|g| g.image.is_some()) {
        work.job
            .constraints
            .node_selector
            .insert(api::OCI_LABEL.into(), "true".into());
    }
}

/// The taint and label key of reservation `name` on its nodes.
pub(crate) fn reservation_key(name: &str) -> String {
    format!("gpuflow.io/reservation-{name}")
}

/// What reservations let pending job `j` do: its own, once open, keeps it
/// on that reservation's nodes; others' nodes take it only if it ends
/// before they start. A job waiting for its reservation to open, or whose
/// reservation is gone, is held back with the reason.
pub(crate) fn reservations(
    world: &World,
    j: &JobRec,
    work: &mut Workload,
    t: u64,
) -> Result<(), api::Why> {
    let c = &mut work.job.constraints;
    for r in world.records().reservations.values().filter(|r| r.end > t) {
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
    let reason = match world.records().reservations.get(name) {
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

pub(crate) fn why(j: &JobRec, reason: String) -> api::Why {
    api::Why {
        id: j.id,
        state: j.state,
        summary: reason.clone(),
        reasons: vec![reason],
        position: None,
        eta: None,
    }
}

/// Why each queue that cannot be scheduled is set aside (a broken parent
/// chain, a tree deeper than [`api::MAX_QUEUE_DEPTH`], a spec that no longer
/// validates), by name. The edge refuses such queues; this guards the cycle
/// against stored state from older versions or bugs, so one bad queue never
/// stops scheduling for everyone else.
pub fn set_aside_queues(world: &World) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for q in world.records().queues.values() {
        if let Err(e) = q.validate() {
            out.insert(
                q.name.clone(),
                format!("its spec is invalid ({})", e.message),
            );
            continue;
        }
        let mut name = q.name.as_str();
        let mut depth = 1;
        while let Some(p) = world
            .records()
            .queues
            .get(name)
            .and_then(|q| q.parent.as_deref())
        {
            depth += 1;
            if !world.records().queues.contains_key(p) {
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
    for q in world
        .records()
        .queues
        .values()
        .filter(|q| !out.contains_key(&q.name))
    {
        let mut p = q.parent.as_deref();
        while let Some(name) = p {
            if out.contains_key(name) {
                below.insert(
                    q.name.clone(),
                    format!("its ancestor queue {name:?} is set aside"),
                );
                break;
            }
            p = world
                .records()
                .queues
                .get(name)
                .and_then(|q| q.parent.as_deref());
        }
    }
    out.extend(below);
    out
}

/// The queue tree, parents before children, with quotas in milli-GPU.
/// Queues set aside (see [`set_aside_queues`]) are left out, with their
/// subtrees, so their jobs wait with that reason. Budgets stand as they
/// do at `t`.
pub(crate) fn build_queues(
    world: &World,
    capacity: &BTreeMap<String, u64>,
    aside: &BTreeMap<String, String>,
    t: u64,
) -> Queues {
    let depth = |name: &str| {
        let mut name = name;
        let mut d = 0;
        while let Some(p) = world
            .records()
            .queues
            .get(name)
            .and_then(|q| q.parent.as_deref())
        {
            d += 1;
            name = p;
        }
        d
    };
    let mut specs: Vec<&api::QueueSpec> = world
        .records()
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

pub(crate) fn workload(
    j: &JobRec,
    queues: &Queues,
    classes: &[schedule::PriorityClass],
) -> Option<Workload> {
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
    use super::*;

    fn queue(name: &str) -> crate::Rec {
        crate::Rec::Queue(
            serde_json::from_value(serde_json::json!({"name": name, "team": "t"})).unwrap(),
        )
    }

    fn job(id: u64, queue: &str, priority: i32) -> JobRec {
        let spec = format!(
            "name: j{id}\nqueue: {queue}\npriority: {priority}\ntasks:\n  - name: main\n    command: [x]\n    resources: {{gpu: {{count: 1}}}}\n"
        );
        let spec = api::JobSpec::parse(spec.as_bytes(), false).unwrap();
        crate::lifecycle::submitted(id, spec, "t", "u", None, 0)
    }

    /// Each cycle's snapshot, reusing the last one's workloads, is the one
    /// built from scratch: it reuses the workloads of pending jobs that
    /// have not changed, builds again those of the jobs put since, and
    /// every one once the queues change (a queue's id is its position).
    #[test]
    fn a_snapshot_reuses_only_the_workloads_of_jobs_and_queues_unchanged() {
        let mut world = World::default();
        world.put_record(queue("b"));
        for id in 1..=3 {
            world.put_job(job(id, "b", 0));
        }
        let mut reuse = Reuse::default();
        let step = |world: &World, reuse: &mut Reuse| {
            let mut snap = snapshot_reusing(world, 10, reuse).unwrap();
            let fresh = snapshot(world, 10).unwrap();
            assert_eq!(snap.pending, fresh.pending);
            let reused = snap.reused;
            *reuse = Reuse::keep(&mut snap);
            reused
        };
        assert_eq!(step(&world, &mut reuse), 0);
        assert_eq!(step(&world, &mut reuse), 3);
        // Job 2 changes: built again; jobs 1 and 3 reused.
        world.put_job(job(2, "b", 5));
        assert_eq!(step(&world, &mut reuse), 2);
        assert_eq!(reuse.pending.items[1].priority, 5);
        // Queue "a" comes first: queue "b"'s id changes for every job.
        world.put_record(queue("a"));
        assert_eq!(step(&world, &mut reuse), 0);
        // A job that leaves is not reused for another.
        let mut gone = job(1, "b", 0);
        gone.state = JobState::Cancelled;
        world.put_job(gone);
        assert_eq!(step(&world, &mut reuse), 2);
    }

    fn node(name: &str) -> crate::state::NodeRec {
        let inventory: api::Inventory = serde_json::from_value(serde_json::json!({
            "cpu_milli": 8000, "memory_mib": 8192, "emulated": true,
            "gpus": (0..2).map(|i| serde_json::json!({
                "index": i, "uuid": format!("GPU-{name}-{i}"), "model": "A100", "memory_mib": 40960
            })).collect::<Vec<_>>(),
        }))
        .unwrap();
        crate::nodes::joined(name, inventory, "h".into(), 1).0
    }

    fn running(id: u64, node: &str, gpu: u8) -> JobRec {
        let mut j = job(id, "b", 0);
        j.state = JobState::Running;
        j.flavor = "A100".into();
        j.started_at = Some(1);
        j.allocs = vec![crate::state::Alloc {
            group: 0,
            index: 0,
            node: node.into(),
            cpu_milli: 1000,
            mem_mib: 0,
            pick: crate::state::Pick::Whole(1 << gpu),
            gpu_uuids: vec![format!("GPU-{node}-{gpu}")],
        }];
        j
    }

    /// The next snapshot starts from the last one's placer while the nodes
    /// are unchanged: it gives back what ended, takes what started, and
    /// holds on every node what a placer built afresh holds. A node whose
    /// inventory changes makes it build afresh.
    #[test]
    fn a_snapshot_starts_from_the_last_placer_while_the_nodes_are_unchanged() {
        let mut world = World::default();
        world.put_record(queue("b"));
        world.put_node(node("n1"));
        world.put_node(node("n2"));
        world.put_job(running(1, "n1", 0));
        world.put_job(running(2, "n1", 1));
        world.put_job(job(3, "b", 0));
        let mut reuse = Reuse::default();
        let step = |world: &World, reuse: &mut Reuse| {
            let mut snap = snapshot_reusing(world, 10, reuse).unwrap();
            let fresh = snapshot(world, 10).unwrap();
            let (a, b) = (snap.placer.cluster(), fresh.placer.cluster());
            for i in 0..a.nodes().len() {
                assert_eq!(a.usage(NodeId(i as u32)), b.usage(NodeId(i as u32)));
            }
            assert!(snap.base_ok);
            snap.base = Some(Box::new(Base::of(&snap)));
            let reused = snap.placer_reused;
            let free = a.free_milli_total(NodeId(0));
            *reuse = Reuse::keep(&mut snap);
            (reused, free)
        };
        assert_eq!(step(&world, &mut reuse), (false, 0));
        assert_eq!(step(&world, &mut reuse), (true, 0));
        // Job 1 ends and job 3 starts on its GPU.
        let mut ended = running(1, "n1", 0);
        ended.state = JobState::Succeeded;
        world.put_job(ended);
        assert_eq!(step(&world, &mut reuse), (true, 1000));
        let mut started = running(3, "n1", 0);
        started.spec.name = "j3".into();
        world.put_job(started);
        assert_eq!(step(&world, &mut reuse), (true, 0));
        // A GPU of n2 fails: built afresh, then reused again.
        let mut sick = world.nodes()["n2"].clone();
        sick.inventory.gpus[1].unhealthy = Some("XID 79".into());
        world.put_node(sick);
        assert_eq!(step(&world, &mut reuse), (false, 0));
        assert_eq!(step(&world, &mut reuse), (true, 0));
    }
}
