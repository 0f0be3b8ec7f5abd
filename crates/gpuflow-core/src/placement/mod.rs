//! Placement: where each task of a job runs, all tasks or none.
//!
//! The pipeline for one task (see [`Placer::place_task`]):
//! 1. Candidates: the live node classes, or the nodes of one topology domain.
//! 2. Filters ([`filters`]): each node (class) passes every rule or is counted
//!    under the first rule that rejects it.
//! 3. GPU picks: the distinct ways the node can give the task its GPUs.
//! 4. Scorers ([`scorers`]): the policy's weighted state scorers rank each pick;
//!    the node's best pick is its score. Results per (class, request) are cached.
//! 5. Context: for gangs and spread services, per-node context scores are added.
//! 6. Choice: the best score, ties broken by the policy (seeded random or lowest id).
//!
//! A job ([`Placer::place_job`]) places its tasks one by one on the working
//! state, biggest first, and undoes them all if one fails. With a topology
//! constraint it tries the domains tightest-first and takes the first that
//! holds the whole gang.

mod eval;
mod explain;
pub(crate) mod filters;
mod reject;
pub mod scorers;

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

pub use explain::Unplaced;
pub use reject::Reject;
pub use scorers::{Norm, Scorer};

use crate::cluster::{Allocation, ClassId, Cluster, GpuPick};
use crate::ids::{CpuMilli, MemMib, NodeId, TaskId};
use crate::mix::{WorkloadMix, fragmentation, free_milli};
use crate::policy::{PickChoice, Policy, TieBreak};
use crate::request::{Constraints, GpuRequest, Job, TaskRequest, Topology, TopologyLevel};
use crate::rng::SplitMix64;
use crate::total::OrdF64;
use filters::NodeView;
use scorers::{GangContext, ScoreInput};

/// A class evaluation: the first rule that rejected it, or its best pick and score.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Eval {
    Reject(Reject),
    Fit { score: f64, pick: GpuPick },
}

/// Two scores closer than this are a tie.
const TIE: f64 = 1e-9;

/// The placement engine: the cluster's working state plus a policy, a seeded
/// generator for tie-breaking and a cache of class evaluations.
///
/// It is pure: no I/O, no clock, no global randomness. Equal clusters, jobs,
/// policies and seeds give equal placements.
#[derive(Clone, Debug)]
pub struct Placer {
    cluster: Cluster,
    policy: Policy,
    mix: WorkloadMix,
    norm: Norm,
    /// Pressure per GPU model under the mix, for the scarcity scorer.
    pressure: Vec<(String, f64)>,
    rng: SplitMix64,
    seed: u64,
    /// Interned (request, class-level constraints) pairs, for the cache key.
    requests: FxHashMap<(TaskRequest, ConstraintKey), u32>,
    /// A hash of each interned request (by id), the same whenever it was
    /// interned: with [`Cluster::class_hash`] it seeds a cached evaluation's
    /// random GPU pick.
    request_hash: Vec<u64>,
    /// Fitting evaluations per (class, request): their scores read the mix,
    /// so a new mix clears them.
    cache: FxHashMap<(ClassId, u32), Eval>,
    /// Per request (by id) and class (by id): whether the class fits, in a
    /// byte ([`UNKNOWN`], [`FITS`], or [`FITS`] + 1 + the index of its
    /// rejection in `rejects`). A rejection is kept only here: it reads the
    /// node and the request, never the mix, and most classes reject most
    /// requests, so scans read bytes instead of a map in which each class
    /// is a miss in the processor's cache.
    verdicts: Vec<Vec<u8>>,
    /// Bytes held by `verdicts`: past [`MAX_VERDICT_BYTES`] it starts over.
    verdict_bytes: usize,
    /// The rejections `verdicts` name, in the order first seen.
    rejects: Vec<Reject>,
    /// Per request: the live classes that fit it, best first, kept in step with
    /// the cluster's class changes. A decision reads the top instead of
    /// evaluating every class.
    ranked: Vec<Ranked>,
    /// Per request: what is known of whether any live class fits it
    /// ([`Placer::fits_job`]).
    fit_memo: Vec<FitMemo>,
    /// Fragmentation of node states already measured: (static shape, free CPU,
    /// free milli-GPU per GPU) → milli-GPU. Valid while the mix stays the same.
    frag_memo: FxHashMap<(u32, u64, [u16; 8]), f64>,
    /// The static filters' answer per (static shape, request): nodes of
    /// one shape differ only in usage, which those filters do not read.
    /// Valid for the placer's life (shapes and requests are interned).
    static_memo: FxHashMap<(u32, u32), Result<(), Reject>>,
    /// Whether a failed placement tallies rejections (off for trial placements).
    explain: bool,
    /// Topology domains per level: name → nodes.
    domains: BTreeMap<TopologyLevel, std::sync::Arc<BTreeMap<String, Vec<NodeId>>>>,
    scratch: Scratch,
}

/// The fitting live classes of one request, ordered best first.
#[derive(Clone, Debug)]
struct Ranked {
    /// The cluster change sequence this is in step with (`u64::MAX`: none kept).
    synced: u64,
    /// When the request last scanned instead (`u64::MAX`: never).
    last_scan: u64,
    order: std::collections::BTreeSet<(std::cmp::Reverse<OrdF64>, ClassId)>,
    fit: FxHashMap<ClassId, (f64, GpuPick)>,
}

