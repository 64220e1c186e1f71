"""The training code against the engine: its forward gives the engine's logits, the indexer loss is a
KL divergence, and exported weights load back into the same model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from engine_utils import TINY

from engine.model.loader import load_model
from engine.runtime.tokenizer import Tokenizer
from tests.forward_utils import PagedModel
from training.corpus import read_corpus
from training.export import export_safetensors
from training.forward import block_mass, forward
from training.indexer import make_optimizer, step


def test_training_forward_equals_the_engine_forward():
    model = load_model(TINY, load_format="dummy", seed=3)
    c = model.cfg
    n = (c.topk_blocks + 3) * c.block_size + 5  # more blocks than the top-k: sparse layers select
    ids = torch.randint(0, c.vocab_size, (2, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, aux = forward(model, ids)
    paged = PagedModel(model, size=4096)
    for row in range(2):
        want = paged.logits(ids[row].tolist())
        assert (got[row] - want).abs().max().item() < 1e-4
    assert len(aux.indexer_kl) == sum(k != "dense" for k in c.layer_kinds)
    assert all(kl.item() >= 0 for kl in aux.indexer_kl)
    assert len(aux.routes) == sum(c.moe_layers) and aux.routes[0].shape == (2 * n, c.num_experts_per_tok)


def test_training_forward_selects_blocks_under_bf16_autocast():
    """Training runs under bf16 autocast (training/train.py); block selection still scores in fp32, as the engine
    does, and the trained model's loss on a held-out story is the fp32 forward's, to bf16 rounding."""
    model = load_model(TINY)
    tok = Tokenizer.from_dir(TINY)
    ids: list[int] = []
    for row in read_corpus():  # shard 0 first: held out
        ids += tok.encode(row["text"], add_special_tokens=False) + [tok.eos_token_id]
        if len(ids) > (model.cfg.topk_blocks + 2) * model.cfg.block_size:
            break
    x = torch.tensor([ids])
    with torch.no_grad():
        want, _ = forward(model, x[:, :-1], indexer_loss=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, aux = forward(model, x[:, :-1])
    assert len(aux.indexer_kl) == sum(k != "dense" for k in model.cfg.layer_kinds)
    loss = [F.cross_entropy(y[0].float(), x[0, 1:]).item() for y in (got, want)]
    assert loss[1] < 4.0 and abs(loss[0] - loss[1]) < 0.02 * loss[1], loss


def test_the_language_model_loss_reaches_every_non_indexer_weight():
    model = load_model(TINY, load_format="dummy", seed=6)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 3 * model.cfg.block_size), generator=torch.Generator().manual_seed(2))
    logits, _ = forward(model, ids, indexer_loss=False)
    F.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    idle = [n for n, p in model.named_parameters()
            if (p.grad is None or p.grad.abs().sum() == 0) and "index" not in n and "router_bias" not in n]
    assert idle == []


def test_indexer_loss_trains_only_the_indexer_and_is_zero_when_it_matches():
    model = load_model(TINY, load_format="dummy", seed=4)
    c = model.cfg
    ids = torch.randint(0, c.vocab_size, (1, 4 * c.block_size), generator=torch.Generator().manual_seed(1))
    _, aux = forward(model, ids)
    torch.stack(aux.indexer_kl).sum().backward()
    attn = model.layers[c.layer_kinds.index("sparse_k_only")].self_attn
    assert attn.index_q_norm.grad is not None and attn.index_q_norm.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is None or model.embed_tokens.weight.grad.abs().sum() == 0
    p = torch.softmax(torch.randn(4, 6), -1)  # the KL itself: 0 iff the distributions agree
    assert F.kl_div(p.log(), p, reduction="batchmean").abs() < 1e-6


def test_exported_weights_load_back_identically(tmp_path):
    model = load_model(TINY, load_format="dummy", seed=5)
    with torch.no_grad():  # export writes bf16 (the router stays fp32): round first, then compare exactly
        for name, p in model.named_parameters():
            if not name.endswith(("router", "router_bias")):
                p.copy_(p.to(torch.bfloat16).float())
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(TINY) / f, tmp_path / f)
    export_safetensors(model, tmp_path / "model.safetensors")
    back = load_model(tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def test_indexer_stage_moves_only_the_score_only_layers_index_rows():
    model = load_model(TINY, load_format="dummy", seed=7)
    c = model.cfg
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, c.vocab_size, (1, 4 * c.block_size), generator=torch.Generator().manual_seed(3))
    opt = make_optimizer(model, lr=1e-3)
    first = step(model, opt, ids)
    assert first > 0 and step(model, opt, ids) < first  # the free-block KL falls on the same window
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    score_only = [i for i, k in enumerate(c.layer_kinds) if k == "sparse_k_only"]
    assert moved == {f"layers.{i}.self_attn.{w}" for i in score_only for w in ("qkv_proj", "index_q_norm", "index_k_norm")}
    for i in score_only:
        a = model.layers[i].self_attn
        lo, hi = sum(a.splits[:2]), sum(a.splits[:4])  # the index q/k rows of the fused projection
        changed = (a.qkv_proj != before[f"layers.{i}.self_attn.qkv_proj"]).any(-1).nonzero().flatten()
        assert changed.min() >= lo and changed.max() < hi


def test_block_mass_is_the_softmax_summed_by_key_block():
    gen = torch.Generator().manual_seed(0)
    b, heads, kv, t, d, bs = 2, 8, 2, 300, 4, 64  # the last block partial; more blocks (5) than the head width
    q, k = torch.randn(b, heads, t, d, generator=gen), torch.randn(b, kv, t, d, generator=gen)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax((q @ k.repeat_interleave(heads // kv, 1).transpose(-1, -2) * d ** -0.5).masked_fill(~causal, float("-inf")), -1)
    p = F.pad(p.view(b, kv, -1, t, t).sum(2), (0, -t % bs)).view(b, kv, t, -1, bs).sum(-1)
    assert (block_mass(q, k, bs, d ** -0.5) - p / p.sum(-1, keepdim=True)).abs().max().item() < 1e-5
