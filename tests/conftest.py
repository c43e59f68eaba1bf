"""Shared fixtures: the multiprocess marker enforced, a check that nothing is left in /dev/shm, the
transports tests run over, a directory for launched rank programs, and a TCP connection's ends."""

import os
import textwrap

import pytest

import bounds
import faults
import harness


def pytest_collection_modifyitems(items):
    """Every test without a timeout of its own gets the scaled hang guard of a whole test, and every
    multiprocess test is slow: the quick tier is -m "not slow"."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(bounds.TEST_HANG_S))
        if item.get_closest_marker("multiprocess") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def processes_only_if_marked(request):
    """A test that is not marked multiprocess fails as soon as it starts a process (the quick tier,
    -m "not slow", must not run any)."""
    if request.node.get_closest_marker("multiprocess") is not None:
        yield
        return
    with harness.refusing_processes(request.node.nodeid):
        yield


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    """Nothing named after shmcoll may be left in /dev/shm when the suite ends."""
    before = {n for n in os.listdir("/dev/shm") if "shmcoll" in n} if os.path.isdir("/dev/shm") else set()
    yield
    if os.path.isdir("/dev/shm"):
        leaked = {n for n in os.listdir("/dev/shm") if "shmcoll" in n} - before
        assert not leaked, f"shared memory left in /dev/shm: {sorted(leaked)}"


#: "hier" simulates two hosts (ranks split in halves, see harness.HOST_LAYOUTS) on this machine.
TRANSPORTS = ["tcp", "shm", "hier"]
#: The hierarchy over every simulated host layout: uneven, one rank per host, interleaved.
LAYOUTS = TRANSPORTS + ["hier:first-alone", "hier:each", "hier:interleaved"]


def _use(monkeypatch, name: str) -> str:
    """Forked ranks inherit SHMCOLL_TRANSPORT (init() reads it) and SHMCOLL_TEST_HOSTS (the harness)."""
    kind, _, layout = name.partition(":")
    monkeypatch.setenv("SHMCOLL_TRANSPORT", kind)
    if kind == "hier":
        monkeypatch.setenv("SHMCOLL_TEST_HOSTS", layout or "halves")
    return kind


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """Run the test once per transport."""
    return _use(monkeypatch, request.param)


@pytest.fixture(params=LAYOUTS)
def layout(request, monkeypatch):
    """Run the test once per transport and once per simulated multi-host layout."""
    return _use(monkeypatch, request.param)


class Job:
    """A directory for a launched job's rank programs (harness.RANKLIB beside them) and their notes."""

    def __init__(self, directory):
        self.dir = directory
        (directory / "ranklib.py").write_text(harness.RANKLIB)

    def program(self, body: str) -> str:
        """Write a rank program (ranklib's helpers imported) and return its path."""
        path = self.dir / "prog.py"
        path.write_text("from ranklib import *\n" + textwrap.dedent(body))
        return str(path)

    def pids(self, prefix: str = "rank") -> list[int]:
        """The pids the job's processes recorded under `prefix`."""
        return [int(p.read_text()) for p in sorted(self.dir.glob(f"{prefix}*.pid"))]

    def wait_started(self, n: int, timeout: float = bounds.LAUNCH_S) -> None:
        """Until n ranks have recorded their pids (bounded)."""
        harness.wait_until(lambda: len(list(self.dir.glob("rank*.pid"))) >= n, timeout, f"{n} ranks to start")


@pytest.fixture
def job(tmp_path):
    """A Job in this test's temporary directory: `job.program(body)` writes a rank program."""
    return Job(tmp_path)


@pytest.fixture
def aftermath():
    """faults.Aftermath: what must hold once a fault scenario is over (its check), and the clean-up of
    whatever a failed check found."""
    after = faults.Aftermath()
    yield after
    after.clean_up()


@pytest.fixture
def pair():
    """connected_pair(), closed after the test."""
    a, b = harness.connected_pair()
    yield a, b
    a.close()
    b.close()
