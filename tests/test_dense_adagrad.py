"""ChunkedAdagrad (train/dense_adagrad.py) is torch.optim.Adagrad(foreach=True), bit for bit."""

import pytest
import torch

from recsys_cli.train.dense_adagrad import PIECE_ELEMENTS, ChunkedAdagrad

pytestmark = pytest.mark.exact

SHAPES = [(3 * PIECE_ELEMENTS // 64 + 1, 64), (1000, 37), (513,), (1,), (40, 5)]


def parameters(transposed: bool) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]
    if transposed:  # a non-contiguous parameter: torch's own path, beside the pieces
        params[-1] = torch.nn.Parameter(torch.randn(5, 40, generator=g).t())
    return params


def train(optimizer_class, transposed: bool, steps: int = 6, swap_at: int | None = None) -> list[torch.Tensor]:
    params = parameters(transposed)
    kwargs = dict(lr=0.05, eps=1e-8, initial_accumulator_value=0.1)
    if optimizer_class is torch.optim.Adagrad:
        kwargs["foreach"] = True
    opt = optimizer_class(params, **kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == swap_at:  # the other optimizer goes on from this one's state_dict (a checkpoint)
            other = ChunkedAdagrad if optimizer_class is torch.optim.Adagrad else torch.optim.Adagrad
            kwargs = dict(lr=0.05, eps=1e-8, initial_accumulator_value=0.1)
            if other is torch.optim.Adagrad:
                kwargs["foreach"] = True
            state = opt.state_dict()
            opt = other(params, **kwargs)
            opt.load_state_dict(state)
        for i, p in enumerate(params):
            # step 2 leaves one parameter without a gradient (Adagrad skips it)
            p.grad = None if (step == 2 and i == 1) else torch.randn(p.shape, generator=g) * 10.0 ** (i - 3)
        for group in opt.param_groups:  # a schedule changes the rate every step (train/schedule.py)
            group["lr"] = 0.05 / (1 + step)
        opt.step()
    return [p.detach().clone() for p in params] + [opt.state[p]["sum"].clone() for p in params] + [
        opt.state[p]["step"].clone() for p in params]


@pytest.mark.parametrize("transposed", [False, True])
def test_pieces_give_foreach_adagrads_bits(transposed):
    reference = train(torch.optim.Adagrad, transposed)
    for got in (train(ChunkedAdagrad, transposed), train(ChunkedAdagrad, transposed, swap_at=3),
                train(torch.optim.Adagrad, transposed, swap_at=3)):
        assert len(got) == len(reference)
        for a, b in zip(got, reference):
            assert torch.equal(a, b)
    # and the update is not the identity: parameters moved
    assert not torch.equal(reference[0], parameters(transposed)[0].detach())
