//! The response body on its way to the client: passed through chunk by
//! chunk (no buffering), watched for silence (idle timeout) and upstream
//! failure, and carrying the request's guard so that in-flight counters are
//! released on every path: end of body, upstream error, or the client going
//! away (actix drops the body, which drops the upstream response and with it
//! the upstream connection: that is the cancellation).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use actix_web::error::PayloadError;
use bytes::Bytes;
use futures_util::Stream;
use tokio::time::{Instant, Sleep};

use super::usage::UsageTap;
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
        GuardedBody { inner, idle, timer: None, sse, end: Some(end), tap, done: false, expected, seen: 0 }
    }

    fn idle_timer(&mut self) -> Pin<&mut Sleep> {
        let idle = self.idle;
        self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(idle))).as_mut()
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
        match Pin::new(&mut self.inner).poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                let idle = self.idle;
                if let Some(timer) = self.timer.as_mut() {
                    timer.as_mut().reset(Instant::now() + idle);
                }
                if self.seen == 0 && self.sse {
                    if let Some(end) = self.end.as_mut() {
                        end.first_event();
                    }
                }
                self.seen += chunk.len() as u64;
                let this = &mut *self;
                if let Some(tap) = this.tap.as_mut() {
                    tap.observe(&chunk);
                    // Before the chunk reaches the client: the follow-up
                    // naming this id cannot overtake its announcement here.
                    if let (Some(id), Some(end)) = (tap.new_response_id(), this.end.as_mut()) {
                        end.response_id(id);
                    }
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                tracing::warn!("upstream body failed mid-response: {e}");
                self.fail(BodyOutcome::UpstreamFailed, "the replica failed while streaming the response")
            }
            Poll::Ready(None) if self.truncated() => {
                tracing::warn!("upstream body ended early (connection closed mid-response)");
                self.fail(
                    BodyOutcome::UpstreamFailed,
                    "the replica closed the connection before the response was complete",
                )
            }
            Poll::Ready(None) => {
                self.finish(BodyOutcome::Complete);
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Pending => match self.idle_timer().poll(cx) {
                Poll::Ready(()) => self.fail(BodyOutcome::IdleTimeout, "the replica stopped sending (idle timeout)"),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S, E: BodyEnd> Drop for GuardedBody<S, E> {
    fn drop(&mut self) {
        // Still holding the end: nobody read the body to its end.
        self.finish(BodyOutcome::ClientGone);
    }
}
