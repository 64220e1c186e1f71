"""Tokenizer wrapper (HF `tokenizer.json`; optional `tokenizer_config.json` and `generation_config.json`, read
offline by `Tokenizer.from_dir`) with its chat template, and incremental detokenization."""

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT_CHAR = "\ufffd"
_PREFIX_CONTEXT_TOKENS = 5  # prompt tokens kept as decode context for the first delta


class ChatTemplateError(ValueError):
    """The chat template is missing, malformed, or rejected the messages."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    if not isinstance(data := json.loads(path.read_text(encoding="utf-8")), dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special-token entry is either a string or an HF AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class Tokenizer:
    def __init__(self, hf_tokenizer: _HFTokenizer, tokenizer_config: dict[str, Any] | None = None,
                 generation_config: dict[str, Any] | None = None, chat_template: str | None = None) -> None:
        self._tok, cfg, gen = hf_tokenizer, tokenizer_config or {}, generation_config or {}
        self.bos_token, self.eos_token = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        self.pad_token = _token_content(cfg.get("pad_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        if self.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            self.bos_token_id = gen["bos_token_id"]
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.add_bos_token, self.add_eos_token = (bool(cfg.get(k, False)) for k in ("add_bos_token", "add_eos_token"))
        self.eos_token_ids: set[int] = {eos} if isinstance(eos := gen.get("eos_token_id"), int) else set(eos or ())
        if self.eos_token_id is not None:
            self.eos_token_ids.add(self.eos_token_id)
        elif self.eos_token_ids:
            self.eos_token_id = min(self.eos_token_ids)
        template = chat_template if chat_template is not None else cfg.get("chat_template")
        if isinstance(template, list):  # HF multi-template form: [{"name": ..., "template": ...}]
            template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._compiled_template: Any = None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str], chat_template: str | None = None) -> "Tokenizer":
        root = Path(path)
        if not (tok_file := root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {root}")
        return cls(_HFTokenizer.from_file(str(tok_file)), _read_json(root / "tokenizer_config.json"),
                   _read_json(root / "generation_config.json"), chat_template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special-token strings map to their ids); BOS/EOS as tokenizer_config asks."""
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the chat template (sandboxed Jinja, HF conventions)."""
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template (tokenizer_config.json has no "
                                    "'chat_template')")
        if self._compiled_template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
            env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            try:
                self._compiled_template = env.from_string(self.chat_template)
            except TemplateError as e:
                raise ChatTemplateError(f"invalid chat template: {e}") from e
        ctx = {k: getattr(self, k) or "" for k in ("bos_token", "eos_token", "pad_token")} | kwargs
        try:
            return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


class IncrementalDetokenizer:
    """Turns a growing id sequence into text deltas without splitting UTF-8 characters: text from `prefix_offset`
    to `read_offset` was emitted already and is the decode context; each step decodes that window plus the new
    ids and emits the part past it, unless it ends in U+FFFD (an incomplete character: held for a later token)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
                 ) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._ids: list[int] = list(prompt_ids or ())
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _PREFIX_CONTEXT_TOKENS, 0)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text, full_text = self._decode(self._prefix_offset, self._read_offset), self._decode(self._prefix_offset)
        if len(full_text) <= len(prefix_text) or (not final and full_text.endswith(REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text) :]

    def add(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Emit anything held back (incomplete characters come out as U+FFFD)."""
        return self._delta(final=True)
