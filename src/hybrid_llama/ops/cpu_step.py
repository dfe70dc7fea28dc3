"""The in-place decode step as one native call on the CPU (``cpu_step.c``, through ctypes).

The torch step (``decode._step_in_place``) is about 20 small ops per layer and token; inside a model
each runs cold, so the step costs its op count rather than its arithmetic. The C kernel does the same
step in one call. It is compiled on first use with the system's C compiler (``$CC``, else ``cc``) and
kept under ``$HYBRID_LLAMA_KERNEL_CACHE`` (default ``~/.cache/hybrid_llama/kernels``), keyed by the
source, the flags and this CPU, so a cluster node never loads a build made for another CPU. Without a
compiler, or with ``HYBRID_LLAMA_NATIVE_STEP=0``, the torch step runs instead (logged once).

Covered: fp32 contiguous CPU tensors, elu1 or Hedgehog (query map per query head, key map per KV
head), the three formulations, any batch and GQA, while every key in the window is real. The caller
checks that; the torch step is the reference it is tested against.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .decode import check_step_shapes
from .feature_maps import HedgehogFeatureMap, elu1

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_step.c")
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")
FORMULATION_CODES = {"hybrid": 0, "lolcats": 1, "window": 2}
MAX_D, MAX_F, MAX_W = 256, 1024, 4096  # the kernel's stack scratch (cpu_step.c)

_library: ctypes.CDLL | None = None
_why_not: str | None = None  # set once loading failed: the reason, logged once


def enabled() -> bool:
    return os.environ.get("HYBRID_LLAMA_NATIVE_STEP", "1") != "0"


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


def _compile(target: Path) -> None:
    """Build the shared library into ``target``: written to a temporary name and renamed, so parallel
    jobs (Snakemake runs several) never load a half-written file. ``-march=native`` first, then
    without it for compilers that reject it."""
    cc = os.environ.get("CC", "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    errors = []
    try:
        for arch in (("-march=native",), ()):
            cmd = [cc, *FLAGS, *arch, "-o", tmp, str(SOURCE), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                os.replace(tmp, target)
                return
            errors.append(f"{' '.join(cmd)}: {done.stderr.strip()[-500:]}")
        raise RuntimeError("; ".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path() -> Path:
    """Where this source, these flags and this CPU's build lives (built or not)."""
    key = hashlib.sha256(SOURCE.read_bytes() + repr(FLAGS).encode() + _cpu_fingerprint().encode()).hexdigest()[:16]
    return _cache_dir() / f"cpu_step-{key}.so"


