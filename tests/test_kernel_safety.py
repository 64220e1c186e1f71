"""The C kernels cannot crash the process: a library is keyed on the CPU it was built for, every index the kernels'
ops read is checked in code `python -O` keeps (a clear IndexError or ValueError, never a read out of bounds), and
the kernels are built when the engine is, not in a first request."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import build, build_all, moe_experts, paged_attention
from engine.runtime import setup
from engine.runtime.engine_args import EngineArgs
from tests.engine_utils import TINY
from tests.kernel_utils import needs_compiler

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_description_names_this_cpu():
    facts = build.cpu().split("\0")
    assert facts[:2] == [torch.backends.cpu.get_cpu_capability(), platform.machine()]
    if Path("/proc/cpuinfo").exists() and platform.machine() == "x86_64":
        assert facts[2].startswith("model name") and facts[3].startswith("flags")
        assert " sse2 " in f" {facts[3]} "  # (every x86-64 CPU has SSE2)


@needs_compiler
def test_a_library_built_for_another_cpu_is_not_loaded(monkeypatch, tmp_path):
    """Two CPUs sharing one cache (a mounted volume): each builds and loads its own library, never the other's.
    The first CPU's library is then made unloadable here, as its instructions could be on the second CPU."""
    source = tmp_path / "answer.c"
    source.write_text("long answer(void) { return 42; }\n")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "cpu", lambda: "AVX512\0x86_64\0model name: AMD EPYC 9654\0flags: avx2 avx512f")
    first = build.library(source)
    assert build.load(source).answer() == 42 and first.exists()
    first.unlink()  # (a new file: writing over the loaded one, still mapped, crashed this process at exit: SIGBUS)
    first.write_bytes(b"not a library for this CPU")
    monkeypatch.setattr(build, "cpu", lambda: "AVX2\0x86_64\0model name: Intel Xeon E5-2680 v4\0flags: avx2")
    second = build.library(source)
    assert second != first and build.load(source).answer() == 42 and second.exists()
    assert first.read_bytes() == b"not a library for this CPU"  # (neither loaded nor rebuilt)


# Each op's bad arguments, run under `python -O` (no asserts): what each raises, or "ok" and the value checked.
BAD_ARGUMENTS = r'''
import sys
import torch
from engine.kernels import moe_experts, paged_attention
from engine.kernels.paged_attention import gather_sdpa

assert sys.flags.optimize and paged_attention.kernel() is not None and moe_experts.kernel() is not None
ops, g = torch.ops.minimax, torch.Generator().manual_seed(0)
q, k, v = torch.randn(2, 2, 4, 32, generator=g), torch.randn(100, 2, 32, generator=g), torch.randn(100, 2, 32, generator=g)
rows, keep = torch.randint(0, 200, (2, 2, 10), generator=g), torch.ones(2, 1, 1, 10, dtype=torch.bool)
slots, q_pos, blocks = torch.arange(120).expand(2, -1) % 100, torch.tensor([119, 60]), torch.tensor([[[0, 2]] * 2, [[1, 0]] * 2])
x, w13, w2 = torch.randn(4, 256, generator=g), torch.randn(8, 512, 256, generator=g), torch.randn(8, 256, 256, generator=g)
ids, w = torch.tensor([[0, 7], [3, 4], [7, 6], [1, 2]]), torch.rand(4, 2, generator=g)


def attention(rows=rows, keep=keep):
    return ops.paged_attention(q, k, v, rows, keep, 0.2)


def blockwise(slots=slots, blocks=blocks, q_pos=q_pos, block_size=50):
    return ops.paged_block_attention(q, k, v, slots, blocks, q_pos, block_size, 0.2)


def moe(ids=ids, w2=w2):
    return ops.moe_experts(x, ids, w, w13, w2, 1.7, 7.0)


def put(t, index, value):
    t = t.clone()
    t[index] = value
    return t


cases = {
    "row past the buffers": lambda: attention(put(rows, (1, 1, 5), 200)),
    "negative row": lambda: attention(put(rows, (0, 0, 0), -1)),
    "row past the buffers, not kept": lambda: attention(put(rows, (1, 1, 5), 10**12), put(keep, (..., 5), False)),
    "rows int32": lambda: attention(rows.int()),
    "keep of another length": lambda: attention(keep=keep[..., :9]),
    "q_pos past the keys": lambda: blockwise(q_pos=put(q_pos, 1, 120)),
    "negative q_pos": lambda: blockwise(q_pos=put(q_pos, 0, -1)),
    "slot past the buffers": lambda: blockwise(put(slots, (0, 10), 100)),
    "negative slot": lambda: blockwise(put(slots, (1, 60), -5)),
    "block size 0": lambda: blockwise(block_size=0),
    "blocks int32": lambda: blockwise(blocks=blocks.int()),
    "expert id E": lambda: moe(put(ids, (2, 1), 8)),
    "expert id -1": lambda: moe(put(ids, (0, 0), -1)),
    "ids int32": lambda: moe(ids.int()),
    "w2 of another shape": lambda: moe(w2=w2[:, :, :128]),
}
for name, call in cases.items():
    try:
        call()
        print(f"{name}: ok")
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}")
# after all of them, valid calls still compute the right numbers (a block id past the keys reads nothing)
want = torch.zeros(4, 256, dtype=torch.float64)  # (the routed experts written out, float64)
for t, s in ((t, s) for t in range(4) for s in range(2)):
    gate, up = (w13[ids[t, s]].double() @ x[t].double()).chunk(2)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    want[t] += w[t, s] * (w2[ids[t, s]].double() @ ((up + 1) * gate * torch.sigmoid(1.7 * gate)))
print("valid calls:", torch.allclose(attention(), gather_sdpa(q, k, v, rows, keep, 0.2), atol=1e-5),
      torch.allclose(blockwise(blocks=put(blocks, (0, 0, 1), 2**62)), blockwise(blocks=put(blocks, (0, 0, 1), -1))),
      torch.allclose(moe().double(), want, rtol=1e-4, atol=1e-3))
'''

