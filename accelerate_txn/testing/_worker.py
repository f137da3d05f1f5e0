"""One worker of the script launcher: run a training script as ``python script.py ARGS`` would, on FSDP on CPU.

Started by ``_launcher.py`` as a file, ``python .../_worker.py SETTINGS SCRIPT ARGS...`` (or ``SETTINGS -m MODULE
ARGS...``), with torchrun's environment. It

1. puts ``sys.path`` as Python would for the script (its directory first; for ``-m``, the working directory) and
   appends the directory holding this ``accelerate_txn``, so that the script's ``import accelerate_txn`` finds the
   launcher's copy when nothing earlier on the path provides one;
2. imports Accelerate and wraps ``Accelerator.__init__``: every Accelerator the script constructs gets ``cpu=True``
   and then FSDP, with the plugin ``_cpu_fsdp.plugin_for_script`` makes of the script's own ``fsdp_plugin`` and the
   launcher's SETTINGS; ``FullyShardedDataParallelPlugin.__init__`` is wrapped so that a plugin the script builds
   with ``sync_module_states`` or ``cpu_ram_efficient_loading`` (both need a GPU) gets them off; and, once the
   script imports transformers' ``training_args``, every ``TrainingArguments`` (TRL's configs are subclasses) gets
   ``use_cpu=True`` (:func:`run_training_arguments_on_cpu`), so a Trainer script joins the gloo job and its
   Trainer's ``Accelerator`` is wrapped like any other;
3. runs the script as ``__main__``: a fresh module with the script's ``__file__`` and loader, ``sys.argv`` =
   ``[script, *args]``, compiled without this file's ``__future__`` flags; ``-m`` goes through ``runpy`` as
   ``python -m`` does. Its exit status, exceptions and tracebacks are the script's: an exception nothing caught is
   printed by ``sys.excepthook`` from the script's first frame on, without this file's and ``runpy``'s frames
   (:func:`report_uncaught`), and the worker exits 1, as ``python`` does.

A setting the harness refuses (``_cpu_fsdp``'s ``CheckpointConfigurationError``: a ``FULL_STATE_DICT`` plugin of the
script, a contradicting ``--fsdp-version``, an ``--auto-wrap`` class that does not import) is not a failure of the
script: :func:`refuse` writes the message to the file the launcher names (``_cpu_fsdp.REFUSAL_FILE_ENV``) and exits
with status 2; the launcher reports it once, as one line, for the whole job.

What it must not do: import the ``accelerate_txn`` package. Its ``__init__`` installs the checkpoint patch, and only
the script's own ``import accelerate_txn`` may do that (so a script runs native without the import, protected with
it). So it loads ``_cpu_fsdp.py`` by path, and imports nothing of the package. The other additions: a lifeline
(``_lifeline.py``, loaded by path too: the worker kills itself and its process group when the launcher ends, ``kill
-9`` included), a ``faulthandler`` on ``SIGUSR1`` (the launcher asks for every thread's stack before killing a job
that timed out), and the end of a script that succeeded (:func:`end_after_exit_handlers`): the interpreter's exit steps run as
``python`` runs them (non-daemon threads joined, ``threading`` exit hooks, ``atexit`` handlers), then the streams are
flushed and the worker exits with status 0 without tearing the interpreter down. That teardown is where PyTorch's gloo
worker threads can abort a process that finished ("terminate called without an active exception", SIGABRT, rank
by rank and at random: pytorch/pytorch#179291), which would fail a run that did everything it had to. A script
that fails (an exception, a non-zero ``sys.exit``) ends exactly as under ``python``.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import faulthandler
import importlib
import importlib.machinery
import importlib.util
import json
import os
import runpy
import signal
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
PACKAGE_PARENT = str(HERE.parents[1])  # the directory that holds this copy of accelerate_txn
CPU_FSDP_NAME = "accelerate_txn_launcher_cpu_fsdp"  # _cpu_fsdp.py loaded by path: not under accelerate_txn
LIFELINE_NAME = "accelerate_txn_launcher_lifeline"  # _lifeline.py, likewise
USAGE_ERROR = 2


def load_by_path(name: str, file: str) -> types.ModuleType:
    """``file`` of this folder as a stand-alone module ``name`` (importing it under ``accelerate_txn`` would install
    the patch)."""
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_cpu_fsdp() -> types.ModuleType:
    """``_cpu_fsdp.py`` as a stand-alone module."""
    return load_by_path(CPU_FSDP_NAME, "_cpu_fsdp.py")


def watch_lifeline() -> None:
    """End with the launcher, however it ends (``kill -9`` too): see ``_lifeline.py``. The variable is removed, so
    the script and what it starts do not see it."""
    lifeline = load_by_path(LIFELINE_NAME, "_lifeline.py")
    fd = os.environ.pop(lifeline.LIFELINE_FD_ENV, "")
    if fd.isdigit():
        lifeline.watch(int(fd))


#: The file the launcher reads a refusal from (``_cpu_fsdp.REFUSAL_FILE_ENV``, taken out of the environment by
#: :func:`main` so that the script and what it starts do not see it); empty when started without one.
_REFUSAL_FILE: list[str] = []


def refuse(message: str) -> NoReturn:
    """End this worker with exit status 2 for a setting the harness cannot run: the launcher reports ``message`` once
    for the whole job, as one line (it is what is refused and the fix, not a failure of the script, so no traceback).
    Raised as ``SystemExit`` where the refusal is found (inside the script's ``Accelerator(...)``), so the script's
    ``finally`` blocks and exit handlers run as at any exit."""
    line = " ".join(message.split())
    if _REFUSAL_FILE:
        staged = Path(_REFUSAL_FILE[0] + ".tmp")
        staged.write_text(line + "\n", encoding="utf-8")
        staged.replace(_REFUSAL_FILE[0])  # whole or absent, however this process ends
    else:  # started by hand, without a launcher to report it
        sys.stderr.write(f"accelerate_txn.testing run: error: {line}\n")
    raise SystemExit(USAGE_ERROR)


@contextlib.contextmanager
def refusals(cpu_fsdp: types.ModuleType) -> Iterator[None]:
    """Around the harness's own code (``_cpu_fsdp``'s functions): its refusals end the worker by :func:`refuse`;
    any other error (Accelerate's, torch's) propagates into the script's traceback."""
    try:
        yield
    except Exception as error:
        if cpu_fsdp.is_refusal(error):
            refuse(str(error))
        raise


