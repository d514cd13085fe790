"""The best any gateway could do at the simulated KV wall (issue 31), measured
straight on the engine: two agent families on one simulated replica (the
sim-wall families: a 500-token system prompt, a first turn of ~2,000 tokens,
1,500 new tokens a turn, 6 turns, 16 tokens out), driven by a schedule that
knows the future. Two replicas each holding two families are two copies of
this, so its ratios are the four-family run's.

Schedules (B is the younger family):
  off        both run freely (what the gateway does with the hold off)
  serial     A's six turns, then B's (two at a time, by hand)
  d=D m=M    B starts once A finished turn D, runs M turns beside A, then
             waits until A is done and runs the rest (every pause the
             gateway could make, with no hand-off cost: B goes the moment A's
             last turn ends)

Prints each schedule's wall (median of ROUNDS) and its ratio to off's, best
first. Usage: python3 bench/sim-oracle.py SIM_URL [ROUNDS]"""
import http.client, json, statistics, sys, threading, time, uuid
from urllib.parse import urlparse

url = urlparse(sys.argv[1])
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
TURNS, SYSTEM, CONTEXT, TURN, OUT = 6, 500, 1500, 1500, 16


def filler(tag, tokens):
    # The simulator counts 4 bytes a token.
    s, i = "", 0
    while len(s) < tokens * 4:
        s += f"{tag} line {i}: the quick brown fox jumps over the lazy dog. "
        i += 1
    return s[: tokens * 4]


class Family:
    def __init__(self, salt, name):
        self.prompt = f"[{salt}] shared\n{filler('system', SYSTEM)}[{salt}] {name}\n{filler(name, CONTEXT)}"
        self.name, self.done = name, 0
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)

    def turn(self):
        body = json.dumps({"model": "sim-model", "prompt": self.prompt, "max_tokens": OUT})
        self.conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = self.conn.getresponse()
        answer = json.loads(r.read())["choices"][0]["text"]
        assert r.status == 200, r.status
        self.done += 1
        self.prompt += answer + filler(f"{self.name}t{self.done}", TURN)


def run(schedule):
    salt = uuid.uuid4().hex[:8]
    a, b = Family(salt, "a"), Family(salt, "b")
    a_turn_done = threading.Condition()

    def run_a():
        for _ in range(TURNS):
            a.turn()
            with a_turn_done:
                a_turn_done.notify_all()

    def wait_a(turns):
        with a_turn_done:
            a_turn_done.wait_for(lambda: a.done >= turns)

    def run_b():
        if schedule == "serial":
            wait_a(TURNS)
            for _ in range(TURNS):
                b.turn()
        elif schedule == "off":
            for _ in range(TURNS):
                b.turn()
        else:
            d, m = schedule
            wait_a(d)
            for _ in range(m):
                b.turn()
            wait_a(TURNS)
            while b.done < TURNS:
                b.turn()

    start = time.monotonic()
    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start


schedules = ["off", "serial"] + [(d, m) for d in range(0, 5) for m in range(1, TURNS + 1) if d + m <= TURNS + 3]
walls = {s: [] for s in schedules}
for _ in range(rounds):
    for s in schedules:
        walls[s].append(run(s))
median = {s: statistics.median(w) for s, w in walls.items()}
off = median["off"]
for s in sorted(schedules, key=median.get):
    name = s if isinstance(s, str) else f"d={s[0]} m={s[1]}"
    print(f"{name:<10} wall {median[s]:6.2f} s   {median[s] / off:5.2f}x of off")
