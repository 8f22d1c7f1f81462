"""Assemble a single-layer OCI image as an image-layout tarball, for ``ctr images import``.

Nothing can be pulled from a registry on the machines gpupool's local services run on, so the
local node's images (deploy/local/kubelet.sh) are built from files already here:

    python oci_image.py OUT.tar NAME [--entrypoint ARG]... [--file SRC:DEST[:MODE]]...
        [--dir DEST[:MODE]]... [--symlink DEST:TARGET]...

writes ``OUT.tar``: an OCI image layout (``oci-layout``, ``index.json``, ``blobs/sha256/...``;
OCI Image Format Specification v1.0, "image-layout.md") holding one manifest (``manifest.md``),
one config (``config.md``: ``os: linux``, the host's architecture, ``Entrypoint``) and one
gzip-compressed layer with the files (``SRC`` copied to ``DEST``, mode octal, default 0755),
directories and symbolic links given, owned by root, mtime 0 (the same inputs give the same
digests). ``NAME`` (``registry.k8s.io/pause:3.10``) is the index's
``io.containerd.image.name`` annotation (the name containerd imports it under) and its tag the
``org.opencontainers.image.ref.name``.

Exit status 2 with a message on stderr for a bad argument or a missing source file.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import platform
import sys
import tarfile
from pathlib import Path

_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name.strip("/"))
    info.type, info.mode, info.mtime, info.uid, info.gid = kind, mode, 0, 0, 0
    return info


def layer(
    files: list[tuple[Path, str, int]], dirs: list[tuple[str, int]], links: list[tuple[str, str]]
) -> bytes:
    """The uncompressed tar of one layer: ``dirs`` (path, mode), ``links`` (path, target) and
    ``files`` (source, path, mode), in that order, root-owned, mtime 0."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, mode in dirs:
            tar.addfile(_info(path, tarfile.DIRTYPE, mode))
        for path, target in links:
            info = _info(path, tarfile.SYMTYPE, 0o777)
            info.linkname = target
            tar.addfile(info)
        for src, path, mode in files:
            data = src.read_bytes()
            info = _info(path, tarfile.REGTYPE, mode)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = _info(f"blobs/sha256/{digest}", tarfile.REGTYPE, 0o644)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return f"sha256:{digest}"


def write_image(out: Path, name: str, entrypoint: list[str], raw_layer: bytes) -> str:
    """Write the image layout tarball ``out`` of image ``name`` with ``raw_layer`` (an
    uncompressed tar) as its one layer; returns the manifest's digest."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    packed = gzip.compress(raw_layer, mtime=0)
    config = {
        "architecture": arch,
        "os": "linux",
        "config": {"Entrypoint": entrypoint, "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(raw_layer).hexdigest()}"]},
    }
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else "latest"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = _blob(tar, config_bytes)
        layer_digest = _blob(tar, packed)
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": len(packed)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest_bytes)
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    "digest": manifest_digest,
                    "size": len(manifest_bytes),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            ],
        }
        for path, data in (
            ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
            ("index.json", json.dumps(index).encode()),
        ):
            info = _info(path, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return manifest_digest


def _mode(text: str) -> int:
    return int(text, 8)


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring); 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("name")
    p.add_argument("--entrypoint", action="append", default=[])
    p.add_argument("--file", action="append", default=[], help="SRC:DEST[:MODE]")
    p.add_argument("--dir", action="append", default=[], help="DEST[:MODE]")
    p.add_argument("--symlink", action="append", default=[], help="DEST:TARGET")
    args = p.parse_args(argv)
    files: list[tuple[Path, str, int]] = []
    for spec in args.file:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not Path(parts[0]).is_file():
            p.error(f"--file {spec!r}: SRC:DEST[:MODE] with SRC an existing file")
        files.append((Path(parts[0]), parts[1], _mode(parts[2]) if len(parts) == 3 else 0o755))
    dirs: list[tuple[str, int]] = []
    for spec in args.dir:
        path, _, mode = spec.partition(":")
        dirs.append((path, _mode(mode) if mode else 0o755))
    links: list[tuple[str, str]] = []
    for spec in args.symlink:
        path, sep, target = spec.partition(":")
        if not sep or not target:
            p.error(f"--symlink {spec!r}: DEST:TARGET")
        links.append((path, target))
    print(write_image(args.out, args.name, args.entrypoint, layer(files, dirs, links)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
