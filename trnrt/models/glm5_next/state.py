"""Decode state of GLM-5.3-Flash: paged MLA latents / pooled indexer keys, per-slot KDA state.

Layout (all tensors stacked over the layers of one kind, so a traced graph takes few inputs;
`state.latent[i]` etc. are per-layer views):

* paged, addressed by block tables (block size a multiple of `index_kpool`, so a pool never
  straddles blocks):
    - ``latent``  [n_mla, num_blocks, block_size, kv_lora_rank]  post-`kv_a_layernorm` latents
    - ``pooled``  [n_full_indexer, num_blocks, block_size // kpool, index_head_dim]  keys of
      complete pools (pool p covers positions p*kpool .. p*kpool+kpool-1)
* per sequence slot, addressed by a slot index:
    - ``kda``   [n_kda, num_slots, H, Dk, Dv] fp32   recurrent state ([K, V] order)
    - ``conv``  [n_kda, num_slots, 3*H*Dk, K-1]      raw q|k|v conv inputs of the last K-1 tokens
    - ``tail``  [n_full_indexer, num_slots, kpool-1, 2, index_head_dim]  raw key (0) and gate
      score (1) of the open pool, RIGHT-aligned: entry i holds position start_pos-(kpool-1)+i.

RESERVED: block 0 and slot 0 are scratch targets. Padding rows (num_new == 0) point at slot 0
and padded tokens write their latents / pooled keys into block 0; the engine must never
allocate block 0 or slot 0 to a sequence (its block/slot allocators start at 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Glm5NextConfig


@dataclass
class ModelState:
    """All state tensors of the model (updated in place by `Glm5NextForServing.forward`)."""

    latent: torch.Tensor  # [n_mla, NB, bs, R]
    pooled: torch.Tensor  # [n_full, NB, bs // kpool, Di]
    kda: torch.Tensor  # [n_kda, NS, H, Dk, Dv] fp32
    conv: torch.Tensor  # [n_kda, NS, C, K-1]
    tail: torch.Tensor  # [n_full, NS, kpool-1, 2, Di]
    block_size: int
    kpool: int
    mtp: "MTPState | None" = None  # the MTP layer's own cache (allocate(..., mtp=True)); not in tensors()

    @classmethod
    def allocate(
        cls,
        config: Glm5NextConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        mtp: bool = False,
    ) -> "ModelState":
        """Zero-initialised state. Block 0 and slot 0 are reserved scratch (see module doc).
        mtp: also allocate the MTP layer's stack (`.mtp`); off by default."""
        kp = config.index_kpool
        _check_sizes(config, num_blocks, block_size, num_slots)
        z = dict(dtype=dtype, device=device)
        n_mla, n_full, n_kda = len(config.mla_layers), len(config.full_indexer_layers), len(config.kda_layers)
        return cls(
            latent=torch.zeros(n_mla, num_blocks, block_size, config.kv_lora_rank, **z),
            pooled=torch.zeros(n_full, num_blocks, block_size // kp, config.index_head_dim, **z),
            kda=torch.zeros(
                n_kda, num_slots, config.linear_num_heads, config.linear_head_dim, config.linear_head_dim,
                dtype=torch.float32, device=device,
            ),
            conv=torch.zeros(n_kda, num_slots, config.conv_channels, config.linear_conv_kernel_dim - 1, **z),
            tail=torch.zeros(n_full, num_slots, max(kp - 1, 0), 2, config.index_head_dim, **z),
            block_size=block_size,
            kpool=kp,
            mtp=MTPState.allocate(config, num_blocks, block_size, num_slots, dtype, device) if mtp else None,
        )

    @property
    def num_blocks(self) -> int:
        return self.latent.shape[1]

    @property
    def num_slots(self) -> int:
        return self.kda.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The state tensors in a fixed order (for a torch.export wrapper)."""
        return (self.latent, self.pooled, self.kda, self.conv, self.tail)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the per-slot state (KDA, conv window, indexer tail) of one slot to another."""
        for t in (self.kda, self.conv, self.tail):
            t[:, dst].copy_(t[:, src])
        if self.mtp is not None:
            self.mtp.copy_slot(src, dst)


def _check_sizes(config: Glm5NextConfig, num_blocks: int, block_size: int, num_slots: int) -> None:
    kp = config.index_kpool
    if block_size <= 0 or block_size % kp:
        raise ValueError(f"block_size ({block_size}) must be a positive multiple of index_kpool ({kp})")
    if num_blocks < 2 or num_slots < 2:
        raise ValueError("num_blocks and num_slots must be >= 2 (block 0 / slot 0 are scratch)")


@dataclass
class MTPState:
    """The MTP layer's paged latent + indexer cache: one MLA layer with a full indexer, laid out
    as ModelState's stacks with n_mla = n_full = 1 (so the MLA / indexer code and kernels index
    layer 0 of it), over the same block tables and slots as the target. No KDA state: the MTP
    layer is an MLA layer. Same scratch rule: block 0 and slot 0 are never a sequence's."""

    latent: torch.Tensor  # [1, NB, bs, R]
    pooled: torch.Tensor  # [1, NB, bs // kpool, Di]
    tail: torch.Tensor  # [1, NS, kpool-1, 2, Di]
    block_size: int
    kpool: int

    @classmethod
    def allocate(
        cls,
        config: Glm5NextConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> "MTPState":
        """Zero-initialised MTP stack (same sizes rule as ModelState.allocate)."""
        _check_sizes(config, num_blocks, block_size, num_slots)
        kp = config.index_kpool
        z = dict(dtype=dtype, device=device)
        return cls(
            latent=torch.zeros(1, num_blocks, block_size, config.kv_lora_rank, **z),
            pooled=torch.zeros(1, num_blocks, block_size // kp, config.index_head_dim, **z),
            tail=torch.zeros(1, num_slots, max(kp - 1, 0), 2, config.index_head_dim, **z),
            block_size=block_size,
            kpool=kp,
        )

    @property
    def num_blocks(self) -> int:
        return self.latent.shape[1]

    @property
    def num_slots(self) -> int:
        return self.tail.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The MTP state tensors in a fixed order."""
        return (self.latent, self.pooled, self.tail)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy the per-slot MTP state (the indexer tail) of one slot to another."""
        self.tail[:, dst].copy_(self.tail[:, src])
