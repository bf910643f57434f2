"""The offline Python API: `trnrt.LLM(model=...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

from trnrt.engine.output.outputs import TokenLogprob
from trnrt.engine.request import FinishReason, GenerateRequest, SamplingParams


@dataclass
class GenerationResult:
    """The whole output of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        d = {"output_ids": self.output_ids, "text": self.text,
             "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None}
        if self.logprobs is not None:
            d["logprobs"] = [lp.to_dict() for lp in self.logprobs]
        if self.error is not None:
            d["error"] = self.error
        return d


class LLM:
    """Loads a checkpoint (None: the embedded tiny model) behind an engine thread.

    All prompts of one `generate` call are submitted together (`EngineClient.submit_many`), so
    they are batched; the admin calls go through the same client methods the HTTP routes use.
    """

    def __init__(self, model: str | None = None, **engine_kwargs):
        from trnrt.engine.core.engine import Engine

        self.engine = Engine.from_model_dir(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """Render a conversation with the model's chat template and tokenize it."""
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(
        self,
        prompts: str | Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for each prompt (text, or token ids). Results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        n = len(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * n
        else:
            params = list(sampling_params)
        reqs = []
        for p, sp in zip(prompts, params):
            ids = self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            reqs.append(GenerateRequest(prompt_token_ids=ids, sampling_params=sp.clone(), stream=False))
        # All or nothing: an invalid prompt raises before any request is queued.
        streams = list(zip(reqs, self.engine.submit_many(reqs)))
        results = []
        for req, stream in streams:
            res = GenerationResult(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                   logprobs=[] if req.sampling_params.logprobs is not None else None)
            for out in stream:
                res.output_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if res.logprobs is not None and out.new_logprobs:
                    res.logprobs.extend(lp for lp in out.new_logprobs if lp is not None)
                if out.finished:
                    res.finish_reason = out.finish_reason
                    res.error = out.error
            results.append(res)
        return results

    def abort_requests(self, prefix: str = "", *, abort_all: bool = False, message: str = "Aborted",
                       timeout_s: float = 5.0) -> list[str]:
        """Abort queued or running requests by id prefix, or all (EngineClient.abort_requests); for
        a `generate` running on another thread."""
        return self.engine.abort_requests(prefix, abort_all=abort_all, message=message, timeout_s=timeout_s)

    def flush_cache(self, timeout_s: float = 0.0):
        """Empty the engine's caches when it is idle (EngineClient.flush_cache) -> FlushResult."""
        return self.engine.flush_cache(timeout_s)

    def load(self):
        """The engine's load (EngineClient.load) -> EngineLoad."""
        return self.engine.load()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
