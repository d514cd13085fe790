//! What sessions grow to. A session's first turn says little about the KV
//! it will hold: an agent's context grows with every tool call, and on an
//! engine whose KV is a pool of tokens (vLLM, SGLang) four first turns fit
//! where four grown sessions do not. So a new session is admitted against
//! its *projected* footprint: the peak context that sessions which ended
//! here reached, kept per first link (the system prompt, instructions and
//! tools a family of sessions shares) where one is known, fleet-wide
//! otherwise. Pure: no clock, no I/O; `Sessions` feeds it as sessions end.
//!
//! - Per link: the largest peak of its last `PER_LINK` sessions (a family
//!   of agents runs alike; the largest recent one is what room must hold).
//! - Fleet-wide: the 75th percentile of the last `FLEET` sessions' peaks
//!   (mixed families: most fit, the largest outliers do not set the rule).
//! - Bounded: at most `MAX_LINKS` links, the least recently fed leaving first.

use std::collections::VecDeque;

use crate::policy::PrefixKey;

/// Peaks kept per link.
const PER_LINK: usize = 4;
/// Peaks kept fleet-wide.
const FLEET: usize = 64;
/// Links kept.
pub const MAX_LINKS: usize = 4_096;

#[derive(Debug, Default)]
struct LinkPeaks {
    peaks: VecDeque<u64>,
    /// What a turn of its recent sessions added, tokens (each session's
    /// largest recent turn): how fast a new session of the link will grow.
    growths: VecDeque<u64>,
    /// When it was last fed (a counter, not a clock): the oldest leaves first.
    fed: u64,
}

#[derive(Debug, Default)]
pub struct Projections {
    links: foldhash::HashMap<PrefixKey, LinkPeaks>,
    fleet: VecDeque<u64>,
    fleet_growths: VecDeque<u64>,
    fed: u64,
}

/// What the capacity view shows of the projections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProjectionFigures {
    /// The fleet-wide projection, tokens (None: nothing learned yet).
    pub fleet_tokens: Option<u64>,
    /// Sessions whose peak was learned (the last `FLEET` at most).
    pub sessions_learned: usize,
    /// First links with a projection of their own.
    pub links: usize,
}

impl Projections {
    /// A session ended (idled out) having reached `peak` tokens of context;
    /// `link` is its first link, when it has one.
    pub fn learn(&mut self, link: Option<PrefixKey>, peak: u64) {
        if peak == 0 {
            return;
        }
        self.fed += 1;
        if self.fleet.len() == FLEET {
            self.fleet.pop_front();
        }
        self.fleet.push_back(peak);
        let Some(link) = link else { return };
        if !self.links.contains_key(&link) && self.links.len() >= MAX_LINKS {
            let oldest = self.links.iter().min_by_key(|(_, l)| l.fed).map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                self.links.remove(&oldest);
            }
        }
        let entry = self.links.entry(link).or_default();
        if entry.peaks.len() == PER_LINK {
            entry.peaks.pop_front();
        }
        entry.peaks.push_back(peak);
        entry.fed = self.fed;
    }

    /// A session of `link` that ended added up to `growth` tokens a turn
    /// (0: not known, nothing is learned). Kept beside its peak, bounded alike.
    pub fn learn_growth(&mut self, link: Option<PrefixKey>, growth: u64) {
        if growth == 0 {
            return;
        }
        if self.fleet_growths.len() == FLEET {
            self.fleet_growths.pop_front();
        }
        self.fleet_growths.push_back(growth);
        // Only a link `learn` keeps (it bounds them): what a link grows to
        // and how fast are learned together.
        if let Some(entry) = link.and_then(|l| self.links.get_mut(&l)) {
            if entry.growths.len() == PER_LINK {
                entry.growths.pop_front();
            }
            entry.growths.push_back(growth);
        }
    }

    /// What a turn of a new session of this link is expected to add,
    /// tokens: the most its link's recent sessions added, else the fleet's
    /// 75th percentile; None when nothing was learned.
    pub fn project_growth(&self, link: Option<PrefixKey>) -> Option<u64> {
        link.and_then(|l| self.links.get(&l))
            .and_then(|l| l.growths.iter().max().copied())
            .or_else(|| percentile_75(&self.fleet_growths))
    }

    /// What a session of this link is expected to reach, tokens: its link's
    /// projection, else the fleet's; None when nothing was learned.
    pub fn project(&self, link: Option<PrefixKey>) -> Option<u64> {
        link.and_then(|l| self.links.get(&l))
            .and_then(|l| l.peaks.iter().max().copied())
            .or_else(|| self.fleet_tokens())
    }

    fn fleet_tokens(&self) -> Option<u64> {
        percentile_75(&self.fleet)
    }

    pub fn figures(&self) -> ProjectionFigures {
        ProjectionFigures {
            fleet_tokens: self.fleet_tokens(),
            sessions_learned: self.fleet.len(),
            links: self.links.len(),
        }
    }
}

