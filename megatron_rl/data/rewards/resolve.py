"""Turn a ``RewardConfig`` into a callable ``(response_text, label, sample_info) -> value``.

Runs in the parent (to fail early, with a ``ValueError``, on a bad ``custom_fn``) and again in every
worker process (which rebuilds the function from the config instead of receiving a pickled one, so a
custom function never has to be picklable).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Dict

from megatron_rl.data.rewards.builtin import exact_match_reward, math_reward
from megatron_rl.data.rewards.config import RewardConfig

RewardCall = Callable[[str, Any, Dict[str, Any]], Any]


def load_custom_fn(spec: str) -> Callable[..., Any]:
    """The function named by ``"package.module:function"`` or ``"path/to/file.py:function"``.

    Raises ``ValueError`` saying what could not be found or imported, and why.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"reward.custom_fn={spec!r}: expected 'package.module:function' or "
                         "'path/to/file.py:function'")
    if target.endswith(".py") or os.sep in target or "/" in target:
        module = _load_file(spec, target)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # ImportError, or whatever the module raises while importing
            raise ValueError(f"reward.custom_fn={spec!r}: cannot import module {target!r} "
                             f"({type(exc).__name__}: {exc}); is it installed or on PYTHONPATH?") from exc
    if not hasattr(module, name):
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"reward.custom_fn={spec!r}: {target!r} has no attribute {name!r}; "
                         f"callables there: {available}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"reward.custom_fn={spec!r}: {name!r} is a {type(fn).__name__}, not callable")
    try:
        inspect.signature(fn).bind("response", "label")
    except TypeError as exc:
        raise ValueError(f"reward.custom_fn={spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                         "fn(response_text, label, **sample_info)") from exc
    except ValueError:  # builtins without a signature: let the call decide
        pass
    return fn


def _load_file(spec: str, path: str) -> Any:
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"reward.custom_fn={spec!r}: file {path!r} does not exist")
    # A name unique per path, registered in sys.modules so the module's own pickling/dataclasses work.
    mod_name = f"_megatron_rl_reward_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward.custom_fn={spec!r}: {path!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise ValueError(f"reward.custom_fn={spec!r}: importing {path!r} failed "
                         f"({type(exc).__name__}: {exc})") from exc
    return module


def build_reward_fn(config: RewardConfig) -> RewardCall:
    """The configured reward as ``call(response_text, label, sample_info)``."""
    if config.kind == "math":
        return lambda response, label, info: math_reward(response, label)
    if config.kind == "exact_match":
        fn = functools.partial(exact_match_reward, options=config.exact_match)
        return lambda response, label, info: fn(response, label)
    fn = load_custom_fn(config.custom_fn)  # type: ignore[arg-type]
    return _with_accepted_kwargs(fn)


def _with_accepted_kwargs(fn: Callable[..., Any]) -> RewardCall:
    """Pass only the sample_info keys ``fn`` accepts, so ``def reward(response, label)`` just works."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except ValueError:
        return lambda response, label, info: fn(response, label, **info)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda response, label, info: fn(response, label, **info)
    # The first two parameters receive response and label positionally; never pass them again by name.
    names = {p.name for p in params[2:] if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return lambda response, label, info: fn(response, label, **{k: v for k, v in info.items() if k in names})
