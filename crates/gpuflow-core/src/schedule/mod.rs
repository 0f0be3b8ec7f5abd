//! The scheduling cycle: which pending jobs start, which running jobs are
//! preempted, which blocked gang gets a reservation, and why every other job
//! waits. See `schedule/README.md` beside this file for the flow.
//!
//! [`schedule`] works on the caller's [`Placer`] and [`Queues`], which hold the
//! committed state (running allocations applied, usage charged). Admissions
//! are applied to them as the cycle goes — the plan's admissions are exactly
//! what was applied. Preemption and reservations are tried on the same state
//! and undone, so after the call the state is the committed state plus the
//! admissions. The cycle reads `now` and a seed from its input, never a clock.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;

use crate::cluster::Allocation;
use crate::ids::JobId;
use crate::placement::{Placement, Placer, Unplaced};
use crate::queue::{QueueId, QueueState, Queues, QuotaBlock};
use crate::request::{GpuRequest, Job};
use crate::total::OrdF64;

/// A job's placement problem without its identity: its groups' requests and
/// counts, and its constraints. Jobs of one shape place, or fail, alike.
#[derive(Clone, Copy)]
struct Shape<'a>(&'a Job);

impl std::hash::Hash for Shape<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.groups.len().hash(h);
        for g in &self.0.groups {
            g.request.hash(h);
            g.replicas.hash(h);
        }
        self.0.constraints.hash(h);
    }
}

impl PartialEq for Shape<'_> {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.0, other.0);
        a.groups.len() == b.groups.len()
            && a.groups
                .iter()
                .zip(&b.groups)
                .all(|(x, y)| x.replicas == y.replicas && x.request == y.request)
            && a.constraints == b.constraints
    }
}

impl Eq for Shape<'_> {}

/// A placement problem in a cycle: (shape number, flavor index, the
/// reservation slots the job keeps off).
type PlaceKey = (u32, u32, u64);

/// Victim candidates considered for one preemptor, cheapest first.
const MAX_CANDIDATES: usize = 256;

/// Reclaim candidates a shared window keeps: enough for a search's
/// [`MAX_CANDIDATES`] after leaving out the searcher's own queue's jobs.
const SHARED_STREAM: usize = MAX_CANDIDATES + 64;

/// [`RunInfo::node`] before the allocations were read.
const NODE_UNKNOWN: u32 = u32::MAX - 1;

/// The flavor index of no GPU, or of a flavor the queues do not know.
const NO_FLAVOR: u32 = u32::MAX;

/// A priority class: its rank orders work; preemptibility and borrowing are
/// set independently.
#[derive(Clone, Debug, PartialEq)]
pub struct PriorityClass {
    pub name: String,
    /// Higher goes first and may preempt lower (within a queue).
    pub rank: u32,
    pub preemptible: bool,
    /// Whether the class may run above its queue's guarantee.
    pub may_borrow: bool,
}

/// The four classes gpuflow ships with.
pub fn default_classes() -> Vec<PriorityClass> {
    let c = |name: &str, rank, preemptible, may_borrow| PriorityClass {
        name: name.into(),
        rank,
        preemptible,
        may_borrow,
    };
    vec![
        c("inference", 40, false, false),
        c("notebook", 30, false, false),
        c("training", 20, true, true),
        c("batch", 10, true, true),
    ]
}

/// A job as the scheduler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub job: Job,
    pub queue: QueueId,
    pub user: String,
    /// Index into [`Config::classes`].
    pub class: usize,
    /// Priority inside the class.
    pub priority: i32,
    /// Submission time, seconds.
    pub submitted: u64,
    /// Declared maximum runtime, seconds.
    pub max_runtime: Option<u64>,
    /// Seconds a victim is given between the signal and the kill.
    pub grace: u64,
}

impl Workload {
    /// GPU demand in milli-GPU, as quota and fair share count it (MIG
    /// instances and time slices by their equivalents, see
    /// [`GpuRequest::quota_milli`](crate::request::GpuRequest::quota_milli)).
    pub fn gpu_milli(&self) -> u64 {
        self.job
            .groups
            .iter()
            .map(|g| g.request.gpu.quota_milli() * g.replicas as u64)
            .sum()
    }

    fn needs_gpu(&self) -> bool {
        self.job
            .groups
            .iter()
            .any(|g| g.request.gpu != GpuRequest::None)
    }
}

/// A running job.
#[derive(Clone, Debug, PartialEq)]
pub struct Running {
    pub work: Workload,
    /// The flavor its quota is charged to ("" for no GPU).
    pub flavor: String,
    pub allocations: Vec<Allocation>,
    pub started: u64,
    pub last_checkpoint: Option<u64>,
    /// Set once it has been told to stop: the kill time.
    pub stopping_at: Option<u64>,
}

impl Running {
    /// Work lost if it stopped now: GPU-seconds since its last checkpoint.
    pub fn lost_gpu_seconds(&self, now: u64) -> f64 {
        self.lost_with(now, self.work.gpu_milli())
    }

    /// [`Running::lost_gpu_seconds`] for a known GPU demand in milli-GPU.
    fn lost_with(&self, now: u64, milli: u64) -> f64 {
        self.unsaved(now) as f64 * milli as f64 / 1000.0
    }

    /// Seconds of work since its last checkpoint (or its start).
    pub fn unsaved(&self, now: u64) -> u64 {
        now.saturating_sub(
            self.last_checkpoint
                .unwrap_or(self.started)
                .max(self.started),
        )
    }
}

/// How jobs are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ordering {
    /// Submission order across all queues, head-of-line blocking.
    Fifo,
    /// Class, priority and age across all queues (Slurm-like).
    Priority,
    /// Weighted dominant-resource fair share between queues, then class,
    /// priority and age inside a queue.
    FairShare,
    /// Slurm's multifactor priority across all queues (see [`Multifactor`]):
    /// class tier first when `class_tiers` is on, then the weighted sum of
    /// age, fair-share and job-size factors plus the job's own priority.
    Multifactor,
}

/// Weights of Slurm's multifactor priority plugin (`PriorityWeight*`), for
/// [`Ordering::Multifactor`]. A job's priority is the whole part of
/// `age · min(waited / max_age, 1) + fairshare · 2^(−U/S) + job_size · gpus / cluster gpus`
/// plus its own priority, where `U` is its queue's share of the decayed usage
/// of all leaf queues (half-life `Config::usage_half_life`) and `S` its
/// queue's share of their weights: Slurm's classic fair-share factor over one
/// level of accounts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Multifactor {
    pub age: f64,
    pub fairshare: f64,
    pub job_size: f64,
    /// `PriorityMaxAge`, seconds.
    pub max_age: u64,
}

impl Default for Multifactor {
    /// The configuration example of Slurm's multifactor priority documentation.
    fn default() -> Multifactor {
        Multifactor {
            age: 1000.0,
            fairshare: 100_000.0,
            job_size: 1000.0,
            max_age: 24 * 3600,
        }
    }
}

/// Scheduler settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub classes: Vec<PriorityClass>,
    pub ordering: Ordering,
    pub preemption: bool,
    pub backfill: bool,
    /// Whether quotas are enforced (FIFO and Slurm-like baselines ignore them).
    pub quotas: bool,
    /// Half-life of historical usage, seconds.
    pub usage_half_life: u64,
    /// Weight of historical usage against current usage in fair share
    /// (0..1; 1, the default: decayed GPU-hours alone, as Slurm's fair
    /// share, which on the realistic workload keeps the tails of small
    /// teams near Slurm's; docs/benchmarks.md).
    pub history_weight: f64,
    /// Age that adds one to a job's priority, seconds (0: no aging).
    pub aging_step: u64,
    /// Most that aging adds.
    pub aging_cap: i32,
    /// Runtime before a job may be preempted, seconds.
    pub min_runtime: u64,
    /// Protect unsaved work: a running job with more than this many seconds
    /// of work since its last checkpoint (or its start) is not preempted, so
    /// no victim loses more; it becomes a candidate again once it
    /// checkpoints. `None`: no limit.
    pub max_unsaved: Option<u64>,
    /// GPU-hours of lost work each queue may suffer per window from the
    /// preemptions that budgets bind (see `protected_pass_budgets` and
    /// `underserved_pass_budgets`); `None`: no limit. Default 1 GPU-hour an
    /// hour: a queue of batch and training is not reclaimed faster than
    /// that unless the reclaimer has had much less than its share, so the
    /// others wait for capacity that frees instead (docs/benchmarks.md).
    pub disruption_budget: Option<f64>,
    /// The disruption budget's window, seconds (default one hour).
    pub disruption_window: u64,
    /// Whether jobs of the protected classes (those that are not
    /// preemptible: inference, notebooks) preempt past disruption budgets:
    /// a budget then paces the reclaims of batch and training, never a
    /// service or a notebook within its guarantee. On by default.
    pub protected_pass_budgets: bool,
    /// A queue whose decayed usage is below this fraction of its weighted
    /// share (among its siblings) preempts past disruption budgets:
    /// reclaims that restore fairness are not paced. Default 0.8 (0: no
    /// queue passes).
    pub underserved_pass_budgets: f64,
    /// Whether a paced reclaim (one that disruption budgets bind: by a
    /// class that `protected_pass_budgets` does not exempt, of a queue at or
    /// above `underserved_pass_budgets` of its share) takes only from
    /// borrowing queues that have had at least the reclaimer's share of
    /// their siblings' decayed usage per unit of weight. A queue that has
    /// had less keeps its borrowed work, and the reclaimer waits for GPUs to
    /// free: a reclaim never deepens an imbalance of the GPU-hours. On by
    /// default (docs/benchmarks.md).
    pub reclaims_restore_fairness: bool,
    /// Failed tries per leaf queue per cycle, shared out equally among the
    /// classes the queue has pending: a class that used its share waits for
    /// the next cycle, and the queue's other classes go on (no head-of-line
    /// blocking across classes). A queue gets more when `tries_per_cycle`
    /// allows.
    pub tries_per_queue: usize,
    /// Failed tries a cycle may spend in all, shared out equally among the
    /// leaf queues with pending jobs (each gets at least `tries_per_queue`):
    /// few queues try deep into their backlogs, many queues keep the cycle's
    /// cost bounded.
    pub tries_per_cycle: usize,
    /// Jobs blocked by capacity that get a reservation each cycle, in
    /// order (Slurm's `bf_max_job_test`): each holds the nodes where it
    /// could start earliest, and later jobs that would still run then keep
    /// off every reserved node. Default 4.
    pub max_reservations: usize,
    /// Whether backfill plans each reserved node on its own, as Slurm's
    /// does: a job may use a reserved node when it ends before that node's
    /// reservation starts. Off (the default): a job that would still run
    /// when the first reservation starts keeps off every reserved node,
    /// which on the realistic workload keeps gpuflow's tails shorter
    /// (docs/benchmarks.md).
    pub backfill_per_node: bool,
    /// Whether priority classes order the queue (off: one tier, as a Slurm
    /// partition with a single QoS, where priority is priority plus age).
    pub class_tiers: bool,
    /// Whether the preemptible classes (training, batch) share one tier of
    /// the order: they take turns by priority with aging, then age, as jobs
    /// of one Slurm QoS do. Their ranks still decide which may preempt
    /// which. On by default.
    pub preemptible_one_tier: bool,
    /// Whether victims are the jobs that would lose the least work first,
    /// their class after (on by default; off: the lowest class first).
    pub victims_by_lost_work: bool,
    /// Weights of [`Ordering::Multifactor`].
    pub multifactor: Multifactor,
    /// Consolidation: a job that no node takes, though the GPUs free in
    /// its flavor would hold it (a gang of whole nodes while single GPUs
    /// sit free on busy nodes), may move running jobs that are preemptible
    /// now (class, minimum runtime), smaller than it, not of a higher class
    /// or priority, and hold at most this many seconds of work since their
    /// last checkpoint or start, when all of them fit elsewhere at once. They are preempted for it and placed again like
    /// any preempted job. `None`, or `preemption` off: never. Default 15 minutes, which on the
    /// realistic workload raises the GPU allocation by about 2 points for
    /// about 0.1 % of the GPU-hours lost (docs/benchmarks.md,
    /// "Consolidation").
    pub consolidate_max_unsaved: Option<u64>,
    /// Seconds from one consolidation to the next (one a cycle at most):
    /// a rate that does not depend on how often cycles run. Default 60.
    pub consolidation_interval: u64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            classes: default_classes(),
            ordering: Ordering::FairShare,
            preemption: true,
            backfill: true,
            quotas: true,
            usage_half_life: 7 * 24 * 3600,
            history_weight: 1.0,
            aging_step: 3600,
            aging_cap: 10,
            min_runtime: 300,
            max_unsaved: Some(3600),
            disruption_budget: Some(1.0),
            disruption_window: 3600,
            protected_pass_budgets: true,
            underserved_pass_budgets: 0.8,
            reclaims_restore_fairness: true,
            tries_per_queue: 8,
            tries_per_cycle: 3_000,
            max_reservations: 4,
            backfill_per_node: false,
            class_tiers: true,
            preemptible_one_tier: true,
            victims_by_lost_work: true,
            multifactor: Multifactor::default(),
            consolidate_max_unsaved: Some(900),
            consolidation_interval: 60,
        }
    }
}

/// When nodes have room for tasks of whole GPUs, from the known ends of
/// the work on them (constraints aside: a lower bound on when a job that
/// no node can take yet may start).
struct NodeSlots {
    /// The cycle's time: when idle GPUs have room.
    now: u64,
    /// Idle whole GPUs per node (0 on nodes that take no new work).
    idle: Vec<u32>,
    /// (node, end, whole GPUs given back), by node then end.
    frees: Vec<(u32, u64, u32)>,
    /// Per GPUs-per-task size: the moments each further task of that size
    /// finds room on some node, soonest first.
    by_size: BTreeMap<u32, Vec<u64>>,
}

impl NodeSlots {
    /// The moments a task of `gpus` whole GPUs finds room, one per task,
    /// soonest first: a node with `k` tasks' room at time t adds t to the
    /// list `k` times in all.
    fn moments(&mut self, gpus: u32) -> &[u64] {
        let (now, idle, frees) = (self.now, &self.idle, &self.frees);
        self.by_size.entry(gpus).or_insert_with(|| {
            let mut out = Vec::new();
            // `frees` is by node, and every node is visited in order.
            let mut k = 0;
            for (n, &free) in idle.iter().enumerate() {
                let mut have = free;
                out.extend(std::iter::repeat_n(now, (have / gpus) as usize));
                while k < frees.len() && frees[k].0 == n as u32 {
                    let before = have / gpus;
                    have += frees[k].2;
                    out.extend(std::iter::repeat_n(
                        frees[k].1,
                        (have / gpus - before) as usize,
                    ));
                    k += 1;
                }
            }
            out.sort_unstable();
            out
        })
    }

    /// The earliest moment, not before `at`, when nodes have room for
    /// every whole-GPU task of `job` (each group on its own; other groups
    /// are not bounded); `None` when the known ends never make room.
    fn earliest(&mut self, job: &Job, at: u64) -> Option<u64> {
        let mut t = at;
        for g in &job.groups {
            let GpuRequest::Whole { count } = g.request.gpu else {
                continue;
            };
            if count == 0 {
                continue;
            }
            let when = self
                .moments(count as u32)
                .get(g.replicas.max(1) as usize - 1)?;
            t = t.max(*when);
        }
        Some(t)
    }
}

/// What the scheduler remembers between cycles.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    /// Decayed GPU-hours per queue (leaf and inner).
    pub usage: BTreeMap<QueueId, f64>,
    pub decayed_at: u64,
    /// (time, GPU-hours lost) per queue, for disruption budgets.
    pub disruptions: BTreeMap<QueueId, Vec<(u64, f64)>>,
    /// Preemptors waiting for their victims to stop.
    pub waiting_for: BTreeMap<JobId, Vec<JobId>>,
    /// When the last consolidation started ([`Config::consolidation_interval`]).
    pub consolidated_at: Option<u64>,
}

impl History {
    /// Ages recorded usage to `now` and adds the GPU-hours used since the last
    /// call by the running jobs (charged to their queues and ancestors).
    pub fn account(&mut self, now: u64, half_life: u64, running: &[Running], queues: &Queues) {
        let dt = now.saturating_sub(self.decayed_at);
        if dt == 0 {
            return;
        }
        let factor = if half_life == 0 {
            0.0
        } else {
            0.5f64.powf(dt as f64 / half_life as f64)
        };
        for v in self.usage.values_mut() {
            *v *= factor;
        }
        for r in running {
            let hours = r.work.gpu_milli() as f64 / 1000.0 * dt as f64 / 3600.0;
            for q in queues.path(r.work.queue) {
                *self.usage.entry(q).or_default() += hours;
            }
        }
        self.decayed_at = now;
    }

