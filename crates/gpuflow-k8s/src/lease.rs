//! Leader election through a `coordination.k8s.io/v1` Lease, as Kubernetes'
//! own controllers do it: the holder renews the lease's `renewTime`; another
//! replica takes it over once `leaseDurationSeconds` have passed without a
//! renewal. Every write carries the `resourceVersion` it read, so of two
//! replicas racing for one lease exactly one wins (the other gets `409
//! Conflict` and stays a follower).

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

/// One replica's view of the lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
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
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Takes or renews the lease; true while this replica holds it. A
    /// replica that is not sure (the API failed) is not the leader.
    ///
    /// # Errors
    /// When the API server cannot be reached or answers other than with a
    /// conflict.
    pub async fn try_lead(&self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let secs = self.duration.as_secs().max(1) as i32;
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
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
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
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
