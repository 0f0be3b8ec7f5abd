//! Job dependencies (`spec.dependency`, as `sbatch --dependency` writes
//! them): resolved to the jobs they name when a job is submitted, met or
//! found unmeetable by each cycle ([`settle`]), and the reason a waiting
//! job gives ([`reason`]).

use std::collections::BTreeMap;

use gpuflow_api::{self as api, DepKind, Dependency, JobState};

use crate::event::EventKind;
pub use crate::state::Wait;
use crate::state::{JobRec, World};

impl Wait {
    fn term(&self) -> String {
        format!("{}:{}", self.kind.as_str(), self.job)
    }
}

/// Where a dependency stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Met,
    /// Not yet: what it waits for.
    Waiting(String),
    /// It never can be: why.
    Never(String),
}

/// What `kind` makes of job `job` in `state`, `started` once it has run.
#[must_use]
pub fn status(kind: DepKind, job: u64, state: JobState, started: bool) -> Status {
    use JobState::{Cancelled, Failed, Succeeded, Timeout};
    use Status::{Met, Never, Waiting};
    let now = state.as_str();
    match kind {
        DepKind::After if started || state.finished() => Met,
        DepKind::After => Waiting(format!("job {job} to start (it is {now})")),
        DepKind::AfterAny if state.finished() => Met,
        DepKind::AfterAny => Waiting(format!("job {job} to end (it is {now})")),
        DepKind::AfterOk | DepKind::AfterCorr => match state {
            Succeeded => Met,
            Failed => Never(format!("job {job} failed")),
            Timeout => Never(format!("job {job} ran past its max runtime")),
            Cancelled => Never(format!("job {job} was cancelled")),
            _ => Waiting(format!("job {job} to succeed (it is {now})")),
        },
        DepKind::AfterNotOk => match state {
            Failed | Timeout | Cancelled => Met,
            Succeeded => Never(format!("job {job} succeeded")),
            _ => Waiting(format!("job {job} to fail or be cancelled (it is {now})")),
        },
    }
}

/// Job `id`'s state and whether it has started, from memory or, for a job
/// long finished, its summary.
fn state_of(world: &World, id: u64) -> Option<(JobState, bool)> {
    if let Some(j) = world.jobs().get(&id) {
        return Some((j.state, j.started_at.is_some() || j.attempts > 0));
    }
    world
        .summaries()
        .get(&id)
        .map(|s| (s.state, s.state.finished()))
}

