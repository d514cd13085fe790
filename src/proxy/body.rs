//! The response body on its way to the client: passed through chunk by
//! chunk (no buffering), watched for silence (idle timeout) and upstream
//! failure, and carrying the request's guard so that in-flight counters are
//! released on every path: end of body, upstream error, or the client going
//! away (actix drops the body, which drops the upstream response and with it
//! the upstream connection: that is the cancellation).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::error::PayloadError;
use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use futures_util::Stream;
use tokio::time::{Instant, Sleep};

use super::resume::{Refusal, Relay, Said};
use super::usage::UsageTap;
use crate::fleet::Replica;
use crate::policy::Dialect;

/// What ends with the body: the guard, and the outcome recorder.
pub trait BodyEnd {
    /// Called once: when the body ends, fails, or is dropped unfinished.
    fn finish(&mut self, outcome: BodyOutcome, usage: Option<&UsageTap>);
    /// Called once, as soon as the body names the response it carries (a
    /// stored response of the Responses API): from the stream's first event,
    /// or from a body that arrived whole; for a body in pieces, when it
    /// ends complete.
    fn response_id(&mut self, id: &str);
    /// Called once, when a stream's first chunk passes (its first token).
    fn first_event(&mut self);
    /// The stream broke (`why`) after `said` and goes on on `to`: from now
    /// on the body is that replica's.
    fn continued(&mut self, to: Arc<Replica>, said: &Said, why: Break);
    /// The stream broke (`why`) and could not go on (`refused`).
    fn not_continued(&mut self, refused: Refusal, why: Break);
}

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

/// A resumed leg: its response, and the replica it runs on.
pub struct Leg<S> {
    pub stream: S,
    pub to: Arc<Replica>,
    /// Resumed through the chat endpoint (a chat that offers tools, so the
    /// engine parses a tool call after the seam): the answer's text it was
    /// resumed from. None: through `/v1/completions`.
    pub via_chat: Option<String>,
}

/// Starts the next leg of a broken stream (`proxy::Resumer`).
pub trait Resume<S> {
    fn start(&mut self, said: &Said) -> LocalBoxFuture<'static, Result<Leg<S>, Refusal>>;
}

/// A stream that may outlive its replica (`failover.continue_streams`):
/// its events through the relay, and the way on when it breaks.
pub struct Continuing<S> {
    /// None: refused before it was sent (`refused` says why).
    pub relay: Option<Relay>,
    pub refused: Option<Refusal>,
    /// The replica asked for token ids, until its first event says
    /// whether it gives them (`Calibration::heard_token_ids`).
    pub learn: Option<Arc<Replica>>,
    /// The replica the stream runs on, and the hand-overs it had asked
    /// when the stream came to it.
    pub on: Arc<Replica>,
    pub handoffs_seen: u64,
    pub stall: Duration,
    pub max_legs: u32,
    pub resume: Box<dyn Resume<S>>,
    pub resuming: Option<LocalBoxFuture<'static, Result<Leg<S>, Refusal>>>,
    pub why: Break,
}

impl<S> Continuing<S> {
    /// Whether the stream, broken now, may go on; why not, if not.
    fn refusal(&self) -> Option<Refusal> {
        if let Some(refused) = self.refused {
            return Some(refused);
        }
        let Some(relay) = self.relay.as_ref() else { return Some(Refusal::NoTokenIds) };
        if relay.legs >= self.max_legs {
            return Some(Refusal::Limit);
        }
        relay.said.refusal()
    }

    /// The replica's bytes through the relay (whole events out), and what
    /// its first event says of its token ids learned.
    fn feed(&mut self, chunk: &Bytes) -> Bytes {
        let Some(relay) = self.relay.as_mut() else { return chunk.clone() };
        let out = relay.feed(chunk);
        if relay.said.id.is_some() {
            if let Some(replica) = self.learn.take() {
                replica.calibration.heard_token_ids(relay.said.prompt_ids.is_some());
            }
        }
        out
    }

