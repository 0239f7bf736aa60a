"""Generated CPU kernels (QIGen): every variant against a float64 reference, odd shapes, the compile
cache, the performance model, the PyTorch fallback, and the QuantizedLinear wiring."""

import warnings

import pytest
import torch

from moeserve.kernels.cpu import build, codegen, gemv, tuning
from moeserve.kernels.cpu.gemv import CpuKernel, pack_for_cpu, packed_sizes, unpacked_for_cpu
from moeserve.kernels.cpu.machine import ISAS, cpu_info
from moeserve.quant import hqq
from moeserve.quant.qlinear import QuantizedLinear

ISAS_HERE = cpu_info().isas  # e.g. avx512, avx2, portable
TILE = {"avx512": (3, 2), "avx2": (2, 2), "portable": (2, 1)}


@pytest.fixture(scope="module")
def kernels():
    return {(isa, bits): CpuKernel(isa, bits, *TILE[isa]) for isa in ISAS_HERE for bits in (2, 3, 4, 8)}


def reference(x, qw):
    """float64: sum over groups of s * (q - z) . x."""
    W = (qw.codes.double().reshape(qw.shape[0], -1, qw.group) - qw.zero.double().unsqueeze(-1)) \
        * qw.scale.double().unsqueeze(-1)
    return x.double() @ W.reshape(qw.shape).T


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_every_variant_matches_float64(kernels, isa, bits):
    kernel = kernels[(isa, bits)]
    out_features, in_features = 100, 384  # 100 outputs: not a whole tile (padding)
    W = torch.randn(out_features, in_features)
    for group in (32, 64, 128, in_features):  # per-channel = one group per row
        qw = hqq.quantize_rtn(W, bits, group)
        packed = pack_for_cpu(qw.codes, qw.scale, qw.zero, bits, group, kernel)
        for rows in (1, 2, 5, 8, 16):
            x = torch.randn(rows, in_features)
            y = kernel(x, packed, threads=2)
            ref = reference(x, qw)
            assert y.shape == (rows, out_features)
            err = (y.double() - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, (isa, bits, group, rows, float(err))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpacking_the_kernel_layout_gives_the_stored_weight_back(kernels, bits):
    """unpacked_for_cpu inverts pack_for_cpu (the disk tier keeps experts in the kernel's layout and unpacks them for a
    prompt's matmul): the packed words, scales and zeros of a QuantizedLinear, bit for bit, at packed_sizes' bytes."""
    kernel = kernels[(ISAS_HERE[0], bits)]
    q = QuantizedLinear.from_quantized(hqq.quantize_hqq(torch.randn(100, 192), bits, 64))  # 100: padded rows
    packed = pack_for_cpu(q.qweight, q.scale, q.zero, bits, 64, kernel, packed_words=True)
    for got, want in zip(unpacked_for_cpu(packed), (q.qweight, q.scale, q.zero), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert packed_sizes(100, 192, bits, 64, kernel) == tuple(t.numel() * t.element_size()
                                                              for t in (packed.words, packed.scale, packed.zero))


def test_threads_do_not_change_the_result(kernels):
    kernel = kernels[(ISAS_HERE[0], 4)]
    qw = hqq.quantize_hqq(torch.randn(256, 512), 4, 64)
    packed = pack_for_cpu(qw.codes, qw.scale, qw.zero, 4, 64, kernel)
    x = torch.randn(3, 512)
    assert torch.equal(kernel(x, packed, threads=1), kernel(x, packed, threads=2))


def test_odd_shapes_are_rejected_or_fall_back(kernels):
    assert not gemv.supports(40, 8, 4) and not gemv.supports(96, 48, 3) and gemv.supports(96, 32, 3)
    qw = hqq.quantize_rtn(torch.randn(8, 48), 4, 16)
    with pytest.raises(ValueError, match="multiples of 32"):
        pack_for_cpu(torch.nn.functional.pad(qw.codes, (0, 16)), qw.scale, qw.zero, 4, 16, kernels[(ISAS_HERE[0], 4)])
    layer = QuantizedLinear.from_quantized(qw)  # 48 inputs: the PyTorch path
    x = torch.randn(2, 48)
    torch.testing.assert_close(layer(x), x @ hqq.dequantize(qw).T)
    assert getattr(layer, "_cpu_packed", None) is None


def test_quantized_linear_uses_the_kernel_for_few_rows_only():
    qw = hqq.quantize_hqq(torch.randn(96, 256), 3, 64)
    layer = QuantizedLinear.from_quantized(qw, bias=torch.randn(96))
    for shape in ((1, 256), (2, 7, 256), (40, 256)):
        x = torch.randn(*shape)
        torch.testing.assert_close(layer(x), x @ layer.weight().T + layer.bias, atol=1e-4, rtol=1e-4)
    assert getattr(layer, "_cpu_packed", None) is not None  # the 1- and 14-row calls went through it


@pytest.mark.parametrize("isa", ISAS_HERE)
def test_batched_call_equals_one_call_per_weight(kernels, isa):
    """qgemm_batch: a layer's experts (one shape) in one parallel region give each expert's own result, bit for bit."""
    kernel = kernels[(isa, 4)]
    packed = [pack_for_cpu(*(lambda q: (q.codes, q.scale, q.zero))(hqq.quantize_rtn(torch.randn(100, 256), 4, 64)), 4,
                           64, kernel) for _ in range(3)]
    rows = [1, 5, 2]
    x = torch.randn(sum(rows), 256)
    y = kernel.batch(x, rows, packed, threads=2)
    assert torch.equal(y, torch.cat([kernel(x[s:s + n], p, threads=2) for p, s, n in zip(packed, (0, 1, 6), rows)]))


def test_quantized_linear_batch_takes_blocks_of_any_size():
    layers = [QuantizedLinear.from_quantized(hqq.quantize_hqq(torch.randn(64, 128), 4, 32)) for _ in range(2)]
    x = torch.randn(3, 128)
    if gemv.default_kernel(4) is None:
        pytest.skip("no C compiler for the generated CPU kernels here")
    y = gemv.quantized_linear_batch(layers, x, [1, 2])
    assert torch.equal(y, torch.cat([gemv.quantized_linear(layers[0], x[:1]), gemv.quantized_linear(layers[1], x[1:])]))
    x = torch.randn(40, 128)
    y = gemv.quantized_linear_batch(layers, x, [30, 10])  # prefill blocks too (QuantizedLinear dequantizes past 16)
    torch.testing.assert_close(y, torch.cat([layers[0](x[:30]), layers[1](x[30:])]), atol=1e-4, rtol=1e-4)
    other = QuantizedLinear.from_quantized(hqq.quantize_hqq(torch.randn(32, 128), 4, 32))
    assert gemv.quantized_linear_batch([layers[0], other], x, [1, 2]) is None  # shapes differ


def test_compiled_kernels_are_cached_and_rebuilt_when_the_source_changes(monkeypatch):
    isa = ISAS_HERE[-1]
    source = codegen.generate(isa, 4, 1, 1)
    lib = build.build(source, isa)
    mtime = lib.stat().st_mtime_ns

    def no_compiler(*a, **k):
        raise AssertionError("recompiled an unchanged kernel")

    monkeypatch.setattr(build.subprocess, "run", no_compiler)
    assert build.build(source, isa) == lib and lib.stat().st_mtime_ns == mtime
    monkeypatch.undo()
    changed = build.build(source + "\n// changed\n", isa)
    assert changed != lib and changed.is_file()


def test_a_compile_says_so_once_on_stderr_and_a_cached_load_says_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path))  # an empty cache: the first build compiles
    build.announce_compile.cache_clear()
    isa = ISAS_HERE[-1]
    source = codegen.generate(isa, 4, 1, 1) + "\n// announce\n"
    build.build(source, isa)
    build.build(source + "// another\n", isa)  # a second compile in the same process: no second line
    err = capsys.readouterr().err
    assert err.count("[compiling CPU kernels for") == 1 and err.strip().startswith("[") and err.endswith("]\n")
    build.announce_compile.cache_clear()
    build.build(source, isa)  # cached
    assert capsys.readouterr().err == ""


