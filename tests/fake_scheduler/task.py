"""One task of a fake job: `python -m tests.fake_scheduler.task JOB_FILE` runs the pickled job.

At the requeue signal rank 0 tells the job it is requeued and exits with REQUEUE_EXIT_CODE (the
executor starts every task again); the other ranks only note it, as submitit's do."""

from __future__ import annotations

import pickle
import signal
import sys

from tests.fake_scheduler.node import REQUEUE_EXIT_CODE, FakeTask


def main(job_file: str) -> int:
    with open(job_file, "rb") as f:
        job = pickle.load(f)
    task = FakeTask()

    def requeue(signum, frame):
        print(f"fake scheduler: {signal.Signals(signum).name} on rank {task.rank()}", file=sys.stderr, flush=True)
        if task.rank() == 0:
            job.requeueing(signal.Signals(signum).name)
            sys.exit(REQUEUE_EXIT_CODE)

    signal.signal(FakeTask.requeue_signal, requeue)
    job()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
