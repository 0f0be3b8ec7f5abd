//! Preemption: the victim index (packed running jobs, reclaim lists per
//! flavor, shared windows) and the victim search: candidate windows,
//! the bounds (guarantees, disruption budgets, fairness of reclaims) and
//! the pick of the cheapest victims that let a job fit.

use super::*;

/// A flavor's reclaim list grouped by queue: each queue's positions in it.
/// One victim search: how it is bound (set from the job's class and queue
/// when it starts) and what it found, passed down the search and returned
/// by [`Cycle::find_victims`].
#[derive(Clone, Debug, Default)]
pub(super) struct Search {
    /// Disruption budgets and [`Config::reclaims_restore_fairness`] bind
    /// its reclaims.
    pub(super) paced: bool,
    /// The disruption budget that binds it (`None`: none does).
    pub(super) budget: Option<Budget>,
    /// When a job that passes budgets binds itself to them until it has
    /// waited [`Config::budget_patience`]: the time it stops.
    pub(super) patient_until: Option<u64>,
    /// The victims, when it found a set that lets the job start.
    pub(super) victims: Option<Vec<Preemption>>,
    /// The first disruption budget that left a candidate out: (the
    /// victim's queue, what it already lost in the window).
    pub(super) budget_block: Option<(QueueId, Spent)>,
    /// The first pair of queues reclaim fairness compared and refused (the
    /// borrower's side, the reclaimer's).
    pub(super) fair_block: Option<(QueueId, QueueId)>,
}

pub(super) type ReclaimGroups = Vec<(QueueId, Vec<u32>)>;

/// A queue's disruption budget over [`Config::disruption_window`]: the
/// GPU-hours of work its reclaims may lose and how many of its jobs they
/// may stop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Budget {
    pub(super) hours: Option<f64>,
    pub(super) jobs: Option<usize>,
}

impl Budget {
    /// The budget `cfg` sets; `None` when it sets neither bound.
    pub(super) fn of(cfg: &Config) -> Option<Budget> {
        let b = Budget {
            hours: cfg.disruption_budget,
            jobs: cfg.disruption_max_jobs,
        };
        (b.hours.is_some() || b.jobs.is_some()).then_some(b)
    }
}

/// What a queue's reclaims already took in the window when its budget left
/// a candidate out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Spent {
    /// GPU-hours of work lost.
    pub(super) hours: f64,
    /// Jobs stopped.
    pub(super) jobs: usize,
    /// Whether the job count refused it (the GPU-hours did not).
    pub(super) by_count: bool,
}

/// What the bounds say of one candidate before a search releases any.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Screen {
    Kept,
    /// Its queue would fall below its guarantee.
    Guarantee,
    /// Its queue's disruption budget: (queue, what it already lost).
    Budget(QueueId, Spent),
}

/// A victim search's candidates that pass the bounds now ([`Cycle::screen`]).
pub(super) struct Screened {
    kept: Vec<usize>,
    /// The first disruption budget that left a candidate out: (queue, what it lost).
    budget_block: Option<(QueueId, Spent)>,
}

impl Screened {
    /// The candidates kept, in order, and the first budget that left one out.
    fn of(screens: impl Iterator<Item = (usize, Screen)>) -> Screened {
        let mut kept = Vec::new();
        let mut budget_block = None;
        for (k, screen) in screens {
            match screen {
                Screen::Kept => kept.push(k),
                Screen::Guarantee => {}
                Screen::Budget(q, used) => {
                    budget_block.get_or_insert((q, used));
                }
            }
        }
        Screened { kept, budget_block }
    }
}

/// GPU-hours and jobs a victim search's reclaims so far take from each
/// victim queue (few queues per search), counted against disruption budgets.
#[derive(Default)]
pub(super) struct Planned(Vec<(QueueId, f64, usize)>);

impl Planned {
    fn of(&self, q: QueueId) -> (f64, usize) {
        self.0
            .iter()
            .find(|p| p.0 == q)
            .map_or((0.0, 0), |p| (p.1, p.2))
    }

    /// One more job of queue `q`, losing `gpu_hours`.
    fn add(&mut self, q: QueueId, gpu_hours: f64) {
        match self.0.iter_mut().find(|p| p.0 == q) {
            Some(p) => {
                p.1 += gpu_hours;
                p.2 += 1;
            }
            None => self.0.push((q, gpu_hours, 1)),
        }
    }
}

/// The reclaim candidates entitled searches share ([`Cycle::shared_window`]).
pub(super) struct SharedWindow {
    /// The value of [`VictimIndex::epoch`] it was built at.
    epoch: u64,
    /// The first eligible jobs of borrowing queues, cheapest first, at most
    /// [`SHARED_STREAM`]: (index into `running`, queue, what
    /// [`Cycle::screen_one`] says of it now).
    stream: Vec<(usize, QueueId, Screen)>,
}

