"""A request's state as it moves waiting -> running -> finished, and the outputs it streams back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling import SamplingParams
from engine.stop import StopChecker


@dataclass
class LogprobOptions:
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output tokens only
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None


@dataclass
class Logprobs:
    """Accumulated logprob entries; each entry is (logprob | None, token_id)."""

    input_token: list[tuple[float | None, int]] = field(default_factory=list)
    input_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_ids: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token: list[tuple[float, int]] = field(default_factory=list)
    output_top: list[list[tuple[float, int]]] = field(default_factory=list)
    output_ids: list[list[tuple[float, int]]] = field(default_factory=list)

    def snapshot(self) -> Logprobs:
        """A copy the engine thread will not append to (outputs cross to the event loop)."""
        return Logprobs(*(list(getattr(self, f)) for f in self.__dataclass_fields__))


@dataclass
class RequestOutput:
    """What one step produced for one request (`new_ids` may be empty, e.g. on abort)."""

    rid: str
    new_ids: list[int]
    output_ids: list[int]  # all generated ids so far
    text: str  # all text released so far (stop strings trimmed once finished)
    finished: bool
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: Logprobs | None
    num_retractions: int = 0
    error: str | None = None


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    logprob: LogprobOptions
    generator: torch.Generator
    stop: StopChecker
    depends_on: Req | None = None  # admitted only once this one has finished (n > 1 prefix sharing)
    output_ids: list[int] = field(default_factory=list)
    # KV state (scheduler-owned)
    row: int = -1  # ReqToTokenPool row, -1 when not running
    slots: torch.Tensor | None = None  # slots of the first `num_computed` tokens of all_ids
    tree_node: Any = None  # radix node locked by this request
    tree_len: int = 0  # leading slots owned by the radix tree (shared), the rest are the request's own
    cached_tokens: int = 0
    num_retractions: int = 0
    prompt_logprobs_done: bool = False
    logprobs: Logprobs = field(default_factory=Logprobs)
    finish_reason: dict[str, Any] | None = None
    error: str | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    sent_ids: int = 0  # output ids already reported
    sent_logprobs: int = 0

    @property
    def num_computed(self) -> int:
        return 0 if self.slots is None else int(self.slots.shape[0])

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def remaining_prefill(self) -> int:
        """Tokens still to feed before this request can sample its next token."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    def finish(self, reason: dict[str, Any]) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
