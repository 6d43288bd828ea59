"""`prepare`: hub models and datasets are fetched on the submit host, because compute
nodes often have no internet (their jobs run with HF_HUB_OFFLINE=1).

Nothing here reaches the hub: downloads are either recorded stand-ins or refused
by HF_HUB_OFFLINE=1, the way an unreachable hub refuses them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core import config as config_module
from pipeline import prepare
from pipeline.hfcache import hf_cache
from tests.conftest import run_cli, tiny_pipeline, write_pipeline


def hub_pipeline(**cluster):
    spec = tiny_pipeline(cluster={"executor": "slurm", **cluster})
    spec["stages"][0]["model"] = "some-org/some-model"
    spec["stages"][0]["data"] = {"path": "some-org/some-rows", "split": "train", "eval_split": "test"}
    return spec


def test_a_pipeline_of_local_and_built_in_inputs_has_nothing_to_fetch(workdir):
    result = run_cli("prepare", write_pipeline(workdir, tiny_pipeline()), cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "nothing to fetch" in result.stdout


def test_hub_models_and_datasets_are_fetched_into_the_configured_cache(workdir, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(workdir / "elsewhere"))  # the pipeline's hf_home wins
    fetched = []
    monkeypatch.setattr(prepare, "download_model", lambda name, home: fetched.append(("model", name, home)))
    monkeypatch.setattr(prepare, "download_dataset",
                        lambda name, splits, home: fetched.append(("dataset", name, splits, home)))
    spec = config_module.load_pipeline(str(write_pipeline(workdir, hub_pipeline(hf_home="cache"))))
    prepare.fetch(spec, hf_cache(spec), echo=lambda line: None)
    cache = workdir / "cache"
    assert fetched == [
        ("model", "some-org/some-model", cache / "hub"),
        ("dataset", "some-org/some-rows", ("train", "test"), cache / "datasets"),
    ]
    assert os.environ["HF_HOME"] == str(cache)


def test_a_hub_id_that_cannot_be_fetched_exits_2_naming_the_field(workdir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_cli("prepare", write_pipeline(workdir, hub_pipeline(hf_home="cache")), cwd=workdir)
    assert result.returncode == 2
    assert "stages[0] (sft).model: cannot fetch model 'some-org/some-model'" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_on_slurm_prepares_before_it_submits(workdir, monkeypatch):
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).write_text(f'#!/bin/sh\ntouch "{workdir}/{tool}-called"\nexit 1\n')
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_cli("run", write_pipeline(workdir, hub_pipeline(hf_home="cache")), cwd=workdir)
    assert result.returncode == 2
    assert "cannot fetch model 'some-org/some-model'" in result.stderr
    assert not (workdir / "sbatch-called").exists()
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("name,is_hub", [("builtin:digits", False), ("org/rows", True), ("rows.jsonl", False)])
def test_what_counts_as_a_hub_dataset(workdir, name, is_hub):
    (workdir / "rows.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    spec = tiny_pipeline()
    spec["stages"][0]["data"] = {"path": name}
    parsed = config_module.PipelineSpec.model_validate(spec)
    assert [i.name for i in prepare.hub_inputs(parsed)] == ([name] if is_hub else [])


def test_one_cache_for_everyone_the_pipeline_s_hf_home_first_then_the_environment(workdir):
    environ = {"HF_HOME": "/env/home", "HF_HUB_CACHE": "/env/hub"}
    spec = config_module.PipelineSpec.model_validate(tiny_pipeline(cluster={"hf_home": "/shared/cache"}))
    configured = hf_cache(spec, environ)
    assert (configured.hub, configured.datasets) == (Path("/shared/cache/hub"), Path("/shared/cache/datasets"))
    from_env = hf_cache(config_module.PipelineSpec.model_validate(tiny_pipeline()), environ)
    assert (from_env.home, from_env.hub, from_env.datasets) == (Path("/env/home"), Path("/env/hub"),
                                                                Path("/env/home/datasets"))
    assert from_env.env()["HF_HUB_CACHE"] == "/env/hub"