impl<'a> Cycle<'a> {
    /// Orders two running jobs as victims: expired leases last; then lowest
    /// class, least work lost (the other way round with
    /// [`Config::victims_by_lost_work`]), fewest GPUs.
    pub(super) fn victim_cost(&self, a: usize, b: usize) -> std::cmp::Ordering {
        let (ra, rb) = (&self.victims.run[a], &self.victims.run[b]);
        let class = || ra.rank.cmp(&rb.rank);
        let lost = || ra.lost.total_cmp(&rb.lost);
        let first = if self.snap.cfg.victims_by_lost_work {
            lost().then_with(class)
        } else {
            class().then_with(lost)
        };
        // Expired leases go after every other candidate.
        ra.leased
            .cmp(&rb.leased)
            .then(first)
            .then(ra.milli.cmp(&rb.milli))
            .then(ra.id.cmp(&rb.id))
    }

    /// Whether running job `k` is charged to the flavor with index `fi` and name `flavor`.
    pub(super) fn runs_on(&self, k: usize, fi: u32, flavor: &str) -> bool {
        self.victims.run[k].flavor == fi
            && (fi != NO_FLAVOR || self.snap.running[k].flavor == flavor)
    }

    /// Reclaim candidates of a flavor in victim-cost order, built once per cycle.
    pub(super) fn reclaim_list(&mut self, flavor: &str) -> Rc<Vec<usize>> {
        if let Some(l) = self.victims.reclaim.get(flavor) {
            return l.clone();
        }
        // Only jobs of queues borrowing at the start of the search can be
        // reclaimed; of those, only preemptible ones past their minimum runtime.
        let borrowers = self
            .victims
            .borrowers
            .get(flavor)
            .cloned()
            .unwrap_or_default();
        let fi = self.fidx(flavor);
        let mut list: Vec<usize> = borrowers
            .iter()
            .flat_map(|q| {
                self.victims
                    .running_by_queue
                    .get(q)
                    .into_iter()
                    .flatten()
                    .copied()
            })
            .filter(|&k| {
                self.runs_on(k, fi, flavor)
                    && self.snap.running[k].stopping_at.is_none()
                    && self.victims.run[k].reclaimable
            })
            .collect();
        list.sort_by(|&a, &b| self.victim_cost(a, b));
        let list = Rc::new(list);
        self.victims
            .reclaim
            .insert(flavor.to_string(), list.clone());
        list
    }

    /// [`Cycle::reclaim_list`] grouped by queue: each queue's positions in
    /// it, in order; built once per cycle.
    pub(super) fn reclaim_groups(&mut self, flavor: &str) -> Rc<ReclaimGroups> {
        if let Some(g) = self.victims.reclaim_groups.get(flavor) {
            return g.clone();
        }
        let list = self.reclaim_list(flavor);
        let mut index: rustc_hash::FxHashMap<QueueId, usize> = Default::default();
        let mut groups: Vec<(QueueId, Vec<u32>)> = Vec::new();
        for (at, &k) in list.iter().enumerate() {
            let q = self.victims.run[k].queue;
            let g = *index.entry(q).or_insert_with(|| {
                groups.push((q, Vec::new()));
                groups.len() - 1
            });
            groups[g].1.push(at as u32);
        }
        let groups = Rc::new(groups);
        self.victims
            .reclaim_groups
            .insert(flavor.to_string(), groups.clone());
        groups
    }

    /// Running jobs job `i` could preempt on `flavors` (its own queue's of
    /// lower priority) but that are kept for their unsaved work. A reclaim
    /// is not held back by unsaved work: capacity beyond a guarantee is
    /// lent on the terms that it can be taken back.
    pub(super) fn unsaved_held_for(&self, i: usize, flavors: &[Arc<str>]) -> usize {
        let w = &self.snap.pending[i];
        let my_rank = (self.rank(w), w.priority);
        let held = self.victims.held.get(&w.queue).map_or(&[][..], |v| v);
        let mut n = 0;
        for flavor in flavors {
            let fi = self.fidx(flavor);
            n += held
                .iter()
                .filter(|&&(f, rank, priority)| f == fi && (rank, priority) < my_rank)
                .count();
        }
        n
    }

    /// How the rules bind job `i`'s reclaims: whether they are paced
    /// (budgets bind them, and reclaim fairness when on: batch and
    /// training, unless protected classes are held to it too, of a queue
    /// that has had its share), and for the others, until when budgets
    /// still bind them (their patience; `None`: past it).
    pub(super) fn pacing(&self, i: usize) -> (bool, Option<u64>) {
        let w = &self.snap.pending[i];
        let cfg = self.snap.cfg;
        let protected = !cfg.classes[w.class].preemptible;
        let paced = (!protected || !cfg.protected_pass_budgets)
            && self.history_share(w.queue) >= cfg.underserved_pass_budgets;
        let until = w.submitted.saturating_add(cfg.budget_patience);
        (paced, (!paced && self.snap.now < until).then_some(until))
    }

