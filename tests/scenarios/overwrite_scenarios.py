"""Code that runs inside the ranks of the overwrite tests (tests/accelerate/test_overwrite.py): saving where a checkpoint
already exists, through the patched ``save_state`` on a real 2-rank FSDP1 run (gloo, CPU).

* :func:`replace_and_fall_back` (``accelerate_txn.testing.launch``): an example-style run saves ``checkpoint-1`` and
  ``checkpoint-2`` into its own output directory, resumes from ``checkpoint-1`` (as ``--resume_from_checkpoint
  checkpoint-1`` does) and saves ``checkpoint-2`` again: native Accelerate overwrites, the library replaces it
  atomically. Then a save into a directory of someone else's files runs native, with a warning, and leaves those
  files alone; ``overwrite="refuse"`` refuses.
* :func:`main` (``tests/scenarios/crash_harness.Job``): one job of the kill chain. It runs the ``actions`` of its spec in
  order: ``["load", NAME, LABEL]`` loads ``ROOT/NAME`` explicitly and compares everything restored with the state
  recorded under ``LABEL``; ``["save", NAME, LABEL]`` trains a step, records its state under ``LABEL`` and saves
  ``ROOT/NAME`` (with the spec's ``kill`` point armed if it is the last action), and rank 0 lists ``ROOT`` after
it. ``no_exchange`` makes every
  replacement use the two-rename fallback (as on a filesystem without ``renameat2(RENAME_EXCHANGE)``).
"""

from __future__ import annotations

import faulthandler
import io
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import accelerate_txn
from accelerate_txn.core.faults import KILL_ENV
from accelerate_txn.core.manifest import MANIFEST
from tests.scenarios.crash_scenarios import capture, differences, write_json
from tests.scenarios.scenarios import _build, _error, _train
from tests.support.log_records import WarningRecords


def _listing(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir())


def _transaction(path: Path) -> str | None:
    manifest = path / MANIFEST
    return json.loads(manifest.read_text())["transaction_id"] if manifest.is_file() else None


