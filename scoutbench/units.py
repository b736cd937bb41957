"""Parsing of human-friendly sizes: `64k` tokens, `80GiB` of memory, `5%` tolerances."""

from __future__ import annotations

import re

from scoutbench.errors import UsageError

# The largest count or size a command takes: torch's int64 (a larger one overflowed the first tensor it sized)
INT64_MAX = 2**63 - 1
_LEN_RE = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")
_LEN_UNITS = {"": 1, "k": 1024, "m": 1024 * 1024}


def parse_length(text: str | int, flag: str = "--len") -> int:
    """Token count: `4096`, `4k` (= 4096, k is 1024), `64k`, `1m` (= 1048576). `flag` names the option in errors
    (`--budget`, `--max-length`), so the message points at what to fix."""
    if isinstance(text, int):
        value = text
    else:
        match = _LEN_RE.match(str(text))
        if not match:
            raise UsageError(f"bad {flag} {text!r}: use an integer with an optional k or m suffix, e.g. 4096, 4k, "
                             "64k, 1m")
        value = int(match.group(1)) * _LEN_UNITS[match.group(2).lower()]
    if value < 1:
        raise UsageError(f"bad {flag} {text!r}: must be at least 1 token")
    if value > INT64_MAX:
        raise UsageError(f"bad {flag} {text!r}: at most {INT64_MAX} tokens")
    return value


def format_length(tokens: int) -> str:
    """Inverse of parse_length for display: 65536 -> '64k'."""
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}m"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}k"
    return str(tokens)


_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ki": 1024,
               "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bytes(text: str | int) -> int:
    """Memory size: `80GiB`, `80GB` (decimal), `1024MiB`, or a plain byte count."""
    if isinstance(text, int):
        return text
    match = _BYTES_RE.match(str(text))
    if not match:
        raise UsageError(f"bad memory size {text!r}: use e.g. 80GiB, 141GB or 512MiB")
    unit = (match.group(2) or "").lower()
    number = float(match.group(1)) * _BYTE_UNITS[unit]
    if not number <= INT64_MAX:  # a number too long for a float is inf
        raise UsageError(f"bad memory size {text!r}: at most {INT64_MAX} bytes (8 EiB)")
    return int(number)


_FRACTION_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*$")


def parse_fraction(text: str | float, flag: str = "fraction") -> float:
    """A share in [0, 1): `5%` or `0.05` -> 0.05. A bare number of 1 or more is refused rather than guessed at
    (`5` could mean 5% or 500%), and so is 100% or more: a tolerance that large could never fail."""
    if isinstance(text, (int, float)):
        text = repr(float(text))
    match = _FRACTION_RE.match(str(text))
    if not match:
        raise UsageError(f"bad {flag} {text!r}: use a percentage such as 5% or a fraction such as 0.05")
    number, percent = float(match.group(1)), match.group(2)
    value = number / 100.0 if percent else number
    if value >= 1:
        hint = f"; did you mean {match.group(1)}%?" if not percent else ""
        raise UsageError(f"bad {flag} {str(text).strip()!r}: must be below 100% (a tolerance of 100% or more "
                         f"could never fail){hint}")
    return value
