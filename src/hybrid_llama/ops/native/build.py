"""The native CPU kernels (``cpu_kernels.c``): built on first use with the system's C compiler, loaded
through ctypes, with their interface read from ``cpu_kernels.h``.

The build runs ``$CC`` (else ``cc``) and is kept under ``$HYBRID_LLAMA_KERNEL_CACHE`` (default
``~/.cache/hybrid_llama/kernels``), keyed by the source, the header, the flags and this CPU, so a
cluster node never loads a build made for another CPU; builds unused for a month and temporary files
of killed builds are pruned. Without a compiler the torch paths run instead (logged once);
``HYBRID_LLAMA_NATIVE=0`` turns the kernels off (for a decode state, from the next state prepared:
``step`` reads it once per state). A library whose declarations differ from the header's is refused
at load (:class:`InterfaceMismatch`). ``step`` (the decode steps), ``prefill`` (the parallel op),
``sparse_prefill`` (the sparse cache's parallel op) and ``softmax_decode`` (the softmax layers'
decode step) decide when a call is covered; this module only builds and loads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
HEADER = Path(__file__).with_name("cpu_kernels.h")  # the interface, declared once (see there)
FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared")
# Tried in this order: OpenMP (the prefill's segments run on the libgomp torch has loaded: same
# soname, so the same thread pool) and -march=native where the compiler has them.
OPTIONS = (("-fopenmp", "-march=native"), ("-fopenmp",), ("-fopenmp-simd", "-march=native"), ("-fopenmp-simd",))
# A build's temporary file older than this is a killed build's; a build unused this long is stale.
STALE_TMP_S, STALE_BUILD_S = 3600, 30 * 86400

# The C types the declarations may use, as ctypes reads them.
KERNEL_TYPES = {
    "int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float,
    "const float *": ctypes.c_void_p, "float *": ctypes.c_void_p, "unsigned char *": ctypes.c_void_p,
    "const unsigned char *": ctypes.c_void_p, "const long long *": ctypes.c_void_p, "long long *": ctypes.c_void_p,
}


@dataclass(frozen=True)
class Declaration:
    """One entry point as cpu_kernels.h declares it: return type and (type, name) of each parameter."""

    restype: str
    name: str
    params: tuple[tuple[str, str], ...]

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(name for _, name in self.params)


def _parse_param(text: str, entry: str) -> tuple[str, str]:
    m = re.fullmatch(r"(.*?)\s*\b([A-Za-z_]\w*)", text.strip())
    ctype = m and re.sub(r"\s*\*\s*$", " *", m.group(1).strip())
    if ctype not in KERNEL_TYPES:
        raise ValueError(f"cpu_kernels.h: {entry}: parameter {text.strip()!r} has a type build.py cannot pass")
    return ctype, m.group(2)


def parse_declarations(text: str) -> dict[str, Declaration]:
    """The entry points of the HYBRID_KERNELS list in ``text`` (the header, or a library's
    ``hybrid_interface()``: ``X(ret, name, (params))`` or ``ret name(params)`` per line)."""
    found = {}
    for m in re.finditer(r"^\s*(?:X\((int|long long), (\w+), \(([^)]*)\)\)|(int|long long) (\w+)\(([^)]*)\))",
                         text, re.M):
        restype, name, params = (m.group(1), m.group(2), m.group(3)) if m.group(1) else m.group(4, 5, 6)
        args = () if params.strip() in ("", "void") else tuple(_parse_param(p, name) for p in params.split(","))
        found[name] = Declaration(restype, name, args)
    return found


def parse_constants(text: str) -> dict[str, int]:
    """Every ``NAME = integer`` of the header's enums."""
    return {name: int(value) for body in re.findall(r"enum\s*\{([^}]*)\}", text)
            for name, value in re.findall(r"(\w+)\s*=\s*(-?\d+)", body)}


DECLARATIONS = parse_declarations(HEADER.read_text())
CONSTANTS = parse_constants(HEADER.read_text())
MAX_D, MAX_F, MAX_W, TILE, DECODE_G = (CONSTANTS[n] for n in ("MAX_D", "MAX_F", "MAX_W", "TILE", "DECODE_G"))
FORMULATION_CODES = {name.lower(): CONSTANTS[f"FORM_{name.upper()}"] for name in ("hybrid", "lolcats", "window")}
MAP_CODES = {"elu1": CONSTANTS["MAP_ELU1"], "hedgehog": CONSTANTS["MAP_HEDGEHOG"]}


