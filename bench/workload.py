"""Seeded synthetic workloads: random token-id prompts and request lists."""

from __future__ import annotations

import random
from dataclasses import dataclass

FIRST_ID = 8  # stay clear of the low special ids (bos/eos live at 0..4 in configs/tiny)


@dataclass(frozen=True)
class Request:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return random_ids(random.Random(seed), n, vocab)


def requests(seed: int, count: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
             vocab: int) -> list[Request]:
    """`count` requests, prompt and output lengths uniform in the given inclusive ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p = rng.randint(*prompt_range)
        o = rng.randint(*output_range)
        out.append(Request(tuple(random_ids(rng, p, vocab)), o))
    return out


def greedy(max_new_tokens: int) -> dict:
    """Greedy, exactly max_new_tokens tokens, EOS ignored (an EOS may be generated and does not stop)."""
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def greedy_like_transformers(max_new_tokens: int) -> dict:
    """Greedy, exactly max_new_tokens tokens, EOS suppressed until then: what transformers'
    `generate(min_new_tokens=max_new_tokens=n)` does, so the two greedy streams can be compared token for
    token. (With ignore_eos an EOS can be the argmax; our engine does not suppress it under ignore_eos.)"""
    return {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "temperature": 0.0}
