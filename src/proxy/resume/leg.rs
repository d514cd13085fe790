//! A continued stream's next leg, the I/O half of continuation: the
//! replica it goes to (planned as a failover, without the replicas its
//! legs ran on), the engine's tokenizer asked where the leg needs it, the
//! fleet-wide bound on legs starting, and the request sent.
//!
//! Nothing here runs until a stream breaks: a stream that never breaks
//! keeps only its `Seed` (the client's request and body, which the
//! request holds anyway).

use std::sync::Arc;
use std::time::Duration;

use actix_web::web;
use futures_util::future::LocalBoxFuture;

use super::transcript::{tokens_of, transcript, Transcript};
use super::{chat_resume_request, resume_request, transcript_chat_request, Refusal, Said, Way};
use crate::fleet::{Replica, ReplicaSpec};
use crate::policy::{Dialect, Mode, RequestShape};
use crate::proxy::attempt::{send, Upstream, UpstreamResponse};
use crate::proxy::{headers, plan, trace};
use crate::state::AppState;

/// What a stream's next leg is made from, should it break: the client's
/// request (its credentials, and the gateway's state and upstream client
/// through it) and body, the routing mode, the request's trace.
pub struct Seed {
    pub req: actix_web::HttpRequest,
    pub body: web::Bytes,
    pub mode: Mode,
    pub trace: trace::RequestTrace,
}

/// A next leg running: its response, the replica it runs on, and (when it
/// runs on the chat endpoint) the answer's text it was continued from.
pub struct Leg {
    pub stream: UpstreamResponse,
    pub to: Arc<Replica>,
    pub via_chat: Option<String>,
}

/// A next leg starting.
pub type Starting = LocalBoxFuture<'static, Result<Leg, Refusal>>;

/// Starts the next leg of the stream `seed` began, after what it `said`,
/// on a replica none of its legs ran on (`tried`, this leg's added).
pub fn start(seed: &Seed, said: &Said, tried: &mut Vec<Arc<str>>) -> Starting {
    let refused = |why| -> Starting { Box::pin(std::future::ready(Err(why))) };
    let state = seed.req.app_data::<web::Data<AppState>>().expect("app state").clone();
    let upstream = seed.req.app_data::<web::Data<Upstream>>().expect("upstream client").clone();
    let Ok(permit) = state.resuming.clone().try_acquire_owned() else { return refused(Refusal::Busy) };
    let endpoint = crate::policy::Endpoint::from_path(seed.req.path());
    let Ok(shape) = crate::policy::identity::extract(endpoint, &seed.body, state.policy.get().identity) else {
        return refused(Refusal::NoTranscript);
    };
    let Ok(request) = serde_json::from_slice::<serde_json::Value>(&seed.body) else {
        return refused(Refusal::NoTranscript);
    };
    let plan = match LegPlan::of(said, request, &shape) {
        Ok(plan) => plan,
        Err(why) => return refused(why),
    };
    let Some(to) = next_replica(&state, seed.mode, &shape, tried) else { return refused(Refusal::NoReplica) };
    tried.push(to.id.clone());
    let (span, carried) = seed.trace.attempt(&state, &to.id);
    let req = seed.req.clone();
    let model = shape.model.unwrap_or_default();
    Box::pin(async move {
        let _starting = permit;
        let Ok(_fleet_wide) = fleet_wide_start(&state, &model).await else {
            trace::attempt_ended(&span, Err(("too many continued legs starting across the fleet", false)));
            return Err(Refusal::Busy);
        };
        let caller = headers::Caller { req: &req, gateway_keys: !state.config.api_keys.is_empty() };
        let spec = to.spec();
        let Some((path, body, via_chat)) = plan.sent_as(&upstream, &spec, caller).await else {
            trace::attempt_ended(&span, Err(("the replica tokenized no conversation", false)));
            return Err(Refusal::NoTokenizer);
        };
        let mut request = upstream.post_json(&spec, caller, path);
        for (name, value) in carried {
            request = request.insert_header((name, value));
        }
        let sent = send(request, body).await;
        let status = sent.as_ref().map(|r| r.status().as_u16()).map_err(|e| (e.message.as_str(), false));
        trace::attempt_ended(&span, status);
        match sent {
            Ok(resp) if resp.status().is_success() => Ok(Leg { stream: resp, to, via_chat }),
            _ => Err(Refusal::NoReplica),
        }
    })
}

