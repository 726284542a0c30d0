"""kt-kernel's `KTMoEWrapper.forward` on one layer, each way of calling it in a child process of its
own (faulthandler on), its first call at T tokens checked against the float MoE on the same bf16
weights (torch, float32):

  queue           CPUInfer.submit(forward_task) + CPUInfer.sync (what cpu_moe_bench.py times)
  wrapper_sync    KTMoEWrapper.forward(x, ids, w, 0) with KT_FORCE_SYNC_SUBMIT=1 (stream ignored)
  wrapper_stream  KTMoEWrapper.forward(x, ids, w, torch.cuda.current_stream().cuda_stream), CPU
                  tensors; the output read at return, then again after torch.cuda.synchronize()
  wrapper_stream0 the same with stream 0 and no CUDA device (--no-pin: pin_memory dropped, since
                  torch without an accelerator refuses it)
  wrapper_gpu     KTMoEWrapper.forward with x, ids, w on the GPU, as sglang calls it

One line per way: exit status (negative: the signal that ended it), relative Frobenius error of
the output (1.0 = zeros: the MoE never ran), and the last lines of its stderr.

    python benchmarks/ktk_stream_probe.py --ways queue,wrapper_sync,wrapper_stream,wrapper_gpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WAYS = ("queue", "wrapper_sync", "wrapper_stream", "wrapper_stream0", "wrapper_gpu")


def _drop_pin_memory(torch) -> None:
  """torch.zeros / full / empty without pin_memory (CPU torch has no pinned allocator)."""
  def strip(f):
    def g(*a, **kw):
      kw.pop("pin_memory", None)
      return f(*a, **kw)
    return g
  for name in ("zeros", "full", "empty"):
    setattr(torch, name, strip(getattr(torch, name)))


def child(args) -> dict:
  import faulthandler
  faulthandler.enable()
  import torch
  if args.no_pin:
    _drop_pin_memory(torch)
  if args.way == "wrapper_sync":
    os.environ["KT_FORCE_SYNC_SUBMIT"] = "1"
  import kt_kernel
  from kt_kernel import KTMoEWrapper
  e, k, h, i, t = args.experts, args.top_k, args.hidden, args.intermediate, args.tokens
  g = torch.Generator().manual_seed(0)
  gate = (torch.randn(e, i, h, generator=g) / h ** 0.5).bfloat16()
  up = (torch.randn(e, i, h, generator=g) / h ** 0.5).bfloat16()
  down = (torch.randn(e, h, i, generator=g) / i ** 0.5).bfloat16()
  x = torch.randn(t, h, generator=g).bfloat16()
  ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int64)
  w = torch.softmax(torch.randn(t, k, generator=g), -1).float()
  want = torch.zeros(t, h)
  for r in range(t):
    for j in range(k):
      ex = int(ids[r, j])
      xr = x[r].float()
      a = torch.nn.functional.silu(gate[ex].float() @ xr) * (up[ex].float() @ xr)
      want[r] += w[r, j] * (down[ex].float() @ a.bfloat16().float())
  layer = KTMoEWrapper(layer_idx=0, num_experts=e, num_experts_per_tok=k, hidden_size=h,
                       moe_intermediate_size=i, gpu_experts_mask=None,
                       cpuinfer_threads=args.threads, threadpool_count=1,
                       weight_path=args.weight_path, chunked_prefill_size=args.chunk,
                       method=args.method)
  layer.load_weights_from_tensors(gate, up, down, torch.arange(e, dtype=torch.int64))
  err = lambda y: float((y.float().cpu() - want).norm() / want.norm())
  out = {"variant": kt_kernel.__cpu_variant__, "torch": torch.__version__}
  if args.way == "queue":
    y = torch.full((t, h), float("nan")).bfloat16()
    qlen = torch.tensor([t], dtype=torch.int32)
    layer.cpu_infer.submit(layer.moe.forward_task(qlen.data_ptr(), k, ids.data_ptr(), w.data_ptr(),
                                                  x.data_ptr(), y.data_ptr(), False))
    layer.cpu_infer.sync()
    out["error"] = err(y)
  elif args.way in ("wrapper_sync", "wrapper_stream0"):
    out["error"] = err(layer.forward(x, ids, w, 0))
  elif args.way == "wrapper_stream":
    stream = torch.cuda.current_stream().cuda_stream
    y = layer.forward(x, ids, w, stream)
    out["error_at_return"] = err(y)
    torch.cuda.synchronize()
    out["error"] = err(y)
  else:  # wrapper_gpu
    dev = torch.device("cuda")
    y = layer.forward(x.to(dev), ids.to(dev), w.to(dev), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    out["error"] = err(y)
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--ways", default="queue,wrapper_sync,wrapper_stream,wrapper_gpu")
  p.add_argument("--method", default="AMXINT4", choices=("AMXINT4", "AMXINT8"))
  p.add_argument("--tokens", type=int, default=1)
  p.add_argument("--chunk", type=int, default=512, help="chunked_prefill_size")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  p.add_argument("--experts", type=int, default=64)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--intermediate", type=int, default=1024)
  p.add_argument("--weight-path", default="/tmp/ktk_stream_probe")
  p.add_argument("--no-pin", action="store_true", help="drop pin_memory (torch without CUDA)")
  p.add_argument("--timeout", type=float, default=90.0, help="seconds per child process")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.child:
    args.way = args.child
    print("RESULT " + json.dumps(child(args)), flush=True)
    return 0
  for way in args.ways.split(","):
    if way not in WAYS:
      p.error(f"unknown way {way!r}; expected some of {WAYS}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", way, *_without_ways(sys.argv[1:])]
    try:
      run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
      print(f"{way}: no exit within {args.timeout:.0f} s (killed)", flush=True)
      continue
    result = [l[7:] for l in run.stdout.splitlines() if l.startswith("RESULT ")]
    tail = " | ".join(l.strip() for l in run.stderr.strip().splitlines()[-6:])
    print(f"{way}: exit {run.returncode}; {result[0] if result else 'no result'}"
          + (f"; stderr: {tail}" if run.returncode or not result else ""), flush=True)
  return 0


def _without_ways(argv: list[str]) -> list[str]:
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == "--ways":
      skip = True
    elif not a.startswith("--ways="):
      out.append(a)
  return out


if __name__ == "__main__":
  sys.exit(main())