impl Ranked {
    fn new() -> Ranked {
        Ranked {
            synced: u64::MAX,
            last_scan: u64::MAX,
            order: Default::default(),
            fit: FxHashMap::default(),
        }
    }
}

/// Whether any live class fits a request, as last found. A class's
/// evaluation never changes (class ids name one state), so a class that
/// fitted fits while it is live, and once no live class fitted, only the
/// classes that became live since can.
#[derive(Clone, Copy, Debug)]
struct FitMemo {
    /// A class that fitted.
    fits: Option<ClassId>,
    /// The change sequence at which no live class fitted (`u64::MAX`: not known).
    none_at: u64,
}

impl Default for FitMemo {
    fn default() -> FitMemo {
        FitMemo {
            fits: None,
            none_at: u64::MAX,
        }
    }
}

/// A kept ranking is brought in step while fewer classes changed than this
/// many times the live classes; past that it is rebuilt or the request scans.
/// Changes repeat classes (a node leaving and coming back), so syncing is cheaper
/// than the raw count suggests.
const KEEP_RANKING: usize = 8;

/// A class not evaluated for a request yet ([`Placer::verdicts`]).
const UNKNOWN: u8 = 0;
/// A class that fits a request ([`Placer::verdicts`]).
const FITS: u8 = 1;
/// Verdict bytes kept at most (requests times class ids); past this they
/// start over.
const MAX_VERDICT_BYTES: usize = 1 << 26;

/// Evaluations kept at most; past this the cache starts over.
const MAX_CACHE: usize = 1 << 22;

/// The constraints that class evaluation reads (topology and spread are per node).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ConstraintKey {
    pool: Option<String>,
    node_selector: BTreeMap<String, String>,
    tolerations: Vec<String>,
    avoid_reservations: u64,
}

