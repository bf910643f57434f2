"""Text config of GLM-5.3-Flash (`glm5_next`), read from a checkpoint's config.json.

Only what the serving code implements is accepted; anything else is refused with a
`ConfigError` naming the field (spec lessons 7 and 10: read config.json, refuse unknown values).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
INDEXED = "indexed_attention"
# transformers' _LEGACY_LAYER_TYPE_REMAP: both mean an MLA layer with a DSA indexer.
_LAYER_TYPE_ALIASES = {"full_attention": INDEXED, "deepseek_sparse_attention": INDEXED}


class ConfigError(ValueError):
    """An unsupported or inconsistent config value; `.field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"config field {field!r}: {message}")
        self.field = field


@dataclass(frozen=True)
class Glm5NextConfig:
    """The text fields of a glm5_next config that the serving model depends on.

    Lists are stored as tuples (frozen, hashable). `layer_types[i]`, `mlp_layer_types[i]` and
    `indexer_types[i]` describe absolute layer i (index for index, never re-derived).
    """

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 154820
    max_position_embeddings: int = 1048576
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()

    # ------------------------------------------------------------------ derived
    @property
    def kda_layers(self) -> tuple[int, ...]:
        """Absolute indices of the KDA (linear attention) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """Absolute indices of the MLA (indexed attention) layers; each has a latent cache."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == INDEXED)

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        """MLA layers that run their own indexer (and own pooled-key cache + tail)."""
        return tuple(i for i in self.mla_layers if self.indexer_types[i] == "full")

    @property
    def conv_channels(self) -> int:
        """Channels of the KDA causal conv (q|k|v)."""
        return 3 * self.linear_num_heads * self.linear_head_dim

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Glm5NextConfig":
        """Build from a config.json dict (text fields flat or under `text_config`) and validate."""
        d = dict(raw.get("text_config") or raw)
        # Top-level fields (tie_word_embeddings lives there for the multimodal wrapper).
        if "text_config" in raw and "tie_word_embeddings" in raw and "tie_word_embeddings" not in d:
            d["tie_word_embeddings"] = raw["tie_word_embeddings"]
        if d.get("quantization_config") or raw.get("quantization_config"):
            raise ConfigError("quantization_config", "quantised checkpoints are not implemented")

        n = int(d.get("num_hidden_layers", cls.num_hidden_layers))
        lin = d.get("linear_attn_config")
        if lin is not None:  # release spelling (transformers accepts it too)
            d.setdefault("linear_head_dim", lin.get("head_dim", cls.linear_head_dim))
            d.setdefault("linear_num_heads", lin.get("num_heads", cls.linear_num_heads))
            d.setdefault("linear_conv_kernel_dim", lin.get("short_conv_kernel_size", cls.linear_conv_kernel_dim))
            if "linear_lower_bound" not in d:
                lb = lin.get("gate_lower_bound", cls.linear_lower_bound)
                if lin.get("safe_gate", True) and lb is None:
                    lb = -5.0
                d["linear_lower_bound"] = lb

        layer_types = d.get("layer_types")
        if layer_types is None:
            layer_types = [LINEAR if i % 4 != 3 else INDEXED for i in range(n)]
        layer_types = [_LAYER_TYPE_ALIASES.get(t, t) for t in layer_types]

        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            k = int(d.get("first_k_dense_replace", 3))
            mlp_types = ["dense"] * min(k, n) + ["sparse"] * max(n - k, 0)

        idx_types = d.get("indexer_types")
        if idx_types is None:
            pattern = d.get("index_topk_pattern")
            if pattern is not None:
                try:
                    letters = {"F": "full", "S": "shared"}
                    idx_types = [letters[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
                except KeyError as e:
                    raise ConfigError("index_topk_pattern", f"unknown letter {e.args[0]!r} (F or S)") from None
            else:
                freq = max(int(d.get("index_topk_freq", 1)), 1)
                off = int(d.get("index_skip_topk_offset", 2))
                idx_types = ["full" if max(i - off + 1, 0) % freq == 0 else "shared" for i in range(n)]

        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in ("layer_types", "mlp_layer_types", "indexer_types"):
                continue
            if f.name in d:
                v = d[f.name]
                if v is None and f.name not in ("linear_lower_bound", "pad_token_id", "q_lora_rank"):
                    continue  # transformers' default applies
                kwargs[f.name] = v
        if d.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", cls.num_attention_heads)
        cfg = cls(
            layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types), indexer_types=tuple(idx_types), **kwargs
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Glm5NextConfig":
        """Read `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Refuse every value the serving code does not implement (ConfigError naming the field)."""
        n = self.num_hidden_layers
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
            "num_experts_per_tok", "n_group", "topk_group", "index_topk", "index_head_dim", "index_n_heads",
            "index_kpool", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "hc_mult",
            "hc_sinkhorn_iters",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(name, f"must be a positive integer, got {v!r}")
        if self.qk_rope_head_dim != 0:
            raise ConfigError("qk_rope_head_dim", f"only NoPE (0) is implemented, got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError("num_key_value_heads", "must equal num_attention_heads")
        if not self.q_lora_rank:
            raise ConfigError("q_lora_rank", "is required (the indexer reads the q LoRA residual)")
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"only 'silu' is implemented, got {self.hidden_act!r}")
        if self.attention_bias:
            raise ConfigError("attention_bias", "biased MLA projections are not implemented")
        if not self.index_kpool_always_select_tail:
            raise ConfigError("index_kpool_always_select_tail", "only True is implemented")
        if self.index_topk % self.index_kpool:
            raise ConfigError("index_topk", f"must be a multiple of index_kpool ({self.index_kpool})")
        if self.n_routed_experts % self.n_group:
            raise ConfigError("n_group", "must divide n_routed_experts")
        if self.n_routed_experts // self.n_group < 2:
            raise ConfigError("n_group", "each group needs >= 2 experts (group score = top-2 sum)")
        if self.topk_group > self.n_group:
            raise ConfigError("topk_group", "must be <= n_group")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError("num_experts_per_tok", "exceeds the experts in the kept groups")
        if self.hc_eps < 0:
            raise ConfigError("hc_eps", "must be >= 0")
        for name, types, allowed in (
            ("layer_types", self.layer_types, (LINEAR, INDEXED)),
            ("mlp_layer_types", self.mlp_layer_types, ("dense", "sparse")),
            ("indexer_types", self.indexer_types, ("full", "shared")),
        ):
            if len(types) != n:
                raise ConfigError(name, f"has {len(types)} entries for {n} layers")
            for i, t in enumerate(types):
                if t not in allowed:
                    raise ConfigError(name, f"unknown type {t!r} at layer {i} (allowed: {', '.join(allowed)})")
        for i in self.mla_layers:
            if self.indexer_types[i] == "shared":
                # transformers only hands top-k indices from a full layer to the layer directly after it.
                if i == 0 or self.layer_types[i - 1] != INDEXED or self.indexer_types[i - 1] != "full":
                    raise ConfigError(
                        "indexer_types",
                        f"shared indexer layer {i} must directly follow a full indexed_attention layer",
                    )


@dataclass(frozen=True)
class Glm5NextMTPConfig:
    """The MTP ("nextn") fields of a glm5_next config.json (spec §6), kept apart from
    `Glm5NextConfig` on purpose: that dataclass is hashed into every graph lock and compiled
    artifact manifest (`model_config_sha256`), and the base model's graphs do not read these.

    num_nextn_predict_layers: MTP layers stored after the decoder (`layers.{num_hidden_layers}.*`);
        0 when the field is absent. trnrt implements at most one.
    index_share_for_mtp_iteration: later draft steps of one MTP iteration reuse the first step's
        indexer top-k (a draft-loop decision; the MTP forward itself always runs its indexer).
    """

    num_nextn_predict_layers: int = 0
    index_share_for_mtp_iteration: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Glm5NextMTPConfig":
        """From a config.json dict (fields flat or under `text_config`); validated."""
        d = dict(raw.get("text_config") or raw)
        n = d.get("num_nextn_predict_layers")
        share = d.get("index_share_for_mtp_iteration")
        cfg = cls(
            num_nextn_predict_layers=cls.num_nextn_predict_layers if n is None else n,
            index_share_for_mtp_iteration=cls.index_share_for_mtp_iteration if share is None else share,
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Glm5NextMTPConfig":
        with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def validate(self) -> None:
        n = self.num_nextn_predict_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError("num_nextn_predict_layers", f"must be a non-negative integer, got {n!r}")
        if not isinstance(self.index_share_for_mtp_iteration, bool):
            raise ConfigError(
                "index_share_for_mtp_iteration", f"must be a boolean, got {self.index_share_for_mtp_iteration!r}"
            )
