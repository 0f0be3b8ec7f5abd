//! Free GPUs over the time to come, for start estimates that backfill.
//!
//! The estimate used to be a strict list schedule: jobs started in their
//! order as GPUs came free, so a small job waited for every big one ahead
//! of it, although the cycle starts it in a gap the big ones cannot use
//! (the simulator found batch estimates hours late). [`Profile`] keeps the
//! free milli-GPUs of each minute ahead (a segment tree over minutes, with
//! additions from a minute on), so a job with an expected runtime starts at
//! the first minute from which enough GPUs stay free for all of it, as
//! Slurm's backfill estimates do; one without runs to the end of the
//! horizon.

/// Seconds a step of the profile covers.
const STEP: u64 = 60;
/// The fewest steps a profile starts with (it doubles as needed).
const MIN_STEPS: usize = 1 << 6;
/// The most steps: 2^18 minutes, about 182 days. Capacity that comes
/// free later is not counted; a job that finds no room before is not
/// estimated.
const MAX_STEPS: usize = 1 << 18;
/// Gaps tried for one job before it takes the first minute from which its
/// GPUs stay free to the horizon (what a strict order would give).
const MAX_GAPS: usize = 256;

/// Free milli-GPUs per minute from `now` (they may fall below 0 where a
/// job was estimated to start later than it was given room for). Past
/// its last step, a profile only rises, by what comes free there
/// (`beyond`), so a check that holds to its last step holds for good.
pub(super) struct Profile {
    now: u64,
    /// Steps covered: a power of two.
    steps: usize,
    /// The tree's nodes, the root at 1 and the steps' leaves from `steps`.
    tree: Vec<Node>,
    /// Per step: the latest time something came free in it, so that a
    /// start is told to the second, not rounded up to the minute.
    last: Vec<u64>,
    /// What comes free after the last step: (time, milli-GPU).
    beyond: Vec<(u64, i64)>,
}

impl Profile {
    /// `avail` free now, and `ends`: (time, milli-GPU that comes free then).
    ///
    /// It starts with the fewest steps and grows only as far as a question
    /// asks ([`Profile::when`]): most questions are answered within the
    /// first hour or two, and a tree over every known end was built (and
    /// its memory zeroed) for nothing, once per queue and cycle.
    pub(super) fn new(ends: &[(u64, u64)], avail: u64, now: u64) -> Profile {
        let steps = MIN_STEPS;
        let mut p = Profile {
            now,
            steps: 0,
            tree: Vec::new(),
            last: Vec::new(),
            beyond: std::iter::once((now, to_i64(avail)))
                .chain(ends.iter().map(|&(t, m)| (t, to_i64(m))))
                .collect(),
        };
        p.build(steps, Vec::new());
        p
    }

    /// The tree over `steps` steps: `leaf`'s values (the last one
    /// carried on to the end) plus what comes free within them.
    fn build(&mut self, steps: usize, mut leaf: Vec<i64>) {
        let from = leaf.len();
        let carry = leaf.last().copied().unwrap_or(0);
        leaf.resize(steps, carry);
        self.last.resize(steps, 0);
        let mut delta = vec![0i64; steps];
        let now = self.now;
        self.beyond.retain(|&(t, m)| {
            let s = step_of(now, t);
            if s >= steps {
                return true;
            }
            delta[s] = delta[s].saturating_add(m);
            self.last[s] = self.last[s].max(t);
            false
        });
        let mut run = 0i64;
        for (v, d) in leaf.iter_mut().zip(&delta).skip(from) {
            run = run.saturating_add(*d);
            *v = v.saturating_add(run);
        }
        self.steps = steps;
        self.tree = vec![Node::default(); 2 * steps];
        for (node, &v) in self.tree[steps..].iter_mut().zip(&leaf) {
            (node.min, node.max) = (v, v);
        }
        for n in (1..steps).rev() {
            self.pull(n);
        }
    }

    /// Twice the steps, keeping the values: `false` at the most.
    fn grow(&mut self) -> bool {
        if self.beyond.is_empty() {
            return false;
        }
        self.double()
    }

    /// Twice the steps, whatever comes later: `false` at the most.
    fn double(&mut self) -> bool {
        if self.steps >= MAX_STEPS {
            return false;
        }
        let mut leaf = vec![0i64; self.steps];
        self.leaves(1, 0, self.steps, 0, &mut leaf);
        self.build(self.steps * 2, leaf);
        true
    }

