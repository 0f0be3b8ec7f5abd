//! What the scheduler remembers between cycles: decayed usage, the
//! preemptors waiting for their victims, disruptions and the last
//! consolidation. The cycle reads and ages it; callers keep it.

use super::*;

/// What the scheduler remembers between cycles.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History {
    /// Decayed GPU-hours per queue (leaf and inner).
    pub usage: BTreeMap<QueueId, f64>,
    pub decayed_at: u64,
    /// (time, GPU-hours lost) per queue, for disruption budgets.
    pub disruptions: BTreeMap<QueueId, Vec<(u64, f64)>>,
    /// Preemptors waiting for their victims to stop.
    pub waiting_for: BTreeMap<JobId, Vec<JobId>>,
    /// When the last consolidation started ([`Config::consolidation_interval`]).
    pub consolidated_at: Option<u64>,
    /// Jobs within their guarantee that held nodes from new borrowing last
    /// cycle, and the flavor: they hold them again first.
    pub holding: BTreeMap<JobId, String>,
    /// Jobs reclaimed from, and the jobs that reclaimed from them while
    /// those run: consolidation does not move them for it.
    pub reclaimed_by: BTreeMap<JobId, Vec<JobId>>,
}

impl History {
    /// Ages recorded usage to `now` and adds the GPU-hours used since the last
    /// call by the running jobs (charged to their queues and ancestors).
    pub fn account(&mut self, now: u64, half_life: u64, running: &[Running], queues: &Queues) {
        let dt = now.saturating_sub(self.decayed_at);
        if dt == 0 {
            return;
        }
        let factor = if half_life == 0 {
            0.0
        } else {
            0.5f64.powf(dt as f64 / half_life as f64)
        };
        for v in self.usage.values_mut() {
            *v *= factor;
        }
        for r in running {
            let hours = r.work.gpu_milli() as f64 / 1000.0 * dt as f64 / 3600.0;
            for q in queues.path(r.work.queue) {
                *self.usage.entry(q).or_default() += hours;
            }
        }
        self.decayed_at = now;
    }

    /// This history keyed by queue name and plain job id, as callers keep
    /// it between cycles and across restarts: queue ids are positions,
    /// which change as queues come and go. Queues with no reclaim left in
    /// their window are left out.
    pub fn named(&self, queues: &Queues) -> NamedHistory {
        let name = |q: &QueueId| queues.get(*q).name.clone();
        NamedHistory {
            usage: self.usage.iter().map(|(q, v)| (name(q), *v)).collect(),
            decayed_at: self.decayed_at,
            disruptions: self
                .disruptions
                .iter()
                .filter(|(_, d)| !d.is_empty())
                .map(|(q, d)| (name(q), d.clone()))
                .collect(),
            waiting_for: self
                .waiting_for
                .iter()
                .map(|(p, v)| (p.0, v.iter().map(|j| j.0).collect()))
                .collect(),
            consolidated_at: self.consolidated_at,
            holding: self.holding.iter().map(|(j, f)| (j.0, f.clone())).collect(),
            reclaimed_by: self
                .reclaimed_by
                .iter()
                .map(|(v, by)| (v.0, by.iter().map(|j| j.0).collect()))
                .collect(),
        }
    }

    /// The history `named` keeps, for the queues of `queues` (those gone
    /// are forgotten).
    pub fn from_named(named: &NamedHistory, queues: &Queues) -> History {
        History {
            usage: named
                .usage
                .iter()
                .filter_map(|(n, v)| Some((queues.by_name(n)?, *v)))
                .collect(),
            decayed_at: named.decayed_at,
            disruptions: named
                .disruptions
                .iter()
                .filter_map(|(n, d)| Some((queues.by_name(n)?, d.clone())))
                .collect(),
            waiting_for: named
                .waiting_for
                .iter()
                .map(|(p, v)| (JobId(*p), v.iter().map(|&j| JobId(j)).collect()))
                .collect(),
            consolidated_at: named.consolidated_at,
            holding: named
                .holding
                .iter()
                .map(|(j, f)| (JobId(*j), f.clone()))
                .collect(),
            reclaimed_by: named
                .reclaimed_by
                .iter()
                .map(|(v, by)| (JobId(*v), by.iter().map(|&j| JobId(j)).collect()))
                .collect(),
        }
    }

    /// Queue `q`'s reclaims in the window ending at `now`: the GPU-hours
    /// of work they lost and how many jobs they stopped.
    pub(super) fn disrupted(&self, q: QueueId, now: u64, window: u64) -> (f64, usize) {
        self.disruptions.get(&q).map_or((0.0, 0), |v| {
            v.iter()
                .filter(|(t, _)| now.saturating_sub(*t) < window)
                // From +0.0: an empty float sum is -0.0, shown as "-0.00".
                .fold((0.0, 0), |(sum, n), (_, h)| (sum + h, n + 1))
        })
    }
}

/// [`History`] keyed by queue name and plain job id ([`History::named`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NamedHistory {
    pub usage: BTreeMap<String, f64>,
    pub decayed_at: u64,
    pub disruptions: BTreeMap<String, Vec<(u64, f64)>>,
    pub waiting_for: BTreeMap<u64, Vec<u64>>,
    pub consolidated_at: Option<u64>,
    pub holding: BTreeMap<u64, String>,
    pub reclaimed_by: BTreeMap<u64, Vec<u64>>,
}
