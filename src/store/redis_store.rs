//! The shared store: Redis, for several gateway instances in front of one
//! fleet. Every instance keeps its own in-memory copy of pins and fleet state
//! and routes from it; this store is where they meet:
//!
//! - writes go here first (operator actions) or behind the requests in
//!   batches (pins, events), exactly as with sled;
//! - every write is announced on the pub/sub channel `{prefix}:changes`, and
//!   each instance applies the others' changes to its own copy (`shared.rs`);
//!   a new pin is announced as soon as it exists (`announce.rs`), before it
//!   is persisted, so instance B knows a pin written by instance A one
//!   pub/sub hop later, and a drain issued on any instance stops new traffic
//!   on all of them;
//! - each instance writes a heartbeat (`{prefix}:instances`) with its
//!   in-flight requests per replica, so `drain?wait=true` can wait for the
//!   whole fleet and the admin API can list live instances.
//!
//! Layout: `{prefix}:meta` (hash: schema), `{prefix}:replicas` (hash: id ->
//! JSON), `{prefix}:pins` (hash: 16-byte key -> pin record, the same layout
//! as sled), `{prefix}:events` (sorted set by id), `{prefix}:settings`
//! (hash: name -> JSON), `{prefix}:instances` (hash: name -> JSON beat),
//! `{prefix}:leases:{replica}` (sorted set: a large request's fleet-wide
//! slot -> its expiry), `{prefix}:session_until:{replica}` (sorted set:
//! session -> when its entry expires) and `{prefix}:session_tokens:{replica}`
//! (hash: session -> footprint): the resident sessions every instance
//! places by; and the pub/sub channel `{prefix}:changes`.
//!
//! Every command goes through redis' async client with a response timeout
//! (`TIMEOUT`) on a multiplexed connection that is re-made after any error:
//! a slow or dead Redis fails the flusher's batch (which is retried) and
//! never holds a runtime worker; the request path reads it only within
//! budgets of its own (`store.read_through_ms`, the hold's).

use std::sync::LazyLock;
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{AsyncCommands, AsyncConnectionConfig, RedisResult};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use super::{corrupt, decode_pin, encode_pin, Change, InstanceBeat, KeptSession, Store, StoreError, StoredReplica};
use crate::events::Event;
use crate::pins::{Pin, PinChange};
use crate::policy::PrefixKey;

/// Longest a single Redis command (or a connection attempt) may take
/// before it counts as a failure.
pub const TIMEOUT: Duration = Duration::from_millis(500);

/// Key namespace in the Redis database.
const PREFIX: &str = "prefixgate";

/// A connection, made when first needed and dropped after any error.
type Slot = tokio::sync::Mutex<Option<MultiplexedConnection>>;

pub struct RedisStore {
    source: Source,
    /// Writes (operator actions, the flusher's batches, heartbeats).
    conn: Slot,
    /// Announcements of new pins, on a connection of their own so they never
    /// queue behind a flusher's batch.
    publisher: Slot,
    /// Read-through lookups from the request path, for the same reason.
    reader: Slot,
    instance: String,
    new: bool,
    /// Where its listener, and the gateway's announcer and follower, run.
    runtime: std::sync::Arc<super::OwnRuntime>,
}

impl From<redis::RedisError> for StoreError {
    fn from(e: redis::RedisError) -> Self {
        StoreError::Backend(format!("redis: {e}"))
    }
}

fn key(k: &str) -> String {
    format!("{PREFIX}:{k}")
}

/// Where connections go: one server, or whichever server the Sentinels
/// name as the master now (asked again at every reconnect, so a failover
/// is followed).
#[derive(Clone)]
enum Source {
    Direct(redis::Client),
    Sentinel { nodes: Vec<String>, service: String, node: redis::sentinel::SentinelNodeConnectionInfo },
}

