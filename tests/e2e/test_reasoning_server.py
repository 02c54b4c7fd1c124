"""--reasoning-parser over HTTP (tiny model, official client): text before ``</think>`` is
``message.reasoning`` / ``delta.reasoning``, and the stream concatenates to the whole
response."""

from __future__ import annotations

import openai
import pytest
from server_utils import TINY_FLAGS, run_server

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Think first"}]


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--reasoning-parser", "deepseek_r1"]
    with run_server(args, tmp_path_factory.mktemp("logs")) as s:
        c = openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0, timeout=60)
        yield c
        c.close()


def test_reasoning_whole_and_streamed(client):
    model = client.models.list().data[0].id
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    # A random model never closes its think block: deepseek_r1 counts it all as reasoning.
    reasoning = whole.model_extra["reasoning"]
    assert reasoning and not whole.content
    streamed = {"reasoning": "", "content": ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            streamed["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
            streamed["content"] += delta.content or ""
    assert streamed == {"reasoning": reasoning, "content": ""}
