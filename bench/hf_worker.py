"""One transformers long-context case in its own process, under an address-space cap:
`python -m bench.hf_worker MODEL_DIR PROMPT_JSON NEW_TOKENS MEM_CAP_BYTES`.

Prints one JSON object per line as results come in, so a case killed at its timeout still reports
what it finished: {"prefill_s"} (one forward of the whole prompt, as generate() does) or
{"prefill_cut"} when that runs out of memory; then {"decode_s", "decode_steps", "tokens",
"synthetic_cache"}. When the prefill did not fit, decode runs on a cache of the same size filled with
random K/V (a decode step's cost does not depend on the cached values; its tokens do, so they are
not comparable then).
"""

from __future__ import annotations

import gc
import json
import re
import resource
import sys
from pathlib import Path

import torch


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "alloc" in str(e).lower() or "memory" in str(e).lower()


def synthetic_cache(config, n: int):
    """A DynamicCache holding `n` positions of random main K/V (and index K on sparse layers)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    gen = torch.Generator().manual_seed(0)
    for i in range(config.num_hidden_layers):
        shape = (1, config.num_key_value_heads, n, config.head_dim)
        cache.update(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), i)
        if config.layer_types[i] == "minimax_m3_sparse":
            cache.layers[i].update_index(torch.randn(1, 1, n, config.index_head_dim, generator=gen))
    return cache


def main(argv: list[str]) -> int:
    model_dir, prompt_file, new_tokens, cap = Path(argv[0]), Path(argv[1]), int(argv[2]), int(argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from bench import hf_gen
    from bench.models import load_transformers

    model = load_transformers(model_dir)
    prompt = json.loads(prompt_file.read_text())
    hf_gen.prefill(model, prompt[:16])  # warm-up
    synthetic = False
    try:
        seconds, cache, first = hf_gen.prefill(model, prompt)
        _emit({"prefill_s": seconds})
    except (RuntimeError, MemoryError) as e:
        if not _is_oom(e):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(e))
        detail = f" (an allocation of {int(asked[1]) / 2**30:.1f} GiB failed)" if asked else ""
        _emit({"prefill_cut": f"out of memory under the {cap / 2**30:.0f} GiB address-space cap{detail}"})
        gc.collect()
        cache, first, synthetic = synthetic_cache(model.config, len(prompt)), prompt[-1], True
    steps = new_tokens - 1
    seconds, tokens = hf_gen.decode(model, cache, first, len(prompt), steps)
    _emit({"decode_s": seconds, "decode_steps": steps, "tokens": [first, *tokens], "synthetic_cache": synthetic})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
