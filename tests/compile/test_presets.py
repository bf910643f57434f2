"""Presets: shipped files load into EngineConfig; every invalid file is refused naming the field."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trnrt.config.engine_config import EngineConfig
from trnrt.config.presets import (
    PresetError, compiler_options, find_preset, list_presets, load_preset, preset_hash, read_preset,
)

ROOT = Path(__file__).resolve().parents[2]

GOOD = """
dtype = "float32"
block_size = 16
max_model_len = 256
decode_batch_buckets = [1, 2]
prefill_token_buckets = [16]
"""


def write(tmp_path: Path, text: str, name: str = "p") -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


def test_shipped_presets_load():
    assert {"default", "batch8"} <= set(list_presets())
    d = load_preset("default")
    assert isinstance(d, EngineConfig)
    assert d.preset == "default"
    assert d.decode_batch_buckets == (1, 8, 32)
    assert d.prefill_token_buckets == (16, 64)
    b = load_preset("batch8")
    assert b.decode_batch_buckets == (8,)
    assert b.prefill_token_buckets == (32, 128)
    assert compiler_options(b, "neuron")["args"]
    assert compiler_options(b, "cuda") == {"args": [], "inductor": {}}


def test_presets_are_package_data():
    # trnrt/presets is a symlink to the repo's presets/, so a wheel carries the same files
    # (pyproject's package-data globs "**/*.toml" and "**/*.json" cover them).
    pkg = ROOT / "trnrt" / "presets"
    assert pkg.is_symlink() and pkg.resolve() == (ROOT / "presets").resolve()
    for name in ("default", "batch8"):
        assert (pkg / f"{name}.toml").is_file()
        assert (pkg / f"{name}.graphs.lock.json").is_file()


def test_found_by_name_path_and_env(tmp_path, monkeypatch):
    p = write(tmp_path, GOOD, "mine")
    assert read_preset(str(p)).engine_config.max_model_len == 256
    monkeypatch.setenv("TRNRT_PRESETS_DIR", str(tmp_path))
    assert find_preset("mine") == p
    assert read_preset("mine").name == "mine"


def test_unknown_preset_lists_known():
    with pytest.raises(PresetError) as e:
        find_preset("no-such-preset")
    assert "default" in str(e.value) and e.value.field == "preset"


@pytest.mark.parametrize(
    "text, field",
    [
        (GOOD + "max_running_requests = 8\n", "max_running_requests"),  # scheduling: not a graph setting
        (GOOD.replace('dtype = "float32"', 'dtype = "float64"'), "dtype"),
        (GOOD.replace("block_size = 16", "block_size = 0"), "block_size"),
        (GOOD.replace("block_size = 16", 'block_size = "16"'), "block_size"),
        (GOOD.replace("[1, 2]", "[2, 1]"), "decode_batch_buckets"),
        (GOOD.replace("[1, 2]", "[]"), "decode_batch_buckets"),
        (GOOD.replace("prefill_token_buckets = [16]", "prefill_token_buckets = [512]"), "prefill_token_buckets"),
        (GOOD.replace("max_model_len = 256", "max_model_len = 250"), "max_model_len"),
        (GOOD.replace("max_model_len = 256\n", ""), "max_model_len"),
        (GOOD + "tensor_parallel = -1\n", "tensor_parallel"),
        (GOOD + "decode_context_buckets = [100]\n", "decode_context_buckets"),  # not a block multiple
        (GOOD + "decode_context_buckets = [256]\n", "decode_context_buckets"),  # not below max_model_len
        (GOOD + "decode_context_buckets = [64, 32]\n", "decode_context_buckets"),
        (GOOD + "decode_context_buckets = []\n", "decode_context_buckets"),
        (GOOD + "[compiler.tpu]\nargs = []\n", "compiler.tpu"),
        (GOOD + "[compiler.neuron]\nflags = []\n", "compiler.neuron.flags"),
        (GOOD + "[compiler.neuron]\nargs = \"-O1\"\n", "compiler.neuron.args"),
        (GOOD + "[compiler.neuron]\ninductor = {x = 1}\n", "compiler.neuron.inductor"),
        (GOOD + "speculative_num_steps = 0\n", "speculative_num_steps"),
        (GOOD + "speculative_num_steps = 9\n", "speculative_num_steps"),
        (GOOD + "speculative_num_steps = 3\nspeculative_mode = \"sometimes\"\n", "speculative_mode"),
        (GOOD + "speculative_mode = \"always\"\n", "speculative_mode"),  # a mode without steps
        (GOOD + "speculative_num_steps = 2\nspeculative_min_accept_length = 4.0\n", "speculative_min_accept_length"),
    ],
)
def test_invalid_presets_name_the_field(tmp_path, text, field):
    p = write(tmp_path, text)
    with pytest.raises(PresetError) as e:
        read_preset(str(p))
    assert e.value.field == field
    assert field.split(".")[-1] in str(e.value)
    assert str(p) in str(e.value)


def test_invalid_toml(tmp_path):
    with pytest.raises(PresetError, match="not valid TOML"):
        read_preset(str(write(tmp_path, "dtype = ")))


def test_preset_hash_ignores_comments_and_order_not_values(tmp_path):
    a = read_preset(str(write(tmp_path, GOOD, "a"))).engine_config
    reordered = "# comment\n" + "\n".join(reversed(GOOD.strip().splitlines())) + "\n"
    b = read_preset(str(write(tmp_path, reordered, "b"))).engine_config
    assert preset_hash(a) == preset_hash(b)  # the name does not count either
    c = read_preset(str(write(tmp_path, GOOD.replace("[16]", "[32]"), "c"))).engine_config
    assert preset_hash(a) != preset_hash(c)
    d = read_preset(str(write(tmp_path, GOOD + "[compiler.neuron]\nargs = [\"-O2\"]\n", "d"))).engine_config
    assert preset_hash(a) != preset_hash(d)


def test_derived_sizes_and_overrides(tmp_path):
    cfg = read_preset(str(write(tmp_path, GOOD))).engine_config
    assert cfg.num_slots == 2 * 2 + 1
    assert cfg.num_blocks == (cfg.num_slots - 1) * (256 // 16) + 1
    cfg = read_preset(str(write(tmp_path, GOOD + "num_slots = 9\nnum_blocks = 100\n"))).engine_config
    assert (cfg.num_slots, cfg.num_blocks) == (9, 100)


def test_decode_context_buckets():
    from trnrt.config import EngineConfig

    cfg = EngineConfig(max_model_len=256, block_size=16, decode_context_buckets=(32, 128))
    assert cfg.context_buckets == (32, 128, 256)
    assert [cfg.context_bucket(n) for n in (1, 32, 33, 128, 129, 256)] == [32, 32, 128, 128, 0, 0]
    assert cfg.table_blocks(32) == 2 and cfg.table_blocks(0) == cfg.max_blocks_per_seq == 16
    assert EngineConfig(max_model_len=256).context_bucket(1) == 0  # no buckets: always the full table
