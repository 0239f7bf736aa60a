"""Code each spawned rank runs in tests/parallel/test_parallel.py (a module, so spawn can import it).

One spawn per world size runs every case in one process group (a spawn costs seconds on 2 cores); a failing
case names itself in the error."""

import datetime
import os
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import moeserve
from moeserve.checkpoint import CheckpointReader
from moeserve.engine.generate import generate
from moeserve.engine.params import SamplingParams
from moeserve.model.experts import ResidentExperts
from moeserve.parallel.accounting import CountingReader
from moeserve.parallel.expert_parallel import ExpertParallelExperts
from moeserve.parallel.groups import split_range
from moeserve.parallel.loading import load_parallel_model
from moeserve.parallel.plan import DispatchPlan

TOKENS_PER_RANK = [3, 0, 5, 1]  # uneven, and one rank with none


def init(rank: int, world: int, rendezvous: str) -> None:
    """Rendezvous through a file (no port to race for); gloo over loopback; bounded waits."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def suite(rank: int, world: int, rendezvous: str, cases: list, paths: dict) -> None:
    init(rank, world, rendezvous)
    try:
        for name, *args in cases:
            try:
                CASES[name](rank, world, paths, *args)
            except Exception as e:
                raise AssertionError(f"case {name}{tuple(args)} on rank {rank}/{world}: {e}") from e
    finally:
        dist.destroy_process_group()


def layer_case(rank: int, world: int, _paths, routing: str) -> None:
    """One expert layer, dynamic and static dispatch, with and without an overlapped dense term:
    EP output == the full layer's output on this rank's tokens."""
    E, k, D, F = 8, 2, 24, 40
    torch.manual_seed(0)  # the same full layer and dense term on every rank
    full = ResidentExperts(E, D, F)
    with torch.no_grad():
        full.gate_up_proj.normal_(0, 0.3)
        full.down_proj.normal_(0, 0.3)
    dense_w = torch.randn(D, D)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    T = TOKENS_PER_RANK[rank % len(TOKENS_PER_RANK)]
    x = torch.randn(T, D, generator=g)
    ids = torch.zeros(0, k, dtype=torch.long)
    if T:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])  # [T, k]
    if routing == "one_expert":  # every token to expert 5 (and 2): one rank gets all the work
        ids[:, 0], ids[:, 1] = 5, 2
    w = torch.rand(T, k, generator=g)
    per = E // world
    local = ResidentExperts(per, D, F)
    local.gate_up_proj.data = full.gate_up_proj.data[rank * per:(rank + 1) * per].clone()
    local.down_proj.data = full.down_proj.data[rank * per:(rank + 1) * per].clone()
    most = max(TOKENS_PER_RANK[r % len(TOKENS_PER_RANK)] for r in range(world))
    with torch.no_grad():
        ref = full(x, ids, w)
        for threshold in (0, 4, 128):  # always dynamic; static unless a rank has 5 tokens; static
            plan = DispatchPlan(dist.group.WORLD, torch.device("cpu"), threshold)
            plan.begin(T)
            assert plan.capacity == (most if most <= threshold else None)
            ep = ExpertParallelExperts(local, E, dist.group.WORLD, rank, world, plan=plan)
            torch.testing.assert_close(ep(x, ids, w), ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ep(x, ids, w, dense=lambda t: t @ dense_w), ref + x @ dense_w,
                                       atol=1e-5, rtol=1e-5)


def _reference(path: str, tokens: torch.Tensor, prompts: list, params: SamplingParams):
    model = moeserve.load_model(path)
    with torch.no_grad():
        logits = model(tokens)
    return logits, [r.token_ids for r in generate(model, prompts, params)]


def _shares(path: str, tp_rank: int, tp: int, ep: int) -> dict[str, int]:
    """The bytes a rank should read: {"experts": its EP share or FFN slice, "dense": 1/tp of the TP-sliced tensors
    (its vocabulary rows of embedding and head) plus the replicated ones whole}."""
    reader = CheckpointReader(path)
    vocab = reader.shapes["model.embed_tokens.weight"][0]
    full_qk_norm = moeserve.ModelSpec.from_dir(path).attention.qk_norm == "full"
    out = {"experts": 0, "dense": 0}
    for name, shape in reader.shapes.items():
        size = reader.get(name).element_size() * torch.Size(shape).numel()  # fp32, or MXFP4's uint8 codes
        if name.endswith(".experts.down_proj_bias") and ep == 1:  # added once: the first FFN slice's rank reads it
            out["experts"] += size if tp_rank == 0 else 0
        elif ".experts." in name:  # a layer of fewer experts than ranks: each rank reads one
            out["experts"] += size // (min(ep, shape[0]) if ep > 1 else tp)
        elif name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
            out["dense"] += size // vocab * len(split_range(vocab, tp_rank, tp))
        elif re.search(r"_a_proj(_with_mqa)?\.", name):  # MLA's latent projections: whole on every rank
            out["dense"] += size
        elif re.search(r"_proj\.weight$|[qkv]_proj\.bias$|\.sinks$", name) or (  # attention, dense and shared FFNs
                full_qk_norm and re.search(r"[qk]_norm\.weight$", name)):  # OLMoE's qk-norm splits with the heads
            out["dense"] += size // tp
        else:  # norms, routers
            out["dense"] += size
    return out


def model_case(rank: int, world: int, paths: dict, families: list, tp: int, ep: int, static_max_tokens: int) -> None:
    """Whole models loaded shard-wise with TP (vocab-parallel embedding/head, heads, FFN slices, expert slicing
    at ep 1) and/or EP: logits and greedy tokens as one process, and each rank reads only its share of the
    routed experts. The ranks of a TP group share their prompts; EP groups differ (uneven batches)."""
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    for family in families:
        path = paths[family]
        g = torch.Generator().manual_seed(300 + rank // tp)
        prompts = [torch.randint(3, 97, (3 + 2 * i + rank // tp,), generator=g).tolist()
                   for i in range(1 + rank // tp % 2)]
        tokens = torch.randint(3, 97, (1 + rank // tp % 2, 5 + rank // tp), generator=g)
        ref_logits, ref_tokens = _reference(path, tokens, prompts, params)
        reader = CountingReader(path)
        model = load_parallel_model(path, rank, world, tp=tp, ep=ep, static_max_tokens=static_max_tokens,
                                    reader=reader)
        read = {kind: sum(n for name, n in reader.bytes_read.items() if (".experts." in name) == (kind == "experts"))
                for kind in ("experts", "dense")}
        if all(view.part is not None for view in reader.views.values()):  # a view read whole reads more
            assert read == _shares(path, rank % tp, tp, ep), (read, _shares(path, rank % tp, tp, ep))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), ref_logits, atol=1e-5, rtol=1e-5)
        assert [r.token_ids for r in generate(model, prompts, params)] == ref_tokens


def quantized_case(rank: int, world: int, paths: dict, name: str, tp: int, ep: int, dense_bits: int = 16) -> None:
    """A moeserve quantized checkpoint (or --dense-bits on a float one) under TP and/or EP: logits, greedy tokens and
    perplexity as the quantized model in one process. Under EP a rank reads the low-bit layers of its own experts
    only. The generated CPU kernels are off: both sides take the PyTorch path (the kernels have their own tests,
    and compiling them in a fresh cache costs tens of seconds)."""
    from moeserve.evaluate import perplexity

    with mock.patch.dict(os.environ, {"MOESERVE_CPU_KERNELS": "0"}):
        path = paths[name]
        g = torch.Generator().manual_seed(500 + rank // tp)  # a TP group shares its tokens
        tokens = torch.randint(3, 97, (2, 6), generator=g)
        prompts = [torch.randint(3, 97, (3 + rank // tp,), generator=g).tolist()]
        params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        ref = moeserve.load_model(path, dense_bits=dense_bits)
        reader = CountingReader(path)
        model = load_parallel_model(path, rank, world, tp=tp, ep=ep, reader=reader, dense_bits=dense_bits)
        if ep > 1:
            _check_own_experts_read(reader, rank // tp % ep, ep)  # EP groups: the ranks of one TP rank (groups.py)
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), ref(tokens), atol=1e-5, rtol=1e-5)
        assert [r.token_ids for r in generate(model, prompts, params)] == [
            r.token_ids for r in generate(ref, prompts, params)]
        ids = tokens.flatten().tolist()
        assert perplexity(model, ids, 5, progress=False)["perplexity"] == pytest.approx(
            perplexity(ref, ids, 5, progress=False)["perplexity"], rel=1e-5)


def _check_own_experts_read(reader: CountingReader, ep_rank: int, ep: int) -> None:
    """Of the experts' low-bit layers (...experts.gate_up.3.qweight), if the checkpoint has them, only those of this
    rank's share were read, and all of them (float experts: model_case checks their shares)."""
    found = {}
    for name in reader.shapes:
        m = re.search(r"\.mlp\.experts\.(gate_up|down)\.(\d+)\.", name)
        if m:
            found.setdefault(int(m.group(2)), []).append(name)
    per = len(found) // ep
    mine = range(ep_rank * per, (ep_rank + 1) * per)
    for e, names in found.items():
        read = [n for n in names if n in reader.bytes_read]
        assert read == (names if e in mine else []), (e, read)


