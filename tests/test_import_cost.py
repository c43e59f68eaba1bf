"""What `import shmcoll` costs every rank: none of the heavy optional modules a rank may never use,
and no compiler even once its collectives are loaded (the kernels are C, built at install); and
what `shmcoll-run` costs before it starts a rank: not even the kernels.

ml_dtypes alone takes about a second of CPU to import, paid by every rank of a job at start-up; torch,
the launcher and the benchmark are for other processes. bfloat16 support must still work once the
user has ml_dtypes: shmcoll resolves the dtype on first use (shmcoll.types.bfloat16).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmcoll import ReduceKind
from shmcoll import validate as v
from shmcoll.types import BF16, U8, bfloat16, wire_type_of

from bounds import LAUNCH_S
from harness import REPO, subprocess_env

#: Modules `import shmcoll` must leave unloaded.
HEAVY = ["ml_dtypes", "torch", "shmcoll.bench", "shmcoll.launch", "shmcoll.torch"]

#: Modules a rank never loads, not even once it has loaded every collective and the kernels: a JIT
#: costs every process of a job about 75 MiB and a second.
NO_COMPILER = ["numba", "llvmlite"]

#: In a fresh interpreter: what import loads, what dtype misses load, then a bfloat16 array once
#: the user has imported ml_dtypes. Prints the observations as JSON.
_FRESH_IMPORT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import shmcoll
    from shmcoll import validate as v
    from shmcoll.types import wire_type_of
    heavy = json.loads(sys.argv[1])
    seen = {"after import": [m for m in heavy if m in sys.modules]}
    misses = [wire_type_of(np.dtype(d)) for d in (object, "U3", "datetime64[s]", "V4")]
    seen["misses"] = [w is None for w in misses]
    seen["after misses"] = [m for m in heavy if m in sys.modules]
    import ml_dtypes
    arr = np.zeros(3, dtype=ml_dtypes.bfloat16)
    seen["bf16 wire"] = wire_type_of(arr.dtype).name
    seen["bf16 validated"] = v.reducible_wire(arr, shmcoll.ReduceKind.SUM, "data")[0].name
    import shmcoll.bootstrap, shmcoll.group, shmcoll.kernels, shmcoll.lean, shmcoll.transport.shm
    seen["compilers"] = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
    print(json.dumps(seen))
""")


@pytest.mark.multiprocess
def test_import_loads_no_heavy_module_and_bf16_still_works_after_ml_dtypes():
    result = subprocess.run([sys.executable, "-c", _FRESH_IMPORT, json.dumps(HEAVY), json.dumps(NO_COMPILER)],
                            env=subprocess_env(),
                            cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_S)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["after import"] == [], f"import shmcoll loaded {seen['after import']}"
    assert seen["misses"] == [True] * 4
    assert seen["after misses"] == [], f"looking up dtypes that cannot travel loaded {seen['after misses']}"
    assert seen["bf16 wire"] == seen["bf16 validated"] == "bf16"
    assert seen["compilers"] == [], f"the library's modules loaded {seen['compilers']}"


def test_bfloat16_arrays_are_bf16_and_bf16_arrays_are_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    arr = np.arange(4, dtype=bf16)
    assert bfloat16() == bf16
    assert wire_type_of(arr.dtype) is BF16
    assert v.reducible_wire(arr, ReduceKind.SUM, "data") == (BF16, ReduceKind.SUM)
    assert BF16.array_dtype == bf16  # what recv, scatter and torch views hand out
    received = arr.view(BF16.storage).view(BF16.array_dtype)
    assert received.dtype == bf16 and received.tolist() == arr.tolist()


def test_dtypes_numpy_has_keep_their_own_array_dtype():
    assert wire_type_of(np.float16).array_dtype == np.float16
    assert wire_type_of(np.uint16).array_dtype == np.uint16
    assert U8.array_dtype == np.uint8
    assert wire_type_of(np.dtype(object)) is None


#: Modules the launcher must leave unloaded: it only starts processes.
LAUNCHER_NEEDS_NONE_OF = ["shmcoll._native", "shmcoll.kernels", "shmcoll.bootstrap", "ml_dtypes", "torch"]


@pytest.mark.multiprocess
def test_the_launcher_loads_neither_the_kernels_nor_the_bootstrap():
    probe = "import json, sys; import shmcoll.launch.run_cli; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], env=subprocess_env(), cwd=REPO, capture_output=True,
                            text=True, timeout=LAUNCH_S)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout))
    assert loaded.isdisjoint(LAUNCHER_NEEDS_NONE_OF), sorted(loaded.intersection(LAUNCHER_NEEDS_NONE_OF))
