#!/usr/bin/env python3
"""Writes an agent trace for `prefixgate bench replay` (JSON lines: task,
after_ms, path, body), shaped like the recorded coding and assistant agents
of issue 49, at their recorded sizes (replay it with --keep-text 0.06 to fit
SmolLM2):

- eight tasks, 168 calls, all starting together; tool pauses of 0.2-3 s;
- five coding tasks share one system prompt and tools (~16,000 tokens),
  three assistant tasks another (~4,000);
- three heavy tasks (tool results of 1,000-1,800 tokens: they grow to
  ~50,000-58,000 tokens), five light ones;
- each task rewrites its tail the way agents do: a status message after
  everything, replaced each call (three tasks); a reminder on the latest
  message, stripped from older ones (two); old tool results cleared every
  six calls (one); the last user message edited and sent again (one); one
  plain loop.

Deterministic for a seed. Never logs or reads real prompts: the text is
words drawn from a fixed list. Usage: bench/agent-trace.py [--seed 49] > trace.jsonl
"""
import argparse
import json
import random

WORDS = (
    "the a of to and in is for on with that this it as be by from at or an are not file function test "
    "value return error line code module import class def self data result request response user path "
    "config read write open close list string number index key map set get update delete create build run "
    "check fix bug issue change commit branch merge review patch diff log trace debug info warn server "
    "client cache token prompt model replica route session turn agent tool call output input stream chunk "
    "time delay retry timeout limit memory disk network thread task queue worker lock state store record"
).split()


def text(rng, tokens):
    """About `tokens` tokens (4 bytes each) of words."""
    out, size = [], 0
    while size < tokens * 4:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def tools(rng, names, description_tokens):
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": text(rng, description_tokens),
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": text(rng, 20)}},
                    "required": ["path"],
                },
            },
        }
        for name in names
    ]


# name, kind, calls, heavy, rewrite
TASKS = [
    ("fix-auth", "coding", 30, True, "status"),
    ("refactor-store", "coding", 28, True, "reminder"),
    ("port-tests", "coding", 26, True, "status"),
    ("triage-logs", "coding", 18, False, "clear"),
    ("docs-typo", "coding", 10, False, "none"),
    ("plan-trip", "assistant", 20, False, "status"),
    ("email-digest", "assistant", 18, False, "reminder"),
    ("research-notes", "assistant", 18, False, "edit"),
]


def sent_messages(messages, rewrite, call, rng):
    """What call `call` sends of the history: the tail rewritten."""
    sent = [dict(m) for m in messages]
    if rewrite == "status":
        sent.append({"role": "user", "content": f"Tool-call turn {call + 1} of 100. {text(rng, 30)}"})
    elif rewrite == "reminder" and sent[-1]["role"] in ("user", "tool"):
        sent[-1]["content"] += f"\n<system-reminder>{text(rng, 60)}</system-reminder>"
    return sent


def task_calls(name, kind, calls, heavy, rewrite, shared, seed):
    rng = random.Random(f"{seed}-{name}")
    system, tool_defs = shared[kind]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Task {name}: {text(rng, 150)}"}]
    out, results, call = [], [], 0
    while call < calls:
        after_ms = 0 if call == 0 else rng.randint(200, 3000)
        body = {"model": "recorded", "messages": sent_messages(messages, rewrite, call, rng), "tools": tool_defs,
                "max_tokens": 1024}
        out.append({"task": name, "after_ms": after_ms, "path": "/v1/chat/completions", "body": body})
        call += 1
        if rewrite == "edit" and call % 6 == 3 and call < calls:
            # The user stopped the answer and sent the last message again, edited.
            edited = [dict(m) for m in messages]
            edited[-1] = {"role": "user", "content": messages[-1]["content"] + " " + text(rng, 40)}
            messages = edited
            body = {"model": "recorded", "messages": [dict(m) for m in messages], "tools": tool_defs, "max_tokens": 1024}
            out.append({"task": name, "after_ms": rng.randint(1000, 3000), "path": "/v1/chat/completions", "body": body})
            call += 1
        tool = tool_defs[rng.randrange(len(tool_defs))]["function"]["name"]
        call_id = f"call_{name}_{call}"
        arguments = json.dumps({"path": f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}.py"})
        messages.append({"role": "assistant", "content": text(rng, 20),
                         "tool_calls": [{"id": call_id, "type": "function",
                                         "function": {"name": tool, "arguments": arguments}}]})
        size = rng.randint(1000, 1800) if heavy else rng.randint(150, 500)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text(rng, size)})
        results.append(len(messages) - 1)
        if kind == "assistant" and call % 5 == 0:
            messages.append({"role": "user", "content": text(rng, 80)})
        if rewrite == "clear" and call % 6 == 0:
            for i in results[:-3]:
                messages[i] = dict(messages[i], content="[Old tool result content cleared]")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", default="49")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    coding_tools = ["read_file", "write_file", "edit_file", "run_tests", "grep", "glob", "bash", "git_diff",
                    "list_dir", "web_fetch", "todo_write", "task"]
    shared = {
        "coding": (text(rng, 6000), tools(rng, coding_tools, 800)),
        "assistant": (text(rng, 2500), tools(rng, ["search", "calendar", "email", "notes"], 350)),
    }
    for name, kind, calls, heavy, rewrite in TASKS:
        for line in task_calls(name, kind, calls, heavy, rewrite, shared, args.seed):
            print(json.dumps(line))


if __name__ == "__main__":
    main()
