"""Building a C kernel of this package into a shared library, once per machine, and loading it (ctypes), under
minimax_kernels/ in inductor's cache (`TORCHINDUCTOR_CACHE_DIR`, by default /tmp/torchinductor_<user>), named by a hash
of its source, headers, flags and CPU (`cpu`: built with -march=native, it may not run on another). Built with
inductor's CPU compiler (gcc, or $CC) and OpenMP, sharing torch's OpenMP runtime (its threads are torch's)."""

import ctypes
import functools
import getpass
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# NOTE: -ffast-math lets gcc vectorize the exp and the dot products (libmvec). It goes to the compile only: at the link,
# gcc (before 13) would add crtfastmath.o, whose constructor sets flush-to-zero process-wide as the library loads.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK, LIBS = ("-shared", "-fopenmp"), ("-lmvec", "-lm")
# Floats in the widest vector a kernel is built with (simd.h's LANES with AVX-512): the matrix sizes the kernels
# that multiply by weights (mat_rows.h) take are multiples of it, whichever width this CPU builds.
WIDEST = 16


def cache_dir(name: str = "minimax_kernels") -> Path:
    """`name` inside inductor's cache directory: where this project keeps what it builds on a machine."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                      f"torchinductor_{getpass.getuser()}")
    return Path(root) / name


@functools.cache
def cpu() -> str:
    """This CPU as -march=native sees it: torch's capability, the machine, /proc/cpuinfo's model name and flags."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    first = [next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags")]
    return "\0".join((torch.backends.cpu.get_cpu_capability(), platform.machine(), *first))


def library(source: Path, defines: tuple[str, ...] = ()) -> Path:
    texts = [f.read_text() for f in (source, *sorted(source.parent.glob("*.h")))]  # (the headers it may include)
    facts = (*texts, os.environ.get("CC", "gcc"), *FLAGS, *defines, *LINK, *LIBS, cpu())
    return cache_dir() / f"{source.stem}-{hashlib.sha256(chr(0).join(facts).encode()).hexdigest()[:16]}.so"


def load(source: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library built from `source` (built now if not cached) with extra `defines` ("-DNAME=value": a test builds a
    vector width this CPU would not choose); OSError or subprocess.CalledProcessError if building or loading fails."""
    cc, flags, lib = os.environ.get("CC", "gcc"), FLAGS + defines, library(source, defines)
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")  # (built apart, then renamed: processes may race)
        obj = tmp.with_suffix(".o")
        subprocess.run([cc, *flags, "-c", "-o", str(obj), str(source)], check=True, capture_output=True, text=True)
        subprocess.run([cc, *LINK, "-o", str(tmp), str(obj), *LIBS], check=True, capture_output=True, text=True)
        obj.unlink()
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def load_or_warn(source: Path, instead: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL]) -> ctypes.CDLL | None:
    """`bind(load(source))` (`bind` sets the functions' argument types), or None, with a warning saying what runs
    `instead`, where it cannot be built (no compiler, or a failed build)."""
    try:
        lib = load(source)
    except Exception as e:
        logger.warning("%s: the C kernel is unavailable (%s); %s", source.name, e, instead)
        return None
    return bind(lib)
