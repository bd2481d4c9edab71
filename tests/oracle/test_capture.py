"""mpifusion.capture: the Recorder's checks, each adapter in one process (one rank), that
importing mpifusion imports no framework, and what the adapters refuse instead of a wrong or
hung result: Paddle params with gradient hooks registered before the capture (they run
first: a reducing one made any reduction pass), FSDP2 with a MixedPrecisionPolicy (a
misleading all-gather mismatch), a param unused on one rank (that rank raised alone and its
peers hung in gather's collective), and JAX pytree keys holding "/" (two leaves got one name).
"""
from __future__ import annotations

import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from mpifusion.capture import CaptureError, Recorder
from mpifusion.oracle import check

from tests.helpers import free_ports, run_job


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
    grad as its input, and then any reduction passes."""
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


# ------------------------------------------------------------------------ what the adapters refuse


def _paddle():
    return pytest.importorskip("paddle")


def test_paddle_capture_refuses_params_with_earlier_grad_hooks():
    """A grad hook registered before the capture runs before it: one that all-reduces made
    every rank record the reduced grad, and a sum-instead-of-mean then passed. Paddle lists
    no hooks, but its hook ids count up per grad node: the capture's id shows how many came
    first."""
    paddle = _paddle()
    from mpifusion.capture import PaddleCapture

    paddle.seed(0)
    layer = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.Linear(4, 2))
    layer[1].weight.register_hook(lambda g: g * 2)  # "all-reduce" over two equal ranks
    with pytest.raises(CaptureError, match=r"^rank 0: 1\.weight: the param already has "
                       r"gradient hooks \(1 registered before the capture's, hook id\(s\) 0\)"
                       r".*create the capture before registering them"):
        PaddleCapture(layer)
    # a hook the user removed again still counts (Paddle cannot show it is gone): refused
    other = paddle.nn.Linear(3, 2)
    other.bias.register_hook(lambda g: g).remove()
    with pytest.raises(CaptureError, match=r"rank 0: bias: the param already has gradient"):
        PaddleCapture(other)


def test_paddle_capture_sees_the_local_grad_under_a_later_reducing_hook():
    """The capture first, the reducing hook after it: the capture records the local grad,
    so a result that is the "sum" where the spec says mean fails (it passed before the fix
    when the hook came first and the capture was allowed)."""
    paddle = _paddle()
    from mpifusion.capture import PaddleCapture

    paddle.seed(0)
    layer = paddle.nn.Linear(3, 2)
    cap = PaddleCapture(layer)
    for p in layer.parameters():
        p.register_hook(lambda g: g * 2)  # a wrong reduction: 2x the local grad
    (layer(paddle.randn([5, 3])) ** 2).mean().backward()
    cap.record_outputs()
    record = cap.to_dict()
    assert not np.allclose(record["in/weight/0"], record["out/weight"])
    report = check(cap.spec("all_reduce", average=True), [record])
    assert sorted(report.failing) == ["bias", "weight"], str(report)
    cap.remove()


def test_paddle_capture_allows_backward_hooks_and_its_own_earlier_hooks():
    """``_register_backward_hook`` (a FusedCommBuffer's add_grad, DataParallel's reducer)
    runs after the grad hooks and takes no hook id; a capture removed, or still alive, is
    not a foreign hook; a refused capture removes the hooks it had registered."""
    paddle = _paddle()
    from mpifusion.capture import PaddleCapture

    paddle.seed(0)
    layer = paddle.nn.Linear(3, 2)
    for p in layer.parameters():
        p._register_backward_hook(lambda *_: None)
    first = PaddleCapture(layer)
    first.remove()
    second = PaddleCapture(layer)
    third = PaddleCapture(layer)  # two alive: the earlier one's hook returns None
    (layer(paddle.randn([4, 3])) ** 2).sum().backward()
    third.record_outputs()
    assert second.acc_steps == third.acc_steps == 1 and first.acc_steps == 0
    assert check(third.spec("all_reduce", average=False), [third.to_dict()]).ok
    second.remove()
    third.remove()

    two = paddle.nn.Sequential(paddle.nn.Linear(3, 3), paddle.nn.Linear(3, 2))
    two[1].bias.register_hook(lambda g: g)
    with pytest.raises(CaptureError, match=r"1\.bias: the param already has gradient hooks"):
        PaddleCapture(two)
    two[0].weight.clear_gradient()
    # the refused capture's hook on 0.weight is gone: a new capture there records one step
    cap = PaddleCapture(two[0])
    (two(paddle.randn([2, 3])) ** 2).sum().backward()
    assert cap.acc_steps == 1


PADDLE_JOB = r'''
import os, sys
rank = next((int(os.environ[k]) for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
             if os.environ.get(k, "").isdigit()), 0)
n, port, out_dir = 2, int(sys.argv[1]), sys.argv[2]
eps = [f"127.0.0.1:{port + r}" for r in range(n)]
os.environ.update(PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(n),
                  PADDLE_TRAINER_ENDPOINTS=",".join(eps), PADDLE_CURRENT_ENDPOINT=eps[rank],
                  PADDLE_DISTRI_BACKEND="gloo", PADDLE_RANK_IN_NODE=str(rank))
import paddle
import paddle.distributed as dist
from mpifusion.capture import CaptureError, PaddleCapture
from mpifusion.oracle import check
paddle.set_device("cpu")
dist.init_parallel_env()

def say(case, text):  # one file per rank: the launcher may interleave the ranks' stdout
    with open(f"{out_dir}/result{rank}.txt", "a", encoding="utf-8") as f:
        f.write(f"{case}: {text}\n")

def layer():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(5, 4), paddle.nn.Tanh(), paddle.nn.Linear(4, 2))

def data(k):
    paddle.seed(100 + 10 * rank + k)
    return paddle.randn([6, 5])

# a hand-written data-parallel hook registered before the capture: it sums (no 1/n)
net = layer()
def allreduce_hook(g):
    g = g.clone()
    dist.all_reduce(g)
    return g
for p in net.parameters():
    p.register_hook(allreduce_hook)
try:
    cap = PaddleCapture(net)
except CaptureError as e:
    say("pre_hook", f"CaptureError: {e}")
else:
    (net(data(0)) ** 2).mean().backward()
    cap.record_outputs()
    records = cap.gather(dst=0)
    if rank == 0:
        ok = check(cap.spec("all_reduce", average=True), records).ok
        say("pre_hook", "PASS" if ok else "FAIL")

# DataParallel first, then the capture (the README's order): accepted and right
net = layer()
model = paddle.DataParallel(net)
cap = PaddleCapture(net)
for k in range(2):
    (model(data(k)) ** 2).mean().backward()
cap.record_outputs()
records = cap.gather(dst=0)
if rank == 0:
    report = check(cap.spec("all_reduce", average=True), records)
    say("dp", "PASS" if report.ok else "FAIL " + str(report).replace("\n", " "))

# 2.weight unused on rank 1 in the second micro-step: every rank raises from gather
net = layer()
cap = PaddleCapture(net)
for k in range(2):
    x = data(k)
    out = net(x) ** 2 if (rank == 0 or k == 0) else net[0](x) ** 2
    out.mean().backward()
try:
    cap.gather(dst=0)
    say("unused", "gathered")
except CaptureError as e:
    say("unused", f"CaptureError: {e}")
sys.stdout.flush()
os._exit(0)
'''


def _results(out_dir, nranks: int) -> dict:
    """``{(rank, case): text}`` from the jobs' ``result{rank}.txt`` files."""
    results = {}
    for r in range(nranks):
        path = out_dir / f"result{r}.txt"
        for line in (path.read_text(encoding="utf-8").splitlines() if path.exists() else []):
            case, _, text = line.partition(": ")
            results[(r, case)] = text
    return results


