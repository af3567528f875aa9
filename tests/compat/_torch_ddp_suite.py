"""Run PyTorch's own DDP tests (``DistributedTest._DistTestBase``) with fastpar's class swapped in.

This follows torch's ``test/distributed/test_distributed_spawn.py``: BACKEND=gloo, WORLD_SIZE ranks,
a temp dir with a barrier, ``TestDistBackend`` + ``_DistTestBase``, each test spawning its ranks.
The only change: every spawned rank replaces ``torch.nn.parallel.DistributedDataParallel`` (the name
the tests construct, as ``DistributedDataParallel``, ``nn.parallel.…`` or ``torch.nn.parallel.…``)
by ``fastpar.DistributedDataParallel`` before the test runs, and counts how many fastpar wrappers the
test built, so a passing test provably ran fastpar's class. ``--impl torch`` runs the same tests on
stock torch (the baseline: what fails here for reasons that have nothing to do with fastpar).

    python tests/compat/_torch_ddp_suite.py --list    # JSON: {test name: why it skips without running, or null}
    WORLD_SIZE=3 python tests/compat/_torch_ddp_suite.py [--impl torch] [--json out.json] [test_name ...]

WORLD_SIZE is an environment variable, not a flag: torch's test module reads it when imported.

``tests/compat/test_torch_ddp_suite.py`` drives this script and holds the list of expected failures.
"""

from __future__ import annotations

import argparse
import functools
import glob
import inspect
import json
import os
import re
import sys
import time
import traceback
import types
import unittest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_IMPL_ENV = "FASTPAR_TORCH_SUITE_IMPL"  # read by the spawned ranks: "fastpar" or "torch"

# torch's test module reads these at import time (spawned ranks inherit them from the runner)
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault(_IMPL_ENV, "fastpar")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "180")  # per test; torch's default is 300 s
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402
from torch.testing._internal import common_distributed  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

torch.backends.cuda.matmul.allow_tf32 = False  # as test_distributed_spawn.py

_COUNT_FILE = "fastpar_ddp_built.rank{rank}"


def _swap_in_fastpar() -> None:
    """In a spawned rank: make the names torch's tests construct point at fastpar's class.

    Only the public name is replaced. ``torch.nn.parallel.distributed.DistributedDataParallel`` stays
    torch's class: torch's own forward machinery (``_inside_ddp_forward``, dynamo's DDPOptimizer) keeps
    class-level state on it, and fastpar subclasses it, so ``isinstance`` checks still hold.
    """
    import torch.nn.parallel
    from torch.testing._internal.distributed import distributed_test

    import fastpar

    cls = fastpar.DistributedDataParallel
    original_init = cls.__init__

    @functools.wraps(original_init)
    def counting_init(self, *args, **kwargs):
        _built[0] += 1
        original_init(self, *args, **kwargs)

    cls.__init__ = counting_init
    torch.nn.parallel.DistributedDataParallel = cls
    distributed_test.DistributedDataParallel = cls


_built = [0]  # fastpar wrappers constructed in this rank


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's spawn test class, with a hook in each rank (``_run``) and a count read back (``tearDown``)."""

    built: dict[str, int] = {}  # test name -> fastpar wrappers built (max over ranks)

    def setUp(self):
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def tearDown(self):
        counts = []
        for path in glob.glob(os.path.join(os.environ["TEMP_DIR"], _COUNT_FILE.format(rank="*"))):
            with open(path) as f:
                counts.append(int(f.read() or 0))
        TestDistBackendWithSpawn.built[self._current_test_name()] = max(counts, default=0)
        super().tearDown()  # removes TEMP_DIR

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, **kwargs):
        if os.environ[_IMPL_ENV] == "fastpar":
            _swap_in_fastpar()
        try:
            super()._run(rank, test_name, file_name, pipe, **kwargs)
        finally:  # _run ends in sys.exit: record the count on every way out
            with open(os.path.join(os.environ["TEMP_DIR"], _COUNT_FILE.format(rank=rank)), "w") as f:
                f.write(str(_built[0]))


def ddp_test_names() -> list[str]:
    """torch's DDP tests: a name that says DDP, or a body (or a ``self._helper`` it calls) that builds one."""
    base = DistributedTest._DistTestBase
    sources = {}
    for name, member in vars(base).items():
        if callable(member):
            try:
                sources[name] = inspect.getsource(member)
            except (OSError, TypeError):
                pass

    def builds_ddp(name: str, seen: set[str]) -> bool:
        if name in seen or name not in sources:
            return False
        seen.add(name)
        if "DistributedDataParallel(" in sources[name]:
            return True
        return any(builds_ddp(helper, seen) for helper in re.findall(r"self\.(_\w+)\(", sources[name]))

    tests = sorted(n for n in sources if n.startswith("test_"))
    return [n for n in tests if "DistributedDataParallel" in n or "ddp" in n.lower() or builds_ddp(n, set())]