/// The 75th percentile of `values` (None: empty): mixed families, where most
/// fit and the largest outliers do not set the rule.
fn percentile_75(values: &VecDeque<u64>) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    let mut sorted: Vec<u64> = values.iter().copied().collect();
    sorted.sort_unstable();
    Some(sorted[(sorted.len() * 3).div_ceil(4) - 1])
}

/// The footprint a new session is admitted against: what it holds now, or
/// what it is projected to grow to, never more than the replica's whole
/// capacity (a projection larger than a replica still lets it run alone).
pub fn admitted_tokens(now: u64, projected: Option<u64>, capacity: Option<u64>) -> u64 {
    let grown = now.max(projected.unwrap_or(0));
    match capacity {
        Some(c) => grown.min(c.max(now)),
        None => grown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_turn_adds_is_learned_beside_the_peak_per_link_then_fleet_wide() {
        let mut p = Projections::default();
        assert_eq!(p.project_growth(Some(1)), None, "nothing learned");
        p.learn(Some(1), 9_500);
        p.learn_growth(Some(1), 1_500);
        p.learn(Some(2), 3_000);
        p.learn_growth(Some(2), 200);
        p.learn_growth(Some(2), 0);
        assert_eq!(p.project_growth(Some(1)), Some(1_500));
        assert_eq!(p.project_growth(Some(2)), Some(200), "0 is unknown, not learned");
        assert_eq!(p.project_growth(Some(3)), Some(1_500), "an unknown link: the fleet's 75th percentile");
        for _ in 0..PER_LINK {
            p.learn(Some(1), 9_500);
            p.learn_growth(Some(1), 1_000);
        }
        assert_eq!(p.project_growth(Some(1)), Some(1_000), "the link's last sessions only");
    }

    #[test]
    fn a_link_projects_its_largest_recent_peak_and_others_the_fleets_upper_quartile() {
        let mut p = Projections::default();
        assert_eq!(p.project(Some(1)), None, "a cold gateway knows nothing");
        for peak in [9_000, 10_500, 9_800] {
            p.learn(Some(1), peak);
        }
        assert_eq!(p.project(Some(1)), Some(10_500));
        for peak in [1_000, 2_000, 3_000, 4_000, 5_000] {
            p.learn(None, peak);
        }
        // Eight peaks fleet-wide: 1k..5k and 9k..10.5k; the upper quartile is the 6th.
        assert_eq!(p.project(Some(2)), Some(9_000), "an unknown link gets the fleet's");
        assert_eq!(p.project(None), Some(9_000));
        // A link's window moves: four newer, smaller sessions replace the large one.
        for _ in 0..PER_LINK {
            p.learn(Some(1), 6_000);
        }
        assert_eq!(p.project(Some(1)), Some(6_000));
        assert_eq!(p.figures(), ProjectionFigures { fleet_tokens: Some(6_000), sessions_learned: 12, links: 1 });
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let mut p = Projections::default();
        for link in 0..(MAX_LINKS as u128 + 100) {
            p.learn(Some(link), 1_000 + link as u64);
        }
        assert_eq!(p.links.len(), MAX_LINKS);
        assert_eq!(p.fleet.len(), FLEET);
        assert!(p.links.contains_key(&(MAX_LINKS as u128 + 99)), "the newest stays");
        assert!(!p.links.contains_key(&0), "the oldest left");
    }

    #[test]
    fn a_session_is_admitted_against_its_projection_bounded_by_the_replica() {
        assert_eq!(admitted_tokens(2_000, None, Some(12_000)), 2_000, "nothing learned: its first turn");
        assert_eq!(admitted_tokens(2_000, Some(9_500), Some(12_000)), 9_500);
        assert_eq!(admitted_tokens(2_000, Some(50_000), Some(12_000)), 12_000, "at most a whole replica");
        assert_eq!(admitted_tokens(14_000, Some(9_000), Some(12_000)), 14_000, "what it holds now, whatever");
        assert_eq!(admitted_tokens(2_000, Some(9_500), None), 9_500);
    }
}
