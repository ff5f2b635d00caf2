"""``opendiloco export``: θ_global of a run as a Hugging Face model directory, whose logits are θ_global's
in the worker; and a checkpoint's weights read with torch alone, without this project."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opendiloco.cli import main
from opendiloco.train.config import load_config
from opendiloco.train.trainer import Trainer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--data.seq-len", "32", "--train.batch-size", "4", "--train.eval-batches", "1", "--train.threads", "1",
       "--optim.local-steps", "4", "--optim.warmup-steps", "2", "--optim.lr", "3e-3", "--run.progress", "false",
       "--run.worker", "w", "--train.total-steps", "6"]  # ends 2 steps after an outer step: θ_local ≠ θ_global
MODELS = {
    "builtin-llama": ["--model.hidden-size", "32", "--model.num-layers", "2", "--model.num-heads", "4",
                      "--model.num-kv-heads", "2", "--model.intermediate-size", "64"],
    "gpt2-tied": ["--model.model-type", "gpt2", "--model.options.n_layer", "2", "--model.options.n_embd", "32",
                  "--model.options.n_head", "2", "--model.options.n_positions", "64"],
    "olmoe": ["--model.model-type", "olmoe", "--model.options.num_hidden_layers", "2",
              "--model.options.hidden_size", "32", "--model.options.num_attention_heads", "2",
              "--model.options.intermediate_size", "32", "--model.options.num_experts", "4",
              "--model.options.num_experts_per_tok", "2"],
}


def _trained(tmp_path, *args) -> Trainer:
    trainer = Trainer(load_config(None, [*RUN, "--run.dir", str(tmp_path / "run"), *args]))
    trainer.run()
    return trainer


def _theta_global_logits(trainer: Trainer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The worker's logits with θ_local (as it ended), then with θ_global loaded into its model."""
    model = trainer.model.eval()
    with torch.no_grad():
        local = model(input_ids=ids).logits
        for p, g in zip(trainer.opt.outer.params, trainer.opt.outer.global_params):
            p.copy_(g)
        return local, model(input_ids=ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
def test_the_exported_model_gives_theta_globals_logits(tmp_path, capsys, arch):
    trainer = _trained(tmp_path, *MODELS[arch])
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert "outer step 1, inner step 6" in capsys.readouterr().out
    out = tmp_path / "hf"
    assert {"config.json", "model.safetensors", "opendiloco.json"} <= {p.name for p in out.iterdir()}
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert exported.dtype == torch.float32
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
    local, glob = _theta_global_logits(trainer, ids)
    diff = (theirs - glob).abs().max().item()
    print(f"{arch}: max abs logit difference, export against the worker's θ_global: {diff:g}")
    assert diff <= 1e-6
    assert (theirs - local).abs().max().item() > 1e-4  # θ_global, not the worker's local weights
    if arch == "builtin-llama":
        assert type(exported).__name__ == "LlamaForCausalLM"
        assert exported.config.eos_token_id == 257  # the bytes tokenizer's end of document


def _local_tokenizer(path: Path) -> None:
    """A small byte-level BPE tokenizer trained here (nothing downloaded), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([inspect.getsource(inspect)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(path)


@pytest.mark.slow
def test_a_checkpoint_exports_with_the_runs_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _local_tokenizer(tmp_path / "tok")
    trainer = _trained(tmp_path, *MODELS["gpt2-tied"], "--data.tokenizer", str(tmp_path / "tok"))
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("step-*.pt"))[-1]
    assert main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    text = "def theta(x):\n    return x + 1\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == trainer.tokenizer.encode(text).tolist()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == tok.eos_token_id == trainer.tokenizer.eos_id
    assert json.loads((tmp_path / "hf" / "opendiloco.json").read_text())["checkpoint"] == str(checkpoint)


@pytest.mark.slow
def test_a_model_fine_tuned_from_a_pretrained_directory_exports_with_its_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pretrained = tmp_path / "pretrained"
    _local_tokenizer(pretrained)
    config = transformers.Qwen3Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64, head_dim=16, vocab_size=300)
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(pretrained)
    trainer = _trained(tmp_path, "--model.pretrained", str(pretrained), "--data.tokenizer", str(pretrained))
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(exported).__name__ == "Qwen3ForCausalLM" and exported.config.num_hidden_layers == 2
    ids = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
    _, glob = _theta_global_logits(trainer, ids)
    assert (theirs - glob).abs().max().item() <= 1e-6
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_the_toml_examples_of_docs_models_md_are_valid_configs():
    from opendiloco.train.config import tomllib, validate_config  # tomli on Python 3.10

    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "models.md").read_text(), re.S)
    assert len(blocks) >= 3
    for block in blocks:
        assert validate_config(tomllib.loads(block)).model.arch == "hf"


def _docs_snippet() -> str:
    text = (ROOT / "docs" / "models.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if "def theta_global" in b)


@pytest.mark.slow
def test_a_checkpoints_theta_global_is_read_with_torch_alone(tmp_path):
    trainer = _trained(tmp_path, *MODELS["gpt2-tied"])
    checkpoint = sorted((tmp_path / "run" / "checkpoints").glob("step-*.pt"))[-1]
    script = "\n".join([
        "import sys",
        "sys.modules['opendiloco'] = None  # this project cannot be imported here",
        _docs_snippet(),
        "try:",
        "    import opendiloco  # noqa",
        "    raise SystemExit('opendiloco was importable')",
        "except ImportError:",
        "    pass",
        "torch.save(theta_global(sys.argv[1]), sys.argv[2])",
    ])
    subprocess.run([sys.executable, "-I", "-c", script, str(checkpoint), str(tmp_path / "global.pt")],
                   check=True, timeout=120, cwd=tmp_path)
    read = torch.load(tmp_path / "global.pt", weights_only=True)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, g in zip(trainer.opt.outer.params, trainer.opt.outer.global_params):
        assert torch.equal(read[names[id(p)]], g)
    local = trainer.model.transformer.h[0].attn.c_attn.weight
    assert not torch.equal(read["transformer.h.0.attn.c_attn.weight"], local)  # θ_global, not θ_local
    assert torch.equal(read["lm_head.weight"], read["transformer.wte.weight"])  # the tied head: θ_global too


def test_export_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for args, message in [
        ([str(tmp_path / "missing"), str(tmp_path / "o")], "no such run dir or checkpoint file"),
        ([str(tmp_path / "empty"), str(tmp_path / "o")], "holds no checkpoints"),
        ([str(tmp_path / "junk.pt"), str(tmp_path / "o")], "no readable checkpoint"),
        ([str(tmp_path / "junk.pt"), str(tmp_path / "full")], "already exists and is not empty"),
    ]:
        assert main(["export", *args]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "o").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
