"""SpeculativeConfig: which drafter, how many drafts; SGLang's and vLLM's spellings. Pure Python.

SGLang: `--speculative-algorithm NEXTN|EAGLE` (for a model with an MTP / nextn layer both mean
"draft with that layer"; SGLang turns NEXTN into EAGLE), `--speculative-num-steps k`,
`--speculative-eagle-topk 1`, `--speculative-num-draft-tokens k+1` (with top-k 1, the steps and
the bonus token). vLLM: `--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'`.
trnrt drafts a chain (top-k 1) with the model's own MTP layer; other algorithms (EAGLE3,
STANDALONE, NGRAM, a separate draft model) and tree drafting (top-k > 1) are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Iterable

#: Accepted algorithm names (upper-cased) -> what trnrt runs.
ALGORITHMS = {"NEXTN": "NEXTN", "EAGLE": "NEXTN", "MTP": "NEXTN"}
DEFAULT_NUM_STEPS = 3  # SGLang's GLM/DeepSeek MTP recipes use 3 steps, top-k 1, 4 draft tokens
MAX_NUM_STEPS = 8


class SpeculativeConfigError(ValueError):
    """A speculative setting trnrt cannot serve; `field` names the option."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SpeculativeConfig:
    """algorithm: "NEXTN" (the model's MTP layer drafts); num_steps: drafts per verify (k)."""

    algorithm: str = "NEXTN"
    num_steps: int = DEFAULT_NUM_STEPS
    # Dynamic speculation: after `probe_verifies` verifies, a request whose tokens per verify
    # (accepted drafts + 1) average below this goes on with plain decode steps (its own
    # graphs, compiled when loaded). 0: always speculate.
    min_accept_length: float = 0.0
    probe_verifies: int = 4
    # ... and while the engine's last 100 verifies (all requests) emit fewer tokens than that on
    # average, only one new request in `probe_every` speculates (to keep measuring) and a request
    # below the line falls back after one verify (trnrt.engine.spec.policy).
    probe_every: int = 16

    @property
    def num_draft_tokens(self) -> int:
        """SGLang's --speculative-num-draft-tokens for a chain: the drafts and the bonus token."""
        return self.num_steps + 1


