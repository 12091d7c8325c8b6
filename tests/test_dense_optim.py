"""DenseSGD and DenseAdagrad (train/dense_optim.py) are torch.optim's SGD and
Adagrad(foreach=True), bit for bit, state dicts included, and a training
process that uses them never imports torch._dynamo."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recsys_cli.train.dense_optim import PIECE_ELEMENTS, DenseAdagrad, DenseSGD

pytestmark = pytest.mark.exact

SHAPES = [(3 * PIECE_ELEMENTS // 64 + 1, 64), (1000, 37), (513,), (1,), (40, 5)]
ADAGRAD = dict(lr=0.05, eps=1e-8, initial_accumulator_value=0.1)


def parameters(transposed: bool) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]
    if transposed:  # a non-contiguous parameter: foreach's kernels, beside the pieces
        params[-1] = torch.nn.Parameter(torch.randn(5, 40, generator=g).t())
    return params


def make(kind: str, params):
    """torch.optim's optimizer ("torch-sgd", "torch-adagrad", "torch-adagrad_fused") or ours ("sgd", "adagrad",
    "adagrad_fused")."""
    if kind == "torch-sgd":
        return torch.optim.SGD(params, lr=0.05, foreach=True)
    if kind.startswith("torch-adagrad"):
        return torch.optim.Adagrad(params, **ADAGRAD, **({"fused": True} if "fused" in kind else {"foreach": True}))
    return DenseSGD(params, lr=0.05) if kind == "sgd" else DenseAdagrad(params, **ADAGRAD, fused="fused" in kind)


def train(kind: str, transposed: bool, steps: int = 6, swap_at: int | None = None, to: str | None = None):
    """Parameters and state after `steps` steps; at swap_at the optimizer
    `to` goes on from the first one's state_dict (a checkpoint)."""
    params = parameters(transposed)
    opt = make(kind, params)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == swap_at:
            state = opt.state_dict()
            opt = make(to, params)
            opt.load_state_dict(state)
        for i, p in enumerate(params):
            # step 2 leaves one parameter without a gradient (it is skipped, its step count too)
            p.grad = None if (step == 2 and i == 1) else torch.randn(p.shape, generator=g) * 10.0 ** (i - 3)
        for group in opt.param_groups:  # a schedule changes the rate every step (train/schedule.py)
            group["lr"] = 0.05 / (1 + step)
        opt.step()
    state = [t for p in params for t in opt.state[p].values()] if opt.state else []
    return [p.detach().clone() for p in params] + [t.clone() for t in state], opt.state_dict()


def assert_same(got, reference) -> None:
    (tensors, state_dict), (ref_tensors, ref_state_dict) = got, reference
    assert len(tensors) == len(ref_tensors)
    for a, b in zip(tensors, ref_tensors):
        assert torch.equal(a, b)
    # torch.optim's format: the same keys in the same order, the same hyperparameters, the same state
    assert list(state_dict) == list(ref_state_dict)
    assert [list(g) for g in state_dict["param_groups"]] == [list(g) for g in ref_state_dict["param_groups"]]
    assert state_dict["param_groups"] == ref_state_dict["param_groups"]
    assert list(state_dict["state"]) == list(ref_state_dict["state"])
    for key, values in state_dict["state"].items():
        assert list(values) == list(ref_state_dict["state"][key])
        for name, value in values.items():
            assert value.dtype == ref_state_dict["state"][key][name].dtype
            assert torch.equal(value, ref_state_dict["state"][key][name])


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adagrad_fused"])
def test_the_same_bits_and_state_dict_as_torch_optim(name, transposed):
    ours, theirs = name, f"torch-{name}"
    reference = train(theirs, transposed)
    for got in (train(ours, transposed), train(ours, transposed, swap_at=3, to=theirs),
                train(theirs, transposed, swap_at=3, to=ours), train(ours, transposed, swap_at=3, to=ours)):
        assert_same(got, reference)
    # and the update is not the identity: parameters moved
    assert not torch.equal(reference[0][0], parameters(transposed)[0].detach())