def test_paddle_two_ranks_reducing_hook_refused_data_parallel_kept(tmp_path):
    """Two CPU ranks over gloo. A hand-written data-parallel hook (all-reduce, a sum where
    the spec says mean) registered before the capture: the check PASSed before the fix; now
    every rank refuses it. DataParallel created before the capture (the README's order)
    still passes. A param unused on rank 1 in one micro-step: every rank raises from
    gather(), naming rank 1 and the param (rank 1 raised alone before, rank 0 waited)."""
    _paddle()
    script = tmp_path / "paddle_job.py"
    script.write_text(PADDLE_JOB, encoding="utf-8")
    out = run_job(2, [sys.executable, str(script), str(free_ports(2)), str(tmp_path)],
                  timeout=150)  # a hung job fails the test with its output
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = _results(tmp_path, 2)
    for r in (0, 1):
        assert results[(r, "pre_hook")].startswith(
            f"CaptureError: rank {r}: 0.weight: the param already has gradient hooks"), results
        unused = results[(r, "unused")]
        assert unused.startswith(f"CaptureError: rank {r}: gather refused on every rank"), unused
        assert "2.weight: 1 micro-step(s) on rank(s) 1; 2 micro-step(s) on rank(s) 0" in unused
    assert results[(0, "dp")] == "PASS"


