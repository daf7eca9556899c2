"""PNG plots (matplotlib): time and ratio versus size, per implementation and world size.

One figure per (area, world size): left, median time versus bytes (log-log) for each
implementation and shape set; right, the same cases as a ratio to their floor.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

# (area, path or kind/path shown, floor description)
SERIES = (
    ("allgather", "e2e", "", "unshard+reshard / raw all-gather"),
    ("padding", "construct", "", "fully_shard construction / memcpy"),
    ("padding", "load_assign", "", "load_state_dict(assign=True) / memcpy"),
    ("state_dict", "save", "full", "FSDP1 FULL save / raw gather"),
    ("state_dict", "save", "dcp_full", "get_model_state_dict(full) / raw gather"),
)


def write(records, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for area, path, kind, title in SERIES:
        chosen = [
            r for r in records if r["area"] == area and r["path"] == path and r["kind"] == kind
        ]
        for ws in sorted({r["world_size"] for r in chosen}):
            lines = defaultdict(list)
            for r in chosen:
                if r["world_size"] == ws:
                    lines[(r["impl"], r["shape_set"])].append(r)
            fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(12, 4.5))
            # colour = implementation, line style and marker = shape set: each line is unique
            impls = sorted({impl for impl, _ in lines})
            shape_sets = sorted({shape_set for _, shape_set in lines})
            for (impl, shape_set), rs in sorted(lines.items()):
                rs.sort(key=lambda r: r["size_mb"])
                mb = [r["size_mb"] for r in rs]
                label = f"{impl} / {shape_set}"
                style = {
                    "color": f"C{impls.index(impl) % 10}",
                    "linestyle": ("-", "--", ":", "-.")[shape_sets.index(shape_set) % 4],
                    "marker": ("o", "s", "^", "D")[shape_sets.index(shape_set) % 4],
                }
                ax_t.plot(mb, [r["median_s"] * 1e3 for r in rs], label=label, **style)
                ratios = [r.get("ratio_to_floor") for r in rs]
                if any(x is not None for x in ratios):
                    ax_r.plot(
                        mb,
                        [x if x is not None else float("nan") for x in ratios],
                        label=label,
                        **style,
                    )
            ax_t.set(
                xscale="log",
                yscale="log",
                xlabel="parameter MiB",
                ylabel="median ms",
                title=f"{area} {kind or path} time, ws {ws}",
            )
            ax_r.set(xscale="log", xlabel="parameter MiB", ylabel="× floor", title=title)
            ax_r.axhline(1.0, color="grey", lw=0.8)
            for ax in (ax_t, ax_r):
                ax.grid(True, which="both", alpha=0.3)
            ax_t.legend(fontsize=7)
            fig.tight_layout()
            target = Path(out_dir) / f"perf-{area}-{kind or path}-ws{ws}.png"
            fig.savefig(target, dpi=90)
            plt.close(fig)
            written.append(target)
    return written
