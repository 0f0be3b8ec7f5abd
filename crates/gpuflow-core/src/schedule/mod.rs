//! The scheduling cycle: which pending jobs start, which running jobs are
//! preempted, which blocked gang gets a reservation, and why every other job
//! waits. See `schedule/README.md` beside this file for the flow and the
//! parts: this file holds the phases ([`schedule`], [`diagnose`]), the
//! `Cycle` that carries a run through them, and phase 0 (`Cycle::new`).
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

use crate::cluster::{Allocation, GpuMode, GpuPick};
use crate::ids::JobId;
use crate::placement::{Placement, Placer, Unplaced};
use crate::queue::{QueueId, QueueState, Queues, QuotaBlock};
use crate::request::{GpuRequest, Job};
use crate::total::OrdF64;

mod admit;
mod consolidate;
mod explain;
mod fair_share;
mod history;
mod model;
mod order;
mod preempt;
mod profile;
mod reason;
mod reserve;

use consolidate::*;
pub use history::*;
pub use model::*;
use preempt::*;
pub use reason::*;

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

/// One scheduling cycle on `snap`, whose `running` must match what is
/// applied to its placer and charged to its queues; admissions are
/// applied. `history` is read and aged.
pub fn schedule(snap: Snapshot<'_>, history: &mut History) -> Plan {
    schedule_observed(snap, history, |_, _| {})
}

/// The phases of a cycle, in the order they run (see `schedule/README.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Phase 0: the running jobs packed and indexed for victim searches.
    Index,
    /// Phase 1: each queue's pending jobs ordered.
    Order,
    /// Phase 2: jobs admitted, preempted for or reserved for, in order.
    Admit,
    /// Phase 3: every job still pending explained and given a start estimate.
    Explain,
}

impl Phase {
    pub const ALL: [Phase; 4] = [Phase::Index, Phase::Order, Phase::Admit, Phase::Explain];
}

/// What a cycle's admission phase did, counted: where its work goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Pending jobs tried for admission (a job may be tried twice: a
    /// preemptor whose victims stopped, then in order).
    pub tries: u64,
    /// Placements computed (a shape that failed on a flavor is not placed
    /// again in the cycle, so most failed tries cost none).
    pub placements: u64,
    /// Searches for victims (at most one round per queue a cycle).
    pub victim_searches: u64,
}

/// [`schedule`], calling `done` as each phase ends, with the tally so far:
/// a caller may read its own clock there (the cycle reads none) to see
/// where a cycle's time goes. The plan is the same as [`schedule`]'s.
pub fn schedule_observed(
    snap: Snapshot<'_>,
    history: &mut History,
    mut done: impl FnMut(Phase, &Tally),
) -> Plan {
    let pending = snap.pending;
    // Phase 0: the running jobs packed and indexed for the victim searches.
    let mut cycle = Cycle::new(snap, history);
    done(Phase::Index, &cycle.tally);
    // Phase 1: order each queue's pending jobs and build the fair-share heap.
    cycle.order();
    debug_assert!(
        cycle.check_order(),
        "a job is ordered twice or is not pending"
    );
    done(Phase::Order, &cycle.tally);
    // Phase 2: take jobs in fair-share (or FIFO, or priority) order; admit,
    // preempt or reserve. Each step keeps usage and allocations consistent.
    cycle.admit_all();
    debug_assert!(cycle.check_quotas(), "admissions exceeded a quota");
    done(Phase::Admit, &cycle.tally);
    // Phase 3: explain every job still pending.
    let tally = cycle.tally;
    let plan = cycle.explain();
    debug_assert!(
        check_plan(&plan, pending),
        "a pending job is neither admitted nor explained, or is both"
    );
    done(Phase::Explain, &tally);
    plan
}

