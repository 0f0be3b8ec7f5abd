//! Leader election through a `coordination.k8s.io/v1` Lease, as Kubernetes'
//! own controllers do it: the holder renews the lease's `renewTime`; another
//! replica takes it over once `leaseDurationSeconds` have passed without a
//! renewal. Every write carries the `resourceVersion` it read, so of two
//! replicas racing for one lease exactly one wins (the other gets `409
//! Conflict` and stays a follower).
//!
//! The holder also keeps a small state on the lease (the annotation
//! [`STATE`], written with each renewal), which the next holder finds when
//! it takes over: the scheduler's fair-share usage, the reclaims it
//! counted against disruption budgets, and the preemptors waiting for
//! their victims.

use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

/// The annotation holding the holder's state.
pub const STATE: &str = "gpuflow.io/state";

/// One replica's view of the lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// What to keep on the lease.
    state: Option<String>,
    /// The state the previous holder left, until read.
    found: Option<String>,
    leading: bool,
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

impl Elector {
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Elector {
        Elector {
            api,
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
            inner: Mutex::default(),
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().expect("the elector's state")
    }

    /// The state written with the next renewal.
    pub fn set_state(&self, state: String) {
        self.inner().state = Some(state);
    }

    /// The state the previous holder left, once, after this replica took
    /// the lease.
    pub fn found_state(&self) -> Option<String> {
        self.inner().found.take()
    }

    /// Whether the last [`Elector::try_lead`] won.
    pub fn leading(&self) -> bool {
        self.inner().leading
    }

    /// Takes or renews the lease; true while this replica holds it. A
    /// replica that is not sure (the API failed) is not the leader.
    ///
    /// # Errors
    /// When the API server cannot be reached or answers other than with a
    /// conflict.
    pub async fn try_lead(&self) -> Result<bool, kube::Error> {
        let r = self.try_lead_once().await;
        self.inner().leading = matches!(r, Ok(true));
        r
    }

    async fn try_lead_once(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let secs = self.duration.as_secs().max(1) as i32;
        let state = self.inner().state.clone();
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    annotations: state.map(|s| [(STATE.to_string(), s)].into()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(e) if conflict(&e) => Ok(false),
                Err(e) => Err(e),
            };
        };
        let annotations = lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default);
        let found = annotations.get(STATE).cloned();
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let mine = spec.holder_identity.as_deref() == Some(self.identity.as_str());
        if !mine {
            let held_for = spec.lease_duration_seconds.unwrap_or(secs).max(1) as i64;
            let renewed = spec.renew_time.as_ref().map_or(0, |t| t.0.as_second());
            let vacant = spec.holder_identity.as_deref().is_none_or(str::is_empty);
            if !vacant && now.as_second() < renewed + held_for {
                return Ok(false);
            }
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(MicroTime(now));
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(secs);
        spec.renew_time = Some(MicroTime(now));
        // A replica that was not leading takes over: it finds what the last
        // holder left and, until it has its own, leaves it in place.
        let taking_over = !mine || !self.leading();
        if let Some(s) = state.filter(|_| !taking_over) {
            lease
                .metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(STATE.into(), s);
        }
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                if taking_over {
                    self.inner().found = found;
                }
                Ok(true)
            }
            Err(e) if conflict(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the lease up (on a clean shutdown), so that another replica
    /// need not wait for it to expire.
    ///
    /// # Errors
    /// As [`Elector::try_lead`].
    pub async fn release(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if conflict(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }
}
