"""Checkpoints a stage can trust (core/checkpoints.py, stages/checkpoints.py).

Every save ends with a manifest (each file's size and checksum, and the step); a stage resumes
from the newest checkpoint whose files match it, sets aside (never deletes) the damaged ones and
says what that costs; with none intact it refuses (exit 2) rather than start over by itself.

The rules run here on a stand-in engine in one process. The end-to-end runs at the bottom do the
same to real two-process DeepSpeed stages under ZeRO-2 and ZeRO-3, through `python -m pipeline run`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from core import checkpoints as manifests
from core.errors import InvalidInput
from core.runfolder import DAMAGED, MANIFEST_FILE, StageFolder
from tests.conftest import read_metrics, run_cli, tiny_pipeline, write_pipeline
from tests.test_preemption import JsonEngine, one_process_group  # noqa: F401  (a fixture)


@pytest.fixture
def saved(one_process_group, tmp_path):  # noqa: F811
    """A stage folder with checkpoints at steps 10, 20 and 30, saved as a stage saves them."""
    from stages.checkpoints import Checkpoints

    folder = StageFolder(tmp_path / "sft")
    folder.path.mkdir()
    checkpoints = Checkpoints(folder, keep=3, is_main=True)
    for step in (10, 20, 30):
        checkpoints.save(JsonEngine(), step, {"step": step}, {"critic": JsonEngine()})
    return folder


def resume(folder: StageFolder) -> int | None:
    """The step a stage resumes from (a fresh Checkpoints, as a new job would make)."""
    from stages.checkpoints import Checkpoints

    state = Checkpoints(folder, keep=3, is_main=True).load(JsonEngine())
    return None if state is None else state["step"]


def set_aside(folder: StageFolder) -> list[str]:
    return sorted(p.name.split(DAMAGED)[0] for p in folder.checkpoints.glob(f"*{DAMAGED}*"))


# --------------------------------------------------------------------------- manifests


def test_a_manifest_lists_every_file_its_size_and_checksum_and_finds_each_kind_of_damage(tmp_path, monkeypatch):
    monkeypatch.setattr(manifests, "BLOCK_BYTES", 16)  # several blocks per file, shared out over "ranks"
    folder = tmp_path / "step-00000010"
    (folder / "critic").mkdir(parents=True)
    (folder / "optim.pt").write_bytes(bytes(range(100)))
    (folder / "critic" / "model.pt").write_bytes(b"critic")
    (folder / "empty").write_bytes(b"")
    (folder / "manifest.json.tmp").write_text("{}")  # a temporary is no part of it
    sizes = manifests.files(folder)
    assert sizes == {"critic/model.pt": 6, "empty": 0, "optim.pt": 100}
    every = manifests.blocks(sizes)
    assert len(every) == 1 + 1 + 7
    crcs = {}
    for rank in range(3):  # three processes, each its share; together every block once
        crcs.update(manifests.checksums(folder, manifests.share(every, rank, 3), threads=2))
    assert len(crcs) == len(every)
    content = json.loads(json.dumps(manifests.manifest(10, sizes, crcs)))
    assert content["step"] == 10 and len(content["files"]["optim.pt"]["crc32"]) == 7
    listed = content["files"]

    def problems():
        return manifests.content_problems(folder, listed, every, threads=2)

    assert problems() == {}
    data = bytearray(range(100))
    data[40] ^= 1
    (folder / "optim.pt").write_bytes(bytes(data))
    assert problems() == {"optim.pt": "optim.pt: bytes 32-48 differ from what was saved (checksum)"}
    (folder / "optim.pt").write_bytes(bytes(range(60)))
    assert problems() == {"optim.pt": "optim.pt is 60 bytes, its manifest says 100"}
    (folder / "critic" / "model.pt").unlink()
    assert problems()["critic/model.pt"] == "critic/model.pt is missing"


def test_a_manifest_that_is_cut_short_or_of_another_kind_is_not_trusted(tmp_path):
    path = tmp_path / MANIFEST_FILE
    assert manifests.read_manifest(path) is None
    path.write_text('{"step": 10, "files": {"a.pt": {"bytes": 3, "crc32"')
    assert manifests.read_manifest(path).startswith(f"{MANIFEST_FILE} cannot be read")
    path.write_text(json.dumps({"step": 10, "files": {"a.pt": {"bytes": 3, "sha256": "00"}}}))
    assert "not a manifest" in manifests.read_manifest(path)


# --------------------------------------------------------------------------- which checkpoint


def found(tags, latest, manifested=(), unmanifested=None) -> manifests.Found:
    return manifests.Found(latest, [f"step-{t:08d}" for t in tags],
                           {f"step-{t:08d}": {"files": {}} for t in manifested},
                           {f"step-{t:08d}": v for t, v in (unmanifested or {}).items()})


def damaged_at(*steps):
    """A check that finds the checkpoints at `steps` damaged."""
    return lambda tag, content: ["x.pt is 1 bytes, its manifest says 2"] if manifests.step_of(tag) in steps else []


def test_the_newest_intact_checkpoint_is_chosen_and_what_was_passed_over_is_said():
    verdict = manifests.judge(found([10, 20, 30], "step-00000040", manifested=[10, 20, 30]), damaged_at(30))
    assert verdict.tag == "step-00000020" and verdict.gone == "step-00000040"
    assert list(verdict.damaged) == ["step-00000030"] and verdict.lost_steps == 20
    assert verdict.status("sft") == (
        "newest intact checkpoint step-00000020: `run` resumes from it (`latest` names step-00000040, which is "
        "gone; step-00000030: x.pt is 1 bytes, its manifest says 2: 20 steps to train again)")


def test_only_a_save_that_did_not_finish_after_an_intact_latest_is_a_leftover():
    # Killed mid-save of 30 (no manifest yet); `latest` still names 20, which is intact.
    verdict = manifests.judge(found([10, 20, 30], "step-00000020", manifested=[10, 20]), damaged_at())
    assert (verdict.tag, verdict.unfinished, verdict.latest_intact) == ("step-00000020", ["step-00000030"], True)
    assert verdict.damaged == {} and verdict.lost_steps == 0
    # Killed after 30's manifest, before `latest` moved: 30 is complete, and resumed from.
    verdict = manifests.judge(found([10, 20, 30], "step-00000020", manifested=[10, 20, 30]), damaged_at())
    assert verdict.tag == "step-00000030" and verdict.unfinished == []
    # The same unfinished 30, but `latest` names a folder that is gone: nothing proves what 30 is; set aside.
    verdict = manifests.judge(found([10, 30], "step-00000020", manifested=[10]), damaged_at())
    assert verdict.tag == "step-00000010" and not verdict.latest_intact and "step-00000030" in verdict.damaged


def test_checkpoints_from_before_manifests_are_taken_up_to_latest_unless_their_torch_files_are_cut_short():
    verdict = manifests.judge(found([10, 20, 30], "step-00000020", unmanifested={10: [], 20: []}), damaged_at())
    assert (verdict.tag, verdict.unchecked, verdict.unfinished) == ("step-00000020", True, ["step-00000030"])
    cut = {10: [], 20: ["optim.pt is cut short or damaged (File is not a zip file)"]}
    verdict = manifests.judge(found([10, 20], "step-00000020", unmanifested=cut), damaged_at())
    assert verdict.tag == "step-00000010" and verdict.damaged == {"step-00000020": cut[20]}
    # Once a stage writes manifests, a newer folder without one has lost it.
    verdict = manifests.judge(found([10, 20, 30], "step-00000030", manifested=[20], unmanifested={10: [], 30: []}),
                              damaged_at())
    assert verdict.tag == "step-00000020" and verdict.damaged == {"step-00000030": ["its manifest.json is missing"]}


def test_with_no_intact_checkpoint_a_stage_refuses_but_a_first_save_that_did_not_finish_starts_over():
    verdict = manifests.judge(found([10, 20], "step-00000020", manifested=[10, 20]), damaged_at(10, 20))
    assert verdict.tag is None and verdict.refused
    assert "`run --rerun sft` starts it over" in verdict.status("sft")
    verdict = manifests.judge(found([10], None), damaged_at())
    assert verdict.tag is None and not verdict.refused and list(verdict.damaged) == ["step-00000010"]
    verdict = manifests.judge(found([], "step-00000010"), damaged_at())
    assert (verdict.tag, verdict.gone, verdict.refused) == (None, "step-00000010", False)


# --------------------------------------------------------------------------- a stage's saves and resumes


def test_each_save_writes_a_manifest_of_every_file_and_latest_names_it(saved):
    content = json.loads(saved.manifest("step-00000030").read_text())
    assert content["step"] == 30
    assert sorted(content["files"]) == ["client.json", "critic/client.json", "rng-rank00000.pt"]
    assert saved.latest_named() == "step-00000030"
    assert manifests.newest_intact(saved).tag == "step-00000030"


def test_a_deleted_newest_checkpoint_falls_back_to_the_one_before_keeps_the_others_and_says_so(saved, caplog):
    shutil.rmtree(saved.checkpoints / "step-00000030")
    with caplog.at_level(logging.INFO, logger="stages"):
        assert resume(saved) == 20
    assert saved.checkpoint_tags() == ["step-00000010", "step-00000020"]
    assert saved.latest_named() == "step-00000020"
    assert "`latest` names checkpoint step-00000030, whose folder" in caplog.text
    assert "resuming from step-00000020, the newest intact checkpoint: 10 steps to train again" in caplog.text


def test_a_cut_short_file_in_the_newest_checkpoint_is_named_set_aside_and_the_one_before_resumed(saved, caplog):
    damaged = saved.checkpoints / "step-00000030" / "critic" / "client.json"
    size = damaged.stat().st_size
    os.truncate(damaged, 5)
    with caplog.at_level(logging.INFO, logger="stages"):
        assert resume(saved) == 20
    assert f"checkpoint step-00000030 is damaged: critic/client.json is 5 bytes, its manifest says {size}; " \
           f"set aside as {saved.checkpoints}/step-00000030{DAMAGED}" in caplog.text
    assert set_aside(saved) == ["step-00000030"]
    kept = next(saved.checkpoints.glob(f"*{DAMAGED}*")) / "critic" / "client.json"
    assert kept.stat().st_size == 5  # kept as it was
    assert saved.checkpoint_tags() == ["step-00000010", "step-00000020"]


def test_with_no_intact_checkpoint_the_stage_refuses_naming_each_and_moves_nothing(saved):
    for step in (10, 20, 30):
        os.truncate(saved.checkpoints / f"step-{step:08d}" / "client.json", 1)
    with pytest.raises(InvalidInput) as refused:
        resume(saved)
    message = refused.value.message
    assert refused.value.exit_code == 2
    assert message.startswith(f"no intact checkpoint to resume from in {saved.checkpoints}: "
                              "step-00000030: client.json is 1 bytes, its manifest says")
    assert "step-00000010: client.json is 1 bytes" in message and "Nothing was moved or deleted" in message
    assert "`python -m pipeline run <pipeline file> --rerun sft`" in message
    assert saved.checkpoint_tags() == ["step-00000010", "step-00000020", "step-00000030"] and set_aside(saved) == []


def test_a_save_killed_before_its_manifest_leaves_only_its_own_folder_and_temporaries_to_remove(saved, caplog):
    earlier = saved.checkpoints / f"step-00000040{DAMAGED}20260101-000000"  # set aside by an earlier resume
    shutil.copytree(saved.checkpoints / "step-00000030", earlier)
    unfinished = saved.checkpoints / "step-00000040"
    shutil.copytree(saved.checkpoints / "step-00000030", unfinished)
    (unfinished / MANIFEST_FILE).rename(unfinished / f"{MANIFEST_FILE}.tmp")  # killed while writing it
    for name in ("model.tmp", "result.json.tmp"):
        (saved.path / name).mkdir()
    assert sorted(p.name for p in saved.temporaries()) == ["model.tmp", "result.json.tmp"]  # what start-up removes
    with caplog.at_level(logging.INFO, logger="stages"):
        assert resume(saved) == 30
    assert f"removed {unfinished}: a save that did not finish (no manifest.json, newer than step-00000030)" \
           in caplog.text
    assert saved.checkpoint_tags() == ["step-00000010", "step-00000020", "step-00000030"]
    assert earlier.is_dir() and set_aside(saved) == ["step-00000040"]


class FullDiskEngine(JsonEngine):
    def save_checkpoint(self, folder, tag, client_state=None, save_latest=False):
        super().save_checkpoint(folder, tag, client_state)
        raise OSError(28, "No space left on device")


def test_rotation_never_removes_the_last_verified_checkpoint_nor_a_set_aside_one(saved):
    from core.failure import WriteFailed
    from stages.checkpoints import Checkpoints

    earlier = saved.checkpoints / f"step-00000040{DAMAGED}20260101-000000"
    shutil.copytree(saved.checkpoints / "step-00000030", earlier)
    checkpoints = Checkpoints(saved, keep=1, is_main=True)
    with pytest.raises(WriteFailed):
        checkpoints.save(FullDiskEngine(), 35, {"step": 35})
    assert saved.checkpoint_tags() == ["step-00000010", "step-00000020", "step-00000030"]
    assert saved.latest_named() == "step-00000030"
    checkpoints.save(JsonEngine(), 35, {"step": 35})
    assert saved.checkpoint_tags() == ["step-00000035"] and earlier.is_dir()
    assert manifests.newest_intact(saved).tag == "step-00000035"
    assert not list(saved.checkpoints.glob("*.tmp"))


# --------------------------------------------------------------------------- end to end: 2 processes, ZeRO-2 and ZeRO-3

STEPS = 8  # checkpoints every 2 steps; the newest 3 are kept: 4, 6 and 8


def sft_pipeline(zero_stage: int, keep: int = 3) -> dict:
    stage = {"name": "sft", "kind": "sft", "model": "builtin:tiny-llama",
             "data": {"path": "builtin:digits", "eval_split": "eval"}, "max_steps": STEPS}
    return tiny_pipeline(stages=[stage], defaults={"zero_stage": zero_stage, "log_interval": 1, "warmup_steps": 2,
                                                   "save_interval": 2, "keep_checkpoints": keep})


# ZeRO-3 on both stacks; ZeRO-2 on the current one (its checkpoint files are the same kind of thing).
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.stack_free), 3], ids=["zero2", "zero3"])
def trained(request, tmp_path_factory) -> Path:
    """A two-process sft stage under ZeRO-`param`, trained once to its end (checkpoints 4, 6 and 8)."""
    workdir = tmp_path_factory.mktemp(f"zero{request.param}")
    config = write_pipeline(workdir, sft_pipeline(request.param))
    done = run_cli("run", config, cwd=workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return workdir


def rerun(trained: Path, tmp_path: Path, damage, keep: int = 3) -> tuple[subprocess.CompletedProcess, StageFolder]:
    """A copy of the trained run, its stage made unfinished (no result.json, no model/), damaged
    by `damage(folder)`, then `run` again."""
    workdir = tmp_path / "copy"
    shutil.copytree(trained, workdir, symlinks=True)
    folder = StageFolder(workdir / "runs" / "t" / "sft")
    assert folder.checkpoint_tags() == ["step-00000004", "step-00000006", "step-00000008"]
    folder.result.unlink()
    shutil.rmtree(folder.model)
    damage(folder)
    zero_stage = json.loads(folder.spec.read_text())["task"]["stage"]["zero_stage"]
    config = write_pipeline(workdir, sft_pipeline(zero_stage, keep))  # keep_checkpoints: no new spec hash
    return run_cli("run", config, cwd=workdir), folder


def largest_file(checkpoint: Path) -> Path:
    """The largest file of a checkpoint: a rank's optimizer states, whatever DeepSpeed names them."""
    return max((p for p in checkpoint.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def trained_steps(folder: StageFolder) -> list[int]:
    return [r["step"] for r in read_metrics(folder.path) if "lr" in r]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_stage_falls_back_past_a_deleted_and_a_cut_short_checkpoint_and_rotation_keeps_the_verified_one(
        trained, tmp_path):
    cut = {}

    def damage(folder):
        shutil.rmtree(folder.checkpoints / "step-00000008")  # the usual advice after a crash mid-write
        cut["file"] = largest_file(folder.checkpoints / "step-00000006")
        cut["bytes"] = cut["file"].stat().st_size
        os.truncate(cut["file"], 100_000)

    done, folder = rerun(trained, tmp_path, damage, keep=1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout
    name = cut["file"].relative_to(folder.checkpoints / "step-00000006")
    assert "`latest` names checkpoint step-00000008, whose folder" in log
    assert f"checkpoint step-00000006 is damaged: {name} is 100000 bytes, its manifest says {cut['bytes']}; set " \
           f"aside as {folder.checkpoints}/step-00000006{DAMAGED}" in log
    assert "resuming from step-00000004, the newest intact checkpoint: 4 steps to train again" in log
    assert "resumed from checkpoint step-00000004" in log  # kept at start-up, not deleted with the others
    assert trained_steps(folder) == list(range(1, STEPS + 1))  # steps 5-8 trained again, each logged once
    # keep_checkpoints 1: the new step 8 replaced every older checkpoint; the set-aside one is as it was.
    assert folder.checkpoint_tags() == ["step-00000008"] and set_aside(folder) == ["step-00000006"]
    kept = next(folder.checkpoints.glob(f"*{DAMAGED}*")) / name
    assert kept.stat().st_size == 100_000
    assert manifests.newest_intact(folder).tag == "step-00000008"


@pytest.mark.slow
@pytest.mark.e2e
def test_a_save_killed_before_its_manifest_is_removed_and_nothing_else_is(trained, tmp_path):
    def damage(folder):
        earlier = folder.checkpoints / f"step-00000008{DAMAGED}20260101-000000"  # set aside by an earlier resume
        shutil.copytree(folder.checkpoints / "step-00000008", earlier)
        folder.manifest("step-00000008").rename(folder.checkpoints / "step-00000008" / f"{MANIFEST_FILE}.tmp")
        folder.latest_marker.write_text("step-00000006")
        (folder.path / "model.tmp").mkdir()

    done, folder = rerun(trained, tmp_path, damage)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"removed {folder.checkpoints / 'step-00000008'}: a save that did not finish" in done.stdout
    assert "resumed from checkpoint step-00000006" in done.stdout and "damaged" not in done.stdout
    assert set_aside(folder) == ["step-00000008"] and not (folder.path / "model.tmp").exists()
    assert folder.checkpoint_tags() == ["step-00000004", "step-00000006", "step-00000008"]
    assert trained_steps(folder) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.e2e
def test_with_no_intact_checkpoint_run_refuses_with_exit_2_and_moves_nothing(trained, tmp_path):
    def damage(folder):  # two cut short, and one whose size is right but not its bytes (only the stage sees that)
        for tag in ("step-00000008", "step-00000006"):
            os.truncate(largest_file(folder.checkpoints / tag), 100_000)
        with open(largest_file(folder.checkpoints / "step-00000004"), "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0xFF]))

    done, folder = rerun(trained, tmp_path, damage)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stderr
    assert f"error: stage sft: no intact checkpoint to resume from in {folder.checkpoints}: step-00000008: " in said
    assert "is 100000 bytes, its manifest says" in said
    assert "step-00000004: " in said and "differ from what was saved (checksum)" in said
    assert "--rerun sft" in said and "Traceback" not in said
    assert folder.checkpoint_tags() == ["step-00000004", "step-00000006", "step-00000008"] and set_aside(folder) == []
    # Damaged so that their sizes show it, `run` refuses before it starts the stage.
    os.truncate(largest_file(folder.checkpoints / "step-00000004"), 100_000)
    config = folder.path.parent.parent.parent / "pipeline.yaml"
    again = run_cli("run", config, cwd=config.parent)
    assert again.returncode == 2 and "error: stage sft: no intact checkpoint to resume from" in again.stderr
    assert "resuming sft" not in again.stdout
