"""Shaping one request's `RequestOutput`s into native /generate dicts (http_api.md §1.3-1.6).

`OutputShaper` is per expanded request. `full(out)` is the non-stream body (and the final stream
frame); `frame(out)` is one stream frame: cumulative text/output_ids/logprobs by default, deltas since
the previous frame with `--incremental-streaming-output`. Logprob entries are `[logprob, id, text]`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from engine.request import LogprobOptions, Logprobs, RequestOutput
from engine.tokenizer import Tokenizer

Entry = tuple[float | None, int]


class OutputShaper:
    def __init__(self, rid: str, logprob: LogprobOptions, tokenizer: Tokenizer | None, text_in_logprobs: bool,
                 incremental: bool, started: float, stream_interval: int | None = None) -> None:
        self.rid, self.logprob, self.tokenizer = rid, logprob, tokenizer
        self.text_in_logprobs = text_in_logprobs and tokenizer is not None
        self.incremental = incremental
        self.started = started  # time.monotonic() when the HTTP request arrived
        self.interval = max(1, stream_interval or 1)
        self._token_text: dict[int, str] = {}
        self._sent_text = 0  # characters of text already streamed
        self._sent_ids = 0  # output ids already streamed
        self._sent_input_lp = 0
        self._last_frame_tokens = -1

    # ---- public ---------------------------------------------------------------------------------
    def full(self, out: RequestOutput) -> dict[str, Any]:
        """The whole result so far (non-stream response shape)."""
        return self._shape(out, 0, 0, 0)

    def frame(self, out: RequestOutput) -> dict[str, Any] | None:
        """The next stream frame for `out`, or None when coalesced away (stream_interval > 1)."""
        n = len(out.output_ids)
        if not out.finished and self._last_frame_tokens >= 0 and n - self._last_frame_tokens < self.interval:
            return None
        self._last_frame_tokens = n
        if not self.incremental:
            return self._shape(out, 0, 0, 0)
        body = self._shape(out, self._sent_text, self._sent_ids, self._sent_input_lp)
        self._sent_text = len(out.text)
        self._sent_ids = n
        if out.logprobs is not None:
            self._sent_input_lp = len(out.logprobs.input_token)
        return body

    # ---- shaping --------------------------------------------------------------------------------
    def _shape(self, out: RequestOutput, text_from: int, ids_from: int, input_from: int) -> dict[str, Any]:
        ids = out.output_ids
        meta: dict[str, Any] = {
            "id": out.rid,
            "finish_reason": out.finish_reason if out.finished else None,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": out.cached_tokens,
            "weight_version": "default",
            "num_retractions": out.num_retractions,
        }
        if out.finished:
            meta["e2e_latency"] = round(time.monotonic() - self.started, 6)
        if self.logprob.return_logprob and out.logprobs is not None:
            meta.update(self._logprobs(out.logprobs, len(ids), ids_from, input_from))
        body: dict[str, Any] = {}
        if self.tokenizer is not None:
            body["text"] = out.text[text_from:]
        body["output_ids"] = list(ids[ids_from:])
        body["meta_info"] = meta
        return body

    def _logprobs(self, lp: Logprobs, n_out: int, out_from: int, in_from: int) -> dict[str, Any]:
        # NOTE: `lp` is the engine's live accumulator (the engine thread may have appended entries for
        # tokens this output does not carry yet): slice to this output's lengths.
        n_in = len(lp.input_token)
        res: dict[str, Any] = {
            "input_token_logprobs": self._entries(lp.input_token[in_from:n_in]),
            "output_token_logprobs": self._entries(lp.output_token[out_from:n_out]),
            "output_token_logprobs_length": n_out,
        }
        if self.logprob.top_logprobs_num > 0:
            res["input_top_logprobs"] = [self._maybe(p) for p in lp.input_top[in_from:n_in]]
            res["output_top_logprobs"] = [self._maybe(p) for p in lp.output_top[out_from:n_out]]
        if self.logprob.token_ids_logprob:
            res["input_token_ids_logprobs"] = [self._maybe(p) for p in lp.input_ids[in_from:n_in]]
            res["output_token_ids_logprobs"] = [self._maybe(p) for p in lp.output_ids[out_from:n_out]]
        return res

    def _maybe(self, entries: list[Entry] | None) -> list[list[Any]] | None:
        return None if entries is None else self._entries(entries)

    def _entries(self, entries: list[Entry]) -> list[list[Any]]:
        # NOTE: JSON has no -inf; a logprob that underflowed is sent as null.
        return [[v if v is None or math.isfinite(v) else None, t, self._text(t)] for v, t in entries]

    def _text(self, token_id: int) -> str | None:
        if not self.text_in_logprobs:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])  # type: ignore[union-attr]
        return text


def server_error(out: RequestOutput) -> tuple[int, str] | None:
    """A server-side abort (finish_reason abort with a status_code) -> (HTTP status, message)."""
    fr = out.finish_reason or {}
    if fr.get("type") == "abort" and fr.get("status_code") is not None:
        return int(fr["status_code"]), str(fr.get("message") or out.error or "request aborted by the server")
    return None
