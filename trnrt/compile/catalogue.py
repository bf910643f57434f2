"""The graph catalogue: which static-shape graphs a preset (and a set of feature flags) needs.

`expand(config, flags)` is the single source of truth for the spec list: `trnrt compile` compiles
exactly these, `trnrt verify graph-equiv` hashes exactly these, and the ModelRunner runs exactly
these. It is pure and deterministic (it computes nothing with torch; GraphSpec's module imports it).

Variants: a feature flag that needs extra device inputs (structured outputs, penalties) adds
*variant* graphs; it never changes the base graphs. The enabled logits-processor flags compile one
superset variant per base spec of the phases they touch (named by the sorted flags joined with
"+"), and the runner feeds neutral inputs to rows that do not use a feature. So #graphs = #base
specs + #base specs of the touched phases, not 2^flags.

`prompt_logprobs` is not a logits processor but another output (every position's logprob, from
all-position logits: a [S, V] head GEMM a plain prefill does not pay), so it adds its own prefill
graphs, one per base prefill spec, named by ALL the enabled flags ("prompt_logprobs", or e.g.
"penalties+prompt_logprobs" carrying the processors too): only a prompt chunk of a request that
asked for prompt logprobs runs in them; every other row runs in the graphs it ran before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from trnrt.config.engine_config import EngineConfig
from trnrt.engine.spec.config import SpeculativeFlagError, check_speculative_flags  # noqa: F401 (re-exported)
from trnrt.engine.runner.step import SAMPLERS, STEP_OUTPUT_NAMES, GraphSpec

BASE_VARIANT = "base"
PHASES = ("decode", "prefill")  # the plain phases; "verify", "draft", "spec_prefill" with speculative_num_steps
_PHASE_ORDER = {p: i for i, p in enumerate(("decode", "prefill", "verify", "draft", "spec_prefill"))}


class UnknownVariantError(ValueError):
    """A flag (or flag set) has no variant graph definition yet."""


@dataclass(frozen=True)
class VariantDef:
    """How a flag set changes the step graph.

    name: the variant name, "+".join(sorted(flags)) (e.g. "penalties+structured_outputs").
    phases: the phases that get a variant graph.
    make_step(model, state, engine_config) -> nn.Module: the variant step function; it takes the
        base STEP_INPUT_NAMES inputs followed by extra_input_names.
    example_extra_inputs(spec, engine_config, vocab_size, device) -> tuple of tensors: neutral
        values of the extra inputs for `spec` (the shapes the graph is compiled for).
    extra_input_names: names of the extra inputs, in order (recorded in the manifest).
    """

    name: str
    phases: tuple[str, ...]
    make_step: Callable
    example_extra_inputs: Callable
    extra_input_names: tuple[str, ...] = ()
    flags: frozenset[str] = field(default_factory=frozenset)
    output_names: tuple[str, ...] = STEP_OUTPUT_NAMES


# Flag sets -> definitions registered explicitly (tests); every other flag set whose flags all
# have a logits processor (trnrt.engine.sample.logits_processors) is derived from them on first use.
_VARIANTS: dict[frozenset[str], VariantDef] = {}
# Flags the command line accepts; a known flag without a registered variant is reported as such.
KNOWN_FLAGS = ("structured_outputs", "penalties", "prompt_logprobs")
# the output flag (its own prefill graphs, see the module docstring), and the variant naming rule
from trnrt.engine.sample.logits_processors import PROMPT_LOGPROBS, processor_flags, variant_name  # noqa: E402


def register_variant(flags: Iterable[str], phases: Iterable[str], make_step: Callable,
                     example_extra_inputs: Callable, extra_input_names: Iterable[str] = ()) -> VariantDef:
    """Define the variant graph of a flag set (replaces an earlier definition of the same set)."""
    fs = frozenset(flags)
    if not fs:
        raise ValueError("a variant needs at least one flag")
    bad = [p for p in phases if p not in _PHASE_ORDER]
    if bad:
        raise ValueError(f"unknown phase(s) {bad}")
    vd = VariantDef(name=variant_name(fs), phases=tuple(phases), make_step=make_step,
                    example_extra_inputs=example_extra_inputs, extra_input_names=tuple(extra_input_names), flags=fs)
    _VARIANTS[fs] = vd
    return vd


def unregister_variant(flags: Iterable[str]) -> None:
    _VARIANTS.pop(frozenset(flags), None)


def get_variant(name_or_flags) -> VariantDef:
    """The definition of a variant, by name ("a+b") or flag set."""
    fs = frozenset(name_or_flags.split("+")) if isinstance(name_or_flags, str) else frozenset(name_or_flags)
    vd = _VARIANTS.get(fs) or (_prompt_variant(fs) if PROMPT_LOGPROBS in fs else _processor_variant(fs))
    if vd is None:
        raise UnknownVariantError(no_variant_message(fs))
    return vd


def _processor_variant(fs: frozenset[str]) -> VariantDef | None:
    """The superset variant of `fs` built from the flags' logits processors: the base step with
    every processor of the set chained before the sampler (trnrt.engine.runner.variant_step), on the
    union of their phases. None when a flag has no processor."""
    from trnrt.engine.sample import logits_processors as lp
    from trnrt.engine.runner.variant_step import VariantStepFunction, extra_example_inputs, extra_input_names

    if not fs or any(lp.processor(f) is None for f in fs):
        return None
    procs = lp.processors_for(fs)
    phases = tuple(p for p in _PHASE_ORDER if any(p in pr.phases for pr in procs))
    flags = frozenset(fs)

    def make_step(model, state, engine_config):
        return VariantStepFunction(model, state, engine_config.max_top_logprobs, flags)

    def example_extra(spec, engine_config, vocab_size, device):
        return extra_example_inputs(flags, spec.batch, vocab_size, device)

    return VariantDef(name=variant_name(fs), phases=phases, make_step=make_step, example_extra_inputs=example_extra,
                      extra_input_names=extra_input_names(flags), flags=flags)


def _prompt_variant(fs: frozenset[str]) -> VariantDef | None:
    """The prompt-logprobs prefill variant of `fs`: the prefill step with all-position logprobs,
    carrying the other flags' processors. None when one of them has no processor."""
    from trnrt.engine.sample import logits_processors as lp
    from trnrt.engine.runner.prompt_logprobs import (PROMPT_OUTPUT_NAMES, PromptLogprobsStepFunction,
                                              prompt_extra_example_inputs, prompt_extra_input_names)

    others = fs - {PROMPT_LOGPROBS}
    if any(lp.processor(f) is None for f in others):
        return None
    flags = frozenset(fs)

    def make_step(model, state, engine_config):
        return PromptLogprobsStepFunction(model, state, engine_config.max_top_logprobs, flags=flags)

    def example_extra(spec, engine_config, vocab_size, device):
        return prompt_extra_example_inputs(flags, spec.batch, spec.tokens, vocab_size, device)

    return VariantDef(name=variant_name(fs), phases=("prefill",), make_step=make_step,
                      example_extra_inputs=example_extra, extra_input_names=prompt_extra_input_names(flags),
                      flags=flags, output_names=STEP_OUTPUT_NAMES + PROMPT_OUTPUT_NAMES)


