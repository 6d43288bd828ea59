"""Several nodes for real: one stage on both nodes of the test cluster, 2 tasks each; and the
same stage with the two processes of each node sharing every sequence (sequence_parallel: 2).

The two "nodes" share this machine's network stack, so a wrong master address
could still connect: the test checks the address itself, against the job's
first node as Slurm names it.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import read_result, run_cli, write_pipeline
from tests.sharing_support import disagreements, needs_the_stack
from tests.slurm_support import (
    job_ids,
    scontrol_job,
    sft_stage,
    slurm_cluster,  # noqa: F401 -- fixture
    slurm_pipeline,
    wait_until_settled,
)

pytestmark = pytest.mark.slow

LAYOUT = re.compile(
    r"stage sft \(sft\): rank (\d+) of (\d+) on (\S+) \(local rank (\d+) of (\d+)\) via (\w+), master ([^:\s]+):(\d+)"
)


@pytest.fixture(scope="module")
def two_node_stage(slurm_cluster, tmp_path_factory):  # noqa: F811 -- the imported slurm_cluster fixture
    if len(slurm_cluster["nodes"]) < 2:
        pytest.fail(f"the test cluster has one node ({slurm_cluster['nodes']}); bring it up with --nodes 2")
    workdir = tmp_path_factory.mktemp("two-nodes")
    stages = [sft_stage("sft", 20, nodes=2, global_batch_size=32),
              sft_stage("shared", 20, nodes=2, global_batch_size=32, sequence_parallel=2)]
    config = write_pipeline(workdir, slurm_pipeline(stages=stages))
    run = run_cli("run", config, cwd=workdir, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    settled = wait_until_settled(workdir, config)
    job = job_ids(workdir)["sft"]
    logs = workdir / "runs" / "t" / "sft" / "logs"
    layouts = {}
    for task in range(4):
        match = LAYOUT.search((logs / f"{job}_{task}_log.out").read_text())
        assert match, f"task {task} logged no layout line"
        rank, world, host, local, local_world, source, master, port = match.groups()
        layouts[int(rank)] = dict(world=int(world), host=host, local=int(local), local_world=int(local_world),
                                  source=source, master=master, port=int(port))
    node_list = scontrol_job(job)["NodeList"]
    hosts = subprocess.run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True,
                           check=True).stdout.split()
    return dict(workdir=workdir, settled=settled, layouts=layouts, hosts=hosts)


def test_four_ranks_spread_over_both_nodes(two_node_stage):
    layouts, hosts = two_node_stage["layouts"], two_node_stage["hosts"]
    assert len(hosts) == 2
    assert sorted(layouts) == [0, 1, 2, 3]
    assert {r: (lay["host"], lay["local"]) for r, lay in layouts.items()} == {
        0: (hosts[0], 0), 1: (hosts[0], 1), 2: (hosts[1], 0), 3: (hosts[1], 1)
    }
    assert all(lay["world"] == 4 and lay["local_world"] == 2 and lay["source"] == "submitit"
               for lay in layouts.values())


def test_every_rank_meets_at_the_first_node_of_the_job(two_node_stage):
    layouts, hosts = two_node_stage["layouts"], two_node_stage["hosts"]
    assert {(lay["master"], lay["port"]) for lay in layouts.values()} == {(hosts[0], layouts[0]["port"])}


def test_the_two_node_stage_trains(two_node_stage):
    assert two_node_stage["settled"]["sft"]["state"] == "finished"
    result = read_result(two_node_stage["workdir"] / "runs" / "t" / "sft")
    assert result["world_size"] == 4
    assert result["final_eval_loss"] < result["initial_eval_loss"]


@needs_the_stack
def test_the_processes_of_each_node_share_its_sequences_and_learn_what_four_apart_learn(two_node_stage):
    """sequence_parallel 2 on 2 nodes x 2 tasks: each node's pair shares every sequence, the rows
    split over the 2 pairs; its losses and gradient norms are the plain 4-process stage's."""
    runs = two_node_stage["workdir"] / "runs" / "t"
    assert two_node_stage["settled"]["shared"]["state"] == "finished"
    job = job_ids(two_node_stage["workdir"])["shared"]
    logs = [(runs / "shared" / "logs" / f"{job}_{task}_log.out").read_text() for task in range(4)]
    assert "sequence_parallel 2: ranks 0-1 share each sequence" in logs[0], logs[0][-2000:]
    assert "split over 2 data-parallel groups" in logs[0]
    hosts = [re.search(r"stage shared \(sft\): rank \d+ of 4 on (\S+)", log).group(1) for log in logs]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # a pair never spans the nodes
    assert disagreements(runs / "sft", runs / "shared") == []
