"""Code each spawned rank runs in tests/test_parallel.py (a module, so spawn can import it)."""

import datetime

import torch
import torch.distributed as dist

import moeserve
from moeserve.engine.generate import generate
from moeserve.engine.sampling import SamplingParams
from moeserve.model.experts import ResidentExperts
from moeserve.parallel.expert_parallel import ExpertParallelExperts, enable_expert_parallel

TOKENS_PER_RANK = [3, 0, 5, 1]  # uneven, and one rank with none


def init(rank: int, world: int, rendezvous: str) -> None:
    """Rendezvous through a file (no port to race for); gloo over loopback; bounded waits."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def layer_case(rank: int, world: int, rendezvous: str, routing: str) -> None:
    """One expert layer: EP output == the full layer's output on this rank's tokens."""
    init(rank, world, rendezvous)
    try:
        E, k, D, F = 8, 2, 24, 40
        torch.manual_seed(0)  # the same full layer on every rank
        full = ResidentExperts(E, D, F)
        with torch.no_grad():
            full.gate_up_proj.normal_(0, 0.3)
            full.down_proj.normal_(0, 0.3)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
        T = TOKENS_PER_RANK[rank % len(TOKENS_PER_RANK)]
        x = torch.randn(T, D, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
        if routing == "one_expert":
            ids[:, 0] = 5
            ids[:, 1] = 2
        w = torch.rand(T, k, generator=g)
        per = E // world
        local = ResidentExperts(per, D, F)
        local.gate_up_proj.data = full.gate_up_proj.data[rank * per:(rank + 1) * per].clone()
        local.down_proj.data = full.down_proj.data[rank * per:(rank + 1) * per].clone()
        ep = ExpertParallelExperts(local, E, dist.group.WORLD, rank, world)
        with torch.no_grad():
            got, ref = ep(x, ids, w), full(x, ids, w)
        assert got.shape == (T, D)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


def model_case(rank: int, world: int, rendezvous: str, path: str) -> None:
    """A whole model: EP logits and greedy tokens == the single-process model's, per rank's own prompts."""
    init(rank, world, rendezvous)
    try:
        model = moeserve.load_model(path)
        g = torch.Generator().manual_seed(200 + rank)
        prompts = [torch.randint(3, 97, (3 + 2 * i + rank,), generator=g).tolist() for i in range(1 + rank % 2)]
        tokens = torch.randint(3, 97, (1 + rank % 3, 5 + rank), generator=g)
        params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
        with torch.no_grad():
            ref_logits = model(tokens)
        ref_tokens = [r.token_ids for r in generate(model, prompts, params)]
        enable_expert_parallel(model, dist.group.WORLD, rank, world)
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), ref_logits, atol=1e-5, rtol=1e-5)
        assert [r.token_ids for r in generate(model, prompts, params)] == ref_tokens
    finally:
        dist.destroy_process_group()


def tp_case(rank: int, world: int, rendezvous: str, paths: list, tp: int, ep: int) -> None:
    """Tensor slicing in TP groups of `tp`, with expert slicing (ep 1) or expert parallelism across TP groups
    (ranks sharing a TP rank): logits and greedy tokens as one process."""
    from moeserve.parallel.groups import RankGrid, new_groups
    from moeserve.parallel.tensor_parallel import enable_tensor_parallel

    init(rank, world, rendezvous)
    try:
        (tp_group, tp_ranks), (ep_group, ep_ranks) = new_groups(RankGrid(world=world, tp=tp, ep=ep), rank)
        for path in paths:
            model = moeserve.load_model(path)
            g = torch.Generator().manual_seed(300 + tp_ranks[0])  # the ranks of a TP group share their inputs
            prompts = [torch.randint(3, 97, (4 + i,), generator=g).tolist() for i in range(2)]
            tokens = torch.randint(3, 97, (2, 7), generator=g)
            params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
            with torch.no_grad():
                ref_logits = model(tokens)
            ref_tokens = [r.token_ids for r in generate(model, prompts, params)]
            enable_tensor_parallel(model, tp_group, tp_ranks.index(rank), tp, slice_experts=ep == 1)
            if ep > 1:  # coordinated: each TP rank dispatches its share of the tokens
                enable_expert_parallel(model, ep_group, ep_ranks.index(rank), ep,
                                       tp=(tp_group, tp_ranks.index(rank), tp))
            with torch.no_grad():
                torch.testing.assert_close(model(tokens), ref_logits, atol=1e-5, rtol=1e-5)
            assert [r.token_ids for r in generate(model, prompts, params)] == ref_tokens
    finally:
        dist.destroy_process_group()


def hierarchical_case(rank: int, world: int, rendezvous: str, path: str) -> None:
    """2 nodes x 2 ranks simulated: the hierarchical exchange returns what all_to_all_single does, and the
    EP model with it matches the single-process model."""
    from moeserve.parallel.hierarchical import hierarchical_all_to_all, node_groups

    init(rank, world, rendezvous)
    try:
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

        model = moeserve.load_model(path)
        tokens = torch.randint(3, 97, (1 + rank % 2, 6), generator=g)
        with torch.no_grad():
            ref = model(tokens)
        enable_expert_parallel(model, dist.group.WORLD, rank, world, hierarchy=(2, intra, inter))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), ref, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()
