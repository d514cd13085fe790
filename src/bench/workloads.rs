//! The three workloads. Each builds a salted corpus, runs it, and returns a
//! report with its samples.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use super::client::{stream_chat, stream_turn};
use super::{Common, Report, Sample, Workload};

/// About `tokens` estimated tokens (4 bytes each) of text, unique to `tag`.
fn filler(tag: &str, tokens: usize) -> String {
    let mut s = String::with_capacity(tokens * 4 + 64);
    let mut i = 0;
    while s.len() < tokens * 4 {
        let _ = std::fmt::Write::write_fmt(
            &mut s,
            format_args!("{tag} line {i}: the quick brown fox jumps over the lazy dog. "),
        );
        i += 1;
    }
    s.truncate(tokens * 4);
    s
}

fn salt(common: &Common) -> String {
    common.salt.clone().unwrap_or_else(|| format!("{:x}", crate::clock::now_ms() ^ u64::from(std::process::id()) << 40))
}

fn bar(len: usize, what: &str) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}

/// How an agent rewrites the tail of what it sends (`agent-loop --rewrite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rewrite {
    None,
    /// A status line after everything ("turn N of 100"), replaced each turn.
    Status,
    /// A reminder appended to the latest user message only.
    Reminder,
}

impl Rewrite {
    /// What turn `turn` sends of the history `messages`.
    pub fn apply(self, messages: &[Value], turn: usize) -> Vec<Value> {
        let mut sent = messages.to_vec();
        match self {
            Rewrite::None => {}
            Rewrite::Status => sent.push(json!({"role": "user", "content": format!("Tool-call turn {turn} of 100.")})),
            Rewrite::Reminder => {
                if let Some(Value::String(text)) = sent.last_mut().map(|m| &mut m["content"]) {
                    text.push_str("\n<system-reminder>The todo list is empty.</system-reminder>");
                }
            }
        }
        sent
    }
}

fn new_report(workload: &str, common: &Common, settings: Value) -> Report {
    Report {
        workload: workload.into(),
        label: common.label.clone(),
        target: common.base_url.clone(),
        settings,
        started: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        ..Report::default()
    }
}

pub(super) fn client() -> awc::Client {
    awc::Client::builder()
        .connector(crate::connector::connector(std::time::Duration::from_secs(10)).limit(0))
        .timeout(std::time::Duration::from_secs(3600))
        .finish()
}

