"""moeserve.build: the per-layer placements it reads (plan/layers.py), the factory's table of what it builds, and
its one read pass: a hybrid run reads each stored checkpoint tensor at most once (the store's experts included),
and builds what the loaded-then-placed path builds (CPU, fp32)."""

from collections import Counter

import pytest
import torch

import moeserve
import moeserve.checkpoint
from moeserve.build import build
from moeserve.errors import MoeserveError
from moeserve.factory import FACTORY, ExpertSources, check_layers, experts_module
from moeserve.hybrid.setup import build_store, enable_hybrid, store_layers
from moeserve.llm import run_config
from moeserve.plan.footprint import Precision
from moeserve.plan.layers import CACHED, GPU, HOST, LayerPlacement
from moeserve.runtime import prepare

# per-expert and fused tensors, biases, a dense first layer; 4-bit where the tiny shapes divide into groups
RUNS = [("mixtral", 4), ("gpt_oss", 16), ("deepseek_v3", 16)]


class CountingHandle:
    """A safetensors handle that counts the tensors read through it (whole or a slice) by stored name."""

    def __init__(self, handle, counts: Counter):
        self.handle, self.counts = handle, counts

    def get_tensor(self, name):
        self.counts[name] += 1
        return self.handle.get_tensor(name)

    def get_slice(self, name):
        self.counts[name] += 1
        return self.handle.get_slice(name)

    def __getattr__(self, attr):
        return getattr(self.handle, attr)


@pytest.fixture
def reads(monkeypatch):
    """Stored name -> times read, for every checkpoint handle opened while the test runs."""
    counts: Counter = Counter()
    opener = moeserve.checkpoint.safe_open
    monkeypatch.setattr(moeserve.checkpoint, "safe_open", lambda *a, **k: CountingHandle(opener(*a, **k), counts))
    return counts


@pytest.mark.parametrize("family,bits", RUNS)
def test_hybrid_build_reads_each_tensor_once(hf_checkpoints, reads, family, bits):
    """--n-cpu-moe 1 (float: the store holds the CPU layer; 4-bit: every MoE layer, the resident ones as its low-bit
    copies): every stored tensor is read, none twice; the model equals the one placed on a loaded model
    (hybrid/setup.py build_store, which reads the checkpoint on its own) on fresh random tokens."""
    path = hf_checkpoints[family][1]
    run = build(prepare(run_config(str(path), n_cpu_moe=1, experts_bits=bits)), progress=False)
    stored = set(moeserve.checkpoint.CheckpointReader(path).keys())
    assert set(reads) == stored, sorted(stored ^ set(reads))[:3]
    assert max(reads.values()) == 1, [n for n, c in reads.items() if c > 1][:3]
    assert run.hybrid is not None

    placement = run.plan.hybrid
    kept = set(store_layers(placement))
    model = moeserve.load_model(path, routed_experts=[i for i in placement.moe_layers if i not in kept])
    enable_hybrid(model, build_store(path, placement, model.dtype, model.device, progress=False), placement)
    tokens = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(len(family) + bits))
    torch.testing.assert_close(run.model(tokens), model(tokens), rtol=0, atol=0)


def test_layers_of_each_placement(hf_checkpoints, tmp_path):
    """RunPlan.layers: resident layers on the model device as the checkpoint stores them; a low-bit hybrid run's CPU
    layers in host RAM and its resident ones as the store's low-bit copies; offload caches every layer."""
    path = str(hf_checkpoints["mixtral"][1])
    moe = moeserve.ModelSpec.from_dir(path).moe.layer_indices()
    resident = prepare(run_config(path)).layers(4)
    assert [(p.layer, p.key) for p in resident] == [(i, (GPU, "float", False)) for i in moe]
    hybrid = prepare(run_config(path, n_cpu_moe=1, experts_bits=4)).layers(4)
    assert [p.key for p in hybrid] == [(HOST, "hqq", True)] + [(GPU, "hqq", True)] * (len(moe) - 1)
    assert {(p.precision.bits, p.precision.group) for p in hybrid} == {(4, 16)}
    store = tmp_path / "store"
    moeserve.offload.store.ExpertStore.build(path, store, low_bits=4, group=8, progress=False)
    offload = prepare(run_config(path, offload=str(store), high_slots=4)).layers(4)
    assert {p.key for p in offload} == {(CACHED, "float", True)} and all(p.mixed for p in offload)


@pytest.mark.parametrize("placement", [LayerPlacement(3, CACHED, Precision.hqq(4, 64), stored=True),
                                       LayerPlacement(3, HOST, Precision.float(2)),
                                       LayerPlacement(3, "disk", Precision.float(2), stored=True)])
def test_unknown_combination_is_refused_in_one_line(hf_checkpoints, placement):
    """A (residency, precision, source) the table lacks: one line naming the layer and the combination, before
    anything is built."""
    assert placement.key not in FACTORY
    spec = moeserve.ModelSpec.from_dir(hf_checkpoints["mixtral"][1])
    for call in (lambda: check_layers((placement,)), lambda: experts_module(placement, ExpertSources(spec))):
        with pytest.raises(MoeserveError, match=r"^MoE layer 3: no expert backend runs experts placed ") as e:
            call()
        assert "\n" not in str(e.value) and placement.describe() in str(e.value)
