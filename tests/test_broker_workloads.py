"""Workload profiles (broker/workloads.py): validation, per-site permission, ports, rendering."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from broker.workloads import WorkloadError, WorkloadProfile, allowed, pick_port, render

SERVER = WorkloadProfile(
    name="sim-inference",
    argv=("python3", "-m", "simulator.inference_server", "--port", "{port}", "--tag", "{site}/{lease_id}/{gpus}"),
    port_min=18000,
    port_max=18002,
    sites=("edge-a", "edge-b"),
)


def test_render_replaces_every_field_and_nothing_else() -> None:
    argv = render(SERVER, port=18001, lease_id="l-1", site="edge-a", gpus=4)
    assert argv == ("python3", "-m", "simulator.inference_server", "--port", "18001", "--tag", "edge-a/l-1/4")


def test_a_site_can_only_name_an_allowed_profile() -> None:
    assert allowed([SERVER], "edge-b", "sim-inference") is SERVER
    with pytest.raises(WorkloadError, match="not allowed to site 'edge-c'"):
        allowed([SERVER], "edge-c", "sim-inference")
    with pytest.raises(WorkloadError, match="unknown workload profile 'rm -rf /'"):
        allowed([SERVER], "edge-a", "rm -rf /")
    open_profile = SERVER.model_copy(update={"sites": ()})
    assert allowed([open_profile], "edge-z", "sim-inference") is open_profile


def test_ports_lowest_free_and_exhaustion() -> None:
    assert pick_port(SERVER, []) == 18000
    assert pick_port(SERVER, [18000]) == 18001
    assert pick_port(SERVER, [18000, 18001]) == 18002  # the range's last port is used
    with pytest.raises(WorkloadError, match="every port 18000-18002 is in use"):
        pick_port(SERVER, [18000, 18001, 18002])


@pytest.mark.parametrize(
    "bad",
    [
        {"argv": ("x", "{port.__class__}")},  # attribute access in a template
        {"argv": ("x", "{env}")},  # an unknown field
        {"argv": ("x", "{")},  # a broken template
        {"argv": ()},
        {"port_min": 18003, "port_max": 18002},
        {"port_min": 80},
        {"name": "Has Space"},
        {"health_path": "health"},
        {"unexpected": 1},
    ],
)
def test_invalid_profiles_are_refused(bad: dict[str, object]) -> None:
    fields = SERVER.model_dump() | bad
    with pytest.raises(ValidationError):
        WorkloadProfile(**fields)


def test_a_one_port_range_is_valid() -> None:
    p = SERVER.model_copy(update={"port_max": 18000})
    WorkloadProfile(**p.model_dump())
    assert pick_port(p, []) == 18000
