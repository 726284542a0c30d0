"""Launch shapes of the shared int4 MoE GEMM core on the GPU (WNA16 and MxInt4): block_m (tokens
per expert block) and the split-K factor, from static shapes at trace time.

The GEMM grid is (expert blocks, ceil(units / 8) CTAs of 8 warps, split). Registers decide how many
CTAs an SM holds (ptxas, sm_90a: block_m 8 / 16 / 32 use 102 / 100 / 118 registers -> 2 CTAs of
256 threads; block_m 64 uses 197 -> 1; the async_ring main loop's 88-112 KB of shared memory also
allows 2), so a "wave" is num_sms * ctas_per_sm CTAs.

Split-K is chosen against a wave model (`_launch_cost`): every CTA of a launch does the same work
(ceil(chunks / split) 64-deep chunks); a full wave streams at full bandwidth, a partial wave (or a
launch smaller than a wave) at a rate that falls once it holds too few CTAs to keep HBM busy; ties
go to the smaller split (split-K adds f32 atomics and, for GEMM1, a finalize launch) unless the
larger one still fits one wave (more loads in flight: measured faster). Why: ncu on
an H100 (2026-11-23, base clocks), Mixtral T=1: GEMM2 at split 9 = 288 CTAs (1.09 waves) took
52 us for 59 MB (1.1 TB/s) while GEMM1 moved 1.45 TB/s. The rule before
this one aimed at "about 16 warps per SM" whatever the waves came to.
"""

from __future__ import annotations

import functools
import math
import os

WARPS_PER_CTA = 8  # kGemmWarps of csrc/cuda/moe_int4_gemm.cuh
MIN_CHUNKS_PER_SPLIT = 4  # a split streams at least 4 chunks (one MT=1 pipeline stage)
MAX_WORKSPACE_BYTES = 1 << 28  # split-K of GEMM1 needs an f32 [rows, 2I] workspace
DEFAULT_NUM_SMS = 132  # H100 SXM, when no GPU is visible at trace time
# Fraction of a wave whose loads in flight saturate HBM (an estimate: 8 warps per SM with 4 chunks
# of weights each, 32 KB, against ~3 TB/s x ~1.5 us / 132 SMs by Little's law). A partial last wave
# below it runs at that rate anyway, so 1.1 waves cost ~1.5, not 2.
SATURATING_FRACTION = 0.5


# GEMM main loops (GemmMainloop in csrc/cuda/moe_int4_gemm.cuh):
#   "registers": each warp loads a stage of chunks into registers, then computes it. For WNA16 at
#     block_m 8/16 with groups of 64 or more it takes the folded form (zero point and scale applied
#     once per group), the fastest measured (H100, 2026-11-23: Mixtral T=1 84 us). At block_m 8
#     the library picks, by the groups, a kernel whose groups sit at fixed chunks of a stage
#     (FixedGroupChunks in csrc/cuda/moe_int4_gemm.cuh; H200, 2026-11-29: 1.13-1.18x at T=4-64).
#   "async_ring": each thread streams its pieces through a cp.async ring in shared memory (block_m
#     8, 16, 32). Faster than "registers" for MxInt4 (groups of 32, never folded) at block_m <= 16
#     (Mixtral shape T=1 106 vs 115 us, T=64 514 vs 676 us), slower at block_m 32.
#   "bulk_copy": each warp streams its weights through shared memory with bulk copies (block_m 8,
#     16); correct, but slower than both on every measured shape: kept for study, never chosen.
#   "wgmma": the wgmma GEMM (MoeInt4WgmmaKernel) with a token tile of block_m (32, 64 or 128;
#     block_m 128 always takes it): a cp.async ring of token tiles in shared memory, no split-K,
#     inputs permuted into its chunk order once per call.
#   "wgmma_ws": the same GEMM (same tiles, results bit-identical) as a persistent kernel, one CTA
#     per SM (two with the 32-token tile), whose producer warpgroup fills the stage ring for two
#     MMA warpgroups (MoeInt4WgmmaWsKernel, csrc/cuda/moe_int4_wgmma_ws.cuh); measured slower
#     than "wgmma" (docs/performance.md), never chosen.
#   "stream": not a GEMM main loop but the one-token path's two streaming kernels (GEMM1 with the
#     activation, GEMM2 with the top-k reduction; csrc/cuda/moe_int4_one_token.cuh): every warp
#     keeps eight 16-byte weight loads per lane in flight, and each CTA sums its K slices in shared
#     memory in a fixed order (no split-K atomics, no alignment or finalize launch). One-token
#     calls only (`choose_one_token_mainloop`).
MAINLOOPS = {"registers": 0, "async_ring": 1, "bulk_copy": 2, "wgmma": 3, "wgmma_ws": 4,
             "stream": 5}
