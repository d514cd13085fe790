//! One attempt: the request built for one replica (`Upstream`, the client
//! side of the hop) and sent, up to its response head.
//! The error says whether a re-send is safe, as Pingora's errors do. The
//! retry rule, stated once (docs/operations.md, "Failover", says the same):
//!
//! | what happened | re-sent? | the replica |
//! |---|---|---|
//! | connection refused, reset or failed before the request was written | yes, to another replica | marked down at once |
//! | connection closed after the request was written, before any response byte | yes: once to the same replica on another connection, then to another replica | not marked down by this (the prober decides) |
//! | no response head within `timeouts.response_head_ms` | no: 504 | |
//! | a malformed response | no: 502 | |
//! | any response byte reached the client | never | |
//! | a stream broke after its first byte | it goes on elsewhere: token for token where the engine gave ids, else from its text (`Resumer`, `resume/`) | |
//!
//! Why a close after the write is re-sent: it is what a client sees when the
//! replica closed an idle pooled connection just as the request went out
//! (the replica never read it: re-sending on a fresh connection is
//! harmless, and marking a healthy replica down for it would not be), and
//! when a replica died after reading the request (it answers nothing, and
//! the next attempt on it is refused). A timeout is not re-sent: the engine
//! may be generating, and generation is not idempotent.
//!
//! The one case where a re-send is not harmless: a Responses request that
//! stores its response (`store`, true unless the client says false) may
//! have been stored by a replica that then closed without answering. It is
//! re-sent all the same (the client never saw that response's id, so
//! nothing can reach it; refusing would only hand the client the retry),
//! and the history records that the replica may hold an unreachable stored
//! response.

use std::sync::Arc;
use std::time::Duration;

use actix_web::error::ParseError;
use actix_web::web;
use awc::error::{ConnectError, SendRequestError};

use super::headers;
use super::resume::transcript::{tokens_of, transcript, Transcript};
use super::resume::{chat_resume_request, offers_tools, resume_request, Refusal, Said, Way};
use crate::error::ApiError;
use crate::fleet::ReplicaSpec;

/// One awc client per actix worker (awc is `!Send`), built in the app
/// factory, with what this worker derived from the replicas once.
pub struct Upstream {
    pub(super) client: awc::Client,
    pub(super) replicas: headers::PerReplica,
}

impl Upstream {
    pub fn new(t: &crate::config::Timeouts) -> Upstream {
        let connector = crate::connector::connector(Duration::from_millis(t.connect_ms))
            // No pool cap: a thousand concurrent streams is a normal day.
            .limit(0);
        let client = awc::Client::builder()
            .connector(connector)
            .no_default_headers()
            .disable_redirects()
            // awc's default of 5 s would kill a slow first token; this
            // bounds sending plus the response head only.
            .timeout(Duration::from_millis(t.response_head_ms))
            .finish();
        Upstream { client, replicas: headers::PerReplica::default() }
    }

    /// A JSON `POST` to `path` on the replica `spec` (a resumed stream's
    /// leg and the tokenize before it, `Resumer`; the engine's count,
    /// `count.rs`), with the credentials
    /// `req` carries there.
    pub(super) fn post_json(
        &self,
        spec: &Arc<ReplicaSpec>,
        caller: headers::Caller<'_>,
        path: &'static str,
    ) -> awc::ClientRequest {
        let target = self.replicas.target(spec, &actix_web::http::Uri::from_static(path));
        headers::replica_request(&self.client, actix_web::http::Method::POST, target, caller, spec)
            .insert_header((actix_web::http::header::CONTENT_TYPE, "application/json"))
    }