impl Source {
    /// `redis+sentinel://[:password@]host:port[,host:port...]/service[/db]`
    /// (the password is the master's), else any URL the redis crate takes.
    fn parse(url: &str) -> Result<Source, StoreError> {
        let bad = |why: &str| StoreError::Backend(format!("store url: {why}"));
        let Some(rest) = url.strip_prefix("redis+sentinel://") else {
            return redis::Client::open(url).map(Source::Direct).map_err(|e| bad(&e.to_string()));
        };
        let (password, rest) = match rest.split_once('@') {
            Some((auth, rest)) => (auth.rsplit_once(':').map(|(_, p)| p.to_string()), rest),
            None => (None, rest),
        };
        let (hosts, path) = rest.split_once('/').ok_or_else(|| bad("a sentinel URL needs /service"))?;
        let mut path = path.split('/');
        let service = path.next().filter(|s| !s.is_empty()).ok_or_else(|| bad("a sentinel URL needs /service"))?;
        let db: i64 = path.next().map_or(Ok(0), str::parse).map_err(|_| bad("the database must be a number"))?;
        let mut info = redis::RedisConnectionInfo::default().set_db(db);
        if let Some(p) = password {
            info = info.set_password(p);
        }
        Ok(Source::Sentinel {
            nodes: hosts.split(',').map(|h| format!("redis://{h}")).collect(),
            service: service.to_string(),
            node: redis::sentinel::SentinelNodeConnectionInfo::default().set_redis_connection_info(info),
        })
    }

    async fn client(&self) -> RedisResult<redis::Client> {
        match self {
            Source::Direct(c) => Ok(c.clone()),
            Source::Sentinel { nodes, service, node } => {
                let mut sentinel = redis::sentinel::Sentinel::build(nodes.clone())?;
                tokio::time::timeout(TIMEOUT, sentinel.async_master_for(service, Some(node)))
                    .await
                    .map_err(|_| timed_out("asking the sentinels"))?
            }
        }
    }
}

/// What goes over the channel: a change and who made it.
#[derive(Serialize, Deserialize)]
struct Envelope {
    from: String,
    change: Change,
}

fn timed_out(what: &str) -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what} timed out")))
}

impl RedisStore {
    /// Connects to `url` (`redis://[:password@]host:port/db`, `rediss://...`
    /// for TLS, `redis+unix:///path/to/socket`, or
    /// `redis+sentinel://host:port,host:port/service` for a Sentinel-managed
    /// primary) as instance `instance`.
    pub async fn open(url: &str, instance: &str) -> Result<RedisStore, StoreError> {
        // rediss:// uses rustls; its crypto provider is chosen once per process
        // (an error here only means another part of the process chose first).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let source = Source::parse(url)?;
        let store = RedisStore {
            source,
            conn: Slot::default(),
            publisher: Slot::default(),
            reader: Slot::default(),
            instance: instance.to_string(),
            new: false,
            runtime: std::sync::Arc::new(
                super::OwnRuntime::start("prefixgate-store")
                    .map_err(|e| StoreError::Backend(format!("cannot start the store's thread: {e}")))?,
            ),
        };
        let created: bool = store
            .run(|mut c| async move {
                redis::cmd("HSETNX").arg(key("meta")).arg("schema").arg(super::SCHEMA_VERSION).query_async(&mut c).await
            })
            .await?;
        let found: u64 = store.run(|mut c| async move { c.hget(key("meta"), "schema").await }).await?;
        if found > super::SCHEMA_VERSION {
            return Err(StoreError::TooNew { found, supported: super::SCHEMA_VERSION });
        }
        Ok(RedisStore { new: created, ..store })
    }

    async fn connect(&self) -> RedisResult<MultiplexedConnection> {
        let config =
            AsyncConnectionConfig::new().set_connection_timeout(Some(TIMEOUT)).set_response_timeout(Some(TIMEOUT));
        self.source.client().await?.get_multiplexed_async_connection_with_config(&config).await
    }