def test_torch_refused_capture_leaves_no_hooks():
    """A refused TorchCapture removes the hooks it had put on earlier params (they were left
    there, recording into the dead capture and refusing the next capture as foreign)."""
    torch = pytest.importorskip("torch")
    from mpifusion.capture import TorchCapture

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    handle = model[1].weight.register_hook(lambda g: g)
    with pytest.raises(CaptureError, match=r"rank 0: 1\.weight: the param already has"):
        TorchCapture(model)
    assert not model[0].weight._backward_hooks
    handle.remove()
    TorchCapture(model).remove()


TORCH_HEAD = """
import os, sys
import torch
import torch.distributed as dist
from mpifusion.capture import CaptureError, TorchCapture

rank = next((int(os.environ[k]) for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
             if os.environ.get(k, "").isdigit()), 0)
out_dir, world = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank,
                        world_size=world)


def say(case, text):  # one file per rank: the launcher may interleave the ranks' stdout
    with open(f"{out_dir}/result{rank}.txt", "a", encoding="utf-8") as f:
        f.write(f"{case}: {text}\\n")
"""


TORCH_TAIL = """
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def _torch_job(tmp_path, body: str, nranks: int, timeout: float = 150) -> dict:
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(TORCH_HEAD + textwrap.dedent(body) + TORCH_TAIL, encoding="utf-8")
    out = run_job(nranks, [sys.executable, str(script), str(tmp_path), str(nranks)],
                  timeout=timeout)  # a hung job fails the test with its output
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return _results(tmp_path, nranks)


def test_fsdp2_mixed_precision_refused_at_construction(tmp_path):
    """FSDP2 with a MixedPrecisionPolicy: grads in param_dtype, reduced in reduce_dtype,
    all-gathered in param_dtype, while the capture declared the fp32 param: the check then
    reported a misleading all-gather mismatch. Now refused up front, naming the param and
    the module; a policy that casts nothing is accepted."""
    body = """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    def build(policy):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(),
                                    torch.nn.Linear(6, 2))
        kw = {} if policy is None else {"mp_policy": policy}
        fully_shard(model[2], **kw)
        fully_shard(model)
        return model

    cases = {
        "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "reduce_only": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
        "no_cast": MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
        "none": None,
    }
    for case, policy in cases.items():
        model = build(policy)
        try:
            cap = TorchCapture(model, gather=True)
        except CaptureError as e:
            say(case, f"CaptureError: {e}")
            continue
        model(torch.randn(4, 5)).square().mean().backward()
        cap.record_outputs()
        records = cap.gather(dst=0)
        if rank == 0:
            from mpifusion.oracle import check
            report = check(cap.spec("reduce_scatter", average=True), records)
            say(case, "PASS" if report.ok else "FAIL " + str(report).replace(chr(10), " "))
        cap.remove()

    # a policy set behind the capture's back (after it was built): the forward refuses
    model = build(None)
    cap = TorchCapture(model, gather=True)
    for group in model[2]._get_fsdp_state()._fsdp_param_groups:
        group.mp_policy = cases["bf16"]
    try:
        model(torch.randn(4, 5))
        say("late", "no error")
    except CaptureError as e:
        say("late", f"CaptureError: {e}")
    """
    results = _torch_job(tmp_path, body, nranks=1)
    assert results[(0, "late")].startswith("CaptureError: rank 0: 2.weight: the unsharded "
                                           "param is torch.bfloat16, the sharded one "
                                           "torch.float32"), results[(0, "late")]
    bf16 = results[(0, "bf16")]
    assert bf16.startswith("CaptureError: rank 0: 2.weight: FSDP2 mixed precision on module "
                           "'2' (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype="
                           "float32)) for a float32 param"), bf16
    assert "not supported" in bf16 and "its all-gather runs in bfloat16" in bf16
    only = results[(0, "reduce_only")]
    assert only.startswith("CaptureError: rank 0: 2.weight: FSDP2 mixed precision") and \
        "reduced in bfloat16" in only, only
    assert results[(0, "no_cast")] == "PASS"
    assert results[(0, "none")] == "PASS"


def test_param_unused_on_one_rank_fails_gather_on_every_rank(tmp_path):
    """A param without a grad on one rank (unused there in one micro-step, or in all): its
    record raised on that rank only, before gather's collective, and the other rank was left
    in it (waiting for ever, or paired with the next gather: rank 0 got the wrong case's
    records). The same for a grad cleared on one rank before record_outputs (that rank
    raised from record_outputs alone). Now every rank raises the same CaptureError from
    gather, naming the rank and the param, and the ranks go on in step (a sound gather
    afterwards works)."""
    body = """
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(3, 2)
            self.b = torch.nn.Linear(3, 2)

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)

    def run(case, uses, zero_first=False):
        torch.manual_seed(0)
        model = Two()
        cap = TorchCapture(model)
        for use_b in uses:
            model(torch.randn(4, 3), use_b).square().sum().backward()
        if zero_first:  # the user's zero_grad came before record_outputs on this rank
            model.zero_grad(set_to_none=True)
        try:
            cap.record_outputs()
        except CaptureError as e:  # raising here, on one rank, strands the other in gather
            say(case + "_record", f"CaptureError: {e}")
        try:
            records = cap.gather(dst=0)
        except CaptureError as e:
            say(case, f"CaptureError: {e}")
        else:
            say(case, f"gathered {None if records is None else len(records)}")
        cap.remove()

    # rank 1 skips b in its second micro-step: its own record is inconsistent
    run("partly", [True, True] if rank == 0 else [True, False])
    # rank 1 never uses b: its record is consistent, but lacks b's inputs
    run("never", [True] if rank == 0 else [False])
    # rank 1 cleared its grads before reading them: raised on rank 1 alone before
    run("zeroed", [True], zero_first=rank == 1)
    run("sound", [True, True])
    """
    results = _torch_job(tmp_path, body, nranks=2)
    for r in (0, 1):
        partly = results[(r, "partly")]
        assert partly.startswith(f"CaptureError: rank {r}: gather refused on every rank (no "
                                 f"record was sent): rank 1: params recorded different "
                                 f"numbers of micro-steps"), partly
        assert "b.weight: 1 micro-step(s) on rank(s) 1; 2 micro-step(s) on rank(s) 0" in partly
        never = results[(r, "never")]
        assert never.startswith(f"CaptureError: rank {r}: gather refused on every rank"), never
        assert "b.weight: no grad on rank(s) 1 (unused there?); 1 micro-step(s) on rank(s) 0" \
            in never and "b.bias: no grad on rank(s) 1" in never and "a.weight" not in never
        zeroed = results[(r, "zeroed")]
        assert zeroed.startswith(f"CaptureError: rank {r}: gather refused on every rank (no "
                                 f"record was sent): rank 1: a.weight: .grad is None after "
                                 f"the sync (call record_outputs before zero_grad)"), zeroed
        assert "b.bias: .grad is None" in zeroed, zeroed
        assert (r, "zeroed_record") not in results, results
    assert results[(0, "sound")] == "gathered 2" and results[(1, "sound")] == "gathered None"


def test_disagreement_names_every_problem():
    """The text every rank raises with, built from every rank's summary (no job)."""
    from mpifusion.capture.core import disagreement

    same = [{"rank": r, "problem": None, "steps": {"w": 2, "b": 0}} for r in range(3)]
    assert disagreement(same) == ""
    mixed = [{"rank": 0, "problem": None, "steps": {"w": 2, "b": 2}},
             {"rank": 1, "problem": "rank 1: oops", "steps": {"w": 2, "b": 1}},
             {"rank": 2, "problem": None, "steps": {"w": 2, "b": 0}}]
    text = disagreement(mixed)
    assert text.startswith("rank 1: oops; params recorded unlike on the ranks: b: no grad on "
                           "rank(s) 2 (unused there?); 1 micro-step(s) on rank(s) 1; 2 "
                           "micro-step(s) on rank(s) 0"), text
    assert "w:" not in text


