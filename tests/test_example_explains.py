"""examples/train_gpt.py explains itself: mesh axes, parameters per rank, where the bytes go, one-device check."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import globaltensor as gt

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_gpt_says_what_it_does(tmp_path):
    mod = _example()
    trace = str(tmp_path / "trace.json")
    lines = gt.launch(mod.main, 4, args=((2, 2), 2, "cpu", None, None, 0, True, True, "sim", trace))[0]
    text = "\n".join(lines)
    assert "axis 0 (size 2): data parallel, DP=2" in text and "axis 1 (size 2): tensor parallel, TP=2" in text
    assert "28032 parameters, 14496 on rank 0" in text
    assert text.count("tokens/s  received 140676 B") == 2
    assert "where the bytes of the last step go (rank 0): forward 41476 B, backward 41216 B, optimizer step 57984 B" \
        in text
    assert "    blocks.1.mlp.proj: 1 x, 8192 B" in text          # --report: the tree
    assert "matches one device" in lines[-1]
    assert Path(trace).exists()
