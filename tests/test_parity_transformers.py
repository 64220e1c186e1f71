"""Parity with transformers 5.24.0's MiniMax-M3 (the independent reference): logits at every prompt
position and greedy tokens, for random tiny configurations saved with save_pretrained."""

from __future__ import annotations

import pytest
import torch
from hf_models import HF_CONFIGS, build_hf_model, to_original_layout

from engine.model.loader import load_model
from engine.runtime.llm import LLM
from tests.forward_utils import PagedModel


class Ours:
    """The engine (generate) and the same checkpoint stepped by hand (logits at every position)."""

    def __init__(self, path) -> None:
        self.llm = LLM(path, max_total_tokens=2048, max_running_requests=8, skip_tokenizer_init=True, disable_cuda_graph=True)
        self.cfg = self.llm.cfg
        self.paged = PagedModel(load_model(path))

    def generate(self, *a, **kw):
        return self.llm.generate(*a, **kw)


def prompt_logits(ours: Ours, ids: list[int]) -> torch.Tensor:
    """Our logits at every position of one prompt, through the pools."""
    return ours.paged.logits(ids)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    hf = build_hf_model(request.param, d)
    return request.param, d, hf, Ours(d)


def lengths(block: int) -> list[int]:
    return sorted({1, block - 1, block, block + 1, 10 * block + 3} - {0})


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_and_greedy_match_transformers(pair):
    name, _, hf, llm = pair
    block = hf.config.index_block_size
    for n in lengths(block):
        ids = random_ids(n, n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        ours = prompt_logits(llm, ids)
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < 1e-4, f"{name} prompt {n}: max |logit diff| {err}"
        want = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, n:].tolist()
        got = llm.generate([ids], {"max_new_tokens": 32, "ignore_eos": True, "temperature": 0})[0]["output_ids"]
        assert got == want, f"{name} prompt {n}: greedy tokens differ from transformers generate"


def test_batch_gives_each_prompt_its_solo_tokens(pair):
    _, _, hf, llm = pair
    prompts = [random_ids(n, 100 + n) for n in (1, 5, hf.config.index_block_size * 3 + 1, 37, 2)]
    params = {"max_new_tokens": 12, "ignore_eos": True, "temperature": 0}
    solo = [llm.generate([p], params)[0]["output_ids"] for p in prompts]
    batch = [o["output_ids"] for o in llm.generate(prompts, params)]
    assert batch == solo
    assert llm.llm.engine.check_integrity()
    st = llm.llm.engine.stats()
    assert st.free_tokens + st.cached_tokens == 2048 and st.num_running == 0  # every slot came back


def test_original_layout_gives_identical_logits(pair, tmp_path):
    name, native_dir, _, llm = pair
    to_original_layout(native_dir, tmp_path)
    orig = Ours(tmp_path)
    assert orig.cfg.shape == "minimax" and llm.cfg.shape == "transformers"
    assert orig.cfg.layer_kinds == llm.cfg.layer_kinds and orig.cfg.rotary_dim == llm.cfg.rotary_dim
    ids = random_ids(50, 7)
    assert torch.equal(prompt_logits(orig, ids), prompt_logits(llm, ids)), name
