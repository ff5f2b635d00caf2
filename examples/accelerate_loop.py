"""An `accelerate launch` training loop as one DiLoCo worker of several processes (docs/integrations.md).

Every process of the job trains the same replica on its share of the worker's batches (DDP); the job's
first process joins the swarm for all of them (`LocalRanks`), the others apply what it hands them.
Without GPUs (`--multi_gpu` then runs the processes on the CPU, over gloo) as with them.

    opendiloco secret run.secret; export OPENDILOCO_RUN_SECRET_FILE=run.secret   # on every worker
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py runs/w0
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py runs/w1 /ip4/IP/tcp/PORT/p2p/PEER_ID
"""

import functools
import logging
import sys

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from opendiloco import DiLoCoOptimizer, connect
from opendiloco.comm import LocalRanks
from opendiloco.integrations import RoundLog

logging.basicConfig(level=logging.INFO)
workdir, peers = sys.argv[1], sys.argv[2:]
accelerator = Accelerator()
torch.manual_seed(0)  # the same initial weights on every worker
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4))
starts = torch.randint(256, (1024, 1), generator=torch.Generator().manual_seed(sum(map(ord, workdir))))
data = [{"input_ids": row, "labels": row} for row in (starts + torch.arange(32)) % 256]  # this worker's own data
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)  # 8 rows per process
model, loader = accelerator.prepare(model, loader)
swarm = functools.partial(connect, peers, identity_dir=workdir, run_id="accelerate-example", min_group_size=2,
                          model=accelerator.unwrap_model(model))
with LocalRanks(swarm if accelerator.is_main_process else None) as comm:  # the first process joins the swarm
    optimizer = DiLoCoOptimizer(model.parameters(), local_steps=10, communicator=comm, module=model,
                                inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    rounds = RoundLog(optimizer)  # logs each outer step: θ_global's hash, the same on every process
    for _, batch in zip(range(40), loader):  # 40 inner steps
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        rounds()