    /// This history keyed by queue name and plain job id, as callers keep
    /// it between cycles and across restarts: queue ids are positions,
    /// which change as queues come and go. Queues with no reclaim left in
    /// their window are left out.
    pub fn named(&self, queues: &Queues) -> NamedHistory {
        let name = |q: &QueueId| queues.get(*q).name.clone();
        NamedHistory {
            usage: self.usage.iter().map(|(q, v)| (name(q), *v)).collect(),
            decayed_at: self.decayed_at,
            disruptions: self
                .disruptions
                .iter()
                .filter(|(_, d)| !d.is_empty())
                .map(|(q, d)| (name(q), d.clone()))
                .collect(),
            waiting_for: self
                .waiting_for
                .iter()
                .map(|(p, v)| (p.0, v.iter().map(|j| j.0).collect()))
                .collect(),
            consolidated_at: self.consolidated_at,
        }
    }

    /// The history `named` keeps, for the queues of `queues` (those gone
    /// are forgotten).
    pub fn from_named(named: &NamedHistory, queues: &Queues) -> History {
        History {
            usage: named
                .usage
                .iter()
                .filter_map(|(n, v)| Some((queues.by_name(n)?, *v)))
                .collect(),
            decayed_at: named.decayed_at,
            disruptions: named
                .disruptions
                .iter()
                .filter_map(|(n, d)| Some((queues.by_name(n)?, d.clone())))
                .collect(),
            waiting_for: named
                .waiting_for
                .iter()
                .map(|(p, v)| (JobId(*p), v.iter().map(|&j| JobId(j)).collect()))
                .collect(),
            consolidated_at: named.consolidated_at,
        }
    }

    fn disrupted(&self, q: QueueId, now: u64, window: u64) -> f64 {
        self.disruptions.get(&q).map_or(0.0, |v| {
            v.iter()
                .filter(|(t, _)| now.saturating_sub(*t) < window)
                // From +0.0: an empty float sum is -0.0, shown as "-0.00".
                .fold(0.0, |sum, (_, h)| sum + h)
        })
    }
}

/// [`History`] keyed by queue name and plain job id ([`History::named`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NamedHistory {
    pub usage: BTreeMap<String, f64>,
    pub decayed_at: u64,
    pub disruptions: BTreeMap<String, Vec<(u64, f64)>>,
    pub waiting_for: BTreeMap<u64, Vec<u64>>,
    pub consolidated_at: Option<u64>,
}

/// A victim of preemption: told to stop now, killed at `kill_at`.
#[derive(Clone, Debug, PartialEq)]
pub struct Preemption {
    pub victim: JobId,
    pub by: JobId,
    pub signal_at: u64,
    pub kill_at: u64,
    pub lost_gpu_hours: f64,
    pub reason: PreemptReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptReason {
    /// The preemptor's queue takes back guaranteed quota the victim's queue borrowed.
    Reclaim,
    /// A strictly higher-priority job of the same queue.
    Priority,
    /// Moved so that a job no node could take fits: it fits elsewhere now.
    Consolidation,
}

/// Nodes held for a blocked gang until it can start.
#[derive(Clone, Debug, PartialEq)]
pub struct Reservation {
    pub job: JobId,
    pub start_at: u64,
    pub nodes: Vec<crate::ids::NodeId>,
}

/// Why a job waits. Each reason is data; [`fmt::Display`] renders it.
#[derive(Clone, Debug, PartialEq)]
pub enum PendingReason {
    QueueHeld {
        queue: String,
    },
    QueueDraining {
        queue: String,
    },
    UserGpuLimit {
        user: String,
        used: u64,
        limit: u64,
    },
    UserRunningLimit {
        user: String,
        running: u32,
        limit: u32,
    },
    /// The class may not borrow and the job does not fit the guarantee.
    NotWithinGuarantee {
        flavor: Arc<str>,
        class: Arc<str>,
        usage: u64,
        guaranteed: u64,
    },
    Quota {
        flavor: Arc<str>,
        block: QuotaBlock,
        /// Names of the queues the block mentions.
        queue_names: Arc<[(QueueId, String)]>,
    },
    Placement {
        flavor: Arc<str>,
        /// Shared: every job of the same shape that fails in a cycle gets the same one.
        unplaced: Arc<Unplaced>,
    },
    /// Capacity is held for a blocked gang that starts before this job would end.
    Reservation {
        job: JobId,
        start_at: u64,
    },
    WaitingForPreemption {
        victims: usize,
    },
    /// Running jobs that could make room hold more work since their last
    /// checkpoint than `Config::max_unsaved` and are kept until they
    /// checkpoint or end.
    UnsavedWork {
        jobs: usize,
        limit_s: u64,
    },
    /// Preemption would help, but would pass a queue's disruption budget.
    DisruptionBudget {
        queue: String,
        used: f64,
        budget: f64,
    },
    /// Reclaiming would take from a queue that has had less of its share of
    /// the decayed usage than this job's ([`Config::reclaims_restore_fairness`]).
    /// The queues compared are the borrower's and the job's, or, when they
    /// have different parents, their ancestors under the nearest common one;
    /// shares are per unit of weight among siblings (1: exactly its share).
    ReclaimFairness {
        queue: String,
        theirs: f64,
        our_queue: String,
        ours: f64,
    },
    /// Not reached this cycle (the queue used its tries, or FIFO blocked at the head).
    NotReached {
        ahead: usize,
    },
}

impl fmt::Display for PendingReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gpus = |m: u64| m as f64 / 1000.0;
        match self {
            PendingReason::QueueHeld { queue } => {
                write!(f, "queue {queue} is held: it accepts work but starts none")
            }
            PendingReason::QueueDraining { queue } => write!(f, "queue {queue} is draining"),
            PendingReason::UserGpuLimit { user, used, limit } => {
                write!(
                    f,
                    "user {user} holds {} GPUs of a {} GPU limit in this queue",
                    gpus(*used),
                    gpus(*limit)
                )
            }
            PendingReason::UserRunningLimit {
                user,
                running,
                limit,
            } => {
                write!(
                    f,
                    "user {user} runs {running} jobs of a {limit} job limit in this queue"
                )
            }
            PendingReason::NotWithinGuarantee {
                flavor,
                class,
                usage,
                guaranteed,
            } => write!(
                f,
                "{class} jobs must fit the guaranteed {flavor} quota: jobs that may not borrow would hold {} of {} GPUs",
                gpus(*usage),
                gpus(*guaranteed)
            ),
            PendingReason::Quota {
                flavor,
                block,
                queue_names,
            } => {
                let name = |q: &QueueId| {
                    queue_names
                        .iter()
                        .find(|(id, _)| id == q)
                        .map_or("?", |(_, n)| n.as_str())
                };
                match block {
                    QuotaBlock::Cap { queue, usage, cap } => {
                        write!(
                            f,
                            "queue {} would use {} {flavor} GPUs, above its cap of {}",
                            name(queue),
                            gpus(*usage),
                            gpus(*cap)
                        )
                    }
                    QuotaBlock::BorrowLimit {
                        queue,
                        usage,
                        limit,
                    } => write!(
                        f,
                        "queue {} would use {} {flavor} GPUs, above its guarantee plus borrowing limit of {}",
                        name(queue),
                        gpus(*usage),
                        gpus(*limit)
                    ),
                    QuotaBlock::NoLendableCapacity {
                        parent,
                        needed,
                        available,
                    } => write!(
                        f,
                        "needs {} {flavor} GPUs of quota; {} has {} left to lend",
                        gpus(*needed),
                        parent.as_ref().map_or("the cluster", |p| name(p)),
                        gpus(*available)
                    ),
                    QuotaBlock::Budget { queue, exhausted } => write!(
                        f,
                        "queue {}'s GPU-hour budget is used up: it {}",
                        name(queue),
                        match exhausted {
                            crate::queue::BudgetExhausted::StopBorrowing => "may not borrow",
                            crate::queue::BudgetExhausted::StopAdmitting => "starts no new work",
                        }
                    ),
                }
            }
            PendingReason::Placement { flavor, unplaced } if flavor.is_empty() => {
                write!(f, "{unplaced}")
            }
            PendingReason::Placement { flavor, unplaced } => write!(f, "on {flavor}: {unplaced}"),
            PendingReason::Reservation { job, start_at } => {
                write!(
                    f,
                    "capacity is reserved for job {} from t={start_at}s and this job would not end before",
                    job.0
                )
            }
            PendingReason::WaitingForPreemption { victims } => {
                write!(f, "waiting for {victims} preempted job(s) to stop")
            }
            PendingReason::DisruptionBudget {
                queue,
                used,
                budget,
            } => write!(
                f,
                "preempting would pass queue {queue}'s disruption budget: {used:.2} of {budget:.2} GPU-hours already lost in the window"
            ),
            PendingReason::ReclaimFairness {
                queue,
                theirs,
                our_queue,
                ours,
            } => write!(
                f,
                "reclaiming would take GPUs from queue {queue}, which has had {theirs:.2} of its share of recent GPU-hours against {ours:.2} for queue {our_queue}: a reclaim never deepens that imbalance, so this job waits for GPUs to free"
            ),
            PendingReason::UnsavedWork { jobs, limit_s } => {
                let limit = if limit_s % 3600 == 0 {
                    format!("{} h", limit_s / 3600)
                } else if limit_s % 60 == 0 {
                    format!("{} min", limit_s / 60)
                } else {
                    format!("{limit_s} s")
                };
                write!(
                    f,
                    "{jobs} running job(s) that could make room hold more than {limit} of work since their last checkpoint and are not preempted until they checkpoint or end"
                )
            }
            PendingReason::NotReached { ahead } => write!(
                f,
                "not reached this cycle: {ahead} job(s) ahead were tried first"
            ),
        }
    }
}

/// A pending job's reasons: most have one, kept inline (a cycle explains
/// every pending job, so a heap allocation each would cost more than the rest).
pub type Reasons = smallvec::SmallVec<[PendingReason; 1]>;

/// A pending job's explanation.
#[derive(Clone, Debug, PartialEq)]
pub struct Pending {
    pub job: JobId,
    pub reasons: Reasons,
    /// 1-based position among its queue's pending jobs.
    pub position: usize,
    /// Estimated start, seconds; `None` when running jobs declare no max runtime.
    pub eta: Option<u64>,
}

/// The outcome of a cycle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub admitted: Vec<(JobId, String, Placement)>,
    pub preempted: Vec<Preemption>,
    pub reservations: Vec<Reservation>,
    pub pending: Vec<Pending>,
}

/// The workload mix a cycle's placement plans for: the task shapes of the
/// work that waits, each replica of a task group counted (running work
/// needs no room; docs/benchmarks.md, "The placement's mix is what
/// waits"). Callers set it on the placer before [`schedule`].
pub fn pending_mix(pending: &[Workload]) -> crate::mix::WorkloadMix {
    crate::mix::WorkloadMix::from_groups(
        pending.iter().flat_map(|w| &w.job.groups),
        crate::mix::MixWeighting::Tasks,
        1.0,
    )
}

/// One scheduling cycle. `running` must match what is applied to `placer` and
/// charged to `queues`; `pending` are the jobs waiting. Admissions are applied.
pub fn schedule(
    now: u64,
    placer: &mut Placer,
    queues: &mut Queues,
    running: &[Running],
    pending: &[Workload],
    history: &mut History,
    cfg: &Config,
) -> Plan {
    let mut cycle = Cycle::new(now, placer, queues, running, pending, history, cfg);
    // Phase 1: order each queue's pending jobs and build the fair-share heap.
    cycle.order();
    // Phase 2: take jobs in fair-share (or FIFO, or priority) order; admit,
    // preempt or reserve. Each step keeps usage and allocations consistent.
    cycle.admit_all();
    debug_assert!(cycle.check_quotas(), "admissions exceeded a quota");
    // Phase 3: explain every job still pending.
    cycle.explain()
}

/// Every reason pending job `job` would wait for if its turn came now, as
/// the next cycle would see it: its queue's state, its user's limits, a
/// preemption it waits for, and quota (with numbers) and placement (with the
/// filters' counts) on each flavor it accepts. Empty when it would start;
/// `None` when `job` is not in `pending`. For the jobs a cycle did not reach
/// ([`PendingReason::NotReached`]): a cycle stops trying a queue after
/// `tries_per_queue` failures, so most of a long backlog is explained by its
/// position alone. Changes nothing: placements are trials, and `history` is
/// read, not aged.
// The inputs of [`schedule`] and the job asked about.
#[allow(clippy::too_many_arguments)]
pub fn diagnose(
    now: u64,
    placer: &mut Placer,
    queues: &mut Queues,
    running: &[Running],
    pending: &[Workload],
    history: &History,
    cfg: &Config,
    job: JobId,
) -> Option<Reasons> {
    let i = pending.iter().position(|w| w.job.id == job)?;
    let mut history = history.clone();
    let mut cycle = Cycle::new(now, placer, queues, running, pending, &mut history, cfg);
    let w = &cycle.pending[i];
    let mut gates: Vec<PendingReason> = cycle.queue_gate(i).into_iter().collect();
    if let Some(v) = cycle.history.waiting_for.get(&w.job.id) {
        gates.push(PendingReason::WaitingForPreemption { victims: v.len() });
    }
    gates.extend(cycle.user_limit(i));
    cycle.reasons[i] = gates;
    cycle.quota_and_fit_reasons(i);
    Some(Reasons::from_vec(std::mem::take(&mut cycle.reasons[i])))
}

/// What victim searches read of a running job, packed so that scanning many
/// candidates touches one small record each instead of the whole job.
#[derive(Clone, Copy, Debug)]
struct RunInfo {
    id: JobId,
    queue: QueueId,
    /// Flavor index ([`NO_FLAVOR`]: none or unknown).
    flavor: u32,
    rank: u32,
    priority: i32,
    /// GPU demand, milli-GPU.
    milli: u64,
    /// GPU-seconds lost if it stopped now.
    lost: f64,
    /// The node all its allocations are on (u32::MAX: several or none) and
    /// the GPUs it holds there; read from the allocations on first use
    /// ([`NODE_UNKNOWN`] until then), as only victim searches need them.
    node: u32,
    gpus: u64,
    /// Its class is preemptible and it ran its minimum runtime.
    preemptible: bool,
    /// It would be preemptible but holds more unsaved work than
    /// `Config::max_unsaved`.
    unsaved_held: bool,
    /// Told to stop, this cycle or earlier.
    victim: bool,
}

impl RunInfo {
    /// Whether it may be chosen as a victim now.
    fn eligible(&self) -> bool {
        self.preemptible && !self.victim
    }
}

/// Consolidations a cycle tries at most (each a few fit tests), so that a
/// cycle with many jobs no node takes stays bounded.
const MAX_CONSOLIDATION_TRIES: usize = 16;

/// What consolidation may move on one flavor ([`Cycle::movable`]).
struct Movable {
    /// The nodes with a GPU of the flavor.
    in_flavor: Vec<u32>,
    /// Nodes whose running jobs may all move: (GPU-seconds they would
    /// lose, milli-GPUs they hold, node), cheapest first.
    nodes: Vec<(f64, u64, u32)>,
    /// The jobs on each of those nodes.
    movers: rustc_hash::FxHashMap<u32, Vec<usize>>,
}

/// `job` with its GPU tasks restricted to `flavor` (none: as it is).
fn on_flavor(job: &Job, flavor: &str) -> Job {
    let mut job = job.clone();
    if !flavor.is_empty() {
        for g in &mut job.groups {
            if g.request.gpu != GpuRequest::None {
                g.request.models = vec![flavor.to_string()];
            }
        }
    }
    job
}

/// The smallest `n` in 1..=`len` for which `probe(n)` finds a placement,
/// when every `n` above one that does finds one too (releasing more never
/// takes room away): doubling `n`, then halving the interval, so O(log len)
/// probes. `probe` sets the state for `n` before it tests; the state is
/// left as the last probe set it.
fn fewest<T>(len: usize, mut probe: impl FnMut(usize) -> Option<T>) -> Option<(usize, T)> {
    let (mut below, mut count) = (0, 1);
    let mut found = None;
    while count <= len {
        if let Some(p) = probe(count) {
            found = Some((count, p));
            break;
        }
        if count == len {
            break;
        }
        below = count;
        count = (count * 2).min(len);
    }
    let (mut above, mut p) = found?;
    while above - below > 1 {
        let mid = below + (above - below) / 2;
        match probe(mid) {
            Some(q) => (above, p) = (mid, q),
            None => below = mid,
        }
    }
    Some((above, p))
}

/// Where `job` would be placed now, leaving no trace.
fn fits_now(placer: &mut Placer, job: &Job) -> Option<Placement> {
    let trial = placer.begin_trial();
    let p = placer.try_place_job(job);
    if let Some(p) = &p {
        placer.release(p);
    }
    placer.end_trial(trial);
    p
}

/// A flavor's reclaim list grouped by queue: each queue's positions in it.
type ReclaimGroups = Vec<(QueueId, Vec<u32>)>;