    /// Runs `f` on the write connection, making one if needed; a failed
    /// command drops the connection so the next call starts clean.
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        self.run_on(&self.conn, f).await
    }

    async fn run_on<T, F, Fut>(&self, slot: &Slot, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let conn = {
            let mut slot = slot.lock().await;
            match slot.as_ref() {
                Some(c) => c.clone(),
                None => slot.insert(self.connect().await?).clone(),
            }
        };
        // The response timeout is the connection's; this bounds a call the
        // connection does not time (a script that never answers, say) too.
        let result = tokio::time::timeout(TIMEOUT * 2, f(conn)).await.unwrap_or_else(|_| Err(timed_out("a command")));
        if result.is_err() {
            *slot.lock().await = None;
        }
        Ok(result?)
    }

    async fn announce(&self, change: Change) -> Result<(), StoreError> {
        let msg = self.envelope(change);
        self.run(|mut c| async move { c.publish::<_, _, ()>(key("changes"), msg).await }).await
    }

    fn envelope(&self, change: Change) -> String {
        serde_json::to_string(&Envelope { from: self.instance.clone(), change }).expect("serializable")
    }
}

/// Adds the writes of `changes` to the pins hash to `pipe`.
fn write_pins_in(pipe: &mut redis::Pipeline, changes: &[PinChange]) {
    for (k, pin) in changes {
        match pin {
            Some(p) => pipe.hset(key("pins"), k.to_be_bytes().to_vec(), encode_pin(p)).ignore(),
            None => pipe.hdel(key("pins"), k.to_be_bytes().to_vec()).ignore(),
        };
    }
}

fn pins_change(changes: &[PinChange]) -> Change {
    let pins = changes.iter().map(|(k, p)| (format!("{k:032x}"), p.clone())).collect();
    Change::Pins { pins, sent_us: super::now_us() }
}

/// One atomic script: forget expired leases, then take one if fewer than
/// `limit` are held. A lease is a sorted-set member scored by its expiry,
/// so an instance that dies without releasing gives its slots back when
/// its leases expire (it stops renewing them).
static TRY_LEASE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"local now = tonumber(ARGV[1])
          redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
          if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
            redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[4])
            return 1
          end
          return 0",
    )
});

/// One atomic script over the candidates' live sessions: per replica a
/// sorted set of session ids scored by expiry, and a hash of their
/// footprints. Expired ones go first; then, of the candidates with room
/// (when capacity is enforced), the one with the most room left in the
/// store's own count takes the session (every capacity known), then the
/// one with the fewest other sessions, then the first. The store's count,
/// not the asking instance's, decides: an instance's view of the others'
/// sessions lags by a flush, and two instances that each saw a different
/// replica as roomiest would otherwise both pick theirs. Returns its
/// index, or -1.
static PLACE_SESSION: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"local now, ttl, session = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
          local footprint, enforce = tonumber(ARGV[4]), ARGV[5] == '1'
          local known = true
          for i = 1, #KEYS / 2 do
            if tonumber(ARGV[5 + i]) < 0 then known = false end
          end
          local best, most, fewest = -1, nil, nil
          for i = 1, #KEYS / 2 do
            local until_key, tokens_key = KEYS[2 * i - 1], KEYS[2 * i]
            for _, s in ipairs(redis.call('ZRANGEBYSCORE', until_key, '-inf', now)) do
              redis.call('HDEL', tokens_key, s)
            end
            redis.call('ZREMRANGEBYSCORE', until_key, '-inf', now)
            local sum, count = 0, 0
            local all = redis.call('HGETALL', tokens_key)
            for j = 1, #all, 2 do
              if all[j] ~= session then
                sum = sum + tonumber(all[j + 1])
                count = count + 1
              end
            end
            local capacity = tonumber(ARGV[5 + i])
            local fits = (not enforce) or capacity < 0 or sum + footprint <= capacity
            local left = 0
            if known then left = capacity - sum end
            if fits and (best < 0 or left > most or (left == most and count < fewest)) then
              best, most, fewest = i, left, count
            end
          end
          if best < 0 then return -1 end
          redis.call('ZADD', KEYS[2 * best - 1], now + ttl, session)
          redis.call('HSET', KEYS[2 * best], session, footprint)
          return best - 1",
    )
});

