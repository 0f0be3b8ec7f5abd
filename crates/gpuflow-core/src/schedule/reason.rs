//! Why a job waits ([`PendingReason`], rendered for people by its
//! `Display`), a pending job's explanation and the plan a cycle returns.

use super::*;

/// Why a job waits. Each reason is data; [`fmt::Display`] renders it.
#[derive(Clone, Debug, PartialEq)]
pub enum PendingReason {
    QueueHeld {
        queue: String,
    },
    QueueDraining {
        queue: String,
    },
    UserGpuLimit {
        user: String,
        used: u64,
        limit: u64,
    },
    UserRunningLimit {
        user: String,
        running: u32,
        limit: u32,
    },
    /// The class may not borrow and the job does not fit the guarantee.
    NotWithinGuarantee {
        flavor: Arc<str>,
        class: Arc<str>,
        usage: u64,
        guaranteed: u64,
    },
    /// The class may not borrow, the job does not fit the guarantee, and
    /// the flavor's leases ([`Config::lease_horizon`]) would pass what may
    /// be lent: `leased` held already, `need` more for this job,
    /// `lendable` in all.
    NoLease {
        flavor: Arc<str>,
        class: Arc<str>,
        usage: u64,
        guaranteed: u64,
        leased: u64,
        need: u64,
        lendable: u64,
    },
    /// Within its queue's guarantee, but other queues hold that capacity
    /// on loan (borrowed, or leased): it is taken back as the loans allow.
    GuaranteeLent {
        flavor: Arc<str>,
        queue: String,
        usage: u64,
        guaranteed: u64,
    },
    Quota {
        flavor: Arc<str>,
        block: QuotaBlock,
        /// Names of the queues the block mentions.
        queue_names: Arc<[(QueueId, String)]>,
    },
    Placement {
        flavor: Arc<str>,
        /// Shared: every job of the same shape that fails in a cycle gets the same one.
        unplaced: Arc<Unplaced>,
    },
    /// Capacity is held for a blocked gang that starts before this job would end.
    Reservation {
        job: JobId,
        start_at: u64,
    },
    /// The job would borrow, and the nodes it could take are held for a
    /// job within its guarantee that reclaims them at `start_at`.
    ReclaimHold {
        job: JobId,
        start_at: u64,
    },
    WaitingForPreemption {
        victims: usize,
    },
    /// Running jobs that could make room hold more work since their last
    /// checkpoint than `Config::max_unsaved` and are kept until they
    /// checkpoint or end.
    UnsavedWork {
        jobs: usize,
        limit_s: u64,
    },
    /// Preemption would help, but would pass a queue's disruption budget.
    DisruptionBudget {
        queue: String,
        used: f64,
        budget: f64,
    },
    /// Preemption would help, but would stop more of a queue's jobs in the
    /// window than its disruption budget allows
    /// ([`Config::disruption_max_jobs`]).
    DisruptionCount {
        queue: String,
        jobs: usize,
        max: usize,
    },
    /// The job would pass disruption budgets (a protected class, or a queue
    /// below its share) but binds itself to them until it has waited
    /// [`Config::budget_patience`]: until `at`.
    BudgetPatience {
        patience: u64,
        at: u64,
    },
    /// Reclaiming would take from a queue that has had less of its share of
    /// the decayed usage than this job's ([`Config::reclaims_restore_fairness`]).
    /// The queues compared are the borrower's and the job's, or, when they
    /// have different parents, their ancestors under the nearest common one;
    /// shares are per unit of weight among siblings (1: exactly its share).
    ReclaimFairness {
        queue: String,
        theirs: f64,
        our_queue: String,
        ours: f64,
    },
    /// Not reached this cycle (the queue used its tries, or FIFO blocked at the head).
    NotReached {
        ahead: usize,
    },
}

