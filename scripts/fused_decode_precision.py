"""Diagnostic (GPU): relative Frobenius error of both one-token paths against the tests' jnp
reference, per case. Run twice, with and without XLA_FLAGS=--xla_allow_excess_precision=false,
to see whether XLA's excess precision on the GPU moves the reference."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_wna16_gpu as t  # noqa: E402

print("XLA_FLAGS =", os.environ.get("XLA_FLAGS", ""))
for case in t.FUSED_DECODE_CASES + t.ONE_TOKEN_CASES:
  errs = []
  for fused in (False, True):
    got, want, _ = t._run_case(case, fused_decode=fused)
    errs.append(t._rel(got, want))
  print(f"{t._case_id(case):48s} kernels {errs[0]:.3e}  fused {errs[1]:.3e}", flush=True)
