"""Bad inputs of the reliability replay (``tools/chaos.py``), counted per class: the command line, config, data
and files (:data:`BAD_INPUTS`, in-process ``--dry-run`` or a real start) and the rollout server
(``tools/chaos_server.py``); see ``chaos.py``'s doc for what counts as clear."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional


from chaos_run import RECIPE, REPO, env, overrides

# ---------------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    args: List[str]  # overrides (after the base ones)
    expect: str  # a regex the error must contain (the field or file and the value)
    setup: Optional[Callable[[str, Dict[str, str]], List[str]]] = None  # (work dir, assets) -> more overrides
    run: bool = False  # needs a real start (not knowable by --dry-run)


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def _copy_model(src: str, dst: str, damage: Optional[Callable[[str], None]] = None) -> str:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if damage:
        damage(dst)
    return dst


def _truncate(path: str, keep: float = 0.5) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * keep)])


def _busy_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    _busy_port.sockets.append(s)  # held (accepting nothing) while the cases run
    return s.getsockname()[1]


_busy_port.sockets = []


ROW = '{"prompt": "1+1=", "answer": "2"}'


def _file(field_: str, name: str, text: str) -> Callable:
    """A setup writing ``text`` to ``name`` in the case's directory and pointing ``field_`` at it."""
    return lambda w, a: [f"{field_}={_write(os.path.join(w, name), text)}"]


