//! Which headers cross the gateway. Everything does, minus hop-by-hop
//! headers (they describe one connection, not the message) and the framing
//! headers the HTTP stack recomputes.

use std::cell::RefCell;
use std::sync::Arc;

use actix_web::http::header::{self, HeaderMap, HeaderName};
use actix_web::http::uri::{Authority, PathAndQuery, Scheme, Uri};
use actix_web::{HttpRequest, HttpResponseBuilder};

use crate::fleet::ReplicaSpec;

/// Standard names compare as enum values (no string comparison).
static HOP_BY_HOP: [HeaderName; 11] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
    header::CONTENT_LENGTH,
];

fn hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
}

/// A replica's base URL, parsed.
struct Base {
    scheme: Scheme,
    authority: Authority,
    /// The URL's own path, if it has one (`http://host/api`), without a trailing slash.
    prefix: String,
}

impl Base {
    fn parse(url: &str) -> Option<Base> {
        let uri: Uri = url.parse().ok()?;
        let prefix = uri.path().trim_end_matches('/').to_string();
        Some(Base { scheme: uri.scheme()?.clone(), authority: uri.authority()?.clone(), prefix })
    }
}

/// The replicas' base URLs as one worker parsed them, so that a request's
/// upstream URI is put together from parts instead of formatted as a string
/// and parsed back on every request. Keyed by the spec's address; an entry
/// keeps its spec alive, so the address cannot be reused while cached, and
/// a changed spec (a new `Arc`) is parsed afresh.
#[derive(Default)]
pub struct BaseUris(RefCell<foldhash::HashMap<usize, Parsed>>);

/// A spec (kept alive) and its URL parsed (None: it does not parse).
type Parsed = (Arc<ReplicaSpec>, Option<Base>);

/// Specs replaced over a worker's life are forgotten past this many entries.
const MAX_CACHED_BASES: usize = 1024;

impl BaseUris {
    /// The upstream URI: the replica's base URL, then the client's path and query.
    pub fn uri(&self, spec: &Arc<ReplicaSpec>, client: &Uri) -> Uri {
        let pq = client.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let key = Arc::as_ptr(spec) as usize;
        let mut bases = self.0.borrow_mut();
        if !bases.contains_key(&key) {
            if bases.len() >= MAX_CACHED_BASES {
                bases.clear();
            }
            bases.insert(key, (spec.clone(), Base::parse(&spec.url)));
        }
        let built = bases[&key].1.as_ref().and_then(|base| {
            let pq = if base.prefix.is_empty() { pq.clone() } else { format!("{}{pq}", base.prefix).parse().ok()? };
            let mut parts = actix_web::http::uri::Parts::default();
            parts.scheme = Some(base.scheme.clone());
            parts.authority = Some(base.authority.clone());
            parts.path_and_query = Some(pq);
            Uri::from_parts(parts).ok()
        });
        // A URL that does not parse goes out as before, and awc reports it.
        built.unwrap_or_else(|| format!("{}{pq}", spec.url).parse().unwrap_or_default())
    }
}

/// The upstream request: same method, path, query and headers; the replica's
/// own API key replaces the client's credentials when it has one, and the
/// client's key for the gateway itself is never passed on.
pub fn upstream_request(
    client: &awc::Client,
    uri: Uri,
    req: &HttpRequest,
    spec: &ReplicaSpec,
    gateway_keys: bool,
) -> awc::ClientRequest {
    let mut up = client.request(req.method().clone(), uri).no_decompress();
    let headers = up.headers_mut();
    for (name, value) in req.headers() {
        if hop_by_hop(name) || (name == header::AUTHORIZATION && (gateway_keys || spec.api_key.is_some())) {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    if let Some(key) = &spec.api_key {
        up = up.insert_header((header::AUTHORIZATION, format!("Bearer {key}")));
    }
    up
}

pub fn copy_response_headers(from: &HeaderMap, to: &mut HttpResponseBuilder) {
    for (name, value) in from {
        if !hop_by_hop(name) {
            to.append_header((name.clone(), value.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(url: &str) -> Arc<ReplicaSpec> {
        Arc::new(ReplicaSpec {
            id: "a".into(),
            url: url.into(),
            api_key: None,
            health_path: None,
            max_large_inflight: None,
            kv_tokens: None,
        })
    }

    #[test]
    fn the_upstream_uri_is_the_base_url_then_the_clients_path_and_query() {
        let bases = BaseUris::default();
        let client: Uri = "/v1/chat/completions?x=1&y=%20".parse().unwrap();
        let plain = spec("http://10.0.0.5:8000");
        assert_eq!(bases.uri(&plain, &client).to_string(), "http://10.0.0.5:8000/v1/chat/completions?x=1&y=%20");
        // Asked twice: the cached parse gives the same URI.
        assert_eq!(bases.uri(&plain, &client).to_string(), "http://10.0.0.5:8000/v1/chat/completions?x=1&y=%20");
        let prefixed = spec("https://gpu-a.internal/api/");
        assert_eq!(
            bases.uri(&prefixed, &client).to_string(),
            "https://gpu-a.internal/api/v1/chat/completions?x=1&y=%20"
        );
        // A changed spec is a new Arc: parsed afresh, not served from the cache.
        let moved = spec("http://10.0.0.6:9000");
        assert_eq!(bases.uri(&moved, &client).to_string(), "http://10.0.0.6:9000/v1/chat/completions?x=1&y=%20");
    }
}
