//! The cycle's inputs and settings: priority classes, pending and running
//! work, the ordering and multifactor weights, the configuration, and what
//! a plan's preemptions and reservations say.

use super::*;

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
    /// For a class that may not borrow: whether its jobs may still run
    /// above the guarantee on a lease ([`Config::lease_horizon`]).
    pub may_lease: bool,
}

/// The four classes gpuflow ships with.
pub fn default_classes() -> Vec<PriorityClass> {
    let c = |name: &str, rank, preemptible, may_borrow| PriorityClass {
        name: name.into(),
        rank,
        preemptible,
        may_borrow,
        may_lease: true,
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
    /// How long the edge expects it to run, seconds (from its user's
    /// recent jobs of its kind): for start estimates only. Reservations,
    /// backfill and preemption keep to `max_runtime`, which is what a
    /// job may hold.
    pub expected_runtime: Option<u64>,
}

/// Each user's last two runtimes per kind of job (`K`: the edge's kind,
/// or class): a job is expected to run as long as their mean (Tsafrir,
/// Etsion and Feitelson, "Backfilling Using System-Generated Predictions
/// Rather than User Runtime Estimates", IEEE TPDS 2007). What the edges
/// give as [`Workload::expected_runtime`]; looked up without allocating.
#[derive(Clone, Debug)]
pub struct RecentRuntimes<K: Ord>(
    std::collections::BTreeMap<String, std::collections::BTreeMap<K, [Option<u64>; 2]>>,
);

impl<K: Ord> Default for RecentRuntimes<K> {
    fn default() -> Self {
        RecentRuntimes(std::collections::BTreeMap::new())
    }
}

impl<K: Ord> RecentRuntimes<K> {
    /// A job of `user` and `kind` ran `seconds`.
    pub fn record(&mut self, user: &str, kind: K, seconds: u64) {
        let last = match self.0.get_mut(user) {
            Some(m) => m.entry(kind).or_default(),
            None => self
                .0
                .entry(user.to_string())
                .or_default()
                .entry(kind)
                .or_default(),
        };
        *last = [Some(seconds), last[0]];
    }

    /// Seconds a job of `user` and `kind` is expected to run, when known.
    pub fn expect(&self, user: &str, kind: &K) -> Option<u64> {
        match self.0.get(user)?.get(kind)? {
            [Some(a), Some(b)] => Some((a + b) / 2),
            [Some(a), None] => Some(*a),
            _ => None,
        }
    }
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

    pub(super) fn needs_gpu(&self) -> bool {
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
    pub(super) fn lost_with(&self, now: u64, milli: u64) -> f64 {
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
    /// How many jobs of each queue the preemptions that budgets bind may
    /// stop per window, whatever work they lose: young jobs lose little,
    /// and a budget of GPU-hours alone would let a queue lose hundreds of
    /// them at once. The rest wait for the window to move on. `None`: no
    /// limit. Default 64 an hour.
    pub disruption_max_jobs: Option<usize>,
    /// The disruption budget's window, seconds (default one hour).
    pub disruption_window: u64,
    /// Whether jobs of the protected classes (those that are not
    /// preemptible: inference, notebooks) preempt past disruption budgets:
    /// a budget then paces the reclaims of batch and training, never a
    /// service or a notebook within its guarantee. On by default.
    pub protected_pass_budgets: bool,
    /// How long a job that passes disruption budgets (a protected class,
    /// or a queue below its share) waits before it does, seconds from its
    /// submission. Until then budgets bind its reclaims as they bind
    /// batch's (reclaim fairness does not): young borrowers, which lose
    /// little, are taken back at once, and one whose loss would pass its
    /// queue's budget only once the job has waited this long, unless GPUs
    /// free for it meanwhile. So a notebook waits a bounded time for its
    /// guarantee, and a borrower that ran for days without a checkpoint is
    /// not stopped for work that GPUs ending soon would hold (on the openb
    /// trace the lost GPU-hours fell from 1.8-2.0 % to 1.2-1.3 %;
    /// docs/benchmarks.md). 0: at once. Default one hour.
    pub budget_patience: u64,
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
    /// Once a cycle has told this many jobs to stop (preemptions and
    /// consolidation moves), it starts no new victim search: the rest
    /// waits for the next cycle, so one cycle cannot preempt a storm
    /// (`bench cycle` saw 1,489 at once). A search under way may pass it.
    /// Default 256.
    pub max_preemptions_per_cycle: usize,
    /// Leases: a job of a class that may not borrow (notebooks, inference)
    /// may still run beyond its queue's guarantee on capacity lent to it:
    /// the flavor's leases stay within its capacity less what the queues
    /// claim of their guarantees (what they hold and all the work they
    /// have pending, each up to its guarantee), and the class allows it
    /// ([`PriorityClass::may_lease`]). A
    /// lease is not reclaimed for this many seconds from the job's start;
    /// after that a queue within its guarantee may take it back, after
    /// every other candidate (preemptible borrowers are reclaimed after
    /// their minimum runtime). So a lender whose work comes back waits at
    /// most this long for the part of its guarantee on lease. `None`: such
    /// classes stay within the guarantee. Default 4 hours.
    pub lease_horizon: Option<u64>,
    /// The lender first: a job within its queue's guarantee that waits for
    /// borrowed GPUs to pass their minimum runtime holds the nodes it will
    /// take back from new borrowing (a reclaim hold), and keeps holding
    /// them every cycle until it starts, so that a stream of borrowers
    /// cannot keep its victims young. Only when it can take them back no
    /// later than a new borrower placed there now could be taken back (else
    /// it gets an ordinary backfill reservation), and no disruption budget
    /// or reclaim fairness refused its reclaim, nor, when its reclaim is
    /// paced, the paced reclaim of an earlier job of its queue this cycle
    /// (such holds, renewed "from now" every cycle for a reclaim that did
    /// not come, kept new borrowers off freed GPUs for hours, the teams
    /// that had had least among them; docs/benchmarks.md). Default on.
    pub reclaim_holds: bool,
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
            disruption_max_jobs: Some(64),
            disruption_window: 3600,
            protected_pass_budgets: true,
            budget_patience: 3600,
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
            max_preemptions_per_cycle: 256,
            lease_horizon: Some(4 * 3600),
            reclaim_holds: true,
        }
    }
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

/// What one cycle works on: the committed state (running allocations
/// applied to `placer`, their usage charged to `queues`), the running and
/// pending work, the time and the settings.
pub struct Snapshot<'a> {
    pub now: u64,
    pub placer: &'a mut Placer,
    pub queues: &'a mut Queues,
    pub running: &'a [Running],
    pub pending: &'a [Workload],
    pub cfg: &'a Config,
}
