"""The disk tier in the placement planner (plan/placement.py) with a given disk bandwidth: a candidate whose CPU
experts exceed the host budget runs from a store on disk with a RAM cache of what the budget leaves, its decode
time adding the misses' bytes over the bandwidth; and the bandwidth's measurement on a store (plan/disk.py), cached
per device."""

import dataclasses
import json
import os

import pytest

from checks import GiB, H100, MIXTRAL_CONFIG
from moeserve.cli import main
from moeserve.errors import MoeserveError
from moeserve.plan import disk
from moeserve.plan.footprint import Precision, expert_bytes
from moeserve.plan.hardware import HardwareProfile
from moeserve.plan.placement import PlanRequest, candidates, plan_placement
from moeserve.spec import ModelSpec

SPEC = ModelSpec.from_hf_config(MIXTRAL_CONFIG)
HW = HardwareProfile.from_dict(H100)
BANDWIDTH = 2e9  # a fake disk: 2 GB/s


def request(host_gib: float, **options) -> PlanRequest:
    """Mixtral-8x7B at 12 GiB of GPU memory, 24 of its MoE layers' 4-bit experts on the CPU, no GPU cache slots."""
    return PlanRequest(12 * GiB, int(host_gib * GiB), 2, kv_tokens=640, bits=4, cpu_layers=24, cache_slots=0,
                       dense_bits=16, **options)


def test_disk_tier_adds_the_misses_over_the_disk_bandwidth():
    (in_ram,) = candidates(SPEC, HW, request(200))
    assert in_ram.fits and not in_ram.disk_cache
    (short,) = candidates(SPEC, HW, request(10))  # 10 GiB cannot hold 24 layers' 4-bit experts (~18 GiB)
    assert not short.fits and "host RAM" in short.problem
    short, disk_tier = candidates(SPEC, HW, request(10, disk_bandwidth=BANDWIDTH))
    assert not short.fits and disk_tier.fits and disk_tier.cache_slots == 0
    other = sum(v for k, v in in_ram.footprint.host.items() if k != "expert store")
    cache = 10 * GiB - other
    assert disk_tier.disk_cache == cache == disk_tier.footprint.host["disk tier RAM cache"]
    assert disk_tier.host_bytes == 10 * GiB
    eb = expert_bytes(SPEC, Precision.hqq(4, 64))
    store = 24 * 8 * eb  # the CPU layers' experts as they run (the in-RAM run's copies and repacks: twice that)
    assert in_ram.footprint.host["expert store"] > 2 * store
    read = 24 * SPEC.moe.top_k * eb * (1 - cache / store)  # a token's experts of the CPU layers, missed
    assert disk_tier.disk_bytes == pytest.approx(read)
    assert 1 / disk_tier.decode_tok_s - 1 / in_ram.decode_tok_s == pytest.approx(read / BANDWIDTH)
    assert disk_tier.prefill_tok_s < in_ram.prefill_tok_s
    assert "read from disk into a" in disk_tier.where()
    assert disk_tier.flags()[-4:] == ["--offload", "STORE", "--cpu-memory", disk_tier.flags()[-1]]
    # twice the bandwidth: the disk's share of the time halves
    (_, faster) = candidates(SPEC, HW, request(10, disk_bandwidth=2 * BANDWIDTH))
    assert 1 / faster.decode_tok_s - 1 / in_ram.decode_tok_s == pytest.approx(read / (2 * BANDWIDTH))


def test_disk_tier_is_chosen_only_where_ram_is_short():
    """The planner's own choice (no placement flags) with a small host budget takes a disk-tier candidate; with
    room in RAM none is rated; a budget below one token's experts of a layer gets none."""
    free = PlanRequest(12 * GiB, 200 * GiB, 2, kv_tokens=640, disk_bandwidth=BANDWIDTH)
    assert not any(c.disk_cache for c in candidates(SPEC, HW, free))
    plan = plan_placement(SPEC, HW, dataclasses.replace(free, host_ram=8 * GiB))
    assert plan.chosen.disk_cache > 0 and plan.chosen.disk_bytes > 0 and plan.chosen.cache_slots == 0
    with pytest.raises(MoeserveError, match="not enough host RAM"):
        plan_placement(SPEC, HW, dataclasses.replace(free, host_ram=8 * GiB, disk_bandwidth=None))
    tiny = dataclasses.replace(free, host_ram=GiB // 8)  # less than two (top-2) 3-bit experts
    assert not any(c.disk_cache for c in candidates(SPEC, HW, tiny))


def test_cli_plan_prints_the_disk_tier(capsys, mixtral, h100_json, expect_cli_error):
    base = ["plan", "--model", mixtral, "--profile", h100_json, "--gpu-memory", "12GiB", "--cpu-memory", "8GiB"]
    assert main([str(a) for a in base + ["--disk-bandwidth", "2GB"]]) == 0
    out = capsys.readouterr().out
    assert "disk tier: the store read at 1.9 GiB/s (--disk-bandwidth)" in out
    chosen = [ln for ln in out.splitlines() if ln.startswith("*  ")]
    assert len(chosen) == 1 and "read from disk into a" in chosen[0] and "(disk tier: " in chosen[0]
    assert "disk tier RAM cache" in out and "--offload STORE --cpu-memory" in out
    assert main([str(a) for a in base + ["--disk-bandwidth", "2GB", "--json"]]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["disk_bandwidth"] == 2e9 and report["candidates"][report["chosen"]]["disk_bytes_per_token"] > 0
    expect_cli_error(base + ["--disk-bandwidth", "fast"], "--disk-bandwidth 'fast' is not a size")
    expect_cli_error(base + ["--for", "batch", "--disk-bandwidth", "2GB"], "--disk-bandwidth rates placements")


def write_store(path, sizes):
    path.mkdir()
    for i, n in enumerate(sizes):
        (path / f"experts-layer-{i:05d}.safetensors").write_bytes(os.urandom(n))


def test_store_read_bandwidth_is_measured_once_per_device(tmp_path, monkeypatch):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "store"
    write_store(store, [3 << 20, 1 << 20])
    assert disk.store_files(store)[0].name == "experts-layer-00000.safetensors"  # largest first
    rate, _ = disk.read_bandwidth(disk.store_files(store), nbytes=2 << 20)
    assert rate > 0
    measured = disk.store_read_bandwidth(store)
    cached = json.loads(disk.cache_path(store).read_text())
    assert cached["read_bytes_per_s"] == measured and disk.cache_path(store).name.startswith("disk-")
    monkeypatch.setattr(disk, "read_bandwidth", lambda *a, **k: pytest.fail("measured again"))
    other = tmp_path / "other"  # another store on the same device: the device's figure
    write_store(other, [1 << 20])
    assert disk.store_read_bandwidth(other) == measured
    with pytest.raises(MoeserveError, match="holds no expert store layer files"):
        disk.store_files(tmp_path / "cache")
