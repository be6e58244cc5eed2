"""Pipeline parallelism: stages are placements, a schedule says when each rank runs which micro-batch.

The model is converted with a plan whose entries carry their own placement (`gt.Layout(stage, sbp)`);
a module whose parameters live on one stage receives its inputs there (`module.py`: a point-to-point
send at the stage boundary, its backward the gradient sent back). So one micro-batch's forward is the
unchanged global program: every rank runs it, computing where its stage's shards are and passing
empty shards elsewhere, and the only messages are the stage boundaries'. What one SPMD program cannot
say is the order: a schedule (data, `schedule_actions(kind, stages, microbatches)`) lists per stage the
forward (F) and backward (B) actions, and each rank runs its stage's list. GPipe runs every forward
then every backward; 1F1B (PipeDream-flush) starts the backward of a micro-batch as soon as the last
stage has it, so a stage holds at most `stages - stage` micro-batches' activations instead of all.

A rank leaves a micro-batch's forward once the rest of it has nothing of its own (`early_exit.py`): every
rank runs the one global program, so without it the first stage would call every later stage's modules on
empty shards.

Messages never wait for their receiver (sends are buffered on the simulator and asynchronous on
gloo) and are matched by (step, micro-batch, direction) tags in program order, never by arrival; so the
stages' different orders cannot cross-match. Receives are posted ahead: once two steps showed a rank
which messages each of its actions receives, it posts those of its next actions while it computes
(a transfer starts only when its receive is posted). Gradients accumulate over micro-batches as autograd
accumulates them; each micro-batch's loss is weighted by its share of the batch, so the step equals
one pass over the whole batch (micro-batches of unequal size, `tensor_split`'s, included).
"""
from __future__ import annotations

