//! The paused-time tier: timeouts and schedules checked on tokio's paused
//! clock (`start_paused`), so a 30-second wait takes no time and a test
//! asserts the exact tick a thing happens on, instead of sleeping and hoping.
//! Time moves only when the test advances it (or when nothing at all is left
//! to run); the tests keep their own tasks busy (`settle`) so it never jumps
//! on its own while they look.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prefixgate::admission::LargeSlots;
use prefixgate::domain_error::DomainError;
use prefixgate::events::EventLog;
use prefixgate::fleet::health::{probe_every, HealthTracker, Observation, ProbeResult};
use prefixgate::fleet::{AdminState, Fleet, Health, Replica, ReplicaSpec};

/// Lets every task that can run, run (without parking the runtime, which
/// would let paused time jump to the next timer).
async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn an_admission_wait_ends_exactly_at_its_timeout_and_leaves_nothing_queued() {
    let admission = Arc::new(LargeSlots::default());
    let replica: Arc<str> = Arc::from("r");
    let limit: Arc<dyn Fn() -> Option<u32> + Send + Sync> = Arc::new(|| Some(1));
    let (_held, _) =
        admission.acquire(&replica, &Default::default(), limit.clone(), Duration::from_secs(1), 4).await.unwrap();
    let started = tokio::time::Instant::now();
    let waiting = tokio::spawn({
        let (admission, replica, limit) = (admission.clone(), replica.clone(), limit.clone());
        async move { admission.acquire(&replica, &Default::default(), limit, Duration::from_secs(30), 4).await.map(|_| ()) }
    });
    settle().await;
    assert_eq!(admission.queued(), 1);
    tokio::time::advance(Duration::from_millis(29_999)).await;
    settle().await;
    assert!(!waiting.is_finished(), "still waiting one millisecond before its timeout");
    tokio::time::advance(Duration::from_millis(1)).await;
    let result = waiting.await.unwrap();
    assert!(matches!(result, Err(DomainError::Overloaded { .. })), "a 429 with Retry-After: {result:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(30));
    assert_eq!((admission.queued(), admission.in_use()), (0, 1), "the waiter left the queue");
}

#[tokio::test(start_paused = true)]
async fn health_falls_after_fall_failed_probes_and_rises_after_rise_good_ones_at_the_probe_interval() {
    let fleet = Arc::new(Fleet::default());
    fleet.add(Replica::new(ReplicaSpec::new("a", "http://127.0.0.1:1"), AdminState::Active));
    let tracker = Arc::new(HealthTracker::new(2, 3, Arc::new(EventLog::new(100, 100, None, Vec::new()).0)));
    // The replica's answer, as the test sets it; the schedule is the prober's own.
    let healthy = Arc::new(AtomicBool::new(true));
    let prober = tokio::spawn({
        let (fleet, tracker, healthy) = (fleet.clone(), tracker.clone(), healthy.clone());
        async move {
            probe_every(Duration::from_secs(5), &fleet, |r| {
                let (tracker, healthy) = (tracker.clone(), healthy.clone());
                async move {
                    let result = if healthy.load(Ordering::SeqCst) { ProbeResult::Ok } else { ProbeResult::Failed };
                    let epoch = tracker.epoch(&r);
                    tracker.observe(&r, Observation::Probe { result, error: None, epoch }, 0);
                }
            })
            .await
        }
    });
    let a = fleet.get("a").unwrap();
    let tick = || async {
        tokio::time::advance(Duration::from_secs(5)).await;
        settle().await;
    };
    settle().await;
    assert_eq!(a.health(), Health::Up, "the first probe runs at once");
    healthy.store(false, Ordering::SeqCst);
    tick().await;
    tick().await;
    assert_eq!(a.health(), Health::Up, "two failures: fall is 3");
    tick().await;
    assert_eq!(a.health(), Health::Down, "the third failure, 15 s after the first");
    healthy.store(true, Ordering::SeqCst);
    tick().await;
    assert_eq!(a.health(), Health::Down, "one success: rise is 2");
    tick().await;
    assert_eq!(a.health(), Health::Up);
    prober.abort();
}

#[tokio::test(start_paused = true)]
async fn the_flusher_writes_pins_behind_the_requests_once_per_interval() {
    let mut config = prefixgate::config::Config::default();
    config.pins.flush_interval_ms = 200;
    let store: Arc<dyn prefixgate::store::Store> = Arc::new(prefixgate::store::MemoryStore::default());
    let state = prefixgate::state::AppState::with_store(config, store.clone()).await.unwrap();
    let flusher = tokio::spawn(prefixgate::flusher(state.clone(), None, Default::default()));
    settle().await;
    state.pins.record(7, &Arc::from("a"), None, 10, 1, Default::default());
    tokio::time::advance(Duration::from_millis(199)).await;
    settle().await;
    assert!(store.pins().await.unwrap().is_empty(), "nothing is written on the request path or before the interval");
    tokio::time::advance(Duration::from_millis(1)).await;
    // The batch is written on a blocking thread: wait for it in real time,
    // keeping this task busy so that paused time stays where it is.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.pins().await.unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the flusher never wrote the pin");
        tokio::task::yield_now().await;
    }
    assert_eq!(store.pins().await.unwrap()[0].0, 7);
    flusher.abort();
}

/// One card's fleet-wide slots as the shared store keeps them (the Redis
/// script's rule: a lease expires `ttl` after it was taken or last renewed),
/// on tokio's clock.
struct LeaseTable {
    limit: usize,
    ttl: Duration,
    leases: std::sync::Mutex<Vec<(String, tokio::time::Instant)>>,
}

impl LeaseTable {
    fn try_take(&self, who: &str) -> bool {
        let now = tokio::time::Instant::now();
        let mut leases = self.leases.lock().unwrap();
        leases.retain(|(_, expires)| *expires > now);
        if leases.len() >= self.limit {
            return false;
        }
        leases.push((who.to_string(), now + self.ttl));
        true
    }
}

#[tokio::test(start_paused = true)]
async fn a_slot_held_by_a_killed_instance_frees_up_when_its_lease_expires_and_not_before() {
    use prefixgate::leases::{wait_for_slot, SlotWait, LEASE_TTL_MS};
    let ttl = Duration::from_millis(LEASE_TTL_MS);
    let table = Arc::new(LeaseTable { limit: 1, ttl, leases: Default::default() });
    assert!(table.try_take("killed"), "the instance that then dies without releasing or renewing");
    let started = tokio::time::Instant::now();
    let ask = |table: Arc<LeaseTable>| move || std::future::ready(Ok::<bool, String>(table.try_take("waiting")));
    // A wait shorter than the lease's life ends without the slot...
    let short = wait_for_slot(ttl - Duration::from_secs(1), ask(table.clone())).await;
    assert_eq!(short, SlotWait::TimedOut);
    assert!(started.elapsed() < ttl);
    // ...a longer one gets it once the lease has expired, within one retry.
    let long = wait_for_slot(Duration::from_secs(30), ask(table.clone())).await;
    assert_eq!(long, SlotWait::Taken { waited: true });
    let at = started.elapsed();
    assert!(at >= ttl && at <= ttl + Duration::from_millis(25), "taken {at:?} after the other instance died");
    // A store that does not answer is not a wait: the local limit applies.
    let down = wait_for_slot(Duration::from_secs(30), || std::future::ready(Err::<bool, String>("down".into()))).await;
    assert_eq!(down, SlotWait::Unreachable { why: "down".into(), waited: false });
}
