//! Who may come in, and how often: the admin bearer token, optional client
//! API keys on `/v1`, and governor rate limits (per client on `/v1`, per IP on
//! the admin API, and a stricter one for failed admin logins).
//!
//! The client IP is the peer address, or the right-most untrusted address in
//! `X-Forwarded-For` when the peer is a configured trusted proxy (any other
//! peer could write whatever it likes there).

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::{web, HttpRequest};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use subtle::ConstantTimeEq;

use crate::config::Config;
use crate::error::ApiError;

pub struct Access {
    admin_token: Option<String>,
    api_keys: Vec<String>,
    trusted: Vec<IpAddr>,
    client: Option<DefaultKeyedRateLimiter<String>>,
    admin: Option<DefaultKeyedRateLimiter<IpAddr>>,
    auth_failures: Option<DefaultKeyedRateLimiter<IpAddr>>,
    /// IPs locked out after too many failed logins, until the instant.
    locked: Mutex<HashMap<IpAddr, Instant>>,
}

fn per_second(n: u32, burst: u32) -> Option<Quota> {
    NonZeroU32::new(n).map(|n| Quota::per_second(n).allow_burst(NonZeroU32::new(burst.max(1)).expect("max(1)")))
}

impl Access {
    pub fn new(c: &Config) -> Access {
        let r = &c.rate_limits;
        Access {
            admin_token: c.admin_token.clone().filter(|t| !t.is_empty()),
            api_keys: c.api_keys.clone(),
            trusted: r.trusted_proxies.clone(),
            client: per_second(r.client_rps, r.client_burst.max(r.client_rps)).map(RateLimiter::keyed),
            admin: per_second(r.admin_rps, r.admin_rps.saturating_mul(2)).map(RateLimiter::keyed),
            auth_failures: NonZeroU32::new(r.admin_auth_failures_per_minute)
                .map(|n| RateLimiter::keyed(Quota::per_minute(n))),
            locked: Mutex::new(HashMap::new()),
        }
    }

    pub fn admin_token_set(&self) -> bool {
        self.admin_token.is_some()
    }

    /// Drops limiter state for keys not seen lately (bounded memory).
    pub fn prune(&self) {
        for l in [&self.admin, &self.auth_failures].into_iter().flatten() {
            l.retain_recent();
            l.shrink_to_fit();
        }
        if let Some(l) = &self.client {
            l.retain_recent();
            l.shrink_to_fit();
        }
        let now = Instant::now();
        self.locked.lock().expect("lock").retain(|_, until| *until > now);
    }

    pub fn client_ip(&self, req: &HttpRequest) -> Option<IpAddr> {
        let peer = req.peer_addr()?.ip();
        if !self.trusted.contains(&peer) {
            return Some(peer);
        }
        let forwarded = req.headers().get("x-forwarded-for").and_then(|v| v.to_str().ok());
        let from_header = forwarded.and_then(|list| {
            list.rsplit(',').filter_map(|s| s.trim().parse::<IpAddr>().ok()).find(|ip| !self.trusted.contains(ip))
        });
        Some(from_header.unwrap_or(peer))
    }

    fn limited<K: std::hash::Hash + Eq + Clone>(l: &DefaultKeyedRateLimiter<K>, key: &K) -> Result<(), ApiError> {
        l.check_key(key).map_err(|not_until| ApiError::RateLimited {
            retry_after: not_until.wait_time_from(DefaultClock::default().now()),
        })
    }

    /// `/v1`: the client key (if keys are configured), then the client's rate.
    pub fn check_client(&self, req: &HttpRequest) -> Result<(), ApiError> {
        let key = bearer(req);
        if !self.api_keys.is_empty() {
            let given = key.unwrap_or("");
            // Every key is compared, in constant time, whatever matched.
            let ok = self.api_keys.iter().fold(false, |ok, k| ok | bool::from(k.as_bytes().ct_eq(given.as_bytes())));
            if !ok {
                return Err(ApiError::Unauthorized("missing or invalid API key".into()));
            }
        }
        if let Some(l) = &self.client {
            let id = match key {
                Some(k) if !self.api_keys.is_empty() => {
                    format!("key:{}", xxhash_rust::xxh3::xxh3_64(k.as_bytes()))
                }
                _ => format!("ip:{}", self.client_ip(req).map_or("?".into(), |ip| ip.to_string())),
            };
            Access::limited(l, &id)?;
        }
        Ok(())
    }

    /// Admin API: lockout, per-IP rate, then the bearer token.
    pub fn check_admin(&self, req: &HttpRequest) -> Result<(), ApiError> {
        let ip = self.client_ip(req).unwrap_or(IpAddr::from([0, 0, 0, 0]));
        if let Some(until) = self.locked.lock().expect("lock").get(&ip) {
            let now = Instant::now();
            if *until > now {
                return Err(ApiError::RateLimited { retry_after: *until - now });
            }
        }
        if let Some(l) = &self.admin {
            Access::limited(l, &ip)?;
        }
        let Some(token) = &self.admin_token else {
            return Ok(());
        };
        let given = bearer(req).unwrap_or("");
        if bool::from(token.as_bytes().ct_eq(given.as_bytes())) {
            return Ok(());
        }
        if let Some(l) = &self.auth_failures {
            if let Err(not_until) = l.check_key(&ip) {
                let wait = not_until.wait_time_from(DefaultClock::default().now()).max(Duration::from_secs(1));
                self.locked.lock().expect("lock").insert(ip, Instant::now() + wait);
                tracing::warn!(%ip, "admin API locked for {} s after repeated failed authentication", wait.as_secs());
                return Err(ApiError::RateLimited { retry_after: wait });
            }
        }
        Err(ApiError::Unauthorized("missing or invalid admin token (send Authorization: Bearer <token>)".into()))
    }
}

fn bearer(req: &HttpRequest) -> Option<&str> {
    crate::priority::bearer(req.headers().get(header::AUTHORIZATION)?.to_str().ok()?)
}

/// Middleware for the admin listener (`/admin/v1` only: metrics, docs and UI are open).
pub async fn guard_admin(
    req: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    if req.path().starts_with("/admin/") {
        let access = req.app_data::<web::Data<Access>>().expect("access data").clone();
        access.check_admin(req.request())?;
    }
    next.call(req).await
}
