"""The native kernels' interface is declared once (ops/native/cpu_kernels.h): the compiler holds the C
definitions to it, a library built from other declarations is refused at load naming the entry
point, Python calls bind their arguments by the declared names, and the kernel cache is pruned."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from hybrid_llama.ops.native import bindings, build

CC = os.environ.get("CC", "cc")
needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler")


def _copy_sources(tmp_path, *, header_extra: bool, source_extra: bool):
    """The kernel source and header copied to ``tmp_path``, with an ``int extra`` first parameter added
    to hybrid_step_f32's declaration and/or definition."""
    header, source = build.HEADER.read_text(), build.SOURCE.read_text()
    if header_extra:
        header, n = re.subn(r"X\(int, hybrid_step_f32, \(int B,", "X(int, hybrid_step_f32, (int extra, int B,",
                            header)
        assert n == 1
    if source_extra:
        source, n = re.subn(r"^int hybrid_step_f32\(int B,", "int hybrid_step_f32(int extra, int B,", source,
                            flags=re.M)
        assert n == 1
    (tmp_path / "cpu_kernels.h").write_text(header)
    (tmp_path / "cpu_kernels.c").write_text(source)
    return tmp_path / "cpu_kernels.c", tmp_path / "cpu_kernels.h"


def test_the_header_declares_every_entry_point_and_the_constants():
    names = set(build.DECLARATIONS)
    assert {"hybrid_step_f32", "hybrid_sparse_step_f32", "hybrid_prefill_f32", "hybrid_sparse_group_f32",
            "softmax_decode_f32"} <= names
    step = build.DECLARATIONS["hybrid_step_f32"]
    assert step.restype == "int" and step.param_names[:3] == ("B", "H", "Hk") and len(step.params) == 29
    assert build.FORMULATION_CODES == {"hybrid": 0, "lolcats": 1, "window": 2}
    assert (build.MAX_D, build.MAX_F, build.MAX_W, build.TILE) == (256, 1024, 4096, 64)
    # every parameter is one ctypes can pass
    assert all(ctype in build.KERNEL_TYPES for d in build.DECLARATIONS.values() for ctype, _ in d.params)


@needs_cc
def test_the_loaded_library_reports_the_headers_declarations():
    lib = build.load()
    assert lib is not None, build.why_not()
    report = lib.hybrid_interface().decode()
    assert build.parse_declarations(report) == build.DECLARATIONS
    assert lib.hybrid_step_f32.argtypes[6] is ctypes.c_longlong  # `seen`, as declared


@needs_cc
def test_the_compiler_rejects_a_definition_that_differs_from_its_declaration(tmp_path):
    source, _ = _copy_sources(tmp_path, header_extra=False, source_extra=True)
    done = subprocess.run([CC, "-fsyntax-only", str(source)], capture_output=True, text=True)
    assert done.returncode != 0 and "hybrid_step_f32" in done.stderr


@needs_cc
def test_a_library_built_from_another_declaration_is_refused_at_load(tmp_path, monkeypatch):
    """One parameter added to hybrid_step_f32 on the C side (declaration and definition) and not on the
    Python side (which reads the shipped header): the load refuses, naming the entry point."""
    source, header = _copy_sources(tmp_path, header_extra=True, source_extra=True)
    monkeypatch.setattr(build, "SOURCE", source)
    monkeypatch.setattr(build, "HEADER", header)
    monkeypatch.setattr(build, "OPTIONS", (("-O0",),))
    monkeypatch.setenv("HYBRID_LLAMA_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_library", None)
    monkeypatch.setattr(build, "_why_not", None)
    with pytest.raises(build.InterfaceMismatch, match=r"hybrid_step_f32") as err:
        build.load()
    assert "int extra" in str(err.value)
    assert "hybrid_prefill_f32" not in str(err.value).split("(")[0]  # only the entry point that differs
    assert build._library is None
    # The same library passes once the Python side declares what it was built with.
    lib = ctypes.CDLL(str(next((tmp_path / "cache").glob("cpu_kernels-*.so"))))
    build.bind_declared(lib, build.parse_declarations(header.read_text()))


def test_calls_bind_arguments_by_the_declared_names():
    kernel = bindings.Kernel("hybrid_prefill_workspace")
    assert kernel.bind(D=64, g=3, w=16) == (3, 16, 64)  # the declared order, not the caller's
    with pytest.raises(TypeError, match=r"hybrid_prefill_workspace.*missing \['D'\]"):
        kernel.bind(g=3, w=16)
    with pytest.raises(TypeError, match=r"hybrid_prefill_workspace.*unknown \['heads'\]"):
        kernel.bind(g=3, w=16, D=64, heads=2)
    with pytest.raises(KeyError, match="no entry point"):
        bindings.Kernel("hybrid_step_f64")
    args, slots = kernel.template(("w",), g=3, D=64)
    assert bindings.fill(args, slots, 16) == [3, 16, 64] and args == [3, None, 64]


def test_the_kernel_cache_prunes_killed_builds_and_stale_libraries(tmp_path):
    now = 1_000_000_000.0
    files = {name: tmp_path / name for name in ("cpu_kernels-a.so", "cpu_kernels-b.so", "cpu_kernels-c.so",
                                                 "cpu_kernels-x.so.tmp", "cpu_kernels-y.so.tmp", "notes.txt")}
    ages = {"cpu_kernels-a.so": 40 * 86400, "cpu_kernels-b.so": 40 * 86400, "cpu_kernels-c.so": 86400,
            "cpu_kernels-x.so.tmp": 2 * 3600, "cpu_kernels-y.so.tmp": 60, "notes.txt": 400 * 86400}
    for name, path in files.items():
        path.write_bytes(b"")
        os.utime(path, (now - ages[name], now - ages[name]))
    removed = build.prune(tmp_path, keep=files["cpu_kernels-a.so"], now=now)
    assert sorted(p.name for p in removed) == ["cpu_kernels-b.so", "cpu_kernels-x.so.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_kernels-a.so", "cpu_kernels-c.so",
                                                          "cpu_kernels-y.so.tmp", "notes.txt"]
