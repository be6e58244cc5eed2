"""GlobalTensor: a torch.Tensor whose shape is global and whose data is this rank's shard."""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from .layout import Layout, normalize_sbp, slice_box, take_ranges
from .placement import Placement, load_placement
from . import boxing
from . import chunks as _chunks
from .ops import dispatch as _ops_dispatch
from .ops import strided_split as _ops_strided
from .ops import zigzag as _ops_zigzag
from .ops.pointwise import register_compile_only
from .ops.keys import geometry_of
from .ops.step_plan import ACTIVE as _STEP, note_conversion
from .runtime import context, graph_ops
from .runtime.symmetry import CHECKING as _SYMMETRY
from .ops.program import TRACED_INPUT
from .sbp import Broadcast, Partial, SbpLike, Split, Strided, Zigzag

_run, _tensor_key = _ops_dispatch.run, _ops_dispatch.tensor_key
_CAT = torch.ops.aten.cat.default
_TENSOR_DATA = torch.Tensor.data  # torch's descriptor, which GlobalTensor.data wraps


class _DryRun:
    on = False  # inside `dry_run_devices()`


_DRY_RUN = _DryRun()


@contextlib.contextmanager
def dry_run_devices() -> Iterator[None]:
    """While open, a meta shard's wrapper reports its placement's device type (`gt.explain`'s dry runs).

    Torch picks some decompositions by the device it sees (scaled_dot_product_attention takes CPU's
    flash kernel on cpu, the math path on meta), so the wrapper must look like the real run's for the
    dispatcher to see the same ops; the shard stays meta. Process-wide: the caller runs one dry run at a time.
    """
    _DRY_RUN.on = True
    try:
        yield
    finally:
        _DRY_RUN.on = False


def _wrap(cls: type, local: torch.Tensor, layout: Layout, shape: tuple, key: Any,
          requires_grad: bool = False) -> "GlobalTensor":
    """The wrapper: the global sizes, and the strides and storage offset one device's tensor would have
    (`key.geometry`: an op's output strides follow its inputs', and as_strided reads them), contiguous where
    the key holds none."""
    if _SYMMETRY.classes is not None:  # a symmetric dry run: is this rank's shard every rank's? (runtime/symmetry.py)
        _SYMMETRY.classes.check(layout, shape)
    device = layout.placement.device_type if _DRY_RUN.on and local.is_meta else local.device
    geometry = key.geometry
    if geometry is None:
        r = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=local.dtype, device=device,
                                                requires_grad=requires_grad)
    else:
        r = torch.Tensor._make_wrapper_subclass(cls, shape, strides=geometry[0], storage_offset=geometry[1],
                                                dtype=local.dtype, device=device, requires_grad=requires_grad)
    r._local = local
    r._layout = layout
    r._key = key
    return r


