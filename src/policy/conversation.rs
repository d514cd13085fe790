//! Explicit conversation names: a client that names its conversation
//! (`prompt_cache_key` in the body, or a session header its agent sends)
//! gets it kept on one replica even when the prefix no longer shows it (a
//! client that compacted its history still lands where its session lives).
//!
//! A key must never glue different conversations together: where a client
//! tells its agents apart (Claude Code's `x-claude-code-agent-id`, parent
//! agent and parent session headers), the key is the session *and* those,
//! so the parallel subagents of one session are spread like any parallel
//! work. Keys are hashed with the model (the same session on two models is
//! two caches) into a `PrefixKey` of their own namespace.
//!
//! Precedence (see `decide`): a prefix match wins (it is exact: that replica
//! served this very prefix); the key decides when there is no prefix
//! evidence; a stored response (`previous_response_id`) overrides both,
//! because only that replica can serve it at all.

use xxhash_rust::xxh3::Xxh3;

use super::chain::{field, ShapeError};
use super::PrefixKey;

/// Session headers read by default, in order of preference: generic, Codex,
/// Claude Code, OpenCode.
pub const SESSION_HEADERS: &[&str] =
    &["x-session-id", "session-id", "session_id", "x-claude-code-session-id", "x-session-affinity"];

/// Headers that tell agents of one session apart; each present one becomes part of the key.
pub const AGENT_HEADERS: &[&str] = &["x-claude-code-agent-id", "x-claude-code-parent-agent-id", "x-parent-session-id"];

/// Longest key accepted (session header values and `prompt_cache_key`); a
/// longer one is a 400: it is not a name, and it would be kept in memory.
pub const MAX_KEY_BYTES: usize = 512;

/// What named the conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    PromptCacheKey,
    SessionHeader,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionKey {
    pub kind: KeyKind,
    pub key: PrefixKey,
}

fn bounded<'a>(what: &str, v: &'a str) -> Result<&'a str, ShapeError> {
    if v.len() > MAX_KEY_BYTES {
        return Err(ShapeError(format!("{what} is longer than {MAX_KEY_BYTES} bytes")));
    }
    Ok(v)
}

/// The request's session key, if it names one. `header` reads a request
/// header (names are lowercase); `extra_headers` are operator-configured
/// session header names, tried after the built-in ones.
pub fn session_key<'h>(
    model: Option<&str>,
    cache_key: Option<&str>,
    header: impl Fn(&str) -> Option<&'h str>,
    extra_headers: &[String],
) -> Result<Option<SessionKey>, ShapeError> {
    let (kind, name, value) = match cache_key.filter(|k| !k.is_empty()) {
        Some(k) => (KeyKind::PromptCacheKey, "prompt_cache_key", bounded("prompt_cache_key", k)?),
        None => {
            let found = SESSION_HEADERS
                .iter()
                .copied()
                .chain(extra_headers.iter().map(String::as_str))
                .find_map(|h| header(h).filter(|v| !v.is_empty()).map(|v| (h, v)));
            match found {
                Some((h, v)) => (KeyKind::SessionHeader, h, bounded(h, v)?),
                None => return Ok(None),
            }
        }
    };
    let mut h = Xxh3::new();
    h.update(b"prefixgate/session\0");
    field(&mut h, b'm', model.unwrap_or("").as_bytes());
    field(&mut h, b'n', name.as_bytes());
    field(&mut h, b'v', value.as_bytes());
    for agent in AGENT_HEADERS {
        if let Some(v) = header(agent).filter(|v| !v.is_empty()) {
            field(&mut h, b'a', agent.as_bytes());
            field(&mut h, b'v', bounded(agent, v)?.as_bytes());
        }
    }
    Ok(Some(SessionKey { kind, key: h.digest128() }))
}

/// What a stored response id may be: letters, digits, `_` and `-`, 1 to 256
/// characters (vLLM, SGLang and OpenAI write `resp_` and hex digits). An id
/// goes into a replica's path (`GET /v1/responses/{id}`) when it is looked
/// for; anything else could leave its one segment (`../`, `/`, `?`, `#`).
pub const RESPONSE_ID_PATTERN: &str = "^[A-Za-z0-9_-]{1,256}$";

/// Checks a stored response id named by `field` (`previous_response_id`,
/// or the path): refused with a message naming the field, never sent on.
pub fn check_response_id(field: &str, id: &str) -> Result<(), ShapeError> {
    let ok = (1..=256).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        return Ok(());
    }
    let shown: String = id.chars().take(64).collect();
    Err(ShapeError(format!(
        "{field}: '{}' is not a response id (letters, digits, '_' and '-', 1 to 256 characters)",
        shown.escape_debug()
    )))
}

/// The key under which a stored response's replica is remembered.
pub fn response_key(response_id: &str) -> PrefixKey {
    let mut h = Xxh3::new();
    h.update(b"prefixgate/response\0");
    field(&mut h, b'r', response_id.as_bytes());
    h.digest128()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_ids_are_one_path_segment_or_refused() {
        for good in ["resp_0123abcdef", "a", "resp-X_9", &"x".repeat(256)] {
            assert!(check_response_id("previous_response_id", good).is_ok(), "{good}");
        }
        for bad in ["", "../../v1/models", "a/b", "x?y=1", "x#y", "a b", "a%2Fb", "é", &"x".repeat(257)] {
            let e = check_response_id("previous_response_id", bad).unwrap_err();
            assert!(e.0.starts_with("previous_response_id: "), "{bad}: {}", e.0);
        }
    }

    fn key(headers: &[(&str, &str)], cache_key: Option<&str>) -> Option<SessionKey> {
        session_key(Some("m"), cache_key, |n| headers.iter().find(|(k, _)| *k == n).map(|(_, v)| *v), &[]).unwrap()
    }

    #[test]
    fn sessions_and_agents_make_distinct_keys() {
        let main = key(&[("x-claude-code-session-id", "s1")], None).unwrap();
        assert_eq!(main.kind, KeyKind::SessionHeader);
        assert_eq!(key(&[("x-claude-code-session-id", "s1")], None), Some(main));
        let sub_a = key(&[("x-claude-code-session-id", "s1"), ("x-claude-code-agent-id", "a")], None).unwrap();
        let sub_b = key(&[("x-claude-code-session-id", "s1"), ("x-claude-code-agent-id", "b")], None).unwrap();
        assert!(sub_a != sub_b && sub_a != main, "subagents of one session are different conversations");
        let cache = key(&[("x-session-id", "s1")], Some("k")).unwrap();
        assert_eq!(cache.kind, KeyKind::PromptCacheKey);
        assert_eq!(key(&[], None), None);
        assert_eq!(key(&[("x-session-id", "")], None), None);
    }

    #[test]
    fn configured_headers_count_and_absurd_keys_are_refused() {
        let extra = vec!["x-my-conversation".to_string()];
        let h = |n: &str| (n == "x-my-conversation").then_some("c1");
        assert!(session_key(None, None, h, &extra).unwrap().is_some());
        assert!(session_key(None, None, h, &[]).unwrap().is_none());
        let long = "x".repeat(MAX_KEY_BYTES + 1);
        let err = session_key(None, Some(&long), |_| None, &[]).unwrap_err();
        assert!(err.0.contains("prompt_cache_key is longer than 512 bytes"), "{}", err.0);
        assert_ne!(response_key("resp_1"), response_key("resp_2"));
    }
}
