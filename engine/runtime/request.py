"""A request as the engine sees it (waiting -> running -> finished), the deltas it reports, and every rule a
submitted request must meet before the engine queues it (http_api.md §1-2)."""

import time
from dataclasses import dataclass, field, fields
from typing import Any

from engine.runtime.sampling_params import SamplingParams
from engine.runtime.stop import StopChecker
from mem_cache import ReqKV

Entry = tuple[float | None, int]  # (logprob or None, token id)


@dataclass
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None


@dataclass
class Logprobs:
    """Logprob entries: a `RequestOutput` holds only the new ones (consumers `extend` a copy for the whole request)."""

    input_token: list[Entry] = field(default_factory=list)
    input_top: list[list[Entry] | None] = field(default_factory=list)
    input_ids: list[list[Entry] | None] = field(default_factory=list)
    input_rank: list[int | None] = field(default_factory=list)  # each prompt token's rank in its distribution
    output_token: list[Entry] = field(default_factory=list)
    output_top: list[list[Entry]] = field(default_factory=list)
    output_ids: list[list[Entry]] = field(default_factory=list)

    def extend(self, more: "Logprobs") -> None:
        for f in fields(self):
            getattr(self, f.name).extend(getattr(more, f.name))


@dataclass
class NewRequest:
    """What a caller submits: one prompt (token ids) and how to sample it (`n` samples share it)."""

    prompt_ids: list[int]
    params: SamplingParams
    logprob: LogprobOptions = field(default_factory=LogprobOptions)
    rid: str | None = None
    fit_context: bool = False  # prompt + max_new_tokens must fit the context (the OpenAI routes' rule)


@dataclass
class RequestOutput:
    """What one step produced for one request: deltas only (nothing here grows with the output)."""

    rid: str
    new_ids: list[int]
    new_text: str
    logprobs: Logprobs | None  # entries new in this output (None unless return_logprob)
    completion_tokens: int  # output tokens so far
    prompt_tokens: int
    cached_tokens: int
    finished: bool = False
    finish_reason: dict[str, Any] | None = None  # set once, on the final output
    num_retractions: int = 0
    error: str | None = None


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    logprob: LogprobOptions
    seed: int  # keys the request's random draws (with each token's position)
    stop: StopChecker
    depends_on: "Req | None" = None  # admitted only once this one has finished (n > 1 prefix sharing)
    hidden: bool = False  # an internal request (the shared prefill of n > 1): reports nothing
    output_ids: list[int] = field(default_factory=list)
    kv: ReqKV | None = None  # the KV cache manager's record while the request holds KV
    cached_tokens: int = 0
    num_retractions: int = 0
    prompt_logprobs_done: bool = False
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    pending: Logprobs = field(default_factory=Logprobs)  # logprob entries not reported yet
    reported: int = 0  # output ids already reported
    inflight: int = 0  # tokens sampled on the device, not read back yet (an overlapped step)

    def __post_init__(self) -> None:
        assert self.prompt_ids, "a request needs at least one prompt token"

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are in the cache."""
        return 0 if self.kv is None else self.kv.num_computed

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """all_ids[start:end], without building all_ids (NOTE: a decode step takes one token per running request:
        copying all of prompt + output cost 0.75 ms of a 33.5 ms captured step at 64 rows x 1k-token prompts, A/B)."""
        if start >= (p := len(self.prompt_ids)):
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:end] + (self.output_ids[:end - p] if end > p else [])

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def remaining_prefill(self) -> int:
        """Tokens still to feed before this request can sample its next token."""
        return len(self.prompt_ids) + len(self.output_ids) + self.inflight - self.num_computed

    def finish(self, reason: dict[str, Any], error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error

    def take_output(self) -> RequestOutput:
        """The delta since the previous call (new ids, released text, new logprob entries)."""
        new, self.reported = self.output_ids[self.reported:], len(self.output_ids)
        lp = None
        if self.logprob.return_logprob:
            lp, self.pending = self.pending, Logprobs()
        return RequestOutput(self.rid, new, self.stop.take_text(), lp, len(self.output_ids), len(self.prompt_ids),
                             self.cached_tokens, self.finished, self.finish_reason, self.num_retractions, self.error)


@dataclass
class JoinedOutput:
    """A request's deltas joined together: the cumulative view a consumer builds for itself."""

    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: Logprobs | None = None
    last: RequestOutput | None = None  # the latest output (finish reason, counts, error)
    _text: list[str] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.output_ids.extend(out.new_ids)
        if out.new_text:
            self._text.append(out.new_text)
        if out.logprobs is not None:
            self.logprobs = self.logprobs or Logprobs()
            self.logprobs.extend(out.logprobs)
        self.last = out

    @property
    def text(self) -> str:
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @property
    def finished(self) -> bool:
        return self.last is not None and self.last.finished

    @property
    def finish_reason(self) -> dict[str, Any] | None:
        return self.last.finish_reason if self.last else None

    @property
    def cached_tokens(self) -> int:
        return self.last.cached_tokens if self.last else 0

    @property
    def num_retractions(self) -> int:
        return self.last.num_retractions if self.last else 0


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_len: int
    pool_size: int  # KV token slots
    max_new_tokens_cap: int | None  # None: the context length
    has_tokenizer: bool


def validate(req: NewRequest, lim: Limits) -> None:
    """`ValueError` with the client's message (SGLang's words where SGLang has them): the server's 400."""
    ids, p, lp, n = req.prompt_ids, req.params, req.logprob, len(req.prompt_ids)
    if not ids:
        raise ValueError("input_ids cannot be empty.")
    if (bad := next((t for t in ids if not 0 <= t < lim.vocab_size), None)) is not None:
        raise ValueError(f"input_ids must be in [0, {lim.vocab_size - 1}], got {bad}.")
    if n >= lim.context_len:
        raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                         f"({lim.context_len} tokens).")
    if n + 1 > lim.pool_size:
        raise ValueError(f"The input ({n} tokens) does not fit in the KV cache ({lim.pool_size} tokens); "
                         "raise --max-total-tokens.")
    p.verify(lim.vocab_size)
    if key := next((k for k in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(p, k) is not None), None):
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
    if req.fit_context and m is not None and n + m > lim.context_len:
        raise ValueError(f"Requested token count exceeds the model's maximum context length of {lim.context_len} "
                         f"tokens. You requested a total of {n + m} tokens: {n} tokens from the input messages "
                         f"and {m} tokens for the completion. Please reduce the number of tokens in the input "
                         "messages or the completion to fit within the limit.")
    if lp.logprob_start_len >= n:
        raise ValueError(f"logprob_start_len ({lp.logprob_start_len}) is higher than the number of input tokens "
                         f"({n}). Request with a lower logprob_start_len.")
    if lp.top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be at least 0, got {lp.top_logprobs_num}.")
    if (bad := next((t for t in lp.token_ids_logprob or () if not 0 <= t < lim.vocab_size), None)) is not None:
        raise ValueError(f"token_ids_logprob must be in [0, {lim.vocab_size - 1}], got {bad}.")