/// Phase 3's post-condition: every pending job is admitted or explained,
/// once, and nothing else is.
fn check_plan(plan: &Plan, pending: &[Workload]) -> bool {
    let mut seen: BTreeSet<JobId> = BTreeSet::new();
    let ids: BTreeSet<JobId> = pending.iter().map(|w| w.job.id).collect();
    plan.admitted
        .iter()
        .map(|a| a.0)
        .chain(plan.pending.iter().map(|p| p.job))
        .all(|id| ids.contains(&id) && seen.insert(id))
        && seen.len() == ids.len()
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
pub fn diagnose(snap: Snapshot<'_>, history: &History, job: JobId) -> Option<Reasons> {
    let i = snap.pending.iter().position(|w| w.job.id == job)?;
    let mut history = history.clone();
    let mut cycle = Cycle::new(snap, &mut history);
    let w = &cycle.snap.pending[i];
    let mut gates: Vec<PendingReason> = cycle.queue_gate(i).into_iter().collect();
    if let Some(v) = cycle.history.waiting_for.get(&w.job.id) {
        gates.push(PendingReason::WaitingForPreemption { victims: v.len() });
    }
    gates.extend(cycle.user_limit(i));
    cycle.out.reasons[i] = gates;
    cycle.quota_and_fit_reasons(i);
    Some(Reasons::from_vec(std::mem::take(&mut cycle.out.reasons[i])))
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
    /// Its class is preemptible, it ran its minimum runtime and holds at
    /// most `Config::max_unsaved` of unsaved work: its queue's own work of
    /// a higher priority may preempt it.
    preemptible: bool,
    /// A reclaim may take it: its class is preemptible and it ran its
    /// minimum runtime (unsaved work does not protect capacity held beyond
    /// a guarantee), or it holds an expired lease (`leased`).
    reclaimable: bool,
    /// Of a class that may not borrow, it has run beyond its queue's
    /// guarantee for `Config::lease_horizon`: a reclaim may take it, after
    /// every other candidate.
    leased: bool,
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

    /// Whether a reclaim may choose it now.
    fn reclaim_eligible(&self) -> bool {
        self.reclaimable && !self.victim
    }
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

/// The pending jobs the free capacity could hold now, quota aside, with
/// their milli-GPUs: GPUs idle while work that fits them waits. Each
/// pending job with GPUs, in order, is placed on what is left (a shape
/// that fails is not tried again, as capacity only shrinks; after
/// `max_failed` failed shapes the rest is not tried, so the answer is a
/// lower bound), then all of it is released: a trial, it changes nothing.
pub fn could_hold<'w>(
    placer: &mut Placer,
    pending: impl IntoIterator<Item = &'w Workload>,
    max_failed: usize,
) -> Vec<(JobId, u64)> {
    use std::hash::{Hash, Hasher};
    let shape = |w: &Workload| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for g in &w.job.groups {
            g.request.hash(&mut h);
            g.replicas.hash(&mut h);
        }
        w.job.constraints.hash(&mut h);
        h.finish()
    };
    let trial = placer.begin_trial();
    let mut failed: BTreeSet<u64> = BTreeSet::new();
    let mut placed = Vec::new();
    let mut held = Vec::new();
    for w in pending.into_iter().filter(|w| w.gpu_milli() > 0) {
        if failed.len() >= max_failed {
            break;
        }
        let s = shape(w);
        if failed.contains(&s) {
            continue;
        }
        match placer.try_place_job(&w.job) {
            Some(p) => {
                held.push((w.job.id, w.gpu_milli()));
                placed.push(p);
            }
            None => {
                failed.insert(s);
            }
        }
    }
    for p in placed.iter().rev() {
        placer.release(p);
    }
    placer.end_trial(trial);
    held
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

/// Phase 1's order of the pending jobs.
#[derive(Default)]
struct Order {
    /// Per leaf queue, indices into `pending`, best first.
    per_queue: BTreeMap<QueueId, Vec<usize>>,
    /// Global order (FIFO and priority orderings).
    global: Vec<usize>,
    /// Each job's GPU demand in the global order, so that the ETA pass
    /// reads it in sequence.
    global_milli: Vec<u64>,
    /// Preemptors whose victims have stopped: tried before everyone else.
    ready: BTreeSet<JobId>,
}

/// What the cycle has decided so far: each pending job's reasons, the admissions and preemptions.
#[derive(Default)]
struct Outcome {
    /// Per pending job (by index), the reasons found so far.
    reasons: Vec<Vec<PendingReason>>,
    /// Per pending job, `ahead` of a "not reached" reason (u32::MAX: none);
    /// kept apart so that the many unreached jobs cost no allocation.
    not_reached: Vec<u32>,
    admitted: Vec<(JobId, String, Placement)>,
    preempted: Vec<Preemption>,
    /// Indices into `pending` of the jobs admitted this cycle.
    admitted_idx: Vec<usize>,
}

/// The placer's slot of the nodes a reclaim hold keeps from new borrowing
/// (reservations take the slots below it).
const HOLD_SLOT: u8 = crate::cluster::MAX_RESERVATION_SLOT;

/// Running jobs by the time they end or may be taken back, earliest first:
/// (time, index into the running jobs).
type Ending = Rc<Vec<(u64, usize)>>;

/// Backfill reservations made this cycle and what they are built from.
#[derive(Default)]
struct Reserves {
    /// This cycle's reservations, in the order they were made.
    reservations: Vec<Reservation>,
    /// This cycle's reclaim holds: nodes kept from new borrowing for a job
    /// within its guarantee until it can take them back
    /// ([`Cycle::reserve`]); their nodes carry [`HOLD_SLOT`].
    holds: Vec<Reservation>,
    /// The earliest start among the holds (`u64::MAX`: none).
    held_from: u64,
    /// The flavor indices the holds are of.
    held_flavors: Vec<u32>,
    /// The nodes preemptors wait to take once their victims stop, per
    /// preemptor ([`Cycle::nominate`]).
    nominated: Vec<Reservation>,
    /// The free GPUs claimed for them, applied to the placer until the
    /// end of the cycle.
    claims: Vec<Allocation>,
    /// The running jobs' indices by id ([`Cycle::running_index`]).
    running_index: Option<Rc<rustc_hash::FxHashMap<JobId, usize>>>,
    /// Each holder's start.
    reserved: rustc_hash::FxHashMap<JobId, u64>,
    /// The earliest start among them (`u64::MAX`: none).
    reserved_from: u64,
    /// Running jobs by the time they end (stop, or reach their time limit),
    /// earliest first: sorted once a cycle, for every reservation.
    ending: Option<Rc<Vec<(u64, usize)>>>,
    /// Per flavor index, `ending` with each job a reclaim could take told
    /// at the time it could ([`Cycle::reclaim_order`]), built when first asked.
    reclaiming: BTreeMap<u32, Option<Ending>>,
    /// Such lists without the jobs told to stop this cycle
    /// ([`Cycle::without_new_victims`]): (list, `VictimIndex::marked` then, result).
    unmarked: Vec<(Ending, usize, Ending)>,
    /// Per flavor, an upper bound of the GPU capacity free on one node ([`Cycle::max_free`]).
    max_free: BTreeMap<String, u64>,
}

/// What victim searches read: the running jobs packed, indexed by queue and flavor, and the searches' memos.
#[derive(Default)]
struct VictimIndex {
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
    /// Counts admissions and preemptions: what the shared reclaim windows
    /// depend on (usage, victims, disruptions) changes only with them.
    epoch: u64,
    /// Counts the running jobs told to stop this cycle.
    marked: usize,
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
    /// Leaves that already searched for victims this cycle (their best job did).
    preempt_tried: BTreeSet<QueueId>,
    /// Reclaims that a disruption budget or reclaim fairness refused this
    /// cycle, by (queue, flavor index, paced ([`Cycle::pacing`])), for the
    /// queue's later jobs bound alike, which do not search themselves (one
    /// search a queue a cycle). Paced ones hold no nodes for a reclaim
    /// that will not come. Those that pass budgets once they have waited
    /// their patience keep their holds (their reclaim comes then), and
    /// their estimates count from it. The value: the reasons the search
    /// gave (less its patience), which those jobs give too.
    refused: rustc_hash::FxHashMap<(QueueId, u32, bool), Vec<PendingReason>>,
    /// Per running job, what victim searches read (by index into `running`).
    run: Vec<RunInfo>,
}

/// Usage the queues' quotas do not hold: per user, by classes that may not borrow, and of jobs told to stop.
#[derive(Default)]
struct Usage<'a> {
    /// Per user and queue: (milli-GPU, running jobs), for the queues with
    /// per-user limits (the only readers).
    users: rustc_hash::FxHashMap<(QueueId, &'a str), (u64, u32)>,
    /// Per queue and flavor index: milli-GPU held by classes that may not borrow.
    protected: rustc_hash::FxHashMap<(QueueId, u32), u64>,
    /// Per queue and flavor index: milli-GPU of jobs told to stop (this cycle
    /// or earlier) that still run, so still count in the queue's usage.
    leaving: rustc_hash::FxHashMap<(QueueId, u32), u64>,
    /// Per flavor index: milli-GPU that classes which may not borrow hold
    /// beyond their queues' guarantees, on a lease ([`Config::lease_horizon`]).
    leased: rustc_hash::FxHashMap<u32, u64>,
    /// By flavor index: what the queues can lend on a lease this cycle
    /// ([`Cycle::with_leases`]); empty when leases are off.
    lendable: Vec<u64>,
}

/// Consolidation's pacing and memos.
#[derive(Default)]
struct Consolidation {
    /// Whether a consolidation may start this cycle (none has, and the
    /// last was `consolidation_interval` ago), and the placement problems
    /// none helps.
    may_consolidate: bool,
    /// Consolidations tried this cycle (at most [`MAX_CONSOLIDATION_TRIES`]).
    consolidation_tries: usize,
    no_consolidation: rustc_hash::FxHashSet<PlaceKey>,
    /// [`Cycle::movable`], per flavor index.
    movable: rustc_hash::FxHashMap<u32, Rc<Movable>>,
}

/// Placement and quota memos: what failed or fitted stays so for the cycle (until an admission changes it).
#[derive(Default)]
struct PlaceMemo<'a> {
    /// Job shapes that found no place this cycle (a seedless hasher: the core
    /// reads no global randomness). Admissions only take
    /// capacity during a cycle, so the same shape fails again.
    unplaceable: rustc_hash::FxHashMap<PlaceKey, PendingReason>,
    /// Placement problems a trial placement found no room for, outside any
    /// trial release (so, like `unplaceable`, they fail again this cycle).
    no_fit: rustc_hash::FxHashSet<PlaceKey>,
    /// Placement problems that fitted, with the [`VictimIndex::epoch`] they
    /// fitted in (see [`Cycle::unplaced_now`]).
    fits_seen: rustc_hash::FxHashMap<PlaceKey, u64>,
    /// Shape numbers, and each pending job's (u32::MAX: not yet looked up).
    shapes: rustc_hash::FxHashMap<Shape<'a>, u32>,
    shape_of: Vec<u32>,
    /// Quota checks of the committed state: (queue, flavor index, milli-GPU,
    /// class) → outcome; cleared by every admission.
    quota_memo: rustc_hash::FxHashMap<(QueueId, u32, u64, usize), Result<(), PendingReason>>,
}