BAD_INPUTS: List[Case] = [
    # -- types and values: every one of them reported by one run
    Case("several type errors at once", ["steps=x", "rollout.n_samples_per_prompt=1.5", "optim.lr=abc",
                                         "logging.progress=maybe"], r"problems in the config:(\n  - .*){4,}"),
    Case("unknown field", ["rollout.temprature=1.0"], r"rollout\.temprature: unknown field"),
    Case("unknown section", ["rolout.n_samples_per_prompt=4"], r"rolout: unknown field; did you mean 'rollout'"),
    Case("override without =", ["steps"], r"override 'steps'"),
    Case("recipe missing", ["__recipe__=/nonexistent.yaml"], r"recipe '/nonexistent.yaml' does not exist"),
    Case("steps=0", ["steps=0"], r"steps=0 must be >= 1"),
    Case("negative warm-up", ["warmup.steps=-1"], r"warmup.steps=-1"),
    Case("lr inf", ["optim.lr=.inf"], r"optim.lr=inf must be a finite number"),
    Case("lr nan", ["optim.lr=.nan"], r"optim.lr=nan must be a finite number"),
    Case("lr negative", ["optim.lr=-1e-3"], r"optim.lr=-0.001 must be a finite number"),
    Case("min_lr nan", ["optim.schedule.min_lr=.nan"], r"min_lr=nan"),
    Case("max_new_tokens 0", ["rollout.sampling.max_new_tokens=0"], r"max_new_tokens=0 must be >= 1"),
    Case("top_p 0", ["rollout.sampling.top_p=0"], r"top_p=0.0 must be in \(0, 1\]"),
    Case("top_k 0", ["rollout.sampling.top_k=0"], r"top_k=0 must be -1"),
    Case("temperature negative", ["rollout.sampling.temperature=-1", "train.temperature=-1"], r"temperature=-1"),
    Case("temperature mismatch", ["rollout.sampling.temperature=0.7"], r"temperature=0.7 and train.temperature=1.0"),
    Case("batch not divisible", ["rollout.prompts_per_step=3", "train.max_tokens_per_micro_batch=0",
                                 "train.forward_max_tokens_per_micro_batch=0"],
         r"not divisible by data-parallel size"),
    Case("world size vs tp", ["parallel.world_size=3"], r"parallel.world_size=3 is not divisible"),
    Case("one-step colocated", ["rollout.mode=one_step"], r"rollout.mode=.one_step. .*placement=.colocated."),
    Case("in-process reward with a timeout", ["reward.timeout_s=5"], r"reward.timeout_s=5.0 cannot be enforced"),
    Case("checkpoint interval negative", ["checkpoint.interval=-2"], r"checkpoint.interval=-2"),
    Case("keep_last negative", ["checkpoint.keep_last=-1"], r"keep_last=-1"),
    Case("resume_step negative", ["resume_step=-3"], r"resume_step=-3"),
    Case("bad YAML value", ["rollout.urls=[unclosed"], r"not valid YAML"),
    # -- files
    Case("data missing", ["data.path=/no/such.jsonl"], r"data.path='/no/such.jsonl' does not exist"),
    Case("empty jsonl", [], r"data.path='.*empty.jsonl' has no rows", _file("data.path", "empty.jsonl", "")),
    Case("broken jsonl line", [], r"broken.jsonl' line 2: not valid JSON",
         _file("data.path", "broken.jsonl", ROW + "\n" + '{"prompt": \n')),
    Case("jsonl row not an object", [], r"line 1: a list, not an object",
         _file("data.path", "list.jsonl", "[1, 2]\n[3]\n")),
    Case("prompt column missing", ["data.prompt_field=question"], r"data.prompt_field: column 'question' is not in"),
    Case("label column missing", ["data.label_field=solution"], r"data.label_field: column 'solution' is not in"),
    Case("label missing in one row", [], r"data.label_field: column 'answer' is not in .*\(line 2\)",
         _file("data.path", "nolabel.jsonl", ROW + "\n" + '{"prompt": "2+2="}\n')),
    Case("eval data broken", ["eval.interval=5"], r"eval.data.path=.*line 1: not valid JSON",
         _file("eval.data.path", "evalbroken.jsonl", "nope\n")),
    Case("data extension unknown", [], r"cannot infer the format from extension '.csv'",
         _file("data.path", "p.csv", "a,b\n")),
    Case("model dir missing", ["model.hf_path=/no/such/model"], r"model.hf_path='/no/such/model' is not a local HF"),
    Case("corrupt safetensors (truncated)", [], r"model.hf_path: .*model.safetensors has \d+ bytes but its header "
         r"describes \d+ \(truncated\)", lambda w, a: [f"model.hf_path={_copy_model(a['student'], os.path.join(w, 'trunc'), lambda d: _truncate(os.path.join(d, 'model.safetensors')))}"]),
    Case("corrupt safetensors (garbage)", [], r"model.safetensors is not a readable safetensors file", lambda w, a: [
        f"model.hf_path={_copy_model(a['student'], os.path.join(w, 'garbage'), lambda d: _write(os.path.join(d, 'model.safetensors'), 'not a model'))}"]),
    Case("corrupt teacher safetensors", [], r"warmup.teacher: .*truncated", lambda w, a: [
        f"warmup.teacher={_copy_model(a['teacher'], os.path.join(w, 'tteach'), lambda d: _truncate(os.path.join(d, 'model.safetensors'), 0.9))}"]),
    Case("broken config.json", [], r"model.hf_path=.*config.json cannot be read", lambda w, a: [
        f"model.hf_path={_copy_model(a['student'], os.path.join(w, 'badcfg'), lambda d: _write(os.path.join(d, 'config.json'), '{oops'))}"]),
    Case("custom reward: module missing", ["reward.kind=custom", "reward.custom_fn=no_such_mod_xyz:f"],
         r"reward.custom_fn='no_such_mod_xyz:f': cannot import module"),
    Case("custom reward: import raises", [], r"reward.custom_fn=.*importing .* failed \(ZeroDivisionError",
         lambda w, a: ["reward.kind=custom", f"reward.custom_fn={_write(os.path.join(w, 'r1.py'), 'x = 1 / 0')}:f"]),
    Case("custom reward: no such function", [], r"has no attribute 'reward'", lambda w, a: [
        "reward.kind=custom", f"reward.custom_fn={_write(os.path.join(w, 'r2.py'), 'def other(r, l): return 0.0')}:reward"]),
    Case("custom reward: wrong signature", [], r"cannot be called as fn\(response_text, label", lambda w, a: [
        "reward.kind=custom", f"reward.custom_fn={_write(os.path.join(w, 'r3.py'), 'def reward(): return 0.0')}:reward"]),
    Case("custom reward: file missing", ["reward.kind=custom", "reward.custom_fn=/no/such_reward.py:f"],
         r"reward.custom_fn='/no/such_reward.py:f': file '/no/such_reward.py' does not exist"),
    Case("output dir is a file", [], r"logging.output_dir=.* is a file", lambda w, a: [
        f"logging.output_dir={_write(os.path.join(w, 'a_file'), 'x')}"]),
    Case("output dir unwritable", ["logging.output_dir=/proc/megatron_rl_out"],
         r"logging.output_dir='/proc/megatron_rl_out' cannot be written"),
    Case("checkpoints exist without resume", [], r"already holds checkpoints of a run: pass resume=true",
         lambda w, a: _fake_checkpoints(w, "exist", latest="iter_0000002", resume=False)),
    Case("bad latest pointer", [], r"resume=true: .*latest names 'iter_garbage'.*set resume_step",
         lambda w, a: _fake_checkpoints(w, "badptr", latest="iter_garbage")),
    Case("resume_step not there", [], r"resume_step=7: no checkpoint iter_0000007 .* steps \[2\]",
         lambda w, a: _fake_checkpoints(w, "rstep", latest="iter_0000002") + ["resume_step=7"]),
    Case("resume with another model size", [], r"trained from another model than model.hf_path=.*hidden_size",
         lambda w, a: _other_model_checkpoint(w, a)),
    Case("resume with another learning rate", ["optim.lr=1e-3"], r"continues another LR schedule \(lr 0.005 "
         r"\(checkpoint\) vs 0.001 \(now\)", lambda w, a: _other_model_checkpoint(w, a, same_model=True)),
    Case("remote server port busy", [], r"rollout.urls\[0\]='http://127.0.0.1:\d+': no SGLang server answers",
         lambda w, a: ["rollout.engine=remote", f"rollout.urls=[http://127.0.0.1:{_busy_port()}]"]),
    Case("remote server not running", ["rollout.engine=remote", "rollout.urls=[http://127.0.0.1:9]"],
         r"rollout.urls\[0\]='http://127.0.0.1:9': no SGLang server answers"),
    # -- only a start can tell (tokenising)
    Case("an overlong prompt with overlong_policy=error", ["data.overlong_policy=error", "data.max_prompt_tokens=4", "overwrite=true"],
         r"prompt at index 0 of .* has 5 tokens > data.max_prompt_tokens=4", run=True),
    Case("every prompt too long", ["data.max_prompt_tokens=2", "overwrite=true"], r"all \d+ prompts of .* exceed data.max_prompt_tokens=2",
         run=True),
    # -- issue 28: YAML bounds, numeric ranges, model sizes, unreadable prompt files, outputs of another run
    *[Case(name, [], expect, setup) for name, expect, setup in [
        ("recipe nested 10 000 deep", r"nested more than \d+ levels deep", lambda w, a: [
            "__recipe__=" + _write(os.path.join(w, "deep.yaml"), "a: " + "[" * 10000 + "]" * 10000 + "\n")]),
        ("recipe alias bomb", r"aliases expand to more than \d+ values", lambda w, a: [
            "__recipe__=" + _write(os.path.join(w, "bomb.yaml"), _alias_bomb())]),
        ("recipe duplicate key", r"duplicate key 'seed' at line \d+", lambda w, a: [
            "__recipe__=" + _write(os.path.join(w, "dup.yaml"), open(RECIPE).read() + "\nseed: 3\n")]),
        ("recipe in Latin-1", r"recipe .*latin.yaml: not UTF-8 text \(byte 0xe9 at line 1\)", lambda w, a: [
            "__recipe__=" + _write_bytes(os.path.join(w, "latin.yaml"), "# caf\xe9\nseed: 0\n".encode("latin-1"))]),
        ("model config.json hidden_size -64", r"config.json has hidden_size=-64", lambda w, a: [
            "model.hf_path=" + _copy_model(a["student"], os.path.join(w, "m"), lambda d: _set_json(
                os.path.join(d, "config.json"), hidden_size=-64))]),
        ("model config.json num_attention_heads 0", r"config.json has num_attention_heads=0", lambda w, a: [
            "model.hf_path=" + _copy_model(a["student"], os.path.join(w, "m"), lambda d: _set_json(
                os.path.join(d, "config.json"), num_attention_heads=0))]),
        ("data.path a FIFO", r"data.path=.* is a FIFO \(named pipe\), not a file", lambda w, a: [
            "data.path=" + _fifo(os.path.join(w, "fifo.jsonl"))]),
        ("data.path /dev/zero", r"data.path='/dev/zero' is a character device", lambda w, a: [
            "data.path=/dev/zero", "data.format=jsonl"]),
        ("data.path a 0-byte parquet", r"data.path=.*empty.parquet' cannot be read as parquet", lambda w, a: [
            "data.path=" + _write(os.path.join(w, "empty.parquet"), "")]),
        ("resume with latest deleted and no checkpoint", r"holds another run's metrics.jsonl .* resume=true finds no "
         r"checkpoint", lambda w, a: [f"logging.output_dir={os.path.join(w, 'out')}", "resume=true"]),
        ("checkpoints/latest a directory", r"latest is a directory, not the checkpoint pointer file", lambda w, a: (
            os.makedirs(os.path.join(w, "out", "checkpoints", "latest"), exist_ok=True) or ["resume=true"])),
        ("output dir in use by a live run", r"is in use by another run \(pid \d+", lambda w, a: [
            f"logging.output_dir={_locked(os.path.join(w, 'out'))}"]),
    ]],
    *[Case(f"override {arg[:40]}", [arg], expect) for arg, expect in [
        ("seed=" + "9" * 5000, r"override 'seed=9+\.\.\. \(5007 characters\): an integer of 5000 digits"),
        (f"rollout.sampling.max_new_tokens={2**63 - 1}", r"rollout.sampling.max_new_tokens=9223372036854775807 must"),
        ("rollout.n_samples_per_prompt=1000000000", r"rollout.n_samples_per_prompt=1000000000 must be an integer"),
        ("rollout.prompts_per_step=1000000000", r"rollout.prompts_per_step=1000000000 must be an integer"),
        ("rollout.oversample_factor=.inf", r"rollout.oversample_factor=inf must be a finite number"),
        ("seed=-1", r"seed=-1 must be an integer in \[0, 4294967295\]"),
        ("cluster.threads_per_worker=0", r"cluster.threads_per_worker=0 must be an integer"),
        ("cluster.cpus_per_trainer=-1", r"cluster.cpus_per_trainer=-1.0 must be a finite number"),
        ("rollout.request_timeout_s=0", r"rollout.request_timeout_s=0.0 must be a finite number"),
    ]],
]


