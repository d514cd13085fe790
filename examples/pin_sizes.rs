//! Size of the pin table: in memory (the routing table) and on disk (sled,
//! the binary layout), and how long a restart takes to load it. By default
//! one million pins, one per conversation; with `CONVERSATIONS=N
//! MESSAGES=M`, N conversations of M messages as their turns leave them (a
//! turn every two messages: its own pin at each turn's last boundary, a
//! mark at every other boundary it passed, `PinSource::Passed`).
//! With `DIR=path`, the database is kept there, and a later run with the
//! same `DIR` only measures the load (writing 40M pins takes minutes).
//! Run: `[CONVERSATIONS=1000000 MESSAGES=40] [DIR=...] cargo run --release --example pin_sizes`.

use std::sync::Arc;

use prefixgate::pins::PinTable;
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
    let kept = std::env::var_os("DIR").map(std::path::PathBuf::from);
    let dir = kept
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("prefixgate-pin-sizes-{}", std::process::id())));
    if !(kept.is_some() && dir.exists()) {
        write(&dir, conversations, messages).await;
    }
    load(&dir).await;
    if kept.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Builds the table of `conversations` x `messages`, reports its size in
/// memory, and writes it to a sled database in `dir`, reporting its size.
async fn write(dir: &std::path::Path, conversations: u128, messages: u128) {
    let n = conversations * messages;
    let replicas: Vec<Arc<str>> = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"].iter().map(|s| Arc::from(*s)).collect();
    let before = rss_bytes();
    let table = PinTable::default();
    let passed = prefixgate::pins::PinOrigin { source: prefixgate::pins::PinSource::Passed, ..Default::default() };
    for c in 0..conversations {
        let replica = &replicas[(c % 4) as usize];
        let family = c.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        let mut marks = Vec::new();
        for m in 0..messages {
            let key = (c * messages + m).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
            let now = 1_700_000_000_000 + c as u64;
            // A turn ends every two messages (and at the last): its own pin.
            if m % 2 == 1 || m + 1 == messages {
                table.record(key, replica, None, 90_000, now, Default::default());
            } else {
                let pin = prefixgate::pins::Pin {
                    replica: replica.clone(),
                    created_ms: now,
                    last_used_ms: now,
                    turns: (m / 2 + 1) as u32,
                    est_tokens: 2_000 * m as u64,
                    family,
                    origin: passed,
                    went_on: 1,
                };
                marks.push((key, pin));
            }
        }
        table.write_marks(marks);
    }
    // The write-behind queue is emptied by the flusher every 200 ms; the
    // table is what stays. Measured with the queue taken and handed over.
    let changes = table.take_dirty();
    let queue_bytes = changes.capacity() * std::mem::size_of::<prefixgate::pins::PinChange>();
    let after = rss_bytes() - queue_bytes as u64;
    println!(
        "in memory: {} pins, RSS grew by {:.1} MiB ({:.0} bytes/pin)",
        table.len(),
        (after - before) as f64 / 1048576.0,
        (after - before) as f64 / n as f64
    );
    println!("({conversations} conversations of {messages} messages)");

    let store = SledStore::open(dir).expect("open sled");
    let started = std::time::Instant::now();
    // Batches as the flusher's at full tilt would be; a million at a time
    // rewrites each sled page a few times, not once per 10k pins.
    let batch_size = (var("BATCH", 1_000_000) as usize).max(1);
    for batch in changes.chunks(batch_size) {
        store.write_pins(batch).await.expect("write");
    }
    store.flush().await.expect("flush");
    let secs = started.elapsed().as_secs_f64();
    println!(
        "on disk: sled reports {:.1} MiB, directory {:.1} MiB ({:.0} bytes/pin); written in batches of {batch_size} in {secs:.1} s ({:.0} pins/s)",
        store.size_on_disk() as f64 / 1048576.0,
        dir_size(dir) as f64 / 1048576.0,
        dir_size(dir) as f64 / n as f64,
        n as f64 / secs
    );
}

/// Startup: open the database in `dir` and load every pin into a fresh table.
async fn load(dir: &std::path::Path) {
    let before = rss_bytes();
    let started = std::time::Instant::now();
    let store = SledStore::open(dir).expect("reopen sled");
    let opened = started.elapsed().as_secs_f64();
    let pins = store.pins().await.expect("read pins");
    let read = started.elapsed().as_secs_f64() - opened;
    let restored = PinTable::default();
    restored.restore(pins);
    let secs = started.elapsed().as_secs_f64();
    drop(store);
    println!(
        "startup load: {} persisted pins in {secs:.2} s (open {opened:.2} s, read {read:.2} s, restore {:.2} s); RSS grew by {:.1} MiB",
        restored.len(),
        secs - opened - read,
        (rss_bytes() - before) as f64 / 1048576.0
    );
}
