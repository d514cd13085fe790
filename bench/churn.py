"""The loop of bench/churn.sh: add a name, delete the previous one, one
family of two turns; samples the gateway every EVERY names. Keep-alive
connections (http.client), so the loop measures the gateway, not curl."""
import http.client, json, sys, time
from urllib.parse import urlparse

base, admin, engine, pid, names, every = sys.argv[1:7]
names, every = int(names), int(every)

def conn(url):
    u = urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=30)

traffic, adm = conn(base), conn(admin)

def call(c, method, path, body=None):
    c.request(method, path, body=None if body is None else json.dumps(body),
              headers={"content-type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()

def rss_mib():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

def sample(n, errors):
    status, text = call(adm, "GET", "/metrics")
    lines = [l for l in text.decode().splitlines() if 'replica="' in l or 'from="' in l]
    print(f"names={n:>6} rss_mib={rss_mib():7.1f} metrics_bytes={len(text):>9} "
          f"replica_lines={len(lines):>6} errors={errors}", flush=True)

system = "You are a careful assistant. " * 60
errors, previous, started = 0, None, time.time()
sample(0, errors)
for i in range(names):
    name = f"pod-{i}"
    s, _ = call(adm, "POST", "/admin/v1/replicas", {"id": name, "url": engine})
    errors += s != 201
    if previous:
        s, _ = call(adm, "DELETE", f"/admin/v1/replicas/{previous}")
        errors += s != 204
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"task {i}"}]
    for turn in range(2):
        s, _ = call(traffic, "POST", "/v1/chat/completions", {"model": "sim-model", "max_tokens": 4, "messages": msgs})
        errors += s != 200
        msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    previous = name
    if (i + 1) % every == 0 or i + 1 == names:
        sample(i + 1, errors)
s, body = call(traffic, "GET", "/healthz")
print(f"done in {time.time() - started:.0f} s: errors={errors}, /healthz {s} {body.decode()}")
