"""A decode step's cost does not depend on what it should not: the MoE's FLOPs are those of the chosen experts
(not every expert's), the operations an engine step dispatches do not grow with its rows, sampling included
(counted with a TorchDispatchMode, eager, steady state), a steady step crosses to the host once, and the model's
step stays within its budget of kernels (what a captured CUDA graph replays)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_utils import TINY, make_engine, submit
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from engine.kernels import triton_decode, triton_indexer, triton_pointwise
from engine.model.layers import MoE
from engine.model.loader import load_model
from engine.runtime.request import LogprobOptions
from engine.runtime.scheduler import Scheduler
from tests.forward_utils import PagedModel


@register_flop_formula(torch.ops.aten._grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """x [M, K] rows, each times one [K, N] matrix of its group: 2 M K N (torch counts no formula for it)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


@register_flop_formula(torch.ops.aten.addmm_)
def _addmm_flops(c_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """The shared expert's down projection, into the routed output (torch counts addmm, not addmm_): 2 M K N."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory) -> Path:
    """configs/tiny's shape with 128 experts, top-4, three layers (one of each kind)."""
    path = tmp_path_factory.mktemp("e128")
    shutil.copy(Path(TINY) / "tokenizer.json", path)
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    cfg.update(num_hidden_layers=3, moe_layer_freq=[1, 1, 1], num_local_experts=128, num_experts_per_tok=4,
               intermediate_size=64)
    cfg["sparse_attention_config"].update(sparse_attention_freq=[0, 1, 1], sparse_disable_index_value=[0, 0, 1])
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_moe_flops_in_a_decode_step_are_the_chosen_experts(many_experts, rows):
    """bfloat16 (the CUDA dtype: the grouped form, not the CPU float32 kernel, whose FLOPs are not counted)."""
    p = PagedModel(load_model(many_experts, torch.bfloat16), size=32768, max_requests=64)
    kvs = [p.kv.admit([]) for _ in range(rows)]
    p.step(kvs, [[5 + i] * (300 + i) for i in range(rows)])  # (past the top-k budget: selection runs)
    batch = p.decode_batch(kvs, [7] * rows)
    moes = [m for m in p.runner.model.modules() if isinstance(m, MoE)]
    with FlopCounterMode(display=False) as fc:
        p.decode_step(batch)
    counts = fc.get_flop_counts()
    cfg = p.runner.model.cfg
    h, i, k = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts_per_tok
    active = rows * k * (2 * h * 2 * i + 2 * i * h)  # each token's k experts: gate|up, then down
    shared = rows * (2 * h * 2 * cfg.shared_intermediate_size + 2 * cfg.shared_intermediate_size * h)
    for layer in range(len(moes)):
        total = sum(counts[f"MiniMaxM3Model.layers.{layer}.mlp"].values())
        routed = total - shared - 2 * rows * h * cfg.num_experts  # (less the shared expert and the router)
        assert active <= routed <= 1.25 * active, (layer, routed / active)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(rows: int, temperature: float) -> int:
    engine = make_engine(max_running_requests=64)
    for r in range(rows):
        submit(engine, [10 + r] * 40, max_new_tokens=12, temperature=temperature, top_p=0.9, ignore_eos=True)
    for _ in range(4):  # prefill, then steady decode
        engine.step()
    assert engine.stats().num_running == rows and engine.stats().num_waiting == 0
    with _Ops() as ops:
        engine.step()
    return ops.n


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ops_per_decode_step_do_not_grow_with_rows(temperature):
    """The same count at 2 and 32 rows (a batch of 1 may take a few ops fewer: no row to pick)."""
    few, many = _ops_per_step(2, temperature), _ops_per_step(32, temperature)
    assert many == few, (few, many)


# Views and allocations launch nothing (nor does `contiguous` of a contiguous tensor; one that copies dispatches a clone)
NO_KERNEL = {"view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "t", "unsqueeze", "squeeze",
             "permute", "as_strided", "alias", "split", "split_with_sizes", "detach", "unbind", "unflatten", "flatten",
             "empty", "empty_like", "empty_strided", "new_empty", "contiguous"}
KERNEL_BUDGET = 115  # configs/tiny: 107 with Triton's pointwise (the residual add in the next norm; K and V written
#                      by the norm+RoPE kernel; the rotations a gather; the shared expert a pair; the router's input
#                      written in fp32 by the norm), MoE and block kernels (the selection in the block kernel) too (559
#                      with its decode kernels alone, 670 gathering, 1,169 before them; 2026-12-05)


class _Kernels(TorchDispatchMode):
    """The kernels a CUDA graph of the dispatched ops would replay: aten ops but views and allocations, the CPU's
    decomposition of `F.rms_norm` (pow, mean, add_, rsqrt, mul) as the one fused kernel it is on CUDA, and the
    minimax ops through the path they take on CUDA (gather and SDPA), counted inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "minimax":  # (its body, run under this mode again: on CPU in bf16 it takes CUDA's path)
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd),
                                       *args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ops += [] if name in NO_KERNEL else [name]
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        return len(self.ops) - 4 * " ".join(self.ops).count("pow mean add_ rsqrt mul")


class _Launch:
    """A Triton kernel's launch (`kernel[grid](...)`), counted as the one kernel it is (its outputs left unwritten)."""

    def __init__(self, ops: list[str], name: str) -> None:
        self.ops, self.name = ops, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.ops.append(self.name)


LAUNCHES = ("_attend_kernel", "_combine_kernel", "_scores_kernel", "_block_kernel", "_rms_kernel", "_norm_rope_kernel",
            "_swiglu_kernel", "_route_kernel", "_experts_up_kernel", "_experts_down_kernel")


def _step_kernels(model_path, rows: int, monkeypatch) -> _Kernels:
    """The kernels of an eager bfloat16 decode step of `rows` rows of 300 tokens (past the top-k budget: block
    selection runs) through CUDA's forms: Triton's kernels (triton_decode, triton_pointwise), each launch one kernel."""
    model = load_model(model_path, dtype=torch.bfloat16, load_format="dummy")
    paged = PagedModel(model, size=rows * 400 + 64, max_requests=rows)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (300,), generator=g).tolist() for _ in range(rows)]
    kvs = [paged.kv.admit([]) for _ in prompts]
    batch = paged.decode_batch(kvs, [int(x[-1].argmax()) for x in paged.step(kvs, prompts)])
    k = _Kernels()
    monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: True)
    for name in LAUNCHES:
        module = next(m for m in (triton_decode, triton_indexer, triton_pointwise) if hasattr(m, name))
        monkeypatch.setattr(module, name, _Launch(k.ops, name))
    with torch.no_grad(), k:
        paged.decode_step(batch)
    return k


