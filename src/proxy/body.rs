//! The response body on its way to the client: passed through chunk by
//! chunk (no buffering), watched for silence (idle timeout) and upstream
//! failure, and carrying the request's guard so that in-flight counters are
//! released on every path: end of body, upstream error, or the client going
//! away (actix drops the body, which drops the upstream response and with it
//! the upstream connection: that is the cancellation). A stream that may
//! outlive its replica carries its continuation (`resume/continuation.rs`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::error::PayloadError;
use bytes::Bytes;
use futures_util::Stream;
use tokio::time::{Instant, Sleep};

use super::attempt::UpstreamResponse;
use super::resume::{Break, Continuation, Next, Refusal, Said};
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
    /// The stream broke (`why`) after `said` and was continued on `to`:
    /// from now on the body is that replica's.
    fn continued(&mut self, to: Arc<Replica>, said: &Said, why: Break);
    /// The stream broke (`why`) and could not be continued (`refused`).
    fn not_continued(&mut self, refused: Refusal, why: Break);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyOutcome {
    Complete,
    UpstreamFailed,
    IdleTimeout,
    ClientGone,
}

type Chunk = Poll<Option<Result<Bytes, PayloadError>>>;

pub struct GuardedBody<E: BodyEnd> {
    inner: UpstreamResponse,
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
    /// Boxed: only a stream that may be continued carries it.
    continuation: Option<Box<Continuation>>,
}

// Why truncation needs detecting here: awc ends a chunked body cleanly when
// the upstream connection closes between two chunks, so a crashed engine
// looks like a finished response. A body shorter than its Content-Length,
// or a stream that does not end the way its API ends streams (OpenAI's
// `data: [DONE]`, the Responses API's `response.completed`, Anthropic's
// `message_stop`: see `UsageTap::stream_completed`) is a failed upstream.

impl<E: BodyEnd> GuardedBody<E> {
    /// How it says it ended: `sse`, by its API's terminal event (checked on
    /// successful streams only: an error reply carries none), else by its
    /// length (`expected`). `continuation`: the stream may outlive its replica.
    pub fn new(
        inner: UpstreamResponse,
        (idle, sse, expected): (Duration, bool, Option<u64>),
        tap: Option<UsageTap>,
        end: E,
        continuation: Option<Continuation>,
    ) -> Self {
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
            continuation: continuation.map(Box::new),
        }
    }

    /// The silence allowed now: `failover.stall_ms` for a stream that may
    /// go on (after its first event), else the idle timeout.
    fn silence(&self) -> Duration {
        self.continuation.as_ref().and_then(|c| c.stall()).map_or(self.idle, |stall| stall.min(self.idle))
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
    fn fail(&mut self, outcome: BodyOutcome, message: &str) -> Chunk {
        self.finish(outcome);
        self.done = true;
        if self.sse {
            let dialect = self.tap.as_ref().map_or(Dialect::Chat, UsageTap::dialect);
            Poll::Ready(Some(Ok(Bytes::from(crate::error::stream_error_event(dialect, message)))))
        } else {
            Poll::Ready(Some(Err(PayloadError::Io(std::io::Error::other(message.to_string())))))
        }
    }

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

    /// The stream broke (`why`): None when it goes on (its next leg is
    /// starting, or its drained replica keeps it); else what the client
    /// reads now (`message`, when it ends broken).
    fn broke(&mut self, why: Break, message: &str) -> Option<Chunk> {
        let Some(c) = self.continuation.as_mut() else { return Some(self.ended_broken(why, message)) };
        let next = c.broke(why, self.expected.is_some());
        self.heard(next, message)
    }

    /// What a break came to, told to the end and done: None while the
    /// stream goes on.
    fn heard(&mut self, next: Next, message: &str) -> Option<Chunk> {
        match next {
            Next::GoesOn => None,
            Next::Finish(ending) => {
                self.continuation = None;
                let done = self.pass(Bytes::from_static(ending));
                self.finish(BodyOutcome::Complete);
                self.done = true;
                Some(Poll::Ready(Some(Ok(done))))
            }
            Next::Runs { stream, to, why } => {
                let said = self.continuation.as_ref().and_then(|c| c.said());
                if let (Some(end), Some(said)) = (self.end.as_mut(), said) {
                    end.continued(to, said, why);
                }
                self.inner = stream;
                self.timer = None;
                None
            }
            Next::NotContinued { refused, why, stays } => {
                if let Some(end) = self.end.as_mut() {
                    end.not_continued(refused, why);
                }
                if stays {
                    return None;
                }
                self.continuation = None;
                Some(self.ended_broken(why, message))
            }
        }
    }

    fn ended_broken(&mut self, why: Break, message: &str) -> Chunk {
        match why {
            Break::Died => self.fail(BodyOutcome::UpstreamFailed, message),
            Break::Stalled | Break::Drained => self.fail(BodyOutcome::IdleTimeout, message),
        }
    }

    /// Bytes from the replica: the silence timer restarted, and what of
    /// them passes now (None: part of an event, which passes whole).
    fn arrived(&mut self, chunk: Bytes) -> Option<Chunk> {
        let silence = self.silence();
        if let Some(timer) = self.timer.as_mut() {
            timer.as_mut().reset(Instant::now() + silence);
        }
        let chunk = match self.continuation.as_mut() {
            Some(c) => c.feed(&chunk),
            None => chunk,
        };
        (!chunk.is_empty()).then(|| Poll::Ready(Some(Ok(self.pass(chunk)))))
    }

    /// The upstream said nothing yet: the silence timer decides (a stall
    /// that breaks the stream, or the idle timeout). None: read again.
    fn quiet(&mut self, cx: &mut Context<'_>) -> Option<Chunk> {
        let silence = self.silence();
        let stalls = self.continuation.as_ref().is_some_and(|c| c.stall().is_some());
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(silence)));
        match timer.as_mut().poll(cx) {
            Poll::Pending => Some(Poll::Pending),
            Poll::Ready(()) if stalls => {
                tracing::warn!("upstream stream stalled: it is continued elsewhere");
                self.broke(Break::Stalled, "the replica stopped sending (stalled)")
            }
            Poll::Ready(()) => Some(self.fail(BodyOutcome::IdleTimeout, "the replica stopped sending (idle timeout)")),
        }
    }
}

