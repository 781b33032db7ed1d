"""privlearn's collectives on a gloo group return only once the backend let go of their
tensors, so that freeing the group right after one cannot hang.

A gloo worker thread marks a collective complete before it drops its references to the
collective's tensors (and to the thread-local state it captured); when its drop is the
last C++ one of a Python-made tensor it takes the GIL to release the Python object. A
training loop that ends with privlearn's step (its last all-reduce) and then frees the
group (``destroy_process_group()``, then the DDP wrapper whose reducer holds it) runs
``ProcessGroupGloo``'s destructor holding the GIL while it joins that worker: the process
hung at exit (the multi-GPU tutorial, about one run in six on a busy machine). privlearn
holds one more C++ reference to each tensor until the worker dropped its own, so the
worker never needs the GIL for them.

The first tests stand in for a descheduled worker with a backend that keeps a C++
reference to each tensor for a moment after its collective returned, on a one-process
gloo group, and check that privlearn's collective returns only once that reference is
gone. One runs the real gloo worker with a Python object in the thread-local state. A
structural test checks that privlearn issues its tensor collectives through the settling
helpers only.
"""

from __future__ import annotations

import ast
import threading
import weakref
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from privlearn.torch import _settle  # noqa: E402
from privlearn.torch._agree import Agreement  # noqa: E402
from privlearn.torch.distributed import all_reduce_sum  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[2] / "privlearn"
LAG = 0.05  # seconds the stand-in worker keeps its reference after the collective returned


@pytest.fixture
def gloo_group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    if not hasattr(torch.Tensor, "_use_count") or not hasattr(torch._C, "ScriptList"):
        pytest.skip("this torch exposes no tensor use count or TorchScript list")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        _settle._LATE.clear()
        dist.destroy_process_group()


@pytest.fixture
def lagging(monkeypatch):
    """Wrap ``all_reduce``, ``broadcast`` and the reduce-scatters: each call keeps a
    C++ reference to the tensors it was given (a TorchScript list) for ``LAG`` seconds
    after it returned, dropped from another thread, as a gloo worker does after marking
    the collective complete. Yields one event per call, set as the reference goes."""
    dropped: list[threading.Event] = []
    timers: list = []

    def wrap(name):
        real = getattr(dist, name)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            held = [torch._C.ScriptList([a for a in args if isinstance(a, torch.Tensor)])]
            event = threading.Event()

            def drop() -> None:
                event.set()  # first: the caller may go on as soon as the reference goes
                held.clear()

            timer = threading.Timer(LAG, drop)
            timer.start()
            timers.append(timer)
            dropped.append(event)
            return out

        monkeypatch.setattr(dist, name, call)

    for name in ("all_reduce", "broadcast", "reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            wrap(name)
    yield dropped
    for timer in timers:
        timer.join()


def _still_held(dropped) -> int:
    """How many of the stand-in backend's references were still held."""
    return sum(not event.is_set() for event in dropped)


def test_status_exchange_returns_after_the_backend_let_go(gloo_group, lagging) -> None:
    Agreement(None, 1).agree(None, steps=3, draw=2, mechanism=(1.0, 0.5))
    assert len(lagging) == 1
    assert _still_held(lagging) == 0  # it returned once no worker held its tensor


def test_sum_over_ranks_returns_after_the_backend_let_go(gloo_group, lagging) -> None:
    parts = [torch.ones(3), torch.full((2, 2), 2.0)]
    out = all_reduce_sum(parts)
    assert [o.tolist() for o in out] == [p.tolist() for p in parts]  # one rank: the sum
    assert len(lagging) == 1
    assert _still_held(lagging) == 0


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "reduce_scatter"])
def test_helpers_return_after_the_backend_let_go(gloo_group, lagging, collective) -> None:
    t, out = torch.arange(4.0), torch.empty(4)
    if collective == "all_reduce":
        _settle.all_reduce(t)
    elif collective == "broadcast":
        _settle.broadcast(t, src=0)
    else:
        _settle.reduce_scatter(out, t)
        assert out.tolist() == t.tolist()
    assert len(lagging) == 1 and _still_held(lagging) == 0
    assert _settle._LATE == []


def test_thread_local_python_objects_are_released_before_return(gloo_group) -> None:
    """A real gloo worker: a collective issued while the thread-local state holds a Python
    object (torch stashes one there during ``backward()``) hands it to the work, and the
    worker's drop of it takes the GIL too. privlearn's status exchange returns only once
    the worker dropped it, every time (plain ``all_reduce`` returned before it in about
    one call in four here)."""
    if not hasattr(torch._C, "_stash_obj_in_tls"):
        pytest.skip("this torch has no thread-local Python objects")

    class Stashed:
        pass

    agreement = Agreement(None, 1)
    alive = 0
    for step in range(200):
        stashed = Stashed()
        ref = weakref.ref(stashed)
        torch._C._stash_obj_in_tls("context", stashed)
        try:
            agreement.agree(None, steps=step, draw=step)
        finally:
            torch._C._remove_obj_from_tls("context")
        del stashed
        alive += ref() is not None
    assert alive == 0


def test_a_failed_collective_keeps_its_hold_instead_of_waiting(gloo_group) -> None:
    t = torch.zeros(2)
    with pytest.raises(RuntimeError, match="stand-in"):
        with _settle.settled([t]):
            raise RuntimeError("stand-in for a collective that failed")
    assert len(_settle._LATE) == 1 and t._use_count() == 2  # kept, not waited for
    _settle.all_reduce(torch.zeros(1))  # the next collective drops it once free
    assert _settle._LATE == [] and t._use_count() == 1


def test_tensor_collectives_go_through_the_settling_helpers() -> None:
    """No module of the package but ``_settle`` calls a tensor collective of
    ``torch.distributed`` itself (object collectives build their tensors inside torch,
    and ``monitored_barrier``'s are made in C++)."""
    direct = {
        "all_reduce",
        "broadcast",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_gather_into_tensor",
        "all_gather",
        "reduce_scatter",
        "reduce",
        "gather",
        "scatter",
        "all_to_all_single",
    }
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_settle.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in direct
                and isinstance(node.value, ast.Name)
                and node.value.id == "dist"
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} dist.{node.attr}")
    assert found == []
