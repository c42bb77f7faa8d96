"""The disk KV store is keyed by the checkpoint's bytes: two tiny random HF Llama checkpoints
with the same directory name, config, tensor names and shapes but other weights (so the same
model id and revision) never share blocks; the same checkpoint again finds its blocks.
``model_digest`` covers weights, config and tokenizer files and is hashed once per file."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.kv.tiers import KVStoreMismatchError
from pagedkv.model.weight_cache import model_digest

PROMPT = [3 + (7 * i) % 90 for i in range(25)]  # 6 full blocks of 4 looked up (the last token is computed)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _checkpoint(parent, seed: int):
    """A tiny random Llama saved as ``parent/tiny`` (the directory name is the model id)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    out = parent / "tiny"
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(out)
    _tiny_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a, b = _checkpoint(root / "a", seed=1), _checkpoint(root / "b", seed=2)
    return a, b


def _llm(path, store, **kw):
    return LLM(str(path), block_size=4, num_blocks=16, max_model_len=64, enable_prefix_caching=True,
               kv_offload=[f"disk:{store}:4MiB"], debug_invariants=True, **kw)


def _run(llm):
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]


def test_other_weights_same_name_never_get_the_blocks(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))  # file_identity's store of hashes
    a, b = checkpoints
    store = tmp_path / "kv"
    first = _llm(a, store)
    ident_a = first.engine.kv_stores.identity
    cold = _run(first)
    assert cold.num_cached_tokens == 0
    first.close()  # persists the 6 cached blocks

    # b: same model id (directory name), revision (config + file names and sizes), shapes
    with pytest.raises(KVStoreMismatchError, match="weights_digest: '[0-9a-f]{64}' != '[0-9a-f]{64}'") as e:
        _llm(b, store)
    assert "model_id" not in str(e.value) and "revision" not in str(e.value)
    # a user-given revision does not stand in for the bytes
    with pytest.raises(KVStoreMismatchError, match="weights_digest"):
        _llm(b, store, model_revision=first.engine.revision)

    # the first checkpoint again: its blocks are served from disk, the same greedy tokens
    again = _llm(a, store)
    assert again.engine.kv_stores.identity == ident_a
    out = _run(again)
    assert out.num_cached_tokens_by_tier == {"disk": 24} and out.token_ids == cold.token_ids
    again.close()

    # b in a store of its own computes its own K/V (different tokens' logits from other weights)
    other = _llm(b, tmp_path / "kv-b")
    assert other.engine.kv_stores.identity.weights_digest != ident_a.weights_digest
    assert {k: v for k, v in vars(other.engine.kv_stores.identity).items() if k != "weights_digest"} == \
        {k: v for k, v in vars(ident_a).items() if k != "weights_digest"}
    assert _run(other).num_cached_tokens == 0
    other.close()


def test_model_digest_covers_weights_and_tokenizer_and_is_cached(checkpoints, tmp_path):
    a, b = checkpoints
    root = tmp_path / "ids"
    da, db = model_digest(a, root), model_digest(b, root)
    assert len(da) == 64 and da != db
    assert model_digest(a, root) == da and len(list((root / "ids").glob("*.json"))) >= 4  # one per file
    c = tmp_path / "c" / "tiny"
    shutil.copytree(a, c)
    assert model_digest(c, root) == da  # the bytes, not the path
    (c / "tokenizer.json").write_text((c / "tokenizer.json").read_text().replace('"w3"', '"w3x"'))
    assert model_digest(c, root) != da  # another tokenizer: other token ids for a text


def test_model_digest_of_an_unreadable_file_is_a_config_error(tmp_path):
    from pagedkv.errors import ConfigError

    with pytest.raises(ConfigError, match="cannot read .*missing.gguf"):
        model_digest(tmp_path / "missing.gguf", tmp_path)
