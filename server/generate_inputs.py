"""/generate input rules (http_api.md §1.1-1.2): one `GenerateReqInput` -> a validated `GenPlan`.

Everything a client can get wrong is checked here, before anything is queued or any stream starts,
and raised as `ValueError` (HTTP 400 in the native envelope): input shape, batch and rid rules,
sampling params (SGLang's messages), logprob arguments, context length, and this server's limits
(`--max-batch-size`, `--max-new-tokens-cap`).
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from engine.engine import Engine
from engine.request import LogprobOptions
from engine.sampling import SamplingParams
from server.args import ServerArgs
from server.protocol import GenerateReqInput

CONSTRAINED = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass
class GenItem:
    """One prompt of the batch, ready for `AsyncEngine.submit` (n > 1 expands inside the engine)."""

    prompt_ids: list[int]
    params: SamplingParams
    logprob: LogprobOptions
    rid: str


@dataclass
class GenPlan:
    items: list[GenItem]
    n: int
    single: bool  # one prompt given as a scalar and n == 1: the response is an object, not a list
    stream: bool
    return_text_in_logprobs: bool

    @property
    def size(self) -> int:
        """Sequences in the expanded batch (prompts x n)."""
        return len(self.items) * self.n


def _prompts(req: GenerateReqInput, engine: Engine) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the input was a scalar (one prompt, not a batch)."""
    if req.input_embeds is not None:
        raise ValueError("input_embeds is not supported by this server; send text or input_ids.")
    if req.text is None and req.input_ids is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if req.text is not None and req.input_ids is not None:
        raise ValueError("Either text or input_ids should be provided, not both.")
    if req.input_ids is not None:
        ids = req.input_ids
        if not ids or isinstance(ids[0], int):
            return [list(ids)], True  # type: ignore[arg-type]
        return [list(x) for x in ids], False  # type: ignore[union-attr]
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("text input needs a tokenizer, but this server runs with --skip-tokenizer-init: "
                         "send input_ids instead.")
    texts = [req.text] if isinstance(req.text, str) else list(req.text)  # type: ignore[arg-type]
    prompts = [tok.encode(t) for t in texts]
    for t, p in zip(texts, prompts):
        if not p:
            raise ValueError(f"text {t!r} encodes to no tokens; send a non-empty prompt.")
    return prompts, isinstance(req.text, str)


def _per_prompt(name: str, value: Any, k: int, n: int, default: Any, listy: bool = False) -> list[Any]:
    """Broadcast a scalar logprob argument, or check a per-prompt list against the batch."""
    if value is None:
        return [default] * k
    per_prompt = isinstance(value, list) and (not listy or (value and isinstance(value[0], list)))
    if not per_prompt:
        return [value] * k
    if n > 1:
        raise ValueError(f"{name} given as a list is not supported together with n > 1 (n={n}).")
    if len(value) != k:
        raise ValueError(f"{name} has {len(value)} entries but the batch has {k} prompts.")
    return list(value)


def _rids(rid: str | list[str] | None, k: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(k)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(k)]
    if len(rid) != k:
        raise ValueError(f"The specified rids length ({len(rid)}) should be equal to the batch size ({k}).")
    dups = sorted(r for r, c in Counter(rid).items() if c > 1)
    if dups:
        raise ValueError(f"Duplicate request ids in the batch: {dups}.")
    return list(rid)


def _sampling(raw: Any, k: int) -> list[dict[str, Any]]:
    if raw is None:
        return [{}] * k
    if isinstance(raw, dict):
        return [raw] * k
    if len(raw) != k:
        raise ValueError(f"sampling_params has {len(raw)} entries but the batch has {k} prompts.")
    return list(raw)


def _check_params(raw: dict[str, Any], params: SamplingParams, engine: Engine, args: ServerArgs) -> SamplingParams:
    """SGLang's range checks, then what this server does not do, then its caps."""
    params.verify(engine.cfg.vocab_size)
    for key in CONSTRAINED:
        if getattr(params, key) is not None:
            raise ValueError(f"Constrained decoding ({key}) is not supported by this server.")
    if params.stop_regex:
        raise ValueError("stop_regex is not supported by this server; use stop strings.")
    if engine.tokenizer is None and params.stop:
        raise ValueError("stop strings need a tokenizer, but this server runs with --skip-tokenizer-init: "
                         "use stop_token_ids.")
    cap = args.max_new_tokens_cap
    if cap is None:  # default limit: the context length (null stays "until EOS or the context")
        m, ctx = params.max_new_tokens, engine.context_len
        if m is not None and m > ctx:
            raise ValueError(f"max_new_tokens {m} exceeds this server's limit of {ctx} (the context length; "
                             "--max-new-tokens-cap sets another).")
    else:
        if "max_new_tokens" not in raw:
            return params.derive(max_new_tokens=min(params.max_new_tokens or cap, cap))
        m = params.max_new_tokens
        if m is None or m > cap:
            got = "null (no limit)" if m is None else str(m)
            raise ValueError(f"max_new_tokens {got} exceeds this server's limit of {cap} (--max-new-tokens-cap).")
    return params


def plan_generate(req: GenerateReqInput, engine: Engine, args: ServerArgs) -> GenPlan:
    """Validate a /generate body completely; raises ValueError with the client's message."""
    prompts, scalar = _prompts(req, engine)
    k = len(prompts)
    if k == 0:
        raise ValueError("The batch is empty: give at least one prompt.")
    raws = _sampling(req.sampling_params, k)
    if scalar and isinstance(req.sampling_params, list) and len(req.sampling_params) != 1:
        raise ValueError("sampling_params must be an object (or a 1-element list) for a single prompt.")
    params = [SamplingParams.from_dict(r) for r in raws]
    n = params[0].n
    if any(p.n != n for p in params):
        raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
    if k * n > args.max_batch_size:
        raise ValueError(f"This request asks for {k * n} sequences ({k} prompts x n={n}); this server allows at "
                         f"most {args.max_batch_size} per request (--max-batch-size).")
    ret = _per_prompt("return_logprob", req.return_logprob, k, n, False)
    start = _per_prompt("logprob_start_len", req.logprob_start_len, k, n, -1)
    top = _per_prompt("top_logprobs_num", req.top_logprobs_num, k, n, 0)
    ids = _per_prompt("token_ids_logprob", req.token_ids_logprob, k, n, None, listy=True)
    rids = _rids(req.rid, k, scalar)
    items = []
    for i, prompt in enumerate(prompts):
        p = _check_params(raws[i], params[i], engine, args)
        lp = LogprobOptions(bool(ret[i]), start[i] if ret[i] else -1, top[i] if ret[i] else 0,
                            (list(ids[i]) or None) if ret[i] and ids[i] is not None else None)
        if ret[i] and top[i] < 0:
            raise ValueError(f"top_logprobs_num must be at least 0, got {top[i]}.")
        engine.validate(prompt, p, lp)
        items.append(GenItem(prompt, p, lp, rids[i]))
    return GenPlan(items, n, scalar and n == 1, bool(req.stream), bool(req.return_text_in_logprobs))
