"""Per-request sampling parameters: parsing, normalization and validation. Names, defaults and `verify`'s
messages are SGLang's (http_api.md §2), so 400 bodies carry SGLang's text; `from_dict` is stricter: unknown keys
and wrongly typed values raise `ValueError` naming the field (SGLang's TypeError surfaces as a 500)."""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MAX_N = 128  # upper bound on `n` (parallel samples per prompt)
GREEDY_EPS = 1e-6  # temperatures below this are greedy decoding (SGLang sets top_k=1 there)

_INT_FIELDS = frozenset({"max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed", "stream_interval"})
_TYPED_FIELDS = {**dict.fromkeys(("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                                  "repetition_penalty"), ((int, float), "a number")),  # a bool is not a number
                 **dict.fromkeys(("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"),
                                 (bool, "a boolean")),
                 **dict.fromkeys(("json_schema", "regex", "ebnf", "structural_tag"), (str, "a string"))}


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    raise ValueError(f"{name} must be an integer, got {v!r}.")


def _coerce(name: str, v: Any) -> Any:
    """Type-check one non-null JSON value of field `name`; the value to store (`__post_init__` lists a stop string)."""
    if name in _INT_FIELDS:
        return _as_int(name, v)
    if name in _TYPED_FIELDS:
        kind, what = _TYPED_FIELDS[name]
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise ValueError(f"{name} must be {what}, got {v!r}.")
        return v  # a number kept as given so that error messages print it the way the client sent it
    if name in ("stop", "stop_regex"):
        if not (isinstance(v, str) or isinstance(v, (list, tuple)) and all(isinstance(s, str) for s in v)):
            raise ValueError(f"{name} must be a string or a list of strings, got {v!r}.")
        return v
    if name == "stop_token_ids":
        if not isinstance(v, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {v!r}.")
        return frozenset(_as_int("stop_token_ids", t) for t in v)
    if name == "logit_bias":
        if not isinstance(v, Mapping):
            raise ValueError(f"logit_bias must be an object mapping token ids to numbers, got {v!r}.")
        out: dict[str, float] = {}
        for k, b in v.items():
            key = str(k) if isinstance(k, int) and not isinstance(k, bool) else k
            if not isinstance(key, str) or re.fullmatch(r"\s*[-+]?\d+\s*", key) is None:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}.")
            if not isinstance(b, (int, float)) or isinstance(b, bool):
                raise ValueError(f"logit_bias values must be numbers, got {b!r} for key {key!r}.")
            out[key] = b
        return out
    if name == "custom_params":
        if not isinstance(v, Mapping):
            raise ValueError(f"custom_params must be an object, got {v!r}.")
        return dict(v)
    raise AssertionError(f"unhandled sampling field {name}")  # pragma: no cover


@dataclass
class SamplingParams:
    """Build from JSON with `from_dict`, then call `verify(vocab_size)` before scheduling the request."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stream_interval: int | None = None
    custom_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.stop, self.stop_regex = ([] if v is None else [v] if isinstance(v, str) else list(v)
                                      for v in (self.stop, self.stop_regex))
        self.stop_token_ids = frozenset(self.stop_token_ids or ())
        if self.logit_bias is not None:
            self.logit_bias = {str(k): v for k, v in self.logit_bias.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "SamplingParams":
        """Parse a JSON `sampling_params` object; null means "the default", but no limit for `max_new_tokens`."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}.")
        names = [f.name for f in fields(cls)]
        if unknown := [key for key in d if key not in names]:
            raise ValueError(f"unknown sampling parameter {unknown[0]!r}; valid parameters are: {', '.join(names)}")
        return cls(**{k: None if v is None else _coerce(k, v) for k, v in d.items()
                      if v is not None or k == "max_new_tokens"})

    def verify(self, vocab_size: int) -> None:
        t, m, seed = self.temperature, self.max_new_tokens, self.sampling_seed
        for name, ok, rule in (
                ("temperature", math.isfinite(t) and t >= 0, "a non-negative finite number"),
                ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
                ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
                ("top_k", self.top_k == -1 or self.top_k >= 1, "-1 (disable) or at least 1"),
                ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
                ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
                ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, "in (0, 2] (1.0 = no penalty)"),
                ("max_new_tokens", m is None or m >= 0, "at least 0"),
                ("min_new_tokens", 0 <= self.min_new_tokens and (m is None or self.min_new_tokens <= m),
                 f"in [0, max_new_tokens({m})]"),
                ("n", 1 <= self.n <= MAX_N, f"in [1, {MAX_N}]"),
                ("stream_interval", self.stream_interval is None or self.stream_interval >= 1, "at least 1"),
                ("sampling_seed", seed is None or -(2**63) <= seed < 2**64, "in [-2**63, 2**64 - 1]")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}.")
        for key, bias in (self.logit_bias or {}).items():
            if not 0 <= int(key) < vocab_size:
                raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers, got {bias} for key {key}.")
        if sum(g is not None for g in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if (bad := min((t for t in self.stop_token_ids if not 0 <= t < vocab_size), default=None)) is not None:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size - 1}], got {bad}.")
        if any(not s for s in self.stop):  # "" is in every text: it would stop at the first token
            raise ValueError("stop cannot contain an empty string.")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}.") from None

    @property
    def is_greedy(self) -> bool:
        """True when decoding is greedy (argmax); such rows never consume randomness."""
        return self.temperature < GREEDY_EPS
