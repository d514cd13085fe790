//! Size of the pin table: in memory (the routing table) and on disk (sled,
//! the binary layout), and how long a restart takes before it routes. By
//! default one million pins, one per conversation; with `CONVERSATIONS=N
//! MESSAGES=M`, N conversations of M messages as their turns leave them (a
//! turn every two messages: its own pin at each turn's last boundary, a
//! mark at every other boundary it passed, `PinSource::Passed`).
//! With `DIR=path`, the database is kept there, and a later run with the
//! same `DIR` only measures the load (writing 40M pins takes minutes).
//! `EAGER=1` also times reading the whole table before routing (the
//! startup before `pins::pages`), in the same run. `FLOOR=1` only times
//! what no layout can undercut on this machine: the same number of keys
//! put into one map already sized for them, with no disk and no decoding.
//! Run: `[CONVERSATIONS=1000000 MESSAGES=40] [DIR=...] cargo run --release --example pin_sizes`.

use std::sync::Arc;
use std::time::Instant;

use prefixgate::pins::{Pin, PinOrigin, PinSource, PinTable};
use prefixgate::policy::{Boundary, PrefixKey};
use prefixgate::store::{SledStore, Store};
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0) * 4096
}

fn dir_size(p: &std::path::Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| {
            rd.flatten()
                .map(
                    |e| {
                        if e.path().is_dir() {
                            dir_size(&e.path())
                        } else {
                            e.metadata().map(|m| m.len()).unwrap_or(0)
                        }
                    },
                )
                .sum()
        })
        .unwrap_or(0)
}

fn var(name: &str, default: u128) -> u128 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let (conversations, messages) = (var("CONVERSATIONS", 1_000_000), var("MESSAGES", 1));
    if std::env::var("FLOOR").is_ok_and(|v| !v.is_empty()) {
        floor(conversations * messages);
        return;
    }
    let kept = std::env::var_os("DIR").map(std::path::PathBuf::from);
    let dir = kept
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("prefixgate-pin-sizes-{}", std::process::id())));
    if !(kept.is_some() && dir.exists()) {
        in_memory(conversations, messages);
        write(&dir, conversations, messages).await;
    }
    load(&dir, conversations, messages).await;
    if std::env::var("EAGER").is_ok_and(|v| !v.is_empty()) {
        load_whole(&dir).await;
    }
    if kept.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A whole table can be in memory no sooner than its keys are in a map:
/// `n` spread keys into a map sized for them up front, once with a pin's
/// size in memory (a 16-byte key and a 64-byte `Slot`), once with the
/// least a pin could be (an 8-byte key and a 4-byte replica), one thread.
fn floor(n: u128) {
    fn fill<K: std::hash::Hash + Eq, V: Copy>(n: u128, key: impl Fn(u128) -> K, value: V) -> f64 {
        let started = Instant::now();
        let mut map = foldhash::HashMap::with_capacity_and_hasher(n as usize, Default::default());
        for i in 0..n {
            map.insert(key(i), value);
        }
        assert_eq!(map.len() as u128, n, "every key distinct");
        started.elapsed().as_secs_f64()
    }
    let pin_sized = fill(n, |i| i.wrapping_mul(SPREAD), [0u64; 8]);
    let least = fill(n, |i| i.wrapping_mul(SPREAD) as u64, 0u32);
    println!("floor: {n} keys into a map sized for them, no disk: {pin_sized:.2} s at a pin's size (80 bytes), {least:.2} s at 12 bytes");
}

const SPREAD: u128 = 0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835;
const NOW: u64 = 1_700_000_000_000;

fn key_of(c: u128, m: u128, messages: u128) -> PrefixKey {
    (c * messages + m).wrapping_mul(SPREAD)
}

/// The table of `conversations` x `messages` as the gateway builds it,
/// turn by turn; reports its size in memory, then lets it go.
fn in_memory(conversations: u128, messages: u128) {
    let replicas: Vec<Arc<str>> = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"].iter().map(|s| Arc::from(*s)).collect();
    let before = rss_bytes();
    let table = PinTable::default();
    for c in 0..conversations {
        let replica = &replicas[(c % 4) as usize];
        let mut marks = Vec::new();
        for m in 0..messages {
            let key = key_of(c, m, messages);
            let pin = pin_at(c, m, messages, replica);
            if pin.origin.source == PinSource::Passed {
                marks.push((key, pin));
            } else {
                table.record(key, replica, None, pin.est_tokens, pin.last_used_ms, pin.origin);
            }
        }
        table.write_marks(marks);
    }
    // The write-behind queue is emptied by the flusher every 200 ms; the
    // table is what stays. Measured with the queue taken and handed over.
    let changes = table.take_dirty();
    let queue_bytes = changes.capacity() * std::mem::size_of::<prefixgate::pins::PinChange>();
    let after = rss_bytes() - queue_bytes as u64;
    let n = conversations * messages;
    println!(
        "in memory: {} pins, RSS grew by {:.1} MiB ({:.0} bytes/pin) ({conversations} conversations of {messages} messages)",
        table.len(),
        (after - before) as f64 / 1048576.0,
        (after - before) as f64 / n as f64
    );
}