/// What the bounds say of one candidate before a search releases any.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Screen {
    Kept,
    /// Its queue would fall below its guarantee.
    Guarantee,
    /// Its queue's disruption budget: (queue, GPU-hours already lost).
    Budget(QueueId, f64),
}

/// A victim search's candidates that pass the bounds now ([`Cycle::screen`]).
struct Screened {
    kept: Vec<usize>,
    /// The first disruption budget that left a candidate out: (queue, GPU-hours lost).
    budget_block: Option<(QueueId, f64)>,
}

impl Screened {
    /// The candidates kept, in order, and the first budget that left one out.
    fn of(screens: impl Iterator<Item = (usize, Screen)>) -> Screened {
        let mut kept = Vec::new();
        let mut budget_block = None;
        for (k, screen) in screens {
            match screen {
                Screen::Kept => kept.push(k),
                Screen::Guarantee => {}
                Screen::Budget(q, used) => {
                    budget_block.get_or_insert((q, used));
                }
            }
        }
        Screened { kept, budget_block }
    }
}

/// GPU-hours a victim search's reclaims so far take from each victim queue
/// (few queues per search), counted against disruption budgets.
#[derive(Default)]
struct Planned(Vec<(QueueId, f64)>);

impl Planned {
    fn of(&self, q: QueueId) -> f64 {
        self.0.iter().find(|p| p.0 == q).map_or(0.0, |p| p.1)
    }

    fn add(&mut self, q: QueueId, gpu_hours: f64) {
        match self.0.iter_mut().find(|p| p.0 == q) {
            Some(p) => p.1 += gpu_hours,
            None => self.0.push((q, gpu_hours)),
        }
    }
}

/// The reclaim candidates entitled searches share ([`Cycle::shared_window`]).
struct SharedWindow {
    /// The value of [`Cycle::epoch`] it was built at.
    epoch: u64,
    /// The first eligible jobs of borrowing queues, cheapest first, at most
    /// [`SHARED_STREAM`]: (index into `running`, queue, what
    /// [`Cycle::screen_one`] says of it now).
    stream: Vec<(usize, QueueId, Screen)>,
}

/// A leaf queue's fair-share key: the shares along its path, top first
/// (inline for trees up to four levels deep).
type LeafKey = smallvec::SmallVec<[OrdF64; 4]>;

/// A class's failed tries in one queue during a cycle: (class, failed
/// tries, the queue position where it stopped once it used its share).
type ClassTries = (usize, usize, Option<usize>);

/// Whether a queue limits what each user may hold or run.
fn has_user_limits(queues: &Queues, q: QueueId) -> bool {
    let l = queues.get(q).user_limits;
    l.max_gpu_milli.is_some() || l.max_running.is_some()
}

/// A flavor's index in `queues`, or [`NO_FLAVOR`].
fn flavor_index(queues: &Queues, flavor: &str) -> u32 {
    queues.flavor_index(flavor).map_or(NO_FLAVOR, |f| f as u32)
}

struct Cycle<'a> {
    now: u64,
    placer: &'a mut Placer,
    queues: &'a mut Queues,
    running: &'a [Running],
    pending: &'a [Workload],
    history: &'a mut History,
    cfg: &'a Config,
    /// Per leaf queue, indices into `pending`, best first.
    per_queue: BTreeMap<QueueId, Vec<usize>>,
    /// Global order (FIFO and priority orderings).
    global: Vec<usize>,
    /// Each job's GPU demand in the global order, so that the ETA pass
    /// reads it in sequence.
    global_milli: Vec<u64>,
    /// Per pending job (by index), the reasons found so far.
    reasons: Vec<Vec<PendingReason>>,
    /// Per pending job, `ahead` of a "not reached" reason (u32::MAX: none);
    /// kept apart so that the many unreached jobs cost no allocation.
    not_reached: Vec<u32>,
    admitted: Vec<(JobId, String, Placement)>,
    preempted: Vec<Preemption>,
    /// This cycle's reservations, in the order they were made.
    reservations: Vec<Reservation>,
    /// Each holder's start.
    reserved: rustc_hash::FxHashMap<JobId, u64>,
    /// The earliest start among them (`u64::MAX`: none).
    reserved_from: u64,
    /// Running jobs by the time they end (stop, or reach their time limit),
    /// earliest first: sorted once a cycle, for every reservation.
    ending: Option<Rc<Vec<(u64, usize)>>>,
    /// Per user and queue: (milli-GPU, running jobs), for the queues with
    /// per-user limits (the only readers).
    users: rustc_hash::FxHashMap<(QueueId, &'a str), (u64, u32)>,
    /// Per queue and flavor index: milli-GPU held by classes that may not borrow.
    protected: rustc_hash::FxHashMap<(QueueId, u32), u64>,
    /// Preemptors whose victims have stopped: tried before everyone else.
    ready: BTreeSet<JobId>,
    /// Per queue, its preemptible running jobs (class and minimum runtime)
    /// not stopping at the start of the cycle: (flavor index, rank, priority,
    /// index into `running`), scanned by every victim search of the queue.
    own_scan: rustc_hash::FxHashMap<QueueId, Vec<(u32, u32, i32, u32)>>,
    /// Running jobs kept for their unsaved work ([`RunInfo::unsaved_held`]),
    /// per queue: (flavor index, rank, priority).
    held: rustc_hash::FxHashMap<QueueId, Vec<(u32, u32, i32)>>,
    /// Indices into `running`, per queue.
    running_by_queue: rustc_hash::FxHashMap<QueueId, Vec<usize>>,
    /// Per flavor, the queues with running jobs that use more than their
    /// guarantee: where reclaim looks for victims. Kept in step with commits.
    borrowers: BTreeMap<String, BTreeSet<QueueId>>,
    /// Preemption searches that found nothing this cycle: (queue, flavor index, rank,
    /// priority) → the smallest demand that failed. A bigger demand of the same
    /// standing cannot succeed either (the candidate set is the same).
    no_victims: rustc_hash::FxHashMap<(QueueId, u32, u32, i32), u64>,
    /// Whether a consolidation may start this cycle (none has, and the
    /// last was `consolidation_interval` ago), and the placement problems
    /// none helps.
    may_consolidate: bool,
    /// Consolidations tried this cycle (at most [`MAX_CONSOLIDATION_TRIES`]).
    consolidation_tries: usize,
    no_consolidation: rustc_hash::FxHashSet<PlaceKey>,
    /// [`Cycle::movable`], per flavor index.
    movable: rustc_hash::FxHashMap<u32, Rc<Movable>>,
    /// Counts admissions and preemptions: what the shared reclaim windows
    /// depend on (usage, victims, disruptions) changes only with them.
    epoch: u64,
    /// Per flavor index, the reclaim window entitled searches share.
    shared: rustc_hash::FxHashMap<u32, Rc<SharedWindow>>,
    /// Per flavor, running jobs in victim-cost order (see [`Cycle::reclaim_list`]).
    reclaim: BTreeMap<String, Rc<Vec<usize>>>,
    /// Per flavor, the reclaim list grouped by queue: each queue's
    /// positions in it, in order ([`Cycle::reclaim_groups`]).
    reclaim_groups: BTreeMap<String, Rc<ReclaimGroups>>,
    /// The merge heap of the searches that reclaim fairness binds, kept to
    /// be reused ([`Cycle::window`]).
    fair_heads: Vec<std::cmp::Reverse<(u32, u32, u32)>>,
    /// Job shapes that found no place this cycle (a seedless hasher: the core
    /// reads no global randomness). Admissions only take
    /// capacity during a cycle, so the same shape fails again.
    unplaceable: rustc_hash::FxHashMap<PlaceKey, PendingReason>,
    /// Placement problems a trial placement found no room for, outside any
    /// trial release (so, like `unplaceable`, they fail again this cycle).
    no_fit: rustc_hash::FxHashSet<PlaceKey>,
    /// Placement problems that fitted, with the [`Cycle::epoch`] they
    /// fitted in (see [`Cycle::unplaced_now`]).
    fits_seen: rustc_hash::FxHashMap<PlaceKey, u64>,
    /// Shape numbers, and each pending job's (u32::MAX: not yet looked up).
    shapes: rustc_hash::FxHashMap<Shape<'a>, u32>,
    shape_of: Vec<u32>,
    /// Quota checks of the committed state: (queue, flavor index, milli-GPU,
    /// class) → outcome; cleared by every admission.
    quota_memo: rustc_hash::FxHashMap<(QueueId, u32, u64, usize), Result<(), PendingReason>>,
    /// Flavor names by index, shared by the reasons.
    flavor_names: Vec<Arc<str>>,
    /// The flavor list of jobs without GPUs, and per queue that of jobs
    /// that name no GPU model ([`Cycle::flavors_for`]).
    no_gpu: Rc<[Arc<str>]>,
    queue_flavors: rustc_hash::FxHashMap<QueueId, Rc<[Arc<str>]>>,
    /// Per queue and flavor index: milli-GPU of jobs told to stop (this cycle
    /// or earlier) that still run, so still count in the queue's usage.
    leaving: rustc_hash::FxHashMap<(QueueId, u32), u64>,
    /// Set by a victim search that skipped a candidate for a disruption budget:
    /// (the victim's queue, GPU-hours already lost in the window).
    budget_block: Option<(QueueId, f64)>,
    /// The disruption budget that binds the victim search under way, `None`
    /// when none does (set by [`Cycle::find_victims`] from the job's class
    /// and queue).
    search_budget: Option<f64>,
    /// Whether the victim search under way is paced: disruption budgets and
    /// [`Config::reclaims_restore_fairness`] bind its reclaims.
    search_paced: bool,
    /// Set by a paced victim search that left out a borrowing queue for
    /// having had less than the reclaimer's share: the first pair of queues
    /// so compared (the borrower's side, the reclaimer's).
    fair_block: Option<(QueueId, QueueId)>,
    /// Leaves that already searched for victims this cycle (their best job did).
    preempt_tried: BTreeSet<QueueId>,
    /// Indices into `pending` of the jobs admitted this cycle.
    admitted_idx: Vec<usize>,
    /// GPU demand (milli-GPU) per pending job, by index.
    pend_milli: Vec<u64>,
    /// Per running job, what victim searches read (by index into `running`).
    run: Vec<RunInfo>,
    /// Per pending job, its id (read in explanation passes without touching the job).
    pend_id: Vec<JobId>,
    /// Per pending job, its class (read by the fair-share walk, which
    /// visits much of a long backlog, without touching the jobs).
    pend_class: Vec<usize>,
    /// Per flavor, an upper bound of the GPU capacity free on one node ([`Cycle::max_free`]).
    max_free: BTreeMap<String, u64>,
    /// Fair-share key per queue, cleared along a queue's path when its usage changes.
    shares: std::cell::RefCell<Vec<Option<f64>>>,
    /// Per parent (`None`: the top), its children's decayed usage and
    /// effective weight, summed once a cycle (neither changes during one).
    sibling_history: std::cell::RefCell<rustc_hash::FxHashMap<Option<QueueId>, (f64, f64)>>,
    /// Per queue, [`Cycle::history_share`] once asked (NaN before): victim
    /// searches compare it for every reclaim candidate.
    history_shares: std::cell::RefCell<Vec<f64>>,
}

impl<'a> Cycle<'a> {
    fn new(
        now: u64,
        placer: &'a mut Placer,
        queues: &'a mut Queues,
        running: &'a [Running],
        pending: &'a [Workload],
        history: &'a mut History,
        cfg: &'a Config,
    ) -> Cycle<'a> {
        let mut users: rustc_hash::FxHashMap<(QueueId, &'a str), (u64, u32)> = Default::default();
        let flavor_names = queues.flavors().map(|f| Arc::from(f.as_str())).collect();
        let mut protected: rustc_hash::FxHashMap<(QueueId, u32), u64> = Default::default();
        let mut leaving: rustc_hash::FxHashMap<(QueueId, u32), u64> = Default::default();
        let mut run = Vec::with_capacity(running.len());
        for r in running {
            let milli = r.work.gpu_milli();
            let fi = flavor_index(queues, &r.flavor);
            let class = cfg.classes.get(r.work.class);
            let may_preempt = class.is_some_and(|c| c.preemptible)
                && now.saturating_sub(r.started) >= cfg.min_runtime;
            let over_unsaved = cfg.max_unsaved.is_some_and(|m| r.unsaved(now) > m);
            run.push(RunInfo {
                id: r.work.job.id,
                queue: r.work.queue,
                flavor: fi,
                rank: class.map_or(0, |c| c.rank),
                priority: r.work.priority,
                milli,
                lost: r.lost_with(now, milli),
                node: NODE_UNKNOWN,
                gpus: 0,
                preemptible: may_preempt && !over_unsaved,
                unsaved_held: may_preempt && over_unsaved && r.stopping_at.is_none(),
                victim: r.stopping_at.is_some(),
            });
            if has_user_limits(queues, r.work.queue) {
                let e = users
                    .entry((r.work.queue, r.work.user.as_str()))
                    .or_default();
                e.0 += milli;
                e.1 += 1;
            }
            if cfg.classes.get(r.work.class).is_some_and(|c| !c.may_borrow) {
                *protected.entry((r.work.queue, fi)).or_default() += milli;
            }
            if r.stopping_at.is_some() {
                *leaving.entry((r.work.queue, fi)).or_default() += milli;
            }
        }
        // Victims still stopping are not chosen again; preemptors whose victims
        // have all stopped no longer wait.
        let stopping: BTreeSet<JobId> = run.iter().filter(|r| r.victim).map(|r| r.id).collect();
        // Preemptors whose victims have all stopped go first this cycle.
        let ready: BTreeSet<JobId> = history
            .waiting_for
            .iter()
            .filter(|(_, v)| !v.iter().any(|j| stopping.contains(j)))
            .map(|(k, _)| *k)
            .collect();
        history.waiting_for.retain(|k, _| !ready.contains(k));
        let may_consolidate = history
            .consolidated_at
            .is_none_or(|t| now >= t.saturating_add(cfg.consolidation_interval));
        history
            .disruptions
            .values_mut()
            .for_each(|v| v.retain(|(t, _)| now.saturating_sub(*t) < cfg.disruption_window));
        Cycle {
            now,
            placer,
            queues,
            running,
            pending,
            history,
            cfg,
            per_queue: BTreeMap::new(),
            global: Vec::new(),
            global_milli: Vec::new(),
            reasons: vec![Vec::new(); pending.len()],
            not_reached: vec![u32::MAX; pending.len()],
            admitted: Vec::new(),
            preempted: Vec::new(),
            reservations: Vec::new(),
            reserved: Default::default(),
            reserved_from: u64::MAX,
            ending: None,
            users,
            protected,
            ready,
            held: {
                let mut m: rustc_hash::FxHashMap<QueueId, Vec<(u32, u32, i32)>> =
                    Default::default();
                for r in run.iter().filter(|r| r.unsaved_held) {
                    m.entry(r.queue)
                        .or_default()
                        .push((r.flavor, r.rank, r.priority));
                }
                m
            },
            own_scan: {
                let mut m: rustc_hash::FxHashMap<QueueId, Vec<(u32, u32, i32, u32)>> =
                    Default::default();
                for (k, r) in run.iter().enumerate() {
                    if r.eligible() {
                        m.entry(r.queue)
                            .or_default()
                            .push((r.flavor, r.rank, r.priority, k as u32));
                    }
                }
                m
            },
            running_by_queue: {
                let mut m: rustc_hash::FxHashMap<QueueId, Vec<usize>> = Default::default();
                for (k, r) in run.iter().enumerate() {
                    m.entry(r.queue).or_default().push(k);
                }
                m
            },
            borrowers: BTreeMap::new(),
            no_victims: Default::default(),
            may_consolidate,
            consolidation_tries: 0,
            no_consolidation: Default::default(),
            movable: Default::default(),
            reclaim: BTreeMap::new(),
            reclaim_groups: BTreeMap::new(),
            fair_heads: Vec::new(),
            epoch: 0,
            shared: Default::default(),
            unplaceable: rustc_hash::FxHashMap::default(),
            no_fit: Default::default(),
            fits_seen: Default::default(),
            shapes: Default::default(),
            quota_memo: Default::default(),
            no_gpu: Rc::from(vec![Arc::from("")]),
            queue_flavors: Default::default(),
            flavor_names,
            shape_of: vec![u32::MAX; pending.len()],
            preempt_tried: BTreeSet::new(),
            budget_block: None,
            search_budget: None,
            search_paced: false,
            fair_block: None,
            leaving,
            shares: std::cell::RefCell::new(Vec::new()),
            sibling_history: Default::default(),
            history_shares: Default::default(),
            max_free: BTreeMap::new(),
            admitted_idx: Vec::new(),
            run,
            pend_milli: pending.iter().map(Workload::gpu_milli).collect(),
            pend_id: pending.iter().map(|w| w.job.id).collect(),
            pend_class: pending.iter().map(|w| w.class).collect(),
        }
        .with_borrowers()
    }

