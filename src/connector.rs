//! The upstream connector every HTTP client of the gateway uses (the proxy,
//! the health prober, the bench client): a leaf, so that none of them has to
//! import another to get it.

use std::time::Duration;

/// awc's connector with TCP_NODELAY on every upstream socket. Without it,
/// awc's separate writes of head and body meet Nagle's algorithm and the
/// peer's delayed ACK: ~40 ms added to every request on loopback.
pub fn connector(
    connect_timeout: Duration,
) -> awc::Connector<
    impl actix_service::Service<
            actix_tls::connect::ConnectInfo<awc::http::Uri>,
            Response = actix_tls::connect::Connection<awc::http::Uri, tokio::net::TcpStream>,
            Error = actix_tls::connect::ConnectError,
        > + Clone,
> {
    use actix_service::ServiceExt;
    let tcp = actix_tls::connect::Connector::new(actix_tls::connect::Resolver::default()).service();
    let tcp = tcp.map(|conn: actix_tls::connect::Connection<awc::http::Uri, tokio::net::TcpStream>| {
        let _ = conn.io_ref().set_nodelay(true);
        conn
    });
    awc::Connector::new().connector(tcp).timeout(connect_timeout)
}