def hierarchical_case(rank: int, world: int, paths: dict) -> None:
    """2 nodes x 2 ranks simulated: the hierarchical exchange returns what all_to_all_single does, and the
    EP model with it matches the single-process model."""
    from moeserve.parallel.hierarchical import hierarchical_all_to_all, node_groups

    intra, inter = node_groups(world, 2, rank)
    g = torch.Generator().manual_seed(400 + rank)
    counts = torch.randint(0, 4, (world,), generator=g)
    counts[(rank + 1) % world] = 0  # some empty chunks
    send = torch.randn(int(counts.sum()), 3, generator=g)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    flat = send.new_empty((int(recv_counts.sum()), 3))
    dist.all_to_all_single(flat, send, recv_counts.tolist(), counts.tolist())
    assert torch.equal(hierarchical_all_to_all(send, counts.tolist(), 2, intra, inter), flat)

    tokens = torch.randint(3, 97, (1 + rank % 2, 6), generator=g)
    with torch.no_grad():
        ref = moeserve.load_model(paths["mixtral"])(tokens)
        model = load_parallel_model(paths["mixtral"], rank, world, ep=world, hierarchical=2)
        torch.testing.assert_close(model(tokens), ref, atol=1e-5, rtol=1e-5)


def static_step_case(rank: int, world: int, paths: dict) -> None:
    """The static decode step (the shapes a CUDA graph captures, run eagerly here; GPUs take it by default) under EP,
    in a continuous batch whose requests join one step apart: its decode passes are not forward() calls and have more
    rows than the last prefill pass read tokens, so the EP layers must agree on their dispatch themselves. Greedy
    tokens as one process."""
    from moeserve.engine.batching import ContinuousBatch, Request
    from moeserve.engine.cuda_graph import SlotDecoder

    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[3 + rank], [40], [77 - rank]]
    ref = [r.token_ids for r in generate(moeserve.load_model(paths["mixtral"]), prompts, params)]
    model = load_parallel_model(paths["mixtral"], rank, world, ep=world)
    batch = ContinuousBatch(model, None, slots=len(prompts), context=16)
    batch.decoder = SlotDecoder(model, batch.kv, graph=False, static=True)
    requests = [Request(p, params, lambda *_: None) for p in prompts]
    for r in requests:  # one joins per step: prefill passes of 1 token, then decode passes of 1, 2, 3 rows
        batch.add(r)
        batch.step()
    while batch.step():
        pass
    assert [r.gen.token_ids for r in requests] == ref


def bad_checkpoint_case(rank: int, world: int, paths: dict) -> None:
    """A checkpoint that lacks one expert: the rank that owns it names the tensor, the others say a peer
    failed; nobody waits for a collective that never comes."""
    from moeserve.errors import MoeserveError

    try:
        load_parallel_model(paths["missing_expert"], rank, world, ep=world)
    except MoeserveError as e:
        owner = rank == world - 1  # the last expert of layer 0 is missing
        assert ("lacks the tensor" if owner else "another rank failed") in str(e), str(e)
    else:
        raise AssertionError("loading a checkpoint without an expert succeeded")


CASES = {"layer": layer_case, "model": model_case, "quantized": quantized_case, "hierarchical": hierarchical_case,
         "static_step": static_step_case, "bad_checkpoint": bad_checkpoint_case}
