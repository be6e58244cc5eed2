"""gt.Pipeline over a Hugging Face-style model: keyword inputs cut into micro-batches, the model's own loss.

The model stands in for a causal LM of transformers: `forward(input_ids=, attention_mask=, labels=)` returns a
ModelOutput (`test_containers.ModelOutput`) with its own mean cross-entropy when given labels. Two one-rank
stages (embedding and half the blocks, the rest and the head); every case trains against the same program on
one device in plain torch, the whole batch at once (fp64, 1e-10): the losses, the gradients of each step and the
parameters after the AdamW steps. The batch (7) does not divide into the micro-batches, so their shares differ.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import globaltensor as gt
from test_containers import ModelOutput

VOCAB, T, D, N_LAYER, BATCH = 32, 6, 8, 4, 7


@dataclasses.dataclass
class CausalLMOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # the mask reaches every stage
        return h + self.fc2(F.gelu(self.fc1(self.norm(h)))) * mask.unsqueeze(-1)


class TinyCausalLM(nn.Module):
    """Hugging Face's calling convention: keyword inputs, the loss inside (computed in the top-level forward from
    the head's logits, as transformers' *ForCausalLM do), `return_dict=False` a tuple (loss, logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.lm_head = nn.Linear(D, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, return_dict: bool = True):
        h = self.embed(input_ids)
        mask = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(h.dtype)
        for layer in self.layers:
            h = layer(h, mask=mask)
        logits = self.lm_head(h)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return CausalLMOutput(loss=loss, logits=logits)


def _data(batch: int = BATCH, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, VOCAB, (batch, T), generator=g),
            "attention_mask": torch.randint(0, 2, (batch, T), generator=g),
            "labels": torch.randint(0, VOCAB, (batch, T), generator=g)}


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM().double()


def reference(steps: int, batch: int = BATCH) -> tuple:
    """Per step the loss and the gradients, and the parameters at the end, of plain torch on the whole batch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = _data(batch)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach() for k, v in model.state_dict().items()}


def _stages() -> tuple:
    return gt.placement("cpu", [0]), gt.placement("cpu", [1])


def _converted() -> TinyCausalLM:
    first, last = _stages()
    on = lambda stage: gt.Layout(stage, gt.broadcast)  # noqa: E731
    half = N_LAYER // 2
    plan = {"embed.*": on(first), "lm_head.*": on(last),
            **{f"layers.{i}.*": on(first if i < half else last) for i in range(N_LAYER)}}
    return gt.to_global(_model(), first, plan)


def pipelined(kind: str, micro: int, steps: int, call: str = "keywords", replay: bool = False,
              batch: int = BATCH) -> tuple:
    """Per step the loss (on the last stage) and this rank's gradients, the parameters it holds at the end, and the
    pipeline's replay state after the last step."""
    model = _converted()
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, replay=replay)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs = _data(batch)
    losses, grads = [], []
    for _ in range(steps):
        if call == "keywords":
            loss = pipe.step(**inputs)
        elif call == "positional":  # input_ids positional, the rest keyword
            rest = {k: v for k, v in inputs.items() if k != "input_ids"}
            loss = pipe.step(inputs["input_ids"], **rest)
        else:  # "tuple": a non-tensor keyword passed as it is; the loss is out[0]
            loss = pipe.step(**inputs, return_dict=False)
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        grads.append({k: p.grad.full_tensor() for k, p in model.named_parameters() if gt.rank() in p.placement})
        opt.step()
        opt.zero_grad()
    state = {k: v.full_tensor() for k, v in model.state_dict().items() if gt.rank() in v.placement}
    return losses, grads, state, (pipe.replaying, pipe.replay_why)


def _check(results: list, want: tuple) -> None:
    want_losses, want_grads, want_state = want
    for rank, (losses, grads, state, _) in enumerate(results):
        if rank == 1:
            torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-10)
        else:
            assert losses == [None] * len(want_losses)
        for got, ref in zip(grads, want_grads):
            assert got and set(got) <= set(ref)
            for k, g in got.items():
                torch.testing.assert_close(g, ref[k], rtol=0, atol=1e-10, msg=k)
        assert state and set(state) <= set(want_state)
        for k, v in state.items():
            torch.testing.assert_close(v, want_state[k], rtol=0, atol=1e-10, msg=k)
    held = [set(g) for _, gs, _, _ in results for g in gs[:1]]
    assert held[0] | held[1] == set(want_grads[0]) and not held[0] & held[1]  # each parameter on one stage


