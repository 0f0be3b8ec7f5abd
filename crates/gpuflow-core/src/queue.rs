//! Queues and quota: a tree of queues (organisation → team → project is the
//! usual shape) with, per flavor (GPU model), a guaranteed quota, a borrowing
//! limit, a lending limit and a hard cap; a weight; per-user limits; a state;
//! an optional budget. Quantities are milli-GPU.
//!
//! Quota semantics, per flavor, checked at every queue from the job's leaf up:
//! - usage never exceeds the cap, nor guaranteed + borrowing limit;
//! - at each parent, every child occupies the larger of its usage and its
//!   *reserved* quota (guaranteed − lending limit: the part it never lends), and
//!   the children together fit the parent's own limit (the cluster's capacity of
//!   the flavor at the top). So a queue may run on idle guaranteed quota of its
//!   siblings — borrowing — but never on what they keep for themselves.
//!
//! A queue using more than its guarantee is *borrowing*; its jobs above the
//! guarantee may be reclaimed by preemption when a sibling needs its own
//! guarantee back (see [`crate::schedule`]).

use std::collections::BTreeMap;

/// Identifies a queue: its index in [`Queues::list`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QueueId(pub u32);

/// Whether a queue takes and starts work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueueState {
    /// Accepts and starts work.
    #[default]
    Open,
    /// Accepts work, starts nothing.
    Held,
    /// Accepts nothing new, lets running work finish.
    Draining,
}

/// One flavor's quota of a queue, in milli-GPU. `None`: no limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FlavorQuota {
    pub guaranteed: u64,
    /// How far above its guarantee the queue may go by borrowing.
    pub borrow_limit: Option<u64>,
    /// How much of its unused guarantee others may borrow (the rest is reserved).
    pub lend_limit: Option<u64>,
    /// Hard cap on usage.
    pub cap: Option<u64>,
}

impl FlavorQuota {
    pub fn guaranteed(milli: u64) -> FlavorQuota {
        FlavorQuota {
            guaranteed: milli,
            ..FlavorQuota::default()
        }
    }

    /// The part of the guarantee never lent.
    pub fn reserved(&self) -> u64 {
        self.lend_limit
            .map_or(0, |l| self.guaranteed.saturating_sub(l))
    }

    /// The most the queue may use.
    pub fn limit(&self) -> u64 {
        let by_borrow = self
            .borrow_limit
            .map_or(u64::MAX, |b| self.guaranteed.saturating_add(b));
        by_borrow.min(self.cap.unwrap_or(u64::MAX))
    }
}

/// Per-user limits inside a queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct UserLimits {
    /// Milli-GPU one user may hold in the queue.
    pub max_gpu_milli: Option<u64>,
    pub max_running: Option<u32>,
}

/// What a queue does when its budget runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BudgetExhausted {
    /// Stop borrowing; work within the guarantee still starts.
    #[default]
    StopBorrowing,
    /// Start nothing new.
    StopAdmitting,
}

/// A GPU-hour budget for the current period.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Budget {
    pub gpu_hours: f64,
    pub used_gpu_hours: f64,
    /// Once this share of the budget is used, the fair-share weight starts to
    /// fall linearly, down to `min_weight_factor` × weight when it is all used.
    pub taper_from: f64,
    pub min_weight_factor: f64,
    pub when_exhausted: BudgetExhausted,
}

impl Budget {
    pub fn used_share(&self) -> f64 {
        if self.gpu_hours <= 0.0 {
            1.0
        } else {
            (self.used_gpu_hours / self.gpu_hours).max(0.0)
        }
    }

    pub fn exhausted(&self) -> bool {
        self.used_share() >= 1.0
    }

    /// The factor applied to the queue's weight.
    pub fn weight_factor(&self) -> f64 {
        let u = self.used_share();
        if u <= self.taper_from {
            1.0
        } else if u >= 1.0 {
            self.min_weight_factor
        } else {
            let t = (u - self.taper_from) / (1.0 - self.taper_from).max(f64::MIN_POSITIVE);
            1.0 - t * (1.0 - self.min_weight_factor)
        }
    }
}

/// The key of a spec's quota entry for every flavor without its own.
pub const EVERY_FLAVOR: &str = "*";