def replace_and_fall_back(root: str) -> dict[str, Any]:
    root_path = Path(root)
    rank = int(os.environ["RANK"])
    obs: dict[str, Any] = {}
    output = root_path / "output"
    accelerator, model, optimizer, scheduler = _build(0)
    _train(accelerator, model, optimizer, scheduler, 1, seed=1)
    accelerator.save_state(str(output / "checkpoint-1"))
    _train(accelerator, model, optimizer, scheduler, 1, seed=2)
    accelerator.save_state(str(output / "checkpoint-2"))
    first_transaction = _transaction(output / "checkpoint-2")

    # Resume from the older checkpoint in a new Accelerator, train on, and save checkpoint-2 again.
    resumed, model2, optimizer2, scheduler2 = _build(7)
    resumed.load_state(str(output / "checkpoint-1"))
    _train(resumed, model2, optimizer2, scheduler2, 1, seed=3)
    expected = capture(resumed, model2, optimizer2, scheduler2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs["replace_error"] = _error(lambda: resumed.save_state(str(output / "checkpoint-2")))
    obs["replace_warnings"] = [str(w.message) for w in caught if "accelerate-txn" in str(w.message)]
    resumed.wait_for_everyone()
    obs["replaced_transaction_changed"] = _transaction(output / "checkpoint-2") not in (None, first_transaction)
    obs["listing_after_replace"] = _listing(output)

    # The replaced checkpoint holds the resumed run's state, exactly.
    check, model3, optimizer3, scheduler3 = _build(11)
    check.load_state(str(output / "checkpoint-2"))
    obs["replaced_differences"] = differences(expected, capture(check, model3, optimizer3, scheduler3))

    # A destination that is not a checkpoint: someone's directory of other files. Native save_state writes into
    # it; the library does the same (unprotected, with a warning) and never replaces it.
    foreign = root_path / "notes"
    if rank == 0:
        foreign.mkdir()
        (foreign / "README.txt").write_text("my notes")
    resumed.wait_for_everyone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        obs["foreign_error"] = _error(lambda: resumed.save_state(str(foreign)))
    obs["foreign_warnings"] = [str(w.message) for w in caught if "accelerate-txn" in str(w.message)]
    resumed.wait_for_everyone()
    obs["foreign_listing"] = _listing(foreign)
    obs["foreign_notes_kept"] = (foreign / "README.txt").read_text() == "my notes"
    obs["foreign_listing_parent"] = _listing(root_path)

    # overwrite="refuse": the strict refusal, on every rank, nothing written.
    accelerate_txn.configure_checkpointing(resumed, overwrite="refuse")
    before = _transaction(output / "checkpoint-2")
    obs["refused"] = _error(lambda: resumed.save_state(str(output / "checkpoint-2")))
    obs["refused_untouched"] = _transaction(output / "checkpoint-2") == before
    obs["listing_after_refusal"] = _listing(output)
    resumed.wait_for_everyone()  # every rank listed before the next save creates its directory

    # Issue 34 item 4: a native checkpoint (library off for this save) that the user added files to, then saved
    # again with the library to the same path: the user's files are carried into the new checkpoint, named.
    accelerate_txn.configure_checkpointing(resumed, overwrite="replace")
    native = output / "checkpoint-3"
    accelerate_txn.unpatch_accelerate_fsdp(resumed)
    resumed.save_state(str(native))
    resumed.wait_for_everyone()
    obs["native_manifest"] = (native / MANIFEST).exists()
    if rank == 0:
        (native / "eval_samples").mkdir()
        (native / "eval_samples" / "sample_0.txt").write_text("sample 0")
        (native / "NOTES.md").write_text("my notes")
    resumed.wait_for_everyone()
    accelerate_txn.patch_accelerate_fsdp(resumed)
    records = WarningRecords()
    logging.getLogger("accelerate_txn").addHandler(records)
    try:
        obs["carry_error"] = _error(lambda: resumed.save_state(str(native)))
    finally:
        logging.getLogger("accelerate_txn").removeHandler(records)
    resumed.wait_for_everyone()
    obs["carry_warnings"] = [m for m in records.messages if m.startswith("Replacing")]
    obs["carried"] = {name: (native / name).read_text() for name in ("NOTES.md", "eval_samples/sample_0.txt")
                      if (native / name).is_file()}
    manifest = json.loads((native / MANIFEST).read_text()) if (native / MANIFEST).is_file() else {}
    obs["carried_listed"] = manifest.get("user_files")
    obs["carried_in_inventory"] = sorted(set(manifest.get("files", {})) & {"NOTES.md", "eval_samples/sample_0.txt"})
    return obs


# --- the kill chain ------------------------------------------------------------------------------------------

#: Files rank 0 adds to a checkpoint directory before a save replaces it: each replacement carries them.
USER_FILES = {"NOTES.md": "my notes", "eval_samples/sample_0.txt": "sample 0"}


def _ref(root: Path, label: str, rank: int) -> Path:
    return root / "refs" / f"{label}.rank{rank}.pt"


def _write_ref(root: Path, label: str, rank: int, state: dict[str, Any]) -> None:
    path = _ref(root, label, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(buffer.getvalue())
    os.replace(temporary, path)


def run(spec: dict[str, Any]) -> None:
    rank = int(os.environ["RANK"])
    root = Path(spec["root"])
    obs_path = Path(spec["obs"]) / f"rank{rank}.json"
    obs: dict[str, Any] = {"loads": {}, "saves": [], "listings": {}}
    if spec.get("no_exchange"):
        from accelerate_txn.store import posix

        posix.exchange = lambda _first, _second: False  # as on a filesystem without RENAME_EXCHANGE
    built = _build(int(spec.get("seed", 0)))
    accelerator, model, optimizer, scheduler = built
    actions = spec["actions"]
    for index, (kind, name, label) in enumerate(actions):
        if kind == "load":
            accelerator.load_state(str(root / name))
            expected = torch.load(_ref(root, label, rank), weights_only=False)  # the test's own file
            obs["loads"][name] = differences(expected, capture(*built))
        else:
            _train(accelerator, model, optimizer, scheduler, 1, seed=100 + index + 10 * len(obs["saves"]))
            _write_ref(root, label, rank, capture(*built))
            if rank == 0 and (root / name).is_dir():  # the user's own files beside the checkpoint being replaced
                for user_file, text in USER_FILES.items():
                    if not (root / name / user_file).exists():
                        (root / name / user_file).parent.mkdir(exist_ok=True)
                        (root / name / user_file).write_text(text)
            if index == len(actions) - 1 and spec.get("kill"):
                os.environ[KILL_ENV] = spec["kill"]
            accelerator.save_state(str(root / name))
            os.environ.pop(KILL_ENV, None)
            obs["saves"].append(name)
            accelerator.wait_for_everyone()
            if rank == 0:
                obs["listings"][name] = _listing(root)  # the directory right after this save
        write_json(obs_path, obs)


def main(spec_path: str) -> None:
    """Entry point of one rank (``tests/scenarios/crash_harness.Job``)."""
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    warnings.filterwarnings("ignore", category=FutureWarning)
    spec = json.loads(Path(spec_path).read_text())
    try:
        run(spec)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
