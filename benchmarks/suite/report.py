"""Tables, target checks, JSON and the plot of ``python -m benchmarks``."""

from __future__ import annotations

import json
import os
import platform
import shlex

from benchmarks.suite.engines import D2H_FLOOR

PROG = "python -m benchmarks"


def command_line(args) -> str:
    """The command that ran, for the reports: ``python -m benchmarks`` and its arguments."""
    return " ".join([PROG, *(shlex.quote(a) for a in getattr(args, "argv", ()))])


def machine() -> str:
    """The machine a run measured: CPUs, their model, memory, Python."""
    cpus = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                         model)
    except OSError:
        pass
    return f"{cpus} CPUs ({model}), {mem:.0f} GiB RAM, Python {platform.python_version()}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def _med(d: dict | None, key: str) -> float | None:
    if not d or key not in d or not d[key]:
        return None
    return d[key].get("median")


def size_table(size: dict) -> list[str]:
    lines = [f"== {size['nbytes'] / 2**20:.0f} MiB in {size['tensors']} tensors =="]
    head = (f"{'case':<19} {'block ms':>9} {'p95':>7} {'durable ms':>11} {'thr/raw':>8} "
            f"{'2nd,3rd b2b ms':>15} {'restore/raw':>11} {'peak +MiB':>9}")
    lines.append(head)
    for name, f in size["floors"].items():
        lines.append(f"{name:<19} {_ms(f.get('median')):>9} {_ms(f.get('p95')):>7}")
    for name, e in size["engines"].items():
        if e.get("error") and not e.get("blocking"):
            lines.append(f"{name:<19} FAILED: {e['error']}")
            continue
        b2b = e.get("back_to_back")
        b2b_s = "-" if not b2b else f"{b2b[1] * 1e3:.0f},{b2b[2] * 1e3:.0f}"
        thr = e.get("durable_throughput_vs_raw_write")
        rr = e.get("restore_vs_raw_read")
        lines.append(
            f"{name:<19} {_ms(_med(e, 'blocking')):>9} {_ms(e['blocking'].get('p95')):>7} "
            f"{_ms(_med(e, 'durable')):>11} {'-' if thr is None else f'{thr:.2f}':>8} "
            f"{b2b_s:>15} {'-' if rr is None else f'{rr:.2f}x':>11} "
            f"{e.get('peak_rss_delta_bytes', 0) / 2**20:>9.0f}"
            + (f"  (error: {e['error']})" if e.get("error") else "")
        )
    return lines


# Phases in the order a save meets them (asyncckpt._engine.metrics names them);
# write:<kind> rows come where "write:" stands. Each with the floor it is compared with.
PHASE_ORDER = ["slot wait", "copy to host", "queue", "write:", "checksum", "checksum (read back)",
               "checksum (beside the write)", "ocdbt commit", "fsync wait", "manifest", "publish",
               "after commit", "retention wait", "other"]
PHASE_FLOORS = {"copy to host": "memcpy", "write:": "raw write (no fsync)",
                "checksum": "crc32c", "fsync wait": "one fsync"}
OFF_PATH = ("fsync", "checksum (beside the write)")  # on helper threads, overlapping the rest


def _phase_rows(breakdown: dict) -> list[str]:
    """The phases of every engine of one size, in PHASE_ORDER."""
    seen: list[str] = []
    for b in breakdown.values():
        seen += [p for p in b["phases"] if p not in seen and p != "fsync"]
    rows = []
    for p in PHASE_ORDER:
        if p == "write:":
            rows += sorted(x for x in seen if x.startswith("write:"))
        elif p in seen:
            rows.append(p)
    return rows + [x for x in seen if x not in rows]


def breakdown_lines(size: dict) -> list[str]:
    """Durable time per phase of each asyncckpt engine, with the floors (ms, medians)."""
    breakdown = size.get("breakdown") or {}
    if not breakdown:
        return []
    names = list(breakdown)
    floors = size["floors"]
    lines = ["-- where the durable time goes (median ms per save; phases on the writer's way, "
             "fsyncs on helper threads apart) --",
             f"{'phase':<28}" + "".join(f"{n:>15}" for n in names) + "   floor"]
    writes_done = False
    for row in _phase_rows(breakdown):
        cells = "".join(f"{_ms(breakdown[n]['phases'].get(row, {}).get('median_s')):>15}"
                        for n in names)
        key = "write:" if row.startswith("write:") else row
        floor = PHASE_FLOORS.get(key)
        note = ""
        if floor and floor in floors and not (key == "write:" and writes_done):
            note = f"   {floor} {_ms(floors[floor].get('median'))}"
            if key == "write:":
                note += " (all files)"
        writes_done = writes_done or key == "write:"
        lines.append(f"{row:<28}{cells}{note}")
    lines.append(f"{'= durable':<28}" + "".join(f"{_ms(breakdown[n]['durable_s']):>15}"
                                                 for n in names)
                 + f"   raw write+fsync {_ms(floors['raw write+fsync']['median'])}")
    fs = []
    for n in names:
        f = breakdown[n]["phases"].get("fsync", {})
        fs.append(f"{f.get('count', 0):.0f} in {_ms(f.get('median_s'))}" if f else "-")
    lines.append(f"{'fsyncs (count in ms)':<28}" + "".join(f"{c:>15}" for c in fs)
                 + f"   one fsync {_ms(floors.get('one fsync', {}).get('median'))}")
    return lines


