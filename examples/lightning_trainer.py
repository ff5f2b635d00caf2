"""A Lightning Trainer as one worker of a closed 2-worker DiLoCo swarm (docs/integrations.md).

    opendiloco secret run.secret; export OPENDILOCO_RUN_SECRET_FILE=run.secret   # on every worker
    python examples/lightning_trainer.py runs/w0          # the first worker prints the address others join
    python examples/lightning_trainer.py runs/w1 /ip4/IP/tcp/PORT/p2p/PEER_ID
"""

import logging
import sys

import lightning
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from opendiloco import connect
from opendiloco.integrations.lightning import DiLoCoCallback


class CausalLM(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every worker
        self.model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4))

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


logging.basicConfig(level=logging.INFO)
workdir, peers = sys.argv[1], sys.argv[2:]
module = CausalLM()
starts = torch.randint(256, (512, 1), generator=torch.Generator().manual_seed(sum(map(ord, workdir))))
data = [{"input_ids": row, "labels": row} for row in (starts + torch.arange(32)) % 256]  # this worker's own data
with connect(peers, identity_dir=workdir, run_id="lightning-example", min_group_size=2, model=module) as comm:
    trainer = lightning.Trainer(max_steps=40, accelerator="cpu", devices=1, default_root_dir=workdir, logger=False,
                                enable_checkpointing=False, callbacks=[DiLoCoCallback(comm, local_steps=10)])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8, shuffle=True))
