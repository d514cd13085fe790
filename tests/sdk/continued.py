"""Streams that outlive their replica, read by the official `openai` and
`anthropic` Python SDKs: every replica behind the gateway dies after 150
tokens of any stream, so a 400-token answer is finished in three legs on
three replicas. Each SDK must read one well-formed stream whose text
equals the same request's answer unstreamed, with usage counting 400
tokens. Run by tests/it/sdk.rs with BASE_URL set; a failed check raises."""

from gateway import an, check, oa

N = 400


def chat():
    messages = [{"role": "user", "content": "Tell me about caches."}]
    whole = oa.chat.completions.create(model="sim-model", messages=messages, max_tokens=N, temperature=0)
    stream = oa.chat.completions.create(model="sim-model", messages=messages, max_tokens=N, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
    text, roles, finishes, usage = [], 0, 0, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            roles += choice.delta.role is not None
            finishes += choice.finish_reason is not None
            text.append(choice.delta.content or "")
    check("".join(text) == whole.choices[0].message.content, "chat: the continued stream's text is the answer")
    check((roles, finishes, usage.completion_tokens) == (1, 1, N), "chat: one role, one finish, usage merged")


def completions():
    whole = oa.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=N, temperature=0)
    stream = oa.completions.create(model="sim-model", prompt="Once upon a time", max_tokens=N, temperature=0,
                                   stream=True, stream_options={"include_usage": True})
    text, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        text.extend(c.text for c in chunk.choices)
    check("".join(text) == whole.choices[0].text, "completions: the continued stream's text is the answer")
    check(usage.completion_tokens == N, "completions: usage merged")


def responses():
    args = dict(model="sim-model", input="Tell me about caches.", max_output_tokens=N, temperature=0, store=False)
    whole = oa.responses.create(**args)
    deltas, completed = [], []
    for event in oa.responses.create(stream=True, **args):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            completed.append(event.response)
    check("".join(deltas) == whole.output_text, "responses: the continued stream's text is the answer")
    check(len(completed) == 1 and completed[0].output_text == whole.output_text, "responses: one completed response, whole")
    check(completed[0].usage.output_tokens == N, "responses: usage merged")


def messages():
    args = dict(model="sim-model", max_tokens=N,
                messages=[{"role": "user", "content": "Tell me about caches."}])
    whole = an.messages.create(**args)
    with an.messages.stream(**args) as stream:
        final = stream.get_final_message()
    check(final.content[0].text == whole.content[0].text, "messages: the SDK's final message is the answer")
    check(len(final.content) == 1 and final.usage.output_tokens == N, "messages: one content block, usage merged")


chat()
completions()
responses()
messages()
print("all SDK checks passed")
