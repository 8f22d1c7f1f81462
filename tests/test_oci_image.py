"""deploy/local/oci_image.py: the local node's images as OCI image-layout tarballs (what `ctr images
import` reads): layout, digests, the layer's files, determinism, bad arguments."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "local" / "oci_image.py"


def _build(tmp_path: Path, out: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / out), *args], capture_output=True, text=True, check=False
    )


def _blobs(path: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    files, blobs = {}, {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            files[m.name] = data
            if m.name.startswith("blobs/sha256/"):
                blobs["sha256:" + m.name.rsplit("/", 1)[1]] = data
    return files, blobs


def test_an_image_layout_with_its_name_entrypoint_and_one_layer_of_files(tmp_path: Path) -> None:
    binary = tmp_path / "pause"
    binary.write_bytes(b"\x7fELF not really")
    args = ("registry.k8s.io/pause:3.10", "--entrypoint", "/pause", "--file", f"{binary}:pause",
            "--dir", "tmp:1777", "--symlink", "bin:usr/bin")  # fmt: skip
    done = _build(tmp_path, "a.tar", *args)
    assert done.returncode == 0, done.stderr
    files, blobs = _blobs(tmp_path / "a.tar")
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    (entry,) = json.loads(files["index.json"])["manifests"]
    assert entry["annotations"] == {
        "io.containerd.image.name": "registry.k8s.io/pause:3.10",
        "org.opencontainers.image.ref.name": "3.10",
    }
    assert done.stdout.strip() == entry["digest"]
    for digest, data in blobs.items():  # every blob is named by its content
        assert digest == "sha256:" + hashlib.sha256(data).hexdigest()
    manifest = json.loads(blobs[entry["digest"]])
    assert entry["size"] == len(blobs[entry["digest"]])
    config = json.loads(blobs[manifest["config"]["digest"]])
    assert config["config"]["Entrypoint"] == ["/pause"] and config["os"] == "linux"
    (layer,) = manifest["layers"]
    raw = gzip.decompress(blobs[layer["digest"]])
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(raw).hexdigest()]
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert tar.extractfile("pause").read() == binary.read_bytes()  # type: ignore[union-attr]
    assert members["pause"].mode == 0o755 and members["tmp"].mode == 0o1777 and members["tmp"].isdir()
    assert members["bin"].issym() and members["bin"].linkname == "usr/bin"
    assert all(m.uid == 0 and m.mtime == 0 for m in members.values())
    again = _build(tmp_path, "b.tar", *args)
    assert again.stdout == done.stdout  # the same inputs, the same image


@pytest.mark.parametrize(
    "bad", [["--file", "/nonexistent:x"], ["--file", "justone"], ["--symlink", "nolink"]]
)
def test_a_bad_argument_is_refused(tmp_path: Path, bad: list[str]) -> None:
    done = _build(tmp_path, "c.tar", "x:1", *bad)
    assert done.returncode == 2 and "error" in done.stderr
    assert not (tmp_path / "c.tar").exists()
