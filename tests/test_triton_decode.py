"""Triton's decode kernels (engine/kernels/triton_decode.py), compiled on a GPU (`make bench-gpu` runs this file) and
run by Triton's interpreter elsewhere (TRITON_INTERPRET=1, set in conftest.py where there is no CUDA): against the
forms over the whole key table (on CPU the C kernel; the gathered index keys), with rows of one key up to many
splits of tiles; a whole decode step of configs/tiny through them against the step through those forms, past the
top-k budget, at two key-table widths; and a kernel that raises, after which the other forms serve."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_utils import TINY

from engine.kernels import triton_decode, triton_indexer, triton_pointwise
from engine.model import attention
from engine.model.loader import load_model
from tests.forward_utils import PagedModel

pytestmark = [pytest.mark.usefixtures("no_failed_launch"),
              pytest.mark.skipif(triton_decode.triton is None, reason="Triton is not installed")]
triton = triton_decode.triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 63, 64, 65, 700, 1024, 1536]  # (one key; a tile's edges; parts of 64 keys and of more; the whole table)


def _case(dtype: torch.dtype, heads: int, group: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots, width = 4000, 1536
    q = torch.randn(len(LENGTHS), heads, group, dim, generator=g).to(dtype)
    k, v = (torch.randn(slots, heads, dim, generator=g).to(dtype) for _ in range(2))
    key_slots = torch.randint(0, slots, (len(LENGTHS), width), generator=g)
    return (x.to(DEVICE) for x in (q, k, v, key_slots, torch.tensor(LENGTHS)))


@pytest.mark.parametrize("heads,group,dim", [(2, 4, 32), (1, 2, 32), (4, 1, 32), (2, 24, 64), (4, 8, 128)])  # (24 > 16)
@pytest.mark.parametrize("programs", [1, 64, 10**4])  # (a part a row and head; some; 64, the most)
def test_attention_kernel_equals_the_whole_table_form(heads, group, dim, programs, monkeypatch):
    monkeypatch.setattr(triton_decode, "_programs", lambda device: programs)
    q, k, v, key_slots, lengths = _case(torch.float32, heads, group, dim)
    got = triton_decode._attention(q, k, v, key_slots, lengths, dim ** -0.5)
    want = triton_decode._listed(q, k, v, key_slots, lengths, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def _blocks(q_pos: torch.Tensor, heads: int, topk: int, block_size: int, g: torch.Generator) -> torch.Tensor:
    """Each (row, head): up to topk distinct blocks up to the query's own (one past it where there is room: no key of
    it may count), -1 in the slots left."""
    out = torch.full((len(q_pos), heads, topk), -1)
    for r, p in enumerate(q_pos.tolist()):
        for h in range(heads):
            picks = torch.randperm(p // block_size + 2, generator=g)[:topk]
            out[r, h, :len(picks)] = picks
    return out


@pytest.mark.parametrize("heads,group,dim", [(2, 4, 32), (4, 8, 128)])
@pytest.mark.parametrize("shared", [False, True])  # (decode rows; an extend chunk's queries over one sequence's keys)
def test_block_attention_kernel_equals_the_c_kernel(heads, group, dim, shared):
    q, k, v, key_slots, lengths = _case(torch.float32, heads, group, dim)
    g = torch.Generator().manual_seed(3)
    q_pos = lengths - 1
    if shared:  # (queries at positions 700..706 of one sequence: its key slots, one row read by every query)
        key_slots, q_pos = key_slots[:1].expand(len(q), -1), torch.arange(700, 700 + len(q), device=q.device)
    blocks = _blocks(q_pos.cpu(), heads, 4, 64, g).to(q.device)
    got = triton_decode._block_attention(q, k, v, key_slots, blocks, q_pos, 64, dim ** -0.5)
    want = triton_decode.paged_block_attention(q, k, v, key_slots, blocks, q_pos, 64, dim ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.fixture
def bf16_dots(monkeypatch):
    """Triton's interpreter multiplies a bf16 dot's raw bits (numpy has no bf16: it keeps them as uint16); here they
    are widened to float32 first, as a GPU's bf16 dot multiplies exactly and sums in float32."""
    if DEVICE == "cpu":
        from triton.runtime import interpreter

        real = interpreter.InterpreterBuilder.create_dot

        def wide(x):
            return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), triton.language.float32) \
                if x.dtype == triton.language.bfloat16 else x

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                            lambda self, a, b, *rest: real(self, wide(a), wide(b), *rest))


