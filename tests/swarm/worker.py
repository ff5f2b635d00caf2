"""A minimal DiLoCo worker for swarm tests: a user's own loop, a small regression MLP, real swarm.

Writes one JSON line per outer step to ``--out``; with ``--dump`` it also saves, per outer step,
the pseudo-gradient it contributed and the average it received (to check the math from outside).
"""

import argparse
import functools
import json
import logging
import os
import signal
import sys
import time

import torch

from opendiloco import DiLoCoOptimizer
from opendiloco.comm.aggregation import Aggregation
from opendiloco.swarm.communicator import SwarmCommunicator
from opendiloco.swarm.daemon.node import start_dht
from opendiloco.swarm.membership import RunSecret
from opendiloco.swarm.settings import SwarmSettings
from opendiloco.testing.faults import RoundRecorder

Communicator = SwarmCommunicator
"""The communicator class the worker runs: an attacker's script replaces it with a subclass."""


def theta_max(opt) -> float:
    """The largest |value| of θ_global (inf or nan if it is not finite)."""
    return max(g.detach().abs().max().item() for g in opt.outer.global_params)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--peers-file", required=True)
    p.add_argument("--run-id", default="test")
    p.add_argument("--outer-steps", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--dump", default=None)
    p.add_argument("--compression", default="fp16")
    p.add_argument("--result-compression", default=None)
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--min-group-size", type=int, default=1)
    p.add_argument("--straggler-wait", type=float, default=8.0)
    p.add_argument("--allreduce-timeout", type=float, default=20.0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--stall-in-allreduce", nargs=2, type=float, default=None, metavar=("OUTER_STEP", "SECONDS"),
                   help="sleep inside the all-reduce of the first round at or after that outer step (the test kills "
                        "or stops us there)")
    p.add_argument("--fault-in-round", nargs=2, default=None, metavar=("OUTER_STEP", "FAULT"),
                   help="lose-confirms: the others' CONFIRMs never reach us; freeze: our streams go silent once our "
                        "parts and our shard's result are out (that outer step's attempts, until it took effect once)")
    p.add_argument("--poison-at", type=int, default=None, help="make the pseudo-gradient of this outer step NaN")
    p.add_argument("--corrupt-at", type=int, default=None,
                   help="perturb θ_global after the first ok sync at or after this outer step")
    p.add_argument("--join-timeout", type=float, default=30.0)
    p.add_argument("--matchmaking-timeout", type=float, default=30.0)
    p.add_argument("--max-wait", type=float, default=600.0)
    p.add_argument("--record-ttl", type=float, default=4.0, help="seconds this worker's record outlives its heartbeat")
    p.add_argument("--partition-hold", type=float, default=SwarmSettings.partition_hold)
    p.add_argument("--pace", default="fixed", choices=["fixed", "swarm"])
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--mix", type=float, default=0.0)
    p.add_argument("--run-until-stopped", action="store_true", help="ignore --outer-steps; train until SIGTERM")
    p.add_argument("--linger", action="store_true",
                   help="after --outer-steps, stay in the run (serving state, heartbeat), not training, until SIGTERM")
    p.add_argument("--aggregation", default="mean", choices=["mean", "centered-clip"])
    p.add_argument("--audit-chunks", type=int, default=4, help="chunks of each other owner's shard audited (0: none)")
    p.add_argument("--config-fingerprint", default="", help="the settings fingerprint this worker publishes")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{args.seed}] %(name)s: %(message)s")
    torch.set_num_threads(1)

    peers = open(args.peers_file).read().split()
    dht = start_dht(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    settings = SwarmSettings(run_id=args.run_id, compression=args.compression, min_group_size=args.min_group_size,
                             result_compression=args.result_compression,
                             straggler_wait=args.straggler_wait, allreduce_timeout=args.allreduce_timeout,
                             matchmaking_timeout=args.matchmaking_timeout, max_wait=args.max_wait,
                             heartbeat_interval=1.0, record_ttl=args.record_ttl, verify_timeout=3.0,
                             aggregation=Aggregation(args.aggregation), audit_chunks=args.audit_chunks,
                             config_fingerprint=args.config_fingerprint, partition_hold=args.partition_hold)
    comm = Communicator(dht, settings, secret=RunSecret.from_environment())  # closed if the env says so
    stall = (int(args.stall_in_allreduce[0]), args.stall_in_allreduce[1]) if args.stall_in_allreduce else None
    fault = (int(args.fault_in_round[0]), args.fault_in_round[1]) if args.fault_in_round else None
    comm.hooks = RoundRecorder(comm.peer_id, attempts=args.out + ".attempts", dump_dir=args.dump, stall=stall,
                               marker=args.out + ".inround", fault=fault)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: (stop.append(1), comm.interrupt()))  # a round waiting gives up

    torch.manual_seed(0)  # identical initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1)).to(args.device)
    opt = DiLoCoOptimizer(model.parameters(), local_steps=args.local_steps, communicator=comm,
                          inner_optimizer=functools.partial(torch.optim.AdamW, lr=3e-2),
                          outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                          pace=args.pace, fragments=args.fragments, overlap=args.overlap, mix=args.mix,
                          error_feedback=args.error_feedback)
    t0 = time.perf_counter()
    state = comm.download_state(timeout=args.join_timeout)
    download_s = time.perf_counter() - t0
    if state is not None:
        opt.load_shareable_state(state)
    gen = torch.Generator().manual_seed(args.seed)
    w_true = torch.linspace(-1, 1, 16)
    out = open(args.out, "a")
    out.write(json.dumps({"event": "start", "peer_id": comm.peer_id, "outer_step": opt.outer_step,
                          "inner_steps_total": opt.inner_steps_total,
                          "global_hash": opt.global_hash(), "pid": os.getpid(), "time": time.time(),
                          "downloaded": state is not None, "download_s": download_s, "theta_max": theta_max(opt),
                          "numel": sum(p.numel() for p in model.parameters())}) + "\n")
    out.flush()
    last_reported = None
    corrupted = False
    try:
        while (args.run_until_stopped or opt.outer_step < args.outer_steps) and not stop:
            x = torch.randn(64, 16, generator=gen)
            y = (x @ w_true).tanh()[:, None] + 0.05 * torch.randn(64, 1, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x.to(args.device)), y.to(args.device))
            loss.backward()
            before = opt.outer_step
            if args.poison_at == opt.outer_step and opt.local_step == args.local_steps - 1:
                with torch.no_grad():
                    model[0].weight.fill_(float("nan"))  # this worker blew up right before the sync
                    model[0].weight.grad = None
            opt.step()
            opt.zero_grad()
            comm.report_progress(outer_step=opt.outer_step, inner_step=opt.inner_steps_total, loss=loss.item(),
                                 global_hash=opt.global_hash())
            if args.step_delay:
                time.sleep(args.step_delay)
            if opt.last_sync is not None and opt.last_sync is not last_reported:
                s = last_reported = opt.last_sync
                if args.corrupt_at is not None and s.ok and opt.outer_step >= args.corrupt_at and not corrupted:
                    corrupted = True  # the first successful sync from corrupt_at on (a busy machine may fail one)
                    with torch.no_grad():  # a silent divergence (e.g. a bit flip) that the swarm must heal
                        opt.outer.global_params[0].add_(1e-3)
                        opt.outer.reset_local()
                out.write(json.dumps({"event": "sync", "ok": s.ok, "outer_step": opt.outer_step, "before": before,
                                      "group_size": s.group_size, "peers": list(s.peers),
                                      "global_hash": opt.global_hash(), "loss": loss.item(),
                                      "allreduce_s": s.allreduce_s, "reason": s.reason, "steps": s.steps,
                                      "contributed": s.contributed_steps, "dropped": s.dropped_steps,
                                      "weight": s.weight, "inner_steps_total": opt.inner_steps_total,
                                      "fragment": s.fragment, "bytes_sent": s.extra.get("bytes_sent"),
                                      "clipped": s.extra.get("clipped"), "capped": s.extra.get("capped"),
                                      "settled": s.extra.get("settled"), "counted": s.extra.get("counted"),
                                      "matchmaking_s": s.extra.get("matchmaking_s"),
                                      "carried": s.extra.get("carried"), "theta_max": theta_max(opt),
                                      "time": time.time()}) + "\n")
                out.flush()
        if args.linger and not stop:
            out.write(json.dumps({"event": "linger", "outer_step": opt.outer_step, "global_hash": opt.global_hash(),
                                  "inner_steps_total": opt.inner_steps_total, "time": time.time()}) + "\n")
            out.flush()
            while not stop:
                time.sleep(0.1)
    finally:
        out.write(json.dumps({"event": "end", "inner_steps_total": opt.inner_steps_total,
                              "contributed": opt.contributed_steps, "dropped": opt.dropped_steps,
                              "outer_step": opt.outer_step, "time": time.time()}) + "\n")
        out.flush()
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
