//! Phase 3: every job still pending gets its reasons, its position in
//! its queue and an estimated start ([`NodeSlots`]: the known ends of
//! running work per node, for gangs no node can take yet).

use super::profile::Profile;
use super::*;
use crate::NodeId;

/// When nodes have room for tasks of whole GPUs, from the known ends of
/// the work on them, on the nodes a job may use (what they are, not what
/// they hold: a lower bound on when a job that no node can take yet may
/// start).
pub(super) struct NodeSlots {
    /// The cycle's time: when idle GPUs have room.
    now: u64,
    /// Idle whole GPUs, free milli-CPUs and free MiB per node (none on
    /// nodes that take no new work).
    idle: Vec<Room>,
    /// (node, end, what it gives back), by node then end.
    frees: Vec<(u32, u64, Room)>,
    /// Each node's static shape, and a node of each shape (by shape id).
    shape: Vec<u32>,
    shape_node: Vec<Option<NodeId>>,
    /// Per task size (whole GPUs, milli-CPUs, MiB) and request (by
    /// placement's id; `None`: one every node's shape admits): the moments
    /// each further task of that size finds room on some node it may use,
    /// soonest first.
    by_size: BTreeMap<(Room, Option<u32>), Vec<u64>>,
    /// The shapes each request may use (`None`: all).
    usable: rustc_hash::FxHashMap<u32, Option<Vec<bool>>>,
}

/// Whole GPUs, milli-CPUs and MiB of memory: what a node has free, gives
/// back, or a task needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Room {
    gpus: u32,
    cpu: u64,
    mem: u64,
}

impl Room {
    fn add(&mut self, o: Room) {
        self.gpus += o.gpus;
        self.cpu += o.cpu;
        self.mem += o.mem;
    }

    /// How many tasks of `size` fit in it (a size of 0 in a resource does
    /// not bound).
    fn holds(&self, size: Room) -> u64 {
        let fit = |have: u64, need: u64| have.checked_div(need).unwrap_or(u64::MAX);
        fit(u64::from(self.gpus), u64::from(size.gpus))
            .min(fit(self.cpu, size.cpu))
            .min(fit(self.mem, size.mem))
    }
}

impl NodeSlots {
    /// The moments a task of `size` of request `rid` (`None`: one any node
    /// admits) finds room on nodes it may use, one per task, soonest
    /// first: a node with `k` tasks' room at time t adds t to the list `k`
    /// times in all.
    fn moments(&mut self, size: Room, rid: Option<u32>) -> &[u64] {
        let (now, idle, frees, shape) = (self.now, &self.idle, &self.frees, &self.shape);
        let usable = rid
            .and_then(|r| self.usable.get(&r))
            .and_then(Option::as_ref);
        self.by_size.entry((size, rid)).or_insert_with(|| {
            let may = |n: usize| usable.is_none_or(|u| u[shape[n] as usize]);
            let mut out = Vec::new();
            // `frees` is by node, and every node is visited in order.
            let mut k = 0;
            for (n, &idle_now) in idle.iter().enumerate() {
                let mut have = idle_now;
                let mut room = have.holds(size);
                let mine = may(n);
                if mine {
                    out.extend(std::iter::repeat_n(now, room as usize));
                }
                while k < frees.len() && frees[k].0 as usize == n {
                    let (_, end, back) = frees[k];
                    k += 1;
                    have.add(back);
                    let more = have.holds(size);
                    if mine {
                        out.extend(std::iter::repeat_n(end, (more - room) as usize));
                    }
                    room = more;
                }
            }
            out.sort_unstable();
            out
        })
    }

    /// When `job`'s whole-GPU tasks all find room, from `at` on, on nodes
    /// they may use (`placer` answers which); `None` when they never do
    /// with what is known.
    fn earliest(&mut self, job: &Job, at: u64, placer: &mut Placer) -> Option<u64> {
        let mut t = at;
        for g in &job.groups {
            let GpuRequest::Whole { count } = g.request.gpu else {
                continue;
            };
            if count == 0 {
                continue;
            }
            let rid = placer.request_id(&g.request, &job.constraints);
            let shape_node = &self.shape_node;
            let restricted = self
                .usable
                .entry(rid)
                .or_insert_with(|| {
                    let u: Vec<bool> = shape_node
                        .iter()
                        .map(|n| {
                            n.is_some_and(|n| {
                                placer.admits_statically(n, rid, &g.request, &job.constraints)
                            })
                        })
                        .collect();
                    (!u.iter().all(|&x| x)).then_some(u)
                })
                .is_some();
            let size = Room {
                gpus: count as u32,
                cpu: g.request.cpu.0,
                mem: g.request.mem.0,
            };
            let when = self
                .moments(size, restricted.then_some(rid))
                .get(g.replicas.max(1) as usize - 1)?;
            t = t.max(*when);
        }
        Some(t)
    }
}