/// The quota entry that applies to `flavor` (a GPU model): its own; else
/// the longest entry that names the model's family, the model up to a `-`
/// (`H100` for `H100-80GB-HBM3`, `A100-80GB` for `A100-80GB-PCIe`), which
/// applies to each model of the family on its own; else [`EVERY_FLAVOR`]'s.
pub fn quota_entry<'a, T>(entries: &'a BTreeMap<String, T>, flavor: &str) -> Option<&'a T> {
    quota_key(entries, flavor).map(|(_, e)| e)
}

/// [`quota_entry`] with the key that matched.
pub fn quota_key<'a, T>(
    entries: &'a BTreeMap<String, T>,
    flavor: &str,
) -> Option<(&'a str, &'a T)> {
    if let Some((k, e)) = entries.get_key_value(flavor) {
        return Some((k, e));
    }
    entries
        .iter()
        .filter(|(k, _)| {
            k.as_str() != EVERY_FLAVOR
                && flavor.len() > k.len()
                && flavor.starts_with(k.as_str())
                && flavor.as_bytes()[k.len()] == b'-'
        })
        .max_by_key(|(k, _)| k.len())
        .or_else(|| entries.get_key_value(EVERY_FLAVOR))
        .map(|(k, e)| (k.as_str(), e))
}

/// A queue.
#[derive(Clone, Debug, PartialEq)]
pub struct Queue {
    pub name: String,
    pub parent: Option<QueueId>,
    pub weight: f64,
    pub state: QueueState,
    /// Quota per flavor; a flavor not listed has guarantee 0 and no limits.
    pub quotas: BTreeMap<String, FlavorQuota>,
    /// Flavors to try, in order, for jobs that accept several (the fallback list);
    /// empty: the order of `quotas`.
    pub flavor_order: Vec<String>,
    pub user_limits: UserLimits,
    pub budget: Option<Budget>,
}

impl Queue {
    pub fn new(name: &str, parent: Option<QueueId>) -> Queue {
        Queue {
            name: name.to_string(),
            parent,
            weight: 1.0,
            state: QueueState::Open,
            quotas: BTreeMap::new(),
            flavor_order: Vec::new(),
            user_limits: UserLimits::default(),
            budget: None,
        }
    }

    pub fn quota(&self, flavor: &str) -> FlavorQuota {
        self.quotas.get(flavor).copied().unwrap_or_default()
    }

    /// Sets the quota on each of `flavors` from a spec's entries: the
    /// flavor's own entry, else the entry [`EVERY_FLAVOR`], converted by
    /// `quota`; a flavor with neither gets none.
    pub fn set_quotas<'f, T>(
        &mut self,
        flavors: impl IntoIterator<Item = &'f String>,
        entries: &BTreeMap<String, T>,
        quota: impl Fn(&T) -> FlavorQuota,
    ) {
        for flavor in flavors {
            if let Some(e) = quota_entry(entries, flavor) {
                self.quotas.insert(flavor.clone(), quota(e));
            }
        }
    }

    /// The weight after the budget's taper.
    pub fn effective_weight(&self) -> f64 {
        self.weight * self.budget.map_or(1.0, |b| b.weight_factor())
    }

    /// Whether the budget forbids borrowing or admitting.
    pub fn budget_blocks(&self, borrowing: bool) -> Option<BudgetExhausted> {
        let b = self.budget?;
        if !b.exhausted() {
            return None;
        }
        match b.when_exhausted {
            BudgetExhausted::StopAdmitting => Some(BudgetExhausted::StopAdmitting),
            BudgetExhausted::StopBorrowing if borrowing => Some(BudgetExhausted::StopBorrowing),
            BudgetExhausted::StopBorrowing => None,
        }
    }
}

/// Why a quota check failed, at which queue.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuotaBlock {
    /// Usage would pass the queue's cap.
    Cap {
        queue: QueueId,
        usage: u64,
        cap: u64,
    },
    /// Usage would pass guaranteed + borrowing limit.
    BorrowLimit {
        queue: QueueId,
        usage: u64,
        limit: u64,
    },
    /// The parent has no room left: siblings use or reserve it.
    NoLendableCapacity {
        parent: Option<QueueId>,
        needed: u64,
        available: u64,
    },
    /// The budget is used up and the queue may not borrow or admit.
    Budget {
        queue: QueueId,
        exhausted: BudgetExhausted,
    },
}

