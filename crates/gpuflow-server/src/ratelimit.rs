//! Rate limits: requests per second for each token, and for each address
//! that calls without a valid one (no token, an unknown, expired or
//! revoked one), through `governor`'s keyed GCRA limiters. A caller past
//! its rate gets a 429 that says when to retry; nothing is queued.
//!
//! It does not own: which routes need a token (`auth.rs`), how many
//! connections there may be (`listen.rs`).

use std::net::IpAddr;
use std::num::NonZeroU32;

use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use gpuflow_api::ApiError;

/// The default rate of one token: far above what a client, agent or
/// dashboard sends, low enough that one token cannot take the server.
pub const PER_TOKEN: u32 = 1000;
/// The default rate of one address without a valid token.
pub const ANONYMOUS: u32 = 50;

/// The limiters; `None` where a rate is 0 (no limit).
pub struct RateLimits {
    tokens: Option<DefaultKeyedRateLimiter<String>>,
    anonymous: Option<DefaultKeyedRateLimiter<IpAddr>>,
    per_token: u32,
    per_address: u32,
}

fn limiter<K: std::hash::Hash + Eq + Clone>(per_s: u32) -> Option<DefaultKeyedRateLimiter<K>> {
    let rate = NonZeroU32::new(per_s)?;
    // Bursts of up to four seconds' worth (a dashboard opening loads a
    // few dozen at once).
    let burst = NonZeroU32::new(per_s.saturating_mul(4)).unwrap_or(rate);
    Some(RateLimiter::keyed(
        Quota::per_second(rate).allow_burst(burst),
    ))
}

fn refused(who: &str, per_s: u32) -> ApiError {
    ApiError::new(
        429,
        "rate_limited",
        format!("too many requests from {who}: at most {per_s} a second; slow down and retry"),
    )
}

impl RateLimits {
    /// `per_token` and `per_address` requests a second (0: no limit).
    pub fn new(per_token: u32, per_address: u32) -> RateLimits {
        RateLimits {
            tokens: limiter(per_token),
            anonymous: limiter(per_address),
            per_token,
            per_address,
        }
    }

    /// One request with the token whose hash is `hash`.
    ///
    /// # Errors
    /// A 429 past the token's rate.
    pub fn token(&self, hash: &str) -> Result<(), ApiError> {
        match &self.tokens {
            Some(l) if l.check_key(&hash.to_string()).is_err() => {
                Err(refused("this token", self.per_token))
            }
            _ => Ok(()),
        }
    }

    /// One request from `ip` without a valid token.
    ///
    /// # Errors
    /// A 429 past the address's rate.
    pub fn anonymous(&self, ip: IpAddr) -> Result<(), ApiError> {
        match &self.anonymous {
            Some(l) if l.check_key(&ip).is_err() => Err(refused(
                "this address without a valid token",
                self.per_address,
            )),
            _ => Ok(()),
        }
    }

    /// Forgets callers whose buckets are full again (keeps memory bounded).
    pub fn tidy(&self) {
        if let Some(l) = &self.tokens {
            l.retain_recent();
            l.shrink_to_fit();
        }
        if let Some(l) = &self.anonymous {
            l.retain_recent();
            l.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_past_its_burst_is_refused_and_others_are_not() {
        let l = RateLimits::new(2, 1);
        // A burst of four seconds' worth, then refused.
        for _ in 0..8 {
            l.token("a").unwrap();
        }
        assert_eq!(l.token("a").unwrap_err().status, 429);
        l.token("b").unwrap();
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        for _ in 0..4 {
            l.anonymous(ip).unwrap();
        }
        assert!(l.anonymous(ip).is_err());
        assert!(l.anonymous("10.0.0.2".parse().unwrap()).is_ok());
        let off = RateLimits::new(0, 0);
        for _ in 0..10_000 {
            off.token("a").unwrap();
        }
    }
}
