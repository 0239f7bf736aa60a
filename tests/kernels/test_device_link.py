"""The CPU end of the device link (kernels/cpu/device_link.py), driven from Python as a device would drive it:
inputs written to the shared buffers, then the ask word; the answer word and the output compared with the same
layer computed by one moe_layer call. The device end (a CUDA kernel waiting on host memory) is covered by the GPU
tests (tests/hybrid/test_gpu_hybrid.py)."""

import time

import pytest
import torch

from moeserve.kernels.cpu import gemv
from moeserve.kernels.cpu.device_link import SEQ_SHIFT, CpuLinkEnd, ask_word
from moeserve.kernels.cpu.gemv import pack_for_cpu
from moeserve.quant import hqq

E, D, F, K, GROUP, ROWS = 6, 128, 96, 2, 32, 8


def random_layer(kernel, bits: int) -> gemv.LayerExperts:
    quantized = [(hqq.quantize_rtn(torch.randn(2 * F, D), bits, GROUP), hqq.quantize_rtn(torch.randn(D, F), bits,
                                                                                          GROUP)) for _ in range(E)]
    return gemv.LayerExperts.of(*[[pack_for_cpu(q.codes, q.scale, q.zero, bits, GROUP, kernel) for q in qs]
                                  for qs in zip(*quantized)])


def answered(end: CpuLinkEnd, word: int, timeout: float = 20.0) -> int:
    """Write the ask word, then wait for the answer word to reach its step (as the device's wait kernel does)."""
    b = end.buffers
    b.ask[0] = word
    want = word >> SEQ_SHIFT << SEQ_SHIFT
    deadline = time.monotonic() + timeout
    while int(b.answer[0]) < want:
        assert time.monotonic() < deadline, "the CPU end did not answer"
        time.sleep(1e-4)
    return int(b.answer[0])


@pytest.fixture
def kernel():
    kernel = gemv.default_kernel(4)
    if kernel is None:
        pytest.skip("no C compiler for the generated CPU kernels here")
    return kernel


def test_asked_layers_equal_one_native_call(kernel):
    """Two layers asked in turn, at 1 and several tokens, for many steps: each answer is the step's own and each
    output equals moe_layer on the same inputs, bit for bit; the counts say what ran."""
    layers = {3: random_layer(kernel, 4), 5: random_layer(kernel, 4)}
    end = CpuLinkEnd(kernel, num_layers=8, rows=ROWS, hidden=D, top_k=K, threads=2, cpu=-1, spin_us=100, pin=False)
    try:
        for layer, experts in layers.items():
            end.register(layer, experts, K)
        b, seq, rows, pairs = end.buffers, 0, 0, 0
        for step in range(12):
            layer, T = (3, 1) if step % 2 else (5, 1 + step % ROWS)
            x, ids = torch.randn(T, D), torch.stack([torch.randperm(E)[:K] for _ in range(T)])  # [T, D], [T, k]
            wts = torch.rand(T, K)
            if step % 3 == 2:  # some pairs computed elsewhere (a GPU cache slot): negative ids, skipped
                ids = torch.where(torch.rand(T, K) < 0.5, -1, ids)
            b.x[:T], b.ids[:T], b.wts[:T] = x, ids, wts
            seq += 1
            assert answered(end, ask_word(seq, layer, T)) == seq << SEQ_SHIFT
            kept = ids >= 0
            want = gemv.moe_layer(kernel, layers[layer], x, ids.clamp(min=0), wts, kept, threads=2)
            assert torch.equal(b.out[:T], want)
            rows, pairs = rows + T, pairs + int(kept.sum())
        assert end.counts() == (12, rows, 0, pairs)
    finally:
        end.close()


def test_pings_and_bad_asks_are_answered(kernel):
    """A ping (0 tokens) is answered without work; an ask for a layer with no entry, or for more rows than the
    buffers hold, is answered with zeros and counted as an error (the device never waits forever)."""
    end = CpuLinkEnd(kernel, num_layers=4, rows=ROWS, hidden=D, top_k=K, threads=2, cpu=-1, spin_us=0, pin=False)
    try:
        end.register(1, random_layer(kernel, 4), K)
        time.sleep(0.01)  # past the spin window: the thread now polls
        answered(end, ask_word(1, 2, 0))
        assert end.counts() == (0, 0, 0, 0)
        end.buffers.out.fill_(7.0)
        answered(end, ask_word(2, 2, 3))  # layer 2 has no entry
        assert end.counts() == (1, 3, 1, 0) and torch.all(end.buffers.out[:3] == 0)
        answered(end, ask_word(3, 1, ROWS + 1))  # more rows than the buffers
        assert end.counts()[2] == 2
    finally:
        end.close()


def test_other_widths_are_refused(kernel):
    three = gemv.default_kernel(3)
    if three is None:
        pytest.skip("no 3-bit kernel")
    end = CpuLinkEnd(kernel, num_layers=2, rows=ROWS, hidden=D, top_k=K, threads=1, cpu=-1, spin_us=0, pin=False)
    try:
        with pytest.raises(ValueError, match="3-bit experts"):
            end.register(0, random_layer(three, 3), K)
        with pytest.raises(ValueError, match="outside"):
            CpuLinkEnd(kernel, num_layers=2, rows=5000, hidden=D, top_k=K, threads=1, cpu=-1, spin_us=0, pin=False)
    finally:
        end.close()
