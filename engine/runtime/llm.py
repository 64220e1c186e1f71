"""Offline API: `LLM(model_path).generate(prompts_or_ids, sampling)`: results in input order, shaped as /generate's."""

from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.runtime.engine import Engine
from engine.runtime.engine_args import EngineArgs
from engine.runtime.request import JoinedOutput, LogprobOptions, NewRequest
from engine.runtime.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model_path: str | Path, **kwargs: Any) -> None:
        """kwargs are EngineArgs fields (device, dtype, max_total_tokens, chunked_prefill_size, ...). The
        decode graphs are compiled here, as a server does at start (`disable_cuda_graph=True`: eager)."""
        self.engine = Engine(EngineArgs(model_path=str(model_path), **kwargs))
        self.engine.warm_up()
        self.tokenizer, self.cfg = self.engine.tokenizer, self.engine.cfg

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: pass token ids instead of text")
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: Prompt | list[Prompt], sampling: dict[str, Any] | list[dict[str, Any]] | None = None,
                 logprob: LogprobOptions | None = None, progress: bool = False) -> list[dict[str, Any]]:
        """Generate for every prompt (n > 1 expands into n results per prompt, grouped by prompt)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        sampling_list = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(sampling_list) != len(prompts):
            raise ValueError(f"got {len(sampling_list)} sampling dicts for {len(prompts)} prompts")
        reqs = [NewRequest(self._encode(p), SamplingParams.from_dict(sp), logprob or LogprobOptions())
                for p, sp in zip(prompts, sampling_list)]
        order = [rid for rids in self.engine.add_requests(reqs) for rid in rids]
        results = {rid: JoinedOutput(rid) for rid in order}
        try:
            with tqdm(total=len(order), desc="generate", disable=not progress) as bar:
                while not all(r.finished for r in results.values()):
                    for out in self.engine.step():
                        results[out.rid].add(out)
                        bar.update(int(out.finished))
        except BaseException as e:  # (a failed step, or Ctrl-C: every request ends, the next call starts clean)
            self.engine.fail_all(f"generate stopped: {e!r}")
            raise
        return [self._to_dict(results[rid]) for rid in order]

    @staticmethod
    def _to_dict(res: JoinedOutput) -> dict[str, Any]:
        meta = {"id": res.rid, "finish_reason": res.finish_reason, "prompt_tokens": res.last.prompt_tokens,
                "completion_tokens": len(res.output_ids), "cached_tokens": res.cached_tokens,
                "num_retractions": res.num_retractions}
        if res.logprobs is not None:
            meta["logprobs"] = res.logprobs
        return {"text": res.text, "output_ids": res.output_ids, "meta_info": meta}