impl ConstraintKey {
    fn of(c: &Constraints) -> ConstraintKey {
        ConstraintKey {
            pool: c.pool.clone(),
            node_selector: c.node_selector.clone(),
            tolerations: c.tolerations.clone(),
            avoid_reservations: c.avoid_reservations,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct Scratch {
    picks: Vec<(GpuPick, u16)>,
    free: Vec<u32>,
    after: Vec<u32>,
    /// Per class id: its evaluation in this walk, and how many of its
    /// nodes it rejected ([`Placer::place_per_node`]).
    by_class: Vec<(Option<Eval>, u32)>,
    /// Per class id: the mark of the last sync that took it
    /// ([`Placer::sync_ranked`]), so a change seen twice is taken once.
    seen: Vec<u32>,
    mark: u32,
}

/// Where the tasks of a job were placed.
pub type Placement = Vec<Allocation>;

/// Draws up to 32 nodes uniformly and takes the first whose class `fits`
/// (with its pick): uniform over the fitting nodes, without walking the
/// classes. `None` when every draw missed (few fit).
fn draw_fitting(
    rng: &mut SplitMix64,
    cluster: &Cluster,
    fits: impl Fn(ClassId) -> Option<GpuPick>,
) -> Option<(NodeId, GpuPick)> {
    let n = cluster.nodes().len() as u64;
    (0..32).find_map(|_| {
        let node = NodeId(rng.below(n) as u32);
        fits(cluster.class_of(node)).map(|pick| (node, pick))
    })
}

/// An open trial: see [`Placer::begin_trial`].
#[derive(Debug)]
#[must_use = "a trial must be ended with Placer::end_trial"]
pub struct Trial {
    mark: crate::cluster::TrialMark,
    rng: SplitMix64,
}

impl Placer {
    /// A placer over an idle cluster.
    pub fn new(cluster: Cluster, policy: Policy, mix: WorkloadMix, seed: u64) -> Placer {
        let nodes = cluster.nodes();
        let norm = Norm {
            cpu: nodes.iter().map(|n| n.cpu.0).max().unwrap_or(1).max(1) as f64,
            gpu_milli: (nodes.iter().map(|n| n.gpus.len()).max().unwrap_or(1).max(1) * 1000) as f64,
        };
        let pressure = mix.model_pressure(&gpus_by_model(&cluster));
        Placer {
            cluster,
            policy,
            mix,
            norm,
            pressure,
            rng: SplitMix64::new(seed),
            seed,
            requests: FxHashMap::default(),
            request_hash: Vec::new(),
            cache: FxHashMap::default(),
            verdicts: Vec::new(),
            verdict_bytes: 0,
            rejects: Vec::new(),
            ranked: Vec::new(),
            fit_memo: Vec::new(),
            frag_memo: FxHashMap::default(),
            static_memo: FxHashMap::default(),
            explain: true,
            domains: BTreeMap::new(),
            scratch: Scratch::default(),
        }
    }

    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The workload mix the fragmentation scorer plans for.
    pub fn mix(&self) -> &WorkloadMix {
        &self.mix
    }

    /// Replaces the workload mix the fragmentation scorer plans for.
    pub fn set_mix(&mut self, mix: WorkloadMix) {
        self.pressure = mix.model_pressure(&gpus_by_model(&self.cluster));
        self.mix = mix;
        // Scores read the mix and go; rejections (in `verdicts`) and
        // whether a class fits do not, and stay.
        self.cache.clear();
        self.ranked.clear();
        self.frag_memo.clear();
    }

    /// Commits allocations made elsewhere (e.g. loaded from the store).
    ///
    /// # Errors
    /// Returns the first allocation that does not fit, leaving the earlier ones applied.
    pub fn apply(&mut self, allocations: &[Allocation]) -> Result<(), Allocation> {
        for a in allocations {
            if !self.cluster.fits(a) {
                return Err(a.clone());
            }
            self.cluster.apply(a);
        }
        Ok(())
    }

    /// Takes back allocations given back during a trial (see
    /// [`Cluster::restore`]): unlike [`Placer::apply`] it cannot fail, so a
    /// running job on a GPU that has failed since keeps its resources.
    pub fn restore(&mut self, allocations: &[Allocation]) {
        for a in allocations {
            self.cluster.restore(a);
        }
    }

    /// Gives a job's allocations back (it ended, was preempted or is being undone).
    pub fn release(&mut self, allocations: &[Allocation]) {
        for a in allocations.iter().rev() {
            self.cluster.release(a);
        }
    }

    /// Holds a node for the reservation in `slot` (1 to 63), or frees it (0).
    pub fn set_reserved(&mut self, node: NodeId, slot: u8) {
        self.cluster.set_reserved(node, slot);
    }

    /// Cordons, drains or readies a node.
    pub fn set_node_state(&mut self, node: NodeId, state: crate::model::NodeState) {
        self.cluster.set_node_state(node, state);
    }

    /// Marks a GPU healthy or not.
    pub fn set_gpu_health(&mut self, node: NodeId, gpu: usize, health: crate::model::GpuHealth) {
        self.cluster.set_gpu_health(node, gpu, health);
    }

    /// Whether a task would pass every filter on node `id` once the
    /// allocations `freed` (all on that node) were given back. Changes nothing:
    /// a cheap exact test of whether stopping those tasks could make room.
    pub fn fits_after_release(
        &self,
        id: NodeId,
        freed: &[&Allocation],
        req: &TaskRequest,
        cons: &Constraints,
    ) -> bool {
        // Necessary first, and cheap.
        let touched = freed.iter().fold(0u64, |m, a| m | a.gpu_mask());
        if !self.may_fit_after_release(id, touched, req) {
            return false;
        }
        let mut usage = self.cluster.usage(id).clone();
        for a in freed {
            crate::cluster::release_usage(&mut usage, a);
        }
        let view = NodeView {
            node: self.cluster.node(id),
            usage: &usage,
            islands: self.cluster.islands(id),
            req,
            cons,
            nvlink_scope: None,
            reserved: self.cluster.reservation_slot(id),
        };
        if filters::run(&view).is_err() {
            return false;
        }
        let mut picks = Vec::new();
        filters::picks(&view, &mut picks);
        !picks.is_empty()
    }

    /// The id placement knows a request by (see [`Placer::admits_statically`]).
    pub fn request_id(&mut self, req: &TaskRequest, cons: &Constraints) -> u32 {
        self.intern(req, cons)
    }

    /// Whether node `id`'s static shape admits a task of `req` (known as
    /// `rid`, [`Placer::request_id`]) under `cons` (state, reservation,
    /// pool, labels, taints, GPU model and health: what the node is, not
    /// what it holds), remembered per (shape, request) as placement
    /// remembers it. For start estimates, which count only the room a job
    /// may use.
    pub fn admits_statically(
        &mut self,
        id: NodeId,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
    ) -> bool {
        let view = NodeView {
            node: self.cluster.node(id),
            usage: self.cluster.usage(id),
            islands: self.cluster.islands(id),
            req,
            cons,
            nvlink_scope: None,
            reserved: self.cluster.reservation_slot(id),
        };
        eval::static_once(&mut self.static_memo, self.cluster.shape_id(id), rid, &view).is_ok()
    }

    /// The id of node `id`'s static shape (nodes with equal ids have equal
    /// static shapes).
    pub fn shape_of(&self, id: NodeId) -> u32 {
        self.cluster.shape_id(id)
    }

    /// A necessary condition of [`Placer::fits_after_release`], from counts
    /// alone: whole and fractional GPUs need as much free capacity as they
    /// ask for, and each GPU in `touched` (those the freed tasks hold) gives
    /// back at most one GPU.
    pub fn may_fit_after_release(&self, id: NodeId, touched: u64, req: &TaskRequest) -> bool {
        let need = match req.gpu {
            GpuRequest::Whole { .. } | GpuRequest::Fraction { .. } => req.gpu.milli(),
            _ => 0,
        };
        self.cluster.free_milli_total(id) + 1000 * u64::from(touched.count_ones()) >= need
    }

    /// Begins a trial: placements, releases and re-applications the caller
    /// makes until [`Placer::end_trial`] leave no trace on later decisions
    /// once the caller has put usage back as it was (released what it
    /// placed, re-applied what it released). Without this, the order of
    /// nodes inside their classes and the tie-break generator would depend on
    /// which trials ran, so work done only to explain or to test (a memo hit
    /// or miss) would change later placements.
    pub fn begin_trial(&mut self) -> Trial {
        Trial {
            mark: self.cluster.begin_trial(),
            rng: self.rng.clone(),
        }
    }

    /// Ends a trial begun by [`Placer::begin_trial`], after the caller has put
    /// usage back: node and class order and the tie-break generator are as
    /// they were when it began.
    pub fn end_trial(&mut self, t: Trial) {
        self.cluster.end_trial(t.mark, true);
        self.rng = t.rng;
    }

    /// [`Placer::place_job`] without the explanation when it fails: cheaper,
    /// for trial placements (does preemption help? when could a gang start?).
    pub fn try_place_job(&mut self, job: &Job) -> Option<Placement> {
        self.explain = false;
        let p = self.place_job(job).ok();
        self.explain = true;
        p
    }

    /// Whether `job` would be placed now: the answer of
    /// [`Placer::trial_place`], without choosing where. A job of one task
    /// (and no topology) fits when any live class fits its task, which is
    /// remembered per request from one test to the next; others are placed
    /// and given back. Changes nothing, and leaves no trace on later
    /// tie-breaks.
    pub fn fits_job(&mut self, job: &Job) -> bool {
        if job.task_count() == 1
            && job.constraints.topology.is_none()
            && let Some(g) = job.groups.iter().find(|g| g.replicas > 0)
        {
            let rid = self.intern(&g.request, &job.constraints);
            return self.any_class_fits(rid, &g.request, &job.constraints);
        }
        self.trial_place(job).is_some()
    }

    /// Where `job` would be placed now ([`Placer::try_place_job`]), given
    /// back: changes nothing, and leaves no trace on later tie-breaks.
    pub fn trial_place(&mut self, job: &Job) -> Option<Placement> {
        let trial = self.begin_trial();
        let p = self.try_place_job(job);
        if let Some(p) = &p {
            self.release(p);
        }
        self.end_trial(trial);
        p
    }

    /// Whether a live class fits request `rid` (see [`FitMemo`]).
    fn any_class_fits(&mut self, rid: u32, req: &TaskRequest, cons: &Constraints) -> bool {
        if self.fit_memo.len() <= rid as usize {
            self.fit_memo.resize(rid as usize + 1, FitMemo::default());
        }
        let memo = self.fit_memo[rid as usize];
        if memo.fits.is_some_and(|c| self.cluster.is_live(c)) {
            return true;
        }
        let now = self.cluster.change_seq();
        let live = self.cluster.live_classes().len();
        let fits = |this: &mut Self, class: ClassId| this.verdict(class, rid, req, cons).is_none();
        let changed = (memo.none_at != u64::MAX)
            .then(|| self.cluster.changes_since(memo.none_at))
            .flatten()
            .map(<[ClassId]>::len)
            .filter(|&n| n <= live);
        let found = match changed {
            // No class fitted then: only one that became live since may.
            Some(n) => (0..n).find_map(|j| {
                let class = self.cluster.changes_since(memo.none_at).expect("kept")[j];
                (self.cluster.is_live(class) && fits(self, class)).then_some(class)
            }),
            // The newest live classes first: the states a trial just made.
            None => (0..live).rev().find_map(|j| {
                let class = self.cluster.live_classes()[j];
                fits(self, class).then_some(class)
            }),
        };
        let m = &mut self.fit_memo[rid as usize];
        match found {
            Some(class) => m.fits = Some(class),
            None => m.none_at = now,
        }
        found.is_some()
    }

    /// Places every task of `job` and commits the allocations to the working
    /// state, or places none and says why. A failure leaves no trace: a gang
    /// placed in part is given back, and node order and the tie-break
    /// generator are as before.
    pub fn place_job(&mut self, job: &Job) -> Result<Placement, Unplaced> {
        let mark = self.cluster.begin_trial();
        let rng = self.rng.clone();
        let r = self.place_job_inner(job);
        let failed = r.is_err();
        self.cluster.end_trial(mark, failed);
        if failed {
            self.rng = rng;
        }
        r
    }

    fn place_job_inner(&mut self, job: &Job) -> Result<Placement, Unplaced> {
        // Biggest tasks first: they have the fewest places to go.
        let mut order: Vec<(usize, u32)> = Vec::with_capacity(job.task_count() as usize);
        for (g, group) in job.groups.iter().enumerate() {
            for r in 0..group.replicas {
                order.push((g, r));
            }
        }
        order.sort_by_key(|&(g, r)| (std::cmp::Reverse(job.groups[g].request.gpu.milli()), g, r));
        let Some(topology) = job.constraints.topology else {
            return self.place_tasks(job, &order, None);
        };
        let all = self.domain_members(topology.level);
        for name in self.domains(topology.level, job) {
            let nvlink = (topology.level == TopologyLevel::NvLink).then_some(name.as_str());
            let scope = Scope {
                members: &all[&name],
                nvlink,
            };
            if let Ok(p) = self.place_tasks(job, &order, Some(scope)) {
                return Ok(p);
            }
        }
        match self.place_tasks(job, &order, None) {
            Ok(p) if !topology.required => Ok(p),
            Ok(p) => {
                self.release(&p);
                let (g, _) = order[0];
                Err(self.unplaced(job, g, Vec::new(), Some(topology)))
            }
            Err(e) => Err(e),
        }
    }

    /// The domains of a topology level that have enough free GPU for the job,
    /// tightest first.
    fn domains(&mut self, level: TopologyLevel, job: &Job) -> Vec<String> {
        let members = self.domain_members(level);
        let need: u64 = job
            .groups
            .iter()
            .map(|g| g.request.gpu.milli() * g.replicas as u64)
            .sum();
        let mut out: Vec<(u64, &String)> = Vec::new();
        for (name, members) in members.iter() {
            let free: u64 = if level == TopologyLevel::NvLink {
                members
                    .iter()
                    .map(|&id| {
                        let node = self.cluster.node(id);
                        free_milli(node, self.cluster.usage(id), &mut self.scratch.free);
                        node.gpus
                            .iter()
                            .zip(&self.scratch.free)
                            .filter(|(g, _)| g.nvlink.as_deref() == Some(name.as_str()))
                            .map(|(_, &m)| m as u64)
                            .sum::<u64>()
                    })
                    .sum()
            } else {
                members
                    .iter()
                    .map(|&id| self.cluster.free_milli_total(id))
                    .sum()
            };
            if free >= need {
                out.push((free, name));
            }
        }
        out.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
        out.into_iter().map(|(_, n)| n.clone()).collect()
    }

    /// The nodes of each domain of a level, by domain name. Topology does not
    /// change while the cluster lives, so this is built once per level.
    fn domain_members(
        &mut self,
        level: TopologyLevel,
    ) -> std::sync::Arc<BTreeMap<String, Vec<NodeId>>> {
        if let Some(m) = self.domains.get(&level) {
            return m.clone();
        }
        let mut by_name: BTreeMap<String, Vec<NodeId>> = BTreeMap::new();
        for n in self.cluster.nodes() {
            let mut add = |k: &String| {
                let m = by_name.entry(k.clone()).or_default();
                if m.last() != Some(&n.id) {
                    m.push(n.id);
                }
            };
            match level {
                TopologyLevel::Node => add(&n.name),
                TopologyLevel::Rack => n.rack.iter().for_each(&mut add),
                TopologyLevel::Block => n.block.iter().for_each(&mut add),
                TopologyLevel::NvLink => n
                    .gpus
                    .iter()
                    .filter_map(|g| g.nvlink.as_ref())
                    .for_each(&mut add),
            }
        }
        let m = std::sync::Arc::new(by_name);
        self.domains.insert(level, m.clone());
        m
    }

    fn place_tasks(
        &mut self,
        job: &Job,
        order: &[(usize, u32)],
        scope: Option<Scope>,
    ) -> Result<Placement, Unplaced> {
        let mut placed: Placement = Vec::with_capacity(order.len());
        let mut nodes: Vec<NodeId> = Vec::with_capacity(order.len());
        for &(g, r) in order {
            let req = &job.groups[g].request;
            match self.place_one(
                req,
                &job.constraints,
                &nodes,
                scope.as_ref(),
                job.task_count() > 1,
            ) {
                Ok((node, pick)) => {
                    let a = Allocation {
                        task: TaskId {
                            job: job.id,
                            group: g as u16,
                            index: r,
                        },
                        node,
                        cpu: req.cpu,
                        mem: req.mem,
                        gpu: req.gpu.clone(),
                        pick,
                    };
                    self.cluster.apply(&a);
                    nodes.push(node);
                    placed.push(a);
                }
                Err(rejections) => {
                    self.release(&placed);
                    return Err(self.unplaced(job, g, rejections, None));
                }
            }
        }
        debug_assert!(
            placed.len() as u64 == job.task_count(),
            "a gang is placed whole"
        );
        Ok(placed)
    }

    fn unplaced(
        &self,
        job: &Job,
        group: usize,
        rejections: Vec<(Reject, u32)>,
        topology: Option<Topology>,
    ) -> Unplaced {
        let g = &job.groups[group];
        Unplaced {
            job: job.id,
            group: g.name.clone(),
            request: g.request.clone(),
            tasks: job.task_count(),
            nodes: self.cluster.nodes().len() as u32,
            rejections: explain::finish(rejections),
            topology,
        }
    }

    /// Places one task without committing it: the chosen node and pick, or the
    /// rejection tally. Exposed for explanations ("which rule rejected how many").
    pub fn place_task(
        &mut self,
        req: &TaskRequest,
        cons: &Constraints,
    ) -> Result<(NodeId, GpuPick), Vec<(Reject, u32)>> {
        self.place_one(req, cons, &[], None, false)
            .map_err(explain::finish)
    }

    fn place_one(
        &mut self,
        req: &TaskRequest,
        cons: &Constraints,
        placed: &[NodeId],
        scope: Option<&Scope>,
        gang: bool,
    ) -> Result<(NodeId, GpuPick), Vec<(Reject, u32)>> {
        let rid = self.intern(req, cons);
        // A job of one task has nothing to spread: it is placed by class,
        // as any other (walking every node, as a spread gang's tasks must,
        // chose among the same best nodes at far more cost).
        if scope.is_none() && (!cons.spread || !gang) {
            let fast = self.place_fast(rid, req, cons)?;
            if !gang || placed.is_empty() || self.policy.gang_locality == 0.0 {
                return Ok(fast);
            }
            // Stage 5 for gangs: only nodes that share a node, rack or block with
            // the tasks placed so far get a locality bonus, so the best is either
            // the fast choice or one of those.
            return Ok(self.prefer_near(rid, req, cons, placed, fast));
        }
        self.place_per_node(rid, req, cons, placed, scope)
    }

    /// Stages 1-4 per class, then 6: the best classes, and a node among them.
    /// Requests that come often keep a ranking of the classes in step with the
    /// cluster; others scan the (cached) class evaluations.
    fn place_fast(
        &mut self,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
    ) -> Result<(NodeId, GpuPick), Vec<(Reject, u32)>> {
        if self.policy.scorers.is_empty() && self.policy.tie_break == TieBreak::Random {
            // No scorers: every fitting node ties. Drawing nodes until one fits
            // is uniform over the fitting nodes and needs no ranking or scan.
            let n = self.cluster.nodes().len() as u64;
            for _ in 0..32.min(n) {
                let node = NodeId(self.rng.below(n) as u32);
                if let Eval::Fit { pick, .. } =
                    self.eval_class(self.cluster.class_of(node), rid, req, cons)
                {
                    return Ok((node, pick));
                }
            }
        }
        if !self.ranking_worthwhile(rid) {
            return self.place_by_scan(rid, req, cons);
        }
        self.sync_ranked(rid, req, cons);
        let ranked = &self.ranked[rid as usize];
        if let (Some(first), Some(last)) = (ranked.order.first(), ranked.order.last()) {
            // Every fitting class ties (e.g. the random policy): draw nodes
            // until one fits, which is uniform over the fitting nodes and
            // avoids walking every class. Few fit: fall through to the walk.
            if self.policy.tie_break == TieBreak::Random
                && (first.0).0.0 - (last.0).0.0 <= TIE
                && let Some(choice) = draw_fitting(&mut self.rng, &self.cluster, |c| {
                    ranked.fit.get(&c).map(|f| f.1)
                })
            {
                return Ok(choice);
            }
        }
        let ranked = &self.ranked[rid as usize];
        let mut tied: Vec<(ClassId, GpuPick)> = Vec::new();
        if let Some((std::cmp::Reverse(OrdF64(best)), _)) = ranked.order.first() {
            for (std::cmp::Reverse(OrdF64(score)), class) in &ranked.order {
                if *score < best - TIE {
                    break;
                }
                tied.push((*class, ranked.fit[class].1));
            }
        }
        if let Some(choice) = self.choose_among_classes(&mut tied) {
            return Ok(choice);
        }
        if !self.explain {
            // Nothing fits, and the caller does not want to know why.
            return Err(Vec::new());
        }
        self.place_by_scan(rid, req, cons)
    }

    /// The fast choice, or a node near the gang's placed tasks if its state
    /// score plus the locality bonus beats it.
    fn prefer_near(
        &mut self,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
        placed: &[NodeId],
        fast: (NodeId, GpuPick),
    ) -> (NodeId, GpuPick) {
        let bonus = |this: &Self, id: NodeId| {
            let ctx = GangContext {
                placed,
                nodes: this.cluster.nodes(),
            };
            this.policy.gang_locality * scorers::gang_locality(&ctx, this.cluster.node(id))
        };
        let score_of = |this: &mut Self, id: NodeId| match this.eval_class(
            this.cluster.class_of(id),
            rid,
            req,
            cons,
        ) {
            Eval::Fit { score, pick } => Some((score, pick)),
            Eval::Reject(_) => None,
        };
        let mut best = (
            score_of(self, fast.0).map_or(f64::NEG_INFINITY, |(s, _)| s) + bonus(self, fast.0),
            fast,
        );
        let mut near: Vec<NodeId> = placed.to_vec();
        for p in placed {
            let n = self.cluster.node(*p);
            let keys = [
                (TopologyLevel::Rack, n.rack.clone()),
                (TopologyLevel::Block, n.block.clone()),
            ];
            for (level, key) in keys {
                if let Some(m) = key.and_then(|k| self.domain_members(level).get(&k).cloned()) {
                    near.extend(m);
                }
            }
        }
        near.sort_unstable();
        near.dedup();
        for id in near {
            if let Some((score, pick)) = score_of(self, id) {
                let total = score + bonus(self, id);
                if total > best.0 + TIE {
                    best = (total, (id, pick));
                }
            }
        }
        best.1
    }

    /// Stages 1-5 node by node, for a topology domain or a spread service.
    fn place_per_node(
        &mut self,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
        placed: &[NodeId],
        scope: Option<&Scope>,
    ) -> Result<(NodeId, GpuPick), Vec<(Reject, u32)>> {
        let mut rejections: Vec<(Reject, u32)> = Vec::new();
        // Per node: stages 1-4 (cached per class unless an NVLink scope narrows
        // the GPUs), plus stage 5, context scores.
        // Node ids are indices: without a scope, every node in id order.
        let count = scope.map_or(self.cluster.nodes().len(), |s| s.members.len());
        let member = |k: usize| scope.map_or(NodeId(k as u32), |s| s.members[k]);
        if scope.is_some() {
            let outside = self.cluster.nodes().len() as u32 - count as u32;
            if outside > 0 {
                explain::tally(&mut rejections, Reject::Topology, outside);
            }
        }
        let nvlink = scope.and_then(|s| s.nvlink);
        let mut best = f64::NEG_INFINITY;
        let mut choice: Option<(NodeId, GpuPick)> = None;
        let mut ties = 0u64;
        // Without an NVLink scope a node's evaluation is its class's, which
        // nothing in this walk changes: each class is evaluated once, and
        // its rejections counted once, at the end (a walk visits every node
        // of the cluster for a spread service, and a lookup in the placer's
        // cache per node was most of the cost of placing one).
        let mut by_class = std::mem::take(&mut self.scratch.by_class);
        by_class.clear();
        if nvlink.is_none() {
            by_class.resize(self.cluster.class_slots(), (None, 0));
        }
        for k in 0..count {
            let id = member(k);
            // `slot`: the node's class's entry, without an NVLink scope.
            let (eval, slot) = match nvlink {
                Some(_) => (self.eval_node(id, req, cons, nvlink, None, None), None),
                None => {
                    let class = self.cluster.class_of(id);
                    let slot = class.0 as usize;
                    let e = match by_class[slot].0 {
                        Some(e) => e,
                        None => {
                            let e = self.eval_class(class, rid, req, cons);
                            by_class[slot].0 = Some(e);
                            e
                        }
                    };
                    (e, Some(slot))
                }
            };
            let (score, pick) = match eval {
                Eval::Reject(r) => {
                    match slot {
                        Some(slot) => by_class[slot].1 += 1,
                        None => explain::tally(&mut rejections, r, 1),
                    }
                    continue;
                }
                Eval::Fit { score, pick } => (score, pick),
            };
            let node = self.cluster.node(id);
            let ctx = GangContext {
                placed,
                nodes: self.cluster.nodes(),
            };
            let mut total = score;
            if !placed.is_empty() {
                if cons.spread {
                    total += self.policy.spread * scorers::spread(&ctx, node);
                } else {
                    total += self.policy.gang_locality * scorers::gang_locality(&ctx, node);
                }
            }
            if total > best + TIE {
                best = total;
                choice = Some((id, pick));
                ties = 1;
            } else if total >= best - TIE {
                ties += 1;
                // Reservoir sampling keeps each tied node equally likely.
                if self.policy.tie_break == TieBreak::Random && self.rng.below(ties) == 0 {
                    choice = Some((id, pick));
                }
            }
        }
        if choice.is_none() {
            for &(eval, n) in &by_class {
                if let (Some(Eval::Reject(r)), 1..) = (eval, n) {
                    explain::tally(&mut rejections, r, n);
                }
            }
        }
        self.scratch.by_class = by_class;
        choice.ok_or(rejections)
    }

    /// One node among tied classes. The classes are taken in the order of
    /// their state ([`Cluster::class_cmp`]), so the choice does not depend on
    /// class ids, which follow the history of the cluster.
    fn choose_among_classes(
        &mut self,
        tied: &mut [(ClassId, GpuPick)],
    ) -> Option<(NodeId, GpuPick)> {
        if tied.is_empty() {
            return None;
        }
        tied.sort_by(|a, b| self.cluster.class_cmp(a.0, b.0));
        match self.policy.tie_break {
            TieBreak::First => tied
                .iter()
                .map(|&(c, p)| {
                    (
                        *self
                            .cluster
                            .class_members(c)
                            .iter()
                            .min()
                            .expect("live class"),
                        p,
                    )
                })
                .min_by_key(|(n, _)| *n),
            TieBreak::Random => {
                let total: u64 = tied
                    .iter()
                    .map(|(c, _)| self.cluster.class_members(*c).len() as u64)
                    .sum();
                let mut k = self.rng.below(total) as usize;
                for &(c, p) in tied.iter() {
                    let m = self.cluster.class_members(c);
                    if k < m.len() {
                        return Some((m[k], p));
                    }
                    k -= m.len();
                }
                unreachable!("k is below the total of the tied classes")
            }
        }
    }

    fn intern(&mut self, req: &TaskRequest, cons: &Constraints) -> u32 {
        use std::hash::{Hash, Hasher};
        let key = (req.clone(), ConstraintKey::of(cons));
        if let Some(&rid) = self.requests.get(&key) {
            return rid;
        }
        let mut h = rustc_hash::FxHasher::default();
        key.hash(&mut h);
        self.request_hash.push(h.finish());
        let rid = self.requests.len() as u32;
        self.requests.insert(key, rid);
        rid
    }

    /// Whether to keep a ranking for this request: yes while one is kept and
    /// few classes changed since, or when the request comes back soon after a
    /// scan. Rare requests scan instead of rebuilding a ranking each time.
    fn ranking_worthwhile(&mut self, rid: u32) -> bool {
        if self.ranked.len() <= rid as usize {
            self.ranked.resize_with(rid as usize + 1, Ranked::new);
        }
        let live = self.cluster.live_classes().len();
        let now = self.cluster.change_seq();
        let r = &mut self.ranked[rid as usize];
        let recent =
            |seq: u64| seq != u64::MAX && now.saturating_sub(seq) <= (live as u64 / 2).max(4);
        if r.synced != u64::MAX
            && self
                .cluster
                .changes_since(r.synced)
                .is_some_and(|c| c.len() <= KEEP_RANKING * live)
        {
            return true;
        }
        if recent(r.last_scan) {
            return true;
        }
        r.synced = u64::MAX;
        r.order.clear();
        r.fit.clear();
        r.last_scan = now;
        false
    }

    /// The fast path's fallback: every live class evaluated (from the cache
    /// where possible), the best taken, the rejections tallied.
    fn place_by_scan(
        &mut self,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
    ) -> Result<(NodeId, GpuPick), Vec<(Reject, u32)>> {
        let mut rejections: Vec<(Reject, u32)> = Vec::new();
        let mut best = f64::NEG_INFINITY;
        let mut tied: Vec<(ClassId, GpuPick)> = Vec::new();
        let mut fitting = 0usize;
        for i in 0..self.cluster.live_classes().len() {
            let class = self.cluster.live_classes()[i];
            match self.eval_class(class, rid, req, cons) {
                Eval::Reject(r) => explain::tally(
                    &mut rejections,
                    r,
                    self.cluster.class_members(class).len() as u32,
                ),
                Eval::Fit { score, pick } => {
                    fitting += 1;
                    if score > best + TIE {
                        best = score;
                        tied.clear();
                        tied.push((class, pick));
                    } else if score >= best - TIE {
                        tied.push((class, pick));
                    }
                }
            }
        }
        // Every fitting class ties: draw nodes as the ranked path does, so
        // that both paths choose alike.
        if self.policy.tie_break == TieBreak::Random
            && !tied.is_empty()
            && tied.len() == fitting
            && let Some(choice) = draw_fitting(&mut self.rng, &self.cluster, |c| {
                tied.iter().find(|t| t.0 == c).map(|t| t.1)
            })
        {
            return Ok(choice);
        }
        self.choose_among_classes(&mut tied).ok_or(rejections)
    }

    /// Brings a request's ranking in step with the cluster: classes that became
    /// live are evaluated and ranked, classes that died are dropped. When more
    /// changed than there are live classes, it is rebuilt from the live classes.
    fn sync_ranked(&mut self, rid: u32, req: &TaskRequest, cons: &Constraints) {
        let now = self.cluster.change_seq();
        let synced = self.ranked[rid as usize].synced;
        if synced == now {
            return;
        }
        let changed: Vec<ClassId> = match self.cluster.changes_since(synced) {
            Some(c)
                if synced != u64::MAX
                    && c.len() <= KEEP_RANKING * self.cluster.live_classes().len() =>
            {
                // Each class once, in the order first changed (what a
                // class's handling below does reads no other class).
                let s = &mut self.scratch;
                s.mark = s.mark.wrapping_add(1);
                if s.mark == 0 {
                    s.seen.fill(0);
                    s.mark = 1;
                }
                s.seen.resize(self.cluster.class_slots(), 0);
                let (seen, mark) = (&mut s.seen, s.mark);
                c.iter()
                    .copied()
                    .filter(|class| std::mem::replace(&mut seen[class.0 as usize], mark) != mark)
                    .collect()
            }
            _ => {
                let r = &mut self.ranked[rid as usize];
                r.order.clear();
                r.fit.clear();
                self.cluster.live_classes().to_vec()
            }
        };
        for class in changed {
            let live = self.cluster.is_live(class);
            let had = self.ranked[rid as usize].fit.get(&class).copied();
            match (live, had) {
                (true, None) => {
                    if let Eval::Fit { score, pick } = self.eval_class(class, rid, req, cons) {
                        let r = &mut self.ranked[rid as usize];
                        r.fit.insert(class, (score, pick));
                        r.order.insert((std::cmp::Reverse(OrdF64(score)), class));
                    }
                }
                (false, Some((score, _))) => {
                    let r = &mut self.ranked[rid as usize];
                    r.fit.remove(&class);
                    r.order.remove(&(std::cmp::Reverse(OrdF64(score)), class));
                }
                _ => {}
            }
        }
        self.ranked[rid as usize].synced = now;
    }
}

/// [`fragmentation`], remembered per node state for nodes of up to 8 GPUs.
fn memo_fragmentation(
    memo: &mut FxHashMap<(u32, u64, [u16; 8]), f64>,
    shape: u32,
    node: &crate::model::Node,
    free_cpu: u64,
    free: &[u32],
    mix: &WorkloadMix,
) -> f64 {
    if free.len() > 8 {
        return fragmentation(node, free_cpu, free, mix);
    }
    let mut key = [u16::MAX; 8];
    for (k, &f) in key.iter_mut().zip(free) {
        *k = f as u16;
    }
    if memo.len() >= MAX_CACHE {
        memo.clear();
    }
    *memo
        .entry((shape, free_cpu, key))
        .or_insert_with(|| fragmentation(node, free_cpu, free, mix))
}

fn gpus_by_model(c: &Cluster) -> BTreeMap<String, u64> {
    // Counted by name borrowed, then named once per model: clusters have
    // tens of thousands of GPUs and a few models.
    let mut m: BTreeMap<&str, u64> = BTreeMap::new();
    for g in c.nodes().iter().flat_map(|n| &n.gpus) {
        *m.entry(g.model.as_str()).or_default() += 1;
    }
    m.into_iter().map(|(k, n)| (k.to_string(), n)).collect()
}

/// How much of the picked shared GPU is left free after the pick (0 for other picks).
fn tightness(pick: GpuPick, after: &[u32]) -> u32 {
    match pick {
        GpuPick::Shared(g) => after[g as usize],
        _ => 0,
    }
}

/// A topology domain being tried: its nodes, and for NVLink the domain's name.
struct Scope<'a> {
    members: &'a [NodeId],
    nvlink: Option<&'a str>,
}

/// Shorthand for tests and fixtures: a task request.
pub fn task(cpu_milli: u64, mem_mib: u64, gpu: GpuRequest) -> TaskRequest {
    TaskRequest {
        cpu: CpuMilli(cpu_milli),
        mem: MemMib(mem_mib),
        gpu,
        models: Vec::new(),
    }
}

#[cfg(test)]
mod tests;
