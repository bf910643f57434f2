"""Presets: named sets of graph-shaping settings, stored as TOML, loaded into an EngineConfig.

A preset holds only what a compiled graph depends on (dtype, block size, max_model_len, bucket
sets, tensor-parallel degree, per-backend compiler settings). Scheduling and server settings are
command-line options and are rejected here, so changing them can never invalidate a compiled
artifact.

Where presets are found, first match wins:
1. a path to a .toml file (anything containing a path separator or ending in ".toml");
2. $TRNRT_PRESETS_DIR/<name>.toml;
3. the checkout's presets/ directory (next to the trnrt package, i.e. ../presets from here);
4. trnrt/presets/ inside the installed package. In the repository this is a symlink to
   ../presets, so a wheel carries the same files as package data (pyproject's "**/*.toml" and
   "**/*.json" globs follow it), and an installed trnrt finds them with no checkout.

Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trnrt.config.engine_config import EngineConfig, EngineConfigError

PRESET_SUFFIX = ".toml"
LOCK_SUFFIX = ".graphs.lock.json"
BACKENDS = ("cpu", "cuda", "neuron", "eager")

# Top-level keys: name -> (type check, description for error messages).
_INT_KEYS = ("block_size", "max_model_len", "max_top_logprobs", "tensor_parallel", "num_blocks", "num_slots")
_BUCKET_KEYS = ("decode_batch_buckets", "prefill_token_buckets")
_OPTIONAL_BUCKET_KEYS = ("decode_context_buckets", "prefill_context_buckets")
# MTP speculative decoding: the drafts per verify (graph-shaping) and the serving defaults a
# preset starts with (mode "always" | "dynamic", the dynamic mode's minimum accept length).
_SPEC_KEYS = ("speculative_num_steps", "speculative_mode", "speculative_min_accept_length")
_TOP_KEYS = ("dtype", *_INT_KEYS, *_BUCKET_KEYS, *_OPTIONAL_BUCKET_KEYS, *_SPEC_KEYS, "compiler")
_REQUIRED = ("dtype", "block_size", "max_model_len", "decode_batch_buckets", "prefill_token_buckets")
# Per backend: "args" (command-line arguments of the backend compiler, e.g. neuronx-cc) and
# "inductor" (torch._inductor config overrides, for cpu and cuda).
_COMPILER_KEYS = ("args", "inductor")


class PresetError(EngineConfigError):
    """A preset is missing, malformed or invalid. `field` names the offending key."""

    def __init__(self, message: str, field: str | None = None, path: Path | None = None):
        where = f"{path}: " if path is not None else ""
        super().__init__(f"{where}{message}", field=field)
        self.path = path


@dataclass(frozen=True)
class Preset:
    """A parsed preset: its name, file, the EngineConfig and the canonical settings it came from."""

    name: str
    path: Path
    engine_config: EngineConfig
    settings: dict  # canonical, fully defaulted settings (what preset_hash covers)

    @property
    def sha256(self) -> str:
        return preset_hash(self.engine_config)

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.name + LOCK_SUFFIX)


def preset_dirs() -> list[Path]:
    """Directories searched for <name>.toml, in order."""
    dirs: list[Path] = []
    env = os.environ.get("TRNRT_PRESETS_DIR")
    if env:
        dirs.append(Path(env))
    here = Path(__file__).resolve().parent  # trnrt/config
    dirs.append(here.parents[1] / "presets")  # checkout: <repo>/presets
    dirs.append(here.parent / "presets")  # installed package data: trnrt/presets
    seen, out = set(), []
    for d in dirs:
        key = d.resolve() if d.exists() else d
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def list_presets() -> list[str]:
    """Names of every preset found in preset_dirs(), sorted."""
    names = set()
    for d in preset_dirs():
        if d.is_dir():
            names.update(p.name[: -len(PRESET_SUFFIX)] for p in d.glob("*" + PRESET_SUFFIX))
    return sorted(names)


def find_preset(name_or_path: str | os.PathLike) -> Path:
    """The file of a preset given by name ("batch8") or path ("presets/batch8.toml")."""
    s = os.fspath(name_or_path)
    if s.endswith(PRESET_SUFFIX) or os.sep in s or "/" in s:
        p = Path(s)
        if not p.is_file():
            raise PresetError(f"preset file {s} does not exist", field="preset")
        return p
    for d in preset_dirs():
        p = d / (s + PRESET_SUFFIX)
        if p.is_file():
            return p
    known = ", ".join(list_presets()) or "none"
    raise PresetError(f"unknown preset {s!r} (known: {known})", field="preset")


def _err(msg: str, field: str, path: Path) -> PresetError:
    if field.split(".")[-1] not in msg:
        msg = f"{field}: {msg}"
    return PresetError(msg, field=field, path=path)


def _check_int(raw: dict, key: str, path: Path) -> None:
    v = raw[key]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise _err(f"{key} must be a positive integer, got {v!r}", key, path)


def _parse_compiler(raw: Any, path: Path) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, dict):
        raise _err("compiler must be a table of backend tables, e.g. [compiler.neuron]", "compiler", path)
    out = []
    for backend in sorted(raw):
        table = raw[backend]
        field = f"compiler.{backend}"
        if backend not in BACKENDS:
            raise _err(f"unknown backend {backend!r} in [compiler] (known: {', '.join(BACKENDS)})", field, path)
        if not isinstance(table, dict):
            raise _err(f"{field} must be a table", field, path)
        for key in table:
            if key not in _COMPILER_KEYS:
                raise _err(f"unknown key {key!r} in [{field}] (known: {', '.join(_COMPILER_KEYS)})", f"{field}.{key}", path)
        args = table.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise _err(f"{field}.args must be a list of strings", f"{field}.args", path)
        inductor = table.get("inductor", {})
        if not isinstance(inductor, dict):
            raise _err(f"{field}.inductor must be a table", f"{field}.inductor", path)
        if inductor and backend not in ("cpu", "cuda"):
            raise _err(f"{field}.inductor applies to the cpu and cuda backends only", f"{field}.inductor", path)
        canon = {"args": list(args), "inductor": dict(sorted(inductor.items()))}
        out.append((backend, json.dumps(canon, sort_keys=True, separators=(",", ":"))))
    return tuple(out)


def parse_preset(raw: dict, name: str, path: Path) -> Preset:
    """Validate a decoded TOML table and build the Preset. Errors name the offending field."""
    for key in raw:
        if key not in _TOP_KEYS:
            raise _err(f"unknown key {key!r} (known: {', '.join(_TOP_KEYS)})", key, path)
    for key in _REQUIRED:
        if key not in raw:
            raise _err(f"missing required key {key!r}", key, path)
    if not isinstance(raw["dtype"], str):
        raise _err(f"dtype must be a string, got {raw['dtype']!r}", "dtype", path)
    for key in _INT_KEYS:
        if key in raw:
            _check_int(raw, key, path)
    for key in (*_BUCKET_KEYS, *[k for k in _OPTIONAL_BUCKET_KEYS if k in raw]):
        v = raw[key]
        if not isinstance(v, list) or not v or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in v):
            raise _err(f"{key} must be a non-empty list of positive integers, got {v!r}", key, path)
        if v != sorted(set(v)):
            raise _err(f"{key} must be strictly increasing, got {v!r}", key, path)
    if raw["max_model_len"] % raw["block_size"]:
        raise _err(
            f"max_model_len ({raw['max_model_len']}) must be a multiple of block_size ({raw['block_size']})",
            "max_model_len", path,
        )
    if raw["prefill_token_buckets"][-1] > raw["max_model_len"]:
        raise _err(
            f"the largest prefill bucket ({raw['prefill_token_buckets'][-1]}) exceeds max_model_len ({raw['max_model_len']})",
            "prefill_token_buckets", path,
        )
    if "speculative_num_steps" in raw:
        _check_int(raw, "speculative_num_steps", path)
    if "speculative_mode" in raw and raw["speculative_mode"] not in ("always", "dynamic"):
        raise _err(f"speculative_mode must be \"always\" or \"dynamic\", got {raw['speculative_mode']!r}",
                   "speculative_mode", path)
    max_batch = raw["decode_batch_buckets"][-1]
    # Defaults: enough slots for a full decode batch plus as many sequences being prefilled or
    # waiting with state, plus the scratch slot 0; enough blocks for every slot at max_model_len,
    # plus the scratch block 0.
    num_slots = raw.get("num_slots", 2 * max_batch + 1)
    blocks_per_seq = raw["max_model_len"] // raw["block_size"]
    num_blocks = raw.get("num_blocks", (num_slots - 1) * blocks_per_seq + 1)
    try:
        cfg = EngineConfig(
            dtype=raw["dtype"],
            block_size=raw["block_size"],
            max_model_len=raw["max_model_len"],
            decode_batch_buckets=tuple(raw["decode_batch_buckets"]),
            prefill_token_buckets=tuple(raw["prefill_token_buckets"]),
            decode_context_buckets=tuple(raw.get("decode_context_buckets", ())),
            prefill_context_buckets=tuple(raw.get("prefill_context_buckets", ())),
            num_blocks=num_blocks,
            num_slots=num_slots,
            max_top_logprobs=raw.get("max_top_logprobs", 20),
            preset=name,
            tensor_parallel=raw.get("tensor_parallel", 1),
            compiler_args=_parse_compiler(raw.get("compiler", {}), path),
            speculative_num_steps=raw.get("speculative_num_steps", 0),
            speculative_mode=raw.get("speculative_mode", "always" if raw.get("speculative_num_steps") else ""),
            speculative_min_accept_length=raw.get("speculative_min_accept_length", 0.0),
        )
    except PresetError:
        raise
    except EngineConfigError as e:
        raise _err(str(e), e.field or "preset", path) from None
    return Preset(name=name, path=path, engine_config=cfg, settings=graph_settings(cfg))


def read_preset(name_or_path: str | os.PathLike) -> Preset:
    """Find, parse and validate a preset."""
    path = find_preset(name_or_path)
    name = path.name[: -len(PRESET_SUFFIX)] if path.name.endswith(PRESET_SUFFIX) else path.stem
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise PresetError(f"not valid TOML: {e}", field=None, path=path) from None
    return parse_preset(raw, name, path)


def load_preset(name_or_path: str | os.PathLike) -> EngineConfig:
    """The EngineConfig of a preset given by name or path (no variants enabled)."""
    return read_preset(name_or_path).engine_config


def graph_settings(cfg: EngineConfig) -> dict:
    """Every EngineConfig field a graph depends on, canonical (the preset hash covers these).

    `preset` (a name) and `variants` (flags chosen at compile time) are left out: the manifest
    records the flags itself, and renaming a preset file does not change a graph.
    `prefill_context_buckets` and `speculative_num_steps` appear only when set, so the presets
    without them keep their hash. The speculative serving defaults (mode, minimum accept length)
    shape no graph and are left out: mtp-always and mtp-dynamic hash the same.
    """
    out = {
        "dtype": cfg.dtype,
        "block_size": cfg.block_size,
        "max_model_len": cfg.max_model_len,
        "decode_batch_buckets": list(cfg.decode_batch_buckets),
        "prefill_token_buckets": list(cfg.prefill_token_buckets),
        "decode_context_buckets": list(cfg.decode_context_buckets),
        "num_blocks": cfg.num_blocks,
        "num_slots": cfg.num_slots,
        "max_top_logprobs": cfg.max_top_logprobs,
        "tensor_parallel": cfg.tensor_parallel,
        "compiler": {b: json.loads(a) for b, a in cfg.compiler_args},
    }
    if cfg.prefill_context_buckets:
        out["prefill_context_buckets"] = list(cfg.prefill_context_buckets)
    if cfg.speculative_num_steps:
        out["speculative_num_steps"] = cfg.speculative_num_steps
    return out


def phase_settings_hash(cfg: EngineConfig, phase: str) -> str:
    """The preset hash a graph of `phase` depends on: preset_hash, except that a plain phase
    (decode, prefill) leaves out speculative_num_steps, which only the verify / draft graphs read.
    So an mtp preset's plain graphs share their fingerprint-cache entries with the preset it
    extends (their graphs are the same graphs)."""
    settings = graph_settings(cfg)
    if phase in ("decode", "prefill"):
        settings.pop("speculative_num_steps", None)
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def preset_hash(cfg: EngineConfig) -> str:
    """sha256 over graph_settings(cfg) as canonical JSON (comments and key order do not count)."""
    blob = json.dumps(graph_settings(cfg), sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def compiler_options(cfg: EngineConfig, backend: str) -> dict:
    """{"args": [...], "inductor": {...}} for `backend` (empty when the preset sets none)."""
    for b, a in cfg.compiler_args:
        if b == backend:
            return json.loads(a)
    return {"args": [], "inductor": {}}
