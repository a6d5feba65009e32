"""Dynamic Resource Allocation facts xidflow reads: which published device sits at a PCI address (pure).

DRA drivers publish their devices in ResourceSlices with the standard attribute
``resource.kubernetes.io/pciBusID``. Per-GPU quarantine (``taintDevice``) selects the faulty device by
it, and ``notifyWorkload`` matches pods' claim allocations to it; both ask ``find_devices``.

MIG: a MIG device of a GPU carries its GPU's PCI address, so every device at the address is the whole GPU
(the full GPU and its MIG devices). When the fault names a MIG GPU instance (``GPU-I:<n>`` in the Xid),
``mig_devices`` picks the device that publishes that instance in an integer attribute ``gpuInstanceId`` (in any
domain). NVIDIA's DRA driver (k8s-dra-driver-gpu) does not: it names MIG devices by parent, profile and placement
(``gpu-0-mig-1g10gb-19-0``) and says in its source that the GPU instance id has no guaranteed relation to
them; with it, the whole GPU is what can be named.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

GROUP = "resource.k8s.io"
SLICE_VERSION = "v1"
"""ResourceSlice and ResourceClaim: GA, served by default since Kubernetes 1.34."""
SLICES = "resourceslices"
PCI_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
"""The standard device attribute DRA drivers publish the PCI address under (``dddd:bb:dd.f``)."""
GPU_INSTANCE_ATTRIBUTE = "gpuInstanceId"
"""The integer attribute (any domain: ``<driver domain>/gpuInstanceId`` or unqualified) naming the MIG GPU instance
a device is; what lets a MIG fault's quarantine name one MIG device instead of the whole GPU."""

_BDF = re.compile(r"^(?:pci:)?([0-9a-f]{1,8}):([0-9a-f]{1,2}):([0-9a-f]{1,2})(?:\.([0-7]))?$")


def normalise_bdf(address: str) -> str | None:
    """``dddd:bb:dd.f`` lowercase (function 0 when absent, domain 0000 when absent, 8-digit domains
    folded), or None if not a PCI address."""
    text = address.strip().lower()
    if text.count(":") == 1:
        text = f"0000:{text}"
    m = _BDF.match(text)
    if not m:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0')}"


@dataclass(frozen=True, order=True)
class DeviceRef:
    """One device as a DRA driver publishes it: what a DeviceTaintRule's selector and a claim's
    allocation name."""

    driver: str
    pool: str
    device: str


def _attributes(device: Mapping[str, Any]) -> Mapping[str, Any]:
    # resource.k8s.io/v1 puts attributes on the device; v1beta1 under ``basic``.
    return device.get("attributes") or (device.get("basic") or {}).get("attributes") or {}


def _text(attr: Any) -> str | None:
    if isinstance(attr, Mapping):
        for kind in ("string", "version"):
            if isinstance(attr.get(kind), str):
                return attr[kind]
        return None
    return attr if isinstance(attr, str) else None


def _int(attr: Any) -> int | None:
    value = attr.get("int") if isinstance(attr, Mapping) else attr
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _gpu_instance(attributes: Mapping[str, Any]) -> int | None:
    for name, attr in attributes.items():
        if name == GPU_INSTANCE_ATTRIBUTE or str(name).endswith(f"/{GPU_INSTANCE_ATTRIBUTE}"):
            return _int(attr)
    return None


def find_devices(slices: Iterable[Mapping[str, Any]], pci: str) -> list[DeviceRef]:
    """Devices of the node's ResourceSlices whose ``resource.kubernetes.io/pciBusID`` is ``pci``.

    Only each pool's newest generation counts (a driver replaces a pool by publishing a higher one; the
    older slices are stale until it deletes them). Several devices may share one GPU's address (MIG or
    partitions): all of them are returned.
    """
    return sorted({ref for ref, _ in _devices_at(slices, pci)})


def mig_devices(slices: Iterable[Mapping[str, Any]], pci: str, gpu_instance: int) -> list[DeviceRef]:
    """The devices at ``pci`` that publish ``gpuInstanceId`` = ``gpu_instance`` (none when the driver publishes no
    GPU instance: then only the whole GPU, ``find_devices``, can be named)."""
    return sorted({ref for ref, attributes in _devices_at(slices, pci) if _gpu_instance(attributes) == gpu_instance})


def _devices_at(slices: Iterable[Mapping[str, Any]], pci: str) -> list[tuple[DeviceRef, Mapping[str, Any]]]:
    wanted = normalise_bdf(pci)
    newest: dict[tuple[str, str], int] = {}
    parsed: list[tuple[str, str, int, list[Mapping[str, Any]]]] = []
    for item in slices:
        spec = item.get("spec") or {}
        pool = spec.get("pool") or {}
        driver, name, gen = str(spec.get("driver", "")), str(pool.get("name", "")), int(pool.get("generation", 0))
        parsed.append((driver, name, gen, spec.get("devices") or []))
        newest[(driver, name)] = max(gen, newest.get((driver, name), gen))
    found: list[tuple[DeviceRef, Mapping[str, Any]]] = []
    for driver, pool, gen, devices in parsed:
        if wanted is None or gen != newest[(driver, pool)]:
            continue
        for device in devices:
            attributes = _attributes(device)
            address = _text(attributes.get(PCI_ATTRIBUTE))
            if address and normalise_bdf(address) == wanted:
                found.append((DeviceRef(driver, pool, str(device.get("name", ""))), attributes))
    return found