def test_paddle_gather_with_one_world_rank_is_local():
    """Without an initialized group PaddleCapture.gather stays local (no collective)."""
    paddle = _paddle()
    from mpifusion.capture import PaddleCapture

    layer = paddle.nn.Linear(2, 2)
    cap = PaddleCapture(layer)
    (layer(paddle.randn([3, 2])) ** 2).sum().backward()
    assert len(cap.gather()) == 1
    cap.remove()


def test_jax_keys_holding_a_slash_cannot_collide():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from mpifusion.capture import JaxCapture

    x, y = jnp.ones((2,)), jnp.zeros((3,))
    cap = JaxCapture(rank=1, nranks=2)
    with pytest.raises(CaptureError, match=r"^rank 1: micro-step 0 grads: leaves \['a'\]\['b'\] "
                       r"and \['a/b'\] both get the name 'a/b'"):
        cap.add_micro_step({"a/b": x, "a": {"b": y}})
    assert cap.recorded() == []  # nothing recorded from the refused tree
    # across trees: the outputs' leaf of that name is a different one
    cap.add_micro_step({"a/b": x})
    with pytest.raises(CaptureError, match=r"rank 1: outputs: leaf \['a'\]\['b'\] gets the "
                       r"name 'a/b', which earlier trees gave leaf \['a/b'\]"):
        cap.set_outputs({"a": {"b": x}})
    with pytest.raises(CaptureError, match=r"micro-step 1 grads: leaf \['a'\]\['b'\]"):
        cap.add_micro_step({"a": {"b": x}})
    with pytest.raises(CaptureError, match=r"both get the name 'leaf'"):
        JaxCapture().add_micro_step({"leaf": x, "": x})  # the root's name, spelled as a key
    with pytest.raises(CaptureError, match=r"micro_steps\[0\]: leaves .* both get the name"):
        JaxCapture.stacked([{"a/b": x, "a": {"b": x}}], {"a/b": x})
    with pytest.raises(CaptureError, match=r"synced: leaf \['a'\]\['b'\] gets the name 'a/b'"):
        JaxCapture.stacked([{"a/b": jnp.ones((2, 3))}], {"a": {"b": jnp.ones((2, 3))}})
    # Haiku-style keys holding "/" keep their names when nothing collides
    ok = JaxCapture(rank=0, nranks=1)
    grads = {"mlp/~/linear_0": {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}}
    ok.add_micro_step(grads)
    ok.set_outputs(grads)
    spec = ok.spec("all_reduce", average=False)
    assert [p["name"] for p in spec["params"]] == ["mlp/~/linear_0/b", "mlp/~/linear_0/w"]
    assert check(spec, [ok.to_dict()]).ok


