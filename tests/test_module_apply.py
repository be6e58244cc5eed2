"""Issue 17 item 1: `m.double()`, `m.half()`, `m.to(dtype)`, `m.to(device)` on a converted module change
shards and metadata together (`nn.Module._apply` assigns `param.data`), keep tied weights tied and
layouts unchanged, and the module still computes what one device computes."""
import pytest
import torch

import globaltensor as gt


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 6)
        self.fc = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 8, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((6,), 2.0))

    def forward(self, idx):
        return self.head(torch.relu(self.fc(self.emb(idx))) * self.scale)


PLAN = {"emb.weight": (gt.split(0), gt.broadcast), "fc.weight": (gt.broadcast, gt.split(0)),
        "fc.bias": (gt.broadcast, gt.split(0))}
IDX = torch.tensor([[1, 2, 7], [0, 3, 5]])


def _run(convert, dtype):
    def program():
        torch.manual_seed(0)
        model = Tied()
        ref = Tied()
        ref.load_state_dict(model.state_dict())
        ref = convert(ref)
        mesh = gt.placement("cpu", [[0, 1], [2, 3]])
        gt.to_global(model, mesh, PLAN)
        layouts = {n: p.global_layout for n, p in model.named_parameters()}
        out = convert(model)
        assert out is model
        for n, p in model.named_parameters():
            assert p.dtype == dtype and p._local.dtype == dtype, (n, p.dtype, p._local.dtype)
            assert p.full_tensor().dtype == dtype
            assert p.global_layout == layouts[n], n  # layouts unchanged
            assert isinstance(p, torch.nn.Parameter) and p.requires_grad
        assert model.scale.dtype == dtype and model.scale._local.dtype == dtype
        assert model.head.weight is model.emb.weight  # tied weights stay tied
        y = model(gt.to_global(IDX, mesh, (gt.split(0), gt.broadcast)))
        y.sum().backward()
        assert y.dtype == dtype and model.emb.weight.grad.dtype == dtype
        torch.testing.assert_close(y.full_tensor(), ref(IDX), atol=1e-2, rtol=1e-2)
        return True
    assert all(gt.launch(program, 4))


@pytest.mark.parametrize("convert,dtype", [
    (lambda m: m.double(), torch.float64),
    (lambda m: m.to(torch.float64), torch.float64),
    (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16),
    (lambda m: m.half(), torch.float16),
])
def test_module_dtype_change_converts_shards(convert, dtype):
    _run(convert, dtype)


def test_module_dtype_change_converts_gradients():
    """A gradient already there is converted with its parameter (swap of `.grad.data`)."""
    def program():
        mesh = gt.placement("cpu", [0, 1])
        lin = gt.to_global(torch.nn.Linear(4, 4), mesh, {"weight": gt.split(0)})
        lin(gt.to_global(torch.ones(2, 4), mesh, gt.broadcast)).sum().backward()
        before = lin.weight.grad.sbp
        lin.double()
        g = lin.weight.grad
        return g.dtype, g._local.dtype, g.sbp == before, torch.equal(g.full_tensor(), torch.full((4, 4), 2.0, dtype=torch.float64))
    for dtype, local_dtype, same_sbp, ok in gt.launch(program, 2):
        assert dtype == local_dtype == torch.float64 and same_sbp and ok