class GlobalTensor(torch.Tensor):
    """Holds `_local` (this rank's shard) and `_layout`; ranks outside the placement hold an empty tensor."""

    _local: torch.Tensor
    _layout: Layout
    _key: Any  # the dispatcher's interned (layout, shape, dtype); set wherever _layout is
    __slots__ = ["_local", "_layout", "_key"]

    _KINDS: dict = {}  # kind of layout -> the subclass that holds it (`__init_subclass__`)

    def __init_subclass__(cls, kind: str | None = None, **kwargs: Any) -> None:
        """A subclass holding a kind of layout the core does not (`class RaggedTensor(GlobalTensor, kind="ragged")`)
        is found by that kind (`of_kind`): the ops, a floor below it, build its tensors through the class they are
        handed, as torch hands `__torch_dispatch__` its class, never by importing upward."""
        super().__init_subclass__(**kwargs)
        if kind is not None:
            GlobalTensor._KINDS[kind] = cls

    @classmethod
    def of_kind(cls, kind: str) -> type:
        """The subclass that holds layouts of `kind` (e.g. "ragged")."""
        found = GlobalTensor._KINDS.get(kind)
        if found is None:
            raise LookupError(f"no GlobalTensor subclass holds {kind!r} layouts; `import globaltensor` defines them")
        return found

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, shape: Sequence[int],
                requires_grad: bool = False, geometry: tuple | None = None) -> "GlobalTensor":
        """`geometry`: the wrapper's (strides, storage offset) as `ops.keys.geometry_of` gives them, where the
        tensor stands for one device's that is not contiguous (None: contiguous at offset 0)."""
        shape = tuple(shape)
        if cls is GlobalTensor and (layout.zigzag_axes or layout.strided_axes):
            cls = _class_for(layout)
        return _wrap(cls, local, layout, shape, _tensor_key(layout, shape, local.dtype, geometry), requires_grad)

    @classmethod
    def _wrapper(cls, layout: Layout, shape: Sequence[int], dtype: torch.dtype,
                 geometry: tuple | None = None) -> Callable[[torch.Tensor], "GlobalTensor"]:
        """`lambda local: cls(local, layout, shape)` with the key looked up once (dispatch cache hits);
        `geometry`: the wrapper's (strides, storage offset) as the op's meta kernel gave them (None: contiguous)."""
        shape = tuple(shape)
        key = _tensor_key(layout, shape, dtype, geometry)
        # the decision's dtype comes from torch's meta kernels, which a real kernel may contradict
        return lambda local: _wrap(cls, local, layout, shape,
                                   key if local.dtype is dtype else _tensor_key(layout, shape, local.dtype, geometry))

    def with_local(self, local: torch.Tensor) -> "GlobalTensor":
        """This tensor's layout, shape and dtype holding another shard, out of autograd and without a dispatch
        (the dispatcher's key is shared): for runtimes that compute on shards themselves (a pipeline's loss
        sums and gradient seeds, a replayed step), where a dispatched op would cost more than the op."""
        return _wrap(type(self), local, self._layout, self._key.shape, self._key)

    def _set_layout(self, local: torch.Tensor, layout: Layout) -> None:
        """Replace shard and layout in place (same global shape and dtype)."""
        if _class_for(layout) is not type(self) and type(self) in (GlobalTensor, ZigzagTensor, StridedTensor):
            raise ValueError(f"a GlobalTensor laid out as {self._layout.sbp} cannot take the layout {layout.sbp} "
                             "in place (zigzag, strided and other layouts are different tensor classes); use "
                             "x.to_global(placement, sbp), which returns a new tensor")
        self._local = local
        self._layout = layout
        shape = tuple(self.shape)
        if _SYMMETRY.classes is not None:
            _SYMMETRY.classes.check(layout, shape)
        self._key = _tensor_key(layout, shape, self.dtype, geometry_of(shape, self.stride(), self.storage_offset()))

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Every aten op on GlobalTensors goes through the one dispatcher (rules in `globaltensor.ops`); a cat
        of like splits along their dim, and a view merging a split dim with the dims before it, are strided
        splits (`ops/strided_split.cat_of_splits`, `merged_view`), which the dispatcher's rules, reading one box
        per shard, have no word for."""
        if func is _CAT:
            out = _ops_strided.cat_of_splits(args, kwargs or {}, GlobalTensor)
            if out is not None:
                return out
        elif func in _ops_strided.VIEWS:
            out = _ops_strided.merged_view(func, args, kwargs or {}, GlobalTensor)
            if out is not None:
                return out
        return _run(func, args, kwargs, GlobalTensor)

    # -- torch.compile: a traceable wrapper subclass (as DTensor) -------------
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        """The shard is the one inner tensor; the layout, the global shape and geometry are constant metadata.

        Dynamo guards on the metadata (compared with `==`), so a compiled program is reused only for inputs
        laid out as the ones it was traced with; the rank is part of it (`_compile_rank`). A subclass that
        holds more than shard and layout (a RaggedTensor's sizes) cannot be rebuilt from these: it raises."""
        if type(self) not in (GlobalTensor, ZigzagTensor, StridedTensor):
            raise TypeError(f"torch.compile: a {type(self).__name__} holds more than its shard and layout (its "
                            "split sizes are data) and cannot be traced; run the part that uses it eagerly "
                            "(torch.compiler.disable)")
        register_compile_only()  # once: the rules of ops only dynamo emits
        return ["_local"], (self._layout, self._key.shape, self._key.geometry, _compile_rank())


    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> "GlobalTensor":
        layout, shape, geometry, _rank = meta
        local = inner["_local"]
        out = _wrap(_class_for(layout), local, layout, shape, _tensor_key(layout, shape, local.dtype, geometry))
        if graph_ops.traced(local):  # a traced program's input (or tangent): its layout is not the program's to change
            out.__dict__[TRACED_INPUT] = True
        return out

    def __coerce_tangent_metadata__(self) -> "GlobalTensor":
        """The layout AOTAutograd traces an output's gradient in: the dual of the output's (Partial's is
        Broadcast), as eager autograd hands it (`ones_like` of a Partial loss is Broadcast). Tracing the
        backward for a Partial gradient instead would coerce every Broadcast one to Partial at run time and
        all-reduce it again inside the graph."""
        want = grad_layout(self._layout)
        if want == self._layout:
            return self
        with torch.no_grad():
            return self.to_global(want.placement, want.sbp)

    def __coerce_same_metadata_as_tangent__(self, expected: tuple, expected_type: type | None = None
                                            ) -> "GlobalTensor | None":
        """A gradient flowing into a compiled backward, laid out as the one the graph was traced with.

        AOTAutograd traces the backward guessing that each output's gradient has the output's metadata; at
        run time it may not (the gradient of a Partial loss comes in Broadcast, `sum`'s backward is an
        expanded view): the value is boxed to the traced layout (Broadcast -> Partial and Broadcast -> Split
        move nothing) and made contiguous, as DTensor redistributes its tangents."""
        if expected_type is not None and expected_type is not type(self):
            return None
        layout, shape, geometry, rank = expected
        if shape != self._key.shape or rank != _compile_rank():
            return None
        x = self
        if x._layout != layout:
            with torch.no_grad():
                x = x.to_global(layout.placement, layout.sbp)
        if x._key.geometry != geometry:
            if geometry is not None:
                return None
            x = x.contiguous()
        return x

    # -- the layout ----------------------------------------------------------
    @property
    def global_layout(self) -> Layout:
        """Placement and nd-SBP together; `x.layout` stays torch's (`torch.strided`)."""
        return self._layout

    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> tuple:
        return self._layout.sbp

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"GlobalTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placement={self.placement}, "
                f"sbp={self.sbp}, local={self._local})")

    def __format__(self, format_spec: str) -> str:
        """A 0-d tensor formats as its value, as torch's does: `f"expert_{idx}"` gives "expert_3".

        Hugging Face models build dict keys this way (Switch Transformers' experts), so a 0-d
        GlobalTensor must not format as its repr. The value is `self.item()`: a collective (every rank
        of the placement calls it) unless the tensor is Broadcast on every mesh axis; a Partial one is
        reduced first, so each rank formats the global value. A meta shard (dry runs) has no value and,
        like an n-d tensor, falls to `object.__format__` (the repr for an empty spec, else TypeError).
        """
        if self.dim() == 0 and not self.is_meta and not self._local.is_meta:
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    # -- module dtype/device changes and host copies ---------------------------
    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`x.data = y` swaps shard, layout and metadata together.

        `nn.Module._apply` (`m.double()`, `m.half()`, `m.to(dtype)`, `m.to(device)`) assigns the converted
        tensor to `param.data`; torch's own setter would change only the wrapper's dtype and device and
        leave the shard as it was (a float64 parameter holding a float32 shard). The parameter object stays
        the same, so tied weights stay tied and optimizers keep their references.
        """
        if not isinstance(new, GlobalTensor):
            raise TypeError(f"GlobalTensor.data: assign a GlobalTensor (got {type(new).__name__}); lay a full "
                            "tensor out first with gt.to_global(t, x.placement, x.sbp)")
        _TENSOR_DATA.__set__(self, new)
        self._local, self._layout, self._key = new._local, new._layout, new._key

    def tolist(self) -> Any:
        """The global value as nested Python lists (a collective: every rank of the world calls it).

        torch refuses `tolist()` on tensor subclasses; a GlobalTensor's value is `full_tensor()`'s, so
        that is what is copied to the host (empty on a rank outside the placement).
        """
        return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        """The global value as a numpy array, via `full_tensor()` (a collective, as `tolist()`)."""
        return self.full_tensor().detach().numpy(force=force)

    # -- saving and copying --------------------------------------------------
    def __reduce_ex__(self, proto: int):
        """What torch.save (and pickle) write: this rank's shard and what makes it global again.

        That is the local shard, the layout, the global shape, requires_grad, the saving rank and
        the Python state (a parameter's mark); hooks are not saved, as torch never saves them. Each
        rank saves its own file and loads it back on the same world (`_rebuild_from_shard`).
        """
        self._clear_non_serializable_cached_data()
        return (_rebuild_from_shard, (self._local.detach(), self._layout, tuple(self.shape), self.requires_grad,
                                      context.current().rank, dict(self.__dict__), self._key.geometry))

    def __deepcopy__(self, memo: dict) -> "GlobalTensor":
        """An independent copy: its own shard storage, the same layout, Python state and gradient.

        Shared objects stay shared through `memo` (tied weights of a deep-copied module stay
        tied), and post-accumulate-grad hooks come along (a converted module's parameters defer
        their gradients' reduction with one).
        """
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError("deepcopy: only a leaf GlobalTensor (a parameter, or one made by gt.to_global or "
                               "the factories) can be deep-copied, as with torch.Tensor; detach() it first")
        new = _wrap(type(self), copy.deepcopy(self._local, memo), self._layout, tuple(self.shape), self._key,
                    self.requires_grad)
        memo[id(self)] = new
        self._clear_non_serializable_cached_data()
        new.__dict__ = copy.deepcopy(self.__dict__, memo)
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for hook in (self._post_accumulate_grad_hooks or {}).values():
            new.register_post_accumulate_grad_hook(hook)
        return new

    # -- torch.distributed.checkpoint: DCP's _Checkpointable protocol, as DTensor's (see chunks.py) --
    def __create_write_items__(self, fqn: str, object: Any) -> list:
        """The chunk this rank writes: each element once, one replica per Broadcast axis."""
        return _chunks.write_items(fqn, self._local, self._layout, tuple(self.shape))

    def __create_chunk_list__(self) -> list:
        """The chunk this rank holds: a load reads only the saved chunks overlapping it (resharding)."""
        return _chunks.chunk_list(self._local, self._layout, tuple(self.shape))

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        """The local shard behind a chunk: written from on save, copied into in place on load."""
        return _chunks.tensor_shard(self._local, self._layout, tuple(self.shape), index)

    # -- conversions ---------------------------------------------------------
    def to_local(self) -> torch.Tensor:
        """This rank's shard (differentiable); empty on ranks outside the placement."""
        return _ToLocal.apply(self)

    def to_global(self, placement: Placement | None = None, sbp: SbpLike | None = None,
                  grad_sbp: SbpLike | None = None) -> "GlobalTensor":
        """Box into another layout (same or other placement); placement/sbp default to the current ones.

        `grad_sbp` (OneFlow's argument of that name) is the layout the gradient of `self` takes in
        the backward: the incoming gradient is boxed to it, on `self`'s placement, instead of to the
        dual of `self`'s layout (Partial's dual is Broadcast). Megatron's column-parallel input is
        `x.to_global(grad_sbp=x.sbp)` with `x` Broadcast: nothing moves forward, and the Partial
        input gradient is all-reduced backward. With a `grad_sbp` the result is always a new
        autograd node, even when the layout is unchanged.
        """
        if grad_sbp is None:
            try:
                target = _TARGETS.get((self._key, placement, sbp))
            except TypeError:  # an unhashable sbp (a list): resolved afresh
                target = None
            if target is None:
                target = _target(self, placement, sbp)
            if target.key is self._key:  # the same layout: nothing to do
                return self
            if self.requires_grad and torch.is_grad_enabled():
                return _Convert.apply(self, target, None)
            return _run_target(self, target)
        placement = self.placement if placement is None else placement
        dst = _resolve(self, placement, sbp)
        return convert(self, dst, gradient_layout(self, grad_sbp))

    def full_tensor(self) -> torch.Tensor:
        """The whole global value on every rank of the placement (Partial reduced); empty outside it."""
        return _FullTensor.apply(self)


class ZigzagTensor(GlobalTensor):
    """A GlobalTensor with a zigzag axis (`gt.zigzag(d)`): its ops go to `ops/zigzag.py` first.

    The dispatcher's rules read shards as boxes; a zigzag shard is two ranges of d, so its ops are
    run on the zigzag reading where that is exact (pointwise ops, attention's ring), and otherwise
    its inputs are boxed to `gt.split(d)` before the dispatcher sees them.
    """

    __slots__ = ()
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _ops_zigzag.run(func, args, kwargs or {}, GlobalTensor, ZigzagTensor)


class StridedTensor(GlobalTensor):
    """A GlobalTensor with a strided axis (`gt.strided(d, groups)`): its ops go to `ops/strided_split.py`
    first, which runs them on the strided reading where that is exact (pointwise ops, products with the
    strided dim kept, the views and slices that separate its groups) and otherwise boxes the tensor to
    `gt.split(d)` before the dispatcher sees it (its rules read a shard as one box)."""

    __slots__ = ()
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _ops_strided.run(func, args, kwargs or {}, GlobalTensor, StridedTensor)


def _compile_rank() -> int:
    """The rank a compiled program is traced for: its graph holds the rank's own slices and groups, so a simulated
    rank (a thread of the same process) must not reuse another rank's program."""
    return context.current().rank


def _class_for(layout: Layout) -> type:
    if layout.strided_axes:
        return StridedTensor
    return ZigzagTensor if layout.zigzag_axes else GlobalTensor


def _take(full: torch.Tensor, layout: Layout, shape: tuple, rank: int) -> torch.Tensor | None:
    """`rank`'s shard of `full` (a view where it is one box), or None outside the placement."""
    if layout.zigzag_axes or layout.strided_axes:
        ranges = layout.ranges(shape, rank)
        return None if ranges is None else take_ranges(full, ranges)
    box = layout.shard(shape, rank)
    return None if box is None else slice_box(full, box)


def _piece(layout: Layout, rank: int) -> tuple | None:
    """Which piece of the global value `rank` holds: its mesh coordinate on every axis that is not
    Broadcast (a Split's block, a Partial's term); None outside the placement."""
    coord = layout.placement.coord(rank)
    if coord is None:
        return None
    return tuple(None if isinstance(s, Broadcast) else c for s, c in zip(layout.sbp, coord))


def _rebuild_from_shard(local: torch.Tensor, layout: Layout, shape: tuple, requires_grad: bool, saved_by: int,
                        state: dict | None, geometry: tuple | None = None) -> GlobalTensor:
    """torch.load's way back to a GlobalTensor: the shard lands on the loading rank.

    The world must hold the placement and the loading rank must hold the piece the saving rank
    held (each rank loads its own file; any rank of a Broadcast axis will do).
    """
    rank = context.current().rank
    where = f"torch.load: a GlobalTensor {layout} of shape {tuple(shape)} saved by rank {saved_by}"
    try:
        layout.placement.check_world(context.current().world_size)
    except ValueError as e:
        raise ValueError(f"{where}: {e}; load it on the world that saved it") from None
    if _piece(layout, rank) != _piece(layout, saved_by):
        raise ValueError(f"{where} is loaded on rank {rank}, which holds another piece of it; let each rank "
                         f"load the file it saved")
    if tuple(local.shape) != layout.local_shape(shape, rank):
        raise ValueError(f"{where}: the saved shard has shape {tuple(local.shape)}, not the "
                         f"{layout.local_shape(shape, rank)} that rank {rank} holds")
    x = GlobalTensor(local, layout, shape, requires_grad=requires_grad, geometry=geometry)
    for name, value in (state or {}).items():  # a parameter's mark, user attributes
        setattr(x, name, value)
    return x


# torch.load(weights_only=True) may rebuild what a saved GlobalTensor names, with nothing for users to allow
torch.serialization.add_safe_globals([GlobalTensor, _rebuild_from_shard, Layout, Placement, load_placement, Split,
                                      Broadcast, Partial, ZigzagTensor, Zigzag, StridedTensor, Strided])


class _Target(NamedTuple):
    """Where a conversion of one input key goes: the layout, the (cached) route, the result's TensorKey."""

    layout: Layout
    route: Any
    key: Any


# (input TensorKey, placement, sbp as given) -> _Target: a training loop repeats the same conversions,
# and the arguments' checks, the route lookup and the result's key are worked out once
_TARGETS: dict[tuple, _Target] = {}
_TARGETS_MAX = 8192


def _resolve(x: GlobalTensor, placement: Any, sbp: Any) -> Layout:
    """`to_global`'s arguments checked and made a Layout valid for x's shape."""
    if not isinstance(placement, Placement):
        raise TypeError(f"to_global(placement): expected a gt.placement, got {type(placement).__name__}")
    if sbp is None:
        if placement.ndim != x.placement.ndim:
            raise ValueError("to_global(sbp): required when the placement's mesh has another number of axes")
        sbp = x.sbp
    dst = Layout(placement, normalize_sbp(sbp, placement.ndim))
    dst.check_shape(x.shape)
    _no_ragged(dst, "to_global(sbp)")
    return dst


def _no_ragged(layout: Layout, arg: str) -> None:
    """A ragged layout needs its sizes, which only `gt.to_global(..., sizes=)` and `gt.from_local` take."""
    if layout.ragged_axes:
        raise ValueError(f"{arg}: {layout.sbp} is ragged and needs its per-rank sizes: "
                         "gt.to_global(x, placement, sbp, sizes=[...]) or gt.from_local(local, placement, sbp, sizes=[...])")


def _target_of(x: GlobalTensor, dst: Layout) -> _Target:
    shape = tuple(x.shape)
    # the value is the same tensor's, so it keeps its strides (DTensor's redistribute keeps them too)
    return _Target(dst, boxing.route(x._layout, dst, shape, x.dtype), _tensor_key(dst, shape, x.dtype, x._key.geometry))


def _target(x: GlobalTensor, placement: Any, sbp: Any) -> _Target:
    """`to_global(placement, sbp)` resolved for x, remembered for x's key when the arguments hash."""
    target = _target_of(x, _resolve(x, x.placement if placement is None else placement, sbp))
    try:
        if len(_TARGETS) >= _TARGETS_MAX:
            _TARGETS.clear()
        _TARGETS[(x._key, placement, sbp)] = target
    except TypeError:
        pass
    return target


def _run_target(x: GlobalTensor, target: _Target) -> GlobalTensor:
    """x boxed to `target`: always a new tensor (autograd's output must not be its input's shard)."""
    if _STEP.plan is not None:
        note_conversion(x, target.layout)
    local = boxing.execute(target.route, x._local, context.current())
    if local is x._local:
        local = local.view_as(local)
    key = target.key
    return _wrap(_class_for(target.layout), local, target.layout, key.shape, key)


def convert(x: GlobalTensor, dst: Layout, grad_dst: Layout | None = None) -> GlobalTensor:
    """Boxing between layouts (differentiable; see `_Convert`); `grad_dst`: the layout of x's gradient.

    Without a gradient to record, the route runs directly: an autograd.Function call costs more than
    a conversion that moves nothing (a B->S slice).
    """
    target = _target_of(x, dst)
    if grad_dst is None and not (x.requires_grad and torch.is_grad_enabled()):
        return _run_target(x, target)
    return _Convert.apply(x, target, grad_dst)


def gradient_layout(x: GlobalTensor, grad_sbp: Any) -> Layout:
    """`grad_sbp` checked as a layout for the gradient of `x`: on x's placement, valid for its shape.

    A gradient is a sum of contributions, so Partial(max/min) is no layout for one.
    """
    sbp = normalize_sbp(grad_sbp, x.placement.ndim, "to_global(grad_sbp)")
    bad = [s for s in sbp if isinstance(s, Partial) and s.op != "sum"]
    if bad:
        raise ValueError(f"to_global(grad_sbp): {bad[0]!r} cannot lay out a gradient (gradients add up); "
                         "use gt.partial_sum, gt.broadcast or gt.split(d)")
    layout = Layout(x.placement, sbp)
    try:
        layout.check_shape(x.shape)
    except ValueError as e:
        raise ValueError(f"to_global(grad_sbp): {e}") from None
    return layout


def distribute(full: torch.Tensor, layout: Layout, requires_grad: bool = False) -> GlobalTensor:
    """`full` (the same on every rank) laid out as `layout`, with no communication: a leaf.

    This rank keeps a copy of its shard, never `full`'s storage (simulated ranks share the objects
    they are handed); a Partial(sum) axis puts the value on its first rank and zeros on the others,
    Partial(max/min) keeps it everywhere. A rank outside the placement keeps an empty shard.
    """
    _no_ragged(layout, "sbp")
    rank = context.current().rank
    t = full.detach().to(device_for(layout.placement))
    piece = _take(t, layout, tuple(full.shape), rank)
    if piece is None:
        local = t.new_empty((0,))
    else:
        local = piece.clone(memory_format=torch.contiguous_format)
        coord = layout.placement.coord(rank)
        if any(isinstance(s, Partial) and s.op == "sum" and coord[a] != 0 for a, s in enumerate(layout.sbp)):
            local = torch.zeros_like(local)
    return GlobalTensor(local, layout, tuple(full.shape), requires_grad=requires_grad)


def device_for(placement: Placement) -> torch.device:
    return context.current().device_for(placement.device_type)


def grad_layout(layout: Layout) -> Layout:
    """The layout a gradient takes when flowing back through `layout`: the dual of Partial is Broadcast."""
    if not layout.has_partial:
        return layout
    return Layout(layout.placement, tuple(Broadcast() if isinstance(s, Partial) else s for s in layout.sbp))


class OnBackward(torch.autograd.Function):
    """Identity whose backward calls `then()` before the gradient goes on: marks where a module's
    backward begins or ends (the named scope), or where a gradient crosses a stage boundary (a
    pipeline fiber's stops), placed where the forward passed that point."""

    @staticmethod
    def forward(ctx, x: GlobalTensor, then: Callable[[], None]) -> GlobalTensor:  # type: ignore[override]
        ctx.then = then
        if type(x) is not GlobalTensor:  # a ragged or zigzag tensor carries more than its layout: its own view
            return x.view_as(x)
        # the same shard, layout and key as `x.view_as(x)` would give, without its dispatch (~0.1 ms; a
        # pipeline marks every crossing of every micro-batch)
        return _wrap(GlobalTensor, x._local.view_as(x._local), x._layout, x._key.shape, x._key)

    @staticmethod
    def backward(ctx, grad: Any) -> Any:  # type: ignore[override]
        ctx.then()
        return grad, None



class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: GlobalTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout, ctx.shape = x._layout, tuple(x.shape)
        return x._local.view_as(x._local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return GlobalTensor(grad, grad_layout(ctx.layout), ctx.shape)


class FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> GlobalTensor:  # type: ignore[override]
        ctx.layout = grad_layout(layout)
        return GlobalTensor(local.view_as(local), layout, shape)

    @staticmethod
    def backward(ctx, grad: GlobalTensor):  # type: ignore[override]
        if grad._layout != ctx.layout:
            grad = grad.to_global(ctx.layout.placement, ctx.layout.sbp)
        return grad._local, None, None


class _FullTensor(torch.autograd.Function):
    """The result is a plain tensor, i.e. the same on every rank; its gradient is sliced, never summed."""

    @staticmethod
    def forward(ctx, x: GlobalTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout, ctx.shape = x._layout, tuple(x.shape)
        full = Layout(x.placement, (Broadcast(),) * x.placement.ndim)
        out = boxing.convert_local(x._local, x._layout, full, ctx.shape, context.current())
        # the shard itself (a Broadcast tensor's) is returned as a view: autograd makes a Function's output take
        # a gradient, which the shard must not (a parameter's `_local` requiring grad fails compiled guards)
        if out is not x._local:
            return out
        return out.view_as(out) if out.layout == torch.strided else out.detach()  # a sparse shard has no views

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        layout = grad_layout(ctx.layout)
        piece = _take(grad, layout, ctx.shape, context.current().rank)
        local = grad.new_zeros((0,)) if piece is None else piece.clone()
        return GlobalTensor(local, layout, ctx.shape)


class _Convert(torch.autograd.Function):
    """Forward runs the boxing route on the local shard; backward boxes the gradient the dual way.

    The gradient of a layout is laid out as `grad_layout` (Partial's dual is
    Broadcast), so S->B all-gather comes back as a B->S slice, P->S
    reduce-scatter as an S->B all-gather, B->P as nothing at all, and so on;
    unless the conversion was given its gradient's layout (`to_global(grad_sbp=)`).
    """

    @staticmethod
    def forward(ctx, x: GlobalTensor, target: _Target, grad_dst: Layout | None) -> GlobalTensor:  # type: ignore[override]
        ctx.want, ctx.shape = grad_layout(x._layout) if grad_dst is None else grad_dst, tuple(x.shape)
        return _run_target(x, target)

    @staticmethod
    def backward(ctx, grad: GlobalTensor):  # type: ignore[override]
        want = ctx.want
        if grad._layout != want:
            grad = grad.to_global(want.placement, want.sbp)
        return grad, None, None


def _register_for_foreach() -> None:
    """Let torch's optimizers and `clip_grad_norm_` take their foreach (multi-tensor) path for GlobalTensors.

    They choose it by exact type (`type(p) in _foreach_supported_types`) and device (CUDA and the like,
    not CPU). Without this, AdamW on GlobalTensor parameters on a GPU would fall back to one kernel per
    parameter and op; DTensor registers itself the same way. Our `_foreach_*` rules run each same-layout
    group of tensors as one foreach kernel on the shards (`ops/optimizer.py`).
    """
    from torch.optim import optimizer as _optim
    from torch.utils import _foreach_utils
    for registry in (_optim._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if GlobalTensor not in registry:
            registry.append(GlobalTensor)


_register_for_foreach()