    /// Why the rules refused this cycle the reclaim of an earlier job of
    /// job `i`'s queue bound as job `i`'s is (paced, or budget-bound until
    /// its patience ends), on the first of `flavors` where they did, with
    /// the end of job `i`'s patience (`None`: it is paced); `None`
    /// otherwise, or when budgets do not bind job `i`.
    pub(super) fn reclaim_refused(
        &self,
        i: usize,
        flavors: &[Arc<str>],
    ) -> Option<(Option<u64>, &[PendingReason])> {
        if self.victims.refused.is_empty() {
            return None;
        }
        let (paced, patient) = self.pacing(i);
        if !paced && patient.is_none() {
            return None;
        }
        let q = self.snap.pending[i].queue;
        flavors.iter().find_map(|f| {
            self.victims
                .refused
                .get(&(q, self.fidx(f), paced))
                .map(|why| (patient, why.as_slice()))
        })
    }

    /// Victims whose removal lets job `i` fit (quota and placement), chosen to
    /// lose the least work and the fewest GPUs; `None` when no allowed set helps.
    /// Tried on the live state and undone.
    pub(super) fn find_victims(&mut self, i: usize, flavor: &str, place_failed: bool) -> Search {
        let w = &self.snap.pending[i];
        // Aging orders the queue but never lets a job preempt its peers: rank
        // and base priority decide who may preempt whom.
        let my_rank = (self.rank(w), w.priority);
        let fi = self.fidx(flavor);
        let entitled = self.within_guarantee(i, flavor);
        // The reclaims of batch and training (unless protected classes are
        // held to it too) by queues that have had their share are paced:
        // budgets bind them, and they take only from queues that have had
        // as much.
        // The others pass budgets once they have waited the patience.
        let cfg = self.snap.cfg;
        let (paced, patient_until) = self.pacing(i);
        let mut s = Search {
            paced,
            budget: Budget::of(cfg).filter(|_| paced || patient_until.is_some()),
            patient_until,
            ..Search::default()
        };
        // Victims may be the own queue's jobs of strictly lower priority and,
        // when entitled to reclaim, the jobs of queues that borrow this flavor.
        // Both lists are in cost order: lowest class, least work lost, fewest GPUs.
        let mut own: Vec<(usize, PreemptReason)> = self
            .victims
            .own_scan
            .get(&w.queue)
            .into_iter()
            .flatten()
            .filter(|&&(f, rank, priority, _)| f == fi && (rank, priority) < my_rank)
            .map(|&(.., k)| k as usize)
            .filter(|&k| self.runs_on(k, fi, flavor) && self.victims.run[k].eligible())
            .map(|k| (k, PreemptReason::Priority))
            .collect();
        own.sort_by(|a, b| self.victim_cost(a.0, b.0));
        // An entitled job's reclaim candidates come from the stream its
        // flavor's searches share, screened once per change of the state
        // (guarantees and disruption budgets; a search's own victims are
        // counted against budgets as it releases them).
        // A search that reclaim fairness binds builds its own window from the
        // queues it may take from ([`Cycle::window`]): the shared stream,
        // filtered, would mostly run dry.
        let fair = s.paced && self.snap.cfg.reclaims_restore_fairness;
        if entitled && fi != NO_FLAVOR && !fair {
            let shared = self.shared_window(fi, flavor);
            if let Some((candidates, screened)) = self.window_from(&shared, &own, w.queue, &s) {
                #[cfg(debug_assertions)]
                {
                    let direct = self.window(&own, Some(fi), w.queue, flavor, &mut s.clone());
                    debug_assert_eq!(candidates, direct, "shared reclaim window differs");
                    let again = self.screen(&direct, &s);
                    debug_assert_eq!(screened.kept, again.kept);
                    debug_assert_eq!(screened.budget_block, again.budget_block);
                }
                s.victims = self.search(i, flavor, &candidates, &screened, place_failed, &mut s);
                return s;
            }
        }
        let reclaim = (entitled && fi != NO_FLAVOR).then_some(fi);
        let candidates = self.window(&own, reclaim, w.queue, flavor, &mut s);
        let screened = self.screen(&candidates, &s);
        s.victims = self.search(i, flavor, &candidates, &screened, place_failed, &mut s);
        s
    }

