"""Build DeepSpeed's CPU ops once, in one process, before the test suite starts.

The tests start many 2-process DeepSpeed runs. On a fresh machine the first of
them JIT-compiles cpu_adam and the shared-memory comm op (about a minute each
on 2 cores) with one rank building and the other waiting on the build lock. In
CI that once hung inside a captured torchrun worker (rank 0 waiting on ninja
with no compiler running, rank 1 on the lock) until the test's 15-minute
timeout. Built here, single-process and up front, no test run compiles
anything. The ops land where the stages keep them (stages/deepspeed_ops.py), built with
the same ninja; the tests' processes get the same folder and ninja (tests/conftest.py).
"""

from __future__ import annotations

import time


def main() -> None:
    from stages import deepspeed_ops

    deepspeed_ops.prepare()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible():
            print(f"prebuild: {name} not available on this DeepSpeed/accelerator; skipped", flush=True)
            continue
        start = time.time()
        builder.load()
        print(f"prebuild: {name} ready ({time.time() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
