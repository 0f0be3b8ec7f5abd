//! Backfill reservations: the first jobs blocked by capacity get the
//! earliest start the known ends of running work allow; others keep off
//! the reserved nodes unless they end before it.

use super::*;

impl<'a> Cycle<'a> {
    /// The reservation slots job `i` must keep off, a bit each: none when
    /// it holds a reservation or ends before the first one starts; else
    /// every reserved node, or with [`Config::backfill_per_node`] the slots
    /// whose reservation starts before the job would end. And the nodes of
    /// reclaim holds ([`HOLD_SLOT`]) when it would borrow a flavor held
    /// and not end before the first hold starts.
    pub(super) fn avoids_reserved(&self, i: usize) -> u64 {
        let w = &self.snap.pending[i];
        if self.reserve.reserved.contains_key(&w.job.id) {
            return 0;
        }
        let end = w
            .max_runtime
            .map_or(u64::MAX, |m| self.snap.now.saturating_add(m));
        let hold = 1u64 << HOLD_SLOT;
        let mut mask = if end <= self.reserve.reserved_from {
            0
        } else if self.snap.cfg.backfill_per_node {
            self.reserve
                .reservations
                .iter()
                .enumerate()
                .filter(|(_, r)| r.start_at < end)
                .fold(0, |mask, (k, _)| mask | 1u64 << Self::slot(k))
        } else {
            !hold
        };
        if end > self.reserve.held_from
            && self.reserve.held_flavors.iter().any(|&f| {
                self.snap.queues.usage_at(w.queue, f as usize) + self.pend.pend_milli[i]
                    > self.snap.queues.quota_at(w.queue, f as usize).guaranteed
            })
        {
            mask |= hold;
        }
        mask
    }

    /// The most GPU capacity free on one node with GPUs of `flavor`, as at
    /// the first call this cycle. Capacity only shrinks during a cycle (trial
    /// releases are undone), so the figure stays an upper bound.
    pub(super) fn max_free(&mut self, flavor: &str) -> u64 {
        if let Some(&m) = self.reserve.max_free.get(flavor) {
            return m;
        }
        let cluster = self.snap.placer.cluster();
        let m = cluster
            .nodes()
            .iter()
            .filter(|n| n.gpus.iter().any(|g| g.model == flavor))
            .map(|n| cluster.free_milli_total(n.id))
            .max()
            .unwrap_or(0);
        self.reserve.max_free.insert(flavor.to_string(), m);
        m
    }

