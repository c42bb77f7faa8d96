"""The tokenizer of a model: a transformers ``AutoTokenizer`` from a directory (HF model or
weight-cache entry) or built from a GGUF file's vocabulary (seconds; the weight cache keeps
the result)."""

from __future__ import annotations

import re
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError, InvalidRequestError


#: GGUF architectures whose config transformers 5.24 does not read (``deepseek2``: not a GGUF
#: architecture of its; ``gpt-oss``: its reader fails on the yarn ``rope.scaling.*`` keys the
#: converter writes): their tokenizer is built from the file's ``tokenizer.*`` metadata alone
GGUF_TOKENIZER_ONLY = ("deepseek2", "gpt-oss")


def load_tokenizer(directory: str | Path, gguf_file: str | None = None) -> Any:
    """A transformers tokenizer (with the chat template when the source has one) saved in
    ``directory``, or built from ``directory/gguf_file``: by ``AutoTokenizer``, or, for a GGUF
    architecture whose config transformers does not read (``GGUF_TOKENIZER_ONLY``, or one it
    calls not supported), by ``PreTrainedTokenizerFast`` from the file's ``tokenizer.*``
    metadata alone (the same converter: the vocabulary, merges, special and added tokens, the
    pre-tokenizer ``tokenizer.ggml.pre`` names, e.g. gpt-oss's ``gpt-4o`` split, and the chat
    template). A directory whose ``tokenizer_config.json`` names the generic fast class
    (``TokenizersBackend`` / ``PreTrainedTokenizerFast``, e.g. the weight cache's SmolLM2 entry)
    is loaded by that class directly: the same tokenizer, without importing ``AutoTokenizer``'s
    model registry (~0.3 s of a warm start). Raises ``ConfigError``."""
    if gguf_file is None and _generic_fast_class(Path(directory)):
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast.from_pretrained(str(directory))
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"tokenizer: cannot load from {str(directory)!r} ({e})") from None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    alone = gguf_file is not None and _gguf_architecture(Path(directory) / gguf_file) in GGUF_TOKENIZER_ONLY
    if gguf_file and not alone:
        tok = _gguf_tokenizer_by_class(Path(directory), gguf_file)
        if tok is not None:
            return tok
    try:
        if alone:
            return PreTrainedTokenizerFast.from_pretrained(str(directory), **kwargs)
        try:
            return AutoTokenizer.from_pretrained(str(directory), **kwargs)
        except ValueError as e:
            if not gguf_file or "is not supported yet" not in str(e):
                raise
            return PreTrainedTokenizerFast.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"tokenizer: cannot load from {str(directory)!r} ({e})") from None


