"""One benchmark in a fresh process: `python -m bench.child NAME CONTEXT_JSON RESULT_JSON`.

bench.run starts one per benchmark, so no benchmark inherits another's memory state, threads or
imports, and a crash (or the OOM killer) costs only that benchmark.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from bench.benches import BENCHES
from bench.context import context_from_json


def main(argv: list[str]) -> int:
    name, ctx_file, out_file = argv[0], Path(argv[1]), Path(argv[2])
    ctx = context_from_json(ctx_file.read_text())
    torch.manual_seed(ctx.seed)
    try:
        res = BENCHES[name](ctx)
    except Exception:
        traceback.print_exc()
        res = {"error": traceback.format_exc()}
    out_file.write_text(json.dumps(res, default=str, allow_nan=True))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
