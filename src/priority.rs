//! Who waits at the wall: a request's priority class and client, and the
//! queue every waiting place in the gateway uses (`FairQueue`).
//!
//! - **Class.** `interactive` (a person at a terminal), `default`,
//!   `background` (subagents, evaluation runs, batch work). Said by the
//!   header `x-prefixgate-priority`, else the SGLang gateway's
//!   `X-SMG-Priority` (`system` and `interactive` are interactive, `default`
//!   default, `bulk` background), else the class `[priority.clients]` sets
//!   for the request's client, else `default`. An unknown value is the
//!   client's error (400 naming the header), not a silent default.
//! - **Client.** The API key the client sent, as a hash (`key-` and the
//!   first 12 hex digits of its SHA-256: never the key), or the
//!   `x-prefixgate-client` header where `priority.client_header` allows
//!   it; otherwise `anonymous`.
//! - **Order.** Higher classes first, always. Within a class, clients take
//!   turns: a client's waiters get consecutive virtual times starting no
//!   earlier than the class's last served one, so a client that queued 50
//!   at once is not ahead of another client's single waiter by more than
//!   one (start-time fair queuing over clients); oldest first within a
//!   client. A lower class waits past `sessions.max_wait_ms` only as today:
//!   admitted over capacity, with its event.
//!
//! Pure: no I/O, no clock.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A request's priority class; ordered: `Background < Default < Interactive`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    Background,
    #[default]
    Default,
    Interactive,
}

impl Class {
    pub const ALL: [Class; 3] = [Class::Interactive, Class::Default, Class::Background];

    pub fn as_str(self) -> &'static str {
        match self {
            Class::Interactive => "interactive",
            Class::Default => "default",
            Class::Background => "background",
        }
    }
}

/// The header a client states its class with.
pub const PRIORITY_HEADER: &str = "x-prefixgate-priority";
/// The SGLang Model Gateway's priority header, understood too.
pub const SMG_HEADER: &str = "x-smg-priority";
/// The header naming a client, honoured with `priority.client_header`.
pub const CLIENT_HEADER: &str = "x-prefixgate-client";

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PriorityConfig {
    /// A waiting session of a higher class pauses the next turn of a
    /// lower-class session between turns and takes its room, instead of
    /// waiting for it to idle out. The paused session goes when room opens
    /// again, or after `sessions.max_wait_ms`.
    pub preempt: bool,
    /// Honour the `x-prefixgate-client` header as the client's identity
    /// (for gateways whose clients share one API key). Off: a client is its
    /// API key's hash, or `anonymous`.
    pub client_header: bool,
    /// A class per client id (`key-<12 hex digits of the key's SHA-256>`,
    /// or an `x-prefixgate-client` value), used when a request states none.
    #[schema(value_type = std::collections::BTreeMap<String, Class>)]
    pub clients: std::collections::BTreeMap<String, Class>,
}

impl Default for PriorityConfig {
    fn default() -> Self {
        PriorityConfig { preempt: true, client_header: false, clients: Default::default() }
    }
}

/// Who a request is, for the queues: its class, whether the request said
/// it (a session's later turn changes its class only then), and its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub class: Class,
    pub stated: bool,
    pub client: Arc<str>,
}

/// The client of a request that names none: one shared name, not an
/// allocation per request.
fn anonymous() -> Arc<str> {
    static ANONYMOUS: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| Arc::from("anonymous"));
    ANONYMOUS.clone()
}

impl Default for Who {
    fn default() -> Self {
        Who { class: Class::Default, stated: false, client: anonymous() }
    }
}

/// A header value that names no class: the message names the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownClass(pub String);

/// Resolves a request's class and client from its headers (`header(name)`:
/// the value of a header, lowercase name) and the config.
pub fn resolve<'a>(
    config: &PriorityConfig,
    ids: &crate::client_ids::ClientIds,
    header: impl Fn(&str) -> Option<&'a str>,
) -> Result<Who, UnknownClass> {
    let client = client_id(config, ids, &header);
    let own = header(PRIORITY_HEADER).map(|v| own_class(v.trim()).ok_or(PRIORITY_HEADER));
    let smg = || header(SMG_HEADER).map(|v| smg_class(v.trim()).ok_or(SMG_HEADER));
    let stated = match own.or_else(smg) {
        Some(Ok(class)) => Some(class),
        Some(Err(name)) => {
            let value = header(name).unwrap_or_default();
            let allowed = if name == PRIORITY_HEADER {
                "interactive, default, background"
            } else {
                "system, interactive, default, bulk"
            };
            return Err(UnknownClass(format!("header {name}: unknown priority class '{value}' (one of: {allowed})")));
        }
        None => None,
    };
    let class = stated.or_else(|| config.clients.get(&*client).copied()).unwrap_or_default();
    Ok(Who { class, stated: stated.is_some(), client })
}

