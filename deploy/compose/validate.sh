#!/usr/bin/env bash
# Load a compose file with the Compose Specification's reference loader and print the model.
#
#   deploy/compose/validate.sh [FILE]      FILE defaults to deploy/compose/compose.yaml
#
# The loader is compose-go (github.com/compose-spec/compose-go, the library Docker Compose v2
# itself uses), its `cmd` validator at a pinned version: it checks the file against the
# compose-spec JSON schema, interpolates variables (from the caller's environment and a .env
# beside FILE), resolves relative paths and checks the model's consistency (services, volumes,
# secrets and networks referenced exist), then prints the normalised model as JSON.
# Built once with `go install` (Go toolchain on PATH, modules from the Go module proxy) into
# ${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/compose-go-$version/. No Docker engine is needed.
# Exit status: 0 and the JSON on stdout; 1 with the loader's error; 3 when Go is missing.
set -euo pipefail

version="v2.16.2"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
file="${1:-$here/compose.yaml}"
bindir="${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/compose-go-$version"
bin="$bindir/cmd"

if [ ! -x "$bin" ]; then
    command -v go >/dev/null 2>&1 || { echo "validate: go not found (needed to build compose-go $version)" >&2; exit 3; }
    mkdir -p "$bindir"
    GOTOOLCHAIN=local GOBIN="$bindir" go install "github.com/compose-spec/compose-go/v2/cmd@$version" >&2
fi
cd "$(dirname "$file")"
"$bin" -format json "$(basename "$file")"
