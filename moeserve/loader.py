"""Build a MoETransformer from a checkpoint directory, streaming one tensor at a time to its device."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from moeserve.checkpoint import CheckpointReader, read_tensor
from moeserve.errors import MoeserveError
from moeserve.model.layers import RotaryEmbedding
from moeserve.model.transformer import MoETransformer
from moeserve.quant.compress import install_quantized_modules, read_manifest
from moeserve.quant.qlinear import QuantizedLinear
from moeserve.spec import ModelSpec

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise MoeserveError(f"unknown device {device!r} (use cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MoeserveError("device 'cuda' requested but no CUDA GPU is available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU, fp32 on a CPU (CPU bf16 matmuls are slow on most hosts)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise MoeserveError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, is_buffer: bool) -> None:
    *path, leaf = name.split(".")
    module = model.get_submodule(".".join(path))
    setattr(module, leaf, value if is_buffer else nn.Parameter(value, requires_grad=False))


def _tensors_to_load(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, meta tensor, is_buffer): every parameter, plus the packed buffers of quantized layers."""
    out = [(n, p, False) for n, p in model.named_parameters()]  # tied lm_head appears once
    for prefix, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            out += [(f"{prefix}.{n}", b, True) for n, b in module.named_buffers()]
    return out


def _is_routed_expert(name: str) -> bool:
    return name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))


def load_model(path: str | Path, device=None, dtype=None, progress: bool = False,
               routed_experts: bool = True) -> MoETransformer:
    """routed_experts=False leaves the routed expert weights unread (on the meta device) for a backend
    that brings its own, e.g. offload.enable_offload."""
    device = resolve_device(device)
    spec = ModelSpec.from_dir(path)
    dtype = resolve_dtype(dtype, device)
    reader = CheckpointReader(path)
    manifest = read_manifest(Path(path))
    with torch.device("meta"):
        model = MoETransformer(spec)
        if manifest:
            install_quantized_modules(model, manifest)
    tensors = [t for t in _tensors_to_load(model) if routed_experts or not _is_routed_expert(t[0])]
    for name, meta, is_buffer in tqdm(tensors, desc="loading weights", unit="tensor", disable=not progress,
                                      leave=False, delay=1.0):
        t = read_tensor(reader, name, spec.family, spec.num_experts)
        if tuple(t.shape) != tuple(meta.shape):
            raise MoeserveError(f"tensor {name} has shape {tuple(t.shape)}, config.json implies {tuple(meta.shape)}")
        # quantized buffers keep their stored dtypes (packed int32, fp16 scales, ...)
        _set_tensor(model, name, t.to(device=device, dtype=meta.dtype if is_buffer else dtype), is_buffer)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = RotaryEmbedding(spec).to(device)
    return model.eval()