    /// A search's candidate window: the cheapest [`MAX_CANDIDATES`] of the
    /// `own` candidates (cheapest first) and, when `reclaim` names the
    /// flavor index, the eligible jobs of other queues that borrow it. The
    /// reclaim list is already in cost order: the own jobs are merged in.
    pub(super) fn window(
        &mut self,
        own: &[(usize, PreemptReason)],
        reclaim: Option<u32>,
        queue: QueueId,
        flavor: &str,
        s: &mut Search,
    ) -> Vec<(usize, PreemptReason)> {
        let window = match reclaim {
            // The rule leaves out whole queues: merge the own lists of the
            // queues it allows, so a search never walks the candidates of
            // queues it may not take from. The same candidates, in the same
            // order, as filtering the reclaim list would give.
            Some(fi) if s.paced && self.snap.cfg.reclaims_restore_fairness => {
                let list = self.reclaim_list(flavor);
                let groups = self.reclaim_groups(flavor);
                let open = |k: usize, q: QueueId| {
                    self.victims.run[k].reclaim_eligible()
                        && self.snap.queues.borrowing_at(q, fi as usize)
                };
                // The queues the rule allows start the merge; of those it
                // refuses, the one whose first open candidate comes first
                // is the job's reason.
                let mut heads = std::mem::take(&mut self.victims.fair_heads);
                heads.clear();
                let mut refused: Option<(u32, (QueueId, QueueId))> = None;
                for (g, (q, at)) in groups.iter().enumerate() {
                    if *q == queue {
                        continue;
                    }
                    let Some(pair) = self.refused(*q, queue, s) else {
                        heads.push(std::cmp::Reverse((at[0], g as u32, 0)));
                        continue;
                    };
                    if refused.is_some_and(|(best, _)| at[0] >= best) {
                        continue;
                    }
                    let first = at.iter().find(|&&p| open(list[p as usize], *q));
                    if let Some(&p) = first
                        && refused.is_none_or(|(best, _)| p < best)
                    {
                        refused = Some((p, pair));
                    }
                }
                if let Some((_, pair)) = refused {
                    s.fair_block.get_or_insert(pair);
                }
                let mut heap = BinaryHeap::from(heads);
                let others = std::iter::from_fn(|| {
                    while let Some(std::cmp::Reverse((at, g, i))) = heap.pop() {
                        let (q, positions) = &groups[g as usize];
                        let k = list[at as usize];
                        if let Some(&next) = positions.get(i as usize + 1) {
                            heap.push(std::cmp::Reverse((next, g, i + 1)));
                        }
                        if open(k, *q) {
                            return Some((k, ()));
                        }
                    }
                    None
                });
                let merged = self.merge(own, (), others).0;
                self.victims.fair_heads = heap.into_vec();
                #[cfg(debug_assertions)]
                {
                    let filtered = list.iter().copied().filter(|&k| {
                        let q = self.victims.run[k].queue;
                        q != queue
                            && self.victims.run[k].reclaim_eligible()
                            && self.snap.queues.borrowing_at(q, fi as usize)
                            && self.refused(q, queue, s).is_none()
                    });
                    let direct = self.merge(own, (), filtered.map(|k| (k, ()))).0;
                    debug_assert_eq!(merged, direct, "the fair window differs from the filter's");
                }
                merged
            }
            Some(fi) => {
                let list = self.reclaim_list(flavor);
                let others = list.iter().copied().filter(|&k| {
                    let q = self.victims.run[k].queue;
                    q != queue
                        && self.victims.run[k].reclaim_eligible()
                        && self.snap.queues.borrowing_at(q, fi as usize)
                });
                self.merge(own, (), others.map(|k| (k, ()))).0
            }
            None => self.merge(own, (), std::iter::empty()).0,
        };
        window
            .into_iter()
            .map(|(k, reason, ())| (k, reason))
            .collect()
    }

    /// The cheapest [`MAX_CANDIDATES`] of `own` and `reclaim` (both in cost
    /// order), each with its tag (`own_tag` for the own ones), and whether
    /// the window filled before the own jobs left over were added.
    pub(super) fn merge<T: Copy>(
        &self,
        own: &[(usize, PreemptReason)],
        own_tag: T,
        reclaim: impl Iterator<Item = (usize, T)>,
    ) -> (Vec<(usize, PreemptReason, T)>, bool) {
        let mut window = Vec::with_capacity(MAX_CANDIDATES);
        let mut own = own.iter().peekable();
        for (k, tag) in reclaim {
            if window.len() >= MAX_CANDIDATES {
                break;
            }
            while let Some(&&(o, reason)) = own.peek()
                && self.victim_cost(o, k).is_lt()
            {
                window.push((o, reason, own_tag));
                own.next();
            }
            window.push((k, PreemptReason::Reclaim, tag));
        }
        let filled = window.len() >= MAX_CANDIDATES;
        window.extend(own.map(|&(o, reason)| (o, reason, own_tag)));
        window.truncate(MAX_CANDIDATES);
        (window, filled)
    }

    /// The search proper over a candidate window, cheapest first (see
    /// [`Cycle::find_victims`]).
    pub(super) fn search(
        &mut self,
        i: usize,
        flavor: &str,
        candidates: &[(usize, PreemptReason)],
        screened: &Screened,
        place_failed: bool,
        s: &mut Search,
    ) -> Option<Vec<Preemption>> {
        if !self.could_help(i, flavor, candidates, screened, place_failed, s) {
            return None;
        }
        let chosen = self.pick_victims(i, flavor, candidates, s)?;
        Some(self.commit_victims(i, chosen))
    }

