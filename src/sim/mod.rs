//! A simulated OpenAI-compatible engine: the test backend and the demo.
//!
//! Not an echo server: it models what makes routing matter. Prompts become
//! pseudo-tokens (4 bytes each, the documented estimate), grouped in blocks
//! of 16 whose hash chain is looked up in a KV pool of `kv_tokens` shared by
//! running sequences and cached prefixes (see `kv`). Only uncached tokens
//! are prefilled, at `prefill_tps`, one prefill at a time (a card's compute
//! is one resource); decode runs at `decode_tps` per sequence. All delays
//! are multiplied by `time_scale`, so the seed's 22 s cold prefill can take
//! 0.2 s in a test while the reported simulated times stay unscaled.
//!
//! `usage.prompt_tokens_details.cached_tokens` is always reported, so tests
//! assert cache hits by count, not by timing. `x-sim-prefill-ms` carries the
//! simulated (unscaled) prefill time of the response.

mod agents;
pub mod kv;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix_web::{web, App, HttpResponse, HttpServer};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Notify;
use xxhash_rust::xxh3::Xxh3;

use kv::{AdmitError, KvPool, BLOCK_TOKENS};

const BYTES_PER_BLOCK: usize = BLOCK_TOKENS as usize * crate::tokens::BYTES_PER_TOKEN;

#[derive(Debug, Clone, clap::Args)]
pub struct SimConfig {
    /// KV cache capacity in tokens (the seed's cards: 122636).
    #[arg(long, default_value_t = 122_636)]
    pub kv_tokens: u64,
    /// Prefill throughput in tokens/s (90k tokens in ~22 s: about 4100).
    #[arg(long, default_value_t = 4_100.0)]
    pub prefill_tps: f64,
    /// Decode speed per sequence in tokens/s.
    #[arg(long, default_value_t = 40.0)]
    pub decode_tps: f64,
    /// Multiplies every delay (0.01 = a hundred times faster than simulated).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// The model id this replica serves.
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// Refuse every call (health, metrics and models included) without
    /// `Authorization: Bearer KEY`, as a keyed engine does.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Report no `vllm:num_preemptions_total`: an engine whose full pool
    /// shows only in `vllm:kv_cache_usage_perc` and its waiting requests.
    #[arg(long)]
    pub no_preemption_counter: bool,
    /// Serve no `POST /tokenize` (404): an engine that cannot count a
    /// prompt for the gateway (vLLM serves one).
    #[arg(long)]
    pub no_tokenize: bool,
    /// Say the KV as llama.cpp's server does: `GET /props` with this many
    /// slots of `kv_tokens / slots` context each, and no vLLM metrics
    /// (`/metrics` answers 404). Unset: vLLM's metrics, no `/props`.
    #[arg(long)]
    pub slots: Option<u64>,
    /// A fault: every stream's connection is cut after this many tokens
    /// (the engine died mid-answer).
    #[arg(long)]
    pub die_after_tokens: Option<u64>,
    /// A fault: every stream stops sending after this many tokens and
    /// keeps its connection open (a wedged engine).
    #[arg(long)]
    pub stall_after_tokens: Option<u64>,
    /// Give no token ids, whatever `return_token_ids` asks (llama-server).
    #[arg(long)]
    pub no_token_ids: bool,
    /// Put a completion stream's usage in its finish chunk, asked for or
    /// not, as llama-server does (a chat stream's still comes in a chunk of
    /// its own, only when asked).
    #[arg(long)]
    pub usage_in_finish_chunk: bool,
    /// A chat stream that offers tools calls the first of them after this
    /// many tokens of its own (arguments `{}`), and finishes with
    /// `tool_calls`: as an engine's tool parser hands a call over.
    #[arg(long)]
    pub tool_call_after_tokens: Option<u64>,
    /// A host tier of this many tokens keeps what the KV pool evicts,
    /// least recently used out first (llama-server's `--cache-ram`, vLLM's
    /// CPU offload): a returning prompt is restored from it, not prefilled.
    #[arg(long, default_value_t = 0)]
    pub host_cache_tokens: u64,
    /// Restore speed from the host tier, in tokens/s (default: 20 times
    /// `--prefill-tps`).
    #[arg(long)]
    pub restore_tps: Option<f64>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            kv_tokens: 122_636,
            prefill_tps: 4_100.0,
            decode_tps: 40.0,
            time_scale: 1.0,
            model: "sim-model".into(),
            api_key: None,
            no_preemption_counter: false,
            no_tokenize: false,
            slots: None,
            die_after_tokens: None,
            stall_after_tokens: None,
            no_token_ids: false,
            usage_in_finish_chunk: false,
            tool_call_after_tokens: None,
            host_cache_tokens: 0,
            restore_tps: None,
        }
    }
}