def test_performance_model():
    for isa in ISAS:
        regs = ISAS[isa][1]
        tiles = tuning.register_tiles(isa)
        assert tiles and all(m + 2 * m * t + t <= regs for m, t in tiles)
    m_b = tuning.k_block(4, 64, 64, l1_bytes=48 * 1024)
    assert m_b % 64 == 0 and 32 * m_b + 4 * m_b * 64 + 32 * 64 <= 48 * 1024 * 8
    assert 32 * (m_b + 64) + 4 * (m_b + 64) * 64 + 32 * 64 > 48 * 1024 * 8  # the largest that fits


def test_tuning_is_measured_once_and_stored(monkeypatch):
    isa = ISAS_HERE[-1]
    tile = gemv.tile_for(isa)
    assert tile in tuning.register_tiles(isa) and tuning.stored_tile(isa) == tile
    monkeypatch.setattr(gemv, "search_tile", lambda *a, **k: pytest.fail("searched again"))
    assert gemv.tile_for(isa) == tile


def test_without_a_compiler_the_pytorch_path_is_used_with_one_warning(monkeypatch):
    def missing():
        raise build.CompilerUnavailable("no C compiler found")

    monkeypatch.setattr(build, "compiler", missing)
    monkeypatch.setattr(build, "build", lambda *a: build.compiler())
    gemv.default_kernel.cache_clear()
    gemv._warn_once.cache_clear()
    try:
        layer = QuantizedLinear.from_quantized(hqq.quantize_rtn(torch.randn(64, 128), 4, 32))
        x = torch.randn(1, 128)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y1, y2 = layer(x), layer(x)
        assert sum("CPU kernels unavailable" in str(w.message) for w in caught) == 1
        torch.testing.assert_close(y1, x @ layer.weight().T)
        assert torch.equal(y1, y2)
    finally:
        gemv.default_kernel.cache_clear()


