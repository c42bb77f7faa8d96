"""``pagedkv export-hf``: a Hugging Face model directory written from a GGUF file.

The peers that read Hugging Face checkpoints (vLLM, OpenVINO's converter) cannot read the
GGUF pagedkv serves, so this writes the same model in their format: transformers de-quantises
the GGUF (its GGUF reader) and ``save_pretrained`` writes ``config.json``,
``generation_config.json``, ``model.safetensors`` and the tokenizer files (with the chat
template the GGUF carries).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pagedkv.errors import ConfigError

#: ``--dtype`` choices: the safetensors' floating-point type
DTYPES = ("float32", "bfloat16")


def export_hf(gguf: Optional[str], out_dir: str, dtype: str = "float32") -> dict[str, Any]:
    """Write the GGUF ``gguf`` (a path or a bundled model's name; None = the default bundled
    model) as a Hugging Face directory ``out_dir`` (created; existing files replaced), weights
    de-quantised to ``dtype`` (``float32`` or ``bfloat16``). Returns a summary: the GGUF path,
    the directory, the dtype, the file names written, parameters (count) and the safetensors
    size (bytes). Raises ``ConfigError`` for an unknown dtype, a model that is not a GGUF file
    or an output path that is a file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.model.loader import resolve_model_path

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = resolve_model_path(gguf)
    if not path.is_file() or path.suffix != ".gguf":
        raise ConfigError(f"export-hf needs a .gguf file, got {str(path)!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export-hf: {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=getattr(torch, dtype))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # a GGUF-loaded model refuses save_pretrained (it counts as quantised): the same weights
    # go into a plain model of the same config, without the GGUF quantisation entry
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    stamp = {"source_gguf": str(path), "dtype": dtype, "written_by": "pagedkv export-hf"}
    (out / "pagedkv_export.json").write_text(json.dumps(stamp, indent=1) + "\n")
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {**stamp, "dir": str(out), "files": files,
            "parameters": int(sum(p.numel() for p in model.parameters())), "safetensors_bytes": size}


def register(sub: Any) -> None:
    """Adds ``export-hf`` to the ``pagedkv`` command line."""
    p = sub.add_parser("export-hf", help="write a GGUF as a Hugging Face directory (for the HF-reading peers)")
    p.add_argument("gguf", nargs="?", default=None,
                   help="a .gguf path or a bundled model's name (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("out_dir", help="the directory to write")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' type (default float32)")
    p.set_defaults(func=_cmd)


def _cmd(args: Any) -> int:
    info = export_hf(args.gguf, args.out_dir, args.dtype)
    print(json.dumps({k: v for k, v in info.items() if k != "files"}, indent=1))
    print("files: " + ", ".join(info["files"]))
    return 0
