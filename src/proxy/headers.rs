//! Which headers cross the gateway. Everything does, minus hop-by-hop
//! headers (they describe one connection, not the message) and the framing
//! headers the HTTP stack recomputes.

use actix_web::http::header::{self, HeaderMap, HeaderName};
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

/// The upstream request: same method, path, query and headers; the replica's
/// own API key replaces the client's credentials when it has one, and the
/// client's key for the gateway itself is never passed on.
pub fn upstream_request(
    client: &awc::Client,
    req: &HttpRequest,
    spec: &ReplicaSpec,
    gateway_keys: bool,
) -> awc::ClientRequest {
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let mut up = client.request(req.method().clone(), format!("{}{}", spec.url, path)).no_decompress();
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
