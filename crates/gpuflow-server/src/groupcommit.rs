//! Group commit: submissions that arrive together are stored in one
//! transaction, each acknowledged once it is durable, and published to
//! the shared state only then (commit, then publish). A submission's
//! handler checks it and takes its job ids under the state lock, then
//! lets go of the lock while the store writes: with SQLite's
//! `synchronous=FULL` (or PostgreSQL with fsync on) one disk flush then
//! serves every submission that waited for it, instead of one each with
//! the lock held.

use std::sync::{Arc, Weak};

use tokio::sync::{mpsc, oneshot};

use crate::{Change, ServerError, Shared};

/// The most submissions one transaction stores.
const MAX_GROUP: usize = 512;

/// One submission waiting to be stored, and who waits for it.
struct Waiting {
    change: Change,
    done: oneshot::Sender<Result<(), String>>,
}

/// The queue of submissions to store, served by one task
/// ([`GroupCommit::start`]).
pub struct GroupCommit {
    tx: mpsc::UnboundedSender<Waiting>,
    rx: std::sync::Mutex<Option<mpsc::UnboundedReceiver<Waiting>>>,
}

impl Default for GroupCommit {
    fn default() -> GroupCommit {
        let (tx, rx) = mpsc::unbounded_channel();
        GroupCommit {
            tx,
            rx: std::sync::Mutex::new(Some(rx)),
        }
    }
}

impl GroupCommit {
    /// Starts the task that stores the queued submissions, on the current
    /// tokio runtime. It holds the shared state weakly and ends with it.
    pub fn start(shared: &Arc<Shared>) {
        let rx = shared
            .submissions
            .rx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(rx) = rx {
            tokio::spawn(serve(Arc::downgrade(shared), rx));
        }
    }
}

/// Stores `change` (new records only: no other writer knows them yet)
/// with the submissions that wait beside it, and publishes it to the
/// shared state once the store has it. The caller holds no lock.
///
/// # Errors
/// When the store refused the transaction: nothing of it was kept.
pub async fn store(shared: &Shared, change: Change) -> Result<(), ServerError> {
    let (done, answer) = oneshot::channel();
    let stopped = || ServerError::Cycle("the server is stopping".into());
    shared
        .submissions
        .tx
        .send(Waiting { change, done })
        .map_err(|_| stopped())?;
    match answer.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(ServerError::Io(std::io::Error::other(e))),
        Err(_) => Err(stopped()),
    }
}

async fn serve(shared: Weak<Shared>, mut rx: mpsc::UnboundedReceiver<Waiting>) {
    while let Some(first) = rx.recv().await {
        let mut group = vec![first];
        while group.len() < MAX_GROUP
            && let Ok(w) = rx.try_recv()
        {
            group.push(w);
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let mut batch = gpuflow_store::Batch::default();
        let mut parts = Vec::with_capacity(group.len());
        for w in group {
            let (b, jobs, nodes) = crate::records(w.change);
            batch.put.extend(b.put);
            batch.delete.extend(b.delete);
            batch.events.extend(b.events.iter().cloned());
            batch.audit.extend(b.audit);
            batch.logs.extend(b.logs);
            parts.push((jobs, nodes, b.events, w.done));
        }
        let started = std::time::Instant::now();
        let stored = shared.store.commit(&batch).await;
        let mut world = shared.world.lock().await;
        world.stats.commit.observe(started.elapsed().as_secs_f64());
        let mut answers = Vec::with_capacity(parts.len());
        for (jobs, nodes, events, done) in parts {
            match &stored {
                Ok(()) => crate::publish(&mut world, jobs, nodes, &events),
                Err(_) => {
                    // Nothing was kept: a retry with the same key submits
                    // again, whether or not its handler still waits.
                    for j in &jobs {
                        world.storing.remove(&j.id);
                        if let Some(k) = &j.idempotency_key {
                            let key = (j.user.clone(), k.clone());
                            if world.idempotency.get(&key) == Some(&j.id) {
                                world.idempotency.remove(&key);
                            }
                        }
                    }
                }
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