@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_keyword_inputs_and_the_models_own_loss_train_as_one_device(kind, micro):
    """step(input_ids=, attention_mask=, labels=) without loss_fn: each keyword tensor cut into the same micro-batches,
    the labels on the last stage, where the model's top-level loss reads them; out.loss weighted by each
    micro-batch's share (7 rows: 4+3, or 2+2+2+1), so 2 AdamW steps equal one device's on the whole batch."""
    steps = 2
    _check(gt.launch(pipelined, 2, args=(kind, micro, steps)), reference(steps))


@settings(max_examples=6, deadline=None)
@given(micro=st.integers(1, 5), batch=st.integers(5, 9), call=st.sampled_from(["keywords", "positional", "tuple"]),
       kind=st.sampled_from(["gpipe", "1f1b"]))
def test_any_split_and_calling_convention_equals_one_device(micro, batch, call, kind):
    """Any micro-batch count up to the batch, the first input positional or keyword, the loss as out.loss or as out[0]
    of a tuple (`return_dict=False`, a non-tensor keyword passed to every micro-batch as it is)."""
    _check(gt.launch(pipelined, 2, args=(kind, micro, 1, call, False, batch)), reference(1, batch))


def test_replay_takes_keyword_inputs():
    """replay=True: keyword inputs are sources of the tape by name, so once two steps agree a rank replays its part,
    or keeps the program with a reason; either way the values are one device's."""
    steps = 5
    results = gt.launch(pipelined, 2, args=("1f1b", 2, steps, "keywords", True))
    _check(results, reference(steps))
    for *_, (replaying, why) in results:
        assert replaying or why, (replaying, why)


def test_the_old_form_with_a_loss_fn_still_works():
    """step(x, target) with loss_fn: the model called with x alone, loss_fn(output, target)."""
    def run() -> tuple:
        model = _converted()
        pipe = gt.Pipeline(model, microbatches=3, schedule="1f1b",
                           loss_fn=lambda out, t: F.cross_entropy(out.logits.flatten(0, 1), t.flatten()))
        inputs = _data()
        loss = pipe.step(inputs["input_ids"], inputs["labels"])
        keyword = pipe.step(input_ids=inputs["input_ids"], target=inputs["labels"])
        return [t.full_tensor().item() if gt.rank() in t.placement else None for t in (loss, keyword)]
    inputs = _data()
    want = _model()(input_ids=inputs["input_ids"], labels=inputs["labels"]).loss.item()  # no mask: all ones
    got = gt.launch(run, 2)
    torch.testing.assert_close(got[1], [want, want], rtol=0, atol=1e-10)


def _raises(**step_inputs) -> None:
    def run() -> None:
        pipe = gt.Pipeline(_converted(), microbatches=step_inputs.pop("micro", 2), schedule="1f1b")
        pipe.step(**step_inputs)
    gt.launch(run, 2)


def test_more_microbatches_than_the_batch_is_an_error():
    """It used to return nan: an empty micro-batch's mean loss."""
    with pytest.raises(ValueError, match=r"Pipeline\(microbatches=\): 8 micro-batches of a batch of 4"):
        _raises(micro=8, **_data(batch=4))


def test_more_microbatches_than_the_batch_is_an_error_in_the_old_form_too():
    def run() -> None:
        pipe = gt.Pipeline(_converted(), microbatches=8, loss_fn=lambda out, t: out.logits.mean())
        inputs = _data(batch=4)
        pipe.step(inputs["input_ids"], inputs["labels"])
    with pytest.raises(ValueError, match=r"Pipeline\(microbatches=\): 8 micro-batches of a batch of 4 "
                                         r"\(args\[0\]'s dim 0\)"):
        gt.launch(run, 2)


def test_no_loss_anywhere_is_an_error_naming_loss_fn():
    inputs = _data()
    del inputs["labels"]  # the model returns no loss
    with pytest.raises(ValueError, match=r"Pipeline\(loss_fn=None\).*holds no loss.*gt.Pipeline\(loss_fn=\)"):
        _raises(**inputs)


def test_inputs_of_different_batch_sizes_are_an_error():
    inputs = _data()
    inputs["attention_mask"] = inputs["attention_mask"][:5]
    with pytest.raises(ValueError, match=r"Pipeline.step\(attention_mask=\): its dim 0 is 5, the batch's "
                                         r"\(input_ids=\) 7"):
        _raises(**inputs)


