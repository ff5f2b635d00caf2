"""The p2p daemon that hivemind's wheel ships, unpacked once at install.

hivemind 1.1.12 ships ``p2pd`` packed with UPX. Every daemon start (one per DHT node: each worker,
each bootstrap, every ``opendiloco status`` and ``doctor``) first decompresses 28 MB of program
into private memory: 0.25-0.3 s of CPU of the 0.9 s a start costs, and 28 MB no two daemons share.
Unpacked, a start costs about 0.6 CPU-s and the program's pages are shared (``docs/benchmarks.md``).

Debian 13 has no ``upx`` to unpack it with, so this does it from the running program: the packed
daemon is started under ``ptrace`` and stopped at the first system call of Go's runtime
(``arch_prctl``, setting up thread-local storage). By then UPX's stub has decompressed every
segment and gone, and no Go code has written to them (what the runtime writes first lies in
.bss, past the file's bytes). The original ELF header and program headers sit at the start of
the first segment; each loadable segment is read from ``/proc/PID/mem`` and written back at its
file offset. The result must answer ``-h`` exactly as the packed daemon does before it replaces
it (atomically); the packed one is kept beside it as ``p2pd.upx`` (``--restore`` puts it back).

An optimisation, never a requirement: anywhere it cannot be done (another architecture, ptrace
not allowed, a daemon packed some other way) the daemon is left as shipped, with a line saying why.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

UPX_MAGIC = b"UPX!"
HEAD = 4096
"""UPX's header lies in a packed program's first page."""

MAX_IMAGE = 512 << 20
PACKED_SUFFIX = ".upx"

_PTRACE_TRACEME, _PTRACE_PEEKUSER, _PTRACE_SYSCALL = 0, 3, 24
_ORIG_RAX = 15 * 8  # offset of orig_rax in x86-64's struct user_regs_struct: the system call's number
_SYS_ARCH_PRCTL = 158
_MAX_SYSCALLS = 10_000
_PT_LOAD, _EM_X86_64 = 1, 62


class UnpackError(Exception):
    """The daemon could not be unpacked here; it is left as it was."""


def daemon_path() -> Path:
    """Where hivemind starts its daemon from."""
    from importlib.resources import files

    return Path(str(files("hivemind.hivemind_cli").joinpath("p2pd")))


def is_packed(path: Path) -> bool:
    with open(path, "rb") as f:
        return UPX_MAGIC in f.read(HEAD)


def unpacked_image(path: Path) -> bytes:
    """The program ``path`` decompresses itself into, as an ELF file (no section headers)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise UnpackError(f"unpacking is done on x86-64 Linux only, not {sys.platform}/{platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    pid = os.fork()
    if pid == 0:  # the child: traced from its exec on, silent
        try:
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            if libc.ptrace(_PTRACE_TRACEME, 0, None, None) == 0:
                os.execv(str(path), [str(path), "-h"])
        finally:
            os._exit(127)
    status = 0
    try:
        _, status = os.waitpid(pid, 0)  # stopped at its exec
        if not os.WIFSTOPPED(status):
            raise UnpackError("it could not be started under ptrace (not a program for this machine?)")
        for _ in range(_MAX_SYSCALLS):
            libc.ptrace(_PTRACE_SYSCALL, pid, None, None)
            _, status = os.waitpid(pid, 0)
            if not os.WIFSTOPPED(status):
                raise UnpackError("the program ended before a Go runtime started in it")
            ctypes.set_errno(0)
            number = libc.ptrace(_PTRACE_PEEKUSER, pid, ctypes.c_void_p(_ORIG_RAX), None)
            if number == -1 and ctypes.get_errno():
                raise UnpackError(f"ptrace: {os.strerror(ctypes.get_errno())}")
            if number == _SYS_ARCH_PRCTL:
                try:
                    return _read_image(pid)
                except (OSError, ValueError, struct.error) as e:
                    raise UnpackError(f"could not read the decompressed program: {e}") from None
        raise UnpackError("the daemon's runtime did not start")
    finally:
        if os.WIFSTOPPED(status):  # still there (an ended child was reaped by the wait that saw it end)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _read_image(pid: int) -> bytes:
    with open(f"/proc/{pid}/maps") as f:
        first = f.readline().split()  # the lowest mapping: the first segment
    if len(first) != 5:  # a file's own mapping names it: UPX's stub decompresses into anonymous memory
        raise UnpackError("its first segment is a file's mapping, not a decompressed program")
    base = int(first[0].split("-", 1)[0], 16)
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        def read(address: int, size: int) -> bytes:
            mem.seek(address)
            data = bytearray()
            while len(data) < size:
                chunk = mem.read(size - len(data))
                if not chunk:
                    raise UnpackError(f"could not read {size} bytes at {address:#x} of the running daemon")
                data += chunk
            return bytes(data)

        header = read(base, 64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or struct.unpack_from("<H", header, 18)[0] != _EM_X86_64:
            raise UnpackError("no x86-64 ELF header at the start of the decompressed program")
        entry, phoff = struct.unpack_from("<QQ", header, 24)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        if phentsize != 56 or not 0 < phnum <= 32:
            raise UnpackError("the decompressed program's headers are not what an ELF file holds")
        loads = []
        for i in range(phnum):
            kind, flags, offset, vaddr, _, filesz, memsz, _ = struct.unpack_from(
                "<IIQQQQQQ", read(base + phoff + i * 56, 56))
            if kind == _PT_LOAD:
                loads.append((offset, vaddr, filesz, flags))
        size = max((offset + filesz for offset, _, filesz, _ in loads), default=0)
        if not loads or size > MAX_IMAGE or loads[0][0] != 0:
            raise UnpackError("the decompressed program's segments are not what an ELF file holds")
        if not any(flags & 1 and vaddr <= entry < vaddr + filesz for _, vaddr, filesz, flags in loads):
            raise UnpackError("the decompressed program's entry point is in no executable segment")
        image = bytearray(size)
        for offset, vaddr, filesz, _ in loads:
            image[offset:offset + filesz] = read(vaddr, filesz)
    struct.pack_into("<Q", image, 40, 0)  # no section headers: they are not loaded, so not in memory
    struct.pack_into("<HHH", image, 58, 64, 0, 0)
    return bytes(image)


def _usage(path: Path) -> tuple[int, str]:
    """What the daemon answers to ``-h``, with its own path taken out."""
    try:
        proc = subprocess.run([str(path), "-h"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)
    return proc.returncode, (proc.stdout + proc.stderr).replace(str(path), "p2pd")


def unpack(path: Path) -> str:
    """Replaces the packed daemon at ``path`` with its unpacked program; one line saying what it did.
    Raises :class:`UnpackError` (``path`` unchanged) where that cannot be done."""
    path = Path(path)
    if not is_packed(path):
        return f"{path}: not packed, left as it is"
    image = unpacked_image(path)
    fd, tmp = tempfile.mkstemp(prefix=".p2pd-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.chmod(tmp, 0o755)
        expected, got = _usage(path), _usage(Path(tmp))
        if got != expected or "Usage" not in expected[1]:
            raise UnpackError("the unpacked daemon does not answer -h as the packed one does")
        backup = path.with_name(path.name + PACKED_SUFFIX)
        backup.unlink(missing_ok=True)  # one kept from an earlier install of hivemind is not this one
        try:
            os.link(path, backup)
        except OSError:
            shutil.copy2(path, backup)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return f"{path}: unpacked ({os.path.getsize(backup) >> 20} MB packed -> {len(image) >> 20} MB); " \
           f"the packed daemon is kept as {backup.name}"


def restore(path: Path) -> str:
    path = Path(path)
    backup = path.with_name(path.name + PACKED_SUFFIX)
    if not backup.exists():
        return f"{path}: no packed daemon kept beside it, left as it is"
    os.replace(backup, path)
    return f"{path}: the packed daemon is back"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opendiloco.swarm.p2pd_binary",
                                     description="Unpack hivemind's UPX-packed p2p daemon once, so that each "
                                                 "start costs less CPU and memory.")
    parser.add_argument("--path", type=Path, default=None, help="the daemon (default: hivemind's)")
    parser.add_argument("--restore", action="store_true", help="put the packed daemon back")
    args = parser.parse_args(argv)
    path = args.path or daemon_path()
    try:
        print(restore(path) if args.restore else unpack(path))
    except Exception as e:  # noqa: BLE001 - an optimisation: whatever stops it, the install goes on
        print(f"{path}: left packed ({e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
