"""lm-evaluation-harness against ``pagedkv serve`` (its ``local-completions`` model) on two
small local tasks (a log-likelihood one and a generation one, data in ``data/``, no hub
access): per-item log-likelihoods equal to lm-eval's own ``hf`` model on the same GGUF
(fp32) within 1e-3, the same accuracy, the same greedy generations."""

from __future__ import annotations

from pathlib import Path

import lm_eval  # the [clients] extra (make test installs it)
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

DATA = Path(__file__).parent / "data"

LL_TASK = """task: pagedkv_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/ll.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pagedkv_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _evaluate(model, model_args, tasks_dir):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["pagedkv_ll", "pagedkv_gen"],
                                   task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True,
                                   batch_size=1)


def test_lm_eval_local_completions_equals_hf(serve_url, hf_model, hf_tokenizer, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "ll.yaml").write_text(LL_TASK.format(data=DATA))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=DATA))
    tok_dir = tmp_path / "tokenizer"
    hf_tokenizer.save_pretrained(tok_dir)  # local-completions tokenizes with it (the GGUF's)
    ours = _evaluate("local-completions", f"model=smol,base_url={serve_url}/v1/completions,tokenizer={tok_dir},"
                     "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=120", tasks)
    # lm-eval's hf model over the session's transformers model (the same GGUF, fp32)
    ref = _evaluate(HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=1, device="cpu"), None, tasks)
    got = {s["doc_id"]: s for s in ours["samples"]["pagedkv_ll"]}
    want = {s["doc_id"]: s for s in ref["samples"]["pagedkv_ll"]}
    assert sorted(got) == sorted(want) == list(range(5))
    for d in got:
        lls = [r[0] for r in got[d]["filtered_resps"]]
        ref_lls = [r[0] for r in want[d]["filtered_resps"]]
        assert len(lls) == len(ref_lls) >= 3
        assert max(abs(a - b) for a, b in zip(lls, ref_lls)) < 1e-3, (d, lls, ref_lls)
        assert [r[1] for r in got[d]["filtered_resps"]] == [r[1] for r in want[d]["filtered_resps"]]
    assert ours["results"]["pagedkv_ll"]["acc,none"] == ref["results"]["pagedkv_ll"]["acc,none"]
    gen = {s["doc_id"]: s["filtered_resps"] for s in ours["samples"]["pagedkv_gen"]}
    ref_gen = {s["doc_id"]: s["filtered_resps"] for s in ref["samples"]["pagedkv_gen"]}
    assert gen == ref_gen and len(gen) == 3
    assert ours["results"]["pagedkv_gen"]["exact_match,none"] == ref["results"]["pagedkv_gen"]["exact_match,none"]