def _rank_that_leaves_marks(index, out, fail):
    """A spawned rank: a file now, another from an atexit handler; rank 1 raises if asked."""
    import atexit

    atexit.register(lambda: open(f"{out}/atexit{index}", "w").close())
    open(f"{out}/done{index}", "w").close()
    if fail and index == 1:
        raise CaptureError("rank 1's record is inconsistent")


def test_spawn_ends_a_finished_rank_without_the_teardown_and_reraises_ours(tmp_path):
    """``capture.torch.spawn`` ends a rank whose function returned with ``os._exit(0)`` (no
    atexit handler runs: torch's C++ teardown after gloo aborted such ranks now and then),
    and still re-raises a rank's CaptureError with its rank."""
    pytest.importorskip("torch")
    import os
    from mpifusion.capture.torch import spawn

    spawn(_rank_that_leaves_marks, args=(str(tmp_path), False), nprocs=2)
    assert sorted(os.listdir(tmp_path)) == ["done0", "done1"]
    (tmp_path / "x").mkdir()
    with pytest.raises(CaptureError, match=r"^rank 1: rank 1's record is inconsistent"):
        spawn(_rank_that_leaves_marks, args=(str(tmp_path / "x"), True), nprocs=2)
    assert {"done1", "atexit1"} <= set(os.listdir(tmp_path / "x"))  # torch's own exit path