class InterfaceMismatch(RuntimeError):
    """A library built from other declarations than the header's: calling it would corrupt memory."""


def check_interface(reported: str, declared: dict[str, Declaration] | None = None) -> None:
    """Raise :class:`InterfaceMismatch` naming every entry point whose declaration in a library's
    ``hybrid_interface()`` text differs from (or is missing in) ``declared`` (the header's)."""
    declared = DECLARATIONS if declared is None else declared
    built = parse_declarations(reported)
    wrong = sorted(name for name in declared.keys() | built.keys() if declared.get(name) != built.get(name))
    if wrong:
        details = "; ".join(f"{n}: header {_show(declared.get(n))}, library {_show(built.get(n))}" for n in wrong)
        raise InterfaceMismatch(f"the native library's interface differs from cpu_kernels.h at {', '.join(wrong)} "
                                f"({details})")


def _show(decl: Declaration | None) -> str:
    return "absent" if decl is None else f"{decl.restype} {decl.name}({', '.join(' '.join(p) for p in decl.params)})"


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


def prune(directory: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Remove what no process will load from the kernel cache: temporary files of killed builds (older
    than an hour, so a parallel job's build in progress stays) and builds unused for a month (each
    load touches its file). Returns what was removed; a file another process removes first is fine."""
    now = time.time() if now is None else now
    removed = []
    for path in directory.glob("cpu_kernels-*"):
        age = now - path.stat().st_mtime if path.exists() else 0.0
        stale = (path.name.endswith(".so.tmp") and age > STALE_TMP_S) or (
            path.suffix == ".so" and path != keep and age > STALE_BUILD_S)
        if stale:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
    return removed


def library_path(options: tuple[str, ...] | None = None) -> Path:
    """Where the build of this source with ``options`` (default: the loaded build's, else the first
    of ``OPTIONS``) for this CPU lives, built or not."""
    options = options if options is not None else (built_with or OPTIONS[0])
    built_from = SOURCE.read_bytes() + HEADER.read_bytes() + repr((FLAGS, options, os.environ.get("CC", "cc"))).encode()
    key = hashlib.sha256(built_from + _cpu_fingerprint().encode()).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{key}.so"


def bind_declared(lib: ctypes.CDLL, declared: dict[str, Declaration] | None = None) -> ctypes.CDLL:
    """Check ``lib`` against the declarations (:func:`check_interface`) and give each entry point its
    ctypes types from them; the library is returned, ready to call."""
    declared = DECLARATIONS if declared is None else declared
    report = lib.hybrid_interface
    report.restype, report.argtypes = ctypes.c_char_p, []
    check_interface(report().decode(), declared)
    for decl in declared.values():
        fn = getattr(lib, decl.name)
        fn.restype = KERNEL_TYPES[decl.restype]
        fn.argtypes = [KERNEL_TYPES[ctype] for ctype, _ in decl.params]
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library (compiled on first use), or None when it cannot be had (reason logged once).
    The first of ``OPTIONS`` that compiles and loads wins: a compiler without OpenMP, or an OpenMP
    build the process cannot load, falls back to a build without it. A library built from other
    declarations than the header's raises :class:`InterfaceMismatch`: calling it would corrupt memory."""
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
        except Exception as exc:  # no compiler, no OpenMP, read-only cache, foreign platform...
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        bind_declared(lib)
        _library, built_with = lib, options
        try:
            if time.time() - path.stat().st_mtime > 86400:
                os.utime(path)  # in use: prune() keeps it (a day's resolution is plenty for a month's age)
        except OSError:
            pass
        prune(path.parent, keep=path)
        return _library
    _why_not = "; ".join(errors)
    logger.warning("hybrid_attention: the native CPU kernels are unavailable, using torch ops (%s)", _why_not)
    return None


def why_not() -> str | None:
    """Why :func:`load` gave None (after it was called), else None."""
    return _why_not
