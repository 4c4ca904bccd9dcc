"""Shared-memory segments for the same-host route: named, versioned, fenced, never left behind."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from ftstate.core.errors import ManifestError, SharedMemoryUnavailable, StaleGroupVersion

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ftstate.transport")

#: Where segments live (tmpfs on Linux).
SHM_DIR = Path("/dev/shm")

#: Every segment name starts with this; the test suite checks none is left behind.
PREFIX = "ftstate-"

#: Bytes before the data: one page, so the data is page- and cache-line aligned.
HEADER_BYTES = 4096

_MAGIC = 0x6674736873656731  # "ftshseg1"
# magic, group version, creator pid, slot, capacity | bucket index + 1 (0: none), weights version, nbytes
_FIXED = struct.Struct("<QQQQQ")
_BUCKET = struct.Struct("<QQQ")
# ``-s<slot>``: a slot of a double buffer; ``-n0``: a node copy (ftstate.transport.nodecopy), whose
# ``p<pid>`` is its owner's (the node agent's), not its writer's
_NAME = re.compile(r"^ftstate-(?P<group>[A-Za-z0-9_.]+)-v(?P<version>\d+)-p(?P<pid>\d+)-g(?P<gen>\d+)"
                   r"-(?P<kind>[sn])(?P<slot>\d+)$")


def safe_group(group: str) -> str:
    """``group`` as it appears in a segment's name."""
    safe = re.sub(r"[^A-Za-z0-9_.]", "_", group)
    return safe[:64] or "_"


def segment_name(group: str, version: int, pid: int, generation: int, slot: int) -> str:
    """The name of slot ``slot`` of generation ``generation`` made by ``pid`` for ``group`` vN."""
    return f"{PREFIX}{safe_group(group)}-v{version}-p{pid}-g{generation}-s{slot}"


def parse_name(name: str) -> dict[str, int | str] | None:
    """The fields of a segment name, or None when it is not one of ours."""
    m = _NAME.match(name)
    if m is None:
        return None
    return {"group": m["group"], "version": int(m["version"]), "pid": int(m["pid"]),
            "generation": int(m["gen"]), "slot": int(m["slot"]), "kind": "node" if m["kind"] == "n" else "slot"}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host. A zombie (killed, not yet reaped by its
    parent) is dead: it holds no mapping and will never write or read again."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: existence is all we know
    state = stat.rsplit(")", 1)[-1].split()[:1]  # the field after the command name
    return state not in (["Z"], ["X"])