def _gpt_by_keyword(kind: str, steps: int) -> tuple:
    """test_pipeline's GPT called by keyword (`GPT.forward(idx, targets=None)`), its loss from loss_fn."""
    from globaltensor.models.gpt import GPT, pp_plan
    from test_pipeline import _cfg, _data as gpt_data, _stages as gpt_stages, loss_fn
    stages = gpt_stages(2, (1,))
    torch.manual_seed(0)
    model = gt.to_global(GPT(_cfg(4, tied_head=False)).double(), stages[0], pp_plan(stages, 4, tied_head=False))
    pipe = gt.Pipeline(model, microbatches=4, schedule=kind, loss_fn=loss_fn, replay=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, t = gpt_data(8)
    losses, replaying = [], []
    for _ in range(steps):
        loss = pipe.step(idx=x, target=t)
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        replaying.append(pipe.replaying)
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    held = {k: gt.rank() in v.placement for k, v in model.state_dict().items()}
    return losses, state, held, replaying, pipe.replay_why


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_replay_feeds_keyword_inputs_by_name(kind):
    """A tape's sources are the micro-batch's inputs by name (`idx=` here, and the target): replayed from the fourth
    step on (the first runs the program whole, the next two record and agree), equal to one device."""
    from test_pipeline import _check_values, reference as gpt_reference
    steps = 5
    want_losses, want_state = gpt_reference(4, 8, steps, tied_head=False)
    results = gt.launch(_gpt_by_keyword, 2, args=(kind, steps))
    _check_values(results, want_losses, want_state)
    for losses, state, held, replaying, why in results:
        assert replaying == [False] * 3 + [True] * 2, why


def test_tensors_inside_a_container_are_an_error():
    inputs = _data()
    inputs["attention_mask"] = [inputs["attention_mask"]]
    with pytest.raises(TypeError, match=r"Pipeline.step\(attention_mask=\): tensors inside a list"):
        _raises(**inputs)


def test_a_loss_that_is_not_a_scalar_is_an_error_naming_loss_fn():
    """A per-row loss (test_containers' head) is not the batch's: the pipeline would not know how to weigh it."""
    def run() -> None:
        model = _converted()
        model.forward = lambda **kw: CausalLMOutput(loss=TinyCausalLM.forward(model, **kw).logits.sum(-1).mean(-1))
        gt.Pipeline(model, microbatches=2).step(**_data())
    with pytest.raises(ValueError, match=r"out.loss has shape \[4\], not a scalar.*gt.Pipeline\(loss_fn=\)"):
        gt.launch(run, 2)


def _general(kind: str, micro: int, per_stage: int, virtual: int, steps: int) -> tuple:
    """`pipelined` over stages of `per_stage` ranks (the batch split over them: data parallel inside each stage, the
    labels split alike on the last) and `virtual` chunks per stage (the blocks dealt round the stages)."""
    first = gt.placement("cpu", list(range(per_stage)))
    last = gt.placement("cpu", list(range(per_stage, 2 * per_stage)))
    on = lambda stage: gt.Layout(stage, gt.broadcast)  # noqa: E731
    chunk = N_LAYER // (2 * virtual)
    plan = {"embed.*": on(first), "lm_head.*": on(last),
            **{f"layers.{i}.*": on((first, last)[i // chunk % 2]) for i in range(N_LAYER)}}
    model = gt.to_global(_model(), first, plan)
    pipe = gt.Pipeline(model, microbatches=micro, schedule=kind, input_sbp=gt.split(0) if per_stage > 1 else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for _ in range(steps):
        loss = pipe.step(**_data())
        losses.append(loss.full_tensor().item() if gt.rank() in loss.placement else None)
        grads.append({k: p.grad.full_tensor() for k, p in model.named_parameters() if gt.rank() in p.placement})
        opt.step()
        opt.zero_grad()
    state = {k: v.full_tensor() for k, v in model.state_dict().items() if gt.rank() in v.placement}
    return losses, grads, state, None


@pytest.mark.parametrize("kind, micro, per_stage, virtual", [("interleaved", 2, 1, 2), ("interleaved", 4, 1, 2),
                                                             ("1f1b", 2, 2, 1)],
                         ids=["interleaved-2", "interleaved-4", "1f1b-dp2"])
def test_interleaved_and_data_parallel_stages_take_keyword_inputs(kind, micro, per_stage, virtual):
    """Interleaved (the keyword inputs reach each chunk's fiber) and PP x DP (the labels split over the last stage's
    ranks as the inputs over the first's)."""
    steps = 2
    want_losses, want_grads, want_state = reference(steps)
    results = gt.launch(_general, 2 * per_stage, args=(kind, micro, per_stage, virtual, steps))
    for rank, (losses, grads, state, _) in enumerate(results):
        if rank >= per_stage:
            torch.testing.assert_close(losses, want_losses, rtol=0, atol=1e-10)
        for got, ref in zip(grads, want_grads):
            for k, g in got.items():
                torch.testing.assert_close(g, ref[k], rtol=0, atol=1e-10, msg=k)
        for k, v in state.items():
            torch.testing.assert_close(v, want_state[k], rtol=0, atol=1e-10, msg=k)
    assert set().union(*(set(r[2]) for r in results)) == set(want_state)
