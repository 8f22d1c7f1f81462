#!/usr/bin/env bash
# Install the Debian packages that gpupool's real services need, only those that are missing.
#
#   mosquitto, mosquitto-clients      MQTT broker + mosquitto_passwd (deploy/local/mosquitto.sh)
#   prometheus                        prometheus + promtool (alerting-rule tests)
#   ibsim-utils, libumad2sim0,        simulated InfiniBand fabric: ibsim, ibsim-run,
#   opensm, infiniband-diags          the subnet manager, perfquery / ibnetdiscover / smpquery
#   default-jre-headless              Java 17+ for Kafka (skipped when a java >= 17 is on PATH)
#   maven                             fetches the Kafka jars (deploy/local/kafka-fetch.sh)
#   chromium                          headless browser: renders `gpupool report` in its tests
#   prometheus-node-exporter          node_exporter on the simulated sysfs (live dashboard test)
#   munge, slurmctld, slurmd,         the training scheduler: a Slurm 22.05 cluster on loopback
#   slurm-client, tini                (deploy/local/slurm.sh; tini reaps the jobs' orphans)
#   openssl, curl, unzip              the Kubernetes control plane's certificates, and a Go toolchain
#                                     fetched when none is new enough (deploy/local/kubernetes*.sh)
#   containerd, runc,                 the one node that runs containers: its container runtime and
#   containernetworking-plugins,      pod network (deploy/local/kubelet.sh); gcc builds its pause
#   gcc, libc6-dev                    binary from Kubernetes' pause.c (kubernetes-build.sh)
#   cargo (with rustc)                the compiled scrape decoder of analytics (analytics/native,
#                                     built into .venv by `make venv`); skipped when a cargo is on
#                                     PATH or in ~/.cargo/bin (rustup). Bookworm's is rustc 1.63,
#                                     the crate's rust-version.
#
# Idempotent: packages are checked with one `dpkg-query` call, `command -v java` and `command -v cargo`; when nothing is
# missing the script prints nothing and exits 0 at once. Otherwise it runs `apt-get update` and
# `apt-get install -y --no-install-recommends` for the missing ones (needs root, or sudo), and exits
# non-zero with apt's output when that fails.
set -euo pipefail

packages=(mosquitto mosquitto-clients prometheus ibsim-utils libumad2sim0 opensm infiniband-diags maven chromium prometheus-node-exporter
    munge slurmctld slurmd slurm-client tini openssl curl unzip containerd runc containernetworking-plugins gcc libc6-dev)

_java_major() {
    # Major version of the java on PATH ("17" from 'openjdk version "17.0.15"'), or 0 if none.
    command -v java >/dev/null 2>&1 || { echo 0; return; }
    java -XshowSettings:properties -version 2>&1 \
        | sed -n 's/^ *java\.specification\.version = \([0-9]*\).*/\1/p' | head -n1
}

missing=()
# One dpkg-query for every package: prints "name installed" for the installed ones.
installed="$(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${packages[@]}" 2>/dev/null || true)"
for p in "${packages[@]}"; do
    if ! grep -qx "$p installed" <<<"$installed"; then
        missing+=("$p")
    fi
done
if command -v java >/dev/null 2>&1 && [ "$(_java_major)" -ge 17 ] 2>/dev/null; then
    :
else
    missing+=(default-jre-headless)
fi

if ! command -v cargo >/dev/null 2>&1 && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
    missing+=(cargo)
fi

if [ "${#missing[@]}" -eq 0 ]; then
    exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
        echo "install-system: missing packages (${missing[*]}) and not root, no sudo" >&2
        exit 1
    }
    sudo=(sudo)
fi

echo "install-system: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! "${sudo[@]}" apt-get update -q >/tmp/gpupool-apt-update.log 2>&1; then
    cat /tmp/gpupool-apt-update.log >&2
    echo "install-system: apt-get update failed" >&2
    exit 1
fi
if ! "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >/tmp/gpupool-apt-install.log 2>&1; then
    tail -n 40 /tmp/gpupool-apt-install.log >&2
    echo "install-system: apt-get install ${missing[*]} failed" >&2
    exit 1
fi
# Debian starts the packaged mosquitto/prometheus services on install where an init system runs;
# gpupool runs its own instances on free ports, so those are left alone (they bind other ports).
echo "install-system: installed ${missing[*]}" >&2
