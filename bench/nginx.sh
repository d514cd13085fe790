# Sourced by the bench scripts that measure nginx beside prefixgate, so all
# of them compare against one nginx setup: 2 workers, keepalive connections
# to the upstreams, no response buffering (streams pass through at once).
#
# nginx_conf DIR PORT UPSTREAMS [MORE]: writes DIR/nginx.conf, nginx on
# 127.0.0.1:PORT proxying round robin to UPSTREAMS (space-separated
# host:port, the simulated replicas); MORE is extra lines for the http block
# (more upstreams and servers).
nginx_conf() {
  cat > "$1/nginx.conf" <<NGINX
worker_processes 2; pid $1/nginx.pid; error_log $1/nginx-error.log; daemon off;
events { worker_connections 4096; }
http {
  access_log off; client_body_temp_path $1; proxy_temp_path $1;
  upstream sims { $(for u in $3; do printf 'server %s; ' "$u"; done) keepalive 64; }
  server { listen 127.0.0.1:$2; location / { proxy_pass http://sims; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; } }
${4:-}
}
NGINX
}
