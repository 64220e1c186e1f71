"""The one rule for a machine without a C compiler, for the kernel tests: a test that needs a built kernel skips
there (`needs_compiler`), and `without_compiler` makes one for a test (the kernels then warn and their ops' PyTorch
forms run). With a compiler at hand a kernel that fails to build fails its tests."""

from __future__ import annotations

import functools
import os
import shutil

import pytest

from engine.kernels import moe_experts, paged_attention

needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None,
                                    reason="no C compiler ($CC, or gcc) here: the C kernels cannot be built")


def without_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike) -> None:
    """No compiler for the rest of a test: $CC names no program, the kernel cache is empty, and each kernel is
    looked up afresh (monkeypatch puts the built ones back after the test)."""
    monkeypatch.setenv("CC", os.path.join(tmp_path, "no-such-compiler"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for module in (moe_experts, paged_attention):
        monkeypatch.setattr(module, "kernel", functools.cache(module.kernel.__wrapped__))