    /// Its replica asks it to move (a drain with hand-over), and it may.
    fn handed_off(&self) -> bool {
        self.on.handoffs() > self.handoffs_seen && self.watches_stalls()
    }

    /// Stalls are watched once the stream's first event came (with its
    /// ids, on the ids way).
    fn watches_stalls(&self) -> bool {
        self.relay.as_ref().is_some_and(|r| r.said.started()) && self.refusal().is_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyOutcome {
    Complete,
    UpstreamFailed,
    IdleTimeout,
    ClientGone,
}

pub struct GuardedBody<S, E: BodyEnd> {
    inner: S,
    idle: Duration,
    /// Armed at the first wait for the upstream: a body that arrives whole
    /// with its head (most non-streamed replies) never sets a timer.
    timer: Option<Pin<Box<Sleep>>>,
    sse: bool,
    end: Option<E>,
    tap: Option<UsageTap>,
    done: bool,
    /// The upstream's Content-Length, and the bytes seen so far.
    expected: Option<u64>,
    seen: u64,
    /// Boxed: only a stream that may go on carries it.
    continuing: Option<Box<Continuing<S>>>,
}

// Why truncation needs detecting here: awc ends a chunked body cleanly when
// the upstream connection closes between two chunks, so a crashed engine
// looks like a finished response. A body shorter than its Content-Length,
// or a stream that does not end the way its API ends streams (OpenAI's
// `data: [DONE]`, the Responses API's `response.completed`, Anthropic's
// `message_stop`: see `UsageTap::stream_completed`) is a failed upstream.

/// How a body says it ended: an SSE stream by its API's terminal event
/// (checked on successful streams only: an error reply carries none), a
/// sized body by its length.
#[derive(Debug, Clone, Copy)]
pub struct Framing {
    pub sse: bool,
    pub expected: Option<u64>,
}

impl<S, E: BodyEnd> GuardedBody<S, E> {
    pub fn new(inner: S, idle: Duration, framing: Framing, tap: Option<UsageTap>, end: E) -> Self {
        let Framing { sse, expected } = framing;
        GuardedBody {
            inner,
            idle,
            timer: None,
            sse,
            end: Some(end),
            tap,
            done: false,
            expected,
            seen: 0,
            continuing: None,
        }
    }

    /// The stream may outlive its replica.
    pub fn continuing(mut self, continuing: Continuing<S>) -> Self {
        self.continuing = Some(Box::new(continuing));
        self
    }

    /// The silence allowed now: `failover.stall_ms` for a stream that may
    /// go on (after its first event), else the idle timeout.
    fn silence(&self) -> Duration {
        match self.continuing.as_ref().filter(|c| c.watches_stalls()) {
            Some(c) => c.stall.min(self.idle),
            None => self.idle,
        }
    }

    fn idle_timer(&mut self) -> Pin<&mut Sleep> {
        let silence = self.silence();
        self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(silence))).as_mut()
    }

    /// The stream broke (`why`): its next leg starts, if it may go on;
    /// else the end hears why not.
    fn go_on(&mut self, why: Break) -> Next {
        let Some(c) = self.continuing.as_mut() else { return Next::Ends };
        if let Some(refused) = c.refusal() {
            if let Some(end) = self.end.as_mut() {
                end.not_continued(refused, why);
            }
            if why == Break::Drained {
                // Its replica still answers: the stream stays there.
                c.handoffs_seen = c.on.handoffs();
                return Next::Stays;
            }
            self.continuing = None;
            return Next::Ends;
        }
        let said = &c.relay.as_ref().expect("a relay: not refused").said;
        c.resuming = Some(c.resume.start(said));
        c.why = why;
        Next::Resuming
    }