class Segment:
    """One mapped segment: :attr:`data` is a uint8 tensor over its data area."""

    def __init__(self, name: str, mm: mmap.mmap, capacity: int) -> None:
        import torch  # here, so listing and sweeping segments needs no torch

        self.name = name
        self.capacity = capacity
        self._mm: mmap.mmap | None = mm
        # capacity 0: a header only (a slot whose data lives in device memory, see samehost)
        self.data: torch.Tensor = torch.frombuffer(mm, dtype=torch.uint8, offset=HEADER_BYTES, count=capacity) \
            if capacity else torch.empty(0, dtype=torch.uint8)

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    @classmethod
    def create(cls, name: str, *, group_version: int, slot: int, capacity: int) -> Segment:
        """Create, reserve and map a new segment of ``capacity`` data bytes; raises
        SharedMemoryUnavailable when ``/dev/shm`` is missing, full or too small."""
        mm = create_mapped(name, HEADER_BYTES + capacity)
        _FIXED.pack_into(mm, 0, _MAGIC, group_version, os.getpid(), slot, capacity)
        return cls(name, mm, capacity)

    @classmethod
    def attach(cls, name: str, *, group: str, group_version: int, creator_pid: int) -> Segment:
        """Map an existing segment after checking its name and header against this reader's
        group version: an older one raises :class:`StaleGroupVersion` (nothing is read), any
        other disagreement :class:`~ftstate.core.errors.ManifestError` (field ``segment``)."""
        fields = parse_name(name)
        if fields is None or fields["group"] != safe_group(group) or fields["pid"] != creator_pid:
            raise ManifestError(f"shared-memory segment {name!r} is not the sender's (group {group!r}, "
                                f"pid {creator_pid})", field="segment")
        if int(fields["version"]) != group_version:
            _refuse_version(name, group, int(fields["version"]), group_version)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ManifestError(f"shared-memory segment {name!r} cannot be opened: {os.strerror(exc.errno or 0)}",
                                field="segment") from exc
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise ManifestError(f"shared-memory segment {name!r} is {size} bytes, shorter than its header",
                                    field="segment")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, version, pid, _slot, capacity = _FIXED.unpack_from(mm, 0)
        problem = None
        if magic != _MAGIC:
            problem = f"bad magic {magic:#x}"
        elif version != group_version:
            mm.close()
            _refuse_version(name, group, version, group_version)
        elif pid != creator_pid:
            problem = f"made by pid {pid}, not the sender's {creator_pid}"
        elif HEADER_BYTES + capacity > size:
            problem = f"capacity {capacity} exceeds its size {size}"
        if problem is not None:
            mm.close()
            raise ManifestError(f"shared-memory segment {name!r}: {problem}", field="segment")
        return cls(name, mm, capacity)

    # -- the bucket it holds --------------------------------------------------------------

    def mark(self, bucket: int, weights_version: int, nbytes: int) -> None:
        """Record which bucket the data area now holds (before the readers are told)."""
        assert self._mm is not None
        _BUCKET.pack_into(self._mm, _FIXED.size, bucket + 1, weights_version, nbytes)

    def holds(self) -> tuple[int, int, int]:
        """``(bucket index, weights version, nbytes)`` as the sender recorded it (index -1: none)."""
        assert self._mm is not None
        index, wv, nbytes = _BUCKET.unpack_from(self._mm, _FIXED.size)
        return index - 1, wv, nbytes

    def group_version(self) -> int:
        assert self._mm is not None
        return int(_FIXED.unpack_from(self._mm, 0)[1])

    # -- lifetime -------------------------------------------------------------------------

    def unlink(self) -> None:
        unlink_names([self.name])

    def close(self) -> None:
        import torch

        mm, self._mm = self._mm, None
        self.data = torch.empty(0, dtype=torch.uint8)
        if mm is not None:
            with contextlib.suppress(BufferError):  # a view still exported: freed with it
                mm.close()


def create_mapped(name: str, size: int, *, populate: bool = False) -> mmap.mmap:
    """Create, reserve and map ``/dev/shm/<name>``: reserving at once makes a full tmpfs raise
    SharedMemoryUnavailable here, not a SIGBUS mid-bucket. Removed again on any failure."""
    path = SHM_DIR / name
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise SharedMemoryUnavailable(path=str(path), nbytes=size, problem=os.strerror(exc.errno or 0)) from exc
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            free = _free_bytes()
            raise SharedMemoryUnavailable(
                path=str(path), nbytes=size,
                problem=f"{os.strerror(exc.errno or errno.ENOSPC)} ({free} bytes free in {SHM_DIR})",
            ) from exc
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _refuse_version(name: str, group: str, got: int, current: int) -> None:
    if got < current:
        raise StaleGroupVersion(group, got=got, current=current, peer=f"shared-memory segment {name!r}")
    raise ManifestError(f"shared-memory segment {name!r} is of group version {got}, newer than this "
                        f"member's {current}", field="segment")


def _free_bytes() -> int:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def unlink_names(names: list[str] | tuple[str, ...]) -> None:
    """Remove segment names (those already gone are fine)."""
    for name in names:
        if parse_name(name) is None:
            continue  # never remove anything that is not an ftstate segment
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / name)


def list_segments() -> list[str]:
    """Names of every ftstate segment in ``/dev/shm`` (any creator)."""
    try:
        return sorted(p.name for p in SHM_DIR.iterdir() if parse_name(p.name) is not None)
    except FileNotFoundError:
        return []


def sweep_orphans() -> list[str]:
    """Unlink the segments whose creator is dead (safe at any time); returns their names."""
    swept = []
    for name in list_segments():
        fields = parse_name(name)
        if fields is not None and not pid_alive(int(fields["pid"])):
            unlink_names([name])
            swept.append(name)
    if swept:
        log.info("orphan shared-memory segments removed", extra={"segments": swept})
    return swept


__all__ = [
    "HEADER_BYTES",
    "PREFIX",
    "SHM_DIR",
    "Segment",
    "create_mapped",
    "list_segments",
    "parse_name",
    "pid_alive",
    "safe_group",
    "segment_name",
    "sweep_orphans",
    "unlink_names",
]
