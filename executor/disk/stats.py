"""What the disk tier did (bytes, seconds, codec and checksum cost, notes), summed over its
threads, for the run's report."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class DiskStats:
    """What the disk tier did: bytes and seconds (summed over threads), and notes for the report."""

    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0          # inside preadv, summed over threads
    write_s: float = 0.0         # inside pwritev
    checksum_s: float = 0.0      # crc32c of written and read blocks
    checksum_bytes: int = 0
    codec_raw_bytes: int = 0     # raw bytes of the blocks a codec encoded
    codec_stored_bytes: int = 0  # what they became (raw-stored blocks count their raw size)
    encode_s: float = 0.0        # codec time, summed over threads
    decode_s: float = 0.0
    io: str = ""                 # the I/O backend's description (executor.disk.io)
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def to_json(self) -> dict:
        return {"read_bytes": self.read_bytes, "write_bytes": self.write_bytes, "read_s": self.read_s,
                "write_s": self.write_s, "checksum_s": self.checksum_s,
                "checksum_bytes": self.checksum_bytes, "codec_raw_bytes": self.codec_raw_bytes,
                "codec_stored_bytes": self.codec_stored_bytes, "encode_s": self.encode_s,
                "decode_s": self.decode_s, "io": self.io, "notes": list(self.notes)}
