"""ModelRunner: padded inputs from scheduled rows -> the step function per bucket -> sampled tokens.

Rows with one new token run in the decode graph (batch padded to a decode bucket, block tables cut
to the smallest decode context bucket that holds the longest row, the greedy-sampler graph when
every row is greedy); each prefill chunk runs in the prefill graph (one sequence, tokens padded to
a token bucket, block table cut to the smallest prefill context bucket that holds the sequence). Eager or compiled, the runner always pads to the EngineConfig's buckets, so a test
of the eager path is a test of the compiled shapes.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from trnrt.config import EngineConfig
# RowInput / RowResult live in the pure outputs module (the scripted runner uses them without torch).
from trnrt.engine.output.outputs import RowInput, RowResult, TokenLogprob
from trnrt.engine.runner.step import SAMPLERS, STEP_INPUT_NAMES, GraphSpec, StepFunction
from trnrt.engine.sample import logits_processors

log = logging.getLogger(__name__)


# Column inputs of the step function (STEP_INPUT_NAMES minus input_ids and block_tables), their
# dtypes, and the value a padding row gets (top_k's is the vocabulary size, set per runner).
_COLUMNS = {
    "start_pos": np.int64, "num_new": np.int64, "slot_ids": np.int64, "temperature": np.float32,
    "top_p": np.float32, "top_k": np.int64, "min_p": np.float32, "seeds": np.int64, "sample_pos": np.int64,
}
_PAD = {"start_pos": 0, "num_new": 0, "slot_ids": 0, "temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "seeds": 0,
        "sample_pos": 0}


# ModelState tensors by kind (dimension 1 is the slot / the page); see trnrt.models.glm5_next.state.
_SLOT_STATE = ("kda", "conv", "tail")
_PAGE_STATE = ("latent", "pooled")


class _InputBuffers:
    """Host arrays of one graph shape and the tensors that share their memory, in
    STEP_INPUT_NAMES order."""

    def __init__(self, batch: int, tokens: int, mb: int):
        self.ids = np.zeros((batch, tokens), np.int64)
        self.tables = np.zeros((batch, mb), np.int64)
        self.cols = {name: np.zeros(batch, dtype) for name, dtype in _COLUMNS.items()}
        arrays = {"input_ids": self.ids, "block_tables": self.tables, **self.cols}
        self.tensors = tuple(torch.from_numpy(arrays[name]) for name in STEP_INPUT_NAMES)


class ModelRunner:
    """Owns the model, its state tensors and the per-bucket step callables."""

    def __init__(self, model: torch.nn.Module, state, engine_config: EngineConfig, vocab_size: int,
                 compiled: dict[GraphSpec, Callable] | None = None):
        self.model = model
        self.state = state
        self.cfg = engine_config
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.step_fns = {sampling: StepFunction(model, state, engine_config.max_top_logprobs, sampling)
                         for sampling in SAMPLERS}
        self.compiled = compiled or {}
        self.num_graph_calls: dict[str, int] = {}
        self._bufs: dict[tuple[int, int, int], _InputBuffers] = {}
        # The enabled logits-processor flags' superset variant ("" = none): a batch with a row
        # that needs one of them runs in it, with neutral inputs for the other rows; see _variant_of.
        from trnrt.engine.sample.logits_processors import PROMPT_LOGPROBS, processor_flags, variant_name

        procs = processor_flags(engine_config.variants)
        self.variant = "+".join(sorted(procs))
        self.processors = logits_processors.processors_for(procs) if self.variant else []
        self._extra_bufs: dict[tuple, tuple] = {}
        if self.variant:
            from trnrt.engine.runner.variant_step import VariantStepFunction

            for sampling in SAMPLERS:
                self.step_fns[(self.variant, sampling)] = VariantStepFunction(
                    model, state, engine_config.max_top_logprobs, procs, sampling)
        # Prompt logprobs: a prompt chunk of a request that asked for them (RowInput.prompt_next_ids)
        # runs in this prefill variant (all the flags: it carries the processors too).
        self.prompt_variant = variant_name(engine_config.variants) if PROMPT_LOGPROBS in engine_config.variants else None
        if self.prompt_variant:
            from trnrt.engine.runner.prompt_logprobs import PromptLogprobsStepFunction

            self.step_fns[(self.prompt_variant, "full")] = PromptLogprobsStepFunction(
                model, state, engine_config.max_top_logprobs, flags=engine_config.variants)

    # -- padding -----------------------------------------------------------------------------

    def _buffers(self, batch: int, tokens: int, mb: int) -> "_InputBuffers":
        key = (batch, tokens, mb)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = _InputBuffers(batch, tokens, mb)
        return buf

    def _pack(self, rows: list[RowInput], batch: int, tokens: int, context: int = 0) -> tuple[torch.Tensor, ...]:
        # Persistent host buffers per graph shape, refilled in place: building 11 arrays and
        # tensors from Python lists every step cost ~50 us of a ~1.1 ms batch-8 decode step.
        # A step's inputs are dead once the step function returns (it runs synchronously).
        mb = self.cfg.table_blocks(context)  # a row's blocks past the context bucket are never read
        buf = self._buffers(batch, tokens, mb)
        n = len(rows)
        vocab = self.vocab_size
        ids, tables = buf.ids, buf.tables
        ids.fill(0)
        tables.fill(0)  # padding rows: block 0 (scratch)
        if tokens == 1:
            ids[:n, 0] = [r.token_ids[0] for r in rows]
        else:
            for i, r in enumerate(rows):
                ids[i, : len(r.token_ids)] = r.token_ids
        for i, r in enumerate(rows):
            blocks = r.block_ids[:mb]
            tables[i, : len(blocks)] = blocks
        c = buf.cols
        # padding rows: num_new 0, the scratch slot 0, greedy
        c["start_pos"][:n] = [r.start_pos for r in rows]
        c["num_new"][:n] = [len(r.token_ids) for r in rows]
        c["slot_ids"][:n] = [r.slot_id for r in rows]
        # float32 inputs: a finite temperature past float32's range (1e300 is valid JSON) would cast
        # to inf; 1e30 samples the same (uniformly) without the overflow.
        c["temperature"][:n] = [min(r.temperature, 1e30) for r in rows]
        c["top_p"][:n] = [r.top_p for r in rows]
        c["top_k"][:n] = [min(r.top_k, vocab) if r.top_k > 0 else vocab for r in rows]
        c["min_p"][:n] = [r.min_p for r in rows]
        c["seeds"][:n] = [r.seed & ((1 << 63) - 1) for r in rows]  # any Python int maps into int64
        c["sample_pos"][:n] = [r.start_pos + len(r.token_ids) for r in rows]
        if n < batch:
            for name, pad in _PAD.items():
                c[name][n:] = pad
            c["top_k"][n:] = vocab
        out = buf.tensors
        if self.device.type != "cpu":
            out = tuple(t.to(self.device) for t in out)
        return out

    # -- variants: logits-processor inputs --------------------------------------------------------

    def _variant_of(self, rows: list[RowInput]) -> str:
        """The variant a group of rows runs in: the superset variant when any row carries a
        non-neutral processor input, else "base" (so with no feature in use, or with every flag
        off, exactly the base graphs run)."""
        if self.variant and any(p.row_value(r) is not None for p in self.processors for r in rows):
            return self.variant
        return "base"

    def _pack_extra(self, spec: GraphSpec, rows: list[RowInput]) -> tuple[torch.Tensor, ...]:
        """The variant's extra inputs for `rows` padded to spec.batch (neutral for the others),
        in persistent host buffers per (variant, batch) like the base inputs."""
        if spec.variant == "base":
            return ()
        prompt = spec.variant == self.prompt_variant
        key = (spec.variant, spec.batch, spec.tokens if prompt else 0)
        bufs = self._extra_bufs.get(key)
        if bufs is None:
            arrays = [p.host_buffers(spec.batch, self.vocab_size) for p in self.processors]
            if prompt:  # next_ids [B, S] int64, after the processors' inputs
                arrays.append((np.zeros((spec.batch, spec.tokens), np.int64),))
            bufs = self._extra_bufs[key] = (arrays, tuple(torch.from_numpy(a) for arr in arrays for a in arr))
        arrays, tensors = bufs
        for p, arr in zip(self.processors, arrays):
            p.pack(arr, [p.row_value(r) for r in rows])
        if prompt:
            (nxt,) = arrays[-1]
            nxt.fill(0)
            for i, r in enumerate(rows):
                nxt[i, : len(r.prompt_next_ids)] = r.prompt_next_ids
        if self.device.type != "cpu":
            return tuple(t.to(self.device) for t in tensors)
        return tensors

    def _step_fn(self, spec: GraphSpec):
        if spec.variant == "base":
            return self.compiled.get(spec) or self.step_fns[spec.sampling]
        return self.compiled.get(spec) or self.step_fns[(spec.variant, spec.sampling)]

    def _run(self, spec: GraphSpec, rows: list[RowInput]) -> list[RowResult]:
        inputs = self._pack(rows, spec.batch, spec.tokens, spec.context) + self._pack_extra(spec, rows)
        fn = self._step_fn(spec)
        self.num_graph_calls[spec.graph_id] = self.num_graph_calls.get(spec.graph_id, 0) + 1
        if torch.is_inference_mode_enabled():  # the engine thread runs in inference mode throughout
            outs = fn(*inputs)
        else:
            with torch.inference_mode():
                outs = fn(*inputs)
        token_ids, token_lp, top_ids, top_lp = outs[:4]
        if spec.variant == self.prompt_variant:
            return self._with_prompt_logprobs(rows, outs)
        ids = token_ids.tolist()
        results = []
        if all(r.num_logprobs is None for r in rows):
            for i in range(len(rows)):
                results.append(RowResult(token_id=ids[i], logprob=None))
            return results
        lps, tids, tlps = token_lp.tolist(), top_ids.tolist(), top_lp.tolist()
        for i, r in enumerate(rows):
            lp = None
            if r.num_logprobs is not None:
                k = r.num_logprobs
                lp = TokenLogprob(token_id=ids[i], logprob=lps[i], top=list(zip(tids[i][:k], tlps[i][:k])))
            results.append(RowResult(token_id=ids[i], logprob=lp))
        return results

    def _with_prompt_logprobs(self, rows: list[RowInput], outs) -> list[RowResult]:
        """RowResults of a prompt-logprobs prefill graph: the sampled token (and its logprobs) as
        in the base graph, plus each fed position's prompt logprob and top-N."""
        token_ids, token_lp, top_ids, top_lp, p_tok, p_ids, p_lp, p_rank = outs
        results = []
        for i, r in enumerate(rows):
            lp = None
            if r.num_logprobs is not None:
                k = r.num_logprobs
                lp = TokenLogprob(token_id=int(token_ids[i]), logprob=float(token_lp[i]),
                                  top=list(zip(top_ids[i, :k].tolist(), top_lp[i, :k].tolist())))
            res = RowResult(token_id=int(token_ids[i]), logprob=lp)
            n, k = len(r.token_ids), r.num_prompt_logprobs
            if r.prompt_next_ids is not None:
                toks, ids, lps = p_tok[i, :n].tolist(), p_ids[i, :n, :k].tolist(), p_lp[i, :n, :k].tolist()
                ranks = p_rank[i, :n].tolist()
                res.prompt_logprobs = [TokenLogprob(token_id=t, logprob=toks[j], top=list(zip(ids[j], lps[j])),
                                                    rank=ranks[j]) for j, t in enumerate(r.prompt_next_ids)]
            results.append(res)
        return results

    def _sampling(self, rows: list[RowInput], context: int) -> str:
        """"greedy" when every row is greedy and the greedy graph exists (compiled artifacts
        always hold both, unless a caller compiled a subset); else "full" (same greedy tokens)."""
        if all(r.temperature <= 0.0 for r in rows):
            return self.greedy_decode_spec(self.cfg.decode_bucket(len(rows)), context).sampling
        return "full"

    def greedy_decode_spec(self, batch: int, context: int) -> GraphSpec:
        """The base decode graph an all-greedy batch of bucket `batch` runs: the greedy one, or
        the full sampler's where only that one was compiled (the same tokens and state)."""
        greedy = GraphSpec("decode", batch, 1, "base", "greedy", context)
        return greedy if not self.compiled or greedy in self.compiled else GraphSpec("decode", batch, 1, "base", "full",
                                                                                      context)

    def warm_up(self) -> dict[GraphSpec, float]:
        """Call every compiled graph twice on padding rows (num_new 0: they write only the scratch
        slot and page, as every padded batch does), so that no request pays a graph's first-call
        work (up to 3x a call here); returns each graph's second-call seconds. Eager: nothing to
        do. Graph call counts (`num_graph_calls`) are left alone: they count requests' calls."""
        return {spec: self.time_graph(spec, fn, warm=True) for spec, fn in self.compiled.items()}

    def time_graph(self, spec: GraphSpec, fn, calls: int = 1, warm: bool = False) -> float:
        """The least seconds of `calls` calls of graph `fn` (`spec`'s) on padding rows (after one
        untimed call if `warm`)."""
        import time

        if spec.phase == "draft":  # the MTP draft graph's own inputs
            from trnrt.engine.runner.graph_inputs import draft_example_inputs

            inputs = draft_example_inputs(spec.batch, spec.tokens - 1, self.cfg.table_blocks(spec.context),
                                          self.model.config.hidden_size, getattr(torch, self.cfg.dtype),
                                          device=self.device)
        else:  # the step inputs of padding rows, as every padded batch packs them
            inputs = self._pack([], spec.batch, spec.tokens, spec.context) + self._pack_extra(spec, [])
        best = float("inf")
        with torch.inference_mode():
            if warm:
                fn(*inputs)
            for _ in range(max(1, int(calls))):
                t0 = time.perf_counter()
                fn(*inputs)
                best = min(best, time.perf_counter() - t0)
        return best

    # -- prefix cache: state copies outside the graphs ------------------------------------------

    def allocate_cache_tiers(self, num_checkpoints: int, num_host_pages: int, num_host_checkpoints: int) -> None:
        """Allocate the checkpoint pool (device) and the host tier for the prefix cache.

        A checkpoint is one slot's per-sequence state (KDA state, conv window, indexer tail); a
        host page is one page of every paged tensor (latents, pooled keys). Neither is a graph
        input: CacheOps copy them in and out of the state tensors between steps.
        """
        st = self.state
        host = torch.device("cpu")
        pin = self.device.type == "cuda"

        def like(t: torch.Tensor, n: int, device) -> torch.Tensor:
            # [layers, n, ...] of the slot / page dimension 1
            out = torch.zeros((t.shape[0], n) + tuple(t.shape[2:]), dtype=t.dtype, device=device)
            return out.pin_memory() if pin and device == host else out

        self._ckpt = {k: like(getattr(st, k), num_checkpoints, self.device) for k in _SLOT_STATE}
        self._host_ckpt = {k: like(getattr(st, k), num_host_checkpoints, host) for k in _SLOT_STATE}
        self._host_pages = {k: like(getattr(st, k), num_host_pages, host) for k in _PAGE_STATE}

    def checkpoint_nbytes(self) -> int:
        """Bytes of one state checkpoint (one slot of every per-sequence state tensor)."""
        st = self.state
        return sum(getattr(st, k)[:, :1].numel() * getattr(st, k).element_size() for k in _SLOT_STATE)

    def page_nbytes(self) -> int:
        """Bytes of one page across the paged state tensors (sizes the host tier in MiB)."""
        st = self.state
        return sum(getattr(st, k)[:, :1].numel() * getattr(st, k).element_size() for k in _PAGE_STATE)

    def apply_cache_ops(self, ops) -> None:
        """Run the prefix cache's CacheOps, in order (see trnrt.engine.output.outputs.CacheOp)."""
        st = self.state
        for op in ops:
            kind = op.kind
            if kind in ("save_slot", "load_slot", "load_slot_host", "ckpt_to_host"):
                names = _SLOT_STATE
                src_of = {"save_slot": lambda k: getattr(st, k), "load_slot": lambda k: self._ckpt[k],
                          "load_slot_host": lambda k: self._host_ckpt[k], "ckpt_to_host": lambda k: self._ckpt[k]}[kind]
                dst_of = {"save_slot": lambda k: self._ckpt[k], "load_slot": lambda k: getattr(st, k),
                          "load_slot_host": lambda k: getattr(st, k), "ckpt_to_host": lambda k: self._host_ckpt[k]}[kind]
            elif kind == "pages_to_host":
                names = _PAGE_STATE
                src_of, dst_of = (lambda k: getattr(st, k)), (lambda k: self._host_pages[k])
            elif kind == "pages_to_device":
                names = _PAGE_STATE
                src_of, dst_of = (lambda k: self._host_pages[k]), (lambda k: getattr(st, k))
            elif kind == "copy_pages":
                names = _PAGE_STATE
                src_of = dst_of = (lambda k: getattr(st, k))
            else:
                raise ValueError(f"unknown cache op {kind!r}")
            for k in names:
                src, dst = src_of(k), dst_of(k)
                if src.shape[2:].numel() == 0:
                    continue  # e.g. no indexer tail when index_kpool == 1
                si = torch.tensor(op.src, dtype=torch.long, device=src.device)
                di = torch.tensor(op.dst, dtype=torch.long, device=dst.device)
                dst.index_copy_(1, di, src.index_select(1, si).to(dst.device))

    # -- public ------------------------------------------------------------------------------

    def thread_context(self):
        """Entered once around the engine thread's whole loop: inference mode (so `_run` skips
        entering it every step)."""
        return torch.inference_mode()

    def release(self, request_ids) -> None:
        """The engine finished these requests. The model runner keeps no per-request state (a
        sequence's state lives in its pages and slot, freed by the cache manager): a no-op."""

    def execute(self, rows: list[RowInput]) -> list[RowResult]:
        """Run one scheduler step. Returns one result per row, in order (partial prefill chunks
        get a result too; the caller ignores it). Raises if the step fails (the engine then fails
        every request of the step); `RowResult.error` is never set by this runner."""
        results: list[RowResult | None] = [None] * len(rows)
        # a prompt chunk that wants prompt logprobs runs in the prefill graph even with one token
        decode = [i for i, r in enumerate(rows) if len(r.token_ids) == 1 and r.prompt_next_ids is None]
        prefill = [i for i, r in enumerate(rows) if len(r.token_ids) > 1 or r.prompt_next_ids is not None]
        maxb = self.cfg.max_decode_batch
        for k in range(0, len(decode), maxb):
            idx = decode[k : k + maxb]
            group = [rows[i] for i in idx]
            context = self.cfg.context_bucket(max(r.start_pos + 1 for r in group))
            spec = GraphSpec("decode", self.cfg.decode_bucket(len(idx)), 1, self._variant_of(group),
                             sampling=self._sampling(group, context), context=context)
            for i, res in zip(idx, self._run(spec, [rows[i] for i in idx])):
                results[i] = res
        for i in prefill:
            r = rows[i]
            tokens = self.cfg.prefill_bucket(len(r.token_ids))
            # the short table must hold the sequence after this chunk and the padded chunk itself
            context = self.cfg.prefill_context_bucket(max(r.start_pos + len(r.token_ids), tokens))
            variant = self.prompt_variant if r.prompt_next_ids is not None else self._variant_of([r])
            results[i] = self._run(GraphSpec("prefill", 1, tokens, variant, context=context), [r])[0]
        return results  # type: ignore[return-value]
