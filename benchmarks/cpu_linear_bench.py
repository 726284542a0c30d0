"""CPU W4A8 dense linear benchmark: `w4a8_linear` against XLA's float32 and bfloat16 matmuls.

At Qwen3-30B-A3B's dense shapes (attention qkv: N=5120, K=2048; o: N=2048, K=4096; LM head:
N=151936, K=2048) and M rows, it times, in one process on XLA's intra-op pool (the same
threads for every contender):

- ours: `w4a8_linear` on bf16 x (int4 weights packed by `pack_w4a8_linear`, group 128);
- xla_f32: `x @ W.T` in float32;
- xla_bf16: `x @ W.T` in bfloat16.

XLA's weights are stored transposed, [K, N], so its call is `x @ Wt`: given W [N, K], XLA's CPU
backend copies W.T into a new buffer on every call (9x slower at M=1 on the 2-core EPYC).

Cold weights, as in a model: one call of a contender runs a chain of linears, each with its own
weight matrix (x <- first K columns of y, or y repeated, so the calls are sequential), enough
matrices that their bytes are at least 4x the last-level cache (a single matrix bigger than
that, the LM head, is one). Contenders are interleaved in blocks, round by round (--block calls
of ours, then of xla_f32, then of xla_bf16, then ours again, ...) so that each sees the same
machine state; the first call of a block is not timed (it absorbs the switch from the other
contender: caches, the other's threads still awake; calls over 0.2 s run one to a block).
Times are medians per linear (call time /
chain length), per-call dispatch shared by the chain as in a model. An XLA contender whose next M
would take longer than --call-budget seconds a call (extrapolated from the last M) is left out
there; ours always runs.

For M=1 it prints the weight stream's effective GB/s (the bytes of one matrix / time per linear)
and that as a % of the machine's read bandwidth (the fastest of _timing.read_bandwidth_gbps'
probes, the native `_cpu_ffi.read_bandwidth_gbps` among them, on an array 8x the LLC).

    python benchmarks/cpu_linear_bench.py                        # every shape, M in 1,8,128,512
    python benchmarks/cpu_linear_bench.py --shapes lm_head --tokens 1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing
import _timing  # noqa: E402

_timing.size_xla_pool_from_argv(sys.argv[1:])

_timing.use_source_tree_if_not_installed()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# name -> (N outputs, K inputs): Qwen3-30B-A3B (hidden 2048, 32 query + 4 kv heads of 128,
# vocabulary 151936); "tiny" for smoke tests.
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "lm_head": (151936, 2048), "tiny": (256, 256)}
DEFAULT_SHAPES = ("qkv", "o", "lm_head")
CONTENDERS = ("ours", "xla_f32", "xla_bf16")
GROUP_SIZE = 128
LONG_CALL_S = 0.2


def progress(message: str) -> None:
  _timing.progress(message)


def _packed_linear(n: int, k: int, seed: int) -> jax.Array:
  """A packed int4 linear [N, K]: a random slab of rows packed by `pack_w4a8_linear`, repeated
  down to N rows (packing 150 MB through jnp takes ~10 s; the bytes' values do not change the
  kernel's time, the matrix's size and layout do)."""
  from jax_moeq.ops import w4a8_linear_cpu as lin
  slab = math.gcd(n, 2048)
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.integers(-8, 8, (slab, k), dtype=np.int8))
  scale = jnp.asarray(rng.uniform(0.5, 1.5, (slab, k // GROUP_SIZE)) / (8 * np.sqrt(k)),
                      jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(slab), jnp.float32)
  part = np.asarray(lin.pack_w4a8_linear(q, scale, GROUP_SIZE, bias))
  body = part.size - 8 * slab
  reps = n // slab
  full = np.concatenate([np.tile(part[:body], reps), np.tile(part[body:body + 4 * slab], reps),
                         np.tile(part[body + 4 * slab:], reps)])
  assert full.size == lin.w4a8_linear_packed_bytes(n, k, GROUP_SIZE)
  return jnp.asarray(full)


def _float_linear(n: int, k: int, dtype, seed: int) -> jax.Array:
  """W.T [K, N] of a random W [N, K]: XLA's best layout for `x @ W.T`."""
  w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) / np.sqrt(k)
  return jax.block_until_ready(w.astype(dtype))


