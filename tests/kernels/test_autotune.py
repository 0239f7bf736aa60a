"""Tuning on first use (kernels/triton/autotune.py) and the user's tuning cache (tune_cache.py), without a GPU: a fake
GPU name, a tiny search space and a cheap timer stand in for the kernels. Also the defaults made from a GPU's
properties and the candidate lists (configs.py, spaces.py)."""

import json
import multiprocessing

import pytest

from moeserve.errors import MoeserveError
from moeserve.kernels.triton import autotune, configs, spaces, tune_cache
from moeserve.kernels.triton.configs import ExpertsConfig, LowbitConfig
from moeserve.kernels.triton.device import DeviceInfo

FAKE = DeviceInfo("Fake GPU 80GB", (9, 0), sms=8, smem_per_block=100 * 1024)
SHAPE = "b3_E4_D64_F96"


def lowbit(**entry) -> LowbitConfig:
    return LowbitConfig.of({"BLOCK_K": 64, "num_warps": 4, **entry})


DEFAULT = ExpertsConfig(lowbit(BLOCK_N=32), lowbit(BLOCK_N=32))
SPACE = {"gate_up": [lowbit(BLOCK_N=16), lowbit(BLOCK_N=64)], "down": [lowbit(BLOCK_N=16), lowbit(BLOCK_N=8)]}


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty user cache and no shipped tables; tuning on (quick); nothing chosen yet in this process."""
    monkeypatch.setenv("MOESERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MOESERVE_TUNE", "quick")
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path / "shipped")
    autotune.forget()
    yield tmp_path
    monkeypatch.undo()
    autotune.forget()


def cost(config: ExpertsConfig) -> float:
    """A made-up time with one best pair (gate_up 64 rows, down 8) that the search can find coordinate-wise."""
    return abs(config.gate_up.BLOCK_N - 64) / 10 + abs(config.down.BLOCK_N - 8) / 100 + 0.05


class Counter:
    """The family's hooks for choose: the lookup (the table's entry, else DEFAULT), the space and a counting timer."""

    def __init__(self):
        self.timed = []
        self.searches = 0

    def lookup(self, tokens):
        return configs.launch_tables(FAKE.name)["lowbit_moe"].get(SHAPE, {}).get(str(autotune.bucket(tokens)), DEFAULT)

    def candidates(self, mode, tokens):
        self.searches += 1
        return SPACE

    def timer(self, tokens):
        return lambda config: self.timed.append(config) or cost(config)

    def choose(self, tokens):
        return autotune.choose(FAKE, "lowbit_moe", SHAPE, tokens, self.lookup, self.candidates, self.timer)


def test_search_finds_the_best_pair_and_skips_failures():
    space = {"gate_up": [*SPACE["gate_up"], lowbit(BLOCK_N=128)], "down": SPACE["down"]}

    def measure(config):
        if config.gate_up.BLOCK_N == 128:
            raise RuntimeError("out of shared memory")
        return cost(config)

    out = autotune.search(DEFAULT, space, measure, budget_s=60)
    assert (out.config.gate_up.BLOCK_N, out.config.down.BLOCK_N) == (64, 8)
    assert out.default_ms == pytest.approx(cost(DEFAULT)) and out.ms == pytest.approx(cost(out.config))
    assert (out.timed, out.failed, out.complete) == (5, 1, True) and out.speedup > 1


def test_search_stops_at_its_budget_and_keeps_the_default_in_the_race():
    ticks = iter(range(100))
    out = autotune.search(DEFAULT, SPACE, cost, budget_s=1.5, clock=lambda: next(ticks))
    assert not out.complete and out.timed == 2  # the default and one candidate, then the clock ran out
    slower = autotune.search(DEFAULT, {"gate_up": [lowbit(BLOCK_N=8)]}, cost, budget_s=60)
    assert slower.config == DEFAULT


def test_a_gpu_with_no_stored_config_tunes_once_and_reuses_the_cache(fresh, capsys):
    family = Counter()
    chosen = family.choose(5)  # bucket 4
    assert (chosen.gate_up.BLOCK_N, chosen.down.BLOCK_N) == (64, 8) and family.searches == 1
    assert "tuning lowbit_moe b3_E4_D64_F96 at 4 tokens on Fake GPU 80GB" in capsys.readouterr().err
    timed = len(family.timed)
    assert family.choose(5) == chosen and family.choose(7) == chosen and len(family.timed) == timed  # same bucket
    path = tune_cache.table_file(FAKE.slug, FAKE.capability)
    assert path.name == "fake-gpu-80gb-sm90.json"
    table = json.loads(path.read_text())
    assert table["device"] == FAKE.name and table["hardware"]["sms"] == 8
    assert table["lowbit_moe"][SHAPE]["4"] == chosen.as_dict()

    autotune.forget()  # a new process: reads the cache, searches nothing
    again = Counter()
    assert again.choose(6) == chosen and again.searches == 0 and again.timed == []
    assert capsys.readouterr().err == ""


def test_tuning_off_and_capture_use_the_default(fresh, monkeypatch):
    family = Counter()
    monkeypatch.setenv("MOESERVE_TUNE", "off")
    assert family.choose(1) == DEFAULT and family.searches == 0
    autotune.forget()
    monkeypatch.setenv("MOESERVE_TUNE", "quick")
    monkeypatch.setattr(autotune, "capturing", lambda: True)
    assert family.choose(2) == DEFAULT and family.searches == 0  # never a search inside a CUDA-graph capture
    monkeypatch.setattr(autotune, "capturing", lambda: False)
    assert family.choose(2) != DEFAULT and family.searches == 1  # the next eager call tunes
    assert family.choose(128) == DEFAULT and family.searches == 1  # above AUTO_MAX_TOKENS: `moeserve tune` only
    monkeypatch.setenv("MOESERVE_TUNE", "fast")
    autotune.forget()
    with pytest.raises(MoeserveError, match="MOESERVE_TUNE must be off, quick or full"):
        family.choose(4)


def test_a_corrupted_cache_is_ignored_with_a_warning_and_rewritten(fresh):
    path = tune_cache.table_file(FAKE.slug, FAKE.capability)
    path.parent.mkdir(parents=True)
    for junk in ('{"lowbit_moe": {"b3_E4_D64_F96": {"4": {"gate_up": {"BLOCK_N": 1', '{"lowbit_moe": [1, 2]}'):
        path.write_text(junk)
        autotune.forget()
        family = Counter()
        with pytest.warns(UserWarning, match="ignoring the tuning cache .*fake-gpu-80gb-sm90.json"):
            chosen = family.choose(4)
        assert family.searches == 1
        assert json.loads(path.read_text())["lowbit_moe"][SHAPE]["4"] == chosen.as_dict()  # rewritten, valid


def write_entries(args) -> None:
    """Worker: store `count` winners of its own (distinct token buckets of its own shape), one write each."""
    cache, worker, count = args
    import os

    os.environ["MOESERVE_CACHE"] = cache
    for n in range(count):
        config = ExpertsConfig(lowbit(BLOCK_N=16 * (1 + n % 4)), lowbit(BLOCK_N=8, SPLIT_K=1 + worker))
        autotune.store(FAKE, autotune.Problem("lowbit_moe", f"b3_E4_D64_F{96 + worker}", 1 << n), config)


def test_concurrent_processes_writing_the_cache_keep_every_entry(fresh):
    workers, count = 4, 12
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        pool.map(write_entries, [(str(fresh / "cache"), w, count) for w in range(workers)])
    path = tune_cache.table_file(FAKE.slug, FAKE.capability)
    table = json.loads(path.read_text())
    configs.typed_sections(table, path.name)
    assert {shape: len(by_count) for shape, by_count in table["lowbit_moe"].items()} == {
        f"b3_E4_D64_F{96 + w}": count for w in range(workers)}
    assert not list(path.parent.glob("*.tmp"))


def test_cached_entries_win_over_shipped_ones(fresh):
    shipped = {"gate_up": DEFAULT.gate_up.as_dict(), "down": DEFAULT.down.as_dict()}
    configs.write_sections(FAKE.name, {"lowbit_moe": {SHAPE: {"1": shipped, "4": shipped}}},
                           configs.CONFIG_DIR / "fake-gpu-80gb.json")
    tuned = ExpertsConfig(lowbit(BLOCK_N=64), lowbit(BLOCK_N=8))
    autotune.store(FAKE, autotune.Problem("lowbit_moe", SHAPE, 4), tuned)
    entries = configs.launch_tables(FAKE.name)["lowbit_moe"][SHAPE]
    assert entries["4"] == tuned and entries["1"] == DEFAULT
    assert configs.stored(FAKE.name, "lowbit_moe", SHAPE, 1) and not configs.stored(FAKE.name, "lowbit_moe", SHAPE, 2)


def test_buckets():
    assert [autotune.bucket(t) for t in (1, 2, 3, 4, 7, 8, 63, 64, 65)] == [1, 2, 2, 4, 4, 8, 32, 64, 64]


def test_defaults_fit_the_gpu():
    """One token on Hopper with group-64 experts: TMA, down split so its small programs fill the SMs (fewer SMs,
    fewer slices; compensators: none); elsewhere the GEMV; many rows: pipelined tensor-core tiles with the stages
    the shared memory holds, the plain tile where two do not fit."""
    h100 = DeviceInfo("H", (9, 0), sms=132)
    one = configs.lowbit_moe_default(h100, 4, 8, 4096, 14336, 1)
    assert one.gate_up.TMA == one.down.TMA == 1 and one.down.SPLIT_K > 1 and one.gate_up.SPLIT_K == 1
    assert configs.lowbit_moe_default(DeviceInfo("H", (9, 0), sms=16), 4, 8, 4096, 14336, 1).down.SPLIT_K == 1
    assert configs.lowbit_moe_default(h100, 4, 8, 4096, 14336, 1, lowrank=True).down.SPLIT_K == 1
    assert configs.lowbit_moe_default(DeviceInfo("A", (8, 0), sms=108), 4, 8, 4096, 14336, 1).gate_up.TMA == 0
    assert configs.lowbit_moe_default(h100, 4, 8, 4096, 14336, 1, group=128).gate_up.TMA == 0
    few = configs.lowbit_moe_default(h100, 3, 8, 4096, 14336, 4)
    assert few.gate_up.BLOCK_M == 1 and few.gate_up.PIPE == 0  # 4 tokens x top-2 / 8 experts: one row each
    many = configs.lowbit_moe_default(h100, 3, 8, 4096, 14336, 16)
    assert (many.gate_up.PIPE, many.gate_up.PAIRED, many.gate_up.BLOCK_M) == (3, 1, None)
    four = configs.lowbit_moe_default(h100, 4, 8, 4096, 14336, 16)
    assert (four.gate_up.PIPE, four.gate_up.PAIRED, four.gate_up.BLOCK_N) == (3, 1, 64)
    small = configs.lowbit_moe_default(DeviceInfo("L", (8, 9), sms=142, smem_per_block=99 * 1024), 4, 8, 4096,
                                       14336, 16)
    assert (small.gate_up.PIPE, small.gate_up.PAIRED) == (3, 0) and small.down.PIPE == 2  # smaller steps fit
    rows16 = configs.lowbit_moe_default(h100, 4, 8, 4096, 14336, 64)  # 16 rows an expert: 128-row tiles, 8 warps
    assert (rows16.gate_up.BLOCK_N, rows16.gate_up.num_warps) == (128, 8)
    assert (rows16.down.BLOCK_N, rows16.down.num_warps) == (128, 8)
    assert configs.lowbit_moe_default(h100, 3, 8, 4096, 14336, 64).gate_up.BLOCK_N == 32  # 3 bits: paired 32
    tiny = DeviceInfo("T", (7, 5), sms=40, smem_per_block=16 * 1024)
    assert configs.lowbit_moe_default(tiny, 4, 8, 4096, 14336, 16).down == configs.LOWBIT_DOT
    wide = configs.fused_moe_default(h100, 64, 2048, 1408, 1, 6)  # 6 experts with rows: narrower blocks fill it
    base = configs.fused_moe_default(h100, 8, 4096, 14336, 1, 2)
    assert wide.gate_up.BLOCK_N < base.gate_up.BLOCK_N == 128


@pytest.mark.parametrize("mode", spaces.MODES)
@pytest.mark.parametrize("tokens", [1, 2, 4, 16, 64])
def test_candidates_are_valid_and_fit(mode, tokens):
    for device in (DeviceInfo("H", (9, 0)), DeviceInfo("L", (8, 9), sms=142, smem_per_block=99 * 1024)):
        space = spaces.lowbit_moe_candidates(mode, device, tokens, 8, 2, 4096, 14336)
        assert space["gate_up"] and space["down"]
        for part, cands in space.items():
            assert len(set(cands)) == len(cands) and all(c.SPLIT_K == 1 for c in space["gate_up"])
            assert all(configs.pipe_stages(device, 2 * c.BLOCK_N, c.BLOCK_K, c.PIPE) == c.PIPE for c in cands
                       if c.PIPE)
            assert device.hopper or not any(c.TMA for c in cands)
            assert tokens > 1 or all(c.BLOCK_M is None and not c.PIPE for c in cands)  # one token: GEMVs
        fused = spaces.fused_moe_candidates(mode, tokens, 4096, 14336)
        assert all(fused[p] for p in ("gate_up", "down"))
    quick = spaces.lowbit_moe_candidates("quick", DeviceInfo("H", (9, 0)), tokens, 8, 2, 4096, 14336)
    full = spaces.lowbit_moe_candidates("full", DeviceInfo("H", (9, 0)), tokens, 8, 2, 4096, 14336)
    assert len(quick["down"]) < len(full["down"]) and len(quick["gate_up"]) <= 24
    first = quick["gate_up"][0]  # best first: CUDA-core rows below 4 rows an expert, tensor cores from there
    if tokens in (2, 4):
        assert first.BLOCK_M is not None
    if tokens >= 16:  # 16 tokens x top-2 / 8 experts = 4 rows an expert
        assert first.BLOCK_M is None and first.PIPE


def test_a_cache_with_an_unknown_key_is_ignored(fresh):
    path = tune_cache.table_file(FAKE.slug, FAKE.capability)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"lowbit_moe": {SHAPE: {"1": {"gate_up": {"BLOCK_N": 8, "BLOCK_K": 64,
                                                                          "num_warps": 4, "WARPS": 2},
                                                             "down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4}}}}}))
    with pytest.warns(UserWarning, match="unknown key 'WARPS'"):
        assert configs.launch_tables(FAKE.name)["lowbit_moe"] == {}
