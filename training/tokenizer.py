"""Train the tiny model's byte-level BPE tokenizer on the story corpus, deterministically and offline.

Writes `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` into `configs/tiny/`
(or `--out DIR`). The training text is the committed corpus (training/data/corpus) plus a little
fixed material (digits, punctuation, code, non-Latin scripts) so that other text still tokenizes
sensibly; two runs give byte-identical files.

Special token ids (fixed, trained first so they occupy the lowest ids):
    0 <|bos|>   1 <|eos|>   2 <|pad|>   3 <|im_start|>   4 <|im_end|>
Then the 256 byte-level alphabet symbols (ids 5..260), then merges up to VOCAB_SIZE.

Usage: python -m training.tokenizer [--out DIR] [--corpus DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 8192
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "configs" / "tiny"
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "corpus"

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message; content may be a string,
# None, or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message['content'] is none %}{%- set content = '' %}\n"
    "{%- elif message['content'] is string %}{%- set content = message['content'] %}\n"
    "{%- else %}{%- set content = namespace(text='') %}\n"
    "{%- for part in message['content'] %}\n"
    "{%- if part['type'] != 'text' %}{{- raise_exception('Only text content parts are supported.') }}{%- endif %}\n"
    "{%- set content.text = content.text + part['text'] %}\n"
    "{%- endfor %}{%- set content = content.text %}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

EXTRA = """
café naïve résumé über straße déjà vu señor crème brûlée français español 日本 中文 你好 世界
東京 北京 こんにちは ありがとう 안녕하세요 привет мир γειά σου κόσμε
""".split()

CODE = [
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    'import json\nwith open("config.json") as f:\n    cfg = json.load(f)\n',
    '{"model": "tiny", "max_tokens": 128, "temperature": 0.7, "stream": true}\n',
    "$ curl -s http://localhost:30000/v1/completions | jq .choices[0].text\n",
]

PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t\n"


# The shipped tokenizer was trained on the first 34 shards; it stays as it is while the corpus grows (the
# shipped model was trained with it). Raise this only together with retraining the model.
TOKENIZER_SHARDS = 34


def fixed_material() -> list[str]:
    """A little text outside the stories: digits, punctuation, code, other scripts."""
    chunks = list(CODE) + [" ".join(EXTRA), PUNCT * 4]
    chunks += [f"{i} + {i * 3} = {i * 4}; {i / 8:.3f} [{i % 10}] ({i % 100}%)" for i in range(0, 2000, 7)]
    return chunks


def corpus(directory: Path = DEFAULT_CORPUS) -> list[str]:
    """The training text: the stories of shards 0..TOKENIZER_SHARDS-1, then the fixed material."""
    from training.corpus import read_corpus

    stories = [row["text"] for row in read_corpus(directory, TOKENIZER_SHARDS)]
    if not stories:
        raise SystemExit(f"no corpus shards in {directory}: run python -m training.corpus first")
    return stories + fixed_material()


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Train the byte-level BPE tokenizer on `texts`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=0,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got unexpected ids {ids}")
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"vocab size {tok.get_vocab_size()} != {VOCAB_SIZE}: corpus too small")
    return tok


def _dump(obj: dict, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out_dir: Path, corpus_dir: Path = DEFAULT_CORPUS) -> dict[str, int]:
    """Write the three tokenizer files into `out_dir`; return the special-token ids."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus(corpus_dir))
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    bos, eos, pad, _, im_end = SPECIAL_TOKENS
    _dump(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": pad,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            "chat_template": CHAT_TEMPLATE,
        },
        out_dir / "tokenizer_config.json",
    )
    _dump(
        {
            "bos_token_id": ids[bos],
            "eos_token_id": [ids[eos], ids[im_end]],
            "pad_token_id": ids[pad],
            "do_sample": False,
        },
        out_dir / "generation_config.json",
    )
    return ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus shard directory")
    args = parser.parse_args(argv)
    ids = build(args.out, args.corpus)
    print(f"wrote {args.out} (vocab_size={VOCAB_SIZE})")
    for token, i in ids.items():
        print(f"  {i:>2} {token}")


if __name__ == "__main__":
    main()
