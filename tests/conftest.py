"""Hypothesis profiles for the property tests (tests/test_properties.py).

- `ci` (the default): bounded example counts; the property module runs in about 3 minutes on
  2 cores, every CPU ISA path included.
- `long` (HYPOTHESIS_PROFILE=long): 20x the examples (about 6,500 in all), about 35 minutes on
  2 cores. Run the fused-op properties one per process (`-k`): a single session of the whole
  module once died of a segfault inside XLA's compiler after some 600 compilations (not seen
  again in separate processes, nor under ASan).

A property's example count is a fraction of the profile's `max_examples` (test_properties.py
`examples`), so that cheap properties (packers) run many more examples than the fused op, whose
every new shape compiles the jnp reference. Tests that set `max_examples` themselves keep it.
No example database is written (`database=None`: nothing lands in the repository) unless
HYPOTHESIS_DATABASE_DIR names a directory for one; a failure prints its reproduction blob.
"""

import os

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(
    deadline=None,  # first calls of a shape compile: timing says nothing about correctness
    database=None,
    print_blob=True,
    # No explain phase: it reruns a failing example hundreds of times to list the lines it
    # reaches, each a fused-op call here.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)
if os.environ.get("HYPOTHESIS_DATABASE_DIR"):  # keep failing examples to replay them
  from hypothesis.database import DirectoryBasedExampleDatabase
  _COMMON["database"] = DirectoryBasedExampleDatabase(os.environ["HYPOTHESIS_DATABASE_DIR"])
settings.register_profile("ci", max_examples=100, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
  """Drops every module's compiled executables when it ends. One pytest process compiles a few
  thousand XLA:CPU executables over the suite; with all of them kept, XLA's compiler died of a
  segfault past some 600 compilations of one module (above) and, after ~1250 tests of the whole
  suite, while compiling a `jax.random.randint` (2026-11-26): both in processes that held every
  earlier executable."""
  yield
  jax.clear_caches()
  gc.collect()