/// A span of seconds for people: `45 s`, `12 min`, `3 h 20 min`, `2 d 4 h`.
pub fn span(secs: u64) -> String {
    match secs {
        0..=89 => format!("{secs} s"),
        90..=5399 => format!("{} min", (secs + 30) / 60),
        5400..=172_799 => {
            let m = (secs + 30) / 60;
            match m % 60 {
                0 => format!("{} h", m / 60),
                r => format!("{} h {r} min", m / 60),
            }
        }
        _ => {
            let h = (secs + 1800) / 3600;
            match h % 24 {
                0 => format!("{} d", h / 24),
                r => format!("{} d {r} h", h / 24),
            }
        }
    }
}

/// `at` for people at time `now`: "in 12 min", or "now" once it has come.
fn relative(at: u64, now: u64) -> String {
    if at > now {
        format!("in {}", span(at - now))
    } else {
        "now".to_string()
    }
}

impl PendingReason {
    /// A short, stable name of the reason's kind (its variant; a quota
    /// block adds its own, `Quota.NoLendableCapacity`), for logs and
    /// tallies: the data it holds is left out.
    pub fn code(&self) -> &'static str {
        match self {
            PendingReason::QueueHeld { .. } => "QueueHeld",
            PendingReason::QueueDraining { .. } => "QueueDraining",
            PendingReason::UserGpuLimit { .. } => "UserGpuLimit",
            PendingReason::UserRunningLimit { .. } => "UserRunningLimit",
            PendingReason::NotWithinGuarantee { .. } => "NotWithinGuarantee",
            PendingReason::NoLease { .. } => "NoLease",
            PendingReason::GuaranteeLent { .. } => "GuaranteeLent",
            PendingReason::Quota { block, .. } => match block {
                QuotaBlock::Cap { .. } => "Quota.Cap",
                QuotaBlock::BorrowLimit { .. } => "Quota.BorrowLimit",
                QuotaBlock::NoLendableCapacity { .. } => "Quota.NoLendableCapacity",
                QuotaBlock::Budget { .. } => "Quota.Budget",
            },
            PendingReason::Placement { .. } => "Placement",
            PendingReason::Reservation { .. } => "Reservation",
            PendingReason::ReclaimHold { .. } => "ReclaimHold",
            PendingReason::WaitingForPreemption { .. } => "WaitingForPreemption",
            PendingReason::UnsavedWork { .. } => "UnsavedWork",
            PendingReason::DisruptionBudget { .. } => "DisruptionBudget",
            PendingReason::DisruptionCount { .. } => "DisruptionCount",
            PendingReason::BudgetPatience { .. } => "BudgetPatience",
            PendingReason::ReclaimFairness { .. } => "ReclaimFairness",
            PendingReason::NotReached { .. } => "NotReached",
        }
    }

    /// The reason for people at time `now`: as its `Display`, with the
    /// times it holds told relative to `now` ("in 12 min"), never as raw
    /// seconds of the cycle's clock.
    pub fn describe(&self, now: u64) -> String {
        match self {
            PendingReason::Reservation { job, start_at } => {
                let when = relative(*start_at, now);
                format!(
                    "capacity is reserved for job {} starting {when}, and this job would not end before",
                    job.0
                )
            }
            PendingReason::ReclaimHold { job, start_at } => {
                let when = relative(*start_at, now);
                format!(
                    "the free GPUs that would hold it are kept from new borrowing for job {}, within its queue's guarantee, which takes back the borrowed GPUs beside them {when}; this job would borrow and not end before",
                    job.0
                )
            }
            PendingReason::BudgetPatience { patience, at } => format!(
                "it preempts past disruption budgets once it has waited {}: {}",
                span(*patience),
                relative(*at, now)
            ),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for PendingReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gpus = |m: u64| m as f64 / 1000.0;
        match self {
            PendingReason::QueueHeld { queue } => {
                write!(f, "queue {queue} is held: it accepts work but starts none")
            }
            PendingReason::QueueDraining { queue } => write!(f, "queue {queue} is draining"),
            PendingReason::UserGpuLimit { user, used, limit } => {
                write!(
                    f,
                    "user {user} holds {} GPUs of a {} GPU limit in this queue",
                    gpus(*used),
                    gpus(*limit)
                )
            }
            PendingReason::UserRunningLimit {
                user,
                running,
                limit,
            } => {
                write!(
                    f,
                    "user {user} runs {running} jobs of a {limit} job limit in this queue"
                )
            }
            PendingReason::NotWithinGuarantee {
                flavor,
                class,
                usage,
                guaranteed,
            } => write!(
                f,
                "{class} jobs must fit the guaranteed {flavor} quota: jobs that may not borrow would hold {} of {} GPUs",
                gpus(*usage),
                gpus(*guaranteed)
            ),
            PendingReason::NoLease {
                flavor,
                class,
                usage,
                guaranteed,
                leased,
                need,
                lendable,
            } => write!(
                f,
                "{class} jobs beyond the guaranteed {flavor} quota (they would hold {} of {} GPUs) run only on idle capacity lent to them: {} GPUs are lent already and this job needs {} more, but the capacity no queue claims for its guarantee (what it holds and has pending) leaves {} GPUs to lend",
                gpus(*usage),
                gpus(*guaranteed),
                gpus(*leased),
                gpus(*need),
                gpus(*lendable)
            ),
            PendingReason::GuaranteeLent {
                flavor,
                queue,
                usage,
                guaranteed,
            } => write!(
                f,
                "within queue {queue}'s guarantee of {} {flavor} GPUs (it would hold {}), but other queues hold that capacity on loan: it is taken back as borrowed jobs pass their minimum runtime, and leases their term",
                gpus(*guaranteed),
                gpus(*usage)
            ),
            PendingReason::Quota {
                flavor,
                block,
                queue_names,
            } => {
                let name = |q: &QueueId| {
                    queue_names
                        .iter()
                        .find(|(id, _)| id == q)
                        .map_or("?", |(_, n)| n.as_str())
                };
                match block {
                    QuotaBlock::Cap { queue, usage, cap } => {
                        write!(
                            f,
                            "queue {} would use {} {flavor} GPUs, above its cap of {}",
                            name(queue),
                            gpus(*usage),
                            gpus(*cap)
                        )
                    }
                    QuotaBlock::BorrowLimit {
                        queue,
                        usage,
                        limit,
                    } => write!(
                        f,
                        "queue {} would use {} {flavor} GPUs, above its guarantee plus borrowing limit of {}",
                        name(queue),
                        gpus(*usage),
                        gpus(*limit)
                    ),
                    QuotaBlock::NoLendableCapacity {
                        parent,
                        needed,
                        available,
                    } => write!(
                        f,
                        "needs {} {flavor} GPUs of quota; {} has {} left to lend",
                        gpus(*needed),
                        parent.as_ref().map_or("the cluster", |p| name(p)),
                        gpus(*available)
                    ),
                    QuotaBlock::Budget { queue, exhausted } => write!(
                        f,
                        "queue {}'s GPU-hour budget is used up: it {}",
                        name(queue),
                        match exhausted {
                            crate::queue::BudgetExhausted::StopBorrowing => "may not borrow",
                            crate::queue::BudgetExhausted::StopAdmitting => "starts no new work",
                        }
                    ),
                }
            }
            PendingReason::Placement { flavor, unplaced } if flavor.is_empty() => {
                write!(f, "{unplaced}")
            }
            PendingReason::Placement { flavor, unplaced } => write!(f, "on {flavor}: {unplaced}"),
            PendingReason::Reservation { job, start_at } => {
                write!(
                    f,
                    "capacity is reserved for job {} from t={start_at}s and this job would not end before",
                    job.0
                )
            }
            PendingReason::ReclaimHold { job, start_at } => {
                write!(
                    f,
                    "the free GPUs that would hold it are kept from new borrowing for job {}, within its queue's guarantee, which takes back the borrowed GPUs beside them from t={start_at}s; this job would borrow and not end before",
                    job.0
                )
            }
            PendingReason::WaitingForPreemption { victims } => {
                write!(f, "waiting for {victims} preempted job(s) to stop")
            }
            PendingReason::DisruptionBudget {
                queue,
                used,
                budget,
            } => write!(
                f,
                "preempting would pass queue {queue}'s disruption budget: {used:.2} of {budget:.2} GPU-hours already lost in the window"
            ),
            PendingReason::DisruptionCount { queue, jobs, max } => write!(
                f,
                "preempting would pass queue {queue}'s disruption budget: {jobs} of at most {max} of its jobs already preempted in the window"
            ),
            PendingReason::BudgetPatience { patience, at } => write!(
                f,
                "it preempts past disruption budgets once it has waited {}, from t={at}s",
                span(*patience)
            ),
            PendingReason::ReclaimFairness {
                queue,
                theirs,
                our_queue,
                ours,
            } => write!(
                f,
                "reclaiming would take GPUs from queue {queue}, which has had {theirs:.2} of its share of recent GPU-hours against {ours:.2} for queue {our_queue}: a reclaim never deepens that imbalance, so this job waits for GPUs to free"
            ),
            PendingReason::UnsavedWork { jobs, limit_s } => {
                let limit = if limit_s % 3600 == 0 {
                    format!("{} h", limit_s / 3600)
                } else if limit_s % 60 == 0 {
                    format!("{} min", limit_s / 60)
                } else {
                    format!("{limit_s} s")
                };
                write!(
                    f,
                    "{jobs} running job(s) that could make room hold more than {limit} of work since their last checkpoint and are not preempted until they checkpoint or end"
                )
            }
            PendingReason::NotReached { ahead } => write!(
                f,
                "not reached this cycle: {ahead} job(s) ahead were tried first"
            ),
        }
    }
}

