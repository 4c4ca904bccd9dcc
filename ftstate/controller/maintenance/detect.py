"""Which maintenance sources to run: as configured, or, for ``auto``, found from the node's DMI identity
without a network request (docs/operations.md, "What each maintenance source reads"). The :class:`Detection`
says in one line what was found."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ftstate.controller.maintenance import aws, gce
from ftstate.controller.maintenance.base import SOURCES

DMI_DIR = Path("/sys/class/dmi/id")
DMI_KEYS = ("sys_vendor", "product_name", "board_vendor", "bios_vendor", "bios_version", "chassis_asset_tag")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
CLOUD_NAMES = {"gce": "GCE", "aws": "AWS", "azure": "Azure"}
#: The environment variable that points each cloud source at its metadata server.
ENDPOINT_ENV = {"gce": gce.ENV, "aws": aws.ENV}


@dataclasses.dataclass(frozen=True)
class Detection:
    """The sources to run and why. cloud: the cloud the DMI identity names (None: none or not
    looked); auto: whether the sources were found out rather than configured; why: one line."""

    sources: tuple[str, ...]
    cloud: str | None
    auto: bool
    why: str

    @property
    def note(self) -> str:
        """The one line to record (once) in the audit trail."""
        return f"maintenance sources: {', '.join(self.sources) or 'none'} ({self.why})"

    def fields(self) -> dict[str, object]:
        return {"sources": list(self.sources), "cloud": self.cloud, "auto": self.auto, "message": self.note}


def read_dmi(dmi_dir: str | os.PathLike[str] = DMI_DIR) -> dict[str, str]:
    """The node's DMI identity strings that exist and can be read (a few small local files)."""
    out = {}
    for key in DMI_KEYS:
        try:
            out[key] = (Path(dmi_dir) / key).read_text(errors="replace")[:256].strip()
        except OSError:
            continue
    return out


def identify_cloud(dmi: Mapping[str, str]) -> str | None:
    """``gce``, ``aws``, ``azure`` or None, from DMI strings (pure)."""
    def get(key: str) -> str:
        return dmi.get(key, "").strip().lower()

    if get("product_name") == "google compute engine" or "google" in (get("sys_vendor"), get("bios_vendor")):
        return "gce"
    if "amazon ec2" in (get("sys_vendor"), get("bios_vendor"), get("board_vendor")) or "amazon" in get("bios_version"):
        return "aws"
    tag = get("chassis_asset_tag")
    if tag == AZURE_ASSET_TAG:
        return "azure"
    if not tag and get("sys_vendor") == "microsoft corporation" and get("product_name") == "virtual machine":
        return "azure"
    return None


def _ordered(sources: set[str] | Sequence[str]) -> tuple[str, ...]:
    return tuple(s for s in SOURCES if s in set(sources))


def detect_sources(
    configured: Sequence[str] = ("auto",),
    *,
    endpoints: Mapping[str, str] | None = None,
    maintenance_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    dmi: Mapping[str, str] | None = None,
    dmi_dir: str | os.PathLike[str] = DMI_DIR,
) -> Detection:
    """The sources to run: ``configured`` as given, or, for ``[auto]`` (or ``[]``), found out
    from the DMI identity (``dmi``, else read under ``dmi_dir``), the endpoints and the
    environment (``environ``, default ``os.environ``). Makes no network request."""
    named = [s for s in configured if s != "auto"]
    unknown = [s for s in named if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown maintenance sources {unknown}; expected some of {SOURCES} or 'auto'")
    if named:
        return Detection(_ordered(named), None, False, "as configured")
    env = os.environ if environ is None else environ
    identity = read_dmi(dmi_dir) if dmi is None else dmi
    cloud = identify_cloud(identity)
    found = {"ray"}
    reasons = []
    if cloud is not None:
        found.add(cloud)
        reasons.append(f"on {CLOUD_NAMES[cloud]}")
    else:
        seen = ", ".join(f"{k} {identity[k]!r}" for k in ("sys_vendor", "product_name") if identity.get(k))
        reasons.append("not on GCE, AWS or Azure" + (f": DMI {seen}" if seen else ": no DMI identity"))
    for source, url in sorted((endpoints or {}).items()):
        if source in CLOUD_NAMES and source not in found:
            found.add(source)
            reasons.append(f"{source} endpoint configured ({url})")
    for source, var in ENDPOINT_ENV.items():
        if env.get(var) and source not in found:
            found.add(source)
            reasons.append(f"{source} from {var}={env[var]}")
    if maintenance_file:
        found.add("file")
        reasons.append(f"file {maintenance_file}")
    return Detection(_ordered(found), cloud, True, "auto: " + "; ".join(reasons))
