"""Hardware profiles: device and server data files, and their loader.

An unknown name is an error naming the known ones, never a silent fallback to another GPU.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from berth.specs.hardware import DeviceProfile, LinkProfile, NvidiaSmiNames, ServerProfile

_HERE = Path(__file__).parent
PROFILE_FORMAT = "berth-profile/1"  # the `format` of a `berth profile` output (executor/profile.py writes it)
DEVICES_DIR = _HERE / "devices"
SERVERS_DIR = _HERE / "servers"

__all__ = [
    "DeviceProfile",
    "PROFILE_FORMAT",
    "LinkProfile",
    "ServerProfile",
    "UnknownProfileError",
    "device_names",
    "load_device",
    "load_profile_file",
    "profile_from_data",
    "load_server",
    "nvidia_smi_device",
    "nvidia_smi_names",
    "server_names",
]


class UnknownProfileError(LookupError):
    def __init__(self, what: str, name: str, known: list[str]):
        self.what, self.name, self.known = what, name, known
        super().__init__(f"unknown {what} {name!r}; known: {', '.join(known)}")


def device_names() -> list[str]:
    return sorted(p.stem for p in DEVICES_DIR.glob("*.json"))


def server_names() -> list[str]:
    return sorted(p.stem for p in SERVERS_DIR.glob("*.json"))


NVIDIA_SMI = "nvidia_smi"  # the device file's section of nvidia-smi names (NvidiaSmiNames), not profile data


@cache
def _device_file(name: str) -> dict:
    path = DEVICES_DIR / f"{name}.json"
    if not path.is_file():
        raise UnknownProfileError("device", name, device_names())
    return json.loads(path.read_text())


@cache
def load_device(name: str) -> DeviceProfile:
    data = {k: v for k, v in _device_file(name).items() if k != NVIDIA_SMI}
    return DeviceProfile.model_validate(data)


def nvidia_smi_names(name: str) -> NvidiaSmiNames | None:
    """The device's nvidia-smi names and local server preset (its file's `nvidia_smi` section); None
    for a device nvidia-smi does not list (a CPU, a non-NVIDIA GPU)."""
    section = _device_file(name).get(NVIDIA_SMI)
    return NvidiaSmiNames.model_validate(section) if section is not None else None


@cache
def load_server(name: str) -> ServerProfile:
    path = SERVERS_DIR / f"{name}.json"
    if not path.is_file():
        raise UnknownProfileError("cluster preset", name, server_names())
    return ServerProfile.model_validate(json.loads(path.read_text()))


def nvidia_smi_device(gpu_name: str) -> tuple[str, str]:
    """(device profile, server preset) of a GPU as nvidia-smi names it (the `nvidia_smi` section of
    each device file). Names are matched exactly, case and surrounding spaces ignored; an unknown
    name raises UnknownProfileError listing the known names, never another device's profile."""
    wanted = " ".join(gpu_name.split()).lower()
    table = {d: e for d in device_names() if (e := nvidia_smi_names(d)) is not None}
    for device, entry in table.items():
        if any(" ".join(n.split()).lower() == wanted for n in entry.names):
            return device, entry.server
    raise UnknownProfileError("GPU", gpu_name, [n for e in table.values() for n in e.names])


def load_profile_file(path: str | Path) -> tuple[DeviceProfile, ServerProfile]:
    """The device and server of a `berth profile` output file (raises ValueError/OSError)."""
    return profile_from_data(json.loads(Path(path).read_text()))


def profile_from_data(data: Any) -> tuple[DeviceProfile, ServerProfile]:
    """The device and server of a `berth profile` output, read already (`load_profile_file`; raises ValueError)."""
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith(PROFILE_FORMAT.split("/")[0] + "/"):
        raise ValueError("not a `berth profile` output (no format: berth-profile/N)")
    return DeviceProfile.model_validate(data["device"]), ServerProfile.model_validate(data["server"])
