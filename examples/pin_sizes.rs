//! Size of the pin table: in memory (the routing table) and on disk (sled,
//! the binary layout), and how long a restart takes to load it. By default
//! one million pins, one per conversation; with `CONVERSATIONS=N
//! MESSAGES=M`, N conversations of M messages as their turns leave them (a
//! turn every two messages: its own pin at each turn's last boundary, a
//! mark at every other boundary it passed, `PinSource::Passed`).
//! Run: `[CONVERSATIONS=1000000 MESSAGES=40] cargo run --release --example pin_sizes`.

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

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let var = |name: &str, default: u128| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (conversations, messages) = (var("CONVERSATIONS", 1_000_000), var("MESSAGES", 1));
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

    let dir = std::env::temp_dir().join(format!("prefixgate-pin-sizes-{}", std::process::id()));
    let store = SledStore::open(&dir).expect("open sled");
    let started = std::time::Instant::now();
    for batch in changes.chunks(10_000) {
        store.write_pins(batch).await.expect("write");
    }
    store.flush().await.expect("flush");
    let secs = started.elapsed().as_secs_f64();
    println!(
        "on disk: sled reports {:.1} MiB, directory {:.1} MiB ({:.0} bytes/pin); written in batches of 10k in {secs:.1} s ({:.0} pins/s)",
        store.size_on_disk() as f64 / 1048576.0,
        dir_size(&dir) as f64 / 1048576.0,
        dir_size(&dir) as f64 / n as f64,
        n as f64 / secs
    );
    drop(store);

    // Startup: open the database and load every pin into a fresh table.
    let started = std::time::Instant::now();
    let store = SledStore::open(&dir).expect("reopen sled");
    let opened = started.elapsed().as_secs_f64();
    let pins = store.pins().await.expect("read pins");
    let read = started.elapsed().as_secs_f64() - opened;
    let restored = PinTable::default();
    restored.restore(pins);
    println!(
        "startup load: {} persisted pins in {:.2} s (open {opened:.2} s, read {read:.2} s, restore {:.2} s)",
        restored.len(),
        started.elapsed().as_secs_f64(),
        started.elapsed().as_secs_f64() - opened - read
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
