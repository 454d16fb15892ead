"""kernels.host: launch sizing and the zeroed buffers of amax passes."""

import pytest
import torch

from fp4lab.kernels import host

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cdiv_is_the_ceiling():
    assert [host.cdiv(a, 16) for a in (0, 1, 15, 16, 17, 33)] == [0, 1, 1, 1, 2, 3]


def test_zeroed_int32_on_the_cpu_is_torch_zeros():
    z = host.zeroed_int32(3, torch.device("cpu"))
    assert z.dtype == torch.int32 and z.shape == (3,) and not z.any()


@cuda
def test_zeroed_slots_are_zero_aligned_and_never_handed_out_twice(monkeypatch):
    monkeypatch.setattr(host, "_pools", {})
    monkeypatch.setattr(host, "_POOL_SLOTS", 64)  # a pool used up after a few calls: replaced
    device = torch.device("cuda")
    slots = []
    for n in (1, 2, 3, 5, 64, 2, 1, 40, 30):
        z = host.zeroed_int32(n, device)
        assert z.shape == (n,) and z.dtype == torch.int32 and z.data_ptr() % 16 == 0 and not z.any()
        z.fill_(7)  # (what a kernel's atomic maxima leave)
        slots.append(z)
    spans = sorted((z.data_ptr(), z.data_ptr() + 4 * z.numel()) for z in slots)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no two overlap
    assert all(bool((z == 7).all()) for z in slots)


@cuda
def test_zeroed_int32_on_another_stream_or_under_capture_is_its_own():
    device = torch.device("cuda")
    host.zeroed_int32(2, device).fill_(5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = host.zeroed_int32(2, device)
    assert other.untyped_storage().data_ptr() != host.zeroed_int32(2, device).untyped_storage().data_ptr()
    # captured: a buffer the graph zeroes at every replay (a pool slot would keep the last replay's maxima)
    graph, out = torch.cuda.CUDAGraph(), None
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph):
        out = host.zeroed_int32(2, device)
        out.add_(3)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [3, 3]


def test_env_reads_what_os_environ_holds_now(monkeypatch):
    monkeypatch.delenv("FP4LAB_TEST_SWITCH", raising=False)
    assert host.env("FP4LAB_TEST_SWITCH") is None and host.env("FP4LAB_TEST_SWITCH", "auto") == "auto"
    monkeypatch.setenv("FP4LAB_TEST_SWITCH", "triton")
    assert host.env("FP4LAB_TEST_SWITCH", "auto") == "triton"
    import os
    os.environ["FP4LAB_TEST_SWITCH"] = "reference"  # (a change made directly, as a user script would)
    assert host.env("FP4LAB_TEST_SWITCH") == "reference"
    monkeypatch.setattr(os, "environ", {"FP4LAB_TEST_SWITCH": "replaced"})  # os.environ swapped for a mapping
    assert host.env("FP4LAB_TEST_SWITCH") == "replaced"


def test_a_plan_table_keeps_at_most_its_limit():
    table = host.PlanTable(3)
    for i in range(3):
        assert table.keep(i, f"plan {i}") == f"plan {i}"
    assert dict(table) == {0: "plan 0", 1: "plan 1", 2: "plan 2"}
    table.keep(3, "plan 3")  # full: emptied first, then kept
    assert dict(table) == {3: "plan 3"}


def test_tracing_is_true_under_a_tracer_only():
    """A tracer's fake, functional or proxy mode (what runs a traced op while compiling) counts;
    no mode, or another mode (a user's), does not."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen = []
    assert not host.tracing()
    with FakeTensorMode():
        seen.append(host.tracing())
    with FunctionalTensorMode():
        seen.append(host.tracing())
    make_fx(lambda x: seen.append(host.tracing()) or x + 1)(torch.ones(2))
    with Passing():
        assert not host.tracing()
    assert seen == [True, True, True]
