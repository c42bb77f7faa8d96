"""`pagedkv generate` input errors fail fast (before loading the model) with rc 2."""

from pagedkv.cli import main


def test_generate_bad_inputs_fail_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    notjson = tmp_path / "nj.jsonl"
    notjson.write_text("{oops\n")
    extra = tmp_path / "extra.jsonl"
    extra.write_text('"fine"\n{"prompt": "hi", "max_tokens": 5}\n')
    both = tmp_path / "both.jsonl"
    both.write_text('{"prompt": "hi", "messages": []}\n')
    cases = [
        (["generate", "--input", str(tmp_path / "missing.jsonl")], "cannot read"),
        (["generate", "--input", str(bad)], "line 1: expected"),
        (["generate", "--input", str(notjson)], "line 1: not JSON"),
        (["generate", "--input", str(extra)], "line 2: unknown key(s) 'max_tokens'"),
        (["generate", "--input", str(both)], 'line 1: a line is a string, {"prompt": "..."} or'),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
        (["generate", "--temperature", "-1", "hi"], "temperature"),
        (["generate"], "no prompts"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "pagedkv: error:" in err and msg in err, (argv, err)
