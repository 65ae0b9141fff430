"""``megatron-rl report``: every panel from a synthetic run that logs all the metrics it plots (MoE
routing, TRM bounds, MFU, length-surge state, several eval datasets); images exist and are not blank.
The tiny recipe's own report is rendered by tests/e2e/test_train_run.py."""

import json
import math


from megatron_rl.cli import main
from megatron_rl.report import Metrics, render

from run_helpers import nontrivial


def _synthetic_run(d, steps=60):
    lines = []
    for s in range(steps + 1):
        m = {"step": s, "rollout/reward_mean": min(1.0, s / steps + 0.05 * math.sin(s)), "train/warmup": float(s < 10),
             "reward/entropy_bits": 0.5 + 0.3 * math.cos(s / 7), "logprobs/mismatch_k3": 1e-3 * (1 + s / 10),
             "mismatch/max_k2": 0.05, "correction/seq_acceptance": 0.9, "is/ess": 0.8,
             "trm/bound_unified": 0.2, "trm/bound_pinsker_marginal_kl": 0.5, "trm/acceptance_rate": 0.95,
             "gain/tangent": 0.01 * (1 + math.sin(s)), "gain/remainder": -0.002, "gain/slack": 0.01,
             "gain/signal_to_slack": 1 + math.sin(s), "routing/agreement_layer0": 0.9, "routing/agreement_layer1": 0.8,
             "time/step": 3.0, "time/rollout": 1.0, "time/train": 1.5, "time/logprobs": 0.5, "train/lr": 1e-3 / (1 + s),
             "perf/rollout_tokens_per_s": 1000 + s, "perf/tokens_per_s_per_gpu": 500.0, "perf/mfu": 0.3,
             "rollout/response_len_mean": 100 + (50 if s > 40 else 0), "schedule/decaying": float(s > 45),
             "schedule/surge_threshold": 130.0, "train/loss": float("nan") if s == 3 else 0.1}
        if s % 10 == 0:
            m.update({"eval/reward_mean": s / steps, "eval/pass@4": min(1, 1.5 * s / steps),
                      "eval/gsm8k/pass@1": s / steps / 2})
        lines.append({k: (v if math.isfinite(v) else str(v)) for k, v in m.items()})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines) + '{"step": 9, "torn')
    (d / "config.yaml").write_text("steps: 60\nmodel: {hf_path: x}\n")


def test_report_draws_every_panel(tmp_path):
    _synthetic_run(tmp_path)
    assert math.isnan(Metrics.read(str(tmp_path)).lines[3]["train/loss"])  # "nan" strings read back as NaN
    page = render(str(tmp_path))
    out = tmp_path / "report"
    names = ["rewards.png", "mismatch.png", "bounds.png", "routing.png", "time.png", "throughput.png", "lr.png"]
    html = (out / "index.html").read_text()
    for name in names:
        assert nontrivial(out / name), name
        assert f'src="{name}"' in html
    assert page.endswith("index.html") and "resolved config.yaml" in html and "gain/signal_to_slack" in html


def test_coinciding_series_stay_visible_and_say_identical(tmp_path):
    from megatron_rl.report import _Plotter

    m = Metrics([{"step": s, "a": 1.0, "b": 1.0, "c": 0.5 + s, "d": 0.5 + s * 1.001} for s in range(1, 6)])
    p = _Plotter(m, str(tmp_path))
    fig, (ax,) = p.figure(1)
    for key in ("a", "b", "c", "d"):
        p.line(ax, key, key.upper())
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert sorted(lines) == ["A", "B (identical to A)", "C", "D (within 1% of C)"]
    assert lines["B (identical to A)"].get_linestyle() == "--" and lines["A"].get_linestyle() == "-"
    assert lines["B (identical to A)"].get_linewidth() > lines["A"].get_linewidth()
    p.plt.close(fig)


def test_report_skips_absent_panels_and_reports_errors(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/reward_mean": 0.5}) + "\n" +
                                            json.dumps({"step": 2, "rollout/reward_mean": 0.7}) + "\n")
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["index.html", "rewards.png"]
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_export_and_eval_command_line_errors(tmp_path, capsys):
    """Bad input: one line naming the problem, exit 2, nothing started."""
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "no trainer checkpoint there" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nothing")]) == 2
    assert "neither a recipe" in capsys.readouterr().err
