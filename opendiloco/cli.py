"""The ``opendiloco`` command: one argparse subcommand per function.

Heavy imports (torch, transformers, hivemind) happen inside the subcommands, so that
``--help`` and config errors answer at once.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path

EXIT_CONFIG = 2


def _add_config_command(sub, name: str, func, *, help: str, description: str, config_help: str):
    """A subcommand that reads ``--config`` and takes any config key as an override after its options
    (``--section.key value``: whole option names only, so that an override is never read as an abbreviation)."""
    p = sub.add_parser(name, allow_abbrev=False, help=help, description=description)
    p.add_argument("--config", "-c", type=Path, help=config_help)
    p.set_defaults(func=func, takes_overrides=True)
    return p


def _add_train(sub) -> None:
    p = _add_config_command(
        sub, "train", cmd_train, help="train a model with DiLoCo (alone, or in a swarm)",
        description="Train with DiLoCo. Any config key can be overridden after the options, e.g. "
                    "--optim.local-steps 50 --data.seq-len 256 --swarm.initial-peers ADDR1 ADDR2 "
                    "(see docs/config.md). A swarm worker needs the run's secret (OPENDILOCO_RUN_SECRET_FILE=FILE, "
                    "FILE made once with `opendiloco secret FILE`), or --swarm.open for an open run (docs/trust.md).",
        config_help="TOML config (e.g. configs/tiny.toml)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the run dir")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")


def _config(args, overrides: list[str]):
    """The config of ``--config`` and its overrides; None (with the one-line error said) if it is refused."""
    from .train.config import ConfigError, load_config

    try:
        return load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return None


def _freeze_imports() -> None:
    """Leaves what the imports made (torch and hivemind: some 330k objects) out of every garbage
    collection from now on: a full collection, and the one at exit, would walk them all (about 1.5 s
    of CPU at a worker's exit on 2 cores). They are freed as usual when nothing refers to them."""
    gc.collect()
    gc.freeze()


def cmd_train(args, overrides: list[str]) -> int:
    from .train.config import to_toml

    cfg = _config(args, overrides)
    if cfg is None:
        return EXIT_CONFIG
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    from .errors import SwarmError
    from .train.checkpoint import CheckpointError
    from .train.trainer import TrainError, train

    _freeze_imports()
    try:
        result = train(cfg, resume=args.resume)
    except SwarmError as e:  # an unreachable or malformed peer, a port in use, other settings
        print(f"opendiloco train: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (TrainError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the machine's, not the program's: a full disk, a read-only or missing dir
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if result.stopped:
        print(f"stopped at inner step {result.inner_steps}; continue with --resume", file=sys.stderr)
    return 0


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="draw the loss curves of one or several workers to a PNG")
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="worker run dirs (with metrics.jsonl)")
    p.add_argument("--out", "-o", type=Path, default=Path("loss.png"), help="PNG to write (default loss.png)")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    from .extras import MissingExtra
    from .train.plot import plot_runs

    try:
        out = plot_runs(args.run_dirs, args.out, title=args.title)
    except (FileNotFoundError, MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _add_dht(sub) -> None:
    # The options have the names of the config keys they match in train, status and doctor; the short
    # spellings of earlier versions are kept as aliases.
    p = sub.add_parser("dht", help="run a bootstrap DHT node and print the addresses others join through")
    p.add_argument("--swarm.initial-peers", "--initial-peers", dest="initial_peers", nargs="*", default=[],
                   help="join an existing swarm (redundant bootstraps)")
    p.add_argument("--swarm.host-maddrs", "--host-maddrs", dest="host_maddrs", nargs="+",
                   default=["/ip4/0.0.0.0/tcp/31337"], help="listen addresses (default: all interfaces, port 31337)")
    p.add_argument("--swarm.announce-maddrs", "--announce-maddrs", dest="announce_maddrs", nargs="*", default=[],
                   help="public addresses to advertise (behind NAT or a port mapping)")
    p.add_argument("--swarm.identity-path", "--identity-path", dest="identity_path", default=None,
                   help="private key file: a stable peer id across restarts")
    p.add_argument("--addrs-file", default=None, help="also write the addresses to this file")
    p.add_argument("--run.metrics-port", "--metrics-port", dest="metrics_port", default=None, metavar="PORT",
                   help="serve the node's figures for Prometheus on this port (0: any free port; default off)")
    p.add_argument("--run.metrics-host", "--metrics-host", dest="metrics_host", default="127.0.0.1",
                   help="where --run.metrics-port listens (default 127.0.0.1)")
    p.set_defaults(func=cmd_dht)


def cmd_dht(args) -> int:
    from .swarm.daemon.bootstrap import run_bootstrap
    from .swarm.daemon.node import SwarmError

    _freeze_imports()
    try:
        port = _port(args.metrics_port, "--metrics-port") if args.metrics_port is not None else None
        return run_bootstrap(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs,
                             announce_maddrs=args.announce_maddrs, identity_path=args.identity_path,
                             addrs_file=args.addrs_file, metrics_port=port, metrics_host=args.metrics_host)
    except (SwarmError, ValueError) as e:
        print(f"opendiloco dht: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="print a table of the live workers of a run",
                       description="Reads the run's records from the DHT. The peers, run id and secret come from "
                                   "the options, else from the [swarm] section of --config (the workers' config).")
    p.add_argument("--config", "-c", type=Path, help="TOML config (the workers'): initial_peers, run_id, secret_file")
    p.add_argument("--swarm.initial-peers", "--initial-peers", dest="initial_peers", nargs="+", default=None)
    p.add_argument("--swarm.run-id", "--run-id", dest="run_id", default=None, help="default: opendiloco")
    p.add_argument("--swarm.secret-file", "--secret-file", dest="secret_file", default=None,
                   help="the secret of a closed run (default: $OPENDILOCO_RUN_SECRET, $OPENDILOCO_RUN_SECRET_FILE)")
    p.add_argument("--serve", metavar="PORT", default=None,
                   help="serve a live page of the run on this port (0: any free port) instead of printing a table")
    p.add_argument("--host", default="127.0.0.1",
                   help="where --serve listens (default 127.0.0.1; 0.0.0.0 shows the run to anyone who can reach it)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between reads of the run with --serve")
    p.set_defaults(func=cmd_status)


def _port(value: str, option: str = "--serve") -> int:
    """A TCP port from the command line (0: any free one), or ``ValueError`` with the sentence to print."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{option} wants a port number from 0 to 65535, got {value!r}")
    return port


def cmd_status(args) -> int:
    if args.config is not None:  # what the options leave unset comes from the workers' config
        cfg = _config(args, [])
        if cfg is None:
            return EXIT_CONFIG
        args.initial_peers = args.initial_peers or cfg.swarm.initial_peers
        args.run_id = args.run_id or cfg.swarm.run_id
        args.secret_file = args.secret_file or cfg.swarm.secret_file
    if not args.initial_peers:
        print("opendiloco status: no peer to ask: give --swarm.initial-peers ADDR, or --config with "
              "[swarm] initial_peers", file=sys.stderr)
        return EXIT_CONFIG
    args.run_id = args.run_id or "opendiloco"
    from .swarm.daemon.node import SwarmError
    from .swarm.membership import RunSecret
    from .swarm.ops.status import fetch_workers, format_table, serve_status
    from .train.config import ConfigError, check_run_id

    try:
        check_run_id(args.run_id)
        port = _port(args.serve) if args.serve is not None else None
        if not args.interval > 0:
            raise ValueError(f"--interval must be more than 0 seconds, got {args.interval:g}")
        secret = RunSecret.from_environment(args.secret_file)
        if port is not None:
            return serve_status(args.initial_peers, args.run_id, secret, host=args.host, port=port,
                                interval=args.interval)
        workers = fetch_workers(args.initial_peers, args.run_id, secret)
    except (ConfigError, ValueError, SwarmError) as e:
        print(f"opendiloco status: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:  # --serve: the port is taken, the host is not this machine's
        print(f"opendiloco status: cannot serve on {args.host}:{args.serve}: {e.strerror or e}", file=sys.stderr)
        return EXIT_CONFIG
    print(format_table(workers, args.run_id))
    return 0


def _add_secret(sub) -> None:
    p = sub.add_parser("secret", help="write a new random run secret to a file (for a closed run)",
                       description="Writes 256 random bits, readable by you only, to PATH. Start every worker of "
                                   "the run with OPENDILOCO_RUN_SECRET_FILE=PATH (or [swarm] secret_file = PATH).")
    p.add_argument("path", type=Path, metavar="PATH", help="file to create (never overwritten)")
    p.set_defaults(func=cmd_secret)


def cmd_secret(args) -> int:
    from .swarm.membership import new_secret_file

    try:
        new_secret_file(str(args.path))
    except FileExistsError:
        print(f"opendiloco secret: {args.path} already exists; not overwritten", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"opendiloco secret: cannot write {args.path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote a new run secret to {args.path}")
    return 0


def _add_doctor(sub) -> None:
    p = _add_config_command(
        sub, "doctor", cmd_doctor, help="check that this machine can join a swarm, and say what to do if not",
        description="Starts a p2p daemon as a worker would (the [swarm] section of --config and its overrides: "
                    "initial_peers, host_maddrs, announce_maddrs, client_mode) and asks each initial peer: does it "
                    "answer, how far is it, how far off is this clock, can it dial this node back. One line per "
                    "finding; exit status 1 if any failed.",
        config_help="TOML config (the worker's)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for each peer (default 10)")
    p.add_argument("--startup-timeout", type=float, default=30.0,
                   help="seconds the p2p daemon may take to start (default 30, as a worker)")


def cmd_doctor(args, overrides: list[str]) -> int:
    cfg = _config(args, overrides)
    if cfg is None:
        return EXIT_CONFIG
    if not (args.timeout > 0 and args.startup_timeout > 0):
        print("opendiloco doctor: --timeout and --startup-timeout must be positive", file=sys.stderr)
        return EXIT_CONFIG
    from .errors import SwarmError
    from .swarm.ops.doctor import examine

    s = cfg.swarm
    try:
        findings = examine(initial_peers=s.initial_peers, host_maddrs=s.host_maddrs, announce_maddrs=s.announce_maddrs,
                           client_mode=s.client_mode, startup_timeout=args.startup_timeout, timeout=args.timeout)
    except SwarmError as e:
        print(f"opendiloco doctor: {e}", file=sys.stderr)
        return EXIT_CONFIG
    for finding in findings:
        print(finding, flush=True)
    return 1 if any(f.level == "fail" for f in findings) else 0


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export", help="write a run's θ_global as a Hugging Face model directory (config.json + safetensors)",
        description="Writes θ_global of the newest intact checkpoint of RUN_DIR (or of the checkpoint file given) "
                    "to OUT_DIR as a Hugging Face model: AutoModelForCausalLM.from_pretrained(OUT_DIR) loads it. "
                    "The run's tokenizer is written beside it where it is a Hugging Face one (docs/models.md).")
    p.add_argument("source", type=Path, metavar="RUN_DIR_OR_CHECKPOINT", help="a worker's run dir, or a .pt checkpoint")
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="directory to create (must not exist, or be empty)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it holds something")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from .train.export import ExportError, export

    try:
        done = export(args.source, args.out, overwrite=args.overwrite)
    except ExportError as e:
        print(f"opendiloco export: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        print(f"opendiloco export: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    note = "" if done["tokenizer_written"] else \
        f" (no Hugging Face tokenizer written: the run used {done['tokenizer']!r})"
    print(f"wrote θ_global of {done['checkpoint']} (outer step {done['outer_step']}, inner step "
          f"{done['inner_step']}) to {done['path']}{note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opendiloco", description="Decentralized DiLoCo training for PyTorch.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train(sub)
    _add_plot(sub)
    _add_dht(sub)
    _add_status(sub)
    _add_secret(sub)
    _add_doctor(sub)
    _add_export(sub)
    return parser


class LogFormatter(logging.Formatter):
    """Names levels the standard way whatever was imported: hivemind renames WARNING to WARN when it
    is imported, so a run's warnings would otherwise change name partway through."""

    NAMES = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
             logging.CRITICAL: "CRITICAL"}

    def format(self, record: logging.LogRecord) -> str:
        record.levelname = self.NAMES.get(record.levelno, record.levelname)
        return super().format(record)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(LogFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
    if getattr(args, "takes_overrides", False):
        return args.func(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
