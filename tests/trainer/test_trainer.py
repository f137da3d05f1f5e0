"""The transformers Trainer front end (``accelerate_txn.trainer``) with a real Trainer (a tiny Llama built from a
config), real 2-rank FSDP1 and FSDP2 on CPU (gloo) and real ``kill -9``:

* a protected save publishes ``checkpoint-N`` with a manifest and leaves nothing behind;
* FSDP1 resumes its optimizer (native Trainer restores none into its fresh optimizer: the defect of issue 18):
  after each restart of the kill chain below, the optimizer state when training begins equals, bitwise, what the
  uninterrupted run had when it saved that checkpoint, and the chain's last run ends with the uninterrupted run's
  final weights and optimizer state;
* the kill chain (FSDP1): ``kill -9`` of one rank or of the whole job at each phase of a Trainer save (inside
  Trainer's own writes, ``tests.scenarios.trainer_scenarios.NATIVE_POINTS``, and at the library's points), each followed by
  ``resume_from_checkpoint=True``, which must take the newest complete checkpoint; one rank killed: the others fail on
  their own (no hang);
* a kill at a random instant (FSDP1): the whole job SIGKILLed at a seeded instant uniform over 5 train+save steps,
  then ``resume_from_checkpoint=True``: every save that returned kept, the newest complete checkpoint selected, its
  optimizer state restored bitwise, the final weights and optimizer state those of the uninterrupted run;
* the end-of-training removal (``save_total_limit=1`` with a best model) goes through the library's retention: only
  the best stays; killed inside it, no half-deleted ``checkpoint-N``, only a hidden leftover;
* FSDP2: a whole job killed mid-save resumes exactly; a corrupt newest checkpoint is skipped by ``True`` and refused
  on every rank when named; each file class damaged in turn (model and optimizer shards, ``scheduler.pt``, an RNG
  file, ``trainer_state.json``, a missing file, an extra loader-readable file) is refused with the same error on
  every rank, before anything is loaded; so is a file a resume reads that cannot be read on one rank (a truncated or
  forged ``rng_state_1.pth``, native or under a manifest rewritten to match, and more), in the same launch;
* a transformers release that changed a piece the front end relies on runs native Trainer with one warning.

Cost on 2 shared CPU cores: two reference runs (module fixtures, reused), a kill chain of 8 jobs, a random-instant
kill and its restart (about 20 s), two launches of the end-of-training removal (about 25 s), about 7 other launches;
under 4 minutes with the machine at load 4.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from accelerate_txn.core.faults import KILL_ENV
from accelerate_txn.core.manifest import MANIFEST, read_manifest, verify_manifest
from accelerate_txn.testing import LaunchError, launch
from tests.scenarios.crash_harness import KILLED, JobResult, run_to_completion, run_until_crash_point
from tests.scenarios.trainer_kills import STEPS as CHAIN_STEPS
from tests.scenarios.trainer_kills import equal, observed, random_kill_trial, reference_run, same_weights, trainer_report

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
TIMEOUT = 240  # per launch: a hung group fails instead of stalling
TRAIN = "tests.scenarios.trainer_scenarios:train"
ENTRY = "tests.scenarios.trainer_scenarios"


def _run(output: Path, resume: Any, max_steps: int, **kwargs: Any) -> list[dict[str, Any]]:
    return launch(TRAIN, 2, args=(str(output), resume, max_steps, kwargs.pop("fsdp_version", 2),
                                  kwargs.pop("save_total_limit", None)), timeout=TIMEOUT, env=kwargs.pop("env", None))


def _copy_run(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination, symlinks=True)
    return destination


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """An uninterrupted FSDP2 run to step 6 (checkpoint-2, -4, -6): its directory and each rank's result. Tests copy
    the directory before changing anything."""
    root = tmp_path_factory.mktemp("fsdp2_reference") / "run"
    return root, _run(root, None, 6)


@pytest.fixture(scope="module")
def fsdp1_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """An uninterrupted FSDP1 run to step 8 with ``save_total_limit=2`` (checkpoint-6 and -8 remain)."""
    root = tmp_path_factory.mktemp("fsdp1_reference") / "run"
    return root, reference_run(root)


def test_a_protected_trainer_save_publishes_a_checkpoint_with_a_manifest_and_no_staging_leftovers(
        fsdp1_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    root, results = fsdp1_reference
    assert results[0]["step"] == 8
    # Retention ran after each publish: the two newest complete checkpoints remain, nothing hidden but the lock.
    assert results[0]["entries"] == [".accelerate-txn.lock", "checkpoint-6", "checkpoint-8"]
    for name in ("checkpoint-6", "checkpoint-8"):
        path = root / name
        manifest = read_manifest(path)
        assert manifest is not None and manifest["status"] == "complete"
        assert manifest["trainer"]["world_size"] == 2 and manifest["trainer"]["backend"] == "FSDP1"
        assert manifest["trainer"]["global_step"] == int(name.split("-")[1])
        assert {"rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "trainer_state.json",
                "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"} <= set(manifest["files"])
        verify_manifest(path, manifest, full=True)  # every file, every hash
        state = json.loads((path / "trainer_state.json").read_text())
        assert state["global_step"] == int(name.split("-")[1])
    # Both checkpoints belong to one run (retention prunes that run's checkpoints only).
    assert read_manifest(root / "checkpoint-6")["run_id"] == read_manifest(root / "checkpoint-8")["run_id"]
    # The optimizer the reference saved is not empty (what the FSDP1 restore test compares against).
    assert all(result["optimizer_at_save"][8] for result in results)
    # Trainer's FSDP DCP files were written as a protected Accelerate save writes them (fsdp.dcp_writer).
    assert all(result["direct_writes"] > 0 for result in results)


# --- the FSDP1 kill chain ------------------------------------------------------------------------------------

#: (kill spec, whole job, complete checkpoints right after the kill). Job 0 trains from scratch and is killed in its
#: second save (checkpoint-4); each later job resumes with ``resume_from_checkpoint=True`` and is killed in its first
#: save; a last job resumes and trains to step 8. One rank or the whole job, alternating over the phases of a save:
#: inside Trainer's own writes (model written; optimizer and scheduler written; RNG written, ``trainer_state.json``
#: not yet), then the library's points (native save done; hashing; manifest written, not renamed; published;
#: retention renaming the oldest aside).
CHAIN = (
    ("trainer:after-model@1#2", False, [2]),
    ("trainer:after-optimizer", True, [2]),
    ("trainer:after-rng@0", False, [2]),
    ("save:after-native-save@1", False, [2]),
    ("save:during-flush@0", False, [2]),
    ("save:after-manifest@0", False, [2]),
    ("save:after-rename", True, [2, 4]),
    ("save:during-retention@0", False, [4, 6]),
)


@pytest.fixture(scope="module")
def fsdp1_chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the kill chain; returns per link the kill's result, the directory right after it, and what the next job
    (its restart) observed when training began; and the last job's results."""
    directory = tmp_path_factory.mktemp("fsdp1_chain")
    root = directory / "run"
    spec = {"output_dir": str(root), "max_steps": CHAIN_STEPS, "fsdp_version": 1, "save_total_limit": 2}
    links = []
    for index, (kill, whole_job, _complete) in enumerate(CHAIN):
        job_spec = {**spec, "kill": kill, "resume": None if index == 0 else True}
        killed = run_until_crash_point(job_spec, directory, f"link{index}", whole_job, entry=ENTRY)
        links.append({"kill": killed, "report": trainer_report(root),
                      "began": observed(directory, f"link{index}", "began")})
    final = run_to_completion({**spec, "resume": True}, directory, "final", entry=ENTRY)
    return {"links": links, "final": final, "final_obs": observed(directory, "final", "began"),
            "final_results": [torch.load(directory / "obs" / "final" / f"rank{r}.pt", weights_only=False)
                              for r in range(2)], "root": root}


