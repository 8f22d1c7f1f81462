"""gpupool contracts: every record that crosses a stage boundary, and the names of the topics.

Stages (``collectors``, ``analytics``, ``broker``) import only this package, never each other.
Kafka records live in :mod:`contracts.telemetry`, :mod:`contracts.scheduler`,
:mod:`contracts.capacity` and :mod:`contracts.leases`; MQTT messages in :mod:`contracts.mqtt`;
topic names in :mod:`contracts.topics`; the bus interface and its implementations in
:mod:`contracts.bus`.
"""

from contracts.base import SCHEMA_VERSION, Record, decode, encode
from contracts.capacity import CapacityUpdate, GpuState, IdleGrade, PoolDemand
from contracts.fabric import FabricTopology
from contracts.leases import LeaseKind, LeaseLogRecord, LeaseState
from contracts.mqtt import (
    Claim,
    LeaseMessage,
    Offer,
    OfferedGpu,
    PeerState,
    ReasonCode,
    Release,
    Renewal,
    Reply,
    Requirements,
)
from contracts.scheduler import PendingJob, SchedulerGpu, SchedulerNode
from contracts.telemetry import (
    GpuColumns,
    GpuSample,
    GpuScrape,
    IbPortSample,
    NvSwitchSample,
    SeriesValue,
    decode_gpu_samples,
    gpu_scrapes,
)
from contracts.topics import KafkaTopics, MqttTopics, gpu_key

__all__ = [
    "SCHEMA_VERSION",
    "Record",
    "encode",
    "decode",
    "GpuSample",
    "GpuScrape",
    "GpuColumns",
    "gpu_scrapes",
    "decode_gpu_samples",
    "IbPortSample",
    "NvSwitchSample",
    "SeriesValue",
    "SchedulerNode",
    "SchedulerGpu",
    "PendingJob",
    "CapacityUpdate",
    "GpuState",
    "IdleGrade",
    "PoolDemand",
    "FabricTopology",
    "LeaseKind",
    "LeaseState",
    "LeaseLogRecord",
    "Offer",
    "OfferedGpu",
    "Claim",
    "Requirements",
    "LeaseMessage",
    "Renewal",
    "Release",
    "Reply",
    "ReasonCode",
    "PeerState",
    "KafkaTopics",
    "MqttTopics",
    "gpu_key",
]
