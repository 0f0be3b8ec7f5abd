//! Group commit: submissions that arrive together are stored in one
//! transaction, each acknowledged once it is durable, and published to
//! the shared state only then (commit, then publish). A submission's
//! handler checks it and takes its job ids under the state lock, then
//! lets go of the lock while the store writes: with SQLite's
//! `synchronous=FULL` (or PostgreSQL with fsync on) one disk flush then
//! serves every submission that waited for it, instead of one each with
//! the lock held.

use std::sync::{Arc, Weak};

use tokio::sync::{Mutex, mpsc, oneshot};

use crate::state::World;
use crate::{Change, ServerError, Shared};

/// The most submissions one transaction stores.
const MAX_GROUP: usize = 512;

/// One submission waiting to be stored, and who waits for it.
pub struct Waiting {
    change: Change,
    done: oneshot::Sender<Result<(), String>>,
}

/// What a queue's task reads from: shared, so that a task started again
/// after a panic goes on with the same queue.
pub(crate) type Receiver<T> = Arc<Mutex<mpsc::UnboundedReceiver<T>>>;

/// Work for one task that serves it in groups (submissions to store,
/// heartbeats to fold in), each with who waits for its answer.
pub struct Queue<T> {
    tx: mpsc::UnboundedSender<T>,
    rx: std::sync::Mutex<Option<Receiver<T>>>,
}

/// The queue of submissions to store, served by one task
/// ([`GroupCommit::start`]).
pub type GroupCommit = Queue<Waiting>;

impl<T> Default for Queue<T> {
    fn default() -> Queue<T> {
        let (tx, rx) = mpsc::unbounded_channel();
        Queue {
            tx,
            rx: std::sync::Mutex::new(Some(Arc::new(Mutex::new(rx)))),
        }
    }
}

impl<T: Send + 'static> Queue<T> {
    /// Queues `item`; gives it back when the task that serves the queue
    /// is gone.
    pub(crate) fn send(&self, item: T) -> Result<(), T> {
        self.tx.send(item).map_err(|e| e.0)
    }

    /// Starts `serve` on the queue, on the current tokio runtime,
    /// supervised: one that panics is logged and started again on the
    /// same queue. It holds the shared state weakly and ends with it. A
    /// queue is served once: later calls do nothing.
    pub(crate) fn serve<F>(
        &self,
        shared: &Arc<Shared>,
        what: &'static str,
        serve: fn(Weak<Shared>, Receiver<T>) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        let queue = self
            .rx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(queue) = queue else {
            return;
        };
        let weak = Arc::downgrade(shared);
        tokio::spawn(async move {
            while let Err(e) = tokio::spawn(serve(weak.clone(), queue.clone())).await {
                tracing::error!(error = %e, task = what, "a queue's task failed; started again");
            }
        });
    }
}

/// `first` and what waits behind it, `max` at most.
pub(crate) fn group<T>(rx: &mut mpsc::UnboundedReceiver<T>, first: T, max: usize) -> Vec<T> {
    let mut group = vec![first];
    while group.len() < max
        && let Ok(w) = rx.try_recv()
    {
        group.push(w);
    }
    group
}

impl GroupCommit {
    /// Starts the task that stores the queued submissions.
    pub fn start(shared: &Arc<Shared>) {
        shared.submissions.serve(shared, "group commit", serve);
    }
}

/// Stores `change` (new records only: no other writer knows them yet)
/// with the submissions that wait beside it, and publishes it to the
/// shared state once the store has it. The caller holds no lock. A
/// submission that is not stored keeps nothing in memory: its ids leave
/// [`World::storing`] and its idempotency key is forgotten.
///
/// # Errors
/// When the store refused the transaction (nothing of it was kept), or
/// the task that stores submissions is gone.
pub async fn store(shared: &Shared, change: Change) -> Result<(), ServerError> {
    let held: Vec<(u64, String, Option<String>)> = change
        .jobs
        .values()
        .map(|j| (j.id, j.user.clone(), j.idempotency_key.clone()))
        .collect();
    let (done, answer) = oneshot::channel();
    let sent = shared.submissions.send(Waiting { change, done });
    match (sent.is_ok(), answer.await) {
        (true, Ok(Ok(()))) => Ok(()),
        // The task answered: it has forgotten the submission already.
        (true, Ok(Err(e))) => Err(ServerError::Io(std::io::Error::other(e))),
        _ => {
            let held = held
                .iter()
                .map(|(id, u, k)| (*id, u.as_str(), k.as_deref()));
            forget(&mut *shared.world.lock().await, held);
            Err(ServerError::Stopping)
        }
    }
}

/// Takes back what submitted jobs that were not stored hold in memory:
/// their ids in [`World::storing`] and their idempotency keys, so that a
/// retry submits again.
/// `jobs`: (id, user, idempotency key).
fn forget<'a>(world: &mut World, jobs: impl IntoIterator<Item = (u64, &'a str, Option<&'a str>)>) {
    for (id, user, key) in jobs {
        world.storing.remove(&id);
        if let Some(k) = key {
            let key = (user.to_string(), k.to_string());
            if world.idempotency.get(&key) == Some(&id) {
                world.idempotency.remove(&key);
            }
        }
    }
}

async fn serve(shared: Weak<Shared>, queue: Receiver<Waiting>) {
    let mut rx = queue.lock().await;
    while let Some(first) = rx.recv().await {
        let group = group(&mut rx, first, MAX_GROUP);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut batch = gpuflow_store::Batch::default();
        let mut parts = Vec::with_capacity(group.len());
        for w in group {
            let (b, memory) = crate::records(w.change);
            let events = b.events.clone();
            batch.append(b);
            parts.push((memory, events, w.done));
        }
        let started = std::time::Instant::now();
        let stored = shared.store.commit(&batch).await;
        let mut world = shared.world.lock().await;
        world.stats.commit.observe(started.elapsed().as_secs_f64());
        let mut answers = Vec::with_capacity(parts.len());
        for (memory, events, done) in parts {
            match &stored {
                Ok(()) => crate::publish(&mut world, memory, &events),
                // Nothing was kept, whether or not its handler still waits.
                Err(_) => forget(
                    &mut world,
                    memory
                        .jobs
                        .values()
                        .map(|j| (j.id, j.user.as_str(), j.idempotency_key.as_deref())),
                ),
            }
            answers.push(done);
        }
        drop(world);
        if let Err(e) = &stored {
            tracing::error!(error = ?e, "a group of submissions was not stored");
        }
        let result = stored.map_err(|e| format!("{e:?}"));
        for done in answers {
            // A handler whose client went away no longer waits.
            let _ = done.send(result.clone());
        }
        shared.wake.notify_one();
    }
}