def test_a_bfloat16_decode_step_keeps_its_kernel_budget(monkeypatch):
    """configs/tiny's step of 4 rows launches at most KERNEL_BUDGET kernels (`_Kernels`: what a captured CUDA graph
    replays, ~2 us each on an H200 at small batches). A change that adds kernels to every layer or step fails here;
    lower the budget as they drop."""
    k = _step_kernels(TINY, 4, monkeypatch)
    launches = {"_attend_kernel": 2 + 3, "_combine_kernel": 2 + 3, "_scores_kernel": 6, "_block_kernel": 6,  # (dense and
                "_rms_kernel": 17, "_norm_rope_kernel": 14, "_swiglu_kernel": 2, "_route_kernel": 6,  # index-value)
                "_experts_up_kernel": 6, "_experts_down_kernel": 6}
    assert {name: k.ops.count(name) for name in launches} == launches  # (block selection ran: its kernel)
    assert k.kernels() <= KERNEL_BUDGET, (k.kernels(), Counter(k.ops).most_common(12))


def test_the_mid_size_models_batch_one_step_keeps_its_kernel_budget(tmp_path, monkeypatch):
    """bench/gpu.py's mid-size model (12 layers: 2 dense, 5 sparse with the index-value branch, 5 score-only; 64
    experts, top-4), at configs/tiny's widths (the kernels do not depend on them): its batch-1 step, whose time
    against its weights' read time is the roofline target (~2 us a replayed kernel: 162 of them, ~0.32 ms, where
    30% of its roofline is 0.53 ms a token), 244 kernels on 2026-12-05 before the last fusions."""
    from bench.gpu import MID, MID_SPARSE
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    cfg.update({k: v for k, v in MID.items() if k in ("num_hidden_layers", "num_local_experts", "num_experts_per_tok",
                                                      "moe_layer_freq")})
    cfg["sparse_attention_config"].update({k: v for k, v in MID_SPARSE.items() if "freq" in k or "disable" in k})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    k = _step_kernels(tmp_path, 1, monkeypatch)
    assert k.ops.count("_block_kernel") == 10 and k.kernels() <= 170, (k.kernels(), Counter(k.ops).most_common(12))


