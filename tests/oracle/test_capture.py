"""mpifusion.capture without a job: the Recorder's checks, each adapter in one process (one
rank), and that importing mpifusion imports no framework."""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest

from mpifusion.capture import CaptureError, Recorder
from mpifusion.oracle import check

from tests.helpers import run_job


def test_recorder_refuses_inconsistent_records(tmp_path):
    rec = Recorder(rank=1, nranks=2)
    rec.declare("w", (2, 3), "float32")
    rec.declare("b", (3,), "bfloat16")
    with pytest.raises(CaptureError, match=r"rank 1: w: local grad of shape \[3, 2\]"):
        rec.add_input("w", np.zeros((3, 2), np.float32))
    with pytest.raises(CaptureError, match="rank 1: nope: not a declared param"):
        rec.add_input("nope", np.zeros(3))
    rec.add_input("w", np.ones((2, 3), np.float32))
    rec.add_input("w", np.ones((2, 3), np.float32))
    rec.add_input("b", np.ones(3, ml_dtypes.bfloat16))
    with pytest.raises(CaptureError, match=r"2 for most, b \(1\)"):
        rec.to_dict()
    rec.add_input("b", np.ones(3, ml_dtypes.bfloat16))
    with pytest.raises(CaptureError, match=r"range \[4, 9\) with 5 element\(s\); expected 0 <= "
                       r"begin <= end <= 6"):
        rec.set_output("w", np.zeros(5, np.float32), range=(4, 9))
    rec.set_output("w", np.zeros(2, np.float32), range=(4, 6))
    with pytest.raises(CaptureError, match=r"differs from the one recorded before \[4, 6\]"):
        rec.set_shard("w", np.zeros(3, np.float32), range=(3, 6))
    path = rec.save(str(tmp_path))
    with np.load(path) as f:  # bfloat16 saved as its raw 2-byte values
        assert f["in/b/1"].dtype == np.uint16 and f["range/w"].tolist() == [4, 6]
    spec = rec.spec("reduce_scatter", average=False)
    assert spec["acc_steps"] == 2 and spec["nranks"] == 2
    assert [(p["name"], p["dtype"]) for p in spec["params"]] == [("w", "float32"),
                                                                 ("b", "bfloat16")]


def test_torch_capture_one_process_plain_module():
    torch = pytest.importorskip("torch")
    from mpifusion.capture import TorchCapture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    cap = TorchCapture(model)
    for _ in range(3):
        model(torch.randn(4, 5)).square().sum().backward()
    cap.record_outputs()  # one rank: .grad is the sum of the micro-steps
    spec = cap.spec("all_reduce", average=False)
    assert spec["acc_steps"] == 3 and spec["nranks"] == 1
    report = check(spec, [cap.to_dict()])
    assert report.ok, str(report)
    model[0].weight.grad[0, 0] += 1.0  # a different value than the micro-steps summed
    cap.record_outputs()
    assert check(spec, [cap.to_dict()]).failing == ["0.weight"]
    cap.remove()
    model(torch.randn(4, 5)).sum().backward()
    assert cap.acc_steps == 3  # hooks removed: nothing more recorded


def test_torch_capture_bfloat16_params():
    torch = pytest.importorskip("torch")
    from mpifusion.capture import TorchCapture

    torch.manual_seed(1)
    model = torch.nn.Linear(6, 3).to(torch.bfloat16)
    cap = TorchCapture(model)
    for _ in range(2):
        model(torch.randn(4, 6, dtype=torch.bfloat16)).float().square().sum().backward()
    cap.record_outputs()
    spec = cap.spec("all_reduce", average=False)
    assert {p["dtype"] for p in spec["params"]} == {"bfloat16"}
    record = cap.to_dict()
    assert record["in/weight/0"].dtype == ml_dtypes.bfloat16
    assert check(spec, [record]).ok


def test_jax_capture_one_rank():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from mpifusion.capture import JaxCapture

    cap = JaxCapture(rank=0, nranks=1)
    total = None
    for k in range(2):
        g = {"layer": {"w": jnp.full((3, 2), k + 0.5, jnp.bfloat16)}, "bias": jnp.arange(2.0)}
        cap.add_micro_step(g)
        total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
    cap.set_outputs(total)
    spec = cap.spec("all_reduce", average=False)
    assert [p["name"] for p in spec["params"]] == ["bias", "layer/w"]
    assert spec["params"][1]["dtype"] == "bfloat16"
    assert check(spec, [cap.to_dict()]).ok


def test_importing_mpifusion_imports_no_framework(tmp_path):
    code = ("import sys, mpifusion, mpifusion.capture, mpifusion.oracle, mpifusion.tools.cli\n"
            "from mpifusion.capture import Recorder\n"
            "print(sorted(m for m in ('torch', 'paddle', 'jax', 'matplotlib', 'mpi4py.MPI')"
            " if m in sys.modules))\n")
    out = run_job(1, [sys.executable, "-c", code], timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_torch_capture_refuses_params_with_earlier_grad_hooks():
    """A hook registered before the capture runs before it: one that all-reduces (a
    hand-written or Horovod-style data-parallel hook) makes every rank record the reduced
    grad as its input, and then any reduction passes (red-team finding)."""
    torch = pytest.importorskip("torch")
    from mpifusion.capture import TorchCapture

    model = torch.nn.Linear(3, 2)
    model.weight.register_hook(lambda g: g * 2)
    with pytest.raises(CaptureError, match=r"weight: the param already has gradient hooks"):
        TorchCapture(model)
    fresh = torch.nn.Linear(3, 2)
    cap = TorchCapture(fresh)  # hooks registered after the capture are fine
    fresh.weight.register_hook(lambda g: g * 2)
    cap.remove()


def test_main_grad_outputs_make_a_main_grad_spec():
    """``attr="main_grad"`` records fp32 main grads: the spec says so, else a half-precision
    spec would give the check the looser half bound (a 0.2% error passed)."""
    torch = pytest.importorskip("torch")
    from mpifusion.capture import TorchCapture

    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    cap = TorchCapture(model, attr="main_grad")
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    for p in model.parameters():
        p.main_grad = p.grad.float()
    cap.record_outputs()
    assert cap.spec("all_reduce")["use_main_grad"] is True
    assert cap.spec("all_reduce", use_main_grad=False)["use_main_grad"] is False
