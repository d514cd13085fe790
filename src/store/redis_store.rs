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
//! (hash: name -> JSON), `{prefix}:instances` (hash: name -> JSON beat).
//!
//! Every command runs with a read/write timeout (`TIMEOUT`) on a connection
//! that is re-made after any error: a slow or dead Redis fails the flusher's
//! batch (which is retried) and never a client request, which does not
//! touch this store at all.

use std::sync::Mutex;
use std::time::Duration;

use redis::{Commands, Connection};
use serde::{Deserialize, Serialize};

use super::{corrupt, decode_pin, encode_pin, Change, InstanceBeat, Store, StoreError, StoredReplica};
use crate::events::Event;
use crate::pins::{Pin, PinChange};
use crate::policy::PrefixKey;

/// Longest a single Redis command may take before it counts as a failure.
const TIMEOUT: Duration = Duration::from_millis(500);

/// Key namespace in the Redis database.
const PREFIX: &str = "prefixgate";

pub struct RedisStore {
    source: Source,
    /// Writes (operator actions, the flusher's batches, heartbeats).
    conn: Mutex<Option<Connection>>,
    /// Announcements of new pins, on a connection of their own so they never
    /// queue behind a flusher's batch.
    publisher: Mutex<Option<Connection>>,
    /// Read-through lookups from the request path, for the same reason.
    reader: Mutex<Option<Connection>>,
    instance: String,
    new: bool,
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

