"""to_global(grad_sbp=) and gt.ModuleLayout: values and gradients vs one device, and the collectives they cause."""
from __future__ import annotations

import pytest
import torch

import globaltensor as gt

B, S, P = gt.broadcast, gt.split, gt.partial_sum


def _grad_sbp_b_to_b():
    """x Broadcast; x.to_global(grad_sbp=B): forward moves nothing, backward all-reduces the P gradient."""
    p = gt.placement("cpu", [0, 1])
    torch.manual_seed(0)
    x_full, w_full = torch.randn(4, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    x = gt.to_global(x_full.clone().requires_grad_(), p, B)
    w = gt.to_global(w_full, p, S(0))                                  # column-parallel weight
    with gt.comm_log() as fwd:
        y = x.to_global(grad_sbp=B)
        out = (y @ w.t()).tanh()                                      # [4, 8] split on dim 1
    assert y is not x and y.sbp == (B,) and fwd.events == []
    with gt.comm_log() as bwd:
        out.sum().backward()                                          # grad of y: P [4, 6] f64; all-reduced
    kinds = [e.kind for e in bwd.events]
    ref_x = x_full.clone().requires_grad_()
    (ref_x @ w_full.t()).tanh().sum().backward()
    return kinds, bwd.recv_bytes, x.grad.sbp, x.grad.full_tensor(), ref_x.grad


def test_grad_sbp_forces_the_backward_all_reduce():
    for kinds, recv, sbp, got, want in gt.launch(_grad_sbp_b_to_b, 2):
        assert kinds == ["all_reduce"] and recv == 4 * 6 * 8 and sbp == (B,)
        torch.testing.assert_close(got, want)


def _grad_sbp_split():
    """A conversion S(0) -> B whose gradient is asked as P: the default dual (B -> S slice) is replaced."""
    p = gt.placement("cpu", [0, 1])
    t = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
    x = gt.to_global(t.clone().requires_grad_(), p, S(0))
    y = x.to_global(p, B, grad_sbp=P)
    (y * y).sum().backward()
    return x.grad.sbp, x.grad.full_tensor()


def test_grad_sbp_sets_the_gradient_layout():
    for sbp, g in gt.launch(_grad_sbp_split, 2):
        t = torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
        # x.grad arrives as P (its leaf layout is then reached by the accumulation) with the right value
        assert sbp in ((P,), (S(0),))
        torch.testing.assert_close(g, 2 * t)


def _bad_grad_sbp():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    x = gt.to_global(torch.zeros(4, 4), p, (B, B))
    errors = []
    for bad in [(B,), (S(2), B), (gt.partial("max"), B)]:
        try:
            x.to_global(grad_sbp=bad)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    try:
        gt.to_global(torch.zeros(2), gt.placement("cpu", [0, 1, 2, 3]), B, grad_sbp=B)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_bad_grad_sbp_is_named():
    errors = gt.launch(_bad_grad_sbp, 4)[0]
    assert len(errors) == 4 and all("grad_sbp" in e for e in errors)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 8)
        self.down = torch.nn.Linear(8, 6)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


def _megatron_mlp(plan_hints):
    """Column `up`, row `down` on a 1-D mesh of 2, with and without activation hints."""
    torch.manual_seed(0)
    ref = _Net().double()
    net = _Net().double()
    net.load_state_dict(ref.state_dict())
    p = gt.placement("cpu", [0, 1])
    plan = {"up.*": S(0), "down.weight": S(1)}
    if plan_hints:
        plan.update({"up": gt.ModuleLayout(input_grad=B), "down": gt.ModuleLayout(output=B)})
    gt.to_global(net, p, plan)
    x_full = torch.randn(5, 6, dtype=torch.float64)
    x = gt.to_global(x_full.clone().requires_grad_(), p, B)
    with gt.comm_log() as fwd:
        y = net(x)
    with gt.comm_log() as bwd:
        (y * y).sum().backward()
    ref_x = x_full.clone().requires_grad_()
    (ref(ref_x) ** 2).sum().backward()
    grads = {n: (q.grad.full_tensor(), dict(ref.named_parameters())[n].grad) for n, q in net.named_parameters()}
    grads["x"] = (x.grad.full_tensor(), ref_x.grad)
    return ([e.kind for e in fwd.events], [e.kind for e in bwd.events], y.sbp, y.full_tensor(),
            ref(x_full).detach(), grads)


