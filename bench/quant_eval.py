"""bench/quality.py's machinery: each compression method applied in memory to one loaded float model, its weights
replaced by what the method's kernels compute with (the dequantized weight, plus U V for MiLo), restored before the
next method; the exact bytes the method's checkpoint holds, counted from the tensor shapes the format stores;
held-out perplexity and next-token accuracy; HOBBIT's per-token precision rule as an expert backend; GPTQ's
calibration Hessians.

Evaluating dequantized float weights instead of writing and loading a checkpoint per method keeps a 0.65B model's
60-row table within minutes on one GPU; a test checks that it gives the checkpoint's bytes and logits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.compress import QuantConfig, linear_tensors, quantize_weight
from moeserve.hybrid.memory import GROUPS as STORE_GROUPS, MIXED_LOW_BITS
from moeserve.kernels.pack import padded_length
from moeserve.model.experts import ExpertBackend, ResidentExperts, glu
from moeserve.offload.precision import HIGH, LOW, SKIP, choose_precision
from moeserve.quant import gptq, hqq, milo, mxfp4
from moeserve.quant.dense import DENSE_GROUP, dense_linears
from moeserve.quant.ranks import TensorInfo, assign_ranks, clamp_ranks, expert_frequency, parse_rank_policy, \
    weight_kurtosis

LOW_BITS = MIXED_LOW_BITS  # HOBBIT's low copies: what a mixed-precision store holds


@dataclass(frozen=True)
class Method:
    """One row of the table. kind: rtn | hqq | milo | gptq (bits, group; MiLo's ranks policy and compensator
    bits), mxfp4 (the experts in MXFP4, the rest float), dense8 (the dense linears in 8-bit HQQ, `--dense-bits
    8`), hobbit (the experts high or low or skipped per token by T1/T2; high_bits 16: float high copies and
    4-bit low ones, `--mixed-precision`; 4: 4-bit experts whose low-weight pairs are skipped, `--experts-bits 4
    --mixed-precision`)."""
    label: str
    kind: str
    bits: int = 16
    group: int = 64
    ranks: str = ""
    compensator_bits: int = 3
    t1: float = 1.0
    t2: float = 1.0
    high_bits: int = 16

    def fields(self) -> dict:
        """The row's record of its settings."""
        out = {"label": self.label, "method": self.kind, "bits": self.bits}
        if self.kind in ("rtn", "hqq", "milo", "gptq"):
            out["group"] = self.group
        if self.kind == "milo":
            out.update(ranks=self.ranks, compensator_bits=self.compensator_bits)
        if self.kind == "hobbit":
            out.update(t1=self.t1, t2=self.t2, high_bits=self.high_bits)
        return out


def quantized_bytes(shape: tuple[int, int], bits: int, group: int, rank: int = 0, compensator_bits: int = 16) -> int:
    """Bytes a QuantizedLinear of `shape` [out, in] stores: packed codes (rows padded to the packing unit), fp16
    scale and zero per group, and a rank-r compensator."""
    out, cols = shape
    return (out * padded_length(cols) * bits // 8 + 2 * 2 * out * (cols // group)
            + milo.compensator_bytes(shape, rank, compensator_bits))


def float_bytes(shape: tuple[int, ...]) -> int:
    return 2 * math.prod(shape)  # bf16, as the checkpoint stores it


class Weights:
    """A loaded float model's linear weights, by TensorInfo (compress.linear_tensors), writable in place, and the
    originals every method starts from."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.tensors = linear_tensors(model.spec)
        self.original = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.total_bytes = sum(float_bytes(tuple(p.shape)) for p in self.original.values())  # the bf16 checkpoint

    def view(self, t: TensorInfo) -> torch.Tensor:
        """The weight [out, in] of tensor t: a module's weight, or one expert's slice of its layer's stack."""
        if t.kind == "expert":
            stack, e = t.name.rsplit(".", 1)  # model.layers.i.mlp.experts.gate_up, e
            module, proj = stack.rsplit(".", 1)
            return getattr(self.model.get_submodule(module), f"{proj}_proj")[int(e)]
        return self.model.get_submodule(t.name).weight

    def experts(self, layer: int) -> ResidentExperts:
        return self.model.model.layers[layer].mlp.experts

    def moe_layers(self) -> list[int]:
        return self.model.spec.moe.layer_indices()

    @torch.no_grad()
    def restore(self) -> None:
        for n, p in self.model.named_parameters():
            p.copy_(self.original[n])


@dataclass
class Calibration:
    """What the calibration text gives the methods that use it: routing counts per (layer, expert) (MiLo's
    frequency policy) and GPTQ's Hessians by tensor name (a layer's experts stacked under its gate_up / down
    name), and the weights' kurtosis (from the weights alone)."""
    frequency: dict | None = None
    hessians: dict[str, torch.Tensor] | None = None
    kurtosis: dict[str, float] | None = None