STREAM_MAINLOOP = MAINLOOPS["stream"]
STREAM_MAX_TOP_K = 16  # kOneTokenMaxTopK of csrc/cuda/moe_int4_one_token.cuh
STREAM_MAX_SMEM_BYTES = 200 * 1024  # kOneTokenMaxSmemBytes
STREAM_MAX_WARPS2 = 24  # kOneTokenMaxWarps2
WGMMA_MAINLOOPS = ("wgmma", "wgmma_ws")
_WGMMA_MAINLOOP_IDS = tuple(MAINLOOPS[name] for name in WGMMA_MAINLOOPS)
WGMMA_MAINLOOP_BLOCK_MS = (32, 64, 128)
DEFAULT_MAINLOOP = "registers"


def default_mainloop(scheme: str, block_m: int, pairs_per_expert: float | None = None) -> str:
  """The measured-fastest main loop for a scheme ("wna16" or "mxint4") at a block_m, given the
  expected pairs per expert when block_m was chosen for them (None: an explicit block_m). A
  block_m of 32 or 64 chosen by choose_block_m is the wgmma GEMM's 32- or 64-token tile."""
  if scheme == "mxint4" and block_m <= 16:
    return "async_ring"
  if block_m in (32, 64) and pairs_per_expert is not None:
    return "wgmma"
  return DEFAULT_MAINLOOP


def mainloop_code(mainloop: str | None, block_m: int | None = None) -> int:
  name = DEFAULT_MAINLOOP if mainloop is None else mainloop
  if name not in MAINLOOPS:
    raise ValueError(f"mainloop must be one of {sorted(MAINLOOPS)}, got {mainloop!r}")
  if name in WGMMA_MAINLOOPS and block_m is not None and block_m not in WGMMA_MAINLOOP_BLOCK_MS:
    raise ValueError(f"the {name} main loop takes block_m {WGMMA_MAINLOOP_BLOCK_MS}, got {block_m}")
  return MAINLOOPS[name]


def stream_error(top_k: int, hidden: int, intermediate: int, elem_bytes: int = 2) -> str:
  """Why the one-token streaming kernels cannot take a call of these shapes ("" when they can;
  OneTokenLayerError in csrc/cuda/moe_int4_one_token.cuh, which the FFI handler checks again)."""
  if not 1 <= top_k <= STREAM_MAX_TOP_K:
    return f"the stream main loop takes top_k in [1, {STREAM_MAX_TOP_K}], got {top_k}"
  smem = (_align16(top_k * intermediate * elem_bytes) + STREAM_MAX_WARPS2 * 64
          + STREAM_MAX_TOP_K * 8)
  if smem > STREAM_MAX_SMEM_BYTES or hidden * elem_bytes > STREAM_MAX_SMEM_BYTES:
    return (f"the stream main loop stages top_k x I and H activations in shared memory: top_k "
            f"{top_k} x I {intermediate} is too large")
  return ""