/// The queue tree with its usage per flavor.
#[derive(Clone, Debug, PartialEq)]
pub struct Queues {
    list: Vec<Queue>,
    children: Vec<Vec<QueueId>>,
    top: Vec<QueueId>,
    /// Usage per queue (subtree total) per flavor index, milli-GPU.
    usage: Vec<Vec<u64>>,
    /// GPUs of each flavor in the cluster, milli-GPU: the top level's limit.
    capacity: BTreeMap<String, u64>,
    /// The flavors in name order; a flavor's index is its position here.
    flavor_names: Vec<String>,
    /// Each queue's quota per flavor index (a copy of `Queue::quotas`, kept in
    /// step by [`Queues::update`]), so that quota checks index instead of search.
    quotas: Vec<Vec<FlavorQuota>>,
    /// `capacity` by flavor index.
    capacity_by_index: Vec<u64>,
    /// Per parent (index `list.len()`: the top level) and flavor index, what
    /// its children take of its room: the sum of max(usage, reserved). Kept
    /// in step by [`Queues::charge_at`] and [`Queues::update`], so that a
    /// quota check reads one figure per level instead of summing siblings.
    taken: Vec<Vec<u64>>,
    /// Per flavor index: how many leaf queues use more than their
    /// guarantee. Kept in step by [`Queues::charge_at`] and
    /// [`Queues::update`].
    borrowing_leaves: Vec<u32>,
}

/// What is wrong with a queue tree.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueError {
    #[error(
        "queue {queue} names parent {parent}, which is not an earlier queue: list parents before children"
    )]
    BadParent { queue: String, parent: u32 },
    #[error("queue name {0} appears twice: queue names must be unique")]
    Duplicate(String),
    #[error("queue {queue}: weight {weight} must be a positive number")]
    BadWeight { queue: String, weight: String },
}

impl Queues {
    /// Builds the tree; parents must come before their children.
    ///
    /// # Errors
    /// On a parent that is not an earlier queue, a repeated name or a bad weight.
    pub fn new(list: Vec<Queue>, capacity: BTreeMap<String, u64>) -> Result<Queues, QueueError> {
        let mut children = vec![Vec::new(); list.len()];
        let mut top = Vec::new();
        let mut names = std::collections::BTreeSet::new();
        for (i, q) in list.iter().enumerate() {
            if !names.insert(q.name.as_str()) {
                return Err(QueueError::Duplicate(q.name.clone()));
            }
            if !(q.weight.is_finite() && q.weight > 0.0) {
                return Err(QueueError::BadWeight {
                    queue: q.name.clone(),
                    weight: q.weight.to_string(),
                });
            }
            match q.parent {
                Some(p) if (p.0 as usize) < i => children[p.0 as usize].push(QueueId(i as u32)),
                Some(p) => {
                    return Err(QueueError::BadParent {
                        queue: q.name.clone(),
                        parent: p.0,
                    });
                }
                None => top.push(QueueId(i as u32)),
            }
        }
        let flavor_names: Vec<String> = capacity.keys().cloned().collect();
        let usage = vec![vec![0; flavor_names.len()]; list.len()];
        let quotas = list
            .iter()
            .map(|q| flavor_names.iter().map(|f| q.quota(f)).collect())
            .collect();
        let capacity_by_index = flavor_names.iter().map(|f| capacity[f]).collect();
        let mut queues = Queues {
            taken: vec![vec![0; flavor_names.len()]; list.len() + 1],
            borrowing_leaves: vec![0; flavor_names.len()],
            list,
            children,
            top,
            usage,
            capacity,
            flavor_names,
            quotas,
            capacity_by_index,
        };
        for slot in 0..queues.taken.len() {
            queues.retake(slot);
        }
        Ok(queues)
    }

    /// The `taken` slot of a parent.
    fn slot(&self, parent: Option<QueueId>) -> usize {
        parent.map_or(self.list.len(), |p| p.0 as usize)
    }

    /// Recomputes what the children of the parent in `slot` take.
    fn retake(&mut self, slot: usize) {
        let children = if slot == self.list.len() {
            &self.top
        } else {
            &self.children[slot]
        };
        for f in 0..self.flavor_names.len() {
            self.taken[slot][f] = children
                .iter()
                .map(|&c| self.usage[c.0 as usize][f].max(self.quotas[c.0 as usize][f].reserved()))
                .sum();
        }
    }

    pub fn list(&self) -> &[Queue] {
        &self.list
    }

    pub fn get(&self, id: QueueId) -> &Queue {
        &self.list[id.0 as usize]
    }