@pytest.mark.parametrize("heads,group,dim", [(2, 4, 32), (4, 8, 128)])
def test_bf16_kernels_are_within_bf16_rounding(heads, group, dim, bf16_dots):
    q, k, v, key_slots, lengths = (x.bfloat16() if x.is_floating_point() else x for x in _case(torch.float32, heads,
                                                                                                group, dim))
    exact = triton_decode._listed(q.float(), k.float(), v.float(), key_slots, lengths, dim ** -0.5)
    torch.testing.assert_close(triton_decode._attention(q, k, v, key_slots, lengths, dim ** -0.5).float(), exact,
                               atol=1e-2, rtol=1e-2)
    q_pos, g = lengths - 1, torch.Generator().manual_seed(3)
    blocks = _blocks(q_pos.cpu(), heads, 4, 64, g).to(q.device)
    torch.testing.assert_close(triton_decode._block_attention(q, k, v, key_slots, blocks, q_pos, 64, dim ** -0.5).float(),
                               triton_decode._block_attention(q.float(), k.float(), v.float(), key_slots, blocks, q_pos, 64,
                                                     dim ** -0.5), atol=1e-2, rtol=1e-2)
    iq, ik = q[:, 0, :2], k[:, :1].contiguous()  # (bf16 products are exact in float32: as the float32 form's)
    torch.testing.assert_close(triton_indexer._scores(iq, ik, key_slots, lengths, 64),
                               triton_indexer._gathered_scores(iq.float(), ik.float(), key_slots, lengths, 64),
                               atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("block_size", [64, 16])
@pytest.mark.parametrize("programs", [1, 64, 10**4])  # (a row's blocks all in one program; some; a program a block)
def test_block_score_kernel_equals_the_gathered_form(block_size, programs, monkeypatch):
    monkeypatch.setattr(triton_indexer, "_programs", lambda device: programs)
    q, k, _, key_slots, lengths = _case(torch.float32, 1, 2, 32)
    iq, ik = q[:, 0], k
    got = triton_indexer._scores(iq, ik, key_slots, lengths, block_size)
    want = triton_indexer._gathered_scores(iq, ik, key_slots, lengths, block_size)
    assert got.shape == want.shape == (len(LENGTHS), 2, 1536 // block_size)
    past = want.isneginf()
    assert torch.equal(got.isneginf(), past) and past[0, :, 1:].all() and not past[-1].any()
    torch.testing.assert_close(got[~past], want[~past], atol=1e-5, rtol=1e-5)


def test_a_decode_step_through_the_kernels_equals_the_cpu_step(monkeypatch):
    """configs/tiny, 3 rows of 300-700 tokens (past the top-k budget: selection runs): the step's logits through the
    kernels equal those through the other forms, and stay the same with the key table 3x wider."""
    monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: False)
    paged = PagedModel(load_model(TINY, device=DEVICE), size=2600, max_requests=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (300, 700, 450)]
    kvs = [paged.kv.admit([]) for _ in prompts]
    batch = paged.decode_batch(kvs, [int(x[-1].argmax()) for x in paged.step(kvs, prompts)])
    want = paged.decode_step(batch)
    monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: True)
    assert batch.key_slots.shape[1] < 800
    wide = dataclasses.replace(batch, key_slots=F.pad(batch.key_slots, (0, 2 * batch.key_slots.shape[1])))
    for b in (batch, wide):
        torch.testing.assert_close(paged.decode_step(b), want, atol=1e-4, rtol=1e-4)