import contextlib
import operator
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from . import early_exit
from .replay import Recorder, Tapes, give_empty_grads, recording
from ..layout import Layout, normalize_sbp
from ..placement import Placement
from ..runtime import context
from ..runtime.trace import STATE as _TRACE_STATE
from ..runtime.comm import PostedMismatch
from ..runtime.failure import CollectiveError
from ..sbp import Broadcast, Partial, Split
from .stage import StageForward
from .trees import tensors
from ..runtime.fiber import Fiber
from ..tensor import GlobalTensor, distribute, grad_layout
from .zero import accumulating, gathered_storages, storage_key

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def schedule_actions(kind: str, stages: int, microbatches: int,
                     virtual: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per stage (rank set), its actions in order: ("F", i, c) the forward of micro-batch i through the
    stage's chunk c (its c-th virtual stage, 0 unless interleaved), ("B", i, c) that chunk's backward.

    Interleaved 1F1B (Megatron's): the stage holds `virtual` chunks, virtual stage c * stages + s; the
    forwards go in rounds of `stages` micro-batches through chunk 0, then the same round through chunk
    1, and so on (backwards the chunks in reverse), with a warm-up of (stages - s - 1) * 2 +
    (virtual - 1) * stages forwards before the one-forward-one-backward steady state.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"Pipeline(schedule=): {kind!r} is not one of {SCHEDULES}")
    m, p, v = microbatches, stages, virtual
    if kind != "interleaved" and v != 1:
        raise ValueError(f"schedule_actions(virtual=): {kind!r} runs one chunk per stage; virtual stages "
                         f"need schedule='interleaved'")
    if kind == "interleaved" and m % p:
        raise ValueError(f"Pipeline(microbatches=): the interleaved schedule runs micro-batches in rounds of "
                         f"one per stage; {m} is not a multiple of the {p} stages (use {m + (-m) % p})")
    out = []
    for s in range(p):
        if kind == "gpipe":
            out.append([("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)])
            continue
        total = m * v

        def unit(k: int, backward: bool) -> tuple[str, int, int]:
            rnd, within = divmod(k, p * v)
            chunk = within // p
            return ("B" if backward else "F", rnd * p + within % p, v - 1 - chunk if backward else chunk)
        warm = min((p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1, total)
        acts = [unit(k, False) for k in range(warm)]
        for k in range(total - warm):
            acts += [unit(warm + k, False), unit(k, True)]
        acts += [unit(k, True) for k in range(total - warm, total)]
        out.append(acts)
    return out


def draw(actions: list[list[tuple[str, int]]]) -> str:
    """A text picture of a schedule (one row per stage, in action order, no timing)."""
    return "\n".join(f"stage {s}: " + " ".join(_label(*a) for a in acts) for s, acts in enumerate(actions))


def _label(act: str, i: int, chunk: int) -> str:
    return f"{act}{i}" if not chunk else f"{act}{i}.{chunk}"


def timeline_svg(timelines: list[list[tuple]], width: int = 900) -> str:
    """An SVG of which rank ran what when (one row per rank, from `Pipeline.timeline`s of one step):
    forward actions light, backward dark, the waiting inside an action hatched grey (drawn from the
    action's start, where a stage waits for its input; the timeline has its length, not its place)."""
    end = max((e for tl in timelines for *_, e, _ in tl), default=1.0) or 1.0
    row, scale = 28, width / end
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 60}" height="{row * len(timelines) + 10}">',
             '<defs><pattern id="wait" width="4" height="4" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><rect width="2" height="4" fill="#999"/></pattern></defs>']
    for r, tl in enumerate(timelines):
        y = 5 + r * row
        parts.append(f'<text x="0" y="{y + 17}" font-size="12">rank {r}</text>')
        for act, i, c, s, e, wait in tl:
            x, w = 55 + s * scale, max((e - s) * scale, 1)
            color = "#9ecae1" if act == "F" else "#3182bd"
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{color}" '
                         f'stroke="white"><title>{_label(act, i, c)}: {1e3 * (e - s):.1f} ms, waiting {1e3 * wait:.1f}'
                         f'</title></rect>')
            if wait > 0:
                parts.append(f'<rect class="wait" x="{x:.1f}" y="{y}" width="{min(wait, e - s) * scale:.1f}" '
                             f'height="{row - 6}" fill="url(#wait)"/>')
            parts.append(f'<text x="{x + 2:.1f}" y="{y + 15}" font-size="10">{_label(act, i, c)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def _stage_placements(model: torch.nn.Module) -> list[Placement]:
    """The distinct placements of the model's parameters, in the order the modules list them."""
    seen: list[Placement] = []
    for q in model.parameters():
        if isinstance(q, GlobalTensor) and q.placement not in seen:
            seen.append(q.placement)
    return seen


class ActivationMeter:
    """Bytes of the tensors autograd saves for the backward (this rank's shards, each storage once,
    the parameters' storages and their gathered copies excluded): live now and the most at once. Installed as saved-tensor hooks around each
    micro-batch's forward; a saved tensor counts until autograd releases it (after its node's backward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage address -> [saved references, bytes]
        self._model = model
        self._params: set[int] = set()

    def watch_parameters(self) -> None:
        """Note the parameters' storages: a saved view of a weight (linear's transposed weight) is no activation."""
        self._params = {storage_key(q._local if isinstance(q, GlobalTensor) else q) for q in self._model.parameters()}

    def pack(self, t: torch.Tensor) -> Any:
        local = t._local if isinstance(t, GlobalTensor) else t
        key, nbytes = storage_key(local), local.untyped_storage().nbytes()
        if not nbytes or key in self._params or key in gathered_storages():
            return t
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            ref[0] += 1
        return _Saved(self, key, t)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if not ref[0]:
            del self._refs[key]
            self.live -= ref[1]


class _Saved:
    """A saved tensor as autograd holds it: dropped when autograd releases it."""
    __slots__ = ("meter", "key", "tensor")

    def __init__(self, meter: ActivationMeter, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class Agreement:
    """What a step showed for inputs of one signature, learnt once two steps in a row showed the same: a first
    step runs what later ones skip, and what one step shows may be that step's alone. The pipeline learns three
    things so (`_Learnt`); a step that shows something else (or nothing: `what` None) unlearns it, unless it
    `keeps` (what is learnt for one signature stays while steps of another show theirs), and a step whose
    learnt turned out wrong forgets it."""
    __slots__ = ("keeps", "shown", "learnt")

    def __init__(self, keeps: bool = False) -> None:
        self.keeps = keeps
        self.shown: Optional[tuple] = None   # (signature, what) the last step showed
        self.learnt: Optional[tuple] = None  # the same, once two steps in a row agreed

    def get(self, signature: Any) -> Any:
        """What is learnt for inputs of `signature`, or None."""
        learnt = self.learnt
        return learnt[1] if learnt is not None and learnt[0] == signature else None

    def show(self, signature: Any, what: Any, same: Callable[[Any, Any], bool] = operator.eq) -> bool:
        """A step showed `what` (None: nothing to learn); whether that made it learnt (`same` as the last step's)."""
        now = None if what is None else (signature, what)
        before, self.shown = self.shown, now
        if now is not None and before is not None and before[0] == signature and same(before[1], what):
            self.learnt = now
            return True
        if not self.keeps:
            self.learnt = None
        return False

    def forget(self) -> None:
        self.shown = self.learnt = None


@dataclass(eq=False)
class _Learnt:
    """What steps of equal inputs taught a pipeline on this rank."""
    receives: Agreement = field(default_factory=Agreement)  # per action, the receives it made: posted ahead
    exits: Agreement = field(default_factory=Agreement)     # per micro-batch, where its forward may be left
    tapes: Agreement = field(default_factory=lambda: Agreement(keeps=True))  # this rank's part (`Tapes`): replayed
    placeholders: dict = field(default_factory=dict)  # micro-batch -> its loss's value from a forward run whole
                                                      # (a left forward's stand-in)
    unreplayable: Optional[tuple] = None  # the inputs whose recording failed


@dataclass(eq=False)
class _Step:
    """One step as its phases (`Pipeline.step`) share it: its plan, then how far it got."""
    comm: Any
    args: Sequence                # per micro-batch: the model's positional inputs, its keyword inputs,
    kwargs: Sequence              # the target (None: the model's own loss), its share of the batch
    ts: Sequence
    weights: list
    mine: list                    # this rank's actions (act, micro-batch, chunk)
    signature: tuple              # the inputs' shapes and dtypes: what the learnt is for
    shown: tuple                  # ... with what else a recording depends on (grad mode, training)
    saved: tuple                  # the communicator's (p2p_tag, p2p_async, p2p_label) before the step
    start: float                  # perf_counter() at its start
    base: int                     # tags: micro-batch i's forward base + 2i, its backward base + 2i + 1
    deferred: int                 # ... the step's deferred reductions
    receives: Optional[list]      # learnt receives per action, posted ahead (None: none)
    leaves: Optional[dict]        # learnt: micro-batch -> where its forward is left (None: learning it)
    tapes: Optional[Tapes]        # replayed (None: the program runs)
    recorder: Optional[Recorder]  # recording this rank's part
    log: contextlib.ExitStack     # the recording's comm log, `recorded`
    recorded: Any
    heard: list                   # per action, and the deferred reductions: the receives it made
    posted: int = 0               # actions whose receives are posted
    losses: dict = field(default_factory=dict)   # micro-batch -> its loss (its value once backpropagated)
    fibers: dict = field(default_factory=dict)   # (act, micro-batch) -> its Fiber (interleaved)
    exited: dict = field(default_factory=dict)   # micro-batch -> where this rank left its forward (LeftForward)
    noted: dict = field(default_factory=dict)    # learning forwards: micro-batch -> (stage calls, communications)
    missed: bool = False          # an armed exit found another call than the learnt one
    held: int = 0                 # chunks whose activations this rank holds (forward run, backward not)
    peak: int = 0                 # ... their most
    left_forwards: int = 0
    flushed: bool = False         # the stages' gradients are in `.grad`
    unclaimed: list = field(default_factory=list)  # receives posted ahead that nothing claimed


class Pipeline:
    """`step(x, target)` (with `loss_fn`) or `step(**inputs)` (the model's own loss, Hugging Face's `labels=`) trains
    one batch as `microbatches` micro-batches in the schedule's order and returns the batch's loss (a GlobalTensor on
    the last stage; every rank calls it). Inputs go to the first stage as `input_sbp` says, keyword inputs named in
    `label_names` (default `("labels",)`, as transformers' Trainer names them) to the last, where a model computing
    its loss from its head's output reads them (an op never moves a non-scalar across stages).

    `measure_activations=True` counts the bytes autograd saves for the backward on this rank
    (`.activations`, an `ActivationMeter`: its `.peak` is what a schedule's memory claim is about).

    `post_receives` (default on): once two steps of equal inputs made the same messages, each rank posts
    the receives of its next `stages x chunks` actions while it runs the current one (`Communicator.
    post_receive`), as torch.pipelining's runtime schedules do; off for a program whose stage boundaries
    carry tensors of data-dependent shapes (a changed message is an error then, never a wrong match). Not
    on nccl, whose in-order stream would hold a rank's later sends behind a receive posted early.

    `leave_early` (default on): likewise learnt from two steps, a rank leaves each micro-batch's forward at the
    stage call from which on nothing of it is its own (`early_exit`: the stages after its last send are not
    called on it, their modules' hooks not run); `.left_forwards` counts those of the last step. Off for a
    program that may add a communication of this rank's after that point in a later step.

    `replay` (opt-in): once two steps of equal inputs recorded the same part of each micro-batch on a rank (its
    stages' calls on plain tensors, the glue computing on its shards, its messages: `globaltensor/parallel/replay.py`),
    later steps run that part alone, as a torch.pipelining stage runs its module, instead of the whole global
    program; the messages are the program's, so each rank decides alone. For a program whose forward, given equal
    input shapes, computes the same way: Python state it reads besides its inputs (a step counter, a mask made
    from the batch's values as a plain tensor) is what no recording can see. `.replaying` says whether the last step
    replayed, `.replay_why` why this rank does not (a stage of several ranks, a collective, hooks, ...)."""

    def __init__(self, model: torch.nn.Module, microbatches: int, schedule: str = "1f1b",
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 input_sbp: Any = None, target_sbp: Any = None, measure_activations: bool = False,
                 post_receives: bool = True, leave_early: bool = True, replay: bool = False,
                 label_names: Sequence[str] = ("labels",)) -> None:
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"Pipeline(microbatches=): expected a positive int, got {microbatches!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"Pipeline(schedule=): {schedule!r} is not one of {SCHEDULES}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Pipeline(loss_fn=): expected a function (output, target) -> scalar, got "
                            f"{type(loss_fn).__name__}")
        if isinstance(label_names, str) or not all(isinstance(n, str) for n in label_names):
            raise TypeError(f"Pipeline(label_names=): expected a sequence of keyword names, got {label_names!r}")
        self.label_names = tuple(label_names)
        self._label_keys = frozenset(_kwarg_name(n) for n in self.label_names)
        self.model, self.microbatches, self.kind, self.loss_fn = model, microbatches, schedule, loss_fn
        self.stages = _stage_placements(model)
        if not self.stages:
            raise ValueError("Pipeline(model=): convert the model with gt.to_global first; its plan puts "
                             "modules on stages with gt.Layout(placement, sbp) entries")
        owners = [i for i, p in enumerate(self.stages) if context.current().rank in p]
        if len(owners) > 1:
            raise ValueError(f"Pipeline: rank {context.current().rank} is in several stages "
                             f"{[self.stages[i] for i in owners]}; stages must be disjoint rank sets")
        self.stage = owners[0] if owners else None
        first = self.stages[0]
        self.input_layout = Layout(first, (Broadcast(),) * first.ndim if input_sbp is None else
                                   normalize_sbp(input_sbp, first.ndim, "Pipeline(input_sbp=)"))
        self.target_sbp = target_sbp
        last = self.stages[-1]  # keyword inputs named in label_names: where the model's own loss reads them
        self.label_layout = Layout(last, normalize_sbp(target_sbp, last.ndim, "Pipeline(target_sbp=)")
                                   if target_sbp is not None else self.input_layout.sbp
                                   if last.ndim == first.ndim else (Broadcast(),) * last.ndim)
        self.activations: Optional[ActivationMeter] = ActivationMeter(model) if measure_activations else None
        self.virtual = _virtual_stages(model, self.stages)
        if schedule == "interleaved" and self.virtual == 1:
            raise ValueError("Pipeline(schedule='interleaved'): each stage holds one contiguous chunk of the model; "
                             "give each stage several (virtual stages), e.g. pp_plan(stages, n_layer, virtual=2)")
        if schedule == "1f1b" and self.virtual > 1:  # a forward would wait on a stage busy in a backward
            raise ValueError(f"Pipeline(schedule='1f1b'): the model visits each stage {self.virtual} times per "
                             f"micro-batch (virtual stages); run it with schedule='interleaved' (or 'gpipe')")
        self.actions = schedule_actions(schedule, len(self.stages), microbatches,
                                        self.virtual if schedule == "interleaved" else 1)
        self.post_receives, self.leave_early, self.replay = post_receives, leave_early, replay
        # the loss is a stage of its own on the output's placement: plain tensors on a one-rank stage,
        # skipped (after a first step) on the ranks outside it, as the model's stage modules are
        self._losses: dict[Placement, StageForward] = {}
        self._target_layouts: dict = {}  # (output layout, target dims) -> the layout targets take there
        self._stage_forwards = [f for f in (mod.__dict__.get("forward") for mod in model.modules())
                                if isinstance(f, StageForward)]
        self._learnt = _Learnt()
        self._steps = 0
        # the last step's: forwards this rank left, whether it replayed, why not
        self.left_forwards, self.replaying, self.replay_why = 0, False, ""

    def _stop_on_entry(self) -> None:
        """At each step (fibers run only inside one): a pre-hook registered since the last makes the stop a hook."""
        if self.chunks > 1:  # fibers: each stops where it enters one of its rank's chunks
            for f in self._stage_forwards:
                f.stop_on_entry()

    def step(self, *args: Any, **kwargs: Any) -> GlobalTensor:
        """The whole batch, the same plain tensors on every rank (as gt.to_global takes them), as the model takes it:
        `step(input_ids=x, attention_mask=m, labels=y)` calls `model(input_ids=x_i, attention_mask=m_i, labels=y_i)`
        per micro-batch. Every tensor input of at least one dim (positional or keyword) is cut along dim 0 into
        the same `tensor_split` pieces, so all must have the batch's size there; 0-dim tensors and other values
        are passed as they are. Inputs go to the first stage (`input_sbp`), keyword inputs named in `label_names`
        to the last (as `target_sbp`), where a model computing its own loss (Hugging Face's) reads its labels.

        The loss: with `loss_fn`, `loss_fn(output, target)`, the target given as `target=` or as the last
        positional argument (`step(x, target)`: the model called as `model(x)`). Without, the model's own: the
        output itself if it is a scalar, else `out.loss` (a ModelOutput's or named tuple's field), `out["loss"]`
        (a dict), or `out[0]` (a tuple whose first item is a scalar). Either is weighted by each micro-batch's
        share of the batch, so a step equals one pass over the whole batch where the loss is a mean over the
        batch's examples. A loss that is not a per-example mean (a token mean over padded sequences, whose
        micro-batches hold different numbers of tokens) is not one device's under micro-batching, as in
        torch.distributed.pipelining (the weights count examples, not tokens): give a `loss_fn` that is a mean over
        the examples (of each example's token mean, say) where the step must equal one device.

        In phases, each its own method: the schedule (`_begin`), this rank's actions in its schedule's order (`_action`),
        the step's end inside its `accumulating()` scope (`_after_actions`), the stages' gradients into `.grad`; a
        failed step unwound (`_failed`), and either way the communicator as before it (`_restore`); then what the
        step showed is learnt (`_learn`) and its figures kept (`_measure`)."""
        run = self._begin(args, kwargs)
        try:
            with accumulating():  # a weight kept gathered (the tied head on the last stage): once per step
                for k, (act, i, c) in enumerate(run.mine):
                    self._action(run, k, act, i, c)
                self._after_actions(run)
            for f in self._stage_forwards:
                f.close_step()
            run.comm.p2p_heard = None
            run.flushed = True
        except BaseException as e:
            said = self._failed(run, e)
            if said is None:
                raise
            raise said from e
        finally:
            self._restore(run)
        self._learn(run)
        self._measure(run)
        for f in self._stage_forwards + list(self._losses.values()):  # stages seen whole: ranks outside them
            f.promote_watched()                                        # skip their ops from now on
        return _summed([run.losses[i] for i in range(self.microbatches)])

    def _begin(self, args: tuple, kwargs: dict) -> "_Step":
        """The step's schedule, before anything runs: its micro-batches, this rank's actions and tags, and what of the
        learnt applies to inputs of these shapes (receives posted ahead, forwards left early, tapes replayed) or
        is being learnt (a recording). The stages open their step: their parameters take its gradients once."""
        comm = context.current()
        args, kwargs, target = self._inputs(args, kwargs)
        batch, named = _batch_size(args, kwargs)
        m = self.microbatches
        if batch < m:  # tensor_split would give empty micro-batches, whose mean losses are nan
            raise ValueError(f"Pipeline(microbatches=): {m} micro-batches of a batch of {batch} ({named}'s dim 0) "
                             f"would leave some empty; use at most {batch} micro-batches or a larger batch")
        self._stop_on_entry()
        a_pieces = [_pieces(a, m) for a in args]
        k_pieces = {k: _pieces(v, m) for k, v in kwargs.items()}
        margs = [tuple(p[i] for p in a_pieces) for i in range(m)]
        mkwargs = [{k: p[i] for k, p in k_pieces.items()} for i in range(m)]
        ts = _split(target, m) if target is not None else [None] * m
        first = next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() > 0)
        # each loss's share: the step is one pass over the batch
        weights = [p.shape[0] / batch for p in first.tensor_split(m)]
        mine = self.actions[self.stage] if self.stage is not None else _whole(self.actions[-1], self.chunks)
        self.timeline: list = []  # (action, micro-batch, chunk, start s, end s, of which waiting s) from the start
        if self.activations is not None:
            self.activations.watch_parameters()
        saved = comm.p2p_tag, comm.p2p_async, comm.p2p_label
        comm.p2p_async = True
        start = time.perf_counter()
        comm.p2p_wait_s = 0.0
        for f in self._stage_forwards:  # the parameters take the step's gradients once, at its end
            f.open_step()
        signature = (_signature(args), tuple((k, _signature(v)) for k, v in kwargs.items()),
                     None if target is None else (tuple(target.shape), target.dtype))
        learnt = self._learnt
        receives = learnt.receives.get(signature) if self.post_receives and comm.posts_receives_ahead else None
        reported = _TRACE_STATE.reporting > 0  # a comm_report open here: the program runs, its modules' frames seen
        # what a recording depends on besides the inputs' shapes, as far as a pipeline sees it
        shown = (signature, torch.is_grad_enabled(), self.model.training)
        tapes, recorder = self._replay_or_record(shown, reported)
        self.replaying = tapes is not None
        if tapes is not None:  # no stage is called here: the parameters take the last step's empty gradients
            for f in self._stage_forwards:
                f.give_empty_grads_as_before()
        # tags: per micro-batch and direction, and per step (every rank steps as often), so that a message left
        # over from a step that failed cannot match one of a later step
        base = (self._steps % 1024) * (2 * self.microbatches + 1)
        for f in self._stage_forwards:  # a stage drawing random numbers: said once, at the first step
            f.watch_draws = self._steps == 0
        self._steps += 1
        log = contextlib.ExitStack()
        recorded = log.enter_context(context.comm_log()) if recorder is not None else None
        comm.p2p_record = recorder.exchange if recorder is not None else None
        return _Step(comm=comm, args=margs, kwargs=mkwargs, ts=ts, weights=weights, mine=mine, signature=signature, shown=shown,
                     saved=saved, start=start, base=base, deferred=base + 2 * self.microbatches,
                     receives=receives, leaves=learnt.exits.get(signature), tapes=tapes, recorder=recorder,
                     log=log, recorded=recorded, heard=[[] for _ in range(len(mine) + 1)])

    def _replay_or_record(self, shown: tuple, reported: bool) -> tuple[Optional[Tapes], Optional[Recorder]]:
        """(the tapes this step replays, or the recorder of this step's part): neither under a comm_report, whose
        view is of the program, nor at the first step (which runs ops later ones skip), nor for inputs whose
        recording failed."""
        tapes = self._learnt.tapes.get(shown) if self.replay and not reported else None
        why = tapes.why_not() if tapes is not None else ""
        if why:  # a hook on one of its stages since: the program runs, and records
            self.replay_why, tapes = why, None
            self._learnt.tapes.forget()
        recorder = Recorder() if (self.replay and tapes is None and self._steps >= 1 and not reported
                                  and self._learnt.unreplayable != shown) else None
        return tapes, recorder

    def _action(self, run: "_Step", k: int, act: str, i: int, c: int) -> None:
        """This rank's k-th action, (act, i, c): its messages tagged and noted (`heard`), the learnt receives of the
        actions ahead posted first, then run from the tapes or in the program (a fiber's chunk when interleaved)."""
        comm = run.comm
        if run.receives is not None:
            ahead = len(self.stages) * self.chunks
            run.posted = _post_ahead(comm, run.mine, run.receives, run.posted, k + 1 + ahead, run.base, run.deferred)
        t0, w0 = time.perf_counter() - run.start, comm.p2p_wait_s
        comm.p2p_tag = run.base + 2 * i + (act == "B")
        comm.p2p_label = _describe(act, i)
        if act == "F":
            leave = (None if run.leaves is None else run.leaves[i] or False) if self.leave_early else _UNWATCHED
            go = partial(self._forward, run, i, leave)
        elif i in run.exited:  # from the tensors the rest of the forward would have taken
            go = partial(torch.autograd.backward, run.exited[i].roots, run.exited[i].grads)
        else:
            go = partial(run.losses[i].backward, _seed(run.losses[i]))
        comm.p2p_heard = run.heard[k]
        if run.recorder is not None:
            run.recorder.current = (act, i, c)
        try:
            if run.tapes is not None:
                done, result = self._replayed(run, act, i, c)
            else:
                done, result = self._chunk(run.fibers, act, i, c, go)
        finally:
            comm.p2p_heard = None
        self._finished(run, act, i, c, done, result)
        self.timeline.append((act, i, c, t0, time.perf_counter() - run.start, comm.p2p_wait_s - w0))

    def _finished(self, run: "_Step", act: str, i: int, c: int, done: bool, result: Any) -> None:
        """An action's outcome: the micro-batch's loss where its forward ended (a left forward's stand-in value, its
        backward then starting from where it was left), the chunks whose activations this rank holds."""
        placeholders = self._learnt.placeholders
        if run.recorder is not None and done and act == "F":
            run.recorder.finish_forward(i, c, placeholders[i] if isinstance(result, early_exit.LeftForward)
                                        else result)
        run.held += 1 if act == "F" else -1
        run.peak = max(run.peak, run.held)
        if done and isinstance(result, early_exit.LeftForward):
            run.exited[i], run.losses[i] = result, placeholders[i]
            run.left_forwards += 1
        elif done:
            run.losses[i] = result if act == "F" else _value(run.losses[i])
            if act == "B":
                run.exited.pop(i, None)

    def _after_actions(self, run: "_Step") -> None:
        """Inside the step's `accumulating()` scope, after the actions: a replayed rank's empty share of a kept
        gather's gradients, the kept gathered copies' summed gradients handed to their gathers once, and the
        scope's close (the step's deferred reductions) under a tag no action uses."""
        comm = run.comm
        if run.recorder is not None:
            run.recorder.current = ("D",)
        if run.tapes is not None:  # a gather this rank ran outside its compute placement: its empty share
            give_empty_grads()
        for f in self._stage_forwards:  # kept gathered copies' gradients, summed: into their gathers once
            f.hand_on()
        comm.p2p_tag = run.deferred
        comm.p2p_label = _DEFERRED
        comm.p2p_heard = run.heard[-1]

    def _failed(self, run: "_Step", e: BaseException) -> Optional[BaseException]:
        """A step that raised is lost: its micro-batches unwound, and what it would have taught unlearnt. Returns the
        error to raise instead of `e` where the learnt explains it (None: `e` as it is)."""
        for f in run.fibers.values():  # micro-batches stopped mid-way: unwind them
            f.cancel()
        if run.tapes is not None:
            run.tapes.drop()
            self._learnt.tapes.forget()
        else:
            self._learnt.tapes.show(run.shown, None)  # a failed step shows nothing
        if run.leaves is not None and isinstance(e, CollectiveError):  # a message after a learnt exit point?
            return CollectiveError(f"{e}\n{_LEFT_HINT}")
        if isinstance(e, PostedMismatch):  # a message learnt and posted ahead changed
            self._learnt.receives.forget()
            return PostedMismatch(f"{e}; {_CHANGED_HINT}")
        return None

    def _restore(self, run: "_Step") -> None:
        """Whether the step ended or failed: the communicator as before it (its sends flushed, the receives posted
        ahead that nothing claimed noted), the recording's log closed, and a failed step's gradients dropped."""
        comm = run.comm
        comm.p2p_heard = comm.p2p_record = None
        run.log.close()
        for f in self._stage_forwards:
            f.watch_draws = False
        if not run.flushed:
            for f in self._stage_forwards:
                f.close_step(flush=False)
        run.unclaimed = comm.posted_left()
        comm.flush_sends()
        comm.p2p_tag, comm.p2p_async, comm.p2p_label = run.saved

    def _learn(self, run: "_Step") -> None:
        """What the step showed, learnt where the step before showed the same for the same inputs (`Agreement`): its
        receives per action, posted ahead from the next step on (a first step also runs the ops the later ones
        skip); where each micro-batch's forward may be left (`early_exit`: an armed step keeps what it was given,
        unless a forward missed its exit); its recording, replayed. A receive posted ahead that the program never
        asked for unlearns the receives, and is an error."""
        if run.unclaimed:
            self._learnt.receives.forget()
            raise RuntimeError(f"Pipeline.step: rank {run.comm.rank} posted receives its program did not ask for "
                               f"(source rank, tag): {run.unclaimed[:4]}; {_CHANGED_HINT}")
        self._learnt.receives.show(run.signature, run.heard)
        if self.leave_early:
            if run.leaves is None:
                exits = {i: early_exit.leave_point(*n) for i, n in run.noted.items()}
                shown = exits if len(exits) == self.microbatches else None
            else:
                shown = None if run.missed else run.leaves
            self._learnt.exits.show(run.signature, shown)
        if run.recorder is not None:
            self._keep_recording(run)

    def _measure(self, run: "_Step") -> None:
        """The step's figures: micro-batches in flight at most, forwards left, and the bubble. Idle is the waiting
        on other stages inside the actions and all the time outside them (the last sends' wait, the tied weight's
        gradient, the step's own work after the actions: counted idle, not work); each moment once (a wait
        outside the actions is in the second term only)."""
        self.peak_in_flight = run.peak if self.chunks == 1 else run.peak / self.chunks  # in micro-batches
        self.left_forwards = run.left_forwards
        total = time.perf_counter() - run.start
        waited = sum(w for *_, w in self.timeline)
        self.bubble = (waited + total - sum(e - s for *_, s, e, _ in self.timeline)) / total

    def _replayed(self, run: "_Step", act: str, i: int, c: int) -> tuple[bool, Any]:
        """Action (act, i, c) from this rank's tapes: (finished, the loss where a forward finishes)."""
        whole = self.stage is None or self.chunks == 1
        if act == "F":
            meter = self.activations
            with (torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter is not None
                  else contextlib.nullcontext()):
                return whole or c == self.chunks - 1, run.tapes.forward(i, c, run.comm, self._sources(run, i),
                                                                        distribute)
        run.tapes.backward(i, c, run.comm)
        return whole or c == 0, None

    def _keep_recording(self, run: "_Step") -> None:
        """The step's recording: replayed from the next step where it equals the step before's."""
        recorder = run.recorder
        for e in run.recorded.events:
            if e.kind != "send_recv":
                recorder.fail(f"a {e.kind} in the step (a stage of several ranks, or a weight's per-step reduction)")
        segments = recorder.done()
        last = 0 if self.stage is None or self.chunks == 1 else self.chunks - 1
        if segments is not None and any((i, last) not in segments or segments[(i, last)].loss is None
                                        for i in range(self.microbatches)):
            recorder.fail("a micro-batch's forward did not end in this rank's last chunk")
            segments = None
        if segments is None:
            self.replay_why, self._learnt.unreplayable = recorder.why, run.shown
            self._learnt.tapes.show(run.shown, None)
        elif self._learnt.tapes.show(run.shown, Tapes(segments), same=Tapes.same):
            self.replay_why = ""

    @property
    def chunks(self) -> int:
        """Chunks of the model each stage runs per micro-batch: its virtual stages when interleaved."""
        return self.virtual if self.kind == "interleaved" else 1

    def _forward(self, run: "_Step", i: int, leave: Any) -> Any:
        """Micro-batch i's forward: its loss, or where this rank left it (`early_exit.LeftForward`). `leave`:
        where it may be left (learnt), None to note its stage calls (learning), False for neither, _UNWATCHED
        for a pipeline that does not leave early."""
        if leave is not _UNWATCHED:  # per thread: set where the forward runs (a fiber's own)
            early_exit.begin(leave)
        try:
            # per thread too: this rank's part recorded where the forward runs
            with recording(run.recorder) if run.recorder is not None else contextlib.nullcontext():
                loss = self._loss_of(run, i)
        except early_exit.LeftForward as left:
            return left
        finally:
            if leave is not _UNWATCHED:
                noted, missed = early_exit.end()
                if noted is not None:
                    run.noted[i] = noted
                run.missed |= missed
        if leave is None:
            self._learnt.placeholders[i] = _value(loss)
        return loss

    def _loss_of(self, run: "_Step", i: int) -> torch.Tensor:
        target = run.ts[i]
        meter = self.activations  # saved-tensor hooks are per thread: set where the forward runs
        with (torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack) if meter is not None
              else contextlib.nullcontext()):
            recorder = run.recorder

            def placed(v: Any, name: str) -> Any:
                if not isinstance(v, torch.Tensor):
                    return v
                d = distribute(v, self.label_layout if name in self._label_keys else self.input_layout)
                if recorder is not None:
                    recorder.source(d, name)
                return d
            args = tuple(placed(a, _arg_name(k)) for k, a in enumerate(run.args[i]))
            kwargs = {k: placed(v, _kwarg_name(k)) for k, v in run.kwargs[i].items()}
            out = self.model(*args, **kwargs)
            if self.loss_fn is None:
                own = _own_loss(out)
                loss = self._losses.get(own.placement)
                if loss is None:
                    loss = self._losses[own.placement] = StageForward(_OwnLoss(), own.placement)
                return loss(own, run.weights[i])
            o = out if isinstance(out, GlobalTensor) else tensors(out)[0]  # where the loss is: its first tensor
            loss = self._losses.get(o.placement)
            if loss is None:
                loss = self._losses[o.placement] = StageForward(_Loss(self.loss_fn), o.placement)
            key = (o._layout, target.dim())  # the target's layout: worked out once per output layout
            lay = self._target_layouts.get(key)
            if lay is None:
                lay = self._target_layouts[key] = _target_layout(target, o, self.target_sbp)
            td = distribute(target, lay)
            if recorder is not None:
                recorder.source(td, "target")
            return loss(out, td, run.weights[i])

    def _sources(self, run: "_Step", i: int) -> dict:
        """Micro-batch i's tensor inputs by the names a recording gives them (`Recorder.source`)."""
        got = {_arg_name(k): a for k, a in enumerate(run.args[i]) if isinstance(a, torch.Tensor)}
        got.update((_kwarg_name(k), v) for k, v in run.kwargs[i].items() if isinstance(v, torch.Tensor))
        if run.ts[i] is not None:
            got["target"] = run.ts[i]
        return got

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
        """(the model's positional inputs, its keyword inputs, the target or None)."""
        target = None
        if self.loss_fn is not None:
            if "target" in kwargs:
                kwargs = dict(kwargs)
                target = kwargs.pop("target")
            elif args:
                args, target = args[:-1], args[-1]
            else:
                raise TypeError("Pipeline.step: with loss_fn, give the target as target= or as the last positional "
                                "argument (step(x, target)); without loss_fn, the model's own loss is used")
        if not args and not kwargs:
            raise TypeError("Pipeline.step: no inputs for the model; pass them as the model takes them "
                            "(step(x, target) with loss_fn, step(input_ids=x, labels=y) without)")
        return args, kwargs, target
    def _chunk(self, fibers: dict, act: str, i: int, c: int, run: Callable[[], Any]) -> tuple[bool, Any]:
        """Run action (act, i, c): the micro-batch's whole forward or backward, or, interleaved, chunk c of
        it (a fiber that stops at the next entry into this rank's stage). Returns (finished, result)."""
        if self.chunks == 1 or self.stage is None:  # a rank in no stage runs each forward and backward whole
            return True, run()
        f = fibers.get((act, i))
        if f is None:
            f = fibers[(act, i)] = Fiber(run, name=f"gt-pipeline-{act}{i}")
        f.resume()
        if f.done != (c == (self.chunks - 1 if act == "F" else 0)):
            raise RuntimeError(f"Pipeline: micro-batch {i}'s {'forward' if act == 'F' else 'backward'} "
                               f"{'ended' if f.done else 'went on'} after chunk {c} of {self.chunks} on rank "
                               f"{context.current().rank}: the model must enter each stage's chunks in the "
                               f"plan's order (pp_plan(virtual=))")
        return f.done, f.result