EXTRAS = {"penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5},
          "bias": {"logit_bias": {"5": 2.0, "7": -1.0}, "min_new_tokens": 10}}  # (stop ids suppressed: min_new_tokens)
LOGPROBS = LogprobOptions(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[5, 9])


@pytest.mark.parametrize(("temperature", "extra"), [(0.0, None), (0.8, None), (0.8, "penalties"), (0.8, "bias"),
                                                    (0.8, "logprobs")])
def test_a_steady_decode_step_crosses_to_the_host_once(monkeypatch, temperature, extra):
    """Tensors built from host data (`torch.tensor`), `.tolist()`, `.item()` and `.cpu()` during steady decode steps
    (the same requests as the step before; half of them with penalties, whose token counts stay on the device, or
    with a logit_bias and under min_new_tokens, whose tensors are kept, or asking for output logprobs, which come
    back with the ids): only the sampled ids' `.tolist()` (a dispatch mode does not see it)."""
    engine = make_engine(max_running_requests=64)
    for r in range(8):
        submit(engine, [10 + r] * 40, LOGPROBS if extra == "logprobs" and r % 2 else None, max_new_tokens=12,
               temperature=temperature, top_p=0.9, ignore_eos=not (extra == "bias" and r % 2),
               **(EXTRAS[extra] if extra in EXTRAS and r % 2 else {}))
    for _ in range(3):  # a prefill, then decode steps
        engine.step()
    crossings: list[str] = []

    def counted(name: str, real):
        return lambda *a, **k: crossings.append(name) or real(*a, **k)

    monkeypatch.setattr(torch, "tensor", counted("torch.tensor", torch.tensor))
    for name in ("tolist", "item", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    for _ in range(4):
        crossings.clear()
        assert engine.step() and engine.stats().num_running == 8
        assert crossings == ["tolist"], crossings


def test_carried_decode_inputs_give_the_tokens_built_ones_give(monkeypatch):
    """Requests joining, finishing and sampling at different temperatures mid-run: the same tokens with the
    decode inputs carried on the device from step to step as with every step's built from Python lists."""
    def run() -> dict[str, list[int]]:
        engine = make_engine(max_running_requests=64, max_total_tokens=4096)
        out: dict[str, list[int]] = {}
        for wave in range(3):
            for r in range(4):
                submit(engine, [10 + r + wave] * (30 + 7 * r), max_new_tokens=5 + 3 * r + wave,
                       temperature=0.8 * (r % 2), sampling_seed=100 * wave + r, ignore_eos=True)
            for _ in range(6):
                for o in engine.step():
                    out.setdefault(o.rid, []).extend(o.new_ids)
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.rid, []).extend(o.new_ids)
        return {rid: ids for rid, ids in out.items()}  # (rids are random: compare the values in order)

    carried = run()
    decode = Scheduler._decode_batch

    def never_steady(self):  # (no decode step follows a decode step it knows of: every input built again)
        self._decoded = None
        return decode(self)

    monkeypatch.setattr(Scheduler, "_decode_batch", never_steady)
    built = run()
    assert sorted(map(tuple, carried.values())) == sorted(map(tuple, built.values())) and len(carried) == 12
