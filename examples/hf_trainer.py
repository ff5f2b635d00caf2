"""A Hugging Face Trainer as one worker of a closed 2-worker DiLoCo swarm (docs/integrations.md).

    opendiloco secret run.secret; export OPENDILOCO_RUN_SECRET_FILE=run.secret   # on every worker
    python examples/hf_trainer.py runs/w0          # the first worker prints the address others join
    python examples/hf_trainer.py runs/w1 /ip4/IP/tcp/PORT/p2p/PEER_ID
"""

import logging
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from opendiloco import connect
from opendiloco.integrations.hf import DiLoCoCallback

logging.basicConfig(level=logging.INFO)
workdir, peers = sys.argv[1], sys.argv[2:]
torch.manual_seed(0)  # the same initial weights on every worker
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4))
starts = torch.randint(256, (512, 1), generator=torch.Generator().manual_seed(sum(map(ord, workdir))))
data = [{"input_ids": row, "labels": row} for row in (starts + torch.arange(32)) % 256]  # this worker's own data
args = TrainingArguments(workdir, max_steps=40, per_device_train_batch_size=8, learning_rate=1e-3, logging_steps=10,
                         save_strategy="no", report_to="none", use_cpu=True)
with connect(peers, identity_dir=workdir, run_id="hf-example", min_group_size=2, model=model) as comm:
    diloco = DiLoCoCallback(comm, local_steps=10)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[diloco],
                      optimizers=diloco.optimizers(model, args))
    trainer.train()