def _gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` of the GGUF at ``path`` (its header only), ``None`` when
    unreadable (the tokenizer's own reader then says why)."""
    from pagedkv.gguf_header import read_gguf_header

    try:
        arch = read_gguf_header(path, reuse=True).metadata.get("general.architecture")
    except (OSError, ValueError, ConfigError):
        return None
    return arch if isinstance(arch, str) else None


def _gguf_tokenizer_by_class(directory: Path, gguf_file: str) -> Any:
    """``AutoTokenizer.from_pretrained(directory, gguf_file=...)``'s tokenizer, seconds sooner, or
    None (the caller then asks ``AutoTokenizer``). To pick the class, ``AutoTokenizer`` builds
    the model's config with gguf's ``GGUFReader``, which turns every vocabulary entry and merge
    into numpy views (~6 s of a 49k vocabulary, more for 128k) and is used for the class only.
    Here ``AutoTokenizer`` picks it from a stand-in file (:func:`gguf_stand_in`: the same
    metadata, arrays cut to their first entries, 1-value tensors of the same names); the class
    then builds the tokenizer from the real file (transformers' own fast GGUF reader)."""
    import tempfile

    from transformers import AutoTokenizer

    try:
        with tempfile.TemporaryDirectory(prefix="pagedkv-gguf-class-") as tmp:
            stand_in = Path(tmp) / "stand-in.gguf"
            gguf_stand_in(directory / gguf_file, stand_in)
            cls = type(AutoTokenizer.from_pretrained(tmp, gguf_file=stand_in.name))
        return cls.from_pretrained(str(directory), gguf_file=gguf_file, _from_auto=True)
    except Exception:  # noqa: BLE001 - any surprise: AutoTokenizer on the real file decides
        return None


def gguf_stand_in(src: Path, dst: Path, keep: int | None = None) -> None:
    """Write ``dst``: the GGUF ``src``'s header with every metadata array cut to its first
    ``keep`` entries (default: enough for every special token id the file names, at least 16;
    the merges to none, as they name tokens cut) and a 1-value F32 tensor for each of its tensors (names kept, shapes not); a few KB.
    Raises ``OSError`` / ``ValueError`` / ``struct.error`` for an unreadable file."""
    import mmap
    import struct

    from pagedkv.gguf_header import read_gguf_header

    if keep is None:
        meta = read_gguf_header(src, reuse=True).metadata
        ids = [v for k, v in meta.items() if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")
               and isinstance(v, int)]
        keep = max([15, *ids]) + 1
    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        out = bytearray(buf[:24])
        pos, align = 24, 32

        def skip(vtype: int, p: int) -> int:
            if vtype == 8:  # a string
                return p + 8 + struct.unpack_from("<Q", buf, p)[0]
            return p + scalar[vtype]

        for _ in range(n_kv):
            start = pos
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            key = bytes(buf[start + 8:pos])
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype != 9:
                end = skip(vtype, pos)
                if key == b"general.alignment":
                    align = struct.unpack_from("<I", buf, pos)[0]
                out += buf[start:end]
                pos = end
                continue
            etype, count = struct.unpack_from("<IQ", buf, pos)
            p = pos + 12
            n_keep = 0 if key == b"tokenizer.ggml.merges" else min(count, keep)  # merges name cut tokens
            if etype == 8:
                kept_end = None
                for i in range(count):
                    if i == n_keep:
                        kept_end = p
                    p = skip(8, p)
            else:
                kept_end = p + scalar[etype] * n_keep
                p += scalar[etype] * count
            out += buf[start:pos] + struct.pack("<IQ", etype, n_keep) + buf[pos + 12:p if kept_end is None else kept_end]
            pos = p
        for i in range(n_tensors):
            n = struct.unpack_from("<Q", buf, pos)[0]
            name = buf[pos:pos + 8 + n]
            n_dims = struct.unpack_from("<I", buf, pos + 8 + n)[0]
            pos += 8 + n + 4 + 8 * n_dims + 12
            out += name + struct.pack("<IQIQ", 1, 1, 0, i * align)
    out += bytes(-len(out) % align) + bytes(align * n_tensors)
    dst.write_bytes(out)


#: ``tokenizer_class`` values that are transformers' generic fast tokenizer itself
GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_fast_class(directory: Path) -> bool:
    """Whether ``directory`` holds a ``tokenizer.json`` and a ``tokenizer_config.json`` whose
    ``tokenizer_class`` is one of ``GENERIC_FAST_CLASSES`` (and no ``auto_map`` to custom code)."""
    import json

    try:
        cfg = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(cfg, dict) and cfg.get("tokenizer_class") in GENERIC_FAST_CLASSES
            and "auto_map" not in cfg and (directory / "tokenizer.json").is_file())


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain-text prompt with the model's own special-token rule: a GGUF's
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` (or an HF directory's
    ``tokenizer_config.json``), as transformers applies them and as vLLM and llama.cpp
    tokenize a completion prompt. SmolLM2 adds nothing; Gemma-3 starts every prompt with
    ``<bos>`` (id 2), without which its greedy completions degenerate. A text that already
    starts with the BOS token's text (``"<bos>..."``) gets no second one (vLLM's rule):
    ``[2, 818, ...]``, not ``[2, 2, 818, ...]``."""
    return drop_double_bos(tokenizer, text, list(tokenizer(text, add_special_tokens=True)["input_ids"]))


def drop_double_bos(tokenizer: Any, text: str, ids: list[int]) -> list[int]:
    """``ids`` (the token ids of ``text`` with the tokenizer's special tokens added) without
    the added BOS when ``text`` itself starts with the BOS token's text, so it is not
    doubled."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if bos and bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == bos_id and text.startswith(bos):
        plain = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) > len(plain) and ids[1:1 + len(plain)] == plain:  # the first BOS was added
            return ids[1:]
    return ids



