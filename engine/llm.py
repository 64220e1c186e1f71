"""Offline API: `LLM(model_path).generate(prompts_or_ids, sampling)` on top of the continuous-batching
engine. Results come back in input order, shaped like the native /generate response."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.engine import Engine
from engine.engine_args import EngineArgs
from engine.request import LogprobOptions, RequestOutput
from engine.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model_path: str | Path, **kwargs: Any) -> None:
        """kwargs are EngineArgs fields (device, dtype, max_total_tokens, chunked_prefill_size, ...)."""
        self.engine = Engine(EngineArgs(model_path=str(model_path), **kwargs))
        self.tokenizer = self.engine.tokenizer
        self.cfg = self.engine.cfg
        self.runner = self.engine.runner

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | list[Prompt], sampling: dict[str, Any] | list[dict[str, Any]] | None = None,
                 logprob: LogprobOptions | None = None, progress: bool = False) -> list[dict[str, Any]]:
        """Generate for every prompt (n > 1 expands into n results per prompt, grouped by prompt)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        sampling_list = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(sampling_list) != len(prompts):
            raise ValueError(f"got {len(sampling_list)} sampling dicts for {len(prompts)} prompts")
        order: list[str] = []
        for prompt, sp in zip(prompts, sampling_list):
            params = SamplingParams.from_dict(sp)
            order.extend(self.engine.add_request(self._encode(prompt), params, logprob))
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="generate", disable=not progress)
        while len(results) < len(order):
            for out in self.engine.step():
                if out.finished:
                    results[out.rid] = out
                    bar.update(1)
        bar.close()
        return [self._to_dict(results[rid]) for rid in order]

    @staticmethod
    def _to_dict(out: RequestOutput) -> dict[str, Any]:
        meta = {"id": out.rid, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
                "completion_tokens": len(out.output_ids), "cached_tokens": out.cached_tokens,
                "num_retractions": out.num_retractions}
        if out.logprobs is not None:
            meta["logprobs"] = out.logprobs
        return {"text": out.text, "output_ids": out.output_ids, "meta_info": meta}
