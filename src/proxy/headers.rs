//! Which headers cross the gateway. Everything does, minus hop-by-hop
//! headers (they describe one connection, not the message) and the framing
//! headers the HTTP stack recomputes.

use std::rc::Rc;
use std::sync::Arc;

use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::http::uri::{Authority, PathAndQuery, Scheme, Uri};
use actix_web::http::Method;
use actix_web::{HttpRequest, HttpResponseBuilder};

use crate::by_arc::ByArc;
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

/// The request's headers by name, read in one pass. The session lookup asks
/// for up to a dozen names, most of them absent; a scan (or a hashed lookup)
/// of the request's `HeaderMap` per name cost more than the rest of the
/// lookup together (callgrind, `bench/hop.sh`'s request).
pub struct RequestHeaders<'r>(smallvec::SmallVec<[(&'r str, &'r HeaderValue); 16]>);

impl<'r> RequestHeaders<'r> {
    pub fn of(req: &'r HttpRequest) -> RequestHeaders<'r> {
        RequestHeaders(req.headers().iter().map(|(k, v)| (k.as_str(), v)).collect())
    }

    /// The first value of `name` (lowercase), if it is text.
    pub fn get(&self, name: &str) -> Option<&'r str> {
        self.0.iter().find(|(k, _)| *k == name).and_then(|(_, v)| v.to_str().ok())
    }
}

/// A replica's base URL, parsed.
struct Base {
    scheme: Scheme,
    authority: Authority,
    /// The URL's own path, if it has one (`http://host/api`), without a trailing slash.
    prefix: String,
    /// The `Host` header, as awc would write it (no port when it is 80 or
    /// 443): set here, awc does not format it for every request.
    host: HeaderValue,
}

impl Base {
    fn parse(url: &str) -> Option<Base> {
        let uri: Uri = url.parse().ok()?;
        let prefix = uri.path().trim_end_matches('/').to_string();
        let host = match uri.port_u16() {
            None | Some(80) | Some(443) => uri.host()?.to_string(),
            Some(port) => format!("{}:{port}", uri.host()?),
        };
        let host = HeaderValue::from_str(&host).ok()?;
        Some(Base { scheme: uri.scheme()?.clone(), authority: uri.authority()?.clone(), prefix, host })
    }
}

/// What one worker derived from the replicas' specs once, instead of per
/// request: each spec's base URL parsed (so a request's upstream URI is put
/// together from parts, not formatted as a string and parsed back). Keyed
/// by the spec's `Arc`, so an edited spec is parsed afresh.
#[derive(Default)]
pub struct PerReplica {
    bases: ByArc<ReplicaSpec, Option<Rc<Base>>>,
}

impl PerReplica {
    /// The upstream URI: the replica's base URL, then the client's path and
    /// query; and the `Host` header for it (None: awc derives it).
    pub fn target(&self, spec: &Arc<ReplicaSpec>, client: &Uri) -> (Uri, Option<HeaderValue>) {
        let pq = client.path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        let base = self.bases.get(spec, |spec| Base::parse(&spec.url).map(Rc::new));
        let built = base.as_deref().and_then(|base| {
            let pq = if base.prefix.is_empty() { pq.clone() } else { format!("{}{pq}", base.prefix).parse().ok()? };
            let mut parts = actix_web::http::uri::Parts::default();
            parts.scheme = Some(base.scheme.clone());
            parts.authority = Some(base.authority.clone());
            parts.path_and_query = Some(pq);
            Some((Uri::from_parts(parts).ok()?, Some(base.host.clone())))
        });
        // A URL that does not parse goes out as before, and awc reports it.
        built.unwrap_or_else(|| (format!("{}{pq}", spec.url).parse().unwrap_or_default(), None))
    }
}

/// The upstream request: same method, path, query and headers; the replica's
/// own API key replaces the client's credentials when it has one, and the
/// client's key for the gateway itself is never passed on (`credentials`).
pub fn upstream_request(
    client: &awc::Client,
    target: (Uri, Option<HeaderValue>),
    caller: Caller<'_>,
    spec: &ReplicaSpec,
) -> awc::ClientRequest {
    let req = caller.req;
    let mut up = replica_request(client, req.method().clone(), target, caller, spec);
    let headers = up.headers_mut();
    for (name, value) in req.headers() {
        if !hop_by_hop(name) && name != header::AUTHORIZATION {
            headers.append(name.clone(), value.clone());
        }
    }
    up
}

