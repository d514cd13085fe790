//! Bench reports: the samples, their summary (medians, p90s, sample sizes,
//! spread across replicas, cached fractions), a table, JSON and an SVG chart.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::{Deserialize, Serialize};

/// One request.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sample {
    pub family: usize,
    pub turn: usize,
    /// Time to the first content chunk.
    pub ttft_ms: Option<f64>,
    pub total_ms: f64,
    pub replica: String,
    pub route: String,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    /// The simulated replica's own prefill time (unscaled), when it reports one.
    pub sim_prefill_ms: Option<f64>,
    pub error: Option<String>,
    /// The response's id (Responses API), for the next turn of a chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Stats {
    pub n: usize,
    pub median_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    /// Median simulated prefill (sim replicas only): immune to machine noise.
    pub sim_prefill_median_ms: Option<f64>,
    pub cached_fraction: Option<f64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub errors: usize,
    pub families: usize,
    pub cold: Stats,
    pub warm: Stats,
    pub by_replica: BTreeMap<String, usize>,
    pub by_route: BTreeMap<String, usize>,
    /// Warm turns served by the replica that served their family's first turn.
    #[serde(default)]
    pub warm_on_home: usize,
    pub wall_ms: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Report {
    pub workload: String,
    pub label: String,
    pub target: String,
    pub settings: serde_json::Value,
    pub started: String,
    pub duration_s: f64,
    pub summary: Summary,
    pub verdict: Option<String>,
    pub warnings: Vec<String>,
    pub samples: Vec<Sample>,
}

pub fn percentile(values: &mut [f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * (values.len() - 1) as f64).round() as usize;
    Some(values[rank])
}

pub fn stats(samples: &[&Sample]) -> Stats {
    let mut ttft: Vec<f64> = samples.iter().filter_map(|s| s.ttft_ms).collect();
    let mut sim: Vec<f64> = samples.iter().filter_map(|s| s.sim_prefill_ms).collect();
    let (cached, prompt) = samples
        .iter()
        .filter_map(|s| Some((s.cached_tokens?, s.prompt_tokens?)))
        .fold((0u64, 0u64), |(c, p), (sc, sp)| (c + sc, p + sp));
    Stats {
        n: samples.len(),
        median_ms: percentile(&mut ttft, 50.0),
        p90_ms: percentile(&mut ttft, 90.0),
        sim_prefill_median_ms: percentile(&mut sim, 50.0),
        cached_fraction: (prompt > 0).then(|| cached as f64 / prompt as f64),
    }
}

impl Report {
    /// Fills the summary and the small-sample warnings from the samples.
    pub fn summarize(&mut self, wall_ms: f64) {
        let ok: Vec<&Sample> = self.samples.iter().filter(|s| s.error.is_none()).collect();
        let cold: Vec<&Sample> = ok.iter().copied().filter(|s| s.turn == 0).collect();
        let warm: Vec<&Sample> = ok.iter().copied().filter(|s| s.turn > 0).collect();
        let mut s = Summary {
            requests: self.samples.len(),
            errors: self.samples.len() - ok.len(),
            families: self.samples.iter().map(|s| s.family).collect::<std::collections::BTreeSet<_>>().len(),
            cold: stats(&cold),
            warm: stats(&warm),
            wall_ms,
            ..Summary::default()
        };
        let homes: BTreeMap<usize, &str> = cold.iter().map(|x| (x.family, x.replica.as_str())).collect();
        s.warm_on_home = warm.iter().filter(|x| homes.get(&x.family) == Some(&x.replica.as_str())).count();
        for x in &ok {
            *s.by_replica.entry(if x.replica.is_empty() { "?".into() } else { x.replica.clone() }).or_default() += 1;
            *s.by_route.entry(if x.route.is_empty() { "?".into() } else { x.route.clone() }).or_default() += 1;
        }
        if self.workload == "agent-loop" && s.warm.n < 20 {
            self.warnings.push(format!("only {} warm turns: too few to compare runs (aim for 20 or more)", s.warm.n));
        }
        if s.errors > 0 {
            self.warnings.push(format!("{} request(s) failed", s.errors));
        }
        // A workload that keeps no samples (overhead) has no headers to miss.
        if !ok.is_empty() && ok.iter().all(|x| x.replica.is_empty()) {
            self.warnings
                .push("no x-prefixgate-replica headers: the target is not prefixgate, spread is unknown".into());
        }
        self.summary = s;
    }