def _whole(actions: list, chunks: int) -> list:
    """A rank in no stage: the last stage's actions, each micro-batch's forward and backward once (where the
    first of its chunks comes), since no chunk of it is this rank's to stop at."""
    return [(act, i, c) for act, i, c in actions if c == (0 if act == "F" else chunks - 1)]


def _describe(act: str, i: int) -> str:
    return f"{'forward' if act == 'F' else 'backward'} of micro-batch {i}"


_DEFERRED = "the step's deferred reductions"
_CHANGED_HINT = ("the messages of this step differ from the two before it, whose inputs were the same. Pass "
                 "gt.Pipeline(post_receives=False) for a program whose stage boundaries depend on data")
_UNWATCHED = object()  # a forward early_exit does not watch (`Pipeline(leave_early=False)`)
_LEFT_HINT = ("(this step's ranks leave each micro-batch's forward where two steps before it showed nothing more of "
              "theirs; a program that adds a message of a rank's after that point waits on a rank that left: pass "
              "gt.Pipeline(leave_early=False) for it)")


def _post_ahead(comm: Any, actions: list, learnt: list, posted: int, upto: int, base: int, deferred: int) -> int:
    """Post the receives the actions from index `posted` to `upto` made in the learnt steps, under the tags
    those actions will use (index len(actions): the step's deferred reductions under tag `deferred`, after
    its actions: the tied weight's summed gradient); returns the new `posted`. Each is labelled with its
    own action, so one that never comes names what it was for."""
    tag, label = comm.p2p_tag, comm.p2p_label
    end = min(upto, len(learnt))
    try:
        for k in range(posted, end):
            if k < len(actions):
                act, i, _ = actions[k]
                comm.p2p_tag, comm.p2p_label = base + 2 * i + (act == "B"), _describe(act, i)
            else:
                comm.p2p_tag, comm.p2p_label = deferred, _DEFERRED
            for src, key, shape, dtype, device in learnt[k]:
                comm.post_receive(src, shape, dtype, key, device)
    finally:
        comm.p2p_tag, comm.p2p_label = tag, label
    return max(posted, end)