    /// The victims among `candidates` (cheapest first) whose removal lets
    /// job `i` start on `flavor`, pruned to a minimal set; tried on the live
    /// state and undone (a trial).
    pub(super) fn pick_victims(
        &mut self,
        i: usize,
        flavor: &str,
        candidates: &[(usize, PreemptReason)],
        s: &mut Search,
    ) -> Option<Vec<(usize, PreemptReason)>> {
        let mut chosen: Vec<(usize, PreemptReason)> = Vec::new();
        let mut planned = Planned::default();
        let mut found = false;
        let mut released = 0u64;
        let demand = self.pend.pend_milli[i];
        // How many victims were released at the last fit test.
        let mut tried = 0;
        // Victims are released and taken back below: a trial.
        let trial = self.snap.placer.begin_trial();
        for &(k, reason) in candidates {
            let r = &self.snap.running[k];
            // Bounds: the victim's queue keeps its guarantee; its disruption budget holds.
            if reason == PreemptReason::Reclaim {
                if !self.keeps_guarantee(k) {
                    continue;
                }
                if let Some(used) = self.over_budget(k, &planned, s.budget) {
                    s.budget_block.get_or_insert((r.work.queue, used));
                    continue;
                }
                planned.add(r.work.queue, self.victims.run[k].lost / 3600.0);
            }
            self.snap.placer.release(&r.allocations);
            self.snap
                .queues
                .charge(r.work.queue, flavor, -(self.victims.run[k].milli as i64));
            chosen.push((k, reason));
            released += self.victims.run[k].milli;
            // Placement is tried once enough is released, and otherwise only
            // at doubling counts and after the last victim (below), so a
            // long candidate list costs O(log n) tries.
            let worth = released >= demand || chosen.len().is_power_of_two();
            if worth {
                tried = chosen.len();
                if self.quota_ok(i, flavor).is_ok() && self.fits_now(i, flavor) {
                    found = true;
                    break;
                }
            }
        }
        // The fit with every victim released, unless tried already (the
        // candidates after the last victim may all have been skipped).
        if !found
            && tried < chosen.len()
            && self.quota_ok(i, flavor).is_ok()
            && self.fits_now(i, flavor)
        {
            found = true;
        }
        // Keep only the victims that are needed: put each back, latest first,
        // and keep it running if the job still fits without it.
        if found {
            let mut k = chosen.len();
            while k > 0 {
                k -= 1;
                let r = &self.snap.running[chosen[k].0];
                self.snap.placer.restore(&r.allocations);
                self.snap
                    .queues
                    .charge(r.work.queue, flavor, r.work.gpu_milli() as i64);
                let still = self.quota_ok(i, flavor).is_ok() && self.fits_now(i, flavor);
                if still {
                    chosen.remove(k);
                } else {
                    let r = &self.snap.running[chosen[k].0];
                    self.snap.placer.release(&r.allocations);
                    self.snap
                        .queues
                        .charge(r.work.queue, flavor, -(r.work.gpu_milli() as i64));
                }
            }
        }
        // Undo: the victims keep running until they stop.
        for (k, _) in chosen.iter().rev() {
            let r = &self.snap.running[*k];
            self.snap.placer.restore(&r.allocations);
            self.snap
                .queues
                .charge(r.work.queue, flavor, r.work.gpu_milli() as i64);
        }
        self.snap.placer.end_trial(trial);
        found.then_some(chosen)
    }

    /// Tells the chosen victims of job `i` to stop.
    pub(super) fn commit_victims(
        &mut self,
        i: usize,
        chosen: Vec<(usize, PreemptReason)>,
    ) -> Vec<Preemption> {
        let by = self.snap.pending[i].job.id;
        let mut out = Vec::new();
        self.victims.epoch += 1;
        for (k, reason) in chosen {
            let r = &self.snap.running[k];
            let lost = r.lost_gpu_seconds(self.snap.now) / 3600.0;
            self.victims.run[k].victim = true;
            self.victims.marked += 1;
            // A queue's own priority preemptions make room for its own job;
            // only reclaim takes usage away from it.
            // Only reclaims count against its disruption budget, too.
            if reason == PreemptReason::Reclaim {
                *self
                    .usage
                    .leaving
                    .entry((r.work.queue, self.victims.run[k].flavor))
                    .or_default() += self.victims.run[k].milli;
                self.history
                    .disruptions
                    .entry(r.work.queue)
                    .or_default()
                    .push((self.snap.now, lost));
                let by_it = self.history.reclaimed_by.entry(r.work.job.id).or_default();
                if !by_it.contains(&by) {
                    by_it.push(by);
                }
            }
            out.push(Preemption {
                victim: r.work.job.id,
                by,
                signal_at: self.snap.now,
                kill_at: self.snap.now + r.work.grace,
                lost_gpu_hours: lost,
                reason,
            });
        }
        out
    }

    /// Whether running job `k`'s queue keeps its guarantee of `flavor` if `k`
    /// is reclaimed, counting the victims chosen earlier (this cycle or still
    /// stopping) as gone.
    pub(super) fn keeps_guarantee(&self, k: usize) -> bool {
        self.keeps_guarantee_with(k, 0)
    }

