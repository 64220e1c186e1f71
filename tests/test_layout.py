"""The core stays small enough to read in an afternoon: server/, engine/ and mem_cache/ within their budget of
7,000 lines of Python (counted as `wc -l` counts), and no file of them over 250 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_core_keeps_its_line_budget() -> None:
    core = [f for d in ("server", "engine", "mem_cache") for f in (ROOT / d).rglob("*.py")]
    files = {f: len(f.read_bytes().splitlines()) for f in core}
    long = {str(f.relative_to(ROOT)): n for f, n in files.items() if n > 250}
    assert not long, f"files over 250 lines: {long}"
    assert sum(files.values()) <= 7000, f"the core is {sum(files.values())} lines, over its 7,000"
