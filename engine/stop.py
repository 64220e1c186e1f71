"""Finishing a request: EOS and stop token ids, stop strings matched on detokenized text (across token
boundaries), max_new_tokens and the context length; and the text that is safe to release so far."""

from __future__ import annotations

from typing import Any

from engine.sampling import SamplingParams
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    """Feeds each new token to an incremental detokenizer and decides whether the request is done.

    NOTE: text that could still be the start of a stop string is held back until it is resolved, so
    a stream never releases characters that a later stop match trims away.
    """

    def __init__(self, params: SamplingParams, eos_ids: set[int], tokenizer: Tokenizer | None,
                 prompt_ids: list[int], max_total_len: int) -> None:
        self.params = params
        self.suppress_ids = set(eos_ids)  # min_new_tokens holds EOS back even under ignore_eos
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.stop_ids = set(params.stop_token_ids or ())
        self.stops = list(params.stop or ())
        self.max_total_len = max_total_len
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text = ""
        self.final_text: str | None = None

    def suppressed(self, n_out: int) -> set[int] | None:
        """Ids to forbid while fewer than min_new_tokens have been generated."""
        return (self.suppress_ids | self.stop_ids) if n_out < self.params.min_new_tokens else None

    def on_token(self, token: int, n_out: int, n_total: int) -> dict[str, Any] | None:
        """Account for the n_out-th output token; return a finish reason if the request is done."""
        min_reached = n_out >= self.params.min_new_tokens
        if min_reached and (token in self.eos_ids or token in self.stop_ids):
            if self.params.no_stop_trim:
                self._add(token)
            return self._finish({"type": "stop", "matched": token})
        old_len = len(self.text)
        self._add(token)
        if min_reached and self.stops:
            longest = max(len(s) for s in self.stops)
            window_start = max(0, old_len - longest + 1)
            hits = [(self.text.find(s, window_start), s) for s in self.stops]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                pos, s = min(hits)
                self.text = self.text[: pos + (len(s) if self.params.no_stop_trim else 0)]
                return self._finish({"type": "stop", "matched": s})
        if self.params.max_new_tokens is not None and n_out >= self.params.max_new_tokens:
            return self._finish({"type": "length", "length": self.params.max_new_tokens})
        if n_total >= self.max_total_len:
            return self._finish({"type": "length", "length": n_out})
        return None

    def abort(self) -> None:
        self._finish(None)

    def released_text(self) -> str:
        """All text safe to show now: everything once finished, else minus a possible stop prefix."""
        if self.final_text is not None:
            return self.final_text
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self.text[: len(self.text) - hold]

    def _add(self, token: int) -> None:
        if self.detok is not None:
            self.text += self.detok.add([token])

    def _finish(self, reason: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.final_text is None:
            stop_str = reason is not None and isinstance(reason.get("matched"), str)
            tail = self.detok.flush() if self.detok is not None and not stop_str else ""
            self.final_text = self.text + tail
        return reason
