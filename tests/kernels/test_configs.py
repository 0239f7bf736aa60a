"""Launch configs (kernels/triton/configs.py): typed entries, their defaults, the shipped tables, and the lookups that
pick an entry per GPU, shape and count. No kernel runs here."""

import json

import pytest

from moeserve.kernels.triton import configs
from moeserve.kernels.triton.configs import (DEFAULT_TILES, ExpertsConfig, FusedMoEConfig, LowbitConfig,
                                             fused_moe_default, typed_sections)
from moeserve.kernels.triton.device import DeviceInfo

SHIPPED = sorted(configs.CONFIG_DIR.glob("*.json"))


def test_configs_ship_for_some_gpu():
    assert SHIPPED, f"no tables in {configs.CONFIG_DIR}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_entry_loads_as_written(path):
    """Each entry of every shipped table becomes a typed config (a key no kernel reads would raise), and gives back
    the entry exactly as written, so a tuner that rewrites the table writes the same JSON."""
    table = json.loads(path.read_text())
    typed = typed_sections(table, path.name)
    for section, by_shape in typed.items():
        for shape, by_count in by_shape.items():
            for count, config in by_count.items():
                assert json.dumps(config.as_dict()) == json.dumps(table[section][shape][count])  # keys in order
    assert sum(len(by_count) for by_shape in typed.values() for by_count in by_shape.values()) > 0


@pytest.mark.parametrize("kind,section", [(LowbitConfig, "lowbit"), (FusedMoEConfig, "fused_moe")])
def test_an_unknown_key_raises_naming_it_and_where(kind, section):
    with pytest.raises(ValueError, match=r"x\.json \[lowbit\]\[b4_N64_K64\]\[1\]: unknown key 'AHAED'"):
        kind.of({"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "BLOCK_M": 16, "AHAED": 2},
                "x.json [lowbit][b4_N64_K64][1]")
    table = {"device": "Test GPU", section: {"E4_D64_F96" if section == "fused_moe" else "b4_N64_K64": {"1": (
        {"gate_up": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4},
         "down": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "TMAA": 1}} if section == "fused_moe"
        else {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "PIPES": 3})}}}
    with pytest.raises(ValueError, match=rf"test\.json \[{section}\].*unknown key '(TMAA|PIPES)'"):
        typed_sections(table, "test.json")
    with pytest.raises(ValueError, match="unknown section 'lowbit-moe'"):
        typed_sections({"lowbit-moe": {}}, "test.json")
    with pytest.raises(ValueError, match="unknown key 'up'"):
        ExpertsConfig.of({"gate_up": {}, "down": {}, "up": {}}, kind, "test.json")


def test_bad_values_and_missing_keys_raise():
    with pytest.raises(ValueError, match="has no BLOCK_K"):
        LowbitConfig.of({"BLOCK_N": 32, "num_warps": 4})
    with pytest.raises(ValueError, match="SPLIT_K = '2' is not"):
        LowbitConfig.of({"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "SPLIT_K": "2"})
    with pytest.raises(ValueError, match="has no BLOCK_M"):
        FusedMoEConfig.of({"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4})  # the bf16 kernels always tile rows
    with pytest.raises(ValueError, match="schedule"):
        FusedMoEConfig.of({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "schedule": "tile"})


def test_defaults_live_in_the_config_classes():
    """A config written with only the required keys gets each family's defaults, and writes back only its keys."""
    entry = {"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4}
    cfg = LowbitConfig.of(entry)
    assert (cfg.BLOCK_M, cfg.SPLIT_K, cfg.SUB, cfg.AHEAD, cfg.PIPE, cfg.HALF, cfg.PAIRED, cfg.TMA, cfg.BLOCK_R,
            cfg.num_stages, cfg.ms) == (None, 1, 1, 1, 0, 1, 0, 0, 32, 3, None)
    assert cfg.as_dict() == entry
    assert cfg == LowbitConfig(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3)  # the keys written do not count
    bf16 = FusedMoEConfig.of({"BLOCK_M": 16, **entry})
    assert (bf16.schedule, bf16.TMA, bf16.num_stages) == ("decode", 0, 3)
    assert fused_moe_default(DeviceInfo("Test GPU", (9, 0)), 8, 64, 96, 1).gate_up.schedule == "decode"
    assert DEFAULT_TILES.down.schedule == "tiles"


def test_replace_keeps_the_entry_as_written():
    """replace is {**entry, **changes}: new keys go last, None drops an optional key (ms: the tuner's time)."""
    cfg = LowbitConfig.of({"BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "ms": 0.02})
    again = cfg.replace(SPLIT_K=2, BLOCK_N=16, ms=None)
    assert list(again.as_dict().items()) == [("BLOCK_N", 16), ("BLOCK_K", 512), ("num_warps", 4), ("SPLIT_K", 2)]
    assert cfg.as_dict()["ms"] == 0.02 and hash(again) == hash(LowbitConfig.of(again.as_dict()))


def test_lowbit_moe_configs_with_compensators_prefer_their_own_entries(tmp_path, monkeypatch):
    """Tuned `_lr` entries serve experts with compensators; without one, the plain entry does; a run that tunes one
    key keeps the others."""
    from moeserve.kernels.triton import configs

    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.device_table.cache_clear()
    configs.launch_tables.cache_clear()
    plain = {"gate_up": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}, "down": {"BLOCK_N": 32, "BLOCK_K": 512,
                                                                                  "num_warps": 4, "SPLIT_K": 2}}
    lowrank = {"gate_up": {**plain["gate_up"], "SUB": 4}, "down": {**plain["down"], "BLOCK_N": 16}}
    typed = {name: configs.ExpertsConfig.of(entry, configs.LowbitConfig) for name, entry in (("plain", plain),
                                                                                          ("lowrank", lowrank))}
    try:
        configs.write_sections("Test GPU", {"lowbit_moe": {configs.lowbit_moe_key(3, 8, 64, 96): {"1": plain}}})
        assert configs.lowbit_moe_config("Test GPU", 3, 8, 64, 96, 1, 2, True) == typed["plain"]  # no _lr entry yet
        configs.write_sections("Test GPU", {"lowbit_moe": {configs.lowbit_moe_key(3, 8, 64, 96, True): {"1": lowrank}}})
        assert configs.lowbit_moe_config("Test GPU", 3, 8, 64, 96, 1, 2, True) == typed["lowrank"]
        assert configs.lowbit_moe_config("Test GPU", 3, 8, 64, 96, 1, 2, False) == typed["plain"]
        assert configs.lowbit_moe_config("Test GPU", 4, 8, 64, 96, 1, 2, True) != typed["lowrank"]  # other widths
    finally:
        monkeypatch.undo()
        for cached in (configs.device_table, configs.launch_tables, configs.lowbit_config, configs.lowbit_moe_config):
            cached.cache_clear()
