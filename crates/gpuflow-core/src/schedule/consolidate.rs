//! Consolidation: a job no node takes, though the GPUs free in its flavor
//! would hold it, starts once running jobs that fit elsewhere at once
//! move (cheapest nodes first, fewest found by doubling and halving).

use super::*;

/// Consolidations a cycle tries at most (each a few fit tests), so that a
/// cycle with many jobs no node takes stays bounded.
pub(super) const MAX_CONSOLIDATION_TRIES: usize = 16;

/// What consolidation may move on one flavor ([`Cycle::movable`]).
pub(super) struct Movable {
    /// The nodes with a GPU of the flavor.
    in_flavor: Vec<u32>,
    /// Nodes whose running jobs may all move: (GPU-seconds they would
    /// lose, milli-GPUs they hold, node), cheapest first.
    nodes: Vec<(f64, u64, u32)>,
    /// The jobs on each of those nodes.
    movers: rustc_hash::FxHashMap<u32, Vec<usize>>,
}

impl<'a> Cycle<'a> {
    /// Consolidation for job `i` on `flavor`: running preemptible jobs
    /// alone on nodes with free GPUs, holding little unsaved work, whose
    /// nodes would then take job `i`, and which all fit elsewhere at once.
    /// Tried on the live state and undone; `None` when no such set exists.
    pub(super) fn consolidate(&mut self, i: usize, flavor: &str) -> Option<Vec<Preemption>> {
        let limit = self.snap.cfg.consolidate_max_unsaved?;
        let key = self.place_key(i, flavor);
        if self.consolidation.no_consolidation.contains(&key) {
            return None;
        }
        self.consolidation.consolidation_tries += 1;
        let fi = self.fidx(flavor);
        let movable = self.movable(fi, flavor, limit);
        let movers = &movable.movers;
        let cluster = self.snap.placer.cluster();
        let free: u64 = movable
            .in_flavor
            .iter()
            .map(|&n| cluster.free_milli_total(cluster.nodes()[n as usize].id))
            .sum();
        if free < self.pend.pend_milli[i] {
            self.consolidation.no_consolidation.insert(key);
            return None;
        }
        // Only smaller jobs that do not outrank it move, so that no moved
        // job moves or preempts it back; nor a job that reclaimed GPUs from
        // it (reclaims ignore rank); nor, when the job would run beyond its
        // queue's guarantee where a reclaim may take it, a job of another
        // queue within its own guarantee, which would reclaim it at once.
        let w = &self.snap.pending[i];
        let (size, rank) = (self.pend.pend_milli[i], (self.rank(w), w.priority));
        let reclaimers = self.history.reclaimed_by.get(&w.job.id);
        let queues = &*self.snap.queues;
        let within = |q: QueueId| {
            let leaving = self.usage.leaving.get(&(q, fi)).copied().unwrap_or(0);
            queues.usage_at(q, fi as usize).saturating_sub(leaving)
                <= queues.quota_at(q, fi as usize).guaranteed
        };
        let reclaimable = fi != NO_FLAVOR
            && self.snap.cfg.classes[w.class].preemptible
            && queues.usage_at(w.queue, fi as usize)
                >= queues.quota_at(w.queue, fi as usize).guaranteed;
        let nodes: Vec<(f64, u64, u32)> = movable
            .nodes
            .iter()
            .filter(|&&(_, _, n)| {
                cluster.free_milli_total(cluster.nodes()[n as usize].id) > 0
                    && movers[&n].iter().all(|&k| {
                        let r = &self.victims.run[k];
                        !r.victim
                            && r.milli < size
                            && (r.rank, r.priority) <= rank
                            && !reclaimers.is_some_and(|v| v.contains(&r.id))
                            && !(reclaimable && r.queue != w.queue && within(r.queue))
                    })
            })
            .take(32)
            .copied()
            .collect();
        let job = self.job_on(i, flavor);
        let trial = self.snap.placer.begin_trial();
        // The fewest nodes (cheapest first) whose emptying lets it fit.
        let mut emptied = 0;
        let mut released: Vec<usize> = Vec::new();
        let empty =
            |placer: &mut Placer, released: &mut Vec<usize>, emptied: &mut usize, n: usize| {
                while *emptied < n {
                    for &k in &movers[&nodes[*emptied].2] {
                        placer.release(&self.snap.running[k].allocations);
                        released.push(k);
                    }
                    *emptied += 1;
                }
                while *emptied > n {
                    *emptied -= 1;
                    for _ in &movers[&nodes[*emptied].2] {
                        let k = released.pop().expect("released");
                        placer.restore(&self.snap.running[k].allocations);
                    }
                }
            };
        let found = fewest(nodes.len(), |n| {
            empty(self.snap.placer, &mut released, &mut emptied, n);
            self.snap.placer.trial_place(&job)
        });
        if let Some((n, _)) = found {
            empty(self.snap.placer, &mut released, &mut emptied, n);
        }
        let Some((_, p)) = found else {
            empty(self.snap.placer, &mut released, &mut emptied, 0);
            self.snap.placer.end_trial(trial);
            self.consolidation.no_consolidation.insert(key);
            return None;
        };
        // Only the jobs on the nodes it takes move.
        let taken: BTreeSet<u32> = p.iter().map(|a| a.node.0).collect();
        let (mut victims, back): (Vec<usize>, Vec<usize>) = released
            .into_iter()
            .partition(|&k| taken.contains(&self.snap.running[k].allocations[0].node.0));
        for &k in back.iter().rev() {
            self.snap.placer.restore(&self.snap.running[k].allocations);
        }
        let applied = self.snap.placer.apply(&p).is_ok();
        victims.sort_by_key(|&k| std::cmp::Reverse(self.victims.run[k].milli));
        let mut placed = Vec::new();
        let mut all = applied;
        for &k in victims.iter().take_while(|_| applied) {
            let mut vjob = on_flavor(&self.snap.running[k].work.job, flavor);
            vjob.constraints.avoid_reservations = u64::MAX;
            match self.snap.placer.try_place_job(&vjob) {
                Some(q) => placed.push(q),
                None => {
                    all = false;
                    break;
                }
            }
        }
        for q in placed.iter().rev() {
            self.snap.placer.release(q);
        }
        if applied {
            self.snap.placer.release(&p);
        }
        for &k in victims.iter().rev() {
            self.snap.placer.restore(&self.snap.running[k].allocations);
        }
        self.snap.placer.end_trial(trial);
        if !all || victims.is_empty() {
            self.consolidation.no_consolidation.insert(key);
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
    pub(super) fn movable(&mut self, fi: u32, flavor: &str, limit: u64) -> Rc<Movable> {
        if let Some(m) = self.consolidation.movable.get(&fi) {
            return m.clone();
        }
        let cluster = self.snap.placer.cluster();
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
        for k in 0..self.snap.running.len() {
            let node = self.locate(k);
            let r = &self.snap.running[k];
            // Preemptible now (its class, its minimum runtime) and little to lose.
            let may_move = self.victims.run[k].flavor == fi
                && self.victims.run[k].preemptible
                && r.unsaved(self.snap.now) <= limit;
            match (node != u32::MAX).then_some(node) {
                Some(n) if may_move => {
                    on.push((n, k));
                    let c = &mut cost[n as usize];
                    c.0 += self.victims.run[k].lost;
                    c.1 += self.victims.run[k].milli;
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
        self.consolidation.movable.insert(fi, m.clone());
        m
    }
}
