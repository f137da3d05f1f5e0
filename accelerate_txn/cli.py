"""``accelerate-txn``: inspect and export checkpoints from the command line (offline, one CPU process).

Imported only by the console script, never by the library.

    accelerate-txn verify CHECKPOINT [--full]      is it complete and intact? (exit 0 yes, 1 no)
    accelerate-txn latest DIRECTORY                 newest complete checkpoint_N (exit 1 if none)
    accelerate-txn export CHECKPOINT CONFIG OUT     model DCP -> Diffusers sharded safetensors
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import CheckpointError


def _verify(args: argparse.Namespace) -> int:
    from ._manifest import read_manifest, verify_manifest

    path = Path(args.checkpoint)
    manifest = read_manifest(path)
    if manifest is None:
        print(f"{path}: no checkpoint_manifest.json: not a complete accelerate-txn checkpoint", file=sys.stderr)
        return 1
    verify_manifest(path, manifest, full=args.full)
    hashed = "every recorded hash" if args.full else "sizes and control-file hashes"
    print(f"{path}: complete (run {manifest['run_id']}, {len(manifest['files'])} files; checked {hashed})")
    if args.json:
        print(json.dumps({"components": sorted(manifest.get("components", {})), "versions": manifest.get("versions"),
                          "steps": manifest.get("steps")}, sort_keys=True))
    return 0


def _latest(args: argparse.Namespace) -> int:
    from ._select import latest_training_checkpoint

    found = latest_training_checkpoint(args.directory)
    if found is None:
        print(f"{args.directory}: no checkpoints", file=sys.stderr)
        return 1
    print(found)
    return 0


def _export(args: argparse.Namespace) -> int:
    import torch

    from .weights import export_dcp_to_diffusers

    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.dtype and not isinstance(dtype, torch.dtype):
        print(f"--dtype {args.dtype!r} is not a torch dtype (e.g. bfloat16, float16, float32)", file=sys.stderr)
        return 2
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    out = export_dcp_to_diffusers(args.checkpoint, Path(args.config), args.output, size, dtype=dtype)
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accelerate-txn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check a checkpoint against its manifest")
    verify.add_argument("checkpoint")
    verify.add_argument("--full", action="store_true", help="also re-hash payloads hashed at save time")
    verify.add_argument("--json", action="store_true", help="also print components, versions and steps as JSON")
    verify.set_defaults(run=_verify)
    latest = commands.add_parser("latest", help="print the newest complete checkpoint_N in a directory")
    latest.add_argument("directory")
    latest.set_defaults(run=_latest)
    export = commands.add_parser("export", help="export a checkpoint's model to Diffusers sharded safetensors")
    export.add_argument("checkpoint", help="checkpoint directory (with pytorch_model_fsdp_0/) or a DCP directory")
    export.add_argument("config", help="model config.json (or its directory) to ship with the weights")
    export.add_argument("output")
    export.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB, or a number of bytes")
    export.add_argument("--dtype", help="cast floating tensors, e.g. bfloat16")
    export.set_defaults(run=_export)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")  # e.g. why a candidate was skipped
    try:
        return int(args.run(args))
    except CheckpointError as exc:
        print(f"accelerate-txn {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