    /// [`Cycle::keeps_guarantee`] with `gone` more milli-GPU of `k`'s queue
    /// and flavor released first (a search's earlier victims, counted
    /// without releasing them).
    pub(super) fn keeps_guarantee_with(&self, k: usize, gone: u64) -> bool {
        let RunInfo {
            queue: q,
            flavor: fi,
            milli,
            ..
        } = self.victims.run[k];
        if fi == NO_FLAVOR {
            return true;
        }
        let leaving = self.usage.leaving.get(&(q, fi)).copied().unwrap_or(0);
        let after = self
            .snap
            .queues
            .usage_at(q, fi as usize)
            .saturating_sub(leaving + gone + milli);
        after >= self.snap.queues.quota_at(q, fi as usize).guaranteed
    }

    /// The pair of queues compared ([`Cycle::compared`]) when the search
    /// under way, by a job of `reclaimer`, may not reclaim from `victim`: a
    /// paced search takes only from queues that have had at least the
    /// reclaimer's share of the decayed usage
    /// ([`Config::reclaims_restore_fairness`]); `None` when it may.
    pub(super) fn refused(
        &self,
        victim: QueueId,
        reclaimer: QueueId,
        s: &Search,
    ) -> Option<(QueueId, QueueId)> {
        if !s.paced || !self.snap.cfg.reclaims_restore_fairness {
            return None;
        }
        let (theirs, ours) = self.compared(victim, reclaimer);
        (self.history_share(theirs) < self.history_share(ours)).then_some((theirs, ours))
    }

    /// The queues whose shares decide between leaves `victim` and
    /// `reclaimer`: themselves when siblings, else their ancestors that are
    /// children of the nearest queue above both (or top-level queues).
    pub(super) fn compared(&self, victim: QueueId, reclaimer: QueueId) -> (QueueId, QueueId) {
        let parent = |q: QueueId| self.snap.queues.get(q).parent;
        if parent(victim) == parent(reclaimer) {
            return (victim, reclaimer);
        }
        let depth = |mut q: QueueId| {
            let mut d = 0;
            while let Some(p) = parent(q) {
                q = p;
                d += 1;
            }
            d
        };
        // Up to the same depth, then up together until siblings.
        let (mut v, mut r) = (victim, reclaimer);
        let (mut dv, mut dr) = (depth(v), depth(r));
        while dv > dr {
            v = parent(v).unwrap_or(v);
            dv -= 1;
        }
        while dr > dv {
            r = parent(r).unwrap_or(r);
            dr -= 1;
        }
        while parent(v) != parent(r) {
            match (parent(v), parent(r)) {
                (Some(a), Some(b)) => (v, r) = (a, b),
                _ => break,
            }
        }
        if v == r { (victim, reclaimer) } else { (v, r) }
    }

    /// The candidates a search over `window` would have released after its
    /// last one: in order, each reclaim that leaves its queue its guarantee
    /// once the earlier ones are gone ([`Cycle::keeps_guarantee`] as the
    /// search sees it) and, when budgets bind the search, whose loss fits
    /// its queue's budget with the earlier ones' (as
    /// [`Cycle::pick_victims`] counts it). Every set the search reaches is a
    /// subset of it.
    pub(super) fn releasable(&self, window: &[(usize, PreemptReason)], s: &Search) -> Vec<usize> {
        // Released so far per victim queue and flavor (few queues per window).
        let mut gone: Vec<(QueueId, u32, u64)> = Vec::new();
        let mut planned = Planned::default();
        let mut out = Vec::with_capacity(window.len());
        for &(k, reason) in window {
            let RunInfo {
                queue: q,
                flavor: fi,
                milli,
                ..
            } = self.victims.run[k];
            let slot = gone.iter().position(|g| g.0 == q && g.1 == fi);
            let before = slot.map_or(0, |s| gone[s].2);
            if reason == PreemptReason::Reclaim {
                if !self.keeps_guarantee_with(k, before)
                    || self.over_budget(k, &planned, s.budget).is_some()
                {
                    continue;
                }
                planned.add(q, self.victims.run[k].lost / 3600.0);
            }
            match slot {
                Some(s) => gone[s].2 += milli,
                None => gone.push((q, fi, milli)),
            }
            out.push(k);
        }
        out
    }

    /// The candidates that pass the bounds now (they only tighten as a search
    /// releases victims, so one that fails them now is never taken), with
    /// the first disruption budget that left one out.
    pub(super) fn screen(&self, candidates: &[(usize, PreemptReason)], s: &Search) -> Screened {
        Screened::of(
            candidates
                .iter()
                .map(|&(k, reason)| (k, self.screen_one(k, reason, s))),
        )
    }

    /// Whether candidate `k` passes the bounds before any victim is
    /// released: a reclaim leaves its queue its guarantee, and its loss
    /// fits its queue's disruption budget.
    pub(super) fn screen_one(&self, k: usize, reason: PreemptReason, s: &Search) -> Screen {
        self.screen_bounds(k, reason, s.budget)
    }

