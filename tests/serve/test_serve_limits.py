"""A small server (2 slots, no queue, 128-token slots, an API key): disconnects free slots, a full server answers
503, keys and context limits are enforced. Every wait is bounded; only 127.0.0.1 is used."""

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.serve.process import ServerProcess
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1", "--parallel", "2", "--max-queue", "0", "--ctx-size", "128", "--api-key", KEY,
                       "--metrics") as s:
        yield s


def aborted(url: str) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.name == "moeserve:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


def test_api_key(server):
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/v1/models", headers=headers, timeout=60).status_code == 401
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200  # open, for load balancers


def test_context_size(server):
    over = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 127}, headers=AUTH, timeout=60)
    assert over.status_code == 400 and "maximum context length is 128 tokens" in over.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x" * 99, "max_tokens": 100, "ignore_eos": True},
                   headers=AUTH, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 128 - 100


def test_disconnect_frees_the_slot_and_spares_the_others(server):
    """Streams A and B fill both slots; C gets 503; A's client goes away mid-stream; D then gets A's slot while B
    streams on to exactly the text it gets alone."""
    b_prompt = "Enter the Ghost."

    def stream(c, prompt, n):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
        return c.stream("POST", "/v1/completions", json=body, headers=AUTH)

    async def chunks(lines, count=None) -> list[dict]:
        """The next `count` chunks of a stream (None: all up to [DONE])."""
        got = []
        async for line in lines:
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                got.append(json.loads(line[6:]))
                if len(got) == count:
                    break
        return got

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as ca, \
                httpx.AsyncClient(base_url=server.url, timeout=120) as cb:
            async with stream(ca, "HAMLET.", 110) as a:
                a_lines = a.aiter_lines()  # held: a dropped line iterator closes its response
                assert len(await chunks(a_lines, 3)) == 3
                async with stream(cb, b_prompt, 30) as b:
                    b_lines = b.aiter_lines()
                    b_chunks = await chunks(b_lines, 2)
                    full = await cb.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
                    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
                    await a.aclose()  # A's client goes away mid-stream
                    for _ in range(200):  # its slot is free within a step or two
                        d = await cb.post("/v1/completions", json={"prompt": "Exit.", "max_tokens": 3, "temperature": 0,
                                                                   "ignore_eos": True}, headers=AUTH)
                        if d.status_code != 503:
                            break
                        await asyncio.sleep(0.1)
                    assert d.status_code == 200 and d.json()["usage"]["completion_tokens"] == 3
                    return b_chunks + await chunks(b_lines)

    before = aborted(server.url)
    b_chunks = asyncio.run(asyncio.wait_for(main(), 300))
    assert aborted(server.url) == before + 1
    assert b_chunks[-1]["choices"][0]["finish_reason"] == "length"
    tok = load_tokenizer(moeserve.DEMO_MODEL)
    solo = generate(moeserve.load_model(moeserve.DEMO_MODEL), [tok.encode(b_prompt)],
                    SamplingParams(max_new_tokens=30, ignore_eos=True), tokenizer=tok)[0].text
    assert "".join(c["choices"][0]["text"] for c in b_chunks) == solo
