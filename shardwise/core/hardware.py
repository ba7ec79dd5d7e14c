"""Human-readable quantities ("30B", "80GB", "100Gbps", "312TFLOPS") and the :class:`Hardware` model.

Decimal prefixes (K, M, G, T, P = 1e3 ... 1e15) are the default, binary ones
(KiB, MiB, GiB, TiB) are 2**10 ... 2**40. In bandwidths a lowercase ``b`` means
bits (``100Gbps``, ``25Gb/s``) and an uppercase ``B`` bytes (``900GB/s``, ``600GBps``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Union

from .errors import ConfigError

__all__ = ["Hardware", "parse_count", "parse_bytes", "parse_bandwidth", "parse_flops",
           "parse_seconds"]

Quantity = Union[int, float, str]

_DECIMAL = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"KI": 2.0 ** 10, "MI": 2.0 ** 20, "GI": 2.0 ** 30, "TI": 2.0 ** 40, "PI": 2.0 ** 50}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z/]*)\s*")


def _split(value: Quantity, what: str, example: str) -> tuple[float, str]:
    """``(number, unit)`` of ``value``; plain numbers have the unit ``""``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a number or a string such as {example!r}, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _NUMBER.fullmatch(value)):
        number, unit = float(match.group(1)), match.group(2)
    else:
        raise ConfigError(f"cannot read {what} {value!r}: write e.g. {example!r}")
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{what} must be a finite non-negative number, got {value!r}")
    return number, unit


def _prefix(prefix: str, what: str, value: Quantity, example: str) -> float:
    key = prefix.upper()
    scale = _BINARY.get(key) if key.endswith("I") else _DECIMAL.get(key)
    if scale is None:
        raise ConfigError(f"unknown unit prefix {prefix!r} in {what} {value!r}: write e.g. {example!r}")
    return scale


def parse_count(value: Quantity, what: str = "parameter count") -> int:
    """A count such as ``30B``, ``1.3B``, ``350M``, ``7e9`` (B = billion)."""
    number, unit = _split(value, what, "30B")
    scale = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}.get(unit.upper())
    if scale is None:
        raise ConfigError(f"unknown unit {unit!r} in {what} {value!r}: use K, M, B or T (e.g. '30B')")
    return int(round(number * scale))


def parse_bytes(value: Quantity, what: str = "memory size") -> int:
    """Bytes in ``80GB`` (decimal), ``80GiB`` (binary), ``512MB``, ``80G`` or a plain number."""
    number, unit = _split(value, what, "80GB")
    body = unit[:-1] if unit.upper().endswith("B") else unit
    return int(round(number * _prefix(body, what, value, "80GB")))


def parse_bandwidth(value: Quantity, what: str = "bandwidth") -> float:
    """Bytes per second in ``100Gbps`` / ``25Gb/s`` (bits) or ``900GB/s`` / ``600GBps`` (bytes)."""
    number, unit = _split(value, what, "900GB/s")
    if unit == "":
        return number
    match = re.fullmatch(r"([A-Za-z]{0,2}?)([bB])(?:[pP][sS]|/[sS])", unit)
    if not match:
        raise ConfigError(f"unknown unit {unit!r} in {what} {value!r}: write e.g. '100Gbps' "
                          "(bits) or '900GB/s' (bytes)")
    scale = _prefix(match.group(1), what, value, "900GB/s")
    return number * scale / (8.0 if match.group(2) == "b" else 1.0)


def parse_flops(value: Quantity, what: str = "peak FLOP/s") -> float:
    """FLOP/s in ``312TFLOPS``, ``312 TFLOP/s``, ``1.98PF`` or a plain number."""
    number, unit = _split(value, what, "312TFLOPS")
    match = re.fullmatch(r"([A-Za-z]?)(FLOPS|FLOP/S|F)?", unit.upper())
    if not match:
        raise ConfigError(f"unknown unit {unit!r} in {what} {value!r}: write e.g. '312TFLOPS'")
    return number * _prefix(match.group(1), what, value, "312TFLOPS")


