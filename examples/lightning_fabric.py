"""A Lightning Fabric loop as one worker of a closed 2-worker DiLoCo swarm (docs/integrations.md).

    opendiloco secret run.secret; export OPENDILOCO_RUN_SECRET_FILE=run.secret   # on every worker
    python examples/lightning_fabric.py runs/w0          # the first worker prints the address others join
    python examples/lightning_fabric.py runs/w1 /ip4/IP/tcp/PORT/p2p/PEER_ID
"""

import functools
import logging
import sys

import torch
from lightning.fabric import Fabric
from transformers import LlamaConfig, LlamaForCausalLM

from opendiloco import DiLoCoOptimizer, connect
from opendiloco.integrations import RoundLog

logging.basicConfig(level=logging.INFO)
workdir, peers = sys.argv[1], sys.argv[2:]
fabric = Fabric(accelerator="cpu", devices=1)
torch.manual_seed(0)  # the same initial weights on every worker
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4))
starts = torch.randint(256, (512, 1), generator=torch.Generator().manual_seed(sum(map(ord, workdir))))
data = [{"input_ids": row, "labels": row} for row in (starts + torch.arange(32)) % 256]  # this worker's own data
with connect(peers, identity_dir=workdir, run_id="fabric-example", min_group_size=2, model=model) as comm:
    diloco = DiLoCoOptimizer(model.parameters(), local_steps=10, communicator=comm, module=model,
                             inner_optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    model, optimizer = fabric.setup(model, diloco)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
    rounds = RoundLog(diloco)  # logs each outer step with θ_global's hash
    for _, batch in zip(range(40), loader):  # 40 inner steps
        loss = model(**batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        rounds()
