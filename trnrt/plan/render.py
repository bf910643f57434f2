"""A Plan as a rich table (what `trnrt plan` prints)."""

from __future__ import annotations

from rich.table import Table

from .devices import GB, Device
from .memory import Plan


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def plan_table(p: Plan, dev: Device, dtype: str, model: str) -> Table:
    """One row per quantity of a rank (every rank holds the same: all splits are even)."""
    t = Table(title=f"{model}: TP {p.tp} EP {p.ep} on {p.tp} x {dev.name} ({dtype}), per rank",
              title_justify="left")
    t.add_column("per rank")
    t.add_column("bytes", justify="right")
    t.add_column("note")
    w, s = p.weights, p.state
    t.add_row("device memory", _gb(p.device_bytes), dev.note)
    t.add_row("static budget", _gb(p.mem_fraction_static * p.device_bytes),
              f"mem_fraction_static {p.mem_fraction_static:.2f}")
    t.add_row("weights", _gb(w.total), f"of which replicated {_gb(w.replicated)}, MTP layer {_gb(w.mtp)}")
    t.add_row("MLA latent + indexer keys", f"{s.token:,.1f} B/token", f"{s.block:,} B per block of {s.block_size}")
    t.add_row("KDA recurrent + conv state", f"{s.kda_slot / 1e6:,.2f} MB/seq",
              f"slot total {s.slot / 1e6:,.2f} MB/seq (with indexer tails)")
    t.add_row("activation reserve", _gb(p.activation), "estimate of the largest step graph")
    t.add_row("state pool", _gb(p.state_pool), "min(static, device - activations) - weights")
    t.add_row("preset allocation", _gb(p.preset_state), "the preset's num_blocks x block + num_slots x slot")
    t.add_row("max running requests", f"{p.max_running_requests:,}", f"each at max_model_len {p.max_model_len:,}")
    t.add_row("max total tokens", f"{p.max_total_tokens:,}", "paged pool beside those slots")
    t.add_row("fits", "yes" if p.fits else "NO", "")
    return t