@pytest.mark.parametrize("hints", [False, True])
def test_module_layout_gives_megatron_collectives(hints):
    for fwd, bwd, sbp, y, want, grads in gt.launch(_megatron_mlp, 2, args=(hints,)):
        torch.testing.assert_close(y, want)
        for got, ref in grads.values():
            torch.testing.assert_close(got, ref)
        if hints:  # one all-reduce each way, as Megatron: row output forward, column input grad backward
            assert fwd == ["all_reduce"] and bwd == ["all_reduce"] and sbp == (B,)


def _hint_errors():
    p = gt.placement("cpu", [[0, 1], [2, 3]])
    errors = []
    for plan in [{"nope": gt.ModuleLayout(output=B)}, {"up": gt.ModuleLayout(output=(B,))},
                 {"up": gt.ModuleLayout(input_grad=(None, gt.partial("max")))}]:
        try:
            gt.to_global(_Net(), p, plan)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    net = gt.to_global(_Net(), p, {"up": gt.ModuleLayout(input=(None, S(1)))})
    try:
        net(torch.zeros(3, 6))                       # a plain tensor where the plan lays out a GlobalTensor
    except TypeError as e:
        errors.append(str(e))
    return errors


def test_module_layout_bad_plans_are_named():
    errors = gt.launch(_hint_errors, 4)[0]
    assert len(errors) == 4
    assert "nope" in errors[0] and "'up'" in errors[1] and "'up'" in errors[2] and "GlobalTensor" in errors[3]
    with pytest.raises(ValueError, match="at least one"):
        gt.ModuleLayout()


def _hooks_replaced():
    p = gt.placement("cpu", [0, 1])
    net = _Net()
    gt.to_global(net, p, {"down": gt.ModuleLayout(output=S(0))})
    gt.to_global(net, p, {"down": gt.ModuleLayout(output=S(1))})
    return net(gt.to_global(torch.zeros(4, 6), p, B)).sbp


def test_second_conversion_replaces_hints():
    assert gt.launch(_hooks_replaced, 2) == [(S(1),), (S(1),)]