pub struct SimState {
    cfg: SimConfig,
    kv: Mutex<KvPool>,
    kv_freed: Notify,
    /// One prefill at a time, first come first served.
    prefill_lane: tokio::sync::Mutex<()>,
    running: AtomicU64,
    waiting: AtomicU64,
    /// Sequences that found the pool full and waited: reported as
    /// `vllm:num_preemptions_total`. The simulated engine has no decode-time
    /// preemption (a sequence's blocks are taken when it starts); a sequence
    /// that finds the pool full waits, which is what a preemption costs one
    /// in vLLM (it waits, then recomputes), so that is what it counts.
    kv_waits: AtomicU64,
    queries: AtomicU64,
    hits: AtomicU64,
    prompt_tokens: AtomicU64,
    generated: AtomicU64,
    /// Requests whose stream ended because the client went away.
    pub cancelled: AtomicU64,
    /// Generation requests received (valid or not).
    pub received: AtomicU64,
    /// `POST /tokenize` requests received (served or not).
    pub tokenize_requests: AtomicU64,
    /// The last 1,000 requests' method and path with query, as received
    /// (tests check what reached the engine).
    pub seen: Mutex<std::collections::VecDeque<String>>,
    /// The `traceparent` of the last 1,000 requests that carried one.
    pub traceparents: Mutex<std::collections::VecDeque<String>>,
    /// The `cache_salt` of the last 1,000 chat and completion requests that
    /// carried one (tests check what reached the engine; the simulated
    /// cache does not tell salts apart).
    pub cache_salts: Mutex<std::collections::VecDeque<String>>,
    /// Responses API: responses stored by this process (as vLLM keeps them).
    responses: Mutex<std::collections::HashMap<String, agents::StoredResponse>>,
}

impl SimState {
    pub fn new(cfg: SimConfig) -> Arc<SimState> {
        Arc::new(SimState {
            kv: Mutex::new(KvPool::with_host_tier(cfg.kv_tokens, cfg.host_cache_tokens)),
            cfg,
            kv_freed: Notify::new(),
            prefill_lane: tokio::sync::Mutex::new(()),
            seen: Mutex::default(),
            traceparents: Mutex::default(),
            cache_salts: Mutex::default(),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_waits: AtomicU64::new(0),
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generated: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            received: AtomicU64::new(0),
            tokenize_requests: AtomicU64::new(0),
            responses: Mutex::default(),
        })
    }

    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Acquire)
    }

    pub fn cancelled(&self) -> u64 {
        self.cancelled.load(Ordering::Acquire)
    }

    pub fn running(&self) -> u64 {
        self.running.load(Ordering::Acquire)
    }

    fn scaled(&self, simulated_secs: f64) -> Duration {
        Duration::from_secs_f64((simulated_secs * self.cfg.time_scale).max(0.0))
    }
}

