"""Facts of a GGUF file that ``pagedkv bench models`` records beside each run: the bytes a
batch-1 decode step reads (the weight-read limit's numerator) and the count of tensors per
stored type. Read from the file's tensor table only."""

from __future__ import annotations


def weight_bytes_per_token(path: str) -> dict[str, int]:
    """Bytes of weights one batch-1 decode step reads from the GGUF at ``path``, from its tensor
    table: ``{"all": every tensor's bytes, "per_token": the same with each stacked expert
    tensor (``*_exps``) counted at ``expert_used_count / expert_count`` of its bytes (shared
    experts ``*_shexp``, ``attn_k_b`` / ``attn_v_b`` and dense layers whole), and an
    untied token embedding at one row (a step looks up its token's row; a tied one is the LM
    head, read whole)}``. Before, ``per_token`` counted an untied embedding whole (the MoE-4B:
    87 MB of its 426), which put the read limit ~20% low and the fraction of it high."""
    from gguf import GGUFReader

    r = GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int | None:
        f = r.fields.get(f"{arch}.{key}")
        return int(f.parts[-1][0]) if f is not None else None

    experts, used = field("expert_count"), field("expert_used_count")
    total = per_token = 0
    untied = any(t.name == "output.weight" for t in r.tensors)
    for t in r.tensors:
        n = int(t.n_bytes)
        total += n
        if experts and used and t.name.endswith("_exps.weight"):
            n = n * used // experts
        elif t.name == "token_embd.weight" and untied:
            n //= int(t.shape[-1])  # one row of vocab (GGUFReader's shape is GGML's: hidden, vocab)
        per_token += n
    return {"all": total, "per_token": per_token}


def tensor_types(path: str) -> dict[str, int]:
    """How many tensors of the GGUF at ``path`` are stored in each GGML type (``{"Q4_0": 169, ...}``)."""
    from gguf import GGMLQuantizationType

    from pagedkv.gguf_header import read_gguf_header

    counts: dict[str, int] = {}
    for t in read_gguf_header(path).tensors:
        name = GGMLQuantizationType(t.ggml_type).name
        counts[name] = counts.get(name, 0) + 1
    return counts
