//! A stream that may outlive its replica, as its body sees it: its events
//! through the relay, its silence watched, and when it breaks, whether it
//! goes on and where. The body (`proxy/body.rs`) calls it through a few
//! methods and tells its end what happened (`Next`).
//!
//! Its state is one of three: relaying (its events read as they pass),
//! refused (refused before it was sent: a break says why), or starting its
//! next leg. One rule holds for every refusal: a stream whose replica was
//! drained (a hand-over) stays where it was, since that replica still
//! answers; a stream whose replica died or stalled ends broken.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;

use super::leg::{self, Leg, Seed};
use super::{Refusal, Relay, Said};
use crate::fleet::Replica;
use crate::proxy::attempt::UpstreamResponse;

/// How a stream broke after its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Break {
    /// The connection closed or reset without the dialect's terminal event.
    Died,
    /// No byte for `failover.stall_ms`.
    Stalled,
    /// Its replica was drained with hand-over.
    Drained,
}

impl Break {
    pub fn as_str(self) -> &'static str {
        match self {
            Break::Died => "replica_failed",
            Break::Stalled => "stalled",
            Break::Drained => "drained",
        }
    }
}

/// What a break comes to.
pub enum Next {
    /// The answer was whole (its finish came) and only its end was
    /// missing: these bytes end the client's stream.
    Finish(&'static [u8]),
    /// It goes on: its next leg is starting (`starting`, `poll_leg`), or
    /// its drained replica, which still answers, finishes it.
    GoesOn,
    /// The next leg runs: the body reads `stream` from now on.
    Runs { stream: UpstreamResponse, to: Arc<Replica>, why: Break },
    /// It could not go on (`refused`); `stays`: its drained replica keeps
    /// it, else it ends broken.
    NotContinued { refused: Refusal, why: Break, stays: bool },
}

enum State {
    Relaying(Relay),
    Refused(Refusal),
    Starting { relay: Relay, why: Break, leg: leg::Starting },
}

/// The settings a continuation runs with (`failover.*`).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `failover.stall_ms`.
    pub stall: Duration,
    /// `failover.max_continuations`.
    pub max_legs: u32,
}

pub struct Continuation {
    state: State,
    /// The replica the stream runs on, and the hand-overs it had asked
    /// when the stream came to it.
    on: Arc<Replica>,
    handoffs_seen: u64,
    /// The replica asked for token ids, until its first event says
    /// whether it gives them (`Calibration::heard_token_ids`).
    learn: Option<Arc<Replica>>,
    limits: Limits,
    seed: Seed,
    /// The replicas its legs ran on (filled at its first break).
    tried: Vec<Arc<str>>,
}

impl Continuation {
    /// A stream on `on`, its events through `relay`, or refused up front.
    /// `asked_ids`: the gateway asked `on` for token ids (its first event
    /// says whether it gives them).
    pub fn new(relay: Result<Relay, Refusal>, on: &Arc<Replica>, asked_ids: bool, limits: Limits, seed: Seed) -> Self {
        Continuation {
            state: match relay {
                Ok(relay) => State::Relaying(relay),
                Err(refused) => State::Refused(refused),
            },
            handoffs_seen: on.handoffs(),
            learn: asked_ids.then(|| on.clone()),
            on: on.clone(),
            limits,
            seed,
            tried: Vec::new(),
        }
    }

    /// The replica's bytes through the relay (whole events out), and what
    /// its first event says of its token ids learned.
    pub fn feed(&mut self, chunk: &Bytes) -> Bytes {
        let State::Relaying(relay) = &mut self.state else { return chunk.clone() };
        let out = relay.feed(chunk);
        if relay.said.id.is_some() {
            if let Some(replica) = self.learn.take() {
                replica.calibration.heard_token_ids(relay.said.prompt_ids.is_some());
            }
        }
        out
    }