    fn leaves(&self, n: usize, lo: usize, hi: usize, above: i64, out: &mut [i64]) {
        if hi - lo == 1 {
            out[lo] = self.tree[n].min + above;
            return;
        }
        let (mid, above) = ((lo + hi) / 2, above + self.tree[n].add);
        self.leaves(2 * n, lo, mid, above, out);
        self.leaves(2 * n + 1, mid, hi, above, out);
    }

    /// When `need` milli-GPU are free for `run` seconds (for good when
    /// `None`), taking them from then on when `take` (see
    /// [`Profile::later`]). `None`: not within the most steps.
    pub(super) fn when(&mut self, need: u64, run: Option<u64>, take: bool) -> Option<u64> {
        let need = to_i64(need);
        let len = run.map(|r| usize::try_from(r.div_ceil(STEP).max(1)).unwrap_or(MAX_STEPS));
        let mut s = self.first_at_least(0, need)?;
        let mut tries = 0;
        let s = loop {
            let end = len.map_or(self.steps, |l| s.saturating_add(l).min(self.steps));
            match self.first(s, |lo, _| lo < need, |v| v < need) {
                Some(short) if short < end => {
                    tries += 1;
                    if tries >= MAX_GAPS {
                        // From the last step short of it on, for good.
                        match self.last_below(need) {
                            Some(b) if b + 1 < self.steps => break b + 1,
                            _ => s = self.first_at_least(self.steps, need)?,
                        }
                        continue;
                    }
                    s = self.first_at_least(short + 1, need)?;
                }
                _ => break s,
            }
        };
        if take {
            self.add_from(s, -need);
        }
        // What came free in the step made room: from its latest moment.
        let at = match (s, self.last[s]) {
            (0, _) => self.now,
            (_, 0) => self.now + s as u64 * STEP,
            (_, t) => t,
        };
        Some(at)
    }

    /// The first step at or after `from` with at least `need`, growing the
    /// profile while it has none.
    fn first_at_least(&mut self, from: usize, need: i64) -> Option<usize> {
        loop {
            if let Some(s) = self.first(from, |_, hi| hi >= need, |v| v >= need) {
                return Some(s);
            }
            if !self.grow() {
                return None;
            }
        }
    }

    /// Takes `need` milli-GPU from `at` on: a start found elsewhere
    /// ([`Profile::when`] without taking, then a later time).
    /// The profile first grows to cover `at`, so that past its last step
    /// it still only rises. Past the most steps nothing is taken (nor is
    /// anything estimated there).
    pub(super) fn take_from(&mut self, at: u64, need: u64) {
        let s = step_of(self.now, at);
        while s >= self.steps {
            if !self.double() {
                return;
            }
        }
        self.add_from(s, -to_i64(need));
    }

    /// `milli` comes free again at `end`.
    pub(super) fn later(&mut self, end: u64, milli: u64) {
        let s = step_of(self.now, end);
        if s >= self.steps {
            self.beyond.push((end, to_i64(milli)));
            return;
        }
        self.add_from(s, to_i64(milli));
        self.last[s] = self.last[s].max(end);
    }

    /// Adds `v` to every minute from step `from` on: to the leaf, to
    /// each right sibling on its way up (whole ranges after it), and the
    /// bounds of the nodes above made again.
    fn add_from(&mut self, from: usize, v: i64) {
        if from >= self.steps {
            return;
        }
        let mut n = from + self.steps;
        self.apply(n, v);
        while n > 1 {
            if n.is_multiple_of(2) {
                self.apply(n + 1, v);
            }
            n /= 2;
            self.pull(n);
        }
    }

    fn apply(&mut self, n: usize, v: i64) {
        let node = &mut self.tree[n];
        node.min += v;
        node.max += v;
        node.add += v;
    }

    /// A node's bounds from its children's and its own addition.
    fn pull(&mut self, n: usize) {
        let (l, r) = (self.tree[2 * n], self.tree[2 * n + 1]);
        let node = &mut self.tree[n];
        node.min = l.min.min(r.min) + node.add;
        node.max = l.max.max(r.max) + node.add;
    }

