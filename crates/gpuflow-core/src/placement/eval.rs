//! Evaluating one node for one class of tasks: the static filters
//! (answered once per static shape and request), the CPU and memory
//! filter, and the GPUs it could give, with the reason when it cannot.

use super::*;

/// The static filters' answer for a node of static shape `shape` and
/// request `rid`, run once per pair for the memo's life (cleared when full).
pub(super) fn static_once(
    memo: &mut FxHashMap<(u32, u32), Result<(), Reject>>,
    shape: u32,
    rid: u32,
    view: &NodeView,
) -> Result<(), Reject> {
    if memo.len() >= MAX_CACHE {
        memo.clear();
    }
    *memo
        .entry((shape, rid))
        .or_insert_with(|| filters::run_static(view))
}

impl Placer {
    /// The evaluation of `class` for request `rid`. A rejection is read
    /// from its byte ([`Placer::verdicts`]); a fit from the cache, as its
    /// score reads the mix. Either is evaluated on first use.
    pub(super) fn eval_class(
        &mut self,
        class: ClassId,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
    ) -> Eval {
        let code = self.verdict_code(class, rid);
        if code > FITS {
            return Eval::Reject(self.rejects[(code - FITS - 1) as usize]);
        }
        if let Some(e) = self.cache.get(&(class, rid)) {
            return *e;
        }
        let rep = self.cluster.class_representative(class);
        // The evaluation is remembered, so a random pick in it must not
        // depend on when it was first made: it is drawn from the class's
        // state and the request instead of the placer's stream.
        let seed = self.seed ^ self.cluster.class_hash(class) ^ self.request_hash[rid as usize];
        let e = self.eval_node(rep, req, cons, None, Some(seed), Some(rid));
        match e {
            Eval::Fit { .. } => {
                if self.cache.len() >= MAX_CACHE {
                    self.cache.clear();
                }
                self.cache.insert((class, rid), e);
                if code == UNKNOWN {
                    self.set_verdict(class, rid, FITS);
                }
            }
            Eval::Reject(x) => {
                let k = match self.rejects.iter().position(|&y| y == x) {
                    Some(k) => k,
                    None => {
                        self.rejects.push(x);
                        self.rejects.len() - 1
                    }
                };
                self.set_verdict(class, rid, FITS + 1 + k as u8);
            }
        }
        e
    }

    /// Whether `class` fits request `rid`: `None` when it does, else the
    /// rejection. Reads only the byte once it is known.
    pub(super) fn verdict(
        &mut self,
        class: ClassId,
        rid: u32,
        req: &TaskRequest,
        cons: &Constraints,
    ) -> Option<Reject> {
        match self.verdict_code(class, rid) {
            FITS => None,
            UNKNOWN => match self.eval_class(class, rid, req, cons) {
                Eval::Fit { .. } => None,
                Eval::Reject(x) => Some(x),
            },
            code => Some(self.rejects[(code - FITS - 1) as usize]),
        }
    }

    /// The byte kept for (`rid`, `class`): [`UNKNOWN`] when none is.
    fn verdict_code(&self, class: ClassId, rid: u32) -> u8 {
        self.verdicts
            .get(rid as usize)
            .and_then(|v| v.get(class.0 as usize))
            .copied()
            .unwrap_or(UNKNOWN)
    }

    fn set_verdict(&mut self, class: ClassId, rid: u32, code: u8) {
        let (r, c) = (rid as usize, class.0 as usize);
        if self.verdicts.len() <= r {
            self.verdicts.resize_with(r + 1, Vec::new);
        }
        let slots = self.cluster.class_slots().max(c + 1);
        let v = &mut self.verdicts[r];
        if v.len() <= c {
            self.verdict_bytes += slots - v.len();
            v.resize(slots, UNKNOWN);
        }
        v[c] = code;
        if self.verdict_bytes > MAX_VERDICT_BYTES {
            self.verdicts.clear();
            self.verdict_bytes = 0;
        }
    }