def ratios(size: dict) -> dict[str, float]:
    """The ratios the targets are stated in, for one size."""
    e, f = size["engines"], size["floors"]
    out = {}

    def put(key: str, a: float | None, b: float | None) -> None:
        if a and b:
            out[key] = a / b

    memcpy = f["memcpy"]["median"]
    for ours, peers in (("asyncckpt tf", ("tf built-in async", "tf sync")),
                        ("asyncckpt jax", ("orbax async",))):
        mine = _med(e.get(ours), "blocking")
        put(f"{ours} blocking / memcpy", mine, memcpy)
        put(f"{ours} blocking / memcpy per tensor", mine, f["memcpy per tensor"]["median"])
        for floor in ("memcpy jax arrays", D2H_FLOOR):  # the second on accelerators only
            if ours == "asyncckpt jax" and floor in f:
                put(f"{ours} blocking / {floor}", mine, f[floor]["median"])
        for p in peers:
            put(f"{ours} blocking / {p} blocking", mine, _med(e.get(p), "blocking"))
        thr = (e.get(ours) or {}).get("durable_throughput_vs_raw_write")
        if thr:
            out[f"{ours} durable throughput / raw write"] = thr
        rr = (e.get(ours) or {}).get("restore_vs_raw_read")
        if rr:
            out[f"{ours} restore / raw read"] = rr
    return out


TARGETS = [
    ("blocking <= 1.5x memcpy", "blocking / memcpy", lambda r: r <= 1.5),
    ("blocking <= 1.3x a memcpy from the jax arrays themselves (issue 13.4)",
     "asyncckpt jax blocking / memcpy jax arrays", lambda r: r <= 1.3),
    ("blocking <= 0.5x orbax async", "asyncckpt jax blocking / orbax async blocking",
     lambda r: r <= 0.5),
    ("blocking <= TF built-in async", "asyncckpt tf blocking / tf built-in async blocking",
     lambda r: r <= 1.0),
    ("durable throughput >= 0.8x raw write", "durable throughput / raw write", lambda r: r >= 0.8),
]


def target_lines(results: dict) -> list[str]:
    lines = ["== targets (per size: ratio, MET or missed) =="]
    for title, key, ok in TARGETS:
        cells = []
        for size in results["sizes"]:
            for name, value in ratios(size).items():
                if name.endswith(key) or name == key:
                    who = name.split(" blocking")[0].split(" durable")[0]
                    cells.append(f"{size['nbytes'] / 2**20:.0f}MiB {who} {value:.2f}x "
                                 f"{'MET' if ok(value) else 'missed'}")
        lines.append(f"{title}: " + ("; ".join(cells) if cells else "not measured"))
    tr = results.get("training")
    if tr:
        for fw, t in tr["frameworks"].items():
            cells = [f"{n} {v['overhead_pct']:+.1f}%" for n, v in t["engines"].items()]
            lines.append(
                f"training overhead ({fw}, save every {t['every_k_steps']} steps of "
                f"{t['step_s'] * 1e3:.0f} ms; target <= 2%): " + ", ".join(cells)
            )
    return lines


def text(results: dict) -> str:
    lines = [f"{PROG}: {results['machine']}", f"command: {results['command']}", ""]
    for size in results["sizes"]:
        lines += size_table(size)
        lines += [f"  {k}: {v:.3f}" for k, v in ratios(size).items()]
        lines += breakdown_lines(size)
        lines.append("")
    tr = results.get("training")
    if tr:
        lines.append(f"== training loop, {tr['nbytes'] / 2**20:.0f} MiB state ==")
        for fw, t in tr["frameworks"].items():
            lines.append(f"{fw}: baseline {t['baseline_s']:.2f} s for {t['steps']} steps "
                         f"(save every {t['every_k_steps']})")
            for n, v in t["engines"].items():
                lines.append(f"  {n:<19} {v['total_s']:.2f} s  overhead {v['overhead_pct']:+.1f}%")
            for n, err in t["errors"].items():
                lines.append(f"  {n:<19} FAILED: {err}")
        lines.append("")
    if results.get("unbuilt_optimizer"):
        lines.append("== save, build the Keras 3 optimizer (one training step), save again ==")
        lines += [f"  {n:<19} {v}" for n, v in results["unbuilt_optimizer"].items()]
        lines.append("")
    lines += target_lines(results)
    return "\n".join(lines)


