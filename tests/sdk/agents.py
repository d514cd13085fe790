"""Drives prefixgate with the official `openai` and `anthropic` Python SDKs,
as Codex-style and Claude-Code-style agents would. Run by tests/sdk.rs with
BASE_URL set to a gateway in front of simulated replicas; any failed check
raises, and the script exits non-zero. Prints one line per check."""

import os
import sys

import anthropic

from gateway import an, check, oa

SALT = os.environ.get("SALT", "run")


def long_text(tag, tokens=1500):
    return " ".join(f"[{SALT} {tag}] sentence {i}." for i in range(tokens // 6))


def responses_chain(stream):
    """A Codex-style loop on stored responses: previous_response_id each turn."""
    first = oa.responses.with_raw_response.create(model="sim-model", input=long_text(f"codex {stream}"), max_output_tokens=4)
    home = first.headers["x-prefixgate-replica"]
    prev = first.parse().id
    for turn in range(1, 4):
        kwargs = dict(model="sim-model", input=f"turn {turn}", previous_response_id=prev, max_output_tokens=4)
        if stream:
            raw = oa.responses.with_raw_response.create(stream=True, **kwargs)
            headers = raw.headers
            final = None
            for event in raw.parse():
                if event.type == "response.completed":
                    final = event.response
            check(final is not None, f"streamed turn {turn} completed")
        else:
            raw = oa.responses.with_raw_response.create(**kwargs)
            headers = raw.headers
            final = raw.parse()
        check(headers["x-prefixgate-replica"] == home, f"responses turn {turn} (stream={stream}) on {home}")
        check(headers["x-prefixgate-route"] == "response", f"responses turn {turn} routed by its stored response")
        cached = final.usage.input_tokens_details.cached_tokens
        check(cached > 0, f"responses turn {turn} reports {cached} cached tokens")
        prev = final.id


def responses_prompt_cache_key():
    replicas = set()
    for turn in range(3):
        raw = oa.responses.with_raw_response.create(
            model="sim-model", input=f"compacted history {turn}", prompt_cache_key=f"{SALT}-conversation-7", max_output_tokens=2
        )
        replicas.add(raw.headers["x-prefixgate-replica"])
        if turn > 0:
            check(raw.headers["x-prefixgate-route"] == "session", f"prompt_cache_key turn {turn} follows its session")
    check(len(replicas) == 1, "one replica for one prompt_cache_key")


def one_shots_spread():
    replicas = {
        oa.responses.with_raw_response.create(model="sim-model", input=f"{SALT} one-shot {i}", max_output_tokens=2).headers[
            "x-prefixgate-replica"
        ]
        for i in range(6)
    }
    check(len(replicas) == 2, f"a batch of one-shots used every replica: {sorted(replicas)}")


TOOLS = [{"name": "bash", "description": "Run a shell command", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def anthropic_loop():
    """A Claude-Code-style loop: tools, tool_use and tool_result, cache_control on the newest message."""
    system = [{"type": "text", "text": "You are Claude Code. " + long_text("system"), "cache_control": {"type": "ephemeral"}}]
    history = [{"role": "user", "content": [{"type": "text", "text": long_text("task")}]}]
    home = None
    for turn in range(4):
        messages = [dict(m) for m in history]
        last = dict(messages[-1])
        last["content"] = [dict(last["content"][0], cache_control={"type": "ephemeral"})] + list(last["content"][1:])
        messages[-1] = last
        if turn == 3:
            with an.messages.stream(model="sim-model", max_tokens=4, system=system, tools=TOOLS, messages=messages) as stream:
                final = stream.get_final_message()
                headers = stream.response.headers
        else:
            raw = an.messages.with_raw_response.create(model="sim-model", max_tokens=4, system=system, tools=TOOLS, messages=messages)
            headers = raw.headers
            final = raw.parse()
        if turn == 0:
            home = headers["x-prefixgate-replica"]
        else:
            check(headers["x-prefixgate-replica"] == home, f"messages turn {turn} on {home}")
            check(headers["x-prefixgate-route"] == "pinned", f"messages turn {turn} pinned by its prefix")
            check((final.usage.cache_read_input_tokens or 0) > 0, f"messages turn {turn} reports {final.usage.cache_read_input_tokens} cache-read tokens")
        history.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{turn}", "name": "bash", "input": {"cmd": "ls"}}]})
        history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"file{turn}.rs"}]})


def anthropic_errors():
    try:
        an.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        check(False, "an unknown model is refused")
    except anthropic.NotFoundError as e:
        check(e.body["error"]["type"] == "not_found_error", "an unknown model is an Anthropic not_found_error")


responses_chain(stream=False)
responses_chain(stream=True)
responses_prompt_cache_key()
one_shots_spread()
anthropic_loop()
anthropic_errors()
print("all SDK checks passed")
sys.exit(0)