class _Loss(torch.nn.Module):
    """A micro-batch's loss, weighted by its share of the batch, as a module (a stage of its own)."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, out: Any, target: Any, weight: float) -> torch.Tensor:
        return self.loss_fn(out, target) * weight


class _OwnLoss(torch.nn.Module):
    """The model's own loss of a micro-batch, weighted by its share of the batch, as a module (a stage of its own)."""

    def forward(self, loss: Any, weight: float) -> torch.Tensor:
        return loss * weight


_NO_LOSS = ("give gt.Pipeline(loss_fn=) a function (output, target) -> scalar and pass the target, or return the "
            "loss from the model (a scalar, out.loss, out['loss'], or a tuple whose first item is a scalar)")


def _own_loss(out: Any) -> GlobalTensor:
    """The model's own loss in its output: the output itself if a scalar, its `loss` field or item, or the first item
    of a tuple where that is a scalar (Hugging Face's `return_dict=False`)."""
    if isinstance(out, torch.Tensor):
        loss, where = out, "the model's output"
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss, where = out.loss, "out.loss"
    elif isinstance(out, Mapping) and isinstance(out.get("loss"), torch.Tensor):
        loss, where = out["loss"], "out['loss']"
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() == 0:
        loss, where = out[0], "out[0]"
    else:
        raise ValueError(f"Pipeline(loss_fn=None): the model's output ({type(out).__name__}) holds no loss (did it "
                         f"get its labels?); {_NO_LOSS}")
    if loss.dim() != 0:
        raise ValueError(f"Pipeline(loss_fn=None): {where} has shape {list(loss.shape)}, not a scalar; reduce it to "
                         f"the batch's mean in the model, or {_NO_LOSS}")
    if not isinstance(loss, GlobalTensor):
        raise TypeError(f"Pipeline(loss_fn=None): {where} is a plain tensor, not computed from the model's "
                        f"inputs and parameters")
    return loss


