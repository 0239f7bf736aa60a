"""Tuning on first use on a real GPU: the low-bit and bf16 fused MoE calls with no stored config search their token
bucket once (a short budget here), store the winner in the user's cache, and compute what the default config
computes. Skipped without CUDA."""

import json

import pytest
import torch

from moeserve.kernels.routing import build_routing_table
from moeserve.kernels.triton import autotune, configs, tune_cache
from moeserve.kernels.triton.device import device_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E, K, D, F = 8, 2, 512, 1024


@pytest.fixture
def tuning(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("MOESERVE_TUNE", "quick")
    monkeypatch.setattr(autotune, "BUDGET_S", {"quick": 4.0, "full": 8.0})
    autotune.forget()
    yield tmp_path
    monkeypatch.undo()
    autotune.forget()


def cached(section: str, shape: str) -> dict:
    info = device_of(torch.empty(1, device="cuda"))
    return json.loads(tune_cache.table_file(info.slug, info.capability).read_text())[section][shape]


@pytest.mark.parametrize("T", [1, 16])
def test_lowbit_experts_tune_once_and_match_the_default(tuning, T, capsys):
    from moeserve.kernels.triton.lowbit import lowbit_experts
    from moeserve.quant.qlinear import QuantizedExperts
    from moeserve.tune import ExpertKind, random_lowbit

    kind = ExpertKind(4, 8)
    ex = QuantizedExperts([random_lowbit(2 * F, D, kind, "cuda") for _ in range(E)],
                          [random_lowbit(D, F, kind, "cuda") for _ in range(E)])
    gu, dn = ex.stacked(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    routing = ids if T == 1 else build_routing_table(ids, torch.rand(T, K, device="cuda"), E)
    x = torch.randn(T if T == 1 else T * K, D, device="cuda", dtype=torch.bfloat16)
    default = configs.lowbit_moe_config(device_of(x), 4, E, D, F, T, K, True)
    want = lowbit_experts(x, gu, dn, routing, default)
    got = lowbit_experts(x, gu, dn, routing)  # tunes the bucket
    assert f"at {T} token" in capsys.readouterr().err
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert str(T) in cached("lowbit_moe", configs.lowbit_moe_key(4, E, D, F, True))
    lowbit_experts(x, gu, dn, routing)
    assert capsys.readouterr().err == ""  # once


def test_fused_bf16_experts_tune_once_and_match_the_default(tuning, capsys):
    from moeserve.kernels.triton.fused_moe import fused_experts

    T = 4
    gu = torch.randn(E, 2 * F, D, device="cuda", dtype=torch.bfloat16) * D ** -0.5
    dn = torch.randn(E, D, F, device="cuda", dtype=torch.bfloat16) * F ** -0.5
    ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
    table = build_routing_table(ids, torch.rand(T, K, device="cuda"), E)
    x = torch.randn(T * K, D, device="cuda", dtype=torch.bfloat16)
    want = fused_experts(x, gu, dn, table, configs.fused_moe_config(device_of(x), E, D, F, T, K))
    got = fused_experts(x, gu, dn, table)
    assert "fused_moe" in capsys.readouterr().err
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert "4" in cached("fused_moe", configs.shape_key(E, D, F))


def test_moeserve_tune_writes_a_shipped_format_table(tuning, tmp_path, byte_model_dir, capsys):
    """`moeserve tune --out` on a tiny checkpoint: the table it writes loads as a shipped one."""
    from moeserve.cli import main

    out = tmp_path / "gpu.json"
    assert main(["tune", "--model", str(byte_model_dir), "--tokens", "1,3", "--bits", "16", "--quick",
                 "--budget", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "default ms" in text and "tuned ms" in text
    table = json.loads(out.read_text())
    typed = configs.typed_sections(table, out.name)
    assert set(next(iter(typed["fused_moe"].values()))) == {"1", "2"} and table["hardware"]["sms"] > 0
