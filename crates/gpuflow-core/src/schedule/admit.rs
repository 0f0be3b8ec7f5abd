//! Phase 2: jobs taken in order and admitted on the first flavor whose
//! quota and placement allow, else preemption, consolidation or a
//! backfill reservation is tried; the gates, quota checks and placement
//! memos they share.

use super::*;

impl<'a> Cycle<'a> {
    pub(super) fn rank(&self, w: &Workload) -> u32 {
        self.snap.cfg.classes.get(w.class).map_or(0, |c| c.rank)
    }

    pub(super) fn admit_all(&mut self) {
        self.nominate_waiting();
        self.hold_again();
        // Preemptors whose victims have stopped take the room made for them.
        let ready: Vec<usize> = if self.order.ready.is_empty() {
            Vec::new()
        } else {
            (0..self.snap.pending.len())
                .filter(|&i| self.order.ready.contains(&self.pend.pend_id[i]))
                .collect()
        };
        let mut done = BTreeSet::new();
        for i in ready {
            if self.try_admit(i) {
                done.insert(i);
            }
        }
        if !done.is_empty() {
            for list in self.order.per_queue.values_mut() {
                list.retain(|i| !done.contains(i));
            }
            (self.order.global, self.order.global_milli) = self
                .order
                .global
                .iter()
                .zip(&self.order.global_milli)
                .filter(|(i, _)| !done.contains(*i))
                .map(|(&i, &m)| (i, m))
                .unzip();
        }
        match self.snap.cfg.ordering {
            Ordering::Fifo | Ordering::Priority | Ordering::Multifactor => {
                let order = std::mem::take(&mut self.order.global);
                for (pos, &i) in order.iter().enumerate() {
                    let admitted = self.try_admit(i);
                    // FIFO: the head blocks everything behind it.
                    if !admitted
                        && self.snap.cfg.ordering == Ordering::Fifo
                        && !self.snap.cfg.backfill
                    {
                        for &j in &order[pos + 1..] {
                            self.out.not_reached[j] = (pos + 1) as u32;
                        }
                        break;
                    }
                }
                self.order.global = order;
            }
            Ordering::FairShare => {
                // A lazy heap of leaves by fair-share key (smallest first): a
                // popped leaf whose key grew since it was pushed goes back.
                let mut heap: BinaryHeap<(std::cmp::Reverse<LeafKey>, std::cmp::Reverse<QueueId>)> =
                    BinaryHeap::new();
                // Per queue (by id), the next position in its list.
                let n = self.snap.queues.list().len();
                let mut cursor = vec![0usize; n];
                // No head-of-line blocking across classes: a queue's failed
                // tries are shared out among the classes it has pending, and
                // a class that used its share holds back only its own jobs
                // (kept with the queue position where it did). The queue's
                // total stays about its part of `tries_per_cycle`, at least
                // `tries_per_queue`.
                let mut share = vec![0usize; n];
                let per_queue = self
                    .snap
                    .cfg
                    .tries_per_queue
                    .max(self.snap.cfg.tries_per_cycle / self.order.per_queue.len().max(1));
                for (&q, list) in &self.order.per_queue {
                    // Distinct classes pending, as bits (classes past the
                    // 128th share the last bit: a larger share, never a
                    // smaller one).
                    let classes = list
                        .iter()
                        .fold(0u128, |m, &j| m | 1 << self.pend.pend_class[j].min(127))
                        .count_ones() as usize;
                    share[q.0 as usize] = per_queue.div_ceil(classes.max(1)).max(1);
                }
                // Per queue, each class it tried.
                let mut tries: Vec<smallvec::SmallVec<[ClassTries; 4]>> =
                    vec![Default::default(); n];
                for &q in self.order.per_queue.keys() {
                    heap.push((std::cmp::Reverse(self.leaf_key(q)), std::cmp::Reverse(q)));
                }
                while let Some((std::cmp::Reverse(key), std::cmp::Reverse(q))) = heap.pop() {
                    let fresh = self.leaf_key(q);
                    if fresh > key {
                        heap.push((std::cmp::Reverse(fresh), std::cmp::Reverse(q)));
                        continue;
                    }
                    let qi = q.0 as usize;
                    let list = &self.order.per_queue[&q];
                    let mine = &mut tries[qi];
                    let c = &mut cursor[qi];
                    while let Some(&j) = list.get(*c) {
                        let class = self.pend.pend_class[j];
                        let Some(at) = mine.iter().find(|t| t.0 == class).and_then(|t| t.2) else {
                            break;
                        };
                        self.out.not_reached[j] = at as u32;
                        *c += 1;
                    }
                    let Some(&i) = list.get(*c) else { continue };
                    *c += 1;
                    let at = *c;
                    if !self.try_admit(i) {
                        let class = self.pend.pend_class[i];
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
    pub(super) fn try_admit(&mut self, i: usize) -> bool {
        self.tally.tries += 1;
        // A ready preemptor that could not start is tried again in order:
        // its reasons are those of its last try, not both.
        self.out.reasons[i].clear();
        let w = &self.snap.pending[i];
        if self.history.waiting_for.contains_key(&w.job.id) {
            let n = self.history.waiting_for[&w.job.id].len();
            return self.wait(i, PendingReason::WaitingForPreemption { victims: n });
        }
        // Gates before quota: the queue's state, then the user's limits.
        let gate = self.queue_gate(i).or_else(|| self.user_limit(i));
        if let Some(r) = gate {
            self.out.reasons[i].push(r);
            // Every reason: what else would hold it once the gate opens.
            self.quota_and_fit_reasons(i);
            return false;
        }
        // Flavors: the queue's order, restricted to what the job accepts.
        let flavors = self.flavors_for(w);
        let mut reasons = Vec::new();
        // Per flavor: whether placement was tried and failed (not only quota).
        let mut place_failed = vec![false; flavors.len()];
        // Whether a victim search was refused by a disruption budget or
        // reclaim fairness: then no hold, for a reclaim that may not come.
        let mut rule_blocked = false;
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
        if self.snap.cfg.preemption
            && self.out.preempted.len() < self.snap.cfg.max_preemptions_per_cycle
            && self
                .victims
                .preempt_tried
                .insert(self.snap.pending[i].queue)
        {
            for (fi, flavor) in flavors.iter().enumerate() {
                let w = &self.snap.pending[i];
                let key = (w.queue, self.fidx(flavor), self.rank(w), w.priority);
                if self
                    .victims
                    .no_victims
                    .get(&key)
                    .is_some_and(|&d| self.pend.pend_milli[i] >= d)
                {
                    continue;
                }
                self.tally.victim_searches += 1;
                let Search {
                    victims: found,
                    budget_block,
                    fair_block,
                    paced,
                    patient_until,
                    ..
                } = self.find_victims(i, flavor, place_failed[fi]);
                rule_blocked |= budget_block.is_some() || fair_block.is_some();
                let told = reasons.len();
                if found.is_none()
                    && let Some((theirs, ours)) = fair_block
                {
                    reasons.push(PendingReason::ReclaimFairness {
                        queue: self.snap.queues.get(theirs).name.clone(),
                        theirs: self.history_share(theirs),
                        our_queue: self.snap.queues.get(ours).name.clone(),
                        ours: self.history_share(ours),
                    });
                }
                if found.is_none()
                    && let Some((q, spent)) = budget_block
                {
                    let queue = self.snap.queues.get(q).name.clone();
                    let cfg = self.snap.cfg;
                    reasons.push(match cfg.disruption_max_jobs {
                        Some(max) if spent.by_count => PendingReason::DisruptionCount {
                            queue,
                            jobs: spent.jobs,
                            max,
                        },
                        _ => PendingReason::DisruptionBudget {
                            queue,
                            used: spent.hours,
                            budget: cfg.disruption_budget.unwrap_or(0.0),
                        },
                    });
                    if let Some(at) = patient_until {
                        reasons.push(PendingReason::BudgetPatience {
                            patience: cfg.budget_patience,
                            at,
                        });
                    }
                }
                if found.is_none()
                    && (budget_block.is_some() || fair_block.is_some())
                    && (paced || patient_until.is_some())
                {
                    let at = (self.snap.pending[i].queue, self.fidx(flavor), paced);
                    let why = reasons[told..]
                        .iter()
                        .filter(|r| !matches!(r, PendingReason::BudgetPatience { .. }))
                        .cloned()
                        .collect();
                    self.victims.refused.entry(at).or_insert(why);
                }
                if found.is_none() {
                    let d = self.pend.pend_milli[i];
                    let e = self.victims.no_victims.entry(key).or_insert(d);
                    *e = (*e).min(d);
                }
                if let Some(victims) = found {
                    return self.wait_for_victims(i, victims);
                }
            }
            if let Some(limit_s) = self.snap.cfg.max_unsaved {
                let jobs = self.unsaved_held_for(i, &flavors);
                if jobs > 0 {
                    reasons.push(PendingReason::UnsavedWork { jobs, limit_s });
                }
            }
        }
        // Consolidation: moving a few running jobs lets it start.
        if self.snap.cfg.preemption
            && self.out.preempted.len() < self.snap.cfg.max_preemptions_per_cycle
            && self.snap.cfg.consolidate_max_unsaved.is_some()
            && self.consolidation.may_consolidate
            && self.consolidation.consolidation_tries < MAX_CONSOLIDATION_TRIES
        {
            let open = flavors
                .iter()
                .enumerate()
                .find(|&(fi, f)| place_failed[fi] && self.quota_check(i, f).is_ok())
                .map(|(_, f)| f.clone());
            if let Some(flavor) = open
                && let Some(victims) = self.consolidate(i, &flavor)
            {
                self.consolidation.may_consolidate = false;
                self.history.consolidated_at = Some(self.snap.now);
                return self.wait_for_victims(i, victims);
            }
        }
        // The rules refused the reclaim of an earlier job of its queue
        // bound as its own is (it did not search itself): the same
        // reasons. Paced, it holds no nodes either; budget-bound until its
        // patience ends, it keeps its hold and says when that is.
        if !rule_blocked && let Some((patient_until, why)) = self.reclaim_refused(i, &flavors) {
            reasons.extend(why.iter().cloned());
            match patient_until {
                None => rule_blocked = true,
                Some(at) => reasons.push(PendingReason::BudgetPatience {
                    patience: self.snap.cfg.budget_patience,
                    at,
                }),
            }
        }
        if rule_blocked {
            self.history.holding.remove(&self.snap.pending[i].job.id);
        }
        // Backfill: the first jobs blocked by capacity (not quota) get a
        // reservation; jobs within their guarantee, a reclaim hold, with an
        // allowance of their own, so that neither takes the other's.
        if self.snap.cfg.backfill
            && !self
                .reserve
                .reserved
                .contains_key(&self.snap.pending[i].job.id)
        {
            // A job within its guarantee that quota blocks (its guarantee is
            // lent) holds the nodes it would take back, too.
            let mut open = flavors
                .iter()
                .find(|f| self.quota_check(i, f).is_ok())
                .map(|f| (f.clone(), !rule_blocked && self.reclaims(i, f)));
            if open.is_none() && !rule_blocked {
                for f in flavors.iter() {
                    if self.reclaims(i, f) {
                        open = Some((f.clone(), true));
                        break;
                    }
                }
            }
            if let Some((flavor, reclaims)) = open {
                let flavor = &*flavor;
                let made = if reclaims {
                    self.reserve.holds.len()
                } else {
                    self.reserve.reservations.len()
                };
                if made < self.snap.cfg.max_reservations.max(1) {
                    self.reserve(i, flavor, reclaims);
                }
            }
        }
        let mine = &mut self.out.reasons[i];
        if mine.is_empty() {
            *mine = reasons;
        } else {
            mine.append(&mut reasons);
        }
        false
    }

    /// Job `i` waits for the victims chosen for it to stop; they are
    /// preempted with the plan.
    pub(super) fn wait_for_victims(&mut self, i: usize, victims: Vec<Preemption>) -> bool {
        let id = self.snap.pending[i].job.id;
        let start_at = victims
            .iter()
            .map(|v| v.kill_at)
            .max()
            .unwrap_or(self.snap.now);
        let by_id = self.running_index();
        let stopping: Vec<usize> = victims
            .iter()
            .filter_map(|v| by_id.get(&v.victim).copied())
            .collect();
        self.nominate(i, &stopping, start_at);
        self.history
            .waiting_for
            .insert(id, victims.iter().map(|v| v.victim).collect());
        let n = victims.len();
        self.out.preempted.extend(victims);
        self.wait(i, PendingReason::WaitingForPreemption { victims: n })
    }

    /// Adds to job `i`'s reasons every quota and placement reason on the
    /// flavors it accepts, trying nothing for good (placements are trials);
    /// none when one flavor has neither (the job would start there).
    pub(super) fn quota_and_fit_reasons(&mut self, i: usize) {
        let flavors = self.flavors_for(&self.snap.pending[i]);
        let mut found = Vec::new();
        for flavor in flavors.iter() {
            let before = found.len();
            found.extend(self.quota_check(i, flavor).err());
            found.extend(self.unplaced_now(i, flavor));
            if found.len() == before {
                return;
            }
        }
        self.out.reasons[i].extend(found);
    }

    /// Why job `i`'s queue starts nothing now (held or draining), if so.
    pub(super) fn queue_gate(&self, i: usize) -> Option<PendingReason> {
        let q = self.snap.queues.get(self.snap.pending[i].queue);
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
    pub(super) fn user_limit(&self, i: usize) -> Option<PendingReason> {
        let w = &self.snap.pending[i];
        let q = self.snap.queues.get(w.queue);
        let (used, count) = if has_user_limits(self.snap.queues, w.queue) {
            self.usage
                .users
                .get(&(w.queue, w.user.as_str()))
                .copied()
                .unwrap_or_default()
        } else {
            (0, 0)
        };
        if let Some(limit) = q.user_limits.max_gpu_milli
            && used + self.pend.pend_milli[i] > limit
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
    pub(super) fn unplaced_now(&mut self, i: usize, flavor: &str) -> Option<PendingReason> {
        let key = self.place_key(i, flavor);
        if let Some(r) = self.memo.unplaceable.get(&key) {
            return Some(r.clone());
        }
        if self.memo.no_fit.contains(&key) {
            // Failed a trial without its explanation: fetch that once.
        } else if self.memo.fits_seen.get(&key) == Some(&self.victims.epoch) {
            return None;
        }
        // A success costs what a trial would; a failure is explained (and
        // leaves no trace by itself).
        let trial = self.snap.placer.begin_trial();
        let r = self.place_once(i, flavor);
        if let Ok(p) = &r {
            self.snap.placer.release(p);
            self.memo.fits_seen.insert(key, self.victims.epoch);
        }
        self.snap.placer.end_trial(trial);
        r.err()
    }

    pub(super) fn wait(&mut self, i: usize, r: PendingReason) -> bool {
        self.out.reasons[i].push(r);
        false
    }

    /// The flavors a job may run on, in its queue's order: shared, and kept
    /// per queue for the jobs that name no GPU model (most of them).
    pub(super) fn flavors_for(&mut self, w: &Workload) -> Rc<[Arc<str>]> {
        if !w.needs_gpu() {
            return self.flavors.no_gpu.clone();
        }
        let open = w.job.groups.iter().all(|g| g.request.models.is_empty());
        if open && let Some(v) = self.flavors.queue_flavors.get(&w.queue) {
            return v.clone();
        }
        let q = self.snap.queues.get(w.queue);
        let order: Vec<&String> = if q.flavor_order.is_empty() {
            // Flavors with quota first (in name order), then any others the cluster has.
            let mut v: Vec<&String> = q.quotas.keys().collect();
            v.extend(
                self.snap
                    .queues
                    .flavors()
                    .filter(|f| !q.quotas.contains_key(*f)),
            );
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
            .filter(|f| accepts(f) && self.snap.queues.capacity(f) > 0)
            .filter_map(|f| self.snap.queues.flavor_index(f))
            .map(|f| self.flavors.flavor_names[f].clone())
            .collect();
        if open {
            self.flavors.queue_flavors.insert(w.queue, list.clone());
        }
        list
    }

    /// [`flavor_index`], first by identity with the cycle's shared names
    /// (what [`Cycle::flavors_for`] hands out), without comparing text.
    pub(super) fn fidx(&self, flavor: &str) -> u32 {
        self.flavors
            .flavor_names
            .iter()
            .position(|n| std::ptr::eq(n.as_ptr(), flavor.as_ptr()) && n.len() == flavor.len())
            .map_or_else(|| flavor_index(self.snap.queues, flavor), |f| f as u32)
    }

    pub(super) fn class_may_borrow(&self, w: &Workload) -> bool {
        self.snap
            .cfg
            .classes
            .get(w.class)
            .is_none_or(|c| c.may_borrow)
    }

    /// Whether job `i`, of a class that may not borrow, may run beyond its
    /// queue's guarantee of `flavor` on a lease ([`Config::lease_horizon`]),
    /// its class holding `held` of `guaranteed` there: `Err(None)` when
    /// leases are off, the class takes none or the flavor has no quota,
    /// else `[leased, need, lendable]` (see [`PendingReason::NoLease`]).
    pub(super) fn lease(
        &self,
        i: usize,
        flavor: &str,
        held: u64,
        guaranteed: u64,
    ) -> Result<(), Option<[u64; 3]>> {
        let fi = self.fidx(flavor);
        let may_lease = self
            .snap
            .cfg
            .classes
            .get(self.snap.pending[i].class)
            .is_some_and(|c| c.may_lease);
        if self.snap.cfg.lease_horizon.is_none() || fi == NO_FLAVOR || !may_lease {
            return Err(None);
        }
        let need = Self::beyond(held, self.pend.pend_milli[i], guaranteed);
        let leased = self.usage.leased.get(&fi).copied().unwrap_or(0);
        let lendable = self.usage.lendable.get(fi as usize).copied().unwrap_or(0);
        if leased + need > lendable {
            return Err(Some([leased, need, lendable]));
        }
        Ok(())
    }

    /// How much of `more` milli-GPU lies beyond `guaranteed` when `held`
    /// is held already.
    pub(super) fn beyond(held: u64, more: u64, guaranteed: u64) -> u64 {
        (held + more).saturating_sub(guaranteed) - held.saturating_sub(guaranteed)
    }

    pub(super) fn within_guarantee(&self, i: usize, flavor: &str) -> bool {
        let q = self.snap.pending[i].queue;
        match self.fidx(flavor) {
            NO_FLAVOR => {
                self.pend.pend_milli[i] <= self.snap.queues.get(q).quota(flavor).guaranteed
            }
            f => {
                self.snap.queues.usage_at(q, f as usize) + self.pend.pend_milli[i]
                    <= self.snap.queues.quota_at(q, f as usize).guaranteed
            }
        }
    }

    /// Whether another queue holds more than its guarantee of the flavor
    /// at index `f`: only then is a queue's guarantee lent. (A guarantee
    /// larger than the cluster, which the queue fills itself, is not.)
    fn lent_to_others(&self, queue: QueueId, f: u32) -> bool {
        if f == NO_FLAVOR {
            return false;
        }
        let queues = &self.snap.queues;
        let mine = queues.is_leaf(queue) && queues.borrowing_at(queue, f as usize);
        debug_assert_eq!(
            queues.borrowing_leaves_at(f as usize) as usize,
            (0..queues.list().len() as u32)
                .map(QueueId)
                .filter(|&q| queues.is_leaf(q) && queues.borrowing_at(q, f as usize))
                .count(),
            "the count of borrowing leaves is out of step"
        );
        queues.borrowing_leaves_at(f as usize) > u32::from(mine)
    }

    pub(super) fn quota_ok(&self, i: usize, flavor: &str) -> Result<(), PendingReason> {
        let w = &self.snap.pending[i];
        if !self.snap.cfg.quotas || flavor.is_empty() {
            return Ok(());
        }
        // Classes that may not borrow share the guarantee among themselves:
        // borrowing work in the same queue yields to them (by preemption).
        if !self.class_may_borrow(w) {
            let held = self
                .usage
                .protected
                .get(&(w.queue, self.fidx(flavor)))
                .copied()
                .unwrap_or(0);
            let guaranteed = match self.fidx(flavor) {
                NO_FLAVOR => self.snap.queues.get(w.queue).quota(flavor).guaranteed,
                f => self.snap.queues.quota_at(w.queue, f as usize).guaranteed,
            };
            if held + self.pend.pend_milli[i] > guaranteed
                && let Err(block) = self.lease(i, flavor, held, guaranteed)
            {
                let class = self
                    .snap
                    .cfg
                    .classes
                    .get(w.class)
                    .map_or(Arc::from(""), |c| Arc::from(c.name.as_str()));
                let (flavor, usage) = (self.flavor_name(flavor), held + self.pend.pend_milli[i]);
                return Err(match block {
                    None => PendingReason::NotWithinGuarantee {
                        flavor,
                        class,
                        usage,
                        guaranteed,
                    },
                    Some([leased, need, lendable]) => PendingReason::NoLease {
                        flavor,
                        class,
                        usage,
                        guaranteed,
                        leased,
                        need,
                        lendable,
                    },
                });
            }
        }
        let fits = match self.fidx(flavor) {
            NO_FLAVOR => self
                .snap
                .queues
                .fits(w.queue, flavor, self.pend.pend_milli[i]),
            f => self
                .snap
                .queues
                .fits_at(w.queue, f as usize, self.pend.pend_milli[i]),
        };
        if let Err(QuotaBlock::NoLendableCapacity { .. }) = fits
            && self.within_guarantee(i, flavor)
            && self.lent_to_others(w.queue, self.fidx(flavor))
        {
            let fi = self.fidx(flavor) as usize;
            return Err(PendingReason::GuaranteeLent {
                flavor: self.flavor_name(flavor),
                queue: self.snap.queues.get(w.queue).name.clone(),
                usage: self.snap.queues.usage_at(w.queue, fi) + self.pend.pend_milli[i],
                guaranteed: self.snap.queues.quota_at(w.queue, fi).guaranteed,
            });
        }
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
                    .map(|q| (q, self.snap.queues.get(q).name.clone()))
                    .into_iter()
                    .collect()
            },
            block,
        })
    }

    /// [`Cycle::quota_ok`] outside trial releases, remembered until the next
    /// admission changes usage.
    pub(super) fn quota_check(&mut self, i: usize, flavor: &str) -> Result<(), PendingReason> {
        let w = &self.snap.pending[i];
        let key = (w.queue, self.fidx(flavor), self.pend.pend_milli[i], w.class);
        if let Some(r) = self.memo.quota_memo.get(&key) {
            return r.clone();
        }
        let r = self.quota_ok(i, flavor);
        self.memo.quota_memo.insert(key, r.clone());
        r
    }

    /// A flavor's name for a reason, shared by every reason of the cycle.
    pub(super) fn flavor_name(&self, flavor: &str) -> Arc<str> {
        match self.snap.queues.flavor_index(flavor) {
            Some(f) => self.flavors.flavor_names[f].clone(),
            None => Arc::from(flavor),
        }
    }

    /// The job restricted to one flavor, keeping off reserved nodes unless it ends first.
    pub(super) fn job_on(&self, i: usize, flavor: &str) -> Job {
        let mut job = on_flavor(&self.snap.pending[i].job, flavor);
        job.constraints.avoid_reservations = self.avoids_reserved(i);
        job
    }

    /// The placer's slot of the `k`-th reservation of the cycle with
    /// [`Config::backfill_per_node`] (without it, every reservation's nodes
    /// take slot 1). The reservations past the last slot share it: a job
    /// keeps off them all when the earliest of them starts before it ends.
    pub(super) fn slot(k: usize) -> u8 {
        (k + 1).min(HOLD_SLOT as usize - 1) as u8
    }

    /// Job `i`'s placement problem on `flavor` (see [`PlaceKey`]).
    pub(super) fn place_key(&mut self, i: usize, flavor: &str) -> PlaceKey {
        if self.memo.shape_of[i] == u32::MAX {
            let next = self.memo.shapes.len() as u32;
            self.memo.shape_of[i] = *self
                .memo
                .shapes
                .entry(Shape(&self.snap.pending[i].job))
                .or_insert(next);
        }
        (
            self.memo.shape_of[i],
            self.fidx(flavor),
            self.avoids_reserved(i),
        )
    }

    /// [`Cycle::place`] for the admission path, remembering shapes that fail.
    pub(super) fn place_once(
        &mut self,
        i: usize,
        flavor: &str,
    ) -> Result<Placement, PendingReason> {
        let key = self.place_key(i, flavor);
        if let Some(r) = self.memo.unplaceable.get(&key) {
            return Err(r.clone());
        }
        self.tally.placements += 1;
        let job = self.job_on(i, flavor);
        let r = self.place(&job, flavor);
        if let Err(e) = &r {
            self.memo.unplaceable.insert(key, e.clone());
        }
        r
    }

    /// Whether job `i` would fit on `flavor` now. Only for the committed
    /// state (no trial release in progress): failures are remembered, as
    /// capacity only shrinks during a cycle, and fits until the state
    /// changes (the next [`VictimIndex::epoch`]).
    pub(super) fn fits_committed(&mut self, i: usize, flavor: &str) -> bool {
        let key = self.place_key(i, flavor);
        if self.memo.unplaceable.contains_key(&key) || self.memo.no_fit.contains(&key) {
            return false;
        }
        if self.memo.fits_seen.get(&key) == Some(&self.victims.epoch) {
            return true;
        }
        let fits = self.fits_now(i, flavor);
        if fits {
            self.memo.fits_seen.insert(key, self.victims.epoch);
        } else {
            self.memo.no_fit.insert(key);
        }
        fits
    }

    /// Whether job `i` would fit on `flavor` now, without choosing where
    /// ([`Placer::fits_job`]): nothing changes.
    pub(super) fn fits_now(&mut self, i: usize, flavor: &str) -> bool {
        let job = self.job_on(i, flavor);
        self.snap.placer.fits_job(&job)
    }

    /// A trial placement of a job already built (see [`Cycle::job_on`]):
    /// where it would fit now, without explanation. Nothing stays placed,
    /// and it leaves no trace on later tie-breaks.
    pub(super) fn fits_now_as(&mut self, job: &Job) -> Option<Placement> {
        self.snap.placer.trial_place(job)
    }

    /// Places a job already restricted by [`Cycle::job_on`], explaining a failure.
    pub(super) fn place(&mut self, job: &Job, flavor: &str) -> Result<Placement, PendingReason> {
        self.snap.placer.place_job(job).map_err(|unplaced| {
            if unplaced
                .rejections
                .iter()
                .any(|(r, _)| *r == crate::placement::Reject::Reserved)
                && let Some(r) = self
                    .reserve
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
            if unplaced
                .rejections
                .iter()
                .any(|(r, _)| *r == crate::placement::Reject::Reserved)
                && job.constraints.avoid_reservations & (1u64 << HOLD_SLOT) != 0
                && let Some(r) = self.reserve.holds.iter().min_by_key(|r| r.start_at)
            {
                return PendingReason::ReclaimHold {
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

    pub(super) fn commit(&mut self, i: usize, flavor: &str, p: Placement) {
        self.memo.quota_memo.clear();
        self.victims.epoch += 1;
        let w = &self.snap.pending[i];
        if !flavor.is_empty() {
            self.snap
                .queues
                .charge(w.queue, flavor, self.pend.pend_milli[i] as i64);
            // Shares of the queue, its ancestors and (through the history sum
            // of siblings, which does not change here) nobody else.
            self.fair.charged(self.snap.queues, w.queue);
            // Jobs admitted now are not victims this cycle, but their queue's
            // existing jobs may now be borrowing.
            if self.snap.queues.borrowing(w.queue, flavor)
                && self.victims.running_by_queue.contains_key(&w.queue)
            {
                self.victims
                    .borrowers
                    .entry(flavor.to_string())
                    .or_default()
                    .insert(w.queue);
            }
        }
        if has_user_limits(self.snap.queues, w.queue) {
            let pending = self.snap.pending;
            let e = self
                .usage
                .users
                .entry((w.queue, pending[i].user.as_str()))
                .or_default();
            e.0 += self.pend.pend_milli[i];
            e.1 += 1;
        }
        if !self.class_may_borrow(w) {
            let fi = self.fidx(flavor);
            let held = self.usage.protected.entry((w.queue, fi)).or_default();
            let before = *held;
            *held += self.pend.pend_milli[i];
            if fi != NO_FLAVOR {
                let guaranteed = self.snap.queues.quota_at(w.queue, fi as usize).guaranteed;
                let lease = Self::beyond(before, self.pend.pend_milli[i], guaranteed);
                if lease > 0 {
                    *self.usage.leased.entry(fi).or_default() += lease;
                }
            }
        }
        self.out.admitted.push((w.job.id, flavor.to_string(), p));
        self.out.admitted_idx.push(i);
    }
}
