"""Init blocks and the index-value branch (which transformers lacks) against a naive whole-matrix
reference written from model.md, on checkpoints in the original MiniMax layout."""

from __future__ import annotations

import pytest
import torch
from naive_reference import naive_logits
from orig_checkpoint import make_config, random_state_dict, write_checkpoint
from test_parity_transformers import Ours, prompt_logits

VARIANTS = {
    "init1_local1_k3_b4": {},
    "init2_local1_k4_b3": {"sparse_init_block": 2, "sparse_topk_blocks": 4, "sparse_block_size": 3},
    "init0_local2_k2_b5": {"sparse_init_block": 0, "sparse_local_block": 2, "sparse_topk_blocks": 2, "sparse_block_size": 5},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def model(request, tmp_path_factory):
    cfg = make_config(**VARIANTS[request.param])
    sd = random_state_dict(cfg, seed=3)
    d = write_checkpoint(tmp_path_factory.mktemp(request.param), cfg, sd)
    llm = Ours(d)
    assert llm.cfg.layer_kinds == ("dense", "sparse_index_kv", "sparse_k_only", "sparse_index_kv")
    return cfg, sd, llm


def test_logits_match_naive_reference(model):
    cfg, sd, llm = model
    b = cfg["sparse_attention_config"]["sparse_block_size"]
    for n in (1, b - 1, b, b + 1, 10 * b + 3, 64):
        ids = torch.randint(0, cfg["vocab_size"], (n,), generator=torch.Generator().manual_seed(n)).tolist()
        err = (prompt_logits(llm, ids) - naive_logits(sd, cfg, ids)).abs().max().item()
        assert err < 1e-4, f"prompt {n}: max |logit diff| {err}"


def test_greedy_decode_matches_naive_recompute(model):
    cfg, sd, llm = model
    ids = torch.randint(0, cfg["vocab_size"], (29,), generator=torch.Generator().manual_seed(5)).tolist()
    want, seq = [], list(ids)
    for _ in range(10):
        nxt = int(naive_logits(sd, cfg, seq)[-1].argmax())
        want.append(nxt)
        seq.append(nxt)
    assert llm.generate([ids], {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0})[0]["output_ids"] == want
