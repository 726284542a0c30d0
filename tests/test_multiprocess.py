"""Expert and tensor parallelism across processes: 2 and 4 Python processes on this machine,
joined by `jax.distributed.initialize` (coordinator on 127.0.0.1, CPU collectives through gloo),
each with one or two CPU devices, run the sharded W4A8 MoE through the public API
(`jax_moeq.sharding`) with all-to-all and replicated token dispatch, and compare with the
single-device op computed in each process.

Tolerances as in tests/test_sharding.py: all-to-all EP is bit-identical to the op; replicated EP
agrees to float32 reassociation (1e-6); with TP, both dispatches sum the same float32 partials of
the slices (1e-6 between them). Every process is bounded in time and killed if any fails.

`from_pretrained(mesh=...)` across 2 processes: each reads exactly the bytes of its own half of
the experts (per-expert and fused checkpoints), and the gathered logits match the unsharded
model's (tolerance as in tests/test_sharded_loading.py). `generate` with one process per device
(2 CPU processes; on a GPU machine one process per GPU) gives the unsharded model's greedy
tokens.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

import jax_moeq

_WORKER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, n_proc, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n_proc,
                               process_id=rank, initialization_timeout=120)
    import jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_moeq.ops import w4a8_cpu as op
    from jax_moeq import sharding as sh

    devices = jax.devices()
    assert jax.process_count() == n_proc and len(devices) == n_proc * len(jax.local_devices())
    r = np.random.default_rng(5)  # the same problem in every process
    E, H, I, T, K, g = 8, 128, 128, 13, 2, 32
    q13 = r.integers(-8, 8, (E, 2 * I, H)).astype(np.int8)
    q2 = r.integers(-8, 8, (E, H, I)).astype(np.int8)
    s13 = r.uniform(.01, .05, (E, 2 * I, H // g)).astype(np.float32)
    s2 = r.uniform(.01, .05, (E, H, I // g)).astype(np.float32)
    b13 = r.normal(size=(E, 2 * I)).astype(np.float32)
    b2 = r.normal(size=(E, H)).astype(np.float32)
    x = r.normal(size=(T, H)).astype(np.float32)
    ids = np.stack([r.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    w = r.uniform(0.1, 1, (T, K)).astype(np.float32)

    # The single-device op, in this process.
    local = jax.local_devices()[0]
    with jax.default_device(local):
      w13p, w2p, *_ = op.convert_to_w4a8_int8_moe_format(q13, q2, jnp.asarray(s13, jnp.bfloat16),
                                                          jnp.asarray(s2, jnp.bfloat16), g, b13, b2)
      want = np.asarray(op.dynamic_4bit_int_moe(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(w),
                                                w13p, w2p, H, I, 2 * I, g))

    def rel(a, b):
      return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))

    run = jax.jit(sh.w4a8_moe_sharded, static_argnames=("capacity_factor", "dispatch"))
    n = len(devices)
    for ep, tp in ((n, 1), (n // 2, 2)):
      mesh = sh.make_mesh(ep, tp, devices=devices)
      sw = sh.shard_w4a8_weights(q13, q2, jnp.asarray(s13, jnp.bfloat16),
                                 jnp.asarray(s2, jnp.bfloat16), g, mesh=mesh,
                                 tensor_axis="tp" if tp > 1 else None, w13_bias=b13, w2_bias=b2)
      rep = NamedSharding(mesh, P())
      args = [jax.make_array_from_callback(a.shape, rep, lambda i, a=a: a[i]) for a in (x, ids, w)]
      got = {}
      for dispatch, cap in (("replicated", 2.0), ("all_to_all", 2.0), ("all_to_all", 0.25)):
        out = run(*args, sw, capacity_factor=cap, dispatch=dispatch)
        got[dispatch, cap] = np.asarray(multihost_utils.process_allgather(out, tiled=True))
      if tp == 1:
        np.testing.assert_array_equal(got["all_to_all", 2.0], want)
        np.testing.assert_array_equal(got["all_to_all", 0.25], want)
        assert rel(got["replicated", 2.0], want) <= 1e-6
      else:
        assert rel(got["all_to_all", 2.0], got["replicated", 2.0]) <= 1e-6
        np.testing.assert_array_equal(got["all_to_all", 0.25], got["all_to_all", 2.0])
    print(f"ok {rank}", flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(worker: str, n_proc: int, devices_per_proc: int, cwd, args: tuple[str, ...] = (),
                 timeout: float = 480, platform: str = "cpu") -> None:
  """Runs `worker` as n_proc processes (argv: port, n_proc, rank, *args); all must print
  'ok {rank}'. If one fails or time runs out, the others are killed. platform="cuda": the
  processes see every GPU (the worker picks its own with local_device_ids)."""
  env = dict(os.environ, JAX_PLATFORMS=platform)
  if platform == "cpu":
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices_per_proc}").strip()
  # The workers import the same jax_moeq as this process, from outside the repository.
  package_parent = os.path.dirname(os.path.dirname(os.path.abspath(jax_moeq.__file__)))
  env["PYTHONPATH"] = package_parent + os.pathsep + env.get("PYTHONPATH", "")
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", worker, str(port), str(n_proc), str(rank),
                             *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for rank in range(n_proc)]
  deadline = time.monotonic() + timeout
  try:
    while any(p.poll() is None for p in procs):
      if time.monotonic() > deadline:
        raise AssertionError(f"the {n_proc} processes did not finish within {timeout} s")
      failed = [p for p in procs if p.poll() not in (None, 0)]
      if failed:  # one failed: the others would wait for it at the next collective
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
    outputs = [p.communicate() for p in procs]
  for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"ok {rank}" in out, (
        f"process {rank} of {n_proc}: rc={p.returncode}\n{out[-2000:]}\n{err[-4000:]}")


@pytest.mark.parametrize("n_proc,devices_per_proc", [(2, 2), (4, 1), (4, 2)])
def test_sharded_moe_across_processes(n_proc, devices_per_proc, tmp_path):
  _run_workers(_WORKER, n_proc, devices_per_proc, tmp_path)


# `from_pretrained(mesh=...)` in 2 processes x 2 CPU devices, EP over the 4: process r holds EP
# ranks 2r and 2r+1, i.e. experts [4r, 4r+4) of 8. Every read of tensor data goes through
# `safetensors_io._read_bytes`; the worker logs the byte ranges and maps them to experts.
_LOAD_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port, n_proc, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    paths = json.loads(sys.argv[4])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n_proc,
                               process_id=rank, initialization_timeout=120)
    import jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_moeq import models, sharding as sh
    from jax_moeq.loaders import SafetensorsDir, safetensors_io

    log = []
    real_read = safetensors_io._read_bytes
    def logged(file, start, nbytes, name):
      log.append((str(file), start, start + nbytes))
      return real_read(file, start, nbytes, name)
    safetensors_io._read_bytes = logged

    def expert_spans(path, num_experts):
      # expert id -> byte ranges of its share of every expert tensor (all layers)
      ckpt, out = SafetensorsDir(path), {e: [] for e in range(num_experts)}
      for name in ckpt.keys():
        info, parts = ckpt.info(name), name.split(".")
        if "experts" not in parts:
          continue
        after = parts[parts.index("experts") + 1]
        if after.isdigit():
          out[int(after)].append((str(info.file), info.start, info.start + info.nbytes))
        elif len(info.shape) >= 2 and info.shape[0] == num_experts:
          row = info.nbytes // num_experts
          out_rows = [(str(info.file), info.start + e * row, info.start + (e + 1) * row)
                      for e in range(num_experts)]
          for e, span in enumerate(out_rows):
            out[e].append(span)
      return out

    def read_experts(spans):
      touched = {e for e, ss in spans.items()
                 if any(f == g and a < d and c < b for f, a, b in ss for g, c, d in log)}
      whole = {e for e, ss in spans.items() if ss and all(
          any(f == g and c <= a and b <= d for g, c, d in log) for f, a, b in ss)}
      return touched, whole

    def rel(a, b):
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    assert jax.process_count() == n_proc
    mesh = sh.make_mesh(len(jax.devices()), 1)
    mine = set(range(4 * rank, 4 * rank + 4))
    assert set(sh.local_expert_ids(mesh, "ep", 8)) == mine
    ids = np.random.default_rng(0).integers(0, 256, (2, 7)).astype(np.int32)
    global_ids = jax.make_array_from_callback(ids.shape, NamedSharding(mesh, P()),
                                              lambda i: ids[i])
    run = jax.jit(lambda m, i: m(i))
    for name, dispatch in (("per_expert", "all_to_all"), ("per_expert", "replicated"),
                           ("fused", "all_to_all")):
      log.clear()
      model = models.from_pretrained(paths[name], quantization="w4a8_int8", dtype=jnp.float32,
                                     show_progress=False, mesh=mesh, dispatch=dispatch)
      touched, whole = read_experts(expert_spans(paths[name], 8))
      assert touched == whole == mine, (name, sorted(touched), sorted(whole))
      got = multihost_utils.process_allgather(run(model, global_ids), tiled=True)
      with jax.default_device(jax.local_devices()[0]):
        full = models.from_pretrained(paths[name], quantization="w4a8_int8", dtype=jnp.float32,
                                      show_progress=False)
        want = np.asarray(run(full, ids))
      # tests/test_sharded_loading.py: EP keeps the W4A8 arithmetic; f32 reassociation only.
      err = rel(got, want)
      assert err <= 1e-5, (name, dispatch, err)
    print(f"ok {rank}", flush=True)
""")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  pytest.importorskip("torch", reason="the checkpoints are written by transformers")
  pytest.importorskip("transformers", reason="the checkpoints are written by transformers")
  import test_sharded_loading  # the tiny checkpoints of the one-process tests
  return test_sharded_loading._checkpoints(tmp_path_factory.mktemp("sharded_ckpts"))


