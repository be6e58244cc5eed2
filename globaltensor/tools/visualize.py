"""`gt.visualize(x)`: a picture of which ranks hold which block of a 1-D or 2-D global tensor.

The layout arithmetic is the same on every rank (placement, nd-SBP and global shape are known
everywhere), so drawing needs no communication and works on the simulator and on real ranks
alike; only rank 0 prints. Like JAX's `visualize_array_sharding` and DTensor's
`visualize_sharding`, each block of the tensor is a cell naming its ranks; in addition, uneven
splits show their index ranges, ranks holding empty shards are listed, and Partial values show
which ranks' shards add up ("0+1": the sum of rank 0's and rank 1's shards; "0,1": copies).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..layout import Layout
from ..runtime import context
from ..sbp import Partial, Split
from ..tensor import GlobalTensor


def _cells(layout: Layout, shape: tuple) -> tuple[list, list, dict, list]:
    """Atomic intervals per drawn dim, {cell index: label} and the ranks whose shard is empty."""
    dims = list(shape) if shape else [1]
    boxes = {}
    for r in layout.placement.flat_ranks:
        box = layout.shard(shape, r) if shape else ()
        boxes[r] = tuple(box) if shape else ((0, 1),)
    cuts = []
    for d, n in enumerate(dims):
        points = {0, n}
        for box in boxes.values():
            points |= {box[d][0], box[d][0] + box[d][1]}
        pts = sorted(points)
        cuts.append([(a, b) for a, b in zip(pts, pts[1:])])
    partial_axes = layout.partial_axes
    empty = [r for r, box in boxes.items() if any(size == 0 for _, size in box)]
    labels = {}
    grid = [cuts[0], cuts[1]] if len(dims) == 2 else [[(0, 1)], cuts[0]]
    for i, (r0, r1) in enumerate(grid[0]):
        for j, (c0, c1) in enumerate(grid[1]):
            cell = ((r0, r1), (c0, c1)) if len(dims) == 2 else ((c0, c1),)
            terms: dict[tuple, list] = {}
            for r, box in boxes.items():
                if r in empty:
                    continue
                if all(s <= lo and hi <= s + size for (lo, hi), (s, size) in zip(cell, box)):
                    coord = layout.placement.coord(r)
                    terms.setdefault(tuple(coord[a] for a in partial_axes), []).append(r)
            if not partial_axes or len(terms) <= 1:
                label = ",".join(str(r) for t in terms.values() for r in sorted(t))
            else:
                label = "+".join(",".join(map(str, sorted(t))) if len(t) == 1 else
                                 "(" + ",".join(map(str, sorted(t))) + ")" for _, t in sorted(terms.items()))
            labels[(i, j)] = label
    return grid[0], grid[1], labels, empty


def layout_grid(layout: Layout, shape: Sequence[int], name: Optional[str] = None) -> str:
    """The text picture of `layout` for a tensor of global `shape` (1-D or 2-D); no tensor needed."""
    shape = tuple(int(s) for s in shape)
    if len(shape) > 2:
        raise ValueError(f"visualize: draws 1-D and 2-D tensors, got shape {shape}; view it as 2-D first "
                         f"(x.reshape({shape[0]}, -1)) or pick a slice")
    rows, cols, labels, empty = _cells(layout, shape)
    sbp = layout.sbp
    sbp_text = str(sbp[0]) if len(sbp) == 1 else "(" + ", ".join(map(str, sbp)) + ")"
    out = [f"{name + ' ' if name else ''}{shape} as {sbp_text} on mesh {layout.placement.ranks}"]
    rng = (lambda a, b: f"{a}:{b}")
    row_names = [rng(a, b) for a, b in rows] if len(shape) == 2 else [""]
    col_names = [rng(a, b) for a, b in cols] if shape else [""]
    widths = [max(len(col_names[j]), *(len(labels[(i, j)]) for i in range(len(rows)))) + 2 for j in range(len(cols))]
    lead = max(len(n) for n in row_names)
    pad = " " * (lead + 1)
    if shape:
        out.append((pad + " " + " ".join(n.center(w) for n, w in zip(col_names, widths))).rstrip())

    def rule(left: str, mid: str, right: str) -> str:
        return pad + left + mid.join("─" * w for w in widths) + right
    out.append(rule("┌", "┬", "┐"))
    for i, rn in enumerate(row_names):
        out.append(rn.rjust(lead) + " │" + "│".join(labels[(i, j)].center(w) for j, w in enumerate(widths)) + "│")
        out.append(rule("├", "┼", "┤") if i + 1 < len(row_names) else rule("└", "┴", "┘"))
    for a, s in enumerate(sbp):
        if isinstance(s, Split) and s.dim < len(shape):
            sizes = sorted({layout.local_shape(shape, r)[s.dim] for r in layout.placement.flat_ranks})
            if len(sizes) > 1:
                what = "rows" if len(shape) == 2 and s.dim == 0 else "columns" if len(shape) == 2 else "elements"
                out.append(f"mesh axis {a} splits dim {s.dim} unevenly: shards of {' or '.join(map(str, sizes))} {what}")
    partials = sorted({str(s) for s in sbp if isinstance(s, Partial)})
    if partials:
        out.append(f"{', '.join(partials)}: a+b is the {'/'.join(p[2:-1] if '(' in p else 'sum' for p in partials)} "
                   "of those ranks' shards; a,b are copies")
    if empty:
        out.append(f"ranks {','.join(map(str, empty))} hold empty shards")
    return "\n".join(out)


def visualize(x: Any, name: Optional[str] = None, image: Optional[str] = None, all_ranks: bool = False) -> str:
    """Print (on rank 0, or on every rank with `all_ranks=True`) and return which ranks hold which block
    of GlobalTensor `x`; `image="file.png"` also draws it with matplotlib, where installed."""
    if isinstance(x, GlobalTensor):
        layout, shape = x._layout, tuple(x.shape)
    elif isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Layout):
        layout, shape = x[0], tuple(x[1])
    elif isinstance(x, torch.Tensor):
        raise TypeError("visualize: a plain tensor lives whole on one device; make it global first "
                        "(gt.to_global(t, placement, sbp))")
    else:
        raise TypeError(f"visualize: expected a GlobalTensor (or (Layout, shape)), got {type(x).__name__}")
    text = layout_grid(layout, shape, name)
    if all_ranks or context.rank() == 0:
        print(text)
        if image is not None:
            _draw(layout, shape, image, name)
    return text


def _draw(layout: Layout, shape: tuple, path: str, name: Optional[str]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional dependency
        raise ImportError("visualize(image=...): needs matplotlib (pip install matplotlib); the text grid "
                          "works without it") from None
    rows, cols, labels, _ = _cells(layout, shape)
    height = rows[-1][1] if len(shape) == 2 else 1
    width = cols[-1][1] if shape else 1
    fig, ax = plt.subplots(figsize=(min(12, 2 + width / max(width, height) * 6),
                                    min(12, 1 + height / max(width, height) * 6)))
    cmap = plt.get_cmap("tab20")
    colors: dict = {}
    for (i, j), label in labels.items():
        r0, r1 = rows[i]
        c0, c1 = cols[j]
        color = colors.setdefault(label, cmap(len(colors) % 20))
        ax.add_patch(plt.Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=color, edgecolor="black"))
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center")
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_title(layout_grid(layout, shape, name).splitlines()[0], fontsize=9)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)

