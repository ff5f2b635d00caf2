"""The p2p daemon that hivemind's wheel ships, unpacked once into this project's cache.

hivemind 1.1.12 ships ``p2pd`` packed with UPX. Every daemon start (one per DHT node: each worker,
each bootstrap, every ``opendiloco status`` and ``doctor``) first decompresses 28 MB of program
into private memory: 0.25-0.3 s of CPU of the 0.9 s a start costs, and 28 MB no two daemons share.
Unpacked, a start costs about 0.6 CPU-s and the program's pages are shared. One worker's one start
hardly notices; a test suite that starts hundreds of daemons does.

hivemind's installed files are never changed: ``python -m opendiloco.swarm.daemon.p2pd_binary`` (run by
``scripts/setup.sh``) writes the unpacked program into this project's cache directory
(``$OPENDILOCO_CACHE_DIR``, else ``$XDG_CACHE_HOME/opendiloco``, else ``~/.cache/opendiloco``), under
a name taken from the hash that pip recorded for hivemind's daemon, so a copy made from another
hivemind release is never used. :func:`use_unpacked` makes this process's daemon starts use that
copy where it exists (``OPENDILOCO_UNPACKED_P2PD=0`` turns that off); anywhere else hivemind starts
its own daemon as shipped.

Debian 13 has no ``upx`` to unpack it with, so this does it from the running program: the packed
daemon is started under ``ptrace`` and stopped at the first system call of Go's runtime
(``arch_prctl``, setting up thread-local storage). By then UPX's stub has decompressed every
segment and gone, and no Go code has written to them (what the runtime writes first lies in
.bss, past the file's bytes). The original ELF header and program headers sit at the start of
the first segment; each loadable segment is read from ``/proc/PID/mem`` and written to its file
offset. The result must answer ``-h`` exactly as the packed daemon does before it is kept.

An optimisation, never a requirement: anywhere it cannot be done (another architecture, ptrace
not allowed, a daemon packed some other way) nothing is written, with a line saying why.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import ctypes
import hashlib
import os
import platform
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
    """Where hivemind's wheel installed its daemon."""
    from importlib.resources import files

    return Path(str(files("hivemind.hivemind_cli").joinpath("p2pd")))


def cache_dir() -> Path:
    """This project's cache directory."""
    if os.environ.get("OPENDILOCO_CACHE_DIR"):
        return Path(os.environ["OPENDILOCO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "opendiloco"


def recorded_hash() -> str | None:
    """The sha256 that pip recorded for hivemind's daemon (hex), or None where there is no record."""
    from importlib import metadata

    try:
        files = metadata.distribution("hivemind").files or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.as_posix().endswith("hivemind_cli/p2pd") and entry.hash is not None and entry.hash.mode == "sha256":
            return base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    return None


def file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cached_path() -> Path | None:
    """Where the unpacked copy of hivemind's installed daemon is kept (whether or not it is there)."""
    recorded = recorded_hash()
    return None if recorded is None else cache_dir() / f"p2pd-{recorded[:16]}"


_ORIGINAL_PATH = None


def use_unpacked() -> Path | None:
    """Makes the daemons this process (and its children) start run the cached unpacked copy, where
    there is one; returns it, or None where hivemind's own daemon is started as shipped."""
    global _ORIGINAL_PATH
    if os.environ.get("OPENDILOCO_UNPACKED_P2PD", "1") == "0":
        return None
    copy = cached_path()
    if copy is None or not os.access(copy, os.X_OK):
        return None
    import hivemind.hivemind_cli as cli
    from hivemind.p2p import p2p_daemon

    if _ORIGINAL_PATH is None:
        _ORIGINAL_PATH = p2p_daemon.path

    def resource_path(package, resource):  # hivemind asks for its daemon by package and name
        if package is cli and resource == p2p_daemon.P2PD_FILENAME:
            return contextlib.nullcontext(copy)
        return _ORIGINAL_PATH(package, resource)

    p2p_daemon.path = resource_path
    return copy


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


def unpack(path: Path, dest: Path) -> str:
    """Writes the unpacked program of the packed daemon at ``path`` to ``dest`` (``path`` is only read);
    one line saying what it did. Raises :class:`UnpackError` (nothing written) where that cannot be done."""
    path, dest = Path(path), Path(dest)
    if not is_packed(path):
        return f"{path}: not packed, nothing to unpack"
    image = unpacked_image(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".p2pd-", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        os.chmod(tmp, 0o755)
        expected, got = _usage(path), _usage(Path(tmp))
        if got != expected or "Usage" not in expected[1]:
            raise UnpackError("the unpacked daemon does not answer -h as the packed one does")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return f"{path}: unpacked into {dest} ({os.path.getsize(path) >> 20} MB packed -> {len(image) >> 20} MB)"


def restore_installed(path: Path, recorded: str | None) -> str | None:
    """Earlier versions of this project unpacked hivemind's daemon in place and kept the shipped one
    beside it as ``p2pd.upx``: put it back where it is the file pip recorded."""
    backup = path.with_name(path.name + PACKED_SUFFIX)
    if not backup.exists() or recorded is None or file_hash(backup) != recorded:
        return None
    os.replace(backup, path)
    return f"{path}: hivemind's daemon is back as pip installed it"


def install(dest: Path | None = None) -> list[str]:
    """What setup runs: hivemind's daemon as pip installed it, and its unpacked copy in the cache."""
    path, recorded = daemon_path(), recorded_hash()
    lines = [line for line in [restore_installed(path, recorded)] if line]
    dest = dest or cached_path()
    if dest is None:
        return lines + [f"{path}: pip has no record of it, left as it is"]
    if recorded is not None and file_hash(path) != recorded:
        return lines + [f"{path}: not the file pip recorded, so not unpacked"]
    if dest.exists():
        return lines + [f"{dest}: unpacked already"]
    try:
        return lines + [unpack(path, dest)]
    except Exception as e:  # noqa: BLE001 - an optimisation: whatever stops it, the install goes on
        return lines + [f"{path}: not unpacked ({e}); hivemind's daemon is used as shipped"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opendiloco.swarm.daemon.p2pd_binary",
                                     description="Unpack hivemind's UPX-packed p2p daemon once into this project's "
                                                 "cache, so that each start costs less CPU and memory. hivemind's "
                                                 "own files are left as pip installed them.")
    parser.add_argument("--path", type=Path, default=None, help="unpack this packed daemon instead (needs --out)")
    parser.add_argument("--out", type=Path, default=None, help="where the unpacked program goes "
                                                               "(default: the cache, named for hivemind's daemon)")
    args = parser.parse_args(argv)
    if args.path is not None:
        if args.out is None:
            parser.error("--path needs --out")
        try:
            print(unpack(args.path, args.out))
        except Exception as e:  # noqa: BLE001 - one line, never a traceback
            print(f"{args.path}: not unpacked ({e})")
        return 0
    for line in install(args.out):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