    /// Changes a queue (state, weight, quotas, limits, budget); its parent and
    /// usage stay as they are.
    pub fn update(&mut self, id: QueueId, change: impl FnOnce(&mut Queue)) {
        let q = &mut self.list[id.0 as usize];
        let parent = q.parent;
        change(q);
        q.parent = parent;
        self.quotas[id.0 as usize] = self.flavor_names.iter().map(|f| q.quota(f)).collect();
        self.retake(self.slot(parent));
        for f in 0..self.flavor_names.len() {
            self.borrowing_leaves[f] = (0..self.list.len() as u32)
                .map(QueueId)
                .filter(|&q| self.is_leaf(q) && self.borrowing_at(q, f))
                .count() as u32;
        }
    }

    /// A flavor's index for the `*_at` methods (its position in name order),
    /// or `None` for a flavor the cluster does not have.
    pub fn flavor_index(&self, flavor: &str) -> Option<usize> {
        self.flavor_names.iter().position(|f| f == flavor)
    }

    /// [`Queues::usage`] by flavor index.
    pub fn usage_at(&self, id: QueueId, f: usize) -> u64 {
        self.usage[id.0 as usize][f]
    }

    /// The queue's quota of the flavor at index `f`.
    pub fn quota_at(&self, id: QueueId, f: usize) -> FlavorQuota {
        self.quotas[id.0 as usize][f]
    }

    pub fn by_name(&self, name: &str) -> Option<QueueId> {
        self.list
            .iter()
            .position(|q| q.name == name)
            .map(|i| QueueId(i as u32))
    }

    pub fn children(&self, id: Option<QueueId>) -> &[QueueId] {
        match id {
            Some(q) => &self.children[q.0 as usize],
            None => &self.top,
        }
    }

    pub fn is_leaf(&self, id: QueueId) -> bool {
        self.children[id.0 as usize].is_empty()
    }

    /// The queue and its ancestors, leaf first.
    pub fn path(&self, id: QueueId) -> Vec<QueueId> {
        let mut out = vec![id];
        let mut cur = self.get(id).parent;
        while let Some(p) = cur {
            out.push(p);
            cur = self.get(p).parent;
        }
        out
    }

    pub fn usage(&self, id: QueueId, flavor: &str) -> u64 {
        self.flavor_index(flavor)
            .map_or(0, |f| self.usage[id.0 as usize][f])
    }

    pub fn capacity(&self, flavor: &str) -> u64 {
        self.capacity.get(flavor).copied().unwrap_or(0)
    }

    pub fn flavors(&self) -> impl Iterator<Item = &String> {
        self.capacity.keys()
    }

    /// Adds (or, negative, removes) usage along the queue's path.
    /// Usage of a flavor the cluster does not have is not tracked.
    pub fn charge(&mut self, id: QueueId, flavor: &str, milli: i64) {
        if let Some(f) = self.flavor_index(flavor) {
            self.charge_at(id, f, milli);
        }
    }

    /// [`Queues::charge`] by flavor index.
    pub fn charge_at(&mut self, id: QueueId, f: usize, milli: i64) {
        let was = self.is_leaf(id) && self.borrowing_at(id, f);
        let mut cur = Some(id);
        while let Some(q) = cur {
            let reserved = self.quotas[q.0 as usize][f].reserved();
            let u = &mut self.usage[q.0 as usize][f];
            let before = (*u).max(reserved);
            *u = (*u as i64 + milli).max(0) as u64;
            let after = (*u).max(reserved);
            let parent = self.list[q.0 as usize].parent;
            let slot = self.slot(parent);
            let t = &mut self.taken[slot][f];
            *t = *t - before + after;
            cur = parent;
        }
        let is = self.is_leaf(id) && self.borrowing_at(id, f);
        let n = &mut self.borrowing_leaves[f];
        *n = *n + u32::from(is) - u32::from(was);
    }

    /// How many leaf queues use more than their guarantee of the flavor at
    /// index `f`.
    pub fn borrowing_leaves_at(&self, f: usize) -> u32 {
        self.borrowing_leaves[f]
    }

    /// Whether the queue is using more than its guarantee of the flavor.
    pub fn borrowing(&self, id: QueueId, flavor: &str) -> bool {
        self.flavor_index(flavor)
            .is_some_and(|f| self.borrowing_at(id, f))
    }

    /// [`Queues::borrowing`] by flavor index.
    pub fn borrowing_at(&self, id: QueueId, f: usize) -> bool {
        self.usage[id.0 as usize][f] > self.quotas[id.0 as usize][f].guaranteed
    }

