"""Expert parallelism: all-to-all against replicated token dispatch (`jax_moeq.sharding`), CPU.

One W4A8 MoE layer (default E=64, top-8, H=1024, I=512, group 128) sharded over an expert axis of
`--devices` CPU devices, timed per token count T with both dispatches, interleaved call by call.
Printed beside each time: the bytes a shard sends per call.
- replicated: the psum of T x H float32 partial outputs. A ring all-reduce sends
  2 (n-1)/n of it per shard; the inputs are replicated already.
- all_to_all: per exchange round, n C rows of H activations plus an id and a weight, and the
  same rows back, where C = ceil(capacity_factor T/n K / n). The rows bound for the shard itself
  do not cross a wire; they are counted anyway, so this is an upper bound.

With `--processes P` the devices are spread over P processes on this machine (jax.distributed,
gloo collectives on 127.0.0.1), so the exchanges cross process boundaries. Virtual CPU devices
share the machine's cores, so the times say where the crossover lies on this machine, not how
a cluster scales.

    python benchmarks/ep_dispatch_bench.py --devices 8 --tokens 8,32,128,512,2048
    python benchmarks/ep_dispatch_bench.py --devices 4 --processes 2 --tokens 32,512
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=8, help="devices on the expert axis")
  parser.add_argument("--processes", type=int, default=1)
  parser.add_argument("--tokens", default="8,32,128,512,2048")
  parser.add_argument("--experts", type=int, default=64)
  parser.add_argument("--top-k", type=int, default=8)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--intermediate", type=int, default=512)
  parser.add_argument("--group-size", type=int, default=128)
  parser.add_argument("--capacity-factor", type=float, default=2.0)
  parser.add_argument("--target-seconds", type=float, default=1.0)
  parser.add_argument("--worker", type=int, nargs=2, metavar=("PORT", "RANK"),
                      help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def _setup_jax(args) -> None:
  """Device count (and the distributed runtime) before JAX starts its backend."""
  per_process = args.devices // args.processes
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={per_process}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _timing
  _timing.use_source_tree_if_not_installed()
  import jax
  if args.worker:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, rank = args.worker
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=args.processes, process_id=rank,
                               initialization_timeout=120)


def wire_bytes(dispatch: str, tokens: int, n: int, k: int, h: int, capacity_factor: float,
               act_bytes: int) -> float:
  """Bytes one shard sends per call (module docstring), one exchange round."""
  if dispatch == "replicated":
    return 2 * (n - 1) / n * tokens * h * 4
  from jax_moeq import sharding
  t_local = math.ceil(tokens / n)
  c = sharding.a2a_capacity(t_local, k, n, capacity_factor)
  return 2 * n * c * h * act_bytes + n * c * 8


def run(args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jax_moeq import sharding

  n, e, k, h, i, g = (args.devices, args.experts, args.top_k, args.hidden, args.intermediate,
                      args.group_size)
  rng = np.random.default_rng(0)
  q13 = rng.integers(-8, 8, (e, 2 * i, h)).astype(np.int8)
  q2 = rng.integers(-8, 8, (e, h, i)).astype(np.int8)
  s13 = jnp.asarray(rng.uniform(.01, .05, (e, 2 * i, h // g)), jnp.bfloat16)
  s2 = jnp.asarray(rng.uniform(.01, .05, (e, h, i // g)), jnp.bfloat16)
  mesh = sharding.make_mesh(n, 1, devices=jax.devices())
  weights = sharding.shard_w4a8_weights(q13, q2, s13, s2, g, mesh=mesh)
  fn = jax.jit(sharding.w4a8_moe_sharded, static_argnames=("capacity_factor", "dispatch"))
  rep = NamedSharding(mesh, P())
  rows = []
  for tokens in [int(t) for t in args.tokens.split(",")]:
    calls = []
    for r in range(8):  # fresh routings between calls
      x = rng.normal(size=(tokens, h)).astype(np.float32)
      ids = np.stack([rng.permutation(e)[:k] for _ in range(tokens)]).astype(np.int32)
      w = rng.uniform(0.1, 1, (tokens, k)).astype(np.float32)
      calls.append([jax.make_array_from_callback(a.shape, rep, lambda idx, a=a: a[idx])
                    for a in (x, ids, w)])
    timed = {}
    dispatches = ("replicated", "all_to_all")
    for d in dispatches:  # compile
      jax.block_until_ready(fn(*calls[0], weights, capacity_factor=args.capacity_factor,
                               dispatch=d))
    times = {d: [] for d in dispatches}
    spent, j = 0.0, 0
    while j < 5 or (spent < args.target_seconds and j < 200):
      for d in dispatches:
        start = time.perf_counter()
        jax.block_until_ready(fn(*calls[j % len(calls)], weights,
                                 capacity_factor=args.capacity_factor, dispatch=d))
        elapsed = time.perf_counter() - start
        times[d].append(elapsed)
        spent += elapsed
      j += 1
    for d in dispatches:
      timed[d] = float(np.median(times[d]))
    rows.append({"tokens": tokens, "calls": j,
                 **{f"{d}_ms": timed[d] * 1e3 for d in dispatches},
                 **{f"{d}_wire_kb": wire_bytes(d, tokens, n, k, h, args.capacity_factor, 4) / 1e3
                    for d in dispatches}})
  return rows


def _spawn(args, argv) -> list[dict]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--worker",
                             str(port), str(rank)], stdout=subprocess.PIPE, text=True)
           for rank in range(args.processes)]
  outs = [p.communicate(timeout=1800)[0] for p in procs]
  if any(p.returncode for p in procs):
    raise SystemExit(f"a worker failed: {[p.returncode for p in procs]}")
  return json.loads(outs[0].strip().splitlines()[-1])


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = _parse(argv)
  if args.devices % args.processes:
    raise SystemExit("--devices must be a multiple of --processes")
  if args.processes > 1 and not args.worker:
    rows = _spawn(args, argv)
  else:
    _setup_jax(args)
    rows = run(args)
    if args.worker:
      if args.worker[1] == 0:
        print(json.dumps(rows))
      return 0
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _timing
  model, _ = _timing.cpu_model_and_flags()
  print(f"## EP token dispatch, {args.devices} CPU devices in {args.processes} process(es)\n")
  print(f"- {time.strftime('%Y-%m-%d %H:%M')}; {model}, {_timing.usable_cores()} usable cores; "
        f"E={args.experts} top-{args.top_k} H={args.hidden} I={args.intermediate} W4A8 group "
        f"{args.group_size}, f32 activations, capacity factor {args.capacity_factor}")
  print(f"- command: `python benchmarks/ep_dispatch_bench.py {' '.join(argv)}`\n")
  header = ["T", "replicated ms", "all_to_all ms", "a2a / replicated", "replicated KB sent",
            "all_to_all KB sent"]
  table = [[r["tokens"], f"{r['replicated_ms']:.2f}", f"{r['all_to_all_ms']:.2f}",
            f"{r['all_to_all_ms'] / r['replicated_ms']:.2f}", f"{r['replicated_wire_kb']:.0f}",
            f"{r['all_to_all_wire_kb']:.0f}"] for r in rows]
  print(_timing.markdown_table(header, table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