/// The arrays a dependency names by element (`ID_INDEX`, `aftercorr`):
/// their indices must be read (from the store) before [`resolve`].
#[must_use]
pub fn arrays_by_element(d: &Dependency) -> Vec<u64> {
    let mut ids: Vec<u64> = d
        .terms
        .iter()
        .flat_map(|t| {
            t.targets
                .iter()
                .filter(move |x| x.index.is_some() || t.kind == DepKind::AfterCorr)
                .map(|x| x.id)
        })
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Resolves a dependency of a job of `team` (an array element with index
/// `index`) to the waits not met yet. `indices`: each array of
/// [`arrays_by_element`], its indices in element order.
///
/// # Errors
/// What is wrong, in words, for a 400: a job that does not exist or is
/// another team's, an index an array does not have, a dependency that can
/// never be met.
pub fn resolve(
    world: &World,
    team: &str,
    d: &Dependency,
    index: Option<u32>,
    indices: &BTreeMap<u64, Vec<u32>>,
) -> Result<Vec<Wait>, String> {
    let mut waits: Vec<Wait> = Vec::new();
    for term in &d.terms {
        for target in &term.targets {
            let id = target.id;
            let Some(s) = world.summaries().get(&id) else {
                return Err(format!("job {id} does not exist"));
            };
            if s.team != team {
                return Err(format!(
                    "job {id} is team {:?}'s; a job may depend only on jobs of its own team ({team:?})",
                    s.team
                ));
            }
            let is_array = s.array == Some(id);
            let element = |i: u32| -> Result<Option<u64>, String> {
                let list = indices.get(&id).filter(|_| is_array).ok_or_else(|| {
                    format!("job {id} is not an array (an array's id is its first element's)")
                })?;
                Ok(list.iter().position(|&x| x == i).map(|k| id + k as u64))
            };
            let jobs: Vec<u64> = match (term.kind, target.index) {
                (DepKind::AfterCorr, _) => {
                    let mine = index.ok_or("aftercorr pairs the elements of two arrays")?;
                    element(mine)?.into_iter().collect()
                }
                (_, Some(i)) => {
                    vec![element(i)?.ok_or_else(|| format!("array {id} has no index {i}"))?]
                }
                (_, None) if is_array => world
                    .summaries()
                    .range(id..)
                    .take_while(|(_, e)| e.array == Some(id))
                    .map(|(&k, _)| k)
                    .collect(),
                (_, None) => vec![id],
            };
            for job in jobs {
                let Some((state, started)) = state_of(world, job) else {
                    return Err(format!("job {job} does not exist"));
                };
                let wait = Wait {
                    kind: term.kind,
                    job,
                };
                match status(term.kind, job, state, started) {
                    Status::Met => {}
                    Status::Never(why) => {
                        return Err(format!("{} can never be met: {why}", wait.term()));
                    }
                    Status::Waiting(_) => {
                        if !waits.contains(&wait) {
                            waits.push(wait);
                        }
                    }
                }
            }
        }
    }
    Ok(waits)
}

/// Pending jobs whose dependencies changed this cycle: waits met leave; a
/// job with one that never can be met is cancelled or held, as its spec
/// says. Each with the event to record, if any.
#[must_use]
pub fn settle(world: &World, t: u64) -> Vec<(JobRec, Option<(crate::event::EventKind, String)>)> {
    let mut out = Vec::new();
    for j in world.waiting_jobs() {
        let mut left = Vec::new();
        let mut never: Vec<String> = Vec::new();
        for w in &j.waits_on {
            match state_of(world, w.job) {
                None => never.push(format!("{}: job {} is gone", w.term(), w.job)),
                Some((state, started)) => match status(w.kind, w.job, state, started) {
                    Status::Met => {}
                    Status::Waiting(_) => left.push(w.clone()),
                    Status::Never(why) => never.push(format!("{}: {why}", w.term())),
                },
            }
        }
        if never.is_empty() && left.len() == j.waits_on.len() {
            continue;
        }
        let mut next = j.clone();
        next.waits_on = left;
        let event = if never.is_empty() {
            next.waits_on.is_empty().then(|| {
                (
                    EventKind::DependencyMet,
                    "its dependencies are met".to_string(),
                )
            })
        } else {
            let kind = crate::lifecycle::dependency_never_met(&mut next, &never.join("; "), t);
            Some((kind, next.reason.clone()))
        };
        out.push((next, event));
    }
    out
}

/// Why a pending job is not given to the scheduler for its dependencies:
/// the first wait not met, or an earlier unfinished job of its name and
/// user (`singleton`); `None` when nothing holds it.
#[must_use]
pub fn reason(world: &World, j: &JobRec, singles: &Singles) -> Option<String> {
    if let Some(w) = j.waits_on.first() {
        let what = state_of(world, w.job)
            .map(|(s, started)| status(w.kind, w.job, s, started))
            .and_then(|s| match s {
                Status::Waiting(what) => Some(what),
                _ => None,
            })
            .unwrap_or_else(|| format!("job {}", w.job));
        let more = match j.waits_on.len() - 1 {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        return Some(format!("dependency {}: waits for {what}{more}", w.term()));
    }
    let before = singles.first_unfinished(j)?;
    Some(format!(
        "dependency singleton: waits for job {before} (same name {:?} and user {}) to end",
        j.spec.name, j.user
    ))
}

/// Whether `j` asks to be a `singleton` (a cheap look first: most
/// dependencies are not).
fn is_singleton(j: &JobRec) -> bool {
    j.spec
        .dependency
        .as_deref()
        .is_some_and(|d| d.contains("singleton") && Dependency::parse(d).is_ok_and(|d| d.singleton))
}

/// The earliest unfinished job per (team, user, name), for `singleton`;
/// built only when a singleton asks for it, so that a cycle with none
/// does not walk every job for it.
pub struct Singles<'w> {
    world: &'w World,
    first: std::cell::OnceCell<BTreeMap<(&'w str, &'w str, &'w str), u64>>,
}

impl<'w> Singles<'w> {
    /// For `world`'s jobs.
    #[must_use]
    pub fn of(world: &'w World) -> Singles<'w> {
        Singles {
            world,
            first: std::cell::OnceCell::new(),
        }
    }

    /// An unfinished job submitted before `j` with its name and user, when
    /// `j` is a singleton.
    fn first_unfinished(&self, j: &JobRec) -> Option<u64> {
        if !is_singleton(j) {
            return None;
        }
        let first = self.first.get_or_init(|| {
            let mut first = BTreeMap::new();
            for j in self.world.jobs().values().filter(|j| !j.state.finished()) {
                first
                    .entry((j.team.as_str(), j.user.as_str(), j.spec.name.as_str()))
                    .and_modify(|id: &mut u64| *id = (*id).min(j.id))
                    .or_insert(j.id);
            }
            first
        });
        first
            .get(&(j.team.as_str(), j.user.as_str(), j.spec.name.as_str()))
            .copied()
            .filter(|&id| id < j.id)
    }
}

/// The indices of an array, from its spec (`None`: not an array).
#[must_use]
pub fn indices_of(j: &JobRec) -> Option<Vec<u32>> {
    api::ArraySpec::parse(j.spec.array.as_deref()?)
        .ok()
        .map(|a| a.indices)
}