    /// The limit a parent gives its children: its own limit, or the cluster's
    /// capacity of the flavor at the top.
    fn room(&self, parent: Option<QueueId>, f: usize) -> u64 {
        match parent {
            Some(p) => self.quotas[p.0 as usize][f]
                .limit()
                .min(self.room(self.list[p.0 as usize].parent, f)),
            None => self.capacity_by_index[f],
        }
    }

    /// Checks that `milli` more of `flavor` fits the quota of `leaf` and every
    /// ancestor; `Ok` or the first block found, leaf first. A flavor the
    /// cluster does not have never fits.
    pub fn fits(&self, leaf: QueueId, flavor: &str, milli: u64) -> Result<(), QuotaBlock> {
        let Some(f) = self.flavor_index(flavor) else {
            return Err(QuotaBlock::NoLendableCapacity {
                parent: None,
                needed: milli,
                available: 0,
            });
        };
        self.fits_at(leaf, f, milli)
    }

    /// [`Queues::fits`] by flavor index.
    pub fn fits_at(&self, leaf: QueueId, f: usize, milli: u64) -> Result<(), QuotaBlock> {
        let mut cur = Some(leaf);
        while let Some(q) = cur {
            let queue = &self.list[q.0 as usize];
            let quota = self.quotas[q.0 as usize][f];
            let used = self.usage[q.0 as usize][f];
            let after = used + milli;
            if let Some(exhausted) = queue.budget_blocks(after > quota.guaranteed) {
                return Err(QuotaBlock::Budget {
                    queue: q,
                    exhausted,
                });
            }
            if let Some(cap) = quota.cap
                && after > cap
            {
                return Err(QuotaBlock::Cap {
                    queue: q,
                    usage: after,
                    cap,
                });
            }
            if after > quota.limit() {
                return Err(QuotaBlock::BorrowLimit {
                    queue: q,
                    usage: after,
                    limit: quota.limit(),
                });
            }
            // The parent's room: every child takes max(usage, reserved).
            let parent = queue.parent;
            let room = self.room(parent, f);
            let taken = self.taken[self.slot(parent)][f] - used.max(quota.reserved())
                + after.max(quota.reserved());
            debug_assert_eq!(
                taken,
                self.children(parent)
                    .iter()
                    .map(|&c| {
                        let u = self.usage[c.0 as usize][f] + if c == q { milli } else { 0 };
                        u.max(self.quotas[c.0 as usize][f].reserved())
                    })
                    .sum::<u64>(),
                "taken out of step"
            );
            if taken > room {
                let others = taken - after.max(quota.reserved());
                return Err(QuotaBlock::NoLendableCapacity {
                    parent,
                    needed: milli,
                    available: room.saturating_sub(others).saturating_sub(used),
                });
            }
            cur = parent;
        }
        Ok(())
    }

