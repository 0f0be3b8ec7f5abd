//! Backfill reservations: the first jobs blocked by capacity get the
//! earliest start the known ends of running work allow; others keep off
//! the reserved nodes unless they end before it.

use super::*;

impl<'a> Cycle<'a> {
    /// The reservation slots job `i` must keep off, a bit each: none when
    /// it holds a reservation or ends before the first one starts; else
    /// every reserved node, or with [`Config::backfill_per_node`] the slots
    /// whose reservation starts before the job would end.
    pub(super) fn avoids_reserved(&self, i: usize) -> u64 {
        let w = &self.snap.pending[i];
        if self.reserve.reserved_from == u64::MAX || self.reserve.reserved.contains_key(&w.job.id) {
            return 0;
        }
        let end = w
            .max_runtime
            .map_or(u64::MAX, |m| self.snap.now.saturating_add(m));
        if end <= self.reserve.reserved_from {
            0
        } else if self.snap.cfg.backfill_per_node {
            self.reserve
                .reservations
                .iter()
                .enumerate()
                .filter(|(_, r)| r.start_at < end)
                .fold(0, |mask, (k, _)| mask | 1u64 << Self::slot(k))
        } else {
            u64::MAX
        }
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
    /// declared max runtime), and holds those nodes for it.
    pub(super) fn reserve(&mut self, i: usize, flavor: &str) {
        let ending = self.ending_order();
        // Victims chosen this cycle end when they are told to stop.
        let ending: Vec<(u64, usize)> = ending
            .iter()
            .copied()
            .filter(|&(_, k)| {
                !self.victims.run[k].victim || self.snap.running[k].stopping_at.is_some()
            })
            .collect();
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