    /// [`Cycle::screen_one`] under `budget`.
    pub(super) fn screen_bounds(
        &self,
        k: usize,
        reason: PreemptReason,
        budget: Option<Budget>,
    ) -> Screen {
        if reason == PreemptReason::Reclaim && !self.keeps_guarantee(k) {
            return Screen::Guarantee;
        }
        if reason == PreemptReason::Reclaim
            && let Some(used) = self.over_budget(k, &Planned::default(), budget)
        {
            return Screen::Budget(self.victims.run[k].queue, used);
        }
        Screen::Kept
    }

    /// What queue `q`'s reclaims already took in the window, when candidate
    /// `k` beside what the search already `planned` to take from its queue
    /// would pass `budget` (the GPU-hours lost or the jobs stopped); `None`
    /// when it fits or no budget binds.
    pub(super) fn over_budget(
        &self,
        k: usize,
        planned: &Planned,
        budget: Option<Budget>,
    ) -> Option<Spent> {
        let budget = budget?;
        let q = self.victims.run[k].queue;
        let (hours, jobs) =
            self.history
                .disrupted(q, self.snap.now, self.snap.cfg.disruption_window);
        let (more_hours, more_jobs) = planned.of(q);
        let by_hours = budget
            .hours
            .is_some_and(|b| hours + more_hours + self.victims.run[k].lost / 3600.0 > b);
        let by_count = budget.jobs.is_some_and(|b| jobs + more_jobs + 1 > b);
        (by_hours || by_count).then_some(Spent {
            hours,
            jobs,
            by_count: !by_hours,
        })
    }

    /// (node, GPUs held there, candidate) for the candidates, by node, from
    /// the packed records; a candidate on several nodes adds one entry per
    /// allocation.
    /// Running job `k`'s node (u32::MAX: several or none) and GPUs there,
    /// read from its allocations on first use.
    pub(super) fn locate(&mut self, k: usize) -> u32 {
        if self.victims.run[k].node == NODE_UNKNOWN {
            let allocations = &self.snap.running[k].allocations;
            self.victims.run[k].node = match allocations.split_first() {
                Some((a, rest)) if rest.iter().all(|b| b.node == a.node) => a.node.0,
                _ => u32::MAX,
            };
            self.victims.run[k].gpus = allocations.iter().fold(0, |m, a| m | a.gpu_mask());
        }
        self.victims.run[k].node
    }

    pub(super) fn by_node(&mut self, candidates: &[usize]) -> Vec<(u32, u64, usize)> {
        let mut on: Vec<(u32, u64, usize)> = Vec::with_capacity(candidates.len());
        for &k in candidates {
            self.locate(k);
            let r = &self.victims.run[k];
            if r.node != u32::MAX {
                on.push((r.node, r.gpus, k));
            } else {
                on.extend(
                    self.snap.running[k]
                        .allocations
                        .iter()
                        .map(|a| (a.node.0, a.gpu_mask(), k)),
                );
            }
        }
        on.sort_unstable();
        on
    }

    /// The reclaim candidates shared by the entitled searches of flavor
    /// `fi`: the first eligible jobs of borrowing queues, each screened
    /// against the bounds once. Rebuilt when an admission or a preemption
    /// (`epoch`) may have changed any of it.
    pub(super) fn shared_window(&mut self, fi: u32, flavor: &str) -> Rc<SharedWindow> {
        if let Some(w) = self.victims.shared.get(&fi)
            && w.epoch == self.victims.epoch
        {
            return w.clone();
        }
        let list = self.reclaim_list(flavor);
        let mut stream = Vec::new();
        for k in list.iter().copied() {
            if stream.len() >= SHARED_STREAM {
                break;
            }
            let q = self.victims.run[k].queue;
            if self.victims.run[k].reclaim_eligible()
                && self.snap.queues.borrowing_at(q, fi as usize)
            {
                // Screened with the budgets, for the searches they bind.
                stream.push((
                    k,
                    q,
                    self.screen_bounds(k, PreemptReason::Reclaim, Budget::of(self.snap.cfg)),
                ));
            }
        }
        let w = Rc::new(SharedWindow {
            epoch: self.victims.epoch,
            stream,
        });
        self.victims.shared.insert(fi, w.clone());
        w
    }

