"""Starting a DHT node: address checks, identities, and daemons that die with their worker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Sequence

import hivemind
import torch.multiprocessing
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from opendiloco.errors import SwarmError

from ..connectivity import reachability, relays
from ..signing import Identity, SignedRecordValidator
from . import hivemind_privates
from .dht_calls import DhtCalls
from .dialing import dial_from_ephemeral_ports
from .p2pd_binary import use_unpacked

log = logging.getLogger(__name__)

# hivemind switches torch to the "file_system" sharing strategy when imported, for the MPFutures that
# carry every DHT call. Our calls are answered by number (``dht_calls``), and the one MPFuture hivemind
# still makes per node (its ready flag) reaches the DHT process by the fork: torch's own default
# serves it without a torch_shm_manager process, which "file_system" starts in every process that
# makes a node (about 0.5 s of CPU each, and 0.6 s of wall time on 2 busy cores).
torch.multiprocessing.set_sharing_strategy("file_descriptor")


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # exited while we looked
    return found


def parse_maddrs(addrs: Sequence[str], *, what: str, require_peer_id: bool = False) -> list[str]:
    """Checks multiaddrs before hivemind sees them; returns them as strings."""
    out = []
    for addr in addrs:
        if not isinstance(addr, str) or not addr.strip():
            raise SwarmError(f"{what}: empty address")
        addr = addr.strip()
        try:
            maddr = Multiaddr(addr)
        except Exception as e:  # the multiaddr library raises several unrelated types
            raise SwarmError(f"{what}: {addr!r} is not a multiaddr ({e}); expected e.g. "
                             "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...") from None
        protocols = {p.name for p in maddr.protocols()}
        if require_peer_id and "p2p" not in protocols:
            raise SwarmError(f"{what}: {addr!r} has no /p2p/<peer id> part; copy the full address "
                             "printed by `opendiloco dht` or a running worker")
        out.append(addr)
    return out


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """Refuses a fixed TCP listen port that another process holds.

    p2pd may bind with SO_REUSEPORT (``LIBP2P_TCP_REUSEPORT``, ``dialing.py``), and a second node on a
    taken port would then start anyway and share it with the first: peers would reach either one at
    random. A plain bind (SO_REUSEADDR only, which on Linux never shares a port with a listening
    socket) tells whether the port is free.
    """
    for addr in host_maddrs:
        parts = addr.strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or parts[3] in ("", "0"):
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((parts[1], int(parts[3])))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise SwarmError(f"port {parts[3]} is already in use on {parts[1]} (another `opendiloco dht` "
                                     f"or worker?): stop it, or listen on another port ({addr})") from None
                if e.errno == errno.EADDRNOTAVAIL:
                    raise SwarmError(f"host_maddrs: {addr!r}: {parts[1]} is not an address of this machine") from None
                raise SwarmError(f"host_maddrs: cannot listen on {addr!r}: {e.strerror or e}") from None


def ensure_identity(path: str) -> None:
    """Creates a persistent peer identity (a private key file) if there is none yet."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        P2P.generate_identity(path)  # RSA: hivemind checks that such a file's id is not taken
        log.info("created a new peer identity at %s", path)


WORKER_IDENTITY = "peer.key"
"""The file in a worker's run dir that holds its peer identity (``worker_identity``)."""


