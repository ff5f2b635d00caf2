"""The inner optimizer choice: Muon on the hidden matrices, AdamW on the rest, as one optimizer."""

import copy

import pytest
import torch

from opendiloco import DiLoCoOptimizer, SingleWorker
from opendiloco.inner import Muon, MuonWithAdamW, inner_optimizer, orthogonalize
from opendiloco.train.config import load_config
from opendiloco.train.model import build_model
from opendiloco.train.trainer import TrainError, train
from tests.test_train_loop import assert_resumes_bit_exactly, small_config

HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _model():
    cfg = load_config(None, ["--model.hidden-size", "32", "--model.num-layers", "2", "--model.num-heads", "4",
                             "--model.intermediate-size", "64"])
    return build_model(cfg.model, 64, 16)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    return model(input_ids=ids, labels=ids).loss


def test_muon_takes_the_hidden_matrices_and_adamw_the_embeddings_head_and_vectors():
    model = _model()
    opt = inner_optimizer("muon", model, **HYPER)(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon and adamw and not muon & adamw
    assert muon | adamw == set(names.values())
    assert all(model.get_parameter(n).ndim == 2 for n in muon)
    assert not any("embed" in n or "lm_head" in n for n in muon)
    assert any("embed" in n for n in adamw) and any("norm" in n for n in adamw)
    assert any("q_proj" in n for n in muon) and any("down_proj" in n for n in muon)


def test_steps_are_exactly_torchs_muon_and_adamw_on_their_halves_and_a_scheduler_drives_both():
    """With bf16 orthogonalisation (torch's, and this one's on CUDA) every step is bit for bit
    torch.optim.Muon on the matrices and torch.optim.AdamW on the rest."""
    model = _model()
    twin = copy.deepcopy(model)
    vocabulary = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    opt = MuonWithAdamW(model.parameters(), use_muon=lambda p: id(p) not in vocabulary, ortho_dtype=torch.bfloat16,
                        **HYPER)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    params = dict(twin.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    muon = torch.optim.Muon([params[names[id(p)]] for p in opt.muon.param_groups[0]["params"]], lr=HYPER["lr"],
                            weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([params[names[id(p)]] for p in opt.adamw.param_groups[0]["params"]], **HYPER)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (muon, adamw)]
    for step in range(4):
        for m in (model, twin):
            _loss(m, step).backward()
        opt.step()
        opt.zero_grad()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
        sched.step()
        for s in scheds:
            s.step()
    assert {g["lr"] for g in opt.param_groups} == {HYPER["lr"] / 5}
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n


def test_on_cpu_the_orthogonalisation_runs_in_fp32_and_stays_close_to_bf16():
    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    fp32, bf16 = orthogonalize(g, 5), orthogonalize(g, 5, dtype=torch.bfloat16).float()
    assert fp32.dtype == torch.float32 and not torch.equal(fp32, bf16)
    assert (fp32 - bf16).abs().max() < 0.05 * fp32.abs().max()
    # Newton-Schulz pushes every singular value towards 1 (into about [0.5, 1.5], by design).
    s = torch.linalg.svdvals(fp32)
    assert s.min() > 0.4 and s.max() < 1.6
    assert torch.allclose(orthogonalize(g.T.contiguous(), 5), fp32.T, atol=1e-5)  # a tall one through its transpose


def test_a_state_dict_round_trip_resumes_exactly():
    def run(steps, model, opt):
        for s in steps:
            _loss(model, s).backward()
            opt.step()
            opt.zero_grad()

    model = _model()
    start = copy.deepcopy(model.state_dict())
    opt = inner_optimizer("muon", model, **HYPER)(model.parameters())
    run(range(6), model, opt)
    whole = copy.deepcopy(model.state_dict())

    model.load_state_dict(start)
    opt = inner_optimizer("muon", model, **HYPER)(model.parameters())
    run(range(3), model, opt)
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    again = _model()
    again.load_state_dict(weights)
    fresh = inner_optimizer("muon", again, **HYPER)(again.parameters())
    fresh.load_state_dict(saved)
    assert fresh.muon.state is fresh.state and fresh.adamw.param_groups[0] is fresh.param_groups[-1]
    assert any("momentum_buffer" in s for s in fresh.state.values())
    run(range(3, 6), again, fresh)
    for k, v in again.state_dict().items():
        assert torch.equal(v, whole[k]), k


def test_muon_without_a_matrix_is_refused():
    with pytest.raises(ValueError, match="no 2-D weight"):
        MuonWithAdamW([torch.nn.Parameter(torch.zeros(3))], use_muon=lambda p: True)
    with pytest.raises(ValueError, match="Muon trains matrices"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="expected one of adamw, muon"):
        inner_optimizer("sgd", _model(), **HYPER)


def test_diloco_over_muon_trains_alone_shares_adamws_layout_and_refuses_its_checkpoint():
    model = _model()
    opt = DiLoCoOptimizer(model.parameters(), local_steps=2, inner_optimizer=inner_optimizer("muon", model, **HYPER),
                          communicator=SingleWorker())
    before = _loss(model, 99).item()
    for s in range(8):
        _loss(model, s % 2).backward()
        opt.step()
        opt.zero_grad()
    assert opt.outer_step == 4 and _loss(model, 0).item() < before
    saved = opt.state_dict()
    assert saved["inner_kind"] == "MuonWithAdamW"

    plain = DiLoCoOptimizer(model.parameters(), local_steps=2, communicator=SingleWorker())
    # θ_global follows the model's order whatever the inner optimizer groups: the same layout for both.
    assert [p.shape for p in plain.outer.global_params] == [p.shape for p in opt.outer.global_params]
    assert [p.shape for p in opt.outer.global_params] == [p.shape for p in model.parameters()]
    with pytest.raises(ValueError, match=r"inner_kind 'MuonWithAdamW' \(this optimizer: 'AdamW'\)"):
        plain.load_state_dict(saved)


@pytest.mark.slow
def test_a_muon_run_resumes_bit_exactly_and_an_adamw_checkpoint_is_one_line(tmp_path):
    muon = ["--optim.inner", "muon", "--train.total-steps", "12"]
    assert_resumes_bit_exactly(lambda run_dir: small_config(run_dir, *muon), tmp_path, 6)

    train(small_config(tmp_path / "adamw", "--train.total-steps", "4"))
    with pytest.raises(TrainError, match=r"inner_kind 'AdamW' \(this optimizer: 'MuonWithAdamW'\)"):
        train(small_config(tmp_path / "adamw", *muon), resume=True)


def test_warm_start_needs_adamw():
    with pytest.raises(Exception, match="warm_start serves AdamW"):
        load_config(None, ["--optim.inner", "muon", "--optim.warm-start", "true"])
