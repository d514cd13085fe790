//! The two changes prefixgate makes to awc (vendor/awc).
//!
//! `client_codec`: a client codec configuration shared per thread instead
//! of built (with a date-updater task) per request. The Date header awc
//! writes must stay current, also on a thread whose first runtime, the one
//! that ran the shared configuration's updater, has ended.
//!
//! The connection pool's map hashes with foldhash: connections must still
//! be kept and found per upstream.

use std::time::{Duration, SystemTime};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};

/// Answers with the client's port: one port, one connection.
async fn echo_peer_port(req: HttpRequest) -> HttpResponse {
    HttpResponse::Ok().body(req.peer_addr().map(|a| a.port()).unwrap_or(0).to_string())
}

/// Serves every request with `handler` from a server on its own thread,
/// with its own actix system; returns the server's base URL.
fn serve_on_a_thread<F, Fut>(handler: F) -> String
where
    F: Fn(HttpRequest) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = HttpResponse> + 'static,
{
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            HttpServer::new(move || App::new().default_service(web::to(handler.clone())))
                .workers(1)
                .listen(listener)
                .unwrap()
                .run()
                .await
        })
    });
    url
}

/// Answers with the Date header it received.
async fn echo_date(req: HttpRequest) -> HttpResponse {
    let date = req.headers().get("date").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    HttpResponse::Ok().body(date)
}

fn date_sent_by_awc(url: &str) -> SystemTime {
    let url = url.to_string();
    // A fresh actix system (runtime) on this same thread each time.
    actix_web::rt::System::new().block_on(async move {
        let client = awc::Client::default();
        let mut resp = client.get(&url).send().await.expect("request");
        let body = resp.body().await.expect("body");
        httpdate::parse_http_date(std::str::from_utf8(&body).expect("utf-8")).expect("an HTTP date")
    })
}

#[test]
fn the_date_header_stays_current_across_runtimes_on_one_thread() {
    let url = serve_on_a_thread(echo_date);
    let first = date_sent_by_awc(&url);
    let now = SystemTime::now();
    assert!(now.duration_since(first).unwrap_or_default() <= Duration::from_secs(2), "first date is current");
    // The first runtime is gone, and with it the task that updated the
    // shared configuration's date. Past the staleness bound (3 s), a new
    // configuration must be made rather than the frozen one reused.
    std::thread::sleep(Duration::from_millis(3_600));
    let second = date_sent_by_awc(&url);
    let now = SystemTime::now();
    let age = now.duration_since(second).unwrap_or_default();
    assert!(age <= Duration::from_secs(2), "the date sent after a runtime restart is {age:?} old");
    assert!(second > first, "the date moved on");
}

#[test]
fn pooled_connections_are_reused_per_upstream_and_kept_apart_between_upstreams() {
    let urls: Vec<String> = (0..2).map(|_| serve_on_a_thread(echo_peer_port)).collect();
    let ports: Vec<Vec<String>> = actix_web::rt::System::new().block_on(async move {
        let client = awc::Client::default();
        let mut ports = vec![Vec::new(), Vec::new()];
        for round in 0..6 {
            let i = round % 2;
            let mut resp = client.get(&urls[i]).send().await.expect("request");
            let body = resp.body().await.expect("body");
            ports[i].push(String::from_utf8(body.to_vec()).unwrap());
        }
        ports
    });
    for (i, seen) in ports.iter().enumerate() {
        assert_eq!(seen.len(), 3);
        assert!(seen.iter().all(|p| p == &seen[0] && p != "0"), "upstream {i} used one pooled connection: {seen:?}");
    }
    assert_ne!(ports[0][0], ports[1][0], "each upstream has its own connection");
}
