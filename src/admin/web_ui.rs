//! The admin web UI: static files from `web/`, embedded in the binary (no
//! front-end build step), served at `/` on the admin listener, with the
//! vendored chart library (`web/vendor/uplot/`) under `/ui/vendor/`.

use actix_web::{web, HttpResponse};

const INDEX: &str = include_str!("../../web/index.html");
const SCRIPT: &str = include_str!("../../web/app.js");
const STYLE: &str = include_str!("../../web/style.css");
// The chart library, vendored with its licence (web/vendor/uplot/README.md).
const UPLOT: &str = include_str!("../../web/vendor/uplot/uPlot.iife.min.js");
const UPLOT_STYLE: &str = include_str!("../../web/vendor/uplot/uPlot.min.css");
const UPLOT_LICENSE: &str = include_str!("../../web/vendor/uplot/LICENSE");

pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/", web::get().to(|| async { file("text/html; charset=utf-8", INDEX) }))
        .route("/ui/app.js", web::get().to(|| async { file("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/ui/style.css", web::get().to(|| async { file("text/css; charset=utf-8", STYLE) }))
        .route(
            "/ui/vendor/uplot/uPlot.iife.min.js",
            web::get().to(|| async { file("text/javascript; charset=utf-8", UPLOT) }),
        )
        .route(
            "/ui/vendor/uplot/uPlot.min.css",
            web::get().to(|| async { file("text/css; charset=utf-8", UPLOT_STYLE) }),
        )
        .route(
            "/ui/vendor/uplot/LICENSE",
            web::get().to(|| async { file("text/plain; charset=utf-8", UPLOT_LICENSE) }),
        );
}

fn file(content_type: &str, body: &'static str) -> HttpResponse {
    HttpResponse::Ok()
        .content_type(content_type)
        .insert_header(("cache-control", "no-cache"))
        .insert_header(("x-content-type-options", "nosniff"))
        .insert_header((
            "content-security-policy",
            "default-src 'self'; style-src 'self'; script-src 'self'; connect-src 'self'",
        ))
        .body(body)
}
