#!/usr/bin/env bash
# Fetch Apache Kafka 4.1.1's broker class path from Maven Central into a cache outside the repo:
#
#   ${GPUPOOL_CACHE:-$HOME/.cache/gpupool}/kafka-4.1.1/libs/*.jar
#
# The artifacts are listed in deploy/local/kafka/pom.xml (kafka_2.13 + log4j-core +
# log4j-slf4j2-impl + slf4j-api 2); `mvn dependency:copy-dependencies` resolves them (through
# ~/.m2, so a warm local repository makes this an offline copy). A marker file holding the pom's
# sha256 is written after a complete copy: a second run with the same pom prints nothing and exits
# at once; a changed pom fetches again. Fails non-zero with Maven's output when resolution fails.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pom="$here/kafka/pom.xml"
cache="${GPUPOOL_CACHE:-$HOME/.cache/gpupool}"
dest="$cache/kafka-4.1.1"
libs="$dest/libs"
marker="$dest/.fetched"

want="$(sha256sum "$pom" | cut -d' ' -f1)"
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$want" ] && [ -f "$libs/kafka_2.13-4.1.1.jar" ]; then
    exit 0
fi

command -v mvn >/dev/null 2>&1 || {
    echo "kafka-fetch: mvn not found; run deploy/local/install-system.sh (make deps-system)" >&2
    exit 1
}

mkdir -p "$dest"
work="$(mktemp -d "$dest/.fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Maven writes target/ next to the pom: build from a copy so the repo stays clean.
cp "$pom" "$work/pom.xml"
echo "kafka-fetch: resolving Kafka 4.1.1 jars into $libs" >&2
if ! mvn -q -B -f "$work/pom.xml" dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$work/libs" >"$work/mvn.log" 2>&1; then
    tail -n 60 "$work/mvn.log" >&2
    echo "kafka-fetch: mvn dependency:copy-dependencies failed" >&2
    exit 1
fi
for jar in kafka_2.13-4.1.1.jar kafka-clients-4.1.1.jar log4j-core-2.24.3.jar log4j-slf4j2-impl-2.24.3.jar; do
    [ -f "$work/libs/$jar" ] || { echo "kafka-fetch: $jar missing after mvn" >&2; exit 1; }
done
if compgen -G "$work/libs/slf4j-api-1.*.jar" >/dev/null; then
    echo "kafka-fetch: slf4j-api 1.x resolved; the log4j SLF4J 2 provider would be ignored" >&2
    exit 1
fi
rm -rf "$libs"
mv "$work/libs" "$libs"
echo "$want" >"$marker"
jars=("$libs"/*.jar)
echo "kafka-fetch: ${#jars[@]} jars in $libs" >&2
