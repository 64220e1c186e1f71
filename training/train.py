"""Train the default model (configs/tiny) on the story corpus: build time, hours on 2 cores, resumable.

    python -m training.train --hours 3          # resumes from training/runs/tiny/ckpt.pt if present
    python -m training.train --export-only       # write configs/tiny/model.safetensors from the checkpoint
    python -m training.train --run-dir training/runs/more --init-from configs/tiny   # continue from weights

Stories are joined with <|eos|> and packed into sequences of --seq-len tokens (several stories each,
so that a sparse layer sees more blocks than it selects). Loss: next-token cross-entropy plus the
indexer's KL term (training/forward.py). MoE balance: DeepSeek-V3's bias update, no aux loss.
bf16 autocast (this CPU has AMX), AdamW, warm-up then cosine decay.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.config_json import load_config
from engine.model.loader import load_weights
from engine.model.model import MiniMaxM3Model
from engine.runtime.tokenizer import Tokenizer
from training.corpus import DEFAULT_DIR, read_corpus
from training.export import export_safetensors
from training.forward import forward

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny"
RUN_DIR = Path(__file__).resolve().parent / "runs" / "tiny"
HELD_OUT_EVERY = 50  # shard i is held out when i % 50 == 0


def token_streams(tok: Tokenizer, corpus_dir: Path = DEFAULT_DIR) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: every story followed by <|eos|>, held-out by shard."""
    eos = tok.eos_token_id
    train, held = [], []
    for row in read_corpus(corpus_dir):
        shard = int(row["id"].split("-")[0])
        (held if shard % HELD_OUT_EVERY == 0 else train).extend(tok.encode(row["text"]) + [eos])
    return torch.tensor(train, dtype=torch.int64), torch.tensor(held, dtype=torch.int64)


def batches(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """Random windows of seq_len + 1 tokens (input and target), forever."""
    while True:
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
        yield torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


def init_weights(model: MiniMaxM3Model, seed: int = 0) -> None:
    """Matrices ~ N(0, 0.02^2) (output projections scaled by 1/sqrt(2 * layers)), norms at 1, biases 0."""
    gen = torch.Generator().manual_seed(seed)
    out_scale = (2 * model.cfg.num_layers) ** -0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or name.endswith("router_bias"):
                p.zero_()
                continue
            std = 0.02 * (out_scale if name.endswith(("o_proj", "down_proj", "w2")) else 1.0)
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% as `progress` (0..1) runs out."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def balance_routers(model: MiniMaxM3Model, routes: list[torch.Tensor], rate: float) -> None:
    """Raise the correction bias of under-used experts, lower it for over-used ones (no gradient)."""
    moes = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "router_bias")]
    with torch.no_grad():
        for moe, ids in zip(moes, routes):
            load = torch.bincount(ids.flatten(), minlength=moe.router_bias.numel()).float()
            moe.router_bias += rate * torch.sign(load.mean() - load)


@torch.no_grad()
def evaluate(model: MiniMaxM3Model, stream: torch.Tensor, seq_len: int, windows: int = 16) -> float:
    """Mean held-out next-token loss over `windows` fixed windows (fp32)."""
    step = max(1, (stream.numel() - seq_len - 1) // windows)
    losses = []
    for i in range(windows):
        x = stream[i * step:i * step + seq_len + 1][None]
        logits, _ = forward(model, x[:, :-1], indexer_loss=False)
        losses.append(F.cross_entropy(logits[0], x[0, 1:]).item())
    return sum(losses) / len(losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=3.0,
                    help="training time in all (resumes count): the learning rate decays over it")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kl-every", type=int, default=4, help="the indexer's distillation term on every n-th step")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--run-dir", type=Path, default=RUN_DIR, help="where the checkpoint lives")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="a checkpoint directory whose weights a new run starts from (instead of random ones)")
    args = ap.parse_args()
    if args.kl_every < 1:
        ap.error(f"--kl-every must be at least 1, got {args.kl_every}")
    torch.set_num_threads(args.threads)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.run_dir / "ckpt.pt"
    cfg = load_config(TINY)
    model = MiniMaxM3Model(cfg)
    if args.init_from is None:
        init_weights(model)
    else:
        load_weights(model, args.init_from)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    state = {"step": 0, "seconds": 0.0, "gen": torch.Generator().manual_seed(0).get_state(), "log": []}
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']}")
    if args.export_only:
        export_safetensors(model, TINY / "model.safetensors")
        return
    tok = Tokenizer.from_dir(TINY)
    train, held = token_streams(tok)
    print(f"corpus: {train.numel()} train tokens, {held.numel()} held-out tokens")
    gen = torch.Generator()
    gen.set_state(state["gen"])
    data = batches(train, args.batch, args.seq_len, gen)
    budget, first = args.hours * 3600, state["step"]
    start = last_save = tick = time.time()
    model.train()
    while state["seconds"] < budget:
        step = state["step"]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, state["seconds"] / budget, args.lr, warmup=100)
        x = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # NOTE: a step with the KL term costs 1.3-1.5x one without
            logits, aux = forward(model, x[:, :-1], indexer_loss=step % args.kl_every == 0)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        kl = torch.stack(aux.indexer_kl).mean() if aux.indexer_kl else torch.zeros(())
        opt.zero_grad(set_to_none=True)
        (lm + kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance_routers(model, aux.routes, rate=1e-3)
        state["step"] = step + 1
        state["seconds"] += time.time() - tick
        if step % 12 == 0:
            tps = (step + 1 - first) * args.batch * args.seq_len / max(1e-9, time.time() - start)
            print(f"step {step} lm {lm.item():.3f} kl {kl.item():.3f} lr {group['lr']:.2e} {tps:.0f} tok/s", flush=True)
            state["log"].append((step, lm.item(), kl.item()))
        if time.time() - last_save > 600:
            state["gen"] = gen.get_state()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)
            last_save = time.time()
            model.eval()
            print(f"step {state['step']}: held-out loss {evaluate(model, held, args.seq_len):.3f}", flush=True)
            model.train()
        tick = time.time()  # saving and evaluating do not count as training time
    state["gen"] = gen.get_state()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt_path)
    model.eval()
    export_safetensors(model, TINY / "model.safetensors")


if __name__ == "__main__":
    main()
