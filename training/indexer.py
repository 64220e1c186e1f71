"""The last training stage: the score-only layers' indexers alone, the rest of the model frozen (resumable).

    python -m training.indexer --hours 0.5      # from training/runs/tiny/ckpt.pt (the joint stages' end)

A score-only layer's index q/k feed nothing but its block selection, so training them alone changes which
blocks its queries attend to and nothing else (an index-value layer's index q/k are also its branch's
attention: they stay with the joint stages). Loss: the indexer's KL term over the free blocks
(training/forward.py) on every step; the model runs without autograd, so a step (9.6 s at 4 x 2,048) costs
less than half of a joint one with the KL term (~23 s). The optimizer is AdamW without weight decay over those layers' qkv_proj and index norms: the rows of
qkv_proj outside the index q/k never get a gradient, and Adam's update on a zero gradient is exactly zero.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from engine.model.config_json import load_config
from engine.model.model import MiniMaxM3Model
from engine.runtime.tokenizer import Tokenizer
from training.export import export_safetensors
from training.forward import forward
from training.train import RUN_DIR, TINY, batches, lr_at, token_streams


def indexer_params(model: MiniMaxM3Model) -> list[torch.nn.Parameter]:
    """What this stage trains: each score-only layer's fused qkv_proj (only its index q/k rows get a
    gradient) and its index q/k norms."""
    attns = [layer.self_attn for layer in model.layers if layer.self_attn.kind == "sparse_k_only"]
    return [p for a in attns for p in (a.qkv_proj, a.index_q_norm, a.index_k_norm)]


def make_optimizer(model: MiniMaxM3Model, lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(indexer_params(model), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def step(model: MiniMaxM3Model, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """One step on token windows x [B, T]; the mean KL of the score-only layers."""
    _, aux = forward(model, x, indexer_loss=True, indexer_only=True)
    kl = torch.stack(aux.indexer_kl).mean()
    opt.zero_grad(set_to_none=True)
    kl.backward()
    opt.step()
    return kl.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=0.5, help="this stage's time in all (resumes count)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--run-dir", type=Path, default=RUN_DIR, help="the joint stages' run (its ckpt.pt)")
    args = ap.parse_args()
    cfg = load_config(TINY)
    if args.seq_len <= (cfg.init_blocks + cfg.local_blocks + 1) * cfg.block_size:
        ap.error(f"--seq-len must leave the indexer two blocks to choose between, "
                 f"more than {(cfg.init_blocks + cfg.local_blocks + 1) * cfg.block_size} tokens; got {args.seq_len}")
    torch.set_num_threads(args.threads)
    model = MiniMaxM3Model(cfg)
    opt = make_optimizer(model, args.lr)
    path, joint = args.run_dir / "indexer.pt", torch.load(args.run_dir / "ckpt.pt", weights_only=False)
    saved = torch.load(path, weights_only=False) if path.exists() else None
    if saved is not None and saved["state"].get("joint_step") == joint["state"]["step"]:  # resume this stage
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
    else:  # start it from where the joint stages ended
        saved = joint
        state = {"step": 0, "seconds": 0.0, "joint_step": joint["state"]["step"],
                 "gen": torch.Generator().manual_seed(1).get_state()}
    model.load_state_dict(saved["model"])
    model.eval()
    train, _ = token_streams(Tokenizer.from_dir(TINY))
    gen = torch.Generator()
    gen.set_state(state["gen"])
    data = batches(train, args.batch, args.seq_len, gen)
    budget, last_save = args.hours * 3600, time.time()

    def save() -> None:
        state["gen"] = gen.get_state()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, path)

    while state["seconds"] < budget:
        tick = time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(state["step"], state["seconds"] / budget, args.lr, warmup=10)
        kl = step(model, opt, next(data)[:, :-1])
        state["step"] += 1
        state["seconds"] += time.time() - tick
        if state["step"] % 5 == 0:
            print(f"step {state['step']} kl {kl:.4f} lr {group['lr']:.2e} {state['seconds'] / 60:.1f} min", flush=True)
        if time.time() - last_save > 600:
            save()
            last_save = time.time()
    save()
    export_safetensors(model, TINY / "model.safetensors")


if __name__ == "__main__":
    main()
