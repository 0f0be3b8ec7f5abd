//! The cluster as the scheduler sees it: the static [`Node`]s plus what is used
//! on each of them, and an index that groups nodes in identical state.
//!
//! Nodes in one *class* have the same static shape (pool, labels, taints, CPU,
//! memory, GPU models and layout) and the same usage, so every filter and every
//! context-free scorer gives them the same answer. The placement pipeline
//! evaluates a class once instead of each of its nodes; in a large cluster of a
//! few node types that is what makes a placement decision cost microseconds.
//! Names, racks and blocks are not part of a class: rules that read them run per node.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::error::CoreError;
use crate::ids::{CpuMilli, GpuMilli, MemMib, NodeId, TaskId};
use crate::model::{GpuHealth, Node, NodeState, Taint};
use crate::request::GpuRequest;

/// How a GPU is being used right now. Sharing modes never mix on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum GpuMode {
    #[default]
    Idle,
    Exclusive,
    Fractional,
    TimeSliced,
    /// At least one MIG instance is in use.
    Mig,
}

/// The usage of one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct GpuUsage {
    pub mode: GpuMode,
    /// Compute share used by fractional tasks.
    pub milli: u32,
    /// GPU memory claimed by fractional and time-sliced tasks, in MiB.
    pub mem: u64,
    /// Tasks on this GPU (fractional or time-sliced).
    pub tasks: u16,
    /// Bit i set: MIG instance i is in use.
    pub mig_used: u32,
}

impl GpuUsage {
    /// Compute share still free for whole-GPU and fractional work, in milli-GPU.
    pub fn free_milli(&self) -> u32 {
        match self.mode {
            GpuMode::Idle => 1000,
            GpuMode::Fractional => 1000u32.saturating_sub(self.milli),
            _ => 0,
        }
    }
}

/// Which GPUs of a node a task gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuPick {
    None,
    /// Whole GPUs: bit i set means GPU i.
    Whole(u64),
    /// One shared GPU (fractional or time-sliced).
    Shared(u8),
    /// One MIG instance of one GPU.
    Mig {
        gpu: u8,
        instance: u8,
    },
}

/// One task's resources on one node, as committed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Allocation {
    pub task: TaskId,
    pub node: NodeId,
    pub cpu: CpuMilli,
    pub mem: MemMib,
    pub gpu: GpuRequest,
    pub pick: GpuPick,
}

impl Allocation {
    /// The GPUs of its node this allocation touches, as a bit mask.
    pub fn gpu_mask(&self) -> u64 {
        match self.pick {
            GpuPick::None => 0,
            GpuPick::Whole(mask) => mask,
            GpuPick::Shared(g) | GpuPick::Mig { gpu: g, .. } => {
                1u64.checked_shl(u32::from(g)).unwrap_or(0)
            }
        }
    }

    /// The GPU indices this allocation touches.
    pub fn gpu_indices(&self) -> Vec<u8> {
        match self.pick {
            GpuPick::None => Vec::new(),
            GpuPick::Whole(mask) => (0..64u8).filter(|i| mask & (1 << i) != 0).collect(),
            GpuPick::Shared(g) | GpuPick::Mig { gpu: g, .. } => vec![g],
        }
    }
}

/// Kinds of task a node hosts, for the clustering scorer: bit per [`shape_kind`].
pub(crate) const KINDS: usize = 7;

/// The kind of a GPU request as the clustering scorer groups them.
pub(crate) fn shape_kind(gpu: &GpuRequest) -> usize {
    match gpu {
        GpuRequest::None => 0,
        GpuRequest::Fraction { milli, .. } if milli.0 < 500 => 1,
        GpuRequest::Fraction { .. } | GpuRequest::TimeSlice { .. } | GpuRequest::Mig { .. } => 2,
        GpuRequest::Whole { count: 1 } => 3,
        GpuRequest::Whole { count: 2 } => 4,
        GpuRequest::Whole { count: 3..=4 } => 5,
        GpuRequest::Whole { .. } => 6,
    }
}

/// What is used on one node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct NodeUsage {
    pub cpu: u64,
    pub mem: u64,
    pub gpus: Vec<GpuUsage>,
    /// Tasks per [`shape_kind`].
    pub kinds: [u32; KINDS],
}