def resolve_auto_wrap(setting: str, cpu_fsdp: types.ModuleType) -> Any:
    """The module class named by the launcher's ``auto_wrap`` (imported from the script's ``sys.path``)."""
    if setting == "keep":
        return cpu_fsdp.KEEP_SCRIPT_POLICY
    if setting == "none":
        return None
    module, _, name = setting.rpartition(".")
    try:
        kind = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        refuse(f"auto_wrap={setting!r} (--auto-wrap {setting}): cannot import it ({exc}). Give the import path of a "
               "module class, e.g. torch.nn.Linear or mymodel.Block, importable from the script's directory.")
    if not isinstance(kind, type):
        refuse(f"auto_wrap={setting!r} (--auto-wrap {setting}): {kind!r} is not a class. Give the import path of a "
               "module class, e.g. torch.nn.Linear or mymodel.Block.")
    return kind


def force_fsdp_on_every_accelerator(settings: dict[str, Any], cpu_fsdp: types.ModuleType, auto_wrap: Any) -> None:
    """Wrap ``Accelerator.__init__`` and ``FullyShardedDataParallelPlugin.__init__`` (see the module docstring)."""
    import inspect

    import accelerate.accelerator
    import accelerate.utils.dataclasses
    import wrapt

    def accelerator_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        with refusals(cpu_fsdp):
            plugin = cpu_fsdp.plugin_for_script(
                bound.arguments.pop("fsdp_plugin", None), fsdp_version=settings["fsdp_version"],
                state_dict_type=settings["state_dict_type"], auto_wrap=auto_wrap)
            # Accelerate refuses a ParallelismConfig (given, or from accelerate launch's environment) on MULTI_CPU:
            # the Accelerator is built without one, and force_fsdp builds its mesh on CPU.
            parallelism = cpu_fsdp.parallelism_for_cpu(bound.arguments.pop("parallelism_config", None))
        bound.arguments["cpu"] = True
        with cpu_fsdp.no_parallelism_environment():
            result = wrapped(*bound.args, **bound.kwargs)
        with refusals(cpu_fsdp):
            cpu_fsdp.force_fsdp(instance, plugin, parallelism)
            cpu_fsdp.hybrid_nodes(instance, plugin)  # FSDP1 HYBRID_SHARD: emulated nodes (RANKS_PER_NODE_ENV)
        return result

    def plugin_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        for name in ("sync_module_states", "cpu_ram_efficient_loading"):
            if bound.arguments.get(name):
                bound.arguments[name] = False
        return wrapped(*bound.args, **bound.kwargs)

    wrapt.wrap_function_wrapper(accelerate.accelerator, "Accelerator.__init__", accelerator_init)
    wrapt.wrap_function_wrapper(accelerate.utils.dataclasses, "FullyShardedDataParallelPlugin.__init__", plugin_init)


