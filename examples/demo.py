"""The README's main job: train with asynchronous checkpoints, then restore and check.

Run from the checkout's root with ``python -m examples.demo`` (or ``make demo``;
``python examples/demo.py`` works too). For each framework it trains a small
model on synthetic data, saves every few steps, prints for each save how long
training was blocked next to how long the background write took and the
speed-up over a synchronous save of the same state, then restores into fresh
objects and checks that every value matches. The halves: ``examples/jax_demo.py``
and ``examples/tf_demo.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _run_jax(workdir: str) -> bool | None:
    try:
        from examples.jax_demo import run_jax_demo
    except ImportError as e:
        print(f"\n(JAX part skipped: {e})")
        return None
    print("\n== JAX: MLP in plain JAX, asyncckpt.jax.CheckpointManager ==")
    result = run_jax_demo(os.path.join(workdir, "jax"))
    return True if result is None else bool(result)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="demo-checkpoints",
                        help="where to write checkpoints (emptied first)")
    parser.add_argument("--framework", choices=["all", "tf", "jax"], default="all")
    args = parser.parse_args(argv)
    workdir = os.path.abspath(args.dir)
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    print(f"asyncckpt demo: checkpoints go to {workdir}")
    results = []
    if args.framework in ("all", "jax"):
        # JAX first: it must see its device-count flag before anything starts XLA.
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        results.append(_run_jax(workdir))
    if args.framework in ("all", "tf"):
        from examples.tf_demo import run_tf_demo

        results.append(run_tf_demo(workdir))
    failed = [r for r in results if r is False]
    print("\ndemo " + ("FAILED" if failed else "finished: every restore matched"))
    return 1 if failed else 0


if __name__ == "__main__":
    # ``python examples/demo.py`` puts examples/ first on the path: the checkout's root too, so
    # the halves import as ``examples.*``, as under ``python -m examples.demo``.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
