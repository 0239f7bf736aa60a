"""Decoder-layer weights on the GPU under a policy: the resident layers copied once, the others streamed from
pinned host memory into two GPU buffers per layer kind (double buffering), the next one copied on the copy
stream while the current one computes.

A streamed layer is copied in pages of at most PAGE_BYTES: one copy of a whole expert stack (1.9 GB for
Mixtral's gate/up) may hold the host->GPU copy engine for ~35 ms, and the pipeline's other transfers in that
direction (CPU attention outputs, FlexGen KV) would wait behind it; between pages they wait ~0.6 ms at most."""

from __future__ import annotations

import copy

import torch
from torch import nn

from moeserve.offload.transfer import Copier

PAGE_BYTES = 32 << 20  # bytes per copy of a streamed layer (~0.6 ms at 54 GB/s)


def layer_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer of module (a tensor shared by two names once): what a layer's
    compute reads besides its inputs, MXFP4 blocks and scales included."""
    return [*module.named_parameters(), *module.named_buffers()]


def placed_tensors(host: nn.Module, with_ffn: bool) -> list[tuple[str, torch.Tensor]]:
    """layer_tensors of a host decoder layer that its GPU twin holds: all, or all but the FFN's (mlp.*)."""
    return [(name, t) for name, t in layer_tensors(host) if with_ffn or not name.startswith("mlp.")]


def device_layer(host: nn.Module, device, with_ffn: bool) -> nn.Module:
    """An uninitialised twin of a host decoder layer on `device`: the same modules, each parameter and buffer an
    empty tensor of the host's shape and dtype (GPT-OSS keeps its norms in float32, MXFP4 blocks are uint8), the
    FFN left out when it runs on the CPU. Made by copying the module tree with the tensors swapped, so the twin
    computes as the host layer does, whatever its modules are."""
    memo = {}
    for _, t in placed_tensors(host, with_ffn):
        empty = torch.empty(t.shape, dtype=t.dtype, device=device)
        memo[id(t)] = nn.Parameter(empty, requires_grad=False) if isinstance(t, nn.Parameter) else empty
    if not with_ffn:
        memo[id(host.mlp)] = nn.Identity()
    return copy.deepcopy(host, memo).eval()


def tensor_pairs(dst: nn.Module, src: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destination, source) tensors of every parameter and buffer of dst, matched by name."""
    src_tensors = dict(layer_tensors(src))
    pairs = [(t.data, src_tensors[name].data) for name, t in layer_tensors(dst)]
    return [d for d, _ in pairs], [s for _, s in pairs]


def paged(dst: list[torch.Tensor], src: list[torch.Tensor], page_bytes: int):
    """(dst, src) pairs of equal shapes split into pairs of flat pages of at most page_bytes; a pair that is not
    contiguous on both sides stays whole."""
    dst_pages, src_pages = [], []
    for d, s in zip(dst, src):
        if d.is_contiguous() and s.is_contiguous():
            step = max(page_bytes // d.element_size(), 1)
            dst_pages += d.view(-1).split(step)
            src_pages += s.view(-1).split(step)
        else:
            dst_pages.append(d)
            src_pages.append(s)
    return dst_pages, src_pages


def pinned_size(nbytes: int, pinned: bool = True) -> int:
    """Host bytes a tensor of nbytes takes when pinned by torch, whose page-locked allocator rounds every block
    up to a power of two (a 2.7 GB KV cache takes 4 GiB)."""
    return 1 << (nbytes - 1).bit_length() if pinned and nbytes else nbytes


def host_weight_bytes(model: nn.Module, pinned: bool = True) -> int:
    """Host bytes the executor keeps for the model's weights: every layer (resident ones too: their host copies
    stay) plus embedding and head, each storage once (layers may share tensors), as torch pins them when
    `pinned` (only the layers are pinned: rounding the embedding too over-counts a little)."""
    storages = {t.data.untyped_storage().data_ptr(): t.data.untyped_storage().nbytes() for _, t in layer_tensors(model)}
    return sum(pinned_size(n, pinned) for n in storages.values())


def pin_host_weights(layers: nn.ModuleList) -> None:
    """Page-lock the host layers' parameters and buffers (once per storage: layers may share tensors) for async
    DMA."""
    pinned: dict[int, torch.Tensor] = {}
    for module in layers.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if not t.data.is_pinned():
                if t.data.data_ptr() not in pinned:
                    pinned[t.data.data_ptr()] = t.data.pin_memory()
                page_locked = pinned[t.data.data_ptr()]
                if isinstance(t, nn.Parameter):
                    t.data = page_locked
                else:
                    setattr(module, name, page_locked)


class LayerWeights:
    def __init__(self, layers: nn.ModuleList, resident: int, device, with_ffn: bool):
        """layers: the host model's decoder layers; the first `resident` of them stay on the GPU."""
        self.host, self.device, self.with_ffn = layers, torch.device(device), with_ffn
        self.cuda = self.device.type == "cuda"
        self.copier = Copier(self.device)
        self.resident = {i: self._copy_now(i) for i in range(resident)}
        self.streamed = list(range(resident, len(layers)))
        self.buffers: dict[tuple, list] = {}  # (slot, kind) -> [module, layer held, loaded, freed]
        self.bytes_streamed = 0

    def _copy_now(self, i: int) -> nn.Module:
        layer = device_layer(self.host[i], self.device, self.with_ffn)
        for d, s in zip(*tensor_pairs(layer, self.host[i])):
            d.copy_(s)
        return layer

    def _buffer(self, i: int) -> list:
        slot = self.streamed.index(i) % 2
        kind = self._kind(i)
        if (slot, kind) not in self.buffers:
            module = device_layer(self.host[i], self.device, self.with_ffn)
            self.buffers[slot, kind] = [module, None, self._event(), self._event()]
        return self.buffers[slot, kind]

    def _kind(self, i: int) -> tuple:
        """What the layers streamed through one buffer share: their tensors' names, shapes and dtypes (dense or MoE
        FFN, experts per layer) and whether attention rotates q and k (Llama-4's NoPE layers do not, and temper q
        instead; the pipeline gives each layer its own mask, so sliding windows may share)."""
        host = self.host[i]
        tensors = tuple((name, t.shape, t.dtype) for name, t in placed_tensors(host, self.with_ffn))
        return tensors, getattr(host.self_attn, "rotary", True)

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _load(self, i: int) -> None:
        """Queue the copy of host layer i into its buffer, after the compute that last read the buffer."""
        buf = self._buffer(i)
        if buf[1] == i:
            return
        dst, src = tensor_pairs(buf[0], self.host[i])
        self.copier.load(*paged(dst, src, PAGE_BYTES), after=buf[3], done=buf[2])
        self.bytes_streamed += sum(s.nbytes for s in src)
        buf[1] = i

    def get(self, i: int) -> nn.Module:
        """Layer i ready for the compute stream; starts copying the next streamed layer (cyclically)."""
        if i in self.resident:
            return self.resident[i]
        self._load(i)
        buf = self._buffer(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(buf[2])
        nxt = self.streamed[(self.streamed.index(i) + 1) % len(self.streamed)]
        if self._buffer(nxt) is not buf:  # an odd count wraps onto the busy buffer: that one loads when needed
            self._load(nxt)
        return buf[0]

    def release(self, i: int) -> None:
        """The compute queued so far is the last to read layer i: its buffer may be refilled after it."""
        if i not in self.resident and self.cuda:
            self._buffer(i)[3].record(torch.cuda.current_stream(self.device))
