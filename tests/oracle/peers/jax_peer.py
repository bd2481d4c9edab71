"""A real JAX peer: data parallelism over two CPU devices of one process (``pmap`` with
``lax.pmean``), captured with mpifusion.capture.JaxCapture. Writes ``OUT/{case}/rank{r}.npz``
+ ``spec.json`` for ``pmean_acc{K}`` and ``pmean_acc{K}_corrupt`` (one element of
``dense/kernel`` perturbed on device 1 after the sync), K = 1, 3; and ``psum_bf16`` (bfloat16
grads, summed).

XLA_FLAGS must give two host devices before jax is imported (this script sets it).
"""
from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()


def main() -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mpifusion.capture import JaxCapture

    out = sys.argv[1]
    n = jax.local_device_count()
    assert n == 2, f"expected 2 CPU devices, got {n}"

    def loss(params, x):
        h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
        return jnp.mean((h @ params["head"]["kernel"]) ** 2)

    grad_fn = jax.pmap(jax.grad(loss), in_axes=(None, 0))
    sync_fns = {op: jax.pmap(lambda g, op=op: getattr(jax.lax, op)(g, "d"), axis_name="d")
                for op in ("pmean", "psum")}

    def save(case, caps, spec):
        d = os.path.join(out, case)
        for cap in caps:
            cap.save(d)
        with open(os.path.join(d, "spec.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f)

    def run(case, acc, dtype, op):
        key = jax.random.PRNGKey(0)
        k1, k2, k3 = jax.random.split(key, 3)
        params = {"dense": {"kernel": jax.random.normal(k1, (17, 33), dtype) * 0.2,
                            "bias": jnp.zeros((33,), dtype)},
                  "head": {"kernel": jax.random.normal(k2, (33, 5), dtype) * 0.2}}
        grad, sync = grad_fn, sync_fns[op]  # built once: compiled once per dtype
        steps, total = [], None
        for k in range(acc):
            x = jax.random.normal(jax.random.fold_in(k3, k), (n, 8, 17), dtype)
            g = grad(params, x)
            steps.append(g)
            total = g if total is None else jax.tree_util.tree_map(jnp.add, total, g)
        synced = sync(total)
        caps = JaxCapture.stacked(steps, synced)
        spec = caps[0].spec("all_reduce", average=op == "pmean")
        save(case, caps, spec)
        kernel = np.array(synced["dense"]["kernel"])
        kernel[1].reshape(-1)[kernel[1].size // 2] += 1e-2
        bad = {**synced, "dense": {**synced["dense"], "kernel": kernel}}
        save(case + "_corrupt", JaxCapture.stacked(steps, bad), spec)

    for acc in (1, 3):
        run(f"pmean_acc{acc}", acc, jnp.float32, "pmean")
    run("psum_bf16", 2, jnp.bfloat16, "psum")
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