/// Where the next leg goes: planned as a failover, without the replicas
/// its legs ran on.
fn next_replica(state: &AppState, mode: Mode, shape: &RequestShape, tried: &[Arc<str>]) -> Option<Arc<Replica>> {
    let fleet = state.fleet.snapshot();
    let input = plan::PlanInput::on_shape(mode, state.config.routing.spread, shape, tried);
    let route = plan::plan(&input, &fleet, |_| true, &state.spread).ok()?;
    Some(fleet[route.replica].clone())
}

/// What a next leg is made of: its prompt, the client's request.
struct LegPlan {
    prompt: Prompt,
    request: serde_json::Value,
    dialect: Dialect,
    generated: usize,
}

/// How a next leg's prompt is had.
enum Prompt {
    /// `/v1/completions` with these ids.
    Ids(Vec<u32>),
    /// `/v1/completions` with the transcript as the replica tokenizes it.
    Text(Transcript),
    /// The chat endpoint, the answer so far as the open last message (a
    /// request that offers tools: the engine's tool parser sees what
    /// follows the seam). A chat's own request, with the answer's text or
    /// its ids to detokenize; a Responses or Messages request's transcript.
    Chat {
        text: Option<String>,
        ids: Vec<u32>,
    },
    AgentChat(Transcript),
}

impl LegPlan {
    /// From what the stream said, for `request` (Err: refused, why).
    fn of(said: &Said, request: serde_json::Value, shape: &RequestShape) -> Result<LegPlan, Refusal> {
        let dialect = shape.dialect;
        let transcribed = || transcript(dialect, &request, &said.text, said.calls()).ok_or(Refusal::NoTranscript);
        let prompt = match (said.way, shape.stream.tools, dialect) {
            (_, true, Dialect::Responses | Dialect::Messages) => Prompt::AgentChat(transcribed()?),
            (Way::Text, true, _) => Prompt::Chat { text: Some(said.text.clone()), ids: Vec::new() },
            (Way::Ids, true, _) => Prompt::Chat { text: None, ids: said.generated.clone() },
            (Way::Ids, false, _) => Prompt::Ids(said.prompt_with_answer().ok_or(Refusal::NoTokenIds)?),
            (Way::Text, false, _) => Prompt::Text(transcribed()?),
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
            Prompt::AgentChat(transcript) => {
                let body = transcript_chat_request(request, dialect, &transcript, generated)?;
                let Transcript::Chat { answer, .. } = transcript else { return None };
                return Some(("/v1/chat/completions", body, Some(answer)));
            }
        };
        Some(("/v1/completions", resume_request(request, dialect, &ids, generated)?, None))
    }
}

/// A next leg's start counted fleet-wide for its model: at most
/// `failover.max_resuming` legs of one model start at once across the
/// instances sharing a store (a lease in the store, as `leases.rs` holds
/// the large-context slots; held until the leg's head arrived: its prefill
/// is what a burst of deaths would pile on the survivors). Without a
/// shared store, or with one that does not answer in time, the instance's
/// own bound (`AppState::resuming`) is the bound. Err: every start is taken.
async fn fleet_wide_start(
    state: &AppState,
    model: &str,
) -> Result<Option<crate::leases::FleetLease>, crate::domain_error::DomainError> {
    let limit = u32::try_from(state.config.failover.max_resuming).unwrap_or(u32::MAX);
    let key = format!("resume:{model}");
    let (lease, _) = state.leases.acquire(&state.store, &key, limit, Duration::ZERO).await?;
    Ok(lease)
}

/// How long each ask of the replica's tokenizer before a leg may take.
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
/// leg asks before it starts).
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