fn own_class(v: &str) -> Option<Class> {
    Class::ALL.into_iter().find(|c| c.as_str().eq_ignore_ascii_case(v))
}

fn smg_class(v: &str) -> Option<Class> {
    match v.to_ascii_lowercase().as_str() {
        "system" | "interactive" => Some(Class::Interactive),
        "default" => Some(Class::Default),
        "bulk" => Some(Class::Background),
        _ => None,
    }
}

/// The client: `x-prefixgate-client` where allowed, else the API key's
/// hash (`Authorization: Bearer`, or Anthropic's `x-api-key`), else
/// `anonymous`.
fn client_id<'a>(
    config: &PriorityConfig,
    ids: &crate::client_ids::ClientIds,
    header: &impl Fn(&str) -> Option<&'a str>,
) -> Arc<str> {
    if config.client_header {
        if let Some(name) = header(CLIENT_HEADER).map(str::trim).filter(|n| !n.is_empty() && n.len() <= 128) {
            return Arc::from(name);
        }
    }
    match header("authorization")
        .and_then(bearer)
        .or_else(|| header("x-api-key"))
        .map(str::trim)
        .filter(|k| !k.is_empty())
    {
        Some(key) => ids.of_key(key),
        None => anonymous(),
    }
}

/// The token of an `Authorization: Bearer TOKEN` value (the scheme's case
/// as clients send it), trimmed: the one reading of it, for client keys
/// here and the admin token (`access.rs`).
pub fn bearer(value: &str) -> Option<&str> {
    value.strip_prefix("Bearer ").or_else(|| value.strip_prefix("bearer ")).map(str::trim)
}

/// One waiter in a `FairQueue`.
#[derive(Debug, Clone)]
pub struct Waiter<T> {
    pub id: u64,
    pub class: Class,
    pub client: Arc<str>,
    /// Its virtual start time within its class.
    vtime: u64,
    pub value: T,
}

/// A queue ordered by class, then by turns between clients, then by
/// arrival (see the module's doc). Small (bounded by its owner's limit):
/// kept as a list, scanned.
#[derive(Debug)]
pub struct FairQueue<T> {
    waiters: Vec<Waiter<T>>,
    /// Per class (`Class as usize`): the virtual time of the last waiter served.
    served: [u64; 3],
    /// Turns clients had without waiting (`served_at_once`): where their
    /// next waiter starts. Entries at or below their class's `served` say
    /// nothing more and are dropped; at most `MAX_CREDITS` are kept.
    credits: Vec<(Class, Arc<str>, u64)>,
    next_id: u64,
}

/// Clients whose turns without waiting are remembered (the most recent).
const MAX_CREDITS: usize = 1024;

impl<T> Default for FairQueue<T> {
    fn default() -> Self {
        FairQueue { waiters: Vec::new(), served: [0; 3], credits: Vec::new(), next_id: 0 }
    }
}

impl<T> FairQueue<T> {
    /// `client` had a turn of `class` without waiting (admitted at once):
    /// its next waiter queues behind the clients that had none.
    pub fn served_at_once(&mut self, class: Class, client: &Arc<str>) {
        let next = self.next_vtime(class, client) + 1;
        // This client's old credit, and any at or below its class's turns.
        self.credits.retain(|(c, who, v)| !(*c == class && who == client) && *v > self.served[*c as usize]);
        self.credits.push((class, client.clone(), next));
        if self.credits.len() > MAX_CREDITS {
            self.credits.remove(0);
        }
    }

    /// Where `client`'s next waiter of `class` starts.
    fn next_vtime(&self, class: Class, client: &Arc<str>) -> u64 {
        let floor = self.served[class as usize];
        let queued = self.waiters.iter().filter(|w| w.class == class && w.client == *client).map(|w| w.vtime + 1);
        let credit = self.credits.iter().filter(|(c, who, _)| *c == class && who == client).map(|(_, _, v)| *v);
        queued.chain(credit).max().unwrap_or(floor).max(floor)
    }

    /// Queues a waiter; returns its id.
    pub fn push(&mut self, class: Class, client: Arc<str>, value: T) -> u64 {
        let vtime = self.next_vtime(class, &client);
        self.next_id += 1;
        let id = self.next_id;
        self.waiters.push(Waiter { id, class, client, vtime, value });
        id
    }