    /// Orders two running jobs as victims: lowest class, least work lost
    /// (the other way round with [`Config::victims_by_lost_work`]), fewest GPUs.
    fn victim_cost(&self, a: usize, b: usize) -> std::cmp::Ordering {
        let (ra, rb) = (&self.run[a], &self.run[b]);
        let class = || ra.rank.cmp(&rb.rank);
        let lost = || ra.lost.total_cmp(&rb.lost);
        let first = if self.cfg.victims_by_lost_work {
            lost().then_with(class)
        } else {
            class().then_with(lost)
        };
        first.then(ra.milli.cmp(&rb.milli)).then(ra.id.cmp(&rb.id))
    }

    /// Whether running job `k` is charged to the flavor with index `fi` and name `flavor`.
    fn runs_on(&self, k: usize, fi: u32, flavor: &str) -> bool {
        self.run[k].flavor == fi && (fi != NO_FLAVOR || self.running[k].flavor == flavor)
    }

    /// Reclaim candidates of a flavor in victim-cost order, built once per cycle.
    fn reclaim_list(&mut self, flavor: &str) -> Rc<Vec<usize>> {
        if let Some(l) = self.reclaim.get(flavor) {
            return l.clone();
        }
        // Only jobs of queues borrowing at the start of the search can be
        // reclaimed; of those, only preemptible ones past their minimum runtime.
        let borrowers = self.borrowers.get(flavor).cloned().unwrap_or_default();
        let fi = self.fidx(flavor);
        let mut list: Vec<usize> = borrowers
            .iter()
            .flat_map(|q| self.running_by_queue.get(q).into_iter().flatten().copied())
            .filter(|&k| {
                self.runs_on(k, fi, flavor)
                    && self.running[k].stopping_at.is_none()
                    && self.run[k].preemptible
            })
            .collect();
        list.sort_by(|&a, &b| self.victim_cost(a, b));
        let list = Rc::new(list);
        self.reclaim.insert(flavor.to_string(), list.clone());
        list
    }

