"""transformers under the benchmark: `generate` with per-token timestamps, and a manual
prefill + greedy decode loop (used by the long-context worker)."""

from __future__ import annotations

import time

import torch

from bench.timing import TokenTimes


class _Stamper:
    """A generate() streamer recording when each new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_timed(model, prompt_ids: list[int], max_new_tokens: int) -> TokenTimes:
    """Greedy `model.generate` of exactly max_new_tokens tokens for one prompt, timestamped."""
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    stamper = _Stamper()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0, streamer=stamper)
    new = out[0, ids.shape[1]:].tolist()
    return TokenTimes(start, tuple(stamper.times), tuple(new))


def generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, int]:
    """One greedy `generate` over equal-length prompts (no padding); (seconds, tokens produced)."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
    elapsed = time.perf_counter() - start
    return elapsed, int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _next_token(logits: torch.Tensor, suppress: list[int]) -> int:
    """Greedy pick with `suppress` forbidden (as generate's min_new_tokens does for EOS)."""
    row = logits[0, -1].clone()
    row[suppress] = float("-inf")
    return int(row.argmax())


def prefill(model, prompt_ids: list[int]):
    """Forward the whole prompt in one call, as generate() does; (seconds, cache, next token)."""
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    elapsed = time.perf_counter() - start
    return elapsed, out.cache, _next_token(out.logits, eos_ids(model))


def decode(model, cache, first_token: int, position: int, steps: int) -> tuple[float, list[int]]:
    """`steps` greedy decode steps after a prefill, EOS suppressed; (seconds, the tokens they produced)."""
    tok, out_ids, suppress = first_token, [], eos_ids(model)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(steps):
            out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[position + i]]),
                        cache=cache, use_cache=True)
            cache = out.cache
            tok = _next_token(out.logits, suppress)
            out_ids.append(tok)
    return time.perf_counter() - start, out_ids