    /// Finds when and where job `i` could start as running jobs end (by their
    /// declared max runtime), and holds those nodes for it. A job within its
    /// queue's guarantee counts, too, the borrowers' jobs it could reclaim
    /// as gone once it could ([`Cycle::reclaim_order`]): so that new
    /// borrowers keep off the nodes it will take back, and a stream of
    /// them cannot keep its victims younger than their minimum runtime.
    pub(super) fn reserve(&mut self, i: usize, flavor: &str, reclaims: bool) {
        let ending = match reclaims {
            true => self
                .reclaim_order(self.fidx(flavor), flavor)
                .unwrap_or_else(|| self.ending_order()),
            false => self.ending_order(),
        };
        let ending = self.without_new_victims(ending);
        // It would start later, when another reservation may hold the
        // nodes: it keeps off all of them.
        let mut job = self.job_on(i, flavor);
        job.constraints.avoid_reservations = u64::MAX;
        // Running jobs are released and taken back below: a trial. The
        // earliest start is after the fewest ending jobs that let it fit.
        // Releasing more never takes room away, so that count is found by
        // doubling it and then halving the interval: O(log n) fit tests.
        let trial = self.snap.placer.begin_trial();
        let mut released = 0;
        let fit = fewest(ending.len(), |n| {
            self.release_first(&ending, &mut released, n);
            self.fits_now_as(&job)
        });
        self.release_first(&ending, &mut released, 0);
        self.snap.placer.end_trial(trial);
        let found = fit.map(|(n, p)| (ending[n - 1].0, p));
        if let Some((start_at, p)) = found {
            let mut nodes: Vec<_> = p.iter().map(|a| a.node).collect();
            nodes.sort();
            nodes.dedup();
            if reclaims {
                // A hold, only when the job can take back the borrowed GPUs
                // no later than a new borrower there could be taken back
                // (its minimum runtime): later, a new borrower is taken back
                // in time, so the nodes stay open to borrowers, and the job
                // gets a backfill reservation as any other would.
                if start_at > self.snap.now.saturating_add(self.snap.cfg.min_runtime) {
                    if self.reserve.reservations.len() < self.snap.cfg.max_reservations.max(1) {
                        self.reserve(i, flavor, false);
                    }
                    return;
                }
                // Only new borrowing keeps off these nodes.
                for &n in &nodes {
                    self.snap.placer.set_reserved(n, HOLD_SLOT);
                }
                self.victims.epoch += 1;
                let fi = self.fidx(flavor);
                if !self.reserve.held_flavors.contains(&fi) {
                    self.reserve.held_flavors.push(fi);
                }
                self.reserve.held_from = self.reserve.held_from.min(start_at);
                let job = self.snap.pending[i].job.id;
                self.reserve.reserved.insert(job, start_at);
                self.history.holding.insert(job, flavor.to_string());
                self.reserve.holds.push(Reservation {
                    job,
                    start_at,
                    nodes,
                });
                return;
            }
            let slot = if self.snap.cfg.backfill_per_node {
                Self::slot(self.reserve.reservations.len())
            } else {
                1
            };
            for &n in &nodes {
                self.snap.placer.set_reserved(n, slot);
            }
            // Fits seen before may have used these nodes.
            self.victims.epoch += 1;
            self.reserve.reserved_from = self.reserve.reserved_from.min(start_at);
            self.reserve
                .reserved
                .insert(self.snap.pending[i].job.id, start_at);
            self.reserve.reservations.push(Reservation {
                job: self.snap.pending[i].job.id,
                start_at,
                nodes,
            });
        }
    }

    /// [`Cycle::reserve`]'s running jobs by end time, built once a cycle.
    /// `ending` without the victims chosen this cycle: they end when they
    /// are told to stop. Kept while no more are chosen (reservations
    /// asked for it with the same list, tens of thousands of jobs long).
    fn without_new_victims(&mut self, ending: Ending) -> Ending {
        let marked = self.victims.marked;
        let kept = &mut self.reserve.unmarked;
        if let Some((_, _, e)) = kept
            .iter()
            .find(|(from, m, _)| *m == marked && Rc::ptr_eq(from, &ending))
        {
            return e.clone();
        }
        let e: Ending = Rc::new(
            ending
                .iter()
                .copied()
                .filter(|&(_, k)| {
                    !self.victims.run[k].victim || self.snap.running[k].stopping_at.is_some()
                })
                .collect(),
        );
        kept.retain(|(from, _, _)| !Rc::ptr_eq(from, &ending));
        kept.push((ending, marked, e.clone()));
        e
    }

    pub(super) fn ending_order(&mut self) -> Rc<Vec<(u64, usize)>> {
        if let Some(e) = &self.reserve.ending {
            return e.clone();
        }
        let mut ending: Vec<(u64, usize)> = self
            .snap
            .running
            .iter()
            .enumerate()
            .filter_map(|(k, r)| Some((Self::end_of(r)?.max(self.snap.now), k)))
            .collect();
        ending.sort_unstable();
        let ending = Rc::new(ending);
        self.reserve.ending = Some(ending.clone());
        ending
    }

    /// Claims for preemptor `i` the free whole GPUs it counted on beside
    /// its victims (`victims`, indices into the running jobs), until the
    /// end of the cycle: so that no one else takes them while the victims
    /// stop (what the victims hold no one else can take, and the preemptor
    /// goes first once they have stopped). Found again every cycle it
    /// waits: the victims released and the job placed in a trial. It
    /// starts at `start_at`, as far as anyone can tell.
    pub(super) fn nominate(&mut self, i: usize, victims: &[usize], start_at: u64) {
        let Some(&first) = victims.first() else {
            return;
        };
        let flavor = self.snap.running[first].flavor.clone();
        let job = self.job_on(i, &flavor);
        let trial = self.snap.placer.begin_trial();
        for &k in victims {
            self.snap.placer.release(&self.snap.running[k].allocations);
        }
        let p = self.fits_now_as(&job);
        for &k in victims.iter().rev() {
            self.snap.placer.restore(&self.snap.running[k].allocations);
        }
        self.snap.placer.end_trial(trial);
        let Some(p) = p else {
            return;
        };
        self.claim_free(&p);
        let mut nodes: Vec<_> = p.iter().map(|a| a.node).collect();
        nodes.sort();
        nodes.dedup();
        let job = self.snap.pending[i].job.id;
        self.reserve.reserved.insert(job, start_at);
        self.reserve.nominated.push(Reservation {
            job,
            start_at,
            nodes,
        });
    }