    /// The order: higher class, then earlier virtual time, then arrival.
    fn key(w: &Waiter<T>) -> (std::cmp::Reverse<Class>, u64, u64) {
        (std::cmp::Reverse(w.class), w.vtime, w.id)
    }

    /// Who goes next.
    pub fn head(&self) -> Option<&Waiter<T>> {
        self.waiters.iter().min_by_key(|w| Self::key(w))
    }

    /// Who would be turned away first when full: the lowest class, the
    /// last in its turns.
    pub fn last(&self) -> Option<&Waiter<T>> {
        self.waiters.iter().max_by_key(|w| Self::key(w))
    }

    /// Takes the next waiter out: it is served (its class's turns move on).
    pub fn pop(&mut self) -> Option<Waiter<T>> {
        let id = self.head()?.id;
        self.remove(id)
    }

    /// Takes waiter `id` out (served, or gone). The head leaving moves its
    /// class's turns on either way: those behind it are next.
    pub fn remove(&mut self, id: u64) -> Option<Waiter<T>> {
        let was_head = self.head().is_some_and(|h| h.id == id);
        let i = self.waiters.iter().position(|w| w.id == id)?;
        let w = self.waiters.swap_remove(i);
        if was_head {
            let served = &mut self.served[w.class as usize];
            *served = (*served).max(w.vtime);
        }
        Some(w)
    }

    pub fn contains(&self, id: u64) -> bool {
        self.waiters.iter().any(|w| w.id == id)
    }

    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// The waiters in the order they go.
    pub fn in_order(&self) -> Vec<&Waiter<T>> {
        let mut all: Vec<&Waiter<T>> = self.waiters.iter().collect();
        all.sort_by_key(|w| Self::key(w));
        all
    }