    /// Dominant share of a queue: the largest, over flavors, of its usage over
    /// the cluster's capacity, divided by its effective weight.
    pub fn dominant_share(&self, id: QueueId) -> f64 {
        let w = self.get(id).effective_weight().max(1e-9);
        self.flavor_names
            .iter()
            .enumerate()
            .map(|(f, _)| (self.usage[id.0 as usize][f], self.capacity_by_index[f]))
            .filter(|(_, c)| *c > 0)
            .map(|(u, c)| u as f64 / c as f64)
            .fold(0.0, f64::max)
            / w
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_quota_named_by_model_family_applies_to_each_model_of_it() {
        let entries: BTreeMap<String, u32> = [("H100", 8), ("A100-80GB", 2), ("*", 1)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let q = |f: &str| quota_entry(&entries, f).copied();
        assert_eq!(q("H100-80GB-HBM3"), Some(8));
        assert_eq!(q("H100"), Some(8));
        assert_eq!(q("A100-80GB-PCIe"), Some(2));
        // A family is a whole part of the name, not any prefix of it.
        assert_eq!(q("H1000"), Some(1));
        assert_eq!(q("A100-40GB"), Some(1));
        let none: BTreeMap<String, u32> = [("H100".to_string(), 8)].into_iter().collect();
        assert_eq!(quota_entry(&none, "A10"), None);
    }

    use super::*;

    fn tree() -> Queues {
        // org ─ team-a (guarantee 4, lends 2 of it) ─ a-proj
        //     └ team-b (guarantee 4, may borrow 2)
        let mut org = Queue::new("org", None);
        org.quotas
            .insert("H100".into(), FlavorQuota::guaranteed(8000));
        let mut a = Queue::new("team-a", Some(QueueId(0)));
        a.quotas.insert(
            "H100".into(),
            FlavorQuota {
                guaranteed: 4000,
                lend_limit: Some(2000),
                ..Default::default()
            },
        );
        let mut b = Queue::new("team-b", Some(QueueId(0)));
        b.quotas.insert(
            "H100".into(),
            FlavorQuota {
                guaranteed: 4000,
                borrow_limit: Some(2000),
                ..Default::default()
            },
        );
        let mut ap = Queue::new("a-proj", Some(QueueId(1)));
        ap.quotas
            .insert("H100".into(), FlavorQuota::guaranteed(4000));
        Queues::new(
            vec![org, a, b, ap],
            BTreeMap::from([("H100".to_string(), 8000)]),
        )
        .unwrap()
    }

    #[test]
    fn borrowing_stops_at_the_lending_and_borrowing_limits() {
        let mut q = tree();
        let b = QueueId(2);
        assert_eq!(q.fits(b, "H100", 4000), Ok(()));
        // Borrowing 2 of team-a's 4 idle: team-a lends at most 2.
        assert_eq!(q.fits(b, "H100", 6000), Ok(()));
        assert!(matches!(
            q.fits(b, "H100", 7000),
            Err(QuotaBlock::BorrowLimit { .. })
        ));
        q.charge(b, "H100", 6000);
        assert!(q.borrowing(b, "H100"));
        // team-a keeps its reserved 2 and may use the 2 it lent only when they are free.
        let ap = QueueId(3);
        assert_eq!(q.fits(ap, "H100", 2000), Ok(()));
        assert!(matches!(
            q.fits(ap, "H100", 3000),
            Err(QuotaBlock::NoLendableCapacity { .. })
        ));
        q.charge(b, "H100", -2000);
        assert_eq!(q.fits(ap, "H100", 4000), Ok(()));
        assert_eq!(
            q.usage(QueueId(0), "H100"),
            4000,
            "usage rolls up to the parent"
        );
    }

    #[test]
    fn a_changed_lending_limit_takes_effect_on_the_next_check() {
        let mut q = tree();
        let (b, ap) = (QueueId(2), QueueId(3));
        q.charge(b, "H100", 6000);
        // team-a reserves 2 of its 4 (lends at most 2): a-proj gets 2.
        assert_eq!(q.fits(ap, "H100", 2000), Ok(()));
        // Lending nothing: team-a reserves all 4, which team-b's 6 overlap.
        q.update(QueueId(1), |a| {
            a.quotas.get_mut("H100").unwrap().lend_limit = Some(0);
        });
        assert!(matches!(
            q.fits(ap, "H100", 2000),
            Err(QuotaBlock::NoLendableCapacity { .. })
        ));
        q.charge(b, "H100", -2000);
        assert_eq!(q.fits(ap, "H100", 4000), Ok(()));
        assert!(matches!(
            q.fits(b, "H100", 1000),
            Err(QuotaBlock::NoLendableCapacity { .. })
        ));
    }

    #[test]
    fn caps_and_budgets_block_with_their_reason() {
        let mut q = tree();
        q.update(QueueId(2), |t| {
            t.quotas.get_mut("H100").unwrap().cap = Some(3000)
        });
        assert_eq!(
            q.fits(QueueId(2), "H100", 4000),
            Err(QuotaBlock::Cap {
                queue: QueueId(2),
                usage: 4000,
                cap: 3000
            })
        );
        let budget = Budget {
            gpu_hours: 100.0,
            used_gpu_hours: 100.0,
            taper_from: 0.5,
            min_weight_factor: 0.25,
            when_exhausted: BudgetExhausted::StopBorrowing,
        };
        q.update(QueueId(3), |t| t.budget = Some(budget));
        assert_eq!(
            q.fits(QueueId(3), "H100", 4000),
            Ok(()),
            "within the guarantee"
        );
        assert!(matches!(
            q.fits(QueueId(3), "H100", 5000),
            Err(QuotaBlock::Budget { .. })
        ));
        assert_eq!(q.get(QueueId(3)).effective_weight(), 0.25);
        let half = Budget {
            used_gpu_hours: 75.0,
            ..budget
        };
        assert_eq!(half.weight_factor(), 1.0 - 0.5 * 0.75);
    }

    #[test]
    fn bad_trees_are_refused() {
        let e = Queues::new(vec![Queue::new("a", Some(QueueId(0)))], BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("list parents before children"));
        let mut w = Queue::new("w", None);
        w.weight = 0.0;
        assert!(Queues::new(vec![w], BTreeMap::new()).is_err());
    }
}
