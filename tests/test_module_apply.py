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