def test_an_extend_through_the_block_kernel_equals_the_cpu_extend(monkeypatch):
    """configs/tiny: a 24-token extend after a 250-token one (past the top-k budget: its queries run the block-sparse
    chunk, each over its selected blocks of the sequence's keys, one key row read by every query): the same logits
    through the kernel as through the C kernel."""
    prompt = torch.randint(0, 4000, (274,), generator=torch.Generator().manual_seed(2)).tolist()
    model, logits = load_model(TINY, device=DEVICE), []
    for kernel in (False, True):
        monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: False)
        paged = PagedModel(model, size=1024, max_requests=2)
        kvs = [paged.kv.admit([])]
        paged.step(kvs, [prompt[:250]])
        monkeypatch.setattr(triton_decode, "serves", lambda device, *dims, on=kernel: on)
        logits.append(paged.step(kvs, [prompt[250:]])[0])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_a_kernel_that_raises_leaves_the_other_forms_serving(monkeypatch, caplog):
    monkeypatch.setattr(triton_decode, "_failed", [])
    monkeypatch.setattr(triton_decode, "_attend_kernel", {})  # (its launch raises: a KeyError)
    q, k, v, key_slots, lengths = _case(torch.float32, 2, 4, 32)
    got = torch.ops.minimax.triton_attention(q, k, v, key_slots, lengths, 0.2)
    torch.testing.assert_close(got, triton_decode._listed(q, k, v, key_slots, lengths, 0.2))
    assert "Triton's _attention failed" in caplog.text and not triton_decode.serves(torch.device("cuda"), 32)


class _RaisesWithTheAdd:
    """The norm kernel, whose launches with the residual add (ADD) raise: layer 0's norm runs, layer 1's fails."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        def launch(*args, ADD, **constexprs):
            if ADD:
                raise RuntimeError("a launch that fails")
            return self.kernel[grid](*args, ADD=ADD, **constexprs)
        return launch


@pytest.mark.parametrize("failing", ["rms_norm", "add_rms_norm"])
def test_a_step_whose_first_launch_raises_ends_on_the_other_forms(monkeypatch, caplog, failing):
    """Layer 0's norm raises (or layer 1's, with the residual add), after the step left its block selection to the
    kernel (no masks made): the step ends on the PyTorch forms, selection included, with the same logits."""
    paged = PagedModel(load_model(TINY, device=DEVICE), size=1600, max_requests=2)
    prompts = [torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 700)]
    kvs = [paged.kv.admit([]) for _ in prompts]
    batch = paged.decode_batch(kvs, [int(x[-1].argmax()) for x in paged.step(kvs, prompts)])
    want = paged.decode_step(batch)
    monkeypatch.setattr(triton_decode, "_failed", [])
    monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: not triton_decode._failed)
    failing_kernel = {} if failing == "rms_norm" else _RaisesWithTheAdd(triton_pointwise._rms_kernel)
    monkeypatch.setattr(triton_pointwise, "_rms_kernel", failing_kernel)
    torch.testing.assert_close(paged.decode_step(batch), want, atol=1e-4, rtol=1e-4)  # ({}: its launch raises)
    assert f"Triton's {failing} failed" in caplog.text and len(triton_decode._failed) == 1


def test_an_extend_as_rows_of_decode_attention_equals_the_cpu_extend(monkeypatch):
    """configs/tiny: requests within the top-k budget extend together, one after a cached prefix of its own (so a
    query's keys run past the step's), every query a row of decode attention's kernel (its request's key slots, its
    position + 1 keys), index-value layers too: the logits of the other forms (SDPA a request)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (40, 7, 90)]
    model, logits, rows = load_model(TINY, device=DEVICE), [], []
    attend = attention.decode_attention
    monkeypatch.setattr(attention, "decode_attention", lambda q, *args: rows.append(q.shape[0]) or attend(q, *args))
    for kernel in (False, True):
        monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: False)
        paged = PagedModel(model, size=1024, max_requests=3)
        kvs = [paged.kv.admit([]) for _ in prompts]
        paged.step(kvs[:1], [prompts[0][:30]])
        monkeypatch.setattr(triton_decode, "serves", lambda device, *dims, on=kernel: on)
        logits.append(torch.cat(paged.step(kvs, [prompts[0][30:]] + prompts[1:])))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    kinds = model.cfg.layer_kinds  # (each attention call once, all 107 queries as rows)
    assert rows == [107] * (len(kinds) + kinds.count("sparse_index_kv"))
