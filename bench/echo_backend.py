"""A tiny OpenAI-shaped backend that records the exact bytes it received.

Used by bench/overhead.sh to check whether a router forwards the client's
request body unchanged. GET /last returns the last body received (base64)."""
import base64, json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

last = b""

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def reply(self, obj, code=200):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/last":
            self.reply({"body_b64": base64.b64encode(last).decode()})
        elif self.path in ("/health", "/v1/models"):
            self.reply({"object": "list", "data": [{"id": "sim-model", "object": "model"}]})
        else:
            self.reply({}, 404)

    def do_POST(self):
        global last
        n = int(self.headers.get("content-length", 0))
        last = self.rfile.read(n)
        self.reply({"id": "x", "object": "chat.completion", "model": "sim-model",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
