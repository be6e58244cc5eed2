"""The README's samples are what its snippets print (issue 17 item 9).

Every ```python block of README.md followed directly by a ```text block is run (in order, in one
namespace, so a later snippet may use an earlier one's imports) and must print exactly that text;
the other Python blocks are fragments (a plan without its model) and must at least compile.
`python tests/test_readme.py` rewrites the text blocks from what the snippets print now.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
import warnings
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def snippets(text: str) -> list[tuple[str, re.Match | None]]:
    """(python source, the match of its output block or None) for every python block, in order."""
    blocks = list(FENCE.finditer(text))
    out = []
    for i, b in enumerate(blocks):
        if b.group(1) != "python":
            continue
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        follows = nxt is not None and nxt.group(1) == "text" and not text[b.end():nxt.start()].strip()
        out.append((b.group(2), nxt if follows else None))
    return out


def printed(source: str, namespace: dict) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(source, str(README), "exec"), namespace)
    return buf.getvalue()


def test_readme_samples_are_what_the_snippets_print():
    text = README.read_text()
    found = snippets(text)
    assert sum(o is not None for _, o in found) >= 2, "the README's runnable snippets went missing"
    namespace: dict = {"__name__": "__readme__"}
    for source, output in found:
        if output is None:
            compile(source, str(README), "exec")
            continue
        got = printed(source, namespace)
        assert got == output.group(2), (f"README sample differs from what its snippet prints; run "
                                        f"`python tests/test_readme.py` to regenerate.\n--- README:\n"
                                        f"{output.group(2)}--- printed:\n{got}")


def regenerate() -> None:
    text = README.read_text()
    namespace: dict = {"__name__": "__readme__"}
    pieces, at = [], 0
    for source, output in snippets(text):
        if output is None:
            continue
        pieces += [text[at:output.start(2)], printed(source, namespace)]
        at = output.end(2)
    README.write_text("".join(pieces) + text[at:])


if __name__ == "__main__":
    sys.path.insert(0, str(README.parent))
    regenerate()
