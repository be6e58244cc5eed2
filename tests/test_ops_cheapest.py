"""Every rule family: the dispatcher's chosen signature receives no more than any valid candidate.

(The pointwise and matrix families have their own hypothesis checks in their files.)
"""
import math

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import globaltensor as gt
import dispatch_probe
from ops_support import MESHES, chosen_is_cheapest, mesh_placement, sbps_for

aten = torch.ops.aten
D = torch.float64

# family -> (op, tensor shapes, make the args from the GlobalTensors); trailing default arguments are
# left out, as torch strips them before __torch_dispatch__ (the decision cache keys on what it sees)
FAMILIES = {
    "reduction": (aten.sum.dim_IntList, [(4, 5, 3)], lambda x: (x, [1])),
    "amax": (aten.amax.default, [(4, 5)], lambda x: (x, [0])),
    "softmax": (aten._log_softmax.default, [(4, 6)], lambda x: (x, 1, False)),
    "layer_norm": (aten.native_layer_norm.default, [(4, 3, 6), (6,), (6,)],
                   lambda x, w, b: (x, [6], w, b, 1e-5)),
    "embedding": (aten.embedding.default, [(10, 4), None], lambda w, i: (w, i)),
    "view": (aten.view.default, [(4, 6, 2)], lambda x: (x, [4, 3, 2, 2])),
    "transpose": (aten.transpose.int, [(4, 6, 2)], lambda x: (x, 0, 2)),
    "cat": (aten.cat.default, [(4, 3), (4, 3)], lambda a, b: ([a, b], 1)),
}


@st.composite
def family_cases(draw):
    name = draw(st.sampled_from(sorted(FAMILIES)))
    mesh = draw(st.sampled_from(MESHES))
    _, shapes, _ = FAMILIES[name]
    sbps = [draw(sbps_for(mesh, s if s is not None else (3, 5), partial=s is not None)) for s in shapes]
    return name, mesh, sbps


def _inputs(name):
    _, shapes, _ = FAMILIES[name]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, dtype=D, generator=g) if s is not None else torch.randint(0, 10, (3, 5), generator=g)
            for s in shapes]


@given(family_cases())
def test_each_family_chooses_a_cheapest_signature(case):
    name, mesh, sbps = case
    func, _, make = FAMILIES[name]
    inputs = _inputs(name)

    def make_args(p):
        return make(*[gt.to_global(t, p, s) for t, s in zip(inputs, sbps)])

    def decomposed():
        args = make_args(mesh_placement(mesh))
        func(*args)
        dec = dispatch_probe.decision_for(func, args)
        return dec.kind

    kinds = set(gt.launch(decomposed, math.prod(mesh)))
    assume(kinds == {"kernel"})  # decomposed ops (e.g. softmax over a split dim) choose per part
    chosen, best, n = chosen_is_cheapest(func, make_args, mesh)
    assert n >= 1 and chosen == best