def _next_input(y: jax.Array, k: int) -> jax.Array:
  """The chain's next x [M, K] from y [M, N]: its first K columns, or y repeated."""
  n = y.shape[-1]
  if n >= k:
    return y[:, :k]
  return jnp.tile(y, (1, k // n))[:, :k]


def chain_fn(name: str, n: int, k: int):
  """jit(x, weights) running x through every matrix of `weights` in turn; returns the last y."""
  from jax_moeq.ops import w4a8_linear_cpu as lin

  def one(x, w):
    if name == "ours":
      return lin.w4a8_linear(x, w, in_features=k, out_features=n, group_size=GROUP_SIZE)
    return x @ w  # w = W.T, [K, N]

  def chain(x, weights):
    y = None
    for i, w in enumerate(weights):
      y = one(x, w)
      if i + 1 < len(weights):
        x = _next_input(y, k)
    return y

  return jax.jit(chain)


def matrix_bytes(name: str, n: int, k: int) -> int:
  from jax_moeq.ops import w4a8_linear_cpu as lin
  if name == "ours":
    return lin.w4a8_linear_packed_bytes(n, k, GROUP_SIZE)
  return n * k * (4 if name == "xla_f32" else 2)


def chain_length(nbytes: int, llc_bytes: int | None, chain: int) -> int:
  """Matrices per call: `chain` if given, else enough that their bytes are at least 4x the
  last-level cache (one when one matrix is)."""
  return chain or max(1, math.ceil(4 * (llc_bytes or 32 << 20) / nbytes))


def make_weights(name: str, n: int, k: int, count: int, seed: int) -> list[jax.Array]:
  if name == "ours":
    first = _packed_linear(n, k, seed)
    # Distinct buffers (what the cache sees), same bytes: copies cost far less than packing.
    return [first] + [jnp.array(first, copy=True) for _ in range(count - 1)]
  dtype = jnp.float32 if name == "xla_f32" else jnp.bfloat16
  first = _float_linear(n, k, dtype, seed)
  return [first] + [jnp.array(first, copy=True) for _ in range(count - 1)]


def bench_shape(shape: str, args, llc_bytes: int | None) -> list[dict]:
  n, k = SHAPES[shape]
  rows: list[dict] = []
  setups = {}
  for name in args.contenders:
    nbytes = matrix_bytes(name, n, k)
    length = chain_length(nbytes, llc_bytes, args.chain)
    progress(f"{shape}: {name}, {length} matrices of {nbytes / 2**20:.1f} MiB")
    setups[name] = (chain_fn(name, n, k), make_weights(name, n, k, length, args.seed), nbytes,
                    length)
  last: dict[str, tuple[int, float]] = {}  # contender -> (M, seconds per call) at the last M
  rng = np.random.default_rng(args.seed)
  for m in args.tokens:
    x32 = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    x16 = x32.astype(jnp.bfloat16)
    inputs = {"ours": x16, "xla_f32": x32, "xla_bf16": x16}
    active = []
    for name in args.contenders:
      if name != "ours" and name in last:
        m0, t0 = last[name]
        if t0 * m / m0 > args.call_budget:
          progress(f"{shape} M={m}: {name} left out (~{t0 * m / m0:.1f} s a call predicted)")
          continue
      active.append(name)
    times: dict[str, list[float]] = {name: [] for name in active}
    # Warm-up (compilation) round, then timed rounds until target_seconds and min_repeats.
    # Calls of over LONG_CALL_S run one to a block: a switch's cost is small beside them.
    blocks = {}
    for name in active:
      fn, weights, _, _ = setups[name]
      start = time.perf_counter()
      _timing.block(fn(inputs[name], weights))
      blocks[name] = args.block if time.perf_counter() - start < LONG_CALL_S else 1
    spent, rounds = 0.0, 0
    while rounds < args.max_repeats:
      for name in active:
        fn, weights, _, _ = setups[name]
        for b in range(blocks[name]):
          start = time.perf_counter()
          _timing.block(fn(inputs[name], weights))
          elapsed = time.perf_counter() - start
          spent += elapsed
          if b > 0 or blocks[name] == 1:  # the first call of a block absorbs the switch
            times[name].append(elapsed)
      rounds += 1
      if rounds >= args.min_repeats and spent >= args.target_seconds:
        break
    row = dict(shape=shape, n=n, k=k, m=m, rounds=rounds)
    for name in args.contenders:
      if name not in times:
        row[f"{name}_us"] = None
        continue
      per_call = statistics.median(times[name])
      last[name] = (m, per_call)
      _, _, nbytes, length = setups[name]
      per_linear = per_call / length
      row[f"{name}_us"] = per_linear * 1e6
      row[f"{name}_gbps"] = nbytes / per_linear / 1e9
    rows.append(row)
    progress(f"{shape} M={m}: " + ", ".join(
        f"{c} {row[c + '_us']:.0f} us" for c in args.contenders if row[c + "_us"] is not None))
  return rows


def fmt(v: float | None, spec: str) -> str:
  return "—" if v is None else format(v, spec)


def report(rows: list[dict], contenders, bandwidth: float) -> str:
  header = ["shape", "N", "K", "M"] + [f"{c} µs" for c in contenders] + [
      f"{c} / ours" for c in contenders[1:]] + ["ours GB/s", "% read bw"]
  lines = []
  for r in rows:
    ours = r.get("ours_us")
    cells = [r["shape"], r["n"], r["k"], r["m"]]
    cells += [fmt(r.get(f"{c}_us"), ".1f") for c in contenders]
    cells += [fmt(None if ours is None or r.get(f"{c}_us") is None else r[f"{c}_us"] / ours,
                  ".2f") for c in contenders[1:]]
    if r["m"] == 1 and ours is not None:
      cells += [f"{r['ours_gbps']:.1f}", f"{100 * r['ours_gbps'] / bandwidth:.0f}"]
    else:
      cells += ["", ""]
    lines.append(cells)
  return _timing.markdown_table(header, lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                      help=f"comma-separated subset of {list(SHAPES)}")
  parser.add_argument("--tokens", default="1,8,128,512", help="comma-separated row counts M")
  parser.add_argument("--contenders", default=",".join(CONTENDERS),
                      help=f"comma-separated subset of {list(CONTENDERS)}, ours first")
  parser.add_argument("--threads", type=int,
                      help="XLA intra-op threads (PJRT_NPROC; default: usable cores)")
  parser.add_argument("--target-seconds", type=float, default=0.3,
                      help="timed seconds per M (all contenders, interleaved)")
  parser.add_argument("--block", type=int, default=3,
                      help="calls of one contender in a row (the first not timed unless 1)")
  parser.add_argument("--min-repeats", type=int, default=2, help="rounds, at least")
  parser.add_argument("--max-repeats", type=int, default=50, help="rounds, at most")
  parser.add_argument("--call-budget", type=float, default=1.0,
                      help="seconds: an XLA contender whose call at the next M would take longer "
                           "(extrapolated linearly in M) is left out there")
  parser.add_argument("--bandwidth-bytes", type=int, default=0,
                      help="array size of the read-bandwidth probe (default: 8x the LLC, at "
                           "least 256 MiB)")
  parser.add_argument("--chain", type=int, default=0,
                      help="matrices per call (default: their bytes >= 4x the last-level cache)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", action="store_true", help="end with one JSON line of the rows")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  args.shapes = [s for s in args.shapes.split(",") if s]
  for s in args.shapes:
    if s not in SHAPES:
      parser.error(f"unknown shape {s!r}; expected some of {list(SHAPES)}")
  args.tokens = [int(t) for t in args.tokens.split(",") if t]
  if args.block < 1 or args.min_repeats < 1:
    parser.error("--block and --min-repeats must be >= 1")
  if not args.tokens or min(args.tokens) < 1:
    parser.error("--tokens: row counts must be >= 1")
  args.contenders = [c for c in args.contenders.split(",") if c]
  if not args.contenders or args.contenders[0] != "ours" or any(
      c not in CONTENDERS for c in args.contenders):
    parser.error(f"--contenders: 'ours' first, then some of {list(CONTENDERS[1:])}")

  from jax_moeq import _ffi
  if not _ffi.cpu_library_available():
    raise SystemExit("the jax_moeq CPU library is not built (scripts/dev_build.sh)")
  threads = args.threads or _timing.usable_cores()
  llc = _timing.last_level_cache()
  llc_bytes = llc[1] if llc else None
  nbytes = args.bandwidth_bytes or max(256 << 20, 8 * (llc_bytes or 0))
  progress(f"measuring read bandwidth ({nbytes / 2**20:.0f} MiB, {_timing.usable_cores()} "
           "threads)")
  bw = _timing.read_bandwidth_gbps(nbytes=nbytes, threads=_timing.usable_cores())
  info = _timing.machine_info()
  load_before = os.getloadavg()[0]
  rows: list[dict] = []
  for shape in args.shapes:
    rows += bench_shape(shape, args, llc_bytes)
  load_after = os.getloadavg()[0]
  probes = ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if k != "best")
  print("## CPU W4A8 dense linear benchmark\n")
  print(f"- machine: {_timing.machine_line(info)}")
  print(f"- threads: {threads} (XLA's intra-op pool, PJRT_NPROC); jax {jax.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}; 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after")
  print(f"- read bandwidth: {bw['best']:.1f} GB/s ({nbytes / 2**20:.0f} MiB array; probes: "
        f"{probes})")
  print(f"- ours: bf16 x, int4 weights, group {GROUP_SIZE}; xla_f32 / xla_bf16: `x @ W.T` in "
        "that dtype, W.T stored [K, N]; µs per linear (median call / chain length, weights "
        "colder than the LLC); \"—\": left out (--call-budget); GB/s at M=1: one matrix's "
        "packed bytes / time\n")
  print(report(rows, args.contenders, bw["best"]))
  if args.json:
    print(json.dumps(dict(machine=info, threads=threads, read_gbps=bw, rows=rows)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
