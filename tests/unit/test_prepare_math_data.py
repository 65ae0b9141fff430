"""tools/prepare_math_data.py: a source it cannot read is one line on stderr, exit 2 and no file (not a
traceback and a 0-byte jsonl that `eval` would then reject); a readable local copy is converted."""

import importlib.util
import json
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "prepare_math_data.py")
_spec = importlib.util.spec_from_file_location("prepare_math_data", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def test_unreadable_source_is_one_line_and_leaves_no_file(tmp_path, capsys):
    out = tmp_path / "data" / "gsm8k_test.jsonl"
    assert tool.main(["gsm8k", "--source", str(tmp_path / "missing.jsonl"), "--split", "test", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--source" in err and "nothing was written" in err
    assert not out.exists() and not (tmp_path / "data" / "gsm8k_test.jsonl.part").exists()


def test_local_copy_is_converted(tmp_path):
    src, out = tmp_path / "gsm8k.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"question": "2+2?", "answer": "so #### 1,004"}) + "\n"
                   + json.dumps({"question": "none?", "answer": "#### "}) + "\n")
    assert tool.main(["gsm8k", "--source", str(src), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["answer"] == "1004" and rows[0]["prompt"].startswith("2+2?\n")
    src.write_text(json.dumps({"question": "none?", "answer": "#### "}) + "\n")
    assert tool.main(["gsm8k", "--source", str(src), "--out", str(tmp_path / "empty.jsonl")]) == 2
    assert not (tmp_path / "empty.jsonl").exists()