    /// The upstream request for `req` on the replica `spec`.
    pub(super) fn request(&self, spec: &Arc<ReplicaSpec>, caller: headers::Caller<'_>) -> awc::ClientRequest {
        headers::upstream_request(&self.client, self.replicas.target(spec, caller.req.uri()), caller, spec)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailure {
    /// The request never reached the replica (refused, reset or failed
    /// before it was written).
    Connect,
    /// The connection closed after the request was written, before any
    /// response byte.
    ClosedAfterWrite,
    /// No response head within `timeouts.response_head_ms`.
    Timeout,
    /// Anything else after the request went out (a malformed response, ...).
    Upstream,
}

#[derive(Debug)]
pub struct AttemptError {
    pub failure: AttemptFailure,
    pub message: String,
}

impl AttemptError {
    pub fn retry_safe(&self) -> bool {
        matches!(self.failure, AttemptFailure::Connect | AttemptFailure::ClosedAfterWrite)
    }

    /// The status recorded in metrics for an attempt that ended here.
    pub fn status_label(&self) -> &'static str {
        match self.failure {
            AttemptFailure::Connect => "connect_failed",
            AttemptFailure::ClosedAfterWrite => "closed_after_write",
            AttemptFailure::Timeout => "504",
            AttemptFailure::Upstream => "502",
        }
    }

    pub fn into_api_error(self) -> ApiError {
        match self.failure {
            AttemptFailure::Timeout => ApiError::UpstreamTimeout,
            AttemptFailure::Connect | AttemptFailure::ClosedAfterWrite | AttemptFailure::Upstream => {
                ApiError::Upstream(self.message)
            }
        }
    }
}

impl From<SendRequestError> for AttemptError {
    fn from(e: SendRequestError) -> Self {
        let failure = match e {
            // awc's name for "the connection ended where the response head should be".
            SendRequestError::Connect(ConnectError::Disconnected) => AttemptFailure::ClosedAfterWrite,
            // Reset while the head was awaited: the same, seen as an I/O error.
            SendRequestError::Response(ParseError::Io(_)) => AttemptFailure::ClosedAfterWrite,
            SendRequestError::Connect(_) | SendRequestError::Send(_) => AttemptFailure::Connect,
            SendRequestError::Timeout => AttemptFailure::Timeout,
            _ => AttemptFailure::Upstream,
        };
        AttemptError { failure, message: e.to_string() }
    }
}

/// A response head, its body still to come.
pub type UpstreamResponse = awc::ClientResponse<actix_web::dev::Decompress<actix_web::dev::Payload>>;

/// Sends the upstream request (`headers::upstream_request`) with the
/// client's body, byte for byte.
pub async fn send(request: awc::ClientRequest, body: web::Bytes) -> Result<UpstreamResponse, AttemptError> {
    request.send_body(body).await.map_err(AttemptError::from)
}

/// The way on for a broken stream (`body::Resume`): another replica, chosen
/// as a failover chooses (the planner, without the replicas it ran on),
/// sent the resuming `/v1/completions` (`resume::resume_request`), its
/// prompt the ids the stream kept or, on the text way, the ids the replica
/// made of the conversation and the answer so far (`tokenize`).
pub struct Resumer {
    pub state: web::Data<crate::state::AppState>,
    pub upstream: web::Data<Upstream>,
    /// The client's request, for the credentials a replica is sent.
    pub req: actix_web::HttpRequest,
    /// The body as the client sent it (parsed only if the stream breaks).
    pub body: web::Bytes,
    pub shape: crate::policy::RequestShape,
    pub mode: crate::policy::Mode,
    /// The replicas its legs ran on.
    pub tried: Vec<Arc<str>>,
    pub trace: super::trace::RequestTrace,
}

type LegStarted = futures_util::future::LocalBoxFuture<'static, Result<super::body::Leg<UpstreamResponse>, Refusal>>;

/// What a resumed leg is made of: its prompt, the client's request.
struct LegPlan {
    prompt: Prompt,
    request: serde_json::Value,
    dialect: crate::policy::Dialect,
    generated: usize,
}

/// How a resumed leg's prompt is had.
enum Prompt {
    /// `/v1/completions` with these ids.
    Ids(Vec<u32>),
    /// `/v1/completions` with the transcript as the replica tokenizes it.
    Text(Transcript),
    /// The chat endpoint, the answer so far as the open last message (a
    /// chat that offers tools: the engine's tool parser sees what follows
    /// the seam): its text, or its ids to detokenize.
    Chat { text: Option<String>, ids: Vec<u32> },
}

impl LegPlan {
    /// From what the stream said, for `request` (None: refused, why).
    fn of(said: &Said, request: serde_json::Value, dialect: crate::policy::Dialect) -> Result<LegPlan, Refusal> {
        let via_chat = dialect == crate::policy::Dialect::Chat && offers_tools(&request);
        let prompt = match (said.way, via_chat) {
            (Way::Text, true) => Prompt::Chat { text: Some(said.text.clone()), ids: Vec::new() },
            (Way::Ids, true) => Prompt::Chat { text: None, ids: said.generated.clone() },
            (Way::Ids, false) => Prompt::Ids(said.prompt_with_answer().ok_or(Refusal::NoTokenIds)?),
            (Way::Text, false) => Prompt::Text(transcript(dialect, &request, &said.text).ok_or(Refusal::NoTranscript)?),
        };
        Ok(LegPlan { prompt, request, dialect, generated: said.seam() })
    }

