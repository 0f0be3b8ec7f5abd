//! The kinds of events the server records: one per transition or fact,
//! stored and served by name (`gpuflow event ls`, webhooks, mail), so a
//! kind is written once here instead of as text at each place that
//! records one.

macro_rules! kinds {
    ($($(#[$doc:meta])* $v:ident = $s:literal,)*) => {
        /// What an event records.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum EventKind {
            $($(#[$doc])* $v,)*
        }

        impl EventKind {
            /// Every kind.
            pub const ALL: &'static [EventKind] = &[$(EventKind::$v,)*];

            /// The kind named `name` (as stored); `None` for a name no
            /// kind has.
            pub fn from_name(name: &str) -> Option<EventKind> {
                EventKind::ALL.iter().copied().find(|k| k.as_str() == name)
            }

            /// The kind's name, as stored and served.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(EventKind::$v => $s,)*
                }
            }
        }
    };
}

kinds! {
    Submitted = "submitted",
    Admitted = "admitted",
    Starting = "starting",
    Running = "running",
    Succeeded = "succeeded",
    Failed = "failed",
    Timeout = "timeout",
    Cancelled = "cancelled",
    Stopping = "stopping",
    Preempted = "preempted",
    Evicted = "evicted",
    Requeued = "requeued",
    /// A failed attempt to be run again after its backoff.
    Retry = "retry",
    Suspended = "suspended",
    Resumed = "resumed",
    Held = "held",
    Released = "released",
    DependencyMet = "dependency-met",
    DependencyNeverMet = "dependency-never-met",
    LifetimeReached = "lifetime-reached",
    IdleStop = "idle-stop",
    IdleWarning = "idle-warning",
    ImagePulling = "image-pulling",
    ImagePulled = "image-pulled",
    ImageFailed = "image-failed",
    /// A task passed its memory limit.
    Oom = "oom",
    /// A task passed its share of a shared GPU's memory.
    GpuMemory = "gpu-memory",
    NoLimits = "no-limits",
    NodeRegistered = "node-registered",
    NodeLost = "node-lost",
    NodeBack = "node-back",
    NodeDrain = "node-drain",
    NodeCordon = "node-cordon",
    NodeUncordon = "node-uncordon",
    NodeReplace = "node-replace",
    NodeClear = "node-clear",
    GpuHealthy = "gpu-healthy",
    GpuUnhealthy = "gpu-unhealthy",
    ReservationCreated = "reservation-created",
    ServiceCreated = "service-created",
    ServiceChanged = "service-changed",
    ServiceDeleted = "service-deleted",
    BudgetLow = "budget-low",
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_have_distinct_names() {
        let names: std::collections::BTreeSet<_> =
            EventKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), EventKind::ALL.len());
        for &k in EventKind::ALL {
            assert_eq!(EventKind::from_name(k.as_str()), Some(k));
        }
        assert_eq!(EventKind::from_name("no-such-kind"), None);
    }
}
