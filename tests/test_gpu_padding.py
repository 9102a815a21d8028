"""Issue 30 on the H200: 1,000 request lengths from a long-tailed distribution, served by
padding through ``configs/llm-precompile.yaml``'s restored artifact, in a fresh process.

Run on the GPU machine (about 3 minutes: the bake, then the replay)::

    scripts/gpu-run.sh tests tests/test_gpu_padding.py -k long_tailed

It prints the per-request summary and writes ``$OUT/padding-llm-replay.json`` (the whole
``--json`` report). Expected: 0 compiles over the 1,000 requests (all in the grid), the
padding path's host overhead well under a millisecond at the median, and the served latency
against the unpadded eager call at the median and p99. The reference LLM returns last-position
logits, which right padding changes (the last position is a pad), so its outputs are not
compared: docs/padding.md says which models padding is safe for.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

import kiln
from kiln.compiler.replay import replay
from tests.conftest import ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

LENGTHS = 1000
LONGEST = 2048  # the spec's largest seq bucket


def long_tailed_lengths(n: int, seed: int = 0) -> list[int]:
    """Log-normal request lengths (median ~90 tokens, a tail to 2048): chat-like traffic."""
    rng = random.Random(seed)
    return [min(LONGEST, max(1, round(rng.lognormvariate(4.5, 1.1)))) for _ in range(n)]


def test_long_tailed_lengths_through_llm_precompile_are_served_padded_with_0_compiles(
    tmp_path: Path,
) -> None:
    spec = ROOT / "configs" / "llm-precompile.yaml"
    baked = kiln.bake(spec, tmp_path / "llm.kiln.tar.zst", prove=False)
    assert baked is not None
    kiln.restore(baked.artifact, tmp_path / "cache")
    log = tmp_path / "traffic.jsonl"
    lengths = long_tailed_lengths(LENGTHS)
    log.write_text("".join(json.dumps({"batch": 1, "seq": s}) + "\n" for s in lengths))
    report = replay(spec, tmp_path / "cache", log, eager=True)
    out = Path(os.environ.get("OUT", "out/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "padding-llm-replay.json").write_text(json.dumps(report.to_dict(), indent=2))
    s = report.summary()
    print("\npadding replay, llm-precompile, 1000 long-tailed lengths:")
    print(json.dumps({k: v for k, v in s.items() if k != "max_abs_diff"}, indent=2))
    print("padding", json.dumps(report.result.padding))
    print("eager pass wrote", len(report.result.eager_new_files), report.result.eager_new_files[:3])
    assert s["in_grid"] == LENGTHS and s["off_grid"] == 0
    assert s["compiles_in_grid"] == 0 and s["new_files"] == 0, report.reasons()
    assert report.ok