/// The pin at message `m` of conversation `c`: a turn ends every two
/// messages (and at the last), with its own pin; the others are marks.
fn pin_at(c: u128, m: u128, messages: u128, replica: &Arc<str>) -> Pin {
    let own = m % 2 == 1 || m + 1 == messages;
    Pin {
        replica: replica.clone(),
        created_ms: NOW,
        last_used_ms: NOW + c as u64,
        turns: (m / 2 + 1) as u32,
        est_tokens: 2_000 * m as u64,
        family: key_of(c, 0, messages),
        origin: PinOrigin { source: if own { PinSource::Prefix } else { PinSource::Passed }, ..Default::default() },
        went_on: u32::from(!own),
    }
}

/// Writes the table to a sled database in `dir`, a sixteenth of the pages
/// at a time (each page written once: holding the whole table and its
/// write queue at once did not fit a 24 GiB machine at 1M x 40).
async fn write(dir: &std::path::Path, conversations: u128, messages: u128) {
    let replicas: Vec<Arc<str>> = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"].iter().map(|s| Arc::from(*s)).collect();
    let store = SledStore::open(dir).expect("open sled");
    let started = Instant::now();
    const PASSES: u32 = 16;
    let per_pass = (prefixgate::pins::PAGES as u32) / PASSES;
    for pass in 0..PASSES {
        let pages = pass * per_pass..(pass + 1) * per_pass;
        let mut changes = Vec::new();
        for c in 0..conversations {
            for m in 0..messages {
                let key = key_of(c, m, messages);
                if pages.contains(&u32::from(prefixgate::pins::page_of(key))) {
                    changes.push((key, Some(pin_at(c, m, messages, &replicas[(c % 4) as usize]))));
                }
            }
        }
        store.write_pins(&changes).await.expect("write");
        store.flush().await.expect("flush");
    }
    let secs = started.elapsed().as_secs_f64();
    let n = conversations * messages;
    println!(
        "on disk: sled reports {:.1} MiB, directory {:.1} MiB ({:.0} bytes/pin); written in {secs:.1} s",
        store.size_on_disk() as f64 / 1048576.0,
        dir_size(dir) as f64 / 1048576.0,
        dir_size(dir) as f64 / n as f64,
    );
}

/// Startup as the gateway does it (`state.rs`): open the database, route a
/// returning turn of one conversation (its boundaries' pages read on
/// touch), while a background thread reads every page.
async fn load(dir: &std::path::Path, conversations: u128, messages: u128) {
    let before = rss_bytes();
    let started = Instant::now();
    let store = SledStore::open(dir).expect("reopen sled");
    let table = Arc::new(PinTable::paged(store.pin_pages().expect("sled reads pages"), None));
    let opened = started.elapsed().as_secs_f64();
    let loader = {
        let table = table.clone();
        std::thread::spawn(move || table.load_all())
    };
    // A returning turn of a conversation in the middle: one boundary more
    // than it sent last (the last message is new), so its longest match is
    // its previous turn's own pin, found among 40 pages read on touch.
    let c = conversations / 2;
    let mut boundaries: Vec<Boundary> =
        (0..messages).map(|m| Boundary { key: key_of(c, m, messages), bytes: 0 }).collect();
    boundaries.push(Boundary { key: 1, bytes: 0 });
    let asked = Instant::now();
    let found = table.lookup_longest(&boundaries, &[], boundaries.len() - 1);
    let lookup_ms = asked.elapsed().as_secs_f64() * 1000.0;
    let routed = started.elapsed().as_secs_f64();
    let previous = key_of(c, messages - 1, messages);
    assert_eq!(found.continued.map(|(b, _)| b.key), Some(previous), "the previous turn's pin");
    loader.join().expect("loader");
    let whole = started.elapsed().as_secs_f64();
    println!(
        "startup: routing after {routed:.3} s (open {opened:.3} s; the first turn's lookup {lookup_ms:.1} ms, \
         reading its pages); every page read in the background after {whole:.2} s: {} pins, RSS grew by {:.1} MiB",
        table.len(),
        (rss_bytes() - before) as f64 / 1048576.0
    );
}

/// The startup before pages: every pin read and restored before routing.
async fn load_whole(dir: &std::path::Path) {
    let started = Instant::now();
    let store = SledStore::open(dir).expect("reopen sled");
    let pins = store.pins().await.expect("read pins");
    let read = started.elapsed().as_secs_f64();
    let restored = PinTable::default();
    restored.restore(pins);
    let secs = started.elapsed().as_secs_f64();
    println!(
        "whole-table startup (EAGER): {} pins in {secs:.2} s (open and read {read:.2} s, restore {:.2} s)",
        restored.len(),
        secs - read
    );
}
