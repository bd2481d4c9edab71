"""What the peer scripts share: the rank the launcher gave (before any framework starts),
gloo's start-up over a rendezvous file, and the small torch model most cases train."""
from __future__ import annotations

import os
from typing import Any


def launcher_rank() -> int:
    """This process's rank from MPICH's, Open MPI's or PMIx's environment (0 alone)."""
    for key in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def init_gloo(out: str, rank: int, world: int) -> None:
    """torch.distributed over gloo, meeting in a file under ``out`` (no port to find)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.abspath(out)}/rendezvous",
                            rank=rank, world_size=world)


def tiny_model_class() -> Any:
    """The peers' torch model: params of awkward sizes (17x257, a LayerNorm, 3 outputs), so
    the flat layouts have padding and the pieces are uneven."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(17, 257)
            self.norm = nn.LayerNorm(257)
            self.fc2 = nn.Linear(257, 31)
            self.head = nn.Linear(31, 3)

        def forward(self, x):
            return self.head(self.fc2(self.norm(self.fc1(x).relu())).tanh())

    return Tiny


def peer_parser() -> Any:
    """The command line of a peer script that writes several cases: ``OUT [--nranks N]
    [--cases a,b]``."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--nranks", type=int, default=2)
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    return parser


def run_and_exit(main: Any) -> None:
    """Run a torch peer's ``main`` and end the process with its code, skipping torch's C++
    teardown (every file is written and closed by then): its gloo threads can abort the
    process at exit under load ("terminate called without an active exception", seen once in
    CI after "done"). A rank that fails ends at once, so its sockets close, the peers'
    collectives raise, and mpiexec ends the job instead of waiting."""
    import sys
    import traceback

    try:
        code = main()
    except BaseException:  # noqa: B036 - whatever it was, this rank ends now
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def save_case(out: str, case: str, cap: Any, spec: dict, rank: int) -> None:
    """``OUT/{case}/rank{r}.npz`` from every rank and, from rank 0, ``OUT/{case}/spec.json``."""
    import json

    d = os.path.join(out, case)
    cap.save(d)
    if rank == 0:
        with open(os.path.join(d, "spec.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f)