def read_chat_template(template: str) -> str:
    """A chat template given as Jinja text, or as the path of a file holding it -> the text.
    Raises ``ConfigError`` for an unreadable file or an empty template."""
    text = template
    if "{" not in template:  # not Jinja: a path
        try:
            text = Path(template).expanduser().read_text()
        except OSError as e:
            raise ConfigError(f"chat_template: cannot read {template!r} ({e.strerror})") from None
    if not text.strip():
        raise ConfigError("chat_template: empty template")
    return text


def apply_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               chat_template: str | None = None, model_id: str = "the model",
               continue_final_message: bool = False) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) through ``chat_template``
    (Jinja text) or the tokenizer's own template (tokenised without adding special tokens:
    a template that writes ``{{ bos_token }}`` gets one BOS, as in vLLM). ``add_generation_prompt``:
    end with the assistant's turn opening. ``continue_final_message``: leave the last
    message, which must be the assistant's, open (the template's end-of-turn after it is
    cut), so generation continues its text; needs ``add_generation_prompt=False`` (vLLM's
    rule). Raises ``InvalidRequestError`` for malformed messages, both flags set, a last
    message that is not the assistant's with ``continue_final_message``, or when there is no
    template (a base model: send plain completions instead)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise InvalidRequestError("messages must be a list of {'role', 'content'} dicts")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true "
                                  "(set add_generation_prompt to false to continue the final message)")
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise InvalidRequestError("continue_final_message needs the last message to be the assistant's")
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise InvalidRequestError(
            f"model {model_id} has no chat template (a base model): send a plain completion "
            "(/v1/completions, `pagedkv generate --raw`) or give one with the chat_template option "
            "(`--chat-template FILE`)")
    kw: dict[str, Any] = {"chat_template": chat_template} if chat_template else {}
    if continue_final_message:
        kw["continue_final_message"] = True
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_TOKEN_KINDS: "weakref.WeakKeyDictionary[Any, tuple[str, frozenset[int]]]" = weakref.WeakKeyDictionary()


def _token_kind(tokenizer: Any) -> tuple[str, frozenset[int]]:
    """``(kind, added token ids)``: kind "byte_level" (GPT-2 style BPE), "sentencepiece"
    (``▁`` for a space, ``<0xNN>`` byte tokens) or "text" (neither: decode each token)."""
    try:
        return _TOKEN_KINDS[tokenizer]
    except (KeyError, TypeError):
        pass
    fast = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer (tokenizers)
    decoder = str(getattr(fast, "decoder", "")) if fast is not None else ""
    if "ByteLevel" in decoder:
        kind = "byte_level"
    elif "ByteFallback" in decoder or "\u2581" in decoder:
        kind = "sentencepiece"
    else:
        kind = "text"
    try:
        added = frozenset(int(i) for i in tokenizer.get_added_vocab().values())
    except Exception:
        added = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()))
    out = (kind, added)
    try:
        _TOKEN_KINDS[tokenizer] = out
    except TypeError:
        pass
    return out


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The UTF-8 bytes token ``token_id`` stands for, also when it holds only part of a
    multi-byte character (its decoded text is then U+FFFD): a byte-level BPE token's
    characters through GPT-2's byte map, a SentencePiece byte token ``<0xNN>`` that byte
    (``▁`` is a space); an added / special token, or a tokenizer of neither kind, the UTF-8
    of its decoded text. Concatenated over a sequence these rebuild its exact text."""
    kind, added = _token_kind(tokenizer)
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str) and int(token_id) not in added:
        m = _BYTE_TOKEN.fullmatch(piece)
        if m is not None and kind != "byte_level":
            return bytes([int(m.group(1), 16)])
        if kind == "byte_level":
            dec = _byte_decoder()
            if all(ch in dec for ch in piece):
                return bytes(dec[ch] for ch in piece)
        elif kind == "sentencepiece":
            return piece.replace("\u2581", " ").encode("utf-8")
    return tokenizer.decode([int(token_id)]).encode("utf-8")
