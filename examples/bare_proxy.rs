//! The framework floor for `bench/hop.sh`: actix-web and awc forwarding
//! `/v1/*` round robin, body read whole and response streamed, with none of
//! prefixgate's logic (no shape, pins, metrics or admission). The gap
//! between this and nginx is what the stack costs; the gap between
//! prefixgate and this is what prefixgate's own work costs.
//!
//! `cargo run --release --example bare_proxy -- 127.0.0.1:18413 http://127.0.0.1:18401 http://127.0.0.1:18402`

use std::cell::Cell;
use std::time::Duration;

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use futures_util::StreamExt;

struct Upstream {
    client: awc::Client,
    backends: Vec<String>,
    next: Cell<usize>,
}

async fn forward(req: HttpRequest, mut payload: web::Payload, up: web::Data<Upstream>) -> HttpResponse {
    let mut body = web::BytesMut::new();
    while let Some(chunk) = payload.next().await {
        match chunk {
            Ok(chunk) => body.extend_from_slice(&chunk),
            Err(e) => return HttpResponse::BadRequest().body(e.to_string()),
        }
    }
    let i = up.next.get();
    up.next.set(i + 1);
    let url = format!("{}{}", up.backends[i % up.backends.len()], req.uri().path());
    let mut request = up.client.request(req.method().clone(), url).no_decompress();
    for (name, value) in req.headers() {
        if name != "host" && name != "content-length" && name != "connection" {
            request.headers_mut().append(name.clone(), value.clone());
        }
    }
    let resp = match request.send_body(body.freeze()).await {
        Ok(resp) => resp,
        Err(e) => return HttpResponse::BadGateway().body(e.to_string()),
    };
    let mut out = HttpResponse::build(resp.status());
    for (name, value) in resp.headers() {
        if name != "content-length" && name != "connection" && name != "transfer-encoding" {
            out.append_header((name.clone(), value.clone()));
        }
    }
    out.streaming(resp)
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((listen, backends)) = args.split_first() else {
        eprintln!("usage: bare_proxy LISTEN_ADDR BACKEND_URL...");
        std::process::exit(2);
    };
    let backends = backends.to_vec();
    HttpServer::new(move || {
        let connector = prefixgate::connector::connector(Duration::from_secs(5)).limit(0);
        let client = awc::Client::builder().connector(connector).no_default_headers().disable_redirects().finish();
        let up = Upstream { client, backends: backends.clone(), next: Cell::new(0) };
        App::new().app_data(web::Data::new(up)).service(web::scope("/v1").default_service(web::to(forward)))
    })
    .workers(std::thread::available_parallelism().map_or(2, |n| n.get()))
    .tcp_nodelay(true)
    .bind(listen.as_str())?
    .run()
    .await
}