    /// The path and body the leg is sent on the replica `spec`, and the
    /// answer's text when it goes through the chat endpoint.
    async fn sent_as(
        self,
        upstream: &Upstream,
        spec: &Arc<ReplicaSpec>,
        caller: headers::Caller<'_>,
    ) -> Option<(&'static str, web::Bytes, Option<String>)> {
        let (request, dialect, generated) = (&self.request, self.dialect, self.generated);
        let ids = match self.prompt {
            Prompt::Ids(ids) => ids,
            Prompt::Text(transcript) => tokenize(upstream, spec, caller, &transcript).await?,
            Prompt::Chat { text, ids } => {
                let answer = match text {
                    Some(text) => text,
                    None => detokenize(upstream, spec, caller, request, ids).await?,
                };
                let body = chat_resume_request(request, &answer, generated)?;
                return Some(("/v1/chat/completions", body, Some(answer)));
            }
        };
        Some(("/v1/completions", resume_request(request, dialect, &ids, generated)?, None))
    }
}

impl super::body::Resume<UpstreamResponse> for Resumer {
    fn start(&mut self, said: &Said) -> LegStarted {
        let refused = |why| -> LegStarted { Box::pin(std::future::ready(Err(why))) };
        let Ok(permit) = self.state.resuming.clone().try_acquire_owned() else { return refused(Refusal::Busy) };
        let Ok(request) = serde_json::from_slice::<serde_json::Value>(&self.body) else {
            return refused(Refusal::NoTranscript);
        };
        let plan = match LegPlan::of(said, request, self.shape.dialect) {
            Ok(plan) => plan,
            Err(why) => return refused(why),
        };
        let Some(to) = self.next_replica() else { return refused(Refusal::NoReplica) };
        self.tried.push(to.id.clone());
        let (span, carried) = self.trace.attempt(&self.state, &to.id);
        let (upstream, req) = (self.upstream.clone(), self.req.clone());
        let gateway_keys = !self.state.config.api_keys.is_empty();
        let (state, model) = (self.state.clone(), self.shape.model.clone().unwrap_or_default());
        Box::pin(async move {
            let _starting = permit;
            let Ok(_fleet_wide) = fleet_wide_start(&state, &model).await else {
                super::trace::attempt_ended(&span, Err(("too many resumed legs starting across the fleet", false)));
                return Err(Refusal::Busy);
            };
            let caller = headers::Caller { req: &req, gateway_keys };
            let spec = to.spec();
            let Some((path, body, via_chat)) = plan.sent_as(&upstream, &spec, caller).await else {
                super::trace::attempt_ended(&span, Err(("the replica tokenized no conversation", false)));
                return Err(Refusal::NoTokenizer);
            };
            let mut request = upstream.post_json(&spec, caller, path);
            for (name, value) in carried {
                request = request.insert_header((name, value));
            }
            let sent = send(request, body).await;
            let status = sent.as_ref().map(|r| r.status().as_u16()).map_err(|e| (e.message.as_str(), false));
            super::trace::attempt_ended(&span, status);
            match sent {
                Ok(resp) if resp.status().is_success() => Ok(super::body::Leg { stream: resp, to, via_chat }),
                _ => Err(Refusal::NoReplica),
            }
        })
    }
}

/// A resumed leg's start counted fleet-wide for its model: at most
/// `failover.max_resuming` legs of one model start at once across the
/// instances sharing a store (a lease in the store, as `leases.rs` holds
/// the large-context slots; held until the leg's head arrived: its prefill
/// is what a burst of deaths would pile on the survivors). Without a
/// shared store, or with one that does not answer in time, the instance's
/// own bound (`AppState::resuming`) is the bound. Err: every start is taken.
async fn fleet_wide_start(
    state: &crate::state::AppState,
    model: &str,
) -> Result<Option<crate::leases::FleetLease>, crate::domain_error::DomainError> {
    let limit = u32::try_from(state.config.failover.max_resuming).unwrap_or(u32::MAX);
    let key = format!("resume:{model}");
    let (lease, _) = state.leases.acquire(&state.store, &key, limit, Duration::ZERO).await?;
    Ok(lease)
}

/// How long the tokenize before a resumed leg may take, each request.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(10);

/// The token ids the replica `spec` makes of `transcript`: vLLM's
/// `/tokenize` with the answer as the open last message, else llama.cpp's
/// `/apply-template`, the answer appended, then its `/tokenize`.
async fn tokenize(
    upstream: &Upstream,
    spec: &Arc<ReplicaSpec>,
    caller: headers::Caller<'_>,
    transcript: &Transcript,
) -> Option<Vec<u32>> {
    let ask = |path, body| ask_replica(upstream, spec, caller, path, body);
    if let Some(ids) = ask("/tokenize", transcript.vllm_tokenize()).await.and_then(|b| tokens_of(&b)) {
        return Some(ids);
    }
    let rendered = match transcript.llama_template() {
        Some(body) => {
            let answer = ask("/apply-template", body).await?;
            let prompt = serde_json::from_slice::<serde_json::Value>(&answer).ok()?;
            Some(prompt.get("prompt")?.as_str()?.to_string())
        }
        None => None,
    };
    ask("/tokenize", transcript.llama_tokenize(rendered.as_deref())).await.and_then(|b| tokens_of(&b))
}

/// The text of `ids` as the replica `spec` decodes them (vLLM's
/// `/detokenize`; llama.cpp's takes the same `tokens` and answers
/// `content`).
async fn detokenize(
    upstream: &Upstream,
    spec: &Arc<ReplicaSpec>,
    caller: headers::Caller<'_>,
    request: &serde_json::Value,
    ids: Vec<u32>,
) -> Option<String> {
    let body = serde_json::json!({"model": request.get("model"), "tokens": ids});
    let answer = ask_replica(upstream, spec, caller, "/detokenize", body).await?;
    let decoded = serde_json::from_slice::<serde_json::Value>(&answer).ok()?;
    decoded.get("prompt").or_else(|| decoded.get("content"))?.as_str().map(str::to_string)
}

/// A successful answer's body to a JSON `POST` of `body` to `path` on the
/// replica `spec`, within `TOKENIZE_TIMEOUT` (the tokenizer's endpoints a
/// resumed leg asks before it starts).
async fn ask_replica(
    upstream: &Upstream,
    spec: &Arc<ReplicaSpec>,
    caller: headers::Caller<'_>,
    path: &'static str,
    body: serde_json::Value,
) -> Option<web::Bytes> {
    let answered = async {
        let mut resp = upstream.post_json(spec, caller, path).send_json(&body).await.ok()?;
        let bytes = resp.body().limit(8 << 20).await.ok()?;
        resp.status().is_success().then_some(bytes)
    };
    tokio::time::timeout(TOKENIZE_TIMEOUT, answered).await.ok().flatten()
}

impl Resumer {
    /// Where the next leg goes: planned as a failover, without the
    /// replicas its legs ran on.
    fn next_replica(&self) -> Option<Arc<crate::fleet::Replica>> {
        let fleet = self.state.fleet.snapshot();
        let input = super::plan::PlanInput {
            mode: self.mode,
            shape: &self.shape,
            pinned: None,
            named: None,
            stored: None,
            tried: &self.tried,
            large: false,
            room: None,
        };
        let route = super::plan::plan(&input, &fleet, |_| true, &self.state.spread).ok()?;
        Some(fleet[route.replica].clone())
    }
}
