"""Every Triton kernel a decode step and its sampling launch builds for a Hopper GPU (sm_90) here, with no GPU: Triton's own compiler
and its bundled ptxas. Triton's interpreter (tests/test_triton_*.py) runs what a GPU's compiler may refuse (a
construct, a dtype mix, a layout). The launches are recorded from configs/tiny decode steps in bfloat16 and float32
through CUDA's forms (their outputs left unwritten), then each distinct one compiled as Triton's launcher specializes
it (its arguments' types and constexprs, which integers and pointers are multiples of 16, integers of 1), in a process
without the interpreter (conftest.py turns it on)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import triton_decode

pytestmark = pytest.mark.skipif(triton_decode.triton is None, reason="Triton is not installed")
ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"_attend_kernel", "_combine_kernel", "_block_kernel", "_scores_kernel", "_rms_kernel",
           "_norm_rope_kernel", "_swiglu_kernel", "_route_kernel", "_experts_up_kernel", "_experts_down_kernel",
           "_race_kernel"}


def test_every_triton_kernel_of_a_decode_step_builds_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    p = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    built = [line.split() for line in p.stdout.splitlines() if line.startswith("built ")]
    assert {name for _, name, *_ in built} == KERNELS and {dtype for _, _, dtype, _ in built} == {"bf16", "fp32"}, built
    # each loop over keys, weights or the vocabulary reads its next tiles (not only their indices) while it computes
    # on this one: the compiler's cp.async pipeline, on its own where the loads feed tl.dot (attention, scores), else
    # by tl.range's num_stages (the largest tile it copies ahead, in elements, is the line's last field)
    assert {name for _, name, _, tile in built if int(tile) < 1024} == {"_combine_kernel", "_rms_kernel",
                                                                        "_norm_rope_kernel", "_swiglu_kernel",
                                                                        "_route_kernel"}, built


def test_serving_builds_no_triton_kernel_that_start_up_did_not(monkeypatch):
    """Nothing is built once /health is 200: Triton builds a kernel for each new key of a launch (its constexprs, its
    arguments' dtypes, and which integers and pointers are multiples of 16, unless told not to look). Every launch of
    extends (within the top-k budget and past it, mixed with a decoding request, at odd offsets) and of decode steps
    (at the one key width CUDA runs) carries a key that `build_kernels` (CUDA's start-up) launched."""
    from engine.kernels import triton_indexer, triton_pointwise
    from engine.model import layers
    from engine.model.loader import load_model
    from engine.runtime.decode_graph import build_kernels
    from tests.engine_utils import TINY
    from tests.forward_utils import PagedModel

    def keys() -> set:
        out = set()
        for kernel, args, constexprs in launches:
            out.add((kernel.__name__, tuple(sorted(constexprs.items())), tuple(_specialized(kernel, args))))
        launches.clear()
        return out

    launches, wide = [], 1024
    for module in (triton_decode, triton_indexer, triton_pointwise):
        for name in KERNELS & set(vars(module)):
            monkeypatch.setattr(module, name, _Recorder(getattr(module, name), launches))
    paged = PagedModel(load_model(TINY, dtype=torch.bfloat16), size=4096, max_requests=4)
    monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: True)  # (CUDA's forms; outputs left unwritten)
    monkeypatch.setattr(layers, "on_kernel", lambda *tensors: False)
    build_kernels(paged.runner.model, paged.pool, wide)
    built = keys()
    kvs = [paged.kv.admit([]) for _ in range(3)]
    paged.step(kvs[:2], [[3] * 3, [2] * 4])  # (queries as decode attention's rows; the next slots at an odd offset)
    paged.step(kvs[:2], [[4] * 299, list(range(5, 42))])
    mixed = [[6], list(range(9, 318)), [7]]  # (a query past the budget among extends; a key table row at an odd offset)
    paged.step([kvs[0], kvs[2], kvs[1]], mixed)
    with torch.no_grad():
        batch = paged.decode_batch(kvs, [8, 9, 10])
        paged.decode_step(dataclasses.replace(batch, key_slots=F.pad(batch.key_slots, (0, wide - 320))))
    new = keys() - built
    assert not new, '\n'.join(map(str, sorted(new, key=str)))


class _Recorder:
    """Stands for a kernel: records each launch's arguments instead of running it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launches.append((self.kernel, args, constexprs))


def _specialized(kernel, args) -> list[tuple]:
    """A launch's positional arguments as Triton's launcher specializes them (`native_specialize_impl`, as jit.py calls
    it): (type, "D" for an integer multiple of 16 or a pointer 16-byte aligned), an integer 1 as ("constexpr", 1), a
    constexpr parameter as its value; `kernel` a JITFunction or the interpreter's function (the decorator's arguments
    in its `kwargs`), do_not_specialize(_on_alignment) naming parameters by name or index."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    flags = getattr(kernel, "kwargs", None) or vars(kernel)
    dns, dnsa = (flags.get(k) or () for k in ("do_not_specialize", "do_not_specialize_on_alignment"))
    return [("constexpr", a) if "constexpr" in str(p.annotation) else native_specialize_impl(
        BaseBackend, a, False, not (i in dns or p.name in dns), not (i in dnsa or p.name in dnsa))
        for i, (p, a) in enumerate(zip(inspect.signature(kernel.fn).parameters.values(), args))]