def choose_one_token_mainloop(mainloop_id: int, requested: str | None, *, one_token: bool,
                              fused: bool, top_k: int, hidden: int, intermediate: int) -> int:
  """The main-loop code a call runs with once its one-token path is known (`fused`: the fused
  decode kernel was chosen). Automatic (`requested` None): the streaming kernels wherever the
  one-token path runs unfused and they take the shapes, else `mainloop_id`. "stream" asked for
  needs all of that (ValueError naming what is missing); any other request is kept.

  Measured (H200, 2026-11-28; docs/performance.md, "the one-token layer as two streaming
  kernels"): WNA16 Qwen3-30B-A3B kernels alone (ncu) 22.5 -> 17.0 us per layer; in the 8-layer
  jit, general kernels / stream in one process, MxInt4 1.06-1.46x and Mixtral 1.06-1.11x faster,
  the small-expert WNA16 shapes level or faster by process."""
  if requested is not None and requested != "stream":
    return mainloop_id
  error = stream_error(top_k, hidden, intermediate)
  if requested is None:
    return STREAM_MAINLOOP if one_token and not fused and not error else mainloop_id
  if not one_token:
    raise ValueError("mainloop='stream' runs only on the one-token path: one token, the standard "
                     "format, no act-order and block_m 8")
  if fused:
    raise ValueError("fused_decode=True and mainloop='stream' are two different one-token paths")
  if error:
    raise ValueError(f"mainloop='stream': {error}")
  return STREAM_MAINLOOP


def uses_wgmma(block_m: int, mainloop_id: int) -> bool:
  """Whether a launch runs the wgmma GEMM (csrc UsesWgmma): block_m 128, or the wgmma main loop.
  Its inputs are permuted once per call and it never splits K."""
  return block_m == WGMMA_BLOCK_M or mainloop_id in _WGMMA_MAINLOOP_IDS


@functools.cache
def num_sms() -> int:
  """Multiprocessors of the first visible CUDA device (132 when none is visible)."""
  import jax
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return DEFAULT_NUM_SMS
  count = getattr(devices[0], "core_count", None) if devices else None
  return int(count) if count else DEFAULT_NUM_SMS


# block_m values of the kernels: 8..64 the mma.sync GEMM (MoeInt4GemmKernel), 128 the wgmma GEMM
# (MoeInt4WgmmaKernel: two warpgroups x 128 weight rows x 128 tokens, no split-K).
BLOCK_MS = (8, 16, 32, 64, 128)
WGMMA_BLOCK_M = 128


def ctas_per_sm(block_m: int) -> int:
  return 1 if block_m >= 64 else 2  # 64: 197 registers; 128: 210 registers and 141 KB of smem


# An expert's pairs vary around their mean (Poisson under uniform routing); the 8-row block is
# taken while the mean stays within this fraction of it. Past it, too many experts overflow into
# a second block, which streams the expert's weights again (H100, WNA16, 2026-11-25, us per layer:
# 6 pairs per expert, block_m 8 -> 16: DeepSeek-V2-Lite T=64 139 -> 149, so 8 stays for 6).
BLOCK_FILL = 0.75

# Expected pairs per expert up to which the wgmma GEMM's 32- and 64-token tiles are taken; the
# 128-token tile beyond. H100, 2026-11-26, WNA16, us per layer (8 layers per jit), one process per
# alternative beside the previous choice:
#   32-token tile: Qwen3-30B-A3B T=128 (8 pairs) 159.7 vs 163.8 (block_m 16), DeepSeek-V2-Lite
#     T=128 (12) 150.7 vs 168.4 (16), Qwen3 T=256 (16) 167.2 vs 217.0 (mma.sync 32),
#     DeepSeek-V2-Lite T=256 (24) 164.1 vs 218.5, Mixtral T=64 (16) 419.1 vs 436.1; MxInt4 at
#     16-24 pairs 171-422 vs 232-456; lost at 4-6 pairs (Qwen3 / DeepSeek-V2-Lite T=64, H200).
#   64-token tile: Mixtral T=128 (32) 440.3 vs 695.6 (mma.sync 32; 523.4 with the 32-token
#     tile), Qwen3 T=512 (32) 254.4 vs 329.5 (240.7), Qwen3 T=640 (40) 261.4 vs 407.5 (302.1),
#     DeepSeek-V2-Lite T=384 (36) 222.3 vs 330.2 (242.3), T=512 (48) 228.2 vs 313.1 (128-token).
#   128-token tile: Mixtral T=384 (96) 674.1 vs 877.1 (64-token), Mixtral T=256 (64) 625 vs 725
#     (H200); DeepSeek-V2-Lite T=640 (60) would take the 64-token tile (277.6 vs 324.6): the
#     crossover depends on the shape, so the constant stays at 48.
WGMMA_TILE32_MAX_PAIRS = 24
WGMMA_TILE64_MAX_PAIRS = 48