impl<'a> Cycle<'a> {
    pub(super) fn check_quotas(&self) -> bool {
        if !self.snap.cfg.quotas {
            return true;
        }
        // Every admitted job's queue path stays within caps and borrow limits.
        self.out.admitted.iter().all(|(id, flavor, _)| {
            let w = self
                .snap
                .pending
                .iter()
                .find(|w| w.job.id == *id)
                .expect("admitted from pending");
            flavor.is_empty()
                || self.snap.queues.path(w.queue).iter().all(|&q| {
                    self.snap.queues.usage(q, flavor)
                        <= self.snap.queues.get(q).quota(flavor).limit()
                })
        })
    }

    pub(super) fn explain(mut self) -> Plan {
        // Release the reservations' hold: the next cycle decides again.
        let claims = std::mem::take(&mut self.reserve.claims);
        self.snap.placer.release(&claims);
        for r in self.reserve.reservations.iter().chain(&self.reserve.holds) {
            for &n in &r.nodes {
                self.snap.placer.set_reserved(n, 0);
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
        // It preempts past disruption budgets once its patience ends.
        const PATIENT: u8 = 64;
        // It holds a reservation (or a reclaim hold) with a start.
        const RESERVED: u8 = 128;
        let mut flags = vec![0u8; self.snap.pending.len()];
        // Each job's expected runtime ([`Cycle::expected_run`]), read here
        // in job order: the ETA pass visits jobs in priority order, and
        // reaching into each job there missed the cache at every one.
        let mut run_of: Vec<Option<u64>> = vec![None; self.snap.pending.len()];
        // Jobs that take victims past disruption budgets once they have
        // waited their patience: (job, when the victims are killed then).
        let mut patient: rustc_hash::FxHashMap<usize, u64> = Default::default();
        let mut graces = None;
        for (i, (f, r)) in flags.iter_mut().zip(&self.out.reasons).enumerate() {
            run_of[i] = Self::expected_run(&self.snap.pending[i]);
            if self.reserve.reserved.contains_key(&self.pend.pend_id[i]) {
                *f |= RESERVED;
            }
            let mut placed_nowhere = None;
            // The first patience and disruption budget among its reasons.
            let mut patience_at = None;
            let mut budget_of: Option<&str> = None;
            for x in r {
                match x {
                    PendingReason::BudgetPatience { at, .. } => {
                        patience_at.get_or_insert(*at);
                    }
                    PendingReason::DisruptionBudget { queue, .. }
                    | PendingReason::DisruptionCount { queue, .. } => {
                        budget_of.get_or_insert(queue);
                    }
                    _ => {}
                }
                *f |= match x {
                    PendingReason::UserGpuLimit { .. } | PendingReason::UserRunningLimit { .. } => {
                        BY_USER
                    }
                    // Within its guarantee, it takes back what borrowers
                    // free: it waits for the cluster's frees, not its
                    // queue's.
                    PendingReason::GuaranteeLent { .. } => 0,
                    // Kept off the nodes held for a lender's reclaim, it
                    // would borrow what the lender takes back: like a job
                    // over its quota, it waits for its own queue's work to
                    // end, not for the cluster's frees (openb's notebooks
                    // were told hours early).
                    PendingReason::Quota { .. }
                    | PendingReason::NotWithinGuarantee { .. }
                    | PendingReason::NoLease { .. }
                    | PendingReason::ReclaimHold { .. } => BY_QUOTA,
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
            if let Some(at) = patience_at {
                let graces = graces.get_or_insert_with(|| self.longest_graces());
                patient.insert(i, at + self.grace_of_blocked(graces, budget_of));
                *f |= PATIENT;
            }
        }
        for &i in &self.out.admitted_idx {
            flags[i] |= ADMITTED;
        }
        // ETA: running jobs' expected ends against the demand ahead in order.
        let mut ends: Vec<(u64, u64)> = self
            .snap
            .running
            .iter()
            .zip(&self.victims.run)
            .filter_map(|(r, info)| {
                Some((
                    Self::expected_end(r, self.snap.now)?.max(self.snap.now),
                    info.milli,
                ))
            })
            // Those admitted this cycle end too.
            .chain(self.out.admitted_idx.iter().filter_map(|&i| {
                let run = Self::expected_run(&self.snap.pending[i])?;
                Some((self.snap.now + run, self.pend.pend_milli[i]))
            }))
            .collect();
        ends.sort_unstable();
        // Some running (or just admitted) job has an expected runtime.
        let expecting = self
            .snap
            .running
            .iter()
            .map(|r| &r.work)
            .chain(self.out.admitted_idx.iter().map(|&i| &self.snap.pending[i]))
            .any(|w| w.expected_runtime.is_some());
        let running_milli: u64 = self.victims.run.iter().map(|r| r.milli).sum();
        let free_now: u64 = self
            .snap
            .queues
            .flavors()
            .map(|f| self.snap.queues.capacity(f))
            .sum::<u64>()
            .saturating_sub(running_milli + self.admitted_milli());
        // The order of phase 1 (the same key for every ordering but FIFO).
        let order = std::mem::take(&mut self.order.global);
        let order_milli = std::mem::take(&mut self.order.global_milli);
        // In order, each job starts at the first minute from which enough
        // GPUs stay free for its expected runtime (backfill: a short job
        // may start in a gap before the big ones ahead of it), and gives
        // them back when it is expected to end ([`super::profile`]).
        const NO_ETA: u64 = u64::MAX;
        let mut all = Profile::new(&ends, free_now, self.snap.now);
        let mut eta: Vec<u64> = vec![NO_ETA; self.snap.pending.len()];
        // Known ends of running and just-admitted jobs of a queue, by end:
        // (end, milli-GPU, user); built for the queues that need it.
        let mut by_queue: rustc_hash::FxHashMap<QueueId, Vec<(u64, u64, &str)>> =
            Default::default();
        // A schedule with backfill of each queue held back by its quota (user:
        // `Some` for a user's limit), over that queue's (or user's) frees.
        let mut own: rustc_hash::FxHashMap<(QueueId, Option<&str>), Profile> = Default::default();
        let mut node_slots: Option<NodeSlots> = None;
        for (&i, &milli) in order.iter().zip(&order_milli) {
            let flag = flags[i];
            // Admitted, or takes nothing from those behind it: it cannot start.
            if flag & (ADMITTED | NOWHERE) != 0 {
                continue;
            }
            // Held back by its queue's quota (or a user's limit), it takes
            // capacity only as its own queue frees it: not from those behind;
            // in a held queue, none.
            let mut takes = flag & (BY_QUOTA | BY_USER | HELD) == 0;
            // One that preempts once its patience ends takes what frees
            // before then, and nothing after: it starts on its victims.
            let patience_end = if flag & PATIENT != 0 {
                patient.get(&i).copied()
            } else {
                None
            };
            let run = run_of[i];
            if let Some(end) = patience_end
                && all.when(milli, run, false).is_none_or(|t| t > end)
            {
                takes = false;
            }
            // Turned away by where GPUs are free, it takes them from when
            // its nodes have room (below), not from when enough are free
            // somewhere: those behind it may use them until then. One that
            // holds a reservation keeps work that would not end before off
            // its nodes from now, and takes from now.
            let by_place = flag & BY_PLACE != 0;
            let takes_at_start = takes && by_place && flag & RESERVED == 0;
            let mut t = all.when(milli, run, takes && !takes_at_start);
            // Blocked by quota or a user limit: also wait for the queue (or the
            // user) to free as much as the job needs, from jobs with a known
            // end, after those of its queue (or user) held back before it.
            let by_user = flag & BY_USER != 0;
            let mut held = None;
            if flag & (BY_USER | BY_QUOTA) != 0 {
                let w = &self.snap.pending[i];
                let key = (w.queue, by_user.then_some(w.user.as_str()));
                let o = own.entry(key).or_insert_with(|| {
                    let ends = by_queue
                        .entry(w.queue)
                        .or_insert_with(|| self.known_ends(w.queue));
                    let mine: Vec<(u64, u64)> = ends
                        .iter()
                        .filter(|(_, _, user)| !by_user || *user == w.user.as_str())
                        .map(|&(end, m, _)| (end, m.max(1)))
                        .collect();
                    Profile::new(&mine, 0, self.snap.now)
                });
                let need = self.pend.pend_milli[i].max(1);
                let when = o.when(need, run, true);
                if when.is_some() {
                    held = Some((key, need));
                }
                t = match (t, when) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            // Turned away by where GPUs are free, not by how many: also
            // wait until enough nodes have room for its tasks.
            if by_place && let Some(at) = t {
                let slots = node_slots.get_or_insert_with(|| self.node_slots());
                t = slots.earliest(&self.snap.pending[i].job, at, self.snap.placer);
            }
            if flag & HELD != 0 {
                t = None;
            }
            // A job waiting for its victims starts when they are killed. A
            // reservation or hold starts at the latest when running jobs
            // reach their declared maxima; where they are expected to end
            // sooner, so is it. A hold whose reclaim budgets bind until the
            // job's patience ends takes back nothing before then.
            if flag & RESERVED != 0
                && let Some((&id, &start_at)) =
                    self.reserve.reserved.get_key_value(&self.pend.pend_id[i])
            {
                let start_at = match patience_end {
                    Some(end) if self.reserve.holds.iter().any(|r| r.job == id) => {
                        start_at.max(end)
                    }
                    _ => start_at,
                };
                let nominated = self.reserve.nominated.iter().any(|r| r.job == id);
                t = match t {
                    Some(e) if expecting && !nominated => Some(e.min(start_at)),
                    _ => Some(start_at),
                };
            }
            if let Some(end) = patience_end {
                t = Some(t.map_or(end, |t| t.min(end)));
            }
            eta[i] = t.unwrap_or(NO_ETA);
            // One turned away by where GPUs are free takes them from its start.
            if takes_at_start && let Some(start) = t {
                all.take_from(start, milli);
            }
            // What it took comes back when it is expected to end.
            if let Some(start) = t
                && let Some(run) = run
            {
                if takes {
                    all.later(start + run, milli);
                }
                if let Some((key, need)) = held
                    && let Some(o) = own.get_mut(&key)
                {
                    o.later(start + run, need);
                }
            }
        }
        // Positions in each queue, then the explanations in job order (the
        // backlog usually comes nearly in that order, which the stable sort
        // takes in about one pass).
        let mut position = vec![0u32; self.snap.pending.len()];
        for list in self.order.per_queue.values() {
            let mut p = 0;
            for &i in list {
                if flags[i] & ADMITTED == 0 {
                    p += 1;
                    position[i] = p;
                }
            }
        }
        let mut by_id: Vec<(JobId, u32)> = (0..self.snap.pending.len())
            .filter(|&i| flags[i] & ADMITTED == 0)
            .map(|i| (self.pend.pend_id[i], i as u32))
            .collect();
        by_id.sort_by_key(|&(id, _)| id);
        let mut pending = Vec::with_capacity(by_id.len());
        for (job, i) in by_id {
            let i = i as usize;
            let tried = std::mem::take(&mut self.out.reasons[i]);
            let mut r = if tried.is_empty() {
                Reasons::new()
            } else {
                Reasons::from_vec(tried)
            };
            if self.out.not_reached[i] != u32::MAX {
                r.push(PendingReason::NotReached {
                    ahead: self.out.not_reached[i] as usize,
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
            admitted: self.out.admitted,
            preempted: self.out.preempted,
            reservations: self.reserve.reservations,
            holds: self.reserve.holds,
            nominated: self.reserve.nominated,
            pending,
        }
    }

    /// Each ready node's idle whole GPUs, free CPU and memory now, and what
    /// its running and just-admitted jobs give back at their known ends,
    /// for [`NodeSlots::earliest`].
    pub(super) fn node_slots(&self) -> NodeSlots {
        let cluster = self.snap.placer.cluster();
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
        let idle: Vec<Room> = cluster
            .nodes()
            .iter()
            .zip(&usable)
            .map(|(n, &m)| {
                if n.state != crate::model::NodeState::Ready {
                    return Room::default();
                }
                let u = cluster.usage(n.id);
                Room {
                    gpus: u
                        .gpus
                        .iter()
                        .enumerate()
                        .filter(|(i, g)| m >> i & 1 == 1 && g.mode == crate::cluster::GpuMode::Idle)
                        .count() as u32,
                    cpu: n.cpu.0.saturating_sub(u.cpu),
                    mem: n.mem.0.saturating_sub(u.mem),
                }
            })
            .collect();
        let mut frees: Vec<(u32, u64, Room)> = Vec::new();
        let mut give_back = |end: u64, allocations: &[Allocation]| {
            for a in allocations {
                let mask = match a.pick {
                    crate::cluster::GpuPick::Whole(mask) => mask,
                    _ => 0,
                };
                let back = Room {
                    gpus: (mask & usable.get(a.node.0 as usize).copied().unwrap_or(0)).count_ones(),
                    cpu: a.cpu.0,
                    mem: a.mem.0,
                };
                if back != Room::default() {
                    frees.push((a.node.0, end.max(self.snap.now), back));
                }
            }
        };
        for r in self.snap.running {
            if let Some(end) = Self::expected_end(r, self.snap.now) {
                give_back(end, &r.allocations);
            }
        }
        for ((_, _, p), &i) in self.out.admitted.iter().zip(&self.out.admitted_idx) {
            if let Some(run) = Self::expected_run(&self.snap.pending[i]) {
                give_back(self.snap.now + run, p);
            }
        }
        frees.sort_unstable();
        let shape: Vec<u32> = cluster
            .nodes()
            .iter()
            .map(|n| self.snap.placer.shape_of(n.id))
            .collect();
        let mut shape_node = vec![None; shape.iter().map(|&s| s as usize + 1).max().unwrap_or(0)];
        for (n, &s) in cluster.nodes().iter().zip(&shape) {
            shape_node[s as usize].get_or_insert(n.id);
        }
        NodeSlots {
            now: self.snap.now,
            idle,
            frees,
            shape,
            shape_node,
            by_size: BTreeMap::new(),
            usable: Default::default(),
        }
    }

    /// The longest grace of each queue's running jobs.
    fn longest_graces(&self) -> rustc_hash::FxHashMap<QueueId, u64> {
        let mut m: rustc_hash::FxHashMap<QueueId, u64> = Default::default();
        for r in self.snap.running {
            let g = m.entry(r.work.queue).or_default();
            *g = (*g).max(r.work.grace);
        }
        m
    }

    /// How long the victims of a job that the disruption budget of queue
    /// `queue` holds back take to stop once it passes the budget: the
    /// longest grace of that queue's running jobs (`graces`).
    fn grace_of_blocked(
        &self,
        graces: &rustc_hash::FxHashMap<QueueId, u64>,
        queue: Option<&str>,
    ) -> u64 {
        queue
            .and_then(|q| self.snap.queues.by_name(q))
            .and_then(|q| graces.get(&q).copied())
            .unwrap_or(0)
    }

    /// A running job's known end: its kill time once told to stop, else its
    /// declared maximum runtime.
    pub(super) fn end_of(r: &Running) -> Option<u64> {
        r.stopping_at.or(r.work.max_runtime.map(|m| r.started + m))
    }

    /// How long a job just admitted is expected to run: its expected
    /// runtime within its declared maximum, or the maximum.
    fn expected_run(w: &Workload) -> Option<u64> {
        match (w.expected_runtime, w.max_runtime) {
            (Some(e), Some(m)) => Some(e.min(m)),
            (e, m) => e.or(m),
        }
    }

    /// When a running job is expected to end, for start estimates: its
    /// kill time once told to stop; else the end of its expected runtime
    /// while that is ahead, and once it has run past it as long again as
    /// it has run; never after its declared maximum ([`Cycle::end_of`],
    /// which reservations keep to). Without an expected runtime, the
    /// declared maximum.
    pub(super) fn expected_end(r: &Running, now: u64) -> Option<u64> {
        if r.stopping_at.is_some() {
            return r.stopping_at;
        }
        let declared = Self::end_of(r);
        let Some(expected) = r.work.expected_runtime else {
            return declared;
        };
        let mut end = r.started + expected;
        if end <= now {
            end = now + now.saturating_sub(r.started).max(60);
        }
        Some(declared.map_or(end, |d| d.min(end)))
    }

    /// Known ends of a queue's running and just-admitted jobs, soonest first:
    /// (end, milli-GPU, user).
    pub(super) fn known_ends(&self, q: QueueId) -> Vec<(u64, u64, &'a str)> {
        let running = self.snap.running;
        let pending = self.snap.pending;
        let mut v: Vec<(u64, u64, &'a str)> = self
            .victims
            .running_by_queue
            .get(&q)
            .into_iter()
            .flatten()
            .filter_map(|&k| {
                let r = &running[k];
                Some((
                    Self::expected_end(r, self.snap.now)?.max(self.snap.now),
                    self.victims.run[k].milli,
                    r.work.user.as_str(),
                ))
            })
            .chain(
                self.out
                    .admitted_idx
                    .iter()
                    .filter(|&&i| pending[i].queue == q)
                    .filter_map(|&i| {
                        let w = &pending[i];
                        Some((
                            self.snap.now + Self::expected_run(w)?,
                            self.pend.pend_milli[i],
                            w.user.as_str(),
                        ))
                    }),
            )
            .collect();
        v.sort_unstable();
        v
    }

    pub(super) fn admitted_milli(&self) -> u64 {
        self.out
            .admitted
            .iter()
            .map(|(_, _, p)| p.iter().map(|a| a.gpu.quota_milli()).sum::<u64>())
            .sum()
    }
}