# ---- methods ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def apply_grid(w: Weights, m: Method, cal: Calibration) -> tuple[int, int]:
    """RTN, HQQ or MiLo on every linear weight, as `moeserve quantize` does each tensor (compress.quantize_weight);
    returns (model bytes, compensator bytes)."""
    cfg = QuantConfig(bits=m.bits, group=m.group, method=m.kind, compensator_bits=m.compensator_bits)
    ranks = milo_ranks(w, m, cal) if m.kind == "milo" else {t.name: 0 for t in w.tensors}
    total, comp = w.total_bytes, 0
    for t in w.tensors:
        W = w.view(t)
        qw, bufs = quantize_weight(W, cfg, ranks[t.name])
        Wq = hqq.dequantize(qw)
        r = ranks[t.name] if bufs else 0
        if r:
            U, V = milo.compensator_from_buffers(bufs, m.compensator_bits, *t.shape, r)
            Wq += U.to(Wq.device) @ V.to(Wq.device)
        W.copy_(Wq)
        total += quantized_bytes(t.shape, m.bits, m.group, r, m.compensator_bits) - float_bytes(t.shape)
        comp += milo.compensator_bytes(t.shape, r, m.compensator_bits)
    return total, comp


def milo_ranks(w: Weights, m: Method, cal: Calibration) -> dict[str, int]:
    """Rank per tensor by the row's policy (quant/ranks.py), clamped to each matrix."""
    asked = assign_ranks(w.tensors, parse_rank_policy(m.ranks), kurtosis=cal.kurtosis, frequency=cal.frequency,
                         compensator_bits=m.compensator_bits)
    return clamp_ranks(w.tensors, asked)[0]


@torch.no_grad()
def apply_gptq(w: Weights, m: Method, cal: Calibration) -> tuple[int, int]:
    """GPTQ on every linear weight: dense ones one by one, a layer's experts in one batched call per projection."""
    H = cal.hessians
    total = w.total_bytes
    for t in w.tensors:
        if t.kind != "expert":
            W = w.view(t)
            W.copy_(hqq.dequantize(gptq.quantize_gptq(W, H[t.name], m.bits, m.group)))
        total += quantized_bytes(t.shape, m.bits, m.group) - float_bytes(t.shape)
    for i in w.moe_layers():
        experts = w.experts(i)
        for proj in ("gate_up", "down"):
            stack = getattr(experts, f"{proj}_proj")  # [E, out, in]
            qw = gptq.quantize_gptq(stack, H[f"model.layers.{i}.mlp.experts.{proj}"], m.bits, m.group)
            stack.copy_(gptq.dequantize_batched(qw))
    return total, 0


@torch.no_grad()
def apply_mxfp4(w: Weights, m: Method, cal: Calibration) -> tuple[int, int]:
    """The experts in MXFP4 (OCP MX: E2M1 values, one power-of-two scale per 32), the dense weights float."""
    total = w.total_bytes
    for i in w.moe_layers():
        experts = w.experts(i)
        for proj in ("gate_up", "down"):
            stack = getattr(experts, f"{proj}_proj")  # [E, out, in]
            blocks, scales = mxfp4.quantize(stack)
            stack.copy_(mxfp4.dequantize(blocks, scales))
            total += blocks.numel() + scales.numel() - float_bytes(tuple(stack.shape))
    return total, 0


@torch.no_grad()
def apply_dense8(w: Weights, m: Method, cal: Calibration) -> tuple[int, int]:
    """`--dense-bits 8`: the dense linears (quant/dense.py's list, an untied LM head included) in 8-bit HQQ."""
    total = w.total_bytes
    for t in dense_linears(w.model.spec):
        W = w.model.get_submodule(t.name).weight
        W.copy_(hqq.dequantize(hqq.quantize_hqq(W.float(), 8, DENSE_GROUP)))
        total += quantized_bytes(t.shape, 8, DENSE_GROUP) - float_bytes(t.shape)
    return total, 0


APPLY = {"rtn": apply_grid, "hqq": apply_grid, "milo": apply_grid, "gptq": apply_gptq, "mxfp4": apply_mxfp4,
         "dense8": apply_dense8}


# ---- HOBBIT ----------------------------------------------------------------------------------------------------


