//! `/admin/v1/capacity`: working set against KV capacity, per replica and
//! for the fleet, with a verdict in plain words.

use actix_web::{get, web};
use utoipa_actix_web::service_config::ServiceConfig;

use crate::capacity::{CapacityReport, HeldByClass, SessionQueue};
use crate::state::AppState;

pub fn routes(cfg: &mut ServiceConfig) {
    cfg.service(get_capacity);
}

/// A read: computed from the current state, changing nothing (warning
/// events come from the background evaluation, once per transition).
#[utoipa::path(tag = "capacity", responses((status = 200, body = CapacityReport)))]
#[get("/capacity")]
async fn get_capacity(s: web::Data<AppState>) -> web::Json<CapacityReport> {
    let mut report = s.capacity.report(&s.fleet.capacity_inputs(s.capacity.since_ms(crate::clock::now_ms())));
    // The sessions' side: who is resident where, the room left, the queue.
    for r in &mut report.replicas {
        if let Some(replica) = s.fleet.get(&r.replica) {
            let resident = crate::sessions::Sessions::resident(&replica);
            (r.resident_sessions, r.resident_tokens) = (resident.sessions, resident.counted_tokens);
            r.room_tokens = s.sessions.room_shown(&replica);
            r.evidence = replica.residents.evidence.learned();
            r.learned_tokens = r.evidence.capacity(r.kv_tokens, replica.slot_tokens());
            r.prefill_tokens_per_s = replica.residents.pace().prefill_tps.map(f64::round);
        }
    }
    let (settings, waits, projections) =
        (s.sessions.settings(), s.sessions.wait_stats(), s.sessions.projection_figures());
    report.sessions = SessionQueue {
        held: s.sessions.held(),
        max_held: settings.max_held,
        max_wait_ms: settings.max_wait_ms,
        idle_ms: settings.idle_ms,
        waited: waits.waited,
        over_capacity: waits.over_capacity,
        mean_wait_ms: waits.total_ms.checked_div(waits.waited).unwrap_or(0),
        max_wait_seen_ms: waits.max_ms,
        projected_tokens: projections.fleet_tokens,
        projections_learned: projections.sessions_learned,
        projection_links: projections.links,
        held_by_class: {
            let [interactive, default, background] = s.sessions.held_by_class();
            HeldByClass { interactive, default, background }
        },
        paused_turns: s.sessions.paused(),
        queue: s.sessions.queue(crate::clock::now_ms()),
    };
    let identity = &s.config.identity;
    report.tenancy = crate::policy::tenancy::Tenancy { scope: identity.scope, cache_salt: identity.cache_salt };
    web::Json(report)
}
