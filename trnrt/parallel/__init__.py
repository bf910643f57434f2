"""Tensor and expert parallelism on torch.distributed: model-agnostic primitives (issue #31).

* `context`     ParallelContext: tp rank/size, ep size, the derived MoE ranks, the process group;
                `ParallelContext.single()` is TP=1 and needs no process group at all.
* `counts`      CollectiveCounts: calls, bytes and seconds per collective kind, per context.
* `collectives` all_reduce / all_gather as torch's functional collectives, the identity at TP=1
                (no op emitted, so no collective can enter a TP=1 graph); every call is counted.
* `layers`      column- / row-parallel linear over plain weight shards, the vocab-parallel
                embedding (mask + all-reduce) and lm_head (logits all-gathered to [.., V]).
* `shard`       `Split` / rules: how one tensor is cut per rank (per part: q|k|v thirds,
                gate|up halves), read lazily through a slice getter, and put back (`unshard`).

Which rule each weight of a model follows lives with the model (trnrt/models/glm5_next/
sharding.py): the rules name the model's layouts, this package only cuts. Layer order: models
import this package, never the reverse, and it imports nothing of trnrt's engine or server.

Kept light on purpose (no torch at import): import the submodules directly.
"""
