"""Finishing a request: EOS and stop token ids, stop strings matched on detokenized text (across token
boundaries), max_new_tokens and the context length; and the text that is safe to release so far."""

from typing import Any

from engine.runtime.sampling_params import SamplingParams
from engine.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    """NOTE: text that could still begin a stop string is held back (`_held`) until resolved, so a stream never releases
    characters that a later stop match trims away; a match always lies inside the held text plus the newest delta."""

    def __init__(self, params: SamplingParams, eos_ids: set[int], tokenizer: Tokenizer | None,
                 prompt_ids: list[int], max_total_len: int) -> None:
        self.params, self.max_total_len = params, max_total_len
        self.suppress_ids = set(eos_ids)  # min_new_tokens holds EOS back even under ignore_eos
        self.eos_ids = set() if params.ignore_eos else set(eos_ids)
        self.stop_ids, self.stops = set(params.stop_token_ids or ()), list(params.stop or ())
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens) if tokenizer else None
        self._held = ""  # decoded, not released: a possible start of a stop string
        self._released: list[str] = []  # released, not taken yet
        self.done = False

    def suppressed(self, n_out: int) -> set[int] | None:
        return (self.suppress_ids | self.stop_ids) if n_out < self.params.min_new_tokens else None

    def at_length(self, n_out: int, n_prompt: int) -> bool:
        m = self.params.max_new_tokens
        return (m is not None and n_out >= m) or n_prompt + n_out >= self.max_total_len

    def on_token(self, token: int, n_out: int, n_total: int) -> dict[str, Any] | None:
        """Account for the n_out-th output token; return a finish reason if the request is done."""
        min_reached = n_out >= self.params.min_new_tokens
        if min_reached and (token in self.eos_ids or token in self.stop_ids):
            if self.params.no_stop_trim:
                self._add(self._decode(token))
            return self.finish({"type": "stop", "matched": token})
        delta = self._decode(token)
        if min_reached and self.stops:
            buf = self._held + delta
            hits = [(pos, s) for s in self.stops if (pos := buf.find(s)) >= 0]
            if hits:
                pos, s = min(hits)
                self._released.append(buf[: pos + (len(s) if self.params.no_stop_trim else 0)])
                self._held, self.done = "", True
                return {"type": "stop", "matched": s}
        self._add(delta)
        # (n_out is max_new_tokens when that is what ends it)
        return self.finish({"type": "length", "length": n_out}) if self.at_length(n_out, n_total - n_out) else None

    def finish(self, reason: dict[str, Any] | None) -> dict[str, Any] | None:
        """Release everything (held text and any incomplete character) and return `reason`."""
        if not self.done:
            self.done = True
            self._released.append(self._held + (self.detok.flush() if self.detok is not None else ""))
            self._held = ""
        return reason

    def take_text(self) -> str:
        """Text released since the previous call."""
        out, self._released = "".join(self._released), []
        return out

    def _decode(self, token: int) -> str:
        return self.detok.add([token]) if self.detok is not None else ""

    def _add(self, delta: str) -> None:
        """Append decoded text, releasing all but the longest suffix that begins a stop string."""
        buf, hold = self._held + delta, 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._released.append(buf[: len(buf) - hold])
        self._held = buf[len(buf) - hold:]
