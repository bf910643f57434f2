"""The glm5_next sharding expressed as neuronx-distributed layers (issue #31): UNTESTED, no SDK here.

On Neuron the usual way to run tensor parallelism is neuronx-distributed's parallel layers
(`neuronx_distributed.parallel_layers.layers`) over its own process groups
(`parallel_state.initialize_model_parallel`), traced with `neuronx_distributed.trace`, instead of
torch functional collectives in the exported graph. This module only maps our per-weight rules
(`sharding.rule_for`) to those layers; nothing calls it yet (the `neuron` backend still traces
the exported program), and `neuronx_distributed` is imported inside `nxd_layer` only.

  rule of the weight [out, in]           NxD layer                      options
  Split(0)                 (column)      ColumnParallelLinear(in, out)  gather_output=False
  Split(1)                 (row)         RowParallelLinear(in, out)     input_is_parallel=True
  embed_tokens (vocab rows)              ParallelEmbedding(V, D)        (masked lookup + all-reduce)
  lm_head / shared_head.head (vocab)     ColumnParallelLinear(D, V)     gather_output=True (logits [.., V])
  replicated                             torch.nn.Linear / the module as is
  anything else (conv1d per third, the   None: no NxD layer; kept as our rank-local block with its
  routed experts [E, ...], 1-D per-head  own cut (a Neuron MoE would use neuronx_distributed.modules.moe)
  vectors)

What the mapping cannot say and a Neuron port must check: our q/k/v conv and the fused in_proj of
`prepare()` cut several parts per rank (Split parts > 1), which one ColumnParallelLinear does not
express; NxD's default initialisation must be skipped (the weights come from the rank's shard).
"""

from __future__ import annotations

from typing import Any

from trnrt.parallel.shard import REPLICATE, Split

COLUMN, ROW, EMBEDDING, GATHERED_HEAD, REPLICATED = (
    "ColumnParallelLinear", "RowParallelLinear", "ParallelEmbedding", "ColumnParallelLinear(gather_output)",
    "replicated")
_VOCAB_HEADS = ("lm_head.weight", "shared_head.head.weight")


def nxd_kind(name: str, shape: tuple[int, ...], cfg: Any) -> str | None:
    """The NxD layer kind of one serving weight (see the table), None where NxD has none."""
    from trnrt.models.glm5_next.sharding import rule_for

    rule = rule_for(name, cfg)
    if rule == REPLICATE:
        return REPLICATED
    if len(rule) != 1 or len(shape) != 2 or not name.endswith(".weight"):
        return None
    s: Split = rule[0]
    if s.parts != 1 or s.axis != "tp":
        return None
    if name.endswith("embed_tokens.weight"):
        return EMBEDDING
    if name.endswith(_VOCAB_HEADS):
        return GATHERED_HEAD
    return COLUMN if s.dim == 0 else ROW if s.dim == 1 else None


def nxd_layer(kind: str, shape: tuple[int, ...]) -> Any:
    """An (uninitialised) NxD layer for a weight of full shape [out, in] (embedding: [V, D]).
    Needs neuronx-distributed and its parallel state initialised; untested."""
    from neuronx_distributed.parallel_layers import layers  # Neuron SDK only

    out_f, in_f = shape
    if kind == COLUMN:
        return layers.ColumnParallelLinear(in_f, out_f, bias=False, gather_output=False)
    if kind == GATHERED_HEAD:
        return layers.ColumnParallelLinear(in_f, out_f, bias=False, gather_output=True)
    if kind == ROW:
        return layers.RowParallelLinear(in_f, out_f, bias=False, input_is_parallel=True)
    if kind == EMBEDDING:
        return layers.ParallelEmbedding(out_f, in_f)
    raise ValueError(f"no NxD layer for kind {kind!r}")
