"""A pipeline posts the receives of its next actions ahead, once two steps of equal inputs made the same ones.

The posting changes when a transfer can start, never what is received: values, bytes and messages are
the steps' own, and a program whose messages change between steps of equal inputs gets an error that
names the opt-out, never a receive matched to the wrong message.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import globaltensor as gt
from globaltensor.runtime import context

from test_pipeline import _check_values, _data, loss_fn, pipelined, reference


def _counting_posts():
    """Wrap this rank's communicator's `post_receive`: returns the list it appends each call's source to."""
    comm = context.current()
    calls: list = []
    real = comm.post_receive

    def post(src, *args, **kwargs):
        calls.append(src)
        return real(src, *args, **kwargs)
    comm.post_receive = post
    return calls


def _posted_per_step(kind: str, batches: list, virtual: int = 1, ahead: bool = True):
    """A 2-stage GPT trained one step per batch size; per step, how many receives were posted ahead, how
    many it received (its actions', and at its end the tied weight's summed gradient) and its comm log."""
    stages = [gt.placement("cpu", [r]) for r in range(2)]
    from globaltensor.models.gpt import GPT, GPTConfig, pp_plan
    torch.manual_seed(0)
    model = gt.to_global(GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2 * virtual, n_head=4, n_embd=16)),
                         stages[0], pp_plan(stages, 2 * virtual, virtual=virtual))
    pipe = gt.Pipeline(model, microbatches=2, schedule=kind, loss_fn=loss_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = _counting_posts()
    context.current().posts_receives_ahead = ahead
    out = []
    for b in batches:
        x, t = _data(b)
        before = len(calls)
        with gt.comm_log() as log:
            pipe.step(x, t)
        opt.step()
        opt.zero_grad()
        received = sum(len(heard) for heard in pipe._learnt.receives.shown[1])  # the step's receives, as it noted them
        out.append((len(calls) - before, received, [(e.kind, e.group, e.recv_bytes) for e in log.events]))
    return out


@pytest.mark.parametrize("kind,virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_receives_are_posted_ahead_from_the_third_step_of_equal_inputs(kind, virtual):
    batches = [4, 4, 4, 4, 6, 6, 6, 4]
    for rank_steps in gt.launch(_posted_per_step, 2, args=(kind, batches, virtual)):
        posted = [p for p, _, _ in rank_steps]
        # steps 1-2 learn; 3-4 post; batch 6: a new signature, learnt in two steps, posted in the third;
        # the last step's inputs are not the learnt ones
        assert posted[:2] == [0, 0] and posted[4:6] == [0, 0] and posted[7] == 0
        for k in (2, 3, 6):
            # every receive of the step (one peer per message here: one logged exchange each), each posted once,
            # the first stage's receive of the tied weight's summed gradient at the step's end among them
            assert posted[k] == rank_steps[k][1] == sum(1 for kind, _, b in rank_steps[k][2]
                                                         if kind == "send_recv" and b) > 0
        logs = [log for _, _, log in rank_steps]
        assert logs[2] == logs[3] == logs[1] == logs[7]  # the same messages and bytes as without posting
        assert logs[6] == logs[5]


def test_a_communicator_whose_receives_would_hold_its_sends_back_posts_none_ahead():
    """nccl runs a rank's point-to-point kernels in order on one stream: there the receives wait for their turn."""
    for rank_steps in gt.launch(_posted_per_step, 2, args=("1f1b", [4] * 4, 1, False)):
        assert [p for p, _, _ in rank_steps] == [0] * 4


def test_posted_receives_train_as_one_device():
    """20 steps with receives posted from the third: losses and parameters equal one device (fp64)."""
    want_losses, want_state = reference(2, 4, 6)
    _check_values(gt.launch(pipelined, 2, args=(2, 2, "1f1b", 2, 4, 6)), want_losses, want_state)


class _Padded(nn.Linear):
    """A Linear that takes fewer features than it has (zero-padded): its input may change width."""

    def forward(self, x):
        return super().forward(F.pad(x, (0, self.in_features - x.shape[-1])).to(self.weight.dtype))


class _Changing(nn.Module):
    """Two stages (a on the first, b on the second); from its `change_at`-th call the tensor crossing to
    the second stage has another shape (`cut`), or the program crosses twice more (`extra`): messages that
    depend on Python state, not on the inputs' shapes."""

    def __init__(self, how: str, change_at: int) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 8), _Padded(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.how, self.change_at, self.calls = how, change_at, 0

    def forward(self, x):
        self.calls += 1
        later = self.calls > self.change_at
        h = self.a(x)
        if self.how == "cut":  # the tensor that crosses to b's stage: 6 columns, then 4
            h = h[:, :4] if later else h[:, :6]
        if self.how == "dtype" and later:  # the same conversion, so the same tag: another dtype
            h = h.double()
        h = self.b(h)
        if self.how == "extra" and not later:
            h = self.d(self.c(h))
        return h


def _changing(how: str, post: bool):
    stages = [gt.placement("cpu", [r]) for r in range(2)]
    first, second = (gt.Layout(p, (gt.broadcast,)) for p in stages)
    torch.manual_seed(0)
    model = gt.to_global(_Changing(how, change_at=2 * 3), stages[0],  # 2 micro-batches a step: from step 4
                         {"a.*": first, "b.*": second, "c.*": first, "d.*": second})
    pipe = gt.Pipeline(model, microbatches=2, schedule="gpipe", loss_fn=lambda o, t: ((o - t) ** 2).mean(),
                       post_receives=post)
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    losses = []
    for _ in range(5):
        loss = pipe.step(x, t)
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
    return losses


@pytest.mark.parametrize("how", ["cut", "extra", "dtype"])
def test_messages_that_change_between_steps_of_equal_inputs_are_an_error_naming_the_opt_out(how):
    """A changed shape changes the conversion's key, so its tag: the posted receive is left unasked. A changed dtype
    keeps the tag: the posted receive is refused when asked for (`Communicator._claim`), and the pipeline names
    its opt-out (the communicator, which knows no pipeline, does not)."""
    unasked = "posted receives its program did not ask for"
    refused = r"posted ahead \(tag \d+\) holds \(16,\) torch.float32, but the program now receives \(16,\) torch.float64"
    with pytest.raises(RuntimeError, match=refused if how == "dtype" else unasked) as err:
        gt.launch(_changing, 2, args=(how, True), timeout=30)
    assert "post_receives=False" in str(err.value)
    losses = [x for r in gt.launch(_changing, 2, args=(how, False)) for x in r if x is not None]
    assert len(losses) == 5 and np.all(np.isfinite(losses))