    /// The first step at or after `from` whose value passes `leaf`;
    /// `may`: whether a range whose values lie within (least, most) holds
    /// one (exactly: a range it admits has a step that passes).
    ///
    /// Down the path to `from` while its range may hold one; then up
    /// again, trying each range right of the path (nearest first), and
    /// down the first that may hold one to its first step that does. A
    /// loop, not a recursion: this is most of the estimates' cost.
    fn first(
        &self,
        from: usize,
        may: impl Fn(i64, i64) -> bool,
        leaf: impl Fn(i64) -> bool,
    ) -> Option<usize> {
        if from >= self.steps {
            return None;
        }
        let may_at = |n: usize, above: i64| {
            let node = self.tree[n];
            may(node.min + above, node.max + above)
        };
        // `above`: what the ancestors of node `n` added.
        let (mut n, mut lo, mut hi, mut above) = (1, 0, self.steps, 0);
        while may_at(n, above) {
            if hi - lo == 1 {
                if leaf(self.tree[n].min + above) {
                    return Some(lo);
                }
                break;
            }
            above += self.tree[n].add;
            let mid = (lo + hi) / 2;
            if from < mid {
                (n, hi) = (2 * n, mid);
            } else {
                (n, lo) = (2 * n + 1, mid);
            }
        }
        while n > 1 {
            // A left child's sibling is the next range right of the path.
            if n.is_multiple_of(2) && may_at(n + 1, above) {
                n += 1;
                // Some step below passes: the first, down the leftmost
                // branch that may hold one.
                while n < self.steps {
                    above += self.tree[n].add;
                    n = if may_at(2 * n, above) {
                        2 * n
                    } else {
                        2 * n + 1
                    };
                }
                return Some(n - self.steps);
            }
            n /= 2;
            above -= self.tree[n].add;
        }
        None
    }

    /// The last step whose value is below `need`.
    fn last_below(&self, need: i64) -> Option<usize> {
        let (mut n, mut lo, mut hi, mut above) = (1, 0, self.steps, 0);
        if self.tree[1].min >= need {
            return None;
        }
        while hi - lo > 1 {
            above += self.tree[n].add;
            let mid = (lo + hi) / 2;
            if self.tree[2 * n + 1].min + above < need {
                (n, lo) = (2 * n + 1, mid);
            } else {
                (n, hi) = (2 * n, mid);
            }
        }
        Some(lo)
    }
}

/// A node of the tree: the least and most value below it, its own
/// addition included, and what was added to its whole range.
#[derive(Clone, Copy, Default)]
struct Node {
    min: i64,
    max: i64,
    add: i64,
}

