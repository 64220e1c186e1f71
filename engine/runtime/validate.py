"""Every rule a request must meet before the engine queues it, in one place (http_api.md §1-2).

Raises `ValueError` with the client's message (SGLang's words where SGLang has them): the server
maps it to HTTP 400. The engine runs it on a whole batch before queuing any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.request import NewRequest

CONSTRAINED = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int
    pool_size: int  # KV token slots
    max_new_tokens_cap: int | None  # None: the context length
    has_tokenizer: bool


def validate(req: NewRequest, lim: Limits) -> None:
    _prompt(req.prompt_ids, lim)
    _sampling(req, lim)
    _logprobs(req, lim)


def _prompt(ids: list[int], lim: Limits) -> None:
    if not ids:
        raise ValueError("input_ids cannot be empty.")
    bad = next((t for t in ids if not 0 <= t < lim.vocab_size), None)
    if bad is not None:
        raise ValueError(f"input_ids must be in [0, {lim.vocab_size - 1}], got {bad}.")
    if len(ids) >= lim.context_len:
        raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length "
                         f"({lim.context_len} tokens).")
    if len(ids) + 1 > lim.pool_size:
        raise ValueError(f"The input ({len(ids)} tokens) does not fit in the KV cache ({lim.pool_size} tokens); "
                         "raise --max-total-tokens.")


def _sampling(req: NewRequest, lim: Limits) -> None:
    p = req.params
    p.verify(lim.vocab_size)
    for key in CONSTRAINED:
        if getattr(p, key) is not None:
            raise ValueError(f"Constrained decoding ({key}) is not supported by this server.")
    if p.stop_regex:
        raise ValueError("stop_regex is not supported by this server; use stop strings.")
    if not lim.has_tokenizer and p.stop:
        raise ValueError("stop strings need a tokenizer, but this server runs with --skip-tokenizer-init: "
                         "use stop_token_ids.")
    m, cap = p.max_new_tokens, lim.max_new_tokens_cap
    if cap is None and m is not None and m > lim.context_len:
        raise ValueError(f"max_new_tokens {m} exceeds this server's limit of {lim.context_len} (the context "
                         "length; --max-new-tokens-cap sets another).")
    if cap is not None and (m is None or m > cap):
        got = "null (no limit)" if m is None else str(m)
        raise ValueError(f"max_new_tokens {got} exceeds this server's limit of {cap} (--max-new-tokens-cap).")
    if req.fit_context and m is not None and len(req.prompt_ids) + m > lim.context_len:
        n = len(req.prompt_ids)
        raise ValueError(f"Requested token count exceeds the model's maximum context length of {lim.context_len} "
                         f"tokens. You requested a total of {n + m} tokens: {n} tokens from the input messages "
                         f"and {m} tokens for the completion. Please reduce the number of tokens in the input "
                         "messages or the completion to fit within the limit.")


def _logprobs(req: NewRequest, lim: Limits) -> None:
    lp, n = req.logprob, len(req.prompt_ids)
    if lp.logprob_start_len >= n:
        raise ValueError(f"logprob_start_len ({lp.logprob_start_len}) is higher than the number of input tokens "
                         f"({n}). Request with a lower logprob_start_len.")
    if lp.top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be at least 0, got {lp.top_logprobs_num}.")
    for t in lp.token_ids_logprob or ():
        if not 0 <= t < lim.vocab_size:
            raise ValueError(f"token_ids_logprob must be in [0, {lim.vocab_size - 1}], got {t}.")