    fn client(&self) -> redis::RedisResult<redis::Client> {
        match self {
            Source::Direct(c) => Ok(c.clone()),
            Source::Sentinel { nodes, service, node } => {
                redis::sentinel::Sentinel::build(nodes.clone())?.master_for(service, Some(node))
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

impl RedisStore {
    /// Connects to `url` (`redis://[:password@]host:port/db`, `rediss://...`
    /// for TLS, `redis+unix:///path/to/socket`, or
    /// `redis+sentinel://host:port,host:port/service` for a Sentinel-managed
    /// primary) as instance `instance`.
    pub fn open(url: &str, instance: &str) -> Result<RedisStore, StoreError> {
        // rediss:// uses rustls; its crypto provider is chosen once per process
        // (an error here only means another part of the process chose first).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let source = Source::parse(url)?;
        let store = RedisStore {
            source,
            conn: Mutex::new(None),
            publisher: Mutex::new(None),
            reader: Mutex::new(None),
            instance: instance.to_string(),
            new: false,
        };
        let created: bool =
            store.run(|c| redis::cmd("HSETNX").arg(key("meta")).arg("schema").arg(super::SCHEMA_VERSION).query(c))?;
        let found: u64 = store.run(|c| c.hget(key("meta"), "schema"))?;
        if found > super::SCHEMA_VERSION {
            return Err(StoreError::TooNew { found, supported: super::SCHEMA_VERSION });
        }
        Ok(RedisStore { new: created, ..store })
    }

    fn connect(&self) -> Result<Connection, StoreError> {
        let c = self.source.client()?.get_connection_with_timeout(TIMEOUT)?;
        c.set_read_timeout(Some(TIMEOUT))?;
        c.set_write_timeout(Some(TIMEOUT))?;
        Ok(c)
    }

    /// Runs `f` on the connection, making one if needed; a failed command
    /// drops the connection so the next call starts clean.
    fn run<T>(&self, f: impl FnOnce(&mut Connection) -> redis::RedisResult<T>) -> Result<T, StoreError> {
        self.run_on(&self.conn, f)
    }

    fn run_on<T>(
        &self,
        conn: &Mutex<Option<Connection>>,
        f: impl FnOnce(&mut Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let mut slot = conn.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(self.connect()?);
        }
        let result = f(slot.as_mut().expect("connected"));
        if result.is_err() {
            *slot = None;
        }
        Ok(result?)
    }

    fn announce(&self, change: Change) -> Result<(), StoreError> {
        self.announce_on(&self.conn, change)
    }

    fn announce_on(&self, conn: &Mutex<Option<Connection>>, change: Change) -> Result<(), StoreError> {
        let msg = serde_json::to_string(&Envelope { from: self.instance.clone(), change }).expect("serializable");
        self.run_on(conn, |c| c.publish::<_, _, ()>(key("changes"), msg))
    }
}

fn pins_change(changes: &[PinChange]) -> Change {
    let pins = changes.iter().map(|(k, p)| (format!("{k:032x}"), p.clone())).collect();
    Change::Pins { pins, sent_us: super::now_us() }
}

impl Store for RedisStore {
    fn is_new(&self) -> bool {
        self.new
    }

    fn replicas(&self) -> Result<Vec<StoredReplica>, StoreError> {
        let mut all: Vec<(String, String)> = self.run(|c| c.hgetall(key("replicas")))?;
        // A hash has no order; every instance lists the fleet the same way.
        all.sort();
        all.iter().map(|(_, v)| serde_json::from_str(v).map_err(|e| corrupt("replicas")(e.to_string()))).collect()
    }

    fn put_replica(&self, r: &StoredReplica) -> Result<(), StoreError> {
        let v = serde_json::to_string(r).map_err(|e| StoreError::Backend(e.to_string()))?;
        self.run(|c| c.hset::<_, _, _, ()>(key("replicas"), &r.spec.id, v))?;
        self.announce(Change::Replica { id: r.spec.id.clone() })
    }

    fn delete_replica(&self, id: &str) -> Result<(), StoreError> {
        self.run(|c| c.hdel::<_, _, ()>(key("replicas"), id))?;
        self.announce(Change::Replica { id: id.to_string() })
    }

    fn pins(&self) -> Result<Vec<(PrefixKey, Pin)>, StoreError> {
        let all: Vec<(Vec<u8>, Vec<u8>)> = self.run(|c| c.hgetall(key("pins")))?;
        all.iter()
            .map(|(k, v)| {
                let k: [u8; 16] = k.as_slice().try_into().map_err(|_| corrupt("pins")("key is not 16 bytes".into()))?;
                Ok((u128::from_be_bytes(k), decode_pin(v).map_err(corrupt("pins"))?))
            })
            .collect()
    }

    /// One transaction per batch, then one announcement of the whole batch.
    fn write_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        pipe.atomic();
        for (k, pin) in changes {
            match pin {
                Some(p) => pipe.hset(key("pins"), k.to_be_bytes().to_vec(), encode_pin(p)).ignore(),
                None => pipe.hdel(key("pins"), k.to_be_bytes().to_vec()).ignore(),
            };
        }
        self.run(|c| pipe.query::<()>(c))?;
        // Announced again after persisting: an instance that missed the
        // first announcement (a full queue, a reconnect) catches up here.
        self.announce(pins_change(changes))
    }

    fn publish_pins(&self, changes: &[PinChange]) -> Result<(), StoreError> {
        self.announce_on(&self.publisher, pins_change(changes))
    }

    fn pin(&self, k: PrefixKey) -> Result<Option<Pin>, StoreError> {
        let v: Option<Vec<u8>> = self.run_on(&self.reader, |c| c.hget(key("pins"), k.to_be_bytes().to_vec()))?;
        v.map(|v| decode_pin(&v).map_err(corrupt("pins"))).transpose()
    }

    fn append_event(&self, e: &Event, dropped_up_to: Option<u64>) -> Result<(), StoreError> {
        let v = serde_json::to_string(e).map_err(|e| StoreError::Backend(e.to_string()))?;
        let mut pipe = redis::pipe();
        pipe.zadd(key("events"), v, e.id).ignore();
        if let Some(upto) = dropped_up_to {
            pipe.zrembyscore(key("events"), "-inf", upto).ignore();
        }
        self.run(|c| pipe.query::<()>(c))?;
        self.announce(Change::Event { event: e.clone() })
    }

    /// One pipeline for the batch: the writes, the trim, and each event's
    /// announcement (the other instances add them to their history).
    fn append_events(&self, batch: &[crate::events::Pending]) -> Result<(), StoreError> {
        let mut pipe = redis::pipe();
        for (e, _) in batch {
            let v = serde_json::to_string(e).map_err(|e| StoreError::Backend(e.to_string()))?;
            pipe.zadd(key("events"), v, e.id).ignore();
        }
        if let Some(upto) = batch.iter().filter_map(|(_, d)| *d).max() {
            pipe.zrembyscore(key("events"), "-inf", upto).ignore();
        }
        for (e, _) in batch {
            let msg = serde_json::to_string(&Envelope {
                from: self.instance.clone(),
                change: Change::Event { event: e.clone() },
            })
            .expect("serializable");
            pipe.publish(key("changes"), msg).ignore();
        }
        self.run(|c| pipe.query::<()>(c))
    }

    fn events(&self) -> Result<Vec<Event>, StoreError> {
        let all: Vec<String> = self.run(|c| c.zrange(key("events"), 0, -1))?;
        all.iter().map(|v| serde_json::from_str(v).map_err(|e| corrupt("events")(e.to_string()))).collect()
    }

    fn setting(&self, name: &str) -> Result<Option<serde_json::Value>, StoreError> {
        let v: Option<String> = self.run(|c| c.hget(key("settings"), name))?;
        v.map(|v| serde_json::from_str(&v).map_err(|e| corrupt("settings")(e.to_string()))).transpose()
    }

    fn put_setting(&self, name: &str, value: &serde_json::Value) -> Result<(), StoreError> {
        self.run(|c| c.hset::<_, _, _, ()>(key("settings"), name, value.to_string()))?;
        self.announce(Change::Setting { name: name.to_string() })
    }

    fn settings(&self, prefix: &str) -> Result<Vec<(String, serde_json::Value)>, StoreError> {
        // The settings hash holds a handful of names: read it whole.
        let all: Vec<(String, String)> = self.run(|c| c.hgetall(key("settings")))?;
        all.into_iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(name, v)| Ok((name, serde_json::from_str(&v).map_err(|e| corrupt("settings")(e.to_string()))?)))
            .collect()
    }

    /// Redis persists on its own terms (RDB/AOF, configured on the server).
    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn instance(&self) -> Option<&str> {
        Some(&self.instance)
    }

    fn heartbeat(&self, beat: &InstanceBeat) -> Result<(), StoreError> {
        let v = serde_json::to_string(beat).expect("serializable");
        self.run(|c| c.hset::<_, _, _, ()>(key("instances"), &beat.instance, v))
    }

    fn instances(&self) -> Result<Vec<InstanceBeat>, StoreError> {
        let all: Vec<(String, String)> = self.run(|c| c.hgetall(key("instances")))?;
        Ok(all.iter().filter_map(|(_, v)| serde_json::from_str(v).ok()).collect())
    }

    /// One atomic script: forget expired leases, then take one if fewer than
    /// `limit` are held. A lease is a sorted-set member scored by its expiry,
    /// so an instance that dies without releasing gives its slots back when
    /// its leases expire (it stops renewing them).
    fn try_lease(&self, replica: &str, lease: &str, limit: u32, ttl_ms: u64) -> Result<bool, StoreError> {
        let script = redis::Script::new(
            r"local now = tonumber(ARGV[1])
              redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
              if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
                redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[4])
                return 1
              end
              return 0",
        );
        let now = crate::clock::now_ms();
        let took: i64 = self.run(|c| {
            script.key(key(&format!("leases:{replica}"))).arg(now).arg(limit).arg(ttl_ms).arg(lease).invoke(c)
        })?;
        Ok(took == 1)
    }

    /// One atomic script over a replica's live sessions: a sorted set of
    /// session ids scored by expiry, and a hash of their footprints. Expired
    /// ones go first; then the others' footprints are summed, and the
    /// session is admitted only if it fits within `capacity`.
    fn admit_session(
        &self,
        replica: &str,
        session: &str,
        footprint: u64,
        capacity: u64,
        ttl_ms: u64,
    ) -> Result<bool, StoreError> {
        let script = redis::Script::new(
            r"local now = tonumber(ARGV[1])
              for _, s in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
                redis.call('HDEL', KEYS[2], s)
              end
              redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
              local sum = 0
              local all = redis.call('HGETALL', KEYS[2])
              for i = 1, #all, 2 do
                if all[i] ~= ARGV[4] then sum = sum + tonumber(all[i + 1]) end
              end
              if sum + tonumber(ARGV[5]) <= tonumber(ARGV[2]) then
                redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[4])
                redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
                return 1
              end
              return 0",
        );
        let now = crate::clock::now_ms();
        let (until, tokens) = (key(&format!("session_until:{replica}")), key(&format!("session_tokens:{replica}")));
        let took: i64 = self.run(|c| {
            script.key(&until).key(&tokens).arg(now).arg(capacity).arg(ttl_ms).arg(session).arg(footprint).invoke(c)
        })?;
        Ok(took == 1)
    }

