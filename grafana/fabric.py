"""The Fabric dashboard: gpupool's InfiniBand fabric collector, and per-port utilisation,
congestion (PortXmitWait), symbol errors, link downs and port state from node_exporter.

gpupool sends per-port counters to Kafka, not to Prometheus; operators scrape node_exporter, whose
infiniband collector reads the same sysfs counters (``node_infiniband_*{device, port}``;
prometheus/node_exporter ``collector/infiniband_linux.go``): data counters in bytes (PortXmitData
× 4), ``rate_bytes_per_second`` the link rate, ``state_id`` 4 = Active. Per leaf switch, the
analytics stage exports what training leaves on the leaf's busiest uplink
(``gpupool_analytics_leaf_uplink_headroom_ratio{leaf}``, with the lent share bound
``gpupool_analytics_lent_share_ratio``) and the uplinks' XmitWait fraction: a leaf under the bound
(or over the XmitWait limit) is not offered.

Fabric QoS (the broker's fabric manager, ``broker/metrics.py``): the lent-share bound of the QoS
plan (one for the whole fabric, so for every leaf), QoS drift per switch from the audit, and the
time to verify a lease's QoS. Lent-VL utilisation needs per-VL counters (PortVLXmitData, an
optional PMA attribute): node_exporter does not export them and ibsim does not implement them, so
no panel shows it.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b

from grafana import panels
from grafana.panels import Query

__all__ = ["UID", "dashboard"]

UID = "gpupool-fabric"
"""Dashboard uid (stable: links and provisioning refer to it)."""

_INST = 'instance=~"$instance"'
_PORT_LEGEND = "{{instance}} {{device}}/{{port}}"
_PORT_STATES = {
    1: ("Down", "red"),
    2: ("Init", "orange"),
    3: ("Armed", "yellow"),
    4: ("Active", "green"),
    5: ("ActDefer", "blue"),
}


def _quantile(q: float, bucket: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({bucket}[$__rate_interval])))"


def dashboard() -> dashboard_b.Dashboard:
    """The Fabric dashboard builder (uid :data:`UID`); variables ``datasource`` and ``instance``
    (node_exporter targets)."""
    return (
        panels.dashboard(
            "gpupool / Fabric",
            UID,
            "InfiniBand fabric: gpupool's fabric collector, and per-port counters from node_exporter.",
            panels.label_variable("instance", "node_infiniband_state_id", "instance", "Host"),
        )
        .with_row(panels.row("Fabric collector (gpupool)"))
        .with_panel(
            panels.stat(
                "Ports down",
                [Query("sum(gpupool_collector_fabric_ports_down)")],
                description="Ports seen connected once and without a peer at the last ibnetdiscover.",
                thresholds=panels.ANY_IS_BAD,
            )
        )
        .with_panel(
            panels.stat(
                "Port samples per second",
                [Query("sum(rate(gpupool_collector_fabric_samples_total[$__rate_interval]))")],
                description="IbPortSample records the fabric collector produces (perfquery readings).",
                unit="ops",
            )
        )
        .with_panel(
            panels.stat(
                "Sweep time p95",
                [Query(_quantile(0.95, "gpupool_collector_fabric_sweep_duration_seconds_bucket"))],
                description="95th percentile of one counter sweep over the whole fabric.",
                unit="s",
            )
        )
        .with_panel(
            panels.stat(
                "Diag timeouts in range",
                [Query("sum(increase(gpupool_collector_fabric_timeouts_total[$__range]))")],
                description="perfquery / ibnetdiscover runs killed at their timeout over the time range.",
                thresholds=panels.ANY_IS_WARNING,
            )
        )
        .with_panel(
            panels.timeseries(
                "Fabric collection errors by reason",
                [
                    Query(
                        "sum by (reason) (rate(gpupool_collector_fabric_errors_total[$__rate_interval]))",
                        "{{reason}}",
                    )
                ],
                description="timeout, exec_error, unreachable, ... or a parser reason (a new infiniband-diags format).",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Sweep, discovery and per-device time",
                [
                    Query(
                        _quantile(0.95, "gpupool_collector_fabric_sweep_duration_seconds_bucket"), "sweep p95"
                    ),
                    Query(
                        _quantile(0.95, "gpupool_collector_fabric_discovery_duration_seconds_bucket"),
                        "ibnetdiscover p95",
                    ),
                    Query(
                        _quantile(
                            0.95, "gpupool_collector_fabric_device_duration_seconds_bucket", "node_type"
                        ),
                        "device p95 {{node_type}}",
                    ),
                ],
                description="95th percentiles of a fabric sweep, an ibnetdiscover run, and reading one device's ports.",
                unit="s",
            )
        )
        .with_row(panels.row("Leaf uplinks (analytics)"))
        .with_panel(
            panels.timeseries(
                "Leaf uplink headroom and the lent share",
                [
                    Query("max by (leaf) (gpupool_analytics_leaf_uplink_headroom_ratio)", "{{leaf}}"),
                    Query("max(gpupool_analytics_lent_share_ratio)", "lent share bound"),
                ],
                description="Per leaf switch: 1 - p95 utilisation of its busiest uplink (switch-to-switch "
                "port, busier direction) over the headroom window, from the fabric collector's switch "
                "reads. A leaf below the lent share bound ([broker] lent_share_percent) is not offered.",
                unit="percentunit",
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            panels.timeseries(
                "Leaf uplink XmitWait",
                [Query("max by (leaf) (gpupool_analytics_leaf_uplink_xmit_wait_ratio)", "{{leaf}}")],
                description="Per leaf switch: the worst XmitWait / (XmitWait + XmitData) among its uplink "
                "ports over the headroom window; above [analytics] max_uplink_xmit_wait the leaf is not "
                "offered.",
                unit="percentunit",
                min_value=0,
                max_value=1,
            )
        )
        .with_row(panels.row("Fabric QoS (broker)"))
        .with_panel(
            panels.stat(
                "Lent share bound",
                [Query("max(gpupool_broker_fabric_lent_share_ratio)")],
                description="The most of a busy link lent traffic can take (its own VL in the low-priority "
                "table, qos_high_limit): the same on every leaf and spine. Shown in each offer and lease.",
                unit="percentunit",
            )
        )
        .with_panel(
            panels.stat(
                "Switches with QoS drift",
                [Query("count(max by (switch) (gpupool_broker_fabric_qos_drift_ports) > 0) or vector(0)")],
                description="Switches whose SL2VL or VL arbitration tables differ from the QoS plan at the last "
                "audit. Alert GpupoolFabricQosDrift.",
                thresholds=panels.ANY_IS_BAD,
            )
        )
        .with_panel(
            panels.stat(
                "Last QoS audit",
                [Query("time() - max(gpupool_broker_fabric_qos_last_audit_timestamp_seconds > 0)")],
                description="Seconds since the last QoS audit of every switch port finished.",
                unit="s",
            )
        )
        .with_panel(
            panels.stat(
                "Lease QoS verify p95",
                [Query(_quantile(0.95, 'gpupool_broker_fabric_apply_seconds_bucket{op="qos_verify"}'))],
                description="95th percentile of reading every port on a lease's paths back before its grant.",
                unit="s",
            )
        )
        .with_panel(
            panels.timeseries(
                "QoS drift per switch",
                [Query("max by (switch) (gpupool_broker_fabric_qos_drift_ports)", "{{switch}}")],
                description="Ports per switch (leaves and spines) whose QoS tables differ from the plan, per audit.",
                min_value=0,
            )
        )
        .with_panel(
            panels.timeseries(
                "QoS verify and audit time",
                [
                    Query(
                        _quantile(0.95, 'gpupool_broker_fabric_apply_seconds_bucket{op="qos_verify"}'),
                        "lease QoS verify p95",
                    ),
                    Query(_quantile(0.95, "gpupool_broker_fabric_qos_audit_seconds_bucket"), "audit p95"),
                ],
                description="95th percentiles of reading a lease's path ports back before the grant, and of one "
                "audit of every switch port.",
                unit="s",
            )
        )
        .with_row(panels.row("Ports (node_exporter)"))
        .with_panel(
            panels.timeseries(
                "Transmit utilisation",
                [
                    Query(
                        f"rate(node_infiniband_port_data_transmitted_bytes_total{{{_INST}}}[$__rate_interval])"
                        f" / node_infiniband_rate_bytes_per_second{{{_INST}}}",
                        _PORT_LEGEND,
                    )
                ],
                description="Transmitted bytes per second over the link rate (PortXmitData × 4 / rate).",
                unit="percentunit",
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            panels.timeseries(
                "Receive utilisation",
                [
                    Query(
                        f"rate(node_infiniband_port_data_received_bytes_total{{{_INST}}}[$__rate_interval])"
                        f" / node_infiniband_rate_bytes_per_second{{{_INST}}}",
                        _PORT_LEGEND,
                    )
                ],
                description="Received bytes per second over the link rate (PortRcvData × 4 / rate).",
                unit="percentunit",
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            panels.timeseries(
                "XmitWait per data word",
                [
                    Query(
                        f"rate(node_infiniband_port_transmit_wait_total{{{_INST}}}[$__rate_interval])"
                        f" / (rate(node_infiniband_port_data_transmitted_bytes_total{{{_INST}}}[$__rate_interval]) / 4)",
                        _PORT_LEGEND,
                    )
                ],
                description="PortXmitWait ticks per 4-byte word sent: congestion (waiting for credits). "
                "Alert GpupoolIbXmitWaitHigh above 1.",
            )
        )
        .with_panel(
            panels.timeseries(
                "XmitWait ticks per second",
                [
                    Query(
                        f"rate(node_infiniband_port_transmit_wait_total{{{_INST}}}[$__rate_interval])",
                        _PORT_LEGEND,
                    )
                ],
                description="PortXmitWait: ticks during which the port had data to send and sent none.",
            )
        )
        .with_panel(
            panels.timeseries(
                "Symbol errors",
                [
                    Query(
                        f"increase(node_infiniband_symbol_error_total{{{_INST}}}[$__rate_interval])",
                        _PORT_LEGEND,
                    )
                ],
                description="SymbolErrorCounter increase: minor link errors on the lanes (cable, transceiver). "
                "A saturated counter (65535) stops counting.",
            )
        )
        .with_panel(
            panels.timeseries(
                "Link downs and error recoveries",
                [
                    Query(
                        f"increase(node_infiniband_link_downed_total{{{_INST}}}[$__rate_interval])",
                        "downed " + _PORT_LEGEND,
                    ),
                    Query(
                        f"increase(node_infiniband_link_error_recovery_total{{{_INST}}}[$__rate_interval])",
                        "recovered " + _PORT_LEGEND,
                    ),
                ],
                description="LinkDownedCounter (the link went down) and LinkErrorRecoveryCounter (it recovered) increases.",
            )
        )
        .with_panel(
            panels.state_timeline(
                "Port state",
                Query(f"node_infiniband_state_id{{{_INST}}}", _PORT_LEGEND),
                description="Logical port state: 1 Down, 2 Init, 3 Armed, 4 Active, 5 ActDefer.",
                states=_PORT_STATES,
            )
        )
    )