def test_from_pretrained_reads_only_local_experts_across_processes(checkpoints, tmp_path):
  _run_workers(_LOAD_WORKER, 2, 2, tmp_path, (json.dumps(checkpoints),), timeout=300)


# Greedy generation with one process per device: `from_pretrained(mesh=...)` on the global mesh
# (WNA16 experts quantized on load, EP over all devices, all-to-all and replicated dispatch),
# `generate` with a batch that the mesh splits for attention, against the unsharded model run in
# each process on its first local device. argv after the rank: checkpoint paths, platform.
_GENERATE_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    port, n_proc, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    paths, platform = json.loads(sys.argv[4]), sys.argv[5]
    kw = {}
    if platform == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
      kw = dict(local_device_ids=[rank])  # one GPU per process
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n_proc,
                               process_id=rank, initialization_timeout=120, **kw)
    import jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from jax_moeq import models, sharding as sh
    assert jax.process_count() == n_proc
    backend = "reference" if platform == "cpu" else "auto"
    dt = jnp.float32 if platform == "cpu" else jnp.bfloat16
    opts = dict(quantization="wna16", moe_backend=backend, dtype=dt, show_progress=False)
    prompts = [[5, 6, 7], [1, 2, 3], [200, 4, 9], [9, 9, 9]]
    with jax.default_device(jax.local_devices()[0]):
      full = models.from_pretrained(paths["per_expert"], **opts)
      want = np.asarray(models.generate(full, prompts, max_new_tokens=5, eos_token_id=[]).tokens)
    mesh = sh.make_mesh(len(jax.devices()), 1)
    for dispatch in ("all_to_all", "replicated"):
      model = models.from_pretrained(paths["per_expert"], mesh=mesh, dispatch=dispatch, **opts)
      got = models.generate(model, prompts, max_new_tokens=5, eos_token_id=[])
      tokens = np.asarray(multihost_utils.process_allgather(got.tokens, tiled=True))
      np.testing.assert_array_equal(tokens, want, err_msg=dispatch)
    print(f"ok {rank}", flush=True)
""")


def test_generate_with_one_process_per_device(checkpoints, tmp_path):
  _run_workers(_GENERATE_WORKER, 2, 1, tmp_path, (json.dumps(checkpoints), "cpu"), timeout=400)


def _gpu_count() -> int:
  import jax
  try:
    return len(jax.devices("gpu"))
  except RuntimeError:
    return 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs at least 2 GPUs with our CUDA library")
def test_generate_with_one_process_per_gpu(checkpoints, tmp_path):
  """One process per GPU (all local GPUs, NCCL between processes): the same greedy tokens as one
  GPU, WNA16 experts on the GPU kernel."""
  n = max(k for k in (2, 4, 8) if k <= _gpu_count())
  _run_workers(_GENERATE_WORKER, n, 1, tmp_path, (json.dumps(checkpoints), "cuda"), timeout=600,
               platform="cuda")