    fn session_loads(&self, replicas: &[String]) -> Result<Vec<u64>, StoreError> {
        let script = redis::Script::new(
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
        );
        if replicas.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = script.prepare_invoke();
        for r in replicas {
            invocation.key(key(&format!("session_until:{r}"))).key(key(&format!("session_tokens:{r}")));
        }
        invocation.arg(crate::clock::now_ms());
        self.run(|c| invocation.invoke(c))
    }

    fn keep_sessions(&self, sessions: &[(String, String, u64)], ttl_ms: u64) -> Result<(), StoreError> {
        if sessions.is_empty() {
            return Ok(());
        }
        let until = crate::clock::now_ms() + ttl_ms;
        let mut pipe = redis::pipe();
        for (replica, session, footprint) in sessions {
            pipe.zadd(key(&format!("session_until:{replica}")), session, until).ignore();
            pipe.hset(key(&format!("session_tokens:{replica}")), session, footprint).ignore();
        }
        self.run(|c| pipe.query::<()>(c))
    }

    fn release_lease(&self, replica: &str, lease: &str) -> Result<(), StoreError> {
        self.run(|c| c.zrem::<_, _, ()>(key(&format!("leases:{replica}")), lease))
    }

    fn renew_leases(&self, leases: &[(String, String)], ttl_ms: u64) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        let until = crate::clock::now_ms() + ttl_ms;
        let mut pipe = redis::pipe();
        for (replica, lease) in leases {
            // XX: renew only what is still ours (an expired lease stays gone).
            pipe.cmd("ZADD").arg(key(&format!("leases:{replica}"))).arg("XX").arg(until).arg(lease).ignore();
        }
        self.run(|c| pipe.query::<()>(c))
    }

    /// Listens on the changes channel on a thread of its own (reconnecting
    /// after errors, with a short pause) and hands other instances' changes
    /// to `on_change` until it returns false.
    fn subscribe(&self, on_change: Box<dyn Fn(Change) -> bool + Send>) -> Result<(), StoreError> {
        let source = self.source.clone();
        let me = self.instance.clone();
        std::thread::Builder::new()
            .name("prefixgate-store-changes".into())
            .spawn(move || loop {
                let listened = (|| -> redis::RedisResult<bool> {
                    let mut conn = source.client()?.get_connection_with_timeout(TIMEOUT)?;
                    let mut pubsub = conn.as_pubsub();
                    pubsub.subscribe(key("changes"))?;
                    // Subscribed: a re-read the follower owes (at start, after a
                    // lost connection) happens now, not at the first message,
                    // which it would delay.
                    if !on_change(Change::Tick) {
                        return Ok(false);
                    }
                    // Wake up now and then to notice that nobody listens any more.
                    pubsub.set_read_timeout(Some(Duration::from_millis(500)))?;
                    loop {
                        let msg = match pubsub.get_message() {
                            Ok(m) => m,
                            Err(e) if e.is_timeout() => {
                                if !on_change(Change::Tick) {
                                    return Ok(false);
                                }
                                continue;
                            }
                            Err(e) => return Err(e),
                        };
                        let payload: String = msg.get_payload()?;
                        match serde_json::from_str::<Envelope>(&payload) {
                            Ok(env) if env.from == me => {}
                            Ok(env) => {
                                if !on_change(env.change) {
                                    return Ok(false);
                                }
                            }
                            Err(e) => tracing::warn!("ignoring a malformed change notice: {e}"),
                        }
                    }
                })();
                match listened {
                    Ok(false) => return,
                    Ok(true) => {}
                    Err(e) => {
                        if !on_change(Change::Lost) {
                            return;
                        }
                        tracing::debug!("store change listener: {e}; reconnecting");
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            })
            .map_err(|e| StoreError::Backend(format!("cannot start the change listener: {e}")))?;
        Ok(())
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
