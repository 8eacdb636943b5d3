"""Draws the pictures in docs/img. Run from the checkout: python docs/diagrams.py"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "benchmarks", "results")


def pipeline() -> None:
    """Training thread vs writer thread over three saves with two slots."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    step, copy, write, commit = 1.0, 0.25, 2.6, 0.6
    lanes = {"training thread": 2, "writer thread": 1, "slots in use": 0}
    t = 0.0
    saves = []
    for i in range(9):
        is_save = i in (1, 3, 5)
        ax.broken_barh([(t, step)], (lanes["training thread"] - 0.35, 0.7),
                       color="#9ecae1", edgecolor="white")
        ax.text(t + step / 2, 2, f"step {i}", ha="center", va="center", fontsize=8)
        t += step
        if is_save:
            ax.broken_barh([(t, copy)], (lanes["training thread"] - 0.35, 0.7), color="#e6550d")
            saves.append(t)
            t += copy
    writer_free = 0.0
    slot_busy = []
    for n, s in enumerate(saves):
        start = max(s + copy, writer_free)
        ax.broken_barh([(start, write)], (0.65, 0.7), color="#31a354")
        ax.text(start + write / 2, 1, f"write {n + 1}", ha="center", va="center",
                fontsize=8, color="white")
        ax.broken_barh([(start + write, commit)], (0.65, 0.7), color="#756bb1")
        writer_free = start + write + commit
        slot_busy.append((s, start + write - s))
    for n, (s, dur) in enumerate(slot_busy):
        ax.broken_barh([(s, dur)], (-0.35 + 0.35 * (n % 2), 0.3), color="#fdae6b")
    ax.set_title("save = short host copy (orange) on the training thread; "
                 "write (green) and commit (purple) in the background", fontsize=9)
    ax.set_xlim(0, max(t, writer_free) + 0.2)
    finish(fig, ax, lanes, "time", "pipeline.png")


def structure() -> None:
    """Who calls whom in one save: front ends, their format writers, the one transaction,
    its destinations, and the one step directory under every manager."""
    fig, ax = plt.subplots(figsize=(10, 4.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 6.2)
    ax.axis("off")

    def box(x, y, w, h, text, color):
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="#555555"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "->", "color": "#555555"})

    fronts = ["tf.CheckpointManager\ntf.Checkpoint", "jax.CheckpointManager\ncheckpointers",
              "JobRunner\nKeras backups", "Keras\nModelCheckpoint"]
    writers = ["TFSaveJob\n(bundle)", "JaxSaveJob\n(orbax layout,\norbax handlers)",
               "_ArraysJob\n(arrays.bin)", "_FileJob\n(Keras file)"]
    for i, (front, writer) in enumerate(zip(fronts, writers, strict=True)):
        x = 0.2 + i * 2.45
        box(x, 5.0, 2.2, 0.9, front, "#c6dbef")
        box(x, 3.5, 2.2, 1.0, writer, "#c7e9c0")
        arrow(x + 1.1, 5.0, x + 1.1, 4.5)
        arrow(x + 1.1, 3.5, 5.0, 2.7)
    box(2.6, 1.9, 4.8, 0.8, "Transaction (_engine/transaction.py)\n"
        "temp -> write (DurableWriter) -> manifest -> publish", "#fdd0a2")
    dests = ["RenamedDirectory", "MarkedDirectory", "PrefixFiles", "Uploaded\n(object store)"]
    for i, d in enumerate(dests):
        x = 0.6 + i * 2.3
        box(x, 0.3, 2.0, 0.8, d, "#fee6ce")
        arrow(5.0, 1.9, x + 1.0, 1.1)
    box(7.9, 1.9, 2.0, 0.8, "StepDirectory\n(_engine/steps.py)", "#dadaeb")
    for i in range(3):
        arrow(0.2 + i * 2.45 + 2.0, 5.0, 8.9, 2.7)
    ax.text(8.9, 1.65, "listing, retention,\ndeletions, lock", ha="center", va="top",
            fontsize=7)
    ax.set_title("one save: the front end stages, its format writer writes through the one "
                 "transaction,\nwhich publishes through a destination; every manager keeps "
                 "its checkpoints in the one step directory", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "img", "structure.png"), dpi=110)
    plt.close(fig)


def durable_breakdown() -> None:
    """Where the durable time goes, before and after asyncckpt wrote OCDBT itself (issue 37),
    then (the bench's managers delete old steps in the background, small staging
    buffers are packed side by side), and now (CPU shards viewed only as copied,
    the OCDBT writer's values plain tuples: fewer garbage collections).

    Drawn by ``asyncckpt bench``'s own plot from the four runs' stored results
    (``benchmarks/results/cpu-durable-breakdown-{before,after,packed}.json``,
    ``cpu-durable-abba-2026-12-08-b1.json``).
    """
    sys.path.insert(0, os.path.dirname(HERE))  # the checkout: benchmarks
    from benchmarks.suite import report

    runs = {}
    for label, name in (("before: TensorStore writes OCDBT", "breakdown-before"),
                        ("after: asyncckpt writes it", "breakdown-after"),
                        ("then: background delete,\npacked buffers", "breakdown-packed"),
                        ("now: fewer collections\n(no 256 MiB run)", "abba-2026-12-08-b1")):
        with open(os.path.join(RESULTS, f"cpu-durable-{name}.json")) as f:
            runs[label] = json.load(f)
    report.plot_breakdown(None, os.path.join(HERE, "img", "cpu-durable-breakdown.png"),
                          "Durable time per save by phase, 2-core VM (floors stacked: memcpy, "
                          "CRC32C, raw write, one fsync)", rows=runs)


def finish(fig, ax, lanes: dict[str, float], xlabel: str, name: str) -> None:
    """Labels the lanes of a timeline, hides time ticks and saves it as docs/img/<name>."""
    ax.set_yticks(list(lanes.values()))
    ax.set_yticklabels(list(lanes))
    ax.set_xticks([])
    ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "img", name), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    os.makedirs(os.path.join(HERE, "img"), exist_ok=True)
    pipeline()
    structure()
    durable_breakdown()
