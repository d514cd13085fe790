"""What every SDK check script shares: the official clients pointed at the
gateway under test (BASE_URL), and `check`, which raises on a failed
check and prints a passed one. The scripts import it from their own
folder (Python puts a script's folder first on its path)."""

import os

import anthropic
import openai

BASE = os.environ["BASE_URL"]
oa = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
an = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0)


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok:", what)
