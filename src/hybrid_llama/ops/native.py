"""The native CPU kernels (``cpu_kernels.c``): built on first use with the system's C compiler, loaded
through ctypes.

The build runs ``$CC`` (else ``cc``) and is kept under ``$HYBRID_LLAMA_KERNEL_CACHE`` (default
``~/.cache/hybrid_llama/kernels``), keyed by the source, the flags and this CPU, so a cluster node
never loads a build made for another CPU. Without a compiler the torch paths run instead (logged
once); ``HYBRID_LLAMA_NATIVE=0`` turns the kernels off (for a decode state, from the next state
prepared: ``cpu_step`` reads it once per state). ``cpu_step`` (the decode steps),
``cpu_prefill`` (the parallel op), ``cpu_sparse`` (the sparse cache's parallel op) and
``softmax_decode`` (the softmax layers' decode step) decide when a call is covered; this module only
builds and loads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")
# Tried in this order: OpenMP (the prefill's segments run on the libgomp torch has loaded: same
# soname, so the same thread pool) and -march=native where the compiler has them.
OPTIONS = (("-fopenmp", "-march=native"), ("-fopenmp",), ("-fopenmp-simd", "-march=native"), ("-fopenmp-simd",))
MAX_D, MAX_F, MAX_W = 256, 1024, 4096  # the kernels' stack scratch (cpu_kernels.c)
FORMULATION_CODES = {"hybrid": 0, "lolcats": 1, "window": 2}

_I, _L, _P = ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p
# name -> (restype, argtypes) of every entry point, as cpu_kernels.c declares them
SIGNATURES = {
    "hybrid_step_f32": (_I, [_I] * 6 + [_L, _I, _I, _I] + [_P] * 17 + [_L]),
    "hybrid_sparse_step_f32": (_I, [_I] * 8 + [_L, _I] + [_P] * 22),
    "hybrid_sparse_group_f32": (_I, [_I] * 8 + [_L] * 4 + [_I, _I] + [_P, _L, _L, _L] * 3 + [_P] * 9
                                + [_P, _L, _L, _L, _P]),
    "hybrid_sparse_group_workspace": (_L, [_I] * 9),
    "hybrid_prefill_f32": (_I, [_I, _I, _I, _L, _I, _I, _I, _I, _I, _I, _P] + [_P, _L, _L, _L] * 3 + [_P] * 8
                           + [_P, _L, _L, _L, _P, _L]),
    "softmax_decode_f32": (_I, [_I] * 4 + [_L, _L, _I] + [_P, _L, _L] + [_P, _L, _L, _L] * 2
                           + [ctypes.c_float, _P, _L, _L, _P]),
    "softmax_decode_workspace": (_L, [_I] * 4 + [_L, _L]),
    "hybrid_native_threads": (_I, []),
    "hybrid_prefill_workspace": (_L, [_I, _I, _I]),
}

_library: ctypes.CDLL | None = None
_why_not: str | None = None  # set once loading failed: the reason, logged once
built_with: tuple[str, ...] | None = None  # the OPTIONS entry of the loaded build


def enabled() -> bool:
    return os.environ.get("HYBRID_LLAMA_NATIVE", "1") != "0"


def _cpu_fingerprint() -> str:
    """What a ``-march=native`` build depends on: the machine and, on Linux, the CPU's feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{flags}"


def _cache_dir() -> Path:
    root = os.environ.get("HYBRID_LLAMA_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybrid_llama" / "kernels"


def _compile(target: Path, options: tuple[str, ...]) -> None:
    """Build the shared library into ``target``: written to a temporary name and renamed, so parallel
    jobs (Snakemake runs several) never load a half-written file."""
    cc = os.environ.get("CC", "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, *options, "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(options: tuple[str, ...] | None = None) -> Path:
    """Where the build of this source with ``options`` (default: the loaded build's, else the first
    of ``OPTIONS``) for this CPU lives, built or not."""
    options = options if options is not None else (built_with or OPTIONS[0])
    built_from = SOURCE.read_bytes() + repr((FLAGS, options, os.environ.get("CC", "cc"))).encode()
    key = hashlib.sha256(built_from + _cpu_fingerprint().encode()).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{key}.so"


def load() -> ctypes.CDLL | None:
    """The kernel library (compiled on first use), or None when it cannot be had (reason logged once).
    The first of ``OPTIONS`` that compiles and loads wins: a compiler without OpenMP, or an OpenMP
    build the process cannot load, falls back to a build without it."""
    global _library, _why_not, built_with
    if _library is not None or _why_not is not None:
        return _library
    errors = []
    for options in OPTIONS:
        try:
            path = library_path(options)
            if not path.exists():
                _compile(path, options)
            lib = ctypes.CDLL(str(path))
            for name, (restype, argtypes) in SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except Exception as exc:  # no compiler, no OpenMP, read-only cache, foreign platform...
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        _library, built_with = lib, options
        return _library
    _why_not = "; ".join(errors)
    logger.warning("hybrid_attention: the native CPU kernels are unavailable, using torch ops (%s)", _why_not)
    return None


def why_not() -> str | None:
    """Why :func:`load` gave None (after it was called), else None."""
    return _why_not