def _arg_name(k: int) -> str:
    return "x" if k == 0 else f"args[{k}]"


def _kwarg_name(k: str) -> str:
    return f"{k}="


def _signature(v: Any) -> Any:
    """What of an input a step's learnt depends on: a tensor's shape and dtype (its values are the step's own), any
    other value as it is."""
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, tuple):
        return tuple(_signature(a) for a in v)
    return v


def _pieces(v: Any, m: int) -> Sequence:
    """An input's micro-batches: a tensor of at least one dim cut along dim 0, anything else each micro-batch's."""
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        return v.tensor_split(m)
    return [v] * m


def _batch_size(args: tuple, kwargs: dict) -> tuple[int, str]:
    """The batch's size, the dim 0 every tensor input of at least one dim shares, and the first input's name."""
    batch, named = None, ""
    for name, v in [(f"args[{k}]", a) for k, a in enumerate(args)] + [(f"{k}=", v) for k, v in kwargs.items()]:
        if not isinstance(v, torch.Tensor):
            if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(v)):
                raise TypeError(f"Pipeline.step({name}): tensors inside a {type(v).__name__} are not cut into "
                                f"micro-batches nor placed on a stage; pass each tensor as an argument of its own")
            continue
        if v.dim() == 0:
            continue
        if batch is None:
            batch, named = v.shape[0], name
        elif v.shape[0] != batch:
            raise ValueError(f"Pipeline.step({name}): its dim 0 is {v.shape[0]}, the batch's ({named}) {batch}; every "
                             f"tensor input is cut into micro-batches along dim 0, so all must share that size")
    if batch is None:
        raise ValueError("Pipeline.step: no tensor input of at least one dim to cut into micro-batches along dim 0")
    return batch, named