def no_variant_message(flags: Iterable[str]) -> str:
    opts = ", ".join("--" + f.replace("_", "-") for f in sorted(flags))
    return (f"no variant graph is defined for {opts} yet: the variant graphs arrive with the feature's own "
            f"issue; compile without the flag")


def base_specs(config: EngineConfig) -> list:
    """decode: batch bucket x 1 token, once with the full sampler and once greedy-only (what an
    all-greedy batch runs: no vocabulary sort); prefill: 1 sequence x token bucket, full sampler
    (it samples one token per prompt, so a greedy twin would not pay for its compile time), over
    the full table and each prefill context bucket."""
    contexts = _decode_contexts(config)
    specs = [GraphSpec("decode", b, 1, BASE_VARIANT, sampling, ctx)
             for b in config.decode_batch_buckets for ctx in contexts for sampling in SAMPLERS]
    # prefill: each token bucket over the full table, and over every prefill context bucket that
    # holds the padded chunk (a 64-token graph over a 32-token table could not place its padding)
    specs += [GraphSpec("prefill", 1, t, BASE_VARIANT, context=c) for t in config.prefill_token_buckets
              for c in config.prefill_contexts if c == 0 or c >= t]
    return specs + speculative_specs(config)


def speculative_specs(config: EngineConfig) -> list:
    """The MTP graphs of a preset with speculative_num_steps k > 0, per decode batch bucket and
    context: `verify` (the target over k + 1 tokens per row and the acceptance rule; full and
    greedy rule, as the decode samplers) and `draft` (the MTP layer's k steps, argmax drafts: one
    kind), and `spec_prefill` (the plain prefill step that also returns every position's hidden
    state, which the drafter reads: one per prefill spec, the same token buckets and contexts).
    Grammar and penalty variants have none: such requests run the plain graphs."""
    k = config.speculative_num_steps
    if not k:
        return []
    contexts = _decode_contexts(config)
    specs = [GraphSpec("verify", b, k + 1, BASE_VARIANT, sampling, ctx)
             for b in config.decode_batch_buckets for ctx in contexts for sampling in SAMPLERS]
    specs += [GraphSpec("draft", b, k + 1, BASE_VARIANT, "greedy", ctx)
              for b in config.decode_batch_buckets for ctx in contexts]
    specs += [GraphSpec("spec_prefill", 1, t, BASE_VARIANT, context=c) for t in config.prefill_token_buckets
              for c in config.prefill_contexts if c == 0 or c >= t]
    return specs