class _GateOpen(Exception):
    pass


def _open_gate(*args, **kwargs):
    raise _GateOpen


def _rank_exit_gates() -> set:
    """Code of torch's decorators that skip a test inside every rank (``sys.exit``) from the GPU count or
    WORLD_SIZE alone: the same answer in this process as in the ranks."""
    cd = common_distributed
    return {
        cd.skip_if_no_gpu(_open_gate).__code__,
        cd.skip_if_lt_x_gpu(1)(_open_gate).__code__,
        cd.nccl_skip_if_lt_x_gpu("nccl", 1)(_open_gate).__code__,
        cd.require_n_gpus_for_nccl_backend(1, "nccl")(_open_gate).__code__,
        cd.skip_if_odd_worldsize(_open_gate).__code__,
        cd.skip_if_small_worldsize(_open_gate).__code__,
    }


def rank_skip_reason(name: str) -> str | None:
    """torch's skip message if a GPU/world-size decorator on this test would exit every rank, else None.

    Each such decorator layer is re-run here with the test body replaced by a sentinel, so a test that
    would only spawn ranks to skip (most GPU tests, on a CPU-only machine) costs no process start-up.
    """
    messages = {skip.exit_code: skip.message for skip in common_distributed.TEST_SKIPS.values()}
    gates = _rank_exit_gates()
    layer = DistributedTest._DistTestBase.__dict__[name]
    while layer is not None:
        code = getattr(layer, "__code__", None)
        if code in gates:
            cells = list(layer.__closure__)
            cells[code.co_freevars.index("func")] = types.CellType(_open_gate)
            gate = types.FunctionType(code, layer.__globals__, code.co_name, layer.__defaults__, tuple(cells))
            try:
                gate(None)
            except _GateOpen:
                pass
            except SystemExit as exc:
                return messages.get(exc.code, f"skipped with exit code {exc.code}")
        layer = getattr(layer, "__wrapped__", None)
    return None


class _Recorder(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome, self.message = "passed", ""

    def addError(self, test, err):
        self.outcome, self.message = "failed", "".join(traceback.format_exception(*err))

    addFailure = addError

    def addSkip(self, test, reason):
        self.outcome, self.message = "skipped", str(reason)


def skip_before_spawn(name: str, precheck: bool = True) -> str | None:
    """Why this test will skip without running (unittest's static skip, or a rank-exit gate), else None."""
    method = getattr(TestDistBackendWithSpawn, name)
    if getattr(method, "__unittest_skip__", False):
        return getattr(method, "__unittest_skip_why__", "skipped")
    reason = rank_skip_reason(name) if precheck else None
    return None if reason is None else f"{reason} (torch's decorator, checked before spawning)"


def run(names: list[str], precheck: bool = True) -> dict[str, dict]:
    results = {}
    for k, name in enumerate(names, 1):
        start = time.monotonic()
        recorder = _Recorder()
        reason = skip_before_spawn(name, precheck)
        if reason is None:
            TestDistBackendWithSpawn(name).run(recorder)
        else:
            recorder.addSkip(name, reason)
        seconds = time.monotonic() - start
        results[name] = {
            "outcome": recorder.outcome,
            "message": recorder.message[-6000:],
            "seconds": round(seconds, 1),
            "fastpar_built": TestDistBackendWithSpawn.built.get(name, 0),
        }
        print(f"[{k}/{len(names)}] {name}: {recorder.outcome} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="tests to run (default: every DDP test)")
    parser.add_argument(
        "--list", action="store_true", help="print {DDP test name: why it skips without running, or null} and exit"
    )
    parser.add_argument("--json", help="write {name: {outcome, message, seconds, fastpar_built}} here")
    parser.add_argument("--impl", choices=["fastpar", "torch"], default=os.environ[_IMPL_ENV])
    parser.add_argument(
        "--no-precheck", action="store_true", help="spawn ranks even for tests torch's GPU/world-size gates skip"
    )
    args = parser.parse_args(argv)
    if args.list:
        print(json.dumps({n: skip_before_spawn(n, not args.no_precheck) for n in ddp_test_names()}, indent=1))
        return 0
    os.environ[_IMPL_ENV] = args.impl
    known = set(ddp_test_names())
    names = args.names or sorted(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"not torch DDP tests (see --list): {', '.join(unknown)}")
    results = run(names, precheck=not args.no_precheck)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    counts = {o: sum(r["outcome"] == o for r in results.values()) for o in ("passed", "failed", "skipped")}
    print(f"{args.impl} DDP, world size {os.environ['WORLD_SIZE']}: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