def test_the_fused_kernel_is_another_rounding_of_the_same_update():
    """optimizer.dense_kernel=fused is not foreach's bits (so it is a choice,
    not the default), but the same update to within rounding; a run resumed
    with the other kernel goes on from the saved state with its own."""
    (foreach, _), (fused, _) = train("adagrad", False), train("adagrad_fused", False)
    assert not all(torch.equal(a, b) for a, b in zip(foreach, fused))
    for a, b in zip(foreach, fused):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    switched, state_dict = train("adagrad", False, swap_at=3, to="adagrad_fused")
    assert state_dict["param_groups"][0]["fused"] is True and state_dict["param_groups"][0]["foreach"] is None
    for a, b in zip(switched, fused):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_state_dict_of_other_parameters_is_refused():
    saved = DenseAdagrad(parameters(False), **ADAGRAD).state_dict()
    with pytest.raises(ValueError, match="doesn't match the size"):
        DenseAdagrad(parameters(False)[:-1], **ADAGRAD).load_state_dict(saved)


def test_another_optimizers_state_is_refused():
    """SGD keeps no state: loaded into Adagrad it left "step" and "sum"
    missing, and the first step failed with KeyError: 'step'."""
    saved = DenseSGD(parameters(False), lr=0.1).state_dict()
    with pytest.raises(ValueError, match="no 'step' for parameter 0: another optimizer's state"):
        DenseAdagrad(parameters(False), **ADAGRAD).load_state_dict(saved)
    saved = DenseAdagrad(parameters(False), **ADAGRAD).state_dict()
    saved["state"][99] = saved["state"].pop(0)
    with pytest.raises(ValueError, match="state for parameter 99"):
        DenseAdagrad(parameters(False), **ADAGRAD).load_state_dict(saved)


def test_loaded_state_takes_the_saved_hyperparameters_and_the_parameters_dtype():
    params = parameters(False)
    saved = DenseAdagrad(params, **ADAGRAD).state_dict()
    saved["param_groups"][0]["lr"] = 0.5
    saved["state"][0]["sum"] = saved["state"][0]["sum"].double()
    opt = DenseAdagrad(params, **ADAGRAD)
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["params"][0] is params[0]
    assert opt.state[params[0]]["sum"].dtype == torch.float32


def test_zero_grad_sets_gradients_to_none_or_zero():
    params = parameters(False)[:2]
    opt = DenseSGD(params, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_a_training_process_does_not_import_torch_dynamo(tmp_path):
    """torch.optim imports torch._dynamo at its first call (~0.9 s and 65 MB
    a process); a trainer steps, checkpoints and resumes without it (SGD's
    step and state dict are the same code but for the arithmetic)."""
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from pathlib import Path\n"
        "from train_config import config, train\n"
        "tmp = Path(sys.argv[2])\n"
        "kw = dict(optimizer__name='adagrad', trainer__max_steps=4, trainer__checkpoint_every=2,\n"
        "          trainer__checkpoint_dir=str(tmp / 'checkpoints'))\n"
        "train(config(tmp, **kw))\n"
        "train(config(tmp, **kw, trainer__resume=True))\n"
        "print('torch._dynamo' in sys.modules)\n")
    tests = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", code, tests, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout


def test_a_run_with_the_fused_kernel_resumes_exactly(tmp_path):
    """optimizer.dense_kernel=fused (optimizer=mlperf_dcnv2's): stopped at a
    checkpoint and resumed, the run ends where the uninterrupted one does."""
    from train_config import config, train

    kw = dict(optimizer__name="adagrad", optimizer__lr=0.05, optimizer__dense_kernel="fused")
    full = train(config(tmp_path, **kw, trainer__max_steps=8))
    ck = str(tmp_path / "ck")
    train(config(tmp_path, **kw, trainer__max_steps=4, trainer__checkpoint_dir=ck))
    resumed = train(config(tmp_path, **kw, trainer__max_steps=8, trainer__checkpoint_dir=ck, trainer__resume="true"))
    assert resumed.step == 8 and resumed.step_losses == full.step_losses[4:]
    assert resumed.dense_optimizer.fused and resumed.dense_optimizer.param_groups[0]["fused"] is True
    for k, v in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k
    for p, q in zip(full.dense_optimizer.params, resumed.dense_optimizer.params):
        assert torch.equal(full.dense_optimizer.state[p]["sum"], resumed.dense_optimizer.state[q]["sum"])
