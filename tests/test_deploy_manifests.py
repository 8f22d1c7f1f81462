"""Deployment manifests for real clusters: compose, Kubernetes (kustomize), systemd, the Dockerfile.

Neither a Docker engine nor a cluster runs here, so each manifest is checked offline by the tool
that defines its format, then against the code it deploys:

* every YAML file parses (PyYAML);
* compose.yaml: loaded by compose-go, the Compose Specification's reference loader that Docker
  Compose v2 uses (JSON-schema validation, interpolation, path resolution, consistency), through
  ``deploy/compose/validate.sh``; the normalised model is then cross-checked;
* Kubernetes: ``deploy/kubernetes/validate.sh`` builds base and overlays/example with the kustomize
  API and decodes every object strictly into its API type (k8s.io/api, Prometheus Operator
  monitoring/v1): unknown fields and wrong types fail; then selectors, ports, volumes and
  references are cross-checked on the built objects;
* systemd: ``systemd-analyze verify`` (with ExecStart pointed at this environment's ``gpupool``,
  since /usr/local/bin/gpupool is the install target) and ``systemd-analyze security --offline``;
* every ``gpupool`` command line (compose command, Kubernetes args after ``$(VAR)`` expansion,
  systemd ExecStart after ``${VAR}``/specifier expansion) is parsed by the real Typer app with the
  stage callbacks replaced by recorders: sub-command path, option names and value types are the
  CLI's own; the settings the stage would run with are then resolved as the stage does it
  (``<stage>.cli.run_settings``: flags > GPUPOOL_* environment > the deployment's one
  ``gpupool.toml`` given with ``--config`` > defaults) and checked (metrics ports 9410/9411/9412
  as in deploy/prometheus/prometheus.yml, 0.0.0.0 in containers, Kafka and MQTT addresses);
* mosquitto-init.sh runs against Debian's mosquitto_passwd.

Go (for the two validators), promtool, mosquitto_passwd and systemd-analyze are needed: a missing
one skips its tests locally and fails them in CI (``CI=true``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import typer
import yaml

import analytics.cli
import broker.cli
import collectors.cli
from broker.acl import BROKER_USER, DEFAULT_ROOT, OBSERVER_USER, render_acl
from gpupool.cli import app
from gpupool.settings import load_settings
from gpupool.topics_cli import TOPICS_FLAGS
from runtime.settings import DeploymentSettings
from tests.support import tool_missing

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"

STAGE_PORTS: dict[tuple[str, ...], int] = {
    ("collect", "run"): 9410,
    ("analytics", "run"): 9411,
    ("broker", "run"): 9412,
}
"""Sub-command of each stage → its metrics port (deploy/prometheus/prometheus.yml)."""
STAGE_JOBS: dict[tuple[str, ...], str] = {
    ("collect", "run"): "gpupool-collectors",
    ("analytics", "run"): "gpupool-analytics",
    ("broker", "run"): "gpupool-broker",
}
PLACEHOLDER = "REPLACE-ME"
CONFIG_PATH = "/etc/gpupool/gpupool.toml"
"""Where every deployment puts its one settings file (the stages' --config)."""
RUN_SETTINGS: dict[tuple[str, ...], Any] = {
    ("collect", "run"): collectors.cli.run_settings,
    ("analytics", "run"): analytics.cli.run_settings,
    ("broker", "run"): broker.cli.run_settings,
    ("topics", "create"): lambda config, partitions, replication_factor, **flags: TOPICS_FLAGS.load(
        config, **flags
    ),
}
"""Sub-command of each stage (and the deployment's one-shot topic creation) → how it resolves its
settings from its parsed parameters."""
SETTINGS_FILES = [
    COMPOSE / "gpupool.toml",
    SYSTEMD / "gpupool.toml",
    K8S / "base" / "config" / "gpupool.toml",
    K8S / "overlays" / "example" / "gpupool.toml",
]
"""The one settings file each deployment ships."""


def _metrics_port(leaf: tuple[str, ...], settings: DeploymentSettings) -> int:
    return {
        ("collect", "run"): settings.metrics.collectors,
        ("analytics", "run"): settings.metrics.analytics,
        ("broker", "run"): settings.metrics.broker,
    }[leaf]


# helpers ----------------------------------------------------------------------------------------
def _missing(what: str) -> NoReturn:
    """Skip locally, fail in CI, when a tool the checks need is absent."""
    tool_missing(f"{what} not available")


def _clean_env() -> dict[str, str]:
    """The environment without GPUPOOL_* settings (so the manifests' defaults apply); the tool
    cache location (GPUPOOL_CACHE, exported by the Makefile) is kept."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_") or k == "GPUPOOL_CACHE"}


def _run_tool(cmd: list[str], *, timeout: float = 600, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, **kw)


def _parse_gpupool(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    files: dict[str, Path] | None = None,
) -> tuple[tuple[str, ...], dict[str, Any], DeploymentSettings]:
    """Parse ``gpupool ARGV`` with the real CLI (env as the process would have it), the command
    callbacks replaced by recorders, then resolve the settings the stage would run with
    (``files`` maps a --config path inside the deployment to the repository's file). Returns the
    leaf sub-command path, its converted params and those settings; fails the test with the CLI's
    own error (unknown command or option, bad value) or the settings' (missing file, invalid
    value, no Kafka)."""
    group = typer.main.get_command(app)
    seen: dict[tuple[str, ...], dict[str, Any]] = {}

    def patch(cmd: Any, path: tuple[str, ...]) -> None:
        cmd.callback = lambda **kw: seen.__setitem__(path, kw)
        for name, sub in getattr(cmd, "commands", {}).items():
            patch(sub, path + (name,))

    patch(group, ())
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("GPUPOOL_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        try:
            group.main(list(argv), prog_name="gpupool", standalone_mode=False)
        except Exception as exc:  # noqa: BLE001 — the CLI's usage errors, reported as the failure
            pytest.fail(f"{where}: `gpupool {shlex.join(argv)}` does not parse: {type(exc).__name__}: {exc}")
        leaf = max(seen, key=len)
        assert leaf in RUN_SETTINGS, f"{where}: `gpupool {shlex.join(argv)}` runs {leaf}, not a stage"
        params = dict(seen[leaf])
        config = params.pop("config")
        assert config is not None and str(config) in (files or {}), f"{where}: --config {config}?"
        settings = RUN_SETTINGS[leaf]((files or {})[str(config)], **params)
    assert settings.kafka, f"{where}: no Kafka configured"
    return leaf, params, settings


def _yaml_files() -> list[Path]:
    roots = [COMPOSE, K8S, SYSTEMD, REPO / "grafana" / "provisioning"]
    return sorted(p for r in roots for p in r.rglob("*") if p.suffix in (".yaml", ".yml"))


def _prometheus_jobs(path: Path) -> dict[str, list[str]]:
    conf = yaml.safe_load(path.read_text())
    return {
        job["job_name"]: [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        for job in conf["scrape_configs"]
    }


def _credential_sites(path: Path) -> dict[str, str]:
    """site → password of an mqtt-sites file."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            site, _, password = line.partition(":")
            out[site] = password
    return out


def _acl_users(path: Path) -> set[str]:
    return {line.split(" ", 1)[1] for line in path.read_text().splitlines() if line.startswith("user ")}


def _image_pinned(image: str) -> bool:
    """``name:tag`` with a version-like tag (a digit in it, not latest), or a digest."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag != "latest" and any(c.isdigit() for c in tag)


@pytest.fixture(scope="module", autouse=True)
def _build_validators_in_parallel() -> None:
    """Start the two Go builds together (about a minute on a fresh machine, cached afterwards in
    $GPUPOOL_CACHE and Go's build cache); the fixtures below then find the binaries ready.
    Failures are left to those fixtures, which report them."""
    if shutil.which("go") is None:
        return
    jobs = [
        subprocess.Popen(
            ["bash", str(script), str(arg)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=_clean_env(),
        )
        for script, arg in (
            (K8S / "validate.sh", K8S / "base"),
            (COMPOSE / "validate.sh", COMPOSE / "compose.yaml"),
        )
    ]
    for job in jobs:
        job.wait(timeout=900)


# every YAML parses --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: no YAML document"


# compose ------------------------------------------------------------------------------------------
def _compose_validate(file: Path) -> subprocess.CompletedProcess[str]:
    return _run_tool(["bash", str(COMPOSE / "validate.sh"), str(file)], env=_clean_env())


@pytest.fixture(scope="module")
def compose_model() -> dict[str, Any]:
    """compose.yaml as compose-go normalises it (interpolated with the defaults, paths absolute)."""
    done = _compose_validate(COMPOSE / "compose.yaml")
    if done.returncode == 3:
        _missing("go (to build the compose-go loader)")
    assert done.returncode == 0, f"compose-go rejects compose.yaml:\n{done.stderr}"
    return json.loads(done.stdout)


def test_compose_loader_rejects_invalid_files(tmp_path: Path, compose_model: dict[str, Any]) -> None:
    """The loader is a real schema check: a misspelt key and a value outside an enum both fail.
    (It does not check references between services: test_compose_mounts_and_dependencies does.)"""
    for broken, word in (("helthcheck", "helthcheck"), ("service_healty", "depends_on.topics-init.condition")):
        base = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
        analytics = base["services"]["analytics"]
        if broken == "helthcheck":
            analytics["helthcheck"] = analytics.pop("healthcheck")
        else:
            analytics["depends_on"]["topics-init"]["condition"] = "service_healty"
        (tmp_path / "broken.yaml").write_text(yaml.safe_dump(base))
        done = _compose_validate(tmp_path / "broken.yaml")
        assert done.returncode == 1 and word in done.stderr, done.stderr


def test_compose_stage_commands_parse(compose_model: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose_model["services"]
    kafka_env = services["kafka"]["environment"]
    assert "PLAINTEXT://kafka:9092" in kafka_env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert kafka_env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    init = services["topics-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy" and init["restart"] == "no"
    leaf, _, s = _parse_gpupool(
        init["command"], {}, monkeypatch, "compose service topics-init",
        {CONFIG_PATH: COMPOSE / "gpupool.toml"},
    )  # fmt: skip
    assert leaf == ("topics", "create") and s.kafka == "kafka:9092"
    leaves = {}
    for name in ("collectors", "analytics", "broker"):
        svc = services[name]
        env = {k: v for k, v in (svc.get("environment") or {}).items() if v is not None}
        files = {
            ref["target"]: Path(compose_model["configs"][ref["source"]]["file"])
            for ref in svc.get("configs", [])
        }
        assert files == {CONFIG_PATH: COMPOSE / "gpupool.toml"}, f"{name}: configs {files}"
        leaf, _, s = _parse_gpupool(svc["command"], env, monkeypatch, f"compose service {name}", files)
        leaves[leaf] = name
        port = STAGE_PORTS[leaf]
        assert _metrics_port(leaf, s) == port and s.metrics.addr == "0.0.0.0", name
        assert s.kafka == "kafka:9092", name
        probe = " ".join(svc["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/metrics" in probe, f"{name}: healthcheck {probe}"
        # every stage waits for the topics (created right, not auto-created) and so for Kafka
        assert svc["depends_on"]["topics-init"]["condition"] == "service_completed_successfully", name
        if leaf == ("collect", "run"):
            ((host, root),) = [r.split("=", 1) for r in s.collectors.sysfs_roots]
            dcgm = services["dcgm-exporter"]
            assert host == dcgm["environment"]["NODE_NAME"] == dcgm["hostname"], "host names differ"
            assert any(
                v["source"] == "/sys" and v["target"] == root and v.get("read_only") for v in svc["volumes"]
            ), "sysfs root is not the host's /sys, read-only"
            (target,) = s.collectors.dcgm_targets
            listen = dcgm["environment"]["DCGM_EXPORTER_LISTEN"]
            assert target == f"http://dcgm-exporter{listen}/metrics"
            spool = s.collectors.spool_dir
            assert spool is not None and any(
                v["type"] == "volume" and spool.is_relative_to(v["target"]) for v in svc["volumes"]
            ), "the spool is not on a volume"
        if leaf == ("analytics", "run"):
            db_dir = str(s.analytics_db.parent)
            assert any(v["type"] == "volume" and v["target"] == db_dir for v in svc["volumes"]), db_dir
        if leaf == ("broker", "run"):
            host, _, port_s = s.mqtt.partition(":")
            assert host in services and any(p["target"] == int(port_s) for p in services[host]["ports"])
            sh, dash_c, script, argv0 = svc["entrypoint"]
            assert (sh, dash_c, argv0) == ("/bin/sh", "-c", "gpupool")
            assert script.endswith('exec gpupool "$@"'), script
            secrets = {ref["source"]: ref["target"] for ref in svc["secrets"]}
            assert f'GPUPOOL_MQTT_PASSWORD="$(cat {secrets["mqtt-broker-password"]})"' in script
            assert s.mqtt_username == BROKER_USER and s.mqtt_root == DEFAULT_ROOT
    assert set(leaves) == set(STAGE_PORTS)


def test_compose_fabric_collector_runs_collect_run_fabric_alone(
    compose_model: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opt-in fabric collector: collect run --fabric with the shared settings, no GPU source,
    the MAD devices, scraped as gpupool-collectors when it runs."""
    svc = compose_model["services"]["fabric-collector"]
    assert svc["profiles"] == ["fabric"], "the fabric collector must be opt-in (one host per fabric)"
    env = {k: v for k, v in (svc.get("environment") or {}).items() if v is not None}
    files = {
        ref["target"]: Path(compose_model["configs"][ref["source"]]["file"]) for ref in svc.get("configs", [])
    }
    assert files == {CONFIG_PATH: COMPOSE / "gpupool.toml"}
    leaf, _, s = _parse_gpupool(svc["command"], env, monkeypatch, "compose service fabric-collector", files)
    cs = s.collectors
    assert leaf == ("collect", "run") and cs.fabric and s.kafka == "kafka:9092"
    sources = (cs.dcgm_targets, cs.sysfs_roots, cs.file_sd, cs.nvidia_smi, cs.nvml_host)
    assert sources == ([], [], [], [], None)
    assert cs.spool_dir is not None and any(
        v["type"] == "volume" and cs.spool_dir.is_relative_to(v["target"]) for v in svc["volumes"]
    ), "the spool is not on a volume"
    assert [d["source"] for d in svc["devices"]] == ["/dev/infiniband"]
    assert svc["depends_on"]["topics-init"]["condition"] == "service_completed_successfully"
    port = s.metrics.collectors
    assert f"http://127.0.0.1:{port}/metrics" in " ".join(svc["healthcheck"]["test"])
    (job,) = [
        j
        for j in yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["scrape_configs"]
        if j["job_name"] == "gpupool-collectors"
    ]
    assert job["dns_sd_configs"] == [{"names": ["fabric-collector"], "type": "A", "port": port}]


def test_compose_images_pinned_and_built(compose_model: dict[str, Any]) -> None:
    for name, svc in compose_model["services"].items():
        assert _image_pinned(svc["image"]), f"{name}: image {svc['image']} is not pinned"
        if "build" in svc:
            assert (
                Path(svc["build"]["context"]) / svc["build"]["dockerfile"]
            ).resolve() == DEPLOY / "Dockerfile"


def test_compose_mounts_and_dependencies(compose_model: dict[str, Any]) -> None:
    services = compose_model["services"]
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            if vol["type"] == "bind":
                src = Path(vol["source"])
                if src.is_relative_to(REPO):
                    assert src.exists(), f"{name}: bind source {src} does not exist"
                else:
                    assert str(src) in ("/sys", "/proc") and vol.get("read_only"), f"{name}: {src}"
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, it has none"
            if spec["condition"] == "service_completed_successfully":
                assert services[dep].get("restart") == "no", f"{dep} is a one-shot job"
        for ref in svc.get("secrets", []):
            assert ref["source"] in compose_model["secrets"], f"{name}: unknown secret {ref['source']}"
        for vol in svc.get("volumes", []):
            if vol["type"] == "volume":
                assert vol["source"] in compose_model["volumes"], f"{name}: unknown volume {vol['source']}"
    # compose-go drops a depends_on entry naming no service: check the file as written too.
    raw = yaml.safe_load((COMPOSE / "compose.yaml").read_text())["services"]
    for name, svc in raw.items():
        assert set(svc.get("depends_on", {})) <= set(raw), f"{name}: depends_on an unknown service"
    for secret in compose_model["secrets"].values():
        assert Path(secret["file"]).is_file()


def test_compose_prometheus_and_grafana(compose_model: dict[str, Any]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        _missing("promtool (Debian prometheus, deploy/local/install-system.sh)")
    done = _run_tool([promtool, "check", "config", str(COMPOSE / "prometheus.yml")])
    assert done.returncode == 0, done.stdout + done.stderr
    services = compose_model["services"]
    jobs = _prometheus_jobs(COMPOSE / "prometheus.yml")
    assert set(jobs) == set(_prometheus_jobs(DEPLOY / "prometheus" / "prometheus.yml")), "job names"
    ports = {
        "dcgm-exporter": 9400,
        "node-exporter": 9100,
        **{STAGE_JOBS[k]: v for k, v in STAGE_PORTS.items()},
    }
    service_of = {
        "gpupool-collectors": "collectors",
        "gpupool-analytics": "analytics",
        "gpupool-broker": "broker",
        "dcgm-exporter": "dcgm-exporter",
        "node-exporter": "node-exporter",
    }
    for job, targets in jobs.items():
        assert targets == [f"{service_of[job]}:{ports[job]}"], job
    prom = services["prometheus"]
    mounts = {v["source"]: v["target"] for v in prom["volumes"] if v["type"] == "bind"}
    assert mounts[str(COMPOSE / "prometheus.yml")] in " ".join(prom["command"])
    rules_dir = mounts[str(DEPLOY / "prometheus" / "rules")]
    assert yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["rule_files"] == [f"{rules_dir}/*.yml"]

    ours = yaml.safe_load((COMPOSE / "grafana" / "datasources" / "prometheus.yaml").read_text())
    repo = yaml.safe_load((REPO / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ours["datasources"][0].pop("url") == "http://prometheus:9090"
    repo["datasources"][0].pop("url")
    assert ours == repo
    graf = {v["source"]: v["target"] for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    provider = yaml.safe_load((REPO / "grafana" / "provisioning" / "dashboards" / "gpupool.yaml").read_text())
    assert graf[str(REPO / "grafana" / "dashboards")] == provider["providers"][0]["options"]["path"]


# Mosquitto credentials and ACL -------------------------------------------------------------------
CREDENTIAL_DIRS = {
    "compose": (COMPOSE / "credentials", DEPLOY / "mosquitto" / "acl"),
    "kubernetes-base": (K8S / "base" / "credentials", K8S / "base" / "mosquitto" / "acl"),
    "kubernetes-example": (
        K8S / "overlays" / "example" / "credentials",
        K8S / "overlays" / "example" / "acl",
    ),
}


@pytest.mark.parametrize("name", sorted(CREDENTIAL_DIRS))
def test_committed_credentials_are_placeholders_matching_the_acl(name: str) -> None:
    creds, acl = CREDENTIAL_DIRS[name]
    sites = _credential_sites(creds / "mqtt-sites")
    assert sites and all(PLACEHOLDER in pw for pw in sites.values()), f"{name}: a real password?"
    assert PLACEHOLDER in (creds / "mqtt-broker-password").read_text()
    assert _acl_users(acl) == {BROKER_USER, OBSERVER_USER, *sites}, f"{name}: ACL users vs mqtt-sites"
    assert acl.read_text() == render_acl(DEFAULT_ROOT, list(sites), BROKER_USER), f"{name}: ACL not rendered"


def _mosquitto_init(
    tmp_path: Path, sites: str, broker_pw: str = "s3cret-broker"
) -> tuple[subprocess.CompletedProcess[str], Path]:
    if shutil.which("mosquitto_passwd") is None:
        _missing("mosquitto_passwd (Debian mosquitto, deploy/local/install-system.sh)")
    src, creds, out = tmp_path / "src", tmp_path / "creds", tmp_path / "out"
    for d in (src, creds, out):
        d.mkdir()
    shutil.copy(DEPLOY / "mosquitto" / "mosquitto.conf", src)
    shutil.copy(DEPLOY / "mosquitto" / "acl", src)
    (creds / "mqtt-broker-password").write_text(broker_pw + "\n")
    (creds / "mqtt-sites").write_text(sites)
    env = {
        **_clean_env(),
        "GPUPOOL_MQTT_SOURCE": str(src),
        "GPUPOOL_MQTT_CREDENTIALS": str(creds),
        "GPUPOOL_MQTT_CONFIG": str(out),
    }
    return _run_tool(["sh", str(COMPOSE / "mosquitto-init.sh")], env=env, timeout=60), out


def test_mosquitto_init_writes_hashed_passwords(tmp_path: Path) -> None:
    done, out = _mosquitto_init(tmp_path, "# sites\nedge-a:pw-a\n\nedge-b:pw:with:colons\nedge-c:pw-c")
    assert done.returncode == 0, done.stderr
    lines = (out / "passwd").read_text().splitlines()
    users = [line.split(":", 1)[0] for line in lines]
    assert users == [BROKER_USER, "edge-a", "edge-b", "edge-c"]
    assert all(line.split(":", 1)[1].startswith("$7$") for line in lines), "not PBKDF2-SHA512 hashes"
    assert "pw-a" not in (out / "passwd").read_text()
    assert (out / "acl").read_bytes() == (DEPLOY / "mosquitto" / "acl").read_bytes()
    assert (out / "mosquitto.conf").read_bytes() == (DEPLOY / "mosquitto" / "mosquitto.conf").read_bytes()
    for f in ("passwd", "acl", "mosquitto.conf"):
        assert stat.S_IMODE((out / f).stat().st_mode) == 0o600, f
    assert sorted(p.name for p in out.iterdir()) == ["acl", "mosquitto.conf", "passwd"], "temp files left"


@pytest.mark.parametrize(
    ("sites", "broker_pw", "error"),
    [
        ((COMPOSE / "credentials" / "mqtt-sites").read_text(), "s3cret", PLACEHOLDER),
        ("edge-a:pw\n", "REPLACE-ME-too", PLACEHOLDER),
        ("edge-a:pw\nedge-z:pw\n", "s3cret", "no 'user edge-z' block"),
        ("edge-a:pw\nedge/b:pw\n", "s3cret", "invalid site name"),
        ("edge-a:pw\nedge-a:pw2\n", "s3cret", "duplicate site"),
        ("edge-a\n", "s3cret", "expected SITE:PASSWORD"),
        (f"{BROKER_USER}:pw\n", "s3cret", "broker's user"),
        ("# nobody\n", "s3cret", "no site"),
        ("edge-a:pw\n", "", "empty"),
    ],
)
def test_mosquitto_init_refuses_bad_credentials(
    tmp_path: Path, sites: str, broker_pw: str, error: str
) -> None:
    done, out = _mosquitto_init(tmp_path, sites, broker_pw)
    assert done.returncode == 1 and error in done.stderr, done.stderr
    assert list(out.iterdir()) == [], "wrote files despite refusing"


# Kubernetes ---------------------------------------------------------------------------------------
def _load_sync() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpupool_k8s_sync", K8S / "sync.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _k8s_build(directory: Path) -> subprocess.CompletedProcess[str]:
    return _run_tool(["bash", str(K8S / "validate.sh"), str(directory)], env=_clean_env())


@pytest.fixture(scope="module", params=["base", "overlays/example"])
def k8s(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(name, objects) of a kustomization built and strictly decoded by validate.sh."""
    done = _k8s_build(K8S / request.param)
    if done.returncode == 3:
        _missing("go (to build deploy/kubernetes/validate)")
    assert done.returncode == 0, f"{request.param}:\n{done.stderr}"
    return request.param, [d for d in yaml.safe_load_all(done.stdout) if d]


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _expand_k8s(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of container command/args: $(VAR) → value, $$ → $; an undefined
    $(VAR) stays as it is (fails the parse check later by not resolving)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


def _container_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    configmaps = _by_kind(objects, "ConfigMap")
    secrets = _by_kind(objects, "Secret")
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in configmaps, f"envFrom ConfigMap {ref} is not in the build"
        env.update(configmaps[ref]["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            env[var["name"]] = "gpu-node-1"
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]]["data"]
            env[var["name"]] = "secret"
    return env


def test_k8s_copies_are_current() -> None:
    assert _load_sync().stale() == [], "run: python deploy/kubernetes/sync.py"


def test_k8s_validator_rejects_invalid_objects(tmp_path: Path, k8s: tuple[str, list[dict[str, Any]]]) -> None:
    """The strict decode is a real check: a misspelt field, a string port and an unknown kind fail."""
    base = tmp_path / "base"
    shutil.copytree(K8S / "base", base)
    sts = base / "analytics" / "statefulset.yaml"
    sts.write_text(sts.read_text().replace("readOnlyRootFilesystem", "readOnlyRootFileSystem", 1))
    svc = base / "broker" / "service.yaml"
    svc.write_text(svc.read_text().replace("port: 9412", 'port: "9412"'))
    sm = base / "monitoring" / "servicemonitors.yaml"
    sm.write_text(sm.read_text().replace("kind: ServiceMonitor", "kind: ServiceMonitr", 1))
    done = _k8s_build(base)
    assert done.returncode == 1, done.stderr
    for expected in ("readOnlyRootFileSystem", "Service gpupool/gpupool-broker", "ServiceMonitr"):
        assert expected in done.stderr, done.stderr


def _configmap_files(
    container: dict[str, Any], pod: dict[str, Any], objects: list[dict[str, Any]], tmp_path: Path
) -> dict[str, Path]:
    """Every file a container sees from a ConfigMap volume (mount path/key) → a local copy."""
    configmaps = _by_kind(objects, "ConfigMap")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out: dict[str, Path] = {}
    for m in container.get("volumeMounts", []):
        ref = volumes.get(m["name"], {}).get("configMap")
        if ref is None:
            continue
        for key, text in configmaps[ref["name"]]["data"].items():
            local = tmp_path / ref["name"] / key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(text)
            out[f"{m['mountPath']}/{key}"] = local
    return out


def test_k8s_stage_args_parse(
    k8s: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    name, objects = k8s
    config = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("gpupool-config")
    )
    shipped = K8S / ("overlays/example/gpupool.toml" if "overlay" in name else "base/config/gpupool.toml")
    assert config["data"] == {"gpupool.toml": shipped.read_text()}, f"{name}: gpupool-config is not {shipped}"
    toml = tomllib.loads(shipped.read_text())
    expected = {
        "gpupool-collectors": ("collect", "run"),
        "gpupool-fabric-collector": ("collect", "run"),
        "gpupool-analytics": ("analytics", "run"),
        "gpupool-broker": ("broker", "run"),
    }
    seen = set()
    for wl in _workloads(objects):
        for c in wl["spec"]["template"]["spec"]["containers"]:
            if "gpupool" not in c["image"].rsplit("/", 1)[-1].split(":")[0]:
                continue
            env = _container_env(c, objects)
            argv = [_expand_k8s(a, env) for a in c["args"]]
            assert not [a for a in argv if "$(" in a], f"{name}: unresolved $(VAR) in {argv}"
            if "command" in c:
                sh, dash_c, script, argv0 = [_expand_k8s(a, env) for a in c["command"]]
                assert (sh, dash_c, argv0) == ("/bin/sh", "-c", "gpupool") and script.endswith(
                    'exec gpupool "$@"'
                )
                found = re.search(r'GPUPOOL_MQTT_PASSWORD="\$\(cat (\S+)\)"', script)
                assert found, script
                path = found.group(1)
                assert any(path.startswith(m["mountPath"] + "/") for m in c["volumeMounts"]), path
                env["GPUPOOL_MQTT_PASSWORD"] = "secret"
            files = _configmap_files(c, wl["spec"]["template"]["spec"], objects, tmp_path)
            assert CONFIG_PATH in files, f"{name} {wl['metadata']['name']}: no {CONFIG_PATH} mounted"
            leaf, _, s = _parse_gpupool(
                argv, env, monkeypatch, f"{name} {wl['kind']} {wl['metadata']['name']}", files
            )
            assert leaf == expected[wl["metadata"]["name"]], (wl["metadata"]["name"], leaf)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert _metrics_port(leaf, s) == ports["metrics"] == STAGE_PORTS[leaf]
            assert s.metrics.addr == "0.0.0.0"
            assert s.kafka == toml["kafka"] and s.topic_prefix == toml["topic_prefix"]
            assert s.idle.pool == ("training-a" if "overlay" in name else "default")
            if wl["metadata"]["name"] == "gpupool-fabric-collector":
                cs = s.collectors
                assert cs.fabric and not (cs.dcgm_targets or cs.sysfs_roots or cs.file_sd), cs
            elif leaf == ("collect", "run"):
                assert not s.collectors.fabric, "every collectors pod would read the whole fabric"
                volumes = {v["name"]: v for v in wl["spec"]["template"]["spec"]["volumes"]}
                spool_dir = s.collectors.spool_dir
                assert spool_dir is not None
                (spool,) = [m for m in c["volumeMounts"] if spool_dir.is_relative_to(m["mountPath"])]
                assert not spool.get("readOnly") and "emptyDir" in volumes[spool["name"]], spool
            if leaf == ("broker", "run"):
                assert s.mqtt_password is not None and s.mqtt_password.get_secret_value() == "secret"
            seen.add(leaf)
    assert seen == set(STAGE_PORTS), f"{name}: stages deployed {seen}"


def test_k8s_references_resolve(k8s: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = k8s
    configmaps, secrets = _by_kind(objects, "ConfigMap"), _by_kind(objects, "Secret")
    pvcs = _by_kind(objects, "PersistentVolumeClaim")
    for wl in _workloads(objects):
        where = f"{name} {wl['kind']} {wl['metadata']['name']}"
        spec = wl["spec"]
        assert (
            spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        ), where
        pod = spec["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        volumes.update({t["metadata"]["name"]: t for t in spec.get("volumeClaimTemplates", [])})
        for v in pod.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, f"{where}: {v}"
            if "secret" in v:
                keys = secrets[v["secret"]["secretName"]]["data"]
                assert all(i["key"] in keys for i in v["secret"].get("items", [])), f"{where}: {v}"
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, f"{where}: {v}"
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert _image_pinned(c["image"]), f"{where}: image {c['image']} not pinned"
            _container_env(c, objects)
            ports = {p["name"] for p in c.get("ports", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{where}: mount of unknown volume {m['name']}"
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in c:
                    port = (c[probe].get("httpGet") or c[probe].get("tcpSocket"))["port"]
                    assert port in ports, f"{where}: {probe} on unknown port {port}"
            sc = c.get("securityContext", {})
            if sc.get("privileged"):  # only to open the host's InfiniBand MAD devices
                assert wl["metadata"]["name"] == "gpupool-fabric-collector", where
                continue
            assert (
                sc.get("allowPrivilegeEscalation") is False or "SYS_ADMIN" in sc["capabilities"]["add"]
            ), where
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {})), f"{where} takes GPUs"


def test_k8s_services_and_servicemonitors(k8s: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = k8s
    pods = [wl["spec"]["template"] for wl in _workloads(objects)]
    services = _by_kind(objects, "Service")
    for svc_name, svc in services.items():
        targets = [p for p in pods if _matches(svc["spec"]["selector"], p["metadata"]["labels"])]
        assert targets, f"{name}: Service {svc_name} selects no pod"
        named = {p["name"] for t in targets for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"{name}: {svc_name} → {port['targetPort']}"
    jobs = set()
    for sm_name, sm in _by_kind(objects, "ServiceMonitor").items():
        selected = [
            s
            for s in services.values()
            if _matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert len(selected) == 1, f"{name}: ServiceMonitor {sm_name} selects {len(selected)} Services"
        (svc,) = selected
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]}, f"{sm_name}: {ep['port']}"
        jobs.add(svc["metadata"]["labels"][sm["spec"]["jobLabel"]])
    prom_jobs = set(_prometheus_jobs(DEPLOY / "prometheus" / "prometheus.yml"))
    assert jobs == {*STAGE_JOBS.values(), "dcgm-exporter"} and jobs <= prom_jobs, jobs


def test_k8s_stage_shapes(k8s: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Broker: one replica, Recreate. Analytics: StatefulSet, the DuckDB file on its claim.
    Collectors: DaemonSet on GPU nodes, host /sys read-only, dcgm-exporter beside it on 9400,
    both naming the node the same way."""
    name, objects = k8s
    (broker,) = [w for w in _workloads(objects) if w["metadata"]["name"] == "gpupool-broker"]
    assert broker["kind"] == "Deployment" and broker["spec"]["replicas"] == 1
    assert broker["spec"]["strategy"]["type"] == "Recreate"
    (analytics,) = _by_kind(objects, "StatefulSet").values()
    (claim,) = analytics["spec"]["volumeClaimTemplates"]
    (container,) = analytics["spec"]["template"]["spec"]["containers"]
    db = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--db="))
    mount = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert Path(db).parent == Path(mount["mountPath"]), (db, mount)
    assert analytics["spec"]["serviceName"] in _by_kind(objects, "Service")

    (ds,) = _by_kind(objects, "DaemonSet").values()
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"], "collectors must be limited to GPU nodes"
    by_name = {c["name"]: c for c in pod["containers"]}
    coll, dcgm = by_name["collectors"], by_name["dcgm-exporter"]
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in coll["args"] if a.startswith("--")}
    host, root = args["--sysfs-root"].split("=", 1)
    assert host == "$(NODE_NAME)"
    for c in (coll, dcgm):
        node = next(e for e in c["env"] if e["name"] == "NODE_NAME")
        assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    sys_mount = next(m for m in coll["volumeMounts"] if m["mountPath"] == root)
    sys_volume = next(v for v in pod["volumes"] if v["name"] == sys_mount["name"])
    assert sys_volume["hostPath"]["path"] == "/sys" and sys_mount["readOnly"] is True
    dcgm_port = next(p["containerPort"] for p in dcgm["ports"])
    listen = next(e["value"] for e in dcgm["env"] if e["name"] == "DCGM_EXPORTER_LISTEN")
    assert args["--dcgm-target"] == f"http://localhost:{dcgm_port}/metrics" and listen == f":{dcgm_port}"

    # the fabric collector: one replica, never two at once, on a labelled node, with the MAD devices
    fabric = _by_kind(objects, "Deployment")["gpupool-fabric-collector"]
    assert fabric["spec"]["replicas"] == 1 and fabric["spec"]["strategy"]["type"] == "Recreate"
    pod = fabric["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpupool.io/fabric-collector": "true"}
    (c,) = pod["containers"]
    dev = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/infiniband")
    volume = next(v for v in pod["volumes"] if v["name"] == dev["name"])
    assert volume["hostPath"]["path"] == "/dev/infiniband"


def test_k8s_prometheusrules_wrap_the_rule_files(k8s: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = k8s
    sync = _load_sync()
    rules = _by_kind(objects, "PrometheusRule")
    files = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
    assert set(rules) == {sync.rule_name(f) for f in files}
    for f in files:
        assert rules[sync.rule_name(f)]["spec"]["groups"] == yaml.safe_load(f.read_text())["groups"], f.name


def test_k8s_mosquitto_and_dashboards(k8s: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = k8s
    configmaps = _by_kind(objects, "ConfigMap")
    mosq = next(c for n, c in configmaps.items() if n.startswith("gpupool-mosquitto"))
    assert set(mosq["data"]) == {"mosquitto.conf", "acl", "mosquitto-init.sh"}
    acl = CREDENTIAL_DIRS["kubernetes-example" if "overlay" in name else "kubernetes-base"][1]
    assert mosq["data"]["acl"] == acl.read_text()
    secret = next(
        s for n, s in _by_kind(objects, "Secret").items() if n.startswith("gpupool-mqtt-credentials")
    )
    assert set(secret["data"]) == {"mqtt-broker-password", "mqtt-sites"}
    (dep,) = [w for w in _workloads(objects) if w["metadata"]["name"] == "gpupool-mosquitto"]
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert init["command"] == ["/bin/sh", f"{env['GPUPOOL_MQTT_SOURCE']}/mosquitto-init.sh"]
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts[env["GPUPOOL_MQTT_SOURCE"]]]["configMap"]["name"] == mosq["metadata"]["name"]
    assert (
        volumes[mounts[env["GPUPOOL_MQTT_CREDENTIALS"]]]["secret"]["secretName"] == secret["metadata"]["name"]
    )
    dashboards = configmaps["gpupool-dashboards"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for f in sorted((REPO / "grafana" / "dashboards").glob("*.json")):
        assert json.loads(dashboards["data"][f.name]) == json.loads(f.read_text()), f.name


# systemd ------------------------------------------------------------------------------------------
UNITS = sorted(SYSTEMD.glob("*.service"))


def _unit(path: Path) -> dict[str, list[str]]:
    """Key → values of a unit file's [Service] section (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}{key}", []).append(value)
    return out


def _env_file(path: Path) -> dict[str, str]:
    pairs = (
        line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
    )
    return {k: v for k, v in pairs}


@pytest.fixture(scope="module")
def gpupool_bin() -> str:
    found = Path(sys.executable).parent / "gpupool"
    assert found.is_file(), f"no gpupool entry point beside {sys.executable}"
    return str(found)


def test_systemd_units_verify(tmp_path: Path, gpupool_bin: str) -> None:
    """systemd-analyze verify, with ExecStart's /usr/local/bin/gpupool (the install target, absent
    here) replaced by this environment's entry point; verify prints warnings but exits 0 for
    unknown keys and bad values, so any output fails."""
    tool = shutil.which("systemd-analyze")
    if tool is None:
        _missing("systemd-analyze")
    for unit in UNITS:
        (tmp_path / unit.name).write_text(unit.read_text().replace("/usr/local/bin/gpupool", gpupool_bin))
    done = _run_tool([tool, "verify", *(str(tmp_path / u.name) for u in UNITS)], timeout=120)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
    bad = tmp_path / "bad.service"
    bad.write_text(
        (tmp_path / UNITS[0].name).read_text().replace("ProtectSystem=strict", "ProtectSystem=stric")
    )
    done = _run_tool([tool, "verify", str(bad)], timeout=120)
    assert "stric" in done.stderr, "verify no longer reports bad values: the check above is blind"
    for unit in UNITS:
        done = _run_tool(
            [tool, "security", "--offline=true", "--threshold=20", "--no-pager", str(tmp_path / unit.name)],
            timeout=120,
        )
        assert done.returncode == 0, f"{unit.name}: exposure above 2.0\n{done.stdout[-600:]}"


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_execstart_parses(unit: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = _unit(unit)
    assert conf["[Service]EnvironmentFile"] == ["/etc/gpupool/gpupool.env"]
    env: dict[str, str] = {}
    for line in conf["[Service]Environment"]:
        for assignment in shlex.split(line):
            key, _, value = assignment.partition("=")
            env[key] = value
    env.update(_env_file(SYSTEMD / "gpupool.env.example"))
    (exec_start,) = conf["[Service]ExecStart"]
    argv = shlex.split(exec_start)
    assert argv[0] == "/usr/local/bin/gpupool"
    used = set(re.findall(r"\$\{(\w+)\}", exec_start))
    assert used <= env.keys(), f"{unit.name}: undefined {used - env.keys()}"
    specifiers = {"%H": "gpu-node-1", "%S": "/var/lib"}
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in argv[1:]]
    argv = [re.sub(r"%[HS]", lambda m: specifiers[m.group(0)], a) for a in argv]
    leaf, _, s = _parse_gpupool(argv, env, monkeypatch, unit.name, {CONFIG_PATH: SYSTEMD / "gpupool.toml"})
    fabric = unit.name == "gpupool-fabric-collector.service"
    if fabric:  # beside gpupool-collectors on one host: its own port, listed in prometheus.yml
        assert leaf == ("collect", "run") and s.metrics.collectors == 9413
        prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
        (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == STAGE_JOBS[leaf]]
        assert any("gpupool-fabric-collector" in f for sd in job["file_sd_configs"] for f in sd["files"])
        assert conf["[Service]SupplementaryGroups"] == ["gpupool-ib"]
        rules = (SYSTEMD / "90-gpupool-umad.rules").read_text()
        assert 'GROUP="gpupool-ib"' in rules and 'KERNEL=="umad*"' in rules
    else:
        assert unit.name == f"{STAGE_JOBS[leaf]}.service"
        assert _metrics_port(leaf, s) == STAGE_PORTS[leaf]
    for key, value in {
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "NoNewPrivileges": "yes",
        "Restart": "on-failure",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }.items():
        assert conf[f"[Service]{key}"] == [value], f"{unit.name}: {key}"
    if leaf == ("analytics", "run"):
        (state,) = conf["[Service]StateDirectory"]
        assert s.analytics_db.parent == Path("/var/lib") / state
    if leaf == ("collect", "run"):
        cs = s.collectors
        if fabric:
            assert cs.fabric and not (cs.dcgm_targets or cs.sysfs_roots or cs.file_sd), cs
        else:
            assert cs.sysfs_roots == ["gpu-node-1=/sys"] and not cs.fabric
        (state,) = conf["[Service]StateDirectory"]
        assert s.collectors.spool_dir is not None
        assert s.collectors.spool_dir.is_relative_to(Path("/var/lib") / state)
    if leaf == ("broker", "run"):
        assert "--password" not in argv, "the password must not be on the command line"
        assert s.mqtt_password is not None
        assert s.mqtt_password.get_secret_value() == env["GPUPOOL_MQTT_PASSWORD"]


@pytest.mark.parametrize("path", SETTINGS_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_shipped_settings_files_are_complete_and_valid(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each deployment's one gpupool.toml loads with the stages' own checks (idle thresholds,
    broker times), names Kafka, sets no secret, and writes the metrics ports Prometheus scrapes."""
    for key in [k for k in os.environ if k.startswith("GPUPOOL_")]:
        monkeypatch.delenv(key)
    s = load_settings(path)
    assert s.kafka and s.mqtt_password is None, path
    assert (s.metrics.collectors, s.metrics.analytics, s.metrics.broker) == tuple(STAGE_PORTS.values())
    assert "mqtt_password" not in tomllib.loads(path.read_text()), f"{path}: a secret in the settings file"


# Dockerfile ---------------------------------------------------------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, rest = line.partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


def test_dockerfile_installs_the_package() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    instructions = _dockerfile()
    args = {k: v for k, _, v in (r.partition("=") for i, r in instructions if i == "ARG")}
    froms = [r.split()[0] for i, r in instructions if i == "FROM"]
    assert froms == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", args["PYTHON_IMAGE"]), args["PYTHON_IMAGE"]
    copied: set[str] = set()
    for instr, rest in instructions:
        if instr == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY source {src} does not exist"
                copied.add(src)
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", pyproject["project"]["readme"]} <= copied, packages - copied
    (entry,) = [json.loads(r) for i, r in instructions if i == "ENTRYPOINT"]
    assert entry == list(pyproject["project"]["scripts"]), entry
    user = [r for i, r in instructions if i == "USER"]
    assert user and not user[-1].startswith("0") and user[-1] != "root"


def test_k8s_topics_job_creates_the_topics_from_the_shipped_settings(
    k8s: tuple[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The one-shot Job runs `gpupool topics create` with the deployment's gpupool.toml (same
    Kafka and topic prefix as the stages), retries on failure and never runs as root."""
    name, objects = k8s
    (job,) = [o for o in objects if o["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure" and pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    files = _configmap_files(c, pod, objects, tmp_path)
    leaf, params, s = _parse_gpupool(list(c["args"]), {}, monkeypatch, f"{name} Job", files)
    shipped = K8S / ("overlays/example/gpupool.toml" if "overlay" in name else "base/config/gpupool.toml")
    toml = tomllib.loads(shipped.read_text())
    assert leaf == ("topics", "create") and params["partitions"] >= 1
    assert s.kafka == toml["kafka"] and s.topic_prefix == toml["topic_prefix"]