/// Flavor names and lists, built once.
struct Flavors {
    /// Flavor names by index, shared by the reasons.
    flavor_names: Vec<Arc<str>>,
    /// The flavor list of jobs without GPUs, and per queue that of jobs
    /// that name no GPU model ([`Cycle::flavors_for`]).
    no_gpu: Rc<[Arc<str>]>,
    queue_flavors: rustc_hash::FxHashMap<QueueId, Rc<[Arc<str>]>>,
}

/// Per pending job (by index), what hot loops read without touching the job.
#[derive(Default)]
struct PendInfo {
    /// GPU demand (milli-GPU) per pending job, by index.
    pend_milli: Vec<u64>,
    /// Per pending job, its id (read in explanation passes without touching the job).
    pend_id: Vec<JobId>,
    /// Per pending job, its class (read by the fair-share walk, which
    /// visits much of a long backlog, without touching the jobs).
    pend_class: Vec<usize>,
}

/// Fair-share figures, computed when first asked.
#[derive(Default)]
struct FairShare {
    /// Fair-share key per queue, cleared along a queue's path when its usage changes.
    shares: std::cell::RefCell<Vec<Option<f64>>>,
    /// Per parent (`None`: the top), its children's decayed usage and
    /// effective weight, summed once a cycle (neither changes during one).
    sibling_history: std::cell::RefCell<rustc_hash::FxHashMap<Option<QueueId>, (f64, f64)>>,
    /// Per queue, [`Cycle::history_share`] once asked (NaN before): victim
    /// searches compare it for every reclaim candidate.
    history_shares: std::cell::RefCell<Vec<f64>>,
}