    /// A leg being resumed, polled: Ready(true) once it runs (the body
    /// reads it from now), Ready(false) when it could not start.
    fn poll_resuming(&mut self, cx: &mut Context<'_>) -> Poll<bool> {
        let Some(c) = self.continuing.as_mut() else { return Poll::Ready(false) };
        let Some(resuming) = c.resuming.as_mut() else { return Poll::Ready(false) };
        let leg = match resuming.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(leg) => leg,
        };
        c.resuming = None;
        let why = c.why;
        match leg {
            Ok(Leg { stream, to, via_chat }) => {
                c.handoffs_seen = to.handoffs();
                c.on = to.clone();
                let relay = c.relay.as_mut().expect("a relay: it resumed");
                relay.resumed(via_chat);
                if let Some(end) = self.end.as_mut() {
                    end.continued(to, &relay.said, why);
                }
                self.inner = stream;
                self.timer = None;
                Poll::Ready(true)
            }
            Err(refused) => {
                if let Some(end) = self.end.as_mut() {
                    end.not_continued(refused, why);
                }
                if why == Break::Drained {
                    // Its replica still answers: the stream goes on there.
                    c.handoffs_seen = c.on.handoffs();
                    return Poll::Ready(true);
                }
                self.continuing = None;
                Poll::Ready(false)
            }
        }
    }

    fn truncated(&self) -> bool {
        let short = self.expected.is_some_and(|n| self.seen < n);
        let unterminated = self.sse && !self.tap.as_ref().is_some_and(UsageTap::stream_completed);
        short || unterminated
    }

    fn finish(&mut self, outcome: BodyOutcome) {
        if let Some(mut end) = self.end.take() {
            if let Some(tap) = self.tap.as_mut() {
                tap.finish();
                if outcome == BodyOutcome::Complete {
                    if let Some(id) = tap.new_response_id() {
                        end.response_id(id);
                    }
                }
            }
            end.finish(outcome, self.tap.as_ref());
        }
    }

    /// How a failure reaches the client: an SSE error event in its API's
    /// own form (the SDKs raise it) then a clean end, or for plain bodies an
    /// aborted response.
    fn fail(&mut self, outcome: BodyOutcome, message: &str) -> Poll<Option<Result<Bytes, PayloadError>>> {
        self.finish(outcome);
        self.done = true;
        if self.sse {
            let dialect = self.tap.as_ref().map_or(Dialect::Chat, UsageTap::dialect);
            Poll::Ready(Some(Ok(Bytes::from(sse_error(dialect, message)))))
        } else {
            Poll::Ready(Some(Err(PayloadError::Io(std::io::Error::other(message.to_string())))))
        }
    }
}

/// A stream's error event as each API writes it.
fn sse_error(dialect: Dialect, message: &str) -> String {
    match dialect {
        Dialect::Messages => {
            let e = serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}});
            format!("event: error\ndata: {e}\n\n")
        }
        Dialect::Responses => {
            let e = serde_json::json!({"type": "error", "code": "upstream_stream_failed", "message": message, "param": null});
            format!("event: error\ndata: {e}\n\n")
        }
        _ => {
            let e = serde_json::json!({"error": {"message": message, "type": "upstream_error", "code": "upstream_stream_failed"}});
            format!("data: {e}\n\n")
        }
    }
}

