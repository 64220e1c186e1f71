"""Resumable story-corpus generator (build time): TinyStories-style prompts -> teacher -> xz shards.

    python -m training.corpus --shards 400            # writes training/data/corpus/shard_00000.jsonl.xz ...

Shard i is fixed by its index: its prompts come from `random.Random(i)` over the word lists in
`training/words.py`, its sampling noise from a generator seeded with i. Existing shards are skipped,
so a stopped run resumes where it stopped (on this or another machine). Each line of a shard is one
story: {"id", "noun", "verb", "adjective", "name", "feature", "ended", "text"}. A story that did not end
within the token limit keeps its whole paragraphs (`ended: false`); stories that loop or are too short
are dropped (counted in the log line).
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
import time
from collections import Counter
from pathlib import Path

from training.words import ADJECTIVES, FEATURES, NAMES, NOUNS, VERBS

DEFAULT_DIR = Path(__file__).parent / "data" / "corpus"
PROMPT = ("Write a short story for young children. Use simple words. The story is about {name} and a {adjective} "
          "{noun}. In the story, {name} likes to {verb}. {feature}")


def shard_prompts(index: int, batch: int) -> list[dict[str, str]]:
    rng = random.Random(index)
    return [{"noun": rng.choice(NOUNS), "verb": rng.choice(VERBS), "adjective": rng.choice(ADJECTIVES),
             "name": rng.choice(NAMES), "feature": rng.choice(FEATURES)} for _ in range(batch)]


def clean(text: str, ended: bool) -> str | None:
    """The story text, or None when it should not be kept (too short, looping, not prose)."""
    text = text.strip()
    if not ended:  # cut off by the token limit: keep the paragraphs that are complete
        text = text[: text.rfind("\n\n")].strip() if "\n\n" in text else ""
    text = re.sub(r"^(title|story)\s*:.*\n+", "", text, flags=re.IGNORECASE).strip()
    words = text.split()
    if len(words) < 60 or "http" in text or "```" in text:
        return None
    grams = Counter(tuple(words[i:i + 4]) for i in range(len(words) - 3))
    if grams and max(grams.values()) > 3:  # a phrase of four words said four times: a loop
        return None
    return text


def write_shard(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.rename(path)  # atomic: a shard is either whole or absent


def read_corpus(directory: Path = DEFAULT_DIR, shards: int | None = None) -> list[dict]:
    """Every story of every shard (or of shards 0..shards-1), in shard order."""
    rows = []
    for path in sorted(directory.glob("shard_*.jsonl.xz")):
        if shards is not None and int(path.name[6:11]) >= shards:
            continue
        with lzma.open(path, "rt", encoding="utf-8") as f:
            rows.extend(json.loads(line) for line in f)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--shards", type=int, default=400, help="shard indices 0..N-1 (existing ones are skipped)")
    ap.add_argument("--batch", type=int, default=128, help="prompts per shard (one batched generation)")
    ap.add_argument("--max-new-tokens", type=int, default=400)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--repetition-penalty", type=float, default=1.05)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    from training.teacher import Teacher

    torch.set_num_threads(args.threads)

    teacher = Teacher()
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(args.shards):
        path = args.out / f"shard_{i:05d}.jsonl.xz"
        if path.exists():
            continue
        t0 = time.time()
        meta = shard_prompts(i, args.batch)
        prompts = [teacher.prompt_ids(PROMPT.format(**m)) for m in meta]
        gen = torch.Generator().manual_seed(i)
        outs = teacher.generate(prompts, args.max_new_tokens, args.temperature, args.top_k,
                                args.repetition_penalty, gen)
        rows, tokens = [], sum(len(ids) for ids, _ in outs)
        for j, (m, (ids, ended)) in enumerate(zip(meta, outs)):
            text = clean(teacher.tok.decode(ids, skip_special_tokens=True), ended)
            if text is not None:
                rows.append({"id": f"{i}-{j}", **m, "ended": ended, "text": text})
        write_shard(path, rows)
        dt = time.time() - t0
        print(f"shard {i}: kept {len(rows)}/{len(meta)} stories, {tokens} teacher tokens in {dt:.0f} s "
              f"({tokens / dt:.0f} tok/s)", flush=True)


if __name__ == "__main__":
    main()
