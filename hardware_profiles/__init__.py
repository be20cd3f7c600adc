"""Hardware profiles: device and server data files, and their loader.

An unknown name is an error naming the known ones, never a silent fallback to another GPU.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from hardware_profiles.schema import DeviceProfile, LinkProfile, ServerProfile

_HERE = Path(__file__).parent
DEVICES_DIR = _HERE / "devices"
SERVERS_DIR = _HERE / "servers"

__all__ = [
    "DeviceProfile",
    "LinkProfile",
    "ServerProfile",
    "UnknownProfileError",
    "device_names",
    "load_device",
    "load_profile_file",
    "load_server",
    "nvidia_smi_device",
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


@cache
def load_device(name: str) -> DeviceProfile:
    path = DEVICES_DIR / f"{name}.json"
    if not path.is_file():
        raise UnknownProfileError("device", name, device_names())
    return DeviceProfile.model_validate(json.loads(path.read_text()))


@cache
def load_server(name: str) -> ServerProfile:
    path = SERVERS_DIR / f"{name}.json"
    if not path.is_file():
        raise UnknownProfileError("cluster preset", name, server_names())
    return ServerProfile.model_validate(json.loads(path.read_text()))


@cache
def _nvidia_smi_names() -> dict[str, dict]:
    return json.loads((_HERE / "nvidia_smi_names.json").read_text())["devices"]


def nvidia_smi_device(gpu_name: str) -> tuple[str, str]:
    """(device profile, server preset) of a GPU as nvidia-smi names it (`nvidia_smi_names.json`);
    an unknown name raises UnknownProfileError listing the known names."""
    wanted = " ".join(gpu_name.split()).lower()
    table = _nvidia_smi_names()
    for device, entry in table.items():
        if any(" ".join(n.split()).lower() == wanted for n in entry["names"]):
            return device, entry["server"]
    raise UnknownProfileError("GPU", gpu_name, [n for e in table.values() for n in e["names"]])


def load_profile_file(path: str | Path) -> tuple[DeviceProfile, ServerProfile]:
    """The device and server of a `berth profile` output file (raises ValueError/OSError)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith("berth-profile/"):
        raise ValueError("not a `berth profile` output (no format: berth-profile/N)")
    return DeviceProfile.model_validate(data["device"]), ServerProfile.model_validate(data["server"])
