"""Commit a two-stage adapter as its trained stage only, and rebuild the full adapter from it, bit for bit.

An RL run from a cold start saves one stacked PEFT adapter (``vpo_lightning.generation.adapters``): the cold start's
ranks, then the trained LoRA's. For the maze that is 58.7 MB, of which the cold start's 39.1 MB is committed once
already under ``docs/results/maze-settled/coldstart/adapter``; every recorded RL adapter repeated it (issue 50: a
submission of five runs was refused for its size). ``split`` keeps only the trained ranks (19.6 MB for r 16 in fp32,
the precision they were trained in: not rounded), with the full file's SHA-256; ``rebuild`` stacks them on the
start adapter again and refuses a result whose SHA-256 differs.

    python benchmarks/adapter_delta.py split checkpoints/<run>/adapters/step=20 \\
        --start docs/results/maze-settled/coldstart/adapter --out docs/results/maze-settled/<run>/adapter-delta
    python benchmarks/adapter_delta.py rebuild docs/results/maze-settled/<run>/adapter-delta --out /tmp/adapter
    vpo eval --adapter /tmp/adapter ...       # the adapter the run saved, byte-equal

The delta folder: ``trained_lora.safetensors`` (the trained ranks, scale 1), ``delta.json`` (the start adapter's
path and SHA-256, the full weights' SHA-256), and the full adapter's ``adapter_config.json``, ``vpo_adapter.json``
and ``README.md`` as they were. Not part of CI; tested in ``tests/test_artifacts.py``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

WEIGHTS = "adapter_model.safetensors"
TRAINED = "trained_lora.safetensors"
DELTA = "delta.json"
SIDE_FILES = ("adapter_config.json", "vpo_adapter.json", "README.md")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fail(message: str) -> int:
    print(f"adapter_delta: {message}", file=sys.stderr)
    return 2


def _restacked_into(tmp: Path, start: Path, trained: Path, want: str) -> bool:
    """Write ``tmp/adapter_model.safetensors`` = ``start`` restacked with the trained ranks in ``trained``; True when
    its SHA-256 is ``want``. The one serialisation both directions use, so a rebuild is byte-equal to the split."""
    from safetensors.torch import load_file

    from vpo_lightning.generation.adapters import restack, save_stacked

    save_stacked(restack(start, load_file(str(trained))), tmp / WEIGHTS)
    return sha256(tmp / WEIGHTS) == want


def _fresh(out: Path) -> Path:
    """An empty temporary folder beside ``out`` (renamed into place at the end: nothing half-written at ``out``)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, source: Path, out: Path) -> None:
    """Copy ``source``'s side files into ``tmp`` and move ``tmp`` to ``out``."""
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def split(full: Path, start: Path, out: Path) -> int:
    """Write ``out`` (the delta folder) from the adapter folder ``full``; checks the rebuild before writing."""
    from safetensors.torch import load_file, save_file

    from vpo_lightning.generation.adapters import split_stacked

    if not (full / WEIGHTS).is_file():
        return _fail(f"{full}: no {WEIGHTS}: give an adapter folder (checkpoints/<run>/adapters/step=N)")
    if not (start / WEIGHTS).is_file():
        return _fail(f"--start {start}: no {WEIGHTS}: give the run's start adapter (its model.model.adapter)")
    try:
        trained = split_stacked(load_file(str(full / WEIGHTS)), start)
    except ValueError as err:
        return _fail(f"{full}: {err}")
    tmp = _fresh(out)
    save_file(trained, str(tmp / TRAINED), metadata={"format": "pt"})
    want = sha256(full / WEIGHTS)
    if not _restacked_into(tmp, start, tmp / TRAINED, want):
        shutil.rmtree(tmp)
        return _fail(f"{full}: the rebuilt weights differ from the saved ones; nothing written")
    (tmp / WEIGHTS).unlink()
    facts = {"start_adapter": str(start), "start_sha256": sha256(start / WEIGHTS), "full_sha256": want,
             "full_bytes": (full / WEIGHTS).stat().st_size,
             "rebuild": f"python benchmarks/adapter_delta.py rebuild {out} --out <folder>"}
    (tmp / DELTA).write_text(json.dumps(facts, indent=1) + "\n")
    _finish(tmp, full, out)
    print(f"{out}: {(out / TRAINED).stat().st_size / 1e6:.1f} MB for {facts['full_bytes'] / 1e6:.1f} MB "
          f"(sha256 {want[:12]} rebuilt and checked)")
    return 0


def rebuild(delta: Path, out: Path, start: Path | None = None) -> int:
    """Write the full adapter folder ``out`` from the delta folder ``delta``; refuses a SHA-256 mismatch."""
    if not (delta / DELTA).is_file():
        return _fail(f"{delta}: no {DELTA}: give a folder written by `adapter_delta.py split`")
    facts = json.loads((delta / DELTA).read_text())
    start = start or Path(facts["start_adapter"])
    if not (start / WEIGHTS).is_file():
        return _fail(f"start adapter {start}: no {WEIGHTS} (run from the repository root, or pass --start)")
    if sha256(start / WEIGHTS) != facts["start_sha256"]:
        return _fail(f"start adapter {start}: its SHA-256 is not the one {delta / DELTA} records")
    tmp = _fresh(out)
    if not _restacked_into(tmp, start, delta / TRAINED, facts["full_sha256"]):
        shutil.rmtree(tmp)
        return _fail(f"{delta}: the rebuilt weights' SHA-256 is not the recorded one; nothing written")
    _finish(tmp, delta, out)
    print(f"{out}: rebuilt, sha256 {facts['full_sha256'][:12]} checked")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="an adapter folder -> its trained ranks (a delta folder)")
    s.add_argument("full", type=Path)
    s.add_argument("--start", type=Path, required=True, help="the start adapter the run stacked on")
    s.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("rebuild", help="a delta folder -> the full adapter folder")
    r.add_argument("delta", type=Path)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--start", type=Path, default=None, help="[the path delta.json records]")
    args = p.parse_args(argv)
    if args.command == "split":
        return split(args.full, args.start, args.out)
    return rebuild(args.delta, args.out, args.start)


if __name__ == "__main__":
    raise SystemExit(main())
