#!/usr/bin/env bash
# Build a kustomization and check every object against its Kubernetes API type (strict decoding).
#
#   deploy/kubernetes/validate.sh DIR      DIR holds a kustomization.yaml (base, overlays/example)
#
# Runs deploy/kubernetes/validate (Go: the kustomize API, k8s.io/api, the Prometheus Operator's
# monitoring/v1 types; see its main.go), built once per source version (go.mod, go.sum, main.go)
# into ${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/k8s-validate-<hash>/ with the Go toolchain on PATH
# and modules from the Go module proxy. No cluster is needed.
# Exit status: 0 and the built YAML on stdout; 1 with one line per invalid object; 2 on usage;
# 3 when Go is missing.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -eq 1 ] || { echo "usage: $0 KUSTOMIZATION_DIR" >&2; exit 2; }
src="$here/validate"
key="$(cat "$src/go.mod" "$src/go.sum" "$src/main.go" | sha256sum | cut -c1-16)"
bindir="${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/k8s-validate-$key"
bin="$bindir/validate"

if [ ! -x "$bin" ]; then
    command -v go >/dev/null 2>&1 || { echo "validate: go not found (needed to build $src)" >&2; exit 3; }
    mkdir -p "$bindir"
    (cd "$src" && GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" go build -trimpath -o "$bin.tmp" .) >&2
    mv "$bin.tmp" "$bin"
fi
exec "$bin" "$1"