impl<S, E> Stream for GuardedBody<S, E>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
    E: BodyEnd + Unpin,
{
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        loop {
            if self.continuing.as_ref().is_some_and(|c| c.resuming.is_some()) {
                match self.poll_resuming(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(true) => {}
                    Poll::Ready(false) => return self.fail(BodyOutcome::UpstreamFailed, NOT_CONTINUED),
                }
            }
            // Between two events: the relay passed every whole one.
            if self.continuing.as_ref().is_some_and(|c| c.handed_off()) {
                tracing::info!("a stream is handed over from its draining replica");
                match self.broke(Break::Drained, "the replica was drained") {
                    Some(end) => return end,
                    None => continue, // its next leg is starting: the old one is read no more
                }
            }
            match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => {
                    let silence = self.silence();
                    if let Some(timer) = self.timer.as_mut() {
                        timer.as_mut().reset(Instant::now() + silence);
                    }
                    let chunk = match self.continuing.as_mut() {
                        Some(c) => c.feed(&chunk),
                        None => chunk,
                    };
                    if chunk.is_empty() {
                        continue; // part of an event: it passes whole
                    }
                    return Poll::Ready(Some(Ok(self.pass(chunk))));
                }
                Poll::Ready(Some(Err(e))) => {
                    tracing::warn!("upstream body failed mid-response: {e}");
                    if let Some(end) = self.broke(Break::Died, NOT_CONTINUED) {
                        return end;
                    }
                }
                Poll::Ready(None) if self.truncated() => {
                    tracing::warn!("upstream body ended early (connection closed mid-response)");
                    let message = "the replica closed the connection before the response was complete";
                    if let Some(end) = self.broke(Break::Died, message) {
                        return end;
                    }
                }
                Poll::Ready(None) => {
                    self.finish(BodyOutcome::Complete);
                    self.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => {
                    let stalls = self.continuing.as_ref().is_some_and(|c| c.watches_stalls());
                    match self.idle_timer().poll(cx) {
                        Poll::Ready(()) if stalls => {
                            tracing::warn!("upstream stream stalled: it goes on elsewhere");
                            if let Some(end) = self.broke(Break::Stalled, "the replica stopped sending (stalled)") {
                                return end;
                            }
                        }
                        Poll::Ready(()) => {
                            return self.fail(BodyOutcome::IdleTimeout, "the replica stopped sending (idle timeout)")
                        }
                        Poll::Pending => return Poll::Pending,
                    }
                }
            }
        }
    }
}

/// What a client reads when its stream broke and could not go on.
const NOT_CONTINUED: &str = "the replica failed while streaming the response";

impl<S, E> GuardedBody<S, E>
where
    S: Stream<Item = Result<Bytes, PayloadError>> + Unpin,
    E: BodyEnd + Unpin,
{
    /// A chunk on its way to the client: its first event timed, its bytes
    /// counted and watched.
    fn pass(&mut self, chunk: Bytes) -> Bytes {
        if self.seen == 0 && self.sse {
            if let Some(end) = self.end.as_mut() {
                end.first_event();
            }
        }
        self.seen += chunk.len() as u64;
        if let Some(tap) = self.tap.as_mut() {
            tap.observe(&chunk);
            // Before the chunk reaches the client: the follow-up
            // naming this id cannot overtake its announcement here.
            if let (Some(id), Some(end)) = (tap.new_response_id(), self.end.as_mut()) {
                end.response_id(id);
            }
        }
        chunk
    }

    /// The stream broke: None when it goes on (its next leg is being
    /// started, or a drained replica keeps a stream that may not move);
    /// else what the client reads now. A stream whose answer was whole (its
    /// finish came) and only its end was missing is ended.
    fn broke(&mut self, why: Break, message: &str) -> Option<Poll<Option<Result<Bytes, PayloadError>>>> {
        let relay = self.continuing.as_mut().and_then(|c| c.relay.as_mut());
        let ending = relay.and_then(|r| {
            r.at_break();
            r.said.finished.then(|| r.ending())
        });
        match ending.filter(|_| self.expected.is_none()) {
            // A drained replica finishes it: its usage and end are coming.
            Some(_) if why == Break::Drained => return None,
            Some(ending) => {
                self.continuing = None;
                let done = self.pass(Bytes::from_static(ending));
                self.finish(BodyOutcome::Complete);
                self.done = true;
                return Some(Poll::Ready(Some(Ok(done))));
            }
            None => {}
        }
        match self.go_on(why) {
            Next::Resuming | Next::Stays => None,
            Next::Ends => Some(match why {
                Break::Died => self.fail(BodyOutcome::UpstreamFailed, message),
                Break::Stalled | Break::Drained => self.fail(BodyOutcome::IdleTimeout, message),
            }),
        }
    }
}

/// What a broken stream does next.
enum Next {
    /// Its next leg is starting.
    Resuming,
    /// It stays on its replica (a drain's hand-over it may not take).
    Stays,
    /// It ends broken.
    Ends,
}

impl<S, E: BodyEnd> Drop for GuardedBody<S, E> {
    fn drop(&mut self) {
        // Still holding the end: nobody read the body to its end.
        self.finish(BodyOutcome::ClientGone);
    }
}
