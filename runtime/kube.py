"""A client of a Kubernetes API server, for the stages that read or act on one.

The official ``kubernetes`` client (PyPI ``kubernetes``) is the one way gpupool talks to an API
server: the broker's lending (``broker.lending_kubernetes``) and the collectors' scheduler source
(``collectors.kube_collector``) both build their client here.
"""

from __future__ import annotations

from pathlib import Path

from kubernetes import client, config

__all__ = ["kubernetes_client"]


def kubernetes_client(kubeconfig: Path | None) -> client.ApiClient:
    """A client of the cluster of ``kubeconfig`` (its current context), or of the pod's own
    service account when ``None``. Raises ``OSError`` when neither can be read, ``ValueError``
    when the kubeconfig is not valid."""
    try:
        if kubeconfig is not None:
            api: client.ApiClient = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
            return api
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return client.ApiClient(configuration)
    except config.ConfigException as e:
        raise ValueError(f"kubeconfig {kubeconfig or '(in-cluster)'}: {e}") from e
