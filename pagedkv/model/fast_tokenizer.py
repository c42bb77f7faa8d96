"""A tokenizer that starts without importing transformers (the warm start of a GGUF model).

Importing transformers and building its tokenizer class take ~1.2 s of a 2-core host's warm
start, more than the model itself (~0.3 s for a 1.7B GGUF from its packed cache). The weight
cache's tokenizer entry holds a ``tokenizer.json`` that the ``tokenizers`` library (Rust, the
backend of every transformers fast tokenizer) loads in milliseconds. :class:`FastTokenizer`
answers the engine's hot path from it directly: ``tokenizer(text, add_special_tokens=...)``,
``decode``, ``convert_ids_to_tokens``, ``get_added_vocab``, the BOS/EOS/UNK/PAD tokens and the
chat template's text. Anything else (``apply_chat_template``, ``save_pretrained``, llguidance,
any attribute a user reaches for) goes to the transformers tokenizer of the same directory,
built on first use (once, ~1.2 s) by :attr:`FastTokenizer.hf`.

It is only used where it is known to agree: when the weight cache writes a tokenizer entry (or
first reads one without the record) :func:`check_agreement` compares it with the transformers
tokenizer on probe texts (plain, code, digits, non-ASCII, whitespace, every special token's
text) and ids spread over the vocabulary, for encoding with and without special tokens,
decoding with and without ``skip_special_tokens``, pieces and the special tokens, and writes
the verdict next to the entry (:data:`MARKER`). A tokenizer that differs anywhere (a class with
its own Python pre- or post-processing, ``clean_up_tokenization_spaces`` on a non-BPE model)
keeps loading through transformers.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
import zlib
from pathlib import Path
from typing import Any

#: the file beside a tokenizer entry's manifest that records :func:`check_agreement`'s verdict
MARKER = "fast_tokenizer.json"
#: the transformers tokenizer's own backend (``backend_tokenizer.to_str()``), beside the marker
BACKEND = "fast_tokenizer.backend.json"
#: bump when the probes or the compared surface change: older verdicts are then re-checked
MARKER_VERSION = 2

_SPECIAL = ("bos", "eos", "unk", "pad")
PROBE_TEXTS = (
    "Hello, world! How are you today?",
    " leading space, trailing space ",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "Numbers 0 1 12 123 1234 12345 3.14159 -42 1e-9",
    "Ünïcödé àccents, 中文字符, 日本語のテキスト, 한국어, emoji 🎉🚀👍🏽",
    "   multiple   spaces\tand\ttabs\r\nand CRLF",
    "",
    "a",
    "<unk> <s> </s> [INST] <<SYS>> {{ x }} <|endoftext|>",
)


def _token_text(value: Any) -> str | None:
    """A tokenizer_config special-token value (a string or an AddedToken dict) -> its text."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class FastTokenizer:
    """The tokenizer of a saved transformers tokenizer directory through ``tokenizers`` alone
    (see the module doc): ``backend`` (default: the directory's ``tokenizer.json``) is the
    ``tokenizers`` serialisation to run, e.g. :data:`BACKEND`, the transformers tokenizer's
    backend as its class set it up (Qwen2's class replaces the file's pre-tokenizer). Any
    attribute not defined here (also through ``hasattr``) builds the transformers tokenizer
    first (~1 s once); pickles and deep copies are that tokenizer. Token ids are Python ``int`` lists, as transformers returns them.
    Raises ``OSError`` / ``ValueError`` (from ``tokenizers`` or JSON) for a missing or damaged
    ``tokenizer.json`` / ``tokenizer_config.json``."""

    def __init__(self, directory: str | Path, backend: str | Path | None = None) -> None:
        from tokenizers import Tokenizer

        self._dir = Path(directory)
        self._tk = Tokenizer.from_file(str(backend or self._dir / "tokenizer.json"))
        cfg = json.loads((self._dir / "tokenizer_config.json").read_text())
        self._config = cfg
        self._specials = {name: _token_text(cfg.get(f"{name}_token")) for name in _SPECIAL}
        template = self._dir / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else cfg.get("chat_template")
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    # ---- the transformers tokenizer, on first use -------------------------------------
    @property
    def hf(self) -> Any:
        """The transformers tokenizer of the same directory (built once, on first use; ~1.2 s
        when transformers is not imported yet). Raises ``ConfigError`` if it cannot load."""
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    from pagedkv.model.tokenizer import load_tokenizer

                    self._hf = load_tokenizer(self._dir)
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never for our own fields (unpickling, half-built objects)
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __reduce__(self) -> Any:
        # a pickled or deep copy (Ray ships the replicas' tokenizer to the ingress) is the transformers one
        return (_identity, (self.hf,))

    def __copy__(self) -> "FastTokenizer":
        new = object.__new__(FastTokenizer)
        new.__dict__.update(self.__dict__)
        new._hf_lock = threading.Lock()
        return new

    def __repr__(self) -> str:
        return f"FastTokenizer({str(self._dir)!r}, vocab={len(self)})"

    # ---- the hot path ---------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` (what transformers' fast tokenizers call the same)."""
        return self._tk

    @property
    def _tokenizer(self) -> Any:  # transformers' private name of it, which some libraries read
        return self._tk

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary's size, without added tokens (transformers' ``vocab_size``)."""
        return self._tk.get_vocab_size(with_added_tokens=False)

    def encode(self, text: str, text_pair: Any = None, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        """Token ids (``list[int]``) of ``text``; a pair or other keyword arguments go to transformers."""
        if kwargs or text_pair is not None or not isinstance(text, str):
            return self.hf.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: Any, text_pair: Any = None, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """``{"input_ids", "attention_mask"}`` of a string (lists of ``int``) or of a list of
        strings (lists of such lists); other arguments (padding, tensors, pairs) go to
        transformers."""
        if kwargs or text_pair is not None:
            return self.hf(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = list(self._tk.encode(text, add_special_tokens=add_special_tokens).ids)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            rows = [list(e.ids) for e in self._tk.encode_batch(list(text), add_special_tokens=add_special_tokens)]
            return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
        return self.hf(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        """The text of ``token_ids`` (an ``int``, a list of ``int``, or a tensor / array with
        ``tolist``); a list of such lists gives a list of texts (as transformers' ``decode``);
        other keyword arguments go to transformers."""
        if kwargs:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        token_ids = list(token_ids)
        if token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in token_ids]
        return self._tk.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        """``decode`` of each sequence (a flat list of ids is one sequence, as in transformers)."""
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        if isinstance(sequences, (list, tuple)) and sequences and isinstance(sequences[0], int):
            sequences = [sequences]
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kwargs) for s in sequences]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        """The piece (``str``) of an id, or the pieces of a list of ids (``None`` for an id
        outside the vocabulary)."""
        if skip_special_tokens:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self._tk.id_to_token(ids)
        return [self._tk.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        """The id of a piece (an unknown piece: the UNK token's id, ``None`` without one, as in
        transformers), or the ids of a list of pieces."""
        if isinstance(tokens, str):
            tid = self._tk.token_to_id(tokens)
            return self.unk_token_id if tid is None else tid
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def get_added_vocab(self) -> dict[str, int]:
        """``{added token text: id}``, in id order (transformers' ``get_added_vocab``)."""
        return {tok.content: int(i) for i, tok in sorted(self._tk.get_added_tokens_decoder().items())}

    def _special_id(self, name: str) -> int | None:
        text = self._specials[name]
        return None if text is None else self._tk.token_to_id(text)

    bos_token = property(lambda self: self._specials["bos"], doc="The BOS token's text (or None).")
    eos_token = property(lambda self: self._specials["eos"], doc="The EOS token's text (or None).")
    unk_token = property(lambda self: self._specials["unk"], doc="The UNK token's text (or None).")
    pad_token = property(lambda self: self._specials["pad"], doc="The PAD token's text (or None).")
    bos_token_id = property(lambda self: self._special_id("bos"), doc="The BOS token's id (or None).")
    eos_token_id = property(lambda self: self._special_id("eos"), doc="The EOS token's id (or None).")
    unk_token_id = property(lambda self: self._special_id("unk"), doc="The UNK token's id (or None).")
    pad_token_id = property(lambda self: self._special_id("pad"), doc="The PAD token's id (or None).")


def _identity(x: Any) -> Any:
    return x


def _probe_ids(tok: Any) -> list[int]:
    n = len(tok)
    ids = set(range(0, n, max(1, n // 509))) | set(range(max(0, n - 64), n))
    ids |= {int(i) for i in tok.get_added_vocab().values()}
    return sorted(i for i in ids if i < n)


def check_agreement(hf: Any, fast: FastTokenizer) -> str | None:
    """None if ``fast`` answers every compared call exactly as ``hf`` (a transformers
    tokenizer of the same directory) does, else the first difference (a short description).
    Compared: the special tokens and their ids, ``len``, ``vocab_size``, the chat template's
    text, ``get_added_vocab``, encoding :data:`PROBE_TEXTS` and every special / added token's
    text (alone and inside a sentence) with and without special tokens, decoding those and
    ~600 ids spread over the vocabulary (one at a time and together) with and without
    ``skip_special_tokens``, and their pieces."""
    for name in _SPECIAL:
        for attr in (f"{name}_token", f"{name}_token_id"):
            if getattr(hf, attr, None) != getattr(fast, attr):
                return f"{attr}: {getattr(hf, attr, None)!r} != {getattr(fast, attr)!r}"
    for attr in ("vocab_size", "chat_template"):
        if getattr(hf, attr, None) != getattr(fast, attr):
            return f"{attr} differs"
    if len(hf) != len(fast):
        return f"len: {len(hf)} != {len(fast)}"
    added = hf.get_added_vocab()
    if added != fast.get_added_vocab():
        return "get_added_vocab differs"
    texts = list(PROBE_TEXTS) + [t for t in list(added)[:64]] + [f"Say {t} twice: {t}{t}." for t in list(added)[:16]]
    bos = hf.bos_token
    if bos:
        texts.append(bos + "Hello")
    for text in texts:
        for special in (True, False):
            a = list(hf(text, add_special_tokens=special)["input_ids"])
            b = fast(text, add_special_tokens=special)["input_ids"]
            if a != b:
                return f"encoding {text!r} (add_special_tokens={special}): {a[:8]} != {b[:8]}"
            for skip in (False, True):
                if hf.decode(a, skip_special_tokens=skip) != fast.decode(b, skip_special_tokens=skip):
                    return f"decoding the ids of {text!r} (skip_special_tokens={skip})"
    ids = _probe_ids(hf)
    for skip in (False, True):
        if hf.decode(ids, skip_special_tokens=skip) != fast.decode(ids, skip_special_tokens=skip):
            return f"decoding {len(ids)} spread ids (skip_special_tokens={skip})"
        for i in ids:
            if hf.decode([i], skip_special_tokens=skip) != fast.decode([i], skip_special_tokens=skip):
                return f"decoding id {i} (skip_special_tokens={skip})"
    if hf.convert_ids_to_tokens(ids) != fast.convert_ids_to_tokens(ids):
        return "convert_ids_to_tokens differs"
    pieces = [p for p in hf.convert_ids_to_tokens(ids) if p is not None] + ["<|pagedkv-no-such-token|>"]
    if hf.convert_tokens_to_ids(pieces) != fast.convert_tokens_to_ids(pieces):
        return "convert_tokens_to_ids differs"
    return None


def _checksums(entry: Path, directory: Path) -> dict[str, int]:
    """CRC-32 of :data:`BACKEND` and of every file of ``directory`` (the saved transformers
    tokenizer, which the fast tokenizer does not read but :attr:`FastTokenizer.hf` will):
    ~1 ms a MB, so a damaged file is found at start-up, not at the first chat call."""
    files = [entry / BACKEND] + sorted(p for p in directory.iterdir() if p.is_file())
    return {p.name if p.parent == entry else f"{directory.name}/{p.name}": zlib.crc32(p.read_bytes()) for p in files}


def _transformers_version() -> str | None:
    """transformers' installed version, without importing it (its tokenizer classes set up the
    backend that :data:`BACKEND` records)."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def read_marker(entry: Path, directory: Path) -> bool | None:
    """The verdict recorded beside the tokenizer entry ``entry`` (True: the fast tokenizer of
    :data:`BACKEND` agrees), or None when there is none for this :data:`MARKER_VERSION` and
    ``tokenizers`` and ``transformers`` versions, or a file it covers changed since (``directory``: the entry's
    saved transformers tokenizer)."""
    import tokenizers

    try:
        rec = json.loads((entry / MARKER).read_text())
        if rec.get("version") != MARKER_VERSION or rec.get("tokenizers") != tokenizers.__version__ \
                or rec.get("transformers") != _transformers_version():
            return None
        if rec.get("agrees") and rec.get("crc32") != _checksums(entry, directory):
            return None
    except (OSError, ValueError, AttributeError):
        return None
    return bool(rec.get("agrees"))


def open_fast(entry: Path, directory: Path) -> FastTokenizer:
    """The fast tokenizer of the tokenizer entry ``entry`` (``directory``: its saved
    transformers tokenizer) with the recorded :data:`BACKEND`."""
    return FastTokenizer(directory, entry / BACKEND)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")  # unique per writer
    tmp.write_text(text)
    os.replace(tmp, path)


def write_marker(entry: Path, hf: Any, directory: Path) -> bool:
    """Write ``hf``'s backend (``hf``: the transformers tokenizer of ``directory``) as
    :data:`BACKEND` beside ``entry``, compare the fast tokenizer of it with ``hf``
    (:func:`check_agreement`) and record the verdict as :data:`MARKER` (each file written to a
    temp file, then renamed). Returns the verdict; a failure to load or write records
    nothing and returns False."""
    import tokenizers

    rec: dict[str, Any] = {"version": MARKER_VERSION, "tokenizers": tokenizers.__version__,
                           "transformers": _transformers_version()}
    try:
        text = hf.backend_tokenizer.to_str()
        _replace(entry / BACKEND, text)
        why = check_agreement(hf, open_fast(entry, directory))
        rec["crc32"] = _checksums(entry, directory)
    except OSError:
        return False
    except Exception as e:  # noqa: BLE001 - a tokenizer the fast path cannot read stays on transformers
        why = f"{type(e).__name__}: {e}"
    rec.update(agrees=why is None, why=why)
    try:
        _replace(entry / MARKER, json.dumps(rec))
    except OSError:
        return False
    return why is None
