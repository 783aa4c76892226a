"""A job's secret, and the proof every message of the job carries.

Every process of a job shares one secret (32 random bytes): `fluidps launch` and a
RemoteExecutor make one for each job they start and hand it to the processes they start
in their environment (FLUIDPS_JOB_SECRET, readable by their user only, as a 0600 file
is); processes started by hand read it from a 0600 file (`fluidps secret gen`,
FLUIDPS_JOB_SECRET_FILE), pods from a Kubernetes Secret. A message's first frame starts
with a keyed BLAKE2b tag of its header, made with the secret: a server refuses any
message whose tag does not match before reading anything else, so a process outside
the job, on loopback included, can neither write a parameter nor take a trainer's id.
The secret itself never crosses a socket.

The tag covers the header, which says every tensor's name, dtype and dims (so the
byte count of each data frame), the kind, the request id and who sends it; not the
data frames' bytes: hashing megabytes a step would cost more than the rest of the
transport. A stranger cannot make a message of its own; one that could alter a job's
traffic in flight could alter the data too, which is what CURVE keys are for
(fluidps.executor.transport.security) on any network that is not loopback.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from fluidps.errors import TransportError

SECRET_BYTES = 32
TAG_BYTES = 16  # 128 bits: no forger gets one right by trying


class JobSecret:
    """The secret of one job. Its repr never shows the key."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes):
        if not isinstance(key, bytes) or len(key) < 16 or len(key) > 64:
            raise TransportError("a job secret is 16 to 64 bytes (fluidps makes 32)")
        self._key = key

    @classmethod
    def generate(cls) -> JobSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, where: str) -> JobSecret:
        """The secret written as hex in `where` (a file's or a variable's name)."""
        text = text.strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if not 32 <= len(text) <= 128 or len(key) * 2 != len(text):
            raise TransportError(
                f"{where} does not hold a job secret (32 to 128 hex digits); make one with "
                "`fluidps secret gen FILE`"
            )
        return cls(key)

    @classmethod
    def read(cls, path: str | Path) -> JobSecret:
        """The secret in a file written by `write` (or `fluidps secret gen`). Like ssh with
        a private key, refuses a file that other users may read."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
            text = path.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise TransportError(f"cannot read the job secret file {path}: {e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise TransportError(
                f"the job secret file {path} may be read by other users (mode {stat.S_IMODE(mode):o}): "
                f"`chmod 600 {path}`"
            )
        return cls.from_hex(text, f"the job secret file {path}")

    def write(self, path: str | Path) -> Path:
        """Write the secret (hex) to a new file only its owner may read."""
        path = Path(path)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="ascii") as file:
            file.write(self._key.hex() + "\n")
        return path

    def hex(self) -> str:
        """The key as hex, to render into a Kubernetes Secret or an environment."""
        return self._key.hex()

    def tag(self, header: bytes) -> bytes:
        return hashlib.blake2b(header, key=self._key, digest_size=TAG_BYTES).digest()

    def proves(self, tag: bytes, header: bytes) -> bool:
        return hmac.compare_digest(tag, self.tag(header))

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JobSecret) and hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash(self.tag(b"hash"))
