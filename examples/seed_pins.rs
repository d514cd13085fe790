//! Writes N pins for replicas `a` and `b` into a sled data directory, as a
//! gateway that has served N conversations would have left them. Used by
//! `bench/million-pins.sh` to start gateways with a full table.
//! Run: `cargo run --release --example seed_pins -- DIR N URL_A URL_B`.

use std::sync::Arc;

use prefixgate::fleet::{AdminState, ReplicaSpec};
use prefixgate::pins::Pin;
use prefixgate::store::{SledStore, Store, StoredReplica};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: seed_pins DIR N URL_A URL_B";
    let dir = args.next().expect(usage);
    let n: u128 = args.next().and_then(|s| s.parse().ok()).expect(usage);
    let store = SledStore::open(std::path::Path::new(&dir)).expect("open sled");
    // The replicas too: a database that holds anything is no longer seeded from flags.
    for id in ["a", "b"] {
        let spec = ReplicaSpec::new(id, &args.next().expect(usage));
        store
            .put_replica(&StoredReplica { spec, admin: AdminState::Active, source: Default::default() })
            .await
            .expect("write replica");
    }
    let replicas: [Arc<str>; 2] = [Arc::from("a"), Arc::from("b")];
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    let mut batch = Vec::with_capacity(10_000);
    for k in 0..n {
        let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835);
        let pin = Pin {
            replica: replicas[(k % 2) as usize].clone(),
            created_ms: now,
            last_used_ms: now,
            turns: 1,
            est_tokens: 2_000,
            family: key,
            origin: Default::default(),
            went_on: 0,
        };
        batch.push((key, Some(pin)));
        if batch.len() == 10_000 {
            store.write_pins(&batch).await.expect("write");
            batch.clear();
        }
    }
    store.write_pins(&batch).await.expect("write");
    store.flush().await.expect("flush");
    println!("{n} pins written to {dir}");
}
