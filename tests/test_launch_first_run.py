"""Issue 17 item 4: the first run under gloo. A script without the `if __name__ == "__main__":` guard is
named as the cause; a lambda or closure is explained before any process starts; a simulated program
run under torchrun warns that it runs world x world ranks."""
import functools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import globaltensor as gt


def _total(n):
    return gt.to_global(torch.arange(float(n)), gt.placement("cpu", [0, 1]), gt.split(0)).full_tensor().sum().item()


FIRST = textwrap.dedent("""
    import torch, globaltensor as gt

    def program():
        x = gt.to_global(torch.arange(4.0), gt.placement("cpu", [0, 1]), gt.split(0))
        return x.full_tensor().sum().item()

    {call}
""")


def _run_script(tmp_path, call):
    script = tmp_path / "first.py"
    script.write_text(FIRST.format(call=call))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - t0, str(script)


@pytest.mark.gloo
def test_a_script_without_the_main_guard_is_told_why(tmp_path):
    r, took, script = _run_script(tmp_path, 'print(gt.launch(program, world_size=2, backend="gloo"))')
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()
    tail = "\n".join(last[-3:])
    assert "before running program" in tail and script in tail and 'if __name__ == "__main__":' in tail, tail
    assert "its traceback:" not in tail  # nothing empty promised
    assert took < 60


@pytest.mark.gloo
def test_the_same_script_with_the_guard_runs(tmp_path):
    r, _, _ = _run_script(tmp_path, 'if __name__ == "__main__":\n    print(gt.launch(program, 2, backend="gloo"))')
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[6.0, 6.0]"


@pytest.mark.parametrize("fn", [lambda: 0, functools.partial(lambda n: n, 1)])
def test_a_lambda_or_closure_is_explained_before_spawning(fn):
    t0 = time.monotonic()
    with pytest.raises(TypeError, match=r"launch\(fn\).*(?s:.*)top level of a module.*args="):
        gt.launch(fn, 2, backend="gloo")
    assert time.monotonic() - t0 < 5  # no process was started


def test_a_closure_over_local_data():
    data = torch.ones(3)

    def program():
        return data.sum()
    with pytest.raises(TypeError, match="test_a_closure_over_local_data.<locals>.program"):
        gt.launch(program, 2, backend="gloo")
    assert gt.launch(program, 2) == [3.0, 3.0]  # the simulator runs any callable


def test_a_program_read_from_stdin_is_told_to_use_a_file():
    code = ("import torch, globaltensor as gt\nfrom test_launch_first_run import _total\n"
            "gt.launch(_total, 2, backend='gloo', args=(4,))\n")
    r = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=120,
                       cwd=str(Path(__file__).parent))
    assert r.returncode != 0 and "'<stdin>', not a file" in r.stderr, r.stderr


def test_unpicklable_args_are_named():
    with pytest.raises(TypeError, match=r"launch\(args\)"):
        gt.launch(_total, 2, backend="gloo", args=(lambda: 4,))


def test_a_simulated_program_under_torchrun_warns(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.warns(UserWarning, match=r"under torchrun.*4 x 2 ranks") as w:
        assert gt.launch(_total, 2, args=(4,)) == [6.0, 6.0]
    assert w[0].filename == __file__