@pytest.mark.parametrize("index", range(len(CHAIN)), ids=[f"{kill.split('#')[0]}-{'job' if whole else 'rank'}"
                                                          for kill, whole, _ in CHAIN])
def test_kill_9_at_each_phase_of_a_trainer_save_then_resume_true_takes_the_newest_complete_checkpoint(
        fsdp1_chain: dict[str, Any], fsdp1_reference: tuple[Path, list[dict[str, Any]]], index: int) -> None:
    kill_spec, _whole_job, complete = CHAIN[index]
    link = fsdp1_chain["links"][index]
    killed: JobResult = link["kill"]
    target = kill_spec.split("#")[0]
    killed_rank = int(target.split("@")[1]) if "@" in target else None
    assert KILLED in killed.returncodes, killed.describe()
    if killed_rank is not None:
        # One rank died; every other rank failed on its own (an error, not a hang the harness had to end).
        assert killed.returncodes[killed_rank] == KILLED and killed.first_dead == killed_rank, killed.describe()
        assert not killed.survivors_killed, f"rank(s) {killed.survivors_killed} hung\n{killed.describe()}"
        assert all(code not in (0, None) for code in killed.survivors_exited.values()), killed.describe()
    report = link["report"]
    # Nothing half-written is published: every checkpoint-N present is complete (every hash), the killed save's
    # checkpoint appears only once its manifest was renamed into place.
    assert report["complete"] == complete and not report["broken"], report
    if target.startswith(("trainer:", "save:after-native", "save:during-flush", "save:after-manifest")):
        # Rank 0 dead: its hidden staging directory stays (never a checkpoint-N); rank 0 alive: it failed on its own
        # and removed it.
        assert bool(report["leftovers"]) == (killed_rank != 1), report
    # The restart (the next link's job, or the last job) selected the newest complete checkpoint and restored the
    # optimizer state the uninterrupted run had when it saved that checkpoint, bitwise, on every rank.
    began = fsdp1_chain["links"][index + 1]["began"] if index + 1 < len(CHAIN) else fsdp1_chain["final_obs"]
    _root, reference = fsdp1_reference
    for rank in range(2):
        assert began[rank] is not None, f"the restart after {kill_spec} never began training"
        assert began[rank]["step"] == complete[-1]
        restored, saved = began[rank]["optimizer"], reference[rank]["optimizer_at_save"][complete[-1]]
        assert restored and len(restored) == len(saved), "the FSDP1 optimizer was not restored"
        assert equal(restored, saved), f"rank {rank}: the restored optimizer state differs from the saved one"