impl NodeUsage {
    pub(crate) fn kinds_mask(&self) -> u8 {
        self.kinds
            .iter()
            .enumerate()
            .fold(0, |m, (i, c)| if *c > 0 { m | (1 << i) } else { m })
    }
}

/// The highest reservation slot: slots are bits of a `u64` mask.
pub const MAX_RESERVATION_SLOT: u8 = 63;

/// The static shape of a node, without its identity or topology position.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct StaticShape {
    pool: String,
    labels: BTreeMap<String, String>,
    taints: Vec<Taint>,
    state: NodeState,
    /// The node's reservation slot (0: none).
    reserved: u8,
    cpu: CpuMilli,
    mem: MemMib,
    gpus: Vec<GpuShape>,
}

/// A GPU's static shape: model, memory, NUMA node, local NVLink island, health,
/// MIG profiles and time-slice limit.
type GpuShape = (
    String,
    MemMib,
    u8,
    Option<u8>,
    GpuHealth,
    Vec<(String, MemMib)>,
    u16,
);

fn static_shape(node: &Node, reserved: u8) -> StaticShape {
    let mut islands: Vec<&str> = Vec::new();
    let gpus = node
        .gpus
        .iter()
        .map(|g| {
            let island = g
                .nvlink
                .as_deref()
                .map(|n| match islands.iter().position(|x| *x == n) {
                    Some(i) => i as u8,
                    None => {
                        islands.push(n);
                        (islands.len() - 1) as u8
                    }
                });
            let mig = g.mig.iter().map(|m| (m.profile.clone(), m.mem)).collect();
            (
                g.model.clone(),
                g.mem,
                g.numa,
                island,
                g.health,
                mig,
                g.time_slices,
            )
        })
        .collect();
    StaticShape {
        pool: node.pool.clone(),
        labels: node.labels.clone(),
        taints: node.taints.clone(),
        state: node.state,
        reserved,
        cpu: node.cpu,
        mem: node.mem,
        gpus,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ClassKey {
    shape: u32,
    cpu: u64,
    mem: u64,
    gpus: Vec<GpuUsage>,
    kinds: u8,
}

/// Identifies a class of nodes in identical state. Class ids are never reused
/// while the cluster lives, so a cached evaluation of a class stays true.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassId(pub u32);

/// Nodes, their usage, and the class index.
#[derive(Clone, Debug)]
pub struct Cluster {
    /// The nodes and their GPUs' NVLink islands change only by
    /// [`Cluster::set_node_state`] and [`Cluster::set_gpu_health`]: shared
    /// between clones, so that a clone copies usage, not every node.
    nodes: std::sync::Arc<Vec<Node>>,
    usage: Vec<NodeUsage>,
    /// Local NVLink island of each GPU, per node (index into a per-node list).
    islands: std::sync::Arc<Vec<Vec<Option<u8>>>>,
    shapes: FxHashMap<StaticShape, u32>,
    shape_of: Vec<u32>,
    classes: FxHashMap<ClassKey, ClassId>,
    class_of: Vec<ClassId>,
    members: Vec<Vec<NodeId>>,
    pos_in_class: Vec<u32>,
    live: Vec<ClassId>,
    live_pos: Vec<u32>,
    /// The node each class was first seen on: its representative for evaluation.
    representative: Vec<NodeId>,
    /// Free milli-GPU per node for whole and fractional work (healthy, non-MIG GPUs).
    free_total: Vec<u64>,
    /// The reservation slot holding each node (0: none): only work that
    /// ends before that reservation starts may use it.
    reserved: Vec<u8>,
    /// Classes whose liveness may have changed, in order; see [`Cluster::changes_since`].
    changes: Vec<ClassId>,
    /// Sequence number of `changes[0]`.
    changes_base: u64,
    /// The key of each class, by id: ties between classes are broken by
    /// state, not by when a class was first seen (see [`Cluster::class_cmp`]).
    keys: Vec<ClassKey>,
    /// [`Cluster::class_hash`] of each class, by id: worked out once, when
    /// the class is first seen (evaluations of every class ask for it).
    key_hash: Vec<u64>,
    /// Open trials (see [`Cluster::begin_trial`]) and the membership moves
    /// made since the outermost one began.
    trials: u32,
    journal: Vec<Move>,
}

/// A node's move between classes, journaled during a trial so that ending
/// the trial can put every list back in its old order.
#[derive(Clone, Debug)]
enum Move {
    /// The node left `class` from position `pos`; `live_at`: the class left
    /// the live list from there (the node was its last member).
    Leave {
        node: NodeId,
        class: ClassId,
        pos: u32,
        live_at: Option<u32>,
    },
    /// The node joined the end of `class`, which became live if `made_live`.
    Join { class: ClassId, made_live: bool },
}

/// Where a trial began: see [`Cluster::begin_trial`].
#[derive(Clone, Copy, Debug)]
#[must_use = "a trial must be ended"]
pub struct TrialMark(usize);

/// Changes are kept up to this many; older ones are dropped and readers rescan.
const MAX_CHANGES: usize = 1 << 20;

const NOT_LIVE: u32 = u32::MAX;

/// Undoes `v.swap_remove(at)` that removed `x`: `x` goes back to `at`, and the
/// element that had moved there from the end goes back to the end
/// (`moved(element, its new index)` is told).
fn unswap<T: Copy>(v: &mut Vec<T>, at: usize, x: T, mut moved: impl FnMut(T, u32)) {
    if at == v.len() {
        v.push(x);
    } else {
        let m = v[at];
        v.push(m);
        moved(m, (v.len() - 1) as u32);
        v[at] = x;
    }
}

/// The most GPUs a node may have (a node's GPUs are a 64-bit mask).
pub const MAX_GPUS_PER_NODE: usize = 64;

/// The most MIG instances a GPU may have (a GPU's instances are a 32-bit
/// mask; NVIDIA's GPUs have at most 7).
pub const MAX_MIG_INSTANCES: usize = 32;

impl Cluster {
    /// Builds a cluster from its nodes, all idle.
    ///
    /// # Errors
    /// When node ids are not 0..n in order, names repeat, a node has more than
    /// 64 GPUs or a GPU more than 32 MIG instances.
    pub fn new(nodes: Vec<Node>) -> Result<Cluster, CoreError> {
        let mut names = std::collections::BTreeSet::new();
        for (i, n) in nodes.iter().enumerate() {
            if n.id.0 as usize != i {
                return Err(CoreError::NodeIdOrder {
                    name: n.name.clone(),
                    id: n.id.0,
                    expected: i as u32,
                });
            }
            if !names.insert(n.name.as_str()) {
                return Err(CoreError::DuplicateNode(n.name.clone()));
            }
            if n.gpus.len() > MAX_GPUS_PER_NODE {
                return Err(CoreError::TooManyGpus {
                    name: n.name.clone(),
                    count: n.gpus.len(),
                });
            }
            if let Some(g) = n.gpus.iter().find(|g| g.mig.len() > MAX_MIG_INSTANCES) {
                return Err(CoreError::TooManyMigInstances {
                    name: n.name.clone(),
                    count: g.mig.len(),
                });
            }
        }
        let usage = nodes
            .iter()
            .map(|n| NodeUsage {
                gpus: vec![GpuUsage::default(); n.gpus.len()],
                ..Default::default()
            })
            .collect();
        let n = nodes.len();
        let mut c = Cluster {
            nodes: std::sync::Arc::new(nodes),
            usage,
            islands: Default::default(),
            shapes: FxHashMap::default(),
            shape_of: vec![0; n],
            classes: FxHashMap::default(),
            class_of: vec![ClassId(0); n],
            members: Vec::new(),
            pos_in_class: vec![0; n],
            live: Vec::new(),
            live_pos: Vec::new(),
            representative: Vec::new(),
            changes: Vec::new(),
            changes_base: 0,
            keys: Vec::new(),
            key_hash: Vec::new(),
            trials: 0,
            journal: Vec::new(),
            free_total: vec![0; n],
            reserved: vec![0; n],
        };
        let mut islands = Vec::with_capacity(n);
        for i in 0..n {
            let shape = static_shape(&c.nodes[i], 0);
            islands.push(shape.gpus.iter().map(|g| g.3).collect());
            c.shape_of[i] = c.intern_shape(shape);
            let class = c.intern_class(NodeId(i as u32));
            c.join(NodeId(i as u32), class);
            c.reclass(NodeId(i as u32));
        }
        c.islands = std::sync::Arc::new(islands);
        Ok(c)
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.0 as usize]
    }

    pub fn usage(&self, id: NodeId) -> &NodeUsage {
        &self.usage[id.0 as usize]
    }

    /// The local NVLink island index of each GPU of a node.
    pub fn islands(&self, id: NodeId) -> &[Option<u8>] {
        &self.islands[id.0 as usize]
    }

    pub fn node_by_name(&self, name: &str) -> Option<NodeId> {
        self.nodes.iter().find(|n| n.name == name).map(|n| n.id)
    }

    pub fn class_of(&self, id: NodeId) -> ClassId {
        self.class_of[id.0 as usize]
    }

    /// Classes that currently have nodes, in a deterministic order.
    pub fn live_classes(&self) -> &[ClassId] {
        &self.live
    }

    /// The id of a node's static shape: nodes with equal ids have equal static shapes.
    pub(crate) fn shape_id(&self, id: NodeId) -> u32 {
        self.shape_of[id.0 as usize]
    }

    /// Whether a class has nodes now.
    pub fn is_live(&self, class: ClassId) -> bool {
        self.live_pos[class.0 as usize] != NOT_LIVE
    }

    /// The sequence number the next change will get.
    pub fn change_seq(&self) -> u64 {
        self.changes_base + self.changes.len() as u64
    }

    /// Classes that became live or died since sequence number `seq`, or `None`
    /// when those changes are no longer kept (the reader must rescan).
    pub fn changes_since(&self, seq: u64) -> Option<&[ClassId]> {
        if seq < self.changes_base {
            return None;
        }
        self.changes.get((seq - self.changes_base) as usize..)
    }

    fn record_change(&mut self, class: ClassId) {
        if self.changes.len() >= MAX_CHANGES {
            self.changes_base += self.changes.len() as u64;
            self.changes.clear();
        }
        self.changes.push(class);
    }

    /// How many class ids there are (live or not): ids are below it.
    pub fn class_slots(&self) -> usize {
        self.members.len()
    }

    pub fn class_members(&self, class: ClassId) -> &[NodeId] {
        &self.members[class.0 as usize]
    }

    /// A node of the class on which its evaluation is made.
    pub fn class_representative(&self, class: ClassId) -> NodeId {
        let m = &self.members[class.0 as usize];
        m.first()
            .copied()
            .unwrap_or(self.representative[class.0 as usize])
    }

    /// Changes a node's state (cordon, drain, lost, ready).
    pub fn set_node_state(&mut self, id: NodeId, state: NodeState) {
        std::sync::Arc::make_mut(&mut self.nodes)[id.0 as usize].state = state;
        self.reshape(id);
    }

    /// Changes a GPU's health. Work already on it is the caller's to requeue.
    pub fn set_gpu_health(&mut self, id: NodeId, gpu: usize, health: GpuHealth) {
        if let Some(g) = std::sync::Arc::make_mut(&mut self.nodes)[id.0 as usize]
            .gpus
            .get_mut(gpu)
        {
            g.health = health;
            self.reshape(id);
        }
    }

    /// Holds a node for the reservation in `slot` (1 to 63), or frees it (0).
    /// Nodes of different slots are never alike; work keeps off the slots
    /// its constraints name ([`crate::request::Constraints::avoid_reservations`]).
    pub fn set_reserved(&mut self, id: NodeId, slot: u8) {
        let slot = slot.min(MAX_RESERVATION_SLOT);
        if self.reserved[id.0 as usize] != slot {
            self.reserved[id.0 as usize] = slot;
            self.reshape(id);
        }
    }

    /// The node's reservation slot (0: none).
    pub fn reservation_slot(&self, id: NodeId) -> u8 {
        self.reserved[id.0 as usize]
    }

    fn reshape(&mut self, id: NodeId) {
        let shape = static_shape(&self.nodes[id.0 as usize], self.reserved[id.0 as usize]);
        self.shape_of[id.0 as usize] = self.intern_shape(shape);
        self.reclass(id);
    }

    fn intern_shape(&mut self, shape: StaticShape) -> u32 {
        let next = self.shapes.len() as u32;
        *self.shapes.entry(shape).or_insert(next)
    }

    fn intern_class(&mut self, id: NodeId) -> ClassId {
        let u = &self.usage[id.0 as usize];
        let key = ClassKey {
            shape: self.shape_of[id.0 as usize],
            cpu: u.cpu,
            mem: u.mem,
            gpus: u.gpus.clone(),
            kinds: u.kinds_mask(),
        };
        let next = ClassId(self.members.len() as u32);
        let class = match self.classes.get(&key) {
            Some(&c) => c,
            None => {
                self.key_hash.push({
                    use std::hash::{Hash, Hasher};
                    let mut h = rustc_hash::FxHasher::default();
                    key.hash(&mut h);
                    h.finish()
                });
                self.keys.push(key.clone());
                self.classes.insert(key, next);
                next
            }
        };
        if class == next {
            self.members.push(Vec::new());
            self.live_pos.push(NOT_LIVE);
            self.representative.push(id);
        }
        class
    }

    fn join(&mut self, id: NodeId, class: ClassId) {
        let c = class.0 as usize;
        self.class_of[id.0 as usize] = class;
        self.pos_in_class[id.0 as usize] = self.members[c].len() as u32;
        self.members[c].push(id);
        let made_live = self.live_pos[c] == NOT_LIVE;
        if made_live {
            self.live_pos[c] = self.live.len() as u32;
            self.live.push(class);
            self.record_change(class);
        }
        if self.trials > 0 {
            self.journal.push(Move::Join { class, made_live });
        }
    }

    fn leave(&mut self, id: NodeId) {
        let class = self.class_of[id.0 as usize];
        let c = class.0 as usize;
        let pos = self.pos_in_class[id.0 as usize] as usize;
        self.members[c].swap_remove(pos);
        if let Some(&moved) = self.members[c].get(pos) {
            self.pos_in_class[moved.0 as usize] = pos as u32;
        }
        let mut live_at = None;
        if self.members[c].is_empty() {
            let lp = self.live_pos[c] as usize;
            self.live.swap_remove(lp);
            if let Some(&moved) = self.live.get(lp) {
                self.live_pos[moved.0 as usize] = lp as u32;
            }
            self.live_pos[c] = NOT_LIVE;
            self.record_change(class);
            live_at = Some(lp as u32);
        }
        if self.trials > 0 {
            self.journal.push(Move::Leave {
                node: id,
                class,
                pos: pos as u32,
                live_at,
            });
        }
    }

    /// Begins a trial: applies and releases until the matching
    /// [`Cluster::end_trial`] are journaled. Trials nest.
    pub fn begin_trial(&mut self) -> TrialMark {
        self.trials += 1;
        TrialMark(self.journal.len())
    }

    /// Ends a trial. With `undo`, the caller has given back everything it
    /// applied during the trial and taken again everything it released (so
    /// usage is as it was), and every node goes back to its old place in its
    /// class's member list, and every class to its old place in the live
    /// list: a trial leaves no trace on later tie-breaks. Without `undo`, the
    /// trial's changes stand (an outer trial may still undo them).
    pub fn end_trial(&mut self, mark: TrialMark, undo: bool) {
        debug_assert!(self.trials > 0 && mark.0 <= self.journal.len());
        if undo {
            while self.journal.len() > mark.0 {
                match self.journal.pop().expect("journal is longer than the mark") {
                    Move::Join { class, made_live } => {
                        let c = class.0 as usize;
                        self.members[c].pop();
                        if made_live {
                            let popped = self.live.pop();
                            debug_assert_eq!(popped, Some(class));
                            self.live_pos[c] = NOT_LIVE;
                            self.record_change(class);
                        }
                    }
                    Move::Leave {
                        node,
                        class,
                        pos,
                        live_at,
                    } => {
                        let c = class.0 as usize;
                        if let Some(lp) = live_at {
                            unswap(&mut self.live, lp as usize, class, |moved, at| {
                                self.live_pos[moved.0 as usize] = at;
                            });
                            self.live_pos[c] = lp;
                            self.record_change(class);
                        }
                        unswap(&mut self.members[c], pos as usize, node, |moved, at| {
                            self.pos_in_class[moved.0 as usize] = at;
                        });
                        self.pos_in_class[node.0 as usize] = pos;
                        self.class_of[node.0 as usize] = class;
                    }
                }
            }
        }
        self.trials -= 1;
        if self.trials == 0 {
            self.journal.clear();
        }
    }

    /// A hash of a class's state, the same however and whenever the class
    /// was first seen: seeds choices that are remembered per class.
    pub fn class_hash(&self, class: ClassId) -> u64 {
        self.key_hash[class.0 as usize]
    }

    /// Orders classes by their state (what they hold and of which static
    /// shape), the same however and whenever they were first seen.
    pub fn class_cmp(&self, a: ClassId, b: ClassId) -> std::cmp::Ordering {
        self.keys[a.0 as usize].cmp(&self.keys[b.0 as usize])
    }

    /// Free milli-GPU on a node for whole and fractional work.
    pub fn free_milli_total(&self, id: NodeId) -> u64 {
        self.free_total[id.0 as usize]
    }

    fn reclass(&mut self, id: NodeId) {
        let node = &self.nodes[id.0 as usize];
        self.free_total[id.0 as usize] = node
            .gpus
            .iter()
            .zip(&self.usage[id.0 as usize].gpus)
            .filter(|(g, _)| g.health == GpuHealth::Healthy && !g.mig_enabled())
            .map(|(_, u)| u.free_milli() as u64)
            .sum();
        let class = self.intern_class(id);
        if class != self.class_of[id.0 as usize] {
            self.leave(id);
            self.join(id, class);
        }
    }

    /// Takes an allocation's resources on its node.
    ///
    /// # Panics
    /// In debug builds, when the allocation does not fit: the placement pipeline
    /// only produces allocations that fit, and a caller restoring committed
    /// allocations must have checked them with [`Cluster::fits`].
    pub fn apply(&mut self, a: &Allocation) {
        debug_assert!(self.fits(a), "allocation does not fit: {a:?}");
        self.take(a);
    }

    /// Takes back an allocation given back during a trial, without checking
    /// that it fits: it held these resources a moment ago, though its GPU
    /// may have failed or its node been cordoned since it started.
    pub fn restore(&mut self, a: &Allocation) {
        self.take(a);
    }

    fn take(&mut self, a: &Allocation) {
        let node = &self.nodes[a.node.0 as usize];
        let u = &mut self.usage[a.node.0 as usize];
        u.cpu += a.cpu.0;
        u.mem += a.mem.0;
        u.kinds[shape_kind(&a.gpu)] += 1;
        match (a.pick, &a.gpu) {
            (GpuPick::Whole(mask), _) => {
                for i in 0..node.gpus.len() {
                    if mask & (1 << i) != 0 {
                        u.gpus[i].mode = GpuMode::Exclusive;
                    }
                }
            }
            (GpuPick::Shared(g), GpuRequest::Fraction { milli, mem }) => {
                let gu = &mut u.gpus[g as usize];
                gu.mode = GpuMode::Fractional;
                gu.milli += milli.0;
                gu.mem += mem.0;
                gu.tasks += 1;
            }
            (GpuPick::Shared(g), GpuRequest::TimeSlice { mem }) => {
                let gu = &mut u.gpus[g as usize];
                gu.mode = GpuMode::TimeSliced;
                gu.mem += mem.0;
                gu.tasks += 1;
            }
            (GpuPick::Mig { gpu, instance }, _) => {
                let gu = &mut u.gpus[gpu as usize];
                gu.mode = GpuMode::Mig;
                gu.mig_used |= 1 << instance;
            }
            _ => {}
        }
        self.reclass(a.node);
    }

    /// Gives an allocation's resources back.
    pub fn release(&mut self, a: &Allocation) {
        release_usage(&mut self.usage[a.node.0 as usize], a);
        self.reclass(a.node);
    }

    /// Whether an allocation fits the node's free resources under the sharing rules.
    /// Used to check committed allocations when they are loaded, and by tests.
    pub fn fits(&self, a: &Allocation) -> bool {
        let Some(node) = self.nodes.get(a.node.0 as usize) else {
            return false;
        };
        let u = &self.usage[a.node.0 as usize];
        if u.cpu + a.cpu.0 > node.cpu.0 || u.mem + a.mem.0 > node.mem.0 {
            return false;
        }
        let gpu_ok = |i: usize| {
            node.gpus
                .get(i)
                .is_some_and(|g| g.health == GpuHealth::Healthy)
        };
        match (a.pick, &a.gpu) {
            (GpuPick::None, GpuRequest::None) => true,
            (GpuPick::Whole(mask), GpuRequest::Whole { count }) => {
                mask.count_ones() == *count as u32
                    && (0..64).filter(|i| mask & (1u64 << i) != 0).all(|i| {
                        gpu_ok(i) && !node.gpus[i].mig_enabled() && u.gpus[i].mode == GpuMode::Idle
                    })
            }
            (GpuPick::Shared(g), GpuRequest::Fraction { milli, mem }) => {
                let g = g as usize;
                gpu_ok(g)
                    && !node.gpus[g].mig_enabled()
                    && matches!(u.gpus[g].mode, GpuMode::Idle | GpuMode::Fractional)
                    && u.gpus[g].milli + milli.0 <= GpuMilli::WHOLE.0
                    && u.gpus[g].mem + mem.0 <= node.gpus[g].mem.0
            }
            (GpuPick::Shared(g), GpuRequest::TimeSlice { mem }) => {
                let g = g as usize;
                gpu_ok(g)
                    && !node.gpus[g].mig_enabled()
                    && matches!(u.gpus[g].mode, GpuMode::Idle | GpuMode::TimeSliced)
                    && u.gpus[g].tasks < node.gpus[g].time_slices
                    && u.gpus[g].mem + mem.0 <= node.gpus[g].mem.0
            }
            (GpuPick::Mig { gpu, instance }, GpuRequest::Mig { profile }) => {
                let g = gpu as usize;
                gpu_ok(g)
                    && node.gpus[g]
                        .mig
                        .get(instance as usize)
                        .is_some_and(|m| &m.profile == profile)
                    && u.gpus[g].mig_used & (1 << instance) == 0
            }
            _ => false,
        }
    }
}

/// A node's usage once allocation `a` (on that node) is given back.
pub(crate) fn release_usage(u: &mut NodeUsage, a: &Allocation) {
    u.cpu = u.cpu.saturating_sub(a.cpu.0);
    u.mem = u.mem.saturating_sub(a.mem.0);
    let k = &mut u.kinds[shape_kind(&a.gpu)];
    *k = k.saturating_sub(1);
    match (a.pick, &a.gpu) {
        (GpuPick::Whole(mask), _) => {
            for (i, gu) in u.gpus.iter_mut().enumerate() {
                if mask & (1 << i) != 0 {
                    *gu = GpuUsage::default();
                }
            }
        }
        (GpuPick::Shared(g), GpuRequest::Fraction { milli, mem }) => {
            let gu = &mut u.gpus[g as usize];
            gu.milli = gu.milli.saturating_sub(milli.0);
            gu.mem = gu.mem.saturating_sub(mem.0);
            gu.tasks = gu.tasks.saturating_sub(1);
            if gu.tasks == 0 {
                *gu = GpuUsage::default();
            }
        }
        (GpuPick::Shared(g), GpuRequest::TimeSlice { mem }) => {
            let gu = &mut u.gpus[g as usize];
            gu.mem = gu.mem.saturating_sub(mem.0);
            gu.tasks = gu.tasks.saturating_sub(1);
            if gu.tasks == 0 {
                *gu = GpuUsage::default();
            }
        }
        (GpuPick::Mig { gpu, instance }, _) => {
            let gu = &mut u.gpus[gpu as usize];
            gu.mig_used &= !(1 << instance);
            if gu.mig_used == 0 {
                *gu = GpuUsage::default();
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Gpu;

    fn node(id: u32, name: &str, gpus: usize) -> Node {
        Node::new(
            id,
            name,
            CpuMilli(1000),
            MemMib(1024),
            vec![Gpu::plain("T4", MemMib(16_384)); gpus],
        )
    }

    #[test]
    fn invalid_clusters_are_refused_with_what_to_fix() {
        let e = Cluster::new(vec![node(0, "a", 1), node(0, "b", 1)]).unwrap_err();
        assert_eq!(
            e,
            CoreError::NodeIdOrder {
                name: "b".into(),
                id: 0,
                expected: 1
            }
        );
        let e = Cluster::new(vec![node(0, "a", 1), node(1, "a", 1)]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "node name a appears twice: node names must be unique"
        );
        let e = Cluster::new(vec![node(0, "a", 65)]).unwrap_err();
        assert!(e.to_string().contains("at most 64 GPUs"));
    }

    #[test]
    fn identical_nodes_share_a_class_until_their_usage_differs() {
        let mut c = Cluster::new(vec![node(0, "a", 2), node(1, "b", 2), node(2, "c", 1)]).unwrap();
        assert_eq!(c.class_of(NodeId(0)), c.class_of(NodeId(1)));
        assert_ne!(c.class_of(NodeId(0)), c.class_of(NodeId(2)));
        assert_eq!(c.live_classes().len(), 2);
        let a = Allocation {
            task: TaskId {
                job: crate::ids::JobId(1),
                group: 0,
                index: 0,
            },
            node: NodeId(1),
            cpu: CpuMilli(500),
            mem: MemMib(0),
            gpu: GpuRequest::Whole { count: 1 },
            pick: GpuPick::Whole(0b01),
        };
        let idle = c.class_of(NodeId(0));
        c.apply(&a);
        assert_ne!(c.class_of(NodeId(1)), idle);
        assert_eq!(c.live_classes().len(), 3);
        assert!(!c.fits(&a), "the GPU is taken");
        c.release(&a);
        assert_eq!(
            c.class_of(NodeId(1)),
            idle,
            "released: back in the idle class"
        );
        assert_eq!(c.class_members(idle).len(), 2);
        assert_eq!(c.live_classes().len(), 2);
    }

    fn whole(job: u64, node: u32, mask: u64) -> Allocation {
        Allocation {
            task: TaskId {
                job: crate::ids::JobId(job),
                group: 0,
                index: 0,
            },
            node: NodeId(node),
            cpu: CpuMilli(100),
            mem: MemMib(0),
            gpu: GpuRequest::Whole {
                count: mask.count_ones() as u8,
            },
            pick: GpuPick::Whole(mask),
        }
    }

    /// Member and live-list order after a trial, and the same without the
    /// undo: a plain release moves nodes to the end of their class.
    #[test]
    fn an_undone_trial_restores_member_and_live_order() {
        let nodes: Vec<Node> = (0..6).map(|i| node(i, &format!("n{i}"), 2)).collect();
        let mut c = Cluster::new(nodes).unwrap();
        // Some history first, so that the lists are not in id order.
        let running = [whole(1, 4, 0b01), whole(2, 1, 0b11)];
        for a in &running {
            c.apply(a);
        }
        let order = |c: &Cluster| -> (Vec<Vec<NodeId>>, Vec<ClassId>) {
            let classes = c.live_classes().to_vec();
            let members = classes
                .iter()
                .map(|&k| c.class_members(k).to_vec())
                .collect();
            (members, classes)
        };
        let before = order(&c);
        let trial = |c: &mut Cluster| {
            // Release a running job, place two, take them back, restore it.
            c.release(&running[1]);
            let tried = [whole(3, 0, 0b01), whole(4, 1, 0b10), whole(5, 2, 0b11)];
            for a in &tried {
                c.apply(a);
            }
            for a in tried.iter().rev() {
                c.release(a);
            }
            c.restore(&running[1]);
        };
        let mark = c.begin_trial();
        trial(&mut c);
        c.end_trial(mark, true);
        assert_eq!(order(&c), before, "an undone trial left a trace");
        let mark = c.begin_trial();
        trial(&mut c);
        c.end_trial(mark, false);
        assert_ne!(order(&c), before, "without the undo the order moves");
        for n in 0..6 {
            let k = c.class_of(NodeId(n));
            assert!(c.class_members(k).contains(&NodeId(n)));
        }
    }
}
