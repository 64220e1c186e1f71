"""Build the tiny model's byte-level BPE tokenizer, deterministically and offline.

Writes `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` into
`configs/tiny/` (or `--out DIR`). The training corpus is generated here from fixed word
lists and a fixed linear congruential generator, so two runs give byte-identical files.

Special token ids (fixed, trained first so they occupy the lowest ids):
    0 <|bos|>   1 <|eos|>   2 <|pad|>   3 <|im_start|>   4 <|im_end|>
Then the 256 byte-level alphabet symbols (ids 5..260), then merges up to VOCAB_SIZE.

Usage: python scripts/build_tiny_tokenizer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 8192
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "configs" / "tiny"

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

WORDS = """
the be to of and a in that have i it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see
other than then now look only come its over think also back after use two how our work first
well way even new want because any these give day most us is are was were been has had did said
world life hand part child eye woman man place week case point government company number group
problem fact small large great little old big high different long young important few public bad
same able early last next right left open close read write run walk talk learn teach build test
model token server request response stream batch cache memory layer attention expert router value
key query block sparse dense index weight tensor shape device kernel queue thread process message
file path config data text byte string list dict class function method return yield import
system user assistant tool call result error warning info debug start stop begin end finish
water light house city country music story question answer money night morning evening home
school family friend food green blue red white black yellow happy quick lazy brown fox dog jumps
""".split()

EXTRA = """
café naïve résumé über straße déjà vu señor crème brûlée français español 日本 中文 你好 世界
東京 北京 こんにちは ありがとう 안녕하세요 привет мир γειά σου κόσμε
""".split()

SENTENCES = """
The quick brown fox jumps over the lazy dog.
A small model can still learn the shape of a language.
Please read the config file and start the server on port 30000.
What time is it? It is 10:45 in the morning, and the meeting starts at 11:00.
She said: "Tokens are not words, but words are often tokens."
The cache holds 4096 tokens per block, with 16 blocks in total.
Errors should never pass silently; unless explicitly silenced.
In 2024, the team shipped version 1.2.3 with 99.5% fewer bugs (allegedly).
Hello, world! Hello, user. Hello, assistant.
""".strip().splitlines()

CODE = [
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Server:\n    def __init__(self, port: int = 8080) -> None:\n        self.port = port\n",
    'import json\nwith open("config.json") as f:\n    cfg = json.load(f)\n',
    '{"model": "tiny", "max_tokens": 128, "temperature": 0.7, "stream": true}\n',
    'if (x != null && y >= 0) { return x[y]; } else { throw new Error("bad"); }\n',
    "$ curl -s http://localhost:30000/v1/completions | jq .choices[0].text\n",
    "SELECT id, name FROM users WHERE age > 21 ORDER BY name;\n",
    "x = [1, 2, 3]; y = {'a': 1, 'b': 2}; z = (x, y)\n",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }\n',
]

PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \t\n"
SUFFIXES = ("", "s", "ed", "ing", "er", "ly")


def _lcg(seed: int) -> Iterator[int]:
    """A fixed 32-bit linear congruential generator (independent of Python's `random`)."""
    state = seed
    while True:
        state = (1103515245 * state + 12345) % (1 << 31)
        yield state >> 8


def corpus() -> list[str]:
    """The fixed training corpus, as a list of text chunks."""
    rng = _lcg(20240601)
    words = WORDS + EXTRA
    chunks: list[str] = []
    for _ in range(6):  # repeat the fixed material so its common pairs dominate
        chunks.extend(SENTENCES)
        chunks.extend(CODE)
        chunks.append(" ".join(WORDS))
    for base in WORDS:  # inflected forms give the merges something to learn
        chunks.append(" ".join(base + suffix for suffix in SUFFIXES))
        chunks.append(base.capitalize() + " " + base.upper() + ".")
    for _ in range(1500):  # pseudo-random sentences over the word lists
        n = 4 + next(rng) % 9
        sentence = " ".join(words[next(rng) % len(words)] for _ in range(n))
        chunks.append(sentence.capitalize() + PUNCT[next(rng) % 14])
    for i in range(0, 2000, 7):  # digits and punctuation
        chunks.append(f"{i} + {i * 3} = {i * 4}; {i / 8:.3f} {i:#x} [{i % 10}] ({i % 100}%)")
    chunks.append(PUNCT * 4)
    return chunks


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer on the fixed corpus."""
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
    tok.train_from_iterator(corpus(), trainer=trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special tokens got unexpected ids {ids}")
    if tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"vocab size {tok.get_vocab_size()} != {VOCAB_SIZE}: corpus too small")
    return tok


def _dump(obj: dict, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(out_dir: Path) -> dict[str, int]:
    """Write the three tokenizer files into `out_dir`; return the special-token ids."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
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
    args = parser.parse_args(argv)
    ids = build(args.out)
    print(f"wrote {args.out} (vocab_size={VOCAB_SIZE})")
    for token, i in ids.items():
        print(f"  {i:>2} {token}")


if __name__ == "__main__":
    main()