def _alias_bomb(levels: int = 9) -> str:
    text = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    for i in range(levels):
        text += f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n"
    return text + f"data: *{chr(97 + levels)}\n"


def _write_bytes(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _set_json(path: str, **changes) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    _write(path, json.dumps(data))


def _fifo(path: str) -> str:
    if not os.path.exists(path):
        os.mkfifo(path)
    return path


def _locked(out: str) -> str:
    """``out`` locked by a live process of this host that is not this one (the parent of this process)."""
    import socket

    from megatron_rl.run_dir import LOCK_NAME, _start_time

    os.makedirs(out, exist_ok=True)
    owner = {"pid": os.getppid(), "host": socket.gethostname(), "started": _start_time(os.getppid()), "time": 0}
    _write(os.path.join(out, LOCK_NAME), json.dumps(owner))
    return out


def _fake_checkpoints(work: str, name: str, latest: str, resume: bool = True) -> List[str]:
    out = os.path.join(work, name)
    root = os.path.join(out, "checkpoints")
    os.makedirs(os.path.join(root, "iter_0000002"), exist_ok=True)
    _write(os.path.join(root, "latest"), latest + "\n")
    return [f"logging.output_dir={out}"] + (["resume=true"] if resume else [])


def _other_model_checkpoint(work: str, a: Dict[str, str], same_model: bool = False) -> List[str]:
    """A checkpoint directory whose common state records a model of another width (or the same model, and the
    recipe's LR schedule)."""
    import dataclasses

    import torch

    from megatron_rl.preflight import load_run_config

    out = os.path.join(work, "othermodel")
    path = os.path.join(out, "checkpoints", "iter_0000002")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(a["student"], "config.json")) as f:
        hidden = json.load(f)["hidden_size"]
    schedule = dataclasses.asdict(load_run_config(RECIPE, overrides(a, out), check=False).optim.schedule)
    trainer = {"step": 2, "model_shape": {"hidden_size": hidden if same_model else hidden * 2},
               "schedule": {"config": schedule, "state": {}, "last_lr": None}}
    torch.save({"trainer": trainer}, os.path.join(path, "common.pt"))
    _write(os.path.join(out, "checkpoints", "latest"), "iter_0000002\n")
    return [f"logging.output_dir={out}", "resume=true"]


