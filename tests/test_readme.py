"""The docs' samples are what their snippets print (issue 17 item 9; issue 33: README.md and docs/*.md
but design.md).

Every ```python block followed directly by a ```text block is run, each in a fresh namespace (every
snippet is self-contained, as a reader copies it), and must print exactly that text; the other Python
blocks must at least compile. Snippets run with `__name__ == "__readme__"`, so a gloo example's
`if __name__ == "__main__":` launch is not spawned there; the gloo-marked test runs those as scripts. `python tests/test_readme.py` rewrites
the text blocks from what the snippets print now.
"""
from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# design.md is the lead's contract, written in signatures rather than programs: not run
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def snippets(text: str) -> list[tuple[str, re.Match | None]]:
    """(python source, the match of its output block or None) for every python block, in order; the source
    starts on its line of the page, so a traceback names the page's line."""
    blocks = list(FENCE.finditer(text))
    out = []
    for i, b in enumerate(blocks):
        if b.group(1) != "python":
            continue
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        follows = nxt is not None and nxt.group(1) == "text" and not text[b.end():nxt.start()].strip()
        out.append(("\n" * text.count("\n", 0, b.start(2)) + b.group(2), nxt if follows else None))
    return out


def printed(source: str, page: Path) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(source, str(page), "exec"), {"__name__": "__readme__"})
    return buf.getvalue()


def test_the_pages_have_runnable_snippets():
    found = [o for page in PAGES for _, o in snippets(page.read_text())]
    assert sum(o is not None for o in found) >= 20, "the docs' runnable snippets went missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_samples_are_what_the_snippets_print(page: Path):
    for source, output in snippets(page.read_text()):
        if output is None:
            compile(source, str(page), "exec")
            continue
        got = printed(source, page)
        assert got == output.group(2), (f"{page.name}: a sample differs from what its snippet prints; run "
                                        f"`python tests/test_readme.py` to regenerate.\n--- page:\n"
                                        f"{output.group(2)}--- printed:\n{got}")


GLOO = [(page, source) for page in PAGES for source, _ in snippets(page.read_text()) if 'backend="gloo"' in source]


@pytest.mark.gloo
@pytest.mark.parametrize("page, source", GLOO, ids=[p.name for p, _ in GLOO])
def test_gloo_snippets_run_as_scripts(page: Path, source: str, tmp_path: Path):
    """The snippets that spawn processes run as a reader runs them: saved as a script, `python script.py`."""
    script = tmp_path / "snippet.py"
    script.write_text(source.lstrip("\n"))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page.name}:\n{done.stderr[-3000:]}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_reach_their_pages_and_headings():
    """A newcomer follows the contents table from page to page: every relative link must land."""
    broken = []
    for page in [*PAGES, ROOT / "docs" / "design.md"]:
        text = FENCE.sub("", page.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif frag and dest.suffix == ".md" and frag not in {
                    anchor(h) for h in re.findall(r"^#+ (.*)$", FENCE.sub("", dest.read_text()), re.M)}:
                broken.append(f"{page.name}: {target}")
    assert broken == []


def regenerate(page: Path) -> None:
    text = page.read_text()
    pieces, at = [], 0
    for source, output in snippets(text):
        if output is None:
            continue
        pieces += [text[at:output.start(2)], printed(source, page)]
        at = output.end(2)
    page.write_text("".join(pieces) + text[at:])


if __name__ == "__main__":
    for page in PAGES if len(sys.argv) < 2 else [Path(a).resolve() for a in sys.argv[1:]]:
        regenerate(page)