def _value(t: GlobalTensor) -> GlobalTensor:
    """t's value, out of autograd (`detach()` without a dispatch: the same shard, layout and key)."""
    return t.with_local(t._local.detach())


def _seed(loss: GlobalTensor) -> GlobalTensor:
    """The gradient a scalar loss's backward starts from, `backward()`'s ones, made on its shard (Broadcast
    where the loss is Partial: the gradient's layout) rather than by a dispatched `ones_like`."""
    lay = loss._layout
    if lay.has_partial:
        return GlobalTensor(torch.ones_like(loss._local), grad_layout(lay), tuple(loss.shape))
    return loss.with_local(torch.ones_like(loss._local))


def _summed(losses: list) -> GlobalTensor:
    """The micro-batches' losses added up: where they share a layout whose shards add up to the sum's (no
    Partial but sums), their shards are added; else through the dispatcher."""
    first = losses[0]
    if all(t._key is first._key for t in losses) and not any(
            isinstance(s, Partial) and s.op != "sum" for s in first._layout.sbp):
        total = first._local
        for t in losses[1:]:
            total = total + t._local
        return first.with_local(total)
    loss = first
    for t in losses[1:]:
        loss = loss + t
    return loss


def _virtual_stages(model: torch.nn.Module, stages: list[Placement]) -> int:
    """How many chunks each stage holds: the runs of one placement among the model's stage modules in
    the order it lists them (the order it calls them, for models written as a sequence of layers),
    which must go round the stages in order (chunk c on stage c mod p), the same number on each."""
    runs: list[Placement] = []
    for mod in model.modules():
        fwd = mod.__dict__.get("forward")
        if isinstance(fwd, StageForward) and (not runs or runs[-1] != fwd.placement):
            runs.append(fwd.placement)
    p = len(stages)
    if not runs or len(runs) % p or any(r != stages[c % p] for c, r in enumerate(runs)):
        if len(runs) <= p:
            return 1
        raise ValueError(f"Pipeline(model=): its stage modules visit the stages in the order "
                         f"{[stages.index(r) for r in runs]}; virtual stages must go round the stages in order "
                         f"(chunk c on stage c mod {p}), as pp_plan(virtual=) places them")
    return len(runs) // p


def _split(target: Any, m: int) -> Sequence:
    if isinstance(target, torch.Tensor):
        return target.tensor_split(m)
    raise TypeError(f"Pipeline.step(target=): expected a tensor, got {type(target).__name__}")


def _target_layout(t: torch.Tensor, o: GlobalTensor, sbp: Any) -> Layout:
    """Where a micro-batch's target goes: the output `o`'s placement (the last stage), as given, or as the
    output's SBP where it splits a dim the target has (the batch), else Broadcast."""
    p = o.placement
    if sbp is not None:
        return Layout(p, normalize_sbp(sbp, p.ndim, "Pipeline(target_sbp=)"))
    return Layout(p, tuple(s if isinstance(s, Split) and s.dim < t.dim() else Broadcast() for s in o.sbp))
