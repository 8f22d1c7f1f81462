#!/usr/bin/env bash
# Build the local Kubernetes control plane's binaries from the Go module proxy (and etcd from
# Debian's etcd-server .deb) into a cache outside the repo:
#
#   ${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/kubernetes-v1.31.14/
#       bin/kube-apiserver bin/kube-scheduler bin/kube-controller-manager   k8s.io/kubernetes v1.31.14
#       bin/etcd                                                            Debian etcd-server 3.4.23
#       bin/kwok                                                            sigs.k8s.io/kwok v0.8.0
#       bin/kueue                                                           sigs.k8s.io/kueue v0.17.0
#       bin/kubelet                                                         k8s.io/kubernetes v1.31.14
#       bin/pause                                                           its build/pause/linux/pause.c (gcc -static)
#       kueue/crds/*.yaml, kueue/webhooks.yaml                             from the kueue module
#
# `kubernetes-build.sh check` builds nothing: exit 0 when everything is built, 1 when not.
#
# Each part is built once: a part whose marker file (.built-<part>) holds the same recipe hash is
# skipped, so a warm run prints nothing and exits at once. Go's own caches (GOMODCACHE, GOCACHE) are
# Go's defaults unless set. Progress lines go to stderr ("kubernetes-build: ..."), a cold build
# takes minutes. Downloads are retried with backoff (GPUPOOL_K8S_RETRIES, default 4); a failure
# exits non-zero naming the step and printing the tail of its log.
#
# Needs: apt-get (only `apt-get download`, nothing installed), curl and unzip. Go: kwok v0.8.0 needs
# Go >= 1.26; the first of GPUPOOL_GO, `go` on PATH, /usr/local/go/bin/go that is new enough is used,
# else Go 1.26.8 is fetched once as the golang.org/toolchain module from the Go module proxy (the
# same zip `go` itself switches to) into ${GPUPOOL_CACHE}/go1.26.8.
#
# Kubernetes from the proxy (see ../shared/DESIGN.md, "Kubernetes"): the k8s.io/kubernetes module
# replaces its staging modules with ./staging/src/..., which its zip does not hold. A writable
# copy of the module gets each such replace rewritten to the published k8s.io/X release; the proxy
# lacks a few patch releases, pinned below; the three sample-* modules have no 0.31 release and
# become empty local modules (nothing built here imports them).
set -euo pipefail

K8S_VERSION=v1.31.14
STAGING_VERSION=v0.31.14
ETCD_DEB_VERSION=3.4.23-4+b4
KWOK_VERSION=v0.8.0
KUEUE_VERSION=v0.17.0
GO_MIN_MINOR=26
GO_FETCH_VERSION=1.26.8
# Published staging releases where the proxy has no v0.31.14.
declare -A STAGING_PINS=(
    [k8s.io/endpointslice]=v0.31.13
    [k8s.io/kube-scheduler]=v0.31.13
    [k8s.io/kube-controller-manager]=v0.31.13
    [k8s.io/kube-proxy]=v0.31.11
)
SAMPLE_MODULES=(k8s.io/sample-apiserver k8s.io/sample-cli-plugin k8s.io/sample-controller)

cache="${GPUPOOL_CACHE:-$HOME/.cache/gpupool}"
dest="${GPUPOOL_K8S_CACHE:-$cache/kubernetes-$K8S_VERSION}"
bin="$dest/bin"
retries="${GPUPOOL_K8S_RETRIES:-4}"
export GOWORK=off GOTOOLCHAIN=local GOFLAGS="-buildvcs=false"
svc=kubernetes-build

_die() {
    echo "$svc: $*" >&2
    exit 1
}

_progress() {
    echo "$svc: $(date -u +%H:%M:%S) $*" >&2
}

_retry() {
    # _retry WHAT LOG CMD...: run CMD (output appended to LOG) up to $retries times, waiting 2, 4,
    # 8 ... s between tries; on the last failure print LOG's tail and exit naming WHAT.
    local what="$1" log="$2" try=1 wait=2
    shift 2
    until "$@" >>"$log" 2>&1; do
        if ((try >= retries)); then
            tail -n 40 "$log" >&2
            _die "$what failed after $try tries (log: $log)"
        fi
        _progress "$what failed (try $try of $retries); again in ${wait} s"
        sleep "$wait"
        try=$((try + 1))
        wait=$((wait * 2))
    done
}

