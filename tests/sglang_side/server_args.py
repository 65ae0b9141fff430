"""Our `sglang.launch_server` command lines parsed by SGLang 0.5.23's own argument parser.

Run with the SGLang venv's python (imports sglang, never megatron_rl):

    .venv-sglang/bin/python tests/sglang_side/server_args.py < input.json

`sglang.launch_server` builds its parser with `ServerArgs.add_cli_args` and parses `sys.argv[1:]`
(`prepare_server_args`); this script runs the same two steps, without constructing `ServerArgs` (whose
`__post_init__` probes the GPU). An unknown flag, a bad value or a value outside a flag's choices is what
`launch_server` would die on at start-up.

Input (stdin): {"argvs": [[...], ...]}: argument lists as they follow `-m sglang.launch_server`.
Output (stdout): {"parsed": [{"ok": true, "args": {dest: value, ...}} | {"ok": false, "error": "..."}, ...]}
"""

import argparse
import contextlib
import io
import json
import sys

from _common import quiet


def main() -> None:
    quiet()
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    out = []
    for argv in json.load(sys.stdin)["argvs"]:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parser.parse_args(argv)
        except SystemExit:
            out.append({"ok": False, "error": err.getvalue().strip().splitlines()[-1]})
            continue
        out.append({"ok": True, "args": {k: v for k, v in vars(ns).items()
                                         if isinstance(v, (str, int, float, bool, type(None)))}})
    print(json.dumps({"parsed": out}))


if __name__ == "__main__":
    main()