def choose_block_m(pairs_per_expert: float) -> int:
  """8 (the mma.sync GEMM) while BLOCK_FILL of 8 rows holds an expert's expected pairs, then the
  wgmma GEMM's token tile: 32 up to WGMMA_TILE32_MAX_PAIRS, 64 up to WGMMA_TILE64_MAX_PAIRS, 128
  beyond. block_m 16 and the mma.sync GEMM at 32 / 64 stay available as explicit choices.
  """
  if pairs_per_expert <= BLOCK_FILL * 8:
    return 8
  if pairs_per_expert <= WGMMA_TILE32_MAX_PAIRS:
    return 32
  if pairs_per_expert <= WGMMA_TILE64_MAX_PAIRS:
    return 64
  return WGMMA_BLOCK_M


# The GPU W4A8 GEMM's token tiles (csrc/cuda/w4a8_moe.cu, W8Tile): 32 and 64 tokens (two
# warpgroups, two CTAs per SM; three for the 32-token tile at K <= 2048) and 128 (four warpgroups,
# one CTA per SM). The 32-token tile up to
# W4A8_TILE32_MAX_PAIRS expected pairs per expert, the 64-token tile beyond: two CTAs of 64 tokens
# beat one of 128 even at T = 4096, each CTA's group promotions and barriers running while the
# other's MMAs do. H100, 2026-11-27, us per layer (8 layers per jit, benchmarks/w4a8_gpu_bench.py
# --block-ms 128,64,32), tiles 32 / 64 / 128:
#   Mixtral-8x7B T=64 (16 pairs) 327 / 364 / 684; T=256 (64) 753 / 558 / 689; T=1024 2341 / 1536
#     / 1719; T=4096 8600 / 5425 / 5642.
#   Qwen3-30B-A3B T=256 (16) 186 / 209 / 383; T=1024 (64) 403 / 316 / 416; T=4096 1298 / 920 / 1060.
#   DeepSeek-V2-Lite T=256 (24) 177 / 193 / 335; T=1024 (96) 470 / 352 / 375; T=4096 1567 / 1066
#     / 1201.
W4A8_BLOCK_MS = (32, 64, 128)
W4A8_TILE32_MAX_PAIRS = 24