_run() {
    # _run WHAT LOG CMD...: run CMD once (a build: retrying does not help); fail naming WHAT.
    local what="$1" log="$2"
    shift 2
    "$@" >>"$log" 2>&1 || { tail -n 60 "$log" >&2; _die "$what failed (log: $log)"; }
}

_done() {
    # _done PART RECIPE FILE...: 0 when PART was built with RECIPE and every FILE exists.
    local part="$1" recipe="$2" f
    shift 2
    [ "$(cat "$dest/.built-$part" 2>/dev/null)" = "$recipe" ] || return 1
    for f in "$@"; do [ -e "$f" ] || return 1; done
}

_mark() {
    echo "$2" >"$dest/.built-$1"
}

_module_dir() {
    # _module_dir MODULE@VERSION: download it (retried) and print its directory in GOMODCACHE.
    local log="$dest/log/download.log"
    _retry "go mod download $1" "$log" "$go" mod download "$1"
    "$go" mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'
}

_go_ok() {
    # _go_ok GO: 0 when GO runs and is Go 1.$GO_MIN_MINOR or newer.
    local v
    v="$("$1" env GOVERSION 2>/dev/null)" || return 1
    [[ "$v" =~ ^go1\.([0-9]+) ]] && ((BASH_REMATCH[1] >= GO_MIN_MINOR))
}

go=""
_find_go() {
    # Set $go to a Go toolchain new enough, fetching Go $GO_FETCH_VERSION when none is (once).
    [ -n "$go" ] && return 0
    local c fetched="$cache/go$GO_FETCH_VERSION"
    for c in "${GPUPOOL_GO:-}" "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go "$fetched/bin/go"; do
        if [ -n "$c" ] && _go_ok "$c"; then
            go="$c"
            return 0
        fi
    done
    local arch zip url log="$dest/log/go.log"
    case "$(uname -m)" in
        x86_64) arch=amd64 ;;
        aarch64) arch=arm64 ;;
        *) _die "no Go >= 1.$GO_MIN_MINOR found and no toolchain to fetch for $(uname -m)" ;;
    esac
    command -v curl >/dev/null 2>&1 && command -v unzip >/dev/null 2>&1 || _die "no Go >= 1.$GO_MIN_MINOR, and curl/unzip missing to fetch one"
    url="https://proxy.golang.org/golang.org/toolchain/@v/v0.0.1-go$GO_FETCH_VERSION.linux-$arch.zip"
    _progress "no Go >= 1.$GO_MIN_MINOR found: fetching Go $GO_FETCH_VERSION from $url"
    zip="$cache/.go$GO_FETCH_VERSION.zip"
    : >"$log"
    _retry "download of Go $GO_FETCH_VERSION" "$log" curl -fsSL --connect-timeout 20 -o "$zip" "$url"
    rm -rf "$fetched.tmp"
    mkdir -p "$fetched.tmp"
    _run "unzip Go $GO_FETCH_VERSION" "$log" unzip -q "$zip" -d "$fetched.tmp"
    rm -rf "$fetched"
    mv "$fetched.tmp/golang.org/toolchain@v0.0.1-go$GO_FETCH_VERSION.linux-$arch" "$fetched"
    rm -rf "$fetched.tmp" "$zip"
    chmod +x "$fetched"/bin/* "$fetched"/pkg/tool/*/* 2>/dev/null || true
    _go_ok "$fetched/bin/go" || _die "fetched Go $GO_FETCH_VERSION does not run"
    go="$fetched/bin/go"
}

_kubernetes_ldflags() {
    # Print the -ldflags that stamp the Kubernetes version into a binary (as `make` upstream does).
    local ld="-s -w" pkg
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ld+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=31"
        ld+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    echo "$ld"
}