    /// Stages 2-4 for one node: filters, GPU picks, state scorers.
    /// `pick_seed`: where random GPU picks come from (the placer's stream
    /// when `None`); `rid`: the interned request, when the static filters'
    /// answer may be remembered per static shape (no NVLink scope).
    pub(super) fn eval_node(
        &mut self,
        id: NodeId,
        req: &TaskRequest,
        cons: &Constraints,
        nvlink: Option<&str>,
        pick_seed: Option<u64>,
        rid: Option<u32>,
    ) -> Eval {
        let mut local = pick_seed.map(SplitMix64::new);
        let node = self.cluster.node(id);
        let usage = self.cluster.usage(id);
        let view = NodeView {
            node,
            usage,
            islands: self.cluster.islands(id),
            req,
            cons,
            nvlink_scope: nvlink,
            reserved: self.cluster.reservation_slot(id),
        };
        let shape = self.cluster.shape_id(id);
        let filtered = match rid {
            // The filters that read only the static shape answer once per shape.
            Some(rid) => static_once(&mut self.static_memo, shape, rid, &view)
                .and_then(|()| filters::run_usage(&view)),
            None => filters::run(&view),
        };
        if let Err(r) = filtered {
            return Eval::Reject(r);
        }
        let s = &mut self.scratch;
        filters::picks(&view, &mut s.picks);
        if s.picks.is_empty() {
            return Eval::Reject(Reject::GpuCapacity);
        }
        free_milli(node, usage, &mut s.free);
        let uses_frag =
            self.policy.uses(Scorer::Fragmentation) || self.policy.uses(Scorer::FgdKube);
        let frag_before = if uses_frag {
            memo_fragmentation(
                &mut self.frag_memo,
                shape,
                node,
                node.cpu.0.saturating_sub(usage.cpu),
                &s.free,
                &self.mix,
            )
        } else {
            0.0
        };
        let mut best: Option<(f64, GpuPick, u32)> = None;
        let mut ties = 0u64;
        for &(pick, weight) in &s.picks {
            s.after.clear();
            s.after.extend_from_slice(&s.free);
            match (pick, &req.gpu) {
                (GpuPick::Whole(mask), _) => {
                    for (i, f) in s.after.iter_mut().enumerate() {
                        if mask & (1 << i) != 0 {
                            *f = 0;
                        }
                    }
                }
                (GpuPick::Shared(g), GpuRequest::Fraction { milli, .. }) => {
                    s.after[g as usize] -= milli.0
                }
                // A time-sliced or MIG GPU serves no whole or fractional work.
                (GpuPick::Shared(g), _) | (GpuPick::Mig { gpu: g, .. }, _) => {
                    s.after[g as usize] = 0
                }
                (GpuPick::None, _) => {}
            }
            let frag_after = if uses_frag {
                let cpu_after = node.cpu.0.saturating_sub(usage.cpu + req.cpu.0);
                memo_fragmentation(
                    &mut self.frag_memo,
                    shape,
                    node,
                    cpu_after,
                    &s.after,
                    &self.mix,
                )
            } else {
                0.0
            };
            let input = ScoreInput {
                node,
                usage,
                islands: view.islands,
                req,
                pick,
                norm: self.norm,
                mix: &self.mix,
                free_before: &s.free,
                free_after: &s.after,
                frag_before,
                frag_after,
                pressure: &self.pressure,
            };
            let score: f64 = self
                .policy
                .scorers
                .iter()
                .map(|&(sc, w)| w * scorers::score(sc, &input))
                .sum();
            // Equal picks: the tightest GPU, the first, or each equally likely.
            let left = tightness(pick, &s.after);
            match best {
                Some((b, _, l)) if score <= b + TIE => {
                    if score >= b - TIE {
                        match self.policy.pick {
                            PickChoice::Tightest if left < l => best = Some((score, pick, left)),
                            PickChoice::Random => {
                                // Each GPU equally likely: a pick stands for `weight` GPUs.
                                ties += weight as u64;
                                let draw = match &mut local {
                                    Some(r) => r.below(ties),
                                    None => self.rng.below(ties),
                                };
                                if draw < weight as u64 {
                                    best = Some((score, pick, left));
                                }
                            }
                            PickChoice::Tightest | PickChoice::First => {}
                        }
                    }
                }
                _ => {
                    best = Some((score, pick, left));
                    ties = weight as u64;
                }
            }
        }
        let (score, pick, _) = best.expect("picks is not empty");
        Eval::Fit { score, pick }
    }
}