/// The first step from which something at `t` counts.
fn step_of(now: u64, t: u64) -> usize {
    usize::try_from(t.saturating_sub(now).div_ceil(STEP))
        .unwrap_or(usize::MAX)
        .min(MAX_STEPS)
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX / 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Numbers below `m`, from a fixed seed.
    fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |m| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        }
    }

    #[test]
    fn gpus_taken_past_the_last_step_are_gone_from_then_on() {
        // 8 GPUs free for good; 8 are taken from day 100 on, far past
        // the steps a new profile covers.
        let mut p = Profile::new(&[], 8000, 0);
        p.take_from(100 * 86_400, 8000);
        // A job that runs for good never finds them; one of an hour does now.
        assert_eq!(p.when(1000, None, false), None);
        assert_eq!(p.when(1000, Some(3600), false), Some(0));
        // Past the most steps nothing is taken.
        let mut q = Profile::new(&[], 8000, 0);
        q.take_from(400 * 86_400, 8000);
        assert_eq!(q.when(1000, None, false), Some(0));
    }

    #[test]
    fn a_short_job_starts_in_the_gap_before_a_big_one() {
        // 4 GPUs free now, 4 more in an hour.
        let mut p = Profile::new(&[(3600, 4000)], 4000, 0);
        // A job of 8 GPUs for two hours: in an hour, holding all 8.
        assert_eq!(p.when(8000, Some(7200), true), Some(3600));
        p.later(3600 + 7200, 8000);
        // A job of 4 GPUs for half an hour fits before it; one for two
        // hours does not, and waits for the big one to end.
        assert_eq!(p.when(4000, Some(1800), true), Some(0));
        p.later(1800, 4000);
        assert_eq!(p.when(4000, Some(7200), true), Some(10_800));
        p.later(10_800 + 7200, 4000);
        // Without a runtime: from when enough stays free for good.
        assert_eq!(p.when(8000, None, false), Some(18_000));
        // More than the cluster ever frees: never.
        assert_eq!(p.when(9000, Some(60), false), None);
    }

    #[test]
    fn ends_count_from_the_minute_they_fall_in_at_their_second() {
        // Counted from the step it falls in, told to the second.
        let mut p = Profile::new(&[(90, 1000)], 0, 0);
        assert_eq!(p.when(1000, Some(10), false), Some(90));
        let mut p = Profile::new(&[(90, 1000), (100, 1000)], 1000, 0);
        assert_eq!(p.when(2000, Some(10), false), Some(100));
        // Far ahead: the profile grows to it, up to its most steps.
        let mut p = Profile::new(&[(STEP * 5000, 1000)], 0, 0);
        assert_eq!(p.when(1000, None, false), Some(STEP * 5000));
        let mut p = Profile::new(&[], 0, 0);
        p.later(STEP * 100_000, 1000);
        assert_eq!(p.when(1000, Some(60), false), Some(STEP * 100_000));
        let mut p = Profile::new(&[(STEP * MAX_STEPS as u64 + 5, 1000)], 0, 0);
        assert_eq!(p.when(1000, None, false), None);
        // What ended already counts now.
        let mut p = Profile::new(&[(0, 1000)], 1000, 30);
        assert_eq!(p.when(2000, Some(60), false), Some(30));
    }

    /// `first` finds the first step from any point, for both questions
    /// the estimates ask, as a scan of the steps would.
    #[test]
    fn first_finds_what_a_scan_of_the_steps_finds() {
        let mut rand = xorshift(0x2545_f491_4f6c_dd1du64);
        for _ in 0..100 {
            let now = 5000;
            let ends: Vec<(u64, u64)> = (0..1 + rand(40))
                .map(|_| (now + rand(300 * STEP), 1000 * (1 + rand(3))))
                .collect();
            let mut p = Profile::new(&ends, 1000 * rand(3), now);
            while p.steps < 512 {
                assert!(p.double());
            }
            for _ in 0..rand(30) {
                let s = rand(p.steps as u64) as usize;
                p.add_from(s, -1000 * (1 + rand(3) as i64));
            }
            let mut v = vec![0i64; p.steps];
            p.leaves(1, 0, p.steps, 0, &mut v);
            for _ in 0..50 {
                let from = rand(p.steps as u64 + 2) as usize;
                let need = 1000 * rand(8) as i64 - 2000;
                let scan = |ok: &dyn Fn(i64) -> bool| (from..p.steps).find(|&s| ok(v[s]));
                assert_eq!(
                    p.first(from, |lo, _| lo < need, |x| x < need),
                    scan(&|x| x < need),
                    "below {need} from {from}"
                );
                assert_eq!(
                    p.first(from, |_, hi| hi >= need, |x| x >= need),
                    scan(&|x| x >= need),
                    "at least {need} from {from}"
                );
            }
        }
    }

    /// Against a plain list of every minute's free GPUs, over random
    /// frees, starts and ends.
    #[test]
    fn answers_as_a_plain_minute_by_minute_list_would() {
        const N: usize = 4096;
        let mut rand = xorshift(0x9e37_79b9_7f4a_7c15u64);
        for _ in 0..200 {
            let now = 1000 + rand(100);
            let ends: Vec<(u64, u64)> = (0..rand(6))
                .map(|_| {
                    (
                        now.saturating_sub(30) + rand(20 * STEP),
                        1000 * (1 + rand(4)),
                    )
                })
                .collect();
            let avail = 1000 * rand(3);
            let mut p = Profile::new(&ends, avail, now);
            let mut v = vec![0i64; N];
            let mut last = vec![0u64; N];
            let free = |v: &mut Vec<i64>, last: &mut Vec<u64>, t: u64, m: i64| {
                let s = step_of(now, t);
                for x in &mut v[s..] {
                    *x += m;
                }
                last[s] = last[s].max(t);
            };
            free(&mut v, &mut last, now, avail as i64);
            for &(t, m) in &ends {
                free(&mut v, &mut last, t, m as i64);
            }
            for _ in 0..8 {
                let need = 1000 * (1 + rand(5));
                let run = (rand(4) > 0).then(|| 1 + rand(30 * STEP));
                let len = run.map_or(N, |r| r.div_ceil(STEP) as usize);
                let want =
                    (0..N - 64).find(|&s| v[s..(s + len).min(N)].iter().all(|&x| x >= need as i64));
                let got = p.when(need, run, true);
                let want_at = want.map(|s| match (s, last[s]) {
                    (0, _) => now,
                    (_, 0) => now + s as u64 * STEP,
                    (_, t) => t,
                });
                assert_eq!(
                    got, want_at,
                    "need {need} run {run:?} ends {ends:?} avail {avail}"
                );
                if let Some(s) = want {
                    for x in &mut v[s..] {
                        *x -= need as i64;
                    }
                    if let Some(r) = run {
                        let end = got.unwrap() + r;
                        p.later(end, need);
                        free(&mut v, &mut last, end, need as i64);
                    }
                }
            }
        }
    }
}
