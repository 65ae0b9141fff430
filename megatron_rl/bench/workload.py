"""Synthetic workloads: prompt and response lengths drawn from a named distribution.

A spec string names one distribution:

  ``fixed:N``                              every length N
  ``lognormal:mean=M,sigma=S,cap=C``       lognormal with mean M (not the log's mean), log-sd S, cut at C
                                           (and floored at 1)
  ``empirical:PATH[,field=NAME]``          lengths drawn (with replacement) from a jsonl: one number a line,
                                           or objects with the length in ``NAME`` (default ``length``)

Responses are generated to their drawn length (``rollout.sampling.ignore_eos`` with a per-prompt
``max_new_tokens`` column): each prompt's ``n_samples_per_prompt`` samples share one drawn length.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | lognormal | empirical
    value: int = 0  # fixed
    mean: float = 0.0  # lognormal
    sigma: float = 0.0
    cap: int = 0
    values: Tuple[int, ...] = ()  # empirical

    @classmethod
    def parse(cls, spec: Any, field: str = "length") -> "LengthDist":
        """``spec``: an int (fixed) or a spec string (module docstring); ``field`` names it in errors."""
        if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
            spec = f"fixed:{int(spec)}"
        text = str(spec).strip()
        kind, _, rest = text.partition(":")
        try:
            if kind == "fixed" or (not rest and kind.isdigit()):
                n = int(rest or kind)
                if n < 1:
                    raise ValueError("a length must be >= 1")
                return cls("fixed", value=n)
            if kind == "lognormal":
                kv = dict(p.split("=", 1) for p in rest.split(","))
                d = cls("lognormal", mean=float(kv["mean"]), sigma=float(kv.get("sigma", 0.5)),
                        cap=int(kv.get("cap", 0)) or int(10 * float(kv["mean"])))
                if d.mean < 1 or d.sigma < 0 or d.cap < 1:
                    raise ValueError("mean >= 1, sigma >= 0 and cap >= 1 needed")
                return d
            if kind == "empirical":
                path, *opts = rest.split(",")
                key = dict(o.split("=", 1) for o in opts).get("field", "length")
                values = tuple(_read_lengths(path, key))
                if not values:
                    raise ValueError(f"{path} holds no lengths")
                return cls("empirical", values=values)
        except (KeyError, ValueError, OSError) as e:
            raise ValueError(f"{field}={text!r}: {e}; write fixed:N, lognormal:mean=M,sigma=S,cap=C or "
                             "empirical:PATH.jsonl[,field=NAME]") from None
        raise ValueError(f"{field}={text!r}: unknown distribution {kind!r}; write fixed:N, "
                         "lognormal:mean=M,sigma=S,cap=C or empirical:PATH.jsonl[,field=NAME]")

    @property
    def max(self) -> int:
        return {"fixed": self.value, "lognormal": self.cap}.get(self.kind) or max(self.values)

    def expected(self) -> Tuple[float, float]:
        """``(E[L], E[L^2])`` of the drawn lengths (the lognormal's cap and floor by a fine quantile grid)."""
        if self.kind == "fixed":
            return float(self.value), float(self.value) ** 2
        if self.kind == "empirical":
            v = np.asarray(self.values, dtype=np.float64)
            return float(v.mean()), float((v * v).mean())
        q = (np.arange(4000) + 0.5) / 4000  # midpoint quantiles of the lognormal
        v = self._transform(_norm_ppf(q))
        return float(v.mean()), float((v * v).mean())

    def _transform(self, z: np.ndarray) -> np.ndarray:
        mu = math.log(self.mean) - 0.5 * self.sigma ** 2  # E[exp(N(mu, s^2))] = mean
        return np.clip(np.rint(np.exp(mu + self.sigma * z)), 1, self.cap)

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "empirical":
            return rng.choice(np.asarray(self.values, dtype=np.int64), size=n)
        return self._transform(rng.standard_normal(n)).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.value}"
        if self.kind == "lognormal":
            return f"lognormal:mean={self.mean:g},sigma={self.sigma:g},cap={self.cap}"
        return f"empirical({len(self.values)} lengths, mean {np.mean(self.values):.1f})"


def _norm_ppf(q: np.ndarray) -> np.ndarray:
    from statistics import NormalDist

    nd = NormalDist()
    return np.asarray([nd.inv_cdf(float(x)) for x in q])


def _read_lengths(path: str, key: str) -> List[int]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                v = json.loads(line)
                out.append(int(v[key] if isinstance(v, dict) else v))
    return out


@dataclass(frozen=True)
class Workload:
    prompt: LengthDist
    response: LengthDist

    @classmethod
    def parse(cls, prompt: Any = "fixed:16", response: Any = "fixed:32") -> "Workload":
        return cls(LengthDist.parse(prompt, "bench.prompt_len"), LengthDist.parse(response, "bench.response_len"))

    def describe(self) -> Dict[str, str]:
        return {"prompt_len": self.prompt.describe(), "response_len": self.response.describe()}


def safe_token_ids(tokenizer) -> List[int]:
    """Token ids that survive decode -> encode alone (no special tokens, no merges with themselves)."""
    special = set(tokenizer.all_special_ids)
    vocab = min(len(tokenizer), 4096)
    out = []
    for i in range(vocab):
        if i in special:
            continue
        text = tokenizer.decode([i, i])
        if text.strip() and tokenizer(text, add_special_tokens=False)["input_ids"] == [i, i]:
            out.append(i)
    if not out:
        raise ValueError(f"no token of the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} round-trips through "
                         "decode/encode: the bench cannot write prompts of a chosen length with it")
    return out


def write_prompts(path: str, tokenizer, workload: Workload, n_prompts: int, seed: int = 0) -> Dict[str, float]:
    """A jsonl of ``n_prompts`` prompts (``prompt``, ``answer``, ``max_new_tokens`` columns) whose token
    counts follow ``workload.prompt`` (the tokenizer's own special tokens, e.g. a BOS, included) and whose
    response lengths follow ``workload.response``; returns the realised mean lengths."""
    rng = np.random.default_rng(seed)
    ids = safe_token_ids(tokenizer)
    extra = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    p_len, r_len = workload.prompt.draw(n_prompts, rng), workload.response.draw(n_prompts, rng)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    got = []
    with open(path, "w") as f:
        for p, r in zip(p_len, r_len):
            body = rng.choice(ids, size=max(1, int(p) - extra)).tolist()
            text = tokenizer.decode(body)
            got.append(len(tokenizer(text)["input_ids"]))
            f.write(json.dumps({"prompt": text, "answer": "", "max_new_tokens": int(r)}) + "\n")
    return {"prompt_len_mean": float(np.mean(got)), "response_len_mean": float(np.mean(r_len))}
