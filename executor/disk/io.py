"""How the disk tier's blocks reach its file: one positional read/write interface, two backends.

- `PosixIO`: `os.preadv`/`os.pwritev` on the file's own descriptor (opened with O_DIRECT where
  the file system allows it). The default, and the only one without CUDA: CI runs it.
- `KvikIO`: kvikio's `CuFile` (the `disk` extra, `kvikio-cu13`): each request is split into
  tasks of its own thread pool, with O_DIRECT for reads and writes (kvikio's
  auto_direct_io_read/write) and GPUDirect Storage where the driver has it. kvikio needs the
  CUDA driver even for host buffers, so it is used only where CUDA is available.

`open_io(kind, path, fd, threads)` picks one: `kind` "auto" (kvikio when it imports and CUDA is there,
else posix), "posix" or "kvikio"; None reads the KVPIPE_DISK_IO environment variable
(default auto). Both return the bytes moved; a short count is the caller's error to raise."""
from __future__ import annotations

import errno
import fcntl
import importlib.util
import os
import re

KINDS = ("auto", "posix", "kvikio")
ENV = "KVPIPE_DISK_IO"


class PosixIO:
    name = "posix"

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.why = ""            # set when `auto` fell back from kvikio

    def pread(self, buf: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)

    def pwrite(self, buf: memoryview, offset: int) -> int:
        return os.pwritev(self.fd, [buf], offset)

    def describe(self) -> str:
        return "disk I/O: os.preadv/pwritev on the tier's thread pool" + self.why

    def close(self) -> None:
        """Nothing of its own: the descriptor belongs to the DiskFile."""


class KvikIO:
    name = "kvikio"

    def __init__(self, path: str, threads: int) -> None:
        import kvikio
        import kvikio.defaults
        # kvikio's settings are process-wide: O_DIRECT for host-buffer I/O (page cache bypassed,
        # honest rates), as the posix path opens its descriptor; its pool as wide as the tier's
        kvikio.defaults.set({"auto_direct_io_read": True, "auto_direct_io_write": True, "num_threads": threads})
        self.version = kvikio.__version__
        mode = kvikio.defaults.get("compat_mode")
        self.compat = getattr(mode, "name", str(mode))
        self.threads = int(kvikio.defaults.get("num_threads"))
        self.file = kvikio.CuFile(path, "r+")

    def pread(self, buf: memoryview, offset: int) -> int:
        return int(self.file.pread(buf, len(buf), offset).get())

    def pwrite(self, buf: memoryview, offset: int) -> int:
        return int(self.file.pwrite(buf, len(buf), offset).get())

    def describe(self) -> str:
        return (f"disk I/O: kvikio {self.version} ({self.threads} threads, compat mode {self.compat}, "
                "O_DIRECT reads and writes)")

    def close(self) -> None:
        self.file.close()


def kvikio_usable() -> bool:
    """kvikio installed and a CUDA device present (its I/O loads the CUDA driver)."""
    if importlib.util.find_spec("kvikio") is None:
        return False
    import torch
    return torch.cuda.is_available()


def resolve(kind: str | None) -> str:
    """The backend `kind` (None: $KVPIPE_DISK_IO, default auto) names here: posix or kvikio.
    ValueError naming the field when it is unknown, or kvikio is asked for and unusable."""
    field = "disk_io" if kind is not None else ENV
    kind = (kind if kind is not None else os.environ.get(ENV, "auto")).strip().lower()
    if kind not in KINDS:
        raise ValueError(f"{field}: expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "auto":
        return "kvikio" if kvikio_usable() else "posix"
    if kind == "kvikio" and not kvikio_usable():
        raise ValueError(f"{field}: kvikio needs the kvikio package (pip install -e '.[disk]') and a CUDA device")
    return kind


def open_io(kind: str | None, path: str, fd: int, threads: int) -> PosixIO | KvikIO:
    """The backend for the open file. Under `auto`, a kvikio that imports but cannot open the
    file (a library mismatch, no driver) gives way to posix, saying why in `describe()`;
    asked for by name, its failure is the caller's."""
    asked = kind if kind is not None else os.environ.get(ENV, "auto")
    if resolve(kind) == "posix":
        return PosixIO(fd)
    try:
        return KvikIO(path, threads)
    except Exception as e:          # kvikio raises RuntimeError for its C++ failures
        if asked.strip().lower() != "auto":
            raise
        io = PosixIO(fd)
        io.why = f" (kvikio unusable: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
        return io


FILE_NAME = re.compile(r"kvpipe-(\d+)-[0-9a-f]+\.kv")   # the tier's file: kvpipe-PID-RANDOM.kv


def lock(fd: int) -> None:
    """Mark the tier's file as in use for as long as `fd` is open: an exclusive flock, which the
    kernel drops however the process ends (SIGKILL too), so a later run can tell it was left."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's live process
        return True
    return True


def left_behind(directory: str, name: re.Pattern) -> list[str]:
    """The entries of `directory` whose name matches `name` (group 1 a pid) and whose process is
    gone: what runs that died without cleanup left. Never this process's."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [n for n in names if (m := name.fullmatch(n)) is not None
            and int(m.group(1)) != os.getpid() and not alive(int(m.group(1)))]


def reclaim(kv_dir: str) -> tuple[int, int]:
    """Remove the tier's files in `kv_dir` left by runs that died without cleanup (SIGKILL, a
    crash): one whose process is gone and whose lock nobody holds. The pid alone could be
    reused by another process, and a new run creates its file a moment before it locks it: both
    checks keep a live run's file. Returns (files removed, their bytes)."""
    removed = nbytes = 0
    for name in left_behind(kv_dir, FILE_NAME):
        path = os.path.join(kv_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = os.fstat(fd).st_size
            os.unlink(path)
            removed, nbytes = removed + 1, nbytes + size
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.ENOENT, errno.EPERM):
                raise
        finally:
            os.close(fd)
    return removed, nbytes