/// A pending job's reasons: most have one, kept inline (a cycle explains
/// every pending job, so a heap allocation each would cost more than the rest).
pub type Reasons = smallvec::SmallVec<[PendingReason; 1]>;

/// A pending job's explanation.
#[derive(Clone, Debug, PartialEq)]
pub struct Pending {
    pub job: JobId,
    pub reasons: Reasons,
    /// 1-based position among its queue's pending jobs.
    pub position: usize,
    /// Estimated start, seconds; `None` when running jobs declare no max runtime.
    pub eta: Option<u64>,
}

/// The outcome of a cycle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub admitted: Vec<(JobId, String, Placement)>,
    pub preempted: Vec<Preemption>,
    pub reservations: Vec<Reservation>,
    /// Reclaim holds: nodes kept from new borrowing for a job within its
    /// guarantee until it can take back the borrowed GPUs there.
    pub holds: Vec<Reservation>,
    /// The nodes preemptors will take once their victims stop, kept from
    /// everyone else meanwhile.
    pub nominated: Vec<Reservation>,
    pub pending: Vec<Pending>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reservation was told to people as "from t=1796442831s", the
    /// cycle's raw clock; it is told relative to now.
    #[test]
    fn a_reservation_is_told_relative_to_now() {
        let r = PendingReason::Reservation {
            job: JobId(7),
            start_at: 1_796_446_431,
        };
        let said = r.describe(1_796_442_831);
        assert_eq!(
            said,
            "capacity is reserved for job 7 starting in 60 min, and this job would not end before"
        );
        assert!(!said.contains("t="));
        assert!(r.describe(1_796_446_431).contains("starting now"));
        // Other reasons read as their Display.
        let q = PendingReason::QueueDraining { queue: "a".into() };
        assert_eq!(q.describe(0), q.to_string());
    }

    #[test]
    fn spans_read_as_people_say_them() {
        assert_eq!(span(45), "45 s");
        assert_eq!(span(600), "10 min");
        assert_eq!(span(3600), "60 min");
        assert_eq!(span(3 * 3600 + 20 * 60), "3 h 20 min");
        assert_eq!(span(7200), "2 h");
        assert_eq!(span(2 * 86_400 + 4 * 3600), "2 d 4 h");
    }
}