    /// What the stream said so far (None: refused before it was sent).
    pub fn said(&self) -> Option<&Said> {
        match &self.state {
            State::Relaying(relay) | State::Starting { relay, .. } => Some(&relay.said),
            State::Refused(_) => None,
        }
    }

    /// The silence allowed before the stream counts as stalled: once its
    /// first event came (with its ids, on the ids way), if it may go on.
    pub fn stall(&self) -> Option<Duration> {
        let State::Relaying(relay) = &self.state else { return None };
        (relay.said.started() && self.refusal(relay).is_none()).then_some(self.limits.stall)
    }

    /// Its replica asks it to move (a drain with hand-over), and it may.
    pub fn handed_off(&self) -> bool {
        self.on.handoffs() > self.handoffs_seen && self.stall().is_some()
    }

    /// Whether its next leg is starting (`poll_leg` says when it runs).
    pub fn starting(&self) -> bool {
        matches!(self.state, State::Starting { .. })
    }

    fn refusal(&self, relay: &Relay) -> Option<Refusal> {
        if relay.legs >= self.limits.max_legs {
            return Some(Refusal::Limit);
        }
        relay.said.refusal()
    }

    /// The stream broke (`why`). `sized`: its body has a length (no SSE
    /// ending can complete it).
    pub fn broke(&mut self, why: Break, sized: bool) -> Next {
        let mut relay = match std::mem::replace(&mut self.state, State::Refused(Refusal::NoReplica)) {
            State::Relaying(relay) => relay,
            State::Refused(refused) => return self.not_continued(refused, None, why),
            starting @ State::Starting { .. } => {
                self.state = starting;
                return Next::GoesOn;
            }
        };
        relay.at_break();
        if relay.said.finished && !sized {
            let ending = relay.ending();
            self.state = State::Relaying(relay);
            if why == Break::Drained {
                // Its usage and end are coming from where it is.
                self.handoffs_seen = self.on.handoffs();
                return Next::GoesOn;
            }
            return Next::Finish(ending);
        }
        if let Some(refused) = self.refusal(&relay) {
            return self.not_continued(refused, Some(relay), why);
        }
        // The replica it runs on (a next leg's is in already: the leg added it).
        if !self.tried.contains(&self.on.id) {
            self.tried.push(self.on.id.clone());
        }
        let leg = leg::start(&self.seed, &relay.said, &mut self.tried);
        self.state = State::Starting { relay, why, leg };
        Next::GoesOn
    }

    /// The next leg, while it starts: Runs once it does (what it said moves
    /// on to it), or NotContinued (GoesOn when none was starting).
    pub fn poll_leg(&mut self, cx: &mut Context<'_>) -> Poll<Next> {
        let State::Starting { leg, .. } = &mut self.state else { return Poll::Ready(Next::GoesOn) };
        let started = match leg.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(started) => started,
        };
        let State::Starting { mut relay, why, .. } =
            std::mem::replace(&mut self.state, State::Refused(Refusal::NoReplica))
        else {
            unreachable!("matched above")
        };
        Poll::Ready(match started {
            Ok(Leg { stream, to, via_chat }) => {
                self.handoffs_seen = to.handoffs();
                self.on = to.clone();
                relay.resumed(via_chat);
                self.state = State::Relaying(relay);
                Next::Runs { stream, to, why }
            }
            Err(refused) => self.not_continued(refused, Some(relay), why),
        })
    }

    /// The one rule for a stream that may not go on: a drained replica
    /// still answers, so the stream stays there (relayed as before); a
    /// replica that died or stalled ends it.
    fn not_continued(&mut self, refused: Refusal, relay: Option<Relay>, why: Break) -> Next {
        let stays = why == Break::Drained;
        if stays {
            self.handoffs_seen = self.on.handoffs();
        }
        self.state = match relay {
            Some(relay) if stays => State::Relaying(relay),
            _ => State::Refused(refused),
        };
        Next::NotContinued { refused, why, stays }
    }
}
