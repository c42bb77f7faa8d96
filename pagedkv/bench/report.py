"""Result files of every benchmark: ``<name>.json`` + ``<name>.md`` (+ ``<name>.png``) in one folder.

:func:`publish` is the one ending of a benchmark's ``run``: draw the plots, write the JSON, the
Markdown (with the machine footer) and the one PNG, then print the JSON (``--json``) or a
summary. A benchmark with one configuration writes its run as the whole result set; one
measured in several configurations passes ``variant``, and the run replaces that variant of
its one result set, the others kept (:mod:`pagedkv.bench.variants`).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pagedkv.bench.common import RESULTS_DIR, log, machine_info
from pagedkv.bench.variants import combine_figures, write_json, write_variant

#: plots(data, out_dir) -> {label: PNG file name in out_dir}
PlotFn = Callable[[dict[str, Any], Path], dict[str, str]]


def results_dir(out_dir: Path | str | None = None) -> Path:
    """``out_dir`` (default docs/benchmarks/), created if missing. Raises ``ConfigError`` if it
    exists and is not a directory."""
    from pagedkv.errors import ConfigError

    out = Path(out_dir) if out_dir is not None else RESULTS_DIR
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out-dir {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table of ``rows`` (floats shown with 4 significant digits)."""
    if not rows:
        return "(no rows)\n"
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def ms(x: Any) -> Any:
    """Seconds -> milliseconds; ``"n/a"`` for a missing value."""
    return x * 1000.0 if isinstance(x, (int, float)) else "n/a"


def closing_lines(data: dict[str, Any], plots: dict[str, str], notes: Optional[str] = None) -> list[str]:
    """The last lines of a report: free-text ``notes``, the machine's 1-minute load average
    over the run (``data["load_average_1m"]``, if recorded) and links to the ``plots``."""
    lines = ["", notes] if notes else []
    la = data.get("load_average_1m") or {}
    if la.get("start") is not None:
        lines += ["", f"1-minute load average at start / end: {la['start']:.1f} / {la['end']:.1f} "
                  f"(on {data['machine']['cpu_count']} CPUs; other jobs share the machine)."]
    if plots:
        lines += [""] + plot_links(plots)
    return lines


def write_results(
    name: str,
    data: dict[str, Any],
    markdown: str,
    out_dir: Path | str | None = None,
) -> dict[str, Path]:
    """Write ``<name>.json`` and ``<name>.md`` (a result set of one run) under ``out_dir``
    (default docs/benchmarks/).

    ``data`` gets a ``"machine"`` entry if it has none; the Markdown gets a footer naming the
    machine, threads, torch version and commit. Returns the written paths.
    """
    out = results_dir(out_dir)
    data.setdefault("machine", machine_info())
    jpath = out / f"{name}.json"
    mpath = out / f"{name}.md"
    write_json(jpath, data)
    mpath.write_text(markdown.rstrip() + "\n" + machine_footer(data["machine"]))
    return {"json": jpath, "md": mpath}


def machine_footer(m: dict[str, Any]) -> str:
    """The italic line closing a run's Markdown: machine, CPUs and ISA, threads, OpenMP wait
    policy, torch, commit and time of the run (``m``: its ``machine`` record)."""
    isa = m.get("cpu_isa") or {}
    isa_text = (f"CPU ISA {isa['isa']} (oneDNN {isa.get('onednn_isa')}, VNNI {'yes' if isa.get('vnni') else 'no'}, "
                f"AMX {'yes' if isa.get('amx') else 'no'}), " if isa.get("isa") else "")
    return (
        f"\n_Machine: {m['machine']}, {m['cpu_count']} CPUs, {isa_text}torch threads {m['torch_threads']}, "
        f"OMP_WAIT_POLICY {m.get('omp_wait_policy', 'default')}, "
        f"torch {m['packages'].get('torch')}, commit {m['commit']}, {m['time_utc']}._\n"
    )


# ---- plots ------------------------------------------------------------------------------------
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None if matplotlib is not
    installed (it comes with the ``[bench]`` extra)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> str:
    """Lay out, write (110 dpi) and close ``fig``; returns the file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def single_plot(name: str, label: str, draw: Callable[[dict[str, Any], Path], None]) -> PlotFn:
    """A :data:`PlotFn` that draws one figure with ``draw(data, path)`` into ``<name>.png``."""

    def plots(data: dict[str, Any], out_dir: Path) -> dict[str, str]:
        path = out_dir / f"{name}.png"
        draw(data, path)
        return {label: path.name}

    return plots


def plot_links(plots: dict[str, str]) -> list[str]:
    """Markdown image lines for ``plots`` (label -> file name)."""
    return [f"![{label}]({name})\n" for label, name in plots.items()]


# ---- the end of every run ------------------------------------------------------------------------
def publish(
    name: str,
    data: dict[str, Any],
    render: Callable[[dict[str, Any], dict[str, str]], str],
    out_dir: Path | str | None = None,
    *,
    variant: Optional[str] = None,
    plots: Optional[PlotFn] = None,
    as_json: bool = False,
    json_keys: Optional[Sequence[str]] = None,
    summary: Optional[Callable[[dict[str, Any], dict[str, Path]], str]] = None,
    echo: bool = True,
) -> dict[str, Path]:
    """Draw ``plots`` (skipped, with a note, without matplotlib), then write the result set
    ``<name>`` under ``out_dir`` (default docs/benchmarks/):

    * without ``variant``: ``<name>.json`` (``data``), ``<name>.md`` (``render(data, {label: png})``
      and the machine footer) and ``<name>.png`` (the figures, stacked when several);
    * with ``variant``: that variant of the set, ``render(data, {})`` as its section, its figures
      as its panel of ``<name>.png``; the set's other variants stay as they are
      (:func:`pagedkv.bench.variants.write_variant`).

    Then print the JSON (``as_json``; only ``json_keys`` if given) or ``summary(data, paths)``
    (default: the Markdown); nothing without ``echo``. Returns the written paths."""
    out = results_dir(out_dir)
    with tempfile.TemporaryDirectory(prefix=f"pagedkv-{name}-") as tmp:
        figures: dict[str, Path] = {}
        if plots is not None:
            if pyplot() is None:
                log(f"[{name}] matplotlib is not installed (pip install 'pagedkv[bench]'): no PNG")
            else:
                figures = {label: Path(tmp) / f for label, f in plots(data, Path(tmp)).items()}
        if variant is not None:
            data.setdefault("machine", machine_info())
            paths = write_variant(name, variant, data, render(data, {}), list(figures.values()), out,
                                  machine_footer(data["machine"]))
        else:
            pngs: dict[str, str] = {}
            if figures:
                combine_figures(list(figures.values()), out / f"{name}.png")
                pngs = {" / ".join(figures): f"{name}.png"}
            paths = write_results(name, data, render(data, pngs), out)
    if echo and as_json:
        shown = {k: data[k] for k in json_keys} if json_keys else data
        json.dump(shown, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
    elif echo:
        print(summary(data, paths) if summary else paths["md"].read_text())
    return paths
