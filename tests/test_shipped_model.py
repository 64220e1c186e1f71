"""configs/tiny's shipped, trained weights: they load as real weights (no dummy warning), give the same
logits as transformers on their score-only copy (the part transformers has: no index-value branch, no
init blocks) and as the naive reference on the weights as shipped, greedy output is deterministic, and
the tokenizer round-trips the corpus it was trained on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from naive_reference import naive_logits
from safetensors.torch import load_file

from bench.hf_copy import write_hf_copy
from bench.models import load_transformers
from engine.model.loader import load_model
from engine.runtime.llm import LLM
from engine.runtime.tokenizer import Tokenizer
from tests.forward_utils import PagedModel
from tests.server_utils import TINY
from training.corpus import read_corpus

SHIPPED = Path(TINY) / "model.safetensors"


@pytest.fixture(scope="module")
def story_ids() -> list[int]:
    """300 tokens of held-out stories: past the top-k budget (4 blocks of 64), so selection matters."""
    tok = Tokenizer.from_dir(TINY)
    ids: list[int] = []
    for row in read_corpus():
        if int(row["id"].split("-")[0]) % 50 == 0:  # the held-out shards (training/train.py)
            ids += tok.encode(row["text"], add_special_tokens=False) + [tok.eos_token_id]
        if len(ids) >= 300:
            return ids[:300]
    raise AssertionError("the corpus has too few held-out tokens")


def test_the_shipped_weights_load_as_real_weights(caplog):
    assert SHIPPED.is_file()
    with caplog.at_level(logging.WARNING):
        load_model(TINY)
    assert "DUMMY" not in caplog.text


def test_transformers_gives_the_same_logits_on_the_score_only_copy(tmp_path, story_ids):
    write_hf_copy(load_model(TINY), tmp_path, Path(TINY))
    ref = load_transformers(tmp_path)(torch.tensor([story_ids])).logits[0].float()
    ours = PagedModel(load_model(tmp_path)).logits(story_ids)
    assert (ours - ref).abs().max().item() < 1e-4
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_the_naive_reference_gives_the_same_logits_on_the_shipped_weights(story_ids):
    sd = {k: v.float() for k, v in load_file(SHIPPED).items()}
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    ids = story_ids[:280]
    err = (PagedModel(load_model(TINY)).logits(ids) - naive_logits(sd, cfg, ids)).abs().max().item()
    assert err < 1e-4, err


def test_greedy_output_is_deterministic_across_runs():
    params = {"max_new_tokens": 40, "temperature": 0}
    outs = [LLM(TINY, disable_cuda_graph=True, max_total_tokens=4096).generate(["Once upon a time"], params)[0]
            for _ in range(2)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"] and len(outs[0]["output_ids"]) > 10
    assert outs[0]["text"] == outs[1]["text"]


def test_the_tokenizer_round_trips_the_corpus():
    tok = Tokenizer.from_dir(TINY)
    rows = list(read_corpus())
    assert len(rows) > 1000
    for row in rows:
        assert tok.decode(tok.encode(row["text"], add_special_tokens=False)) == row["text"], row["id"]