pub async fn run(w: &Workload) -> Result<Report, String> {
    let started = Instant::now();
    let mut report = match w {
        Workload::AgentLoop {
            common,
            families,
            turns,
            context_tokens,
            turn_tokens,
            api,
            pause_ms,
            system_tokens,
            rewrite,
            heavy,
            heavy_factor,
            heavy_alternate,
        } => {
            let salt = salt(common);
            let heavy_families = heavy_families(*families, *heavy, *heavy_alternate);
            let settings = json!({"families": families, "turns": turns, "context_tokens": context_tokens, "turn_tokens": turn_tokens, "max_tokens": common.max_tokens, "salt": salt, "api": api, "pause_ms": pause_ms, "system_tokens": system_tokens, "rewrite": rewrite, "heavy": heavy, "heavy_factor": heavy_factor, "heavy_families": heavy_families});
            let system = (*system_tokens > 0)
                .then(|| json!({"role": "system", "content": format!("[run {salt}] shared\n{}", filler("system", *system_tokens))}));
            let mut report = new_report("agent-loop", common, settings);
            let pb = bar(families * turns, "turns");
            let runs = (0..*families).map(|f| {
                let (pb, salt, system) = (pb.clone(), salt.clone(), system.clone());
                let is_heavy = heavy_families.contains(&f);
                async move {
                    let c = client();
                    let mut messages: Vec<serde_json::Value> = system.into_iter().collect();
                    messages.push(json!({"role": "user", "content": format!("[run {salt}] family {f}\n{}", filler(&format!("ctx{f}"), *context_tokens))}));
                    let mut samples = Vec::new();
                    let mut previous: Option<String> = None;
                    for turn in 0..*turns {
                        if turn > 0 && *pause_ms > 0 {
                            tokio::time::sleep(std::time::Duration::from_millis(*pause_ms)).await;
                        }
                        let base = common.base_for(f, turn);
                        let sent = rewrite.apply(&messages, turn);
                        let sample = match stream_turn(&c, &base, *api, &sent, previous.as_deref()).await {
                            Ok((s, answer)) => {
                                messages.push(json!({"role": "assistant", "content": answer}));
                                previous.clone_from(&s.response_id);
                                s
                            }
                            Err(e) => Sample { error: Some(e), ..Sample::default() },
                        };
                        let grows = if is_heavy { turn_tokens * heavy_factor } else { *turn_tokens };
                        messages.push(json!({"role": "user", "content": filler(&format!("f{f}t{turn}"), grows)}));
                        samples.push(Sample { family: f, turn, ..sample });
                        pb.inc(1);
                    }
                    samples
                }
            });
            report.samples = futures_util::future::join_all(runs).await.into_iter().flatten().collect();
            pb.finish_and_clear();
            report
        }
        Workload::Burst { common, requests, prompt_tokens, shared_prefix_tokens } => {
            let salt = salt(common);
            let settings = json!({"requests": requests, "prompt_tokens": prompt_tokens, "shared_prefix_tokens": shared_prefix_tokens, "max_tokens": common.max_tokens, "salt": salt});
            let system = json!({"role": "system", "content": format!("[run {salt}]\n{}", filler("shared", *shared_prefix_tokens))});
            let mut report = new_report("burst", common, settings);
            let pb = bar(*requests, "requests");
            let all = (0..*requests).map(|i| {
                let (pb, salt, system) = (pb.clone(), salt.clone(), system.clone());
                async move {
                    let msg = json!({"role": "user", "content": format!("[run {salt}] request {i}\n{}", filler(&format!("burst{i}"), *prompt_tokens))});
                    let messages = if *shared_prefix_tokens > 0 { vec![system, msg] } else { vec![msg] };
                    let s = match stream_chat(&client(), common, &messages).await {
                        Ok((s, _)) => s,
                        Err(e) => Sample { error: Some(e), ..Sample::default() },
                    };
                    pb.inc(1);
                    Sample { family: i, turn: 0, ..s }
                }
            });
            report.samples = futures_util::future::join_all(all).await;
            pb.finish_and_clear();
            report
        }
        Workload::ProbeCache { common, prompt_tokens } => {
            let salt = salt(common);
            let mut report = new_report("probe-cache", common, json!({"prompt_tokens": prompt_tokens, "salt": salt}));
            let prompt = format!("[run {salt}]\n{}", filler("probe", *prompt_tokens));
            let c = client();
            let mut samples = Vec::new();
            for (i, tail) in ["", "", " And one more question with a different tail."].iter().enumerate() {
                let msg = json!({"role": "user", "content": format!("{prompt}{tail}")});
                let s = stream_chat(&c, common, &[msg]).await.map_err(|e| format!("probe request {i}: {e}"))?.0;
                samples.push(Sample { turn: i, ..s });
            }
            let t = |i: usize| samples[i].ttft_ms.unwrap_or(f64::MAX);
            report.verdict = Some(if t(1) * 3.0 < t(0) && t(2) * 3.0 < t(0) {
                format!(
                    "prefix cache works: cold {:.0} ms, same prompt {:.0} ms, varying tail {:.0} ms",
                    t(0),
                    t(1),
                    t(2)
                )
            } else {
                format!(
                    "no evidence of a working prefix cache: cold {:.0} ms, same prompt {:.0} ms, varying tail {:.0} ms \
                     (is the server idle, and the prompt long enough?)",
                    t(0),
                    t(1),
                    t(2)
                )
            });
            report.samples = samples;
            report
        }
        Workload::Overhead { common, direct_url, requests } => {
            let mut report = new_report("overhead", common, json!({"requests": requests, "direct_url": direct_url}));
            let c = client();
            let direct = Common { base_url: direct_url.clone(), ..common.clone() };
            let pb = bar(requests * 2, "requests");
            let (mut via, mut straight) = (Vec::new(), Vec::new());
            for i in 0..*requests {
                let msg = [json!({"role": "user", "content": format!("overhead probe {i}")})];
                // Alternate, so both see the same machine noise.
                for (target, out) in [(common, &mut via), (&direct, &mut straight)] {
                    let s = stream_chat(&c, target, &msg).await.map_err(|e| format!("{}: {e}", target.base_url))?.0;
                    out.push(s.total_ms);
                    pb.inc(1);
                }
            }
            pb.finish_and_clear();
            let mut d: Vec<f64> = via.iter().zip(&straight).map(|(a, b)| a - b).collect();
            let (p50v, p50d) =
                (super::report::percentile(&mut via, 50.0), super::report::percentile(&mut straight, 50.0));
            let (p99v, p99d) =
                (super::report::percentile(&mut via, 99.0), super::report::percentile(&mut straight, 99.0));
            report.verdict = Some(format!(
                "{} pairs: through the gateway p50 {:.3} ms / p99 {:.3} ms, direct p50 {:.3} ms / p99 {:.3} ms; \
                 added latency median {:.3} ms",
                requests,
                p50v.unwrap_or(0.0),
                p99v.unwrap_or(0.0),
                p50d.unwrap_or(0.0),
                p99d.unwrap_or(0.0),
                super::report::percentile(&mut d, 50.0).unwrap_or(0.0)
            ));
            report
        }
        Workload::Replay { common, trace, keep_text, pause_scale } => {
            if !(*keep_text > 0.0 && *keep_text <= 1.0) {
                return Err(format!("--keep-text {keep_text}: a fraction in (0, 1]"));
            }
            let tasks = super::replay::read_trace(trace)?;
            let calls: usize = tasks.iter().map(|(_, c)| c.len()).sum();
            let settings = json!({"trace": trace, "tasks": tasks.len(), "calls": calls, "keep_text": keep_text,
                                  "pause_scale": pause_scale, "max_tokens": common.max_tokens});
            let mut report = new_report("replay", common, settings);
            // Timed from the first call: reading the trace is not the routers' time.
            let started = Instant::now();
            report.samples = super::replay::run(common, &tasks, *keep_text, *pause_scale).await;
            report.duration_s = started.elapsed().as_secs_f64();
            report.summarize(started.elapsed().as_secs_f64() * 1000.0);
            return Ok(report);
        }
        Workload::Chart { .. } => return Err("chart is not a workload".into()),
    };
    let wall = started.elapsed();
    report.duration_s = wall.as_secs_f64();
    report.summarize(wall.as_secs_f64() * 1000.0);
    Ok(report)
}

/// Which of `families` are heavy: the first `heavy`, or with `alternate`
/// every other one from the first while light ones remain.
fn heavy_families(families: usize, heavy: usize, alternate: bool) -> Vec<usize> {
    if !alternate {
        return (0..heavy.min(families)).collect();
    }
    let (mut heavy_left, mut light_left) = (heavy.min(families), families.saturating_sub(heavy));
    let mut out = Vec::new();
    for f in 0..families {
        if heavy_left > 0 && (f % 2 == 0 || light_left == 0) {
            out.push(f);
            heavy_left -= 1;
        } else {
            light_left -= 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn heavy_families_come_first_or_alternate_with_light_ones() {
        assert_eq!(super::heavy_families(5, 3, false), vec![0, 1, 2]);
        assert_eq!(super::heavy_families(5, 3, true), vec![0, 2, 4]);
        // More heavy than light: alternate while light ones remain.
        assert_eq!(super::heavy_families(5, 4, true), vec![0, 2, 3, 4]);
        assert_eq!(super::heavy_families(2, 5, true), vec![0, 1]);
    }
}