ROWS = "IndexError: paged_attention: a key's row is outside the k/v buffers' rows [0, 200)"
Q_POS = "IndexError: paged_block_attention: a q_pos is outside the key range [0, 120)"
SLOT = "IndexError: paged_block_attention: a key slot read is outside the k/v buffers' slots [0, 100)"
EXPERT = "IndexError: moe_experts: an expert id outside [0, 8)"
ATTENTION = "ValueError: paged_attention: q [B, H, G, D] and k_buf, v_buf [..., D] float32, rows int64 [B, H, N]"
BLOCKS = "ValueError: paged_block_attention: q [B, H, G, D] and k_buf, v_buf [..., D] float32, key_slots int64"
MOE = "ValueError: moe_experts: x [T, H], ids int64 and w [T, k >= 1], w13 [E, 2I, H], w2 [E, H, I], float32"
EXPECTED = {  # (what the line starts with, and what the error names of the arguments given)
    "row past the buffers": (ROWS, ""), "negative row": (ROWS, ""), "row past the buffers, not kept": (ROWS, ""),
    "rows int32": (ATTENTION, "torch.int32 (2, 2, 10)"), "keep of another length": (ATTENTION, "torch.bool (2, 1, 1, 9)"),
    "q_pos past the keys": (Q_POS, ""), "negative q_pos": (Q_POS, ""),
    "slot past the buffers": (SLOT, ""), "negative slot": (SLOT, ""),
    "block size 0": (BLOCKS, "torch.int64 (2,), 0"), "blocks int32": (BLOCKS, "torch.int32 (2, 2, 2)"),
    "expert id E": (EXPERT, ""), "expert id -1": (EXPERT, ""),
    "ids int32": (MOE, "torch.int32 (4, 2)"), "w2 of another shape": (MOE, "torch.float32 (8, 256, 128)"),
    "valid calls": ("True True True", ""),
}


@needs_compiler
def test_bad_indices_shapes_and_dtypes_raise_clear_errors_under_python_O():
    """Out-of-range expert ids, rows, slots and query positions, and arguments of the wrong dtype or shape, given to
    each op (torch.ops.minimax.*) in a `python -O` process: each a clear error, the process alive after them all."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}  # (two threads: the C loops' status)
    done = subprocess.run([sys.executable, "-O", "-c", BAD_ARGUMENTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert got.keys() == EXPECTED.keys(), done.stdout
    for name, (start, names) in EXPECTED.items():
        assert got[name].startswith(start) and names in got[name], (name, got[name])


def test_build_all_builds_every_kernel_and_the_engine_calls_it_first(monkeypatch):
    """build_all loads (or builds) the MoE and attention kernels; build_components calls it before the model."""
    for module in (moe_experts, paged_attention):
        monkeypatch.setattr(module, "kernel", functools.cache(module.kernel.__wrapped__))
    build_all()
    assert moe_experts.kernel.cache_info().currsize == paged_attention.kernel.cache_info().currsize == 1

    def stop(*args: object) -> None:
        raise InterruptedError  # (the test ends there)

    calls: list[str] = []
    monkeypatch.setattr(setup, "build_all", lambda: calls.append("build_all"))
    monkeypatch.setattr(setup, "load_config", stop)
    with pytest.raises(InterruptedError):
        setup.build_components(EngineArgs(model_path=TINY, device="cpu"))
    assert calls == ["build_all"]
