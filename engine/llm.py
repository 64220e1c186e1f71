"""Offline API: `LLM(model_path).generate(prompts_or_ids, sampling)`.

Runs a batch of requests of different lengths through the pools: one extend step for the prompts,
then all requests decode together, each stopping at EOS or its max_new_tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.loader import load_model
from engine.model_runner import ExtendItem, ModelRunner
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU (no fast bf16 there), bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@dataclass
class _Req:
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    row: int = -1
    slots: list[torch.Tensor] = field(default_factory=list)


class LLM:
    def __init__(self, model_path: str | Path, *, device: str | None = None, dtype: torch.dtype | None = None,
                 load_format: str = "auto", max_total_tokens: int = 65536, max_running_requests: int = 64,
                 context_length: int | None = None, seed: int = 0) -> None:
        self.device = device or default_device()
        self.dtype = dtype or default_dtype(self.device)
        self.model = load_model(model_path, self.dtype, self.device, load_format, seed)
        self.cfg = self.model.cfg
        path = Path(model_path)
        self.tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
        self.context_len = context_length or min(self.cfg.max_position_embeddings, max_total_tokens)
        self.runner = ModelRunner(self.model, max_total_tokens, max_running_requests, self.context_len)
        self.eos_ids = set(self.cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling: dict[str, Any] | list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Generate for each prompt; returns [{"output_ids", "text"}] in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling if isinstance(sampling, list) else [sampling or {}] * len(prompts)
        reqs = []
        for p, sp in zip(prompts, params):
            seed = sp.get("seed")
            gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
            reqs.append(_Req(self._encode(p), int(sp.get("max_new_tokens", 16)), float(sp.get("temperature", 0.0)),
                             bool(sp.get("ignore_eos", False)), gen))
        for r in reqs:
            if not r.prompt or len(r.prompt) + r.max_new_tokens > self.context_len:
                raise ValueError(f"prompt of {len(r.prompt)} tokens + max_new_tokens does not fit the context "
                                 f"length {self.context_len}")
        wave = self.runner.req_to_token_pool.size
        for i in range(0, len(reqs), wave):
            self._run_wave([r for r in reqs[i:i + wave] if r.max_new_tokens > 0])
        return [{"output_ids": r.output, "text": self.tokenizer.decode(r.output) if self.tokenizer else None}
                for r in reqs]

    def _alloc(self, items: list[tuple[_Req, int, list[int]]]) -> list[ExtendItem]:
        rt, alloc = self.runner.req_to_token_pool, self.runner.allocator
        need = sum(len(ids) for _, _, ids in items)
        if not alloc.can_alloc(need):
            raise MemoryError(f"KV pool too small: need {need} token slots, {alloc.available_size()} free")
        slots = alloc.alloc(need)
        out, start = [], 0
        for r, prefix, ids in items:
            s = slots[start:start + len(ids)]
            rt.write(r.row, prefix, s)
            r.slots.append(s)
            out.append(ExtendItem(r.row, prefix, ids))
            start += len(ids)
        return out

    def _run_wave(self, reqs: list[_Req]) -> None:
        if not reqs:
            return
        rows = self.runner.req_to_token_pool.alloc(len(reqs))
        for r, row in zip(reqs, rows):
            r.row = row
        try:
            active = reqs
            items = self._alloc([(r, 0, r.prompt) for r in active])
            while active:
                fb = self.runner.build_batch(items, torch.cat([r.slots[-1] for r in active]))
                logits = self.runner.forward(fb)
                for r, row_logits in zip(active, logits):
                    r.output.append(self._sample(row_logits, r))
                active = [r for r in active if not self._finished(r)]
                items = self._alloc([(r, len(r.prompt) + len(r.output) - 1, [r.output[-1]]) for r in active])
        finally:
            for r in reqs:
                if r.slots:
                    self.runner.allocator.free(torch.cat(r.slots))
                r.slots = []
            self.runner.req_to_token_pool.free(rows)

    def _sample(self, logits: torch.Tensor, r: _Req) -> int:
        if r.temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / r.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=r.generator))

    def _finished(self, r: _Req) -> bool:
        return len(r.output) >= r.max_new_tokens or (not r.ignore_eos and r.output[-1] in self.eos_ids)