def test_fsdp1_resume_restores_the_optimizer_and_ends_exactly_as_an_uninterrupted_run(
        fsdp1_chain: dict[str, Any], fsdp1_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """The defect of issue 18: native Trainer restores 0 optimizer tensors into its fresh FSDP1 optimizer. After eight
    kills and restarts the last run ends with the uninterrupted run's weights and optimizer state, bitwise."""
    _root, reference = fsdp1_reference
    final = fsdp1_chain["final_results"]
    assert [result["step"] for result in final] == [CHAIN_STEPS] * 2
    assert same_weights(final, reference), "the resumed FSDP1 run's final weights differ from the uninterrupted run's"
    for rank in range(2):
        assert final[rank]["optimizer"] and equal(final[rank]["optimizer"], reference[rank]["optimizer"])
    report = trainer_report(fsdp1_chain["root"])
    assert report == {"complete": [6, 8], "broken": {}, "leftovers": []}, report  # every leftover removed


# --- a kill at a random instant -------------------------------------------------------------------------------

#: The seed of the random-instant kill (``ACCELERATE_TXN_TRAINER_KILL_SEED`` overrides it: the failure message names
#: the seed and the instant, so a failing draw can be replayed; ``python -m tests.crash_sweep --trainer`` draws many).
RANDOM_KILL_SEED = 18


def test_kill_9_of_the_whole_job_at_a_random_instant_then_resume_true_ends_exactly_as_an_uninterrupted_run(
        tmp_path: Path, fsdp1_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """The whole FSDP1 job SIGKILLed at a seeded instant, uniform over 5 of the 8 train+save steps (the step time
    measured on the uninterrupted reference run): wherever it lands (training, Trainer's own writes, hashing, the
    rename, retention) every ``checkpoint-N`` present is complete, every save that returned is kept, and
    ``resume_from_checkpoint=True`` takes the newest complete one, restores its optimizer state bitwise and ends with
    the uninterrupted run's weights and optimizer state, bitwise (tests/scenarios/trainer_kills.py)."""
    _root, reference = fsdp1_reference
    seed = int(os.environ.get("ACCELERATE_TXN_TRAINER_KILL_SEED", RANDOM_KILL_SEED))
    where, problems = random_kill_trial(tmp_path, reference, seed)
    assert problems == [], where


# --- the end-of-training removal -------------------------------------------------------------------------------

def test_the_end_of_training_removal_keeps_only_the_best_through_retention_and_survives_a_kill_inside_it(
        tmp_path: Path) -> None:
    """``save_total_limit=1`` with a best model: at the end of the run Trainer deletes every checkpoint but the best
    with ``shutil.rmtree``. Protected, the library's retention does it: the best stays, every other complete
    checkpoint of the run is renamed aside, then deleted. Killed inside that removal (rank 0, after renaming
    checkpoint-6 aside): no half-deleted ``checkpoint-6``, only a hidden leftover, and the best is still complete."""
    done = launch("tests.scenarios.trainer_scenarios:train_keeping_best", 2, args=(str(tmp_path / "done"), 6), timeout=TIMEOUT)
    assert done[0]["step"] == 6 and done[0]["best"] == str(tmp_path / "done" / "checkpoint-2")
    assert done[0]["entries"] == [".accelerate-txn.lock", "checkpoint-2"], done[0]["entries"]
    assert trainer_report(tmp_path / "done") == {"complete": [2], "broken": {}, "leftovers": []}

    # Retention reaches save:during-retention once in the save of checkpoint-6 (checkpoint-4 goes: neither the newest
    # nor the best), then at the end of training (checkpoint-6 goes).
    killed = tmp_path / "killed"
    with pytest.raises(LaunchError, match="died with exit codes"):
        launch("tests.scenarios.trainer_scenarios:train_keeping_best", 2, args=(str(killed), 6), timeout=TIMEOUT,
               env={KILL_ENV: "save:during-retention@0#2"})
    report = trainer_report(killed)
    assert report["complete"] == [2] and not report["broken"], report
    assert [name.split(".deleting-")[0] for name in report["leftovers"]] == [".checkpoint-6"], report


# --- FSDP2 ---------------------------------------------------------------------------------------------------

def test_kill_9_of_the_whole_job_mid_save_resumes_from_the_previous_complete_checkpoint_exactly(
        tmp_path: Path, fsdp2_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    _root, reference = fsdp2_reference
    killed = tmp_path / "killed"
    # Every rank kills itself (SIGKILL, no cleanup) in the save of checkpoint-4, after hashing its first file.
    with pytest.raises(LaunchError, match="died with exit codes"):
        _run(killed, None, 6, env={KILL_ENV: "save:during-flush#2"})
    entries = sorted(entry.name for entry in killed.iterdir())
    assert "checkpoint-2" in entries and "checkpoint-4" not in entries
    assert any(name.startswith(".checkpoint-4.staging-") for name in entries), entries  # the dead writer's leftover
    resumed = _run(killed, True, 6)
    assert resumed[0]["step"] == 6
    assert same_weights(resumed, reference), "the resumed run's final weights differ from the uninterrupted run's"
    for rank in range(2):  # the library's FSDP2 restore put back what the reference had saved at step 2
        assert equal(resumed[rank]["began"]["optimizer"], reference[rank]["optimizer_at_save"][2])
    assert not [name for name in resumed[0]["entries"] if ".staging-" in name]  # the next save removed the leftover
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        verify_manifest(killed / name, read_manifest(killed / name), full=True)


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the content hash can tell
    path.write_bytes(bytes(data))


def _rank_parts(text: str) -> list[str]:
    return [text.split(f"--- rank {rank} ---")[1].split("--- rank")[0] for rank in (0, 1)]


def test_a_corrupt_newest_checkpoint_is_skipped_by_resume_true_and_refused_when_named(
        tmp_path: Path, fsdp2_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    source, reference = fsdp2_reference
    run = _copy_run(source, tmp_path / "run")  # checkpoint-2, -4, -6 of the uninterrupted run
    newest = run / "checkpoint-6"
    _corrupt(newest / "rng_state_1.pth")  # rank 1's file: Trainer would read it, and treats it as optional
    with pytest.raises(LaunchError) as refused:
        _run(run, str(newest), 6)
    for part in _rank_parts(str(refused.value)):  # the same error on every rank, before Trainer loaded anything
        assert "CheckpointIntegrityError" in part and "rng_state_1.pth does not match its xxh3_128" in part, part
        assert "_load_from_checkpoint" not in part and "_prepare_for_training" not in part
    resumed = _run(run, True, 6)  # skips checkpoint-6 (logged), resumes from checkpoint-4
    assert resumed[0]["step"] == 6 and resumed[0]["began"]["step"] == 4
    assert same_weights(resumed, reference)
    # checkpoint-6 was saved again by the resumed run: replaced atomically by a complete, verified one.
    verify_manifest(newest, read_manifest(newest), full=True)
    assert (newest / MANIFEST).is_file()


def _damage(checkpoint: Path, case: str) -> None:
    if case == "model shard":
        _corrupt(checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp")  # rank 1's shard: rank 1 finds it
    elif case == "optimizer shard":
        path = checkpoint / "optimizer_0" / "__0_0.distcp"
        os.truncate(path, path.stat().st_size // 2)
    elif case == "scheduler":
        _corrupt(checkpoint / "scheduler.pt")
    elif case == "rng state":
        _corrupt(checkpoint / "rng_state_0.pth")
    elif case == "trainer state":
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        state["global_step"] += 2  # still valid JSON, still a plausible Trainer state
        (checkpoint / "trainer_state.json").write_text(json.dumps(state, indent=2))
    elif case == "missing file":
        (checkpoint / "optimizer_0" / "__1_0.distcp").unlink()
    elif case == "extra file":
        (checkpoint / "model.safetensors").write_bytes(b"{}")  # a file Trainer's loader would read
    else:
        raise AssertionError(case)


#: Each damaged file class and what the refusal names (the same text on every rank).
DAMAGE = {
    "model shard": "pytorch_model_fsdp_0/__1_0.distcp does not match its xxh3_128",
    "optimizer shard": "optimizer_0/__0_0.distcp",
    "scheduler": "scheduler.pt does not match its xxh3_128",
    "rng state": "rng_state_0.pth does not match its xxh3_128",
    "trainer state": "trainer_state.json",
    "missing file": "optimizer_0/__1_0.distcp",
    "extra file": "model.safetensors",
}


class Forged:
    """Unpickling this runs ``os.system(command)``: a stand-in for arbitrary code in a forged checkpoint file."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


def _unreadable(checkpoint: Path, case: str, marker: Path) -> None:
    """Damage ``checkpoint`` (a copy of checkpoint-6) so that a file Trainer's resume reads cannot be read on some
    rank (``UNREADABLE``); the hashes of a manifest that stays are rewritten to match, so that only reading can
    tell."""
    from tests.scenarios.corruption_scenarios import rewrite_rows

    native, kind = case.split(": ", 1)[0] == "native", case.split(": ", 1)[1]
    rng = checkpoint / "rng_state_1.pth"
    if kind == "truncated rng of rank 1":
        os.truncate(rng, rng.stat().st_size // 2)
    elif kind == "forged rng of rank 1":
        torch.save({"python": Forged(f"touch {marker}"), "numpy": 0, "cpu": torch.zeros(1)}, rng)
    elif kind == "rng of rank 1 that cannot be applied":
        state = torch.load(rng, weights_only=False)
        torch.save({**state, "cpu": torch.zeros(8, dtype=torch.uint8)}, rng)  # not a generator state
    elif kind == "truncated scheduler":
        os.truncate(checkpoint / "scheduler.pt", 40)
    elif kind == "trainer state not JSON":
        path = checkpoint / "trainer_state.json"
        path.write_text(path.read_text()[:-20])
    elif kind == "forged model metadata":  # DCP itself unpickles .metadata with plain pickle
        (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(pickle.dumps(Forged(f"touch {marker}")))
    elif kind == "truncated model shard of rank 1":
        path = checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp"
        os.truncate(path, path.stat().st_size // 2)
    else:
        raise AssertionError(case)
    if native:
        (checkpoint / MANIFEST).unlink()  # as native Trainer saves it
    else:
        rewrite_rows(checkpoint, [rng.name])


#: A file Trainer's resume reads that cannot be read on some rank, in a native (manifest-less) checkpoint or under a
#: manifest rewritten to match: what the refusal names and the ranks it failed on (the same text on every rank).
UNREADABLE = {
    "native: truncated rng of rank 1": ("rng_state_1.pth", "[1]"),
    "manifest: forged rng of rank 1": ("rng_state_1.pth", "[1]"),
    "native: forged rng of rank 1": ("GLOBAL posix.system", "[1]"),
    "manifest: rng of rank 1 that cannot be applied": ("rng_state_1.pth", "[1]"),
    "native: truncated scheduler": ("scheduler.pt", "[0, 1]"),
    "native: trainer state not JSON": ("trainer_state.json", "[0, 1]"),
    "native: truncated model shard of rank 1": ("pytorch_model_fsdp_0/__1_0.distcp", "[0, 1]"),
    "native: forged model metadata": ("posix.system is not allowed", "[0, 1]"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory,
             fsdp2_reference: tuple[Path, list[dict[str, Any]]]) -> dict[str, Any]:
    """One 2-rank launch (``tests.scenarios.trainer_scenarios.refuse_each``) tries every damaged copy of checkpoint-6 of
    ``DAMAGE`` and ``UNREADABLE`` in turn; returns each rank's result and the markers a forged file would create."""
    source, _reference = fsdp2_reference
    directory = tmp_path_factory.mktemp("refusals")
    cases, markers = {}, {}
    for case in (*DAMAGE, *UNREADABLE):
        checkpoint = _copy_run(source / "checkpoint-6", directory / case.replace(" ", "-").replace(":", "") /
                               "checkpoint-6")
        markers[case] = directory / f"marker-{len(markers)}"
        if case in DAMAGE:
            _damage(checkpoint, case)
        else:
            _unreadable(checkpoint, case, markers[case])
        cases[case] = str(checkpoint)
    results = launch("tests.scenarios.trainer_scenarios:refuse_each", 2, args=(str(directory / "out"), cases), timeout=TIMEOUT)
    return {"results": results, "markers": markers}


def test_each_damaged_file_class_is_refused_on_every_rank_before_anything_is_loaded(
        refusals: dict[str, Any]) -> None:
    results = refusals["results"]
    for case, expected in DAMAGE.items():
        errors = [result["errors"][case] for result in results]
        assert errors[0] == errors[1], f"{case}: the ranks raised different errors: {errors}"
        assert errors[0].startswith("CheckpointIntegrityError: ") and expected in errors[0], (case, errors[0])
        assert all(result["untouched"][case] for result in results), f"{case}: something was loaded"


def test_a_file_a_trainer_resume_reads_unreadable_on_one_rank_is_the_same_error_on_every_rank_before_anything_loads(
        refusals: dict[str, Any]) -> None:
    """A native checkpoint whose ``rng_state_1.pth`` is truncated, or a forged one (a pickle calling ``os.system``)
    under a manifest rewritten to match: natively rank 1 raises ``PytorchStreamReader failed``/``UnpicklingError``
    after the model and optimizer were restored, while rank 0 waits for it (gloo: "Connection closed by peer"). Every
    file a Trainer resume reads is read safely, on every rank, before Trainer loads anything: the same
    ``CheckpointIntegrityError`` on every rank naming the file and the rank(s); model, optimizer, Trainer state and
    generators untouched; the forged pickle never ran."""
    results = refusals["results"]
    for case, (expected, ranks) in UNREADABLE.items():
        errors = [result["errors"][case] for result in results]
        assert errors[0] == errors[1], f"{case}: the ranks raised different errors: {errors}"
        assert errors[0].startswith("CheckpointIntegrityError: Reading the files a Trainer resume reads"), errors[0]
        assert expected in errors[0] and f"failed on rank(s) {ranks}" in errors[0], (case, errors[0])
        assert "resume from another one" in errors[0], (case, errors[0])  # the fix
        assert all(result["untouched"][case] for result in results), f"{case}: something was restored"
        assert not refusals["markers"][case].exists(), f"{case}: the forged pickle ran"
    assert "on rank 1" in results[0]["errors"]["native: truncated rng of rank 1"]


# --- the command line on a Trainer output directory -----------------------------------------------------------

def test_a_checkpoint_whose_optimizer_does_not_match_is_refused_before_the_model_is_loaded(
        tmp_path: Path, fsdp2_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    """Trainer loads the model before the optimizer: a checkpoint whose optimizer state does not match the live
    optimizer (here the resumed run freezes the embedding, so its optimizer trains fewer parameters) is refused with
    the same error on every rank by the optimizer restore's own checks, run before the model load; the model keeps
    its fresh weights (natively they would be replaced, then the optimizer restore would fail)."""
    root, _results = fsdp2_reference
    run = _copy_run(root, tmp_path / "run")
    results = launch("tests.scenarios.trainer_scenarios:refuse_other_optimizer", 2,
                     args=(str(tmp_path / "out"), str(run / "checkpoint-4")), timeout=TIMEOUT)
    errors = [result["error"] for result in results]
    assert errors[0] == errors[1], errors  # the same error on every rank
    assert "before the model is loaded" in errors[0] and "embed_tokens" in errors[0], errors[0]
    assert [result["untouched"] for result in results] == [True, True], errors


def _cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    from accelerate_txn.cli import main

    code = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out, captured.err


def test_the_cli_lists_verifies_inspects_and_picks_trainer_checkpoints_as_resume_true_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fsdp2_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    source, _reference = fsdp2_reference
    run = _copy_run(source, tmp_path / "run")
    _corrupt(run / "checkpoint-6" / "rng_state_1.pth")  # the newest: resume_from_checkpoint=True skips it
    native = _copy_run(source / "checkpoint-6", run / "checkpoint-8")  # as native Trainer saves: no manifest
    (native / MANIFEST).unlink()

    code, out, _err = _cli(capsys, "list", run, "--json")
    listing = json.loads(out)
    assert code == 0 and listing["trainer"] is True and listing["would_load"] == str(run / "checkpoint-4")
    rows = {row["name"]: row for row in listing["checkpoints"]}
    assert [row["name"] for row in listing["checkpoints"]] == ["checkpoint-8", "checkpoint-6", "checkpoint-4",
                                                                "checkpoint-2"]
    assert rows["checkpoint-8"]["status"] == "legacy" and "native Trainer" in rows["checkpoint-8"]["reason"]
    assert rows["checkpoint-6"]["status"] == "corrupt" and "rng_state_1.pth" in rows["checkpoint-6"]["reason"]
    assert [(rows[n]["status"], rows[n]["global_step"]) for n in ("checkpoint-4", "checkpoint-2")] == [
        ("complete", 4), ("complete", 2)]
    code, out, _err = _cli(capsys, "list", run)
    assert code == 0 and "train(resume_from_checkpoint=True) would resume from checkpoint-4" in out

    code, out, err = _cli(capsys, "latest", run)
    assert code == 0 and out.strip() == str(run / "checkpoint-4") and "checkpoint-6" in err

    code, out, _err = _cli(capsys, "verify", run / "checkpoint-4", "--full")
    assert code == 0 and "valid" in out and "Trainer global step 4" in out
    assert "the 6 files a Trainer resume reads" in out
    code, _out, err = _cli(capsys, "verify", run / "checkpoint-6")
    assert code == 1 and "rng_state_1.pth does not match its xxh3_128" in err
    code, _out, err = _cli(capsys, "verify", native)
    assert code == 1 and "saved by native Trainer" in err
    extra = _copy_run(source / "checkpoint-2", tmp_path / "extra" / "checkpoint-2")
    (extra / "config.json").write_text("{}")  # a file a Trainer resume reads, not in the inventory
    code, _out, err = _cli(capsys, "verify", extra)
    assert code == 1 and "config.json" in err

    code, out, _err = _cli(capsys, "inspect", run / "checkpoint-4")
    assert code == 0 and "saved by transformers.Trainer" in out
    assert "world size 2, backend FSDP2, state dict type SHARDED_STATE_DICT, global step 4" in out
    assert "rng_state_1.pth" in out and "trainer_state.json" in out  # the files a resume reads

    # prune counts every published checkpoint of the run: a corrupt one is refused, as in an Accelerate run.
    code, _out, err = _cli(capsys, "prune", run, "--keep", "1")
    assert code == 1 and "checkpoint-6" in err and "fail verification" in err
    shutil.rmtree(run / "checkpoint-6")
    code, out, _err = _cli(capsys, "prune", run, "--keep", "1", "--json")
    pruned = json.loads(out)
    assert code == 0 and pruned["deleted"] == [str(run / "checkpoint-2")] and pruned["kept"] == [
        str(run / "checkpoint-4")]
    assert sorted(p.name for p in run.iterdir()) == [".accelerate-txn.lock", "checkpoint-4", "checkpoint-8"]


def test_the_cli_reads_a_trainer_directory_without_importing_torch(
        fsdp2_reference: tuple[Path, list[dict[str, Any]]]) -> None:
    import subprocess
    import sys

    source, _reference = fsdp2_reference
    probe = ("import sys\nfrom accelerate_txn.cli import main\n"
             "codes = [main(['verify', sys.argv[1]]), main(['list', sys.argv[2]]), main(['latest', sys.argv[2]])]\n"
             "print('torch' in sys.modules, codes)")
    result = subprocess.run([sys.executable, "-c", probe, str(source / "checkpoint-4"), str(source)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False [0, 0, 0]"


_UNVALIDATED = """\
import os, sys, warnings
import torch
import accelerate_txn
import transformers.trainer
assert transformers.trainer.__file__.startswith(sys.argv[2])  # the changed release (tests/support/overlay.py)
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64))
data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (16, 8))]
args = TrainingArguments(output_dir=sys.argv[1], use_cpu=True, per_device_train_batch_size=4, max_steps=4, save_steps=2,
                         report_to=[], disable_tqdm=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Trainer(model=model, args=args, train_dataset=data).train()
notes = [str(w.message) for w in caught if "NOT protected" in str(w.message)]
print("WARNINGS", len(notes), notes[:1])
"""


_FIRST, _LAST = "self._save_optimizer_and_scheduler(output_dir)", "self._save_rng_state(output_dir)"


def _two_writes_swapped(text: str) -> str:
    """Trainer's ``_save_checkpoint`` writing the RNG state where it wrote the optimizer, and the other way round
    (each call appears once in transformers' trainer.py)."""
    assert text.count(_FIRST) == 1 and text.count(_LAST) == 1
    return text.replace(_FIRST, "\0").replace(_LAST, _FIRST).replace("\0", _LAST)


_RNG_NAME = 'f"rng_state_{self.args.process_index}.pth"'


def _rng_file_renamed(text: str) -> str:
    """Trainer's ``_save_rng_state`` writing each rank's RNG state under another name (a changed layout)."""
    assert text.count(_RNG_NAME) == 1
    return text.replace(_RNG_NAME, 'f"rng_states_{self.args.process_index}.pt"')


def test_a_layout_the_evidence_did_not_foresee_fails_the_save_on_every_rank_and_publishes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never trade safety for reach: a release whose pieces the gate accepts (here forced with the override: the
    # evidence would have caught this change) still passes every runtime check of the protected path. A Trainer that
    # writes its RNG files under other names fails its first save on both ranks with the same error, nothing
    # published, no staging left.
    from tests.support.overlay import overlay

    shadow = overlay("transformers", tmp_path / "release", {"trainer.py": _rng_file_renamed})
    output = tmp_path / "run"
    monkeypatch.setenv("ACCELERATE_TXN_ALLOW_UNVALIDATED", "1")  # what the gate says where the evidence misses it
    results = launch("tests.scenarios.trainer_scenarios:train_reporting_the_error", 2, args=(str(output), 2, str(shadow)),
                     timeout=TIMEOUT)
    errors = [obs["error"] for obs in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0]["type"] == "CheckpointIntegrityError" and "rng_state_" in errors[0]["message"], errors[0]
    assert results[0]["entries"] == [entry for entry in results[0]["entries"] if not entry.startswith("checkpoint-")]
    assert not any(".staging" in entry for entry in results[0]["entries"]), results[0]["entries"]


def test_a_transformers_release_whose_save_writes_in_another_order_runs_native_trainer_with_one_warning(
        tmp_path: Path) -> None:
    import subprocess
    import sys

    import transformers

    from tests.support.overlay import overlay

    shadow = overlay("transformers", tmp_path / "release", {"trainer.py": _two_writes_swapped})
    output = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", _UNVALIDATED, str(output), str(shadow)], capture_output=True,
                            text=True, timeout=TIMEOUT, cwd=Path(__file__).resolve().parents[2],
                            env={**{k: v for k, v in os.environ.items() if k != "ACCELERATE_TXN_ALLOW_UNVALIDATED"},
                                 "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(shadow)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNINGS 1 " in result.stdout, result.stdout
    assert "accelerate-txn: transformers Trainer (one-process and DDP) checkpoints run native, NOT protected" \
        in result.stdout
    assert (f"transformers {transformers.__version__}: transformers.trainer.Trainer._save_checkpoint (its code) "
            "differs from every release that passed") in result.stdout
    assert "the same calls in another order" in result.stdout, result.stdout
    # Native Trainer saved as it does without the library: no manifest, no lock, no staging.
    assert sorted(entry.name for entry in output.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not (output / "checkpoint-4" / MANIFEST).exists()


def test_a_trainer_with_local_state_dict_runs_native_and_full_or_sharded_are_protected(tmp_path: Path) -> None:
    from accelerate_txn.runtime.protection import STATE_DICT_FIX

    for found in launch("tests.scenarios.trainer_scenarios:protection_by_state_dict_type", 2, args=(str(tmp_path),),
                        timeout=300):
        assert found["SHARDED_STATE_DICT"]["protected"] and found["FULL_STATE_DICT"]["protected"]
        assert found["LOCAL_STATE_DICT"] == {
            "protected": False, "fix": STATE_DICT_FIX,
            "reason": "state_dict_type is LOCAL_STATE_DICT (protected: SHARDED_STATE_DICT and FULL_STATE_DICT)"}