/// Every replica's live sessions' footprints, summed (expired ones left out).
static SESSION_LOADS: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        r"local now = tonumber(ARGV[1])
          local sums = {}
          for i = 1, #KEYS, 2 do
            local sum = 0
            for _, s in ipairs(redis.call('ZRANGEBYSCORE', KEYS[i], '(' .. now, '+inf')) do
              sum = sum + (tonumber(redis.call('HGET', KEYS[i + 1], s)) or 0)
            end
            table.insert(sums, sum)
          end
          return sums",
    )
});

#[async_trait::async_trait]
impl Store for RedisStore {
    fn is_new(&self) -> bool {
        self.new
    }

    async fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError> {
        let mut all: Vec<(String, String)> = self.run(|mut c| async move { c.hgetall(key("replicas")).await }).await?;
        // A hash has no order; every instance lists the fleet the same way.
        all.sort();
        all.iter().map(|(_, v)| serde_json::from_str(v).map_err(|e| corrupt("replicas")(e.to_string()))).collect()
    }

    async fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError> {
        let v = serde_json::to_string(r).map_err(|e| StoreError::Backend(e.to_string()))?;
        let id = r.spec.id.clone();
        self.run(|mut c| async move { c.hset::<_, _, _, ()>(key("replicas"), id, v).await }).await?;
        self.announce(Change::Replica { id: r.spec.id.clone() }).await
    }

    async fn restore_replicas(&self, all: &[StoredReplica]) -> Result<(), StoreError> {
        let fields = all
            .iter()
            .map(|r| Ok((r.spec.id.clone(), serde_json::to_string(r).map_err(|e| StoreError::Backend(e.to_string()))?)))
            .collect::<Result<Vec<(String, String)>, StoreError>>()?;
        if fields.is_empty() {
            return Ok(());
        }
        // One HSET of every field: atomic, so a re-read sees all or none.
        self.run(|mut c| async move { c.hset_multiple::<_, _, _, ()>(key("replicas"), &fields).await }).await?;
        for r in all {
            self.announce(Change::Replica { id: r.spec.id.clone() }).await?;
        }
        Ok(())
    }

