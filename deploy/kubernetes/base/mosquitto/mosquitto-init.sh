#!/bin/sh
# Build Mosquitto's config directory for gpupool: mosquitto.conf, acl and a hashed passwd file.
#
# Runs before Mosquitto, in the eclipse-mosquitto image (compose: the mosquitto-init service;
# Kubernetes: the init container of the gpupool-mosquitto Deployment, from a synced copy), as
# Mosquitto's user (uid 1883), so the files it writes are Mosquitto's own and mode 0600.
#
# Inputs (environment, with defaults):
#   GPUPOOL_MQTT_SOURCE       /gpupool/mosquitto  holds mosquitto.conf and acl (deploy/mosquitto)
#   GPUPOOL_MQTT_CREDENTIALS  /run/secrets        holds the two credential files:
#       mqtt-broker-password    the gpupool broker's password (one line)
#       mqtt-sites              one "SITE:PASSWORD" line per edge site ('#' comments, blank lines)
#   GPUPOOL_MQTT_CONFIG       /mosquitto/config   where mosquitto.conf, acl and passwd are written
#   GPUPOOL_MQTT_BROKER_USER  gpupool-broker      the broker's MQTT user name
#
# Refuses (exit 1, nothing written) when a file is missing, a line is malformed, a site name is not
# 1-64 of [A-Za-z0-9_.-] starting alphanumeric (broker.acl.check_user_name), a site has no
# "user SITE" block in the acl (it could log in but would see no offers), or a password still
# contains the REPLACE-ME placeholder of the committed example credentials.
# passwd format: mosquitto_passwd -U (Mosquitto 2: user:$7$ PBKDF2-SHA512 lines).
set -eu

src="${GPUPOOL_MQTT_SOURCE:-/gpupool/mosquitto}"
creds="${GPUPOOL_MQTT_CREDENTIALS:-/run/secrets}"
out="${GPUPOOL_MQTT_CONFIG:-/mosquitto/config}"
broker_user="${GPUPOOL_MQTT_BROKER_USER:-gpupool-broker}"
placeholder="REPLACE-ME"

die() {
    echo "mosquitto-init: $*" >&2
    exit 1
}

valid_name() {
    case "$1" in
        "" | [!A-Za-z0-9]* | *[!A-Za-z0-9_.-]*) return 1 ;;
    esac
    [ "${#1}" -le 64 ]
}

for f in "$src/mosquitto.conf" "$src/acl" "$creds/mqtt-broker-password" "$creds/mqtt-sites"; do
    [ -r "$f" ] || die "cannot read $f"
done
if [ ! -d "$out" ] || [ ! -w "$out" ]; then die "cannot write to $out"; fi
command -v mosquitto_passwd >/dev/null 2>&1 || die "mosquitto_passwd not found"
valid_name "$broker_user" || die "invalid broker user name '$broker_user'"

umask 077
tmp="$(mktemp "$out/.passwd.XXXXXX")"
trap 'rm -f "$tmp" "$out/.acl.tmp" "$out/.conf.tmp"' EXIT

broker_pw="$(cat "$creds/mqtt-broker-password")"
[ -n "$broker_pw" ] || die "mqtt-broker-password is empty"
printf '%s:%s\n' "$broker_user" "$broker_pw" >"$tmp"

sites=0
lineno=0
while IFS= read -r line || [ -n "$line" ]; do
    lineno=$((lineno + 1))
    case "$line" in "" | "#"*) continue ;; esac
    site="${line%%:*}"
    pw="${line#*:}"
    if [ "$site" = "$line" ] || [ -z "$pw" ]; then
        die "mqtt-sites line $lineno: expected SITE:PASSWORD"
    fi
    valid_name "$site" || die "mqtt-sites line $lineno: invalid site name '$site'"
    [ "$site" != "$broker_user" ] || die "mqtt-sites line $lineno: '$site' is the broker's user"
    grep -qx "user $site" "$src/acl" || die "site '$site' has no 'user $site' block in $src/acl"
    if cut -d: -f1 "$tmp" | grep -qx "$site"; then
        die "mqtt-sites line $lineno: duplicate site '$site'"
    fi
    printf '%s:%s\n' "$site" "$pw" >>"$tmp"
    sites=$((sites + 1))
done <"$creds/mqtt-sites"
[ "$sites" -gt 0 ] || die "mqtt-sites lists no site"
if grep -q "$placeholder" "$tmp"; then
    die "credentials still hold the $placeholder placeholder: set real passwords first"
fi

mosquitto_passwd -U "$tmp" || die "mosquitto_passwd -U failed"
cp "$src/acl" "$out/.acl.tmp"
cp "$src/mosquitto.conf" "$out/.conf.tmp"
chmod 0600 "$tmp" "$out/.acl.tmp" "$out/.conf.tmp"
mv "$out/.acl.tmp" "$out/acl"
mv "$out/.conf.tmp" "$out/mosquitto.conf"
mv "$tmp" "$out/passwd"
echo "mosquitto-init: wrote $out/passwd for $broker_user and $sites sites"