def test_module_to_same_device_and_assigning_data():
    def program():
        mesh = gt.placement("cpu", [0, 1])
        lin = gt.to_global(torch.nn.Linear(4, 2), mesh, {"weight": gt.split(1)})
        w = lin.weight
        lin.to("cpu")
        lin.to(torch.device("cpu"), torch.float64)
        assert lin.weight is w and w._local.dtype == torch.float64 and w.sbp == (gt.split(1),)
        with pytest.raises(TypeError, match="assign a GlobalTensor"):
            w.data = torch.zeros(2, 4)
        with pytest.raises(ValueError, match=r"to\(device\).*'meta'"):
            w.to("meta")
        return True
    assert all(gt.launch(program, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_module_to_cuda_moves_shards_and_placement():
    def program():
        mesh = gt.placement("cpu", [0, 1])
        lin = gt.to_global(torch.nn.Linear(4, 2), mesh, {"weight": gt.split(0)})
        lin.to("cuda")
        w = lin.weight
        assert w._local.is_cuda and w.placement.device_type == "cuda" and w.sbp == (gt.split(0),)
        y = lin(gt.to_global(torch.ones(3, 4, device="cuda"), w.placement, gt.broadcast))
        return y.full_tensor().cpu()
    a, b = gt.launch(program, 2)
    torch.testing.assert_close(a, b)


def test_module_dtype_change_after_backward_and_step_keeps_the_bucket_right():
    """`nn.Module._apply` swaps a traceable subclass's tensors (`torch.utils.swap_tensors`), which refuses a
    tensor with weak references: nothing of globaltensor holds one on a gradient waiting for its bucketed
    reduction (the pending list holds it, `ops/inputs._Pending`), nor on one its bucket reduced in place (its
    memo lives in the tensor). So `m.double()` works after a backward (DP's Partial gradients pending) and after
    a step, and the next steps equal one device's: the pending gradients, converted, are still reduced once."""
    from globaltensor.ops import inputs

    torch.manual_seed(0)
    X = torch.randn(8, 4)
    ref = torch.nn.Linear(4, 3)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    ref(X).square().sum().backward()
    ref.double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt.step()
    ref.double()
    ref(X.double()).square().sum().backward()
    opt.step()

    def program(swap: bool):
        mesh = gt.placement("cpu", [0, 1])
        lin = torch.nn.Linear(4, 3)
        lin.load_state_dict(state)
        gt.to_global(lin if swap else lin.double(), mesh)
        x = gt.to_global(X, mesh, gt.split(0))
        lin(x if swap else x.double()).square().sum().backward()
        g = lin.weight.grad
        pending = g in inputs._PENDING[gt.runtime.context.current()]
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        with gt.comm_log() as log:
            if swap:
                # a gradient waiting for its bucket, swapped; the cast reads it reduced (a cast of a Partial is not
                # the cast of its sum): reduce-scattered in fp32, then all-gathered by the bucket in fp64
                lin.double()
                assert lin.weight.grad is g and g.dtype == torch.float64
            opt.step()
        lin.double()  # after the bucket converted the gradients in place
        lin(x.double()).square().sum().backward()
        opt.step()
        return pending, log.recv_bytes, {k: v.full_tensor() for k, v in lin.state_dict().items()}

    for rank, ((pending, log, params), (_, want_log, _)) in enumerate(zip(gt.launch(program, 2, args=(True,)),
                                                                          gt.launch(program, 2, args=(False,)))):
        # fp64 from the start: one all-reduce of the 15 gradient elements; swapped: the 12 weight and 3 bias
        # elements reduce-scattered in fp32 (this rank's 6 + 2 or 6 + 1), then all-gathered in fp64 (the others)
        bias = (2, 1) if rank == 0 else (1, 2)
        assert pending and want_log == 15 * 8 and log == (6 + bias[0]) * 4 + (6 + bias[1]) * 8
        for k, v in ref.state_dict().items():  # the first gradients are fp32 sums (in another order than one device's)
            torch.testing.assert_close(params[k], v, rtol=0, atol=1e-6)


def test_pending_gradient_dropped_unread_is_let_go():
    """The pending list holds gradients strongly (no weak reference: see above) but lets one go once nobody
    else holds it: a backward whose gradients are dropped unread (`zero_grad()` with no step) leaves nothing
    held after the next backward's."""
    import weakref
    from globaltensor.ops import inputs

    def program():
        mesh = gt.placement("cpu", [0, 1])
        lin = gt.to_global(torch.nn.Linear(4, 3), mesh)
        x = gt.to_global(torch.ones(8, 4), mesh, gt.split(0))
        lin(x).sum().backward()
        old = [weakref.ref(p.grad._local) for p in lin.parameters()]  # (a weakref on the shards, not the grads)
        lin.zero_grad()
        lin(x).sum().backward()
        held = [e[0] for e in inputs._PENDING[gt.runtime.context.current()].entries.values()]
        return [r() is None for r in old], held and all(any(t is p.grad for p in lin.parameters()) for t in held)

    for gone, only_current in gt.launch(program, 2):
        assert gone == [True, True] and only_current