def write(results: dict, out_dir: str) -> dict[str, str]:
    """Writes results.json, results.txt and blocking.png; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "text": os.path.join(out_dir, "results.txt"),
        "plot": os.path.join(out_dir, "blocking.png"),
    }
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1)
    with open(paths["text"], "w") as f:
        f.write(text(results) + "\n")
    if not plot(results, paths["plot"]):
        del paths["plot"]
    path = os.path.join(out_dir, "breakdown.png")
    if plot_breakdown(results, path):
        paths["breakdown"] = path
    return paths


def plot(results: dict, path: str) -> bool:
    """Blocking time per save vs state size, per engine, log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = results["sizes"]
    xs = [s["nbytes"] / 2**20 for s in sizes]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = []
    for s in sizes:
        names += [n for n in s["engines"] if n not in names]
    for name in names:
        pts = [(x, _med(s["engines"].get(name), "blocking"))
               for x, s in zip(xs, sizes, strict=True)]
        pts = [(x, y * 1e3) for x, y in pts if y]
        if pts:
            style = "-o" if name.startswith("asyncckpt") else "--s"
            ax.plot(*zip(*pts, strict=True), style, label=name)
    for floor, style in (("memcpy", ":"), ("raw write+fsync", "-.")):
        pts = [(x, s["floors"][floor]["median"] * 1e3) for x, s in zip(xs, sizes, strict=True)]
        ax.plot(*zip(*pts, strict=True), style, color="gray", label=f"floor: {floor}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state size (MiB)")
    ax.set_ylabel("training blocked per save (ms, median)")
    ax.set_title("Blocking time per save")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# One colour per phase, the same in every picture (the floors' bars use their phase's).
PHASE_COLORS = {"slot wait": "#bdbdbd", "copy to host": "#e6550d", "queue": "#fdd0a2",
                "write": "#31a354", "checksum": "#9e9ac8", "checksum (read back)": "#6a51a3",
                "ocdbt commit": "#3182bd", "fsync wait": "#636363", "manifest": "#fd8d3c",
                "publish": "#c51b8a", "after commit": "#fa9fb5", "retention wait": "#fcc5c0",
                "other": "#d9d9d9"}
FLOOR_PHASES = [("memcpy", "copy to host"), ("crc32c", "checksum"),
                ("raw write (no fsync)", "write"), ("one fsync", "fsync wait")]


def plot_breakdown(results: dict, path: str, title: str | None = None, *,
                   rows: dict[str, dict] | None = None) -> bool:
    """Stacked bars per state: each asyncckpt engine's phases (ms), and the floors stacked.

    A line across each panel marks the raw write+fsync of the same bytes, the
    durable-throughput yardstick; a dashed one 1/0.9 of it. ``rows``: several
    runs, labelled, one row of panels each (``results`` is then ignored).
    """
    runs = rows or {"": results}
    grid = [[s for s in r["sizes"] if s.get("breakdown")] for r in runs.values()]
    if not any(grid):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cols = max(len(g) for g in grid)
    fig, axes = plt.subplots(len(grid), cols, figsize=(max(7.0, 1.2 + 2.3 * cols),
                                                      0.9 + 3.9 * len(grid)), squeeze=False)
    used: dict[str, str] = {}
    for r, (label, sizes) in enumerate(zip(runs, grid, strict=True)):
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(sizes):
                ax.axis("off")
                continue
            _breakdown_panel(ax, sizes[c], used)
        axes[r][0].set_ylabel(f"{label}\nms per save (median)" if label
                              else "ms per save (median)", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in used.values()]
    handles += [plt.Line2D([0], [0], color="black"),
                plt.Line2D([0], [0], color="black", linestyle="--")]
    fig.legend(handles, [*used, "raw write+fsync", "raw write+fsync / 0.9"], fontsize=7,
               loc="lower center", ncol=min(5, len(handles)), frameon=False)
    fig.suptitle(title or "Durable time per save, by phase (floors: memcpy, CRC32C, raw "
                 "write, one fsync)", fontsize=10)
    fig.tight_layout(rect=(0, 0.14 / len(grid), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _breakdown_panel(ax, size: dict, used: dict[str, str]) -> None:
    """One state's bars: its engines' phases, then the floors, and the raw write marked."""
    bars = []
    for name, b in size["breakdown"].items():
        stack: dict[str, float] = {}
        for phase, v in b["phases"].items():
            if phase in OFF_PATH:
                continue
            key = "write" if phase.startswith("write:") else phase
            stack[key] = stack.get(key, 0.0) + max(0.0, v["median_s"]) * 1e3
        bars.append((name.replace("asyncckpt ", ""), stack))
    floors = size["floors"]
    bars.append(("floors", {phase: floors[f]["median"] * 1e3 for f, phase in FLOOR_PHASES
                            if f in floors}))
    for x, (_label, stack) in enumerate(bars):
        bottom = 0.0
        for phase, color in PHASE_COLORS.items():
            h = stack.get(phase, 0.0)
            if h <= 0:
                continue
            ax.bar(x, h, bottom=bottom, color=color, edgecolor="white", linewidth=0.5,
                   width=0.7)
            used[phase] = color
            bottom += h
    raw = floors["raw write+fsync"]["median"] * 1e3
    ax.axhline(raw, color="black", linewidth=1)
    ax.axhline(raw / 0.9, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b[0] for b in bars], fontsize=8)
    ax.set_title(f"{size['nbytes'] / 2**20:.0f} MiB in {size['tensors']} arrays", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
