# Sourced by the bench scripts that measure nginx beside prefixgate, so all
# of them compare against one nginx setup: 2 workers, keepalive connections
# to the upstreams, no response buffering (streams pass through at once).
#
# nginx_conf DIR PORT [MORE]: writes DIR/nginx.conf, nginx on 127.0.0.1:PORT
# proxying round robin to the two simulated replicas on 18401 and 18402;
# MORE is extra lines for the http block (more upstreams and servers).
nginx_conf() {
  cat > "$1/nginx.conf" <<NGINX
worker_processes 2; pid $1/nginx.pid; error_log $1/nginx-error.log; daemon off;
events { worker_connections 4096; }
http {
  access_log off; client_body_temp_path $1; proxy_temp_path $1;
  upstream sims { server 127.0.0.1:18401; server 127.0.0.1:18402; keepalive 64; }
  server { listen 127.0.0.1:$2; location / { proxy_pass http://sims; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; } }
${3:-}
}
NGINX
}
