"""The server runs every single-process placement the CLI loads: offloaded experts and quantized checkpoints,
through the same loading code as `moeserve generate`; concurrent requests get what they get alone."""

import asyncio

import httpx
import pytest

import moeserve
from moeserve.cli import main
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.serve.process import ServerProcess
from moeserve.tokenizer import load_tokenizer
from single_thread import one_thread  # noqa: F401 - autouse fixture

PROMPTS = ["HAMLET.", "Enter the Ghost.", "To be, or not to be, that is", "O"]


def concurrent_texts(url: str, n: int = 24) -> list[str]:
    async def one(c, prompt):
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in PROMPTS))

    return asyncio.run(asyncio.wait_for(run(), 300))


def solo_texts(model_dir: str, n: int = 24, **load) -> list[str]:
    model, tok = moeserve.load_model(model_dir, **load), load_tokenizer(model_dir)
    return [generate(model, [tok.encode(p)], SamplingParams(max_new_tokens=n), tokenizer=tok)[0].text
            for p in PROMPTS]


def test_offloaded_experts(tmp_path, capsys):
    """--offload with every expert in high precision computes what the resident model computes."""
    assert main(["offload-prepare", "--out", str(tmp_path / "experts")]) == 0
    capsys.readouterr()
    with ServerProcess("--threads", "1", "--parallel", "4", "--offload", str(tmp_path / "experts"), "--high-slots",
                       "12", "--all-high") as server:
        assert concurrent_texts(server.url) == solo_texts(moeserve.DEMO_MODEL)


def test_quantized_checkpoint(tmp_path, capsys):
    assert main(["quantize", "--out", str(tmp_path / "q4"), "--bits", "4", "--method", "rtn"]) == 0
    capsys.readouterr()
    with ServerProcess("--threads", "1", "--parallel", "4", "--model", str(tmp_path / "q4")) as server:
        assert concurrent_texts(server.url) == solo_texts(str(tmp_path / "q4"))
        assert httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"] == "q4"


@pytest.mark.parametrize("argv,message", [
    (["--offload", "{tmp}/none", "--high-slots", "4"], "none"),
    (["--offload", "{tmp}", "--gpu-memory", "lots"], "--gpu-memory 'lots' is not a size"),
])
def test_bad_placement_options(expect_cli_error, tmp_path, argv, message):
    expect_cli_error(["serve", *(a.format(tmp=tmp_path) for a in argv)], message)