    /// Waiters of each class, in `Class::ALL` order.
    pub fn by_class(&self) -> [usize; 3] {
        Class::ALL.map(|c| self.waiters.iter().filter(|w| w.class == c).count())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn resolve_with(config: &PriorityConfig, headers: &[(&str, &str)]) -> Result<Who, UnknownClass> {
        let map: HashMap<String, String> = headers.iter().map(|(k, v)| (k.to_lowercase(), v.to_string())).collect();
        resolve(config, &Default::default(), |name| map.get(name).map(String::as_str))
    }

    #[test]
    fn the_class_comes_from_our_header_then_sglangs_then_the_clients_config_then_default() {
        let mut config = PriorityConfig::default();
        config.clients.insert(crate::client_ids::key_id("sk-batch"), Class::Background);
        let batch = ("authorization", "Bearer sk-batch");
        let of = |h: &[(&str, &str)]| resolve_with(&config, h).map(|w| (w.class, w.stated));
        assert_eq!(of(&[]), Ok((Class::Default, false)));
        assert_eq!(of(&[batch]), Ok((Class::Background, false)));
        assert_eq!(of(&[batch, ("X-SMG-Priority", "system")]), Ok((Class::Interactive, true)));
        assert_eq!(of(&[batch, ("x-smg-priority", "interactive")]), Ok((Class::Interactive, true)));
        assert_eq!(of(&[("x-smg-priority", "bulk")]), Ok((Class::Background, true)));
        assert_eq!(of(&[("x-smg-priority", "default")]), Ok((Class::Default, true)));
        // Ours wins over SGLang's, whatever the case.
        assert_eq!(
            of(&[("x-smg-priority", "bulk"), ("x-prefixgate-priority", "Interactive")]),
            Ok((Class::Interactive, true))
        );
        assert_eq!(of(&[batch, ("x-prefixgate-priority", "default")]), Ok((Class::Default, true)));
    }

    #[test]
    fn an_unknown_class_is_an_error_naming_its_header() {
        let config = PriorityConfig::default();
        let err = resolve_with(&config, &[("x-prefixgate-priority", "urgent")]).unwrap_err();
        assert!(err.0.contains("x-prefixgate-priority") && err.0.contains("urgent"), "{}", err.0);
        let err = resolve_with(&config, &[("x-smg-priority", "high")]).unwrap_err();
        assert!(err.0.contains("x-smg-priority"), "{}", err.0);
        // Our header's bad value is reported even when SGLang's is fine.
        let err = resolve_with(&config, &[("x-prefixgate-priority", "low"), ("x-smg-priority", "bulk")]).unwrap_err();
        assert!(err.0.contains("x-prefixgate-priority"), "{}", err.0);
    }

    #[test]
    fn the_client_is_the_keys_hash_or_the_header_where_allowed_never_the_key() {
        let mut config = PriorityConfig::default();
        let who = |c: &PriorityConfig, h: &[(&str, &str)]| resolve_with(c, h).unwrap().client.to_string();
        assert_eq!(who(&config, &[]), "anonymous");
        let by_key = who(&config, &[("authorization", "Bearer sk-secret-1")]);
        assert!(by_key.starts_with("key-") && by_key.len() == 16 && !by_key.contains("secret"), "{by_key}");
        // sha256("sk-secret-1"), first 12 hex digits: what `sha256sum` prints.
        assert_eq!(by_key, format!("key-{}", &hex_sha256("sk-secret-1")[..12]));
        assert_eq!(who(&config, &[("x-api-key", "sk-secret-1")]), by_key, "Anthropic's header: the same client");
        assert_ne!(who(&config, &[("authorization", "Bearer sk-secret-2")]), by_key);
        // The client header counts only where the operator allows it.
        assert_eq!(who(&config, &[("x-prefixgate-client", "team-a")]), "anonymous");
        config.client_header = true;
        assert_eq!(who(&config, &[("x-prefixgate-client", "team-a"), ("authorization", "Bearer k")]), "team-a");
        config.clients.insert("team-a".into(), Class::Interactive);
        assert_eq!(resolve_with(&config, &[("x-prefixgate-client", "team-a")]).unwrap().class, Class::Interactive);
    }

    fn hex_sha256(s: &str) -> String {
        use sha2::{Digest, Sha256};
        Sha256::digest(s.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }

    fn ids<T>(q: &FairQueue<T>) -> Vec<u64> {
        q.in_order().iter().map(|w| w.id).collect()
    }

    #[test]
    fn higher_classes_go_first_and_arrival_orders_the_rest() {
        let mut q = FairQueue::default();
        let c: Arc<str> = Arc::from("c");
        let bg = q.push(Class::Background, c.clone(), ());
        let def = q.push(Class::Default, c.clone(), ());
        let int = q.push(Class::Interactive, c.clone(), ());
        let def2 = q.push(Class::Default, c.clone(), ());
        assert_eq!(ids(&q), [int, def, def2, bg]);
        assert_eq!(q.last().map(|w| w.id), Some(bg), "the lowest class is turned away first");
        assert_eq!(q.by_class(), [1, 2, 1]);
    }

    #[test]
    fn clients_take_turns_within_a_class() {
        let mut q = FairQueue::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let a_ids: Vec<u64> = (0..6).map(|_| q.push(Class::Default, a.clone(), ())).collect();
        // B arrives later with one: it goes second, not seventh.
        let b1 = q.push(Class::Default, b.clone(), ());
        assert_eq!(ids(&q)[..3], [a_ids[0], b1, a_ids[1]]);
        // Once A's first was served, B's one is next.
        assert_eq!(q.pop().map(|w| w.id), Some(a_ids[0]));
        assert_eq!(q.head().map(|w| w.id), Some(b1));
        // A client arriving after some were served starts at the turns'
        // current point, not ahead of them by its idle time.
        q.pop();
        q.pop();
        let b2 = q.push(Class::Default, b.clone(), ());
        let order = ids(&q);
        assert_eq!(order[..2], [b2, a_ids[2]], "{order:?}");
    }

    #[test]
    fn a_client_whose_sessions_went_at_once_waits_behind_one_that_had_none() {
        let mut q = FairQueue::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        // A's first two went without waiting; its next four queue.
        q.served_at_once(Class::Default, &a);
        q.served_at_once(Class::Default, &a);
        let a3 = q.push(Class::Default, a.clone(), ());
        let b1 = q.push(Class::Default, b.clone(), ());
        assert_eq!(ids(&q), [b1, a3], "B's first goes at the first room");
        // Credits below the turns' point are dropped, so they stay few.
        for i in 0..2_000 {
            q.served_at_once(Class::Background, &Arc::from(format!("c{i}")));
        }
        assert!(q.credits.len() <= MAX_CREDITS);
    }

    #[test]
    fn a_waiter_that_leaves_is_gone_from_the_turns() {
        let mut q = FairQueue::default();
        let a: Arc<str> = Arc::from("a");
        let first = q.push(Class::Default, a.clone(), 1);
        let second = q.push(Class::Default, a.clone(), 2);
        assert_eq!(q.remove(second).map(|w| w.value), Some(2));
        assert!(!q.contains(second) && q.contains(first));
        assert_eq!(q.remove(second).map(|w| w.value), None);
        assert_eq!(q.len(), 1);
    }
}
