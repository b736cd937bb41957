"""The kernel library's foreign functions, each declared once: its C result type and parameter list, written as in
its `extern "C"` definition in `csrc/*.cpp`. `bind` gives ctypes every signature from this table when the library
loads; callers then call `library().sb_<name>(...)` with the arguments in this order, and ctypes converts and checks
each one against its declared type (a wrong count raises TypeError). tests/kernels/test_native_abi.py reads the C++
definitions and checks them against this table, name for name and type for type.

Binding costs nothing per call: ctypes keeps the argument types on the function object, as a hand-written
`argtypes` does, and no torch call is involved (a decode step's `host.torch_calls_per_step` counts torch calls).
"""

from __future__ import annotations

import ctypes

# the library's `sb_abi_version()`: raised with any change of an entry point's parameters, which makes a cached
# library built from older sources fail `bind` (`stale kernel build`) rather than be called with the wrong arguments
ABI_VERSION = 7

# name -> (C result type, C parameters) as in the definition
SIGNATURES: dict[str, tuple[str, str]] = {
    "sb_abi_version": ("int", ""),
    "sb_isa": ("const char*", ""),
    "sb_helper_spin_us": ("int", ""),
    # csrc/attention.cpp
    "sb_attention": ("int", "int dtype, int64_t B, int64_t H, int64_t rows_per_kv, int64_t G, int64_t D, "
                            "const void* q, const void* k, const void* v, int64_t kb, int64_t kh, int64_t kid, "
                            "int64_t ktok, int64_t vb, int64_t vh, int64_t vid, int64_t vtok, int64_t block_size, "
                            "const int64_t* ids, int64_t ids_b, int64_t ids_h, const int64_t* lens, "
                            "int64_t max_tokens, float scale, float* out, float* lse, float* probs, "
                            "int64_t probs_width, int threads"),
    # csrc/decode.cpp
    "sb_linear": ("int", "int dtype, int64_t M, int64_t N, int64_t K, const void* x, const void* W, const void* bias, "
                         "void* y, int threads"),
    "sb_rms_norm": ("int", "int dtype, int64_t rows, int64_t n, const void* x, const void* w, float eps, void* out"),
    "sb_attention_prologue": ("int", "int dtype, int64_t M, int64_t hidden, const void* normed, const void* wq, "
                                     "const void* bq, const void* wk, const void* bk, const void* wv, const void* bv, "
                                     "int64_t Hq, int64_t Hkv, int64_t D, const void* qn_w, const void* kn_w, "
                                     "float qk_eps, const void* cos, const void* sin, void* q, void* k, void* v, "
                                     "int threads"),
    # csrc/digest.cpp
    "sb_digest_scores": ("int", "int dtype, int64_t rows, int64_t heads, int64_t group, int64_t dim, "
                                "int64_t num_blocks, const void* digests, int64_t row_stride, const float* q, "
                                "const uint8_t* blocked, int64_t blocked_b, int64_t blocked_h, int64_t k, "
                                "float* scores, int64_t* ids, int threads"),
    # csrc/top_tokens.cpp
    "sb_top_tokens": ("int", "int64_t rows, int64_t heads, int64_t G, int64_t P, const float* k, int64_t row_stride, "
                             "int64_t tok_stride, const float* q, const int64_t* lens, int64_t n, int64_t* ids, "
                             "int threads"),
    # csrc/split_plan.cpp
    "sb_split_plan": ("int", "int64_t rows, int64_t k, const int64_t* ids, const uint8_t* valid, "
                             "const int64_t* block_slot, int64_t max_blocks, const uint8_t* slot_ready, "
                             "const int64_t* slot_block, int64_t num_slots, const int64_t* victims, "
                             "const int64_t* available, int64_t* data, uint8_t* pool_use"),
    # csrc/merge.cpp
    "sb_merge2": ("int", "int64_t rows, int64_t D, const float* o_a, const float* lse_a, const float* o_b, "
                         "const float* lse_b, float* o, float* lse"),
    # csrc/copy_rows.cpp
    "sb_copy_rows": ("int", "int64_t n, int64_t row_bytes, void* dst, const int64_t* dst_rows, const void* src, "
                            "const int64_t* src_rows, int threads"),
}

# C scalar types -> ctypes; every data pointer is passed as an address (`tensor.data_ptr()`, or None for null)
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_RESULTS = {"int": ctypes.c_int, "const char*": ctypes.c_char_p}


def parameters(name: str) -> list[tuple[str, str]]:
    """`name`'s parameters as (C type, name) pairs, in order."""
    text = SIGNATURES[name][1]
    return [tuple(part.strip().rsplit(" ", 1)) for part in text.split(",")] if text else []


def ctype(c_type: str) -> type:
    """The ctypes type of a C parameter type: a pointer of any kind is a `c_void_p`."""
    return ctypes.c_void_p if c_type.endswith("*") else _SCALARS[c_type]


def abi_version(library: ctypes.CDLL) -> int:
    """The ABI version `library` was built with: the one call made before `bind`, since a stale build may lack
    functions of the table."""
    library.sb_abi_version.restype = _RESULTS[SIGNATURES["sb_abi_version"][0]]
    return library.sb_abi_version()


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """`library` with every function of `SIGNATURES` given its result and argument types."""
    for name, (result, _) in SIGNATURES.items():
        function = getattr(library, name)
        function.restype = _RESULTS[result]
        function.argtypes = [ctype(c_type) for c_type, _ in parameters(name)]
    return library
