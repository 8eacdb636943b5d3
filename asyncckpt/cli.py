"""The ``asyncckpt`` command: list, inspect and verify checkpoints.

``asyncckpt list DIR``, ``asyncckpt inspect DIR [STEP]`` and
``asyncckpt verify DIR [STEP]`` work on TensorFlow and JAX checkpoint
directories alike, local or ``s3://`` / ``gs://`` URLs (only committed
checkpoints are listed; ``inspect`` and ``verify`` download the checkpoints
they look at into a temporary directory). ``inspect`` and ``verify`` also
take one checkpoint's own path or URL: a TensorFlow prefix, a step
directory, or (locally) the path a JAX checkpointer saved to. ``verify`` exits with 0
only if every checked checkpoint matches its manifest (and, for a whole
directory, every checkpoint its TensorFlow ``checkpoint`` state file names is
there), and both exit with 1 where there is no checkpoint. The benchmarks are
not part of the package: they run from a source checkout (``python -m
benchmarks``); ``asyncckpt bench``, their old entry point, only says so.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time

from asyncckpt import catalog, layout
from asyncckpt.errors import CheckpointNotFoundError, CorruptCheckpointError


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _remote_list(url: str):
    from asyncckpt.storage.protocol import list_committed
    from asyncckpt.storage.stores import open_store

    store = open_store(url)
    return store, list_committed(store)


@contextlib.contextmanager
def _local_view(args: argparse.Namespace):
    """``args.dir`` itself, or for a URL a temporary directory with the selected checkpoints."""
    from asyncckpt.storage.url import is_url

    if not is_url(args.dir):
        yield args.dir
        return
    from asyncckpt.storage import RetryPolicy
    from asyncckpt.storage.protocol import download_checkpoint

    store, found = _remote_list(args.dir)
    if not found and args.step is None:
        # Not a directory of checkpoints: perhaps one checkpoint's own URL
        # (``s3://bucket/run/ckpt-3``, ``gs://bucket/run/20``), as locally.
        parent, _, name = args.dir.rstrip("/").rpartition("/")
        if name and "://" in parent:  # not the bucket itself
            parent_store, siblings = _remote_list(parent)
            one = [c for c in siblings if c.name == name]
            if one:
                store, found = parent_store, one
    which = args.step
    if which is not None:
        found = [c for c in found if c.name == which or (which.isdigit() and c.step == int(which))]
        if not found:
            raise CheckpointNotFoundError(f"no committed checkpoint {which!r} in {args.dir!r}")
    elif args.command == "inspect":
        found = found[-1:]
    with tempfile.TemporaryDirectory(prefix="asyncckpt-cli-") as tmp:
        for c in found:
            try:
                download_checkpoint(store, c, tmp, retry=RetryPolicy(deadline_s=60.0),
                                    checksums=False)  # verify (or inspect) decides below
            except CorruptCheckpointError as e:
                print(f"FAIL  {c.name}: {e}")
                args.remote_failures = getattr(args, "remote_failures", 0) + 1
        yield tmp


def _cmd_list(args: argparse.Namespace) -> int:
    from asyncckpt.storage.url import is_url

    if is_url(args.dir):
        _store, remote = _remote_list(args.dir)
        if not remote:
            print(f"no committed checkpoints in {args.dir}")
            return 0
        print(f"{'name':<24} {'framework':<11} {'step':>8} {'size':>12}  committed")
        for c in remote:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.committed))
            step = "" if c.step is None else str(c.step)
            print(f"{c.name:<24} {c.framework:<11} {step:>8} {_mib(c.nbytes):>12}  {when}")
        return 0
    found = catalog.list_checkpoints(args.dir)
    if not found:
        print(f"no checkpoints in {args.dir}")
        return 0
    print(f"{'name':<24} {'framework':<11} {'step':>8} {'size':>12} {'files':>6}  committed")
    for c in found:
        try:
            m = c.manifest()
            missing = "no manifest"
        except CorruptCheckpointError:
            m, missing = None, "manifest damaged"
        size = _mib(m.nbytes) if m else "?"
        files = str(len(m.files)) if m else "?"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created)) if m else missing
        step = "" if c.step is None else str(c.step)
        print(f"{c.name:<24} {c.framework:<11} {step:>8} {size:>12} {files:>6}  {when}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    with _local_view(args) as directory:
        return _inspect(directory, args)


def _inspect(directory: str, args: argparse.Namespace) -> int:
    chosen = catalog.select(directory, args.step)
    if not chosen:
        print(f"no checkpoints in {args.dir}")
        return 1
    if args.step is None:
        chosen = chosen[-1:]  # the newest
    for c in chosen:
        m = c.manifest()
        print(f"checkpoint {c.path} ({c.framework}, step {c.step})")
        if m is not None:
            s = m.stats
            print(f"  written by asyncckpt {m.version}; {len(m.files)} files, {_mib(m.nbytes)}")
            if s:
                print(
                    f"  save: blocked {s.get('blocking_s', 0) * 1e3:.1f} ms, "
                    f"wrote {s.get('write_s', 0) * 1e3:.0f} ms, "
                    f"{_mib(s.get('nbytes', 0))} staged, "
                    f"{s.get('throughput_bytes_per_s', 0) / 2**20:.0f} MiB/s"
                )
            if m.extra:
                print(f"  extra: {m.extra}")
        else:
            print("  no asyncckpt manifest (written by another tool)")
        arrays = catalog.describe_arrays(c)
        width = max([len(a.name) for a in arrays] + [4])
        print(f"  {'name':<{width}} {'shape':<20} {'dtype':<10} {'bytes':>12}")
        for a in arrays:
            print(f"  {a.name:<{width}} {list(a.shape)!s:<20} {a.dtype:<10} {a.nbytes:>12}")
        print(f"  {len(arrays)} arrays, {_mib(sum(a.nbytes for a in arrays))}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    with _local_view(args) as directory:
        return _verify(directory, args)


def _verify(directory: str, args: argparse.Namespace) -> int:
    chosen = catalog.select(directory, args.step)
    failed_download = getattr(args, "remote_failures", 0)
    if failed_download:
        print(f"{failed_download} checkpoint(s) failed while downloading")
        return 1
    if not chosen:
        print(f"no checkpoints in {args.dir}")
        return 1
    bad = 0
    for c in chosen:
        try:
            m = catalog.verify(c, checksums=not args.sizes_only)
            algorithms = sorted({f.algorithm for f in m.files if f.crc is not None})
            sums = f" ({', '.join(algorithms)})" if algorithms and not args.sizes_only else ""
            print(f"OK    {c.name}: {len(m.files)} files, {_mib(m.nbytes)}{sums}")
        except CorruptCheckpointError as e:
            bad += 1
            print(f"FAIL  {c.name}: {e}")
    # A directory of TensorFlow checkpoints: its state file must name checkpoints that are there.
    whole = args.step is None and catalog.checkpoint_at(directory) is None
    named = (catalog.state_file_problems(directory)
             if whole and any(c.framework == "tensorflow" for c in chosen) else [])
    for e in named:
        print(f"FAIL  {layout.TF_STATE_FILE}: {e}")
    what = "sizes" if args.sizes_only else "sizes and checksums"
    print(f"{len(chosen) - bad}/{len(chosen)} checkpoint(s) verified ({what})"
          + (f"; {len(named)} problem(s) with the state file" if named else ""))
    return 0 if bad == 0 and not named else 1


# The benchmarks live beside the package in a source checkout (``benchmarks/``), not in it:
# nothing here imports them. Their old entry point gets one line naming the new one.
_BENCH_MOVED = ("asyncckpt bench: the benchmarks are not part of asyncckpt; from the root of a "
                "source checkout run `python -m benchmarks [options]` (or `make bench`)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="list the committed checkpoints in a directory")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("inspect", help="arrays, shapes, dtypes, bytes and save stats")
    p.add_argument("dir", help="a checkpoint directory, or one checkpoint's own path")
    p.add_argument("step", nargs="?", help="step or name (default: the newest)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("verify", help="check files against manifests; exit 1 on any failure")
    p.add_argument("dir", help="a checkpoint directory, or one checkpoint's own path")
    p.add_argument("step", nargs="?", help="step or name (default: every checkpoint)")
    p.add_argument("--sizes-only", action="store_true", help="skip the CRC32 pass")
    p.set_defaults(func=_cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # whatever options follow: the line says where to go
        print(_BENCH_MOVED, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointNotFoundError, ValueError) as e:  # ValueError: an unsupported URL
        print(f"asyncckpt: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
