"""Build a MoETransformer from a checkpoint directory, streaming one tensor at a time to its device."""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from moeserve.checkpoint import CheckpointReader, read_tensor, tensor_experts
from moeserve.errors import MoeserveError
from moeserve.model.layers import RotaryEmbedding
from moeserve.model.transformer import MoETransformer
from moeserve.quant.defaults import DENSE_BITS
from moeserve.quant.dense import DENSE_GROUP, convertible, quantize_linear, replace_module
from moeserve.quant.manifest import install_quantized_modules, is_quantized_expert, read_manifest, stored_to_current
from moeserve.quant.mxfp4 import use_stored_experts
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


def set_tensor(model: nn.Module, name: str, value: torch.Tensor, is_buffer: bool) -> None:
    """A Parameter is set as it is, so that the names of a tied tensor keep sharing one."""
    *path, leaf = name.split(".")
    module = model.get_submodule(".".join(path))
    keep = is_buffer or isinstance(value, nn.Parameter)
    setattr(module, leaf, value if keep else nn.Parameter(value, requires_grad=False))


def tensors_to_load(model: nn.Module) -> list[tuple[list[str], torch.Tensor, bool]]:
    """(names, meta tensor, is_buffer): every parameter once, under all the names it has (a tied head shares
    the embedding's, also after vocab-parallel surgery), plus the packed buffers of quantized layers."""
    names: dict[int, list[str]] = {}
    params = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    out = [(names[i], p, False) for i, p in params.items()]
    for prefix, module in model.named_modules():
        if isinstance(module, QuantizedLinear) or getattr(module, "PACKED_BUFFERS", False):
            out += [([f"{prefix}.{n}"], b, True) for n, b in module.named_buffers()]
    return out


def is_routed_expert(name: str) -> bool:
    """The routed expert weights, also inside a tensor-parallel wrapper (...mlp.experts.inner.down_proj), and a
    quantized checkpoint's (each expert's QuantizedLinear buffers)."""
    return (re.search(r"\.mlp\.experts\.(\w+\.)?(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$", name) is not None
            or is_quantized_expert(name))


def meta_model(path: str | Path) -> MoETransformer:
    """The model of checkpoint `path` with every tensor on the meta device: shapes only, nothing read yet
    (parallel loading cuts it to a rank's part before reading, see moeserve.parallel.loading)."""
    spec = ModelSpec.from_dir(path)
    manifest = read_manifest(Path(path))
    with torch.device("meta"):
        model = MoETransformer(spec)
        use_stored_experts(model)  # MXFP4 experts as shipped
        if manifest:
            install_quantized_modules(model, manifest)
    return model


def read_weights(model: MoETransformer, reader: CheckpointReader, device: torch.device, dtype: torch.dtype,
                 skip=None, index_of=None, progress: bool = False) -> MoETransformer:
    """Fill the meta tensors of `model` from the checkpoint on `device` and return it ready to run.

    skip(name): leave that tensor on the meta device (a backend brings its own). index_of(name): the part
    (a tuple of slices) of the stored tensor to read, None for all of it: a tensor-parallel rank reads only
    its slice, and the tensor's meta shape is that of the slice."""
    spec = model.spec
    manifest = read_manifest(reader.path)  # None for a float checkpoint
    tensors = [t for t in tensors_to_load(model) if skip is None or not skip(t[0][0])]
    with tqdm(tensors, desc="loading weights", unit="tensor", disable=not progress, leave=False, delay=1.0) as bar:
        for names, meta, is_buffer in bar:  # an error clears the bar (closed by `with`), so it prints on its own line
            name = names[0]
            t = read_tensor(reader, name, spec.family, tensor_experts(spec, name),
                            None if index_of is None else index_of(name))
            if tuple(t.shape) != tuple(meta.shape):
                raise MoeserveError(f"tensor {name} has shape {tuple(t.shape)}, config.json implies "
                                    f"{tuple(meta.shape)}")
            if is_buffer:
                t = stored_to_current(manifest, name, t)  # an older format's 3-bit rows, in this moeserve's layout
            # quantized buffers keep their stored dtypes (packed int32, fp16 scales, ...)
            t = t.to(device=device, dtype=meta.dtype if is_buffer else _param_dtype(model, name, dtype))
            t = t if is_buffer else nn.Parameter(t, requires_grad=False)
            for alias in names:
                set_tensor(model, alias, t, is_buffer)
    model.rotary = RotaryEmbedding(spec).to(device)
    return model.eval()


def _param_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """float32 for the tensors their module keeps in float32 (FP32_TENSORS: DeepSeek's router), else dtype."""
    path, leaf = name.rsplit(".", 1)
    return torch.float32 if leaf in getattr(model.get_submodule(path), "FP32_TENSORS", ()) else dtype


def read_dense_quantized(model: MoETransformer, reader: CheckpointReader, device: torch.device, dtype: torch.dtype,
                         bits: int, progress: bool = False) -> set[str]:
    """Read the dense linear layers quant/dense.py converts (those of the meta model that are plain nn.Linear) one at a
    time and put each on `device` as a B-bit HQQ QuantizedLinear (its bias in dtype): only one layer's float weight is
    on the device at once, so the load stays within what the 8-bit dense part needs. Returns the modules replaced
    (read_weights must skip their tensors)."""
    spec = model.spec
    names = convertible(model)
    for name in tqdm(names, desc="quantizing dense layers", unit="layer", disable=not progress, leave=False, delay=1.0):
        bias = None
        if model.get_submodule(name).bias is not None:
            bias = read_tensor(reader, name + ".bias", spec.family, tensor_experts(spec, name)).to(device, dtype)
        weight = read_tensor(reader, name + ".weight", spec.family, tensor_experts(spec, name)).to(device)
        replace_module(model, name, quantize_linear(weight, bias, bits, DENSE_GROUP))
    return set(names)


def skipping_modules(modules: set[str], skip=None):
    """read_weights' skip(name) that also skips the tensors of `modules` (already in place), besides what `skip`
    skips."""
    return lambda name: name.rsplit(".", 1)[0] in modules or (skip is not None and skip(name))


def load_model(path: str | Path, device=None, dtype=None, progress: bool = False,
               routed_experts: bool | Collection[int] = True, dense_bits: int = 16) -> MoETransformer:
    """routed_experts=False leaves the routed expert weights unread (on the meta device) for a backend
    that brings its own, e.g. offload.enable_offload; a collection of layer indices reads only those layers'
    (the hybrid backend brings the others'). dense_bits 8: the dense part's linear layers as 8-bit HQQ copies
    (quant/dense.py), quantized as they are read."""
    if dense_bits not in DENSE_BITS:
        raise MoeserveError(f"--dense-bits {dense_bits} is not one of {', '.join(map(str, DENSE_BITS))}")
    device = resolve_device(device)
    model = meta_model(path)
    dtype = resolve_dtype(dtype, device)
    if routed_experts is True:
        skip = None
    elif routed_experts is False:
        skip = is_routed_expert
    else:
        layers = {int(i) for i in routed_experts}
        skip = lambda name: is_routed_expert(name) and int(name.split(".")[2]) not in layers  # noqa: E731
    reader = CheckpointReader(path)
    if dense_bits != 16:
        skip = skipping_modules(read_dense_quantized(model, reader, device, dtype, dense_bits, progress), skip)
    return read_weights(model, reader, device, dtype, skip, progress=progress)
