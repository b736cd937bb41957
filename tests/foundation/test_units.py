"""Units (scoutbench/units.py): lengths (`4k`, `64k`, `1m`), byte sizes and fractions."""

import pytest

from scoutbench.errors import UsageError
from scoutbench.units import format_length, parse_bytes, parse_fraction, parse_length


@pytest.mark.parametrize("text,tokens", [("4096", 4096), ("4k", 4096), ("64k", 65536), ("1m", 1 << 20),
                                         ("32K", 32768), (" 8k ", 8192)])
def test_parse_length(text, tokens):
    assert parse_length(text) == tokens


@pytest.mark.parametrize("text", ["64q", "", "k", "1.5k", "-4", "0", "64K0", "4kk"])
def test_parse_length_rejects(text):
    with pytest.raises(UsageError):
        parse_length(text)


def test_format_length_roundtrip():
    for tokens in (1000, 4096, 65536, 1 << 20):
        assert parse_length(format_length(tokens)) == tokens


def test_parse_bytes_and_fraction():
    assert parse_bytes("80GiB") == 80 * 1024**3
    assert parse_bytes("80GB") == 80 * 1000**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_fraction("5%") == pytest.approx(0.05)
    assert parse_fraction("0.1") == pytest.approx(0.1)
    with pytest.raises(UsageError):
        parse_bytes("lots")
