"""ttar reader: the format's forms (directory, file, symlink, EOF, NULLBYTE) and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from collectors.ttar import TtarError, extract_ttar, materialize_ttar, parse_ttar

SEP = "# ttar - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - - -"
ARCHIVE = "\n".join(
    [
        "Directory: a",
        "Mode: 755",
        SEP,
        "Path: a/one",
        "Lines: 1",
        "4: ACTIVE",
        "Mode: 644",
        SEP,
        "Path: a/two",
        "Lines: 2",
        "InfiniBand",
        "",
        "Mode: 644",
        SEP,
        "Path: a/guid",
        "Lines: 1",
        "0a7f:bc12:45ef:d23bEOF",
        "Mode: 444",
        SEP,
        "Path: a/empty",
        "Lines: 0",
        "Mode: 644",
        SEP,
        "Path: a/nul",
        "Lines: 1",
        "xNULLBYTEyEOF",
        "Mode: 644",
        SEP,
        "Path: a/link",
        "SymlinkTo: one",
        SEP,
        "",
    ]
)


def test_parse_forms() -> None:
    entries = {e.path: e for e in parse_ttar(ARCHIVE)}
    assert entries["a"].kind == "dir" and entries["a"].mode == 0o755
    assert entries["a/one"].content == b"4: ACTIVE\n"
    assert entries["a/two"].content == b"InfiniBand\n\n"
    assert entries["a/guid"].content == b"0a7f:bc12:45ef:d23b" and entries["a/guid"].mode == 0o444
    assert entries["a/empty"].content == b""
    assert entries["a/nul"].content == b"x\0y"
    assert entries["a/link"].kind == "symlink" and entries["a/link"].target == "one"


def test_extract_and_materialize(tmp_path: Path) -> None:
    archive = tmp_path / "x.ttar"
    archive.write_text(ARCHIVE)
    extract_ttar(archive, tmp_path / "out")
    assert (tmp_path / "out/a/two").read_bytes() == b"InfiniBand\n\n"
    assert (tmp_path / "out/a/link").read_text() == "4: ACTIVE\n"
    with materialize_ttar(archive) as root:
        kept = root
        assert (root / "a" / "guid").read_text() == "0a7f:bc12:45ef:d23b"
    assert not kept.exists()


@pytest.mark.parametrize(
    "text",
    [
        "Path: a\nLines: 3\nonly one\n",
        "Path: a\nLines: x\n",
        "Path: a\nLines: -1\n",
        "Path: a\nMode: 644\n",
        "Directory: /etc\n",
        "Directory: a/../../b\n",
        "Directory: a\nMode: 9z9\n",
        "Garbage: here\n",
    ],
)
def test_malformed_archives(text: str) -> None:
    with pytest.raises(TtarError):
        parse_ttar(text)