    /// [`Cycle::reclaim_list`] grouped by queue: each queue's positions in
    /// it, in order; built once per cycle.
    fn reclaim_groups(&mut self, flavor: &str) -> Rc<ReclaimGroups> {
        if let Some(g) = self.reclaim_groups.get(flavor) {
            return g.clone();
        }
        let list = self.reclaim_list(flavor);
        let mut index: rustc_hash::FxHashMap<QueueId, usize> = Default::default();
        let mut groups: Vec<(QueueId, Vec<u32>)> = Vec::new();
        for (at, &k) in list.iter().enumerate() {
            let q = self.run[k].queue;
            let g = *index.entry(q).or_insert_with(|| {
                groups.push((q, Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push(at as u32);
        }
        let groups = Rc::new(groups);
        self.reclaim_groups
            .insert(flavor.to_string(), groups.clone());
        groups
    }

    fn with_borrowers(mut self) -> Self {
        let queues: BTreeSet<QueueId> = self.running_by_queue.keys().copied().collect();
        let flavors: Vec<String> = self.queues.flavors().cloned().collect();
        for f in flavors {
            let set = queues
                .iter()
                .copied()
                .filter(|q| self.queues.borrowing(*q, &f))
                .collect();
            self.borrowers.insert(f, set);
        }
        self
    }

    fn rank(&self, w: &Workload) -> u32 {
        self.cfg.classes.get(w.class).map_or(0, |c| c.rank)
    }

    /// Priority with aging: one step per `aging_step` seconds waited, capped.
    fn effective_priority(&self, w: &Workload) -> i32 {
        if self.cfg.aging_step == 0 {
            return w.priority;
        }
        let steps = (self.now.saturating_sub(w.submitted) / self.cfg.aging_step)
            .min(self.cfg.aging_cap.max(0) as u64);
        w.priority.saturating_add(steps as i32)
    }

    /// Slurm's classic fair-share factor `2^(−U/S)` per leaf queue (see
    /// [`Multifactor`]).
    fn fair_share_factors(&self) -> BTreeMap<QueueId, f64> {
        let leaves: Vec<(QueueId, f64, f64)> = self
            .queues
            .list()
            .iter()
            .enumerate()
            .map(|(i, q)| (QueueId(i as u32), q.weight.max(0.0)))
            .filter(|&(id, _)| self.queues.is_leaf(id))
            .map(|(id, w)| (id, w, self.history.usage.get(&id).copied().unwrap_or(0.0)))
            .collect();
        let used: f64 = leaves.iter().map(|l| l.2).sum();
        let weights: f64 = leaves.iter().map(|l| l.1).sum();
        leaves
            .into_iter()
            .map(|(id, weight, usage)| {
                let u = if used > 0.0 { usage / used } else { 0.0 };
                let s = if weights > 0.0 { weight / weights } else { 0.0 };
                (id, if s > 0.0 { 2f64.powf(-u / s) } else { 0.0 })
            })
            .collect()
    }

    /// A job's multifactor priority (see [`Multifactor`]).
    fn multifactor_priority(
        &self,
        w: &Workload,
        fair_share: &BTreeMap<QueueId, f64>,
        cluster_gpus: u64,
    ) -> i32 {
        let m = &self.cfg.multifactor;
        let waited = self.now.saturating_sub(w.submitted) as f64;
        let age = if m.max_age == 0 {
            1.0
        } else {
            (waited / m.max_age as f64).min(1.0)
        };
        let gpus = w.gpu_milli() as f64 / 1000.0;
        let size = if cluster_gpus > 0 {
            (gpus / cluster_gpus as f64).min(1.0)
        } else {
            0.0
        };
        let fs = fair_share.get(&w.queue).copied().unwrap_or(0.0);
        let p = m.age * age + m.fairshare * fs + m.job_size * size;
        (p.floor().min(i32::MAX as f64 / 2.0) as i32).saturating_add(w.priority)
    }

    fn order(&mut self) {
        use std::cmp::Reverse;
        // The order is (class tier, priority with aging) highest first, then
        // submission time and id, oldest first. Tier and priority take few
        // values: jobs are first counted into one bucket per pair, in index
        // order, then each bucket is sorted by submission. A backlog kept in
        // submission order (as callers keep it) is then already nearly
        // sorted, which the stable sort takes in about one pass.
        type Tier = (Reverse<u32>, Reverse<i32>);
        let n = self.pending.len();
        let factors = (self.cfg.ordering == Ordering::Multifactor).then(|| {
            let gpus = self
                .placer
                .cluster()
                .nodes()
                .iter()
                .map(|n| n.gpus.len() as u64)
                .sum::<u64>();
            (self.fair_share_factors(), gpus)
        });
        let mut bucket_of: rustc_hash::FxHashMap<Tier, u32> = Default::default();
        let mut tiers: Vec<Tier> = Vec::new();
        // (bucket, submitted, id, queue) per job: one pass over the jobs.
        let mut bucket: Vec<(u32, u64, JobId, u32)> = Vec::with_capacity(n);
        for w in self.pending.iter() {
            let tier = match self.cfg.ordering {
                Ordering::Fifo => (Reverse(0), Reverse(0)),
                _ => (
                    Reverse(if self.cfg.class_tiers {
                        match self.cfg.classes.get(w.class) {
                            Some(c) if c.preemptible && self.cfg.preemptible_one_tier => 0,
                            _ => self.rank(w),
                        }
                    } else {
                        0
                    }),
                    Reverse(match &factors {
                        Some((f, gpus)) => self.multifactor_priority(w, f, *gpus),
                        None => self.effective_priority(w),
                    }),
                ),
            };
            let b = *bucket_of.entry(tier).or_insert_with(|| {
                tiers.push(tier);
                tiers.len() as u32 - 1
            });
            bucket.push((b, w.submitted, w.job.id, w.queue.0));
        }
        // Each bucket's start in the order.
        let mut by_tier: Vec<u32> = (0..tiers.len() as u32).collect();
        by_tier.sort_unstable_by_key(|&b| tiers[b as usize]);
        let mut count = vec![0usize; tiers.len()];
        for &(b, ..) in &bucket {
            count[b as usize] += 1;
        }
        let mut start = vec![0usize; tiers.len()];
        let mut at = 0;
        for &b in &by_tier {
            start[b as usize] = at;
            at += count[b as usize];
        }
        // (submitted, id, index, queue): the queue rides along so that
        // filling the per-queue lists reads the order, not the jobs.
        let mut keyed: Vec<(u64, JobId, u32, u32, u64)> = vec![(0, JobId(0), 0, 0, 0); n];
        let mut next = start.clone();
        for (i, &(b, submitted, id, q)) in bucket.iter().enumerate() {
            let b = b as usize;
            keyed[next[b]] = (submitted, id, i as u32, q, self.pend_milli[i]);
            next[b] += 1;
        }
        for &b in &by_tier {
            let (s, c) = (start[b as usize], count[b as usize]);
            keyed[s..s + c].sort_by_key(|&(submitted, id, ..)| (submitted, id));
        }
        let mut lists: Vec<Vec<usize>> = vec![Vec::new(); self.queues.list().len()];
        for &(_, _, i, q, _) in &keyed {
            lists[q as usize].push(i as usize);
        }
        self.per_queue = lists
            .into_iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(q, l)| (QueueId(q as u32), l))
            .collect();
        self.global = keyed.iter().map(|k| k.2 as usize).collect();
        self.global_milli = keyed.iter().map(|k| k.4).collect();
    }

    /// The fair-share key of a queue: current dominant share blended with
    /// decayed historical usage, both over the effective weight.
    /// [`Cycle::compute_share`], remembered until the queue's usage changes.
    fn share(&self, q: QueueId) -> f64 {
        let cached = self.shares.borrow().get(q.0 as usize).copied().flatten();
        cached.unwrap_or_else(|| {
            let v = self.compute_share(q);
            let mut c = self.shares.borrow_mut();
            if c.len() <= q.0 as usize {
                c.resize(q.0 as usize + 1, None);
            }
            c[q.0 as usize] = Some(v);
            v
        })
    }

    /// A queue's share of its siblings' decayed usage over its share of
    /// their weight (below 1: it has had less than its share).
    fn history_share(&self, q: QueueId) -> f64 {
        let i = q.0 as usize;
        if let Some(&v) = self.history_shares.borrow().get(i)
            && !v.is_nan()
        {
            return v;
        }
        let (used, weights) = self.sibling_history(self.queues.get(q).parent);
        let weight = self.queues.get(q).effective_weight();
        let v = if used > 0.0 && weight > 0.0 {
            self.history.usage.get(&q).copied().unwrap_or(0.0) / used / (weight / weights)
        } else {
            0.0
        };
        let mut cache = self.history_shares.borrow_mut();
        if cache.len() <= i {
            cache.resize(i + 1, f64::NAN);
        }
        cache[i] = v;
        v
    }

    /// The decayed usage and the effective weight of `parent`'s children.
    fn sibling_history(&self, parent: Option<QueueId>) -> (f64, f64) {
        if let Some(&sums) = self.sibling_history.borrow().get(&parent) {
            return sums;
        }
        let children = self.queues.children(parent);
        let used: f64 = children
            .iter()
            .map(|c| self.history.usage.get(c).copied().unwrap_or(0.0))
            .sum();
        let weights: f64 = children
            .iter()
            .map(|&c| self.queues.get(c).effective_weight())
            .sum();
        self.sibling_history
            .borrow_mut()
            .insert(parent, (used, weights));
        (used, weights)
    }

    fn compute_share(&self, q: QueueId) -> f64 {
        let current = self.queues.dominant_share(q);
        let (total_hist, _) = self.sibling_history(self.queues.get(q).parent);
        let hist = if total_hist > 0.0 {
            self.history.usage.get(&q).copied().unwrap_or(0.0)
                / total_hist
                / self.queues.get(q).effective_weight().max(1e-9)
        } else {
            0.0
        };
        (1.0 - self.cfg.history_weight) * current + self.cfg.history_weight * hist
    }

    /// The leaf's key: the shares along its path from the top, compared in order.
    fn leaf_key(&self, leaf: QueueId) -> LeafKey {
        let mut key = LeafKey::new();
        let mut cur = Some(leaf);
        while let Some(q) = cur {
            key.push(OrdF64(self.share(q)));
            cur = self.queues.get(q).parent;
        }
        key.reverse();
        key
    }

    fn admit_all(&mut self) {
        // Preemptors whose victims have stopped take the room made for them.
        let ready: Vec<usize> = if self.ready.is_empty() {
            Vec::new()
        } else {
            (0..self.pending.len())
                .filter(|&i| self.ready.contains(&self.pend_id[i]))
                .collect()
        };
        let mut done = BTreeSet::new();
        for i in ready {
            if self.try_admit(i) {
                done.insert(i);
            }
        }
        if !done.is_empty() {
            for list in self.per_queue.values_mut() {
                list.retain(|i| !done.contains(i));
            }
            (self.global, self.global_milli) = self
                .global
                .iter()
                .zip(&self.global_milli)
                .filter(|(i, _)| !done.contains(*i))
                .map(|(&i, &m)| (i, m))
                .unzip();
        }
        match self.cfg.ordering {
            Ordering::Fifo | Ordering::Priority | Ordering::Multifactor => {
                let order = std::mem::take(&mut self.global);
                for (pos, &i) in order.iter().enumerate() {
                    let admitted = self.try_admit(i);
                    // FIFO: the head blocks everything behind it.
                    if !admitted && self.cfg.ordering == Ordering::Fifo && !self.cfg.backfill {
                        for &j in &order[pos + 1..] {
                            self.not_reached[j] = (pos + 1) as u32;
                        }
                        break;
                    }
                }
                self.global = order;
            }
            Ordering::FairShare => {
                // A lazy heap of leaves by fair-share key (smallest first): a
                // popped leaf whose key grew since it was pushed goes back.
                let mut heap: BinaryHeap<(std::cmp::Reverse<LeafKey>, std::cmp::Reverse<QueueId>)> =
                    BinaryHeap::new();
                // Per queue (by id), the next position in its list.
                let n = self.queues.list().len();
                let mut cursor = vec![0usize; n];
                // No head-of-line blocking across classes: a queue's failed
                // tries are shared out among the classes it has pending, and
                // a class that used its share holds back only its own jobs
                // (kept with the queue position where it did). The queue's
                // total stays about its part of `tries_per_cycle`, at least
                // `tries_per_queue`.
                let mut share = vec![0usize; n];
                let per_queue = self
                    .cfg
                    .tries_per_queue
                    .max(self.cfg.tries_per_cycle / self.per_queue.len().max(1));
                for (&q, list) in &self.per_queue {
                    // Distinct classes pending, as bits (classes past the
                    // 128th share the last bit: a larger share, never a
                    // smaller one).
                    let classes = list
                        .iter()
                        .fold(0u128, |m, &j| m | 1 << self.pend_class[j].min(127))
                        .count_ones() as usize;
                    share[q.0 as usize] = per_queue.div_ceil(classes.max(1)).max(1);
                }
                // Per queue, each class it tried.
                let mut tries: Vec<smallvec::SmallVec<[ClassTries; 4]>> =
                    vec![Default::default(); n];
                for &q in self.per_queue.keys() {
                    heap.push((std::cmp::Reverse(self.leaf_key(q)), std::cmp::Reverse(q)));
                }
                while let Some((std::cmp::Reverse(key), std::cmp::Reverse(q))) = heap.pop() {
                    let fresh = self.leaf_key(q);
                    if fresh > key {
                        heap.push((std::cmp::Reverse(fresh), std::cmp::Reverse(q)));
                        continue;
                    }
                    let qi = q.0 as usize;
                    let list = &self.per_queue[&q];
                    let mine = &mut tries[qi];
                    let c = &mut cursor[qi];
                    while let Some(&j) = list.get(*c) {
                        let class = self.pend_class[j];
                        let Some(at) = mine.iter().find(|t| t.0 == class).and_then(|t| t.2) else {
                            break;
                        };
                        self.not_reached[j] = at as u32;
                        *c += 1;
                    }
                    let Some(&i) = list.get(*c) else { continue };
                    *c += 1;
                    let at = *c;
                    if !self.try_admit(i) {
                        let class = self.pend_class[i];
                        let mine = &mut tries[qi];
                        let k = match mine.iter().position(|t| t.0 == class) {
                            Some(k) => k,
                            None => {
                                mine.push((class, 0, None));
                                mine.len() - 1
                            }
                        };
                        mine[k].1 += 1;
                        if mine[k].1 >= share[qi] {
                            mine[k].2 = Some(at);
                        }
                    }
                    heap.push((std::cmp::Reverse(self.leaf_key(q)), std::cmp::Reverse(q)));
                }
            }
        }
    }

    /// Tries to start pending job `i`; records why not. Returns whether it started.
    fn try_admit(&mut self, i: usize) -> bool {
        // A ready preemptor that could not start is tried again in order:
        // its reasons are those of its last try, not both.
        self.reasons[i].clear();
        let w = &self.pending[i];
        if self.history.waiting_for.contains_key(&w.job.id) {
            let n = self.history.waiting_for[&w.job.id].len();
            return self.wait(i, PendingReason::WaitingForPreemption { victims: n });
        }
        // Gates before quota: the queue's state, then the user's limits.
        let gate = self.queue_gate(i).or_else(|| self.user_limit(i));
        if let Some(r) = gate {
            self.reasons[i].push(r);
            // Every reason: what else would hold it once the gate opens.
            self.quota_and_fit_reasons(i);
            return false;
        }
        // Flavors: the queue's order, restricted to what the job accepts.
        let flavors = self.flavors_for(w);
        let mut reasons = Vec::new();
        // Per flavor: whether placement was tried and failed (not only quota).
        let mut place_failed = vec![false; flavors.len()];
        for (fi, flavor) in flavors.iter().enumerate() {
            if let Err(r) = self.quota_check(i, flavor) {
                reasons.push(r);
                // Every reason, not the first.
                if let Some(r) = self.unplaced_now(i, flavor) {
                    place_failed[fi] = true;
                    reasons.push(r);
                }
                continue;
            }
            match self.place_once(i, flavor) {
                Ok(p) => {
                    self.commit(i, flavor, p);
                    return true;
                }
                Err(r) => {
                    place_failed[fi] = true;
                    reasons.push(r)
                }
            }
        }
        // Preemption, on the first flavor (in the queue's order) where it helps.
        if self.cfg.preemption && self.preempt_tried.insert(self.pending[i].queue) {
            for (fi, flavor) in flavors.iter().enumerate() {
                let w = &self.pending[i];
                let key = (w.queue, self.fidx(flavor), self.rank(w), w.priority);
                if self
                    .no_victims
                    .get(&key)
                    .is_some_and(|&d| self.pend_milli[i] >= d)
                {
                    continue;
                }
                self.budget_block = None;
                self.fair_block = None;
                let found = self.find_victims(i, flavor, place_failed[fi]);
                if found.is_none()
                    && let Some((theirs, ours)) = self.fair_block
                {
                    reasons.push(PendingReason::ReclaimFairness {
                        queue: self.queues.get(theirs).name.clone(),
                        theirs: self.history_share(theirs),
                        our_queue: self.queues.get(ours).name.clone(),
                        ours: self.history_share(ours),
                    });
                }
                if found.is_none()
                    && let Some((q, used)) = self.budget_block
                {
                    let budget = self.cfg.disruption_budget.unwrap_or(0.0);
                    let queue = self.queues.get(q).name.clone();
                    reasons.push(PendingReason::DisruptionBudget {
                        queue,
                        used,
                        budget,
                    });
                }
                if found.is_none() {
                    let d = self.pend_milli[i];
                    let e = self.no_victims.entry(key).or_insert(d);
                    *e = (*e).min(d);
                }
                if let Some(victims) = found {
                    return self.wait_for_victims(i, victims);
                }
            }
            if let Some(limit_s) = self.cfg.max_unsaved {
                let jobs = self.unsaved_held_for(i, &flavors);
                if jobs > 0 {
                    reasons.push(PendingReason::UnsavedWork { jobs, limit_s });
                }
            }
        }
        // Consolidation: moving a few running jobs lets it start.
        if self.cfg.preemption
            && self.cfg.consolidate_max_unsaved.is_some()
            && self.may_consolidate
            && self.consolidation_tries < MAX_CONSOLIDATION_TRIES
        {
            let open = flavors
                .iter()
                .enumerate()
                .find(|&(fi, f)| place_failed[fi] && self.quota_check(i, f).is_ok())
                .map(|(_, f)| f.clone());
            if let Some(flavor) = open
                && let Some(victims) = self.consolidate(i, &flavor)
            {
                self.may_consolidate = false;
                self.history.consolidated_at = Some(self.now);
                return self.wait_for_victims(i, victims);
            }
        }
        // Backfill: the first jobs blocked by capacity (not quota) get a reservation.
        if self.cfg.backfill
            && self.reservations.len() < self.cfg.max_reservations.max(1)
            && !self.reserved.contains_key(&self.pending[i].job.id)
        {
            let open = flavors.iter().find(|f| self.quota_check(i, f).is_ok());
            if let Some(flavor) = open {
                self.reserve(i, flavor);
            }
        }
        for r in reasons {
            self.reasons[i].push(r);
        }
        false
    }

    /// Job `i` waits for the victims chosen for it to stop; they are
    /// preempted with the plan.
    fn wait_for_victims(&mut self, i: usize, victims: Vec<Preemption>) -> bool {
        let id = self.pending[i].job.id;
        self.history
            .waiting_for
            .insert(id, victims.iter().map(|v| v.victim).collect());
        let n = victims.len();
        self.preempted.extend(victims);
        self.wait(i, PendingReason::WaitingForPreemption { victims: n })
    }

    /// Adds to job `i`'s reasons every quota and placement reason on the
    /// flavors it accepts, trying nothing for good (placements are trials);
    /// none when one flavor has neither (the job would start there).
    fn quota_and_fit_reasons(&mut self, i: usize) {
        let flavors = self.flavors_for(&self.pending[i]);
        let mut found = Vec::new();
        for flavor in flavors.iter() {
            let before = found.len();
            found.extend(self.quota_check(i, flavor).err());
            found.extend(self.unplaced_now(i, flavor));
            if found.len() == before {
                return;
            }
        }
        self.reasons[i].extend(found);
    }

    /// Why job `i`'s queue starts nothing now (held or draining), if so.
    fn queue_gate(&self, i: usize) -> Option<PendingReason> {
        let q = self.queues.get(self.pending[i].queue);
        match q.state {
            QueueState::Held => Some(PendingReason::QueueHeld {
                queue: q.name.clone(),
            }),
            QueueState::Draining => Some(PendingReason::QueueDraining {
                queue: q.name.clone(),
            }),
            QueueState::Open => None,
        }
    }

    /// The per-user limit of its queue that job `i` would pass, if any.
    fn user_limit(&self, i: usize) -> Option<PendingReason> {
        let w = &self.pending[i];
        let q = self.queues.get(w.queue);
        let (used, count) = if has_user_limits(self.queues, w.queue) {
            self.users
                .get(&(w.queue, w.user.as_str()))
                .copied()
                .unwrap_or_default()
        } else {
            (0, 0)
        };
        if let Some(limit) = q.user_limits.max_gpu_milli
            && used + self.pend_milli[i] > limit
        {
            return Some(PendingReason::UserGpuLimit {
                user: w.user.clone(),
                used,
                limit,
            });
        }
        if let Some(limit) = q.user_limits.max_running
            && count + 1 > limit
        {
            return Some(PendingReason::UserRunningLimit {
                user: w.user.clone(),
                running: count,
                limit,
            });
        }
        None
    }

    /// Why job `i` would not fit on `flavor` now, quota aside (`None` when
    /// it would): so that a job quota blocks is not promised to start once
    /// quota frees. Both outcomes are remembered (see
    /// [`Cycle::fits_committed`]).
    fn unplaced_now(&mut self, i: usize, flavor: &str) -> Option<PendingReason> {
        let key = self.place_key(i, flavor);
        if let Some(r) = self.unplaceable.get(&key) {
            return Some(r.clone());
        }
        if self.no_fit.contains(&key) {
            // Failed a trial without its explanation: fetch that once.
        } else if self.fits_seen.get(&key) == Some(&self.epoch) {
            return None;
        }
        // A success costs what a trial would; a failure is explained (and
        // leaves no trace by itself).
        let trial = self.placer.begin_trial();
        let r = self.place_once(i, flavor);
        if let Ok(p) = &r {
            self.placer.release(p);
            self.fits_seen.insert(key, self.epoch);
        }
        self.placer.end_trial(trial);
        r.err()
    }

    fn wait(&mut self, i: usize, r: PendingReason) -> bool {
        self.reasons[i].push(r);
        false
    }

    /// The flavors a job may run on, in its queue's order: shared, and kept
    /// per queue for the jobs that name no GPU model (most of them).
    fn flavors_for(&mut self, w: &Workload) -> Rc<[Arc<str>]> {
        if !w.needs_gpu() {
            return self.no_gpu.clone();
        }
        let open = w.job.groups.iter().all(|g| g.request.models.is_empty());
        if open && let Some(v) = self.queue_flavors.get(&w.queue) {
            return v.clone();
        }
        let q = self.queues.get(w.queue);
        let order: Vec<&String> = if q.flavor_order.is_empty() {
            // Flavors with quota first (in name order), then any others the cluster has.
            let mut v: Vec<&String> = q.quotas.keys().collect();
            v.extend(self.queues.flavors().filter(|f| !q.quotas.contains_key(*f)));
            v
        } else {
            q.flavor_order.iter().collect()
        };
        let accepts = |f: &String| {
            w.job
                .groups
                .iter()
                .all(|g| g.request.models.is_empty() || g.request.models.contains(f))
        };
        // A flavor with capacity is one the queues know, so it has a name here.
        let list: Rc<[Arc<str>]> = order
            .into_iter()
            .filter(|f| accepts(f) && self.queues.capacity(f) > 0)
            .filter_map(|f| self.queues.flavor_index(f))
            .map(|f| self.flavor_names[f].clone())
            .collect();
        if open {
            self.queue_flavors.insert(w.queue, list.clone());
        }
        list
    }

    /// [`flavor_index`], first by identity with the cycle's shared names
    /// (what [`Cycle::flavors_for`] hands out), without comparing text.
    fn fidx(&self, flavor: &str) -> u32 {
        self.flavor_names
            .iter()
            .position(|n| std::ptr::eq(n.as_ptr(), flavor.as_ptr()) && n.len() == flavor.len())
            .map_or_else(|| flavor_index(self.queues, flavor), |f| f as u32)
    }

    fn class_may_borrow(&self, w: &Workload) -> bool {
        self.cfg.classes.get(w.class).is_none_or(|c| c.may_borrow)
    }

    fn within_guarantee(&self, i: usize, flavor: &str) -> bool {
        let q = self.pending[i].queue;
        match self.fidx(flavor) {
            NO_FLAVOR => self.pend_milli[i] <= self.queues.get(q).quota(flavor).guaranteed,
            f => {
                self.queues.usage_at(q, f as usize) + self.pend_milli[i]
                    <= self.queues.quota_at(q, f as usize).guaranteed
            }
        }
    }

    fn quota_ok(&self, i: usize, flavor: &str) -> Result<(), PendingReason> {
        let w = &self.pending[i];
        if !self.cfg.quotas || flavor.is_empty() {
            return Ok(());
        }
        // Classes that may not borrow share the guarantee among themselves:
        // borrowing work in the same queue yields to them (by preemption).
        if !self.class_may_borrow(w) {
            let held = self
                .protected
                .get(&(w.queue, self.fidx(flavor)))
                .copied()
                .unwrap_or(0);
            let guaranteed = match self.fidx(flavor) {
                NO_FLAVOR => self.queues.get(w.queue).quota(flavor).guaranteed,
                f => self.queues.quota_at(w.queue, f as usize).guaranteed,
            };
            if held + self.pend_milli[i] > guaranteed {
                let class = self
                    .cfg
                    .classes
                    .get(w.class)
                    .map_or(Arc::from(""), |c| Arc::from(c.name.as_str()));
                return Err(PendingReason::NotWithinGuarantee {
                    flavor: self.flavor_name(flavor),
                    class,
                    usage: held + self.pend_milli[i],
                    guaranteed,
                });
            }
        }
        let fits = match self.fidx(flavor) {
            NO_FLAVOR => self.queues.fits(w.queue, flavor, self.pend_milli[i]),
            f => self.queues.fits_at(w.queue, f as usize, self.pend_milli[i]),
        };
        fits.map_err(|block| PendingReason::Quota {
            flavor: self.flavor_name(flavor),
            queue_names: {
                let named = match &block {
                    QuotaBlock::Cap { queue, .. }
                    | QuotaBlock::BorrowLimit { queue, .. }
                    | QuotaBlock::Budget { queue, .. } => Some(*queue),
                    QuotaBlock::NoLendableCapacity { parent, .. } => *parent,
                };
                named
                    .map(|q| (q, self.queues.get(q).name.clone()))
                    .into_iter()
                    .collect()
            },
            block,
        })
    }

    /// [`Cycle::quota_ok`] outside trial releases, remembered until the next
    /// admission changes usage.
    fn quota_check(&mut self, i: usize, flavor: &str) -> Result<(), PendingReason> {
        let w = &self.pending[i];
        let key = (w.queue, self.fidx(flavor), self.pend_milli[i], w.class);
        if let Some(r) = self.quota_memo.get(&key) {
            return r.clone();
        }
        let r = self.quota_ok(i, flavor);
        self.quota_memo.insert(key, r.clone());
        r
    }

    /// A flavor's name for a reason, shared by every reason of the cycle.
    fn flavor_name(&self, flavor: &str) -> Arc<str> {
        match self.queues.flavor_index(flavor) {
            Some(f) => self.flavor_names[f].clone(),
            None => Arc::from(flavor),
        }
    }

    /// The job restricted to one flavor, keeping off reserved nodes unless it ends first.
    fn job_on(&self, i: usize, flavor: &str) -> Job {
        let mut job = on_flavor(&self.pending[i].job, flavor);
        job.constraints.avoid_reservations = self.avoids_reserved(i);
        job
    }

    /// The reservation slots job `i` must keep off, a bit each: none when
    /// it holds a reservation or ends before the first one starts; else
    /// every reserved node, or with [`Config::backfill_per_node`] the slots
    /// whose reservation starts before the job would end.
    fn avoids_reserved(&self, i: usize) -> u64 {
        let w = &self.pending[i];
        if self.reserved_from == u64::MAX || self.reserved.contains_key(&w.job.id) {
            return 0;
        }
        let end = w
            .max_runtime
            .map_or(u64::MAX, |m| self.now.saturating_add(m));
        if end <= self.reserved_from {
            0
        } else if self.cfg.backfill_per_node {
            self.reservations
                .iter()
                .enumerate()
                .filter(|(_, r)| r.start_at < end)
                .fold(0, |mask, (k, _)| mask | 1u64 << Self::slot(k))
        } else {
            u64::MAX
        }
    }

    /// The placer's slot of the `k`-th reservation of the cycle with
    /// [`Config::backfill_per_node`] (without it, every reservation's nodes
    /// take slot 1). The reservations past the last slot share it: a job
    /// keeps off them all when the earliest of them starts before it ends.
    fn slot(k: usize) -> u8 {
        (k + 1).min(crate::cluster::MAX_RESERVATION_SLOT as usize) as u8
    }

    /// Job `i`'s placement problem on `flavor` (see [`PlaceKey`]).
    fn place_key(&mut self, i: usize, flavor: &str) -> PlaceKey {
        if self.shape_of[i] == u32::MAX {
            let next = self.shapes.len() as u32;
            self.shape_of[i] = *self
                .shapes
                .entry(Shape(&self.pending[i].job))
                .or_insert(next);
        }
        (self.shape_of[i], self.fidx(flavor), self.avoids_reserved(i))
    }

    /// [`Cycle::place`] for the admission path, remembering shapes that fail.
    fn place_once(&mut self, i: usize, flavor: &str) -> Result<Placement, PendingReason> {
        let key = self.place_key(i, flavor);
        if let Some(r) = self.unplaceable.get(&key) {
            return Err(r.clone());
        }
        let job = self.job_on(i, flavor);
        let r = self.place(&job, flavor);
        if let Err(e) = &r {
            self.unplaceable.insert(key, e.clone());
        }
        r
    }

    /// Whether job `i` would fit on `flavor` now. Only for the committed
    /// state (no trial release in progress): failures are remembered, as
    /// capacity only shrinks during a cycle, and fits until the state
    /// changes (the next [`Cycle::epoch`]).
    fn fits_committed(&mut self, i: usize, flavor: &str) -> bool {
        let key = self.place_key(i, flavor);
        if self.unplaceable.contains_key(&key) || self.no_fit.contains(&key) {
            return false;
        }
        if self.fits_seen.get(&key) == Some(&self.epoch) {
            return true;
        }
        match self.fits_now(i, flavor) {
            Some(_) => {
                self.fits_seen.insert(key, self.epoch);
                true
            }
            None => {
                self.no_fit.insert(key);
                false
            }
        }
    }

    /// A trial placement: where job `i` would fit now, without explanation.
    /// Nothing stays placed, and it leaves no trace on later tie-breaks.
    fn fits_now(&mut self, i: usize, flavor: &str) -> Option<Placement> {
        let job = self.job_on(i, flavor);
        self.fits_now_as(&job)
    }

    /// [`Cycle::fits_now`] of a job already built.
    fn fits_now_as(&mut self, job: &Job) -> Option<Placement> {
        fits_now(self.placer, job)
    }

    /// Places a job already restricted by [`Cycle::job_on`], explaining a failure.
    fn place(&mut self, job: &Job, flavor: &str) -> Result<Placement, PendingReason> {
        self.placer.place_job(job).map_err(|unplaced| {
            if unplaced
                .rejections
                .iter()
                .any(|(r, _)| *r == crate::placement::Reject::Reserved)
                && let Some(r) = self
                    .reservations
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| {
                        job.constraints.avoid_reservations & (1u64 << Self::slot(*k)) != 0
                    })
                    .map(|(_, r)| r)
                    .min_by_key(|r| r.start_at)
            {
                return PendingReason::Reservation {
                    job: r.job,
                    start_at: r.start_at,
                };
            }
            PendingReason::Placement {
                flavor: self.flavor_name(flavor),
                unplaced: Arc::new(unplaced),
            }
        })
    }

    fn commit(&mut self, i: usize, flavor: &str, p: Placement) {
        self.quota_memo.clear();
        self.epoch += 1;
        let w = &self.pending[i];
        if !flavor.is_empty() {
            self.queues
                .charge(w.queue, flavor, self.pend_milli[i] as i64);
            // Shares of the queue, its ancestors and (through the history sum
            // of siblings, which does not change here) nobody else.
            let mut c = self.shares.borrow_mut();
            for q in self.queues.path(w.queue) {
                if let Some(x) = c.get_mut(q.0 as usize) {
                    *x = None;
                }
            }
            drop(c);
            // Jobs admitted now are not victims this cycle, but their queue's
            // existing jobs may now be borrowing.
            if self.queues.borrowing(w.queue, flavor)
                && self.running_by_queue.contains_key(&w.queue)
            {
                self.borrowers
                    .entry(flavor.to_string())
                    .or_default()
                    .insert(w.queue);
            }
        }
        if has_user_limits(self.queues, w.queue) {
            let pending = self.pending;
            let e = self
                .users
                .entry((w.queue, pending[i].user.as_str()))
                .or_default();
            e.0 += self.pend_milli[i];
            e.1 += 1;
        }
        if !self.class_may_borrow(w) {
            *self
                .protected
                .entry((w.queue, self.fidx(flavor)))
                .or_default() += self.pend_milli[i];
        }
        self.admitted.push((w.job.id, flavor.to_string(), p));
        self.admitted_idx.push(i);
    }

    /// Consolidation for job `i` on `flavor`: running preemptible jobs
    /// alone on nodes with free GPUs, holding little unsaved work, whose
    /// nodes would then take job `i`, and which all fit elsewhere at once.
    /// Tried on the live state and undone; `None` when no such set exists.
    fn consolidate(&mut self, i: usize, flavor: &str) -> Option<Vec<Preemption>> {
        let limit = self.cfg.consolidate_max_unsaved?;
        let key = self.place_key(i, flavor);
        if self.no_consolidation.contains(&key) {
            return None;
        }
        self.consolidation_tries += 1;
        let fi = self.fidx(flavor);
        let movable = self.movable(fi, flavor, limit);
        let movers = &movable.movers;
        let cluster = self.placer.cluster();
        let free: u64 = movable
            .in_flavor
            .iter()
            .map(|&n| cluster.free_milli_total(cluster.nodes()[n as usize].id))
            .sum();
        if free < self.pend_milli[i] {
            self.no_consolidation.insert(key);
            return None;
        }
        // Only smaller jobs that do not outrank it move, so that no moved
        // job moves or preempts it back.
        let w = &self.pending[i];
        let (size, rank) = (self.pend_milli[i], (self.rank(w), w.priority));
        let nodes: Vec<(f64, u64, u32)> = movable
            .nodes
            .iter()
            .filter(|&&(_, _, n)| {
                cluster.free_milli_total(cluster.nodes()[n as usize].id) > 0
                    && movers[&n].iter().all(|&k| {
                        let r = &self.run[k];
                        !r.victim && r.milli < size && (r.rank, r.priority) <= rank
                    })
            })
            .take(32)
            .copied()
            .collect();
        let job = self.job_on(i, flavor);
        let trial = self.placer.begin_trial();
        // The fewest nodes (cheapest first) whose emptying lets it fit.
        let mut emptied = 0;
        let mut released: Vec<usize> = Vec::new();
        let empty =
            |placer: &mut Placer, released: &mut Vec<usize>, emptied: &mut usize, n: usize| {
                while *emptied < n {
                    for &k in &movers[&nodes[*emptied].2] {
                        placer.release(&self.running[k].allocations);
                        released.push(k);
                    }
                    *emptied += 1;
                }
                while *emptied > n {
                    *emptied -= 1;
                    for _ in &movers[&nodes[*emptied].2] {
                        let k = released.pop().expect("released");
                        placer.restore(&self.running[k].allocations);
                    }
                }
            };
        let found = fewest(nodes.len(), |n| {
            empty(self.placer, &mut released, &mut emptied, n);
            fits_now(self.placer, &job)
        });
        if let Some((n, _)) = found {
            empty(self.placer, &mut released, &mut emptied, n);
        }
        let Some((_, p)) = found else {
            empty(self.placer, &mut released, &mut emptied, 0);
            self.placer.end_trial(trial);
            self.no_consolidation.insert(key);
            return None;
        };
        // Only the jobs on the nodes it takes move.
        let taken: BTreeSet<u32> = p.iter().map(|a| a.node.0).collect();
        let (mut victims, back): (Vec<usize>, Vec<usize>) = released
            .into_iter()
            .partition(|&k| taken.contains(&self.running[k].allocations[0].node.0));
        for &k in back.iter().rev() {
            self.placer.restore(&self.running[k].allocations);
        }
        let applied = self.placer.apply(&p).is_ok();
        victims.sort_by_key(|&k| std::cmp::Reverse(self.run[k].milli));
        let mut placed = Vec::new();
        let mut all = applied;
        for &k in victims.iter().take_while(|_| applied) {
            let mut vjob = on_flavor(&self.running[k].work.job, flavor);
            vjob.constraints.avoid_reservations = u64::MAX;
            match self.placer.try_place_job(&vjob) {
                Some(q) => placed.push(q),
                None => {
                    all = false;
                    break;
                }
            }
        }
        for q in placed.iter().rev() {
            self.placer.release(q);
        }
        if applied {
            self.placer.release(&p);
        }
        for &k in victims.iter().rev() {
            self.placer.restore(&self.running[k].allocations);
        }
        self.placer.end_trial(trial);
        if !all || victims.is_empty() {
            self.no_consolidation.insert(key);
            return None;
        }
        let chosen = victims
            .into_iter()
            .map(|k| (k, PreemptReason::Consolidation))
            .collect();
        Some(self.commit_victims(i, chosen))
    }

    /// The running jobs consolidation may move on flavor `fi`, by node, and
    /// the nodes that hold nothing else in cost order (least work lost,
    /// fewest GPUs): built once a cycle, as the running jobs do not change
    /// during it (victims are left out where they are used).
    fn movable(&mut self, fi: u32, flavor: &str, limit: u64) -> Rc<Movable> {
        if let Some(m) = self.movable.get(&fi) {
            return m.clone();
        }
        let cluster = self.placer.cluster();
        let in_flavor: Vec<u32> = cluster
            .nodes()
            .iter()
            .filter(|n| n.gpus.iter().any(|g| g.model == flavor))
            .map(|n| n.id.0)
            .collect();
        let count = cluster.nodes().len();
        let mut fixed = vec![false; count];
        let mut cost = vec![(0.0f64, 0u64); count];
        let mut on: Vec<(u32, usize)> = Vec::new();
        for k in 0..self.running.len() {
            let node = self.locate(k);
            let r = &self.running[k];
            // Preemptible now (its class, its minimum runtime) and little to lose.
            let may_move =
                self.run[k].flavor == fi && self.run[k].preemptible && r.unsaved(self.now) <= limit;
            match (node != u32::MAX).then_some(node) {
                Some(n) if may_move => {
                    on.push((n, k));
                    let c = &mut cost[n as usize];
                    c.0 += self.run[k].lost;
                    c.1 += self.run[k].milli;
                }
                _ => {
                    for a in &r.allocations {
                        fixed[a.node.0 as usize] = true;
                    }
                }
            }
        }
        on.sort_unstable();
        let mut movers: rustc_hash::FxHashMap<u32, Vec<usize>> = Default::default();
        for jobs in on.chunk_by(|a, b| a.0 == b.0) {
            let n = jobs[0].0;
            if !fixed[n as usize] {
                movers.insert(n, jobs.iter().map(|&(_, k)| k).collect());
            }
        }
        let mut nodes: Vec<(f64, u64, u32)> = movers
            .keys()
            .map(|&n| (cost[n as usize].0, cost[n as usize].1, n))
            .collect();
        nodes.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let m = Rc::new(Movable {
            in_flavor,
            nodes,
            movers,
        });
        self.movable.insert(fi, m.clone());
        m
    }

    /// Running jobs job `i` could preempt on `flavors` (its own queue's of
    /// lower priority; borrowers' where it is within its guarantee) but that
    /// are kept for their unsaved work.
    fn unsaved_held_for(&self, i: usize, flavors: &[Arc<str>]) -> usize {
        let w = &self.pending[i];
        let my_rank = (self.rank(w), w.priority);
        let held = |q: QueueId, fi: u32, below: Option<(u32, i32)>| {
            self.held
                .get(&q)
                .into_iter()
                .flatten()
                .filter(|&&(f, rank, priority)| {
                    f == fi && below.is_none_or(|b| (rank, priority) < b)
                })
                .count()
        };
        let mut n = 0;
        for flavor in flavors {
            let fi = self.fidx(flavor);
            n += held(w.queue, fi, Some(my_rank));
            if fi != NO_FLAVOR && self.within_guarantee(i, flavor) {
                n += self
                    .borrowers
                    .get(&**flavor)
                    .into_iter()
                    .flatten()
                    .filter(|&&q| q != w.queue)
                    .map(|&q| held(q, fi, None))
                    .sum::<usize>();
            }
        }
        n
    }

    /// Victims whose removal lets job `i` fit (quota and placement), chosen to
    /// lose the least work and the fewest GPUs; `None` when no allowed set helps.
    /// Tried on the live state and undone.
    fn find_victims(
        &mut self,
        i: usize,
        flavor: &str,
        place_failed: bool,
    ) -> Option<Vec<Preemption>> {
        let w = &self.pending[i];
        // Aging orders the queue but never lets a job preempt its peers: rank
        // and base priority decide who may preempt whom.
        let my_rank = (self.rank(w), w.priority);
        let fi = self.fidx(flavor);
        let entitled = self.within_guarantee(i, flavor);
        // The reclaims of batch and training (unless protected classes are
        // held to it too) by queues that have had their share are paced:
        // budgets bind them, and they take only from queues that have had
        // as much.
        let protected = !self.cfg.classes[w.class].preemptible;
        self.search_paced = (!protected || !self.cfg.protected_pass_budgets)
            && self.history_share(w.queue) >= self.cfg.underserved_pass_budgets;
        self.search_budget = self.cfg.disruption_budget.filter(|_| self.search_paced);
        // Victims may be the own queue's jobs of strictly lower priority and,
        // when entitled to reclaim, the jobs of queues that borrow this flavor.
        // Both lists are in cost order: lowest class, least work lost, fewest GPUs.
        let mut own: Vec<(usize, PreemptReason)> = self
            .own_scan
            .get(&w.queue)
            .into_iter()
            .flatten()
            .filter(|&&(f, rank, priority, _)| f == fi && (rank, priority) < my_rank)
            .map(|&(.., k)| k as usize)
            .filter(|&k| self.runs_on(k, fi, flavor) && self.run[k].eligible())
            .map(|k| (k, PreemptReason::Priority))
            .collect();
        own.sort_by(|a, b| self.victim_cost(a.0, b.0));
        // An entitled job's reclaim candidates come from the stream its
        // flavor's searches share, screened once per change of the state
        // (guarantees and disruption budgets; a search's own victims are
        // counted against budgets as it releases them).
        // A search that reclaim fairness binds builds its own window from the
        // queues it may take from ([`Cycle::window`]): the shared stream,
        // filtered, would mostly run dry.
        let fair = self.search_paced && self.cfg.reclaims_restore_fairness;
        if entitled && fi != NO_FLAVOR && !fair {
            let shared = self.shared_window(fi, flavor);
            if let Some((candidates, screened)) = self.window_from(&shared, &own, w.queue) {
                #[cfg(debug_assertions)]
                {
                    let direct = self.window(&own, Some(fi), w.queue, flavor);
                    debug_assert_eq!(candidates, direct, "shared reclaim window differs");
                    let again = self.screen(&direct);
                    debug_assert_eq!(screened.kept, again.kept);
                    debug_assert_eq!(screened.budget_block, again.budget_block);
                }
                return self.search(i, flavor, &candidates, &screened, place_failed);
            }
        }
        let reclaim = (entitled && fi != NO_FLAVOR).then_some(fi);
        let candidates = self.window(&own, reclaim, w.queue, flavor);
        let screened = self.screen(&candidates);
        self.search(i, flavor, &candidates, &screened, place_failed)
    }

    /// A search's candidate window: the cheapest [`MAX_CANDIDATES`] of the
    /// `own` candidates (cheapest first) and, when `reclaim` names the
    /// flavor index, the eligible jobs of other queues that borrow it. The
    /// reclaim list is already in cost order: the own jobs are merged in.
    fn window(
        &mut self,
        own: &[(usize, PreemptReason)],
        reclaim: Option<u32>,
        queue: QueueId,
        flavor: &str,
    ) -> Vec<(usize, PreemptReason)> {
        let window = match reclaim {
            // The rule leaves out whole queues: merge the own lists of the
            // queues it allows, so a search never walks the candidates of
            // queues it may not take from. The same candidates, in the same
            // order, as filtering the reclaim list would give.
            Some(fi) if self.search_paced && self.cfg.reclaims_restore_fairness => {
                let list = self.reclaim_list(flavor);
                let groups = self.reclaim_groups(flavor);
                let open = |k: usize, q: QueueId| {
                    self.run[k].eligible() && self.queues.borrowing_at(q, fi as usize)
                };
                // The queues the rule allows start the merge; of those it
                // refuses, the one whose first open candidate comes first
                // is the job's reason.
                let mut heads = std::mem::take(&mut self.fair_heads);
                heads.clear();
                let mut refused: Option<(u32, (QueueId, QueueId))> = None;
                for (g, (q, at)) in groups.iter().enumerate() {
                    if *q == queue {
                        continue;
                    }
                    let Some(pair) = self.refused(*q, queue) else {
                        heads.push(std::cmp::Reverse((at[0], g as u32, 0)));
                        continue;
                    };
                    if refused.is_some_and(|(best, _)| at[0] >= best) {
                        continue;
                    }
                    let first = at.iter().find(|&&p| open(list[p as usize], *q));
                    if let Some(&p) = first
                        && refused.is_none_or(|(best, _)| p < best)
                    {
                        refused = Some((p, pair));
                    }
                }
                if let Some((_, pair)) = refused {
                    self.fair_block.get_or_insert(pair);
                }
                let mut heap = BinaryHeap::from(heads);
                let others = std::iter::from_fn(|| {
                    while let Some(std::cmp::Reverse((at, g, i))) = heap.pop() {
                        let (q, positions) = &groups[g as usize];
                        let k = list[at as usize];
                        if let Some(&next) = positions.get(i as usize + 1) {
                            heap.push(std::cmp::Reverse((next, g, i + 1)));
                        }
                        if open(k, *q) {
                            return Some((k, ()));
                        }
                    }
                    None
                });
                let merged = self.merge(own, (), others).0;
                self.fair_heads = heap.into_vec();
                #[cfg(debug_assertions)]
                {
                    let filtered = list.iter().copied().filter(|&k| {
                        let q = self.run[k].queue;
                        q != queue
                            && self.run[k].eligible()
                            && self.queues.borrowing_at(q, fi as usize)
                            && self.refused(q, queue).is_none()
                    });
                    let direct = self.merge(own, (), filtered.map(|k| (k, ()))).0;
                    debug_assert_eq!(merged, direct, "the fair window differs from the filter's");
                }
                merged
            }
            Some(fi) => {
                let list = self.reclaim_list(flavor);
                let others = list.iter().copied().filter(|&k| {
                    let q = self.run[k].queue;
                    q != queue && self.run[k].eligible() && self.queues.borrowing_at(q, fi as usize)
                });
                self.merge(own, (), others.map(|k| (k, ()))).0
            }
            None => self.merge(own, (), std::iter::empty()).0,
        };
        window
            .into_iter()
            .map(|(k, reason, ())| (k, reason))
            .collect()
    }

    /// The cheapest [`MAX_CANDIDATES`] of `own` and `reclaim` (both in cost
    /// order), each with its tag (`own_tag` for the own ones), and whether
    /// the window filled before the own jobs left over were added.
    fn merge<T: Copy>(
        &self,
        own: &[(usize, PreemptReason)],
        own_tag: T,
        reclaim: impl Iterator<Item = (usize, T)>,
    ) -> (Vec<(usize, PreemptReason, T)>, bool) {
        let mut window = Vec::with_capacity(MAX_CANDIDATES);
        let mut own = own.iter().peekable();
        for (k, tag) in reclaim {
            if window.len() >= MAX_CANDIDATES {
                break;
            }
            while let Some(&&(o, reason)) = own.peek()
                && self.victim_cost(o, k).is_lt()
            {
                window.push((o, reason, own_tag));
                own.next();
            }
            window.push((k, PreemptReason::Reclaim, tag));
        }
        let filled = window.len() >= MAX_CANDIDATES;
        window.extend(own.map(|&(o, reason)| (o, reason, own_tag)));
        window.truncate(MAX_CANDIDATES);
        (window, filled)
    }

    /// The search proper over a candidate window, cheapest first (see
    /// [`Cycle::find_victims`]).
    fn search(
        &mut self,
        i: usize,
        flavor: &str,
        candidates: &[(usize, PreemptReason)],
        screened: &Screened,
        place_failed: bool,
    ) -> Option<Vec<Preemption>> {
        if !self.could_help(i, flavor, candidates, screened, place_failed) {
            return None;
        }
        let chosen = self.pick_victims(i, flavor, candidates)?;
        Some(self.commit_victims(i, chosen))
    }

    /// The victims among `candidates` (cheapest first) whose removal lets
    /// job `i` start on `flavor`, pruned to a minimal set; tried on the live
    /// state and undone (a trial).
    fn pick_victims(
        &mut self,
        i: usize,
        flavor: &str,
        candidates: &[(usize, PreemptReason)],
    ) -> Option<Vec<(usize, PreemptReason)>> {
        let mut chosen: Vec<(usize, PreemptReason)> = Vec::new();
        let mut planned = Planned::default();
        let mut found = false;
        let mut released = 0u64;
        let demand = self.pend_milli[i];
        // How many victims were released at the last fit test.
        let mut tried = 0;
        // Victims are released and taken back below: a trial.
        let trial = self.placer.begin_trial();
        for &(k, reason) in candidates {
            let r = &self.running[k];
            // Bounds: the victim's queue keeps its guarantee; its disruption budget holds.
            if reason == PreemptReason::Reclaim {
                if !self.keeps_guarantee(k) {
                    continue;
                }
                if let Some(used) = self.over_budget(k, &planned, self.search_budget) {
                    self.budget_block.get_or_insert((r.work.queue, used));
                    continue;
                }
                planned.add(r.work.queue, self.run[k].lost / 3600.0);
            }
            self.placer.release(&r.allocations);
            self.queues
                .charge(r.work.queue, flavor, -(self.run[k].milli as i64));
            chosen.push((k, reason));
            released += self.run[k].milli;
            // Placement is tried once enough is released, and otherwise only
            // at doubling counts and after the last victim (below), so a
            // long candidate list costs O(log n) tries.
            let worth = released >= demand || chosen.len().is_power_of_two();
            if worth {
                tried = chosen.len();
                if self.quota_ok(i, flavor).is_ok() && self.fits_now(i, flavor).is_some() {
                    found = true;
                    break;
                }
            }
        }
        // The fit with every victim released, unless tried already (the
        // candidates after the last victim may all have been skipped).
        if !found
            && tried < chosen.len()
            && self.quota_ok(i, flavor).is_ok()
            && self.fits_now(i, flavor).is_some()
        {
            found = true;
        }
        // Keep only the victims that are needed: put each back, latest first,
        // and keep it running if the job still fits without it.
        if found {
            let mut k = chosen.len();
            while k > 0 {
                k -= 1;
                let r = &self.running[chosen[k].0];
                self.placer.restore(&r.allocations);
                self.queues
                    .charge(r.work.queue, flavor, r.work.gpu_milli() as i64);
                let still = self.quota_ok(i, flavor).is_ok() && self.fits_now(i, flavor).is_some();
                if still {
                    chosen.remove(k);
                } else {
                    let r = &self.running[chosen[k].0];
                    self.placer.release(&r.allocations);
                    self.queues
                        .charge(r.work.queue, flavor, -(r.work.gpu_milli() as i64));
                }
            }
        }
        // Undo: the victims keep running until they stop.
        for (k, _) in chosen.iter().rev() {
            let r = &self.running[*k];
            self.placer.restore(&r.allocations);
            self.queues
                .charge(r.work.queue, flavor, r.work.gpu_milli() as i64);
        }
        self.placer.end_trial(trial);
        found.then_some(chosen)
    }

    /// Tells the chosen victims of job `i` to stop.
    fn commit_victims(&mut self, i: usize, chosen: Vec<(usize, PreemptReason)>) -> Vec<Preemption> {
        let by = self.pending[i].job.id;
        let mut out = Vec::new();
        self.epoch += 1;
        for (k, reason) in chosen {
            let r = &self.running[k];
            let lost = r.lost_gpu_seconds(self.now) / 3600.0;
            self.run[k].victim = true;
            // A queue's own priority preemptions make room for its own job;
            // only reclaim takes usage away from it.
            // Only reclaims count against its disruption budget, too.
            if reason == PreemptReason::Reclaim {
                *self
                    .leaving
                    .entry((r.work.queue, self.run[k].flavor))
                    .or_default() += self.run[k].milli;
                self.history
                    .disruptions
                    .entry(r.work.queue)
                    .or_default()
                    .push((self.now, lost));
            }
            out.push(Preemption {
                victim: r.work.job.id,
                by,
                signal_at: self.now,
                kill_at: self.now + r.work.grace,
                lost_gpu_hours: lost,
                reason,
            });
        }
        out
    }

    /// Whether running job `k`'s queue keeps its guarantee of `flavor` if `k`
    /// is reclaimed, counting the victims chosen earlier (this cycle or still
    /// stopping) as gone.
    fn keeps_guarantee(&self, k: usize) -> bool {
        self.keeps_guarantee_with(k, 0)
    }

    /// [`Cycle::keeps_guarantee`] with `gone` more milli-GPU of `k`'s queue
    /// and flavor released first (a search's earlier victims, counted
    /// without releasing them).
    fn keeps_guarantee_with(&self, k: usize, gone: u64) -> bool {
        let RunInfo {
            queue: q,
            flavor: fi,
            milli,
            ..
        } = self.run[k];
        if fi == NO_FLAVOR {
            return true;
        }
        let leaving = self.leaving.get(&(q, fi)).copied().unwrap_or(0);
        let after = self
            .queues
            .usage_at(q, fi as usize)
            .saturating_sub(leaving + gone + milli);
        after >= self.queues.quota_at(q, fi as usize).guaranteed
    }

    /// The pair of queues compared ([`Cycle::compared`]) when the search
    /// under way, by a job of `reclaimer`, may not reclaim from `victim`: a
    /// paced search takes only from queues that have had at least the
    /// reclaimer's share of the decayed usage
    /// ([`Config::reclaims_restore_fairness`]); `None` when it may.
    fn refused(&self, victim: QueueId, reclaimer: QueueId) -> Option<(QueueId, QueueId)> {
        if !self.search_paced || !self.cfg.reclaims_restore_fairness {
            return None;
        }
        let (theirs, ours) = self.compared(victim, reclaimer);
        (self.history_share(theirs) < self.history_share(ours)).then_some((theirs, ours))
    }

    /// The queues whose shares decide between leaves `victim` and
    /// `reclaimer`: themselves when siblings, else their ancestors that are
    /// children of the nearest queue above both (or top-level queues).
    fn compared(&self, victim: QueueId, reclaimer: QueueId) -> (QueueId, QueueId) {
        let parent = |q: QueueId| self.queues.get(q).parent;
        if parent(victim) == parent(reclaimer) {
            return (victim, reclaimer);
        }
        let depth = |mut q: QueueId| {
            let mut d = 0;
            while let Some(p) = parent(q) {
                q = p;
                d += 1;
            }
            d
        };
        // Up to the same depth, then up together until siblings.
        let (mut v, mut r) = (victim, reclaimer);
        let (mut dv, mut dr) = (depth(v), depth(r));
        while dv > dr {
            v = parent(v).unwrap_or(v);
            dv -= 1;
        }
        while dr > dv {
            r = parent(r).unwrap_or(r);
            dr -= 1;
        }
        while parent(v) != parent(r) {
            match (parent(v), parent(r)) {
                (Some(a), Some(b)) => (v, r) = (a, b),
                _ => break,
            }
        }
        if v == r { (victim, reclaimer) } else { (v, r) }
    }

    /// The candidates a search over `window` would have released after its
    /// last one: in order, each reclaim that leaves its queue its guarantee
    /// once the earlier ones are gone ([`Cycle::keeps_guarantee`] as the
    /// search sees it) and, when budgets bind the search, whose loss fits
    /// its queue's budget with the earlier ones' (as
    /// [`Cycle::pick_victims`] counts it). Every set the search reaches is a
    /// subset of it.
    fn releasable(&self, window: &[(usize, PreemptReason)]) -> Vec<usize> {
        // Released so far per victim queue and flavor (few queues per window).
        let mut gone: Vec<(QueueId, u32, u64)> = Vec::new();
        let mut planned = Planned::default();
        let mut out = Vec::with_capacity(window.len());
        for &(k, reason) in window {
            let RunInfo {
                queue: q,
                flavor: fi,
                milli,
                ..
            } = self.run[k];
            let slot = gone.iter().position(|g| g.0 == q && g.1 == fi);
            let before = slot.map_or(0, |s| gone[s].2);
            if reason == PreemptReason::Reclaim {
                if !self.keeps_guarantee_with(k, before)
                    || self.over_budget(k, &planned, self.search_budget).is_some()
                {
                    continue;
                }
                planned.add(q, self.run[k].lost / 3600.0);
            }
            match slot {
                Some(s) => gone[s].2 += milli,
                None => gone.push((q, fi, milli)),
            }
            out.push(k);
        }
        out
    }

    /// The candidates that pass the bounds now (they only tighten as a search
    /// releases victims, so one that fails them now is never taken), with
    /// the first disruption budget that left one out.
    fn screen(&self, candidates: &[(usize, PreemptReason)]) -> Screened {
        Screened::of(
            candidates
                .iter()
                .map(|&(k, reason)| (k, self.screen_one(k, reason))),
        )
    }

    /// Whether candidate `k` passes the bounds before any victim is
    /// released: a reclaim leaves its queue its guarantee, and its loss
    /// fits its queue's disruption budget.
    fn screen_one(&self, k: usize, reason: PreemptReason) -> Screen {
        self.screen_bounds(k, reason, self.search_budget)
    }

    /// [`Cycle::screen_one`] under `budget`.
    fn screen_bounds(&self, k: usize, reason: PreemptReason, budget: Option<f64>) -> Screen {
        if reason == PreemptReason::Reclaim && !self.keeps_guarantee(k) {
            return Screen::Guarantee;
        }
        if reason == PreemptReason::Reclaim
            && let Some(used) = self.over_budget(k, &Planned::default(), budget)
        {
            return Screen::Budget(self.run[k].queue, used);
        }
        Screen::Kept
    }

    /// Queue `q`'s GPU-hours already lost in the window, when candidate
    /// `k`'s loss beside what the search already `planned` to take from
    /// its queue would pass `budget`; `None` when it fits or no budget binds.
    fn over_budget(&self, k: usize, planned: &Planned, budget: Option<f64>) -> Option<f64> {
        let budget = budget?;
        let q = self.run[k].queue;
        let used = self
            .history
            .disrupted(q, self.now, self.cfg.disruption_window);
        (used + planned.of(q) + self.run[k].lost / 3600.0 > budget).then_some(used)
    }

    /// (node, GPUs held there, candidate) for the candidates, by node, from
    /// the packed records; a candidate on several nodes adds one entry per
    /// allocation.
    /// Running job `k`'s node (u32::MAX: several or none) and GPUs there,
    /// read from its allocations on first use.
    fn locate(&mut self, k: usize) -> u32 {
        if self.run[k].node == NODE_UNKNOWN {
            let allocations = &self.running[k].allocations;
            self.run[k].node = match allocations.split_first() {
                Some((a, rest)) if rest.iter().all(|b| b.node == a.node) => a.node.0,
                _ => u32::MAX,
            };
            self.run[k].gpus = allocations.iter().fold(0, |m, a| m | a.gpu_mask());
        }
        self.run[k].node
    }

    fn by_node(&mut self, candidates: &[usize]) -> Vec<(u32, u64, usize)> {
        let mut on: Vec<(u32, u64, usize)> = Vec::with_capacity(candidates.len());
        for &k in candidates {
            self.locate(k);
            let r = &self.run[k];
            if r.node != u32::MAX {
                on.push((r.node, r.gpus, k));
            } else {
                on.extend(
                    self.running[k]
                        .allocations
                        .iter()
                        .map(|a| (a.node.0, a.gpu_mask(), k)),
                );
            }
        }
        on.sort_unstable();
        on
    }

    /// The reclaim candidates shared by the entitled searches of flavor
    /// `fi`: the first eligible jobs of borrowing queues, each screened
    /// against the bounds once. Rebuilt when an admission or a preemption
    /// (`epoch`) may have changed any of it.
    fn shared_window(&mut self, fi: u32, flavor: &str) -> Rc<SharedWindow> {
        if let Some(w) = self.shared.get(&fi)
            && w.epoch == self.epoch
        {
            return w.clone();
        }
        let list = self.reclaim_list(flavor);
        let mut stream = Vec::new();
        for k in list.iter().copied() {
            if stream.len() >= SHARED_STREAM {
                break;
            }
            let q = self.run[k].queue;
            if self.run[k].eligible() && self.queues.borrowing_at(q, fi as usize) {
                // Screened with the budgets, for the searches they bind.
                stream.push((
                    k,
                    q,
                    self.screen_bounds(k, PreemptReason::Reclaim, self.cfg.disruption_budget),
                ));
            }
        }
        let w = Rc::new(SharedWindow {
            epoch: self.epoch,
            stream,
        });
        self.shared.insert(fi, w.clone());
        w
    }

    /// The window and screened candidates of an entitled search of `queue`
    /// with `own` candidates (cheapest first), built from the shared stream
    /// exactly as [`Cycle::find_victims`] builds them from the reclaim list;
    /// `None` when the stream is too short to tell.
    fn window_from(
        &self,
        shared: &SharedWindow,
        own: &[(usize, PreemptReason)],
        queue: QueueId,
    ) -> Option<(Vec<(usize, PreemptReason)>, Screened)> {
        let others = shared
            .stream
            .iter()
            .filter(|s| s.1 != queue)
            .map(|&(k, _, screen)| match screen {
                Screen::Budget(..) if self.search_budget.is_none() => (k, Some(Screen::Kept)),
                _ => (k, Some(screen)),
            });
        // The own candidates are screened here (`None` in the merge).
        let (window, filled) = self.merge(own, None, others);
        // The stream ran out before the window filled: the reclaim list may
        // hold more than the stream kept.
        if !filled && shared.stream.len() >= SHARED_STREAM {
            return None;
        }
        let screened =
            Screened::of(window.iter().map(|&(k, reason, screen)| {
                (k, screen.unwrap_or_else(|| self.screen_one(k, reason)))
            }));
        let candidates = window
            .into_iter()
            .map(|(k, reason, _)| (k, reason))
            .collect();
        Some((candidates, screened))
    }

    /// Whether stopping every candidate could let job `i` start on `flavor`;
    /// when not, no subset of them helps and the search is skipped. Two
    /// necessary conditions, both cheap:
    /// - quota: quota only loosens as usage falls, so the job must pass it with
    ///   every candidate's usage released;
    /// - placement (a single task): only nodes where a candidate runs change,
    ///   so the task must pass the filters on one of them once every candidate
    ///   there stops, unless it already fits elsewhere (a job quota blocked
    ///   before placement was tried).
    ///
    /// Quota is tested first, as it is the cheaper. The tests are then
    /// repeated with the set the search would end with
    /// ([`Cycle::releasable`]), when smaller: releases only loosen quota and
    /// free capacity, so a set that does not help has no subset that does,
    /// and the search would fail.
    fn could_help(
        &mut self,
        i: usize,
        flavor: &str,
        window: &[(usize, PreemptReason)],
        screened: &Screened,
        place_failed: bool,
    ) -> bool {
        if let Some(b) = screened.budget_block {
            self.budget_block.get_or_insert(b);
        }
        // Every candidate that passes the bounds now first: most searches
        // end there, and the set the search would end with is a subset.
        if !self.helps(i, flavor, &screened.kept, place_failed) {
            return false;
        }
        let last = self.releasable(window);
        let helps = last.len() == screened.kept.len() || self.helps(i, flavor, &last, place_failed);
        #[cfg(debug_assertions)]
        if !helps {
            debug_assert!(
                self.pick_victims(i, flavor, window).is_none(),
                "the search found victims where its last set does not help"
            );
        }
        helps
    }

    /// [`Cycle::could_help`]'s two tests with `candidates` released.
    fn helps(&mut self, i: usize, flavor: &str, candidates: &[usize], place_failed: bool) -> bool {
        if candidates.is_empty() {
            return false;
        }
        // Quota first: the cheaper test.
        let fi = self.fidx(flavor);
        if self.cfg.quotas && !flavor.is_empty() && fi != NO_FLAVOR {
            let f = fi as usize;
            // Released per queue: one charge up the tree per queue, not per job.
            let mut by_queue: Vec<(QueueId, i64)> = candidates
                .iter()
                .map(|&k| (self.run[k].queue, self.run[k].milli as i64))
                .collect();
            by_queue.sort_unstable_by_key(|&(q, _)| q);
            by_queue.dedup_by(|b, a| {
                let same = a.0 == b.0;
                if same {
                    a.1 += b.1;
                }
                same
            });
            for &(q, milli) in &by_queue {
                self.queues.charge_at(q, f, -milli);
            }
            let ok = self.quota_ok(i, flavor).is_ok();
            for &(q, milli) in &by_queue {
                self.queues.charge_at(q, f, milli);
            }
            if !ok {
                return false;
            }
        }
        let w = &self.pending[i];
        let milli = self.pend_milli[i];
        if milli == 0 || w.job.task_count() != 1 {
            return true;
        }
        let job = self.job_on(i, flavor);
        let req = &job.groups[0].request;
        let on = self.by_node(candidates);
        let on_candidate_node = on.chunk_by(|a, b| a.0 == b.0).any(|at| {
            let node = crate::ids::NodeId(at[0].0);
            // From the packed records first, before reading any allocation.
            let gpus = at.iter().fold(0u64, |m, x| m | x.1);
            if !self.placer.may_fit_after_release(node, gpus, req) {
                return false;
            }
            let mut ks: Vec<usize> = at.iter().map(|x| x.2).collect();
            ks.sort_unstable();
            ks.dedup();
            let freed: Vec<&Allocation> = ks
                .iter()
                .flat_map(|&k| &self.running[k].allocations)
                .filter(|a| a.node == node)
                .collect();
            self.placer
                .fits_after_release(node, &freed, req, &job.constraints)
        });
        // Quota blocked the job before placement was tried: it may fit
        // elsewhere as things are (then only quota needs the victims).
        on_candidate_node
            || !(place_failed || self.max_free(flavor) < milli || !self.fits_committed(i, flavor))
    }

    /// The most GPU capacity free on one node with GPUs of `flavor`, as at
    /// the first call this cycle. Capacity only shrinks during a cycle (trial
    /// releases are undone), so the figure stays an upper bound.
    fn max_free(&mut self, flavor: &str) -> u64 {
        if let Some(&m) = self.max_free.get(flavor) {
            return m;
        }
        let cluster = self.placer.cluster();
        let m = cluster
            .nodes()
            .iter()
            .filter(|n| n.gpus.iter().any(|g| g.model == flavor))
            .map(|n| cluster.free_milli_total(n.id))
            .max()
            .unwrap_or(0);
        self.max_free.insert(flavor.to_string(), m);
        m
    }

    /// Finds when and where job `i` could start as running jobs end (by their
    /// declared max runtime), and holds those nodes for it.
    fn reserve(&mut self, i: usize, flavor: &str) {
        let ending = self.ending_order();
        // Victims chosen this cycle end when they are told to stop.
        let ending: Vec<(u64, usize)> = ending
            .iter()
            .copied()
            .filter(|&(_, k)| !self.run[k].victim || self.running[k].stopping_at.is_some())
            .collect();
        // It would start later, when another reservation may hold the
        // nodes: it keeps off all of them.
        let mut job = self.job_on(i, flavor);
        job.constraints.avoid_reservations = u64::MAX;
        // Running jobs are released and taken back below: a trial. The
        // earliest start is after the fewest ending jobs that let it fit.
        // Releasing more never takes room away, so that count is found by
        // doubling it and then halving the interval: O(log n) fit tests.
        let trial = self.placer.begin_trial();
        let mut released = 0;
        let fit = fewest(ending.len(), |n| {
            self.release_first(&ending, &mut released, n);
            self.fits_now_as(&job)
        });
        self.release_first(&ending, &mut released, 0);
        self.placer.end_trial(trial);
        let found = fit.map(|(n, p)| (ending[n - 1].0, p));
        if let Some((start_at, p)) = found {
            let mut nodes: Vec<_> = p.iter().map(|a| a.node).collect();
            nodes.sort();
            nodes.dedup();
            let slot = if self.cfg.backfill_per_node {
                Self::slot(self.reservations.len())
            } else {
                1
            };
            for &n in &nodes {
                self.placer.set_reserved(n, slot);
            }
            // Fits seen before may have used these nodes.
            self.epoch += 1;
            self.reserved_from = self.reserved_from.min(start_at);
            self.reserved.insert(self.pending[i].job.id, start_at);
            self.reservations.push(Reservation {
                job: self.pending[i].job.id,
                start_at,
                nodes,
            });
        }
    }

    /// [`Cycle::reserve`]'s running jobs by end time, built once a cycle.
    fn ending_order(&mut self) -> Rc<Vec<(u64, usize)>> {
        if let Some(e) = &self.ending {
            return e.clone();
        }
        let mut ending: Vec<(u64, usize)> = self
            .running
            .iter()
            .enumerate()
            .filter_map(|(k, r)| Some((Self::end_of(r)?.max(self.now), k)))
            .collect();
        ending.sort_unstable();
        let ending = Rc::new(ending);
        self.ending = Some(ending.clone());
        ending
    }

    /// Releases or takes back running jobs so that exactly the first `n` of
    /// `ending` are released (`released` of them are now); taken back in the
    /// reverse order of release.
    fn release_first(&mut self, ending: &[(u64, usize)], released: &mut usize, n: usize) {
        while *released < n {
            self.placer
                .release(&self.running[ending[*released].1].allocations);
            *released += 1;
        }
        while *released > n {
            *released -= 1;
            self.placer
                .restore(&self.running[ending[*released].1].allocations);
        }
    }

    fn check_quotas(&self) -> bool {
        if !self.cfg.quotas {
            return true;
        }
        // Every admitted job's queue path stays within caps and borrow limits.
        self.admitted.iter().all(|(id, flavor, _)| {
            let w = self
                .pending
                .iter()
                .find(|w| w.job.id == *id)
                .expect("admitted from pending");
            flavor.is_empty()
                || self.queues.path(w.queue).iter().all(|&q| {
                    self.queues.usage(q, flavor) <= self.queues.get(q).quota(flavor).limit()
                })
        })
    }

    fn explain(mut self) -> Plan {
        // Release the reservations' hold: the next cycle decides again.
        for r in &self.reservations {
            for &n in &r.nodes {
                self.placer.set_reserved(n, 0);
            }
        }
        // What the ETA pass needs of each job, in one sequential pass (the
        // ETA pass visits jobs in priority order, so random access to the
        // reasons themselves would miss the cache at every job).
        const ADMITTED: u8 = 1;
        const BY_USER: u8 = 2;
        const BY_QUOTA: u8 = 4;
        const HELD: u8 = 8;
        // No node takes it as the cluster stands, however much is free.
        const NOWHERE: u8 = 16;
        // Some node turned it away for what it holds now.
        const BY_PLACE: u8 = 32;
        let mut flags = vec![0u8; self.pending.len()];
        for (f, r) in flags.iter_mut().zip(&self.reasons) {
            let mut placed_nowhere = None;
            for x in r {
                *f |= match x {
                    PendingReason::UserGpuLimit { .. } | PendingReason::UserRunningLimit { .. } => {
                        BY_USER
                    }
                    PendingReason::Quota { .. } | PendingReason::NotWithinGuarantee { .. } => {
                        BY_QUOTA
                    }
                    PendingReason::QueueHeld { .. } | PendingReason::QueueDraining { .. } => HELD,
                    _ => 0,
                };
                // On every flavor it was tried on, every node turned it
                // away by what the node is, not by what it holds.
                if let PendingReason::Placement { unplaced, .. } = x {
                    let fixed = !unplaced.rejections.is_empty()
                        && unplaced.rejections.iter().all(|(r, _)| r.is_static());
                    placed_nowhere = Some(placed_nowhere.unwrap_or(true) && fixed);
                }
            }
            match placed_nowhere {
                Some(true) => *f |= NOWHERE,
                Some(false) => *f |= BY_PLACE,
                None => {}
            }
        }
        for &i in &self.admitted_idx {
            flags[i] |= ADMITTED;
        }
        // ETA: running jobs' declared ends against the demand ahead in order.
        let mut ends: Vec<(u64, u64)> = self
            .running
            .iter()
            .zip(&self.run)
            .filter_map(|(r, info)| Some((Self::end_of(r)?.max(self.now), info.milli)))
            .collect();
        ends.sort_unstable();
        let running_milli: u64 = self.run.iter().map(|r| r.milli).sum();
        let free_now: u64 = self
            .queues
            .flavors()
            .map(|f| self.queues.capacity(f))
            .sum::<u64>()
            .saturating_sub(running_milli + self.admitted_milli());
        let mut ahead: u64 = 0;
        // The order of phase 1 (the same key for every ordering but FIFO).
        let order = std::mem::take(&mut self.global);
        let order_milli = std::mem::take(&mut self.global_milli);
        // Demand ahead only grows along the order, so one pass over the ends suffices.
        const NO_ETA: u64 = u64::MAX;
        let mut eta: Vec<u64> = vec![NO_ETA; self.pending.len()];
        // Known ends of running and just-admitted jobs of a queue, by end:
        // (end, milli-GPU, user); built for the queues that need it.
        let mut by_queue: rustc_hash::FxHashMap<QueueId, Vec<(u64, u64, &str)>> =
            Default::default();
        let (mut freed, mut next) = (free_now, 0usize);
        let mut node_slots: Option<NodeSlots> = None;
        for (&i, &milli) in order.iter().zip(&order_milli) {
            let flag = flags[i];
            // Admitted, or takes nothing from those behind it: it cannot start.
            if flag & (ADMITTED | NOWHERE) != 0 {
                continue;
            }
            ahead += milli;
            while freed < ahead && next < ends.len() {
                freed += ends[next].1;
                next += 1;
            }
            let mut t = match (freed >= ahead, next) {
                (false, _) => None,
                (true, 0) => Some(self.now),
                (true, n) => Some(ends[n - 1].0),
            };
            // Blocked by quota or a user limit: also wait for the queue (or the
            // user) to free as much as the job needs, from jobs with a known end.
            let by_user = flag & BY_USER != 0;
            if flag & (BY_USER | BY_QUOTA) != 0 {
                let w = &self.pending[i];
                let mine = by_queue
                    .entry(w.queue)
                    .or_insert_with(|| self.known_ends(w.queue));
                let mut got = 0;
                let mut when = None;
                for &(end, m, user) in mine.iter() {
                    if by_user && user != w.user.as_str() {
                        continue;
                    }
                    got += m.max(1);
                    if got >= self.pend_milli[i].max(1) {
                        when = Some(end);
                        break;
                    }
                }
                t = match (t, when) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            // Turned away by where GPUs are free, not by how many: also
            // wait until enough nodes have room for its tasks.
            if flag & BY_PLACE != 0
                && let Some(at) = t
            {
                let slots = node_slots.get_or_insert_with(|| self.node_slots());
                t = slots.earliest(&self.pending[i].job, at);
            }
            if flag & HELD != 0 {
                t = None;
            }
            if let Some(&start_at) = self.reserved.get(&self.pend_id[i]) {
                t = Some(start_at);
            }
            eta[i] = t.unwrap_or(NO_ETA);
        }
        // Positions in each queue, then the explanations in job order (the
        // backlog usually comes nearly in that order, which the stable sort
        // takes in about one pass).
        let mut position = vec![0u32; self.pending.len()];
        for list in self.per_queue.values() {
            let mut p = 0;
            for &i in list {
                if flags[i] & ADMITTED == 0 {
                    p += 1;
                    position[i] = p;
                }
            }
        }
        let mut by_id: Vec<(JobId, u32)> = (0..self.pending.len())
            .filter(|&i| flags[i] & ADMITTED == 0)
            .map(|i| (self.pend_id[i], i as u32))
            .collect();
        by_id.sort_by_key(|&(id, _)| id);
        let mut pending = Vec::with_capacity(by_id.len());
        for (job, i) in by_id {
            let i = i as usize;
            let tried = std::mem::take(&mut self.reasons[i]);
            let mut r = if tried.is_empty() {
                Reasons::new()
            } else {
                Reasons::from_vec(tried)
            };
            if self.not_reached[i] != u32::MAX {
                r.push(PendingReason::NotReached {
                    ahead: self.not_reached[i] as usize,
                });
            }
            if r.is_empty() {
                r.push(PendingReason::NotReached {
                    ahead: position[i] as usize - 1,
                });
            }
            pending.push(Pending {
                job,
                reasons: r,
                position: position[i] as usize,
                eta: (eta[i] != NO_ETA).then_some(eta[i]),
            });
        }
        Plan {
            admitted: self.admitted,
            preempted: self.preempted,
            reservations: self.reservations,
            pending,
        }
    }

    /// Each ready node's idle whole GPUs now and the whole GPUs its running
    /// and just-admitted jobs give back at their known ends, for
    /// [`NodeSlots::earliest`].
    fn node_slots(&self) -> NodeSlots {
        let cluster = self.placer.cluster();
        // Only GPUs that can take work count, now or once given back:
        // healthy, not split into MIG instances, on a node that takes new
        // work.
        let usable: Vec<u64> = cluster
            .nodes()
            .iter()
            .map(|n| {
                if n.state != crate::model::NodeState::Ready {
                    return 0;
                }
                n.gpus
                    .iter()
                    .enumerate()
                    .filter(|(_, g)| {
                        g.health == crate::model::GpuHealth::Healthy && !g.mig_enabled()
                    })
                    .fold(0u64, |m, (i, _)| m | 1 << i)
            })
            .collect();
        let idle: Vec<u32> = cluster
            .nodes()
            .iter()
            .zip(&usable)
            .map(|(n, &m)| {
                cluster
                    .usage(n.id)
                    .gpus
                    .iter()
                    .enumerate()
                    .filter(|(i, u)| m >> i & 1 == 1 && u.mode == crate::cluster::GpuMode::Idle)
                    .count() as u32
            })
            .collect();
        let mut frees: Vec<(u32, u64, u32)> = Vec::new();
        let mut give_back = |end: u64, allocations: &[Allocation]| {
            for a in allocations {
                if let crate::cluster::GpuPick::Whole(mask) = a.pick {
                    let back = mask & usable.get(a.node.0 as usize).copied().unwrap_or(0);
                    if back != 0 {
                        frees.push((a.node.0, end.max(self.now), back.count_ones()));
                    }
                }
            }
        };
        for r in self.running {
            if let Some(end) = Self::end_of(r) {
                give_back(end, &r.allocations);
            }
        }
        for ((_, _, p), &i) in self.admitted.iter().zip(&self.admitted_idx) {
            if let Some(m) = self.pending[i].max_runtime {
                give_back(self.now + m, p);
            }
        }
        frees.sort_unstable();
        NodeSlots {
            now: self.now,
            idle,
            frees,
            by_size: BTreeMap::new(),
        }
    }

    /// A running job's known end: its kill time once told to stop, else its
    /// declared maximum runtime.
    fn end_of(r: &Running) -> Option<u64> {
        r.stopping_at.or(r.work.max_runtime.map(|m| r.started + m))
    }

    /// Known ends of a queue's running and just-admitted jobs, soonest first:
    /// (end, milli-GPU, user).
    fn known_ends(&self, q: QueueId) -> Vec<(u64, u64, &'a str)> {
        let running = self.running;
        let pending = self.pending;
        let mut v: Vec<(u64, u64, &'a str)> = self
            .running_by_queue
            .get(&q)
            .into_iter()
            .flatten()
            .filter_map(|&k| {
                let r = &running[k];
                Some((
                    Self::end_of(r)?.max(self.now),
                    self.run[k].milli,
                    r.work.user.as_str(),
                ))
            })
            .chain(
                self.admitted_idx
                    .iter()
                    .filter(|&&i| pending[i].queue == q)
                    .filter_map(|&i| {
                        let w = &pending[i];
                        Some((
                            (self.now + w.max_runtime?).max(self.now),
                            self.pend_milli[i],
                            w.user.as_str(),
                        ))
                    }),
            )
            .collect();
        v.sort_unstable();
        v
    }

    fn admitted_milli(&self) -> u64 {
        self.admitted
            .iter()
            .map(|(_, _, p)| p.iter().map(|a| a.gpu.quota_milli()).sum::<u64>())
            .sum()
    }
}