/// Simulated GPU time passing. Zero (`--time-scale 0`) means no wait at all:
/// a zero-length tokio sleep still waits for the timer wheel's next 1 ms
/// tick, which under the one prefill lane capped an "instant" replica at
/// about 900 requests/s and made proxy benchmarks measure an idle machine.
pub(crate) async fn elapse(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

/// Starts a simulated replica on `listener` (bind `127.0.0.1:0` in tests).
pub fn serve(listener: std::net::TcpListener, state: Arc<SimState>) -> std::io::Result<actix_web::dev::Server> {
    let data = web::Data::from(state);
    let wanted: Option<Arc<str>> = data.cfg.api_key.as_ref().map(|k| Arc::from(format!("Bearer {k}")));
    Ok(HttpServer::new(move || {
        let wanted = wanted.clone();
        App::new()
            .wrap_fn(move |req, srv| {
                use actix_web::dev::Service;
                if let Some(s) = req.app_data::<web::Data<SimState>>() {
                    let mut seen = s.seen.lock().expect("seen lock");
                    if seen.len() >= 1_000 {
                        seen.pop_front();
                    }
                    let pq = req.uri().path_and_query().map_or("", |pq| pq.as_str());
                    seen.push_back(format!("{} {pq}", req.method()));
                    if let Some(tp) = req.headers().get("traceparent").and_then(|v| v.to_str().ok()) {
                        let mut tps = s.traceparents.lock().expect("traceparents lock");
                        if tps.len() >= 1_000 {
                            tps.pop_front();
                        }
                        tps.push_back(tp.to_string());
                    }
                }
                let refused = wanted.as_deref().is_some_and(|w| {
                    req.headers().get(actix_web::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) != Some(w)
                });
                let reply = (!refused).then(|| srv.call(req));
                async move {
                    match reply {
                        Some(fut) => fut.await,
                        None => Err(actix_web::error::InternalError::from_response(
                            "unauthorized",
                            HttpResponse::Unauthorized().json(json!({"error": {
                                "message": "invalid or missing API key", "type": "authentication_error", "code": "invalid_api_key"}})),
                        )
                        .into()),
                    }
                }
            })
            .app_data(data.clone())
            .app_data(web::PayloadConfig::new(256 * 1024 * 1024))
            .route("/health", web::get().to(|| async { HttpResponse::Ok().finish() }))
            .route("/metrics", web::get().to(metrics))
            .route("/props", web::get().to(props))
            .route("/v1/models", web::get().to(models))
            .route("/v1/chat/completions", web::post().to(chat))
            .route("/v1/completions", web::post().to(completions))
            .route("/tokenize", web::post().to(tokenize))
            .route("/detokenize", web::post().to(detokenize))
            .configure(agents::routes)
    })
    .workers(1)
    .tcp_nodelay(true)
    .shutdown_timeout(1)
    .disable_signals()
    .listen(listener)?
    .run())
}

async fn models(s: web::Data<SimState>) -> HttpResponse {
    HttpResponse::Ok()
        .json(json!({"object": "list", "data": [{"id": s.cfg.model, "object": "model", "owned_by": "prefixgate-sim"}]}))
}

/// llama.cpp's `GET /props`, with `--slots`: its slots and one slot's context.
async fn props(s: web::Data<SimState>) -> HttpResponse {
    match s.cfg.slots.filter(|n| *n > 0) {
        Some(n) => HttpResponse::Ok().json(json!({
            "total_slots": n,
            "default_generation_settings": {"n_ctx": s.cfg.kv_tokens / n, "id": 0},
            "model_path": format!("{}.gguf", s.cfg.model),
        })),
        None => HttpResponse::NotFound().finish(),
    }
}

async fn metrics(s: web::Data<SimState>) -> HttpResponse {
    if s.cfg.slots.is_some() {
        return HttpResponse::NotFound().finish();
    }
    let kv = s.kv.lock().expect("kv lock");
    let usage = kv.running_blocks() as f64 / kv.capacity_blocks().max(1) as f64;
    let body = format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
         # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{{model_name=\"{m}\"}} {}\n\
         # TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{{model_name=\"{m}\"}} {}\n\
         {preemptions}\
         # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",num_gpu_blocks=\"{}\"}} 1\n",
        s.running.load(Ordering::Relaxed),
        s.waiting.load(Ordering::Relaxed),
        s.queries.load(Ordering::Relaxed),
        s.hits.load(Ordering::Relaxed),
        s.prompt_tokens.load(Ordering::Relaxed),
        s.generated.load(Ordering::Relaxed),
        BLOCK_TOKENS,
        kv.capacity_blocks(),
        m = s.cfg.model,
        preemptions = match s.cfg.no_preemption_counter {
            true => String::new(),
            false => format!(
                "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{{model_name=\"{}\"}} {}\n",
                s.cfg.model,
                s.kv_waits.load(Ordering::Relaxed)
            ),
        },
    );
    HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(body)
}