@dataclass
class InputResult:
    name: str
    exit_code: Optional[int]
    clear: bool  # exit 2, one line per problem, the expected field/file named
    traceback: bool
    data_lost: bool
    message: str = ""
    hang: bool = False  # no answer within the case's deadline


def _sentinel_outputs(out: str) -> Dict[str, str]:
    """A previous run's files in ``out``; returns their contents, to check they survive a failed start."""
    os.makedirs(out, exist_ok=True)
    files = {"config.yaml": "previous: run\n", "metrics.jsonl": json.dumps({"step": 1, "x": 1.0}) + "\n"}
    for name, text in files.items():
        _write(os.path.join(out, name), text)
    return files


DRY_RUN_S = 120  # an in-process --dry-run takes seconds; past this it hangs (a FIFO read, /dev/zero)


class _Hang(BaseException):  # not an Exception: the code under test must not swallow it
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    """SIGALRM after ``seconds`` raises :class:`_Hang` (it interrupts a blocking read too); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_input(case: Case, work: str, a: Dict[str, str]) -> InputResult:
    from megatron_rl import cli

    case_dir = os.path.join(work, re.sub(r"\W+", "_", case.name))
    os.makedirs(case_dir, exist_ok=True)
    extra = case.setup(case_dir, a) if case.setup else []
    out = os.path.join(case_dir, "out")
    recipe = RECIPE
    args = []
    for item in overrides(a, out) + case.args + extra:
        if item.startswith("__recipe__="):
            recipe = item.split("=", 1)[1]
        else:
            args.append(item)
    outputs = next((x.split("=", 1)[1] for x in args[::-1] if x.startswith("logging.output_dir=")), out)
    before = _sentinel_outputs(outputs) if not os.path.isfile(outputs) and outputs.startswith(work) else {}
    traceback, code, text = False, None, ""
    if case.run:
        try:
            proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", recipe, *args], cwd=REPO,
                                  env=env(), capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return InputResult(case.name, None, False, False, False, "no exit within 600 s", hang=True)
        code, text = proc.returncode, proc.stderr
        traceback = "Traceback (most recent call last)" in text
    else:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), _deadline(DRY_RUN_S):
                code = cli.main(["train", recipe, *args, "--dry-run"])
        except _Hang:
            return InputResult(case.name, None, False, False, False, f"no answer within {DRY_RUN_S} s", hang=True)
        except SystemExit as e:  # argparse
            code = e.code
        except Exception as e:  # noqa: BLE001 - what a user would see as a traceback
            traceback, text = True, f"{type(e).__name__}: {e}"
        text = err.getvalue() + text
    lines = [line for line in text.strip().splitlines() if "config error" in line or line.startswith("  - ")]
    message = "\n".join(lines)
    clear = (code == 2 and not traceback and bool(re.search(case.expect, message))
             and all(not line.startswith(" ") or line.startswith("  - ") for line in message.splitlines()))
    lost = any(open(os.path.join(outputs, k)).read() != v for k, v in before.items())
    return InputResult(case.name, code, clear, traceback, lost, message if not clear else message[:300])


def bad_inputs(work: str, a: Dict[str, str], names: Optional[List[str]] = None) -> List[InputResult]:
    cases = [c for c in BAD_INPUTS if names is None or c.name in names]
    return [check_input(c, work, a) for c in cases]


def _chaos_server():
    """tools/chaos_server.py, loaded by path (tools/ is not a package; this file is also loaded by path)."""
    if "chaos_server" not in sys.modules:
        spec = importlib.util.spec_from_file_location("chaos_server", os.path.join(REPO, "tools", "chaos_server.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["chaos_server"] = module
        spec.loader.exec_module(module)
    return sys.modules["chaos_server"]


def server_inputs(work: str, a: Dict[str, str], names: Optional[List[str]] = None) -> List[InputResult]:
    """``chaos_server.server_cases()`` against one embedded server (tiny Qwen3, started once), each next to a
    well-formed request: a 4xx with a message, or a valid 2xx where SGLang accepts the input too, is clear; a 5xx,
    invalid JSON or the other client's request failing is a traceback; the server left paused or unhealthy, or a
    file written outside its folder, counts as data lost (state changed by a bad request)."""
    return [InputResult(r["case"], r["status"], r["verdict"] in ("clear", "accepted"), r["verdict"] == "traceback",
                        r["verdict"] == "broken", r["message"][:300], hang=r["verdict"] == "hang")
            for r in _chaos_server().campaign(work, names=names)]


# Bad-input classes besides BAD_INPUTS: name -> (work dir, assets) -> their results; main() counts each like
# BAD_INPUTS and sums them in one table.
INPUT_CLASSES: Dict[str, Callable[[str, Dict[str, str]], List[InputResult]]] = {"rollout server": server_inputs}
INPUT_COLUMNS = ("tried", "clear", "tracebacks", "hangs", "data_lost")
INPUT_HEADER = "tried | clear one-line errors (or valid 2xx) | tracebacks | hangs | data lost"


def input_counts(results: List[InputResult]) -> Dict[str, int]:
    return dict(tried=len(results), clear=sum(r.clear for r in results), tracebacks=sum(r.traceback for r in results),
                hangs=sum(r.hang for r in results), data_lost=sum(r.data_lost for r in results))


def _print_inputs(title: str, results: List[InputResult]) -> Dict[str, int]:
    print(f"| {title} | exit | clear | traceback | hang | data lost | message |\n|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.exit_code} | {'yes' if r.clear else 'NO'} | {'YES' if r.traceback else 'no'} | "
              f"{'YES' if r.hang else 'no'} | {'YES' if r.data_lost else 'no'} | "
              f"{r.message[:90].replace('|', '/').replace(chr(10), ' ')} |")
    counts = input_counts(results)
    print(f"\n{title}: {INPUT_HEADER}: " + " / ".join(str(counts[k]) for k in INPUT_COLUMNS) + "\n")
    return counts


def print_input_summary(per_class: Dict[str, Dict[str, int]]) -> Dict[str, int]:
    """One table: a row per class and their sum."""
    total = {k: sum(c[k] for c in per_class.values()) for k in INPUT_COLUMNS}
    print(f"| bad inputs | {INPUT_HEADER} |\n|---|---|---|---|---|---|")
    for name, c in [*per_class.items(), ("all", total)]:
        print(f"| {name} | " + " | ".join(str(c[k]) for k in INPUT_COLUMNS) + " |")
    print()
    return total
