"""The kernel library's one table of foreign functions (scoutbench/kernels/native_abi.py) against the C++ it
declares (scoutbench/kernels/csrc), the bound library, and the build's cache key over every source file."""

from __future__ import annotations

import ctypes
import re
import shutil

import pytest

from scoutbench.kernels import cpu_attention, native_abi

DEFINITION = re.compile(r"^(int|const char\*)\s+(sb_\w+)\(([^)]*)\)\s*\{", re.M)


def _definitions() -> dict[str, tuple[str, str]]:
    """name -> (result type, parameters with single spaces) of each `sb_*` function defined in csrc/*.cpp."""
    found: dict[str, tuple[str, str]] = {}
    for path in cpu_attention.sources():
        for result, name, params in DEFINITION.findall(path.read_text(encoding="utf-8")):
            assert name not in found, f"{name} is defined twice"
            found[name] = (result, ", ".join(" ".join(p.split()) for p in params.split(",") if p.strip()))
    return found


def test_the_table_declares_every_entry_point_as_its_definition_does():
    assert _definitions() == native_abi.SIGNATURES


def test_every_parameter_has_a_ctypes_type():
    for name in native_abi.SIGNATURES:
        for c_type, param in native_abi.parameters(name):
            assert param.isidentifier(), (name, param)
            native_abi.ctype(c_type)
    assert len(native_abi.parameters("sb_attention")) == 29


def test_the_loaded_library_is_bound_from_the_table():
    lib = cpu_attention.library()
    if lib is None:
        pytest.skip("needs the kernel built (a C++ compiler)")
    assert lib.sb_abi_version() == native_abi.ABI_VERSION
    for name in native_abi.SIGNATURES:
        argtypes = getattr(lib, name).argtypes or []
        assert list(argtypes) == [native_abi.ctype(c) for c, _ in native_abi.parameters(name)], name
    assert lib.sb_isa.restype is ctypes.c_char_p
    with pytest.raises(ctypes.ArgumentError):  # an int64 parameter refuses a float: checked before the call
        lib.sb_merge2(0, 1.5, None, None, None, None, None, None)
    with pytest.raises(TypeError):  # a wrong count never reaches the library
        lib.sb_merge2(0, 1)


def test_the_cache_key_covers_every_source_file(tmp_path):
    """A change to any one file of the library, header or translation unit, changes the key (so it rebuilds)."""
    folder = tmp_path / "csrc"
    shutil.copytree(cpu_attention.SOURCE_DIR, folder)
    files = cpu_attention.source_files(folder)
    assert {p.suffix for p in files} == {".cpp", ".h"}
    assert [p.name for p in files] == [p.name for p in cpu_attention.source_files()]
    base = cpu_attention.source_digest(folder)
    assert base == cpu_attention.source_digest()
    keys = {base}
    for path in files:
        text = path.read_bytes()
        path.write_bytes(text + b"\n")
        keys.add(cpu_attention.source_digest(folder))
        path.write_bytes(text)
    assert len(keys) == len(files) + 1
    assert cpu_attention.source_digest(folder) == base
