"""Prometheus text-format pieces: label sets, values, timestamps (Prometheus "Exposition formats")."""

from __future__ import annotations

import math

import pytest

from collectors.exposition import ExpositionError, parse_labels, parse_timestamp_ms, parse_value


@pytest.mark.parametrize(
    "text,want",
    [
        ("", {}),
        ('a="1"', {"a": "1"}),
        ('a="1",b="2",', {"a": "1", "b": "2"}),
        ('a="1", b="2"', {"a": "1", "b": "2"}),
        (' a = "1" ,\tb="x, y z" ', {"a": "1", "b": "x, y z"}),
        (
            'msg="say \\"hi\\"",path="C:\\\\dir",nl="a\\nb"',
            {"msg": 'say "hi"', "path": "C:\\dir", "nl": "a\nb"},
        ),
        ('odd="\\t kept"', {"odd": "\\t kept"}),
        ('brace="}{",eq="a=b"', {"brace": "}{", "eq": "a=b"}),
        ('_x1="",Y="ü"', {"_x1": "", "Y": "ü"}),
    ],
)
def test_parse_labels(text: str, want: dict[str, str]) -> None:
    assert parse_labels(text) == want


@pytest.mark.parametrize(
    "text,reason",
    [
        ('a="1"b="2"', "bad_labels"),
        ("a=1", "bad_labels"),
        ('a="1', "bad_labels"),
        ('a="1\\"', "bad_labels"),
        ('1a="x"', "bad_labels"),
        ('a-b="x"', "bad_labels"),
        ("a", "bad_labels"),
        ('a="1",,b="2"', "bad_labels"),
        ('a="1",a="2"', "duplicate_label"),
    ],
)
def test_parse_labels_errors(text: str, reason: str) -> None:
    with pytest.raises(ExpositionError) as ei:
        parse_labels(text)
    assert ei.value.reason == reason


@pytest.mark.parametrize(
    "text,want",
    [
        ("0", 0),
        ("42", 42),
        ("-7", -7),
        ("+7", 7),
        ("129931554972", 129931554972),
        (str(2**64 + 1), 2**64 + 1),
        ("0.5", 0.5),
        ("1e3", 1000.0),
        ("-1.5E-2", -0.015),
        ("+Inf", math.inf),
        ("-Inf", -math.inf),
        ("71.204000", 71.204),
    ],
)
def test_parse_value(text: str, want: float) -> None:
    got = parse_value(text)
    assert got == want and type(got) is type(want)


def test_parse_value_nan() -> None:
    assert math.isnan(parse_value("NaN"))


@pytest.mark.parametrize("text", ["", "abc", "1_000", "٣", "1.2.3", "0x10", "--1"])
def test_parse_value_errors(text: str) -> None:
    with pytest.raises(ExpositionError) as ei:
        parse_value(text)
    assert ei.value.reason == "bad_value"


def test_parse_timestamp() -> None:
    assert parse_timestamp_ms("1700000000123") == 1700000000123
    assert parse_timestamp_ms("-5") == -5
    for bad in ("1.5", "x", str(2**63), ""):
        with pytest.raises(ExpositionError):
            parse_timestamp_ms(bad)
