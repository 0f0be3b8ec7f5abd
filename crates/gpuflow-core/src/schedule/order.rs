//! Phase 1: the order jobs are tried in: per leaf queue by class tier,
//! priority with aging and age; fair share across queues (dominant share
//! blended with decayed usage); FIFO, priority and Slurm's multifactor.

use super::*;

impl<'a> Cycle<'a> {
    /// Priority with aging: one step per `aging_step` seconds waited, capped.
    pub(super) fn effective_priority(&self, w: &Workload) -> i32 {
        if self.snap.cfg.aging_step == 0 {
            return w.priority;
        }
        let steps = (self.snap.now.saturating_sub(w.submitted) / self.snap.cfg.aging_step)
            .min(self.snap.cfg.aging_cap.max(0) as u64);
        w.priority.saturating_add(steps as i32)
    }

    /// Slurm's classic fair-share factor `2^(−U/S)` per leaf queue (see
    /// [`Multifactor`]).
    pub(super) fn fair_share_factors(&self) -> BTreeMap<QueueId, f64> {
        let leaves: Vec<(QueueId, f64, f64)> = self
            .snap
            .queues
            .list()
            .iter()
            .enumerate()
            .map(|(i, q)| (QueueId(i as u32), q.weight.max(0.0)))
            .filter(|&(id, _)| self.snap.queues.is_leaf(id))
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
    pub(super) fn multifactor_priority(
        &self,
        w: &Workload,
        fair_share: &BTreeMap<QueueId, f64>,
        cluster_gpus: u64,
    ) -> i32 {
        let m = &self.snap.cfg.multifactor;
        let waited = self.snap.now.saturating_sub(w.submitted) as f64;
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

    pub(super) fn order(&mut self) {
        use std::cmp::Reverse;
        // The order is (class tier, priority with aging) highest first, then
        // submission time and id, oldest first. Tier and priority take few
        // values: jobs are first counted into one bucket per pair, in index
        // order, then each bucket is sorted by submission. A backlog kept in
        // submission order (as callers keep it) is then already nearly
        // sorted, which the stable sort takes in about one pass.
        type Tier = (Reverse<u32>, Reverse<i32>);
        let n = self.snap.pending.len();
        let factors = (self.snap.cfg.ordering == Ordering::Multifactor).then(|| {
            let gpus = self
                .snap
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
        for w in self.snap.pending.iter() {
            let tier = match self.snap.cfg.ordering {
                Ordering::Fifo => (Reverse(0), Reverse(0)),
                _ => (
                    Reverse(if self.snap.cfg.class_tiers {
                        match self.snap.cfg.classes.get(w.class) {
                            Some(c) if c.preemptible && self.snap.cfg.preemptible_one_tier => 0,
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
            keyed[next[b]] = (submitted, id, i as u32, q, self.pend.pend_milli[i]);
            next[b] += 1;
        }
        for &b in &by_tier {
            let (s, c) = (start[b as usize], count[b as usize]);
            keyed[s..s + c].sort_by_key(|&(submitted, id, ..)| (submitted, id));
        }
        let mut lists: Vec<Vec<usize>> = vec![Vec::new(); self.snap.queues.list().len()];
        for &(_, _, i, q, _) in &keyed {
            lists[q as usize].push(i as usize);
        }
        self.order.per_queue = lists
            .into_iter()
            .enumerate()
            .filter(|(_, l)| !l.is_empty())
            .map(|(q, l)| (QueueId(q as u32), l))
            .collect();
        self.order.global = keyed.iter().map(|k| k.2 as usize).collect();
        self.order.global_milli = keyed.iter().map(|k| k.4).collect();
    }

    /// Phase 1's post-condition: the global order and the queues' orders
    /// together each hold every pending job once.
    pub(super) fn check_order(&self) -> bool {
        let n = self.snap.pending.len();
        let once = |order: Vec<usize>| {
            let mut seen = vec![false; n];
            order
                .into_iter()
                .all(|i| i < n && !std::mem::replace(&mut seen[i], true))
                && seen.iter().all(|&s| s)
        };
        once(self.order.global.clone())
            && once(self.order.per_queue.values().flatten().copied().collect())
    }
}