def max_padded_rows(pairs: int, experts: int, block_m: int) -> int:
  """Rows of the alignment's sorted_ids for `pairs` (token, slot) pairs over `experts` experts in
  blocks of block_m: every expert hit may leave block_m - 1 rows of padding (the alignment kernel's
  bound, as csrc W4a8MoeMaxPadded / the WNA16 and MxInt4 launchers); at least one block."""
  padded = pairs + min(pairs, experts) * (block_m - 1)
  return max(block_m, -(-padded // block_m) * block_m)


def choose_w4a8_block_m(pairs_per_expert: float, block_m: int | None = None) -> int:
  """Tokens per expert block of a GPU W4A8 call: `block_m` when given (ValueError unless one of
  W4A8_BLOCK_MS), else 32 up to W4A8_TILE32_MAX_PAIRS expected pairs per expert and 64 beyond
  (the 128-token tile was slower everywhere measured)."""
  if block_m is not None:
    if block_m not in W4A8_BLOCK_MS:
      raise ValueError(f"block_m must be one of {W4A8_BLOCK_MS}, got {block_m}")
    return block_m
  return 32 if pairs_per_expert <= W4A8_TILE32_MAX_PAIRS else 64


DETERMINISTIC_ENV = "JAX_MOEQ_DETERMINISTIC"


def deterministic() -> bool:
  """Whether GPU calls traced now must give run-to-run bit-identical results
  (JAX_MOEQ_DETERMINISTIC=1, read at trace time like the other launch choices).

  Two launch choices add float partial sums in arrival order: split-K (the splits meet in f32
  `atomicAdd`s on the workspace) and the fused decode kernel (its warps' sums meet in
  shared-memory atomics). Deterministic mode takes neither: every output element is then summed
  by one warp in a fixed order. It costs split-K's speed-up where a launch fills less than a
  wave (small T on large experts)."""
  value = os.environ.get(DETERMINISTIC_ENV, "").strip()
  if value not in ("", "0", "1"):
    raise ValueError(f"{DETERMINISTIC_ENV}={value!r}: expected 1 (deterministic) or 0 / unset")
  return value == "1"


def choose_launch(scheme: str, pairs_per_expert: float, block_m: int | None,
                  mainloop: str | None) -> tuple[int, int]:
  """(block_m, main-loop code) of one call of a scheme ("wna16" or "mxint4"): block_m from the
  expected pairs per expert unless given, the main loop from default_mainloop unless given.
  ValueError for a block_m or a main loop the kernels do not take."""
  chosen = block_m is None
  if chosen:
    block_m = choose_block_m(pairs_per_expert)
    if mainloop in WGMMA_MAINLOOPS:  # a wgmma main loop asked for: its smallest tile at least
      block_m = max(block_m, WGMMA_MAINLOOP_BLOCK_MS[0])
  if block_m not in BLOCK_MS:
    raise ValueError(f"block_m must be one of {BLOCK_MS}, got {block_m}")
  if mainloop is None:
    mainloop = default_mainloop(scheme, block_m, pairs_per_expert if chosen else None)
  return block_m, mainloop_code(mainloop, block_m)


def choose_gemm_splits(busy_blocks: int, hidden: int, intermediate: int, block_m: int,
                       pairs: int, mainloop_id: int = MAINLOOPS[DEFAULT_MAINLOOP]
                       ) -> tuple[int, int]:
  """(split13, split2) of one call's GEMMs: GEMM1 has intermediate / 16 warp units along N and
  hidden / 64 chunks along K, plus an f32 [pairs, 2I] workspace when split; GEMM2 has hidden / 32
  units and intermediate / 64 chunks. (1, 1) in deterministic mode, for the wgmma GEMM, which
  does not split K, and for the one-token streaming kernels, which sum K slices in each CTA."""
  if deterministic() or uses_wgmma(block_m, mainloop_id) or mainloop_id == STREAM_MAINLOOP:
    return 1, 1
  split13 = choose_split(busy_blocks, intermediate // 16, hidden // 64, block_m,
                         pairs * 2 * intermediate * 4)
  split2 = choose_split(busy_blocks, hidden // 32, intermediate // 64, block_m, 0)
  return split13, split2


MAX_FEATURES = 1 << 24  # kMaxMoeFeatures of csrc/cuda/moe_int4_gemm.cuh


def check_problem_size(rows: int, hidden: int, intermediate: int, rows_name: str) -> None:
  """ValueError unless the kernels' 32-bit row indexing holds (MoeRowsFitInt32 in
  csrc/cuda/moe_int4_gemm.cuh, which the FFI handler checks again): rows x max(H, 2I) < 2^31,
  rows being `rows_name` (T * K pairs, or E * M for the batched format)."""
  for name, size in (("hidden size", hidden), ("intermediate size", intermediate)):
    if size > MAX_FEATURES:
      raise ValueError(f"{name} {size} exceeds the kernels' {MAX_FEATURES}")
  width = max(hidden, 2 * intermediate)
  if rows * width >= 1 << 31:
    raise ValueError(
        f"{rows_name} = {rows} rows of max(H, 2I) = {width} elements reach 2^31 elements, past "
        f"the kernels' 32-bit row indexing: call with fewer than {(1 << 31) // width} rows "
        "(split the tokens)")


def gemm2_workspace_floats(rows: int, hidden: int) -> int:
  """Length of the f32 ws2 scratch (Gemm2WorkspaceFloats in csrc/cuda/moe_int4_gemm.cuh): GEMM2's
  rows x hidden accumulators, then one arrival counter per 32 columns for the one-token path."""
  return rows * hidden + hidden // 32


def decodes_without_alignment(tokens: int, block_m: int, *, batched: bool = False,
                              act_order: bool = False) -> bool:
  """Whether a CUDA op call takes the one-token decode path (the ops pass it as the one_token
  attribute; the FFI handler checks it against DecodesWithoutAlignment in
  csrc/cuda/moe_int4_gemm.cuh): each of the token's K pairs is its own expert block (no
  alignment launch), GEMM1 clears GEMM2's workspace, a split GEMM1's last split per 16 columns
  applies the activation (no GEMM1 finalize launch) and GEMM2's last warp per 32 output columns
  finalizes (no finalize launch)."""
  return not batched and not act_order and tokens == 1 and block_m == 8


def gemm1_workspace_floats(rows: int, intermediate: int, split13: int, one_token: bool) -> int:
  """Length of the f32 ws13 scratch (Gemm1WorkspaceFloats in csrc/cuda/moe_int4_gemm.cuh, at
  least 1): GEMM1's split-K rows x 2I accumulators, then on the one-token path one arrival counter
  per pair and 16 activation columns; unsplit, none."""
  if split13 <= 1:
    return 1
  return rows * 2 * intermediate + (rows * (intermediate // 16) if one_token else 0)


def _launch_cost(ctas: int, chunks_per_cta: int, wave: int) -> int:
  """Time of a memory-bound launch in units of one CTA slot streaming one chunk: each wave moves
  its CTAs' chunks at a rate that grows with its CTAs up to SATURATING_FRACTION of a wave."""
  full, rest = divmod(ctas, wave)
  saturating = max(1, int(wave * SATURATING_FRACTION))
  return chunks_per_cta * (full * wave + (max(rest, saturating) if rest else 0))


def expected_busy_blocks(pairs: float, experts: int, block_m: int) -> int:
  """Expert blocks with work, expected: one per expert hit, at least pairs / block_m."""
  return max(1, math.ceil(pairs / block_m), math.ceil(min(experts, pairs)))


def choose_split(busy_blocks: int, units: int, chunks: int, block_m: int, ws_bytes: int) -> int:
  """Split-K factor of one GEMM: `busy_blocks` expert blocks with work, `units` warps of work per
  block along N, `chunks` 64-deep chunks along K.

  1 when the unsplit launch already spans two waves (the tail costs at most ~25 % there, less than
  split-K's f32 workspace traffic) or when the f32 workspace would be too large.
  """
  if block_m == WGMMA_BLOCK_M:
    return 1
  ctas = max(1, busy_blocks) * -(-units // WARPS_PER_CTA)
  wave = num_sms() * ctas_per_sm(block_m)
  if ws_bytes > MAX_WORKSPACE_BYTES or ctas >= 2 * wave:
    return 1
  best_cost, best_split = None, 1
  for split in range(1, max(1, chunks // MIN_CHUNKS_PER_SPLIT) + 1):
    per_cta = -(-chunks // split)
    live = -(-chunks // per_cta)  # splits that get chunks at all
    cost = _launch_cost(ctas * live, per_cta, wave)
    # Ties keep the smaller split (fewer atomics) unless the larger one still fits one wave: more
    # CTAs then means more loads in flight (H100, Mixtral T=1 GEMM2: split 8 = 256 CTAs against
    # split 7 = 224, same modelled cost: 80.0 vs 82.1 us per layer WNA16, 91.6 vs 93.6 MxInt4).
    if (best_cost is None or cost < best_cost or
        (cost == best_cost and live > best_split and ctas * live <= wave)):
      best_cost, best_split = cost, live
  return best_split


# The one-token fused decode kernel (csrc/cuda/moe_int4_decode.cuh): the whole layer in one
# cooperative launch of one CTA per SM, every weight byte of the token's pairs held in shared
# memory at once. The plan below repeats PlanDecodeLayer's arithmetic (keep the two in step; the
# FFI handler checks the plan again with the device's own figures and refuses one that does not
# fit).
DECODE_WARPS = 16            # kDecodeWarps
DECODE_MAX_SLICE1 = 4        # kDecodeMaxSlice1: GEMM1 chunks per warp and unit
DECODE_MAX_ITEMS2 = 16       # kDecodeMaxItems2: GEMM2 chunks per warp
DECODE_MAX_TOP_K = 32        # kDecodeMaxTopK: expert ids staged in shared memory
MAX_SHARED_BYTES_PER_CTA = 232448  # opt-in shared memory per block, H100 / H200 (227 KB)
DECODE_STATIC_SHARED_BYTES = 1024  # kDecodeStaticSmemBytes: the kernel's static shared memory


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def _align16(a: int) -> int:
  return _ceil_div(a, 16) * 16


def fused_decode_error(top_k: int, hidden: int, intermediate: int,
                       ctas: int | None = None) -> str:
  """Why the fused decode kernel cannot take a one-token call of these shapes ("" when it can):
  each CTA's share of the pairs' weights, the token, the activations and its sums must fit one
  SM's shared memory (PlanDecodeLayer / DecodeLayerPlanError in csrc/cuda/moe_int4_decode.cuh)."""
  ctas = num_sms() if ctas is None else ctas
  max_units1 = _ceil_div(top_k * (intermediate // 16), ctas)
  max_units2 = _ceil_div(hidden // 16, ctas)
  slice1 = _ceil_div(hidden // 64, DECODE_WARPS)
  items2 = _ceil_div(max_units2 * top_k * (intermediate // 64), DECODE_WARPS)
  if top_k > DECODE_MAX_TOP_K:
    return f"fused decode needs top_k <= {DECODE_MAX_TOP_K}"
  if slice1 > DECODE_MAX_SLICE1:
    return "fused decode needs hidden <= 4096"
  if items2 > DECODE_MAX_ITEMS2:
    return f"fused decode: GEMM2 has more than {DECODE_MAX_ITEMS2} chunks per warp"
  smem = ((max_units1 * 2 * (hidden // 64) + max_units2 * top_k * (intermediate // 64)) * 512
          + _align16(hidden * 2) + _align16(top_k * intermediate * 2) + max_units1 * 32 * 4
          + _align16(max_units2 * top_k * 16 * 4) + (max_units1 + 1) * 8
          + DECODE_STATIC_SHARED_BYTES)
  if smem > MAX_SHARED_BYTES_PER_CTA:
    return (f"fused decode needs {smem} bytes of shared memory per CTA, the device has "
            f"{MAX_SHARED_BYTES_PER_CTA}")
  return ""


def choose_fused_decode(requested: bool | None, *, one_token: bool, top_k: int, hidden: int,
                        intermediate: int) -> bool:
  """Whether a call runs as the one fused decode kernel: True requires it (ValueError naming why
  it cannot); None (automatic) and False keep the multi-kernel one-token path.

  Automatic never takes it yet: on an H100 (2026-11-24, Qwen3-30B-A3B T=1, in-graph, one
  process) it measured 27.2 us against the kernels' 23.1 us for WNA16 and 29.1 against 26.5 us
  for MxInt4 (docs/performance.md): its weights land in ~11 us (1.7 TB/s) and GEMM1's math trails
  them by another ~6 us. It stays available, tested, for the work that could make it win
  (docs/gpu_notes.md, "The fused decode kernel")."""
  if not requested:
    return False
  if deterministic():
    raise ValueError(f"fused_decode=True sums its warps' partial results in arrival order; "
                     f"{DETERMINISTIC_ENV}=1 asks for run-to-run identical results")
  if not one_token:
    raise ValueError("fused_decode=True needs the one-token path: one token, the standard "
                     "format, no act-order and block_m 8")
  error = fused_decode_error(top_k, hidden, intermediate)
  if error:
    raise ValueError(f"fused_decode=True: {error}")
  return True
