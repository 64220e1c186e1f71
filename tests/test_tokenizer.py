"""Tests for engine/tokenizer.py and the tiny tokenizer built by `python -m training.tokenizer`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtime.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny"
BUILD_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "héllo 世界 🎉🎉 ok",
    "日本語のテキストと中文文本",
    "emoji: 👍🏽 🇯🇵 👨‍👩‍👧 🎉",
    "mixed: café naïve Ω≈ç√ — “quotes” \t tabs\nnew\r\nlines   spaces ",
    "def f(x: int) -> int:\n    return x ** 2  # ✓\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TINY)


def _byte_to_symbol() -> dict[int, str]:
    """GPT-2 byte-level symbol for each byte: printable Latin-1 maps to itself, the rest to 256+n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == 4096
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.token_to_id("<|im_start|>") == 3 and tok.token_to_id("<|im_end|>") == 4
    assert tok.eos_token_ids == {1, 4}


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_no_bos_by_default_and_specials_parsed(tok: Tokenizer) -> None:
    assert tok.encode("hello")[0] != tok.bos_token_id
    assert tok.encode("<|im_start|>user")[0] == 3
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_every_byte_has_a_token(tok: Tokenizer) -> None:
    for byte, symbol in _byte_to_symbol().items():
        token_id = tok.token_to_id(symbol)
        assert token_id is not None, byte
        assert tok.decode([token_id]) == bytes([byte]).decode("utf-8", errors="replace")
    all_code_points = "".join(chr(i) for i in range(256))
    assert tok.decode(tok.encode(all_code_points)) == all_code_points


def test_matches_transformers_reference(tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"))
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ref.encode(text, add_special_tokens=False) == ids
        assert ref.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        assert ref.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


def _stream(det: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = [det.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, det.flush()]


@pytest.mark.parametrize("step", [1, 2, 3])
@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_matches_full_decode(tok: Tokenizer, text: str, step: int) -> None:
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok)
    deltas = _stream(det, ids, step)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_incremental_holds_back_split_characters(tok: Tokenizer) -> None:
    text = "héllo 世界 🎉🎉 ok"
    assert len(tok.encode("🎉")) > 1  # the emoji really spans several byte tokens
    det = IncrementalDetokenizer(tok)
    deltas = _stream(det, tok.encode(text))
    assert "" in deltas[:-1]  # something was held back mid-character
    assert "".join(deltas) == text
    det = IncrementalDetokenizer(tok)
    assert det.add(tok.encode("🎉")[:1]) == ""
    assert det.flush() == "\ufffd"  # bytes that never complete come out as a replacement char


def test_incremental_with_prompt_and_specials(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nsay 🎉<|im_end|>\n<|im_start|>assistant\n")
    gen = tok.encode("Sure: 🎉 世界!") + [tok.token_to_id("<|im_end|>")]
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(_stream(det, gen)) == "Sure: 🎉 世界!"
    det = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(_stream(det, gen)) == "Sure: 🎉 世界!<|im_end|>"


def test_incremental_decodes_a_bounded_window(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode("The quick brown fox 🎉 jumps over the lazy dog. " * 40)
    seen: list[int] = []
    real_decode = tok.decode

    def spy(ids_: list[int], skip_special_tokens: bool = True) -> str:
        seen.append(len(ids_))
        return real_decode(ids_, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    det = IncrementalDetokenizer(tok, prompt_ids=ids[:50])
    text = "".join(_stream(det, ids[50:]))
    monkeypatch.undo()
    assert max(seen) <= 8
    assert text == tok.decode(ids[50:])


def test_chat_template(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    body = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == body
    assert tok.apply_chat_template(messages) == body + "<|im_start|>assistant\n"
    ids = tok.encode(tok.apply_chat_template(messages[:1]))
    assert ids[0] == 3 and 4 in ids
    with pytest.raises(ChatTemplateError, match="Only text"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_chat_template_matches_transformers(tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(TINY))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    for agp in (True, False):
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
        assert tok.apply_chat_template(messages, add_generation_prompt=agp) == expected


def test_missing_template_and_dict_tokens(tmp_path: Path) -> None:
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    bare = Tokenizer.from_dir(tmp_path)
    assert bare.eos_token_ids == set() and bare.bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    config = {
        "bos_token": {"content": "<|bos|>", "special": True},
        "eos_token": {"content": "<|im_end|>", "special": True},
        "add_bos_token": True,
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    custom = Tokenizer.from_dir(tmp_path)
    assert (custom.bos_token_id, custom.eos_token_id, custom.eos_token_ids) == (0, 4, {1, 4})
    assert custom.encode("hi")[0] == 0 and custom.encode("hi", add_special_tokens=False)[0] != 0
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "<|bos|>x"


def test_build_script_is_deterministic(tmp_path: Path) -> None:
    """Two runs of the trainer on the committed corpus give the committed files, byte for byte."""
    for run in ("a", "b"):
        out = tmp_path / run
        result = subprocess.run([sys.executable, "-m", "training.tokenizer", "--out", str(out)], cwd=ROOT,
                                capture_output=True, text=True, check=True)
        assert "3 <|im_start|>" in result.stdout
        for name in BUILD_FILES:
            assert (out / name).read_bytes() == (TINY / name).read_bytes(), name