def _decode_contexts(config: EngineConfig) -> list[int]:
    """The decode-shaped graphs' contexts: each decode context bucket, then 0 (the full table)."""
    return [c if c < config.max_model_len else 0 for c in config.context_buckets]


def spec_sort_key(spec) -> tuple:
    return (_PHASE_ORDER.get(spec.phase, 99), spec.batch, spec.tokens, spec.context or 1 << 62,
            SAMPLERS.index(spec.sampling),
            spec.variant != BASE_VARIANT, spec.variant)


def expand(config: EngineConfig, flags: Iterable[str] | None = None) -> list:
    """The sorted GraphSpec list of `config` with `flags` enabled (default: config.variants).

    The base specs come out the same, in the same relative order, whatever the flags.
    Raises UnknownVariantError when the flag set has no registered variant.
    """
    fs = frozenset(config.variants if flags is None else flags)
    check_speculative_flags(config, fs)
    base = base_specs(config)
    specs = list(base)
    variants = []
    if processor_flags(fs):
        variants.append(get_variant(processor_flags(fs)))
    if PROMPT_LOGPROBS in fs:
        variants.append(get_variant(fs))
    for vd in variants:
        specs += [GraphSpec(s.phase, s.batch, s.tokens, vd.name, s.sampling, s.context)
                  for s in base if s.phase in vd.phases]
    return sorted(specs, key=spec_sort_key)


def spec_from_id(graph_id: str):
    """Inverse of GraphSpec.graph_id ("decode-b8-t1-base", "decode-b8-t1-c128-base-greedy")."""
    parts = graph_id.split("-")
    context = 0
    if len(parts) > 3 and parts[3][:1] == "c" and parts[3][1:].isdigit():
        context = int(parts.pop(3)[1:])
        if context <= 0:
            raise ValueError(f"not a graph id: {graph_id!r}")
    if len(parts) not in (4, 5) or not (parts[1].startswith("b") and parts[2].startswith("t")):
        raise ValueError(f"not a graph id: {graph_id!r}")
    sampling = parts[4] if len(parts) == 5 else "full"
    if sampling not in SAMPLERS or sampling == "full" and len(parts) == 5:
        raise ValueError(f"not a graph id: {graph_id!r}")
    return GraphSpec(parts[0], int(parts[1][1:]), int(parts[2][1:]), parts[3], sampling, context)
