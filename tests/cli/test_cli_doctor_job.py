"""``accelerate-txn doctor`` judges the job: the settings ``accelerate launch`` and the Trainer would use.

The command line runs in this process (``accelerate_txn.cli.main``, as tests/cli/test_cli_doctor.py does) with the
job's environment set by ``monkeypatch``, Accelerate's default config location in a temporary ``HF_HOME``; one test
runs ``python -m accelerate_txn doctor`` in a subprocess that finds the config file at the default location alone.
What the doctor reads is checked against Accelerate itself: the default location against
``accelerate.commands.config.config_args`` in a fresh interpreter, the variables ``accelerate launch`` exports against
its own launcher functions, and the version and state dict type against a ``FullyShardedDataParallelPlugin`` built in
the same environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from accelerate_txn.cli import main
from accelerate_txn.runtime.protection import STATE_DICT_FIX
from accelerate_txn.runtime.versions import OVERRIDE_ENV, PATCH_ENV

REPO = Path(__file__).resolve().parents[2]
SWITCHES = (PATCH_ENV, OVERRIDE_ENV, "VIDEOX_ACCELERATE_PATCHES", "VIDEOX_ACCELERATE_ALLOW_UNVALIDATED",
            "ACCELERATE_TXN_PROTECT", "VIDEOX_ACCELERATE_PROTECT", "ACCELERATE_TXN_REQUIRE_PROTECTION")
JOB = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "FSDP_VERSION", "FSDP_STATE_DICT_TYPE", "HF_HOME",
       "XDG_CACHE_HOME", "FSDP_CPU_RAM_EFFICIENT_LOADING")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A plain environment: no switch, no job variable, ``HF_HOME`` an empty directory (no default config file)."""
    for name in (*SWITCHES, *JOB):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path


def config(directory: Path, name: str = "accelerate.yaml", *, kind: str = "FSDP", **fsdp: Any) -> Path:
    """An Accelerate config file as ``accelerate config`` writes it (YAML; ``fsdp``: its fsdp_config)."""
    lines = ["compute_environment: LOCAL_MACHINE", "debug: false", f"distributed_type: {kind}",
             "machine_rank: 0", "mixed_precision: 'no'", "num_machines: 1", "num_processes: 2", "use_cpu: false"]
    if fsdp:
        lines.append("fsdp_config:")
        lines += [f"  {key}: {value}" for key, value in fsdp.items()]
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    """Exit status, the JSON report and the text output of the same command."""
    code = main(["doctor", "--json", *args])
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    again = main(["doctor", *args])
    text = capsys.readouterr().out
    assert again == code, text
    assert report["protected"] is (code == 0)
    return code, report, text


