"""A MoETransformer from a checkpoint directory: the meta model (its resident experts from moeserve/factory.py) and
the read pass that fills it, streaming one tensor at a time to its device."""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

import torch
from torch import nn

from moeserve.checkpoint import CheckpointReader, read_tensor, tensor_experts
from moeserve.errors import MoeserveError
from moeserve.factory import ExpertSources, place_experts
from moeserve.model.layers import RotaryEmbedding
from moeserve.model.transformer import MoETransformer
from moeserve.progress import Progress, track
from moeserve.plan.layers import LayerPlacement, resident_layers
from moeserve.quant.defaults import DENSE_BITS
from moeserve.quant.dense import DENSE_GROUP, convertible, quantize_linear, replace_module
from moeserve.quant.manifest import install_quantized_dense, read_manifest, stored_to_current
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
    """The routed expert weights, also inside a tensor-parallel wrapper (...mlp.experts.inner.down_proj)."""
    return re.search(r"\.mlp\.experts\.(\w+\.)?(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$", name) is not None


def meta_model(path: str | Path, layers: tuple[LayerPlacement, ...] | None = None) -> MoETransformer:
    """The model of checkpoint `path` with every tensor on the meta device: shapes only, nothing read yet
    (parallel loading cuts it to a rank's part before reading, see moeserve.parallel.loading). layers: the MoE
    layers whose experts the factory makes now (default: every one as the checkpoint stores them); the others keep
    the model code's float experts, unread, until the build places them."""
    spec = ModelSpec.from_dir(path)
    manifest = read_manifest(Path(path))
    with torch.device("meta"):
        model = MoETransformer(spec)
        if manifest:
            install_quantized_dense(model, manifest)
    # the factory does not look at the float width: any dtype_bytes describes the checkpoint's experts
    layers = resident_layers(spec, 2, manifest) if layers is None else layers
    place_experts(model, layers, ExpertSources(spec, manifest))
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
    with Progress(len(tensors), "loading weights", "tensors", progress, transient=True) as bar:
        for names, meta, is_buffer in tensors:  # an error closes the bar (by `with`), so it prints on its own line
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
            bar.update(1)
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
    for name in track(names, "quantizing dense layers", "layers", progress, transient=True):
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


def read_model(model: MoETransformer, reader: CheckpointReader, device: torch.device, dtype: torch.dtype,
               dense_bits: int = 16, skip=None, progress: bool = False) -> MoETransformer:
    """Fill `model`'s meta tensors from the checkpoint, each tensor read once: dense_bits 8 reads the dense part's
    linear layers first and quantizes each as it is read (read_dense_quantized), then read_weights reads the rest
    but what skip(name) leaves for a backend."""
    if dense_bits not in DENSE_BITS:
        raise MoeserveError(f"--dense-bits {dense_bits} is not one of {', '.join(map(str, DENSE_BITS))}")
    if dense_bits != 16:
        skip = skipping_modules(read_dense_quantized(model, reader, device, dtype, dense_bits, progress), skip)
    return read_weights(model, reader, device, dtype, skip, progress=progress)


def unread_layers(layers: Collection[int]):
    """read_weights' skip(name) for the routed experts of MoE layers `layers`, which a backend brings."""
    skipped = {int(i) for i in layers}
    return lambda name: is_routed_expert(name) and int(name.split(".")[2]) in skipped


def load_model(path: str | Path, device=None, dtype=None, progress: bool = False,
               routed_experts: bool | Collection[int] = True, dense_bits: int = 16) -> MoETransformer:
    """Every tensor of a checkpoint on one device (the resident model, what tests and benchmarks start from; a run
    builds through moeserve.build). routed_experts=False leaves the routed expert weights unread (on the meta
    device) for a backend that brings its own; a collection of layer indices reads only those layers'. dense_bits
    8: the dense part's linear layers as 8-bit HQQ copies (quant/dense.py), quantized as they are read."""
    device = resolve_device(device)
    model = meta_model(path)
    dtype = resolve_dtype(dtype, device)
    moe = model.spec.moe.layer_indices()
    kept = moe if routed_experts is True else () if routed_experts is False else {int(i) for i in routed_experts}
    skip = unread_layers([i for i in moe if i not in kept])
    return read_model(model, CheckpointReader(path), device, dtype, dense_bits, skip, progress)
