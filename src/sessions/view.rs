//! What the sessions view shows (`GET /admin/v1/sessions`, the UI's
//! "Sessions"): every session resident on a replica here, and the new ones
//! held for room, each with its context, projection, class, client, state
//! and how long it waited. Read under the same locks as the room (the
//! sessions' state, then one replica's residents at a time).

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{Sessions, State};
use crate::fleet::residents::Resident;
use crate::priority::Class;

/// Where a session stands now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    /// A turn of it runs.
    Running,
    /// Between turns: resident until it idles out.
    Idle,
    /// Its next turn waits at the wall for room on its replica.
    Paused,
    /// New, waiting for room on any replica.
    Held,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SessionView {
    /// The session's id, 32 hex digits (its pin family's key; none while held).
    pub session: Option<String>,
    /// Its replica (none while held).
    pub replica: Option<String>,
    pub state: SessionState,
    pub class: Class,
    /// Its client: an API key's hash (`key-...`), an `x-prefixgate-client`
    /// name, `anonymous`, or `elsewhere` (known from another instance's pins).
    pub client: String,
    /// Its context at its latest turn, tokens (held: its estimated footprint).
    pub context_tokens: u64,
    /// What it was projected to grow to when it arrived (0: nothing learned).
    pub projected_tokens: u64,
    /// What it counts for against its replica's room.
    pub counted_tokens: u64,
    pub turns: u32,
    /// How long it waited at the wall: its pauses (the one now included),
    /// or, held, its wait so far, ms.
    pub waited_ms: u64,
    /// A turn of it ran on this instance (not only another's pins say so).
    pub served_here: bool,
}

impl Sessions {
    /// Every session this instance knows, resident ones by replica, then
    /// the held in the order they go; at most `limit`.
    pub fn view(&self, now_ms: u64, limit: usize) -> Vec<SessionView> {
        let state = self.lock();
        let mut out: Vec<SessionView> = Vec::new();
        for (session, home) in &state.home {
            let Some(replica) = home.upgrade() else { continue };
            let Some(r) = replica.residents.get(*session) else { continue };
            out.push(resident_view(&state, &replica.id, *session, &r, now_ms));
        }
        out.sort_by(|a, b| a.replica.cmp(&b.replica).then(a.session.cmp(&b.session)));
        out.extend(state.held.in_order().into_iter().map(|w| SessionView {
            session: None,
            replica: None,
            state: SessionState::Held,
            class: w.class,
            client: w.client.to_string(),
            context_tokens: w.value.tokens,
            projected_tokens: 0,
            counted_tokens: 0,
            turns: 0,
            waited_ms: now_ms.saturating_sub(w.value.since_ms),
            served_here: true,
        }));
        out.truncate(limit);
        out
    }
}

fn resident_view(state: &State, replica: &str, session: u128, r: &Resident, now_ms: u64) -> SessionView {
    let status = match (r.paused, r.running) {
        (1.., _) => SessionState::Paused,
        (0, 1..) => SessionState::Running,
        (0, 0) => SessionState::Idle,
    };
    let pausing = if r.paused > 0 { now_ms.saturating_sub(r.paused_since_ms) } else { 0 };
    SessionView {
        session: Some(format!("{session:032x}")),
        replica: Some(replica.to_string()),
        state: status,
        class: r.class,
        client: state.clients.get(&r.client).map_or_else(|| "elsewhere".to_string(), |c| c.to_string()),
        context_tokens: r.tokens,
        projected_tokens: r.projected,
        counted_tokens: r.counted_tokens(),
        turns: r.turns,
        waited_ms: r.waited_ms + pausing,
        served_here: r.ours,
    }
}