    /// The jobs that held nodes last cycle hold them again before anyone
    /// is admitted ([`Cycle::reserve`]), while they are still within
    /// their guarantee and have borrowers to take back: so that borrowers
    /// whose queues come first in the order do not take what frees up
    /// meanwhile.
    pub(super) fn hold_again(&mut self) {
        let holding = std::mem::take(&mut self.history.holding);
        if holding.is_empty() {
            return;
        }
        for i in 0..self.snap.pending.len() {
            let Some(flavor) = holding.get(&self.pend.pend_id[i]) else {
                continue;
            };
            if self.reserve.holds.len() >= self.snap.cfg.max_reservations.max(1) {
                break;
            }
            let Some(flavor) = self
                .snap
                .queues
                .flavor_index(flavor)
                .map(|f| self.flavors.flavor_names[f].clone())
            else {
                continue;
            };
            if !self.reserve.reserved.contains_key(&self.pend.pend_id[i])
                && self.reclaims(i, &flavor)
            {
                self.reserve(i, &flavor, true);
            }
        }
    }

    /// Claims, until the end of the cycle, the whole GPUs of placement `p`
    /// that are free now, so that no one else takes them this cycle.
    pub(super) fn claim_free(&mut self, p: &Placement) {
        for a in p {
            let GpuPick::Whole(mask) = a.pick else {
                continue;
            };
            let usage = self.snap.placer.cluster().usage(a.node);
            let free = (0..usage.gpus.len())
                .filter(|&g| mask & (1 << g) != 0 && usage.gpus[g].mode == GpuMode::Idle)
                .fold(0u64, |m, g| m | 1 << g);
            if free == 0 {
                continue;
            }
            let claim = Allocation {
                task: a.task,
                node: a.node,
                cpu: Default::default(),
                mem: Default::default(),
                gpu: GpuRequest::Whole {
                    count: free.count_ones() as u8,
                },
                pick: GpuPick::Whole(free),
            };
            if self.snap.placer.apply(std::slice::from_ref(&claim)).is_ok() {
                self.reserve.claims.push(claim);
            }
        }
        self.victims.epoch += 1;
    }

    /// The running jobs' indices by id, built once a cycle when first asked.
    pub(super) fn running_index(&mut self) -> Rc<rustc_hash::FxHashMap<JobId, usize>> {
        self.reserve
            .running_index
            .get_or_insert_with(|| {
                Rc::new(
                    self.snap
                        .running
                        .iter()
                        .enumerate()
                        .map(|(k, r)| (r.work.job.id, k))
                        .collect(),
                )
            })
            .clone()
    }

    /// The preemptors still waiting for their victims, from earlier
    /// cycles, hold the nodes they will take ([`Cycle::nominate`]).
    pub(super) fn nominate_waiting(&mut self) {
        if self.history.waiting_for.is_empty() {
            return;
        }
        let by_id = self.running_index();
        let waiting: Vec<(usize, Vec<usize>)> = (0..self.snap.pending.len())
            .filter_map(|i| {
                let victims = self.history.waiting_for.get(&self.pend.pend_id[i])?;
                Some((
                    i,
                    victims
                        .iter()
                        .filter_map(|v| by_id.get(v).copied())
                        .collect(),
                ))
            })
            .collect();
        for (i, victims) in waiting {
            let start_at = victims
                .iter()
                .filter_map(|&k| self.snap.running[k].stopping_at)
                .max()
                .unwrap_or(self.snap.now)
                .max(self.snap.now);
            self.nominate(i, &victims, start_at);
        }
    }