    async fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        let owned = id.to_string();
        self.run(|mut c| async move { c.hdel::<_, _, ()>(key("replicas"), owned).await }).await?;
        self.announce(Change::Replica { id: id.to_string() }).await
    }

    async fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError> {
        let all: Vec<(Vec<u8>, Vec<u8>)> = self.run(|mut c| async move { c.hgetall(key("pins")).await }).await?;
        let mut names = super::ReplicaNames::default();
        all.iter()
            .map(|(k, v)| {
                let k: [u8; 16] = k.as_slice().try_into().map_err(|_| corrupt("pins")("key is not 16 bytes".into()))?;
                Ok((u128::from_be_bytes(k), super::decode_pin_named(v, &mut names).map_err(corrupt("pins"))?))
            })
            .collect()
    }

    /// One transaction per batch, then one announcement of the whole batch.
    async fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        write_pins_in(&mut pipe, changes);
        self.run(|mut c| async move { pipe.query_async::<()>(&mut c).await }).await?;
        // Announced again after persisting: an instance that missed the
        // first announcement (a full queue, a reconnect) catches up here.
        self.announce(pins_change(changes)).await
    }

    /// One pipeline, written before it is announced: a turn that reaches
    /// another instance before the message does finds the pin by reading
    /// (`pins_at`). Why both: the next turn of an agent can come within a
    /// millisecond of the answer, faster than a loaded instance applies
    /// what it hears.
    async fn publish_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        write_pins_in(&mut pipe, changes);
        pipe.publish(key("changes"), self.envelope(pins_change(changes))).ignore();
        self.run_on(&self.publisher, |mut c| async move { pipe.query_async::<()>(&mut c).await }).await
    }

    async fn pins_at(&self, keys: &[PrefixKey]) -> Result<Vec<Option<Pin>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let fields: Vec<Vec<u8>> = keys.iter().map(|k| k.to_be_bytes().to_vec()).collect();
        // HMGET, even for one key: always an array back.
        let values: Vec<Option<Vec<u8>>> = self
            .run_on(&self.reader, |mut c| async move {
                redis::cmd("HMGET").arg(key("pins")).arg(fields).query_async(&mut c).await
            })
            .await?;
        values.into_iter().map(|v| v.map(|v| decode_pin(&v).map_err(corrupt("pins"))).transpose()).collect()
    }

    async fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError> {
        let v = serde_json::to_string(e).map_err(|e| StoreError::Backend(e.to_string()))?;
        let mut pipe = redis::pipe();
        pipe.zadd(key("events"), v, e.id).ignore();
        if let Some(upto) = dropped_up_to {
            pipe.zrembyscore(key("events"), "-inf", upto).ignore();
        }
        self.run(|mut c| async move { pipe.query_async::<()>(&mut c).await }).await?;
        self.announce(Change::Event { event: e.clone() }).await
    }

    /// One pipeline for the batch: the writes, the trim, and each event's
    /// announcement (the other instances add them to their history).
    async fn append_events(&self, batch: &[crate::events::Pending]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for crate::events::Pending { event: e, .. } in batch {
            let v = serde_json::to_string(e).map_err(|e| StoreError::Backend(e.to_string()))?;
            pipe.zadd(key("events"), v, e.id).ignore();
        }
        if let Some(upto) = batch.iter().filter_map(|p| p.dropped_upto).max() {
            pipe.zrembyscore(key("events"), "-inf", upto).ignore();
        }
        for crate::events::Pending { event: e, .. } in batch {
            pipe.publish(key("changes"), self.envelope(Change::Event { event: e.clone() })).ignore();
        }
        self.run(|mut c| async move { pipe.query_async::<()>(&mut c).await }).await
    }

    async fn events(&self) -> Result<Vec<Event>, StoreError> {
        let all: Vec<String> = self.run(|mut c| async move { c.zrange(key("events"), 0, -1).await }).await?;
        all.iter().map(|v| serde_json::from_str(v).map_err(|e| corrupt("events")(e.to_string()))).collect()
    }

    async fn setting(&self, name: &str) -> Result<Option<serde_json::Value>, StoreError> {
        let name = name.to_string();
        let v: Option<String> = self.run(|mut c| async move { c.hget(key("settings"), name).await }).await?;
        v.map(|v| serde_json::from_str(&v).map_err(|e| corrupt("settings")(e.to_string()))).transpose()
    }

    async fn put_setting(&self, name: &str, value: &serde_json::Value) -> Result<(), StoreError> {
        let (owned, v) = (name.to_string(), value.to_string());
        self.run(|mut c| async move { c.hset::<_, _, _, ()>(key("settings"), owned, v).await }).await?;
        self.announce(Change::Setting { name: name.to_string() }).await
    }

    async fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        // The settings hash holds a handful of names: read it whole.
        let all: Vec<(String, String)> = self.run(|mut c| async move { c.hgetall(key("settings")).await }).await?;
        all.into_iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(name, v)| Ok((name, serde_json::from_str(&v).map_err(|e| corrupt("settings")(e.to_string()))?)))
            .collect()
    }

    /// Redis persists on its own terms (RDB/AOF, configured on the server).
    async fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn instance(&self) -> Option<&str> {
        Some(&self.instance)
    }

    fn runtime(&self) -> Option<&tokio::runtime::Handle> {
        Some(self.runtime.handle())
    }

    async fn heartbeat(&self, beat: &InstanceBeat) -> Result<(), StoreError> {
        let v = serde_json::to_string(beat).expect("serializable");
        let name = beat.instance.clone();
        self.run(|mut c| async move { c.hset::<_, _, _, ()>(key("instances"), name, v).await }).await
    }

    async fn instances(&self) -> Result<Vec<InstanceBeat>, StoreError> {
        let all: Vec<(String, String)> = self.run(|mut c| async move { c.hgetall(key("instances")).await }).await?;
        Ok(all.iter().filter_map(|(_, v)| serde_json::from_str(v).ok()).collect())
    }

    async fn announce_handoff(&self, replica: &str) -> Result<(), StoreError> {
        self.announce(Change::HandOff { replica: replica.to_string() }).await
    }

    async fn try_lease(&self, replica: &str, lease: &str, limit: u32, ttl_ms: u64) -> Result<bool, StoreError> {
        let now = crate::clock::now_ms();
        let (leases, lease) = (key(&format!("leases:{replica}")), lease.to_string());
        let took: i64 = self
            .run(|mut c| async move {
                TRY_LEASE.key(leases).arg(now).arg(limit).arg(ttl_ms).arg(lease).invoke_async(&mut c).await
            })
            .await?;
        Ok(took == 1)
    }

    async fn place_session(
        &self,
        candidates: &[(String, Option<u64>)],
        session: &str,
        footprint: u64,
        ttl_ms: u64,
        enforce_capacity: bool,
    ) -> Result<Option<usize>, StoreError> {
        if candidates.is_empty() {
            return Ok(None);
        }
        let now = crate::clock::now_ms();
        let session = session.to_string();
        let candidates = candidates.to_vec();
        let placed: i64 = self
            .run(|mut c| async move {
                let mut invocation = PLACE_SESSION.prepare_invoke();
                for (replica, _) in &candidates {
                    invocation.key(key(&format!("session_until:{replica}")));
                    invocation.key(key(&format!("session_tokens:{replica}")));
                }
                invocation.arg(now).arg(ttl_ms).arg(session).arg(footprint).arg(u8::from(enforce_capacity));
                for (_, capacity) in &candidates {
                    invocation.arg(capacity.map_or(-1, |c| c as i64));
                }
                invocation.invoke_async(&mut c).await
            })
            .await?;
        Ok(usize::try_from(placed).ok())
    }

    async fn session_loads(&self, replicas: &[String]) -> Result<Vec<u64>, StoreError> {
        if replicas.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<(String, String)> = replicas
            .iter()
            .map(|r| (key(&format!("session_until:{r}")), key(&format!("session_tokens:{r}"))))
            .collect();
        let now = crate::clock::now_ms();
        self.run(|mut c| async move {
            let mut invocation = SESSION_LOADS.prepare_invoke();
            for (until, tokens) in keys {
                invocation.key(until).key(tokens);
            }
            invocation.arg(now);
            invocation.invoke_async(&mut c).await
        })
        .await
    }

    async fn keep_sessions(&self, sessions: &[KeptSession]) -> Result<(), StoreError> {
        if sessions.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for s in sessions {
            pipe.zadd(key(&format!("session_until:{}", s.replica)), &s.session, s.until_ms).ignore();
            pipe.hset(key(&format!("session_tokens:{}", s.replica)), &s.session, s.footprint).ignore();
        }
        self.run(|mut c| async move { pipe.query_async::<()>(&mut c).await }).await
    }

    /// One pipeline: the entries leave, and one announcement says so.
    async fn release_sessions(&self, sessions: &[(String, String)]) -> Result<(), StoreError> {
        if sessions.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (replica, session) in sessions {
            pipe.zrem(key(&format!("session_until:{replica}")), session).ignore();
            pipe.hdel(key(&format!("session_tokens:{replica}")), session).ignore();
        }
        let change = Change::SessionsReleased { sessions: sessions.to_vec(), sent_us: super::now_us() };
        pipe.publish(key("changes"), self.envelope(change)).ignore();
        self.run_on(&self.publisher, |mut c| async move { pipe.query_async::<()>(&mut c).await }).await
    }

    async fn release_lease(&self, replica: &str, lease: &str) -> Result<(), StoreError> {
        let (leases, lease) = (key(&format!("leases:{replica}")), lease.to_string());
        self.run(|mut c| async move { c.zrem::<_, _, ()>(leases, lease).await }).await
    }

    async fn renew_leases(&self, leases: &[(String, String)], ttl_ms: u64) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        let until = crate::clock::now_ms() + ttl_ms;
        let mut pipe = redis::pipe();
        for (replica, lease) in leases {
            // XX: renew only what is still ours (an expired lease stays gone).
            pipe.cmd("ZADD").arg(key(&format!("leases:{replica}"))).arg("XX").arg(until).arg(lease).ignore();
        }
        self.run(|mut c| async move { pipe.query_async::<()>(&mut c).await }).await
    }

    /// Listens on the changes channel in a task of its own (reconnecting
    /// after errors, with a short pause) and hands other instances' changes
    /// to the receiver until it is dropped.
    fn subscribe(&self) -> Option<mpsc::Receiver<Change>> {
        let (tx, rx) = mpsc::channel(1024);
        let (source, me) = (self.source.clone(), self.instance.clone());
        self.runtime.handle().spawn(async move {
            loop {
                match listen(&source, &me, &tx).await {
                    Ok(()) => return,
                    Err(e) => {
                        if tx.send(Change::Lost).await.is_err() {
                            return;
                        }
                        tracing::debug!("store change listener: {e}; reconnecting");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        });
        Some(rx)
    }
}

/// One subscription, until the connection fails (an error) or nobody
/// listens any more (`Ok`).
async fn listen(source: &Source, me: &str, tx: &mpsc::Sender<Change>) -> RedisResult<()> {
    let client = source.client().await?;
    let mut pubsub =
        tokio::time::timeout(TIMEOUT, client.get_async_pubsub()).await.map_err(|_| timed_out("subscribing"))??;
    tokio::time::timeout(TIMEOUT, pubsub.subscribe(key("changes"))).await.map_err(|_| timed_out("subscribing"))??;
    // Subscribed: a re-read the follower owes (at start, after a lost
    // connection) happens now, not at the first message, which it would delay.
    if tx.send(Change::Tick).await.is_err() {
        return Ok(());
    }
    let mut messages = pubsub.on_message();
    loop {
        // Idle now and then: a tick lets the follower notice it owes a re-read.
        let msg = match tokio::time::timeout(Duration::from_millis(500), messages.next()).await {
            Err(_) => {
                if tx.send(Change::Tick).await.is_err() {
                    return Ok(());
                }
                continue;
            }
            Ok(None) => return Err(timed_out("the subscription (connection closed)")),
            Ok(Some(m)) => m,
        };
        let payload: String = msg.get_payload()?;
        match serde_json::from_str::<Envelope>(&payload) {
            Ok(env) if env.from == me => {}
            Ok(env) => {
                if tx.send(env.change).await.is_err() {
                    return Ok(());
                }
            }
            Err(e) => tracing::warn!("ignoring a malformed change notice: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentinel_urls_name_their_nodes_service_password_and_database() {
        match Source::parse("redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2:26379/mymaster/2").unwrap() {
            Source::Sentinel { nodes, service, node } => {
                assert_eq!(nodes, ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"]);
                assert_eq!(service, "mymaster");
                let debug = format!("{node:?}");
                assert!(debug.contains("db: 2"), "{debug}");
            }
            Source::Direct(_) => panic!("a sentinel URL"),
        }
        assert!(Source::parse("redis+sentinel://10.0.0.1:26379").is_err(), "no service");
        assert!(Source::parse("redis+sentinel://10.0.0.1:26379/m/x").is_err(), "bad db");
        assert!(matches!(Source::parse("redis://127.0.0.1:6379/0").unwrap(), Source::Direct(_)));
    }
}
