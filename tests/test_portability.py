"""Portability: the CPU kernels build on AArch64 and their NEON paths (SDOT, SMMLA) equal the
portable path bit for bit under qemu, the run-time detection choosing them only where the CPU has
the instructions; the x86 paths agree with portable within a bound; the CUDA kernels build for
sm_80, the extra target of a portable CUDA build.

The kernel comparisons run tests/native/w4a8_isa_harness.cc (no JAX), built from the csrc/cpu
sources with the per-file flags CMakeLists.txt gives them.
"""

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DIR = Path(ROOT) / "csrc" / "cpu"
HARNESS = Path(ROOT) / "tests" / "native" / "w4a8_isa_harness.cc"
CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"

needs_cross_compiler = pytest.mark.skipif(
    shutil.which(CROSS_CXX) is None,
    reason="no AArch64 cross compiler (apt-get install g++-aarch64-linux-gnu)")
needs_qemu = pytest.mark.skipif(
    shutil.which(QEMU) is None,
    reason="no qemu-aarch64 user-mode emulator (apt-get install qemu-user)")


@needs_cross_compiler
def test_cpu_kernels_build_for_aarch64():
  result = subprocess.run(
      ["bash", os.path.join(ROOT, "scripts", "check_aarch64_build.sh")],
      capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  # The MoE and dense-linear drivers, their handlers, the ISA dispatch and four GEMM/row files.
  assert "aarch64 build ok: 9 objects" in result.stdout


# ------------------------------------------------------------------ ISA harness builds
_COMMON_SOURCES = ("cpu_isa.cc", "w4a8_moe.cc", "w4a8_gemm_portable.cc", "w4a8_rows_portable.cc")
_AARCH64_SOURCES = _COMMON_SOURCES + ("w4a8_gemm_neon_dotprod.cc", "w4a8_gemm_neon_i8mm.cc")
_X86_SOURCES = _COMMON_SOURCES + ("w4a8_gemm_avx2.cc", "w4a8_rows_avx2.cc",
                                  "w4a8_gemm_avx512vnni.cc", "w4a8_rows_avx512.cc",
                                  "w4a8_gemm_amx.cc")
# The library's flags (CMakeLists.txt JAX_MOEQ_CPU_FLAGS at -O2): the NEON paths' bit identity
# rests on -ffp-contract=off.
_FLAGS = ["-std=c++17", "-O2", "-ffp-contract=off", "-fno-math-errno", f"-I{ROOT}/csrc"]


def _cmake_file_flags() -> dict[str, list[str]]:
  """Per-file COMPILE_OPTIONS of CMakeLists.txt's set_source_files_properties, by file name, so
  that the harness builds each ISA's file exactly as the library does."""
  text = (Path(ROOT) / "CMakeLists.txt").read_text()
  flags = {}
  pattern = r'set_source_files_properties\(([^)]*?)PROPERTIES\s+COMPILE_OPTIONS\s+"([^"]*)"\)'
  for files, options in re.findall(pattern, text):
    for path in files.split():
      flags[os.path.basename(path)] = options.split(";")
  return flags


def _compile_all(cxx: str, sources, defines, out_dir: Path, link_flags,
                 extra_flags: dict[str, list[str]] | None = None) -> Path:
  """Compiles csrc/cpu `sources` and the harness (two at a time) and links them; `extra_flags`
  adds flags to some files, by name."""
  file_flags = _cmake_file_flags()
  extra_flags = extra_flags or {}
  jobs = [([*_FLAGS, *defines, *file_flags.get(name, []), *extra_flags.get(name, []), "-c",
            str(CPU_DIR / name)], name)
          for name in sources]
  jobs.append(([*_FLAGS, *defines, "-c", str(HARNESS)], HARNESS.name))

  def compile_one(job):
    args, name = job
    obj = out_dir / (name + ".o")
    return subprocess.run([cxx, *args, "-o", str(obj)], capture_output=True, text=True,
                          timeout=600), obj

  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    results = list(pool.map(compile_one, jobs))
  for proc, obj in results:
    assert proc.returncode == 0, f"{obj.name}: {proc.stderr[-4000:]}"
  exe = out_dir / "w4a8_isa_harness"
  link = subprocess.run([cxx, *link_flags, *(str(obj) for _, obj in results), "-o", str(exe)],
                        capture_output=True, text=True, timeout=300)
  assert link.returncode == 0, link.stderr[-4000:]
  return exe


def _isa_lines(stdout: str) -> dict[str, str]:
  """{isa: status} from the harness's summary lines ("ok neon_i8mm: 300 cases (...)")."""
  return {m.group(2): m.group(1)
          for m in re.finditer(r"^(ok|FAIL) (\w+): \d+ cases", stdout, re.MULTILINE)}


def _case_counts(stdout: str) -> set[int]:
  return {int(n) for n in re.findall(r"^(?:ok|FAIL) \w+: (\d+) cases", stdout, re.MULTILINE)}


def test_cmake_gives_every_simd_file_its_flags():
  flags = _cmake_file_flags()
  assert flags["w4a8_gemm_neon_dotprod.cc"] == ["-march=armv8.2-a+dotprod"]
  assert flags["w4a8_gemm_neon_i8mm.cc"] == ["-march=armv8.2-a+dotprod+i8mm"]
  for name in ("w4a8_gemm_avx2.cc", "w4a8_rows_avx2.cc", "w4a8_gemm_avx512vnni.cc",
               "w4a8_rows_avx512.cc", "w4a8_gemm_amx.cc"):
    assert "-mfma" in flags[name], name
  assert {"-mamx-tile", "-mamx-int8", "-mavx512vnni"} <= set(flags["w4a8_gemm_amx.cc"])


@pytest.fixture(scope="module")
def aarch64_harness(tmp_path_factory):
  """The harness for AArch64, static (qemu-aarch64 then needs no AArch64 libraries)."""
  out = tmp_path_factory.mktemp("aarch64_harness")
  return _compile_all(CROSS_CXX, _AARCH64_SOURCES, ["-DJAX_MOEQ_AARCH64=1"], out, ["-static"])


def _qemu_cpus() -> str:
  return subprocess.run([QEMU, "-cpu", "help"], capture_output=True, text=True,
                        timeout=60).stdout


# qemu CPU model -> the paths AvailableIsas must report there, best first. `max` has every
# feature qemu emulates (DotProd and I8MM); Neoverse N1 has DotProd only; Cortex-A57 neither.
_QEMU_EXPECTED = {
    "max": ["neon_i8mm", "neon_dotprod", "portable"],
    "neoverse-n1": ["neon_dotprod", "portable"],
    "cortex-a57": ["portable"],
}


@needs_cross_compiler
@needs_qemu
@pytest.mark.parametrize("cpu", list(_QEMU_EXPECTED))
def test_neon_paths_equal_portable_under_qemu(aarch64_harness, cpu):
  """Under qemu-aarch64 -cpu <cpu>, the HWCAP detection offers exactly the paths the CPU model
  has, and each one's GEMM and MoE outputs equal the portable path's bit for bit."""
  if not re.search(rf"^\s*{re.escape(cpu)}\s*$", _qemu_cpus(), re.MULTILINE):
    pytest.skip(f"qemu-aarch64 offers no -cpu {cpu}")
  proc = subprocess.run([QEMU, "-cpu", cpu, str(aarch64_harness)], capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  lines = _isa_lines(proc.stdout)
  assert list(lines) == _QEMU_EXPECTED[cpu], proc.stdout
  assert set(lines.values()) == {"ok"}, proc.stdout
  assert len(_case_counts(proc.stdout)) == 1, proc.stdout  # every path ran every case
  for isa in lines:
    if isa != "portable":
      assert re.search(rf"^ok {isa}: \d+ cases \(.*; bit-exact\)$", proc.stdout, re.MULTILINE)


def _native_cxx():
  return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def _read_cpuinfo() -> str:
  try:
    return Path("/proc/cpuinfo").read_text()
  except OSError:
    return ""


def _x86_cpu_flags() -> set[str]:
  match = re.search(r"^flags\s*:(.*)$", _read_cpuinfo(), re.MULTILINE)
  return set(match.group(1).split()) if match else set()


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64", "amd64"),
                    reason="the x86 SIMD paths need an x86-64 host")
@pytest.mark.skipif(_native_cxx() is None, reason="no C++ compiler")
def test_x86_paths_agree_with_portable(tmp_path):
  """The same harness natively: AVX2 / AVX-512 VNNI outputs within the harness's FMA bound of
  the portable ones (their epilogues fuse multiply-adds, so they are not bit-exact)."""
  exe = _compile_all(_native_cxx(), _X86_SOURCES, ["-DJAX_MOEQ_X86=1"], tmp_path, [])
  proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  lines = _isa_lines(proc.stdout)
  assert lines.get("portable") == "ok" and set(lines.values()) == {"ok"}, proc.stdout
  assert len(_case_counts(proc.stdout)) == 1, proc.stdout
  flags = _x86_cpu_flags()
  vendor = re.search(r"^vendor_id\s*:\s*(\S+)", _read_cpuinfo(), re.MULTILINE)
  if vendor:  # the maker that picks the VNNI loop's prefetch plan
    expected = {"GenuineIntel": "intel", "AuthenticAMD": "amd", "HygonGenuine": "amd"}
    assert f"cpu vendor: {expected.get(vendor.group(1), 'other')}" in proc.stdout, proc.stdout
  family = re.search(r"^cpu family\s*:\s*(\d+)", _read_cpuinfo(), re.MULTILINE)
  if family:  # CPUID's display family, which picks the AVX2 loop's plan on AMD
    assert f"cpu family: {family.group(1)}\n" in proc.stdout, proc.stdout
  # The SIMD row stages against the portable ones (and AVX2 against AVX-512, bit for bit).
  rows = re.search(r"^ok row ops: (\d+) cases against portable, (\d+) avx2 against avx512",
                   proc.stdout, re.M)
  if {"avx2", "fma"} <= flags:
    assert "avx2" in lines, proc.stdout
    assert rows and int(rows.group(1)) > 0, proc.stdout
  if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= flags:
    assert "avx512_vnni" in lines, proc.stdout
    assert rows and int(rows.group(2)) > 0, proc.stdout
    # AMX also needs the OS to grant the tile state, which /proc/cpuinfo does not show: where
    # the path was chosen, its bit-exact comparison with VNNI must have run and passed.
    if "amx_int8" in lines:
      assert re.search(r"^ok amx_int8 against avx512_vnni: \d+ GEMM cases", proc.stdout, re.M), \
          proc.stdout


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64", "amd64"),
                    reason="the x86 SIMD paths need an x86-64 host")