def front(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = report["job"]["front_ends"][name]
    return found


def setting(report: dict[str, Any], name: str, key: str) -> tuple[Any, str]:
    found = front(report, name)["settings"][key]
    return found["value"], found["source"]


# --- The Accelerate config file ---------------------------------------------------------------------------------------


def test_local_state_dict_is_not_protected_and_names_the_fix(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    path = config(home, fsdp_version=1, fsdp_state_dict_type="LOCAL_STATE_DICT")
    code, report, text = doctor(capsys, "--config-file", str(path))
    assert code == 1
    job = front(report, "accelerate")
    assert (job["status"], job["protected"], job["path"]) == ("not protected", False, "fsdp1")
    assert job["reason"] == "state_dict_type is LOCAL_STATE_DICT (protected: SHARDED_STATE_DICT and FULL_STATE_DICT)"
    assert job["fix"] == STATE_DICT_FIX
    assert setting(report, "accelerate", "state_dict_type") == ("LOCAL_STATE_DICT",
                                                                f"{path}: fsdp_config.fsdp_state_dict_type")
    assert setting(report, "accelerate", "fsdp_version") == (1, f"{path}: fsdp_config.fsdp_version")
    assert setting(report, "accelerate", "distributed_type") == ("FSDP", f"{path}: distributed_type: FSDP")
    assert report["job"]["config_file"] == str(path) and report["job"]["config_default"] is False
    # The Trainer launched with the same file takes the same plugin, and runs LOCAL_STATE_DICT native too
    # (trainer.patch.native_reason): both front ends fail, naming the same fix.
    trainer = front(report, "trainer")
    assert (trainer["status"], trainer["path"], trainer["fix"]) == ("not protected", "trainer-fsdp1", STATE_DICT_FIX)
    lines = text.splitlines()
    assert ("  Accelerate save_state(): state_dict_type is LOCAL_STATE_DICT (protected: SHARDED_STATE_DICT "
            f"and FULL_STATE_DICT); to protect it: {STATE_DICT_FIX}") in lines, text
    assert f"this job (read from Accelerate config {path}, the environment):" in lines
    assert f"      state dict type: LOCAL_STATE_DICT ({path}: fsdp_config.fsdp_state_dict_type)" in lines
    assert "  Accelerate save_state(): FSDP1 with LOCAL_STATE_DICT (fsdp1 path)" in lines
    assert any(line.startswith("Accelerate FSDP1 ") and line.endswith("protected  (this job's path)")
               for line in lines), text


def test_fsdp1_without_a_state_dict_type_takes_full_state_dict_and_is_protected(
        capsys: pytest.CaptureFixture[str], home: Path) -> None:
    path = config(home, fsdp_sharding_strategy="FULL_SHARD")  # no fsdp_version: accelerate launch's default, 1
    code, report, text = doctor(capsys, "--config-file", str(path))
    assert code == 0, text
    for name, target in (("accelerate", "fsdp1"), ("trainer", "trainer-fsdp1")):
        job = front(report, name)
        assert (job["status"], job["path"], job["reasons"]) == ("protected", target, [])
        assert setting(report, name, "state_dict_type") == ("FULL_STATE_DICT",
                                                            "Accelerate's default for FSDP1 (FSDP_STATE_DICT_TYPE unset)")
        assert setting(report, name, "fsdp_version") == (
            1, f"accelerate launch's default (--fsdp_version 1): {path} has no fsdp_version")
    assert report["required"] == ["fsdp1", "trainer-fsdp1"]
    assert text.splitlines()[-1] == ("protected: this job's checkpoints on Accelerate save_state() (fsdp1) and Trainer "
                                     "(trainer-fsdp1) (exit 0)")


def test_fsdp2_takes_sharded_state_dict_and_is_protected(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    path = config(home, fsdp_version=2, fsdp_reshard_after_forward="true")
    code, report, _ = doctor(capsys, "--config-file", str(path))
    assert code == 0
    assert front(report, "accelerate")["path"] == "fsdp2" and front(report, "trainer")["path"] == "trainer-fsdp2"
    assert setting(report, "accelerate", "state_dict_type") == (
        "SHARDED_STATE_DICT", "Accelerate's default for FSDP2 (FSDP_STATE_DICT_TYPE unset)")
    # An explicit FULL_STATE_DICT (a JSON config file this time) is protected too.
    json_path = home / "fsdp2.json"
    json_path.write_text(json.dumps({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2,
                                     "fsdp_state_dict_type": "FULL_STATE_DICT"}}), encoding="utf-8")
    code, report, _ = doctor(capsys, "--config_file", str(json_path))  # accelerate launch's spelling
    assert code == 0 and front(report, "accelerate")["describes"] == "FSDP2 with FULL_STATE_DICT"


def test_the_environment_decides_where_the_config_file_is_silent(capsys: pytest.CaptureFixture[str], home: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT")
    silent = config(home, "silent.yaml", fsdp_version=1)
    code, report, _ = doctor(capsys, "--config-file", str(silent))
    assert code == 1
    assert setting(report, "accelerate", "state_dict_type") == ("LOCAL_STATE_DICT", "environment: FSDP_STATE_DICT_TYPE")
    assert front(report, "accelerate")["fix"] == STATE_DICT_FIX

    # accelerate launch exports the file's value over the environment's: the file decides, and the doctor says so.
    explicit = config(home, "explicit.yaml", fsdp_version=1, fsdp_state_dict_type="SHARDED_STATE_DICT")
    code, report, text = doctor(capsys, "--config-file", str(explicit))
    assert code == 0, text
    assert setting(report, "accelerate", "state_dict_type") == ("SHARDED_STATE_DICT",
                                                                f"{explicit}: fsdp_config.fsdp_state_dict_type")
    assert report["job"]["notes"] == [
        "the environment's FSDP_STATE_DICT_TYPE=LOCAL_STATE_DICT is replaced: accelerate launch exports "
        f"FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT ({explicit}: fsdp_config.fsdp_state_dict_type)"]

    # Without a config file, the environment Accelerator() reads is the job (torchrun, a cluster's launcher), and a
    # number is read as torch's StateDictType (3: SHARDED_STATE_DICT).
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "3")
    code, report, _ = doctor(capsys)
    assert code == 0 and report["job"]["config_file"] is None
    assert setting(report, "accelerate", "distributed_type") == ("FSDP", "environment: ACCELERATE_USE_FSDP")
    assert setting(report, "accelerate", "state_dict_type") == ("SHARDED_STATE_DICT",
                                                                "environment: FSDP_STATE_DICT_TYPE")


def test_fsdp2_with_local_state_dict_does_not_start(capsys: pytest.CaptureFixture[str], home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT")
    code, report, _ = doctor(capsys)
    assert code == 1
    for name in ("accelerate", "trainer"):
        assert front(report, name)["reasons"] == [{
            "reason": "Accelerate refuses LOCAL_STATE_DICT with FSDP2 (FSDP2 does not support it): the job does not "
                      "start", "fix": STATE_DICT_FIX}]


def test_automatic_dispatch_off_is_not_protected(capsys: pytest.CaptureFixture[str], home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATCH_ENV, "0")
    path = config(home, fsdp_version=1, fsdp_state_dict_type="SHARDED_STATE_DICT")
    code, report, text = doctor(capsys, "--config-file", str(path))
    assert code == 1
    assert front(report, "accelerate")["reasons"] == [{
        "reason": f"automatic dispatch is off ({PATCH_ENV}=0)",
        "fix": f"unset {PATCH_ENV} (or set it to 1), or opt this Accelerator in with patch_accelerate_fsdp()"}]
    assert front(report, "trainer")["reasons"] == [{"reason": f"automatic dispatch is off ({PATCH_ENV}=0)",
                                                    "fix": f"unset {PATCH_ENV} (or set it to 1)"}]
    assert text.splitlines()[-3] == "NOT protected: this job's checkpoints on Accelerate save_state(), Trainer (exit 1)"

    # Named as it was set: the older spelling.
    monkeypatch.delenv(PATCH_ENV)
    monkeypatch.setenv("VIDEOX_ACCELERATE_PATCHES", "off")
    code, report, _ = doctor(capsys, "--config-file", str(path))
    assert code == 1 and front(report, "accelerate")["fix"].startswith("unset VIDEOX_ACCELERATE_PATCHES (or set it")


def test_one_process_and_ddp_need_protect_all_on_the_accelerate_front_end(
        capsys: pytest.CaptureFixture[str], home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = config(home, kind="MULTI_GPU")
    code, report, text = doctor(capsys, "--config-file", str(path))
    assert code == 1
    assert front(report, "accelerate")["reasons"] == [{
        "reason": "MULTI_GPU checkpoints are protected only with protect='all'",
        "fix": "configure_checkpointing(accelerator, protect='all') or ACCELERATE_TXN_PROTECT=all"}]
    assert front(report, "accelerate")["path"] == "ddp"
    assert front(report, "trainer")["status"] == "protected"  # the Trainer protects one process and DDP always
    code, report, _ = doctor(capsys, "--config-file", str(path), "--require", "trainer")
    assert code == 0 and report["required"] == ["trainer-ddp"]

    monkeypatch.setenv("ACCELERATE_TXN_PROTECT", "all")
    code, report, text = doctor(capsys, "--config-file", str(path))
    assert code == 0, text and report["protect"] == "all"
    assert "protect (ACCELERATE_TXN_PROTECT): all: one process and DDP too" in text.splitlines()


def test_deepspeed_is_not_protected(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    path = config(home, kind="DEEPSPEED")
    code, report, _ = doctor(capsys, "--config-file", str(path))
    assert code == 1
    assert front(report, "accelerate")["reason"] == "the distributed type DEEPSPEED is not protected"
    assert front(report, "trainer")["reason"] == "DeepSpeed writes its own checkpoint layout (native Trainer)"
    assert setting(report, "trainer", "distributed_type") == ("DEEPSPEED", f"{path}: distributed_type: DEEPSPEED")


def test_a_path_required_must_be_the_one_the_job_takes(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    path = config(home, fsdp_version=1, fsdp_state_dict_type="SHARDED_STATE_DICT")
    code, report, _ = doctor(capsys, "--config-file", str(path), "--require", "fsdp1")
    assert code == 0 and report["required"] == ["fsdp1"] and front(report, "trainer")["required"] is False
    code, report, text = doctor(capsys, "--config-file", str(path), "--require", "fsdp2")
    assert code == 1
    assert front(report, "accelerate")["reasons"] == [{
        "reason": "this job takes the fsdp1 path, not fsdp2 (--require)",
        "fix": "ask for it (--require fsdp1), or change the job's settings to take fsdp2"}]
    assert text.splitlines()[-1] == ("  Accelerate save_state(): this job takes the fsdp1 path, not fsdp2 (--require); "
                                     "to protect it: ask for it (--require fsdp1), or change the job's settings to take "
                                     "fsdp2")


def test_strict_mode_says_the_first_save_raises(capsys: pytest.CaptureFixture[str], home: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_TXN_REQUIRE_PROTECTION", "1")
    path = config(home, fsdp_version=1, fsdp_state_dict_type="LOCAL_STATE_DICT")
    code, report, text = doctor(capsys, "--config-file", str(path), "--require", "accelerate")
    assert code == 1 and report["strict"] is True
    assert text.splitlines()[-1] == ("  strict mode (ACCELERATE_TXN_REQUIRE_PROTECTION): the first save or load "
                                     "raises CheckpointUnprotectedError instead of running native")


# --- The Trainer's fsdp_config ---------------------------------------------------------------------------------------


def test_a_trainer_fsdp_config_with_local_state_dict_is_not_protected(capsys: pytest.CaptureFixture[str],
                                                                      home: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    code, report, text = doctor(capsys, "--fsdp-config", '{"state_dict_type": "LOCAL_STATE_DICT"}')
    assert code == 1
    job = front(report, "trainer")
    assert job["required"] is True and front(report, "accelerate")["required"] is False  # a Trainer's job
    assert setting(report, "trainer", "state_dict_type") == ("LOCAL_STATE_DICT",
                                                             "Trainer fsdp_config (--fsdp-config): state_dict_type")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # set by TrainingArguments: undone after the test
    plugin = getattr(transformers.TrainingArguments(output_dir=str(home / "out"), fsdp=True, fsdp_config={},
                                                    report_to=[]), "fsdp_plugin_args", None)
    if plugin is not None and plugin.get("fsdp_version") == 2:  # the release's default: FSDP2, which refuses LOCAL
        assert job["reasons"] == [{"reason": "Accelerate refuses LOCAL_STATE_DICT with FSDP2 (FSDP2 does not support "
                                             "it): the job does not start", "fix": STATE_DICT_FIX}]
        assert setting(report, "trainer", "fsdp_version") == (
            2, f"transformers {transformers.__version__}'s default (Trainer fsdp_config (--fsdp-config) has no "
               "version)")
    assert text.splitlines()[-2] == "NOT protected: this job's checkpoints on Trainer (exit 1)"
    assert "  Accelerate save_state(): one process or DDP (ddp path)  (not required)" in text.splitlines()


def test_a_trainer_fsdp_config_file_with_sharded_state_dict_is_protected(capsys: pytest.CaptureFixture[str],
                                                                         home: Path) -> None:
    path = home / "fsdp.json"  # the keys with the fsdp_ prefix TrainingArguments strips
    path.write_text(json.dumps({"fsdp_version": 1, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}), encoding="utf-8")
    code, report, text = doctor(capsys, "--fsdp-config", str(path))
    assert code == 0, text
    assert front(report, "trainer")["path"] == "trainer-fsdp1"
    assert setting(report, "trainer", "state_dict_type") == ("SHARDED_STATE_DICT",
                                                             f"Trainer fsdp_config ({path}): state_dict_type")
    assert report["required"] == ["trainer-fsdp1"]
    assert os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") is None  # TrainingArguments ran in the job's environment


# --- Where the config file is, and usage errors -----------------------------------------------------------------------


def test_the_default_location_is_accelerates(tmp_path: Path) -> None:
    from accelerate_txn.cli._job import default_config_file

    clean = {key: value for key, value in os.environ.items() if key not in (*SWITCHES, *JOB)}
    cases = {"hf": {"HF_HOME": str(tmp_path / "hf")}, "xdg": {"XDG_CACHE_HOME": str(tmp_path / "xdg")},
             "home": {"HOME": str(tmp_path / "home")}}
    script = "from accelerate.commands.config.config_args import default_config_file; print(default_config_file)"
    processes = {name: subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                        env={**clean, **extra}) for name, extra in cases.items()}
    for name, process in processes.items():
        stdout, _ = process.communicate(timeout=120)
        assert process.returncode == 0
        assert stdout.strip() == str(default_config_file({**clean, **cases[name]})), name


def test_the_real_cli_finds_the_config_file_at_the_default_location(tmp_path: Path) -> None:
    path = config(tmp_path / "hf" / "accelerate", "default_config.yaml", fsdp_version=1,
                  fsdp_state_dict_type="LOCAL_STATE_DICT")
    environment = {key: value for key, value in os.environ.items() if key not in (*SWITCHES, *JOB)}
    environment.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "accelerate_txn", "doctor", "--require", "accelerate"],
                            capture_output=True, text=True, cwd=REPO, env=environment, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert f"this job (read from Accelerate config {path} (Accelerate's default location), the environment):" in lines
    assert lines[-1].startswith("  Accelerate save_state(): state_dict_type is LOCAL_STATE_DICT")
    assert "Traceback" not in result.stderr


def test_a_missing_or_bad_config_file_is_a_usage_error(capsys: pytest.CaptureFixture[str], home: Path) -> None:
    missing = home / "nowhere.yaml"
    assert main(["doctor", "--json", "--config-file", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{missing}: no such file" in captured.err and "--config-file" in captured.err
    assert "Traceback" not in captured.err

    bad = home / "bad.yaml"
    bad.write_text("mixed_precision: bf16\n", encoding="utf-8")
    assert main(["doctor", "--config-file", str(bad)]) == 2
    captured = capsys.readouterr()
    assert f"{bad}: not an Accelerate config file: it has no distributed_type" in captured.err

    # At the default location too: accelerate launch would refuse it.
    default = home / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("[unclosed\n", encoding="utf-8")
    assert main(["doctor"]) == 2
    assert f"{default}: not YAML" in capsys.readouterr().err
    default.unlink()

    assert main(["doctor", "--fsdp-config", "{not json"]) == 2
    assert "is neither a file nor a JSON object" in capsys.readouterr().err


# --- What the doctor reads is what Accelerate does --------------------------------------------------------------------


@pytest.mark.parametrize(("fsdp", "environment"), [
    ({}, {}),
    ({"fsdp_version": 2}, {"FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT"}),
    ({"fsdp_version": 1, "fsdp_state_dict_type": "SHARDED_STATE_DICT"}, {"FSDP_STATE_DICT_TYPE": "LOCAL_STATE_DICT",
                                                                         "FSDP_VERSION": "2"}),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, {}),  # launch adds the fsdp_ prefix
])
def test_the_launch_environment_and_plugin_are_accelerates(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                           fsdp: dict[str, Any], environment: dict[str, str]) -> None:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    from accelerate_txn.cli._job import accelerate_job, read_inputs

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    path = config(home, **fsdp)
    inputs = read_inputs(str(path), None, os.environ)
    job = accelerate_job(inputs)

    args, _defaults, _mixed = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(path), "train.py"]))
    launched = prepare_multi_gpu_env(args)
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_STATE_DICT_TYPE"):
        assert inputs.environment.get(name) == launched.get(name), name
    for name, value in launched.items():  # the environment the launched script starts with
        monkeypatch.setenv(name, value)
    # Both off: syncing module states needs an accelerator device (CPU here); neither touches what is compared.
    plugin = FullyShardedDataParallelPlugin(sync_module_states=False, cpu_ram_efficient_loading=False)
    assert job.fsdp_version is not None and job.state_dict_type is not None
    assert (job.fsdp_version.value, job.state_dict_type.value) == (plugin.fsdp_version, plugin.state_dict_type.name)
