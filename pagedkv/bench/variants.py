"""Result sets with variants: one ``<name>.json`` / ``.md`` / ``.png`` per benchmark, one run per variant.

A benchmark measured in several configurations (a CPU class, a model, a weight format, a part
of it) keeps ONE result set under docs/benchmarks/; each configuration is a *variant* of it:

* ``<name>.json``: ``{"benchmark": name, "variants": {variant: <that run's data>, ...}}``;
* ``<name>.md``: a short head (the variants, linked, and the figure), then one ``## <variant>``
  section per variant: that run's Markdown with its headings two levels down, then its
  machine footer (the heading is also the variant's anchor: ``<name>.md#<variant>``);
* ``<name>.png``: one panel per variant that drew figures, top to bottom, each headed by its
  variant's name; the panels' pixel rows are kept in the PNG's ``pagedkv-panels`` text chunk.

:func:`write_variant` upserts one variant: the JSON entry, Markdown section and PNG panel of
every other variant stay as they are, so rerunning one configuration never rewrites another's
numbers, and rerunning any of them adds no file. Variants keep their order; a new one goes last.
:func:`read_variants` / :func:`read_variant` read a result file of either layout (a benchmark
with one configuration writes its data dict directly, without ``variants``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from pagedkv.errors import ConfigError

VARIANTS = "variants"  #: the JSON key holding {variant: data}
PANELS = "pagedkv-panels"  #: the PNG text chunk: {variant: [first row, end row, width]}
_SECTION = re.compile(r"^## (\S+)\s*$")
_HEADING = re.compile(r"^(#{1,6}) ")


# ---- names ---------------------------------------------------------------------------------------
def variant_name(text: str) -> str:
    """``text`` as a variant name: lower case, each run of characters outside ``a-z 0-9 _ -``
    replaced by ``_`` (so the name is its own Markdown anchor). ``ConfigError`` when nothing is left."""
    name = re.sub(r"[^a-z0-9_-]+", "_", str(text).strip().lower()).strip("_")
    if not name:
        raise ConfigError(f"--variant: {text!r} names no variant (letters, digits, '_' and '-')")
    return name


def _variant_arg(text: str) -> str:
    try:
        return variant_name(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_variant_option(p: Any, default: str) -> None:
    """``--variant NAME``: which variant of the result set the run writes (``default`` says what
    is taken without it); the set's other variants stay as they are."""
    p.add_argument("--variant", type=_variant_arg, default=None,
                   help=f"the variant of the result set this run replaces (default: {default}); the set's "
                        "other variants stay as they are")


def cpu_class(isa: Optional[dict[str, Any]]) -> str:
    """A variant-name slug of the CPU class a run's kernels ran under, from its
    ``machine["cpu_isa"]`` record: ``avx512`` / ``avx2`` (+ ``_amx`` where present), with
    ``_on_<native>`` under a cap (``PAGEDKV_CPU_ISA=avx2`` on an AVX-512 host: ``avx2_on_avx512``);
    ``unknown_cpu`` without a record."""
    if not isa or not isa.get("isa"):
        return "unknown_cpu"
    slug = str(isa["isa"]) + ("_amx" if isa.get("amx") else "")
    native = isa.get("native_isa")
    if native and native != isa["isa"]:
        slug += f"_on_{native}"
    return variant_name(slug)


