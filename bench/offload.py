"""Offloaded decode at batch 1: a Mixtral-8x7B-shaped model (32 layers, D 4096, F 14336, 8 experts top-2,
bf16, random weights) whose experts live in pinned host memory, under GPU memory budgets, per method:

  naive      every selected expert copied on demand, nothing cached (top_k slots in flight); measured once
  lru        a high-precision LRU cache over all layers filling the budget
  lru-per-layer  the same slots split evenly over the layers, one LRU each (mixtral-offloading's layout)
  hobbit     mixed precision (bf16 + 4-bit HQQ, T1 0.6 / T2 0.9), HOBBIT's policy, stacked-gate prefetch
  hobbit+cpu the same, misses computed on the CPU when that is predicted to finish first
  hf-accelerate  transformers + accelerate `device_map` with the MoE blocks on the CPU (what users do today)

Routing: random routers give near-uniform gate weights and no locality, unlike a trained model, so by
default each layer's routing (expert ids, gate weights, and the stacked-gate prediction of the next
layer's experts) is replayed from the trained demo model reading held-out text: Mixtral layer i uses
demo layer i mod 6 (both have 8 experts, top-2). `--routing model` uses the random routers instead.

Floor per method: the bytes it moved in the timed steps over the measured pinned host->device bandwidth.
Host memory: the 128 GiB hosts cannot hold 32 layers of bf16 + 4-bit experts pinned, so the store holds
`--distinct-layers` layers of random experts and layer i reads layer i mod that; every load still copies
a whole expert over PCIe (the timing is unchanged, only the values repeat).
transformers: random weights; `--hf-layers` layers are timed and the per-token time scaled to 32 layers.

    python bench/offload.py            # GPU: budgets 12/24/48 GiB, JSON to bench/results/
    python bench/offload.py --quick    # tiny model on the CPU (RAM as the fast tier), seconds
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # bench/, repo
from common import add_run_args, result_record, run_device, sync, write_result  # noqa: E402
from random_checkpoint import MXFP4_SCALE  # noqa: E402

from moeserve.engine.cuda_graph import host_layers  # noqa: E402
from moeserve.engine.generate import iterate  # noqa: E402
from moeserve.engine.params import SamplingParams  # noqa: E402
from moeserve.loader import is_routed_expert, set_tensor, load_model  # noqa: E402
from moeserve.model.layers import RotaryEmbedding  # noqa: E402
from moeserve.model.transformer import MoETransformer  # noqa: E402
from moeserve.offload.setup import enable_offload  # noqa: E402
from moeserve.plan.footprint import dense_bytes, plan_slots, resident_layout  # noqa: E402
from moeserve.offload.store import ExpertStore, SourceExperts, layer_tensors, store_meta  # noqa: E402
from moeserve.offload.transfer import measure_h2d_bandwidth  # noqa: E402
from moeserve.quant.mxfp4 import stored_experts  # noqa: E402
from moeserve.spec import ClampedSwiGLU, MLASpec, ModelSpec, RopeSpec, RouterSpec  # noqa: E402
GiB = 1 << 30

DEMO_DIR = Path(__import__("moeserve").__file__).resolve().parent / "demo"
MIXTRAL = dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
               expert_ffn=14336, num_experts=8, top_k=2)
QUICK = dict(vocab_size=258, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
             expert_ffn=256, num_experts=8, top_k=2)
METHODS = {  # name -> enable_offload options (slots come from the budget)
    "naive": dict(policy="lru", mixed=False, prefetch_layers=0, naive=True),
    "lru": dict(policy="lru", mixed=False, prefetch_layers=0),
    "lru-per-layer": dict(policy="lru", mixed=False, prefetch_layers=0, per_layer=True),
    "hobbit": dict(policy="hobbit", mixed=True, prefetch_layers=1),
    "hobbit+cpu": dict(policy="hobbit", mixed=True, prefetch_layers=1, cooperative=True),
}
STD = 0.02
NESTED = {"mla": MLASpec, "router": RouterSpec, "rope": RopeSpec,  # shape fields given as dicts of their fields
          "expert_act": ClampedSwiGLU}
PER_LAYER = ("dense_layers", "sliding_window")  # shape keys model_spec expands to one value per layer


def model_spec(shape: dict) -> ModelSpec:
    """The ModelSpec of a bench shape. A shape is plain data, as the results record it: ModelSpec's fields over
    Mixtral's defaults, the nested dataclasses (NESTED) as dicts of their fields, `dense_layers`: that many first
    layers have a dense FFN of dense_ffn instead of experts (DeepSeek's first_k_dense_replace; default 0), and
    `sliding_window`: even layers attend within that window, odd ones to everything (GPT-OSS's pattern)."""
    fields = {k: NESTED[k](**v) if k in NESTED else v for k, v in shape.items() if k not in PER_LAYER}
    dense, window = shape.get("dense_layers", 0), shape.get("sliding_window")
    layers = range(shape["num_layers"])
    moe_layers = tuple(i >= dense for i in layers)
    if window is not None:
        fields["sliding_windows"] = tuple(window if i % 2 == 0 else None for i in layers)
    return ModelSpec.of(**{"family": "mixtral", "max_position_embeddings": 4096, "norm_topk_prob": True,
                        "router_weights_fp32": True, "moe_layers": moe_layers, **fields})


def dense_model(spec: ModelSpec, device, dtype) -> MoETransformer:
    """Random non-expert weights on `device`; routed experts left on the meta device for the offload backend."""
    with torch.device("meta"):
        model = MoETransformer(spec)
    g = torch.Generator(device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        if is_routed_expert(name):
            continue
        t = (torch.ones(p.shape, device=device, dtype=dtype) if "norm" in name
             else torch.randn(p.shape, device=device, dtype=dtype, generator=g) * STD)
        set_tensor(model, name, t, False)
    model.rotary = RotaryEmbedding(spec).to(device)
    return model.eval()


def random_store(spec: ModelSpec, distinct: int, device, dtype, low_bits: int = 4, group: int = 64,
                 high: bool = True) -> ExpertStore:
    """Random experts of every MoE layer (quantized on `device`), `distinct` layers of them pinned, layer i reads
    i mod distinct; high=False leaves out the float copies (a run that computes the low-bit ones only). A spec with
    MXFP4 experts (GPT-OSS) gets MXFP4 high copies as shipped (random codes, every block's scale MXFP4_SCALE, biases
    N(0, STD^2)) and no low-bit ones."""
    E, D, F = spec.moe.num_experts, spec.hidden_size, spec.moe.expert_ffn
    mxfp4 = spec.moe.experts_mxfp4
    layers = []
    for i in range(distinct):
        g = torch.Generator(device).manual_seed(1000 + i)
        experts = random_mxfp4_experts(spec, g, device, dtype) if mxfp4 else SourceExperts(
            torch.randn(E, 2 * F, D, device=device, dtype=dtype, generator=g) * STD,
            torch.randn(E, D, F, device=device, dtype=dtype, generator=g) * STD)
        t = layer_tensors(experts, 0 if mxfp4 else low_bits, group, high=high or mxfp4, mxfp4=mxfp4)
        layers.append({k: v.pin_memory() if torch.cuda.is_available() else v for k, v in t.items()})
    meta = store_meta(spec, spec.moe.layer_indices(), 0 if mxfp4 else low_bits, group)
    return ExpertStore({**meta, "high_mxfp4": True} if mxfp4 else meta, lambda i: layers[i % distinct])


def random_mxfp4_experts(spec: ModelSpec, g: torch.Generator, device, dtype) -> SourceExperts:
    """A layer of random MXFP4 experts as GPT-OSS ships them: blocks [E, N, K/32, 16] of random E2M1 codes, scales
    [E, N, K/32] MXFP4_SCALE, biases gate_up [E, 2F] and down [E, D] in dtype (spec.moe.expert_bias)."""
    E, D, F = spec.moe.num_experts, spec.hidden_size, spec.moe.expert_ffn

    def matrix(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (E, n, k // 32, 16), device=device, dtype=torch.uint8, generator=g)
        return blocks, torch.full((E, n, k // 32), MXFP4_SCALE, device=device, dtype=torch.uint8)

    biases = ((torch.randn(E, 2 * F, device=device, dtype=dtype, generator=g) * STD,
               torch.randn(E, D, device=device, dtype=dtype, generator=g) * STD) if spec.moe.expert_bias else ())
    return SourceExperts(matrix(2 * F, D), matrix(D, F), *biases)


def random_resident_mxfp4(model: MoETransformer, layers: list[int], device, dtype) -> None:
    """Give `layers` of a dense_model random MXFP4 experts resident on `device` (the layers a hybrid run keeps on the
    GPU; the store holds the others), drawn as random_mxfp4_experts draws them."""
    spec = model.spec
    for i in layers:
        experts = random_mxfp4_experts(spec, torch.Generator(device).manual_seed(2000 + i), device, dtype)
        with torch.device(device):
            module = stored_experts(spec, spec.moe.experts_at(i))
        for name, t in zip(("gate_up_proj", "down_proj"), (experts.gate_up, experts.down)):
            getattr(module, f"{name}_blocks").copy_(t[0])
            getattr(module, f"{name}_scales").copy_(t[1])
            if experts.bias is not None:
                getattr(module, f"{name}_bias").data = experts.bias[name == "down_proj"].to(dtype)
        model.model.layers[i].mlp.experts = module


class DemoRouting:
    """The demo model's routing of held-out text, per token and demo layer: ids, weights and the experts
    the next layer's gate predicts from this layer's gate input (HOBBIT's stacked-gate prediction)."""

    def __init__(self, tokens: int):
        demo = load_model(DEMO_DIR, device="cpu", dtype="float32")
        text = (DEMO_DIR / "heldout.txt").read_bytes()[:tokens]
        ids = torch.tensor([list(text)])
        inputs = {}
        hooks = [layer.mlp.gate.register_forward_pre_hook(lambda _, a, i=i: inputs.__setitem__(i, a[0]))
                 for i, layer in enumerate(demo.model.layers)]
        with torch.no_grad():
            demo(ids)
            L = len(demo.model.layers)
            self.ids, self.weights, self.predicted = [], [], []
            for i, layer in enumerate(demo.model.layers):
                x = inputs[i].reshape(-1, demo.spec.hidden_size)
                e, w, _ = layer.mlp.gate(x)  # [T, k]
                self.ids.append(e)
                self.weights.append(w)
                self.predicted.append(demo.model.layers[(i + 1) % L].mlp.gate(x)[0])  # [T, k]
        for h in hooks:
            h.remove()
        self.num_layers, self.cursor = L, {}

    def route(self, layer: int, n: int, device, dtype):
        """The next n tokens' (ids, weights) for a model layer (demo layer = layer mod L)."""
        start = self.cursor.get(layer, 0)
        self.cursor[layer] = start + n
        d = layer % self.num_layers
        return self.ids[d][start:start + n].to(device), self.weights[d][start:start + n].to(device, dtype)

    def prediction(self, layer: int, num_layers: int) -> list[tuple[int, int]]:
        """Keys predicted for layer + 1 from the token this layer just routed."""
        t = self.cursor[layer] - 1
        nxt = layer + 1
        return [(nxt, int(e)) for e in self.predicted[layer % self.num_layers][t]] if nxt < num_layers else []


class ReplayExperts(nn.Module):
    """An expert backend that runs the demo's routing instead of the router's. Where the backend reads the routing on
    the host anyway (offload, the hybrid host path) a call takes the next tokens' routing there, and decode steps
    still run as CUDA-graph segments around it. Where the backend's path is captured (the hybrid device link), a one-row
    call reads static buffers that the model's step hook fills with the next token's routing before each step (a
    router replayed inside a graph would otherwise replay one token's routing forever)."""

    def __init__(self, inner: nn.Module, routing: DemoRouting, layer: int, static: bool = False):
        super().__init__()
        self.inner, self.routing, self.layer, self.static = inner, routing, layer, static
        self.ids: torch.Tensor | None = None  # [1, k] the next decode token's routing (static)
        self.weights: torch.Tensor | None = None  # [1, k]

    @property
    def overlaps_dense(self) -> bool:
        return self.inner.overlaps_dense

    def kernel_path(self, *args, **kwargs) -> str:
        return self.inner.kernel_path(*args, **kwargs)

    def x_preparation(self, x, top_k):
        return None

    def next_token(self, device, dtype) -> None:
        """Static: the next decode token's routing into the buffers the captured step reads."""
        ids, weights = self.routing.route(self.layer, 1, device, dtype)
        if self.ids is None:
            self.ids, self.weights = ids.clone(), weights.clone()
        else:
            self.ids.copy_(ids)
            self.weights.copy_(weights)

    def forward(self, x, expert_ids, expert_weights, **kwargs):
        if self.static and x.shape[0] == 1 and self.ids is not None:
            return self.inner(x, self.ids, self.weights.to(expert_weights.dtype), **kwargs)
        ids, weights = self.routing.route(self.layer, x.shape[0], x.device, expert_weights.dtype)
        return self.inner(x, ids, weights, **kwargs)


def replay_routing(model, routing: DemoRouting, layers: list[int] | None = None) -> None:
    """The layers whose experts live off the GPU (default: those that read the routing on the host: offload, hybrid
    CPU layers; their next-layer predictions too) replay the demo model's routing; resident layers keep their random
    routers (every expert costs the same there). Layers whose decode step is captured whole replay through static
    buffers (ReplayExperts.static), filled by a step hook."""
    routing.cursor = {}
    host = host_layers(model, 1)
    static = []
    for i in host if layers is None else layers:
        experts = model.model.layers[i].mlp.experts
        experts = experts.inner if isinstance(experts, ReplayExperts) else experts  # replayed before: a new text
        experts.predict_next = lambda x, i=i: routing.prediction(i, model.spec.num_layers)
        replay = ReplayExperts(experts, routing, i, static=i not in host)
        model.model.layers[i].mlp.experts = replay
        if replay.static:
            static.append(replay)
    model.step_hooks[:] = [h for h in model.step_hooks if not getattr(h, "replays_routing", False)]
    if static:
        def next_token():
            for replay in static:
                replay.next_token(model.device, model.dtype)

        next_token.replays_routing = True
        model.step_hooks.insert(0, next_token)


def run_method(spec, store, device, dtype, budget, method: str, args, bandwidth, routing, dense_bits: int = 16) -> dict:
    """Decode args.new_tokens tokens after an args.prompt-token prompt; time the steps after the warm-up."""
    opts = dict(METHODS[method])
    naive = opts.pop("naive", False)
    model = dense_model(spec, device, dtype)
    base = replace(resident_layout(spec, "cuda", dtype.itemsize, 1, args.prompt + args.new_tokens, dense_bits,
                                   budget=budget, experts=False),  # the dense part and a KV cache of one row
                   blas_workspaces=2 if device.type == "cuda" else 0)  # on the CPU the slots hold no cuBLAS's
    low_bytes = store.expert_bytes(True) if opts["mixed"] else 0
    high, low = (0, 0) if naive else plan_slots(spec, base, store.expert_bytes(False), low_bytes,
                                                 reserve=spec.moe.top_k)
    cache = enable_offload(model, store, high_slots=high, low_slots=low, bandwidth=bandwidth, pin=False, **opts)
    if routing is not None:
        replay_routing(model, routing)
    prompt = torch.randint(0, spec.vocab_size, (args.prompt,)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    marks = []  # after the prompt, then after each decode step
    for _ in iterate(model, [prompt], params):
        sync(device)
        marks.append((time.perf_counter(), cache.stats.bytes_moved, cache.stats.hits, cache.stats.requests))
    (t0, b0, h0, r0), (t1, b1, h1, r1) = marks[args.warmup], marks[-1]
    steps = len(marks) - 1 - args.warmup
    seconds = t1 - t0
    moved = b1 - b0
    floor = moved / bandwidth if bandwidth else None
    st = cache.summary()
    row = {"method": method, "budget_bytes": budget, "high_slots": high, "low_slots": low,
           "tokens_per_s": steps / seconds, "ms_per_token": 1e3 * seconds / steps, "bytes_per_token": moved / steps,
           "hit_rate": (h1 - h0) / max(r1 - r0, 1), "floor_tokens_per_s": steps / floor if floor else None,
           "of_floor": floor / seconds if floor else None,
           **{k: st[k] for k in ("high_misses", "low_misses", "skipped", "prefetched", "prefetch_accuracy",
                                  "cpu_experts")}}
    del model, cache
    gc.collect()  # the model and its cache hold each other: free the slots before the next method
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def hf_accelerate(shape: dict, layers: int, device, dtype, args) -> dict:
    """transformers Mixtral with `layers` layers, MoE blocks on the CPU via accelerate's device_map (their
    weights move to the GPU at every forward); per-token time scaled to the full layer count."""
    import transformers
    from accelerate import dispatch_model

    cfg = transformers.MixtralConfig(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                                     intermediate_size=shape["expert_ffn"], num_hidden_layers=layers,
                                     num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
                                     num_local_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"])
    with torch.device(device):
        model = transformers.MixtralForCausalLM(cfg).to(dtype)  # random init on the GPU, then the MoE blocks move
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0}
    for i in range(layers):
        device_map.update({f"model.layers.{i}.self_attn": 0, f"model.layers.{i}.input_layernorm": 0,
                           f"model.layers.{i}.post_attention_layernorm": 0, f"model.layers.{i}.mlp": "cpu"})
    for i in range(layers):
        model.model.layers[i].mlp.to("cpu")
    model = dispatch_model(model, device_map=device_map, main_device=0)
    ids = torch.randint(0, shape["vocab_size"], (1, args.prompt), device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        sync(device)
        t1 = time.perf_counter()
        n = max(args.new_tokens // 4, 2)
        model.generate(ids, max_new_tokens=1 + n, do_sample=False, min_new_tokens=1 + n)
        sync(device)
        t2 = time.perf_counter()
    per_token = ((t2 - t1) - (t1 - t0)) / n * shape["num_layers"] / layers
    return {"method": "hf-accelerate", "measured_layers": layers, "ms_per_token": 1e3 * per_token,
            "tokens_per_s": 1 / per_token}


def plot(record: dict, path: Path) -> Path | None:
    """tokens/s vs GPU budget per method (log scale), the transformers baseline as a line; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    rows = [r for r in record["results"] if "budget_bytes" in r]
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["budget_bytes"] / GiB, r["tokens_per_s"]) for r in rows if r["method"] == method]
        ax.plot(*zip(*pts), marker="o", label=method)
    for r in record["results"]:
        if r["method"] == "hf-accelerate" and "tokens_per_s" in r:
            ax.axhline(r["tokens_per_s"], color="grey", linestyle="--", label="transformers + accelerate")
    ax.set(xlabel="GPU memory budget (GiB)", ylabel="decode tokens/s (batch 1)", yscale="log",
           title=f"{'tiny model (--quick)' if record['config']['quick'] else 'Mixtral-8x7B shape'}, experts "
                  f"offloaded\n{record['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    ap.add_argument("--budgets", default="12,24,48", help="GPU memory budgets in GiB (comma separated)")
    ap.add_argument("--methods", default=",".join(METHODS), help="methods to run (comma separated)")
    ap.add_argument("--routing", choices=("demo", "model"), default="demo",
                    help="replay the demo model's routing (default) or use the random routers")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=24, help="decode steps (the first --warmup are not timed)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--distinct-layers", type=int, default=4, help="layers of distinct random experts in the store")
    ap.add_argument("--hf-layers", type=int, default=2, help="layers of the transformers baseline (0 = skip it)")
    add_run_args(ap)
    args = ap.parse_args(argv)
    device, dtype = run_device(args)
    cuda = device.type == "cuda"
    shape = QUICK if args.quick else MIXTRAL
    if args.quick:
        args.new_tokens, args.warmup, args.prompt, args.hf_layers = 6, 2, 4, 0
    spec = model_spec(shape)
    store = random_store(spec, min(args.distinct_layers, len(spec.moe.layer_indices())), device, dtype,
                         group=32 if args.quick else 64)
    bandwidth = measure_h2d_bandwidth(device) if cuda else None
    routing = DemoRouting(args.prompt + args.new_tokens) if args.routing == "demo" else None
    high, low = store.expert_bytes(False), store.expert_bytes(True)
    dense = dense_bytes(spec, dtype.itemsize)
    budgets = ([int(float(b) * GiB) for b in args.budgets.split(",")] if not args.quick
               else [dense + n * high for n in (6, 12)])  # the dense weights + 6 / 12 experts' worth
    rows = []
    naive = None
    for budget in budgets:
        for method in args.methods.split(","):
            if method == "naive" and naive is not None:  # caches nothing: the same at every budget
                rows.append(dict(naive, budget_bytes=budget))
                continue
            row = run_method(spec, store, device, dtype, budget, method, args, bandwidth, routing)
            naive = row if method == "naive" else naive
            rows.append(row)
            print(f"{budget / GiB:6.2f} GiB {method:11s} {row['tokens_per_s']:7.2f} tok/s  hit {row['hit_rate']:.0%}  "
                  f"{row['bytes_per_token'] / 1e9:6.2f} GB/token  floor {row['of_floor'] or 0:.0%}", flush=True)
    if cuda and args.hf_layers:
        try:
            rows.append(hf_accelerate(shape, args.hf_layers, device, dtype, args))
            print(f"hf-accelerate {rows[-1]['tokens_per_s']:.3f} tok/s (scaled from {args.hf_layers} layers)")
        except Exception as e:  # noqa: BLE001 - the baseline is optional; say why it is missing
            rows.append({"method": "hf-accelerate", "error": str(e).splitlines()[0]})
    record = result_record("offload", {"shape": shape, "quick": args.quick, "routing": args.routing,
                                       "prompt": args.prompt, "new_tokens": args.new_tokens, "warmup": args.warmup,
                                       "distinct_layers": args.distinct_layers, "low_bits": 4, "group": 64,
                                       "expert_bytes_high": high, "expert_bytes_low": low, "dtype": str(dtype)},
                           device)
    record.update({"h2d_bytes_per_s": bandwidth, "results": rows})
    path = write_result(record, args.out)
    print(path, plot(record, path.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