    /// Whether job `i`'s reservation on `flavor` is a reclaim hold: holds
    /// and preemption are on, it is within its queue's guarantee there, and some
    /// borrower's job could be taken back before it ends.
    pub(super) fn reclaims(&mut self, i: usize, flavor: &str) -> bool {
        self.snap.cfg.reclaim_holds
            && self.snap.cfg.preemption
            && self.fidx(flavor) != NO_FLAVOR
            && self.within_guarantee(i, flavor)
            && self.reclaim_order(self.fidx(flavor), flavor).is_some()
    }

    /// [`Cycle::ending_order`] for a job within its guarantee of flavor
    /// `fi`: each running job of another queue that borrows the flavor and
    /// that a reclaim could take is told at the earlier of its end and the
    /// time a reclaim could take it (preemptible classes after their
    /// minimum runtime, leases after [`Config::lease_horizon`]). Built
    /// once a cycle per flavor, by merging the end order with the
    /// borrowers' jobs in reclaim order; `None` when no borrower's job
    /// could be taken before its end.
    pub(super) fn reclaim_order(&mut self, fi: u32, flavor: &str) -> Option<Rc<Vec<(u64, usize)>>> {
        if let Some(e) = self.reserve.reclaiming.get(&fi) {
            return e.clone();
        }
        let ending = self.ending_order();
        let now = self.snap.now;
        let mut early: Vec<(u64, usize)> = Vec::new();
        let borrowers = self
            .victims
            .borrowers
            .get(flavor)
            .cloned()
            .unwrap_or_default();
        for q in borrowers {
            let g = self.snap.queues.quota_at(q, fi as usize).guaranteed;
            let held = self.usage.protected.get(&(q, fi)).copied().unwrap_or(0);
            for &k in self.victims.running_by_queue.get(&q).into_iter().flatten() {
                let r = &self.snap.running[k];
                if !self.runs_on(k, fi, flavor) || r.stopping_at.is_some() {
                    continue;
                }
                let class = self.snap.cfg.classes.get(r.work.class);
                let after = if class.is_some_and(|c| c.preemptible) {
                    Some(self.snap.cfg.min_runtime)
                } else if class.is_some_and(|c| !c.may_borrow)
                    && held >= g + self.victims.run[k].milli
                {
                    self.snap.cfg.lease_horizon
                } else {
                    None
                };
                if let Some(after) = after {
                    let at = r.started.saturating_add(after).max(now);
                    if Self::end_of(r).is_none_or(|e| at < e.max(now)) {
                        early.push((at, k));
                    }
                }
            }
        }
        early.sort_unstable();
        let merged = if early.is_empty() {
            None
        } else {
            // A job told early is not told again at its end.
            let mut moved = vec![false; self.snap.running.len()];
            for &(_, k) in &early {
                moved[k] = true;
            }
            let mut rest = ending
                .iter()
                .copied()
                .filter(|&(_, k)| !moved[k])
                .peekable();
            let mut early = early.into_iter().peekable();
            let mut merged = Vec::with_capacity(ending.len() + early.len());
            loop {
                let next = match (rest.peek(), early.peek()) {
                    (Some(&x), Some(&y)) if x <= y => rest.next(),
                    (_, Some(_)) => early.next(),
                    (Some(_), None) => rest.next(),
                    (None, None) => break,
                };
                merged.extend(next);
            }
            Some(Rc::new(merged))
        };
        self.reserve.reclaiming.insert(fi, merged.clone());
        merged
    }

    /// Releases or takes back running jobs so that exactly the first `n` of
    /// `ending` are released (`released` of them are now); taken back in the
    /// reverse order of release.
    pub(super) fn release_first(
        &mut self,
        ending: &[(u64, usize)],
        released: &mut usize,
        n: usize,
    ) {
        while *released < n {
            self.snap
                .placer
                .release(&self.snap.running[ending[*released].1].allocations);
            *released += 1;
        }
        while *released > n {
            *released -= 1;
            self.snap
                .placer
                .restore(&self.snap.running[ending[*released].1].allocations);
        }
    }
}
