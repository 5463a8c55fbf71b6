"""What an LMDB data file must hold before it is mapped, moving a damaged one aside, free room.

LMDB reads pages through a map of data.mdb: a page past the end of the file is a SIGBUS that
kills the process, not an error. So a file shorter than its environment says (a truncated
copy, a half-written restore) is caught here, from its two meta pages read with pread, never
through a map::

    offset 0        meta page 0: page header, then MDB_meta
    offset psize    meta page 1  (psize: the page size meta page 0 records)

    MDB_meta, from the end of the page header (16 bytes in LMDB 0.9, 24 in LMDB 1.0):
      +0    mm_magic    u32   0xBEEFC0DE
      +4    mm_version  u32   data format: 1 (LMDB 0.9), 3 (LMDB 1.0)
      +8    mm_address  u64
      +16   mm_mapsize  u64
      +24   mm_dbs[0]   48 B  FREE_DBI's MDB_db; its first field (md_pad, u32) is psize
      +72   mm_dbs[1]   48 B  MAIN_DBI's MDB_db
      +120  mm_last_pg  u64   last page the environment uses
      +128  mm_txnid    u64   the meta page with the larger txnid is the current one

The current meta page's environment spans pages 0..mm_last_pg, so the file must hold
(mm_last_pg + 1) * psize bytes. Offsets checked against files written by py-lmdb 3.0 with
LMDB 0.9.36 and 1.0 (64-bit little-endian; integers are in host order). LMDB's format would
allow a tail of free pages never written, but LMDB leaves none: the file held every page of
its meta after each of 20,000 random put/delete transactions, and py-lmdb's own verifier
(`lmdb.verify`) notes the same. A file longer than its environment is sound: LMDB reads and
writes pages by number and never looks at the file's size (a store's prefault leaves a
sparse tail past the last page; see `LmdbEnvironment.prefault`).

Threads: functions of paths and open files, no state; any thread.
"""

from __future__ import annotations

import errno
import os
import resource
import struct
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
QUARANTINE_SUFFIX = ".corrupt-"  # data.mdb.corrupt-<UTC stamp>, lock.mdb.corrupt-<same>
NUM_METAS = 2  # LMDB's meta pages, pages 0 and 1
MAGIC = 0xBEEFC0DE  # MDB_MAGIC
# Page-header size -> the data format (mm_version) written with it (LMDB 0.9, LMDB 1.0).
HEADER_VERSIONS = {16: 1, 24: 3}
_META = struct.Struct("=II8xQI44x48xQQ")  # magic, version, mapsize, psize, last_pg, txnid
# Page sizes LMDB writes: powers of two from 256 B to 64 KiB (LMDB 1.0's MAX_PAGESIZE; 0.9
# stops at 32 KiB); the bounds py-lmdb's verifier accepts.
MIN_PSIZE, MAX_PSIZE = 256, 0x10000
# A file that looks damaged is checked again this many times this far apart before it is
# moved aside: another process creating the environment writes its two meta pages just after
# creating the empty file, and a check in between must not take that for a truncation.
SETTLE_CHECKS = 4
SETTLE_S = 0.05


class Replaced(Exception):
    """The environment was unusable (its file shrank, LMDB gave up on it) and was replaced:
    the call that found it so is a counted miss / skipped write."""


class Meta(NamedTuple):
    """The fields of an MDB_meta this module needs."""

    version: int
    psize: int
    last_pg: int
    txnid: int

    @property
    def required_bytes(self) -> int:
        """What the file must hold: every page up to the last one in use."""
        return (self.last_pg + 1) * self.psize


def read_meta(fd: int, offset: int, size: int) -> Meta | str:
    """The meta page at `offset` of the open file `fd` of `size` bytes, or why it is none."""
    head = os.pread(fd, max(HEADER_VERSIONS) + _META.size, offset)
    for header, version in HEADER_VERSIONS.items():
        if len(head) >= header + _META.size and \
                struct.unpack_from("=I", head, header)[0] == MAGIC:
            _, found, _, psize, last_pg, txnid = _META.unpack_from(head, header)
            if found != version:
                return f"meta page at {offset} has data format {found}, expected {version}"
            if not (MIN_PSIZE <= psize <= MAX_PSIZE and psize & (psize - 1) == 0):
                return f"meta page at {offset} has page size {psize}, not a power of two " \
                       f"in [{MIN_PSIZE}, {MAX_PSIZE}]"
            return Meta(found, psize, last_pg, txnid)
    if size < offset + min(HEADER_VERSIONS) + _META.size:
        return f"holds {size} bytes, too few for a meta page at {offset}"
    return f"has no LMDB magic in the meta page at {offset}"