# ---- reading -------------------------------------------------------------------------------------
def read_variants(path: Path | str) -> dict[str, dict[str, Any]]:
    """``{variant: data}`` of a result JSON; a file of one run (no ``variants``) is ``{"": data}``."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get(VARIANTS), dict):
        return dict(data[VARIANTS])
    return {"": data}


def read_variant(path: Path | str, variant: Optional[str] = None) -> dict[str, Any]:
    """The data of ``variant`` in a result JSON (without ``variant``: its only run).
    ``ConfigError`` when there is no such variant, or several and none named."""
    found = read_variants(path)
    if variant is None and len(found) == 1:
        return next(iter(found.values()))
    if variant is not None and variant_name(variant) in found:
        return found[variant_name(variant)]
    raise ConfigError(f"{path}: name one of its variants with --variant ({', '.join(found)})"
                      if variant is None else f"{path}: no variant {variant!r} (it has {', '.join(found)})")


# ---- writing -------------------------------------------------------------------------------------
def json_default(obj: Any) -> Any:
    """``json.dumps`` fallback: arrays and numpy scalars as lists / numbers, paths as strings."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj)}")


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` as indented JSON (keys in their order, :func:`json_default` for the rest)."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")


def write_variant(name: str, variant: str, data: dict[str, Any], markdown: str, figures: list[Path],
                  out_dir: Path, footer: str) -> dict[str, Path]:
    """Upsert ``variant`` of the result set ``<name>`` in ``out_dir`` (see the module doc):
    ``data`` into ``<name>.json``, ``markdown`` + ``footer`` as its section of ``<name>.md``, the
    PNG ``figures`` (none: its panel is dropped) stacked under its name as its panel of
    ``<name>.png``. Returns the written paths (``png`` only when the set has a figure). Raises
    ``ConfigError`` when ``<name>.json`` exists but does not parse or holds one run without
    variants: numbers already there are never dropped (move the file away to start the set anew). The PNG is written first, so
    a figure that fails leaves the JSON and the Markdown as they were."""
    variant = variant_name(variant)
    jpath, mpath, ppath = (out_dir / f"{name}{ext}" for ext in (".json", ".md", ".png"))
    variants: dict[str, Any] = {}
    if jpath.is_file():
        try:
            variants = read_variants(jpath)
        except ValueError as e:
            raise ConfigError(f"{jpath}: not a result file ({e}); its other variants would be lost: "
                              "move it away to start the result set anew") from None
        if "" in variants:
            raise ConfigError(f"{jpath}: one run without variants; writing variant {variant!r} would drop it: "
                              "move it away to start the result set anew")
    sections = split_sections(mpath.read_text()) if mpath.is_file() else {}
    variants[variant] = data
    sections[variant] = demote(markdown).strip() + "\n\n" + footer.strip()
    has_png = _write_panels(ppath, variant, figures, list(variants))
    write_json(jpath, {"benchmark": name, VARIANTS: variants})
    mpath.write_text(compose(name, list(variants), sections, has_png))
    return {"json": jpath, "md": mpath, **({"png": ppath} if has_png else {})}


# ---- Markdown ------------------------------------------------------------------------------------
def demote(markdown: str) -> str:
    """``markdown`` with every heading two levels down (``#`` -> ``###``, at most ``######``),
    so no line of a variant's section reads as a variant heading."""
    return "\n".join(_HEADING.sub(lambda m: "#" * min(6, len(m.group(1)) + 2) + " ", line)
                     for line in markdown.splitlines())


def split_sections(text: str) -> dict[str, str]:
    """``{variant: section text}`` of a variant set's Markdown (the head is left out)."""
    out: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v).strip() for k, v in out.items()}


def compose(name: str, variants: list[str], sections: dict[str, str], has_png: bool) -> str:
    """The Markdown of a variant set: the head, then each variant's section in order."""
    lines = [f"# {name}: results", "",  # not "# {name}": its anchor would shadow a variant named like the set
             f"{len(variants)} variant{'s' if len(variants) != 1 else ''} of this benchmark, each the latest run "
             "of one configuration; rerunning a configuration replaces its own section, JSON entry and figure "
             "panel (docs/benchmarks/README.md lists the command of each).", "",
             " · ".join(f"[{v}](#{v})" for v in variants), ""]
    if has_png:
        lines += [f"![{name}: one panel per variant, top to bottom]({name}.png)", ""]
    for v in variants:
        lines += [f"## {v}", "", sections.get(v) or "(no Markdown kept for this variant: rerun it)", ""]
    return "\n".join(lines)


# ---- PNG -----------------------------------------------------------------------------------------
def combine_figures(figures: list[Path], dest: Path) -> None:
    """``figures`` (PNGs) as one PNG ``dest``: a single figure copied as is, several stacked
    top to bottom (narrower ones padded white on the right)."""
    if len(figures) == 1:
        shutil.copyfile(figures[0], dest)
        return
    _save(dest, _stack([_load(f) for f in figures]))


def _write_panels(path: Path, variant: str, figures: list[Path], order: list[str]) -> bool:
    """Rewrite ``path`` with ``variant``'s panel made of ``figures`` and the other variants'
    panels kept from the current file; returns whether the set has a PNG now."""
    panels = _read_panels(path)
    panels.pop(variant, None)
    if figures:
        imgs = [_load(f) for f in figures]
        panels[variant] = _stack([_caption(variant, max(i.shape[1] for i in imgs)), *imgs])
    kept = [(v, panels[v]) for v in order if v in panels]
    if not kept:
        path.unlink(missing_ok=True)
        return False
    rows, y = {}, 0
    for v, img in kept:
        rows[v] = [y, y + img.shape[0], img.shape[1]]
        y += img.shape[0]
    _save(path, _stack([img for _, img in kept]), {PANELS: json.dumps(rows)})
    return True


def _read_panels(path: Path) -> dict[str, Any]:
    """The panels of a variant set's PNG by variant ({} without the file or its panel record)."""
    if not path.is_file():
        return {}
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        rows = json.loads(getattr(im, "text", {}).get(PANELS) or "{}")
        arr = np.asarray(im.convert("RGBA"))
    return {v: arr[a:b, :w] for v, (a, b, w) in rows.items()}


def _load(path: Path) -> Any:
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGBA"))


def _stack(images: list[Any]) -> Any:
    import numpy as np

    width = max(i.shape[1] for i in images)
    padded = [np.pad(i, ((0, 0), (0, width - i.shape[1]), (0, 0)), constant_values=255) for i in images]
    return np.concatenate(padded, axis=0)


def _save(path: Path, arr: Any, text: Optional[dict[str, str]] = None) -> None:
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    for k, v in (text or {}).items():
        info.add_text(k, v)
    Image.fromarray(arr, "RGBA").save(path, pnginfo=info)


def _caption(text: str, width: int) -> Any:
    """A white strip ``width`` pixels wide with ``text`` in bold on its left (a panel's head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig = plt.figure(figsize=(width / 100, 0.42), dpi=100)
    fig.text(0.01, 0.5, text, fontsize=13, fontweight="bold", va="center")
    fig.canvas.draw()
    arr = np.asarray(fig.canvas.buffer_rgba())[:, :width].copy()
    plt.close(fig)
    return arr
