"""gpupool broker: idle capacity → MQTT offers → leases with reclaim notice; the edge-site SDK.

Public API (imported lazily, so ``python -m broker.acl`` stays light):

* :class:`BrokerService` (:mod:`broker.service`) — the stage; :class:`BrokerConfig` its settings;
* :class:`LeaseBook` (:mod:`broker.leases`) — offers, claims, leases, reclaims as pure logic;
* :class:`FabricManager`, :class:`NoIsolation` (:mod:`broker.fabric`) — the fabric-isolation seam;
* :class:`EdgeClient`, :class:`ClaimRejected`, :class:`LeaseRequestRejected`,
  :class:`OfferWithdrawn` (:mod:`broker.edge`) — the edge-site SDK;
* :mod:`broker.cli` — ``gpupool broker ...`` and ``gpupool edge ...``;
* :mod:`broker.acl` — Mosquitto users, passwords and ACL.
"""

from __future__ import annotations

from runtime.lazy import lazy_exports

_EXPORTS = {
    "BrokerConfig": "broker.config",
    "BrokerService": "broker.service",
    "LeaseBook": "broker.leases",
    "FabricManager": "broker.fabric",
    "NoIsolation": "broker.fabric",
    "EdgeClient": "broker.edge",
    "BrokerRejected": "broker.edge",
    "ClaimRejected": "broker.edge",
    "LeaseRequestRejected": "broker.edge",
    "OfferWithdrawn": "broker.edge",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