def resolve_speculative(algorithm: str | None = None, num_steps: int | None = None, eagle_topk: int | None = None,
                        num_draft_tokens: int | None = None, vllm_config: str | dict | None = None,
                        min_accept_length: float | None = None) -> SpeculativeConfig | None:
    """The SpeculativeConfig of SGLang's flags and/or vLLM's --speculative-config (None: off).

    Raises SpeculativeConfigError naming the option for what trnrt does not serve."""
    if vllm_config is not None:
        cfg = vllm_config
        if isinstance(cfg, str):
            try:
                cfg = json.loads(cfg)
            except ValueError as e:
                raise SpeculativeConfigError(f"--speculative-config is not JSON: {e}", "--speculative-config")
        if not isinstance(cfg, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object", "--speculative-config")
        method = cfg.get("method")
        if method is None or str(method).lower() not in ("mtp", "nextn", "deepseek_mtp", "glm4_moe_mtp"):
            raise SpeculativeConfigError(f"--speculative-config method {method!r}: trnrt drafts with the model's "
                                         "MTP layer only (method \"mtp\")", "--speculative-config")
        unknown = sorted(set(cfg) - {"method", "num_speculative_tokens", "model"})
        if unknown:
            raise SpeculativeConfigError(f"--speculative-config: unsupported keys {unknown}", "--speculative-config")
        if algorithm is None:
            algorithm = "NEXTN"
        if num_steps is None and cfg.get("num_speculative_tokens") is not None:
            num_steps = cfg["num_speculative_tokens"]
    if algorithm is None:
        for name, v in (("--speculative-num-steps", num_steps), ("--speculative-eagle-topk", eagle_topk),
                        ("--speculative-num-draft-tokens", num_draft_tokens),
                        ("--speculative-min-accept-length", min_accept_length)):
            if v is not None:
                raise SpeculativeConfigError(f"{name} needs --speculative-algorithm", name)
        return None
    algo = ALGORITHMS.get(str(algorithm).upper())
    if algo is None:
        raise SpeculativeConfigError(
            f"--speculative-algorithm {algorithm!r}: trnrt serves NEXTN (alias EAGLE, MTP): drafts from the "
            "model's own MTP layer", "--speculative-algorithm")
    if eagle_topk is not None and eagle_topk != 1:
        raise SpeculativeConfigError("--speculative-eagle-topk: only 1 (chain drafting) is served",
                                     "--speculative-eagle-topk")
    if num_steps is None and num_draft_tokens is not None:
        num_steps = num_draft_tokens - 1
    if num_steps is None:
        num_steps = DEFAULT_NUM_STEPS
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or not 1 <= num_steps <= MAX_NUM_STEPS:
        raise SpeculativeConfigError(f"--speculative-num-steps must be 1..{MAX_NUM_STEPS}, got {num_steps!r}",
                                     "--speculative-num-steps")
    if num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
        raise SpeculativeConfigError(
            f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 ({num_steps + 1}) with top-k 1, "
            f"got {num_draft_tokens}", "--speculative-num-draft-tokens")
    mal = 0.0 if min_accept_length is None else float(min_accept_length)
    if not 0.0 <= mal <= num_steps + 1:
        raise SpeculativeConfigError(f"--speculative-min-accept-length must be 0..{num_steps + 1} (tokens per "
                                     f"verify), got {min_accept_length}", "--speculative-min-accept-length")
    return SpeculativeConfig(algorithm=algo, num_steps=num_steps, min_accept_length=mal)


def preset_speculative(spec: SpeculativeConfig | None, engine_config, num_steps_given: bool = True,
                       min_accept_given: bool = True) -> SpeculativeConfig | None:
    """The speculative config of a run on `engine_config`'s preset.

    A preset with speculative_num_steps k (mtp-always, mtp-dynamic) turns speculation on by
    itself: with no flags, NEXTN with k drafts and the preset's minimum accept length (dynamic
    mode; 0 = always). Flags refine it: the steps must be k (the verify graphs hold k + 1 tokens
    a row; a different count is refused naming --speculative-num-steps), and a
    --speculative-min-accept-length replaces the preset's. A preset without speculative graphs
    leaves `spec` as it is (eager speculation beside its plain graphs). `*_given`: whether the
    flags set the steps / the minimum (False: resolve_speculative's defaults stand in for them)."""
    k = getattr(engine_config, "speculative_num_steps", 0)
    if not k:
        return spec
    mal = engine_config.speculative_min_accept_length if engine_config.speculative_mode == "dynamic" else 0.0
    if spec is None:
        return SpeculativeConfig(num_steps=k, min_accept_length=mal)
    if not num_steps_given:
        spec = replace(spec, num_steps=k)
    elif spec.num_steps != k:
        raise SpeculativeConfigError(
            f"--speculative-num-steps {spec.num_steps}: preset {engine_config.preset!r} verifies {k} drafts a step "
            f"(its graphs take {k + 1} tokens a row); leave the flag out or pass {k}", "--speculative-num-steps")
    if not min_accept_given:
        spec = replace(spec, min_accept_length=mal)
    return spec


#: The flags an always-speculating preset refuses: logits processors the verify / draft graphs lack.
REFUSED_FLAGS = ("penalties", "structured_outputs")


class SpeculativeFlagError(ValueError):
    """A flag a `speculative_mode = "always"` preset refuses (every request speculates, and the
    speculative graphs have no grammar / penalty variant); `field` names the flag."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_speculative_flags(engine_config, flags: Iterable[str]) -> None:
    """Raise SpeculativeFlagError when an always-speculating preset gets a logits-processor flag
    (--structured-outputs, --penalties); prompt logprobs (prefill only) are served."""
    bad = sorted(set(flags) & set(REFUSED_FLAGS))
    if getattr(engine_config, "speculative_mode", "") == "always" and bad:
        opts = ", ".join("--" + f.replace("_", "-") for f in bad)
        raise SpeculativeFlagError(
            f"preset {engine_config.preset!r} speculates on every request and its verify / draft graphs have no "
            f"grammar or penalty variant: {opts} needs a dynamic preset (mtp-dynamic runs such requests on "
            f"plain steps) or a plain one", "--" + bad[0].replace("_", "-"))
