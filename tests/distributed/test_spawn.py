"""Tensor-parallel workers start as their own processes (``python -m
pagedkv.distributed.worker``), so a driver started from ``python -c``, from standard input, or
as a script without a ``__main__`` guard works (multiprocessing's spawn re-imports the driver's
main module; the workers must not die at start-up)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

DRIVER = """
from pagedkv import LLM, SamplingParams
llm = LLM(tensor_parallel_size=3, block_size=16, num_blocks=64, weights="fp32")
out = llm.generate([[504, 3575, 282, 4649, 314]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
print("TOKENS", out[0].outputs[0].token_ids)
llm.close()
"""


def _expected() -> list[int]:
    from pagedkv import LLM, SamplingParams

    with LLM(block_size=16, num_blocks=64, weights="fp32") as llm:
        out = llm.generate([[504, 3575, 282, 4649, 314]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
    return out[0].outputs[0].token_ids


def _run(args: list[str], stdin: str | None = None) -> list[int]:
    env = dict(os.environ, PAGEDKV_TP_THREADS="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("TOKENS"))
    return [int(t) for t in line.split("[", 1)[1].rstrip("]").split(",")]


@pytest.fixture(scope="module")
def expected(bundled_gguf) -> list[int]:
    return _expected()


def test_driver_from_python_c(expected):
    assert _run(["-c", DRIVER]) == expected


def test_driver_from_stdin_and_unguarded_script(expected, tmp_path):
    assert _run(["-"], stdin=DRIVER) == expected
    script = tmp_path / "unguarded.py"
    script.write_text(DRIVER)
    assert _run([str(script)]) == expected
