"""ZeRO-3's gathers return the values that were set, on gloo, on the stack under test.

DeepSpeed 0.13.2 (the pinned stack) launches one asynchronous all-gather per parameter in a
blocking gather of several and waits for the last only, trusting the device's synchronize() for
the rest: right with NCCL on CUDA, wrong on gloo, where the CPU's synchronize() does nothing. The
persistent parameters (norm weights) are gathered that way after every optimizer step, so a
ZeRO-3 run on CPU now and then trained on garbage and went nan (the pinned CI run of stop 32).
tests/pinned_shims waits for every one (shim e); the current stack's DeepSpeed does it itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import deepspeed
import pytest

from stages.distributed import free_port

SCRIPT = Path(__file__).with_name("zero3_gathers.py")
PINNED = deepspeed.__version__.startswith("0.13.")


def wrong_gathers(trials: int, **env) -> int:
    result = subprocess.run([sys.executable, str(SCRIPT), str(trials), str(free_port())], capture_output=True,
                            text=True, timeout=300, env={**os.environ, **env})
    found = re.search(r"wrong gathers: (\d+) of", result.stdout)
    assert result.returncode == 0 and found, result.stdout[-2000:] + result.stderr[-3000:]
    return int(found.group(1))


def test_every_zero3_gather_of_several_parameters_returns_what_was_set():
    assert wrong_gathers(50) == 0


@pytest.mark.skipif(not PINNED, reason="DeepSpeed 0.13.2's gather, which the pinned stack's shim fixes")
def test_without_the_shim_deepspeed_0_13_returns_gathers_before_they_arrive():
    # The check above can fail: with shim e left out, most gathers of the large parameter are wrong.
    assert wrong_gathers(50, PINNED_SHIMS_SKIP="gather_waits") > 10