    pub fn table(&self) -> String {
        let s = &self.summary;
        let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0} ms"));
        let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.0} %", v * 100.0));
        let mut out = String::new();
        let _ = writeln!(out, "{} [{}] against {} ({:.1} s)", self.workload, self.label, self.target, self.duration_s);
        let _ = writeln!(out, "settings: {}", self.settings);
        let _ = writeln!(
            out,
            "requests: {} ({} failed), families: {}, wall: {:.0} ms",
            s.requests, s.errors, s.families, s.wall_ms
        );
        let _ = writeln!(
            out,
            "{:<6} {:>5} {:>12} {:>12} {:>14} {:>8}",
            "", "n", "TTFT p50", "TTFT p90", "sim prefill", "cached"
        );
        for (name, st) in [("cold", &s.cold), ("warm", &s.warm)] {
            let _ = writeln!(
                out,
                "{:<6} {:>5} {:>12} {:>12} {:>14} {:>8}",
                name,
                st.n,
                ms(st.median_ms),
                ms(st.p90_ms),
                ms(st.sim_prefill_median_ms),
                pct(st.cached_fraction)
            );
        }
        let _ = writeln!(out, "warm turns on their family's replica: {}/{}", s.warm_on_home, s.warm.n);
        let _ = writeln!(out, "by replica: {:?}", s.by_replica);
        let _ = writeln!(out, "by route:   {:?}", s.by_route);
        if let Some(v) = &self.verdict {
            let _ = writeln!(out, "verdict: {v}");
        }
        for w in &self.warnings {
            let _ = writeln!(out, "warning: {w}");
        }
        out
    }
}

/// Median TTFT by turn, one line per report.
pub fn svg(runs: &[Report]) -> String {
    const W: f64 = 640.0;
    const H: f64 = 360.0;
    const PAD: f64 = 50.0;
    const COLORS: &[&str] = &["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df"];
    let lines: Vec<(String, Vec<(usize, f64)>)> = runs
        .iter()
        .map(|r| {
            let mut by_turn: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
            for s in r.samples.iter().filter(|s| s.error.is_none()) {
                if let Some(t) = s.ttft_ms {
                    by_turn.entry(s.turn).or_default().push(t);
                }
            }
            let pts = by_turn.into_iter().filter_map(|(t, mut v)| percentile(&mut v, 50.0).map(|m| (t, m))).collect();
            (r.label.clone(), pts)
        })
        .collect();
    let max_turn = lines.iter().flat_map(|(_, p)| p.iter().map(|x| x.0)).max().unwrap_or(1).max(1) as f64;
    let max_ms = lines.iter().flat_map(|(_, p)| p.iter().map(|x| x.1)).fold(1.0, f64::max);
    let x = |t: usize| PAD + (t as f64 / max_turn) * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD - (v / max_ms) * (H - 2.0 * PAD);
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\
         <text x=\"{PAD}\" y=\"20\" font-size=\"14\">Median time to first token by turn</text>\
         <line x1=\"{PAD}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#888\"/><line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{0}\" stroke=\"#888\"/>\
         <text x=\"{2}\" y=\"{3}\" text-anchor=\"middle\">turn</text><text x=\"8\" y=\"{PAD}\">{max_ms:.0} ms</text><text x=\"8\" y=\"{0}\">0</text>",
        H - PAD,
        W - PAD,
        W / 2.0,
        H - 15.0
    );
    for t in 0..=max_turn as usize {
        let _ = write!(out, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{t}</text>", x(t), H - PAD + 15.0);
    }
    for (i, (label, pts)) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts.iter().map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v))).collect();
        let _ = write!(
            out,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            path.join(" ")
        );
        let _ = write!(
            out,
            "<text x=\"{}\" y=\"{}\" fill=\"{color}\">{}</text>",
            W - PAD - 100.0,
            PAD + 16.0 * i as f64,
            escape(label)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_split_cold_and_warm_and_warn_on_small_samples() {
        let mut r = Report { workload: "agent-loop".into(), ..Report::default() };
        for turn in 0..4 {
            r.samples.push(Sample {
                turn,
                ttft_ms: Some(if turn == 0 { 1000.0 } else { 100.0 * turn as f64 }),
                replica: "a".into(),
                route: if turn == 0 { "spread" } else { "pinned" }.into(),
                prompt_tokens: Some(100),
                cached_tokens: Some(if turn == 0 { 0 } else { 90 }),
                ..Sample::default()
            });
        }
        r.summarize(5.0);
        assert_eq!((r.summary.cold.n, r.summary.warm.n), (1, 3));
        assert_eq!(r.summary.warm.median_ms, Some(200.0));
        assert_eq!(r.summary.warm.cached_fraction, Some(0.9));
        assert!(r.warnings.iter().any(|w| w.contains("only 3 warm turns")));
        assert!(!r.warnings.iter().any(|w| w.contains("not prefixgate")), "every sample named its replica");
        assert!(svg(&[r]).contains("<polyline"));
    }

    #[test]
    fn only_samples_without_replica_headers_say_the_target_is_not_prefixgate() {
        let mut none = Report { workload: "overhead".into(), ..Report::default() };
        none.summarize(1.0);
        assert!(none.warnings.is_empty(), "no samples, nothing to judge: {:?}", none.warnings);
        let mut foreign = Report { workload: "burst".into(), ..Report::default() };
        foreign.samples.push(Sample { ttft_ms: Some(1.0), ..Sample::default() });
        foreign.summarize(1.0);
        assert!(foreign.warnings.iter().any(|w| w.contains("not prefixgate")));
    }
}