class _Attn(torch.nn.Module):
    """Two column-parallel projections of one input and a row-parallel one; returns a tuple, as transformers'
    attention modules do."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = torch.nn.Linear(6, 8), torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)

    def forward(self, hidden_states, scale=None):
        return self.o(torch.tanh(self.q(hidden_states)) * self.k(hidden_states)) * scale, None


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Attn()

    def forward(self, x):
        out, _ = self.attn(hidden_states=x, scale=2.0)  # keywords alone, as a transformers decoder layer calls it
        return out + x


def _block_input_grad(on_block: bool):
    torch.manual_seed(0)
    ref, net = _Layer().double(), _Layer().double()
    net.load_state_dict(ref.state_dict())
    p = gt.placement("cpu", [0, 1])
    plan = {"attn.q.*": S(0), "attn.k.*": S(0), "attn.o.weight": S(1), "attn.o": gt.ModuleLayout(output=B)}
    hint = gt.ModuleLayout(input_grad=B)
    plan.update({"attn": hint} if on_block else {"attn.q": hint, "attn.k": hint})
    gt.to_global(net, p, plan)
    x_full = torch.randn(5, 6, dtype=torch.float64)
    x = gt.to_global(x_full.clone().requires_grad_(), p, B)
    with gt.comm_log() as fwd:
        y = net(x)
    with gt.comm_log() as bwd:
        (y * y).sum().backward()
    ref_x = x_full.clone().requires_grad_()
    (ref(ref_x) ** 2).sum().backward()
    grads = [(q.grad.full_tensor(), dict(ref.named_parameters())[n].grad) for n, q in net.named_parameters()]
    return ([(e.kind, e.recv_bytes) for e in fwd.events], [(e.kind, e.recv_bytes) for e in bwd.events],
            (y.full_tensor(), ref(x_full).detach()), grads + [(x.grad.full_tensor(), ref_x.grad)])


@pytest.mark.parametrize("on_block", [False, True])
def test_input_hint_reaches_a_block_called_by_keyword(on_block):
    """Megatron's f once per block: `input_grad=B` on a module called with keywords alone (`attn(hidden_states=x)`)
    lays out its forward's first parameter, so q's and k's input gradients, left Partial inside (the named scope
    runs to the block's input, the backward entering it at its tuple output's first tensor), are all-reduced once,
    [5, 6] fp64; hinted on q and k each, twice."""
    for fwd, bwd, (y, want), grads in gt.launch(_block_input_grad, 2, args=(on_block,)):
        torch.testing.assert_close(y, want)
        for got, ref in grads:
            torch.testing.assert_close(got, ref)
        assert fwd == [("all_reduce", 240)]
        assert bwd == [("all_reduce", 240)] * (1 if on_block else 2)


class _Weighted(torch.nn.Module):
    """Experts' shape: forward(x, index, weights), the output weighted per row by `weights`."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6, bias=False)

    def forward(self, x, index, weights):
        return self.down(torch.relu(self.up(x))) * weights[:, None]


class _Routed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(6, 1)
        self.experts = _Weighted()

    def forward(self, x):
        return self.experts(x, None, weights=torch.sigmoid(self.router(x))[:, 0]) + x


def _arg_grads():
    torch.manual_seed(0)
    ref, net = _Routed().double(), _Routed().double()
    net.load_state_dict(ref.state_dict())
    p = gt.placement("cpu", [0, 1])
    gt.to_global(net, p, {"experts.up.*": S(0), "experts.down.weight": S(1),
                          "experts": gt.ModuleLayout(input_grad=B, arg_grads={2: B}, output=B)})
    x_full = torch.randn(5, 6, dtype=torch.float64)
    x = gt.to_global(x_full.clone().requires_grad_(), p, B)
    y = net(x)
    with gt.comm_log() as bwd:
        (y * y).sum().backward()
    ref_x = x_full.clone().requires_grad_()
    (ref(ref_x) ** 2).sum().backward()
    grads = [(q.grad.full_tensor(), dict(ref.named_parameters())[n].grad) for n, q in net.named_parameters()]
    return ([(e.kind, e.recv_bytes) for e in bwd.events], (y.full_tensor(), ref(x_full).detach()),
            grads + [(x.grad.full_tensor(), ref_x.grad)], net.router.weight.grad.sbp)


def test_arg_grads_lay_out_another_arguments_gradient():
    """`arg_grads={2: B}` (by position, the call passing it by keyword): the routing weights' gradient, Partial
    over the tensor axis ([5] fp64, 40 B), all-reduced at the experts' boundary, as Megatron's MoE does; the
    router's gradients are then whole, and the input's is all-reduced once ([5, 6], 240 B)."""
    for bwd, (y, want), grads, router_sbp in gt.launch(_arg_grads, 2):
        torch.testing.assert_close(y, want)
        for got, ref in grads:
            torch.testing.assert_close(got, ref)
        assert sorted(bwd) == [("all_reduce", 40), ("all_reduce", 240)]
        assert router_sbp == (B,)


def test_arg_grads_are_checked():
    with pytest.raises(TypeError, match="arg_grads"):
        gt.ModuleLayout(arg_grads={-1: B})
    with pytest.raises(TypeError, match="input_grad"):
        gt.ModuleLayout(arg_grads={0: B})  # the first argument's gradient is input_grad's
    assert gt.ModuleLayout(arg_grads={"weights": B}) == gt.ModuleLayout(arg_grads={"weights": B})