def _build_every_launch() -> None:
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels import triton_indexer, triton_pointwise
    from engine.model import layers
    from engine.model.loader import load_model
    from engine.runtime import sampler
    from tests.engine_utils import TINY
    from tests.forward_utils import PagedModel

    launches, on_kernel = [], layers.on_kernel
    for module in (triton_decode, triton_indexer, triton_pointwise):
        for name in KERNELS & set(vars(module)):
            setattr(module, name, _Recorder(getattr(module, name), launches))
    for dtype in (torch.bfloat16, torch.float32):
        paged = PagedModel(load_model(TINY, dtype=dtype), size=4 * 400 + 64, max_requests=4)
        kvs = [paged.kv.admit([]) for _ in range(4)]
        prompts = [torch.randint(0, 4000, (300,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
        batch = paged.decode_batch(kvs, [int(x[-1].argmax()) for x in paged.step(kvs, prompts)])
        triton_decode.serves = lambda device, *dims: True  # (CUDA's forms from here: this process ends after)
        layers.on_kernel = lambda *tensors: False  # (the CPU's MoE kernel)
        rows = torch.arange(4)
        with torch.no_grad():  # (and the sampler's race over the step's logits)
            sampler.race(paged.decode_step(batch), sampler.seed_hash(rows), rows, rows > 2, torch.ones(4),
                         sampler.token_hash(4096, torch.device("cpu")))
            paged.step(kvs, [[5, 6]] * 4)  # (an extend: the block kernel given its blocks, not choosing them)
        triton_decode.serves, layers.on_kernel = lambda device, *dims: False, on_kernel
    seen = set()
    for kernel, args, constexprs in launches:
        options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
        signature, attrs, fixed = {}, {}, {}
        for i, (name, (kind, spec)) in enumerate(zip(kernel.arg_names, _specialized(kernel, args))):
            signature[name] = kind
            if kind == "constexpr":  # (an integer 1, or a constexpr parameter)
                fixed[(i,)] = spec
            elif spec:  # (a multiple of 16, or a pointer 16-byte aligned)
                attrs[(i,)] = BaseBackend.parse_attr(spec)
        signature |= dict.fromkeys(constexprs, "constexpr")
        fixed |= {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
        key = (kernel.__name__, tuple(signature.items()), tuple(fixed.items()), str(attrs), tuple(options.items()))
        if key not in seen:
            seen.add(key)
            built = triton.compile(ASTSource(kernel, signature, constexprs=fixed, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32), options=options)
            tiles = re.findall(r"async_copy_global_to_local .*?: tensor<([\dx]+)x!tt\.ptr", built.asm["ttgir"])
            print("built", kernel.__name__, "bf16" if "*bf16" in signature.values() else "fp32",
                  max((math.prod(map(int, t.split("x"))) for t in tiles), default=0), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    _build_every_launch()