class MixedExperts(ExpertBackend):
    """A layer's experts under HOBBIT's rule (offload/precision.py): per token, each selected expert runs from the
    `high` copy, the `low` copy, or not at all (its gate weight dropped, as the hybrid backend skips it), by the
    gate-weight mass ranked before it against T1 and T2. Counts the pairs of each choice."""

    def __init__(self, high: ResidentExperts, low: ResidentExperts, t1: float, t2: float):
        super().__init__()
        self.high, self.low, self.t1, self.t2 = high, low, t1, t2
        self.counts = torch.zeros(3, dtype=torch.int64)  # pairs HIGH, LOW, SKIP

    def kernel_path(self, x: torch.Tensor, num_tokens: int, expert_weights: torch.Tensor | None = None) -> str:
        return self.high.kernel_path(x, num_tokens, expert_weights)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
        choice = choose_precision(expert_weights, self.t1, self.t2)  # [T, k]
        self.counts += torch.bincount(choice.flatten(), minlength=3).cpu()
        out = self.high(x, expert_ids, expert_weights * (choice == HIGH))  # [T, D]
        return out + self.low(x, expert_ids, expert_weights * (choice == LOW))


def store_group(D: int, F_: int) -> int:
    """The group of a store built for mixed precision (hybrid/memory.py store_precision): the largest that divides
    the hidden size and the expert FFN."""
    return next(g for g in STORE_GROUPS if D % g == 0 and F_ % g == 0)


