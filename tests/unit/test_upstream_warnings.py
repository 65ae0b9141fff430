"""The command line's filter of known upstream warnings: one line for them all; other warnings pass;
worker processes inherit PYTHONWARNINGS entries that ignore them."""

import subprocess
import sys
import warnings

from megatron_rl import upstream_warnings


def test_known_warnings_become_one_line_and_others_pass(monkeypatch, capsys):
    passed = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: passed.append(str(message)))
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setattr(upstream_warnings, "_shown", set())
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    upstream_warnings.install()
    for text in ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                 "Transformer Engine and Apex are not installed. Falling back to local implementations"):
        warnings.warn(text, UserWarning)
    warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
    warnings.warn("a real problem", UserWarning)
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and len(err.strip().splitlines()) == 1 and "Transformer Engine and Apex are not" not in err
    assert passed == ["a real problem"]
    env = __import__("os").environ["PYTHONWARNINGS"]
    assert env.startswith("default,ignore:Transformer Engine and Apex are not installed:UserWarning")
    child = subprocess.run([sys.executable, "-c", "import warnings; warnings.warn("
                            "'Transformer Engine and Apex are not installed. x', UserWarning); "
                            "warnings.warn('kept', UserWarning)"], capture_output=True, text=True, timeout=60)
    assert "Transformer Engine" not in child.stderr and "kept" in child.stderr