def parse_seconds(value: Quantity, what: str = "latency") -> float:
    """Seconds in ``5us``, ``10µs``, ``2ms``, ``0.5s`` or a plain number of seconds."""
    number, unit = _split(value.replace("µ", "u") if isinstance(value, str) else value, what, "5us")
    scale = {"": 1.0, "S": 1.0, "MS": 1e-3, "US": 1e-6, "NS": 1e-9}.get(unit.upper())
    if scale is None:
        raise ConfigError(f"unknown unit {unit!r} in {what} {value!r}: use s, ms, us or ns")
    return number * scale


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """A homogeneous cluster, as the planner's cost model sees it (defaults: A100-80GB SXM nodes)."""

    num_devices: int
    """Accelerators taking part in training."""
    memory_per_device: int = 80_000_000_000
    """Bytes of accelerator memory per device."""
    devices_per_node: int = 8
    """Devices sharing the fast intra-node link; tensor-parallel groups never leave a node."""
    intra_node_bandwidth: float = 300e9
    """Bytes/s one device sends to a peer in its node (per direction, e.g. NVLink)."""
    intra_node_latency: float = 5e-6
    """Seconds per message step inside a node (the alpha of the alpha-beta model)."""
    inter_node_bandwidth: float = 12.5e9
    """Bytes/s one device sends to another node: its share of the node's network (100 Gb/s)."""
    inter_node_latency: float = 10e-6
    """Seconds per message step between nodes."""
    peak_flops: float = 312e12
    """Peak dense FLOP/s of one device in the training precision."""
    efficiency: float = 0.5
    """Fraction of ``peak_flops`` a well-tuned model reaches (model FLOPs utilisation)."""
    compute_units_per_node: Optional[int] = None
    """Devices of a node that can compute at once, when ranks share them (CPU ranks outnumbering
    cores); ``None``: every device computes independently."""

    def __post_init__(self) -> None:
        if self.compute_units_per_node is not None and (
                isinstance(self.compute_units_per_node, bool) or not isinstance(self.compute_units_per_node, int)
                or self.compute_units_per_node < 1):
            raise ConfigError(f"compute_units_per_node must be an integer >= 1 or None, "
                              f"got {self.compute_units_per_node!r}")
        for name in ("num_devices", "memory_per_device", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "peak_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or not math.isfinite(value):
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"{name} must be seconds in [0, 1), got {value!r}")
        if isinstance(self.efficiency, bool) or not isinstance(self.efficiency, (int, float)) \
                or not 0 < self.efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ConfigError(f"{self.num_devices} devices are not a whole number of nodes of "
                              f"{self.devices_per_node} devices each")

    @classmethod
    def parse(cls, *, num_devices: Quantity, memory_per_device: Quantity = "80GB",
              devices_per_node: Quantity = 8, intra_node_bandwidth: Quantity = "300GB/s",
              intra_node_latency: Quantity = "5us", inter_node_bandwidth: Quantity = "100Gbps",
              inter_node_latency: Quantity = "10us", peak_flops: Quantity = "312TFLOPS",
              efficiency: float = 0.5) -> "Hardware":
        """A :class:`Hardware` from human strings (``"80GB"``, ``"100Gbps"``, ``"312TFLOPS"``) or numbers."""
        return cls(num_devices=parse_count(num_devices, "num_devices"),
                   memory_per_device=parse_bytes(memory_per_device, "memory_per_device"),
                   devices_per_node=parse_count(devices_per_node, "devices_per_node"),
                   intra_node_bandwidth=parse_bandwidth(intra_node_bandwidth, "intra_node_bandwidth"),
                   intra_node_latency=parse_seconds(intra_node_latency, "intra_node_latency"),
                   inter_node_bandwidth=parse_bandwidth(inter_node_bandwidth, "inter_node_bandwidth"),
                   inter_node_latency=parse_seconds(inter_node_latency, "inter_node_latency"),
                   peak_flops=parse_flops(peak_flops, "peak_flops"), efficiency=efficiency)

    @property
    def node_size(self) -> int:
        """Devices per node actually used (``devices_per_node`` capped at ``num_devices``)."""
        return min(self.devices_per_node, self.num_devices)

    @property
    def sharing(self) -> float:
        """How many ranks share one compute unit (1.0 unless ranks outnumber ``compute_units_per_node``)."""
        units = self.compute_units_per_node
        return max(1.0, self.node_size / units) if units else 1.0

    def link(self, span: int) -> tuple[float, float]:
        """``(bandwidth, latency)`` of a group whose ranks lie within ``span`` consecutive devices."""
        if span <= self.node_size:
            return self.intra_node_bandwidth, self.intra_node_latency
        return self.inter_node_bandwidth, self.inter_node_latency