def load() -> ctypes.CDLL | None:
    """The kernel library (compiled on first use), or None when it cannot be had (reason logged once)."""
    global _library, _why_not
    if _library is not None or _why_not is not None:
        return _library
    try:
        path = library_path()
        if not path.exists():
            _compile(path)
        lib = ctypes.CDLL(str(path))
        fn = lib.hybrid_step_f32
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int] * 6 + [ctypes.c_longlong, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 15
        _library = lib
    except Exception as exc:  # no compiler, read-only cache, foreign platform...
        _why_not = f"{type(exc).__name__}: {exc}"
        logger.warning("hybrid_attention_step: the native CPU step is unavailable, using the torch step (%s)", _why_not)
    return _library


def _map_parameters(fmap, heads: int, D: int) -> tuple[Tensor, Tensor] | None:
    """A Hedgehog map's ``(W [heads, D, F/2], b [heads, 1, F/2])`` as the kernel reads them, or None."""
    if not isinstance(fmap, HedgehogFeatureMap) or fmap.num_heads != heads or fmap.head_dim != D:
        return None
    W, bias = fmap.weight, fmap.bias
    fh = fmap.feature_dim
    if W.shape != (heads, D, fh) or bias.numel() != heads * fh or not _fp32_cpu(W, bias):
        return None
    return W, bias


def _fp32_cpu(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


@dataclass
class _Prepared:
    """A checked call for one state and one layer's parameters: every size and pointer but the
    token's own. Inside a model the Python around the kernel runs cold too (docs/performance.md), so
    each step only checks that nothing it was prepared from has changed."""

    sources: tuple  # the objects it was prepared from (kept alive here, so their ids stay theirs)
    ids: tuple[int, ...]
    pointers: tuple[int, ...]  # their data pointers: a parameter moved by .to() keeps its identity
    formulation: str
    sizes: tuple[int, ...]  # B, H, Hk, D, w, F
    q_shape: torch.Size
    kv_shape: torch.Size
    args: tuple  # formulation and map codes, then the state's and parameters' pointers


def _sources(state, window_logit: Tensor, linear_logit: Tensor, maps: tuple) -> tuple[tuple, tuple]:
    """``(objects, pointers)``: the state's buffers, the logits and the maps with their parameters
    (compared by id: the prepared call holds them, so no id is reused), and the data pointers of the
    logits and parameters (``Module.to`` and ``.data =`` keep a tensor's identity, not its memory)."""
    objects = (state.k_window, state.v_window, state.window_valid, state.S, state.z, window_logit, linear_logit, *maps)
    return objects, tuple(t.data_ptr() for t in objects[5:] if isinstance(t, Tensor))


def _prepare(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor, formulation: str,
             phi_q_map, phi_k_map) -> _Prepared | None:
    """Check everything the kernel will trust (it reads by these sizes) and bind the pointers; None
    where the kernel does not cover the arguments."""
    check_step_shapes(q, k, v, state)
    B, H, _, D = q.shape
    Hk, w, F = k.shape[1], state.window, state.S.shape[2]
    if phi_q_map is elu1 and phi_k_map is elu1:
        fmap, maps = 0, ()
    else:
        qmap, kmap = _map_parameters(phi_q_map, H, D), _map_parameters(phi_k_map, Hk, D)
        if qmap is None or kmap is None or qmap[0].shape[2] * 2 != F:
            return None
        fmap, maps = 1, (*qmap, *kmap)
    if (formulation not in FORMULATION_CODES or D > MAX_D or F > MAX_F or w > MAX_W
            or window_logit.shape != (H,) or linear_logit.shape != (H,)):
        return None
    buffers = (state.k_window, state.v_window, state.S, state.z)
    if (not _fp32_cpu(*buffers, window_logit, linear_logit, *maps) or v.shape != k.shape
            or state.v_window.shape != state.k_window.shape or state.S.shape != (B, Hk, F, D)
            or state.z.shape != (B, Hk, F) or state.window_valid.shape != (B, w)
            or state.window_valid.dtype != torch.bool or not state.window_valid.is_contiguous()):
        return None
    sources, pointers = _sources(state, window_logit, linear_logit, (phi_q_map, phi_k_map, *maps))
    bound = (state.k_window, state.v_window, state.window_valid, state.S, state.z, window_logit, linear_logit)
    map_pointers = tuple(t.data_ptr() for t in maps) if maps else (None,) * 4
    args = (FORMULATION_CODES[formulation], fmap, *(t.data_ptr() for t in bound), *map_pointers)
    sizes = (B, H, Hk, D, w, F)
    return _Prepared(sources, tuple(map(id, sources)), pointers, formulation, sizes, q.shape, k.shape, args)


def _still_valid(call: _Prepared, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map) -> bool:
    """Nothing the call was prepared from was replaced, moved or rebound (cheap: runs every token)."""
    if phi_q_map is not call.sources[7] or phi_k_map is not call.sources[8] or formulation != call.formulation:
        return False
    maps = (phi_q_map, phi_k_map)
    if len(call.sources) > 9:  # Hedgehog maps: their parameters, read from the modules' own table (a
        # plain dict look-up; attribute access through nn.Module.__getattr__ costs several times more)
        qp, kp = phi_q_map._parameters, phi_k_map._parameters
        maps += (qp["weight"], qp["bias"], kp["weight"], kp["bias"])
    objects, pointers = _sources(state, window_logit, linear_logit, maps)
    return tuple(map(id, objects)) == call.ids and pointers == call.pointers


def step_in_place(q: Tensor, k: Tensor, v: Tensor, state, window_logit: Tensor, linear_logit: Tensor,
                  formulation: str, phi_q_map, phi_k_map) -> Tensor | None:
    """Run the step natively, updating ``state`` in place; None when the kernel does not cover these
    arguments (the caller then runs the torch step). The caller guarantees: no autograd, the new key
    real, every key in the window real."""
    if not enabled():
        return None
    call = state.__dict__.get("_native_step")
    if call is None or not _still_valid(call, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map):
        call = _prepare(q, k, v, state, window_logit, linear_logit, formulation, phi_q_map, phi_k_map)
        if call is None:
            return None
        state.__dict__["_native_step"] = call
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # no copy for a model's one-token q, k, v
    if q.shape != call.q_shape or k.shape != call.kv_shape or v.shape != call.kv_shape or not _fp32_cpu(q, k, v):
        return None
    lib = load()
    if lib is None:
        return None
    out = torch.empty_like(q)
    if lib.hybrid_step_f32(*call.sizes, state.seen, *call.args[:2], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                           *call.args[2:], out.data_ptr()) != 0:
        return None
    state.seen += 1
    return out