_build_from_kubernetes() {
    # _build_from_kubernetes PART LOG CMD_DIR...: prepare a writable copy of k8s.io/kubernetes with
    # its staging replaces rewritten (see the header), build ./cmd/<CMD_DIR> for each into $bin, and
    # remove the copy. CGO is off (static binaries; kubelet's cgo parts are optional).
    local part="$1" log="$2"
    shift 2
    _find_go
    local src="$dest/src/kubernetes-$part" mod m target cmds=()
    : >"$log"
    _progress "downloading k8s.io/kubernetes@$K8S_VERSION"
    mod="$(_module_dir "k8s.io/kubernetes@$K8S_VERSION")"
    [ -n "$mod" ] && [ -f "$mod/go.mod" ] || _die "k8s.io/kubernetes@$K8S_VERSION: no module directory"
    rm -rf "$src"
    mkdir -p "$(dirname "$src")"
    cp -r "$mod" "$src"
    chmod -R u+w "$src"
    # Each `k8s.io/X => ./staging/src/k8s.io/X` becomes `k8s.io/X => k8s.io/X <published release>`.
    local sed_args=()
    while read -r m; do
        case " ${SAMPLE_MODULES[*]} " in
            *" $m "*)
                mkdir -p "$src/staging/src/$m"
                printf 'module %s\n\ngo 1.22\n' "$m" >"$src/staging/src/$m/go.mod"
                continue
                ;;
        esac
        target="${STAGING_PINS[$m]:-$STAGING_VERSION}"
        sed_args+=(-e "s#^\([[:space:]]*\)${m//./\\.} => \./staging/src/${m//./\\.}\$#\1$m => $m $target#")
    done < <(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\) => \./staging/src/.*#\1#p' "$src/go.mod")
    sed -i "${sed_args[@]}" "$src/go.mod"
    rm -rf "$src/vendor" "$src/go.work" "$src/go.work.sum"
    _progress "resolving Kubernetes' dependencies (staging modules at $STAGING_VERSION)"
    (cd "$src" && _retry "go mod download (k8s.io/kubernetes dependencies)" "$log" "$go" mod download)
    for m in "$@"; do cmds+=("./cmd/$m"); done
    _progress "building $* $K8S_VERSION (minutes when cold)"
    mkdir -p "$bin"
    # go.sum lacks the published staging modules (they were local): -mod=mod lets go add them.
    (cd "$src" && _run "go build $*" "$log" \
        env GOFLAGS="$GOFLAGS -mod=mod" CGO_ENABLED=0 "$go" build -trimpath -ldflags "$(_kubernetes_ldflags)" \
        -o "$bin/" "${cmds[@]}")
    rm -rf "$src"
    _progress "built $*"
}

build_kubernetes() {
    local recipe="$K8S_VERSION $STAGING_VERSION ${STAGING_PINS[*]}"
    if _done kubernetes "$recipe" "$bin/kube-apiserver" "$bin/kube-scheduler" "$bin/kube-controller-manager"; then
        return 0
    fi
    _build_from_kubernetes kubernetes "$dest/log/kubernetes.log" kube-apiserver kube-scheduler kube-controller-manager
    _mark kubernetes "$recipe"
}

build_kubelet() {
    # The kubelet of the one local node that runs containers (deploy/local/kubelet.sh).
    local recipe="kubelet $K8S_VERSION $STAGING_VERSION ${STAGING_PINS[*]}"
    if _done kubelet "$recipe" "$bin/kubelet"; then return 0; fi
    _build_from_kubernetes kubelet "$dest/log/kubelet.log" kubelet
    _mark kubelet "$recipe"
}

build_pause() {
    # The pause binary of the local node's sandbox and placeholder image (deploy/local/kubelet.sh):
    # Kubernetes' own build/pause/linux/pause.c, compiled static as its Makefile does.
    local recipe="pause $K8S_VERSION gcc -Os -static"
    if _done pause "$recipe" "$bin/pause"; then return 0; fi
    _find_go
    local log="$dest/log/pause.log" mod
    : >"$log"
    command -v gcc >/dev/null 2>&1 || _die "gcc not found: the pause binary is built from pause.c"
    mod="$(_module_dir "k8s.io/kubernetes@$K8S_VERSION")"
    [ -f "$mod/build/pause/linux/pause.c" ] || _die "k8s.io/kubernetes@$K8S_VERSION: no build/pause/linux/pause.c"
    mkdir -p "$bin"
    _run "gcc pause.c" "$log" gcc -Os -Wall -Werror -static "-DVERSION=$K8S_VERSION-gpupool" \
        -o "$bin/pause" "$mod/build/pause/linux/pause.c"
    _mark pause "$recipe"
    _progress "built pause"
}

