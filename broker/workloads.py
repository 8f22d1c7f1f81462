"""Workload profiles: what runs on a lease's GPUs, declared by the operator, never sent by a site.

A profile is an argv template, a port range, a health check and resource limits. A claim names a
profile (``Claim.workload``); the broker checks that the site may use it, renders the argv for
the lease (:func:`render`) and hands it to the training scheduler, which runs it on the held GPUs
(:class:`broker.scheduler.HoldRequest.command`). A site can choose among the profiles allowed to
it and nothing else: no command, argument, environment or path comes from a claim.

Template fields (Python ``str.format`` names, each replaced by a value the broker computes):
``{port}`` (the port chosen for the lease from the profile's range), ``{lease_id}``, ``{site}``,
``{gpus}`` (GPU count). Anything else in braces is an error when the profile is loaded.

Where it runs: on Slurm, in the lease's placeholder job on the host (the argv names programs of
the node); on Kubernetes, as the container of the lease's pod (:mod:`broker.lending_kubernetes`),
in the profile's ``image`` with its ``host_paths`` mounted read-only.

CPUs: Slurm reserves CPUs with the placeholder jobs that hold the GPUs, before any claim names a
profile, so every placeholder asks for :func:`placeholder_cpus` (the largest ``cpus_per_gpu`` of
the declared profiles, at least the scheduler's default); a lease's workload is told its own
budget, ``cpus_per_gpu`` × its GPUs on the node (:func:`broker.placeholders.start_script`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import string
import time
from collections.abc import Callable, Collection

import httpx

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TEMPLATE_FIELDS = frozenset({"port", "lease_id", "site", "gpus"})
"""The names a profile's argv template may use."""


class WorkloadError(ValueError):
    """A profile is invalid, unknown, not allowed to the site, or has no free port."""


class WorkloadProfile(BaseModel):
    """One operator-declared workload.

    Attributes:
        name: profile name a claim uses (``[a-z0-9][a-z0-9._-]{0,62}``).
        argv: the command as an argument list, with template fields (module docstring); run
            without a shell.
        port_min, port_max: the inclusive port range the workload listens on; one port per live
            lease of this profile on a node.
        health_path: HTTP path answering 200 when the workload serves (``/health``).
        health_timeout_s: seconds after the hold starts within which the health check must pass,
            or the lease's endpoint is reported unhealthy.
        cpus_per_gpu: CPUs per GPU the workload may use: Slurm reserves at least this many per
            held GPU (:func:`placeholder_cpus`), and the workload is told
            ``cpus_per_gpu`` × its GPUs on the node (``GPUPOOL_CPUS``, ``OMP_NUM_THREADS``).
        sites: the sites allowed to use it; empty: every site.
        image: the container image the workload runs in on Kubernetes (the site's serving image;
            pulled by the kubelet as any pod's image, ``IfNotPresent``). Required there, unused
            on Slurm.
        host_paths: absolute paths of the node mounted read-only at the same path in the
            workload's container on Kubernetes (``hostPath`` volumes): for an image that brings
            no program of its own (the local node's, deploy/local/kubelet.sh). Unused on Slurm.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")
    argv: tuple[str, ...] = Field(min_length=1)
    port_min: int = Field(ge=1024, le=65535)
    port_max: int = Field(ge=1024, le=65535)
    health_path: str = Field(default="/health", pattern=r"^/[A-Za-z0-9._~/-]*$")
    health_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    cpus_per_gpu: int = Field(default=1, ge=1, le=256)
    sites: tuple[str, ...] = ()
    image: str | None = Field(default=None, min_length=1)
    host_paths: tuple[str, ...] = ()

    @field_validator("host_paths")
    @classmethod
    def _absolute_paths(cls, paths: tuple[str, ...]) -> tuple[str, ...]:
        for path in paths:
            if not path.startswith("/") or "\x00" in path or ".." in path.split("/"):
                raise ValueError(f"host path {path!r}: an absolute path without '..'")
        return paths

    @field_validator("argv")
    @classmethod
    def _template_fields_known(cls, argv: tuple[str, ...]) -> tuple[str, ...]:
        for arg in argv:
            try:
                names = {f for _, f, _, _ in string.Formatter().parse(arg) if f is not None}
            except ValueError as e:
                raise ValueError(f"argument {arg!r}: {e}") from e
            unknown = names - TEMPLATE_FIELDS
            if unknown:
                raise ValueError(
                    f"argument {arg!r} uses {sorted(unknown)}; allowed: {sorted(TEMPLATE_FIELDS)}"
                )
        return argv

    @model_validator(mode="after")
    def _port_range(self) -> WorkloadProfile:
        if self.port_max < self.port_min:
            raise ValueError(f"port_max {self.port_max} < port_min {self.port_min}")
        return self


def allowed(profiles: Collection[WorkloadProfile], site: str, name: str) -> WorkloadProfile:
    """The profile ``name`` if ``site`` may use it. Raises :class:`WorkloadError` naming the
    reason: unknown profile, or not allowed to this site."""
    for p in profiles:
        if p.name == name:
            if p.sites and site not in p.sites:
                raise WorkloadError(f"workload profile {name!r} is not allowed to site {site!r}")
            return p
    raise WorkloadError(f"unknown workload profile {name!r}")


def pick_port(profile: WorkloadProfile, in_use: Collection[int]) -> int:
    """The lowest port of ``profile``'s range not in ``in_use`` (the ports of the profile's live
    leases on the same node). Raises :class:`WorkloadError` when every port is taken."""
    taken = set(in_use)
    for port in range(profile.port_min, profile.port_max + 1):
        if port not in taken:
            return port
    raise WorkloadError(
        f"workload profile {profile.name!r}: every port {profile.port_min}-{profile.port_max} is in use"
    )


def render(profile: WorkloadProfile, *, port: int, lease_id: str, site: str, gpus: int) -> tuple[str, ...]:
    """The argv of ``profile`` for one lease, every template field replaced."""
    values = {"port": port, "lease_id": lease_id, "site": site, "gpus": gpus}
    return tuple(arg.format(**values) for arg in profile.argv)


def placeholder_cpus(profiles: Collection[WorkloadProfile], default: int) -> int:
    """CPUs each one-GPU placeholder job asks Slurm for (``--cpus-per-task``): the largest
    ``cpus_per_gpu`` of ``profiles``, at least ``default`` (the scheduler's own CPUs per GPU), so
    the CPUs any profile may need on a GPU are reserved before a claim names one."""
    return max([default, *(p.cpus_per_gpu for p in profiles)])


@functools.cache
def _tls() -> ssl.SSLContext:
    """One verifying TLS context for every health check (building one loads the CA store)."""
    return ssl.create_default_context()


async def wait_healthy(url: str, timeout_s: float, wanted: Callable[[], bool], step_s: float = 0.1) -> bool:
    """Poll ``url`` (a workload's health path) with GET until it answers 200: True then; False
    after ``timeout_s`` seconds, or as soon as ``wanted()`` is false (the lease ended). Each try
    may take 1 s; a refused or failed connection is a try that failed."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=1.0, verify=_tls()) as client:
        while time.monotonic() < deadline and wanted():
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return wanted()
            await asyncio.sleep(step_s)
    return False