#[derive(Deserialize)]
struct GenParams {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stream_options: Option<StreamOptions>,
    cache_salt: Option<String>,
    /// vLLM's: the prompt's token ids in a stream's first chunk, each
    /// chunk's own in `choices[0].token_ids`.
    #[serde(default)]
    return_token_ids: bool,
    /// Chat's tools: the first one's name is what `--tool-call-after-tokens` calls.
    #[serde(default)]
    tools: Vec<Value>,
}

impl SimState {
    /// The fault knobs, before a stream's token `i`: true when the stream
    /// ends here (`--die-after-tokens`: the connection is cut without an
    /// end; `--stall-after-tokens`: wedged, its connection open until the
    /// client leaves).
    pub(crate) async fn fault(&self, tx: &tokio::sync::mpsc::Sender<Frame>, i: u64) -> bool {
        if self.cfg.die_after_tokens == Some(i) {
            return true;
        }
        if self.cfg.stall_after_tokens == Some(i) {
            tx.closed().await;
            self.cancelled.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Keeps the salt a generation request carried, if any (the last 1,000).
    fn saw_salt(&self, params: &GenParams) {
        if let Some(salt) = &params.cache_salt {
            let mut salts = self.cache_salts.lock().expect("salts lock");
            if salts.len() >= 1_000 {
                salts.pop_front();
            }
            salts.push_back(salt.clone());
        }
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct ChatPrompt {
    messages: Vec<Value>,
    /// vLLM's: the last (assistant) message is left open and goes on.
    #[serde(default)]
    continue_final_message: bool,
}

impl ChatPrompt {
    /// Where the answer's words start: after an open last answer's words.
    fn first_word(&self) -> usize {
        let last = self.messages.last().and_then(|m| m.get("content")).and_then(Value::as_str);
        match last.filter(|_| self.continue_final_message).map(answer_ids) {
            Some(ids) => first_word(&json!(ids)),
            None => 0,
        }
    }
}

#[derive(Deserialize)]
struct CompletionPrompt {
    prompt: Value,
}

fn bad_request(msg: impl Into<String>) -> HttpResponse {
    HttpResponse::BadRequest()
        .json(json!({"error": {"message": msg.into(), "type": "invalid_request_error", "code": null}}))
}

/// A chat template stand-in: role and content of each message, in order.
fn render_chat(messages: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        out.extend_from_slice(m.get("role").and_then(Value::as_str).unwrap_or("user").as_bytes());
        out.push(b'\n');
        match m.get("content") {
            Some(Value::String(s)) => out.extend_from_slice(s.as_bytes()),
            Some(other @ Value::Array(_)) => out.extend_from_slice(other.to_string().as_bytes()),
            _ => {}
        }
        if let Some(calls) = m.get("tool_calls") {
            out.extend_from_slice(calls.to_string().as_bytes());
        }
        out.push(b'\n');
    }
    out
}

fn render_completion(prompt: &Value) -> Option<Vec<u8>> {
    match prompt {
        Value::String(s) => Some(s.as_bytes().to_vec()),
        Value::Array(items) if items.iter().all(Value::is_u64) => {
            Some(items.iter().flat_map(|t| (t.as_u64().unwrap_or(0) as u32).to_le_bytes()).collect())
        }
        _ => None,
    }
}

/// The simulated tokenizer: a token for every 4 bytes of the rendered
/// prompt (as many as `prompt_tokens` counts), never an answer word's id.
fn prompt_ids(prompt: &[u8]) -> Vec<u32> {
    let id = |chunk: &[u8]| {
        let mut word = [0u8; 4];
        word[..chunk.len()].copy_from_slice(chunk);
        10 + u32::from_le_bytes(word) % 100_000
    };
    prompt.chunks(crate::tokens::BYTES_PER_TOKEN).map(id).collect()
}

/// The answer is deterministic, as greedy decoding is: each token follows
/// from the one before it, the words of `WORDS` in a cycle, their ids
/// 1..=9. A prompt of token ids that ends in an answer's token (a stream
/// resumed with its prompt and the tokens generated so far) goes on where
/// that answer was; any other prompt starts the cycle.
fn first_word(prompt: &Value) -> usize {
    let last = prompt.as_array().and_then(|ids| ids.last()).and_then(Value::as_u64);
    match last {
        Some(id @ 1..=9) => id as usize % WORDS.len(),
        _ => 0,
    }
}

fn word_id(word: usize) -> u32 {
    (word % WORDS.len()) as u32 + 1
}

async fn chat(s: web::Data<SimState>, body: web::Bytes) -> HttpResponse {
    s.received.fetch_add(1, Ordering::Relaxed);
    let (params, prompt, first_word) =
        match (serde_json::from_slice::<GenParams>(&body), serde_json::from_slice::<ChatPrompt>(&body)) {
            (Ok(p), Ok(c)) if !c.messages.is_empty() => (p, render_chat(&c.messages), c.first_word()),
            _ => return bad_request("expected a chat completion request with a non-empty 'messages' array"),
        };
    s.saw_salt(&params);
    let ids = prompt_ids(&prompt);
    generate(s.into_inner(), params, prompt, Answer { chat: true, first_word, prompt_ids: ids }).await
}

async fn completions(s: web::Data<SimState>, body: web::Bytes) -> HttpResponse {
    s.received.fetch_add(1, Ordering::Relaxed);
    let prompt = serde_json::from_slice::<CompletionPrompt>(&body).ok();
    let rendered = prompt.as_ref().and_then(|c| render_completion(&c.prompt));
    let parsed = serde_json::from_slice::<GenParams>(&body).ok().zip(rendered);
    match (parsed, prompt) {
        (Some((params, rendered)), Some(prompt)) => {
            s.saw_salt(&params);
            let ids = match prompt.prompt.as_array() {
                Some(ids) => ids.iter().filter_map(Value::as_u64).map(|id| id as u32).collect(),
                None => prompt_ids(&rendered),
            };
            let answer = Answer { chat: false, first_word: first_word(&prompt.prompt), prompt_ids: ids };
            generate(s.into_inner(), params, rendered, answer).await
        }
        _ => bad_request("expected a completion request with a string or token-array 'prompt'"),
    }
}

/// vLLM's `POST /tokenize`: a chat request's messages (rendered as `chat`
/// renders them) or a completion's prompt, counted as the prefill counts
/// them, before anything runs. Only the fields vLLM's tokenize request
/// takes are read.
async fn tokenize(s: web::Data<SimState>, body: web::Bytes) -> HttpResponse {
    s.tokenize_requests.fetch_add(1, Ordering::Relaxed);
    if s.cfg.no_tokenize {
        return HttpResponse::NotFound().json(json!({"detail": "Not Found"}));
    }
    let prompt = match serde_json::from_slice::<ChatToTokenize>(&body) {
        Ok(c) if c.continue_final_message && c.messages.len() > 1 => {
            // The answer so far, left open: the words it said as their ids,
            // so a completion of these ids goes on where the answer was.
            let (last, before) = c.messages.split_last().expect("two or more");
            // No generation prompt: a chat's own prompt counts none either,
            // so the resumed prompt is the first one and the answer's ids.
            let mut rendered = render_chat(before);
            let answer = last.get("content").and_then(Value::as_str).unwrap_or("");
            let mut ids = prompt_ids(&rendered);
            ids.extend(answer_ids(answer));
            rendered.extend_from_slice(answer.as_bytes());
            Some((prompt_tokens(&rendered), ids))
        }
        Ok(c) if !c.messages.is_empty() => {
            let rendered = render_chat(&c.messages);
            Some((prompt_tokens(&rendered), prompt_ids(&rendered)))
        }
        _ => serde_json::from_slice::<CompletionPrompt>(&body)
            .ok()
            .and_then(|c| render_completion(&c.prompt))
            .map(|rendered| (prompt_tokens(&rendered), prompt_ids(&rendered))),
    };
    match prompt {
        Some((count, ids)) => {
            HttpResponse::Ok().json(json!({"count": count, "max_model_len": s.cfg.kv_tokens, "tokens": ids}))
        }
        None => bad_request("expected 'messages' or a string 'prompt'"),
    }
}

/// vLLM's `POST /detokenize`: ids to text (an answer's ids to its words).
async fn detokenize(body: web::Bytes) -> HttpResponse {
    #[derive(Deserialize)]
    struct Ids {
        tokens: Vec<u32>,
    }
    match serde_json::from_slice::<Ids>(&body) {
        Ok(ids) => {
            let words = ids.tokens.iter().filter_map(|&id| WORDS.get((id as usize).checked_sub(1)?));
            HttpResponse::Ok().json(json!({"prompt": words.copied().collect::<String>()}))
        }
        Err(_) => bad_request("expected 'tokens'"),
    }
}

#[derive(Deserialize)]
struct ChatToTokenize {
    messages: Vec<Value>,
    #[serde(default)]
    continue_final_message: bool,
}

/// The simulated tokenizer on an answer's text: its words as the answer's
/// ids, in the answer's order; what follows no answer word, by the prompt
/// rule.
fn answer_ids(text: &str) -> Vec<u32> {
    let mut ids = Vec::new();
    let mut rest = text;
    let mut i = 0;
    while !rest.is_empty() {
        match rest.strip_prefix(WORDS[i % WORDS.len()]) {
            Some(after) => {
                ids.push(word_id(i));
                rest = after;
                i += 1;
            }
            None => {
                ids.extend(prompt_ids(rest.as_bytes()));
                break;
            }
        }
    }
    ids
}

/// The tokens a rendered prompt counts for (the bytes-per-token rule the
/// gateway's estimate starts from).
fn prompt_tokens(prompt: &[u8]) -> u64 {
    crate::tokens::estimate_tokens(prompt.len()).max(1)
}

/// One running sequence: its KV reservation is released when it drops,
/// including when the client disconnects mid-stream.
pub(crate) struct Sequence {
    state: Arc<SimState>,
    chain: Vec<u128>,
    private: usize,
}

impl Drop for Sequence {
    fn drop(&mut self) {
        self.state.kv.lock().expect("kv lock").release(&self.chain, self.private);
        self.state.running.fetch_sub(1, Ordering::AcqRel);
        self.state.kv_freed.notify_waiters();
    }
}

pub(crate) struct Prefilled {
    seq: Sequence,
    prompt_tokens: u64,
    cached_tokens: u64,
    prefill_ms: f64,
}

fn block_chain(prompt: &[u8]) -> Vec<u128> {
    let mut prev = 0u128;
    prompt
        .chunks_exact(BYTES_PER_BLOCK)
        .map(|block| {
            let mut h = Xxh3::new();
            h.update(&prev.to_le_bytes());
            h.update(block);
            prev = h.digest128();
            prev
        })
        .collect()
}

/// Waits for KV and the prefill lane, then "prefills" the uncached tokens.
pub(crate) async fn prefill(s: &Arc<SimState>, prompt: &[u8], max_tokens: u64) -> Result<Prefilled, HttpResponse> {
    let prompt_tokens = prompt_tokens(prompt);
    let chain = block_chain(prompt);
    let partial = usize::from(!prompt.len().is_multiple_of(BYTES_PER_BLOCK));
    let private = partial + max_tokens.div_ceil(BLOCK_TOKENS) as usize;
    s.waiting.fetch_add(1, Ordering::AcqRel);
    let lane = s.prefill_lane.lock().await;
    let mut waited = false;
    let (matched, restored) = loop {
        let freed = s.kv_freed.notified();
        let result = {
            let mut kv = s.kv.lock().expect("kv lock");
            kv.admit(&chain, private).map(|m| (m, kv.restored(&chain, m)))
        };
        match result {
            Ok(m) => break m,
            Err(AdmitError::Full) => {
                if !std::mem::replace(&mut waited, true) {
                    s.kv_waits.fetch_add(1, Ordering::Relaxed);
                }
                freed.await
            }
            Err(AdmitError::TooLarge { needed, capacity }) => {
                s.waiting.fetch_sub(1, Ordering::AcqRel);
                return Err(bad_request(format!(
                    "this request needs {} KV tokens but the cache holds {}",
                    needed as u64 * BLOCK_TOKENS,
                    capacity as u64 * BLOCK_TOKENS
                )));
            }
        }
    };
    s.waiting.fetch_sub(1, Ordering::AcqRel);
    s.running.fetch_add(1, Ordering::AcqRel);
    let seq = Sequence { state: s.clone(), chain, private };
    // vLLM recomputes at least the last token even on a full hit. Blocks
    // restored from the host tier count as cached (engines report them so)
    // and cost their copy back at the restore speed.
    let most = (prompt_tokens - 1) / BLOCK_TOKENS * BLOCK_TOKENS;
    let cached_tokens = ((matched + restored) as u64 * BLOCK_TOKENS).min(most);
    let restored_tokens = cached_tokens.saturating_sub(matched as u64 * BLOCK_TOKENS);
    s.queries.fetch_add(prompt_tokens, Ordering::Relaxed);
    s.hits.fetch_add(cached_tokens, Ordering::Relaxed);
    s.prompt_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
    let restore_tps = s.cfg.restore_tps.unwrap_or(20.0 * s.cfg.prefill_tps);
    let prefill_secs =
        (prompt_tokens - cached_tokens) as f64 / s.cfg.prefill_tps + restored_tokens as f64 / restore_tps;
    elapse(s.scaled(prefill_secs)).await;
    drop(lane);
    Ok(Prefilled { seq, prompt_tokens, cached_tokens, prefill_ms: prefill_secs * 1000.0 })
}

/// The non-streaming path: prefill, then decode all `max_tokens` at the
/// card's speed. The KV stays held until the caller drops the result.
pub(crate) async fn prefill_and_decode(
    s: &Arc<SimState>,
    prompt: &[u8],
    max_tokens: u64,
) -> Result<Prefilled, HttpResponse> {
    let p = prefill(s, prompt, max_tokens).await?;
    elapse(s.scaled(1.0 / s.cfg.decode_tps) * max_tokens as u32).await;
    s.generated.fetch_add(max_tokens, Ordering::Relaxed);
    Ok(p)
}

/// A stream's response: headers at once (as real SSE servers send them),
/// then whatever the generator sends.
pub(crate) fn sse_response(rx: tokio::sync::mpsc::Receiver<Frame>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("cache-control", "no-cache"))
        .streaming(tokio_stream_from(rx))
}

/// The words every answer cycles through (tests read answers against them).
pub const WORDS: &[&str] = &["the", " cache", " is", " warm", " and", " the", " prefix", " holds", ","];

fn usage(p: &Prefilled, completion: u64) -> Value {
    json!({
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": p.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": p.cached_tokens},
    })
}

/// An id as engines make them (vLLM: `resp_` and a random UUID's hex):
/// random, so two replicas never answer to the same id, and a follow-up
/// sent to the wrong replica fails as it would on a real engine.
pub(crate) fn random_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// What a generation answers: chat or completion, where its words start,
/// and its prompt's token ids.
struct Answer {
    chat: bool,
    first_word: usize,
    prompt_ids: Vec<u32>,
}

async fn generate(s: Arc<SimState>, params: GenParams, prompt: Vec<u8>, answer: Answer) -> HttpResponse {
    let Answer { chat, first_word, prompt_ids } = answer;
    let max_tokens = params.max_completion_tokens.or(params.max_tokens).unwrap_or(16).min(4096);
    let model = params.model.clone().unwrap_or_else(|| s.cfg.model.clone());
    let id = random_id(if chat { "chatcmpl" } else { "cmpl" });
    let created = crate::clock::now_ms() / 1000;
    let per_token = s.scaled(1.0 / s.cfg.decode_tps);
    let word = move |i: usize| first_word + i;
    if !params.stream {
        let p = match prefill_and_decode(&s, &prompt, max_tokens).await {
            Ok(p) => p,
            Err(resp) => return resp,
        };
        let text: String = (0..max_tokens as usize).map(|i| WORDS[word(i) % WORDS.len()]).collect();
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": text, "finish_reason": "length"})
        };
        let object = if chat { "chat.completion" } else { "text_completion" };
        let body = json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice], "usage": usage(&p, max_tokens)});
        drop(p.seq);
        return HttpResponse::Ok().insert_header(("x-sim-prefill-ms", format!("{:.1}", p.prefill_ms))).json(body);
    }
    // Streaming: headers go out at once (as real SSE servers do); the first
    // data chunk waits for the prefill.
    let include_usage = params.stream_options.is_some_and(|o| o.include_usage);
    let with_ids = params.return_token_ids && !s.cfg.no_token_ids;
    let tool = params.tools.first().and_then(|t| t["function"]["name"].as_str()).map(str::to_string);
    let calls_after = s.cfg.tool_call_after_tokens.filter(|_| chat && tool.is_some());
    let usage_in_finish = s.cfg.usage_in_finish_chunk && !chat;
    let (tx, rx) = tokio::sync::mpsc::channel::<Frame>(8);
    actix_web::rt::spawn(async move {
        let p = match prefill(&s, &prompt, max_tokens).await {
            Ok(p) => p,
            Err(_) => {
                let _ = tx
                    .send(Frame::Chunk(sse(&json!({"error": {"message": "prompt does not fit in the KV cache"}}))))
                    .await;
                let _ = tx.send(Frame::End).await;
                return;
            }
        };
        let object = if chat { "chat.completion.chunk" } else { "text_completion" };
        let chunk = |i: Option<usize>, finish: Option<&str>| {
            let text = i.map(|i| WORDS[word(i) % WORDS.len()]);
            let mut choice = match (chat, text) {
                (true, Some(d)) if i == Some(0) => {
                    json!({"index": 0, "delta": {"role": "assistant", "content": d}, "finish_reason": finish})
                }
                (true, Some(d)) => json!({"index": 0, "delta": {"content": d}, "finish_reason": finish}),
                (true, None) => json!({"index": 0, "delta": {}, "finish_reason": finish}),
                (false, d) => json!({"index": 0, "text": d.unwrap_or(""), "finish_reason": finish}),
            };
            let mut event = json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "prefill_ms": p.prefill_ms});
            if with_ids {
                choice["token_ids"] = json!(i.map(|i| vec![word_id(word(i))]).unwrap_or_default());
                if i == Some(0) {
                    event["prompt_token_ids"] = json!(prompt_ids);
                }
            }
            event["choices"] = json!([choice]);
            event
        };
        let (mut finish_reason, mut said) = ("length", max_tokens);
        for i in 0..max_tokens as usize {
            if i > 0 {
                elapse(per_token).await;
            }
            if calls_after == Some(i as u64) {
                let call = json!([{"index": 0, "id": random_id("call"), "type": "function",
                    "function": {"name": tool, "arguments": "{}"}}]);
                let event = json!({"id": id, "object": object, "created": created, "model": model,
                    "choices": [{"index": 0, "delta": {"tool_calls": call}, "finish_reason": null}]});
                if tx.send(Frame::Chunk(sse(&event))).await.is_err() {
                    return;
                }
                // The call's own tokens counted as one.
                (finish_reason, said) = ("tool_calls", i as u64 + 1);
                break;
            }
            if s.fault(&tx, i as u64).await {
                return;
            }
            s.generated.fetch_add(1, Ordering::Relaxed);
            if tx.send(Frame::Chunk(sse(&chunk(Some(i), None)))).await.is_err() {
                s.cancelled.fetch_add(1, Ordering::Relaxed);
                return; // the client went away: stop generating, free the KV
            }
        }
        let mut finish = chunk(None, Some(finish_reason));
        if usage_in_finish {
            finish["usage"] = usage(&p, said);
        }
        let mut tail = vec![sse(&finish)];
        if include_usage && !usage_in_finish {
            tail.push(sse(&json!({"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": usage(&p, said)})));
        }
        tail.push(web::Bytes::from_static(b"data: [DONE]\n\n"));
        for t in tail {
            if tx.send(Frame::Chunk(t)).await.is_err() {
                s.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let _ = tx.send(Frame::End).await;
    });
    sse_response(rx)
}

fn sse(v: &Value) -> web::Bytes {
    web::Bytes::from(format!("data: {v}\n\n"))
}

/// What the generator sends to the response body.
pub(crate) enum Frame {
    Chunk(web::Bytes),
    End,
}

/// The response body of a stream. If the generator vanishes without `End`
/// (the engine "crashed": its runtime stopped), the body fails, so the
/// connection is cut mid-response as a real crash would cut it.
pub(crate) fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Frame>,
) -> impl futures_util::Stream<Item = Result<web::Bytes, std::io::Error>> {
    let mut ended = false;
    futures_util::stream::poll_fn(move |cx| {
        if ended {
            return std::task::Poll::Ready(None);
        }
        rx.poll_recv(cx).map(|frame| match frame {
            Some(Frame::Chunk(b)) => Some(Ok(b)),
            Some(Frame::End) => {
                ended = true;
                None
            }
            None => {
                ended = true;
                Some(Err(std::io::Error::other("simulated engine crashed mid-stream")))
            }
        })
    })
}