@torch.no_grad()
def low_copy(experts: ResidentExperts, group: int) -> ResidentExperts:
    """The layer's experts as a mixed-precision store's low copies: each expert's matrices in 4-bit HQQ
    (offload/store.py), dequantized."""
    E, two_f, D = experts.gate_up_proj.shape
    low = ResidentExperts(E, D, two_f // 2).to(experts.gate_up_proj.device)
    for proj in ("gate_up_proj", "down_proj"):
        src, dst = getattr(experts, proj), getattr(low, proj)
        for e in range(E):
            dst[e].copy_(hqq.dequantize(hqq.quantize_hqq(src[e].float(), LOW_BITS, group)))
    return low.requires_grad_(False)


class Hobbit:
    """HOBBIT rows on one model: the low copies made once, each row's MixedExperts swapped in for its evaluation."""

    def __init__(self, w: Weights):
        self.w = w
        self.layers = w.moe_layers()
        spec = w.model.spec
        D, F_ = spec.hidden_size, spec.moe.expert_ffn
        group = store_group(D, F_)
        self.float = {i: w.experts(i) for i in self.layers}
        self.low = {i: low_copy(self.float[i], group) for i in self.layers}
        shapes = [(2 * F_, D), (D, F_)]
        self.expert_bytes = {16: sum(float_bytes(s) for s in shapes),
                             LOW_BITS: sum(quantized_bytes(s, LOW_BITS, group) for s in shapes)}
        self.experts_total = sum(spec.moe.experts_at(i) for i in self.layers)

    def enter(self, m: Method) -> list[MixedExperts]:
        mixed = []
        for i in self.layers:
            high = self.float[i] if m.high_bits == 16 else self.low[i]
            mixed.append(MixedExperts(high, self.low[i], m.t1, m.t2))
            self.w.model.model.layers[i].mlp.experts = mixed[-1]
        return mixed

    def leave(self) -> None:
        for i in self.layers:
            self.w.model.model.layers[i].mlp.experts = self.float[i]

    def fields(self, m: Method, mixed: list[MixedExperts]) -> dict:
        """Bytes held (float model and low copies; or the 4-bit experts alone), the shares of pairs by choice and
        the expert bytes read per token relative to every pair reading the float expert."""
        counts = sum(x.counts for x in mixed).tolist()
        pairs = max(sum(counts), 1)
        high_b, low_b = self.expert_bytes[m.high_bits], self.expert_bytes[LOW_BITS]
        read = counts[HIGH] * high_b + counts[LOW] * low_b
        low_copies = self.experts_total * low_b
        held = self.w.total_bytes + low_copies if m.high_bits == 16 else \
            self.w.total_bytes - self.experts_total * (self.expert_bytes[16] - low_b)
        return {"bytes": held, "high_share": counts[HIGH] / pairs, "low_share": counts[LOW] / pairs,
                "skipped_share": counts[SKIP] / pairs,
                "expert_bytes_read_vs_bf16": read / (pairs * self.expert_bytes[16])}


# ---- calibration -----------------------------------------------------------------------------------------------


@torch.no_grad()
def hessians(w: Weights, windows: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
    """GPTQ's H = 2 sum x x^T of every linear weight's inputs over the calibration windows [N, S], read from the
    float model in one pass: a dense weight's by its name; a layer's experts' stacked [E, in, in] under
    `...experts.gate_up` / `...experts.down` (an expert's inputs: the tokens routed to it, and their glu)."""
    H, hooks = {}, []
    for t in w.tensors:
        if t.kind == "expert":
            continue
        H[t.name] = torch.zeros(t.shape[1], t.shape[1], device=w.model.device)
        hooks.append(w.model.get_submodule(t.name).register_forward_pre_hook(
            lambda _, args, name=t.name: gptq.accumulate_hessian(H[name], args[0])))
    for i in w.moe_layers():
        experts = w.experts(i)
        E, two_f, D = experts.gate_up_proj.shape
        gu, down = f"model.layers.{i}.mlp.experts.gate_up", f"model.layers.{i}.mlp.experts.down"
        H[gu] = torch.zeros(E, D, D, device=w.model.device)
        H[down] = torch.zeros(E, two_f // 2, two_f // 2, device=w.model.device)

        def expert_inputs(mod, args, gu=gu, down=down):
            x, ids = args[0], args[1]  # [T, D], [T, k]
            for e in range(mod.num_experts):
                rows = x[(ids == e).any(-1)]  # [n, D]
                if rows.shape[0]:
                    gptq.accumulate_hessian(H[gu][e], rows)
                    gptq.accumulate_hessian(H[down][e], glu(F.linear(rows, mod.gate_up_proj[e]), mod.act))

        hooks.append(experts.register_forward_pre_hook(expert_inputs))
    try:
        for b in range(0, len(windows), batch):
            w.model(windows[b:b + batch].to(w.model.device))
    finally:
        for h in hooks:
            h.remove()
    return H


def calibrate(w: Weights, methods: list[Method], windows: torch.Tensor | None, batch: int) -> Calibration:
    """What the rows need, computed once: kurtosis for MiLo kurtosis policies, routing counts on the calibration
    windows for frequency policies, Hessians for GPTQ (windows None: those rows cannot run)."""
    cal = Calibration()
    policies = " ".join(m.ranks for m in methods if m.kind == "milo")
    parts = {"kurtosis": lambda: {t.name: weight_kurtosis(w.view(t)) for t in w.tensors}
             if "kurtosis" in policies else None,
             "frequency": lambda: expert_frequency(w.model, windows.flatten().tolist(), windows.shape[1])
             if windows is not None and "frequency" in policies else None,
             "hessians": lambda: hessians(w, windows, batch)
             if windows is not None and any(m.kind == "gptq" for m in methods) else None}
    for name, compute in parts.items():
        try:
            setattr(cal, name, compute())
        except Exception as e:  # noqa: BLE001 - the rows that need it fail one by one; the others still run
            print(f"calibration: {name} failed: {type(e).__name__}: {e}", flush=True)
    return cal


# ---- evaluation ------------------------------------------------------------------------------------------------


def spaced_windows(ids: list[int], window: int, max_tokens: int) -> torch.Tensor:
    """[N, window] windows of ids: all the whole windows, or max_tokens worth of them evenly spaced over the text
    (0: all)."""
    starts = list(range(0, len(ids) - window + 1, window))
    if max_tokens and len(starts) * window > max_tokens:
        n = max(1, max_tokens // window)
        starts = [starts[round(i * (len(starts) - 1) / max(n - 1, 1))] for i in range(n)]
    return torch.tensor([ids[s:s + window] for s in starts], dtype=torch.int64)


@torch.inference_mode()
def score(model: nn.Module, windows: torch.Tensor, batch: int) -> dict:
    """Held-out perplexity and next-token accuracy (argmax) over windows [N, S], each read without context."""
    nll, correct, count = 0.0, 0, 0
    for b in range(0, len(windows), batch):
        x = windows[b:b + batch].to(model.device)  # [B, S]
        logits = model(x[:, :-1]).float()  # [B, S-1, V]
        target = x[:, 1:]
        nll += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
        count += target.numel()
    return {"perplexity": math.exp(nll / count), "accuracy": correct / count, "tokens": count}


def run_method(w: Weights, m: Method, cal: Calibration, hobbit: Hobbit | None, windows: torch.Tensor,
               batch: int) -> dict:
    """One row: the method applied to the float model, its bytes and seconds, perplexity and accuracy; the model
    restored after."""
    t0 = time.perf_counter()
    row = m.fields()
    if m.kind == "hobbit":
        mixed = hobbit.enter(m)
        try:
            row.update(score(w.model, windows, batch))
            row.update(hobbit.fields(m, mixed))
        finally:
            hobbit.leave()
        row.update(compensator_bytes=0, quantize_seconds=0.0)
    else:
        try:
            if m.kind != "bf16":
                row["bytes"], row["compensator_bytes"] = APPLY[m.kind](w, m, cal)
            else:
                row["bytes"], row["compensator_bytes"] = w.total_bytes, 0
            if w.model.device.type == "cuda":
                torch.cuda.synchronize()
            row["quantize_seconds"] = round(time.perf_counter() - t0, 2)
            row.update(score(w.model, windows, batch))
        finally:
            w.restore()
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row
