"""bench/small_batch.py's other forms of the batch-dynamic CPU graph's weight products (the candidates it measures on
any CPU) give the products' numbers, and take the products they are meant to: an A/B against a form that computed
something else, or left the products as they were, would measure nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from bench.small_batch import ManyRowForms


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("form", ["rewritten", "onednn"])
def test_small_batch_forms_keep_the_numbers(form, bias):
    if form == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g) if bias else None

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(torch.relu(x), w, b)  # (the weight an argument, as the decode graphs take theirs)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, options={"post_grad_custom_post_pass": ManyRowForms(form)})
    for rows in (3, 5):  # (one graph, its row count symbolic)
        x = torch.randn(rows, 64, generator=g)
        with torch.no_grad():
            got, code = run_and_get_code(compiled, x, w, b)
        torch.testing.assert_close(got, f(x, w, b), rtol=1e-5, atol=1e-4)
    assert "extern_kernels.mm" not in code[0] and "extern_kernels.addmm" not in code[0]
    assert ("small_batch.packed_linear" in code[0]) is (form == "onednn")


def test_the_mkl_path_a_figure_was_measured_on_is_read_as_mkl_reads_it(tmp_path):
    """bench.machine.mkl_intel_path() (recorded beside the CPU figures) asks MKL's own vendor check; a check preloaded
    over it (the README's measurement stub) is what MKL then calls, and what it must report."""
    import os
    import subprocess
    import sys

    from bench.machine import mkl_intel_path

    if mkl_intel_path() is None:
        pytest.skip("this torch has no MKL")
    stub = tmp_path / "stub.so"
    (tmp_path / "stub.c").write_text("int mkl_serv_intel_cpu_true(void) { return 1; }\n")
    subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-fPIC", "-o", stub, tmp_path / "stub.c"], check=True)
    ask = [sys.executable, "-c", "from bench.machine import mkl_intel_path; print(mkl_intel_path())"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    told = subprocess.run(ask, env=os.environ | {"LD_PRELOAD": str(stub)}, cwd=root, capture_output=True, text=True)
    assert told.stdout.strip() == "True", told.stderr