_apt_download() {
    # apt-get download etcd-server (into the current folder); when that fails, refresh apt's lists
    # (a fresh machine may have none) so that the next try can succeed.
    apt-get download "etcd-server=$ETCD_DEB_VERSION" && return 0
    local sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo -n)
    "${sudo[@]}" apt-get update -q || true
    return 1
}

build_etcd() {
    local recipe="etcd-server $ETCD_DEB_VERSION"
    if _done etcd "$recipe" "$bin/etcd"; then return 0; fi
    local log="$dest/log/etcd.log" work
    : >"$log"
    command -v apt-get >/dev/null 2>&1 || _die "apt-get not found: etcd comes from Debian's etcd-server .deb"
    _progress "fetching Debian etcd-server $ETCD_DEB_VERSION (unpacked under $dest, not installed)"
    work="$(mktemp -d "$dest/.etcd.XXXXXX")"
    (cd "$work" && _retry "apt-get download etcd-server=$ETCD_DEB_VERSION" "$log" _apt_download)
    _run "dpkg-deb -x etcd-server" "$log" dpkg-deb -x "$work"/etcd-server_*.deb "$work/root"
    [ -x "$work/root/usr/bin/etcd" ] || { rm -rf "$work"; _die "etcd-server .deb holds no usr/bin/etcd"; }
    mkdir -p "$bin"
    mv "$work/root/usr/bin/etcd" "$bin/etcd"
    rm -rf "$work"
    _mark etcd "$recipe"
}

build_go_tool() {
    # build_go_tool NAME MODULE VERSION: go install MODULE/cmd/NAME@VERSION into $bin (and, for
    # Kueue, copy its CRDs and webhook configurations).
    local name="$1" module="$2" version="$3"
    local recipe="$module $version"
    local needs=("$bin/$name")
    [ "$name" = kueue ] && needs+=("$dest/kueue/crds" "$dest/kueue/webhooks.yaml")
    if _done "$name" "$recipe" "${needs[@]}"; then return 0; fi
    _find_go
    local log="$dest/log/$name.log" mod
    : >"$log"
    _progress "downloading $module@$version"
    mod="$(_module_dir "$module@$version")"
    [ -n "$mod" ] && [ -d "$mod" ] || _die "$module@$version: no module directory"
    _progress "building $name $version (go install; minutes when cold)"
    mkdir -p "$bin"
    # Retried as a whole: go install downloads the dependencies itself.
    _retry "go install $module/cmd/$name@$version" "$log" \
        env GOBIN="$bin" CGO_ENABLED=0 "$go" install -trimpath -ldflags "-s -w" "$module/cmd/$name@$version"
    if [ "$name" = kueue ]; then
        rm -rf "$dest/kueue"
        mkdir -p "$dest/kueue/crds"
        cp "$mod"/config/components/crd/bases/*.yaml "$dest/kueue/crds/"
        cp "$mod"/config/components/webhook/manifests.yaml "$dest/kueue/webhooks.yaml"
        chmod -R u+w "$dest/kueue"
    fi
    _mark "$name" "$recipe"
    _progress "built $name $version"
}

if [ "${1:-}" = check ]; then
    # check: exit 0 when every part is built with its current recipe (nothing to do), else 1.
    _done etcd "etcd-server $ETCD_DEB_VERSION" "$bin/etcd" \
        && _done kubernetes "$K8S_VERSION $STAGING_VERSION ${STAGING_PINS[*]}" \
            "$bin/kube-apiserver" "$bin/kube-scheduler" "$bin/kube-controller-manager" \
        && _done kwok "sigs.k8s.io/kwok $KWOK_VERSION" "$bin/kwok" \
        && _done kueue "sigs.k8s.io/kueue $KUEUE_VERSION" "$bin/kueue" "$dest/kueue/crds" "$dest/kueue/webhooks.yaml" \
        && _done kubelet "kubelet $K8S_VERSION $STAGING_VERSION ${STAGING_PINS[*]}" "$bin/kubelet" \
        && _done pause "pause $K8S_VERSION gcc -Os -static" "$bin/pause"
    exit
fi
mkdir -p "$dest/log"
exec 8>"$dest/.build-lock"
flock -w 3600 8 || _die "another build holds $dest/.build-lock"
build_etcd
build_kubernetes
build_go_tool kwok sigs.k8s.io/kwok "$KWOK_VERSION"
build_go_tool kueue sigs.k8s.io/kueue "$KUEUE_VERSION"
build_kubelet
build_pause
