"""A tool call the model starts after the seam of a continued stream, read
by the official `openai` and `anthropic` Python SDKs: every replica dies
after 150 tokens of a Responses or Messages stream, and its chat endpoint
calls the request's tool after 20 tokens. The next leg runs on the chat
endpoint, so the call reaches the client parsed: a `function_call` output
item, a `tool_use` block. Run by tests/it/sdk.rs with BASE_URL set; a
failed check raises."""

from gateway import an, check, oa


def responses():
    tools = [{"type": "function", "name": "ls", "description": "list files", "parameters": {"type": "object"}}]
    with oa.responses.stream(model="sim-model", input="List the files.", max_output_tokens=400, temperature=0,
                             store=False, tools=tools) as stream:
        final = stream.get_final_response()
    kinds = [item.type for item in final.output]
    check(kinds == ["message", "function_call"], f"responses: a message, then a function_call item ({kinds})")
    call = final.output[1]
    check((call.name, call.arguments) == ("ls", "{}"), "responses: the call's name and arguments")
    check(len(final.output_text.split()) > 100, "responses: the text before the call is whole")


def messages():
    tools = [{"name": "ls", "description": "list files", "input_schema": {"type": "object"}}]
    with an.messages.stream(model="sim-model", max_tokens=400, tools=tools,
                            messages=[{"role": "user", "content": "List the files."}]) as stream:
        final = stream.get_final_message()
    kinds = [block.type for block in final.content]
    check(kinds == ["text", "tool_use"], f"messages: a text block, then a tool_use block ({kinds})")
    check((final.content[1].name, final.content[1].input) == ("ls", {}), "messages: the call's name and input")
    check(final.stop_reason == "tool_use", "messages: it stops for the tool")


responses()
messages()
print("all SDK checks passed")