    /// The window and screened candidates of an entitled search of `queue`
    /// with `own` candidates (cheapest first), built from the shared stream
    /// exactly as [`Cycle::find_victims`] builds them from the reclaim list;
    /// `None` when the stream is too short to tell.
    pub(super) fn window_from(
        &self,
        shared: &SharedWindow,
        own: &[(usize, PreemptReason)],
        queue: QueueId,
        s: &Search,
    ) -> Option<(Vec<(usize, PreemptReason)>, Screened)> {
        let others = shared
            .stream
            .iter()
            .filter(|s| s.1 != queue)
            .map(|&(k, _, screen)| match screen {
                Screen::Budget(..) if s.budget.is_none() => (k, Some(Screen::Kept)),
                _ => (k, Some(screen)),
            });
        // The own candidates are screened here (`None` in the merge).
        let (window, filled) = self.merge(own, None, others);
        // The stream ran out before the window filled: the reclaim list may
        // hold more than the stream kept.
        if !filled && shared.stream.len() >= SHARED_STREAM {
            return None;
        }
        let screened = Screened::of(window.iter().map(|&(k, reason, screen)| {
            (k, screen.unwrap_or_else(|| self.screen_one(k, reason, s)))
        }));
        let candidates = window
            .into_iter()
            .map(|(k, reason, _)| (k, reason))
            .collect();
        Some((candidates, screened))
    }

    /// Whether stopping every candidate could let job `i` start on `flavor`;
    /// when not, no subset of them helps and the search is skipped. Two
    /// necessary conditions, both cheap:
    /// - quota: quota only loosens as usage falls, so the job must pass it with
    ///   every candidate's usage released;
    /// - placement (a single task): only nodes where a candidate runs change,
    ///   so the task must pass the filters on one of them once every candidate
    ///   there stops, unless it already fits elsewhere (a job quota blocked
    ///   before placement was tried).
    ///
    /// Quota is tested first, as it is the cheaper. The tests are then
    /// repeated with the set the search would end with
    /// ([`Cycle::releasable`]), when smaller: releases only loosen quota and
    /// free capacity, so a set that does not help has no subset that does,
    /// and the search would fail.
    pub(super) fn could_help(
        &mut self,
        i: usize,
        flavor: &str,
        window: &[(usize, PreemptReason)],
        screened: &Screened,
        place_failed: bool,
        s: &mut Search,
    ) -> bool {
        if let Some(b) = screened.budget_block {
            s.budget_block.get_or_insert(b);
        }
        // Every candidate that passes the bounds now first: most searches
        // end there, and the set the search would end with is a subset.
        if !self.helps(i, flavor, &screened.kept, place_failed) {
            return false;
        }
        let last = self.releasable(window, s);
        let helps = last.len() == screened.kept.len() || self.helps(i, flavor, &last, place_failed);
        #[cfg(debug_assertions)]
        if !helps {
            debug_assert!(
                self.pick_victims(i, flavor, window, &mut s.clone())
                    .is_none(),
                "the search found victims where its last set does not help"
            );
        }
        helps
    }

    /// [`Cycle::could_help`]'s two tests with `candidates` released.
    pub(super) fn helps(
        &mut self,
        i: usize,
        flavor: &str,
        candidates: &[usize],
        place_failed: bool,
    ) -> bool {
        if candidates.is_empty() {
            return false;
        }
        // Quota first: the cheaper test.
        let fi = self.fidx(flavor);
        if self.snap.cfg.quotas && !flavor.is_empty() && fi != NO_FLAVOR {
            let f = fi as usize;
            // Released per queue: one charge up the tree per queue, not per job.
            let mut by_queue: Vec<(QueueId, i64)> = candidates
                .iter()
                .map(|&k| (self.victims.run[k].queue, self.victims.run[k].milli as i64))
                .collect();
            by_queue.sort_unstable_by_key(|&(q, _)| q);
            by_queue.dedup_by(|b, a| {
                let same = a.0 == b.0;
                if same {
                    a.1 += b.1;
                }
                same
            });
            for &(q, milli) in &by_queue {
                self.snap.queues.charge_at(q, f, -milli);
            }
            let ok = self.quota_ok(i, flavor).is_ok();
            for &(q, milli) in &by_queue {
                self.snap.queues.charge_at(q, f, milli);
            }
            if !ok {
                return false;
            }
        }
        let w = &self.snap.pending[i];
        let milli = self.pend.pend_milli[i];
        if milli == 0 || w.job.task_count() != 1 {
            return true;
        }
        let job = self.job_on(i, flavor);
        let req = &job.groups[0].request;
        let on = self.by_node(candidates);
        let on_candidate_node = on.chunk_by(|a, b| a.0 == b.0).any(|at| {
            let node = crate::ids::NodeId(at[0].0);
            // From the packed records first, before reading any allocation.
            let gpus = at.iter().fold(0u64, |m, x| m | x.1);
            if !self.snap.placer.may_fit_after_release(node, gpus, req) {
                return false;
            }
            let mut ks: Vec<usize> = at.iter().map(|x| x.2).collect();
            ks.sort_unstable();
            ks.dedup();
            let freed: Vec<&Allocation> = ks
                .iter()
                .flat_map(|&k| &self.snap.running[k].allocations)
                .filter(|a| a.node == node)
                .collect();
            self.snap
                .placer
                .fits_after_release(node, &freed, req, &job.constraints)
        });
        // Quota blocked the job before placement was tried: it may fit
        // elsewhere as things are (then only quota needs the victims).
        on_candidate_node
            || !(place_failed || self.max_free(flavor) < milli || !self.fits_committed(i, flavor))
    }
}