def run_training_arguments_on_cpu() -> None:
    """Every ``TrainingArguments`` (and subclass: TRL's configs) gets ``use_cpu=True`` before its own checks, once
    the script imports transformers' ``training_args`` (a post-import hook: a script without transformers never
    loads it). Without it, a GPU-less ``TrainingArguments`` sets up a 1-process job or a mismatched gloo group, and
    ``bf16`` (TRL's default) is refused; with it, ``TrainingArguments`` joins the launcher's gloo job, and the
    Trainer's ``Accelerator`` gets FSDP like any other (Trainer reads ``is_fsdp_enabled`` from its plugin)."""
    import wrapt

    def post_init(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        instance.use_cpu = True
        return wrapped(*args, **kwargs)

    def patch(module: types.ModuleType) -> None:
        wrapt.wrap_function_wrapper(module, "TrainingArguments.__post_init__", post_init)

    wrapt.register_post_import_hook(patch, "transformers.training_args")


def run_file(path: str, args: list[str]) -> None:
    """Execute ``path`` as ``python path ARGS`` does: a new ``__main__`` module, ``sys.argv = [path, *args]``."""
    absolute = os.path.abspath(path)
    code = compile(Path(path).read_bytes(), absolute, "exec", dont_inherit=True)  # honours a coding cookie
    script = types.ModuleType("__main__")  # __spec__ and __package__ None, as for python script.py
    script.__file__ = absolute
    script.__cached__ = None  # type: ignore[attr-defined]
    script.__loader__ = importlib.machinery.SourceFileLoader("__main__", absolute)
    script.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = script  # pickling, multiprocessing and `import __main__` see the script
    sys.argv[:] = [path, *args]
    exec(code, script.__dict__)


#: Set once the script has returned (or exited 0): :func:`end_after_exit_handlers` then skips the teardown.
_SUCCEEDED: list[bool] = []


def end_after_exit_handlers() -> None:
    """The last ``atexit`` handler (registered before the script runs: handlers run newest first). By then ``python``
    has joined the non-daemon threads, run ``threading``'s exit hooks and every other ``atexit`` handler, as at any
    exit. If the script succeeded, flush the streams and exit 0 without the interpreter's teardown (see the module
    docstring; ``os._exit`` is the documented way to end without it); otherwise return: ``python`` ends as usual."""
    if not _SUCCEEDED:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: python would ignore it at exit too
            pass
    os._exit(0)


def main() -> None:
    watch_lifeline()
    settings = json.loads(sys.argv[1])
    target = sys.argv[2:]
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    module = target[0] == "-m"
    if not getattr(sys.flags, "safe_path", False):  # (3.11+) python put this file's directory first; the script's
        # directory belongs there (python -m: the working directory)
        sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(target[0]))
    if PACKAGE_PARENT not in sys.path:
        sys.path.append(PACKAGE_PARENT)
    cpu_fsdp = load_cpu_fsdp()
    _REFUSAL_FILE[:] = filter(None, [os.environ.pop(cpu_fsdp.REFUSAL_FILE_ENV, "")])
    auto_wrap = resolve_auto_wrap(settings["auto_wrap"], cpu_fsdp)
    force_fsdp_on_every_accelerator(settings, cpu_fsdp, auto_wrap)
    run_training_arguments_on_cpu()
    if module:
        sys.argv[:] = [target[1], *target[2:]]  # runpy replaces argv[0] with the module's file, as python -m does
        # python -m runs in the existing __main__, whose __builtins__ is the module (a fresh dict would get the dict)
        try:
            runpy.run_module(target[1], init_globals={"__builtins__": builtins}, run_name="__main__", alter_sys=True)
        except ImportError as error:
            if script_frames(error.__traceback__) is not None:  # raised by the module's own code: the script's error
                raise
            refuse(f"-m {target[1]}: {error}. Give a module importable from the working directory {os.getcwd()} "
                   "(as for python -m), or a script's path without -m.")
    else:
        run_file(target[0], target[1:])


def script_frames(traceback: types.TracebackType | None) -> types.TracebackType | None:
    """``traceback`` from its first frame that is neither this file's nor ``runpy``'s (how the worker reached the
    script) on: where the script's own frames start; None if it has none."""
    launcher = (globals(), vars(runpy))
    first = traceback
    while first is not None and any(first.tb_frame.f_globals is namespace for namespace in launcher):
        first = first.tb_next
    return first


def from_the_script_on(traceback: types.TracebackType | None) -> types.TracebackType | None:
    """``traceback`` without its leading frames of this file and of ``runpy`` (:func:`script_frames`), so that it
    starts at the script's first frame, as under ``python script.py``. Unchanged if nothing else is in it (an error
    of the worker itself)."""
    return script_frames(traceback) or traceback


def report_uncaught(error: BaseException) -> None:
    """What ``python`` does with an exception nothing caught: ``sys.excepthook`` (the script's own, if it set one)
    prints it, from the script's first frame on (:func:`from_the_script_on`)."""
    error.__traceback__ = from_the_script_on(error.__traceback__)
    try:
        sys.excepthook(type(error), error, error.__traceback__)
    except BaseException as hook_error:  # as python does when its hook fails: both, by the default hook
        sys.stderr.write("Error in sys.excepthook:\n")
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(type(error), error, error.__traceback__)


if __name__ == "__main__":
    atexit.register(end_after_exit_handlers)  # before the script registers any: it runs after all of theirs
    try:
        main()
    except SystemExit as exit_request:
        if exit_request.code not in (None, 0):
            raise
    except KeyboardInterrupt:  # python's own ending: the traceback, then death by SIGINT after the exit handlers
        raise
    except BaseException as uncaught:
        report_uncaught(uncaught)
        raise SystemExit(1) from None  # python's exit status for an uncaught exception
    _SUCCEEDED.append(True)