def damage(env_dir: Path) -> str | None:
    """Why `env_dir`'s data file must not be mapped, or None (sound, or no data file yet).

    Raises OSError when the file exists but cannot be read at all (permissions, an I/O
    error): that says nothing of its contents, and LMDB would fail on it the same way.
    """
    try:
        fd = os.open(env_dir / DATA_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        first = read_meta(fd, 0, size)
        if isinstance(first, str):
            return f"{DATA_FILE} {first}"
        second = read_meta(fd, first.psize, size)
        if isinstance(second, str):
            return f"{DATA_FILE} {second}"
    finally:
        os.close(fd)
    current = max(first, second, key=lambda meta: meta.txnid)
    if current.last_pg < NUM_METAS - 1 or size < current.required_bytes:
        return (f"{DATA_FILE} holds {size} bytes, but its environment uses "
                f"{current.required_bytes} (pages 0..{current.last_pg} of {current.psize} B)")
    return None


def lasting_damage(env_dir: Path) -> str | None:
    """`damage(env_dir)` that is still there after SETTLE_CHECKS checks (see SETTLE_S)."""
    problem = damage(env_dir)
    for _ in range(SETTLE_CHECKS - 1):
        if problem is None:
            return None
        time.sleep(SETTLE_S)
        problem = damage(env_dir)
    return problem


def move_aside(env_dir: Path) -> Path:
    """Rename data.mdb and lock.mdb to `<name>.corrupt-<UTC stamp>`; the new data path.

    Both go: a process that still has the old pair open keeps a consistent pair, and the next
    open creates a fresh environment. Raises OSError when a rename fails.
    """
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    moved = env_dir / f"{DATA_FILE}{QUARANTINE_SUFFIX}{stamp}"
    if moved.exists():
        raise FileExistsError(f"{moved} already exists")
    os.rename(env_dir / DATA_FILE, moved)
    lock = env_dir / LOCK_FILE
    if lock.exists():
        os.rename(lock, env_dir / f"{LOCK_FILE}{QUARANTINE_SUFFIX}{stamp}")
    return moved


# Write failures that mean the disk has no room, whatever the free space says. LMDB reports a
# short pwrite as EIO, so EIO counts only when the free room is short too (see out_of_space).
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# Room a write needs beyond its values: B-tree pages it splits or copies and free-list
# records, a few dozen LMDB pages for a batch; rounded up to 1 MiB.
SPACE_MARGIN_BYTES = 2**20


def out_of_space(err: Exception, env_dir: Path, need_bytes: int) -> bool:
    """Whether a write needing `need_bytes` failed with `err` for want of disk (or
    file-size) room under `env_dir`."""
    code = getattr(err, "code", 0)  # set by LMDB; absent on an Error built in Python
    if code in _NO_SPACE_ERRNOS:
        return True
    if code != errno.EIO:
        return False
    try:
        room = room_bytes(env_dir)
    except OSError:  # the path itself is gone or unreadable: not a question of room
        return False
    return room < need_bytes + SPACE_MARGIN_BYTES


def room_bytes(env_dir: Path) -> int:
    """How many more bytes data.mdb may grow by: the free disk space under `env_dir`, or
    less where RLIMIT_FSIZE caps the file's size."""
    disk = os.statvfs(env_dir)
    room = disk.f_bavail * disk.f_frsize
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit != resource.RLIM_INFINITY:
        try:
            size = (env_dir / DATA_FILE).stat().st_size
        except FileNotFoundError:
            size = 0
        room = min(room, max(0, limit - size))
    return room


READ_CHUNK_BYTES = 2**20  # one read of `read_range`


def read_range(fd: int, start: int, end: int) -> int:
    """Read bytes `start` to `end` of the open file `fd` and drop them (one reused buffer),
    which leaves them in the page cache as base pages; how many were read.

    Base pages, not readahead's large folios (Linux 6.x): the reads are advised random, on
    `fd` only. A write dirties the whole folio it lands in and a sync writes it back whole,
    so pages committed one synced transaction at a time into large folios were written to
    disk several times over (docs/tiers.md)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_RANDOM)
    buffer = memoryview(bytearray(READ_CHUNK_BYTES))
    offset = start
    while offset < end:
        got = os.preadv(fd, [buffer[:min(READ_CHUNK_BYTES, end - offset)]], offset)
        if got <= 0:
            break
        offset += got
    return offset - start


def free_memory_bytes() -> int | None:
    """Memory no page of anything holds now (Linux's MemFree), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemFree:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class FileSize:
    """The size of one open data file, by fstat of a descriptor kept open.

    The descriptor follows the file that was opened even after a rename, so a check reads the
    file the map is of, not whatever now sits at the path. (py-lmdb does not expose LMDB's own
    descriptor, so this one is opened just after `lmdb.open`.)
    """

    def __init__(self, path: Path) -> None:
        self._fd: int | None = os.open(path, os.O_RDONLY)

    def bytes(self) -> int:
        if self._fd is None:
            raise ValueError("FileSize is closed")
        return os.fstat(self._fd).st_size

    def allocated_bytes(self) -> int:
        """What the file takes on disk: `bytes()` less the holes of a sparse tail (see
        `LmdbEnvironment.prefault`)."""
        if self._fd is None:
            raise ValueError("FileSize is closed")
        info = os.fstat(self._fd)
        if not info.st_blocks:  # a filesystem that counts no blocks (some FUSE ones)
            return info.st_size
        return min(info.st_size, info.st_blocks * 512)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
