"""kernels/linear.py: both operand orders compute F.linear (within float rounding), whatever the machine chose."""
import pytest
import torch
import torch.nn.functional as F

from evospec.kernels import linear as lin


@pytest.fixture
def forced(monkeypatch):
    """Force an order for every weight shape (the measured choice differs between machines)."""
    table: dict = {}
    monkeypatch.setattr(lin, "_WEIGHT_FIRST", table)

    def force(weight: torch.Tensor, first: bool) -> None:
        table[(weight.device.type, weight.dtype, *weight.shape)] = first
    return force


@pytest.mark.parametrize("first", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_functional_linear_in_either_order(forced, first, rows, with_bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(48, 40), torch.randn(3, rows, 40)
    bias = torch.randn(48) if with_bias else None
    forced(weight, first)
    out = lin.linear(x, weight, bias)
    assert out.shape == (3, rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_weight_first_is_measured_once_per_kind(monkeypatch):
    monkeypatch.setattr(lin, "_WEIGHT_FIRST", {})
    calls = []
    monkeypatch.setattr(lin, "_weight_first_is_faster", lambda w, **_: calls.append(tuple(w.shape)) or True)
    a, b = torch.randn(8, 4), torch.randn(6, 4)
    for _ in range(3):
        lin.linear(torch.randn(2, 4), a)
        lin.linear(torch.randn(3, 4), b)
    lin.linear(torch.randn(1, 4), a)  # one row never asks
    assert calls == [(8, 4), (6, 4)]
    assert lin.linear_orders() == {"float32 8x4": "weight-first", "float32 6x4": "weight-first"}


def test_project_runs_wrapped_layers_their_own_way(forced):
    plain = torch.nn.Linear(16, 8)
    forced(plain.weight, True)
    x = torch.randn(4, 16)
    torch.testing.assert_close(lin.project(plain, x), plain(x))
    doubled = torch.nn.Sequential(plain, torch.nn.Identity())  # not an nn.Linear: called as itself
    torch.testing.assert_close(lin.project(doubled, x), plain(x))
