//! Size of one million pins: in memory (the routing table) and on disk
//! (sled, the schema-2 binary layout), and how long a restart takes to load
//! them. Run: `cargo run --release --example pin_sizes`.

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
    const N: u128 = 1_000_000;
    let replicas: Vec<Arc<str>> = ["gpu-0", "gpu-1", "gpu-2", "gpu-3"].iter().map(|s| Arc::from(*s)).collect();
    let before = rss_bytes();
    let table = PinTable::default();
    for k in 0..N {
        let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        table.record(key, &replicas[(k % 4) as usize], None, 90_000, 1_700_000_000_000 + k as u64, Default::default());
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
        (after - before) as f64 / N as f64
    );

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
        dir_size(&dir) as f64 / N as f64,
        N as f64 / secs
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