/// One scheduling cycle: its inputs and the state of each phase, in
/// parts that each own their state.
struct Cycle<'a> {
    /// What the cycle works on.
    snap: Snapshot<'a>,
    /// Kept between cycles: decayed usage, the preemptors waiting for
    /// their victims, disruptions and the last consolidation.
    history: &'a mut History,
    order: Order,
    out: Outcome,
    reserve: Reserves,
    victims: VictimIndex,
    usage: Usage<'a>,
    consolidation: Consolidation,
    memo: PlaceMemo<'a>,
    flavors: Flavors,
    pend: PendInfo,
    fair: FairShare,
    tally: Tally,
}

impl<'a> Cycle<'a> {
    fn new(snap: Snapshot<'a>, history: &'a mut History) -> Cycle<'a> {
        let (now, running, pending, cfg) = (snap.now, snap.running, snap.pending, snap.cfg);
        let queues: &Queues = snap.queues;
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
                reclaimable: may_preempt,
                leased: false,
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
        // Reclaimers are remembered while they wait for their victims or run.
        if !history.reclaimed_by.is_empty() {
            let wanted: rustc_hash::FxHashSet<JobId> =
                history.reclaimed_by.values().flatten().copied().collect();
            let live: rustc_hash::FxHashSet<JobId> = run
                .iter()
                .map(|r| r.id)
                .chain(pending.iter().map(|w| w.job.id))
                .filter(|id| wanted.contains(id))
                .collect();
            history.reclaimed_by.retain(|_, by| {
                by.retain(|j| live.contains(j));
                !by.is_empty()
            });
        }
        let may_consolidate = history
            .consolidated_at
            .is_none_or(|t| now >= t.saturating_add(cfg.consolidation_interval));
        history
            .disruptions
            .values_mut()
            .for_each(|v| v.retain(|(t, _)| now.saturating_sub(*t) < cfg.disruption_window));
        let held = {
            let mut m: rustc_hash::FxHashMap<QueueId, Vec<(u32, u32, i32)>> = Default::default();
            for r in run.iter().filter(|r| r.unsaved_held) {
                m.entry(r.queue)
                    .or_default()
                    .push((r.flavor, r.rank, r.priority));
            }
            m
        };
        let own_scan = {
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
        };
        let running_by_queue = {
            let mut m: rustc_hash::FxHashMap<QueueId, Vec<usize>> = Default::default();
            for (k, r) in run.iter().enumerate() {
                m.entry(r.queue).or_default().push(k);
            }
            m
        };
        Cycle {
            tally: Tally::default(),
            snap,
            history,
            order: Order {
                ready,
                ..Order::default()
            },
            out: Outcome {
                reasons: vec![Vec::new(); pending.len()],
                not_reached: vec![u32::MAX; pending.len()],
                ..Outcome::default()
            },
            reserve: Reserves {
                reserved_from: u64::MAX,
                held_from: u64::MAX,
                ..Reserves::default()
            },
            victims: VictimIndex {
                run,
                own_scan,
                held,
                running_by_queue,
                ..VictimIndex::default()
            },
            usage: Usage {
                users,
                protected,
                leaving,
                ..Usage::default()
            },
            consolidation: Consolidation {
                may_consolidate,
                ..Consolidation::default()
            },
            memo: PlaceMemo {
                shape_of: vec![u32::MAX; pending.len()],
                ..PlaceMemo::default()
            },
            flavors: Flavors {
                flavor_names,
                no_gpu: Rc::from(vec![Arc::from("")]),
                queue_flavors: Default::default(),
            },
            pend: PendInfo {
                pend_milli: pending.iter().map(Workload::gpu_milli).collect(),
                pend_id: pending.iter().map(|w| w.job.id).collect(),
                pend_class: pending.iter().map(|w| w.class).collect(),
            },
            fair: FairShare::default(),
        }
        .with_borrowers()
        .with_leases()
    }

    /// What classes that may not borrow hold beyond their guarantees, per
    /// flavor (leases taken in earlier cycles), which of them may be taken
    /// back, and what may be lent: the flavor's capacity less what each
    /// leaf queue claims of its guarantee, all it holds and has pending
    /// (of any flavor: a queue that may want its guarantee back soon lends
    /// none of it) up to the guarantee. Guarantees that add up to more
    /// than the cluster (the default queue is guaranteed everything) claim
    /// only what their queues hold and want. An admission moves a queue's
    /// demand from pending to held, so the figure stands for the cycle.
    fn with_leases(mut self) -> Self {
        if self.snap.cfg.lease_horizon.is_none() {
            return self;
        }
        let queues: &Queues = self.snap.queues;
        let mut pending = vec![0u64; queues.list().len()];
        for (w, &m) in self.snap.pending.iter().zip(&self.pend.pend_milli) {
            pending[w.queue.0 as usize] += m;
        }
        let leaves: Vec<QueueId> = (0..queues.list().len())
            .map(|q| QueueId(q as u32))
            .filter(|&q| queues.is_leaf(q))
            .collect();
        // Leases past the horizon may be taken back, each while its queue
        // keeps its guarantee without it.
        let horizon = self.snap.cfg.lease_horizon.unwrap_or(u64::MAX);
        for (k, r) in self.snap.running.iter().enumerate() {
            let info = &self.victims.run[k];
            if info.flavor == NO_FLAVOR
                || self.snap.now.saturating_sub(r.started) < horizon
                || self
                    .snap
                    .cfg
                    .classes
                    .get(r.work.class)
                    .is_none_or(|c| c.may_borrow)
            {
                continue;
            }
            let held = self
                .usage
                .protected
                .get(&(info.queue, info.flavor))
                .copied()
                .unwrap_or(0);
            let g = queues.quota_at(info.queue, info.flavor as usize).guaranteed;
            if held >= g + info.milli {
                self.victims.run[k].reclaimable = true;
                self.victims.run[k].leased = true;
            }
        }
        self.usage.lendable = (0..self.flavors.flavor_names.len())
            .map(|f| {
                let claimed: u64 = leaves
                    .iter()
                    .map(|&q| {
                        let wants = queues.usage_at(q, f) + pending[q.0 as usize];
                        queues.quota_at(q, f).guaranteed.min(wants)
                    })
                    .sum();
                queues
                    .capacity(&self.flavors.flavor_names[f])
                    .saturating_sub(claimed)
            })
            .collect();
        let mut leased: rustc_hash::FxHashMap<u32, u64> = Default::default();
        for (&(q, fi), &held) in &self.usage.protected {
            if fi == NO_FLAVOR {
                continue;
            }
            let g = self.snap.queues.quota_at(q, fi as usize).guaranteed;
            if held > g {
                *leased.entry(fi).or_default() += held - g;
            }
        }
        self.usage.leased = leased;
        self
    }

    fn with_borrowers(mut self) -> Self {
        let queues: BTreeSet<QueueId> = self.victims.running_by_queue.keys().copied().collect();
        let flavors: Vec<String> = self.snap.queues.flavors().cloned().collect();
        for f in flavors {
            let set = queues
                .iter()
                .copied()
                .filter(|q| self.snap.queues.borrowing(*q, &f))
                .collect();
            self.victims.borrowers.insert(f, set);
        }
        self
    }
}
