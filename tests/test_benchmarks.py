"""The CPU benchmark runs end to end on a tiny shape (as a script, importing whichever jax_moeq
is installed or on PYTHONPATH), the native read-bandwidth probe behind its "% DRAM", and the GPU
benchmarks' side-by-side harness on CPU ops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moeq import _ffi

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_moe_bench.py"
pytestmark = pytest.mark.skipif(not _ffi.cpu_library_available(), reason="CPU library not built")


def test_read_probe_measures_and_refuses_bad_sizes():
  gbps = _ffi.cpu_module().read_bandwidth_gbps(64 << 20, 2, 2)
  assert 0.1 < gbps < 10_000, gbps
  with pytest.raises(ValueError, match="must be >= 1"):
    _ffi.cpu_module().read_bandwidth_gbps(0, 1)
  with pytest.raises(ValueError, match="must be >= 1"):
    _ffi.cpu_module().read_bandwidth_gbps(1 << 20, 0)


def test_cpu_bench_runs_on_a_tiny_shape(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, str(BENCH), "--shapes", "tiny", "--tokens", "1,3", "--layers", "2",
         "--target-seconds", "0.05", "--baselines", "ort,ref,xla", "--baseline-budget", "5",
         "--threads", "1", "--out", str(tmp_path / "report.md"), "--json"]
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["threads"] == 1 and result["dram_gbps"] > 0
  rows = result["rows"]["tiny"]
  assert [r["tokens"] for r in rows] == [1, 3]
  for r in rows:
    assert r["ours_s"] > 0 and r["weight_gbps"] > 0 and r["calls"] >= 5
    assert r["ref_s"] is not None and r["xla_s"] is not None
  report = (tmp_path / "report.md").read_text()
  assert "### tiny (E=8, top-2, H=256, I=256" in report and "DRAM read bandwidth" in report
  assert "check at T=3: kernel vs jnp reference" in report


def test_cpu_spread_probe_reports_calls_and_thread_placement():
  probe = BENCH.parent / "cpu_spread_probe.py"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, str(probe), "--shape", "tiny", "--tokens", "16", "--layers", "2",
         "--calls", "5", "--threads", "1", "--sample-ms", "0.5"]
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  result = json.loads(lines[-2])
  assert result["threads"] == 1 and len(result["calls_ms"]) == 5
  m = result["ms_per_layer"]
  assert 0 < m["min"] <= m["median"] <= m["max"]
  assert result["samples"] >= 1 and 0 <= result["share_same_cpu"] <= 1
  assert 0 <= result["share_smt_siblings"] <= 1 and result["cpus_seen"] >= 0
  assert lines[-1].startswith(f"# process {result['pid']} (T=16, JAX_MOEQ_CPU_WORKERS=")


def test_cpu_linear_bench_runs_on_a_tiny_shape():
  bench = BENCH.parent / "cpu_linear_bench.py"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, str(bench), "--shapes", "tiny", "--tokens", "1,3", "--chain", "2",
         "--target-seconds", "0.02", "--bandwidth-bytes", str(16 << 20), "--threads", "1",
         "--json"]
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["threads"] == 1 and result["read_gbps"]["best"] > 0
  assert [r["m"] for r in result["rows"]] == [1, 3]
  for r in result["rows"]:
    assert r["ours_us"] > 0 and r["xla_f32_us"] > 0 and r["xla_bf16_us"] > 0
  assert "| tiny | 256 | 256 | 1 |" in out.stdout and "% read bw" in out.stdout


def test_ep_dispatch_bench_runs_on_a_tiny_layer(tmp_path):
  bench = BENCH.parent / "ep_dispatch_bench.py"
  cmd = [sys.executable, str(bench), "--devices", "4", "--tokens", "3,16", "--experts", "8",
         "--top-k", "2", "--hidden", "128", "--intermediate", "128", "--group-size", "32",
         "--target-seconds", "0.05"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False,
                       cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line for line in out.stdout.splitlines() if line.startswith("| 3 ") or
          line.startswith("| 16 ")]
  assert len(rows) == 2, out.stdout
  for row in rows:
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[1]) > 0 and float(cells[2]) > 0, row


def test_gpu_peer_harness_times_each_op_and_reports_a_refusal(monkeypatch, capsys):
  # The side-by-side harness of the GPU benchmarks (w4a8_gpu_bench, tokamax_bench), on CPU ops.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import gpu_moe_bench as gb  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(gb.SHAPES, "tiny", (4, 2, 128, 64))
  make = lambda key, e, h, i: jax.random.normal(key, (e, h, i), jnp.float32)

  def layer(x, w, ids, weights):
    y = jnp.einsum("th,thi->ti", x.astype(jnp.float32), w[ids[:, 0]])
    return y * weights[:, :1]

  def refuse(x, w, ids, weights):
    raise NotImplementedError("no kernel for this shape")

  rows = gb.peer_rows(["tiny"], [1, 5], [("a", make, layer), ("b", make, refuse)], hbm=1e11,
                      gpu_time=True)
  assert [(r["shape"], r["T"]) for r in rows] == [("tiny", 1), ("tiny", 5)]
  for r in rows:
    assert r["a_us"] > 0 and r["a_tflops"] > 0 and 0 < r["a_hbm_frac"]
    assert r["a_gpu_us"] is None  # no GPU events on the CPU
    assert r["b_us"] is None and 1 <= r["experts_hit"] <= 4
  out = capsys.readouterr().out
  assert out.count("b failed at tiny") == 2 and "no kernel for this shape" in out
  gb.print_peer_table(rows + [dict(rows[0], b_us=2 * rows[0]["a_us"], b_tflops=1.0)], ("a", "b"))
  table = capsys.readouterr().out.splitlines()
  assert table[0].split()[-1] == "a/b" and table[1].split()[-1] == "n/a"
  assert table[-1].split()[-1] == "0.50"
  assert "GPU us" not in table[0]  # no GPU times: no such column
  gb.print_peer_table([dict(rows[0], a_gpu_us=3.25)], ("a", "b"))
  table = capsys.readouterr().out.splitlines()
  assert table[0].split()[-4:] == ["a", "GPU", "us", "a/b"]
  assert table[1].split()[-2:] == ["3.2", "n/a"]


def test_gpu_roofline_plot_reads_both_benchmark_json_kinds(monkeypatch, tmp_path):
  # benchmarks/plot_gpu_roofline.py: % of the int4 roofline from gpu_moe_bench.py's JSON and from
  # the side-by-side harness's, with the byte term or the FLOP term binding.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import plot_gpu_roofline as plot  # pylint: disable=import-outside-toplevel
  moe = tmp_path / "moe.json"
  # 100 us moving 2 TB/s of a 4 TB/s copy rate (roof 50 us); 10 ms at 350 of 700 TFLOP/s.
  moe.write_text(json.dumps(dict(device="GPU", copy_tbps=4.0, rows=[
      dict(shape="S", T=1, us=100.0, tbps=2.0, tflops=0.1, ragged_us=400.0),
      dict(shape="S", T=4096, us=1e4, tbps=0.01, tflops=350.0, ragged_us=None)])))
  peers = tmp_path / "peers.json"
  peers.write_text(json.dumps(dict(device="GPU", hbm=4e12, rows=[
      dict(shape="S", T=16, a_us=200.0, a_tflops=0.1, a_hbm_frac=0.25, b_us=100.0,
           b_tflops=0.2, b_hbm_frac=0.5),
      dict(shape="S", T=64, a_us=None, b_us=None)])))
  device, series = plot.load_row_group([str(moe)], 700e12)
  assert device == "GPU"
  assert series["ours WNA16"] == pytest.approx({("S", 1): 50.0, ("S", 4096): 50.0})
  assert series["XLA ragged_dot (bf16)"] == pytest.approx({("S", 1): 12.5})
  _, series = plot.load_row_group([str(peers)], 700e12)
  assert sorted(series) == ["a", "b"]
  assert series["a"] == pytest.approx({("S", 16): 25.0})
  assert series["b"] == pytest.approx({("S", 16): 50.0})


def test_gpu_roofline_plot_holds_every_op_of_a_point_to_one_roofline(monkeypatch, tmp_path):
  # One figure row of several files: the gpu_moe_bench-format files set each point's roofline
  # (WNA16's int4 bytes), peers timed beside WNA16 keep the first WNA16 figure, and a
  # gpu_moe_bench-format file of another op is named by its `op` or by NAME=path.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import plot_gpu_roofline as plot  # pylint: disable=import-outside-toplevel
  wna16 = tmp_path / "wna16.json"  # roof 50 us at T=1 (2 of 4 TB/s over 100 us)
  wna16.write_text(json.dumps(dict(device="GPU", copy_tbps=4.0, rows=[
      dict(shape="S", T=1, us=100.0, tbps=2.0, tflops=0.1, torch_us=500.0)])))
  mx = tmp_path / "mx.json"  # its own bytes (with scales) would give another roof: not used
  mx.write_text(json.dumps(dict(device="GPU", copy_tbps=4.0, rows=[
      dict(shape="S", T=1, us=125.0, tbps=3.0, tflops=0.1)])))
  named = tmp_path / "named.json"
  named.write_text(json.dumps(dict(device="GPU", copy_tbps=4.0, op="MxInt4", rows=[
      dict(shape="S", T=1, us=200.0, tbps=3.0, tflops=0.1)])))
  w4a8 = tmp_path / "w4a8.json"  # no byte rates: held to WNA16's roof; its WNA16 is not kept
  w4a8.write_text(json.dumps(dict(device="GPU", rows=[
      dict(shape="S", T=1, wna16_us=90.0, wna16_tflops=0.1, w4a8_us=250.0, w4a8_tflops=0.1),
      dict(shape="S", T=16, wna16_us=90.0, wna16_tflops=0.1, w4a8_us=250.0,
           w4a8_tflops=0.1)])))
  _, series = plot.load_row_group([str(wna16), f"MxInt4={mx}", str(w4a8)], 700e12)
  assert series["ours WNA16"] == pytest.approx({("S", 1): 50.0})
  assert series["ours MxInt4"] == pytest.approx({("S", 1): 40.0})
  assert series["ours W4A8"] == pytest.approx({("S", 1): 20.0})  # T=16 has no roofline
  assert series["torch _grouped_mm (bf16)"] == pytest.approx({("S", 1): 10.0})
  _, series = plot.load_row_group([str(wna16), str(named)], 700e12)
  assert series["ours MxInt4"] == pytest.approx({("S", 1): 25.0})
  out = tmp_path / "roof.png"
  monkeypatch.setattr(plot, "SHAPE_ORDER", ("S",))
  monkeypatch.setattr(sys, "argv", ["plot", "--json", f"{wna16},{w4a8}", "--out", str(out)])
  pytest.importorskip("matplotlib")
  plot.main()
  assert out.stat().st_size > 0


def test_gpu_moe_bench_alternative_launch(monkeypatch):
  # --alt-kw: JSON op keywords, "none" (no alternative timed), or the script's own default.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import gpu_moe_bench as gb  # pylint: disable=import-outside-toplevel
  parse = gb.argument_parser().parse_args
  default = dict(mainloop="bulk_copy")
  assert gb.alternative(parse([]), default) == (default, "mainloop='bulk_copy'")
  assert gb.alternative(parse([]), dict(block_m=32)) == (dict(block_m=32), "block_m=32")
  assert gb.alternative(parse(["--alt-kw", "none"]), default) == (None, None)
  kw = '{"mainloop": "wgmma_ws"}'
  assert gb.alternative(parse(["--alt-kw", kw]), default) == (dict(mainloop="wgmma_ws"), kw)


def test_gpu_launch_ab_launch_names(monkeypatch):
  # benchmarks/gpu_launch_ab.py: "auto" is the op's own choice, a main loop's name that loop at
  # block_m 8; anything else is refused before any GPU work.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import gpu_launch_ab as ab  # pylint: disable=import-outside-toplevel
  assert ab.launch_kwargs("auto") == {}
  assert ab.launch_kwargs("async_ring") == dict(block_m=8, mainloop="async_ring")
  with pytest.raises(ValueError, match="mainloop must be one of"):
    ab.launch_kwargs("registers_fast")
  with pytest.raises(ValueError, match="block_m"):
    ab.launch_kwargs("wgmma")


def test_sass_source_summary_sums_an_ncu_source_export(monkeypatch, tmp_path, capsys):
  # benchmarks/sass_source_summary.py over an export in ncu's CSV form (lines before the header,
  # thousands separators, predicated instructions).
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import sass_source_summary as summary  # pylint: disable=import-outside-toplevel
  path = tmp_path / "source.csv"
  path.write_text(
      '"Kernel Name","k"\n'
      '"Address","Source","Warp Stall Sampling (All Samples)","Thread Instructions Executed",'
      '"Instructions Executed","stall_wait","stall_wait (Not Issued)","stall_math"\n'
      '"0x10","@P0 LDGSTS.E.BYPASS.128 [R1], [R2.64]","10","3,200","100","5","4","1"\n'
      '"0x20","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24","1,200","32,000","1,000","700",'
      '"600","20"\n'
      '"0x30","  HGMMA.64x128x16.F32.BF16 R88, gdesc[UR4], R88","30","32,000","1,000","7","7",'
      '"0"\n')
  header, rows = summary.read_rows(str(path))
  assert header[:2] == ["Address", "Source"] and len(rows) == 3
  assert summary.column(header, "Instructions Executed") == "Thread Instructions Executed"
  assert [summary.opcode(r["Source"]) for r in rows] == ["LDGSTS", "HGMMA", "HGMMA"]
  monkeypatch.setattr(sys, "argv", ["summary", str(path), "--top", "1"])
  summary.main()
  out = capsys.readouterr().out
  assert "executed='Instructions Executed'" in out and "2100 warp-instructions" in out
  hgmma = next(line for line in out.splitlines() if line.startswith("HGMMA"))
  assert hgmma.split()[1:3] == ["2000", "95.2"]
  assert out.splitlines()[-1].split()[:5] == ["0x20", "1000", "1200", "stall_wait=700,",
                                              "stall_math=20"]


def test_sass_loops_counts_each_backward_branch_body(monkeypatch, tmp_path, capsys):
  # benchmarks/sass_loops.py over cuobjdump -sass text: two functions, a loop of four
  # instructions (one predicated) closed by a backward branch, a forward branch that is no loop.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import sass_loops  # pylint: disable=import-outside-toplevel
  sass = (
      "\n\tcode for sm_90a\n\t\tFunction : _Z6kernelv\n"
      "        /*0000*/                   MOV R1, c[0x0][0x28] ;  /* 0x00000a0000017a02 */\n"
      "        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;  /* 0x0 */\n"
      "        /*0020*/                   LOP3.LUT R8, R4, 0xf000f, R9, 0xea, !PT ;  /* 0x0 */\n"
      "        /*0030*/               @P0 LOP3.LUT R9, R5, 0xf000f, R9, 0xea, !PT ;  /* 0x0 */\n"
      "        /*0040*/              @!P1 BRA 0x10 ;  /* 0x0 */\n"
      "        /*0050*/                   BRA 0x70 ;  /* 0x0 */\n"
      "        /*0060*/                   EXIT ;  /* 0x0 */\n"
      "\t\tFunction : _Z5otherv\n"
      "        /*0000*/                   EXIT ;  /* 0x0 */\n")
  funcs = sass_loops.functions(sass)
  assert list(funcs) == ["_Z6kernelv", "_Z5otherv"] and len(funcs["_Z6kernelv"]) == 7
  (start, end, body), = sass_loops.loops(funcs["_Z6kernelv"])
  assert (start, end) == (0x10, 0x40) and body == {"LDG": 1, "LOP3": 2, "BRA": 1}
  path = tmp_path / "k.sass"
  path.write_text(sass)
  monkeypatch.setattr(sys, "argv", ["sass_loops", str(path), "--kernel", "kernel", "--min", "1"])
  sass_loops.main()
  out = capsys.readouterr().out.splitlines()
  assert out == ["_Z6kernelv: 7 instructions", "  loop 0x10-0x40: 4: LOP3 2, LDG 1, BRA 1"]


def test_tokamax_bench_stubs_a_missing_xprof_tool(monkeypatch):
  # tokamax 0.0.17 imports xprof.cli.tools.get_kernel_stats_tool at import time.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import tokamax_bench  # pylint: disable=import-outside-toplevel
  for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    monkeypatch.setitem(sys.modules, name, None)  # "not importable"; restored afterwards
  assert tokamax_bench.stub_xprof_if_missing()
  from xprof.cli.tools import get_kernel_stats_tool  # pylint: disable=import-outside-toplevel
  with pytest.raises(NotImplementedError, match="stub from tokamax_bench"):
    get_kernel_stats_tool()
  assert not tokamax_bench.stub_xprof_if_missing()  # already importable now


def test_e2e_cpu_plot_reads_the_recorded_runs(monkeypatch):
  # benchmarks/plot_e2e_cpu.py draws docs/e2e_cpu.png from e2e_cpu_bench.py's JSON (docs/data).
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import plot_e2e_cpu as plot  # pylint: disable=import-outside-toplevel
  root = Path(__file__).resolve().parents[1]
  for path in sorted((root / "docs" / "data").glob("e2e_cpu_*.json")):
    title, rows = plot.load_rows(str(path))
    assert "layers" in title and "avx" not in title
    names = {r["variant"] for r in rows}
    assert "llama.cpp:Q4_0" in names and "jax:int4+head4" in names
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows)


def test_model_roofline_plot_reads_the_recorded_run(monkeypatch):
  # benchmarks/plot_model_roofline.py draws docs/model_h100.png from model_bench.py's JSON.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import plot_model_roofline as plot  # pylint: disable=import-outside-toplevel
  path = Path(__file__).resolve().parents[1] / "docs" / "data" / "model_h100_l48.json"
  machine, by_batch = plot.roofline_rows(str(path), bandwidth_gbs=2990.0)
  assert "H100" in machine and sorted(by_batch) == [1, 64]
  one = {r["variant"]: r for r in by_batch[1]}
  # 1587 MB a step at 2.99 TB/s: 1884 tok/s; measured 237.
  assert abs(one["wna16_all"]["roofline_tok_s"] - 1884) < 5
  assert 0 < one["wna16_all"]["decode_tok_s"] < one["wna16_all"]["roofline_tok_s"]


def test_cpu_bench_replots_the_recorded_xeon_runs(tmp_path):
  # docs/cpu_ktk_xeon.png comes from the recorded JSON lines by --replot, which times nothing.
  pytest.importorskip("matplotlib")
  data = BENCH.parents[1] / "docs" / "data"
  runs = [data / f"cpu_ktk_xeon16_{name}.json" for name in ("olmoe_qwen3", "dsv2lite", "dsv3")]
  png = tmp_path / "replot.png"
  cmd = [sys.executable, str(BENCH), "--replot", ",".join(map(str, runs)), "--plot", str(png)]
  out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                       timeout=300, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  shapes = set()
  for run in runs:
    shapes |= set(json.loads(run.read_text())["rows"])
  assert shapes == {"OLMoE-1B-7B", "Qwen3-30B-A3B", "DeepSeek-V2-Lite", "DeepSeek-V3"}


def test_ort_layers_past_protobufs_limit_go_as_external_data(monkeypatch):
  # A DeepSeek-V3 layer's QMoE weights pass protobuf's 2 GB: such graphs keep their weights as
  # ONNX external data, and must compute what the inline graph does.
  pytest.importorskip("onnxruntime")
  pytest.importorskip("onnx")
  import numpy as np  # pylint: disable=import-outside-toplevel
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import cpu_moe_bench as bench  # pylint: disable=import-outside-toplevel
  shape = bench.SHAPES["tiny"]
  inline, why_inline = bench.ort_session(shape, 0, 1, range(0, 2))
  monkeypatch.setattr(bench, "ORT_GRAPH_BYTES", 10)
  external, why_external = bench.ort_session(shape, 0, 1, range(0, 2))
  assert inline is not None and external is not None, (why_inline, why_external)
  assert "external data" in why_external and "external data" not in why_inline
  rng = np.random.default_rng(1)
  feed = {"input": rng.standard_normal((5, shape.hidden_size)).astype(np.float32),
          **{f"router_probs_{l}": rng.random((5, shape.num_experts)).astype(np.float32)
             for l in range(2)}}
  want = inline.run(None, feed)[0]
  got = external.run(None, feed)[0]
  assert np.abs(want).max() > 0
  np.testing.assert_array_equal(got, want)


def test_graph_gap_probe_groups_events_by_call_and_reads_host_events(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import _timing  # pylint: disable=import-outside-toplevel
  import graph_gap_probe as gg  # pylint: disable=import-outside-toplevel
  import launch_probe as lp  # pylint: disable=import-outside-toplevel
  events = [(10, 12), (13, 20), (40, 41), (42, 50), (70, 71)]
  assert _timing.split_calls(events, 2) == [events[:2], events[2:4]]  # a partial call left out
  assert _timing.calls_in_trace(events, 2) is None  # 5 events do not divide into 2 calls
  assert _timing.calls_in_trace(events[:4] * 2, 4) == [events[:2], events[2:4]]  # two left out
  assert _timing.calls_in_trace([], 4) is None
  fn = jax.jit(lambda a: jnp.sin(a @ a))
  a = jnp.ones((64, 64), jnp.float32)
  jax.block_until_ready(fn(a))
  gpu, host = _timing.profiled_calls(fn, (a,), 3)
  assert gpu == []  # no GPU here
  assert host and all(ns >= 0 for ns in host.values())
  assert _timing.gpu_span_per_call(fn, (a,), 4) is None  # no GPU events: no GPU time
  wall, enqueue = gg.wall_and_enqueue(fn, (a,), 4)
  assert 0 < enqueue <= wall
  assert gg.enqueue_when_idle(fn, (a,), 3) > 0
  # The probe's layers: every layer on x (a list) or each on the previous one's output (a chain).
  monkeypatch.setattr(lp, "SETS", 3)
  layer = lambda x, j: 10 * x + j
  monkeypatch.setattr(lp, "CHAIN", False)
  assert lp._layers(layer, 1, lambda j: (j,)) == [10, 11, 12]
  monkeypatch.setattr(lp, "CHAIN", True)
  assert lp._layers(layer, 1, lambda j: (j,)) == 1012


def test_launch_probe_routing_stacked_or_one_argument_a_layer(monkeypatch):
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import gpu_moe_bench as gb  # pylint: disable=import-outside-toplevel
  import launch_probe as lp  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(gb.SHAPES, "tiny", (8, 2, 256, 128))
  monkeypatch.setattr(gb, "ROUTING_SETS", 3)
  monkeypatch.setattr(lp, "SETS", 3)
  monkeypatch.setattr(lp, "WEIGHT_SETS", 2)
  for routing_args in (False, True):
    monkeypatch.setattr(lp, "ROUTING_ARGS", routing_args)
    _, (x, layers, w, ids), _, per_call = lp.make_op("wna16", "tiny", 1)
    assert x.shape == (1, 256) and len(layers) == 2 and len(per_call) == 3
    assert per_call[2][1] is layers[0]  # layer 2 takes weight set 2 % 2
    if routing_args:
      assert isinstance(ids, list) and [a.shape for a in ids] == [(1, 2)] * 3
    else:
      assert ids.shape == (3, 1, 2) and w.shape == (3, 1, 2)
    np_ids = [np.asarray(ids[j]) for j in range(3)]
    assert all(((a >= 0) & (a < 8)).all() for a in np_ids)


def test_cpu_probe_interleave_sets_each_block_against_its_own_probe(monkeypatch, capsys):
  # benchmarks/cpu_probe_interleave.py: the probe and the chained CPU harness in alternating
  # blocks, each block's weight stream over that block's probe.
  monkeypatch.syspath_prepend(str(BENCH.parent))
  import cpu_probe_interleave as probe  # pylint: disable=import-outside-toplevel
  rows = probe.main(["tiny", "1", "2", "--layers", "2", "--calls", "2", "--probe-mib", "8"])
  assert [r["block"] for r in rows] == [0, 1]
  for r in rows:
    assert r["probe_gbps"] > 0 and r["layer_ms"] > 0 and r["weights_gbps"] > 0
    assert r["dram_frac"] == pytest.approx(r["weights_gbps"] / r["probe_gbps"])
  assert capsys.readouterr().out.count("block ") == 2