@pytest.mark.skipif(_native_cxx() is None, reason="no C++ compiler")
def test_amx_loops_equal_vnni_on_emulated_tiles(tmp_path):
  """The AMX GEMM's loops (the 16-row gather, up to four C tiles per B load, every TDPBSUD
  width, tile and row remainders) on scalar stand-ins for the tile instructions
  (tests/native/amx_emulation.h), bit for bit against the VNNI path: the check the AMX host runs
  natively, here on any CPU with AVX-512 VNNI for the promotion's real vector code."""
  if not {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"} <= _x86_cpu_flags():
    pytest.skip("the AMX file's promotion and unpacking are AVX-512 code; this CPU has none")
  emulation = ["-include", str(Path(ROOT) / "tests" / "native" / "amx_emulation.h")]
  exe = _compile_all(_native_cxx(), _X86_SOURCES,
                     ["-DJAX_MOEQ_X86=1", "-DJAX_MOEQ_AMX_EMULATED=1"], tmp_path, [],
                     extra_flags={"w4a8_gemm_amx.cc": emulation})
  proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  match = re.search(r"^ok amx_int8 against avx512_vnni: (\d+) GEMM cases", proc.stdout, re.M)
  assert match and int(match.group(1)) > 0, proc.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler (nvcc)")
def test_cuda_kernels_build_for_sm80():
  """The portable build's sm_80 target compiles (sm_90-only instructions behind guards)."""
  result = subprocess.run(["bash", os.path.join(ROOT, "scripts", "check_cuda_sm80_build.sh")],
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-4000:]
  n_sources = len([f for f in os.listdir(os.path.join(ROOT, "csrc", "cuda")) if f.endswith(".cu")])
  assert f"sm_80 build ok: {n_sources} objects" in result.stdout