/// What a client reads when its stream broke and could not go on.
const NOT_CONTINUED: &str = "the replica failed while streaming the response";

impl<E: BodyEnd + Unpin> Stream for GuardedBody<E> {
    type Item = Result<Bytes, PayloadError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Chunk {
        if self.done {
            return Poll::Ready(None);
        }
        loop {
            if let Some(c) = self.continuation.as_mut().filter(|c| c.starting()) {
                let Poll::Ready(next) = c.poll_leg(cx) else { return Poll::Pending };
                if let Some(end) = self.heard(next, NOT_CONTINUED) {
                    return end;
                }
            }
            // Between two events: the relay passed every whole one.
            if self.continuation.as_ref().is_some_and(|c| c.handed_off()) {
                tracing::info!("a stream is handed over from its draining replica");
                match self.broke(Break::Drained, "the replica was drained") {
                    Some(end) => return end,
                    None => continue, // its next leg is starting: the old one is read no more
                }
            }
            let outcome = match Pin::new(&mut self.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(chunk))) => self.arrived(chunk),
                Poll::Ready(Some(Err(e))) => {
                    tracing::warn!("upstream body failed mid-response: {e}");
                    self.broke(Break::Died, NOT_CONTINUED)
                }
                Poll::Ready(None) if self.truncated() => {
                    tracing::warn!("upstream body ended early (connection closed mid-response)");
                    self.broke(Break::Died, "the replica closed the connection before the response was complete")
                }
                Poll::Ready(None) => {
                    self.finish(BodyOutcome::Complete);
                    self.done = true;
                    Some(Poll::Ready(None))
                }
                Poll::Pending => self.quiet(cx),
            };
            if let Some(out) = outcome {
                return out;
            }
        }
    }
}

impl<E: BodyEnd> Drop for GuardedBody<E> {
    fn drop(&mut self) {
        // Still holding the end: nobody read the body to its end.
        self.finish(BodyOutcome::ClientGone);
    }
}
