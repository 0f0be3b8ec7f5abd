//! Fair share: each queue's share (its dominant share of the cluster
//! blended with its decayed usage, over its effective weight), each
//! leaf's key along its path, and each queue's share of its siblings'
//! decayed usage, computed when first asked and kept for the cycle (a
//! queue's share is forgotten along its path when it is charged). The
//! cycle asks [`FairShare`] through a [`View`] of what it reads.

use super::*;

/// What fair share reads of the cycle: the queues (their usage changes as
/// jobs are admitted), the decayed history and the settings.
pub(super) struct View<'v> {
    pub(super) queues: &'v Queues,
    pub(super) history: &'v History,
    pub(super) cfg: &'v Config,
}

impl FairShare {
    /// The fair-share key of a queue: current dominant share blended with
    /// decayed historical usage, both over the effective weight.
    /// [`FairShare::compute_share`], remembered until the queue's usage changes.
    pub(super) fn share(&self, v: &View<'_>, q: QueueId) -> f64 {
        let cached = self.shares.borrow().get(q.0 as usize).copied().flatten();
        cached.unwrap_or_else(|| {
            let v = self.compute_share(v, q);
            let mut c = self.shares.borrow_mut();
            if c.len() <= q.0 as usize {
                c.resize(q.0 as usize + 1, None);
            }
            c[q.0 as usize] = Some(v);
            v
        })
    }

    /// A queue's share of its siblings' decayed usage over its share of
    /// their weight (below 1: it has had less than its share).
    pub(super) fn history_share(&self, v: &View<'_>, q: QueueId) -> f64 {
        let i = q.0 as usize;
        if let Some(&v) = self.history_shares.borrow().get(i)
            && !v.is_nan()
        {
            return v;
        }
        let (used, weights) = self.sibling_history(v, v.queues.get(q).parent);
        let weight = v.queues.get(q).effective_weight();
        let v = if used > 0.0 && weight > 0.0 {
            v.history.usage.get(&q).copied().unwrap_or(0.0) / used / (weight / weights)
        } else {
            0.0
        };
        let mut cache = self.history_shares.borrow_mut();
        if cache.len() <= i {
            cache.resize(i + 1, f64::NAN);
        }
        cache[i] = v;
        v
    }

    /// The decayed usage and the effective weight of `parent`'s children.
    fn sibling_history(&self, v: &View<'_>, parent: Option<QueueId>) -> (f64, f64) {
        if let Some(&sums) = self.sibling_history.borrow().get(&parent) {
            return sums;
        }
        let children = v.queues.children(parent);
        let used: f64 = children
            .iter()
            .map(|c| v.history.usage.get(c).copied().unwrap_or(0.0))
            .sum();
        let weights: f64 = children
            .iter()
            .map(|&c| v.queues.get(c).effective_weight())
            .sum();
        self.sibling_history
            .borrow_mut()
            .insert(parent, (used, weights));
        (used, weights)
    }

    fn compute_share(&self, v: &View<'_>, q: QueueId) -> f64 {
        let current = v.queues.dominant_share(q);
        let (total_hist, _) = self.sibling_history(v, v.queues.get(q).parent);
        let hist = if total_hist > 0.0 {
            v.history.usage.get(&q).copied().unwrap_or(0.0)
                / total_hist
                / v.queues.get(q).effective_weight().max(1e-9)
        } else {
            0.0
        };
        (1.0 - v.cfg.history_weight) * current + v.cfg.history_weight * hist
    }

    /// The leaf's key: the shares along its path from the top, compared in order.
    pub(super) fn leaf_key(&self, v: &View<'_>, leaf: QueueId) -> LeafKey {
        let mut key = LeafKey::new();
        let mut cur = Some(leaf);
        while let Some(q) = cur {
            key.push(OrdF64(self.share(v, q)));
            cur = v.queues.get(q).parent;
        }
        key.reverse();
        key
    }

    /// Forgets the shares along `q`'s path (its usage changed; the
    /// siblings' history sums do not change within a cycle).
    pub(super) fn charged(&self, queues: &Queues, q: QueueId) {
        let mut c = self.shares.borrow_mut();
        for q in queues.path(q) {
            if let Some(x) = c.get_mut(q.0 as usize) {
                *x = None;
            }
        }
    }
}

impl Cycle<'_> {
    /// What fair share reads now.
    pub(super) fn fair_view(&self) -> View<'_> {
        View {
            queues: self.snap.queues,
            history: self.history,
            cfg: self.snap.cfg,
        }
    }

    /// [`FairShare::history_share`] now.
    pub(super) fn history_share(&self, q: QueueId) -> f64 {
        self.fair.history_share(&self.fair_view(), q)
    }

    /// [`FairShare::leaf_key`] now.
    pub(super) fn leaf_key(&self, leaf: QueueId) -> LeafKey {
        self.fair.leaf_key(&self.fair_view(), leaf)
    }
}
