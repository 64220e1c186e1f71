"""`python -m bench.quality`: the default model's quality on the held-out stories (the README figures).

- Held-out perplexity of configs/tiny through a live server's input logprobs (POST /generate) and
  through the training forward (the engine's math, dense layout); and of its score-only copy (no
  index-value branch, no init blocks: what transformers has) through our engine and through
  transformers. Each pair must agree.
- Block-sparse against every layer dense (the same weights, top-k raised past every block) at 1k and
  2k tokens of packed context.
- The indexer's recall: the share of the true top-k blocks' attention mass (main attention, per KV
  group) that its chosen blocks hold, over queries that see more blocks than top-k.
- Six samples through the server: three story openings, greedy and at temperature 0.8.

Writes docs/benchmarks/quality.json and prints a summary. About 3 minutes on 2 idle cores; never run it
beside training or another benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F

from bench.hf_copy import write_hf_copy
from bench.models import load_transformers
from engine.model.loader import load_model
from engine.model.model import MiniMaxM3Model
from engine.runtime.tokenizer import Tokenizer
from tests.server_utils import start_server
from training.forward import forward
from training.train import token_streams

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny"
OUT = ROOT / "docs" / "benchmarks" / "quality.json"
OPENINGS = ["Once upon a time, there was a little girl named Lily.",
            "Tom and his dog Max went to the park.",
            "One day, a small bird could not find its mother."]


def windows(stream: torch.Tensor, n: int, limit: int) -> list[torch.Tensor]:
    """Non-overlapping windows of n tokens from the held-out stream (at most `limit`)."""
    return [stream[i:i + n] for i in range(0, stream.numel() - n + 1, n)][:limit]


@torch.no_grad()
def offline(model: MiniMaxM3Model, wins: list[torch.Tensor]) -> tuple[float, list[float]]:
    """(perplexity, mean indexer recall per sparse layer, [] when none selects) of the windows through the
    training forward (fp32)."""
    nll, count, recall = 0.0, 0, []
    for w in wins:
        logits, aux = forward(model, w[None], indexer_loss=True)
        nll += F.cross_entropy(logits[0, :-1], w[1:], reduction="sum").item()
        count += w.numel() - 1
        recall.append([r.item() for r in aux.recall])
    return math.exp(nll / count), [sum(layer) / len(layer) for layer in zip(*recall)]


def dense_twin(model: MiniMaxM3Model) -> MiniMaxM3Model:
    """The same weights with every sparse layer attending to every block."""
    twin = MiniMaxM3Model(dataclasses.replace(model.cfg, topk_blocks=1 << 20))
    twin.load_state_dict(model.state_dict())
    return twin.eval()


class Server:
    def __init__(self, model_dir: Path) -> None:
        self.srv = start_server("--model-path", str(model_dir), "--max-total-tokens", "16384", wait=120)
        self.url = self.srv.url

    def perplexity(self, wins: list[torch.Tensor]) -> float:
        nll, count = 0.0, 0
        for w in wins:
            r = httpx.post(self.url + "/generate", timeout=300, json={
                "input_ids": w.tolist(), "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
            lps = [e[0] for e in r["meta_info"]["input_token_logprobs"] if e[0] is not None]
            nll -= sum(lps)
            count += len(lps)
        return math.exp(nll / count)

    def sample(self, text: str, temperature: float) -> str:
        r = httpx.post(self.url + "/generate", timeout=300, json={
            "text": text, "sampling_params": {"max_new_tokens": 100, "temperature": temperature, "sampling_seed": 7}})
        return text + r.json()["text"]

    def close(self) -> None:
        self.srv.terminate()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=TINY)
    ap.add_argument("--quick", action="store_true", help="two windows per context (a smoke run)")
    args = ap.parse_args()
    model_dir, most = args.model, 2 if args.quick else 1 << 30
    torch.set_num_threads(2)
    tok = Tokenizer.from_dir(model_dir)
    _, held = token_streams(tok)
    res: dict = {"held_out_tokens": held.numel()}
    model = load_model(model_dir).eval()
    dense = dense_twin(model)
    for n, limit in ((1024, 24), (2048, 12)):
        wins = windows(held, n, min(limit, most))
        sparse_ppl, per_layer = offline(model, wins)
        dense_ppl, _ = offline(dense, wins)
        recall = sum(per_layer) / len(per_layer)
        res[f"ctx{n}"] = {"windows": len(wins), "sparse_ppl": sparse_ppl, "dense_ppl": dense_ppl,
                          "sparse_over_dense": sparse_ppl / dense_ppl, "indexer_recall": recall,
                          "indexer_recall_per_sparse_layer": per_layer}
        print(f"context {n}: {len(wins)} windows, ppl sparse {sparse_ppl:.3f} dense {dense_ppl:.3f} "
              f"({100 * (sparse_ppl / dense_ppl - 1):+.2f}%), indexer recall {recall:.3f} "
              f"(per sparse layer {' '.join(f'{r:.3f}' for r in per_layer)})", flush=True)
    srv = Server(model_dir)
    try:
        wins = windows(held, 2048, min(12, most))
        res["server_ppl_ctx2048"] = srv.perplexity(wins)
        print(f"server ppl at 2048: {res['server_ppl_ctx2048']:.3f} (offline {res['ctx2048']['sparse_ppl']:.3f})")
        res["samples"] = [{"prompt": o, "temperature": t, "text": srv.sample(o, t)} for t in (0.0, 0.8) for o in OPENINGS]
    finally:
        srv.close()
    with tempfile.TemporaryDirectory() as d:
        write_hf_copy(model, Path(d), model_dir)
        hf = load_transformers(Path(d))
        wins = windows(held, 1024, min(6, most))
        nll, count = 0.0, 0
        with torch.no_grad():
            for w in wins:
                logits = hf(w[None]).logits[0].float()
                nll += F.cross_entropy(logits[:-1], w[1:], reduction="sum").item()
                count += w.numel() - 1
        copy_ours, _ = offline(load_model(Path(d)).eval(), wins)
        res["score_only_copy_ctx1024"] = {"ours": copy_ours, "transformers": math.exp(nll / count)}
        print(f"score-only copy at 1024: ppl ours {copy_ours:.4f}, transformers {math.exp(nll / count):.4f}")
    if not args.quick:
        OUT.write_text(json.dumps(res, indent=1))
    for s in res["samples"]:
        print(f"--- T={s['temperature']}: {s['text']!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