/// The client's request, as far as its credentials go upstream: the
/// request, and whether the gateway has keys of its own (`api_keys`: a
/// client's key for the gateway is never passed on).
#[derive(Clone, Copy)]
pub struct Caller<'a> {
    pub req: &'a HttpRequest,
    pub gateway_keys: bool,
}

/// A `method` request to the replica `spec` at `uri`, with its host and
/// the credentials the caller carries there (`credentials`), and nothing
/// else of its request: the base of the proxied request, and the whole of
/// the gateway's own (the engine's count of a prompt, `count.rs`; a stored
/// response's lookup, `locate.rs`).
pub fn replica_request(
    client: &awc::Client,
    method: Method,
    (uri, host): (Uri, Option<HeaderValue>),
    caller: Caller<'_>,
    spec: &ReplicaSpec,
) -> awc::ClientRequest {
    let mut up = client.request(method, uri).no_decompress();
    let headers = up.headers_mut();
    if let Some(host) = host {
        headers.insert(header::HOST, host);
    }
    if let Some(credentials) = credentials(caller.req, spec, caller.gateway_keys) {
        headers.insert(header::AUTHORIZATION, credentials);
    }
    up
}

/// The credentials a request to the replica `spec` carries: its own API key
/// when it has one; else the client's, unless the client's key is for the
/// gateway itself (`gateway_keys`).
fn credentials(req: &HttpRequest, spec: &ReplicaSpec, gateway_keys: bool) -> Option<HeaderValue> {
    match spec.own_credentials() {
        Some(own) => Some(own),
        None if gateway_keys => None,
        None => req.headers().get(header::AUTHORIZATION).cloned(),
    }
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
        Arc::new(ReplicaSpec::new("a", url))
    }

    #[test]
    fn request_headers_answer_the_first_text_value_of_a_lowercase_name() {
        let req = actix_web::test::TestRequest::default()
            .insert_header(("X-Session-Id", "s1"))
            .append_header(("x-session-id", "s2"))
            .insert_header(("content-type", "application/json"))
            .insert_header(("x-binary", HeaderValue::from_bytes(b"\xff").unwrap()))
            .to_http_request();
        let headers = RequestHeaders::of(&req);
        assert_eq!(headers.get("x-session-id"), Some("s1"));
        assert_eq!(headers.get("content-type"), Some("application/json"));
        assert_eq!(headers.get("x-binary"), None);
        assert_eq!(headers.get("session-id"), None);
    }

    #[test]
    fn the_upstream_target_is_the_base_url_then_the_clients_path_and_query_with_awcs_host() {
        let replicas = PerReplica::default();
        let client: Uri = "/v1/chat/completions?x=1&y=%20".parse().unwrap();
        let target = |spec: &Arc<ReplicaSpec>| {
            let (uri, host) = replicas.target(spec, &client);
            (uri.to_string(), host.map(|h| h.to_str().unwrap().to_string()))
        };
        let plain = spec("http://10.0.0.5:8000");
        let want =
            ("http://10.0.0.5:8000/v1/chat/completions?x=1&y=%20".to_string(), Some("10.0.0.5:8000".to_string()));
        assert_eq!(target(&plain), want);
        // Asked twice: the cached parse gives the same target.
        assert_eq!(target(&plain), want);
        let prefixed = spec("https://gpu-a.internal/api/");
        assert_eq!(
            target(&prefixed),
            ("https://gpu-a.internal/api/v1/chat/completions?x=1&y=%20".into(), Some("gpu-a.internal".into()))
        );
        // awc leaves the default ports out of Host.
        assert_eq!(target(&spec("http://gpu-b:80")).1.as_deref(), Some("gpu-b"));
        // A changed spec is a new Arc: parsed afresh, not served from the cache.
        let moved = spec("http://10.0.0.6:9000");
        assert_eq!(target(&moved).0, "http://10.0.0.6:9000/v1/chat/completions?x=1&y=%20");
    }
}