@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("bits", [3, 4])
def test_moe_layer_matches_float64_experts(kernels, isa, bits):
    """moe_layer: a layer's routed experts (grouping, gate/up, SwiGLU, down, weighted sum) in one native call equal
    float64 experts of the same dequantized weights, for decode rows, rows past a register tile and masked pairs."""
    kernel = kernels[(isa, bits)]
    E, D, F, k, group = 5, 128, 96, 2, 32
    quantized = [(hqq.quantize_rtn(torch.randn(2 * F, D), bits, group), hqq.quantize_rtn(torch.randn(D, F), bits, group))
                 for _ in range(E)]
    experts = gemv.LayerExperts.of(*[[pack_for_cpu(q.codes, q.scale, q.zero, bits, group, kernel) for q in qs]
                                     for qs in zip(*quantized)])
    for T in (1, 3, 20):
        x = torch.randn(T, D)
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])  # [T, k]
        weights = torch.rand(T, k)
        mask = torch.rand(T, k) > 0.3
        mask[0] = torch.tensor([True, False])  # a kept and a dropped pair whatever the draw
        y = gemv.moe_layer(kernel, experts, x, ids, weights, mask, threads=2)
        pending = gemv.moe_layer(kernel, experts, x, ids, weights, mask, threads=3, start=True)  # on the helpers
        assert torch.equal(pending.result(), y)  # each output is one thread's sum: the split does not change it
        skipped = torch.where(mask, ids, -1)  # a negative id: the pair is computed elsewhere, as masked out
        assert torch.equal(gemv.moe_layer(kernel, experts, x, skipped, weights, threads=2), y)
        ref = torch.zeros(T, D, dtype=torch.float64)
        for t in range(T):
            for j in range(k):
                if mask[t, j]:
                    gu, dn = quantized[int(ids[t, j])]
                    h = reference(x[t:t + 1], gu)  # [1, 2F]
                    ref[t] += weights[t, j].double() * reference(torch.nn.functional.silu(h[:, :F]) * h[:, F:], dn)[0]
        err = (y.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, (isa, bits, T, float(err))
    with pytest.raises(RuntimeError, match="code 3"):  # an expert id outside the layer
        gemv.moe_layer(kernel, experts, torch.randn(1, D), torch.tensor([[0, E]]), torch.rand(1, 2))
