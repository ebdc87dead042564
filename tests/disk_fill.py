"""Run a command while a real tmpfs fills up under it, at a chosen moment: the disk tier's
"a disk that fills anyway" case, made deterministic without any mock.

    unshare -m python tests/disk_fill.py MOUNT SIZE -- COMMAND...

In a private mount namespace (root), mounts a tmpfs of SIZE bytes at MOUNT and watches it with
fanotify permission events (FAN_OPEN_PERM). The command runs; every open on the mount waits for
this process's answer. When the command opens its KV file (a name ending in .kv), this process
first fills the tmpfs completely with a file of its own (pre-allocated), then lets the open go on.
The command's free-space checks have all passed by then, so the kernel refuses the KV file's
pre-allocation with a real ENOSPC. Exit status: the command's; the last stdout line is JSON:
{"rc", "filled", "left"} (the mount's listing after the command, the filler excluded)."""
from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import subprocess
import sys

FAN_CLASS_CONTENT, FAN_OPEN_PERM, FAN_MARK_ADD, FAN_MARK_MOUNT = 0x4, 0x10000, 0x1, 0x10
AT_FDCWD, FAN_ALLOW = -100, 0x1
EVENT = struct.Struct("<IBBHQii")        # struct fanotify_event_metadata
RESPONSE = struct.Struct("<iI")          # struct fanotify_response
FILLER = "filler.bin"


def watch(mount: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    fan = libc.fanotify_init(FAN_CLASS_CONTENT, os.O_RDONLY)
    if fan < 0:
        raise OSError(ctypes.get_errno(), "fanotify_init")
    if libc.fanotify_mark(fan, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN_PERM, AT_FDCWD, mount.encode()) < 0:
        raise OSError(ctypes.get_errno(), "fanotify_mark")
    return fan


def main(argv: list[str]) -> int:
    mount, size, sep, *command = argv
    if sep != "--" or not command:
        print("usage: disk_fill.py MOUNT SIZE -- COMMAND...", file=sys.stderr)
        return 2
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mount], check=True)
    filler = os.open(os.path.join(mount, FILLER), os.O_WRONLY | os.O_CREAT, 0o600)   # opened before the watch
    fan = watch(mount)
    child = subprocess.Popen(command)
    filled = False
    while child.poll() is None:
        if not select.select([fan], [], [], 0.05)[0]:
            continue
        buf = os.read(fan, 4096)
        for at in range(0, len(buf), EVENT.size):
            _, _, _, _, mask, fd, _ = EVENT.unpack_from(buf, at)
            if fd < 0:
                continue
            if not filled and os.readlink(f"/proc/self/fd/{fd}").endswith(".kv"):
                free = os.statvfs(mount)
                os.posix_fallocate(filler, 0, free.f_bavail * free.f_frsize)   # every free block
                filled = True
            os.write(fan, RESPONSE.pack(fd, FAN_ALLOW))
            os.close(fd)
    os.close(fan)
    left = sorted(set(os.listdir(mount)) - {FILLER})
    print(json.dumps({"rc": child.returncode, "filled": filled, "left": left}))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