def worker_identity(run_dir: str) -> str:
    """The path of the peer identity a worker keeps in its run dir, created on its first start.

    A worker restarted in the same run dir (``--resume`` after a crash) comes back as the same peer, so
    the workers it averaged with still know it: the run's majority (``majority.py``) counts it as back
    instead of missing, and its record replaces its old one. With a fresh identity per launch, a
    survivor whose last rounds were with workers that crashed and came back held its rounds for
    ``partition_hold`` as if the run were split. The run dir's lock keeps two processes from using the
    file at once; a copied run dir brings the identity along (delete ``peer.key`` in the copy)."""
    path = os.path.join(run_dir, WORKER_IDENTITY)
    if not os.path.exists(path):
        os.makedirs(run_dir, exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"  # written whole, then renamed: a crash leaves no torn key
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        Identity.generate(partial)
        os.replace(partial, path)
        log.info("created this worker's peer identity at %s", path)
    return path


def _keep_tasks_referenced() -> None:
    """Holds a strong reference to every asyncio task of this process until it is done.

    The DHT process starts one task per request (``asyncio.create_task`` in ``DHT.run``) and
    keeps no reference to it; the event loop holds tasks only weakly, so under load the garbage
    collector can destroy one mid-request ("Task was destroyed but it is pending!"). The
    caller's future then never resolves and the worker hangs (seen in ``get_visible_maddrs`` with
    4 workers starting on 2 cores). Called only inside the DHT process.
    """
    running: set[asyncio.Task] = set()
    create_task = asyncio.create_task

    def create_task_kept(coro, **kwargs):
        task = create_task(coro, **kwargs)
        running.add(task)
        task.add_done_callback(running.discard)
        return task

    asyncio.create_task = create_task_kept


class WorkerBoundDHT(hivemind.DHT):
    """A hivemind DHT whose process (and its p2pd) exits when the process that started it dies.

    Plain hivemind leaves the DHT process and p2pd running for minutes after its parent is
    SIGKILLed; a watchdog thread in the DHT process ends both at once.
    ``identity``: the key of its p2p identity, which signs the records this node's worker stores.
    """

    identity: Identity | None = None

    def start(self) -> None:
        self._calls = DhtCalls()  # made before the fork: both processes hold its pipe
        super().start()
        self._calls.started()

    def get(self, key, latest: bool = False, return_future: bool = False, **kwargs):
        future = self._call(hivemind_privates.DHT_GET, dict(key=key, latest=latest, **kwargs))
        return future if return_future else future.result()

    def store(self, key, value, expiration_time, subkey=None, return_future: bool = False, **kwargs):
        future = self._call(hivemind_privates.DHT_STORE, dict(key=key, value=value, expiration_time=expiration_time,
                                                              subkey=subkey, **kwargs))
        return future if return_future else future.result()

    def run_coroutine(self, coro, return_future: bool = False):
        future = self._call(hivemind_privates.DHT_RUN_COROUTINE, dict(coro=coro))
        return future if return_future else future.result()

    def _call(self, method: str, kwargs: dict):
        """hivemind's calls, answered through ``dht_calls`` instead of an ``MPFuture`` each."""
        assert os.getpid() != self.pid, "calling the DHT's external interface from inside its process deadlocks"
        return self._calls.call(hivemind_privates.dht_request_pipe(self), method, kwargs)

    def shutdown(self) -> None:
        if self.is_alive():
            pipe = hivemind_privates.dht_request_pipe(self)
            self._calls.send(pipe, (hivemind_privates.DHT_SHUTDOWN, [], {}))
            pipe.close()
            self.join(self.shutdown_timeout)
            if self.is_alive():
                log.warning("the DHT process did not shut down within %ss; terminating it", self.shutdown_timeout)
                self.terminate()

    def run(self) -> None:
        self._calls.serve_answers()
        _keep_tasks_referenced()
        use_unpacked()  # the daemon unpacked into this project's cache by setup, where it is there
        parent = hivemind_privates.dht_parent_pid(self)

        def watchdog():
            while True:
                time.sleep(0.5)
                if os.getppid() != parent:
                    for child in _children(os.getpid()):  # p2pd
                        try:
                            os.kill(child, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    os._exit(0)

        threading.Thread(target=watchdog, name="opendiloco-dht-watchdog", daemon=True).start()
        super().run()


def start_dht(
    *,
    initial_peers: Sequence[str] = (),
    host_maddrs: Sequence[str] = ("/ip4/0.0.0.0/tcp/0",),
    announce_maddrs: Sequence[str] = (),
    identity_path: str | None = None,
    client_mode: bool = False,
    use_relay: bool = True,
    startup_timeout: float = 30.0,
    identity_locked: bool = False,
) -> hivemind.DHT:
    """Starts a DHT node (joining ``initial_peers`` if any), with clear errors on bad input.

    The node stores only records signed by their writer (``SignedRecordValidator``). Without an
    ``identity_path`` it gets a fresh identity; either way its key is kept as ``dht.identity``.
    ``identity_locked``: the caller holds a lock that keeps any other process from using the identity
    (a worker's own, ``worker_identity``), so hivemind's check that no live peer holds it is skipped:
    that check reads RSA keys only, and dials the peer id, which after a crash only finds the dead node.
    """
    initial_peers = parse_maddrs(initial_peers, what="initial peer", require_peer_id=True)
    host_maddrs = parse_maddrs(host_maddrs, what="host_maddrs")
    announce_maddrs = parse_maddrs(announce_maddrs, what="announce_maddrs")
    for addr in announce_maddrs:
        parts = addr.split("/")
        if any(parts[i] in ("tcp", "udp") and parts[i + 1] == "0" for i in range(len(parts) - 1)):
            raise SwarmError(f"announce_maddrs: {addr!r} has port 0; announce the real, reachable port")
    check_ports_free(host_maddrs)
    dial_from_ephemeral_ports()
    kwargs = dict(host_maddrs=host_maddrs, client_mode=client_mode, use_relay=use_relay,
                  startup_timeout=startup_timeout)
    if use_relay:
        kwargs.update(relays.daemon_options(client_mode, initial_peers))
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    temporary = None
    if identity_path:
        ensure_identity(identity_path)
        if identity_locked:
            kwargs["check_if_identity_free"] = False
    else:  # a fresh Ed25519 key: nobody else can hold it, so hivemind's check (RSA files only) is skipped
        _, identity_path = temporary = Identity.temporary()
        kwargs["check_if_identity_free"] = False
    try:
        identity = Identity.from_file(identity_path)
    except (OSError, ValueError) as e:
        raise SwarmError(f"identity {identity_path!r} cannot be used: {e}") from None
    kwargs["identity_path"] = identity_path
    try:
        dht = _start(initial_peers, identity, startup_timeout, kwargs)
    finally:
        if temporary is not None:  # p2pd has read it (or failed to): the key lives on in memory only
            _remove_temporary_identity(temporary[1])
    try:  # every node answers peers that ask whether it can dial them back (``opendiloco doctor``)
        dht.run_coroutine(reachability.serve, return_future=True).result(startup_timeout)
    except Exception as e:  # a node without the service still trains; peers' checks then say so
        log.warning("could not serve reachability checks: %s: %s", type(e).__name__, e)
    return dht


CLIENT_START_TRIES = 3
"""A client-mode daemon (``-autoRelay`` with its initial peers as static relays) now and then fails
its bootstrap at once ("failed to connect to bootstrap peers", 2-3 starts in 50 on loopback) while
the same peer is reachable: it is started again, within the startup timeout."""


def _start(initial_peers: list[str], identity: Identity, startup_timeout: float, kwargs: dict) -> hivemind.DHT:
    deadline = time.monotonic() + startup_timeout
    tries = CLIENT_START_TRIES if kwargs.get("client_mode") and initial_peers else 1
    for attempt in range(1, tries + 1):
        try:
            return _start_once(initial_peers, identity, max(1.0, deadline - time.monotonic()), kwargs)
        except _BootstrapFailed as e:
            if attempt == tries or time.monotonic() > deadline - 2.0:
                raise SwarmError(str(e)) from None
            log.info("the p2p daemon could not reach its initial peers (try %d of %d): starting it again",
                     attempt, tries)
            time.sleep(0.5)
    raise AssertionError("unreachable")


class _BootstrapFailed(Exception):
    """The daemon reached none of the initial peers (the message is the user's one line)."""


def _start_once(initial_peers: list[str], identity: Identity, startup_timeout: float,
                kwargs: dict) -> hivemind.DHT:
    start = time.monotonic()
    dht = WorkerBoundDHT(initial_peers=initial_peers or None, start=True, await_ready=False,
                         record_validators=[SignedRecordValidator()], **kwargs)
    dht.identity = identity
    dht.relays = tuple(kwargs.get("trusted_relays", ()))  # where it holds a slot (client mode): its record names them
    dht.rejoin_peers = tuple(initial_peers)  # dialled again if the node loses every peer (``rejoin.py``)
    identity_path = kwargs["identity_path"]
    try:
        dht.wait_until_ready(timeout=startup_timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):  # distinct types before Python 3.11
        dht.shutdown()
        raise SwarmError(f"could not start the DHT node within {startup_timeout:.0f}s "
                         f"(initial peers: {', '.join(initial_peers) or 'none'})") from None
    except Exception as e:
        dht.shutdown()
        msg = str(e)
        if "bootstrap" in msg or "connect" in msg:
            raise _BootstrapFailed(f"none of the initial peers could be reached after {time.monotonic() - start:.1f}s: "
                                   f"{', '.join(initial_peers)} (is the peer running, the port open, the address "
                                   "copied whole?)") from None
        clock = re.search(r"local time must be within ([\d.]+) seconds.*local: ([\d.]+), peer: ([\d.]+)", msg)
        if clock:
            limit, local, peer = map(float, clock.groups())
            side = "ahead of" if local > peer else "behind"
            raise SwarmError(f"this machine's clock is {abs(local - peer):.1f} s {side} the initial peer's, and the "
                             f"DHT admits no peer more than {limit:g} s off: set the clock (NTP, or "
                             "`timedatectl set-ntp true`) and start again") from None
        if "identity" in msg.lower() or "taken" in msg.lower():
            raise SwarmError(f"identity {identity_path!r} is already used by a live peer: {msg}") from None
        raise SwarmError(f"could not start the DHT node: {msg}") from None
    return dht


def _remove_temporary_identity(path: str) -> None:
    try:
        os.chmod(path, 0o600)
        os.unlink(path)
        os.rmdir(os.path.dirname(path))
    except OSError as e:
        log.debug("could not remove the temporary identity %s: %s", path, e)


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs(latest=True)]
